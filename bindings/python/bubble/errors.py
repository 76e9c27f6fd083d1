"""Status codes of bubble.h as an enum, and the exceptions that carry the library's message."""
from __future__ import annotations

import enum
import os

from ._lib import lib


class Status(enum.IntEnum):
    OK = 0
    E_INVALID = -1
    E_NOMEM = -2
    E_SYSTEM = -3
    E_NOT_FOUND = -4
    E_BUSY = -5
    E_FULL = -6
    E_VERSION = -7
    E_PERMISSION = -8
    E_TIMEOUT = -9
    E_STOPPED = -10
    E_TRAINER_GONE = -11
    E_CORRUPT = -12
    E_STATE = -13
    E_UNSUPPORTED = -14
    E_CALLBACK = -15

    @property
    def description(self) -> str:
        return lib.bb_status_str(int(self)).decode()


class BubbleError(Exception):
    """A libbubble call failed. `status` is the code, `message` what the library said, and
    `raw_status` the number the call returned (a code newer than this binding, which `status`
    can only name E_SYSTEM, keeps its value there)."""

    status: Status = Status.E_SYSTEM

    def __init__(self, message: str, status: Status | int | None = None, *,
                 raw_status: int | None = None) -> None:
        if status is not None:
            self.status = Status(status)
        self.raw_status = int(self.status) if raw_status is None else raw_status
        self.message = message
        super().__init__(f"{message} [{lib.bb_status_name(int(self.status)).decode()}]")


class InvalidArgument(BubbleError, ValueError): status = Status.E_INVALID
class OutOfMemory(BubbleError, MemoryError): status = Status.E_NOMEM
class SystemCallError(BubbleError, OSError): status = Status.E_SYSTEM
class HubNotFound(BubbleError, LookupError): status = Status.E_NOT_FOUND
class Busy(BubbleError): status = Status.E_BUSY
class HubFull(BubbleError): status = Status.E_FULL
class VersionMismatch(BubbleError): status = Status.E_VERSION
class PermissionDenied(BubbleError, PermissionError): status = Status.E_PERMISSION
class Timeout(BubbleError, TimeoutError): status = Status.E_TIMEOUT
class Stopped(BubbleError): status = Status.E_STOPPED
class TrainerGone(BubbleError): status = Status.E_TRAINER_GONE
class Corrupt(BubbleError): status = Status.E_CORRUPT
class InvalidState(BubbleError): status = Status.E_STATE
class Unsupported(BubbleError): status = Status.E_UNSUPPORTED
class CallbackFailed(BubbleError): status = Status.E_CALLBACK


_BY_STATUS: dict[int, type[BubbleError]] = {
    cls.status: cls for cls in BubbleError.__subclasses__()}


def error_for(status: int, message: str | None = None) -> BubbleError:
    """The exception for a failed call; reads bb_last_error() unless a message is given."""
    if message is None:
        message = lib.bb_last_error().decode(errors="replace") or \
            lib.bb_status_str(status).decode()
    try:
        cls = _BY_STATUS[Status(status)]
    except ValueError:  # a code newer than this binding
        return BubbleError(f"{message} (status {status}, unknown to this binding)",
                           Status.E_SYSTEM, raw_status=status)
    return cls(message)


def check(status: int) -> None:
    """Raise the matching exception for a non-OK status (call right after the C call)."""
    if status != 0:
        raise error_for(status)


def c_string(what: str, value: str | os.PathLike[str], *, path: bool = False) -> bytes:
    """`value` for a const char* argument (a path: os.fsencode'd); InvalidArgument when it
    holds a NUL byte, which C would take for its end, and so use a shorter, other name."""
    raw = os.fsencode(value) if path else value.encode()
    if b"\0" in raw:
        raise InvalidArgument(f"{what} {value!r} contains a NUL byte; pass "
                              f"{'a path' if path else 'a name'} without one")
    return raw
