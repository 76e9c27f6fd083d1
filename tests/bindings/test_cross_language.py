"""One trainer and side tasks in C, C++, Rust, Go and Python on one hub at once.

Every task is started in a bubble, paused at its end and finally stopped, one after another;
one task is SIGKILLed in the middle of a step and the others go on. The task programs are
built by CMake and cargo/go (paths in $BUBBLE_XLANG_*); see tests/bindings/CMakeLists.txt.
"""
from __future__ import annotations

import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import pytest

import bubble

from procs import Child, Children, poll_until

HERE = Path(__file__).resolve().parent
STEP_MS = "2"
BUBBLE_S = 0.05


def task_commands() -> dict[str, tuple[list[str], str]]:
    """name -> (command line before the common arguments, mode)."""
    def exe(var: str) -> list[str]:
        path = os.environ.get(var)
        if not path or not os.access(path, os.X_OK):
            pytest.fail(f"${var} must name the built task program (run this test through ctest)")
        return [path]
    return {
        "c-task": (exe("BUBBLE_XLANG_C"), "run"),
        "cpp-task": (exe("BUBBLE_XLANG_CPP"), "loop"),
        "rust-task": (exe("BUBBLE_XLANG_RUST"), "run"),
        "go-task": (exe("BUBBLE_XLANG_GO"), "loop"),
        "python-task": ([sys.executable, str(HERE / "xlang_task.py")], "run"),
    }


