"""Only clients of the agent's own uid get in (unless allowed); the socket is created 0600."""
import atexit
import os
import select
import shutil
import stat
import struct
import subprocess
import sys
import tempfile

import pytest

from conftest import AGENT_SCHEMA, BUBBLECTL
from procs import wait_until

NOBODY = 65534
AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")
_reachable = {}


def nobody_bubblectl():
    """A copy of bubblectl that uid 65534 can run: the build tree may sit under a directory
    only its owner may enter (root's home is 0700 on Debian). bubblectl links only system
    libraries, so the copy runs as is."""
    if "path" not in _reachable:
        d = tempfile.mkdtemp(prefix="bb-nobody-")
        os.chmod(d, 0o755)
        path = os.path.join(d, "bubblectl")
        shutil.copy2(BUBBLECTL, path)
        os.chmod(path, 0o755)
        atexit.register(shutil.rmtree, d, True)
        _reachable["path"] = path
    return _reachable["path"]


def ctl_as_nobody(env, *args):
    return env.ctl(*args, check=False, prefix=AS_NOBODY, program=nobody_bubblectl())


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
    r = ctl_as_nobody(env, "list")
    assert r.returncode != 0
    assert "permission denied" in r.stderr


def test_other_uid_is_refused_by_peer_credentials(rooted):
    env = rooted
    env.start_agent()
    open_up(env)
    r = ctl_as_nobody(env, "list")
    assert r.returncode != 0
    assert f"uid {NOBODY} may not use this agent" in r.stderr
    assert "--allow-uid" in r.stderr
    metrics = env.status()  # the owner still gets in
    assert metrics["agent_pid"] == env.agent.pid


def test_allowed_uid_gets_in(rooted):
    env = rooted
    env.start_agent("--allow-uid", str(NOBODY))
    open_up(env)
    r = ctl_as_nobody(env, "list")
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
        r = ctl_as_nobody(env, *args)
        assert r.returncode != 0, args
        assert f"uid {NOBODY} may watch this agent (--allow-uid) but not {what}" in r.stderr
        assert "run your own `bubbled`" in r.stderr
    r = ctl_as_nobody(env, "list", "--all")
    assert r.returncode == 0, r.stderr
    assert "sleep" in r.stdout
    # Nothing was submitted, cancelled or drained by the refused requests.
    rows = env.ctl("list", "--all").stdout
    assert "/bin/true" not in rows
    assert env.status()["draining"] is False
    env.ctl("cancel", str(tid))  # the owner still may


# Run as the allowed uid: opens N connections, says hello on each, and tells how each was
# answered; then holds them until its stdin closes.
_GUEST = r"""
import socket, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
hello = bytes.fromhex(sys.argv[3])
conns, counts, replies = [], {"guest_cap": 0}, set()
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    conns.append(s)
for s in conns:
    try:
        s.sendall(hello)
    except OSError:
        pass
    data = b""
    try:
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    if b"users other than its own" in data:
        counts["guest_cap"] += 1
    else:
        replies.add(data[4:].hex())
print(len(conns) - counts["guest_cap"], counts["guest_cap"], " ".join(sorted(replies)), flush=True)
sys.stdin.read()
"""


def test_an_allowed_uid_cannot_take_every_connection_from_the_owner(rooted):
    """An allowed uid may watch, but holding connections open must not lock the agent's own
    user out: other uids get at most 32 of the 128 connections, and the rest are refused with
    the reason."""
    env = rooted
    env.start_agent("--allow-uid", str(NOBODY))
    open_up(env)
    hello = subprocess.run(["capnp", "encode", AGENT_SCHEMA, "Request"],
                           input=b'(id = 1, hello = (protocolVersion = 1, client = "guest"))',
                           capture_output=True, check=True, timeout=60).stdout
    frame = struct.pack("<I", len(hello)) + hello
    guest = subprocess.Popen([*AS_NOBODY, sys.executable, "-c", _GUEST, env.socket, "60",
                              frame.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        ready, _, _ = select.select([guest.stdout], [], [], 60)
        assert ready, "the guest printed nothing within 60 s"
        served, capped, *replies = guest.stdout.readline().split()
        assert (int(served), int(capped)) == (32, 28)
        # Every one served was answered as a client: a hello reply, the same for each.
        assert len(replies) == 1, replies
        reply = subprocess.run(["capnp", "decode", AGENT_SCHEMA, "Response"],
                               input=bytes.fromhex(replies[0]), capture_output=True, check=True,
                               timeout=60).stdout.decode()
        assert "hello = (" in reply and "error" not in reply, reply
        # The owner still gets in while the guest holds its 32.
        assert env.status()["agent_pid"] == env.agent.pid
    finally:
        guest.stdin.close()
        try:
            guest.wait(timeout=30)
        except subprocess.TimeoutExpired:
            guest.kill()
            guest.wait()
    # And the guest gets in again once the agent has seen its connections close.
    wait_until("the guest to get in again", lambda: ctl_as_nobody(env, "list").returncode == 0)
