from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import pytest

import bubble
from conftest import Background, bubble_until, eventually


class Counting(bubble.SideTask):
    def __init__(self, done_after: int | None = None) -> None:
        self.calls: list[str] = []
        self.steps = 0
        self.seqs: set[int] = set()
        self.done_after = done_after
        self.finished_with: bubble.Status | None = None

    def init(self) -> None:
        self.calls.append("init")

    def step(self, info: bubble.StepInfo) -> bool:
        self.steps += 1
        self.seqs.add(info.bubble_seq)
        return self.steps == self.done_after

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def finish(self, status: bubble.Status) -> None:
        self.finished_with = status


def run_in_background(job: str, name: str, side_task: bubble.SideTask) -> Background:
    def go():
        with bubble.Task(job, 0, name) as task:
            return task.run(side_task)
    return Background(go)


def test_imperative_loop_follows_begin_and_end(job):
    with bubble.Trainer(job, 0) as trainer, bubble.Task(job, 0, "imperative") as task:
        assert task.wait_start(timeout=0.001) is None
        waiter = Background(lambda: task.wait_start(timeout=20))
        trainer.bubble_begin(0.05, kind=bubble.BubbleKind.STEADY)
        start = waiter.join_result()
        assert start.kind is bubble.BubbleKind.STEADY
        assert not task.should_pause()
        task.report_step(1_000_000)
        trainer.bubble_end()
        assert eventually(task.should_pause)
        task.ack_pause()
        assert trainer.stats().bubbles == 1
        # Step reports reach the trainer's counters through its service thread.
        assert eventually(lambda: trainer.stats().steps == 1)


def test_side_task_steps_in_bubbles_pauses_after_them_and_stops(job):
    side = Counting()
    with bubble.Trainer(job, 0) as trainer:
        runner = run_in_background(job, "iterative", side)
        assert eventually(lambda: len(trainer.tasks()) == 1 and "init" in side.calls)
        for i in range(3):
            before = side.steps
            assert bubble_until(trainer, lambda: side.steps > before,
                                kind=bubble.BubbleKind.STEADY)
            assert eventually(lambda: side.calls.count("pause") == i + 1)
        assert side.calls.count("resume") == 3
        assert len(side.seqs) == 3
        trainer.stop_task(trainer.tasks()[0])
        assert runner.join_result() is bubble.Outcome.STOPPED
        assert side.finished_with is bubble.Status.E_STOPPED


def test_step_returning_true_finishes_the_run(job):
    side = Counting(done_after=2)
    with bubble.Trainer(job, 0) as trainer:
        runner = run_in_background(job, "finisher", side)
        assert eventually(lambda: len(trainer.tasks()) == 1)
        trainer.bubble_begin(0.2)
        assert runner.join_result() is bubble.Outcome.FINISHED
        trainer.bubble_end()
    assert side.steps == 2
    assert side.finished_with is bubble.Status.OK


def test_an_exception_in_step_is_re_raised_by_run_and_finish_still_runs(job):
    class Broken(bubble.SideTask):
        finished_with: bubble.Status | None = None

        def step(self, info):
            raise KeyError("lost")

        def finish(self, status):
            self.finished_with = status

    broken = Broken()
    with bubble.Trainer(job, 0) as trainer:
        runner = run_in_background(job, "broken", broken)
        assert eventually(lambda: len(trainer.tasks()) == 1)
        trainer.bubble_begin(0.05)
        with pytest.raises(KeyError, match="lost"):
            runner.join_result()
        trainer.bubble_end()
    # Its cleanup is not skipped: finish ran, told how the run ended.
    assert broken.finished_with is bubble.Status.E_CALLBACK


def test_bubbles_iterator_ends_when_the_task_is_stopped(job):
    seen: list[int] = []
    with bubble.Trainer(job, 0) as trainer:
        def loop():
            with bubble.Task(job, 0, "looper") as task:
                for start in task.bubbles():
                    seen.append(start.bubble_seq)
                    while not task.should_pause():
                        pass
        runner = Background(loop)
        assert eventually(lambda: len(trainer.tasks()) == 1)
        for n in range(1, 3):
            assert bubble_until(trainer, lambda: len(seen) == n)
        trainer.stop_task(trainer.tasks()[0].id)
        runner.join_result()
    assert len(set(seen)) == 2


