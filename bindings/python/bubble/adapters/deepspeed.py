"""DeepSpeed's PipelineEngine: one bubble per receive instruction.

The engine executes its schedule as instructions through ``engine._INSTRUCTION_MAP``; the
adapter gives the engine its own copy of that map in which RecvActivation and RecvGrad run
inside a bubble, and wraps ``train_batch``/``eval_batch`` to mark iterations:

    engine, *_ = deepspeed.initialize(model=pipeline_module, ...)
    with bubble.Trainer(job, engine.global_rank) as trainer, DeepSpeedBubbles(trainer, engine):
        for _ in range(steps):
            engine.train_batch()

The schedule (stages, stage, micro-batches; DeepSpeed's TrainSchedule is 1F1B) is read from the
engine and published to the predictor on construction: one bubble per receive instruction,
times measured (WaitReporter), so deadlines are predicted from the first iteration on. Every
receive instruction is a bubble, also one whose data is already there, which keeps the
numbering in step with the schedule.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from ..trainer import Trainer
from ._common import PipelineSchedule, WaitReporter


def _schedule_module() -> ModuleType:
    try:
        from deepspeed.runtime.pipe import schedule
    except ImportError as exc:
        raise ImportError("DeepSpeed is not installed (pip install deepspeed): "
                          "DeepSpeedBubbles needs deepspeed.runtime.pipe") from exc
    return schedule


class DeepSpeedBubbles(WaitReporter):
    """Reports a PipelineEngine's receive instructions as bubbles while installed.

    schedule_module: DeepSpeed's deepspeed.runtime.pipe.schedule (tests pass a stand-in)."""

    RECEIVES = ("RecvActivation", "RecvGrad")

    def __init__(self, trainer: Trainer, engine: Any, *,
                 schedule_module: ModuleType | None = None, **kw: Any) -> None:
        sched = PipelineSchedule(stages=int(engine.num_stages), stage=int(engine.stage_id),
                                 micro_batches=int(engine.micro_batches))
        super().__init__(trainer, sched, **kw)
        self.engine = engine
        self._mod = schedule_module
        self._installed = False

    def install(self) -> None:
        if self._installed:
            raise RuntimeError("DeepSpeedBubbles is already installed")
        mod = self._mod or _schedule_module()
        engine, reporter = self.engine, self
        table = dict(engine._INSTRUCTION_MAP)
        for name in self.RECEIVES:
            instr = getattr(mod, name)
            if instr not in table:
                raise RuntimeError(f"this DeepSpeed engine has no {name} instruction: the "
                                   "adapter does not know this engine's schedule")
            table[instr] = _in_bubble(reporter, name, table[instr])
        engine._INSTRUCTION_MAP = table  # the instance's map shadows the class's
        for entry in ("train_batch", "eval_batch"):
            orig = getattr(engine, entry, None)
            if orig is not None:
                setattr(engine, entry, _marking_iterations(reporter, orig))
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        for attr in ("_INSTRUCTION_MAP", "train_batch", "eval_batch"):
            self.engine.__dict__.pop(attr, None)
        self._installed = False

    def __enter__(self) -> "DeepSpeedBubbles":
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def _in_bubble(reporter: WaitReporter, name: str, fn: Any) -> Any:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with reporter.wait(name):
            return fn(self, *args, **kwargs)
    return run


def _marking_iterations(reporter: WaitReporter, fn: Any) -> Any:
    def entry(*args: Any, **kwargs: Any) -> Any:
        reporter.iteration()
        return fn(*args, **kwargs)
    return entry
