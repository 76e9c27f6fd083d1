"""Ctrl-C reaches a Python side task while it waits for a bubble, in both styles: the
imperative wait_start() and the iterative run(). Python raises KeyboardInterrupt only when it
runs bytecode again, so a wait that stays in C for good (or a callback that swallows the
exception, as ctypes does) would leave the task deaf to it."""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

import bubble

from conftest import eventually

CHILD = r'''
import sys, bubble
job, style = sys.argv[1], sys.argv[2]
task = bubble.Task(job, 0, "ctrl-c", wake_mode=bubble.WakeMode.SLEEP)

class Idle(bubble.SideTask):
    def init(self):
        print("WAITING", flush=True)  # inside run(), where Ctrl-C must be heard
    def step(self, info):
        print("STEP", flush=True)
    def finish(self, status):
        print("FINISH", getattr(status, "name", status), flush=True)

if style != "run":
    print("WAITING", flush=True)
try:
    if style == "run":
        task.run(Idle())
    else:
        task.wait_start()
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
    raise
print("RETURNED", flush=True)
'''


def read_until(proc: subprocess.Popen, seen: list[str], word: str, timeout: float) -> list[str]:
    """Reads proc's stdout lines into seen until one is `word` (fails after timeout)."""
    end = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    partial = b""
    while word not in seen:
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no {word!r} line within {timeout} s; got {seen}, "
                                 f"exit {proc.poll()}")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"stdout ended before a {word!r} line; got {seen}, "
                                 f"exit {proc.wait()}")
        *done, partial = (partial + chunk).split(b"\n")
        seen += [line.decode() for line in done]
    return seen


@contextlib.contextmanager
def child(script: str, *args: str) -> Iterator[subprocess.Popen]:
    """A Python child running `script` with this binding, killed and reaped whatever happens."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", script, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def asleep(pid: int) -> bool:
    """Whether the process's main thread is asleep in the kernel (state S in /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


@pytest.mark.parametrize("style", ["wait_start", "run"])
def test_ctrl_c_interrupts_a_task_waiting_for_a_bubble(job, style):
    with bubble.Trainer(job, 0) as trainer, child(CHILD, job, style) as proc:
        lines: list[str] = []
        read_until(proc, lines, "WAITING", 20)
        assert eventually(lambda: any(t.name == "ctrl-c" for t in trainer.tasks()))
        # Inside the wait (no bubble comes, so it never ends) once the child sleeps in the
        # kernel: a task waiting in SLEEP mode spins a few microseconds, then waits on a futex.
        assert eventually(lambda: asleep(proc.pid), timeout=20.0)
        proc.send_signal(signal.SIGINT)
        read_until(proc, lines, "INTERRUPTED", 10)
        assert proc.wait(timeout=10) != 0
        assert "RETURNED" not in lines
        if style == "run":
            # finish ran before run() re-raised, and the run counts as failed.
            assert "FINISH E_CALLBACK" in lines
        assert b"KeyboardInterrupt" in proc.stderr.read()


def test_idle_runs_while_waiting_ends_the_run_and_the_sigint_handler_comes_back(job):
    class Idler(bubble.SideTask):
        calls = 0

        def step(self, info):
            raise AssertionError("no bubble was begun")

        def idle(self):
            assert signal.getsignal(signal.SIGINT) is not before  # the run's own, meanwhile
            self.calls += 1
            return self.calls == 3

    before = signal.getsignal(signal.SIGINT)
    side = Idler()
    with bubble.Trainer(job, 0):
        with bubble.Task(job, 0, "idler") as task:
            assert task.run(side) is bubble.Outcome.FINISHED  # on the main thread
    assert side.calls == 3
    assert signal.getsignal(signal.SIGINT) is before


TERM_CHILD = r'''
import signal, sys, bubble
job = sys.argv[1]

def on_term(signum, frame):
    sys.exit(5)

signal.signal(signal.SIGTERM, on_term)
task = bubble.Task(job, 0, "sigterm", wake_mode=bubble.WakeMode.SLEEP)

class Waits(bubble.SideTask):
    def init(self):
        print("WAITING", flush=True)
    def step(self, info):
        print("STEP", flush=True)
    def idle(self):
        return False
    def finish(self, status):
        print("FINISH", getattr(status, "name", status), flush=True)

task.run(Waits())
print("RETURNED", flush=True)
'''


def test_an_exception_from_a_signal_handler_ends_the_run(job):
    """A SIGTERM handler that calls sys.exit runs at the entry of the run's next callback,
    where ctypes could only print the SystemExit: it ends the run instead, after finish(), and
    run() raises it."""
    with bubble.Trainer(job, 0) as trainer, child(TERM_CHILD, job) as proc:
        lines: list[str] = []
        read_until(proc, lines, "WAITING", 20)
        assert eventually(lambda: any(t.name == "sigterm" for t in trainer.tasks()))
        proc.send_signal(signal.SIGTERM)
        read_until(proc, lines, "FINISH E_CALLBACK", 20)
        assert proc.wait(timeout=20) == 5
        assert "RETURNED" not in lines
        assert b"Exception ignored" not in proc.stderr.read()


def test_runs_on_two_threads_leave_the_unraisable_hook_as_they_found_it(job):
    """Each run() takes lost callback exceptions through sys.unraisablehook while it runs; runs
    on two threads that end in the other order than they began leave the hook as it was."""
    class Idles(bubble.SideTask):
        def __init__(self, rounds: int, started: threading.Event) -> None:
            self.rounds, self.started = rounds, started

        def step(self, info):
            raise AssertionError("no bubble was begun")

        def idle(self):
            self.started.set()
            self.rounds -= 1
            return self.rounds == 0

    before = sys.unraisablehook
    first_in, second_in = threading.Event(), threading.Event()
    outcomes: list = []

    def run(name: str, side: Idles) -> None:
        with bubble.Task(job, 0, name) as task:
            outcomes.append((name, task.run(side)))

    with bubble.Trainer(job, 0):
        first = threading.Thread(target=run, args=("first", Idles(3, first_in)))
        first.start()
        assert first_in.wait(20)
        second = threading.Thread(target=run, args=("second", Idles(8, second_in)))
        second.start()
        assert second_in.wait(20)
        first.join(20)
        assert sys.unraisablehook is not before  # the second still runs
        second.join(20)
    assert [name for name, _ in outcomes] == ["first", "second"]
    assert all(o is bubble.Outcome.FINISHED for _, o in outcomes)
    assert sys.unraisablehook is before