def test_the_bubble_calls_hold_the_gil_and_the_waits_give_it_up():
    from bubble._lib import lib
    holds = lambda fn: bool(type(fn)._flags_ & ctypes._FUNCFLAG_PYTHONAPI)  # noqa: E731
    for name in ("bb_bubble_begin", "bb_bubble_end", "bb_trainer_iteration",
                 "bb_task_should_pause", "bb_task_report_step", "bb_task_time_left"):
        assert holds(getattr(lib, name)), name
    for name in ("bb_task_wait_start", "bb_task_run", "bb_task_attach", "bb_trainer_close",
                 "bb_trainer_stats"):
        assert not holds(getattr(lib, name)), name


def test_close_waits_for_calls_in_flight_on_other_threads(job):
    trainer = bubble.Trainer(job, 0)
    calls = [0]
    errors: list[BaseException] = []

    def caller():
        try:
            while True:
                trainer.stats()
                trainer.tasks()
                calls[0] += 1
        except BaseException as exc:  # noqa: BLE001 - what ended the loop is the result
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    assert eventually(lambda: calls[0] >= 100)
    trainer.close()
    for t in threads:
        t.join(timeout=30)
    # Every caller ended with the closed trainer's error, none inside a freed hub.
    assert len(errors) == 3
    assert all(isinstance(e, ValueError) and "closed" in str(e) for e in errors), errors
    with pytest.raises(ValueError, match="closed"):
        trainer.bubble_begin(0.001)


class _LibCalling:
    """bubble.trainer's `lib`, but `name` first runs `hook`: what a signal handler does when
    Python runs it on the thread inside the call, before the C function is called."""

    def __init__(self, name: str, hook) -> None:
        from bubble._lib import lib
        self._lib, self._name, self._hook = lib, name, hook

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)
        if name != self._name:
            return fn

        def hooked(*args):
            self._hook()
            return fn(*args)
        return hooked


def test_close_on_another_thread_frees_the_hub_only_after_the_call_in_flight(job, monkeypatch):
    """A stats() call is held between the handle's read and its C call (where the GIL may pass
    to another thread); close() on another thread must not free the hub under it. The free is
    watched through bb_trainer_close itself, and close()'s wait through the condition it waits
    on: while the call is held, close() reaches its wait and the free does not come; it comes
    once the held call has reached the live hub."""
    import bubble.trainer as trainer_module
    trainer = bubble.Trainer(job, 0)
    entered, release, freed = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    class Lib(_LibCalling):
        def __getattr__(self, name: str):
            if name == "bb_trainer_close":
                real = getattr(self._lib, name)

                def close(h):
                    order.append("hub freed")
                    freed.set()
                    return real(h)
                return close
            return super().__getattr__(name)

    def hold():
        entered.set()
        assert release.wait(30)
    monkeypatch.setattr(trainer_module, "lib", Lib("bb_trainer_stats", hold))

    def stats_then_note():
        stats = trainer.stats()
        order.append("stats returned")
        return stats
    waiting = threading.Event()
    handle = trainer._handle

    class Watched(threading.Condition):
        def wait_for(self, predicate, timeout=None):
            waiting.set()
            return super().wait_for(predicate, timeout)
    handle._returned = Watched(handle._mu)
    held = Background(stats_then_note)
    assert entered.wait(30)
    closer = Background(trainer.close)
    # close() either frees at once (wrong) or waits for the call: whichever it does comes first.
    assert eventually(lambda: freed.is_set() or waiting.is_set())
    assert not freed.is_set(), "the hub was freed under a call in flight"
    release.set()
    assert held.join_result(timeout=30).tasks_attached == 0  # the live hub's stats
    closer.join_result(timeout=30)
    assert order == ["stats returned", "hub freed"]


