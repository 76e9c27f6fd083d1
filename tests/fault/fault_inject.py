#!/usr/bin/env python3
"""Fault injection: randomized rounds of killing side tasks, trainers and the agent at random
points, with every invariant checked after every round.

    fault_inject.py [--rounds N] [--agent-rounds M] [--seed S] [--soak SECONDS]

Environment (set by CTest): FAULT_TRAINER (bb_test_trainer), FAULT_TASK (bb_test_task), BUBBLED,
BUBBLECTL (built programs).
BB_FAULT_ROUNDS / BB_FAULT_AGENT_ROUNDS / BB_FAULT_SEED / BB_FAULT_SOAK_S override the flags'
defaults; --soak (or BB_FAULT_SOAK_S) keeps running rounds until that many seconds have passed.

Hub rounds (no agent): a trainer (bb_test_trainer --commands) lends host memory (auto grants)
and runs bubbles; 1..4 imperative tasks (bb_test_task --die-at ...) attach, some needing memory (so they hold grants), some waiting
for a restarted trainer. Each task may SIGKILL itself at a protocol point (attached, started,
inside a step, between seeing a pause and acking it, just after acking, holding a grant); the
driver SIGKILLs others from outside at random times (often while they wait for a start), and
may SIGKILL the trainer or close it cleanly, then starts a new one.

Agent rounds: bubbled supervises tasks submitted through bubblectl onto such a trainer;
the driver SIGKILLs the agent, the trainer or task processes at random and restarts them.

After every round, checked (a failure names the round and the seed to replay it):
  - the trainer never waited on a side task: every bb_bubble_begin/end returned BB_OK and the
    trainer's own count of completed bubbles advanced during the round;
  - once every task of the round is gone, the hub has no task attached, and every memory grant
    is accounted for: none active, revoking or quarantined, granted bytes 0, free = capacity;
  - no descriptor leaks: the trainer's /proc/<pid>/fd count is back to what it was with no task
    attached, the agent's likewise once its tasks ended, and this driver's own count is unchanged;
  - no process leaks: this driver's only children are the trainer (and the agent), and no
    process started for the round is left;
  - no segment appeared in /dev/shm, and the runtime dir is empty after a clean close;
  - every task ended by a SIGKILL, or returned after the hub told it the trainer went away
    (never by a crash or a sanitizer's exit), and an attached task that does not wait for a
    new trainer is told within 3 s that its trainer was killed or closed;
  - (agent rounds) every submitted task is queued, running or recorded as ended in
    `bubblectl list --all`, across agent restarts.
"""
import argparse
import collections
import fcntl
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import procs
from procs import pids_with_env

FAULT_TRAINER = os.environ.get("FAULT_TRAINER", "")
FAULT_TASK = os.environ.get("FAULT_TASK", "")
BUBBLED = os.environ.get("BUBBLED", "")
BUBBLECTL = os.environ.get("BUBBLECTL", "")

POINTS = ["never", "attached", "started", "step", "pause-seen", "acked", "grant"]
LIVE_STATES = {"queued", "running", "stopped", "stopping"}
FINAL_STATES = {"finished", "failed", "killed", "cancelled", "lost"}
# What a task was doing when the driver killed it, from its last line.
WHERE = {"ATTACHED": "just attached", "WAITING": "waiting for a start",
         "STARTED": "running in a bubble",
         "GRANT": "running in a bubble", "DYING": "about to kill itself", "RESULT": "returning"}
GRANT_BYTES = 1 << 20
LEND_BYTES = 16 << 20
DEADLINE_S = 20.0


class Failure(AssertionError):
    """A broken invariant; the timeouts of procs.wait_until are AssertionErrors too."""


def wait_until(what, pred, timeout=DEADLINE_S):
    # A short interval: the conditions polled here are cheap, and rounds are short.
    return procs.wait_until(what, pred, timeout, interval=0.01)


def check(cond, what):
    if not cond:
        raise Failure(what)


def fd_count(pid="self"):
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid):
    """(descriptors that are not sockets, sockets). A trainer's sockets are its listening
    socket plus one per connected task or observer; everything else it holds is fixed."""
    targets = fd_targets(pid).values()
    socks = sum(1 for t in targets if t.startswith("socket:"))
    return len(targets) - socks, socks


