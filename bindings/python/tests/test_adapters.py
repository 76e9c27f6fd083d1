"""The framework adapters (bubble.adapters).

Tests named test_real_* run against the real framework and are skipped, saying why, where it is
not importable. Tests named test_standin_* check an adapter's own logic against a minimal
stand-in of the framework's documented surface (the function, attribute and instruction names
the adapter relies on): they are NOT tests of the real framework, only of the adapter.
"""
from __future__ import annotations

import importlib
import threading
import time
import types

import pytest

import bubble
from bubble.adapters import PipelineSchedule, WaitReporter
from bubble.adapters.deepspeed import DeepSpeedBubbles
from bubble.adapters.megatron import BubbleTimers
from bubble.adapters.torch_pipelining import PipeliningBubbles
from conftest import Background, eventually

K = bubble.BubbleKind


def _missing(module: str) -> str | None:
    try:
        importlib.import_module(module)
        return None
    except ImportError as exc:
        return f"{module} is not importable here ({exc})"


# ---- the schedule every adapter publishes ------------------------------------------------------

def test_schedule_counts_receives_per_iteration():
    assert PipelineSchedule(stages=4, stage=0, micro_batches=8).receives_per_iteration() == 8
    assert PipelineSchedule(stages=4, stage=1, micro_batches=8).receives_per_iteration() == 16
    assert PipelineSchedule(stages=4, stage=3, micro_batches=8).receives_per_iteration() == 8
    assert PipelineSchedule(stages=1, stage=0, micro_batches=8).receives_per_iteration() == 0
    inter = PipelineSchedule(stages=2, stage=0, micro_batches=4, kind="interleaved", chunks=2)
    assert inter.receives_per_iteration() == 4 + 8  # chunk 1 receives activations from stage 1


def test_schedule_kinds_first_wait_of_a_later_stage_is_warmup():
    first = PipelineSchedule(stages=3, stage=0, micro_batches=4)
    later = PipelineSchedule(stages=3, stage=2, micro_batches=4)
    assert [first.kind_of(i) for i in range(3)] == [K.STEADY] * 3
    assert [later.kind_of(i) for i in range(3)] == [K.WARMUP, K.STEADY, K.STEADY]


@pytest.mark.parametrize("kw, says", [
    (dict(stages=2, stage=2, micro_batches=1), "stage 2 is not in 0..1"),
    (dict(stages=2, stage=0, micro_batches=0), "micro_batches"),
    (dict(stages=2, stage=0, micro_batches=1, kind="zigzag"), "not one of"),
    (dict(stages=2, stage=0, micro_batches=1, chunks=2), "interleaved"),
])
def test_schedule_rejects_what_cannot_be(kw, says):
    with pytest.raises(ValueError, match=says):
        PipelineSchedule(**kw)


# ---- publishing the schedule to the predictor ----------------------------------------------------

class _Side:
    """A side task on a thread that takes each start, says so, and acks the pause: the waits
    of a test block until the task runs in them, so each start is seen, whatever the load."""

    def __init__(self, task: bubble.Task, starts: int) -> None:
        self.task, self.starts = task, []
        self.started, self.idle = threading.Event(), threading.Event()
        self.idle.set()
        self._thread = Background(lambda: self._run(starts))

    def _run(self, n: int) -> None:
        for _ in range(n):
            start = self.task.wait_start(timeout=20)
            assert start is not None, "the trainer never started the side task"
            self.starts.append(start)
            self.idle.clear()
            self.started.set()
            assert eventually(self.task.should_pause)
            self.started.clear()
            self.task.ack_pause()
            self.idle.set()

    def join(self) -> None:
        self._thread.join_result()


