"""Nothing is lost: an agent killed with SIGKILL and restarted keeps every submission and every
result, re-adopts tasks still alive (by pid and start time), and never adopts a reused pid."""
import contextlib
import os
import re
import select
import signal
import socket
import sqlite3
import subprocess

from conftest import BUBBLECTL, BUBBLED, TASK_GOOD, decode, read_frame, wait_until
from procs import pids_with_env
from test_metrics import scrape


def gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_agent_killed_and_restarted_keeps_everything(env, tmp_path):
    env.trainer("j", 0)
    env.start_agent("--stop-timeout-ms", "1000")
    done = env.submit("/bin/true")
    env.wait_state(done, "finished")
    # Ends only once the gate exists, which is made after the agent is killed.
    gate = tmp_path / "gate"
    ends_while_down = env.submit(
        "/bin/sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 5")
    long = env.submit(TASK_GOOD, "0")
    victim = env.submit(TASK_GOOD, "0")
    queued = env.submit("/bin/true", opts=("--hub", "nosuch:0"))
    for t in (ends_while_down, long, victim):
        env.wait_state(t, "running")
    before = env.tasks()
    env.kill_agent(signal.SIGKILL)
    assert not gone(before[ends_while_down]["pid"])  # it ends while the agent is down, not before

    # While the agent is down: one task ends by itself; another dies and its pid is "reused" by
    # an unrelated process, which the restarted agent must not take for the task.
    gate.touch()
    wait_until("the short task to end", lambda: gone(before[ends_while_down]["pid"]))
    os.killpg(before[victim]["pid"], signal.SIGKILL)
    wait_until("the victim to die", lambda: gone(before[victim]["pid"]))
    # The stranger leads a process group of its own, numbered like the dead task's group was.
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        db = sqlite3.connect(os.path.join(env.state, "bubbled.db"))
        # The row keeps the task's start time: the stranger is not the task, and its group,
        # which started later, is not the task's either (it lacks the task's environment).
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


def test_only_the_newest_ended_tasks_are_kept_with_their_logs_and_actions(env):
    """A node agent runs for months: its records keep the newest --keep-ended ended tasks, and
    the older ones go with their logs and actions. Queued and live tasks are never deleted, a
    lowered bound applies at the next start, and ids are never handed out again."""
    env.trainer("j", 0)
    # A generous grace: a late ack on a busy machine must not add actions or kill `live`.
    env.start_agent("--keep-ended", "2", "--grace-ms", "500")
    live = env.submit(TASK_GOOD, "0")
    queued = env.submit("/bin/true", opts=("--hub", "nosuch:0"))
    env.wait_state(live, "running")
    cancelled = env.submit(TASK_GOOD, "0")
    env.wait_state(cancelled, "running")
    env.ctl("cancel", str(cancelled))
    env.wait_state(cancelled, "cancelled")
    acts = [line.split() for line in env.ctl("actions").stdout.splitlines()[1:]]
    assert [a[4] for a in acts if a[1] == str(cancelled)] == ["cancel"], acts
    ended = [cancelled]
    for i in range(3):
        tid = env.submit("/bin/sh", "-c", f"echo output-{i}")
        env.wait_state(tid, "finished")
        ended.append(tid)
    logs = os.path.join(env.state, "logs")
    wait_until("the two oldest ended tasks deleted",
               lambda: set(env.tasks()) == {live, queued, ended[2], ended[3]})
    for tid in ended[:2]:
        assert not os.path.exists(os.path.join(logs, f"{tid}.out"))
        assert not os.path.exists(os.path.join(logs, f"{tid}.err"))
        r = env.ctl("logs", str(tid), check=False)
        assert r.returncode != 0 and "keeps the newest 2 ended tasks" in r.stderr, r.stderr
    assert env.ctl("logs", str(ended[3])).stdout.strip() == "output-2"
    acts = [line.split() for line in env.ctl("actions").stdout.splitlines()[1:]]
    assert not [a for a in acts if a[1] == str(cancelled)], acts
    st = env.status()
    assert st["pruned"] == 2 and st["keep_ended"] == 2, st
    assert "records: the newest 2 ended tasks are kept; 2 older deleted" in env.ctl("status").stdout
    db = sqlite3.connect(os.path.join(env.state, "bubbled.db"))
    try:
        ids = {r[0] for r in db.execute("SELECT id FROM tasks")}
        assert ids == {live, queued, ended[2], ended[3]}
        assert db.execute("SELECT COUNT(*) FROM actions WHERE task = ?", (cancelled,)).fetchone() \
            == (0,)
    finally:
        db.close()

    # A lower bound takes effect at the next start; the live and queued tasks stay. Log files
    # of tasks not in the records (an agent stopped between the two deletions) go then too,
    # and nothing else in the directory.
    env.kill_agent(signal.SIGTERM)
    for name in ("99999.out", "99999.err", "notes.txt"):
        with open(os.path.join(logs, name), "w") as f:
            f.write("x")
    env.start_agent("--keep-ended", "1", "--grace-ms", "500")
    assert set(env.tasks()) == {live, queued, ended[3]}
    assert env.status()["pruned"] == 3
    assert not os.path.exists(os.path.join(logs, f"{ended[2]}.out"))
    assert not os.path.exists(os.path.join(logs, "99999.out"))
    assert not os.path.exists(os.path.join(logs, "99999.err"))
    assert os.path.exists(os.path.join(logs, "notes.txt"))
    # Ids are never reused: a new task gets a fresh one.
    fresh = env.submit("/bin/true")
    assert fresh > max(ended)
    env.wait_state(fresh, "finished")
    wait_until("the older of the two ended tasks deleted",
               lambda: set(env.tasks()) == {live, queued, fresh})
    env.ctl("cancel", str(live))
    env.wait_state(live, "cancelled")


