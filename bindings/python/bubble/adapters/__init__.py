"""Adapters that report a pipeline framework's receive waits as bubbles, in a few lines each.

    torch_pipelining.PipeliningBubbles  torch.distributed.pipelining schedules (torch >= 2.4)
    deepspeed.DeepSpeedBubbles           DeepSpeed's PipelineEngine
    megatron.BubbleTimers                Megatron-Core's timers hook (config.timers)

Each knows the pipeline's schedule (kind, stages, this stage, micro-batches, chunks) from the
framework and publishes it to the predictor (Trainer.set_schedule: one bubble per receive, the
times measured by the library from the first iteration's compute), so bubble deadlines and
predictive wake work from the first iteration on. Iterations are marked at the framework's step
entry, so the predictor numbers the bubbles of every iteration alike, and each wait carries its
kind (the first wait of a stage that is not the first is its warm-up). The framework modules
are imported only by the adapter that needs them: importing this package needs none.
"""
from __future__ import annotations

from ._common import PipelineSchedule, WaitRecord, WaitReporter

__all__ = ["PipelineSchedule", "WaitRecord", "WaitReporter"]
