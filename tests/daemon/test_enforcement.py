"""A task that ignores pauses is stopped with SIGSTOP, continued at its hub's next bubble, and
killed after the configured number of violations; every action is recorded and shown."""
import os
import signal

from conftest import HOSTILE_TASK, TASK_GOOD, TASK_ROGUE, wait_until


def test_task_ignoring_pause_is_stopped_then_killed(env):
    env.trainer("j", 0)
    env.start_agent("--grace-ms", "20", "--kill-after", "3")
    tid = env.submit(TASK_ROGUE)
    t = env.wait_state(tid, ("killed", "failed", "finished"))
    assert t["state"] == "killed", t
    assert t["violations"] == 3
    acts = [line.split() for line in env.ctl("actions").stdout.splitlines()[1:]]
    kinds = [a[4] for a in acts if a[1] == str(tid)]
    assert kinds == ["stop", "continue", "stop", "continue", "kill"], kinds
    assert env.status()["actions"] == 5


def test_well_behaved_task_is_never_stopped(env):
    env.trainer("j", 0)
    # A generous grace: a task that acks is not punished for being descheduled on a busy machine.
    env.start_agent("--grace-ms", "500")
    tid = env.submit(TASK_GOOD, "60")
    t = env.wait_state(tid, ("finished", "failed", "killed"))
    assert t["state"] == "finished" and t["violations"] == 0
    assert "no enforcement actions" in env.ctl("actions").stdout


def test_hostile_task_is_marked_bad_and_the_trainer_goes_on(env):
    """A task that scribbles over its whole slot is found out by the trainer's validation; the
    agent adopts it, records it as bad once and shows it, and the hub keeps its bubbles."""
    env.trainer("j", 0)
    env.start_agent("--grace-ms", "500")
    sock = os.path.join(env.runtime, "j.0.sock")
    evil = env.spawn([HOSTILE_TASK, sock, "3"], "hostile.log")
    wait_until("the hostile task marked bad",
               lambda: any(line.split()[4:5] == ["bad"]
                           for line in env.ctl("actions").stdout.splitlines()[1:]))
    acts = [line.split() for line in env.ctl("actions").stdout.splitlines()[1:]]
    bad = [a for a in acts if a[4] == "bad"]
    assert len(bad) == 1, acts
    assert "marked bad" in env.ctl("list", "--all").stdout
    before = env.hub("j:0")["bubbles"]
    wait_until("bubbles go on", lambda: env.hub("j:0")["bubbles"] > before)
    evil.wait(timeout=30)
    assert evil.returncode == -signal.SIGSEGV  # its write into the trainer's pages faulted


def test_a_task_being_cancelled_is_not_stopped_again_nor_shown_running(env):
    """Cancelling a task that enforcement stopped continues it so it can stop. Until it is gone
    it is "stopping": enforcement neither stops it again (which would only delay the stop) nor
    marks it running (an agent restarted meanwhile would then forget the cancel)."""
    env.trainer("j", 0)
    # A stop timeout far beyond the test: the task stays `stopping` for as long as it runs.
    env.start_agent("--grace-ms", "20", "--kill-after", "1000", "--stop-timeout-ms", "600000")
    tid = env.submit(TASK_ROGUE)
    env.wait_state(tid, "stopped")
    env.ctl("cancel", str(tid))
    assert env.task(tid)["state"] == "stopping", (env.task(tid), env.ctl("actions").stdout)
    before = env.hub("j:0")["bubbles"]
    # Bubbles pass: each would have continued it (and found it not pausing, stopped it again).
    wait_until("three more bubbles", lambda: env.hub("j:0")["bubbles"] >= before + 3)
    assert env.task(tid)["state"] == "stopping"
    acts = [line.split() for line in env.ctl("actions").stdout.splitlines()[1:]]
    kinds = [a[4] for a in acts if a[1] == str(tid)]
    assert "cancel" in kinds, kinds
    after = kinds[kinds.index("cancel") + 1:]
    # The cancel's own continue, and nothing from enforcement after it.
    assert "stop" not in after and after.count("continue") <= 1, kinds
    os.killpg(env.task(tid)["pid"], signal.SIGKILL)  # it would never stop by itself
    t = env.wait_state(tid, ("cancelled", "failed", "killed", "finished"))
    assert t["state"] == "cancelled", t