def test_keep_ended_must_be_a_positive_count(env):
    r = subprocess.run([BUBBLED, "--keep-ended", "0"], capture_output=True, text=True, timeout=10)
    assert r.returncode != 0
    assert "--keep-ended 0 must be a whole number from 1 to 100000000" in r.stderr


def test_rows_from_before_a_restart_of_the_node_are_ended_without_touching_their_pids(env):
    """A pid and a start time name a process within one boot only. Rows written before the node
    restarted are ended as lost, and nothing is signalled or adopted by their pids (which may be
    anybody's by then). The restart is simulated: the record of the boot is changed while the
    agent is down, and the task, still alive here, stands for a process that reuses its pid."""
    env.trainer("j", 0)
    env.start_agent()
    tid = env.submit(TASK_GOOD, "0")
    pid = env.wait_state(tid, "running")["pid"]
    env.kill_agent(signal.SIGKILL)
    db = sqlite3.connect(os.path.join(env.state, "bubbled.db"))
    assert db.execute("SELECT value FROM meta WHERE key = 'boot_id'").fetchone()
    db.execute("UPDATE meta SET value = 'an-earlier-boot' WHERE key = 'boot_id'")
    db.commit()
    db.close()
    try:
        env.start_agent()
        t = env.task(tid)
        assert t["state"] == "lost" and "node restarted" in t["message"], t
        assert not gone(pid), "the agent signalled a pid of an earlier boot"
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        db = sqlite3.connect(os.path.join(env.state, "bubbled.db"))
        assert db.execute("SELECT value FROM meta WHERE key = 'boot_id'").fetchone()[0] == boot
        db.close()
    finally:
        os.killpg(pid, signal.SIGKILL)  # the task the agent left alone


def _outsider_left_with_its_trainer(env, kill_trainer):
    """A task that attached by itself, whose trainer ends while the agent is down: it leaves
    its hub and lives on. Returns its row and process."""
    trainer = env.trainer("j", 0)
    env.start_agent()
    out = os.path.join(env.root, "outsider.out")
    ext = env.spawn([TASK_GOOD, "0", "200", "600"], "outsider.out",
                    env=dict(env.env, BUBBLE_JOB="j", BUBBLE_RANK="0", BUBBLE_TASK_NAME="outsider"))
    t = wait_until("the external task to be adopted",
                   lambda: [t for t in env.tasks().values() if t["name"] == "outsider"])[0]
    assert t["state"] == "running"
    env.kill_agent()
    if kill_trainer:
        trainer.kill()  # its socket file stays behind
        trainer.wait(timeout=30)
    else:
        trainer.terminate()
        assert trainer.wait(timeout=30) == 0
    wait_until("the task to leave its hub", lambda: "detached" in open(out).read())
    assert ext.poll() is None  # it lives on, without a hub
    env.start_agent()
    return t, ext


