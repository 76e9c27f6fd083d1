from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
from typing import Callable

import pytest

_ids = itertools.count()


@pytest.fixture(autouse=True)
def runtime_dir(monkeypatch):
    """Each test gets a private runtime directory (short: it holds Unix socket paths)."""
    path = tempfile.mkdtemp(prefix="bb-py-")
    monkeypatch.setenv("BUBBLE_RUNTIME_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job() -> str:
    return f"py-{os.getpid()}-{next(_ids)}"


def eventually(pred: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def bubble_until(trainer, pred: Callable[[], bool], attempts: int = 20, **kw) -> bool:
    """Opens bubbles until pred() holds inside one. A task that has not yet acked the pause of
    the previous bubble is (rightly) not started, and nothing on the trainer side tells when
    that ack lands: so a bubble in which nothing started is closed and another one opened."""
    for _ in range(attempts):
        with trainer.bubble(0.05, **kw):
            if eventually(pred, timeout=1.0):
                return True
    return False


class Background(threading.Thread):
    """Runs fn on a thread and keeps its result or exception for join_result()."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            self.error = exc

    def join_result(self, timeout: float = 20.0):
        self.join(timeout)
        assert not self.is_alive(), "the background call did not return"
        if self.error is not None:
            raise self.error
        return self.result