# What a trainer holds for each attached task besides its connection: the task's pidfd (shown as
# "pidfd:[N]" since Linux 6.9, "anon_inode:[pidfd]" before), its page and its grant. With no task
# attached there is none of them.
PER_TASK_FDS = ("anon_inode:[pidfd]", "pidfd:", "/memfd:bubble-task", "/memfd:bubble-grant")


def fixed_files(pid):
    """The descriptors a trainer holds whatever its tasks: neither sockets nor a task's own. A
    task (waiting to reattach, or launched by the agent) may attach the moment a hub opens."""
    return sum(1 for t in fd_targets(pid).values()
               if not t.startswith("socket:") and not t.startswith(PER_TASK_FDS))


def fd_targets(pid):
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def children_of_self():
    me = os.getpid()
    out = set()
    for tid in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return out


def dev_shm():
    """Entries of /dev/shm that could be libbubble's. Other programs on the machine (of other
    projects) come and go there, so only names that could be ours are compared."""
    return {n for n in os.listdir("/dev/shm") if "bubble" in n.lower() or n.startswith("bb")}


def maps_dev_shm(pid):
    """What the process maps from /dev/shm: libbubble shares memfds only, so nothing."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [l.split()[-1] for l in f if "/dev/shm/" in l]
    except OSError:
        return []


class Proc:
    """A child with its stdout read line by line (non-blocking) and stdin kept open."""

    def __init__(self, argv, env, stdin=False, log=None):
        self.argv = argv
        self.p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                  stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                  stderr=log if log else subprocess.DEVNULL)
        if log:
            log.close()  # the child has its own copy
        fl = fcntl.fcntl(self.p.stdout, fcntl.F_GETFL)
        fcntl.fcntl(self.p.stdout, fcntl.F_SETFL, fl | os.O_NONBLOCK)
        self.buf = b""
        self.lines = []  # the recent ones
        self.dropped = 0  # how many older ones were let go: line k of the output is lines[k - dropped]
        self.seen = set()  # the first word of every line so far
        self.last = ""

    @property
    def pid(self):
        return self.p.pid

    def pump(self):
        while True:
            try:
                chunk = os.read(self.p.stdout.fileno(), 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self.buf += chunk
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                s = line.decode(errors="replace")
                self.lines.append(s)
                self.seen.add(s.split(" ", 1)[0])
                self.last = s
                if len(self.lines) > 200:
                    del self.lines[:100]
                    self.dropped += 100

    @property
    def count(self):
        """How many lines the process printed so far: a `start` for wait_line that survives the
        trimming of old lines."""
        return self.dropped + len(self.lines)

    def wait_line(self, prefix, timeout=DEADLINE_S, start=0):
        """The first line starting with prefix, from line `start` of the output on (counted as
        `count` counts; the older lines it has let go of are not searched)."""
        end = time.monotonic() + timeout
        idx = start
        while True:
            open_ = self.pump()
            for i in range(max(idx - self.dropped, 0), len(self.lines)):
                if self.lines[i].startswith(prefix):
                    return self.lines[i]
            idx = self.count
            left = end - time.monotonic()
            if left <= 0 or not open_:
                return ""
            select.select([self.p.stdout], [], [], min(left, 0.2))

    def send(self, text):
        self.p.stdin.write(text.encode())
        self.p.stdin.flush()

    def kill(self):
        if self.p.poll() is None:
            try:
                self.p.kill()
            except ProcessLookupError:
                pass

    def reap(self, timeout=DEADLINE_S):
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Failure(f"{self.argv[0]} (pid {self.pid}) did not exit within {timeout:.0f} s")

    def close(self):
        self.kill()
        try:
            self.p.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.p.stdout, self.p.stdin):
            if f:
                f.close()


def parse_stats(line):
    check(line.startswith("STATS "), f"trainer gave no STATS line (got {line!r})")
    out = {}
    for kv in line.split()[1:]:
        k, v = kv.split("=", 1)
        out[k] = v if k == "pids" else int(v)
    out["pids"] = set() if out["pids"] == "-" else {int(p) for p in out["pids"].split(",")}
    return out


class Trainer:
    def __init__(self, world, job):
        self.world = world
        self.job = job
        self.proc = world.spawn([FAULT_TRAINER, job, "0", "--lend", f"host:{LEND_BYTES}",
                                 "--bubble-us", "800", "--gap-us", "400", "--commands"],
                                stdin=True, log=world.log("trainer"))
        line = self.proc.wait_line("OPEN") and self.proc.wait_line("LENT")
        check(line, f"the trainer did not open its hub and lend: {self.proc.lines}")
        # With no task attached: its fixed descriptors, and its listening socket (an observer
        # may already be connected, so sockets are counted apart).
        self.fds_idle = (fixed_files(self.pid), 1)
        self.calls_at_round = 0
        self.totals = world.totals

    @property
    def pid(self):
        return self.proc.pid

    def stats(self):
        n = self.proc.count
        self.proc.send("S\n")
        return parse_stats(self.proc.wait_line("STATS", start=n))

    def sigkill(self):
        self.proc.kill()
        self.proc.reap()
        self.proc.close()
        self.world.procs.remove(self.proc)

    def close_cleanly(self):
        n = self.proc.count
        self.proc.send("Q\n")
        line = self.proc.wait_line("CLOSED", start=n)
        check(line == "CLOSED BB_OK", f"clean close of the trainer said {line!r}")
        check(self.proc.reap() == 0, "the trainer's clean close did not exit 0")
        self.proc.close()
        self.world.procs.remove(self.proc)


class World:
    """One private runtime dir (and agent state) per phase, torn down even on failure."""

    def __init__(self, name, totals):
        self.root = tempfile.mkdtemp(prefix=f"bbfault-{name}-", dir="/tmp")
        self.runtime = os.path.join(self.root, "rt")
        os.mkdir(self.runtime, 0o700)
        self.marker = "BUBBLE_RUNTIME_DIR=" + self.runtime
        self.env = dict(os.environ, BUBBLE_RUNTIME_DIR=self.runtime)
        self.env.pop("BUBBLE_AGENT_SOCKET", None)
        self.procs = []
        self.totals = totals

    def log(self, name):
        return open(os.path.join(self.root, name + ".log"), "ab")

    def spawn(self, argv, **kw):
        p = Proc(argv, self.env, **kw)
        self.procs.append(p)
        return p

    def teardown(self):
        for p in self.procs:
            p.kill()
        procs.kill_marked(self.marker, pause=0.02)
        for p in self.procs:
            p.close()
        shutil.rmtree(self.root, ignore_errors=True)


class Totals:
    def __init__(self):
        self.c = collections.Counter()

    def add(self, key, n=1):
        self.c[key] += n


def task_argv(rng, job, name, totals, may_wait=True):
    """A task that dies at a random protocol point; a task with a grant writes it."""
    die = rng.choice(POINTS)
    mem = GRANT_BYTES if rng.random() < 0.5 else 0
    argv = [FAULT_TASK, job, "0", name, "imperative", "--wake", "sleep", "--die-at", die,
            "--die-after", str(rng.randint(1, 12)), "--step-us", str(rng.choice([50, 100, 300]))]
    if mem:
        argv += ["--mem", str(mem), "--grant-seed", "1"]
        totals.add("tasks with a grant")
    if rng.random() < 0.3 and may_wait:
        argv += ["--wait", "--reattach-ms", "30000"]
    return argv, die


def quiescent(trainer, what):
    """Waits until the hub holds no task and no grant; returns the last stats."""
    def idle():
        s = trainer.stats()
        ok = (s["attached"] == 0 and s["active"] == 0 and s["revoking"] == 0 and
              s["quarantined"] == 0 and s["granted"] == 0 and s["free"] == s["capacity"])
        return s if ok else None
    return wait_until(f"{what}: no task attached and every grant given back", idle)


def check_trainer(trainer, s, what):
    check(s["begin_fail"] == 0 and s["end_fail"] == 0,
          f"{what}: bb_bubble_begin/end failed (begin {s['begin_fail']}, end {s['end_fail']})")
    check(s["calls"] > trainer.calls_at_round,
          f"{what}: the trainer's bubble count did not advance ({s['calls']})")
    check(s["capacity"] > 0, f"{what}: the trainer lent no memory")
    # The slot is freed before its page descriptor is closed on the service thread: give it
    # time, a leak stays.
    end = time.monotonic() + DEADLINE_S
    while fd_kinds(trainer.pid) != trainer.fds_idle and time.monotonic() < end:
        time.sleep(0.01)
    fds = fd_kinds(trainer.pid)
    check(not maps_dev_shm(trainer.pid), f"{what}: the trainer maps {maps_dev_shm(trainer.pid)}")
    check(fds == trainer.fds_idle,
          f"{what}: the trainer holds (files, sockets) {fds} with no task attached, "
          f"{trainer.fds_idle} after it opened (leak?): {fd_targets(trainer.pid)}")
    trainer.totals.add("bubbles, every begin/end BB_OK", s["calls"] - trainer.calls_at_round)
    trainer.calls_at_round = s["calls"]


# ----------------------------------------------------------------------------------------------
# Hub rounds.

def hub_round(rng, world, state, rnd, totals):
    trainer = state["trainer"]
    tasks = []  # (Proc, die point, waits for a new trainer)
    for i in range(rng.randint(1, 4)):
        argv, die = task_argv(rng, "fj", f"t{rnd}-{i}", totals)
        p = world.spawn(argv)
        tasks.append((p, die, "--wait" in argv))
        totals.add("tasks started")
    duration = rng.uniform(0.1, 0.4)
    trainer_fate = rng.random()
    t_end = time.monotonic() + duration
    kill_at = sorted(rng.uniform(0, duration) for _ in range(rng.randint(0, len(tasks))))
    fate_at = rng.uniform(0, duration)
    t0 = time.monotonic()
    fate_done = False
    while time.monotonic() < t_end:
        for p, _, _ in tasks:
            p.pump()
        now = time.monotonic() - t0
        if kill_at and now >= kill_at[0]:
            kill_at.pop(0)
            live = [p for p, _, _ in tasks if p.p.poll() is None]
            if live:
                victim = rng.choice(live)
                where = WHERE.get(victim.last.split(" ", 1)[0] if victim.last else "",
                                  "while attaching")
                victim.kill()
                totals.add(f"tasks SIGKILLed from outside ({where})")
        if not fate_done and now >= fate_at:
            fate_done = True
            if trainer_fate < 0.15:
                trainer.sigkill()
                totals.add("trainers SIGKILLed")
                state["trainer"] = trainer = restart_trainer(world, tasks, totals, "was killed")
            elif trainer_fate < 0.25:
                trainer.close_cleanly()
                totals.add("trainers closed cleanly and reopened")
                check(not os.listdir(world.runtime),
                      f"round {rnd}: runtime dir not empty after a clean close: "
                      f"{os.listdir(world.runtime)}")
                state["trainer"] = trainer = restart_trainer(world, tasks, totals, "closed")
        time.sleep(0.005)
    # Where did the tasks die by themselves?
    for p, die, _ in tasks:
        p.pump()
        for line in p.lines:
            if line.startswith("DYING "):
                totals.add(f"tasks SIGKILLed themselves ({line.split()[1]})")
    s_live = trainer.stats()
    live_pids = {p.pid for p, _, _ in tasks if p.p.poll() is None}
    check(s_live["pids"] <= live_pids | {p.pid for p, _, _ in tasks},
          f"round {rnd}: the hub lists pids {s_live['pids']} that are not this round's tasks")
    check(s_live["active"] + s_live["revoking"] <= len(tasks),
          f"round {rnd}: {s_live['active']} grants for {len(tasks)} tasks")
    check(s_live["granted"] <= s_live["capacity"], f"round {rnd}: granted beyond the lent range")
    # End of round: every task goes (some by SIGKILL, the rest of the round's survivors too).
    for p, _, _ in tasks:
        p.kill()
    for p, _, _ in tasks:
        rc = p.reap()
        p.pump()
        # A task ends by a SIGKILL (its own or ours), returns after the hub told it so, or
        # failed to attach while no trainer served the hub; anything else (a sanitizer's
        # exit, an abort, a crash) is a bug in the task runtime.
        result = next((l for l in p.lines if l.startswith("RESULT")), "")
        check(rc == -signal.SIGKILL or (rc == 0 and result) or
              (rc == 2 and any(e in result for e in ("BB_E_NOT_FOUND", "BB_E_TRAINER_GONE"))),
              f"round {rnd}: task {p.argv[3:]} ended with status {rc} ({result or 'no RESULT'})")
        p.close()
        world.procs.remove(p)
    s = quiescent(trainer, f"round {rnd}")
    check_trainer(trainer, s, f"round {rnd}")
    # The grant counters start from zero with each trainer.
    prev = state.get("made", {}).get(trainer.pid, 0)
    totals.add("grants made", s["made"] - prev)
    totals.add("grants taken back from dead tasks", s["released_dead"] -
               state.get("released", {}).get(trainer.pid, 0))
    state["made"] = {trainer.pid: s["made"]}
    state["released"] = {trainer.pid: s["released_dead"]}


def told_trainer_gone(p, totals, what):
    """An attached task that does not wait for a new trainer must learn that its trainer went
    away: a task waiting for a start within its 100 ms liveness slice."""
    line = p.wait_line("RESULT")
    if line:
        check("BB_E_TRAINER_GONE" in line or "BB_E_STOPPED" in line,
              f"a task whose trainer {what} said {line!r}")
        totals.add("tasks told the trainer was gone")
        return
    if not p.pump():
        # Its output ended: it is on its way out (a death at its own point). The pipe closes
        # before the process can be reaped, so wait for that rather than take it for alive.
        try:
            p.p.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pass
    if p.p.poll() is not None:
        return  # it died at its own point meanwhile
    # A task started in the trainer's last bubble must stop too: the runtime looks at its
    # connection every 100 ms while running, and bb_task_should_pause then says pause.
    raise Failure(f"a task waiting for a start was not told within {DEADLINE_S:.0f} s that its "
                  f"trainer {what} "
                  f"(last lines {p.lines[-3:]})")


def restart_trainer(world, tasks, totals, what):
    """A new trainer after the last one `what` ("was killed" or "closed"). A SIGKILLed trainer
    leaves its socket and lock file (a stale hub) and nothing else: the hub and task pages are
    memfds. The new trainer must take the name over."""
    t = Trainer(world, "fj")
    for p, _, waits in tasks:
        if p.p.poll() is None and not waits and "ATTACHED" in p.seen:
            told_trainer_gone(p, totals, what)
    return t


def run_hub_rounds(rng, rounds, soak_until, totals):
    world = World("hub", totals)
    shm_before = dev_shm()
    try:
        state = {"trainer": Trainer(world, "fj")}
        fds_before = None
        rnd = 0
        while rnd < rounds or time.monotonic() < soak_until:
            hub_round(rng, world, state, rnd, totals)
            rnd += 1
            totals.add("hub rounds")
            if fds_before is None:
                fds_before = fd_count()
            check(fd_count() == fds_before,
                  f"round {rnd}: this driver holds {fd_count()} descriptors, {fds_before} before")
            kids = children_of_self()
            check(kids == {state["trainer"].pid},
                  f"round {rnd}: leftover children {kids - {state['trainer'].pid}}")
            check(dev_shm() == shm_before,
                  f"round {rnd}: /dev/shm changed: {dev_shm() ^ shm_before}")
        state["trainer"].close_cleanly()
        check(not os.listdir(world.runtime),
              f"runtime dir not empty after a clean close: {os.listdir(world.runtime)}")
        check(not pids_with_env(world.marker), "processes of the hub rounds are left")
        check(dev_shm() == shm_before, "/dev/shm changed")
    finally:
        world.teardown()


# ----------------------------------------------------------------------------------------------
# Agent rounds.

class Agent:
    def __init__(self, world):
        self.world = world
        self.socket = os.path.join(world.root, "agent.sock")
        self.state = os.path.join(world.root, "state")
        self.proc = None

    def start(self):
        self.proc = self.world.spawn([BUBBLED, "--socket", self.socket, "--state-dir", self.state,
                                      "--metrics-port", "off", "--stop-timeout-ms", "500",
                                      "--sample-ms", "20"], log=self.world.log("agent"))
        wait_until("the agent to answer", lambda: self.ctl("status", check=False).returncode == 0)

    def ctl(self, *args, check=True):
        r = subprocess.run([BUBBLECTL, "--socket", self.socket, *args], env=self.world.env,
                           capture_output=True, text=True, timeout=30)
        if check and r.returncode != 0:
            raise Failure(f"bubblectl {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def tasks(self):
        return {t["id"]: t for t in json.loads(self.ctl("list", "--all", "--json").stdout)}

    def sigkill(self):
        self.proc.kill()
        self.proc.reap()
        self.proc.close()
        self.world.procs.remove(self.proc)


def agent_trainer(world, agent):
    """A trainer whose idle sockets include the agent's observer connection."""
    t = Trainer(world, "fa")
    wait_until("the agent to observe the new hub",
               lambda: any(h["name"] == "fa:0" and h["alive"] and h["trainer_pid"] == t.pid
                           for h in json.loads(agent.ctl("status", "--json").stdout)["hubs"]))
    t.fds_idle = (t.fds_idle[0], 2)  # and the agent's observer connection
    return t


