"""A side task that harvests a pipeline stage's bubbles: it fits a small model of its own, one
mini-batch per step, and records when each step ran.

    python3 harvester.py --job JOB --rank R --out FILE
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import bubble


class Harvester(bubble.SideTask):
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.x = torch.randn(64, 16)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.steps: list[list[int]] = []  # [bubble_seq, start_ns, end_ns]

    def step(self, info: bubble.StepInfo) -> bool:
        start = bubble.now_ns()
        self.opt.zero_grad()
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.opt.step()
        self.steps.append([info.bubble_seq, start, bubble.now_ns()])
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    deadline = time.monotonic() + 60
    while True:  # the stage opens its hub after torch starts up: wait for it
        try:
            task = bubble.Task(args.job, args.rank, f"harvester-{args.rank}")
            break
        except bubble.HubNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    harvester = Harvester()
    with task:
        outcome = task.run(harvester)
    with open(args.out, "w") as f:
        json.dump({"outcome": outcome.value, "steps": harvester.steps}, f)


if __name__ == "__main__":
    main()
