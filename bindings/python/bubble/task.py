"""The side-task side: attach to a hub, then either subclass SideTask (the runtime drives the
loop) or run your own loop with wait_start / should_pause / ack_pause."""
from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from . import _lib
from ._handle import SharedHandle
from ._lib import lib
from .errors import BubbleError, CallbackFailed, InvalidState, Status, c_string, check, error_for
from .grant import GrantLookup, TaskGrant, ViewScope, task_grant
from .trainer import BubbleKind, _checked


@dataclass(frozen=True)
class StartInfo:
    """Why the task was started: the bubble it runs in."""
    bubble_seq: int
    kind: BubbleKind
    begin_ns: int
    deadline_ns: int  # 0 if unknown
    free_mem: int | None  # None if unknown
    grant: TaskGrant | None = None  # the memory grant held in this run


@dataclass(frozen=True)
class StepInfo:
    bubble_seq: int
    kind: BubbleKind
    deadline_ns: int  # 0 if unknown
    time_left_ns: int | None  # None if unknown
    est_step_ns: int  # 0 before the first step
    free_mem: int | None
    # The memory grant for this step; its memoryview is released when the step returns.
    grant: TaskGrant | None = None


class Outcome(enum.Enum):
    """How Task.run ended when nothing failed."""
    FINISHED = "finished"          # step() said the work is done
    STOPPED = "stopped"            # the trainer (or agent) told the task to stop
    TRAINER_GONE = "trainer_gone"  # the trainer closed its hub or exited


class OnTrainerExit(enum.IntEnum):
    RETURN = 0  # calls end with TrainerGone
    WAIT = 1    # wait for the trainer to reopen the hub, then re-attach


class WakeMode(enum.IntEnum):
    """How a task waits for its next start."""
    PREDICTIVE = 0  # sleep, and spin from wake_lead before the predicted next bubble
    SLEEP = 1       # spin briefly, then sleep: least CPU, a wake-up's latency
    SPIN = 2        # spin all the time: lowest latency, a whole core


class SideTask:
    """Subclass and override step() (and any of the others); pass an instance to Task.run.

    step() returns True once the work is finished; anything else means "more to do". The
    runtime calls it only inside bubbles, while the measured step time fits. idle() is called
    about every 100 ms while the task waits for a bubble; True from it ends the run as
    finished too (a shutdown asked of the task). An exception in any method ends the run: the
    task reports FAILED and Task.run re-raises the exception.
    """

    def init(self) -> None: ...
    def step(self, info: StepInfo) -> bool | None: raise NotImplementedError
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def finish(self, status: Status) -> None: ...
    def idle(self) -> bool | None: ...


class _SigintGate:
    """Ctrl-C while Task.run is inside the runtime.

    Python runs a signal's handler where it next runs bytecode: here that is the entry of the
    next callback, before any try in it, and an exception leaving a ctypes callback can only be
    printed, not raised. So while run() is in C (on the main thread, with Python's default
    SIGINT handler) the signal is noted instead, and raised only inside a callback's body, where
    it ends the run like any other exception: finish() runs and run() re-raises it. The
    runtime comes back to Python while it waits (the idle callback), so this happens within
    about 100 ms, in a bubble or not."""

    def __init__(self) -> None:
        self.hit = False
        self.in_body = False
        self._old = None

    def __enter__(self) -> "_SigintGate":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    @property
    def active(self) -> bool:
        return self._old is not None

    def _handler(self, signum, frame) -> None:
        self.hit = True
        if self.in_body:
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


# The runs in progress, by thread: what _lost_hook takes exceptions into (see below). One hook
# for all of them, installed while any runs: runs on several threads at once come and go in any
# order, and a hook each, chained, could not all be taken out again.
_lost_mu = threading.Lock()
_lost_runs: dict[int, list[tuple[tuple, list]]] = {}
_lost_prev = None


def _from_callback(unraisable, callbacks: tuple) -> bool:
    if any(unraisable.object is c for c in callbacks):
        return True
    # Python 3.13 on names the callback in the message and passes no object.
    msg = getattr(unraisable, "err_msg", None) or ""
    return (unraisable.object is None and "ctypes callback" in msg
            and any(repr(c) in msg for c in callbacks))


def _lost_hook(unraisable) -> None:
    for callbacks, sink in _lost_runs.get(threading.get_ident(), ()):
        if unraisable.exc_value is not None and _from_callback(unraisable, callbacks):
            sink.append(unraisable.exc_value)
            return
    (_lost_prev or sys.__unraisablehook__)(unraisable)


