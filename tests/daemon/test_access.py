"""Only clients of the agent's own uid get in (unless allowed); the socket is created 0600."""
import os
import stat

import pytest

from conftest import BUBBLECTL

NOBODY = 65534
AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")


@pytest.fixture
def rooted(env):
    if os.geteuid() != 0:
        pytest.skip("switching to another uid needs root: run as root to test peer credentials")
    if not os.access(BUBBLECTL, os.X_OK):
        pytest.skip("bubblectl is not executable")
    return env


def open_up(env):
    # Let uid 65534 reach the socket through the file system, so the agent's own credential
    # check is what refuses it.
    os.chmod(env.root, 0o755)
    os.chmod(env.socket, 0o666)


def test_socket_is_owner_only(env):
    env.start_agent()
    assert stat.S_IMODE(os.stat(env.socket).st_mode) == 0o600


def test_other_uid_cannot_reach_the_socket(rooted):
    env = rooted
    env.start_agent()
    os.chmod(env.root, 0o755)
    r = env.ctl("list", check=False, prefix=AS_NOBODY)
    assert r.returncode != 0
    assert "permission denied" in r.stderr


def test_other_uid_is_refused_by_peer_credentials(rooted):
    env = rooted
    env.start_agent()
    open_up(env)
    r = env.ctl("list", check=False, prefix=AS_NOBODY)
    assert r.returncode != 0
    assert f"uid {NOBODY} may not use this agent" in r.stderr
    assert "--allow-uid" in r.stderr
    metrics = env.status()  # the owner still gets in
    assert metrics["agent_pid"] == env.agent.pid


def test_allowed_uid_gets_in(rooted):
    env = rooted
    env.start_agent("--allow-uid", str(NOBODY))
    open_up(env)
    r = env.ctl("list", check=False, prefix=AS_NOBODY)
    assert r.returncode == 0, r.stderr


def test_allowed_uid_watches_but_cannot_change_what_runs(rooted):
    # Tasks run with the agent's uid: a submission from another uid would run as the agent (as
    # root here), so an allowed uid may look but not submit, cancel or drain.
    env = rooted
    env.start_agent("--allow-uid", str(NOBODY))
    open_up(env)
    tid = env.submit("/bin/sleep", "30")
    for args, what in ((("submit", "--", "/bin/true"), "submit tasks"),
                       (("cancel", str(tid)), "cancel tasks"),
                       (("drain",), "drain hubs")):
        r = env.ctl(*args, check=False, prefix=AS_NOBODY)
        assert r.returncode != 0, args
        assert f"uid {NOBODY} may watch this agent (--allow-uid) but not {what}" in r.stderr
        assert "run your own `bubbled`" in r.stderr
    r = env.ctl("list", "--all", check=False, prefix=AS_NOBODY)
    assert r.returncode == 0, r.stderr
    assert "sleep" in r.stdout
    # Nothing was submitted, cancelled or drained by the refused requests.
    rows = env.ctl("list", "--all").stdout
    assert "/bin/true" not in rows
    assert env.status()["draining"] is False
    env.ctl("cancel", str(tid))  # the owner still may
