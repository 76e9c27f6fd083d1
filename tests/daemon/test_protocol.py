"""The control protocol: a Hello with a version check first; malformed, truncated and
oversized frames get an error reply and the connection is closed; the agent never crashes."""
import os
import random
import signal
import socket
import struct
import subprocess
import time
import urllib.request

import pytest

from conftest import AGENT_SCHEMA, HELLO, decode, encode, frame, read_frame, wait_until


def connect(env):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(env.socket)
    return s


def expect_error_and_close(s, needle):
    body = read_frame(s)
    assert body is not None, "no error reply"
    text = decode(body)
    assert "error" in text and needle in text, text
    assert read_frame(s) is None, "connection left open after a bad frame"


@pytest.fixture
def agent(env):
    env.start_agent()
    return env


def test_hello_then_request(agent):
    s = connect(agent)
    s.sendall(frame(encode(HELLO)))
    text = decode(read_frame(s))
    assert "protocolVersion = 1" in text
    s.sendall(frame(encode("(id = 2, list = (all = true))")))
    assert "id = 2" in decode(read_frame(s))
    s.close()


def test_wrong_protocol_version_is_refused(agent):
    s = connect(agent)
    s.sendall(frame(encode('(id = 1, hello = (protocolVersion = 99, client = "old"))')))
    expect_error_and_close(s, "protocol version 99")


def test_request_before_hello_is_refused(agent):
    s = connect(agent)
    s.sendall(frame(encode("(id = 1, status = void)")))
    expect_error_and_close(s, "must be hello")


def test_oversized_frame(agent):
    s = connect(agent)
    s.sendall(struct.pack("<I", 0xFFFFFFF8) + b"\0" * 64)
    expect_error_and_close(s, "exceeds the maximum")


def test_length_not_a_word_multiple(agent):
    s = connect(agent)
    s.sendall(struct.pack("<I", 13) + b"x" * 13)
    expect_error_and_close(s, "multiple of 8")


def test_garbage_body(agent):
    s = connect(agent)
    s.sendall(frame(b"\xff" * 64))
    expect_error_and_close(s, "does not decode")


def test_pointer_out_of_bounds(agent):
    s = connect(agent)
    s.sendall(frame(encode(HELLO)))
    read_frame(s)
    # One segment of two words; the root pointer points far outside it.
    body = struct.pack("<II", 0, 2) + struct.pack("<Q", (0x7FFFFFF << 2) | (1 << 32) | (1 << 48))
    body += b"\0" * 8
    s.sendall(frame(body))
    expect_error_and_close(s, "malformed request")


def test_truncated_frame(agent):
    s = connect(agent)
    s.sendall(struct.pack("<I", 64) + b"\0" * 10)
    s.shutdown(socket.SHUT_WR)
    expect_error_and_close(s, "truncated frame")


def test_a_client_that_half_closes_after_its_requests_gets_every_reply(agent):
    """A client may send its requests, shut its side (as `socat` or a shell pipe does) and then
    read. Replies the agent had queued, not yet written, were dropped with the connection."""
    s = connect(agent)
    n = 5000  # their replies fill the socket's buffer, so some wait in the agent's queue
    s.sendall(frame(encode(HELLO)) + frame(encode("(id = 2, status = void)")) * n)
    s.shutdown(socket.SHUT_WR)
    time.sleep(0.5)  # not reading: the agent's queue fills
    got = 0
    while read_frame(s) is not None:
        got += 1
    assert got == n + 1
    s.close()


def test_a_client_that_never_says_hello_is_closed_and_an_idle_one_after_hello_is_not(agent):
    hello, status = frame(encode(HELLO)), frame(encode("(id = 2, status = void)"))
    silent = connect(agent)
    trickle = connect(agent)
    idle = connect(agent)
    idle.sendall(hello)
    assert "protocolVersion = 1" in decode(read_frame(idle))
    # A byte at a time does not buy time: the deadline runs from the connect, so the agent
    # closes the connection while bytes are still coming (a deadline that each byte restarted
    # would let this go on for good).
    partial = struct.pack("<I", 64) + b"\0" * 60
    cut_off = False
    for byte in partial[:10]:
        try:
            trickle.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            cut_off = True
            break
        time.sleep(2)
    assert cut_off, "a client trickling a byte every 2 s was not cut off within 20 s"
    expect_error_and_close(silent, "no hello within 10 s")
    expect_error_and_close(trickle, "truncated frame")
    # The connection that said hello owes nothing: it is still served after the same wait.
    idle.sendall(status)
    assert "id = 2" in decode(read_frame(idle))
    idle.close()


