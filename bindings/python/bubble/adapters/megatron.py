"""Megatron-Core: a timers object whose *-recv phases are bubbles, with no synchronization.

Megatron-Core's pipeline schedules time every point-to-point phase through ``config.timers``
("forward-recv", "backward-recv", "forward-send-backward-recv", ...). BubbleTimers is such a
timers object: a phase whose name ends in "-recv" is a bubble from start() to stop(); every other
phase goes to the timers it wraps (or nowhere). Megatron's own timers synchronize the device at
each start and stop when their barrier is asked; these never do.

    timers = BubbleTimers(trainer, PipelineSchedule(stages=pp, stage=pp_rank, micro_batches=m),
                          inner=config.timers)
    config.timers = timers
    forward_backward = timers.wrap(get_forward_backward_func())   # marks iterations

The schedule given is published to the predictor on construction: one bubble per *-recv phase,
times measured (WaitReporter), so deadlines are predicted from the first iteration on.
Megatron times a receive only where the stage has a neighbour to receive from, which matches
the schedule model's receives for 1F1B. Its interleaved schedule may fuse two receives into one
phase ("forward-backward-send-forward-backward-recv"): the first iteration's predictions are
then off by a position or more; observations take over from the second.
"""
from __future__ import annotations

from typing import Any, Callable

from ..trainer import Trainer
from ._common import PipelineSchedule, WaitReporter


def schedule_from_parallel_state(micro_batches: int, chunks: int = 1) -> PipelineSchedule:
    """The schedule from megatron.core.parallel_state (after initialize_model_parallel)."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError as exc:
        raise ImportError("Megatron-Core is not installed (pip install megatron-core): pass a "
                          "PipelineSchedule instead") from exc
    return PipelineSchedule(stages=ps.get_pipeline_model_parallel_world_size(),
                            stage=ps.get_pipeline_model_parallel_rank(),
                            micro_batches=micro_batches,
                            kind="interleaved" if chunks > 1 else "1f1b", chunks=chunks)


class _Timer:
    def __init__(self, owner: "BubbleTimers", name: str, log_level: int | None) -> None:
        self._owner, self._name, self._level = owner, name, log_level
        self._token: Any = None

    def _inner(self) -> Any:
        inner = self._owner.inner
        if inner is None:
            return None
        return inner(self._name) if self._level is None else inner(self._name, self._level)

    def start(self, barrier: bool = False) -> None:
        if self._name.endswith("-recv"):
            if self._token is None:
                self._token = self._owner.begin(self._name)
        elif (t := self._inner()) is not None:
            t.start(barrier=barrier)

    def stop(self, barrier: bool = False) -> None:
        if self._name.endswith("-recv"):
            if self._token is not None:
                token, self._token = self._token, None
                self._owner.end(self._name, token)
        elif (t := self._inner()) is not None:
            t.stop(barrier=barrier)

    def __getattr__(self, attr: str) -> Any:  # reset(), elapsed(), ... of the wrapped timer
        t = self._inner()
        if t is None:
            raise AttributeError(attr)
        return getattr(t, attr)


class BubbleTimers(WaitReporter):
    """A Megatron timers object: ``timers(name, log_level=None)`` returns a timer."""

    def __init__(self, trainer: Trainer, schedule: PipelineSchedule, *, inner: Any = None,
                 **kw: Any) -> None:
        super().__init__(trainer, schedule, **kw)
        self.inner = inner
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        t = self._timers.get(name)
        if t is None:
            t = self._timers[name] = _Timer(self, name, log_level)
        return t

    def wrap(self, forward_backward: Callable[..., Any]) -> Callable[..., Any]:
        """The forward-backward function with an iteration mark at each call."""
        def run(*args: Any, **kwargs: Any) -> Any:
            self.iteration()
            return forward_backward(*args, **kwargs)
        return run

    def __getattr__(self, attr: str) -> Any:  # log(), write(), ... of the wrapped timers
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(attr)
        return getattr(inner, attr)
