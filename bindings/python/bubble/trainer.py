"""The trainer side: a hub per rank, and the bubble markers a training loop calls."""
from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import threading
from dataclasses import dataclass, fields
from typing import Iterator

from . import _lib
from ._handle import SharedHandle
from ._lib import lib
from .errors import c_string, check
from .grant import (GrantBackend, GrantInfo, GrantStats, ViewScope, grant_info, grant_stats,
                    lend_options)


class BubbleKind(enum.IntEnum):
    OTHER = 0
    WARMUP = 1    # pipeline fill: before the stage's first forward
    STEADY = 2    # a wait on a point-to-point transfer in the steady state
    COOLDOWN = 3  # pipeline drain: after the stage's last backward


class ScheduleKind(enum.IntEnum):
    GPIPE = 0        # all forwards, then all backwards
    ONE_F_ONE_B = 1  # one forward, one backward (PipeDream-flush, Megatron)
    INTERLEAVED = 2  # interleaved 1F1B with `chunks` model chunks per stage
    ZBH1 = 3         # zero-bubble H1: backward split into input and weight parts


class ScheduleBubbles(enum.IntEnum):
    """What the trainer reports as one bubble, which fixes how bubbles are numbered."""
    IDLE = 0      # each idle interval of the stage in the schedule model
    RECEIVES = 1  # one per point-to-point receive, waited or not (as the adapters report)


@dataclass(frozen=True)
class TrainerStats:
    tasks_attached: int
    bubbles: int
    bubble_ns: int
    starts: int
    pauses: int
    wakes: int
    task_ns_in_bubbles: int
    task_ns_outside: int
    steps: int
    start_latency_p50_ns: int
    start_latency_p99_ns: int
    pause_latency_p50_ns: int
    pause_latency_p99_ns: int
    tasks_reclaimed: int
    tasks_bad: int
    events_dropped: int


@dataclass(frozen=True)
class TaskInfo:
    id: int
    slot: int
    name: str
    pid: int
    priority: int
    mem_need: int
    min_step_ns: int
    steps: int
    step_ns: int
    running: bool
    bad: bool
    ns_in_bubbles: int = 0  # its step time inside bubbles, from its reports
    ns_outside: int = 0     # its step time that spilled past bubbles' ends


def _ns(seconds: float | None) -> int:
    return 0 if seconds is None else max(0, int(seconds * 1e9))


