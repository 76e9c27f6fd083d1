"""A task that ignores pauses is stopped with SIGSTOP, continued at its hub's next bubble, and
killed after the configured number of violations; every action is recorded and shown."""
import os
import signal
import socket
import sqlite3
import subprocess
import urllib.request

import pytest

from conftest import BUBBLED, HOSTILE_TASK, TASK_GOOD, TASK_ROGUE, children, proc_state, wait_until


def test_task_ignoring_pause_is_stopped_then_killed(env):
    env.trainer("j", 0)
    env.start_agent("--grace-ms", "20", "--kill-after", "3")
    tid = env.submit(TASK_ROGUE)
    t = env.wait_state(tid, ("killed", "failed", "finished"))
    assert t["state"] == "killed", t
    assert t["violations"] == 3
    acts = [line.split() for line in env.ctl("actions").stdout.splitlines()[1:]]
    kinds = [a[4] for a in acts if a[1] == str(tid)]
    assert kinds == ["stop", "continue", "stop", "continue", "kill"], kinds
    assert env.status()["actions"] == 5


def test_well_behaved_task_is_never_stopped(env):
    env.trainer("j", 0)
    # A generous grace: a task that acks is not punished for being descheduled on a busy machine.
    env.start_agent("--grace-ms", "500")
    tid = env.submit(TASK_GOOD, "60")
    t = env.wait_state(tid, ("finished", "failed", "killed"))
    assert t["state"] == "finished" and t["violations"] == 0
    assert "no enforcement actions" in env.ctl("actions").stdout


def test_hostile_task_is_marked_bad_and_the_trainer_goes_on(env):
    """A task that scribbles over its whole slot is found out by the trainer's validation; the
    agent adopts it, records it as bad once and shows it, and the hub keeps its bubbles."""
    env.trainer("j", 0)
    env.start_agent("--grace-ms", "500")
    sock = os.path.join(env.runtime, "j.0.sock")
    evil = env.spawn([HOSTILE_TASK, sock, "3"], "hostile.log")
    wait_until("the hostile task marked bad",
               lambda: any(line.split()[4:5] == ["bad"]
                           for line in env.ctl("actions").stdout.splitlines()[1:]))
    acts = [line.split() for line in env.ctl("actions").stdout.splitlines()[1:]]
    bad = [a for a in acts if a[4] == "bad"]
    assert len(bad) == 1, acts
    assert "marked bad" in env.ctl("list", "--all").stdout
    before = env.hub("j:0")["bubbles"]
    wait_until("bubbles go on", lambda: env.hub("j:0")["bubbles"] > before)
    evil.wait(timeout=30)
    assert evil.returncode == -signal.SIGSEGV  # its write into the trainer's pages faulted


def test_a_task_being_cancelled_is_not_stopped_again_nor_shown_running(env):
    """Cancelling a task that enforcement stopped continues it so it can stop. Until it is gone
    it is "stopping": enforcement neither stops it again (which would only delay the stop) nor
    marks it running (an agent restarted meanwhile would then forget the cancel)."""
    env.trainer("j", 0)
    # A stop timeout far beyond the test: the task stays `stopping` for as long as it runs.
    env.start_agent("--grace-ms", "20", "--kill-after", "1000", "--stop-timeout-ms", "600000")
    tid = env.submit(TASK_ROGUE)
    env.wait_state(tid, "stopped")
    env.ctl("cancel", str(tid))
    assert env.task(tid)["state"] == "stopping", (env.task(tid), env.ctl("actions").stdout)
    before = env.hub("j:0")["bubbles"]
    # Bubbles pass: each would have continued it (and found it not pausing, stopped it again).
    wait_until("three more bubbles", lambda: env.hub("j:0")["bubbles"] >= before + 3)
    assert env.task(tid)["state"] == "stopping"
    acts = [line.split() for line in env.ctl("actions").stdout.splitlines()[1:]]
    kinds = [a[4] for a in acts if a[1] == str(tid)]
    assert "cancel" in kinds, kinds
    after = kinds[kinds.index("cancel") + 1:]
    # The cancel's own continue, and nothing from enforcement after it.
    assert "stop" not in after and after.count("continue") <= 1, kinds
    os.killpg(env.task(tid)["pid"], signal.SIGKILL)  # it would never stop by itself
    t = env.wait_state(tid, ("cancelled", "failed", "killed", "finished"))
    assert t["state"] == "cancelled", t


def _stopped_rogue(env):
    """A task that never pauses, launched and then stopped by enforcement, on the last stage of
    a pipeline whose every compute step takes a second or more: the continue its next bubble
    brings is a second away or more."""
    env.trainer("j", 3, fwd=1000, bwd=2000)
    env.start_agent("--grace-ms", "20", "--kill-after", "1000")
    tid = env.submit(TASK_ROGUE)
    t = env.wait_state(tid, "stopped")
    task = wait_until("the task under its wrapper", lambda: children(t["pid"]))[0]
    return tid, t["pid"], task


def _actions_of(env, tid):
    return [line for line in env.ctl("actions").stdout.splitlines()[1:]
            if line.split()[1] == str(tid)]


def test_a_stopped_task_whose_slot_leaves_is_continued_and_ends(env):
    """The task dies while stopped (its trainer killed it at a revoke's deadline, or the OOM
    killer did): its slot leaves the hub, so no bubble of that hub will continue it. The agent
    continues its group, whose wrapper, stopped with it, then reaps it and the row ends."""
    tid, wrapper, task = _stopped_rogue(env)
    os.kill(task, signal.SIGKILL)
    t = env.wait_state(tid, ("killed", "failed", "finished", "lost"))
    assert t["state"] == "failed" and "killed by signal 9" in t["message"], t
    assert any("its slot left hub j:3 while it was stopped" in a for a in _actions_of(env, tid))
    wait_until("the wrapper gone", lambda: proc_state(wrapper) in ("", "Z"))


