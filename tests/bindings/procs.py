"""Child processes whose output lines a test can wait for, killed however the test ends."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from typing import Callable


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
