"""Memory grants (docs/GRANTS.md): the trainer lends memory, each task is granted a piece of it.

Host grants are reachable from Python as memoryviews. A view of a task's grant is released by the
binding as soon as the mapping may go (the task's next wait_start, ack_pause, ack_revoke, grant
or detach, or the end of the step, or of the SideTask method, it was taken in), so touching it
afterwards raises ValueError
instead of faulting; slices and arrays made from it are not tracked and must be dropped by then.
A trainer's views of its lent memory (GrantInfo.memory) go the same way when it unlends or
closes, which unmaps the whole lent range.
"""
from __future__ import annotations

import contextlib
import ctypes
import enum
import weakref
from dataclasses import dataclass, fields

from . import _lib
from ._lib import lib
from .errors import Status, check


class GrantBackend(enum.IntEnum):
    HOST = 1      # shared host memory: CPU side tasks, machines without a GPU
    CUDA_IPC = 2  # a window of one device allocation, by its CUDA IPC handle
    CUDA_VMM = 3  # a cuMemCreate allocation per grant


class GrantState(enum.IntEnum):
    NONE = 0
    ACTIVE = 1
    REVOKING = 2     # asked back; the task has not acked yet
    QUARANTINED = 3  # giving it back failed; never reused


def _backend(raw: int) -> GrantBackend | int:
    try:
        return GrantBackend(raw)
    except ValueError:  # a backend newer than this binding
        return raw


def _host_view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


@dataclass(frozen=True)
class GrantInfo:
    """A task's grant as the trainer sees it."""
    id: int
    task_id: int
    state: GrantState
    backend: GrantBackend | int
    mapped: bool          # the task says it maps the grant (its word: informative only)
    bytes: int
    offset: int           # where the grant sits in the lent range
    address: int          # the trainer's own address: host pointer, or CUdeviceptr for CUDA
    deadline_ns: int | None  # while revoking: when the task will be killed

    def memory(self) -> memoryview:
        """The trainer's view of a host grant. Its contents are the task's while the grant is
        active or revoking; once released (the task may leave at any moment) the range reads
        zeros, and a later grant there is another task's. Trainer.unlend() and close() unmap
        the whole lent range: they release the views taken here, so touching one afterwards
        raises ValueError (slices and arrays made from a view are not tracked: drop them
        first; nor is a GrantInfo made by hand or by dataclasses.replace, whose views are
        plain). Trainer.read_grant() copies the bytes out instead, and refuses once the grant
        is released."""
        if self.backend != GrantBackend.HOST:
            raise TypeError(f"grant {self.id} is device memory ({self.backend!r}): copy it "
                            "out with Trainer.read_grant(), or pass its address to device code")
        # The trainer's views of the lent range, released when it unlends or closes (set by
        # Trainer.task_grant, not a field: asdict leaves it out, a copy shares it, a pickle
        # gets a closed one).
        views = self.__dict__.get("_views")
        if views is None:  # made by hand, not by a trainer
            return _host_view(self.address, self.bytes)
        return views.view(self.address, self.bytes)


@dataclass(frozen=True)
class GrantStats:
    """The lender's exact byte counts and the revoke protocol's counters."""
    backend: GrantBackend | None  # None before Trainer.lend
    capacity: int
    granted_bytes: int
    requested_bytes: int
    free_bytes: int
    largest_free: int
    revoking_bytes: int
    quarantined_bytes: int
    active: int
    revoking: int
    quarantined: int
    grants_made: int
    grants_failed: int
    revokes: int
    revokes_acked: int
    tasks_killed: int
    released_dead: int


class TaskGrant:
    """The grant a task maps: id, backend, the task's pointer (an int) and size, the GPU it is
    mapped on (`device`), and for host grants a memoryview of it (`memory`), valid until the
    mapping may go."""

    def __init__(self, grant_id: int, backend: GrantBackend | int | None, ptr: int, size: int,
                 revoke_deadline_ns: int | None, scope: ViewScope,
                 device: int | None = None) -> None:
        self.id = grant_id
        self.backend = backend  # None when the runtime did not say
        self.ptr = ptr
        self.bytes = size
        self.revoke_deadline_ns = revoke_deadline_ns
        # CUDA backends: this process's ordinal of the GPU the grant is mapped on (the trainer's
        # GPU found by UUID; it differs from the trainer's ordinal where CUDA_VISIBLE_DEVICES
        # does), e.g. torch.device("cuda", device). -1 for host; None when the runtime did not say.
        self.device = device
        self._scope = scope
        self._memory: memoryview | None = None

    @property
    def revoking(self) -> bool:
        """True while the trainer asks the grant back: stop using it and call
        Task.ack_revoke (or Task.ack_pause) before revoke_deadline_ns."""
        return self.revoke_deadline_ns is not None

    @property
    def memory(self) -> memoryview | None:
        """The grant's host memory (None for device memory)."""
        if self.backend != GrantBackend.HOST:
            return None
        if self._memory is None:
            self._memory = self._scope.view(self.ptr, self.bytes)
        return self._memory

    def __repr__(self) -> str:
        return (f"TaskGrant(id={self.id}, backend={self.backend!r}, ptr={self.ptr:#x}, "
                f"bytes={self.bytes}, device={self.device}, "
                f"revoke_deadline_ns={self.revoke_deadline_ns})")