def test_an_agent_that_stops_continues_the_tasks_it_had_stopped(env):
    """No agent is left to continue them at their hub's next bubble: they are continued as the
    agent stops, and keep running for the next agent to adopt."""
    tid, wrapper, task = _stopped_rogue(env)
    assert proc_state(task) == "T"
    env.kill_agent(signal.SIGTERM)
    assert env.agent.returncode == 0
    assert proc_state(task) not in ("T", ""), proc_state(task)
    assert proc_state(wrapper) not in ("T", ""), proc_state(wrapper)
    env.start_agent()  # (which may stop it again soon: it still does not pause)
    assert any("the agent is stopping" in a for a in _actions_of(env, tid))


def _open_writer(fifo):
    """A descriptor writing to fifo once a reader has it open, else None."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


@pytest.mark.parametrize("hub", ["its own", "another trainer's"])
def test_a_task_inside_a_trainers_process_is_never_signalled(env, hub):
    """The C ABI lets a trainer run a side task on one of its own threads; that task's pid is
    the trainer's. When it ignores pauses, a SIGSTOP or SIGKILL would stop or kill the trainer
    (and hang every rank with it): the agent records the violation and signals nothing. That
    holds as well when the task attached to another trainer's hub than its process's."""
    env.start_agent("--grace-ms", "20", "--kill-after", "2")
    go = os.path.join(env.root, "go")
    os.mkfifo(go, 0o600)
    if hub == "its own":
        name, argv = "own:0", [TASK_ROGUE, "--own-trainer"]
    else:
        env.trainer("j", 0)
        name, argv = "j:0", [TASK_ROGUE, "--own-trainer", "own"]
    both = env.spawn(argv, "own-trainer.log",
                     env=dict(env.env, BUBBLE_JOB=name.split(":")[0], BUBBLE_RANK="0",
                              ROGUE_GO=go))
    # The task attaches once the agent knows the hub its process serves as trainer; before,
    # its first violation could come first, and the agent would have had no trainer to spare.
    wait_until("the agent to see the rogue's own hub",
               lambda: (h := env.hub("own:0")) and h["alive"] and h["trainer_pid"] == both.pid)
    # Opening the FIFO lets the rogue's open return (without blocking here should it be gone).
    os.close(wait_until("the rogue to wait on its FIFO", lambda: _open_writer(go)))
    unenforced = wait_until(
        "the violation recorded",
        lambda: [a for a in env.ctl("actions").stdout.splitlines()[1:] if a.split()[4:5] == ["unenforced"]])
    tid = int(unenforced[0].split()[1])
    t = env.task(tid)
    assert t["pid"] == both.pid and t["state"] == "running" and t["hub"] == name, t
    assert "inside its trainer's process" in t["message"], t
    assert env.hub("own:0")["trainer_pid"] == both.pid
    # Past the violation that would have killed it (the second: --kill-after 2).
    before = env.hub(name)["bubbles"]
    wait_until("more bubbles", lambda: env.hub(name)["bubbles"] > before + 5)
    assert both.poll() is None and proc_state(both.pid) not in ("T", "t", ""), proc_state(both.pid)
    kinds = [a.split()[4] for a in _actions_of(env, tid)]
    assert kinds == ["unenforced"], kinds
    assert env.task(tid)["state"] == "running"
    # Counted in the metrics as well, as every kind of action is.
    with urllib.request.urlopen(f"http://127.0.0.1:{env.status()['metrics_port']}/metrics",
                                timeout=20) as r:
        metrics = r.read().decode()
    assert 'bubble_enforcement_actions_total{action="unenforced"} 1\n' in metrics, metrics
    # A cancel goes through the hub, never as a signal to the trainer.
    env.ctl("cancel", str(tid))
    before = env.hub(name)["bubbles"]
    wait_until("bubbles after the cancel", lambda: env.hub(name)["bubbles"] > before + 5)
    assert both.poll() is None and proc_state(both.pid) not in ("T", "t", ""), proc_state(both.pid)


def test_an_agent_that_cannot_start_leaves_its_tasks_as_they_were(env):
    """An agent whose metrics port is taken exits with the reason, before it acts on any task:
    a task an earlier agent had stopped is neither continued nor recorded as continued."""
    tid, wrapper, task = _stopped_rogue(env)
    env.kill_agent(signal.SIGKILL)

    def recorded():
        db = sqlite3.connect(os.path.join(env.state, "bubbled.db"), timeout=30)
        try:
            return db.execute("SELECT COUNT(*) FROM actions WHERE task = ?", (tid,)).fetchone()[0]
        finally:
            db.close()

    before = recorded()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        r = subprocess.run([BUBBLED, "--socket", env.socket, "--state-dir", env.state,
                            "--metrics-port", str(taken.getsockname()[1])],
                           env=env.env, capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert r.returncode != 0 and "cannot serve metrics" in r.stderr, r.stderr
    assert proc_state(task) == "T", proc_state(task)
    assert recorded() == before
    # The next agent that starts does continue it (its escalation died with the old agent).
    env.start_agent()
    assert any("the agent restarted" in a for a in _actions_of(env, tid))