def test_a_task_whose_trainer_died_while_the_agent_was_down_is_not_kept_running(env):
    """The same, its trainer killed: the socket it left names a hub nobody answers on. Once the
    agent gives up on it, the row ends."""
    t, ext = _outsider_left_with_its_trainer(env, kill_trainer=True)
    t = env.wait_state(t["id"], ("finished", "lost"))
    assert "does not answer" in t["message"], t
    assert ext.poll() is None


def test_a_task_that_left_its_hub_while_the_agent_was_down_is_not_kept_running(env):
    """A task that attached by itself is known by its hub's snapshots only. If it leaves while
    the agent is down (here with its trainer, which closes its hub), the restarted agent sees
    neither again: it ends the row instead of showing it running for good, although the
    process lives on."""
    t, ext = _outsider_left_with_its_trainer(env, kill_trainer=False)
    t = env.wait_state(t["id"], ("finished", "lost"))
    assert "was gone when the agent came back" in t["message"], t
    assert ext.poll() is None


def test_a_task_that_left_a_live_hub_while_the_agent_was_down_is_ended(env):
    """The same with the hub still there: the restarted agent's first snapshot of it does not
    show the task, so the task had detached."""
    env.trainer("j", 0)
    env.start_agent()
    ext = env.spawn([TASK_GOOD, "0", "200", "600"], "outsider.out",
                    env=dict(env.env, BUBBLE_JOB="j", BUBBLE_RANK="0", BUBBLE_TASK_NAME="outsider"))
    t = wait_until("the external task to be adopted",
                   lambda: [t for t in env.tasks().values() if t["name"] == "outsider"])[0]
    env.kill_agent()
    ext.send_signal(signal.SIGUSR1)  # its work done, it detaches and lives on
    out = os.path.join(env.root, "outsider.out")
    wait_until("the task to leave its hub", lambda: "detached" in open(out).read())
    env.start_agent()
    t = env.wait_state(t["id"], ("finished", "lost"))
    assert t["state"] == "finished" and "detached from hub j:0 while the agent was down" in \
        t["message"], t
    assert ext.poll() is None


def test_a_drained_hub_stays_drained_across_a_restart(env):
    """An operator took a hub out of service: an agent restarted (an upgrade, say) must not put
    tasks back on it; undrain is remembered the same way."""
    trainer = env.trainer("j", 0)
    env.start_agent()
    wait_until("the hub", lambda: env.hub("j:0") is not None)
    env.ctl("drain", "--hub", "j:0")
    env.kill_agent()
    env.start_agent()
    assert wait_until("the hub seen again", lambda: env.hub("j:0"))["draining"]
    tid = env.submit(TASK_GOOD, "5")
    assert env.task(tid)["state"] == "queued"  # its only hub is draining
    env.ctl("undrain", "--hub", "j:0")
    assert env.wait_state(tid, ("finished", "failed"))["state"] == "finished"
    env.kill_agent(signal.SIGTERM)
    env.start_agent()
    assert not wait_until("the hub seen again", lambda: env.hub("j:0"))["draining"]
    # A drain remembered for a hub that is not back (its job ended) can still be undone.
    env.ctl("drain", "--hub", "j:0")
    env.kill_agent()
    trainer.terminate()
    assert trainer.wait(timeout=30) == 0
    env.start_agent()
    assert "when it comes back" in env.ctl("undrain", "--hub", "j:0").stdout
    env.trainer("j", 0)
    assert not wait_until("the hub back", lambda: env.hub("j:0"))["draining"]


