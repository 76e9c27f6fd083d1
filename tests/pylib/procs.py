"""Process helpers shared by the Python test suites (tests/daemon, tests/security, tests/fault,
tests/bindings): waiting on another process's progress, finding and killing every process a
test started, and child processes whose output lines a test can wait for.

CTest puts this directory on PYTHONPATH for each suite that imports it."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable


def poll_until(pred: Callable[[], Any], timeout: float, interval: float) -> Any:
    """Calls pred every interval seconds until it returns a truthy value or timeout passes;
    returns its last value (falsy on timeout)."""
    end = time.monotonic() + timeout
    while True:
        last = pred()
        if last or time.monotonic() >= end:
            return last
        time.sleep(interval)


def wait_until(what: str, pred: Callable[[], Any], timeout: float = 30.0,
               interval: float = 0.05) -> Any:
    """poll_until that fails naming `what` (an AssertionError, so pytest reports it as a failed
    check). A driver polling a cheap local condition passes a shorter interval."""
    last = poll_until(pred, timeout, interval)
    if not last:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")
    return last


def pids_with_env(marker: str) -> list[int]:
    """Processes (other than this one) whose environment contains marker, e.g. a test's
    private BUBBLE_RUNTIME_DIR=...: what a test started, however deep below it."""
    needle = marker.encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read():
                    out.append(int(d))
        except OSError:
            pass
    return out


def kill_marked(marker: str, pause: float = 0.05) -> None:
    """SIGKILLs every process whose environment contains marker. Three passes: a process may
    fork between the listing and the kill of its parent."""
    for _ in range(3):
        for pid in pids_with_env(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(pause)


class Child:
    """A process with its stdout collected line by line on a reader thread."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        # stderr goes to a file: a pipe nobody reads could fill and block the child.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()

    def mark(self) -> int:
        """A position in the output: wait_for(..., since=mark) only sees later lines."""
        with self._cv:
            return len(self.lines)

    def wait_for(self, pred: Callable[[str], bool], timeout: float = 20.0, since: int = 0) -> str:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines[since:]:
                    if pred(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"{self.name}: expected line not seen within {timeout}s; "
                        f"exit={self.proc.poll()} output={self.lines[since:][-20:]} "
                        f"stderr={self.stderr_tail()}")
                self._cv.wait(min(left, 0.1))

    def stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-2000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


class Children:
    """Every child started through it is SIGKILLed and reaped on exit, pass or fail."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        child = Child(name, argv, env)
        self.children.append(child)
        return child

    def __enter__(self) -> "Children":
        return self

    def __exit__(self, *exc: object) -> None:
        for child in self.children:
            child.kill()
