"""The Python side task of the cross-language test; same protocol as xlang_task.c."""
from __future__ import annotations

import os
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


def main() -> int:
    if len(sys.argv) != 6:
        print(f"usage: {sys.argv[0]} JOB RANK NAME run|loop STEP_MS", file=sys.stderr)
        return 2
    job, rank, name, mode, step_ms = sys.argv[1:]
    step_s = int(step_ms) / 1000
    with bubble.Task(job, int(rank), name) as task:
        emit("attached")
        if mode == "run":
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