def test_a_cancel_stays_a_cancel_across_restarts(env):
    """A task still stopping after a cancel is stopped again by a restarted agent, for the same
    reason: however many restarts come before it ends, it ends cancelled, and is not run again
    as if it had been stopped to be placed elsewhere."""
    env.trainer("j", 0)
    # It ignores SIGTERM (so does its sleep), and the stop's SIGKILL is far beyond the test.
    opts = ("--stop-timeout-ms", "600000")
    env.start_agent(*opts)
    tid = env.submit("/bin/sh", "-c", "trap '' TERM; while :; do sleep 0.05; done")
    pid = env.wait_state(tid, "running")["pid"]
    env.ctl("cancel", str(tid))
    assert env.task(tid)["state"] == "stopping"
    for _ in range(2):
        env.kill_agent(signal.SIGKILL)
        env.start_agent(*opts)
        assert env.task(tid)["state"] == "stopping"
        assert "cancel" in env.task(tid)["message"], env.task(tid)
    os.killpg(pid, signal.SIGKILL)
    t = env.wait_state(tid, ("cancelled", "failed", "finished", "killed", "queued", "running"))
    assert t["state"] == "cancelled" and t["attempts"] == 1, t


def test_a_task_drained_while_the_agent_was_down_is_placed_again(env):
    """A drain stops a hub's tasks to place them on other hubs. One that obeyed the stop while
    the agent was down is placed again by the restarted agent, as a running agent would."""
    env.trainer("j", 0)
    env.start_agent()
    tid = env.submit(TASK_GOOD, "0")  # placed by the agent: on j:0, the only hub yet
    pid = env.wait_state(tid, "running")["pid"]
    assert env.task(tid)["hub"] == "j:0"
    wait_until("the task on its hub", lambda: env.hub("j:0")["tasks"] >= 1)
    env.trainer("k", 0)
    wait_until("the second hub", lambda: env.hub("k:0") is not None)
    env.ctl("drain", "--hub", "j:0")
    env.kill_agent(signal.SIGKILL)
    wait_until("the task to obey the stop", lambda: gone(pid))
    env.start_agent()
    t = wait_until("the task ended or running on k:0",
                   lambda: (t := env.task(tid))["state"] not in ("queued", "running", "stopping")
                   or (t["state"] == "running" and t["hub"] == "k:0") and t)
    assert t["state"] == "running" and t["hub"] == "k:0" and t["attempts"] == 2, t


class _Waiter:
    """`bubblectl wait TID` running: what it says on stderr, line by line, and how it ends."""

    def __init__(self, env, tid, *opts):
        self.p = subprocess.Popen([BUBBLECTL, "--socket", env.socket, "wait", str(tid), *opts],
                                  env=env.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)

    def said(self, what):
        """Its next line on stderr (also returns if it ended)."""
        wait_until(what, lambda: self.p.poll() is not None
                   or select.select([self.p.stderr], [], [], 0)[0])
        return self.p.stderr.readline()

    def finished(self):
        """Asserts it reports the task finished (exit 0)."""
        out, err = self.p.communicate(timeout=60)
        assert self.p.returncode == 0, (self.p.returncode, out, err)
        assert out.startswith("finished"), out

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def test_wait_goes_on_through_a_restart_of_the_agent(env, tmp_path):
    """An agent being restarted (an upgrade) is not the task failing: `wait` tries again and
    reports how the task ends (exit 0: finished), not that the agent was gone (exit 4)."""
    env.trainer("j", 0)
    env.start_agent()
    gate = tmp_path / "gate"
    tid = env.submit("/bin/sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.02; done")
    env.wait_state(tid, "running")
    waiter = _Waiter(env, tid, "-v")
    try:
        # Its first look (-v says what it saw) is done before the agent goes.
        assert waiter.said("the first look") == f"task #{tid}: running\n"
        env.kill_agent(signal.SIGTERM)
        # It says so on stderr, and goes on (the agent is started again only after that).
        lost = waiter.said("the waiter to see the agent gone")
        assert "lost the agent" in lost and "trying again" in lost, (lost, waiter.p.poll())
        env.start_agent()
        gate.touch()
        waiter.finished()
    finally:
        waiter.stop()


