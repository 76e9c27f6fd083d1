"""The Prometheus endpoint answers on loopback and its counters move."""
import re
import socket
import urllib.error
import urllib.request

import pytest

from conftest import TASK_GOOD, wait_until


def scrape(port, path="/metrics"):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def value(text, name, labels=""):
    m = re.search(r"^" + re.escape(name + labels) + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_metrics_endpoint_answers_and_counters_move(env):
    env.trainer("j", 0)
    env.start_agent()
    port = env.status()["metrics_port"]
    assert port > 0
    first = scrape(port)
    assert "# TYPE bubble_seconds_total counter" in first
    assert value(first, "bubble_hubs") == 1
    b0 = value(first, "bubble_seconds_total", '{hub="j:0"}')
    assert b0 is not None
    wait_until("bubble time to grow",
               lambda: value(scrape(port), "bubble_seconds_total", '{hub="j:0"}') > b0)
    assert value(first, "bubble_tasks_submitted_total") == 0

    tid = env.submit(TASK_GOOD, "0", opts=("--name", "harvester"))
    env.wait_state(tid, "running")
    lbl = f'{{task="harvester",hub="j:0",id="{tid}",slot="0"}}'  # the hub's first task: slot 0
    wait_until("the side task's bubble time to appear and grow",
               lambda: (value(scrape(port), "bubble_side_task_seconds_total", lbl) or 0) > 0)
    text = scrape(port)
    assert value(text, "bubble_tasks_submitted_total") == 1
    assert value(text, "bubble_tasks", '{state="running"}') == 1
    env.ctl("cancel", str(tid))
    # Ended cancelled, or killed if enforcement got to it first (a starved task acks late).
    ended = env.wait_state(tid, ("cancelled", "killed"))["state"]
    text = scrape(port)
    assert value(text, "bubble_tasks_ended_total", f'{{state="{ended}"}}') == 1
    assert value(text, "bubble_harvested_seconds_total", '{hub="j:0"}') > 0
    assert value(text, "bubble_agent_metrics_requests_total") >= 4

    with pytest.raises(urllib.error.HTTPError) as e:
        scrape(port, "/nope")
    assert e.value.code == 404


def test_metrics_can_be_turned_off(env):
    env.start_agent(metrics="off")
    assert env.status()["metrics_port"] == 0


def test_idle_metrics_connections_cannot_use_up_the_agents_descriptors(env):
    """The metrics port is open to every local user. Connections that never send a request are
    capped and closed after a deadline: the agent keeps the descriptors it needs to serve its
    clients and launch tasks."""
    env.trainer("j", 0)
    env.start_agent(max_fds=96)
    port = env.status()["metrics_port"]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(150)]
    # Beyond the cap the agent hangs up at once; the rest at their deadline (5 s). A connection
    # it never closed fails the recv with a timeout.
    for s in idle:
        s.settimeout(30)
        assert s.recv(1) == b"", "an idle connection got data"
        s.close()
    # Meanwhile and after, the agent served its clients and launches tasks.
    assert env.ctl_ok("status")
    tid = env.submit(TASK_GOOD, "5")
    assert env.wait_state(tid, ("finished", "failed", "killed", "lost"))["state"] == "finished"
    assert value(scrape(port), "bubble_hubs") == 1
