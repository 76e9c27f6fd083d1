"""torch.distributed.pipelining (torch >= 2.4): one bubble per point-to-point wait of a schedule.

Every schedule of that package waits for its batched sends and receives in one function,
``schedules._wait_batch_p2p(works)``; the adapter wraps it while installed, and wraps the
schedule's ``step()`` to mark iterations. Nothing else changes:

    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss)
    with bubble.Trainer(job, rank) as trainer, PipeliningBubbles(trainer, schedule):
        for batch in data:
            schedule.step(batch)            # each wait that really waits is a bubble

Works that already completed are not reported (no idle time to hand out). With NCCL, wait()
returns once the GPU stream waits, not when the data is there; the host-side bubble then ends
early. Use the NCCL profiler plugin (docs/FIND_MY_BUBBLES.md) for the device timeline.
"""
from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from ..trainer import Trainer
from ._common import PipelineSchedule, WaitReporter

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
        super().__init__(trainer, schedule_of(schedule), **kw)
        self._sched = schedule
        self._module = module
        self._saved: tuple[Any, Any] | None = None

    def install(self) -> None:
        if self._saved is not None:
            raise RuntimeError("PipeliningBubbles is already installed")
        mod = self._module or _schedules_module()
        orig_wait, orig_step = mod._wait_batch_p2p, self._sched.step
        reporter = self

        def _wait_batch_p2p(works, *args, **kwargs):
            # Only waits made inside our schedule's step() are ours; another schedule in the
            # process (or a module-level caller) passes straight through.
            if getattr(_active, "reporter", None) is not reporter or not _pending(works):
                return orig_wait(works, *args, **kwargs)
            with reporter.wait("p2p"):
                return orig_wait(works, *args, **kwargs)

        def step(*args, **kwargs):
            reporter.iteration()
            outer = getattr(_active, "reporter", None)
            _active.reporter = reporter
            try:
                return orig_step(*args, **kwargs)
            finally:
                _active.reporter = outer

        mod._wait_batch_p2p = _wait_batch_p2p
        self._sched.step = step
        self._saved = (mod, orig_wait)

    def uninstall(self) -> None:
        if self._saved is None:
            return
        mod, orig_wait = self._saved
        mod._wait_batch_p2p = orig_wait
        del self._sched.step  # the instance attribute; the class's method shows again
        self._saved = None

    def __enter__(self) -> "PipeliningBubbles":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def _pending(works: Any) -> bool:
    works = list(works.values()) if isinstance(works, dict) else list(works or [])
    flat = []
    for w in works:
        flat.extend(w if isinstance(w, (list, tuple)) else [w])
    return any(not (hasattr(w, "is_completed") and w.is_completed()) for w in flat)
