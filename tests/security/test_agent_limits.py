"""What a client of the agent can send: every field of a submission is checked by the agent
itself (not only by bubblectl), the number of connections and the size of a log tail are
bounded, and exceeding a bound gets a clear error. Who may connect at all is tested in
tests/daemon/test_access.py; malformed frames in tests/daemon/test_protocol.py."""
import importlib.util
import os
import socket
import sqlite3

import pytest

_spec = importlib.util.spec_from_file_location(
    "daemon_conftest", os.path.join(os.path.dirname(__file__), "..", "daemon", "conftest.py"))
daemon_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(daemon_conftest)
env = daemon_conftest.env  # the fixture: private dirs, real processes, teardown kills them
AGENT_SCHEMA = daemon_conftest.AGENT_SCHEMA
wait_until = daemon_conftest.wait_until

HELLO = '(id = 1, hello = (protocolVersion = 1, client = "limits"))'
MAX_FRAME = 16 << 20


def encode(text, type_name="Request"):
    """One framed message."""
    return daemon_conftest.frame(daemon_conftest.encode(text, type_name))


decode = daemon_conftest.decode
read_frame = daemon_conftest.read_frame


def session(e):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(e.socket)
    s.sendall(encode(HELLO))
    assert "hello" in decode(read_frame(s))
    return s


def request(s, text):
    s.sendall(encode(text))
    return decode(read_frame(s))


@pytest.fixture
def agent(env):
    env.start_agent()
    return env


# Each is refused by the agent with a sentence naming the rule; bubblectl would refuse some of
# them before sending, so they go out as raw frames here.
BAD_SUBMISSIONS = [
    ('argv = []', "has no command"),
    ('argv = [""]', "has no command"),
    (f'argv = ["t"], name = "{"n" * 48}"', "must be 1..47 printable characters"),
    ('argv = ["t"], name = "two\\nlines"', "must be 1..47 printable characters"),
    ('argv = ["t"], env = ["NOEQUALS"]', "is not KEY=VALUE"),
    ('argv = ["t"], env = ["=value"]', "is not KEY=VALUE"),
    ('argv = ["t"], cwd = "relative/dir"', "must be an absolute path"),
    # The job and rank are held to the library's rules, and the reply gives its sentence.
    ('argv = ["t"], hub = "../../etc:0"', "must not start with"),
    ('argv = ["t"], hub = "a/b:0"', "use only letters, digits"),
    ('argv = ["t"], hub = "job:99999999999"', "is neither `auto` nor JOB:RANK"),
    (f'argv = ["t"], hub = "{"j" * 48}:0"', "must be 1 to 47 characters long"),
    ('argv = ["t"], hub = "job:70000"', "out of range 0..65535"),
    # Size bounds: every record stays small next to the frame, so `list` keeps working.
    ('argv = [' + ", ".join(['"a"'] * 257) + ']', "argv has 257 arguments, more than the limit of 256"),
    ('argv = ["t"], env = [' + ", ".join(['"K=v"'] * 257) + ']',
     "env has 257 entries, more than the limit of 256"),
    (f'argv = ["t", "{"x" * 4097}"]', "argv entry has 4097 bytes, more than the limit of 4096"),
    (f'argv = ["t"], env = ["K={"x" * 4095}"]', "env entry has 4097 bytes"),
    ('argv = ["t", ' + ", ".join([f'"{"x" * 4000}"'] * 17) + ']',
     "argv and env together has 68001 bytes, more than the limit of 65536"),
    ('argv = ["t"], gpu = -7', "is negative"),
    ('argv = ["t"], mpsPriority = 5', "MPS client priority must be 0"),
    ('argv = ["t"], mpsMemLimit = "2G; rm -rf /"', "is malformed"),
    (f'argv = ["t"], cwd = "/{"d" * 4096}"',
     "working directory has 4097 bytes, more than the limit of 4096"),
    (f'argv = ["t"], mpsMemLimit = "{"0=2G," * 52}"',
     "MPS memory limit has 260 bytes, more than the limit of 256"),
]


def _id(p):
    return (p.values if hasattr(p, "values") else p)[0][:40]


@pytest.mark.parametrize("fields,needle", BAD_SUBMISSIONS, ids=[_id(p) for p in BAD_SUBMISSIONS])
def test_the_agent_checks_every_submission_field_itself(agent, fields, needle):
    s = session(agent)
    text = request(s, f"(id = 2, submit = ({fields}))")
    assert "badRequest" in text and needle in text, text
    # A refused request is not a protocol error: the connection stays usable, nothing queued.
    assert "list = []" in request(s, "(id = 3, list = (all = true))")
    s.close()


