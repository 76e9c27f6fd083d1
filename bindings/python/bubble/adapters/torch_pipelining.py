"""torch.distributed.pipelining (torch >= 2.4): one bubble per point-to-point receive of a schedule.

Every schedule of that package batches its sends and receives with ``schedules._batch_p2p(ops,
desc)`` and waits for them in ``schedules._wait_batch_p2p(works)``; the adapter wraps both while
installed, and wraps the schedule's ``step()`` to mark iterations. Nothing else changes:

    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss)
    with bubble.Trainer(job, rank) as trainer, PipeliningBubbles(trainer, schedule):
        for batch in data:
            schedule.step(batch)            # each wait for a receive is a bubble

On install the adapter publishes the schedule it read from the schedule object (kind, stages,
this stage, micro-batches, chunks) to the predictor, one bubble per receive with the times
measured (WaitReporter), so deadlines are predicted from the first iteration on. To keep the
numbering in step with the schedule, every wait for a batch that holds a receive is a bubble,
even one whose data is already there (a bubble of a few microseconds), and waits for sends
alone are not. A module without ``_batch_p2p`` (an older torch) cannot tell sends from
receives: there the adapter reports every wait that really waits and publishes nothing.

With NCCL, wait() returns once the GPU stream waits, not when the data is there; the host-side
bubble then ends early. Use the NCCL profiler plugin (docs/FIND_MY_BUBBLES.md) for the device
timeline.
"""
from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from ..trainer import Trainer
from ._common import PipelineSchedule, WaitReporter, _live

_active = threading.local()


def _schedules_module() -> ModuleType:
    try:
        from torch.distributed.pipelining import schedules
    except ImportError as exc:
        import torch
        raise ImportError(
            f"torch {torch.__version__} has no torch.distributed.pipelining (it came with torch "
            "2.4): upgrade torch, or report waits with bubble.torch_hooks.P2PBubbles") from exc
    return schedules


def schedule_of(schedule: Any) -> PipelineSchedule:
    """Reads stages, this stage and micro-batches from a pipelining schedule object."""
    n = int(schedule._n_microbatches)
    stages = getattr(schedule, "_stages", None)
    if stages:  # a multi-stage (virtual pipeline) schedule: this rank holds several stages
        first = stages[0]
        chunks = len(stages)
        groups = int(getattr(schedule, "pp_group_size", first.num_stages // chunks))
        return PipelineSchedule(stages=groups, stage=first.stage_index % groups,
                                micro_batches=n, kind="interleaved" if chunks > 1 else "1f1b",
                                chunks=chunks)
    st = schedule._stage
    kind = "gpipe" if type(schedule).__name__ == "ScheduleGPipe" else "1f1b"
    return PipelineSchedule(stages=int(st.num_stages), stage=int(st.stage_index),
                            micro_batches=n, kind=kind)


class PipeliningBubbles(WaitReporter):
    """Reports the waits of one pipelining schedule object as bubbles while installed.

    module: the schedules module to patch (defaults to torch's; tests pass a stand-in)."""

    def __init__(self, trainer: Trainer, schedule: Any, *, module: ModuleType | None = None,
                 **kw: Any) -> None:
        super().__init__(trainer, schedule_of(schedule), publish=False, **kw)
        self._sched = schedule
        self._module = module
        self._saved: tuple[Any, Any, Any] | None = None
        # Work batches of the running step() that hold a receive, by id (the batch is kept so
        # its id cannot be reused before it is waited for).
        self._receiving: dict[int, Any] = {}

    def install(self) -> None:
        if self._saved is not None:
            raise RuntimeError("PipeliningBubbles is already installed")
        mod = self._module or _schedules_module()
        orig_wait, orig_step = mod._wait_batch_p2p, self._sched.step
        orig_batch = getattr(mod, "_batch_p2p", None)
        if orig_batch is not None and not self.published:
            # Before anything is patched: when it raises (a closed trainer, say), nothing is
            # left installed, and install() may be called again.
            self.publish_schedule()
        reporter = self

        def ours() -> bool:
            # Only calls made inside our schedule's step() are ours; another schedule in the
            # process (or a module-level caller) passes straight through.
            return getattr(_active, "reporter", None) is reporter

        def _batch_p2p(ops, *args, **kwargs):
            works = orig_batch(ops, *args, **kwargs)
            if ours() and _receives(ops, args, kwargs):
                reporter._receiving[id(works)] = works
            return works

        def _wait_batch_p2p(works, *args, **kwargs):
            if not ours():
                return orig_wait(works, *args, **kwargs)
            if orig_batch is not None:
                if reporter._receiving.pop(id(works), None) is None:  # sends only
                    return orig_wait(works, *args, **kwargs)
            elif not _pending(works):
                return orig_wait(works, *args, **kwargs)
            with reporter.wait("p2p"):
                return orig_wait(works, *args, **kwargs)

        def step(*args, **kwargs):
            reporter.iteration()
            reporter._receiving.clear()
            outer = getattr(_active, "reporter", None)
            _active.reporter = reporter
            try:
                return orig_step(*args, **kwargs)
            finally:
                _active.reporter = outer
                reporter._receiving.clear()

        # Marked as ours, so that an instance installed on top of this one and uninstalled after
        # it puts back what lies under them, not these (see _live).
        for wrapper, inner in ((_wait_batch_p2p, orig_wait), (_batch_p2p, orig_batch)):
            wrapper._bubble_owner = self  # type: ignore[attr-defined]
            wrapper._bubble_inner = inner  # type: ignore[attr-defined]
        mod._wait_batch_p2p = _wait_batch_p2p
        if orig_batch is not None:
            mod._batch_p2p = _batch_p2p
        self._sched.step = step
        self._saved = (mod, orig_wait, orig_batch)
        self._wrappers = (_wait_batch_p2p, _batch_p2p)

    def uninstall(self) -> None:
        """Puts back what install() found, less the wrappers of instances uninstalled since.
        Uninstalled while a later instance's wrappers sit on top of its own, it leaves them there
        (its own pass everything through from then on: its step() is gone), and that instance's
        uninstall skips them."""
        if self._saved is None:
            return
        (mod, orig_wait, orig_batch), self._saved = self._saved, None
        wait_wrapper, batch_wrapper = self._wrappers
        if mod._wait_batch_p2p is wait_wrapper:
            mod._wait_batch_p2p = _live(orig_wait)
        if orig_batch is not None and getattr(mod, "_batch_p2p", None) is batch_wrapper:
            mod._batch_p2p = _live(orig_batch)
        del self._sched.step  # the instance attribute; the class's method shows again

    def __enter__(self) -> "PipeliningBubbles":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def _receives(ops: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a batch of P2POps holds a receive: by its description ("fwd_recv",
    "bwd_send_fwd_recv", ...) where the caller gives one, else by the ops' functions."""
    desc = kwargs.get("desc", args[0] if args else None)
    if isinstance(desc, str):
        return "recv" in desc
    return any(getattr(getattr(op, "op", None), "__name__", "") in ("irecv", "recv")
               for op in ops or [])


def _pending(works: Any) -> bool:
    works = list(works.values()) if isinstance(works, dict) else list(works or [])
    flat = []
    for w in works:
        flat.extend(w if isinstance(w, (list, tuple)) else [w])
    return any(not (hasattr(w, "is_completed") and w.is_completed()) for w in flat)
