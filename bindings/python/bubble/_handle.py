"""A C handle that threads share and one of them frees: the hub of a Trainer, a Task's slot."""
from __future__ import annotations

import threading
from threading import get_ident
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class SharedHandle:
    """Counts the calls in flight on a handle, so that close() frees it only once none uses it.

    close() waits for the calls other threads have in flight; calls made after it raise
    ValueError(closed). A close on a thread that is itself inside a call cannot wait for that
    call, which is below it on its stack: a signal handler (Python runs one between two
    bytecodes of the call, before the C function is called as well as after it returns) or a
    callback the C function made. That call may still pass the handle to the library, so the
    handle is freed when the thread's outermost call returns, by that call.

    A call takes no lock: it marks itself in flight (one dict store, atomic under the GIL)
    before it reads the handle, and close() clears the handle before it looks at the calls in
    flight, so either the call sees the handle gone or close() sees the call."""

    def __init__(self, h: Any, closed: str) -> None:
        self._h = h
        self._closed = closed
        self._users: dict[int, int] = {}  # thread id -> its calls in flight (nested: a handler)
        self._pending: dict[int, tuple[Any, Callable[[Any], None]]] = {}  # closed inside one
        # A close interrupted (Ctrl-C) while other threads' calls were in: the last to return
        # frees the handle.
        self._orphan: tuple[Any, Callable[[Any], None]] | None = None
        # An RLock: a signal handler's close() may run while this thread holds it.
        self._mu = threading.RLock()
        self._returned = threading.Condition(self._mu)  # once closed, as calls return

    @property
    def closed(self) -> bool:
        return self._h is None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(handle, *args), counted in flight. Raises ValueError(closed) once closed."""
        users, me = self._users, get_ident()
        base = users.get(me, 0)
        try:
            users[me] = base + 1  # before the handle is read: see the class
            h = self._h
            if h is None:
                raise ValueError(self._closed)
            return fn(h, *args)
        finally:
            # Back to what it was, wherever an exception (a handler's) left the lines above.
            if base:
                users[me] = base
            else:
                users.pop(me, None)
            if self._h is None:  # closed: close() may wait for this call, or left it the free
                self._after_close(me, base)

    def close(self, free: Callable[[Any], None]) -> None:
        """free(handle) once no call uses it; see the class. Closing twice does nothing."""
        with self._mu:
            h, self._h = self._h, None
            if h is None:
                return
            if self._users.get(get_ident()):
                self._pending[get_ident()] = (h, free)
                return
        self._release(h, free)

    def _after_close(self, me: int, base: int) -> None:
        with self._mu:
            self._returned.notify_all()
            pending = None if base else self._pending.pop(me, None)
            orphan = None
            if self._orphan is not None and not self._users:
                orphan, self._orphan = self._orphan, None
        if pending is not None:
            self._release(*pending)
        if orphan is not None:
            orphan[1](orphan[0])

    def _release(self, h: Any, free: Callable[[Any], None]) -> None:
        # This thread has no call in flight here: the calls left are other threads'.
        try:
            with self._mu:
                self._returned.wait_for(lambda: not self._users)
        except BaseException:
            # Interrupted (a KeyboardInterrupt in the wait): the handle must still be freed, by
            # the last call to return, or here if none is left.
            with self._mu:
                if self._users:
                    self._orphan = (h, free)
                    raise
            free(h)
            raise
        free(h)