class _LostCallbackErrors:
    """Exceptions raised at the entry of one of run()'s callbacks, before any try in it: by a
    signal handler (Python runs one where it next runs bytecode, here a callback's first line)
    such as a SIGTERM handler that calls sys.exit. ctypes cannot let an exception leave a
    callback: it hands it to sys.unraisablehook and the callback returns 0. While run() is in C,
    the hook takes those of its own callbacks, raised on its thread, into `sink`, so they end
    the run like any other exception (finish() runs, and run() re-raises it); anything else goes
    on to the hook that was there before."""

    def __init__(self, callbacks: tuple, sink: list[BaseException]) -> None:
        self._entry = (callbacks, sink)
        self._thread = threading.get_ident()

    def __enter__(self) -> "_LostCallbackErrors":
        global _lost_prev
        with _lost_mu:
            if not _lost_runs:
                _lost_prev = sys.unraisablehook
                sys.unraisablehook = _lost_hook
            _lost_runs.setdefault(self._thread, []).append(self._entry)
        return self

    def __exit__(self, *exc: object) -> None:
        global _lost_prev
        with _lost_mu:
            mine = _lost_runs.get(self._thread, [])
            for k, entry in enumerate(mine):
                if entry is self._entry:  # this run's (another may hold equal lists)
                    del mine[k]
                    break
            if not mine:
                _lost_runs.pop(self._thread, None)
            if not _lost_runs:
                # Someone may have put their own hook in meanwhile: theirs stays.
                if sys.unraisablehook is _lost_hook:
                    sys.unraisablehook = _lost_prev
                _lost_prev = None


def _unknown_none(value: int) -> int | None:
    return None if value == _lib.UINT64_MAX else value


