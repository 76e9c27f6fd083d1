"""Runs the two-stage pipeline, with or without libbubble side tasks, and prints the losses.

    python3 run.py [--bubbles] [--iterations N]

With --bubbles, each stage reports its receive waits as bubbles and one harvester side task
per stage fills them. Every process is killed if the run fails or times out.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_pipeline(workdir: str, *, bubbles: bool, iterations: int = 40, seed: int = 1234,
                 timeout: float = 120) -> dict:
    """Returns {"stages": [result of rank 0, rank 1], "harvesters": [...]} (JSON from each)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if bubbles:
        env.setdefault("BUBBLE_RUNTIME_DIR", workdir)
    job = f"torch-{os.getpid()}"
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(2):
            cmd = [sys.executable, str(HERE / "pipeline.py"), "--rank", str(rank),
                   "--store", workdir, "--out", f"{workdir}/stage{rank}.json",
                   "--iterations", str(iterations), "--seed", str(seed)]
            if bubbles:
                cmd += ["--bubbles", job, "--tasks", "1"]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        if bubbles:
            for rank in range(2):
                procs.append(subprocess.Popen(
                    [sys.executable, str(HERE / "harvester.py"), "--job", job, "--rank", str(rank),
                     "--out", f"{workdir}/harvester{rank}.json"], env=env, start_new_session=True))
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"{p.args[1]} {' '.join(p.args[2:4])} exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    load = lambda name: json.loads(Path(workdir, name).read_text())  # noqa: E731
    out = {"stages": [load(f"stage{r}.json") for r in range(2)]}
    if bubbles:
        out["harvesters"] = [load(f"harvester{r}.json") for r in range(2)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bubbles", action="store_true", help="report bubbles and run side tasks")
    ap.add_argument("--iterations", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bb-torch-") as workdir:
        out = run_pipeline(workdir, bubbles=args.bubbles, iterations=args.iterations)
    losses = out["stages"][1]["losses"]
    print(f"loss: first {losses[0]:.4f}  last {losses[-1]:.4f}")
    for r, h in enumerate(out.get("harvesters", [])):
        print(f"stage {r}: {len(out['stages'][r]['bubbles'])} bubbles, "
              f"{len(h['steps'])} side-task steps")


if __name__ == "__main__":
    main()