def check_recorded(agent, submitted, what):
    rows = agent.tasks()
    for tid in submitted:
        check(tid in rows, f"{what}: submitted task {tid} is missing from `bubblectl list --all`")
        st = rows[tid]["state"]
        check(st in LIVE_STATES | FINAL_STATES, f"{what}: task {tid} is in unknown state {st!r}")
    # Every task here is submitted: an `attached` row is a task that outlived its wrapper.
    extra = {t: (r["name"], r["pid"]) for t, r in rows.items() if r["origin"] == "attached"}
    check(not extra, f"{what}: tasks orphaned by their launch wrapper were adopted again: {extra}")
    return rows


def run_agent_rounds(rng, rounds, soak_until, totals):
    world = World("agent", totals)
    shm_before = dev_shm()
    try:
        agent = Agent(world)
        agent.start()
        trainer = agent_trainer(world, agent)
        submitted = []
        rnd = 0
        while rnd < rounds or time.monotonic() < soak_until:
            what = f"agent round {rnd}"
            for i in range(rng.randint(1, 3)):
                argv, die = task_argv(rng, "-", f"a{rnd}-{i}", totals, may_wait=False)
                opts = ["--name", f"a{rnd}-{i}"]
                if "--mem" in argv:
                    opts += ["--mem", str(GRANT_BYTES)]
                tid = int(agent.ctl("submit", *opts, "--", *argv).stdout.strip())
                submitted.append(tid)
                totals.add("agent tasks submitted")
            time.sleep(rng.uniform(0.05, 0.3))
            fate = rng.random()
            if fate < 0.35:
                agent.sigkill()
                totals.add("agents SIGKILLed")
                time.sleep(rng.uniform(0, 0.1))
                agent.start()
            elif fate < 0.5:
                trainer.sigkill()
                totals.add("trainers SIGKILLed (agent rounds)")
                trainer = agent_trainer(world, agent)
            elif fate < 0.7:
                rows = agent.tasks()
                pids = [r["pid"] for r in rows.values() if r["state"] == "running" and r["pid"] > 0]
                if pids:
                    # The recorded pid is the launch wrapper's, leader of the task's process
                    # group: a crash takes the group, a user may kill the listed pid alone (the
                    # task must then die with its wrapper, not run on orphaned).
                    alone = rng.random() < 0.5
                    try:
                        (os.kill if alone else os.killpg)(rng.choice(pids), signal.SIGKILL)
                        totals.add("agent tasks SIGKILLed from outside"
                                   + (" (the listed pid alone)" if alone else " (the group)"))
                    except ProcessLookupError:
                        pass
            check_recorded(agent, submitted, what)
            s = trainer.stats()
            check(s["begin_fail"] == 0 and s["end_fail"] == 0, f"{what}: a bubble call failed")
            check(s["calls"] > trainer.calls_at_round, f"{what}: the trainer made no bubble")
            totals.add("bubbles, every begin/end BB_OK", s["calls"] - trainer.calls_at_round)
            trainer.calls_at_round = s["calls"]
            rnd += 1
            totals.add("agent rounds")
        # Wind down: cancel what is left, every task must end and be recorded as ended.
        for tid, row in check_recorded(agent, submitted, "wind-down").items():
            if row["state"] in LIVE_STATES:
                agent.ctl("cancel", str(tid), check=False)
        def all_ended():
            r = check_recorded(agent, submitted, "wind-down")
            return [r] if all(r[t]["state"] in FINAL_STATES for t in submitted) else None
        rows = wait_until("every submitted task to be recorded as ended", all_ended)[0]
        for t in submitted:
            totals.add(f"agent tasks ended {rows[t]['state']}")
        s = quiescent(trainer, "agent wind-down")
        check(s["begin_fail"] == 0 and s["end_fail"] == 0, "agent wind-down: a bubble call failed")
        try:
            wait_until("the trainer's descriptors to settle (no task attached, one observer)",
                       lambda: fd_kinds(trainer.pid) == trainer.fds_idle)
        except AssertionError as e:
            raise Failure(f"{e}: {trainer.fds_idle} when the agent first observed the hub, now "
                          f"{fd_targets(trainer.pid)}")
        # The agent's descriptors with this hub and no live task, compared after one more
        # launch/death cycle: nothing may be held then that was not held before. (Fewer is
        # fine: a control connection of an earlier bubblectl call may still be open here.)
        agent_pid = agent.proc.pid
        idle_targets = fd_targets(agent_pid)
        tid = int(agent.ctl("submit", "--name", "last", "--", FAULT_TASK, "-", "0", "last",
                            "imperative", "--wake", "sleep", "--die-at", "started").stdout.strip())
        submitted.append(tid)
        wait_until("the last task to end",
                   lambda: agent.tasks()[tid]["state"] in FINAL_STATES)
        def agent_extra_fds():
            return {fd: t for fd, t in fd_targets(agent_pid).items() if idle_targets.get(fd) != t}
        try:
            wait_until("the agent's descriptors to settle", lambda: not agent_extra_fds())
        except AssertionError as e:
            raise Failure(f"{e}: held now and not before the last task: {agent_extra_fds()}; "
                          f"task {agent.tasks()[tid]}")
        trainer.close_cleanly()
        agent.proc.p.send_signal(signal.SIGTERM)
        check(agent.proc.reap() == 0, "the agent did not stop cleanly on SIGTERM")
        # Tasks see their trainer close and exit by themselves (bounded: they poll their
        # connection every 100 ms).
        end = time.monotonic() + DEADLINE_S
        while pids_with_env(world.marker) and time.monotonic() < end:
            time.sleep(0.02)
        left = {p: cmdline(p) for p in pids_with_env(world.marker)}
        check(not left, f"processes of the agent rounds are left: {left}; tasks: "
              f"{ {t: (r['state'], r['pid'], r['message']) for t, r in rows.items()} }")
        check(not os.listdir(world.runtime),
              f"runtime dir not empty after the trainer closed: {os.listdir(world.runtime)}")
        check(dev_shm() == shm_before, "/dev/shm changed")
    finally:
        world.teardown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=int(os.environ.get("BB_FAULT_ROUNDS", "40")))
    ap.add_argument("--agent-rounds", type=int,
                    default=int(os.environ.get("BB_FAULT_AGENT_ROUNDS", "12")))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("BB_FAULT_SEED", "0")) or None)
    ap.add_argument("--soak", type=float, default=float(os.environ.get("BB_FAULT_SOAK_S", "0")),
                    help="keep running rounds for this many seconds (half hub, half agent)")
    args = ap.parse_args()
    for name, path in [("FAULT_TRAINER", FAULT_TRAINER), ("FAULT_TASK", FAULT_TASK),
                       ("BUBBLED", BUBBLED), ("BUBBLECTL", BUBBLECTL)]:
        if not path or not os.access(path, os.X_OK):
            sys.exit(f"{name} must point to the built program (run this through ctest)")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 1 << 31)
    print(f"fault injection: seed {seed} (replay with --seed {seed})", flush=True)
    rng = random.Random(seed)
    totals = Totals()
    t0 = time.monotonic()
    soak_half = args.soak / 2
    try:
        run_hub_rounds(rng, args.rounds, t0 + soak_half, totals)
        run_agent_rounds(rng, args.agent_rounds, time.monotonic() + soak_half, totals)
    except AssertionError as e:
        print(f"FAILED (seed {seed}): {e}", flush=True)
        for k, v in sorted(totals.c.items()):
            print(f"  {k}: {v}")
        sys.exit(1)
    print(f"fault injection passed in {time.monotonic() - t0:.1f} s, seed {seed}")
    for k, v in sorted(totals.c.items()):
        print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
