"""Placement by memory fit, priority and fairness across several hubs; queueing when nothing
fits; re-placement when a hub goes away; drain."""
import os

import pytest

from conftest import TASK_GOOD, wait_until

MiB = 1 << 20


def hubs_reported(env, names):
    return wait_until("hubs to report their free memory",
                      lambda: all((h := env.hub(n)) and h["bubbles"] > 0 for n in names))


def test_tasks_go_where_their_memory_fits(env):
    for rank, mib in [(0, 256), (1, 1024), (2, 4096)]:
        env.trainer("j", rank, free_mib=mib)
    env.start_agent()
    hubs_reported(env, ["j:0", "j:1", "j:2"])
    big = env.submit(TASK_GOOD, "0", opts=("--mem", "2G"))
    assert env.wait_state(big, "running")["hub"] == "j:2"
    # 4 GiB - 2 GiB granted leaves 2 GiB: 3 GiB fits nowhere and waits, saying why.
    huge = env.submit(TASK_GOOD, "0", opts=("--mem", "3G"))
    t = env.task(huge)
    assert t["state"] == "queued" and "MiB" in t["message"], t
    # 512 MiB fits j:1 and j:2; j:1 has fewer tasks.
    mid = env.submit(TASK_GOOD, "0", opts=("--mem", "512M"))
    assert env.wait_state(mid, "running")["hub"] == "j:1"
    # Needs no memory at all: the least loaded hub.
    small = env.submit(TASK_GOOD, "0")
    assert env.wait_state(small, "running")["hub"] == "j:0"
    assert env.hub("j:2")["mem_granted"] == 2048 * MiB
    # Freeing the big task's memory lets the queued one in.
    env.ctl("cancel", str(big))
    env.wait_state(big, ("cancelled",))
    assert env.wait_state(huge, "running")["hub"] == "j:2"


def test_memory_needs_that_would_wrap_the_sum_leave_the_hub_full(env):
    """A task that attaches by itself states any mem_need. Two of 2^63 bytes summed to 0 and
    the hub looked empty: a submitted task was placed on memory that was all spoken for."""
    env.trainer("j", 0, free_mib=4096)
    env.start_agent()
    hubs_reported(env, ["j:0"])
    for k in range(2):
        env.spawn([TASK_GOOD, "0"], f"greedy{k}.log",
                  env=dict(env.env, BUBBLE_JOB="j", BUBBLE_RANK="0",
                           BUBBLE_TASK_NAME=f"greedy{k}", BUBBLE_MEM_NEED=str(1 << 63)))
    wait_until("both to be adopted", lambda: len([t for t in env.tasks().values()
                                                  if t["name"].startswith("greedy")]) == 2)
    assert env.hub("j:0")["mem_granted"] == (1 << 64) - 1
    tid = env.submit(TASK_GOOD, "0", opts=("--mem", "1G"))
    t = env.task(tid)
    assert t["state"] == "queued" and "MiB" in t["message"], t


def test_higher_priority_is_placed_first(env):
    env.trainer("j", 0, free_mib=1024)
    env.start_agent("--stop-timeout-ms", "1000")
    hubs_reported(env, ["j:0"])
    env.ctl("drain")
    low = env.submit(TASK_GOOD, "0", opts=("--mem", "768M", "--priority", "1"))
    high = env.submit(TASK_GOOD, "0", opts=("--mem", "768M", "--priority", "5"))
    assert env.task(low)["state"] == "queued" and "draining" in env.task(low)["message"]
    env.ctl("undrain")
    assert env.wait_state(high, "running")["hub"] == "j:0"
    assert env.task(low)["state"] == "queued"


def test_task_is_replaced_when_its_hub_goes_away(env):
    t0 = env.trainer("j", 0, free_mib=2048)
    env.start_agent("--stop-timeout-ms", "1000")
    hubs_reported(env, ["j:0"])
    tid = env.submit(TASK_GOOD, "0", opts=("--mem", "1G"))
    assert env.wait_state(tid, "running")["hub"] == "j:0"
    env.trainer("j", 1, free_mib=512)  # too small for it
    hubs_reported(env, ["j:1"])
    t0.terminate()
    t0.wait(timeout=30)
    t = env.wait_state(tid, "queued")
    assert "went away" in t["message"]
    env.trainer("j", 2, free_mib=2048)
    t = env.wait_state(tid, "running")
    assert t["hub"] == "j:2" and t["attempts"] == 2
    acts = env.ctl("actions").stdout
    assert "replace" in acts


def test_drain_moves_tasks_off_a_hub(env):
    env.trainer("j", 0)
    env.trainer("j", 1)
    env.start_agent("--stop-timeout-ms", "1000")
    hubs_reported(env, ["j:0", "j:1"])
    tid = env.submit(TASK_GOOD, "0", opts=("--hub", "auto"))
    first = env.wait_state(tid, "running")["hub"]
    other = "j:1" if first == "j:0" else "j:0"
    wait_until("the task to attach", lambda: env.hub(first)["tasks"] == 1)
    out = env.ctl("drain", "--hub", first).stdout
    assert "draining" in out
    t = wait_until("the task to move", lambda: (t := env.task(tid))["hub"] == other
                   and t["state"] == "running" and t)
    assert t["attempts"] == 2
    assert [h for h in env.status()["hubs"] if h["name"] == first][0]["draining"]


@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-ipc"])
def test_a_task_on_a_trainers_second_gpu_maps_the_cuda_memory_it_is_lent(env, backend):
    """The agent launches a task with CUDA_VISIBLE_DEVICES set to its hub's GPU alone, so the
    trainer's device 1 is the task's device 0. The grant names its GPU by UUID, and the task
    maps it there and runs (a grant that named device 1 failed to map, and a task that needs
    memory never started). The CUDA driver is the test double, with two GPUs."""
    double = os.environ.get("CUDA_DOUBLE", "")
    if not double:
        pytest.skip("CUDA_DOUBLE (the driver double's path) is not set")
    env.env.update(BUBBLE_CUDA_DRIVER=double, BUBBLE_CUDA_DOUBLE_DEVICES="2")
    env.env.pop("CUDA_VISIBLE_DEVICES", None)
    env.trainer("j", 1, extra=("--lend", f"{backend}:16:1"))
    env.start_agent()
    hubs_reported(env, ["j:1"])
    tid = env.submit(TASK_GOOD, "20", opts=("--mem", "1M", "--hub", "j:1"))
    t = env.wait_state(tid, ("finished", "failed"))
    out = env.ctl("logs", str(tid)).stdout
    assert t["state"] == "finished", (t, out, env.ctl("logs", str(tid), "--stderr").stdout)
    assert "grant 1: 1048576 bytes" in out, out
    assert "done: BB_OK after 20 steps" in out, out
