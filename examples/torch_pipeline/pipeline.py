"""One stage of a two-stage pipeline-parallel MLP, trained with a 1F1B schedule over gloo.

    python3 pipeline.py --rank R --world 2 --store DIR --out FILE [--bubbles JOB --tasks N]

With --bubbles, the stage opens a libbubble hub (job JOB, rank R), publishes its schedule to the
predictor and reports its point-to-point receives as bubbles through
bubble.torch_hooks.P2PBubbles; without it, it is plain torch. The schedule and the model are the
same either way.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist
from torch import nn

FEATURES, HIDDEN = 32, 128
MICRO_BATCHES, MICRO_BATCH = 4, 16


def build_stage(rank: int, seed: int) -> nn.Module:
    # Every stage builds the whole model from one seed and keeps its half: the split model
    # starts from exactly the weights the unsplit one would.
    torch.manual_seed(seed)
    full = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                         nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    return full[:4] if rank == 0 else full[4:]


def dataset(seed: int, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return x, torch.tanh(x @ w / FEATURES ** 0.5) + 0.1 * x[:, :1]


def train(rank: int, iterations: int, seed: int, hooks) -> list[float]:
    """1F1B on two stages: stage 0 runs one warm-up forward, then alternates forward and
    backward, then drains one backward; stage 1 alternates from the start."""
    model = build_stage(rank, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x, y = dataset(seed)
    batch = MICRO_BATCHES * MICRO_BATCH
    warmup = 1 if rank == 0 else 0  # forwards before the first backward: p - rank - 1

    def phase(kind: str):
        # Tells the hook which part of the schedule a wait belongs to (plain torch: nothing).
        if hooks is None:
            return contextlib.nullcontext()
        from bubble import BubbleKind
        return hooks.phase(BubbleKind[kind])
    losses: list[float] = []

    for it in range(iterations):
        if hooks:
            hooks.iteration()
        lo = (it * batch) % x.shape[0]
        xs = x[lo:lo + batch].split(MICRO_BATCH)
        ys = y[lo:lo + batch].split(MICRO_BATCH)
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, output) per micro-batch
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        iter_loss = 0.0
        fwd = bwd = 0

        def forward() -> None:
            nonlocal fwd, iter_loss
            if rank == 0:
                inp = xs[fwd]
            else:
                inp = torch.empty(MICRO_BATCH, HIDDEN)
                dist.recv(inp, src=0)
                inp.requires_grad_()
            out = model(inp)
            if rank == 0:
                act = out.detach()
                sends.append((dist.isend(act, dst=1), act))
            else:
                out = nn.functional.mse_loss(out, ys[fwd]) / MICRO_BATCHES
                iter_loss += out.item()
            saved.append((inp, out))
            fwd += 1

        def backward() -> None:
            nonlocal bwd
            inp, out = saved[bwd]
            if rank == 0:
                grad = torch.empty(MICRO_BATCH, HIDDEN)
                dist.recv(grad, src=1)
                out.backward(grad)
            else:
                out.backward()
                g = inp.grad.detach()
                sends.append((dist.isend(g, dst=0), g))
            saved[bwd] = (None, None)
            bwd += 1

        opt.zero_grad()
        for _ in range(warmup):
            forward()
        for i in range(MICRO_BATCHES - warmup):
            # A later stage's first receive waits for the pipeline to fill.
            with phase("WARMUP" if i == 0 and rank > 0 else "STEADY"):
                forward()
            backward()
        with phase("COOLDOWN"):
            for _ in range(warmup):
                backward()
        for work, _ in sends:
            work.wait()
        opt.step()

        if rank == 1:
            sent = torch.tensor([iter_loss])  # float32 on the wire: both stages keep that value
            losses.append(float(sent))
            dist.send(sent, dst=0)
        else:
            got = torch.empty(1)
            dist.recv(got, src=1)
            losses.append(float(got))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--store", required=True, help="directory for the rendezvous file")
    ap.add_argument("--out", required=True, help="where to write the results (JSON)")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bubbles", metavar="JOB", help="report bubbles to a libbubble hub")
    ap.add_argument("--tasks", type=int, default=0, help="wait for this many side tasks")
    args = ap.parse_args()
    if args.world != 2:
        raise SystemExit("this example splits the model into exactly two stages: use --world 2")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}/rendezvous",
                            rank=args.rank, world_size=args.world)
    result: dict = {"rank": args.rank}
    try:
        if args.bubbles:
            import bubble
            from bubble.adapters import PipelineSchedule
            from bubble.torch_hooks import P2PBubbles

            sched = PipelineSchedule(stages=args.world, stage=args.rank,
                                     micro_batches=MICRO_BATCHES)
            with bubble.Trainer(args.bubbles, args.rank) as trainer, \
                    P2PBubbles(trainer, record=True, schedule=sched) as hooks:
                result["published"] = hooks.published
                result["receives_per_iteration"] = sched.receives_per_iteration()
                deadline = time.monotonic() + 60
                while len(trainer.tasks()) < args.tasks:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"no {args.tasks} side task(s) attached within 60 s")
                    time.sleep(0.01)
                dist.barrier()
                result["losses"] = train(args.rank, args.iterations, args.seed, hooks)
                result["bubbles"] = [[r.seq, int(r.kind), r.begin_ns, r.end_ns]
                                     for r in hooks.records]
                stats = trainer.stats()
                result["stats"] = {"steps": stats.steps, "bubbles": stats.bubbles,
                                   "task_ns_in_bubbles": stats.task_ns_in_bubbles,
                                   "task_ns_outside": stats.task_ns_outside}
        else:
            dist.barrier()
            result["losses"] = train(args.rank, args.iterations, args.seed, None)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