def test_wait_rides_out_a_full_agent_and_tells_a_missing_task_from_a_failed_one(env, tmp_path):
    """An agent with every connection taken turns `wait` away for now: that is not the task
    failing (exit 1); `wait` tries again and reports the task's end. A task the agent does not
    know is exit 5, not 1."""
    env.trainer("j", 0)
    env.start_agent()
    r = env.ctl("wait", "999", check=False)
    assert r.returncode == 5 and "no task #999" in r.stderr, (r.returncode, r.stderr)
    gate = tmp_path / "gate"
    tid = env.submit("/bin/sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.02; done")
    env.wait_state(tid, "running")
    held = []
    try:
        # Every connection the agent admits, held open (it admits at most 128).
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(env.socket)
            held.append(s)
            s.settimeout(0.05)
            try:
                body = read_frame(s)  # only a refusal comes unasked
                assert "too many open connections" in str(decode(body)), decode(body)
                break
            except (socket.timeout, BlockingIOError):
                pass
            assert len(held) < 1000, "the agent never said it was full"
        waiter = _Waiter(env, tid)
        try:
            said = waiter.said("the waiter to say the agent is full")
            assert "too many open connections" in said and "trying again" in said, \
                (said, waiter.p.poll())
            for s in held:
                s.close()
            held.clear()
            gate.touch()
            waiter.finished()
        finally:
            waiter.stop()
    finally:
        for s in held:
            s.close()
        gate.touch()


def test_wait_says_what_is_wrong_with_its_options_and_when_no_agent_answers(env):
    r = env.ctl("wait", "1", "--timeout", "abc", check=False)
    assert r.returncode == 2 and "--timeout abc is not a number of seconds" in r.stderr, r.stderr
    r = env.ctl("wait", "1", "--timeout", check=False)
    assert r.returncode == 2 and "--timeout needs a value" in r.stderr, r.stderr
    # No agent ever answered: no retrying, exit 4 with the reason.
    r = env.ctl("wait", "1", check=False)
    assert r.returncode == 4 and "no agent at" in r.stderr, r.stderr
    env.start_agent()
    r = env.ctl("logs", "1", "--bytes", "0", check=False)
    assert r.returncode == 2 and "--bytes 0 must be 1..8388608" in r.stderr, r.stderr
    r = env.ctl("drain", "--hub", check=False)
    assert r.returncode == 2 and "--hub needs a value" in r.stderr, r.stderr
    r = env.ctl("trace", "--seconds", "5s", check=False)
    assert r.returncode == 2 and "--seconds 5s must be a number of seconds" in r.stderr, r.stderr


def test_a_record_the_agent_could_not_write_is_written_later_and_its_status_is_kept(env, tmp_path):
    """The database refuses a write (another process holds its write lock past the agent's
    0.25 s wait; a full disk does the same): the task's end is not lost. The row is written once the
    database takes writes again, and the exit status file stays until it is."""
    env.trainer("j", 0)
    env.start_agent()
    gate = tmp_path / "gate"
    tid = env.submit("/bin/sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 3")
    env.wait_state(tid, "running")
    path = os.path.join(env.state, "bubbled.db")

    def stored_state():
        db = sqlite3.connect(path, timeout=30)
        try:
            return db.execute("SELECT state FROM tasks WHERE id = ?", (tid,)).fetchone()[0]
        finally:
            db.close()

    lock = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        lock.execute("BEGIN IMMEDIATE")  # the write lock: the agent's writes fail after 0.25 s
        gate.touch()
        wait_until("the failed save logged", lambda: f"cannot save task #{tid}" in env.log_tail(),
                   timeout=60)
        assert stored_state() == "running"  # the database is behind
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    wait_until("the row written", lambda: stored_state() == "failed", timeout=60)
    # and the exit file it was read from, kept until then, is gone
    assert not os.path.exists(os.path.join(env.state, "run", f"{tid}.exit"))
    # What the agent wrote is what a restarted agent knows.
    env.kill_agent(signal.SIGKILL)
    env.start_agent()
    t = env.task(tid)
    assert t["state"] == "failed" and t["exit_code"] == 3, t