def _first_iteration(job: str, publish: bool) -> tuple[WaitReporter, list]:
    """A 1F1B p=4 m=8 stage-2 iteration reported as the adapters do, one bubble per receive,
    with a real side task started in every one; returns the reporter and the task's starts."""
    sched = PipelineSchedule(stages=4, stage=2, micro_batches=8)
    waits = sched.receives_per_iteration()
    with bubble.Trainer(job, 0) as trainer, bubble.Task(job, 0, "side") as task:
        assert eventually(lambda: trainer.stats().tasks_attached == 1)
        rep = WaitReporter(trainer, sched, publish=publish)
        side = _Side(task, waits)
        rep.iteration()
        for _ in range(waits):
            assert side.idle.wait(20)  # "compute": the task has acked the last pause
            time.sleep(0.001)
            with rep.wait("recv"):
                assert side.started.wait(20)
        side.join()
        return rep, side.starts


def test_wait_reporter_publishes_the_schedule_and_the_first_iteration_has_deadlines(job):
    rep, starts = _first_iteration(job, publish=True)
    assert rep.published
    assert len(starts) == 16
    # Nothing is known before the first compute; from the second receive on every bubble has
    # a deadline, from the model scaled by the compute measured so far.
    assert starts[0].deadline_ns == 0
    assert all(s.deadline_ns > s.begin_ns for s in starts[1:])


def test_wait_reporter_without_publishing_has_no_deadline_for_the_first_steady_wait(job):
    rep, starts = _first_iteration(job, publish=False)
    assert not rep.published
    assert [s.kind for s in starts[:2]] == [K.WARMUP, K.STEADY]
    assert starts[0].deadline_ns == 0
    assert starts[1].deadline_ns == 0  # no steady wait seen yet, no schedule known


def test_a_schedule_the_model_rejects_is_not_published_and_says_why(job):
    with bubble.Trainer(job, 0) as trainer:
        sched = PipelineSchedule(stages=4, stage=1, micro_batches=6, kind="interleaved", chunks=2)
        with pytest.warns(RuntimeWarning, match="not published.*multiple of stages"):
            rep = WaitReporter(trainer, sched)
        assert not rep.published
        with rep.wait("recv"):  # reporting still works
            pass
        assert trainer.stats().bubbles == 1


def test_trainer_set_schedule_measures_unknown_times(job):
    with bubble.Trainer(job, 0) as trainer:
        trainer.set_schedule(bubble.ScheduleKind.ZBH1, stages=4, microbatches=8, stage=3,
                             bubbles=bubble.ScheduleBubbles.RECEIVES)
        trainer.set_schedule(stages=4, microbatches=8, stage=3, fwd=0.001, bwd=0.002)
        with pytest.raises(ValueError, match="both fwd and bwd"):
            trainer.set_schedule(stages=4, microbatches=8, stage=3, fwd=0.001)
        with pytest.raises(bubble.InvalidArgument, match="comm_ns"):
            trainer.set_schedule(stages=4, microbatches=8, stage=3, comm=0.001)


# ---- the real frameworks -----------------------------------------------------------------------

@pytest.mark.skipif(_missing("torch.distributed.pipelining") is not None,
                    reason=f"{_missing('torch.distributed.pipelining')}: Debian's torch 1.13 "
                           "predates it (torch >= 2.4)")
