"""Memory grants through the Python binding: the trainer lends host memory, a task (on a thread
of this process) writes a pattern into its grant and the trainer reads it back at its own
address of the grant; then revoke and ack."""
from __future__ import annotations

import copy
import ctypes
import dataclasses
import pickle
import struct
import threading

import pytest

import bubble
from conftest import Background, bubble_until, eventually

GRANT = 64 * 1024
LENT = 1 << 20


def pattern(seed: int, size: int) -> bytes:
    return struct.pack(f"<{size // 4}I",
                       *((seed ^ (i * 2654435761)) & 0xFFFFFFFF for i in range(size // 4)))


def only_task(trainer: bubble.Trainer) -> bubble.TaskInfo:
    assert eventually(lambda: len(trainer.tasks()) == 1)
    return trainer.tasks()[0]


def test_host_grant_written_by_task_is_read_by_trainer_then_revoked_and_acked(job):
    written, acked, rewritten = [], [], []
    paused = threading.Event()
    quit_ = threading.Event()

    def task_side() -> str:
        with bubble.Task(job, 0, "granted", mem_need=GRANT) as task:
            start = task.wait_start(timeout=20)
            assert start is not None, "never started"
            g = start.grant
            assert g is not None and g.bytes == GRANT and g.backend is bubble.GrantBackend.HOST
            again = task.grant()  # the same mapping, and it says whether it is being revoked
            assert (again.id, again.ptr, again.revoking) == (g.id, g.ptr, False)
            assert (g.device, again.device) == (-1, -1), "a host grant names a GPU"
            again.memory[:] = pattern(7, GRANT)
            written.append(again.id)
            eventually(lambda: task.should_pause() or quit_.is_set())
            task.ack_pause()
            paused.set()
            with pytest.raises(ValueError):  # the view went with the call that may unmap
                again.memory[0]
            # Idle now: wait for the trainer to ask the grant back, then give it.
            seen: list[bubble.TaskGrant | None] = [None]

            def revoking() -> bool:
                seen[0] = task.grant()
                return quit_.is_set() or (seen[0] is not None and seen[0].revoking)
            assert eventually(revoking) and not quit_.is_set(), "no revoke"
            assert seen[0].revoke_deadline_ns > bubble.now_ns()
            task.ack_revoke()
            assert task.grant() is None, "still mapped after ack_revoke"
            acked.append(seen[0].id)
            # The trainer grants again on request: the new grant is mapped on the next look.
            assert eventually(lambda: quit_.is_set() or (seen.__setitem__(0, task.grant())
                                                         or seen[0] is not None))
            assert not quit_.is_set()
            seen[0].memory[:] = pattern(11, GRANT)
            rewritten.append(seen[0].id)
            while not quit_.is_set():
                try:
                    task.wait_start(timeout=0.1)
                except bubble.Stopped:
                    return "stopped"
            return "quit"

    with bubble.Trainer(job, 0) as trainer:
        trainer.lend(LENT)
        with pytest.raises(bubble.Busy):
            trainer.lend(LENT)
        runner = Background(task_side)
        try:
            task = only_task(trainer)
            # auto_grant: the attach with a mem_need is granted without being asked.
            assert eventually(lambda: trainer.task_grant(task) is not None)
            assert bubble_until(trainer, lambda: bool(written))
            g = trainer.task_grant(task)
            assert g.id == written[0] and g.task_id == task.id
            assert g.state is bubble.GrantState.ACTIVE
            assert g.backend is bubble.GrantBackend.HOST
            assert g.bytes == GRANT and g.mapped
            # The trainer reads what the task wrote at its own address of the grant.
            assert g.memory().tobytes() == pattern(7, GRANT)
            # ... or copies it out, which a release waits for.
            assert trainer.read_grant(g) == pattern(7, GRANT)
            assert trainer.read_grant(g.id, 8, offset=16) == pattern(7, GRANT)[16:24]
            into = bytearray(12)
            assert trainer.read_grant(g, into=into, offset=4) is None
            assert bytes(into) == pattern(7, GRANT)[4:16]
            raw = bytearray(8)
            buf = (ctypes.c_ubyte * 8).from_buffer(raw)
            trainer.read_grant(g, 8, into=ctypes.addressof(buf))
            assert bytes(raw) == pattern(7, GRANT)[:8]
            with pytest.raises(bubble.InvalidArgument, match="outside grant"):
                trainer.read_grant(g, 8, offset=GRANT - 4)
            with pytest.raises(ValueError, match="size is needed"):
                trainer.read_grant(g.id)
            with pytest.raises(TypeError, match="read-only"):
                trainer.read_grant(g, into=bytes(4))
            assert trainer.read_grant(g, into=bytearray()) is None  # a liveness check
            s = trainer.grant_stats()
            assert s.backend is bubble.GrantBackend.HOST
            assert (s.capacity, s.active, s.granted_bytes, s.grants_made) == (LENT, 1, GRANT, 1)

            # Revoked once idle: a pending revoke would be acked by the pause's ack already.
            assert paused.wait(20)
            trainer.revoke(task, timeout=30)
            with pytest.raises(bubble.BubbleError):  # already revoking, or already given back
                trainer.revoke(task)
            assert eventually(lambda: trainer.grant_stats().revokes_acked == 1)
            assert eventually(lambda: acked == [g.id])  # the task says so after its ack
            assert trainer.task_grant(task) is None
            with pytest.raises(bubble.HubNotFound, match="is not live"):
                trainer.read_grant(g)  # given back: its bytes went with it
            s = trainer.grant_stats()
            assert (s.revokes, s.tasks_killed, s.active, s.granted_bytes) == (1, 0, 0, 0)
            assert s.free_bytes == s.capacity

            again = trainer.grant(task)
            assert again > g.id
            with pytest.raises(bubble.Busy):  # one grant per task
                trainer.grant(task)
            assert eventually(lambda: rewritten == [again])
            assert trainer.task_grant(task).memory().tobytes() == pattern(11, GRANT)

            trainer.stop_task(task)
            assert runner.join_result() == "stopped"
            # Detaching gave the grant back.
            assert eventually(lambda: trainer.grant_stats().active == 0)
            assert trainer.grant_stats().tasks_killed == 0
        finally:
            quit_.set()
            runner.join(20)


class Writer(bubble.SideTask):
    def __init__(self) -> None:
        self.written = 0
        self.without_grant = 0
        self.stale: memoryview | None = None

    def step(self, info: bubble.StepInfo) -> bool:
        g = info.grant
        if g is None or g.memory is None or len(g.memory) != g.bytes:
            self.without_grant += 1
        elif self.written != g.id:
            g.memory[:] = pattern(5, g.bytes)
            self.stale = g.memory
            self.written = g.id
        return False


def run_writer(job: str, trainer: bubble.Trainer, side: Writer):
    """Runs `side` as an iterative task with a mem_need on a thread, until it wrote its grant;
    returns the thread and the task's info."""
    def go():
        with bubble.Task(job, 0, "iterative-grant", mem_need=GRANT) as task:
            return task.run(side)
    runner = Background(go)
    task = only_task(trainer)
    assert bubble_until(trainer, lambda: side.written != 0)
    return runner, task


def test_side_task_writes_its_grant_in_steps_and_the_runtime_acks_the_revoke(job):
    side = Writer()
    with bubble.Trainer(job, 0) as trainer:
        trainer.lend(LENT)
        runner, task = run_writer(job, trainer, side)
        g = trainer.task_grant(task)
        assert g.id == side.written
        assert g.memory().tobytes() == pattern(5, GRANT)
        # A step's view is released when the step returns.
        with pytest.raises(ValueError):
            side.stale[0]
        # Between bubbles the runtime unmaps the revoked grant and acks by itself.
        trainer.revoke(task, timeout=30)
        assert eventually(lambda: trainer.grant_stats().revokes_acked == 1)
        assert trainer.task_grant(task) is None
        trainer.stop_task(task)
        assert runner.join_result() is bubble.Outcome.STOPPED
        # A task that needs memory is started only while it holds a grant.
        assert side.without_grant == 0
        assert eventually(lambda: trainer.grant_stats().active == 0)


def test_unlend_takes_the_grant_back_and_lend_may_lend_again(job):
    side = Writer()
    with bubble.Trainer(job, 0) as trainer:
        with pytest.raises(bubble.InvalidState):
            trainer.unlend()
        trainer.lend(LENT)
        runner, task = run_writer(job, trainer, side)
        first = side.written
        # Its steps ran inside bubbles: its own figure says so (from its reports, a moment later).
        assert eventually(lambda: trainer.tasks()[0].ns_in_bubbles > 0)
        held = trainer.task_grant(task)
        view = held.memory()
        assert view.tobytes() == pattern(5, GRANT)
        # The runtime gives the grant back between bubbles; unlend returns once it has.
        trainer.unlend(timeout=30)
        # The lent range is unmapped: the trainer's view of it was released first, so touching
        # it raises instead of faulting, and so does asking the old info for a new one.
        with pytest.raises(ValueError, match="released"):
            view[0]
        with pytest.raises(ValueError, match="unlent"):
            held.memory()
        s = trainer.grant_stats()
        assert s.backend is None and s.capacity == 0
        assert s.revokes_acked == 1 and s.tasks_killed == 0
        with pytest.raises(bubble.InvalidState):
            trainer.unlend()
        # Lent again, twice the size: the task is granted again, a new grant.
        trainer.lend(2 * LENT)
        assert bubble_until(trainer, lambda: side.written not in (0, first))
        assert trainer.grant_stats().capacity == 2 * LENT
        assert trainer.task_grant(task).id == side.written
        kept = trainer.task_grant(task).memory()
        assert kept.tobytes() == pattern(5, GRANT)
        trainer.stop_task(task)
        assert runner.join_result() is bubble.Outcome.STOPPED
    # Closing unmaps the lent range too, and releases the view first.
    with pytest.raises(ValueError, match="released"):
        kept[0]


def test_a_grant_looked_up_while_unlend_waits_gives_no_view_of_the_range_going(job):
    mapped, revoking, go = threading.Event(), threading.Event(), threading.Event()

    def task_side() -> str:
        with bubble.Task(job, 0, "slow-ack", mem_need=GRANT) as task:
            assert eventually(lambda: task.grant() is not None)
            mapped.set()  # revoked before it maps it, a task gives its grant back unasked
            # Holds the grant until the trainer, blocked in unlend, has looked it up.
            assert eventually(lambda: (g := task.grant()) is not None and g.revoking)
            revoking.set()
            assert go.wait(20)
            task.ack_revoke()
            return "acked"

    with bubble.Trainer(job, 0) as trainer:
        trainer.lend(LENT)
        runner = Background(task_side)
        task = only_task(trainer)
        assert mapped.wait(20)
        before = trainer.task_grant(task)
        view = before.memory()
        unlender = Background(lambda: trainer.unlend(timeout=30))
        try:
            assert revoking.wait(20)
            # Taken back, not yet given: looked up now, the grant is still in the range the
            # unlend is about to unmap, so it has no view to give, and the one from before
            # was released.
            during = trainer.task_grant(task)
            assert during is not None and during.state is bubble.GrantState.REVOKING
            with pytest.raises(ValueError, match="unlend"):
                during.memory()
            with pytest.raises(ValueError, match="released"):
                view[0]
            # Copies and pickles carry the data, not the views.
            assert dataclasses.asdict(during)["id"] == during.id
            assert copy.deepcopy(during) == during
            revived = pickle.loads(pickle.dumps(during))
            assert revived == during
            with pytest.raises(ValueError):
                revived.memory()
        finally:
            go.set()
        unlender.join_result()
        assert runner.join_result() == "acked"
        # Unmapped now: the lookups from before and during still give no view.
        for g in (before, during):
            with pytest.raises(ValueError, match="unlend"):
                g.memory()


def test_a_device_grant_has_no_host_view():
    g = bubble.GrantInfo(id=1, task_id=1, state=bubble.GrantState.ACTIVE,
                         backend=bubble.GrantBackend.CUDA_VMM, mapped=True, bytes=4096,
                         offset=0, address=1 << 40, deadline_ns=None)
    with pytest.raises(TypeError, match="device memory"):
        g.memory()


class TakesItsGrant(bubble.SideTask):
    """Takes its grant through Task.grant() in a step and keeps the view, as a task might."""

    def __init__(self) -> None:
        self.task: bubble.Task | None = None
        self.view: memoryview | None = None
        self.later: str | None = None  # what touching that view in a later step did

    def step(self, info: bubble.StepInfo) -> bool:
        if self.view is None:
            g = self.task.grant()
            if g is not None and g.memory is not None:
                self.view = g.memory
                self.view[0] = 7
        elif self.later is None:
            try:
                self.view[0]
                self.later = "read"
            except ValueError:
                self.later = "ValueError"
        return False


def run_until(job: str, trainer: bubble.Trainer, side, done) -> tuple[Background, bubble.TaskInfo]:
    """Runs `side` (which is handed its Task as side.task) as an iterative task with a mem_need
    on a thread, in bubbles until done() holds; returns the thread and the task's info."""
    def go():
        with bubble.Task(job, 0, type(side).__name__, mem_need=GRANT) as task:
            side.task = task
            return task.run(side)
    runner = Background(go)
    task = only_task(trainer)
    assert bubble_until(trainer, done)
    return runner, task


def test_a_grant_view_taken_in_a_side_task_method_ends_with_it(job):
    """Between two steps the runtime may unmap a revoked grant: a view taken through
    Task.grant() in a step goes with that step, as the step's own grant view does, so keeping
    it raises ValueError rather than faulting on memory that may be gone."""
    side = TakesItsGrant()
    with bubble.Trainer(job, 0) as trainer:
        trainer.lend(LENT)
        runner, task = run_until(job, trainer, side, lambda: side.later is not None)
        assert side.later == "ValueError"
        trainer.stop_task(task)
        assert runner.join_result() is bubble.Outcome.STOPPED


class AcksInsideItsStep(bubble.SideTask):
    """Takes its grant through Task.grant() in a step, then calls run (nested), ack_revoke,
    ack_pause and wait_start there, which the runtime refuses inside a run, and goes on using
    the view."""

    def __init__(self) -> None:
        self.task: bubble.Task | None = None
        self.refused: list[str] = []
        self.after: str | None = None  # what touching the view after the refusals did

    def step(self, info: bubble.StepInfo) -> bool:
        if self.after is not None:
            return False
        g = self.task.grant()
        if g is None or g.memory is None:
            return False
        view = g.memory
        view[0] = 9
        calls = [("run", lambda: self.task.run(self)), ("ack_revoke", self.task.ack_revoke),
                 ("ack_pause", self.task.ack_pause), ("wait_start", self.task.wait_start)]
        for name, call in calls:
            try:
                call()
            except bubble.InvalidState:
                self.refused.append(name)
        try:
            view[1] = view[0]
            self.after = "written"
        except ValueError:
            self.after = "ValueError"
        return False


def test_an_ack_refused_inside_a_run_leaves_the_steps_grant_views_usable(job):
    """The runtime refuses run, ack_revoke, ack_pause and wait_start from a task's own run (they
    would unmap the grant under the step): the refusal unmaps nothing, so it closes no view."""
    side = AcksInsideItsStep()
    with bubble.Trainer(job, 0) as trainer:
        trainer.lend(LENT)
        runner, task = run_until(job, trainer, side, lambda: side.after is not None)
        # A nested run is refused before it touches anything: it used to close the step's
        # views and clear the outer run's mark, so the acks after it closed them as well.
        assert side.refused == ["run", "ack_revoke", "ack_pause", "wait_start"]
        assert side.after == "written"
        trainer.stop_task(task)
        assert runner.join_result() is bubble.Outcome.STOPPED