@contextlib.contextmanager
def _outsider_under_a_stopped_trainer(env):
    """A trainer and a task that attached to it by itself; the agent restarted while the
    trainer is stopped (a debugger, a suspended job). Yields (trainer, task, task id) past the
    agent's quick tries, the task's row kept; the trainer goes on (SIGCONT) on the way out."""
    trainer = env.trainer("j", 0)
    env.start_agent()
    ext = env.spawn([TASK_GOOD, "0"], "external.log",
                    env=dict(env.env, BUBBLE_JOB="j", BUBBLE_RANK="0", BUBBLE_TASK_NAME="outsider"))
    tid = wait_until("the external task to be adopted",
                     lambda: [t for t in env.tasks().values() if t["name"] == "outsider"])[0]["id"]
    env.kill_agent(signal.SIGKILL)
    os.kill(trainer.pid, signal.SIGSTOP)
    try:
        env.start_agent()
        # Past the quick tries (about 4.5 s): said once, and the task's row kept.
        wait_until("the quick tries over", lambda: "stopped or hung?" in env.log_tail()
                   or "no trainer answers" in env.log_tail(), timeout=60)
        assert env.task(tid)["state"] == "running", env.task(tid)
        yield trainer, ext, tid
    finally:
        os.kill(trainer.pid, signal.SIGCONT)


def test_a_hub_whose_trainer_is_stopped_is_observed_once_it_goes_on(env):
    """A stopped trainer holds the connection without answering. That is not a dead trainer's
    socket: the agent keeps trying it, slowly, keeps the rows of the tasks attached to it, and
    observes the hub once the trainer goes on, with those tasks under the ids they had."""
    with _outsider_under_a_stopped_trainer(env) as (trainer, ext, tid):
        pass
    wait_until("the hub observed again", lambda: (env.hub("j:0") or {}).get("alive"), timeout=60)
    t = env.task(tid)
    assert t["state"] == "running" and t["pid"] == ext.pid, t
    assert [x["id"] for x in env.tasks().values() if x["name"] == "outsider"] == [tid]


def test_a_stopped_hub_that_closes_before_it_is_observed_again_ends_its_tasks_rows(env):
    """As above, but the trainer goes on only to close its hub at once, and its task leaves
    with it, before the agent's next try: the row kept for the task must end then, not stay
    running for good (no snapshot of that hub will ever come to end it)."""
    with _outsider_under_a_stopped_trainer(env) as (trainer, ext, tid):
        assert "stopped or hung?" in env.log_tail()
        # Its stop cannot be asked meanwhile, and the refusal says why: not a hub that is gone.
        r = env.ctl("cancel", str(tid), check=False)
        assert r.returncode != 0 and "does not answer (stopped or hung?)" in r.stderr, r
        # Pending before it goes on: it closes its hub (its socket goes) as it resumes.
        os.kill(trainer.pid, signal.SIGTERM)
    trainer.wait(timeout=30)
    ext.wait(timeout=30)
    t = env.wait_state(tid, ("lost", "finished", "failed"), timeout=60)
    assert "closed before the agent could observe it" in t["message"], t


