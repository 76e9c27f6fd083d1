"""The Python side task of the cross-language test; same protocol as xlang_task.c, plus the
grant-run mode (an iterative task that fills its host grant in a step)."""
from __future__ import annotations

import os
import struct
import sys
import time

import bubble


def emit(line: str) -> None:
    print(line, flush=True)


def work(step_s: float) -> None:
    slow = os.environ.get("BUBBLE_XLANG_SLOW_FILE")
    if slow and os.path.exists(slow):
        emit("slow")
        step_s = 60.0
    time.sleep(step_s)


class XlangTask(bubble.SideTask):
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def step(self, info: bubble.StepInfo) -> bool:
        work(self.step_s)
        emit(f"step {info.bubble_seq}")
        return False

    def pause(self) -> None:
        emit("pause")


GRANT_BYTES = 64 * 1024


class GrantFiller(bubble.SideTask):
    """Fills each new grant with the test's pattern in a step."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.written = 0

    def step(self, info: bubble.StepInfo) -> bool:
        g = info.grant
        if g is None or g.memory is None:
            raise RuntimeError(f"started without a host grant: {g!r}")
        if g.id != self.written:
            g.memory[:] = struct.pack(f"<{g.bytes // 4}I", *(
                (self.seed ^ (i * 2654435761)) & 0xFFFFFFFF for i in range(g.bytes // 4)))
            self.written = g.id
            emit(f"granted {g.id}")
        time.sleep(0.001)
        return False

    def pause(self) -> None:
        emit("pause")


def main() -> int:
    if len(sys.argv) != 6:
        print(f"usage: {sys.argv[0]} JOB RANK NAME run|loop STEP_MS | grant-run SEED", file=sys.stderr)
        return 2
    job, rank, name, mode, step_ms = sys.argv[1:]
    step_s = int(step_ms) / 1000
    mem_need = GRANT_BYTES if mode == "grant-run" else 0
    with bubble.Task(job, int(rank), name, mem_need=mem_need) as task:
        emit("attached")
        if mode == "grant-run":
            if task.run(GrantFiller(int(step_ms))) is not bubble.Outcome.STOPPED:
                return 1
        elif mode == "run":
            if task.run(XlangTask(step_s)) is not bubble.Outcome.STOPPED:
                return 1
        else:
            for start in task.bubbles():
                while not task.should_pause():
                    t0 = time.monotonic_ns()
                    work(step_s)
                    task.report_step(time.monotonic_ns() - t0)
                    emit(f"step {start.bubble_seq}")
                emit("pause")  # bubbles() acks the pause when the body ends
    emit("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
