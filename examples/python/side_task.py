"""A side task that sums squares, one small chunk per step, only inside the trainer's bubbles."""
import sys

import bubble


class SumOfSquares(bubble.SideTask):
    def __init__(self) -> None:
        self.next = self.total = self.steps = 0

    def step(self, info: bubble.StepInfo) -> bool:
        self.total += sum(n * n for n in range(self.next, self.next + 10_000))
        self.next += 10_000
        self.steps += 1
        return False  # never done: runs until the trainer stops the task or leaves


job = sys.argv[1] if len(sys.argv) > 1 else "example"
with bubble.Task(job, 0, "python-side-task") as task:
    work = SumOfSquares()
    task.run(work)
print(f"{work.steps} steps, sum {work.total}")