class Trainer:
    """Owns the hub of one trainer rank. Close it (or use `with`) to stop its tasks.

    bubble_begin/bubble_end never wait on a side task; call them from the training loop's
    thread only.
    """

    def __init__(self, job_id: str, rank: int = 0, *, max_slots: int | None = None,
                 max_running: int | None = None, event_capacity: int | None = None,
                 runtime_dir: str | os.PathLike[str] | None = None,
                 allow_uid: int | None = None) -> None:
        self._handle: SharedHandle | None = None
        # Views of the lent memory (GrantInfo.memory), released before it is unmapped: closed
        # for the whole of an unlend, and for good once the trainer closes.
        self._lent_views = ViewScope(ViewScope.LENT_GONE)
        # Reentrant: close() from a signal handler may interrupt this thread inside it.
        self._views_lock = threading.RLock()
        self._views_final = False
        opts = _lib.TrainerOptions()
        lib.bb_trainer_options_init_sized(ctypes.byref(opts), ctypes.sizeof(opts))
        if max_slots is not None:
            opts.max_slots = max_slots
        if max_running is not None:
            opts.max_running = max_running
        if event_capacity is not None:
            opts.event_capacity = event_capacity
        if runtime_dir is not None:
            opts.runtime_dir = c_string("runtime dir", runtime_dir, path=True)
        if allow_uid is not None:
            opts.allow_uid = allow_uid
        job = c_string("job id", job_id)
        # Held before the call, which fills it in place: a KeyboardInterrupt raised as the call
        # returns (the GIL is given up inside it) still leaves the hub to close() or __del__.
        handle = ctypes.c_void_p()
        self._handle = SharedHandle(handle, "the trainer is closed; open a new Trainer")
        status = lib.bb_trainer_open(job, rank, ctypes.byref(opts), ctypes.byref(handle))
        if not handle.value:
            self._handle = None  # nothing was opened
        check(status)
        self.job_id = job_id
        self.rank = rank

    def _call(self, fn, *args) -> None:
        """One call on the hub, counted in flight: close() waits for it before it frees the hub,
        so a close on another thread never frees the handle under it (the GIL is given up in
        most calls, and between any two bytecodes); a close on this thread inside it (a signal
        handler's) leaves the free to it (see SharedHandle)."""
        self._handle.call(_checked, fn, *args)

    def close(self) -> None:
        """Stops every attached task and removes the hub, once the calls other threads have in
        flight have returned; calls made after it raise. Safe to call twice.

        Called on a thread that is itself inside a call on this trainer (a signal handler, say
        SIGTERM's, that interrupted bubble_begin), it cannot wait for that call: it returns at
        once, and the hub is removed when the interrupted call returns (raising from there if
        the removal fails)."""
        self._renew_views(final=True)  # the lent memory goes with the hub
        if self._handle is not None:
            self._handle.close(_close_hub)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A backstop only: a forgotten trainer must not leave its hub behind for the next run.
        handle = getattr(self, "_handle", None)
        if handle is not None and not handle.closed:
            with contextlib.suppress(Exception):
                self.close()

    def bubble_begin(self, expected: float | None = None, *, free_mem: int | None = None,
                     kind: BubbleKind = BubbleKind.OTHER) -> None:
        """A bubble starts now. expected: its length in seconds (None: predicted);
        free_mem: device bytes side tasks may use (None: unknown)."""
        self._call(lib.bb_bubble_begin, _ns(expected),
                                  _lib.MEM_UNKNOWN if free_mem is None else free_mem, int(kind))

    def bubble_end(self) -> None:
        self._call(lib.bb_bubble_end)

    @contextlib.contextmanager
    def bubble(self, expected: float | None = None, *, free_mem: int | None = None,
               kind: BubbleKind = BubbleKind.OTHER) -> Iterator[None]:
        """`with trainer.bubble(): wait()` marks the wait as a bubble, ended even on error."""
        self.bubble_begin(expected, free_mem=free_mem, kind=kind)
        try:
            yield
        finally:
            self.bubble_end()

    def iteration(self) -> None:
        """Marks the start of a training iteration (numbers bubbles for the predictor)."""
        self._call(lib.bb_trainer_iteration)

    def set_schedule(self, kind: ScheduleKind = ScheduleKind.ONE_F_ONE_B, *, stages: int,
                     microbatches: int, stage: int, fwd: float | None = None,
                     bwd: float | None = None, wgrad: float = 0.0, comm: float = 0.0,
                     chunks: int = 1, bubbles: ScheduleBubbles = ScheduleBubbles.IDLE) -> None:
        """Declares the pipeline schedule (times in seconds), so the predictor knows each
        bubble's length from the first iteration on. fwd and bwd None: the times are unknown
        and the library measures them from the compute between bubbles (wgrad and comm must
        stay 0 then). bubbles: what one bubble is (the numbering of bubble_begin calls in an
        iteration). Call it from the training loop's thread before an iteration. Raises
        InvalidArgument naming what the schedule model rejects."""
        if (fwd is None) != (bwd is None):
            raise ValueError("give both fwd and bwd, or neither (None: measure them)")
        sc = _lib.ScheduleC()
        lib.bb_schedule_init_sized(ctypes.byref(sc), ctypes.sizeof(sc))
        sc.kind = int(kind)
        sc.stages, sc.microbatches, sc.stage, sc.chunks = stages, microbatches, stage, chunks
        sc.fwd_ns, sc.bwd_ns = _ns(fwd), _ns(bwd)
        sc.wgrad_ns, sc.comm_ns = _ns(wgrad), _ns(comm)
        sc.bubbles = int(ScheduleBubbles(bubbles))
        self._call(lib.bb_trainer_set_schedule, ctypes.byref(sc))

    def stats(self) -> TrainerStats:
        out = _lib.TrainerStatsC(size=ctypes.sizeof(_lib.TrainerStatsC))
        self._call(lib.bb_trainer_stats, ctypes.byref(out))
        return TrainerStats(**{f.name: getattr(out, f.name) for f in fields(TrainerStats)})

    def tasks(self) -> list[TaskInfo]:
        """The tasks attached now."""
        count = ctypes.c_size_t(0)
        self._call(lib.bb_trainer_tasks, None, 0, ctypes.byref(count))
        while True:
            cap = count.value + 4  # room for tasks that attach between the two calls
            arr = (_lib.TaskInfoC * cap)()
            for item in arr:
                item.size = ctypes.sizeof(_lib.TaskInfoC)
            self._call(lib.bb_trainer_tasks, arr, cap, ctypes.byref(count))
            if count.value <= cap:
                return [_task_info(arr[i]) for i in range(count.value)]

    def stop_task(self, task: int | TaskInfo) -> None:
        """Tells one task to stop; it finishes and detaches."""
        task_id = task.id if isinstance(task, TaskInfo) else task
        self._call(lib.bb_trainer_stop_task, task_id)


    # ---- memory grants ---------------------------------------------------------------------

    def lend(self, size: int, *, backend: GrantBackend = GrantBackend.HOST,
             device_ptr: int | None = None, device: int = 0, max_grants: int | None = None,
             alignment: int | None = None, auto_grant: bool = True,
             clear_grants: bool = True) -> None:
        """Lends `size` bytes to the hub's tasks; one lent range at a time (Busy while one is
        lent: unlend() first to lend differently).

        auto_grant: grant each task that states a mem_need that much when it attaches.
        clear_grants: zero each CUDA grant on the device before a task gets it; turn it off
        only when every task belongs to one owner (a task then sees the previous holder's data).
        device_ptr (cuda-ipc): lend this range of your own allocation, kept alive until the hub
        closes or unlend() returns. Raises Unsupported for a CUDA backend without a usable CUDA
        driver."""
        opts = lend_options(size, backend, device_ptr, device, max_grants, alignment, auto_grant,
                            clear_grants)
        self._call(lib.bb_trainer_lend, ctypes.byref(opts))

    def unlend(self, timeout: float | None = None) -> None:
        """Takes every grant back and gives the lent memory back, so that lend() may lend again
        (another size or backend). A holder that has not given its grant back within `timeout`
        seconds (None: 1 s) is killed. Blocks until then, at most `timeout` + 2 s, so call it
        where the trainer can wait. Raises InvalidState when nothing is lent, and Timeout when a
        holder the kill cannot reach keeps the memory lent. The views GrantInfo.memory() gave
        are released first (touching one raises ValueError): the memory under them goes."""
        deadline = 0 if timeout is None else lib.bb_now_ns() + _ns(timeout)
        # Closed during the call too: a grant another thread looks up meanwhile is still in the
        # range being unmapped.
        self._renew_views(usable=False)
        try:
            self._call(lib.bb_trainer_unlend, deadline)
        finally:
            self._renew_views(usable=True)

    def _renew_views(self, usable: bool = False, final: bool = False) -> None:
        """Releases the views of the lent memory handed out so far and puts a new scope in
        place: usable, or closed (during an unlend, and for good once the trainer closes)."""
        fresh = ViewScope(ViewScope.LENT_GONE)
        with self._views_lock:
            self._views_final = self._views_final or final
            old, self._lent_views = self._lent_views, fresh
            # Decided after the swap: a close() that interrupted this (a signal handler on this
            # thread) and made the views final leaves no usable scope behind it.
            if not usable or self._views_final:
                fresh.close()
        old.close()

    def grant(self, task: int | TaskInfo, size: int | None = None) -> int:
        """Grants `size` bytes (None: the task's mem_need) to a task holding no grant; returns
        the grant's id. OutOfMemory when no free extent is large enough, Busy when the task
        already holds one."""
        grant_id = ctypes.c_uint64()
        self._call(lib.bb_trainer_grant, _task_id(task), size or 0,
                                   ctypes.byref(grant_id))
        return grant_id.value

    def revoke(self, task: int | TaskInfo, timeout: float | None = None) -> None:
        """Asks a task's grant back; a task that has not acked within `timeout` seconds
        (None: 1 s) is killed. Returns at once: task_grant() and grant_stats() show progress."""
        deadline = 0 if timeout is None else lib.bb_now_ns() + _ns(timeout)
        self._call(lib.bb_trainer_revoke, _task_id(task), deadline)

    def task_grant(self, task: int | TaskInfo) -> GrantInfo | None:
        """The task's grant, None when it holds none. Raises HubNotFound (a LookupError) when
        no such task is attached."""
        out = _lib.GrantInfoC(size=ctypes.sizeof(_lib.GrantInfoC))
        # The scope of before the call: an unlend that begins meanwhile closes it, and one that
        # ended before gave back every grant this call could name in its range.
        views = self._lent_views
        self._call(lib.bb_trainer_task_grant, _task_id(task), ctypes.byref(out))
        return grant_info(out, views)

    def read_grant(self, grant: int | GrantInfo, size: int | None = None, offset: int = 0,
                   into=None) -> bytes | None:
        """Copies a grant's bytes out: the safe way to read what its task wrote. The task may
        leave or die at any moment, which releases the grant, but never during the copy (the
        release waits for it), so this never touches memory already given back; a grant no
        longer live raises HubNotFound (a LookupError).

        `grant` is a GrantInfo (from task_grant()) or a grant id. `size` bytes are copied from
        `offset` into the grant (default: the rest of it, for a GrantInfo). With `into` None the
        bytes are returned; `into` may instead be a writable buffer (bytearray, memoryview, a
        NumPy array: its size is the default), or, for the CUDA backends, an int address of host
        or device memory of the lender's GPU (a CUDA tensor's data_ptr(), with `size`); the call
        then returns None. The copy runs on this thread; the hub's grants and releases wait for
        it, so copy what you need."""
        gid = grant.id if isinstance(grant, GrantInfo) else int(grant)
        if size is None:
            if into is not None and not isinstance(into, int):
                size = memoryview(into).nbytes
            elif isinstance(grant, GrantInfo):
                size = grant.bytes - offset
            else:
                raise ValueError("size is needed: pass the number of bytes to copy, or a "
                                 "GrantInfo from task_grant()")
        if size < 0 or offset < 0:
            raise ValueError(f"size {size} and offset {offset} must not be negative")
        if isinstance(into, int):
            if into == 0:
                raise ValueError("into is address 0: pass a buffer or a real address")
            self._call(lib.bb_trainer_read_grant, gid, offset, ctypes.c_void_p(into), size)
            return None
        if into is None:
            buf = (ctypes.c_ubyte * max(size, 1))()
            self._call(lib.bb_trainer_read_grant, gid, offset, buf, size)
            return bytes(memoryview(buf).cast("B")[:size])
        view = memoryview(into)
        if not view.c_contiguous:
            raise TypeError("into is not contiguous: pass a contiguous buffer")
        view = view.cast("B")
        if view.readonly:
            raise TypeError("into is read-only: pass a writable buffer")
        if view.nbytes == 0:  # nothing to copy: still says whether the grant is live
            self.read_grant(gid, 0, offset)
            return None
        if size > view.nbytes:
            raise ValueError(f"into holds {view.nbytes} bytes, fewer than the {size} asked for")
        dst = (ctypes.c_ubyte * max(view.nbytes, 1)).from_buffer(view)
        self._call(lib.bb_trainer_read_grant, gid, offset, dst, size)
        return None

    def grant_stats(self) -> GrantStats:
        out = _lib.GrantStatsC(size=ctypes.sizeof(_lib.GrantStatsC))
        self._call(lib.bb_trainer_grant_stats, ctypes.byref(out))
        return grant_stats(out)


def _checked(h: ctypes.c_void_p, fn, *args) -> None:
    check(fn(h, *args))  # inside the call: bb_last_error() is the failed call's


def _close_hub(h: ctypes.c_void_p) -> None:
    check(lib.bb_trainer_close(h))


def _task_id(task: int | TaskInfo) -> int:
    return task.id if isinstance(task, TaskInfo) else task


def _task_info(c: _lib.TaskInfoC) -> TaskInfo:
    return TaskInfo(id=c.id, slot=c.slot, name=c.name.decode(errors="replace"), pid=c.pid,
                    priority=c.priority, mem_need=c.mem_need, min_step_ns=c.min_step_ns,
                    steps=c.steps, step_ns=c.step_ns, running=bool(c.running), bad=bool(c.bad),
                    ns_in_bubbles=c.ns_in_bubbles, ns_outside=c.ns_outside)
