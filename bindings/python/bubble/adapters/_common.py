"""What every adapter shares: the schedule it publishes and the bubble it opens per wait."""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Iterator

from .. import now_ns
from ..errors import BubbleError, InvalidArgument
from ..trainer import BubbleKind, ScheduleBubbles, ScheduleKind, Trainer

_KINDS = ("gpipe", "1f1b", "interleaved", "zbh1")
_SCHEDULE_KINDS = {"gpipe": ScheduleKind.GPIPE, "1f1b": ScheduleKind.ONE_F_ONE_B,
                   "interleaved": ScheduleKind.INTERLEAVED, "zbh1": ScheduleKind.ZBH1}


def _live(f):
    """f, or what it wraps if it is the wrapper of an uninstalled reporter (one whose _saved is
    None: P2PBubbles, PipeliningBubbles), and so on down."""
    while getattr(f, "_bubble_owner", None) is not None and f._bubble_owner._saved is None:
        f = f._bubble_inner
    return f


def report(owner, fn, *args, **kwargs) -> bool:
    """A report to the trainer from inside the training's own calls (a receive, a schedule
    step). A refusal (the trainer closed by a signal handler, a library error) is counted in
    owner.report_errors and kept in owner.last_report_error, never raised there: a bubble
    report must not break the receive it wraps. Returns whether the trainer took it."""
    try:
        fn(*args, **kwargs)
        return True
    except (BubbleError, ValueError) as e:
        owner.report_errors += 1
        owner.last_report_error = e
        return False

@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule as a framework states it (names as in docs/SCHEDULES.md).

    stages: pipeline depth p; stage: this rank's stage 0..p-1; micro_batches: m per iteration;
    chunks: model chunks per stage (interleaved v, else 1).
    """

    stages: int
    stage: int
    micro_batches: int
    kind: str = "1f1b"
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"schedule kind {self.kind!r} is not one of {', '.join(_KINDS)}")
        if self.stages < 1 or not 0 <= self.stage < self.stages:
            raise ValueError(f"stage {self.stage} is not in 0..{self.stages - 1} "
                             f"(stages={self.stages})")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, not {self.micro_batches}")
        if self.chunks < 1 or (self.chunks > 1) != (self.kind == "interleaved"):
            raise ValueError("chunks > 1 goes with kind='interleaved' only (and it needs >= 2)")

    def receives_per_iteration(self) -> int:
        """Tensors this stage receives per iteration: activations for every virtual stage but
        the first, gradients for every virtual stage but the last."""
        virtual = self.micro_batches * self.chunks
        fwd = virtual - (self.micro_batches if self.stage == 0 else 0)
        bwd = virtual - (self.micro_batches if self.stage == self.stages - 1 else 0)
        return fwd + bwd

    def kind_of(self, wait_index: int) -> BubbleKind:
        """The kind of the n-th wait of an iteration: a stage after the first idles from the
        iteration's start until its first input arrives (warm-up); every later wait of the
        iteration is steady. (The cool-down idle time after a stage's last op holds no receive.)"""
        if wait_index == 0 and self.stage > 0:
            return BubbleKind.WARMUP
        return BubbleKind.STEADY


def publish_schedule(trainer: Trainer, s: PipelineSchedule) -> bool:
    """Declares `s` to the trainer's predictor: one bubble per receive, times measured by the
    library. A schedule the model cannot simulate is not published: a RuntimeWarning says why
    and False comes back (bubbles are then predicted from observations only)."""
    try:
        trainer.set_schedule(_SCHEDULE_KINDS[s.kind], stages=s.stages,
                             microbatches=s.micro_batches, stage=s.stage, chunks=s.chunks,
                             bubbles=ScheduleBubbles.RECEIVES)
    except InvalidArgument as exc:
        warnings.warn(f"bubble: the {s.kind} schedule (stages={s.stages}, "
                      f"micro_batches={s.micro_batches}, chunks={s.chunks}) is not published "
                      f"to the predictor: {exc}; bubbles are predicted from observations only",
                      RuntimeWarning, stacklevel=4)
        return False
    return True


@dataclass(frozen=True)
class WaitRecord:
    iteration: int
    index: int        # the wait's number within its iteration
    kind: BubbleKind
    name: str         # what the framework called it ("recv", "forward-recv", "RecvGrad", ...)
    begin_ns: int
    end_ns: int


class WaitReporter:
    """Opens one bubble per receive on the trainer and numbers them per iteration.

    On construction it publishes the schedule to the trainer's predictor
    (Trainer.set_schedule with bubbles=RECEIVES and the times unknown): the n-th bubble of an
    iteration is the n-th receive of the schedule model, whose lengths the library scales by
    the compute it measures between bubbles, so predictions (deadlines, predictive wake) start
    in the first iteration instead of the second. A schedule the model cannot simulate is not
    published (a RuntimeWarning says why); bubbles are then predicted from observations only.

    expected: announced bubble length in seconds (None: the library predicts it per position);
    free_mem: device bytes side tasks may use during waits (None: unknown);
    record: keep a WaitRecord per wait in `records`;
    publish: publish the schedule now (an adapter that must first check the framework passes
    False and calls publish_schedule() itself).
    """

    def __init__(self, trainer: Trainer, schedule: PipelineSchedule, *,
                 expected: float | None = None, free_mem: int | None = None,
                 record: bool = False, publish: bool = True) -> None:
        self.trainer = trainer
        self.schedule = schedule
        self.expected = expected
        self.free_mem = free_mem
        self.records: list[WaitRecord] | None = [] if record else None
        self.iterations = 0
        self.waits = 0              # all waits reported
        # Reports the trainer refused (closed by a signal handler, say): counted, never raised
        # into the training's own receive.
        self.report_errors = 0
        self.last_report_error: Exception | None = None
        self.published = False      # the predictor knows the schedule
        self._index = 0             # waits in the current iteration
        self._open = False
        if publish:
            self.publish_schedule()

    def publish_schedule(self) -> bool:
        """Declares the schedule to the trainer: one bubble per receive, times measured.
        Returns whether the schedule model took it."""
        self.published = publish_schedule(self.trainer, self.schedule)
        return self.published

    def iteration(self) -> None:
        """A training iteration starts: the predictor counts bubble positions from here."""
        report(self, self.trainer.iteration)
        self.iterations += 1
        self._index = 0

    @property
    def in_wait(self) -> bool:
        return self._open

    def begin(self, name: str) -> tuple[int, BubbleKind, int]:
        kind = self.schedule.kind_of(self._index)
        token = (self._index, kind, now_ns())
        self._open = report(self, self.trainer.bubble_begin, self.expected,
                            free_mem=self.free_mem, kind=kind)
        self._index += 1
        self.waits += 1
        return token

    def end(self, name: str, token: tuple[int, BubbleKind, int]) -> None:
        was_open, self._open = self._open, False
        if not was_open:  # its begin was refused: the wait went on without a bubble
            return
        report(self, self.trainer.bubble_end)
        if self.records is not None:
            index, kind, begin = token
            self.records.append(WaitRecord(self.iterations, index, kind, name, begin, now_ns()))

    @contextlib.contextmanager
    def wait(self, name: str) -> Iterator[None]:
        """`with reporter.wait("recv"): work.wait()`: the block is one bubble, ended on error."""
        token = self.begin(name)
        try:
            yield
        finally:
            self.end(name, token)