def test_writes_the_database_refuses_are_kept_and_made_once_it_takes_them(env):
    """A drain, and the actions and rows of a cancel, made while another process holds the
    database's write lock are not lost: the drain's reply says it is not saved yet, and the agent
    writes all of it once the lock is gone, so a restart then keeps the drain."""
    env.trainer("j", 0)
    env.start_agent()
    wait_until("the hub", lambda: env.hub("j:0") is not None)
    tid = env.submit(TASK_GOOD, "0")
    env.wait_state(tid, "running")
    db = sqlite3.connect(os.path.join(env.state, "bubbled.db"), timeout=30, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")  # the agent's writes now fail after their busy timeout
        out = env.ctl("drain").stdout
        assert "not saved yet" in out, out
        env.ctl("cancel", str(tid))
        db.execute("ROLLBACK")
        wait_until("the owed writes to be made", lambda: db.execute(
            "SELECT value FROM meta WHERE key = 'draining'").fetchone() == ("1",))
        wait_until("the cancel's action record", lambda: db.execute(
            "SELECT COUNT(*) FROM actions WHERE task = ? AND action = 'cancel'",
            (tid,)).fetchone()[0] >= 1)
    finally:
        db.close()
    assert env.wait_state(tid, ("cancelled", "killed"))["state"] in ("cancelled", "killed")
    env.kill_agent(signal.SIGTERM)
    env.start_agent()
    assert env.status()["draining"], env.status()


def test_a_process_holding_two_slots_ends_only_when_it_has_left_both(env):
    """A process that attached two slots of one hub is one task row: leaving one of them is not
    detaching, and its figures are both slots'."""
    env.trainer("j", 0)
    env.start_agent()
    out = os.path.join(env.root, "two.out")
    ext = env.spawn([TASK_GOOD, "0", "200", "600"], "two.out",
                    env=dict(env.env, BUBBLE_JOB="j", BUBBLE_RANK="0", BUBBLE_TASK_NAME="two",
                             BUBBLE_SECOND_SLOT="1"))
    wait_until("both slots attached", lambda: env.hub("j:0")["tasks"] == 2)
    t = wait_until("the process to be adopted",
                   lambda: [t for t in env.tasks().values() if t["name"] == "two"])[0]
    assert len([r for r in env.tasks().values() if r["pid"] == ext.pid]) == 1  # one row
    port = env.status()["metrics_port"]

    def slot_steps(name):  # the slot's own count, from the metrics (one series per slot)
        m = re.search(r'^bubble_side_task_steps_total\{task="' + name + r'",[^}]*\} (\d+)$',
                      scrape(port), re.M)
        return int(m.group(1)) if m else 0

    # The first slot has done far more steps than the second can do between two looks below.
    wait_until("steps of both slots", lambda: slot_steps("two") >= 2000 and slot_steps("second"),
               timeout=60)
    ext.send_signal(signal.SIGUSR1)  # the first slot's work is done: it detaches
    wait_until("the first slot to leave", lambda: "detached" in open(out).read())
    wait_until("the hub to show one slot", lambda: env.hub("j:0")["tasks"] == 1)
    # The row keeps the first slot's steps: it counts more than the second slot alone.
    row_steps = env.task(t["id"])["steps"]
    assert row_steps > slot_steps("second") + 1000, (row_steps, slot_steps("second"))
    before = env.hub("j:0")["bubbles"]
    wait_until("more bubbles", lambda: env.hub("j:0")["bubbles"] > before + 20)
    assert env.task(t["id"])["state"] == "running", env.task(t["id"])
    ext.send_signal(signal.SIGUSR2)
    wait_until("the second slot to leave", lambda: "second detached" in open(out).read())
    t = env.wait_state(t["id"], ("finished", "failed", "lost"))
    assert t["state"] == "finished" and "detached from hub j:0" in t["message"], t
    assert ext.poll() is None


def _wrappers(env, tid):
    """Launch wrappers of this test's agent running for task tid (each task process has one)."""
    out = []
    want = f"\0--exec-task\0{env.state}/run/{tid}.exit\0".encode()
    for pid in pids_with_env(f"BUBBLE_TASK_ID={tid}\0"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if want in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def _set_launching(env, tid, hub):
    db = sqlite3.connect(os.path.join(env.state, "bubbled.db"))
    db.execute("UPDATE tasks SET state = 'launching', hub = ?, attempts = 1, pid = 0 "
               "WHERE id = ?", (hub, tid))
    db.commit()
    db.close()


def test_a_launch_the_agent_died_in_is_settled_never_launched_twice(env):
    """The agent records a launch before it spawns the task, and the pid after. Killed between
    the two, it leaves rows marked as launching (made here by hand while it is down, with the
    wrapper started as the agent starts it). The restarted agent adopts a wrapper that runs,
    ends by its exit file one that ran, and places again one that never started; it launches
    no second copy of any."""
    env.start_agent()  # no hub yet: the tasks stay queued
    runs = env.submit(TASK_GOOD, "0")
    ran = env.submit("/bin/true")
    never = env.submit(TASK_GOOD, "0")
    env.kill_agent(signal.SIGKILL)
    for tid in (runs, ran, never):
        _set_launching(env, tid, "j:0")
    env.trainer("j", 0)
    exit_file = os.path.join(env.state, "run", f"{runs}.exit")
    wrapper = env.spawn([BUBBLED, "--exec-task", exit_file, "--", TASK_GOOD, "0"], "wrapper.out",
                        env=dict(env.env, BUBBLE_JOB="j", BUBBLE_RANK="0",
                                 BUBBLE_TASK_ID=str(runs), BUBBLE_TASK_NAME="runs"),
                        start_new_session=True)
    with open(os.path.join(env.state, "run", f"{ran}.exit"), "w") as f:
        f.write("exit 4\n")
    wait_until("the wrapper's task on the hub", lambda: os.path.exists(exit_file) or
               "attached" in open(os.path.join(env.root, "wrapper.out")).read())
    assert wrapper.poll() is None, open(os.path.join(env.root, "wrapper.out")).read()
    env.start_agent()
    t = env.task(runs)
    assert t["state"] == "running" and t["pid"] == wrapper.pid, t
    assert "found running after the agent restarted" in t["message"], t
    t = env.task(ran)
    assert t["state"] == "failed" and t["exit_code"] == 4, t
    env.wait_state(never, "running")
    wait_until("both tasks on the hub", lambda: env.hub("j:0")["tasks"] == 2)
    assert _wrappers(env, runs) == [wrapper.pid]
    assert len(_wrappers(env, never)) == 1
    assert not [r for r in env.tasks().values() if r["origin"] == "attached"], env.tasks()
    # The adopted wrapper is supervised: a cancel ends it and is recorded.
    env.ctl("cancel", str(runs))
    assert env.wait_state(runs, ("cancelled", "killed"))["state"] == "cancelled"
    assert wrapper.wait(timeout=30) is not None


def test_a_launch_the_database_cannot_record_is_not_made(env):
    """While the database refuses writes, a task is not launched (it stays queued and is tried
    again): an agent killed then, and restarted, launches it once, not a second time next to
    a copy it never recorded."""
    env.start_agent()
    tid = env.submit(TASK_GOOD, "0")
    db = sqlite3.connect(os.path.join(env.state, "bubbled.db"), timeout=30, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        env.trainer("j", 0)
        wait_until("the launch refused", lambda: f"task #{tid} not launched yet: cannot record "
                   "the launch" in env.log_tail(), timeout=60)
        assert env.task(tid)["state"] == "queued"
        assert _wrappers(env, tid) == []
        env.kill_agent(signal.SIGKILL)
    finally:
        db.execute("ROLLBACK")
        db.close()
    env.start_agent()
    env.wait_state(tid, "running")
    wait_until("the task on the hub", lambda: env.hub("j:0")["tasks"] == 1)
    assert len(_wrappers(env, tid)) == 1


def test_an_agent_given_relative_directories_hands_its_tasks_absolute_ones(env, tmp_path):
    """Tasks run in their own directory (bubblectl's, or --cwd): relative directories given to
    the agent must reach them, and the launch wrapper's exit file, as absolute paths. Else the
    task looks for hubs in the wrong place, and its status, written while the agent is down,
    is lost."""
    env.trainer("j", 0)

    def start():
        env.agent = env.spawn([BUBBLED, "--socket", env.socket, "--state-dir", "rel-state",
                               "--runtime-dir", os.path.relpath(env.runtime, env.root),
                               "--metrics-port", "0", "--grace-ms", "500"], "agent.log",
                              cwd=env.root)
        wait_until("the agent's socket", lambda: env.ctl_ok("status"))

    start()
    gate = tmp_path / "gate"
    tid = env.submit("/bin/sh", "-c", 'echo "runtime=$BUBBLE_RUNTIME_DIR"; '
                     f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 3", opts=("--cwd", "/"))
    pid = env.wait_state(tid, "running")["pid"]
    try:
        wait_until("the task's output", lambda: "runtime=" in env.ctl("logs", str(tid)).stdout)
        assert f"runtime={env.runtime}\n" in env.ctl("logs", str(tid)).stdout
        env.kill_agent(signal.SIGKILL)
    finally:
        gate.touch()  # the task ends even when a check failed (teardown may not know it)
    wait_until("the task to end", lambda: gone(pid))
    start()
    t = env.task(tid)
    assert t["state"] == "failed" and t["exit_code"] == 3, t
