"""A handle shared by threads is freed once, after the last call that uses it, also when the
close that asked for it was interrupted."""
from __future__ import annotations

import signal
import threading

import pytest

from bubble._handle import SharedHandle


def test_a_close_interrupted_while_another_thread_is_inside_a_call_still_frees_the_handle():
    freed: list[str] = []
    shared = SharedHandle("H", "closed")
    inside, leave = threading.Event(), threading.Event()

    def long_call(h: str) -> str:
        inside.set()
        leave.wait(20)
        return h

    other = threading.Thread(target=shared.call, args=(long_call,))
    other.start()
    try:
        assert inside.wait(20)
        # Ctrl-C while close() waits for the other thread's call to return.
        ctrl_c = threading.Timer(0.2, signal.pthread_kill,
                                 (threading.main_thread().ident, signal.SIGINT))
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            shared.close(freed.append)
        ctrl_c.join()
        assert shared.closed
        assert freed == []  # the other thread's call still uses it
    finally:
        leave.set()
        other.join(20)
    assert freed == ["H"]  # freed by that call as it returned, once
    shared.close(freed.append)
    assert freed == ["H"]
