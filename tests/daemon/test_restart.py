"""Nothing is lost: an agent killed with SIGKILL and restarted keeps every submission and every
result, re-adopts tasks still alive (by pid and start time), and never adopts a reused pid."""
import os
import signal
import sqlite3
import subprocess

from conftest import TASK_GOOD, wait_until


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_agent_killed_and_restarted_keeps_everything(env):
    env.trainer("j", 0)
    env.start_agent("--stop-timeout-ms", "1000")
    done = env.submit("/bin/true")
    env.wait_state(done, "finished")
    ends_while_down = env.submit("/bin/sh", "-c", "read x < /dev/null; sleep 1.5; exit 5")
    long = env.submit(TASK_GOOD, "0")
    victim = env.submit(TASK_GOOD, "0")
    queued = env.submit("/bin/true", opts=("--hub", "nosuch:0"))
    for t in (ends_while_down, long, victim):
        env.wait_state(t, "running")
    before = env.tasks()
    env.kill_agent(signal.SIGKILL)

    # While the agent is down: one task ends by itself; another dies and its pid is "reused" by
    # an unrelated process, which the restarted agent must not take for the task.
    wait_until("the short task to end", lambda: gone(before[ends_while_down]["pid"]))
    os.killpg(before[victim]["pid"], signal.SIGKILL)
    wait_until("the victim to die", lambda: gone(before[victim]["pid"]))
    stranger = subprocess.Popen(["sleep", "120"])
    try:
        db = sqlite3.connect(os.path.join(env.state, "bubbled.db"))
        db.execute("UPDATE tasks SET pid = ? WHERE id = ?", (stranger.pid, victim))
        db.commit()
        db.close()

        env.start_agent("--stop-timeout-ms", "1000")
        after = env.tasks()
        assert set(after) == set(before)
        assert after[done]["state"] == "finished"
        assert after[ends_while_down]["state"] == "failed"
        assert after[ends_while_down]["exit_code"] == 5
        assert after[long]["state"] == "running"
        assert after[long]["pid"] == before[long]["pid"]
        assert after[queued]["state"] == "queued"
        assert after[victim]["state"] == "lost", after[victim]
        assert stranger.poll() is None, "the agent signalled a process that merely reused a pid"
        for tid in before:
            assert after[tid]["argv"] == before[tid]["argv"]

        # The re-adopted task is still supervised: cancelling it ends it and records that.
        env.ctl("cancel", str(long))
        assert env.wait_state(long, ("cancelled", "killed", "failed"))["state"] == "cancelled"
        # And a clean restart keeps the records too.
        env.kill_agent(signal.SIGTERM)
        env.start_agent()
        final = env.tasks()
        assert final[long]["state"] == "cancelled"
        assert final[ends_while_down]["exit_code"] == 5
    finally:
        stranger.kill()
        stranger.wait()