def test_connections_beyond_the_cap_are_refused_with_a_reason(agent):
    held = []
    try:
        for _ in range(128):
            held.append(session(agent))
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        extra.settimeout(30)
        extra.connect(agent.socket)
        text = decode(read_frame(extra))
        assert "too many open connections" in text and "retry" in text, text
        assert read_frame(extra) is None, "the refused connection was left open"
        extra.close()
    finally:
        for s in held:
            s.close()
    # Room again once clients leave.
    wait_until("a new client to get in", lambda: agent.ctl_ok("status"))


def test_a_log_tail_is_capped_at_8_mib(agent):
    agent.trainer(job="logs")
    tid = agent.submit("/bin/sh", "-c", "head -c 9437184 /dev/zero | tr '\\0' x")
    agent.wait_state(tid, "finished")
    s = session(agent)
    s.sendall(encode(f"(id = 2, logs = (task = {tid}, maxBytes = 4294967295))"))
    body = read_frame(s)
    assert 8 << 20 < len(body) < (8 << 20) + 4096, len(body)  # the tail, not the 9 MiB log
    s.close()


def _huge_argv(n):
    return "(id = 2, submit = (argv = [" + ", ".join(['"xxxxxxxxxxxxxxx"'] * n) + "]))"


def test_large_submissions_are_bounded_so_listing_keeps_working(agent):
    s = session(agent)
    frame = encode(_huge_argv(500_000))
    assert len(frame) < MAX_FRAME
    for _ in range(2):
        s.sendall(frame)
        text = decode(read_frame(s))
        assert "badRequest" in text and "argv has 500000 arguments" in text, text
    # The largest accepted submission, many times: the list reply still fits.
    big = ", ".join([f'"{"x" * 4000}"'] * 16)
    for i in range(4):
        assert "submit" in request(s, f'(id = {3 + i}, submit = (argv = ["/bin/true", {big}]))')
    s.close()
    r = agent.ctl("list", "--all", check=False)
    assert r.returncode == 0, r.stderr
    rows = agent.tasks()
    assert len(rows) == 4 and all(len(t["argv"]) == 17 for t in rows.values()), rows


def test_a_list_reply_fits_a_frame_even_with_records_from_before_the_bounds(agent):
    """Records stored before the size bounds existed may each be megabytes: the reply trims the
    older ones' arguments (saying so) instead of exceeding the frame."""
    agent.trainer(job="big")
    tid = agent.submit("/bin/true")
    agent.wait_state(tid, ("finished", "failed"))
    agent.kill_agent()
    db = sqlite3.connect(os.path.join(agent.state, "bubbled.db"))
    huge = b"".join(a + b"\0" for a in [b"/bin/true"] + [b"y" * 15] * 100_000)
    cols = [r[1] for r in db.execute("PRAGMA table_info(tasks)") if r[1] != "id"]
    for _ in range(8):  # about 19 MiB of arguments in all, more than one frame
        db.execute(f"INSERT INTO tasks ({', '.join(cols)}) SELECT {', '.join(cols)} FROM tasks "
                   "WHERE id = ?", (tid,))
        db.execute("UPDATE tasks SET argv = ? WHERE id = last_insert_rowid()", (huge,))
    db.commit()
    db.close()
    agent.start_agent()
    rows = agent.tasks()  # `bubblectl list --all --json` succeeds
    assert len(rows) == 9
    newest = max(rows)
    assert len(rows[newest]["argv"]) == 100_001
    trimmed = [t for t in rows.values() if "left out" in t["message"]]
    assert len(trimmed) == 7 and all(t["argv"] == ["/bin/true"] for t in trimmed), \
        [(t["id"], len(t["argv"])) for t in rows.values()]


def test_pipelined_requests_are_all_answered_in_order_a_batch_per_loop_turn(agent):
    """A client may send many requests before reading a reply. The agent answers a batch of them
    per loop turn, reading nothing more from that client until it is through (so one client's
    run of requests cannot hold the loop, nor grow without bound), and answers every one, in
    order, also what the client sent after."""
    s = session(agent)
    frames = b"".join(encode(f"(id = {100 + k}, status = void)") for k in range(100))
    s.sendall(frames)  # 100 requests in one write: several batches
    ids = []
    for _ in range(100):
        text = decode(read_frame(s))
        ids.append(int(text.split("id = ", 1)[1].split(",", 1)[0]))
    assert ids == list(range(100, 200))
    # Reading resumed: a request sent now is answered too.
    assert "status = (" in request(s, "(id = 7, status = void)")
    s.close()
