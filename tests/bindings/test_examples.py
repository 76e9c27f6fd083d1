"""Every language's example trainer and side task run together and the side task steps.

The programs come from examples/{cpp,rust,go,python}; their paths are in $BUBBLE_EXAMPLE_*
(set by tests/bindings/CMakeLists.txt).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from procs import Children

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def programs(lang: str) -> tuple[list[str], list[str]]:
    if lang == "python":
        return ([sys.executable, str(EXAMPLES / "python" / "trainer.py")],
                [sys.executable, str(EXAMPLES / "python" / "side_task.py")])
    found = []
    for role in ("TRAINER", "SIDE_TASK"):
        var = f"BUBBLE_EXAMPLE_{lang.upper()}_{role}"
        path = os.environ.get(var)
        if not path or not os.access(path, os.X_OK):
            pytest.fail(f"${var} must name the built example (run this test through ctest)")
        found.append([path])
    return found[0], found[1]


@pytest.mark.parametrize("lang", ["cpp", "rust", "go", "python"])
def test_example_trainer_lends_its_bubbles_to_the_example_side_task(lang):
    trainer_cmd, task_cmd = programs(lang)
    runtime_dir = tempfile.mkdtemp(prefix="bb-ex-")
    env = dict(os.environ, BUBBLE_RUNTIME_DIR=runtime_dir)
    job = f"example-{lang}-{os.getpid()}"
    try:
        with Children() as children:
            trainer = children.start("trainer", trainer_cmd + [job], env)
            trainer.wait_for(lambda l: l == "hub open")
            task = children.start("side task", task_cmd + [job], env)
            summary = trainer.wait_for(lambda l: "side-task steps" in l, timeout=60)
            assert trainer.proc.wait(timeout=30) == 0, trainer.stderr_tail()
            # The trainer left: the side task ends by itself and reports its work.
            assert task.proc.wait(timeout=30) == 0, task.stderr_tail()
            steps = int(re.search(r"^(\d+) steps", task.wait_for(lambda l: " steps" in l))[1])
            bubbles, trainer_steps = map(int, re.findall(r"\d+", summary))
            assert bubbles == 20
            assert steps > 0
            assert trainer_steps <= steps
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
