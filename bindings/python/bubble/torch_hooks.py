"""Reports the waits of torch.distributed point-to-point receives as bubbles.

A pipeline stage spends its bubbles blocked in a receive: the activations of the previous
stage or the gradients of the next one have not arrived yet. P2PBubbles wraps
torch.distributed.recv, irecv and batch_isend_irecv (the Works' wait()) so that every receive
that really has to wait becomes a bubble on the stage's Trainer; the model and the schedule stay
unchanged:

    with bubble.Trainer(job, rank) as trainer, P2PBubbles(trainer) as hooks:
        for it in range(iterations):
            hooks.iteration()
            run_1f1b_schedule(...)          # calls dist.recv / dist.irecv as usual

Only code that calls them as torch.distributed.recv/irecv/batch_isend_irecv is covered; a name
imported with `from torch.distributed import recv` before install() keeps the unwrapped function.
A batch (batch_isend_irecv) with at least one receive is one receive of the schedule: with a
schedule published, the first wait() on one of its receives' Works is its bubble (or on the
batch's one Work, where torch returns one for the whole batch); without one, every such wait()
that has to wait is a bubble, as for irecv. Sends' Works, and a batch of sends only, are passed
through.

Given the schedule (schedule=PipelineSchedule(stages, stage, micro_batches)), P2PBubbles
publishes it to the predictor, one bubble per receive with the times measured by the library,
so deadlines are predicted from the first iteration on; every receive is then a bubble, also
one whose data is already there, so the numbering stays the schedule's. Receives the schedule
does not know (a loss sent back after the iteration) belong after its last receive.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch.distributed as dist

from . import now_ns
from .adapters._common import PipelineSchedule, _live, publish_schedule, report
from .trainer import BubbleKind, Trainer


@dataclass(frozen=True)
class BubbleRecord:
    seq: int          # the hub's bubble number (the n-th bubble begun on this trainer)
    kind: BubbleKind
    begin_ns: int     # just before bb_bubble_begin, CLOCK_MONOTONIC
    end_ns: int       # just after bb_bubble_end


class _BubbleWork:
    """An irecv Work whose wait() is reported as a bubble; everything else is passed through."""

    def __init__(self, work: Any, hooks: "P2PBubbles") -> None:
        self._work = work
        self._hooks = hooks

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._hooks._wait(self._work, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Batch:
    """One batch_isend_irecv with a receive: whether its bubble (the first wait()) is still to
    come, for a published schedule, which counts the batch as one receive."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = True


class _BatchWork(_BubbleWork):
    """A Work of a batch with a receive (torch returns one per op, or one for the batch)."""

    def __init__(self, work: Any, hooks: "P2PBubbles", batch: _Batch) -> None:
        super().__init__(work, hooks)
        self._batch = batch

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self._hooks.published:
            if not self._batch.pending:  # the batch's one position is taken
                return self._work.wait(*args, **kwargs)
            self._batch.pending = False
        return self._hooks._wait(self._work, *args, **kwargs)


def _unwrap(op: Any) -> Any:
    """torch's own function under any P2PBubbles wrappers of it."""
    while getattr(op, "_bubble_inner", None) is not None:
        op = op._bubble_inner
    return op