def test_a_client_that_keeps_completing_frames_is_never_cut_off(agent):
    """Requests back to back with a part of the next always in flight: each completed frame is
    progress, so the 10 s deadline starts over, for 14 s here."""
    hello, status = frame(encode(HELLO)), frame(encode("(id = 2, status = void)"))
    s = connect(agent)
    s.sendall(hello)
    read_frame(s)
    s.sendall(status[:1])
    for _ in range(7):
        time.sleep(2)
        s.sendall(status[1:] + status[:1])  # the rest of one request, the start of the next
        assert "id = 2" in decode(read_frame(s))
    s.sendall(status[1:])
    assert "id = 2" in decode(read_frame(s))
    s.close()


def test_random_frames_never_crash_the_agent(agent):
    rng = random.Random(1234)
    valid = encode(HELLO)
    for i in range(150):
        s = connect(agent)
        kind = i % 3
        if kind == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        elif kind == 1:
            body = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            data = frame(bytes(body))
        else:
            body = bytes(rng.randrange(256) for _ in range(8 * rng.randrange(1, 20)))
            data = frame(body)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        s.close()
    assert agent.agent.poll() is None, "the agent died"
    assert agent.ctl_ok("status")


def test_a_client_that_never_reads_its_replies_is_closed(env):
    """Asking and never reading would make the agent hold every reply in memory: past a bound
    (twice the largest frame) the agent hangs up on the client, and serves the others."""
    env.trainer("j", 0)
    env.start_agent()
    wait_until("a few hundred bubbles in the hub's event log",
               lambda: env.hub("j:0")["bubbles"] >= 300)
    s = connect(env)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # replies pile up in the agent
    s.sendall(frame(encode(HELLO)))
    batch = frame(encode("(id = 2, events = (seconds = 1e6))")) * 200
    sent, closed = 0, False
    deadline = time.monotonic() + 120
    while not closed and time.monotonic() < deadline:
        try:
            s.sendall(batch)
            sent += 200
        except (BrokenPipeError, ConnectionResetError):
            closed = True
    s.close()
    assert closed, f"still connected after {sent} unread replies"
    wait_until("the agent to say why it hung up", lambda: "unread" in env.log_tail())
    assert env.agent.poll() is None, "the agent died"
    assert env.ctl_ok("status")


def test_a_cancel_that_cannot_be_done_says_whether_the_task_is_unknown_or_ended(agent):
    agent.trainer("j", 0)
    tid = agent.submit("/bin/true")
    agent.wait_state(tid, "finished")
    s = connect(agent)
    s.sendall(frame(encode(HELLO)))
    read_frame(s)
    s.sendall(frame(encode(f"(id = 2, cancel = {tid})")))
    text = decode(read_frame(s))
    assert "code = state" in text and "already ended" in text, text
    s.sendall(frame(encode("(id = 3, cancel = 99999)")))
    text = decode(read_frame(s))
    assert "code = notFound" in text and "no task #99999" in text, text
    s.close()


def test_clients_together_hold_a_bounded_amount_of_the_agents_memory(agent):
    """Each client's buffers are bounded (a frame being received, replies unread), and so are
    all of them together: past 256 MiB the agent closes the client holding the most, and goes on
    serving the others."""
    chunk = b"\0" * (1 << 20)
    socks, cut = [], 0
    for _ in range(24):  # each sends 15 MiB of a 16 MiB hello and stops there
        s = connect(agent)
        socks.append(s)
        try:
            s.sendall(struct.pack("<I", (16 << 20) - 8))
            for _ in range(15):
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            cut += 1
    wait_until("the agent to close the clients holding the most",
               lambda: sum("holding the most memory" in line for line in agent.log_lines()) >= 4)
    closed = sum("holding the most memory" in line for line in agent.log_lines())
    assert closed <= 12, (f"{closed} clients closed: more than the bound needs",
                          [l for l in agent.log_lines() if "holding the most" in l])
    for s in socks:
        s.close()
    assert agent.agent.poll() is None, "the agent died"
    assert agent.ctl_ok("status")


def test_clients_pipelining_at_once_get_a_bounded_number_of_answers_per_loop_turn(env):
    """Eight clients whose requests all arrive in one poll of the agent's loop (it is stopped
    while they send) are answered over several turns: at most 64 answers a turn for all of
    them together (16 for one), not 16 for each, so timers wait on a bounded amount of work."""
    env.start_agent()
    port = env.status()["metrics_port"]
    clients = [connect(env) for _ in range(8)]
    for s in clients:
        s.sendall(frame(encode(HELLO)))
        assert read_frame(s) is not None
    burst = frame(encode("(id = 2, status = void)")) * 40
    os.kill(env.agent.pid, signal.SIGSTOP)
    try:
        for s in clients:
            s.sendall(burst)
    finally:
        os.kill(env.agent.pid, signal.SIGCONT)
    for s in clients:  # every request answered
        for _ in range(40):
            assert read_frame(s) is not None
        s.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as r:
        text = r.read().decode()
    most = [float(line.split()[1]) for line in text.splitlines()
            if line.startswith("bubble_agent_control_requests_most_per_turn ")]
    assert most and 16 <= most[0] <= 64, most