def test_real_torch_pipelining_schedule_waits_are_bubbles(job):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    import tempfile
    store = tempfile.mktemp(prefix="bb-pp-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        stage = PipelineStage(torch.nn.Linear(4, 4), 0, 1, torch.device("cpu"))
        sched = ScheduleGPipe(stage, n_microbatches=2)
        with bubble.Trainer(job, 0) as trainer, PipeliningBubbles(trainer, sched, record=True) as a:
            sched.step(torch.randn(4, 4))
            assert a.schedule == PipelineSchedule(stages=1, stage=0, micro_batches=2, kind="gpipe")
            assert a.iterations == 1
            assert trainer.stats().bubbles == a.waits  # one stage: nothing to wait for
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(_missing("deepspeed") is not None,
                    reason=f"{_missing('deepspeed')}: DeepSpeed is not installed")
def test_real_deepspeed_module_has_the_receive_instructions():
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine
    for name in DeepSpeedBubbles.RECEIVES:
        assert getattr(schedule, name) in PipelineEngine._INSTRUCTION_MAP


@pytest.mark.skipif(_missing("megatron.core") is not None,
                    reason=f"{_missing('megatron.core')}: Megatron-Core is not installed")
def test_real_megatron_config_takes_a_timers_object(job):
    from megatron.core import ModelParallelConfig
    with bubble.Trainer(job, 0) as trainer:
        timers = BubbleTimers(trainer, PipelineSchedule(stages=2, stage=1, micro_batches=2))
        config = ModelParallelConfig(timers=timers)
        config.timers("forward-recv", log_level=2).start()
        config.timers("forward-recv", log_level=2).stop()
        assert trainer.stats().bubbles == 1


# ---- stand-ins of the documented surfaces (adapter logic only, not the frameworks) ------------

class _Work:
    """A dist.Work stand-in: wait() blocks until the 'peer' sends."""

    def __init__(self, delay: float | None = 0.0) -> None:
        self._done = threading.Event()
        if delay is None:
            return  # completed by the test
        if delay:
            threading.Timer(delay, self._done.set).start()
        else:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        return self._done.wait(10)


def _pipelining_standin():
    """torch.distributed.pipelining.schedules, reduced to what the adapter touches: the module
    function _wait_batch_p2p(works) every schedule calls, and a schedule with step(),
    _n_microbatches and _stage.{num_stages, stage_index}."""
    mod = types.ModuleType("schedules_standin")
    mod.waited = 0

    def _wait_batch_p2p(works):
        for w in works:
            w.wait()
        mod.waited += 1
    mod._wait_batch_p2p = _wait_batch_p2p

    class Schedule1F1B:
        def __init__(self, stage, n):
            self._stage, self._n_microbatches = stage, n

        def step(self, delays):
            for d in delays:  # one batched receive per micro-batch op
                mod._wait_batch_p2p([d if isinstance(d, _Work) else _Work(d)])
            return "loss"
    mod.Schedule1F1B = Schedule1F1B
    return mod


def test_standin_pipelining_waits_that_wait_become_bubbles_of_the_schedule(job):
    mod = _pipelining_standin()
    stage = types.SimpleNamespace(num_stages=4, stage_index=2)
    sched = mod.Schedule1F1B(stage, 8)
    with bubble.Trainer(job, 0) as trainer:
        with PipeliningBubbles(trainer, sched, module=mod, record=True) as a:
            assert a.schedule == PipelineSchedule(stages=4, stage=2, micro_batches=8)
            assert sched.step([0.02, 0.0, 0.02]) == "loss"
            assert sched.step([0.02]) == "loss"
            # Another caller of the module function is not this schedule's wait.
            mod._wait_batch_p2p([_Work(0.01)])
        assert mod.waited == 5
        assert a.iterations == 2
        assert not a.published  # without _batch_p2p it cannot number receives: nothing published
        assert [(r.iteration, r.index, r.kind) for r in a.records] == [
            (1, 0, K.WARMUP), (1, 1, K.STEADY), (2, 0, K.WARMUP)]
        assert trainer.stats().bubbles == 3
        # Uninstalled: the module and the schedule are back to themselves.
        sched.step([0.01])
        assert trainer.stats().bubbles == 3
        assert "step" not in vars(sched)


def test_standin_pipelining_wait_starts_a_real_side_task(job):
    mod = _pipelining_standin()
    sched = mod.Schedule1F1B(types.SimpleNamespace(num_stages=2, stage_index=1), 2)
    gate = _Work(None)  # this receive completes only once the side task runs in the bubble
    with bubble.Trainer(job, 0) as trainer, bubble.Task(job, 0, "side") as task:
        def side():
            start = task.wait_start(timeout=20)
            gate._done.set()
            return start
        waiter = Background(side)
        with PipeliningBubbles(trainer, sched, module=mod):
            sched.step([gate])
        start = waiter.join_result()
        assert start is not None and start.kind is K.WARMUP
        assert eventually(task.should_pause)
        task.ack_pause()
        assert trainer.stats().bubbles == 1


def _pipelining_standin_with_batches():
    """The module as torch >= 2.5 has it: _batch_p2p(ops, desc) batches sends and receives,
    _wait_batch_p2p(works) waits for one batch."""
    mod = types.ModuleType("schedules_standin_batches")
    mod.waited = 0

    def _batch_p2p(ops, desc=None):
        return [op.work for op in ops]

    def _wait_batch_p2p(works):
        for w in works:
            w.wait()
        mod.waited += 1
    mod._batch_p2p, mod._wait_batch_p2p = _batch_p2p, _wait_batch_p2p

    class Schedule1F1B:
        def __init__(self, stage, n):
            self._stage, self._n_microbatches = stage, n

        def step(self, plan):
            for desc, delay in plan:  # e.g. ("fwd_recv", 0.01), ("bwd_send", 0.0)
                ops = [types.SimpleNamespace(work=_Work(delay))]
                mod._wait_batch_p2p(mod._batch_p2p(ops, desc=desc))
            return "loss"
    mod.Schedule1F1B = Schedule1F1B
    return mod


def test_standin_pipelining_publishes_and_numbers_every_receive(job):
    mod = _pipelining_standin_with_batches()
    orig_batch = mod._batch_p2p
    sched = mod.Schedule1F1B(types.SimpleNamespace(num_stages=4, stage_index=2), 8)
    with bubble.Trainer(job, 0) as trainer:
        a = PipeliningBubbles(trainer, sched, module=mod, record=True)
        assert not a.published  # not before the module is known to batch receives
        with a:
            assert a.published
            # Receives are bubbles even when their data is already there (the numbering stays
            # the schedule's); sends are not, even when they wait.
            sched.step([("fwd_recv", 0.005), ("fwd_send", 0.005), ("bwd_recv", 0.0),
                        ("fwd_send_bwd_recv", 0.0), ("bwd_send", 0.0)])
            # Batches made outside the schedule's step() are not ours.
            mod._wait_batch_p2p(mod._batch_p2p([types.SimpleNamespace(work=_Work(0.0))],
                                               desc="fwd_recv"))
        assert mod.waited == 6
        assert [(r.index, r.kind) for r in a.records] == [(0, K.WARMUP), (1, K.STEADY),
                                                         (2, K.STEADY)]
        assert trainer.stats().bubbles == 3
        assert mod._batch_p2p is orig_batch  # uninstalled


def test_standin_pipelining_install_that_fails_to_publish_leaves_nothing_installed(job):
    mod = _pipelining_standin_with_batches()
    orig_wait, orig_batch = mod._wait_batch_p2p, mod._batch_p2p
    sched = mod.Schedule1F1B(types.SimpleNamespace(num_stages=4, stage_index=2), 8)
    with bubble.Trainer(job, 0) as trainer:
        a = PipeliningBubbles(trainer, sched, module=mod)

        def refused(*args, **kwargs):
            raise bubble.Busy("the schedule cannot be set now")
        trainer.set_schedule = refused  # an error other than InvalidArgument comes through
        with pytest.raises(bubble.Busy):
            a.install()
        assert mod._wait_batch_p2p is orig_wait and mod._batch_p2p is orig_batch
        assert "step" not in vars(sched)
        del trainer.set_schedule
        with a:  # not "already installed": it installs, and publishes this time
            assert a.published
            sched.step([("fwd_recv", 0.0)])
        assert mod._wait_batch_p2p is orig_wait and mod._batch_p2p is orig_batch
        assert trainer.stats().bubbles == 1


def test_standin_pipelining_instances_uninstalled_out_of_order_leave_the_module_clean(job):
    """A training and an evaluation schedule each get an adapter. Uninstalling the first while
    the second's wrappers sit on top must keep the second's waits reported, and the second's
    uninstall must not put the first's wrappers back for good."""
    mod = _pipelining_standin_with_batches()
    orig_wait, orig_batch = mod._wait_batch_p2p, mod._batch_p2p
    stage = types.SimpleNamespace(num_stages=4, stage_index=2)
    train, evaluate = mod.Schedule1F1B(stage, 8), mod.Schedule1F1B(stage, 8)
    with bubble.Trainer(job, 0) as trainer:
        a = PipeliningBubbles(trainer, train, module=mod)
        b = PipeliningBubbles(trainer, evaluate, module=mod)
        a.install()
        b.install()
        a.uninstall()
        evaluate.step([("fwd_recv", 0.0)])
        assert b.waits == 1, "the later instance's waits are no longer reported"
        train.step([("fwd_recv", 0.0)])  # a's schedule is its own again
        assert a.waits == 0
        b.uninstall()
        assert mod._wait_batch_p2p is orig_wait and mod._batch_p2p is orig_batch
        assert trainer.stats().bubbles == 1


def test_a_trainer_closed_under_the_adapter_never_breaks_a_receive(job):
    """A SIGTERM handler may close the trainer while the training goes on to its end. Bubble
    reports then fail; the receives they wrap must still return their results, and the
    failures are counted instead."""
    mod = _pipelining_standin_with_batches()
    sched = mod.Schedule1F1B(types.SimpleNamespace(num_stages=4, stage_index=2), 8)
    trainer = bubble.Trainer(job, 0)
    with PipeliningBubbles(trainer, sched, module=mod) as a:
        assert sched.step([("fwd_recv", 0.0)]) == "loss"
        assert a.report_errors == 0
        trainer.close()
        assert sched.step([("fwd_recv", 0.0), ("bwd_recv", 0.0)]) == "loss"
        assert mod.waited == 3
        # The iteration mark and both begins were refused; no end was sent for a bubble that
        # never began.
        assert a.report_errors == 3, a.report_errors
        assert isinstance(a.last_report_error, ValueError)
        with a.wait("recv"):  # the reporter's own context manager as well
            pass
        assert a.report_errors == 4


def _deepspeed_standin():
    """deepspeed.runtime.pipe: instruction classes, and an engine that runs them the documented
    way (self._INSTRUCTION_MAP[type(cmd)] bound with MethodType, kwargs from the instruction)."""
    sched = types.ModuleType("ds_schedule_standin")

    class PipeInstruction:
        def __init__(self, **kwargs):
            self.kwargs = kwargs
    for name in ("LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation",
                 "RecvActivation", "SendGrad", "RecvGrad", "OptimizerStep"):
        setattr(sched, name, type(name, (PipeInstruction,), {}))

    class PipelineEngine:
        def __init__(self, stages, stage_id, micro_batches, delay):
            self.num_stages, self.stage_id, self.micro_batches = stages, stage_id, micro_batches
            self.delay, self.log = delay, []

        def _exec_recv_activations(self, buffer_id):
            time.sleep(self.delay)
            self.log.append(("recv-act", buffer_id))

        def _exec_recv_grads(self, buffer_id):
            time.sleep(self.delay)
            self.log.append(("recv-grad", buffer_id))

        def _exec_other(self, **kw):
            self.log.append("other")

        _INSTRUCTION_MAP = {
            sched.RecvActivation: _exec_recv_activations,
            sched.RecvGrad: _exec_recv_grads,
            sched.ForwardPass: _exec_other, sched.BackwardPass: _exec_other,
            sched.SendActivation: _exec_other, sched.SendGrad: _exec_other,
            sched.OptimizerStep: _exec_other,
        }

        def _exec_schedule(self, cmds):
            for cmd in cmds:
                types.MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)

        def train_batch(self):
            s = sched
            cmds = []
            for mb in range(self.micro_batches):  # a middle stage: receive both ways
                cmds += [s.RecvActivation(buffer_id=mb), s.ForwardPass(buffer_id=mb),
                         s.SendActivation(buffer_id=mb)]
            for mb in range(self.micro_batches):
                cmds += [s.RecvGrad(buffer_id=mb), s.BackwardPass(buffer_id=mb),
                         s.SendGrad(buffer_id=mb)]
            cmds.append(s.OptimizerStep())
            self._exec_schedule(cmds)
            return 0.5
    return sched, PipelineEngine