def test_close_inside_a_call_of_its_own_thread_returns_and_the_hub_goes_when_the_call_does(
        job, monkeypatch):
    # A SIGTERM handler that closes the trainer while the main thread is inside a trainer
    # call: the call is below close() on the stack, so close() cannot wait for it (it hung).
    import bubble.trainer as trainer_module
    trainer = bubble.Trainer(job, 0)
    task = bubble.Task(job, 0, "watcher")
    assert eventually(lambda: len(trainer.tasks()) == 1)
    order: list[str] = []

    def close_then_note():
        trainer.close()
        order.append("close returned")
    monkeypatch.setattr(trainer_module, "lib", _LibCalling("bb_trainer_stats", close_then_note))
    # The handle given to the C call is still the live hub's: the stats are its own.
    stats = Background(trainer.stats).join_result(timeout=10)
    assert order == ["close returned"]
    assert stats.tasks_attached == 1
    # Removed once the call returned: the task sees its trainer gone, new calls raise.
    with pytest.raises(bubble.TrainerGone):
        task.wait_start(timeout=5)
    task.detach()
    with pytest.raises(ValueError, match="closed"):
        trainer.bubble_begin(0.001)
    with pytest.raises(bubble.HubNotFound):
        bubble.Task(job, 0, "late")


def test_close_inside_a_call_after_its_c_function_returned_does_not_hang(job, monkeypatch):
    # The same handler, run where CPython runs it: right after bb_bubble_begin returned, inside
    # the call (here by the status check that follows the C call).
    import bubble.trainer as trainer_module
    trainer = bubble.Trainer(job, 0)
    real_check = trainer_module.check

    def check(status):
        if not calls:
            calls.append(status)
            trainer.close()
        real_check(status)
    calls: list[int] = []
    monkeypatch.setattr(trainer_module, "check", check)
    Background(lambda: trainer.bubble_begin(0.01)).join_result(timeout=10)
    assert calls == [0]
    with pytest.raises(ValueError, match="closed"):
        trainer.bubble_end()
    with pytest.raises(bubble.HubNotFound):
        bubble.Task(job, 0, "late")


def test_ctrl_c_as_the_open_or_the_attach_returns_leaks_neither(job, monkeypatch):
    """CPython raises a KeyboardInterrupt at the first bytecode after a C call that gave up the
    GIL: here the status check after bb_trainer_open and bb_task_attach. The handle the call
    made is then already held by the object, so collecting it frees the hub (a leaked one kept
    its lock: a new Trainer of that job got Busy) and the slot (a leaked one stayed attached)."""
    import gc

    import bubble.task as task_module
    import bubble.trainer as trainer_module
    real_check = trainer_module.check

    def interrupted_once(status):
        if not fired:
            fired.append(status)
            raise KeyboardInterrupt
        real_check(status)
    fired: list[int] = []
    monkeypatch.setattr(trainer_module, "check", interrupted_once)
    try:
        bubble.Trainer(job, 0)
    except KeyboardInterrupt:
        pass
    assert fired == [0]
    gc.collect()
    monkeypatch.setattr(trainer_module, "check", real_check)
    with bubble.Trainer(job, 0) as trainer:  # the interrupted one's hub is gone
        fired.clear()
        monkeypatch.setattr(task_module, "check", interrupted_once)
        try:
            bubble.Task(job, 0, "interrupted")
        except KeyboardInterrupt:
            pass
        assert fired == [0]
        gc.collect()
        monkeypatch.setattr(task_module, "check", real_check)
        assert eventually(lambda: trainer.tasks() == [])


def test_detach_on_another_thread_waits_for_wait_start_which_raises(job):
    with bubble.Trainer(job, 0) as trainer:
        task = bubble.Task(job, 0, "waiter")
        assert eventually(lambda: len(trainer.tasks()) == 1)
        waiter = Background(task.wait_start)  # no timeout: waits until something happens
        # The detach comes while the wait is in flight (its call counted on the handle).
        assert eventually(lambda: task._handle._users)
        assert waiter.is_alive()
        Background(task.detach).join_result(timeout=10)
        # The wait noticed within its 100 ms slice, before the slot went away under it.
        with pytest.raises(ValueError, match="detached"):
            waiter.join_result(timeout=10)
        assert eventually(lambda: trainer.tasks() == [])
        with pytest.raises(ValueError, match="detached"):
            task.should_pause()