@pytest.fixture
def runtime_dir():
    # Short and private: hub sockets live here, and a socket path is limited to 108 bytes.
    path = tempfile.mkdtemp(prefix="bb-xl-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def steps_in(child: Child, seq: int, since: int) -> bool:
    return f"step {seq}" in child.lines[since:]


def begin(trainer: bubble.Trainer) -> int:
    """Begins a bubble and returns its sequence number (every bubble before it was closed)."""
    seq = trainer.stats().bubbles + 1
    trainer.bubble_begin(BUBBLE_S, kind=bubble.BubbleKind.STEADY)
    return seq


def eventually(pred, timeout: float = 20.0):
    return poll_until(pred, timeout, interval=0.005)


def run_one_bubble(trainer: bubble.Trainer, tasks: dict[str, Child]) -> str:
    """Opens a bubble, waits for the task that runs in it to step, closes it and waits for
    that task's pause. Returns the task's name.

    A task that has not acked its last pause yet is not started, and the trainer cannot see
    when that ack lands; a bubble in which nobody stepped is closed and another one opened."""
    for _ in range(20):
        marks = {name: c.mark() for name, c in tasks.items()}
        seq = begin(trainer)
        try:
            def stepped() -> list[str]:
                return [n for n, c in tasks.items() if steps_in(c, seq, marks[n])]
            eventually(stepped, timeout=2.0)
            names = stepped()
        finally:
            trainer.bubble_end()
        if names:
            assert len(names) == 1, f"max_running is 1, yet {names} stepped in one bubble"
            tasks[names[0]].wait_for(lambda l: l == "pause", since=marks[names[0]])
            return names[0]
    raise AssertionError("no task stepped in 20 bubbles")


def test_tasks_in_five_languages_share_one_hub(runtime_dir: str) -> None:
    job = f"xlang-{os.getpid()}"
    env = dict(os.environ, BUBBLE_RUNTIME_DIR=runtime_dir)
    slow_file = os.path.join(runtime_dir, "slow")
    victim = "go-task"
    with bubble.Trainer(job, 0, max_running=1, runtime_dir=runtime_dir) as trainer, \
            Children() as children:
        tasks: dict[str, Child] = {}
        for name, (argv, mode) in task_commands().items():
            child_env = dict(env, BUBBLE_XLANG_SLOW_FILE=slow_file) if name == victim else env
            tasks[name] = children.start(name, argv + [job, "0", name, mode, STEP_MS], child_env)
        for c in tasks.values():
            c.wait_for(lambda l: l == "attached")
        # The trainer's service thread lists a task shortly after its attach returns.
        assert eventually(lambda: sorted(t.name for t in trainer.tasks()) == sorted(tasks))

        # Started and paused in turn: round-robin among equal priorities, one per bubble.
        started: list[str] = []
        for _ in range(4 * len(tasks)):
            started.append(run_one_bubble(trainer, tasks))
            if set(started) == set(tasks):
                break
        assert set(started) == set(tasks), f"not every task was started: {started}"
        # Step reports reach the trainer's counters through its service thread.
        assert eventually(lambda: all(t.steps > 0 for t in trainer.tasks())), trainer.tasks()
        assert not any(t.running for t in trainer.tasks())

        # Killed in the middle of a step: the others go on.
        Path(slow_file).touch()
        for _ in range(4 * len(tasks)):
            marks = {name: c.mark() for name, c in tasks.items()}
            seq = begin(trainer)
            try:
                def ran() -> list[str]:
                    return [n for n, c in tasks.items() if steps_in(c, seq, marks[n])
                            or (n == victim and "slow" in c.lines[marks[n]:])]
                eventually(ran, timeout=2.0)
                names = ran()
                if names == [victim]:
                    tasks[victim].kill()  # in the middle of its step
            finally:
                trainer.bubble_end()
            for n in names:
                if n != victim:
                    tasks[n].wait_for(lambda l: l == "pause", since=marks[n])
            if tasks[victim].proc.returncode is not None:
                break
        assert tasks[victim].proc.returncode == -9, "the victim was never started"
        survivors = {n: c for n, c in tasks.items() if n != victim}

        assert eventually(lambda: victim not in {t.name for t in trainer.tasks()}), \
            "the killed task's slot was not reclaimed"

        before = {t.name: t.steps for t in trainer.tasks()}
        ran_after: set[str] = set()
        for _ in range(4 * len(survivors)):
            ran_after.add(run_one_bubble(trainer, survivors))
            if ran_after == set(survivors):
                break
        assert ran_after == set(survivors)
        # The dead task's slot is freed once the bubble thread has let go of it.
        assert eventually(lambda: trainer.stats().tasks_reclaimed == 1)
        assert eventually(lambda: all(t.steps > before[t.name] for t in trainer.tasks())), \
            (before, trainer.tasks())

        # Stopped in turn: each exits cleanly while the rest stay attached.
        for i, name in enumerate(survivors):
            info = next(t for t in trainer.tasks() if t.name == name)
            trainer.stop_task(info)
            c = survivors[name]
            c.wait_for(lambda l: l == "stopped")
            assert c.proc.wait(timeout=20) == 0, c.stderr_tail()
            assert eventually(lambda: name not in {t.name for t in trainer.tasks()})
            assert {t.name for t in trainer.tasks()} == set(list(survivors)[i + 1:])


GRANT_BYTES = 64 * 1024  # the mem_need of the task programs' grant modes


def grant_pattern(seed: int, size: int) -> bytes:
    return struct.pack(f"<{size // 4}I",
                       *((seed ^ (i * 2654435761)) & 0xFFFFFFFF for i in range(size // 4)))


def test_tasks_in_four_languages_fill_host_grants_the_trainer_reads(runtime_dir: str) -> None:
    """Each binding's task, in its own process, writes a pattern into the host memory it was
    granted; the trainer reads it at its own address of each grant, then revokes them all:
    the imperative tasks (C++, Go) ack with ack_revoke, the iterative ones (Rust, Python) are
    acked by their runtime between bubbles."""
    job = f"xgrant-{os.getpid()}"
    env = dict(os.environ, BUBBLE_RUNTIME_DIR=runtime_dir)
    commands = task_commands()
    modes = {"cpp-task": "grant-loop", "go-task": "grant-loop", "rust-task": "grant-run",
             "python-task": "grant-run"}
    seeds = {name: 1000 + i for i, name in enumerate(modes)}
    with bubble.Trainer(job, 0, max_running=1, runtime_dir=runtime_dir) as trainer, \
            Children() as children:
        trainer.lend(1 << 20)
        tasks = {name: children.start(name, commands[name][0] + [job, "0", name, mode,
                                                                  str(seeds[name])], env)
                 for name, mode in modes.items()}
        for c in tasks.values():
            c.wait_for(lambda l: l == "attached")
        assert eventually(lambda: sorted(t.name for t in trainer.tasks()) == sorted(tasks))
        infos = {t.name: t for t in trainer.tasks()}
        # Granted on attach (auto_grant), and started only while holding the grant.
        assert eventually(lambda: all(trainer.task_grant(i) for i in infos.values()))

        def granted(name: str) -> int | None:
            lines = [l for l in tasks[name].lines if l.startswith("granted ")]
            return int(lines[0].split()[1]) if lines else None
        for _ in range(20 * len(tasks)):
            pending = [n for n in tasks if granted(n) is None]
            if not pending:
                break
            trainer.bubble_begin(BUBBLE_S, kind=bubble.BubbleKind.STEADY)
            try:
                eventually(lambda: any(granted(n) is not None for n in pending), timeout=2.0)
            finally:
                trainer.bubble_end()
        assert all(granted(n) is not None for n in tasks), {n: c.lines for n, c in tasks.items()}
        for name, c in tasks.items():
            # Revoked once paused: a revoke pending at the pause's ack is acked by that ack.
            since = c.lines.index(f"granted {granted(name)}")
            c.wait_for(lambda l: l == "pause", since=since)
            g = trainer.task_grant(infos[name])
            assert g is not None and g.id == granted(name)
            assert g.backend is bubble.GrantBackend.HOST and g.bytes == GRANT_BYTES
            assert g.memory().tobytes() == grant_pattern(seeds[name], GRANT_BYTES), name

        for info in infos.values():
            trainer.revoke(info, timeout=30)
        for name, mode in modes.items():
            if mode == "grant-loop":
                tasks[name].wait_for(lambda l: l == f"acked {granted(name)}")
        assert eventually(lambda: trainer.grant_stats().revokes_acked == len(tasks))
        assert all(trainer.task_grant(i) is None for i in infos.values())
        stats = trainer.grant_stats()
        assert (stats.active, stats.granted_bytes, stats.tasks_killed) == (0, 0, 0)

        for name, c in tasks.items():
            trainer.stop_task(infos[name])
            c.wait_for(lambda l: l == "stopped")
            assert c.proc.wait(timeout=20) == 0, c.stderr_tail()