def test_standin_deepspeed_receive_instructions_become_bubbles(job):
    sched, Engine = _deepspeed_standin()
    engine = Engine(stages=3, stage_id=1, micro_batches=2, delay=0.002)
    with bubble.Trainer(job, 0) as trainer:
        with DeepSpeedBubbles(trainer, engine, schedule_module=sched, record=True) as a:
            assert a.schedule == PipelineSchedule(stages=3, stage=1, micro_batches=2)
            assert a.published
            assert engine.train_batch() == 0.5
            assert engine.train_batch() == 0.5
        assert [r.name for r in a.records] == ["RecvActivation"] * 2 + ["RecvGrad"] * 2 + \
            ["RecvActivation"] * 2 + ["RecvGrad"] * 2
        assert [r.kind for r in a.records[:2]] == [K.WARMUP, K.STEADY]
        assert a.iterations == 2
        assert len(a.records) == 2 * a.schedule.receives_per_iteration()
        assert trainer.stats().bubbles == 8
        assert engine.log.count(("recv-grad", 1)) == 2  # the instructions still ran
        # Uninstalled: the class's map and methods are back.
        engine.train_batch()
        assert trainer.stats().bubbles == 8
        assert "_INSTRUCTION_MAP" not in vars(engine)


def test_standin_deepspeed_engine_without_receive_instruction_is_refused(job):
    sched, Engine = _deepspeed_standin()
    engine = Engine(stages=2, stage_id=0, micro_batches=1, delay=0)
    engine._INSTRUCTION_MAP = {k: v for k, v in Engine._INSTRUCTION_MAP.items()
                               if k is not sched.RecvGrad}
    with bubble.Trainer(job, 0) as trainer:
        with pytest.raises(RuntimeError, match="no RecvGrad instruction"):
            DeepSpeedBubbles(trainer, engine, schedule_module=sched).install()