def _torch_op(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """P2POp's arguments with its op (first, or op=) unwrapped to torch's own function."""
    if args:
        return (_unwrap(args[0]), *args[1:]), kwargs
    if "op" in kwargs:
        return args, {**kwargs, "op": _unwrap(kwargs["op"])}
    return args, kwargs


class P2PBubbles:
    """Wraps torch.distributed.recv/irecv/batch_isend_irecv while installed (use it as a
    context manager).

    expected: the bubble length to announce in seconds (None: the library predicts it from
    the same bubble of earlier iterations, numbered from each iteration() call).
    record: keep a BubbleRecord per bubble in `records` (for tests and traces).
    schedule: the pipeline schedule this stage runs, published to the predictor (`published`
    says whether the model took it); None publishes nothing and reports only waits that wait.
    """

    def __init__(self, trainer: Trainer, *, expected: float | None = None,
                 free_mem: int | None = None, record: bool = False,
                 schedule: PipelineSchedule | None = None) -> None:
        self.trainer = trainer
        self.expected = expected
        self.free_mem = free_mem
        self.kind = BubbleKind.STEADY
        self.records: list[BubbleRecord] | None = [] if record else None
        self.bubbles = 0
        # Reports the trainer refused (closed by a signal handler, say): counted, never raised
        # into the receive they wrap.
        self.report_errors = 0
        self.last_report_error: Exception | None = None
        self._saved: dict[str, Any] | None = None
        self._wrappers: dict[str, Any] = {}
        self.schedule = schedule
        self.published = schedule is not None and publish_schedule(trainer, schedule)

    # ---- installation -----------------------------------------------------------------------

    def install(self) -> None:
        if self._saved is not None:
            raise RuntimeError("P2PBubbles is already installed")
        saved = {"recv": dist.recv, "irecv": dist.irecv, "P2POp": dist.P2POp,
                 "batch_isend_irecv": dist.batch_isend_irecv}
        orig_recv, orig_irecv = saved["recv"], saved["irecv"]
        orig_batch = saved["batch_isend_irecv"]
        torch_irecv = _unwrap(orig_irecv)

        # **kw: what a newer torch takes besides (group_src, since 2.6), passed on as given.
        def recv(tensor, src=None, group=None, tag=0, **kw):
            if self._saved is None:  # uninstalled under a later instance's wrappers
                return orig_recv(tensor, src, group, tag, **kw)
            if src is None or kw:
                # Receive-from-any has no irecv form, and with a newer torch's arguments what
                # recv returns is torch's to work out: report the whole call.
                with self._bubble():
                    return orig_recv(tensor, src, group, tag, **kw)
            work = orig_irecv(tensor, src, group, tag)
            if work is None:  # this rank is not in the group, as dist.recv reports it
                return -1
            self._wait(work)
            return src

        def irecv(tensor, src=None, group=None, tag=0, **kw):
            work = orig_irecv(tensor, src, group, tag, **kw)
            if self._saved is None or work is None:
                return work
            return _BubbleWork(work, self)

        def batch_isend_irecv(p2p_op_list):
            works = orig_batch(p2p_op_list)
            receives = [_unwrap(getattr(op, "op", None)) is torch_irecv for op in p2p_op_list]
            if self._saved is None or not works or not any(receives):
                return works
            batch = _Batch()
            # One Work per op: only the receives' waits are the batch's (a send's wait, first in
            # Megatron's order, is no bubble); one Work for the whole batch: that one.
            per_op = len(works) == len(receives)
            return [w if w is None or (per_op and not receives[i]) else _BatchWork(w, self, batch)
                    for i, w in enumerate(works)]

        class P2POp(saved["P2POp"]):
            """torch's P2POp, given torch's own irecv for this wrapper of it: torch checks that
            the op is one of its own (batch_isend_irecv, wrapped too, reports the receive)."""

            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                args, kwargs = _torch_op(args, kwargs)
                return super().__new__(cls, *args, **kwargs)

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                args, kwargs = _torch_op(args, kwargs)
                super().__init__(*args, **kwargs)

        wrappers = {"recv": recv, "irecv": irecv, "P2POp": P2POp,
                    "batch_isend_irecv": batch_isend_irecv}
        for name, wrapper in wrappers.items():
            wrapper._bubble_inner = saved[name]  # type: ignore[attr-defined]
            wrapper._bubble_owner = self  # type: ignore[attr-defined]
        self._saved = saved
        self._wrappers = wrappers
        for name, wrapper in wrappers.items():
            setattr(dist, name, wrapper)

    def uninstall(self) -> None:
        """Puts back what install() found, less the wrappers of instances uninstalled since.
        Uninstalled while a later instance's wrappers sit on top of its own, it leaves them
        there (its own pass everything through from then on), and that instance's uninstall
        skips them."""
        if self._saved is None:
            return
        saved, self._saved = self._saved, None
        for name, wrapper in self._wrappers.items():
            if getattr(dist, name) is wrapper:
                setattr(dist, name, _live(saved[name]))

    def __enter__(self) -> "P2PBubbles":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ---- schedule annotations ----------------------------------------------------------------

    def iteration(self) -> None:
        """Marks the start of a training iteration (bubbles are predicted per position). A
        refusal is counted in report_errors, not raised."""
        report(self, self.trainer.iteration)

    @contextlib.contextmanager
    def phase(self, kind: BubbleKind) -> Iterator[None]:
        """Waits inside this block are reported as bubbles of `kind` (warm-up, cool-down)."""
        saved, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = saved

    # ---- the hook ---------------------------------------------------------------------------

    def _wait(self, work: Any, *args: Any, **kwargs: Any) -> Any:
        # Data already here means no idle time to hand out, but a published schedule numbers
        # every receive: skipping one would shift the rest of the iteration.
        if not self.published and work.is_completed():
            return work.wait(*args, **kwargs)
        with self._bubble():
            return work.wait(*args, **kwargs)

    @contextlib.contextmanager
    def _bubble(self) -> Iterator[None]:
        kind = self.kind
        begin = now_ns()
        if not report(self, self.trainer.bubble_begin, self.expected, free_mem=self.free_mem,
                      kind=kind):
            yield  # the receive goes on without a bubble
            return
        self.bubbles += 1
        try:
            yield
        finally:
            report(self, self.trainer.bubble_end)
            if self.records is not None:
                self.records.append(BubbleRecord(self.bubbles, kind, begin, now_ns()))