def test_detach_from_a_step_of_the_run_detaches_when_the_run_returns(job):
    class DetachesInStep(bubble.SideTask):
        def __init__(self, task: bubble.Task) -> None:
            self.task, self.after, self.steps = task, None, 0

        def step(self, info):
            self.steps += 1
            if self.steps == 1:
                self.task.detach()  # the run is below it on this thread: it returns at once
                try:
                    self.task.time_left()
                except ValueError as exc:
                    self.after = str(exc)
            return self.steps == 3  # the run goes on with its slot until it returns

    with bubble.Trainer(job, 0) as trainer:
        task = bubble.Task(job, 0, "self-detacher")
        side = DetachesInStep(task)
        runner = Background(lambda: task.run(side))
        assert eventually(lambda: len(trainer.tasks()) == 1)
        trainer.bubble_begin(0.2)
        assert runner.join_result(timeout=10) is bubble.Outcome.FINISHED
        trainer.bubble_end()
        assert side.steps == 3
        assert side.after is not None and "detached" in side.after
        assert eventually(lambda: trainer.tasks() == [])


@pytest.mark.parametrize("what, make", [
    ("job id", lambda job: bubble.Trainer(job + "\0x", 0)),
    ("runtime dir", lambda job: bubble.Trainer(job, 1, runtime_dir=os.environ[
        "BUBBLE_RUNTIME_DIR"] + "\0/other")),
    ("job id", lambda job: bubble.Task(job + "\0x", 0, "cut")),
    ("task name", lambda job: bubble.Task(job, 0, "cut\0short")),
    ("runtime dir", lambda job: bubble.Task(job, 0, "cut", runtime_dir=Path(os.environ[
        "BUBBLE_RUNTIME_DIR"] + "\0/other"))),
])
def test_a_nul_byte_in_a_name_is_invalid_not_cut_short(job, what, make):
    # Cut at the NUL, each of these names one that works here: the hub of `job`.
    with bubble.Trainer(job, 0) as trainer:
        with pytest.raises(bubble.InvalidArgument, match=f"{what} .* contains a NUL byte") as info:
            make(job)
        assert info.value.status is bubble.Status.E_INVALID
        assert "without one" in info.value.message
        assert trainer.tasks() == []


def test_leaving_the_bubbles_loop_early_still_acks_the_pause(job):
    with bubble.Trainer(job, 0) as trainer, bubble.Task(job, 0, "leaver") as task:
        assert eventually(lambda: len(trainer.tasks()) == 1)
        trainer.bubble_begin(0.05, kind=bubble.BubbleKind.STEADY)
        loop = task.bubbles()
        start = next(loop)
        trainer.bubble_end()
        assert eventually(task.should_pause)
        loop.close()  # what a `break` out of the for loop does
        # The ack reached the trainer: it timed the pause.
        assert eventually(lambda: trainer.stats().pause_latency_p50_ns > 0)
        assert start.bubble_seq == 1  # the hub's first bubble


def test_tasks_lists_attached_tasks_and_detach_removes_them(job):
    with bubble.Trainer(job, 0) as trainer:
        with bubble.Task(job, 0, "alpha", priority=5, mem_need=4096):
            with bubble.Task(job, 0, "beta"):
                # The trainer's service thread lists a task shortly after its attach returns.
                assert eventually(lambda: len(trainer.tasks()) == 2)
                infos = {t.name: t for t in trainer.tasks()}
                assert set(infos) == {"alpha", "beta"}
                assert infos["alpha"].priority == 5
                assert infos["alpha"].mem_need == 4096
                assert infos["alpha"].id != infos["beta"].id
            assert eventually(lambda: [t.name for t in trainer.tasks()] == ["alpha"])


def test_closing_the_trainer_removes_the_hub(job):
    with bubble.Trainer(job, 0):
        pass
    with pytest.raises(bubble.HubNotFound):
        bubble.Task(job, 0, "late")
    with bubble.Trainer(job, 0):  # the name is free again
        pass


def test_set_schedule_accepts_a_1f1b_pipeline_and_names_what_it_rejects(job):
    with bubble.Trainer(job, 0) as trainer:
        trainer.set_schedule(stages=4, microbatches=8, stage=1, fwd=0.002, bwd=0.004)
        with pytest.raises(bubble.InvalidArgument, match="stage"):
            trainer.set_schedule(bubble.ScheduleKind.GPIPE, stages=4, microbatches=8, stage=4,
                                 fwd=0.002, bwd=0.004)