class _InnerTimers:
    """Megatron's timers surface: timers(name, log_level) -> timer with start/stop(barrier)."""

    def __init__(self):
        self.calls = []

    def __call__(self, name, log_level=None):
        calls = self.calls

        class T:
            def start(self, barrier=False):
                calls.append(("start", name, barrier))

            def stop(self, barrier=False):
                calls.append(("stop", name, barrier))

            def elapsed(self, reset=True):
                return 1.5
        return T()

    def log(self, names, **kw):
        self.calls.append(("log", tuple(names)))


def test_standin_megatron_recv_phases_are_bubbles_and_the_rest_passes_through(job):
    inner = _InnerTimers()

    def forward_backward(config, micro_batches):  # the schedule's timer calls, as Megatron makes
        t = config.timers
        for mb in range(micro_batches):
            t("forward-recv", log_level=2).start()
            time.sleep(0.001)
            t("forward-recv", log_level=2).stop()
            t("forward-compute", log_level=2).start()
            t("forward-compute", log_level=2).stop()
            t("forward-send-backward-recv", log_level=2).start()
            t("forward-send-backward-recv", log_level=2).stop()
        return ["loss"]

    with bubble.Trainer(job, 0) as trainer:
        timers = BubbleTimers(trainer, PipelineSchedule(stages=2, stage=1, micro_batches=2),
                              inner=inner, record=True)
        assert timers.published
        config = types.SimpleNamespace(timers=timers)
        fb = timers.wrap(forward_backward)
        assert fb(config, 2) == ["loss"]
        assert trainer.stats().bubbles == 4
        assert [r.name for r in timers.records] == ["forward-recv", "forward-send-backward-recv"] * 2
        assert timers.records[0].kind is K.WARMUP
        # Only the compute phase reached Megatron's timers, without a barrier asked by us.
        assert inner.calls == [("start", "forward-compute", False),
                               ("stop", "forward-compute", False)] * 2
        assert timers("forward-compute").elapsed() == 1.5
        timers.log(["forward-compute"])
        assert inner.calls[-1] == ("log", ("forward-compute",))
        # A stop without a start (a schedule's early return) opens nothing.
        timers("backward-recv").stop()
        assert trainer.stats().bubbles == 4