class ViewScope:
    """The views of grant mappings handed out until a call that may unmap them; close() then
    releases them all and refuses new ones. Safe across threads: a view made while another
    thread closes the scope is released before it is handed out."""

    TASK_GONE = ("this grant mapping may be gone (the task called wait_start, ack_pause, "
                 "ack_revoke, grant or detach since, or the step or SideTask method it was taken "
                 "in returned): take the grant again")
    LENT_GONE = ("the lent memory this view was of may be gone (the trainer unlent, or began "
                 "to unlend, or closed since): take the grant again with Trainer.task_grant()")

    def __init__(self, gone: str = TASK_GONE, closed: bool = False) -> None:
        # Weak: a view its user dropped needs no release, and a long-lived scope (a trainer's,
        # for the whole of a lend) must not keep every view ever made.
        self._views: list[weakref.ref[memoryview]] = []
        self._closed = closed
        self._gone = gone

    def view(self, address: int, size: int) -> memoryview:
        if self._closed:
            raise ValueError(self._gone)
        mv = _host_view(address, size)
        if len(self._views) >= 64:  # forget the dropped ones, in place: another thread may append
            for dead in [r for r in self._views if r() is None]:
                with contextlib.suppress(ValueError):
                    self._views.remove(dead)
        self._views.append(weakref.ref(mv))
        # Checked again after the append: a close() on another thread between the first check
        # and the append would not have seen this view.
        if self._closed:
            mv.release()
            raise ValueError(self._gone)
        return mv

    def close(self) -> None:
        self._closed = True
        while self._views:
            mv = self._views.pop()()
            if mv is not None:
                with contextlib.suppress(BufferError):  # exported to an array: the user's
                    mv.release()

    # A GrantInfo copied or pickled keeps no views: a copy shares the scope, and a pickle
    # comes back with a closed one (an address means nothing in another process).
    def __copy__(self) -> "ViewScope":
        return self

    def __deepcopy__(self, memo: dict) -> "ViewScope":
        return self

    def __reduce__(self):
        return (ViewScope, (self._gone, True))


def lend_options(size: int, backend: GrantBackend, device_ptr: int | None, device: int,
                 max_grants: int | None, alignment: int | None,
                 auto_grant: bool, clear_grants: bool = True) -> _lib.LendOptionsC:
    opts = _lib.LendOptionsC()
    lib.bb_lend_options_init_sized(ctypes.byref(opts), ctypes.sizeof(opts))
    opts.backend = int(backend)
    opts.bytes = size
    opts.device_ptr = device_ptr or 0
    opts.device = device
    if max_grants is not None:
        opts.max_grants = max_grants
    opts.alignment = alignment or 0
    opts.auto_grant = 1 if auto_grant else 0
    opts.clear_grants = 1 if clear_grants else 0
    return opts


def grant_info(c: _lib.GrantInfoC, views: ViewScope | None = None) -> GrantInfo | None:
    if c.state == GrantState.NONE:
        return None
    info = GrantInfo(id=c.id, task_id=c.task_id, state=GrantState(c.state),
                     backend=_backend(c.backend), mapped=bool(c.mapped), bytes=c.bytes,
                     offset=c.offset, address=c.address, deadline_ns=c.deadline_ns or None)
    if views is not None:
        object.__setattr__(info, "_views", views)  # frozen: set as the dataclass's own init does
    return info


def grant_stats(c: _lib.GrantStatsC) -> GrantStats:
    values = {f.name: getattr(c, f.name) for f in fields(GrantStats)}
    values["backend"] = _backend(c.backend) if c.backend else None
    return GrantStats(**values)


def task_grant(handle: ctypes.c_void_p, scope: ViewScope) -> TaskGrant | None:
    out = _lib.TaskGrantC(size=ctypes.sizeof(_lib.TaskGrantC))
    status = lib.bb_task_grant(handle, ctypes.byref(out))
    if status == Status.E_NOT_FOUND:
        return None
    check(status)
    return TaskGrant(out.id, _backend(out.backend), out.ptr or 0, out.bytes,
                     out.revoke_deadline_ns or None, scope, out.device)


class GrantLookup:
    """Names the grant of a start or step. The infos do not carry the backend; a
    bb_task_grant on the task's own thread right after the start, or between the runtime's
    steps, reports that same mapping (it maps, never unmaps). The last answer is kept."""

    def __init__(self) -> None:
        self._known: tuple[int, int, GrantBackend | int, int] | None = None

    def __call__(self, handle: ctypes.c_void_p, grant_id: int, ptr: int | None, size: int,
                 scope: ViewScope) -> TaskGrant | None:
        if not grant_id or not ptr:
            return None
        if self._known is None or self._known[:2] != (grant_id, ptr):
            with contextlib.suppress(Exception):
                g = task_grant(handle, ViewScope())
                if g is not None and (g.id, g.ptr) == (grant_id, ptr):
                    self._known = (g.id, g.ptr, g.backend, g.device)
        known = self._known if self._known and self._known[:2] == (grant_id, ptr) else None
        return TaskGrant(grant_id, known[2] if known else None, ptr, size, None, scope,
                         known[3] if known else None)