class Task:
    """A side task's attachment to one hub. Belongs to one thread at a time; only detach() may
    also come from another thread, or from a callback or signal handler inside a call (see
    there)."""

    def __init__(self, job_id: str, rank: int, name: str, *, priority: int = 0,
                 mem_need: int = 0, min_step_ns: int = 0,
                 on_trainer_exit: OnTrainerExit = OnTrainerExit.RETURN,
                 reattach_timeout: float | None = None, spin_ns: int | None = None,
                 wake_mode: WakeMode = WakeMode.PREDICTIVE, wake_lead_ns: int | None = None,
                 runtime_dir: str | os.PathLike[str] | None = None) -> None:
        opts = _lib.TaskOptions()
        lib.bb_task_options_init_sized(ctypes.byref(opts), ctypes.sizeof(opts))
        opts.priority = priority
        opts.mem_need = mem_need
        opts.min_step_ns = min_step_ns
        opts.on_trainer_exit = int(on_trainer_exit)
        if reattach_timeout is not None:
            opts.reattach_timeout_ns = int(reattach_timeout * 1e9)
        if spin_ns is not None:
            opts.spin_ns = spin_ns
        opts.wake_mode = int(wake_mode)
        if wake_lead_ns is not None:
            opts.wake_lead_ns = wake_lead_ns
        if runtime_dir is not None:
            opts.runtime_dir = c_string("runtime dir", runtime_dir, path=True)
        job, cname = c_string("job id", job_id), c_string("task name", name)
        self.name = name
        self._scope = ViewScope()  # views of grant mappings, until a call that may unmap them
        self._lookup = GrantLookup()
        self._run_thread: int | None = None  # the thread inside this task's run(), if any
        # Every call goes through it, counted in flight: detach() frees the handle only once no
        # call uses it. Held before the attach, which fills it in place: a KeyboardInterrupt
        # raised as the attach returns still leaves the slot to detach() or __del__ (a slot
        # left attached would hold its grant until the trainer killed this process for it).
        handle = ctypes.c_void_p()
        self._handle = SharedHandle(handle, "the task is detached; attach a new Task")
        status = lib.bb_task_attach(job, rank, cname, ctypes.byref(opts), ctypes.byref(handle))
        if not handle.value:
            self._handle = None  # nothing was attached
        check(status)

    def _unmapping(self) -> None:
        """Before a call that may unmap the grant: views of it stop working."""
        self._scope.close()
        self._scope = ViewScope()

    def detach(self) -> None:
        """Acks any pending pause and releases the slot. Safe to call twice.

        From another thread while this task is inside a call, it waits for the call to return
        (and later calls raise ValueError): wait_start() returns within 100 ms, raising
        ValueError, but run() only when its run ends (finished, stopped, the trainer gone), so
        end the run first. From a SideTask method or a signal handler inside a call on this
        thread, it returns at once and the slot is released when that call returns."""
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close(self._detach_now)

    close = detach

    def _detach_now(self, h: ctypes.c_void_p) -> None:
        self._unmapping_call(h, lib.bb_task_detach)

    def _unmapping_call(self, h: ctypes.c_void_p, fn) -> None:
        """A call that may unmap the grant: views of it stop working first. Inside this task's
        own run() on this thread the runtime refuses the call (InvalidState) and unmaps nothing,
        so the views a SideTask method took stay usable for the rest of that method."""
        if self._run_thread == threading.get_ident():
            status = fn(h)
            if status == Status.OK:  # not expected: the runtime refuses these inside a run
                self._unmapping()
            check(status)
            return
        self._unmapping()
        check(fn(h))

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and not handle.closed:
            with contextlib.suppress(Exception):
                self.detach()

    # ---- iterative -------------------------------------------------------------------------

    def run(self, side_task: SideTask) -> Outcome:
        """Hands the loop to the runtime until the work is done, the task is stopped or the
        trainer leaves. Re-raises whatever a SideTask method raised, and KeyboardInterrupt on
        Ctrl-C (after finish() ran), also while the task waits for a bubble."""
        if self._run_thread == threading.get_ident():
            # Before anything: a nested run would close the outer method's grant views and end
            # with the outer run's marker cleared (the runtime refuses it anyway).
            raise InvalidState("run() inside this task's own run(): return from the SideTask "
                               "method instead")
        raised: list[BaseException] = []
        gate = _SigintGate()

        def interrupted() -> bool:
            # After a method raised, the runtime is ending the run: only finish is still called
            # (always), so its cleanup runs; what raised first is what run re-raises.
            if gate.hit and not raised:
                raised.append(KeyboardInterrupt())
            return bool(raised)

        def guard(fn, *args, always: bool = False) -> int:
            if interrupted() and not always:
                return -1
            try:
                gate.in_body = True
                result = fn(*args)
                gate.in_body = False
                return result
            except BaseException as exc:  # noqa: BLE001 - carried across C and re-raised
                gate.in_body = False
                raised.append(exc)
                return -1
            finally:
                # Between two callbacks the runtime may unmap a revoked grant: views taken with
                # grant() in this one go with it, as a step's own grant view does.
                self._unmapping()

        def call(fn) -> int:
            fn()
            return 0

        def step(_user, info_p) -> int:
            if interrupted():
                return -1
            c = info_p.contents
            scope = ViewScope()

            def body() -> int:
                grant = self._lookup(handle, c.grant_id, c.grant_ptr, c.grant_bytes, scope)
                info = StepInfo(c.bubble_seq,
                                BubbleKind(c.kind) if c.kind < 4 else BubbleKind.OTHER,
                                c.deadline_ns, _unknown_none(c.time_left_ns), c.est_step_ns,
                                _unknown_none(c.free_mem), grant)
                return _lib.STEP_DONE if side_task.step(info) is True else _lib.STEP_CONTINUE

            try:
                return guard(body)
            finally:
                scope.close()  # a revoked grant is unmapped between steps

        own_idle = getattr(type(side_task), "idle", SideTask.idle) is not SideTask.idle

        def idle(_user) -> int:
            return guard(lambda: _lib.STEP_DONE if own_idle and side_task.idle() is True else 0)

        def finish(_user, status) -> None:
            with contextlib.suppress(ValueError):
                status = Status(status)
            guard(call, lambda: side_task.finish(status), always=True)

        def init(_user) -> int:
            return guard(call, side_task.init)

        def pause(_user) -> int:
            return guard(call, side_task.pause)

        def resume(_user) -> int:
            return guard(call, side_task.resume)

        # The CFUNCTYPE objects must outlive bb_task_run: they are held in locals until it returns.
        cbs = _lib.TaskCallbacks()
        lib.bb_task_callbacks_init_sized(ctypes.byref(cbs), ctypes.sizeof(cbs))
        cbs.init = _lib.INIT_FN(init)
        cbs.step = _lib.STEP_FN(step)
        cbs.pause = _lib.INIT_FN(pause)
        cbs.resume = _lib.INIT_FN(resume)
        cbs.finish = _lib.FINISH_FN(finish)
        lost = _LostCallbackErrors((init, step, pause, resume, finish, idle), raised)
        handle: ctypes.c_void_p | None = None  # for step(): the handle the run is on

        def run(h: ctypes.c_void_p) -> int:
            nonlocal handle
            handle = h
            self._unmapping()
            with gate, lost:
                # An idle call is a trip into Python (and for the GIL) every 100 ms: made only
                # when something listens, the SIGINT gate or a SideTask's own idle().
                if gate.active or own_idle:
                    cbs.idle = _lib.INIT_FN(idle)
                self._run_thread = threading.get_ident()
                try:
                    st = lib.bb_task_run(h, ctypes.byref(cbs))
                finally:
                    self._run_thread = None
                # The error read inside the call: a detach left pending until the call returns
                # would overwrite bb_last_error() once it has.
                plain = (Status.OK, Status.E_STOPPED, Status.E_TRAINER_GONE, Status.E_CALLBACK)
                return st, (None if st in plain else error_for(st))
        status, failure = self._handle.call(run)
        interrupted()  # a Ctrl-C no callback saw (the run ended first) is not lost either
        if raised:
            raise raised[0]
        if status == Status.OK:
            return Outcome.FINISHED
        if status == Status.E_STOPPED:
            return Outcome.STOPPED
        if status == Status.E_TRAINER_GONE:
            return Outcome.TRAINER_GONE
        if status == Status.E_CALLBACK:
            raise CallbackFailed("a side-task callback reported failure")
        raise failure

    # ---- imperative ------------------------------------------------------------------------

    def wait_start(self, timeout: float | None = None) -> StartInfo | None:
        """Blocks until the trainer starts this task in a bubble; None after `timeout` seconds.
        Raises Stopped when told to stop and TrainerGone when the trainer left (and ValueError
        within 100 ms of a detach() on another thread)."""
        return self._handle.call(self._wait_start, timeout)

    def _wait_start(self, handle: ctypes.c_void_p, timeout: float | None) -> StartInfo | None:
        out = _lib.StartInfoC(size=ctypes.sizeof(_lib.StartInfoC))
        if self._run_thread == threading.get_ident():  # refused inside a run: unmaps nothing
            check(lib.bb_task_wait_start(handle, 0, ctypes.byref(out)))
        self._unmapping()
        # In slices of at most 100 ms: Python raises a Ctrl-C's KeyboardInterrupt only once the
        # call returns.
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            left = _lib.TASK_IDLE_NS if deadline is None else min(
                _lib.TASK_IDLE_NS, max(0, int((deadline - time.monotonic()) * 1e9)))
            status = lib.bb_task_wait_start(handle, left, ctypes.byref(out))
            if status != Status.E_TIMEOUT or (deadline is not None
                                              and time.monotonic() >= deadline):
                break
            if self._handle.closed:  # detach() on another thread waits for this call to return
                raise ValueError("the task is detached; attach a new Task")
        if status == Status.E_TIMEOUT:
            return None
        check(status)
        grant = self._lookup(handle, out.grant_id, out.grant_ptr, out.grant_bytes, self._scope)
        return StartInfo(out.bubble_seq, BubbleKind(out.kind) if out.kind < 4 else BubbleKind.OTHER,
                         out.begin_ns, out.deadline_ns, _unknown_none(out.free_mem), grant)

    def should_pause(self) -> bool:
        """True once the bubble ended or the task was told to stop. One shared-memory load."""
        return self._handle.call(lib.bb_task_should_pause) != 0

    def ack_pause(self) -> None:
        """The task stopped its device work for this bubble (and gives back a grant being
        revoked)."""
        self._handle.call(self._unmapping_call, lib.bb_task_ack_pause)

    def grant(self) -> TaskGrant | None:
        """The grant this task maps now (mapping one just offered); None when it holds none.
        Raises Unsupported (once) for a CUDA grant in a process without a CUDA driver."""
        return self._handle.call(self._grant)

    def _grant(self, h: ctypes.c_void_p) -> TaskGrant | None:
        self._unmapping()
        return task_grant(h, self._scope)

    def ack_revoke(self) -> None:
        """If the trainer is revoking this task's grant: unmaps it and acks; otherwise nothing.
        Stop all use of the grant first."""
        self._handle.call(self._unmapping_call, lib.bb_task_ack_revoke)

    def report_step(self, step_ns: int) -> None:
        self._handle.call(_checked, lib.bb_task_report_step, step_ns)

    def time_left(self) -> tuple[int | None, int]:
        """(ns left in the current bubble or None if unknown, estimated step ns)."""
        left, est = ctypes.c_uint64(), ctypes.c_uint64()
        self._handle.call(_checked, lib.bb_task_time_left, ctypes.byref(left), ctypes.byref(est))
        return _unknown_none(left.value), est.value

    def bubbles(self) -> Iterator[StartInfo]:
        """`for start in task.bubbles(): ...` runs the body once per bubble and acks the pause
        after it; the loop ends when the task is told to stop. A body that leaves the loop
        (break, return, an exception) acks its bubble too, so the trainer is not left waiting
        for it (and a grant being revoked is given back)."""
        while True:
            try:
                start = self.wait_start()
            except BubbleError as exc:
                if exc.status == Status.E_STOPPED:
                    return
                raise
            assert start is not None
            try:
                yield start
            except BaseException:
                try:
                    self.ack_pause()
                except BubbleError:
                    pass  # what ended the loop is the error worth reporting
                raise
            self.ack_pause()
