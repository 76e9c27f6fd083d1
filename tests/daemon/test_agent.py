"""Submit, run, finish, list; logs; adoption of tasks started outside the agent; cancel; traces
and timelines; errors that name the fix."""
import json
import os
import resource
import signal
import socket
import subprocess
import time

from conftest import (BUBBLECTL, BUBBLED, TASK_GOOD, HELLO, children, decode, encode, frame,
                      proc_state, read_frame, wait_until)


def test_submit_runs_task_to_completion_and_lists_it(env):
    env.trainer("j", 0)
    env.start_agent()
    tid = env.submit(TASK_GOOD, "30", opts=("--name", "good", "--priority", "2"))
    t = env.wait_state(tid, ("finished", "failed", "killed", "lost"))
    assert t["state"] == "finished", t
    assert t["exit_code"] == 0
    assert t["hub"] == "j:0"
    assert t["name"] == "good"
    assert t["origin"] == "submitted"
    assert t["attempts"] == 1
    table = env.ctl("list", "--all").stdout
    assert "good" in table and "finished" in table and "SPILL" in table
    row = next(r for r in json.loads(env.ctl("list", "--all", "--json").stdout) if r["id"] == tid)
    # As last sampled (a task this short may end before any sample sees it run).
    assert isinstance(row["ns_in_bubbles"], int) and isinstance(row["ns_outside"], int)
    out = env.ctl("logs", str(tid)).stdout
    assert "attached to j:0" in out
    assert "done: BB_OK after 30 steps" in out
    # The task ran inside the hub's bubbles: the hub counts its harvested time, once it has
    # drained the task's last step reports (every 10 ms, and when it frees the slot; later than
    # the agent sees the process end when the machine is busy).
    wait_until("the hub to count the task's harvested time",
               lambda: env.hub("j:0")["harvested_ns"] > 0, timeout=10)


def test_a_task_that_ends_between_two_samples_still_counts_as_harvest(env):
    """The hub's harvested time comes from the hub's own total, so a task the agent never saw
    running (it started and ended between two samples) still counts."""
    env.trainer("j", 0)
    # Samples 10 s apart, and nothing below looks at the hub until the task has ended: `logs`
    # does not refresh the agent's view (`list`, `wait` and `status` do).
    env.start_agent("--check-ms", "10000", "--sample-ms", "10000")
    tid = env.submit(TASK_GOOD, "30", opts=("--name", "brief"))
    out = env.ctl("logs", str(tid), "--follow", timeout=60).stdout  # returns once it has ended
    assert "done: BB_OK after 30 steps" in out
    wait_until("the hub to count the task's harvested time",
               lambda: env.hub("j:0")["harvested_ns"] > 0, timeout=10)
    # The premise: no sample saw the task run, so its own figure stayed 0.
    assert env.task(tid)["ns_in_bubbles"] == 0


def test_failing_task_is_recorded_with_its_exit_code_and_stderr(env):
    env.trainer("j", 0)
    env.start_agent()
    tid = env.submit("/bin/sh", "-c", "echo broken >&2; exit 7")
    t = env.wait_state(tid, ("finished", "failed"))
    assert t["state"] == "failed" and t["exit_code"] == 7
    assert "broken" in env.ctl("logs", str(tid), "--stderr").stdout


def test_task_started_outside_the_agent_is_adopted_and_shown(env):
    env.trainer("j", 0)
    env.start_agent()
    ext = env.spawn([TASK_GOOD, "0"], "external.log",
                    env=dict(env.env, BUBBLE_JOB="j", BUBBLE_RANK="0", BUBBLE_TASK_NAME="outsider"))
    t = wait_until("the external task to be adopted",
                   lambda: [t for t in env.tasks().values() if t["name"] == "outsider"])[0]
    assert t["origin"] == "attached"
    assert t["pid"] == ext.pid
    assert t["hub"] == "j:0"
    ext.terminate()
    ext.wait(timeout=10)
    t = env.wait_state(t["id"], ("finished", "failed", "lost"))
    assert "detached" in t["message"]


def _descriptors_without_clients(pid, control_socket):
    """How many descriptors process pid holds, less the connections accepted on control_socket
    (connected sockets bound to that path, in /proc/net/unix)."""
    clients = set()
    with open("/proc/net/unix") as f:
        next(f)  # Num RefCount Protocol Flags Type St Inode Path
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == control_socket and fields[5] == "03":
                clients.add(f"socket:[{fields[6]}]")
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}") not in clients
        except OSError:
            pass  # closed meanwhile
    return count


def test_a_launch_short_of_descriptors_is_tried_again_not_failed(env):
    """Running out of descriptors (or memory) for a moment is no reason to fail a task for good:
    it stays queued and is launched once they are back."""
    env.trainer("j", 0)
    env.start_agent()
    wait_until("the hub's first bubbles", lambda: (h := env.hub("j:0")) and h["bubbles"] > 0)
    pid = env.agent.pid
    # What the agent holds between requests: its descriptors less its client connections (one
    # the agent has not yet seen close would count one too many).
    used = _descriptors_without_clients(pid, env.socket)
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    # The submission's own connection takes one, so the launch made while it is answered (two
    # logs, /dev/null and the pipe a spawn reports through: five) finds four left and fails;
    # the next try, with the connection gone, finds five.
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + 5, hard))
    tid = env.submit(TASK_GOOD, "5")
    t = env.wait_state(tid, ("finished", "failed", "killed", "lost"))
    assert t["state"] == "finished" and t["attempts"] == 1, t
    said = [line for line in env.log_lines() if f"task #{tid} not launched yet" in line]
    assert len(said) == 1 and "too many open files" in said[0].lower(), env.log_tail()


def test_cancelling_again_never_puts_off_the_kill(env):
    """A task that ignores the stop and SIGTERM is killed one stop timeout after SIGTERM, however
    often it is cancelled meanwhile: each cancel must not start the escalation over."""
    env.trainer("j", 0)
    env.start_agent("--stop-timeout-ms", "1000")
    tid = env.submit("/bin/sh", "-c", "trap '' TERM; while :; do sleep 1; done")
    env.wait_state(tid, "running")

    def cancel_again():
        env.ctl("cancel", str(tid), check=False)  # refused once it has ended
        return env.task(tid)["state"] not in ("running", "stopping") and env.task(tid)

    t = wait_until("the task killed while cancelled again and again", cancel_again,
                   timeout=60, interval=0.3)
    assert t["state"] == "cancelled" and t["signal"] == 9, t


def test_cancel_stops_a_running_task_and_drops_a_queued_one(env):
    env.trainer("j", 0)
    env.start_agent("--stop-timeout-ms", "2000")
    running = env.submit(TASK_GOOD, "0")
    env.wait_state(running, "running")
    queued = env.submit(TASK_GOOD, opts=("--hub", "nosuch:0"))
    assert env.task(queued)["state"] == "queued"
    assert "nosuch:0" in env.task(queued)["message"]
    env.ctl("cancel", str(queued))
    assert env.task(queued)["state"] == "cancelled"
    # Wait until the task has attached so the stop goes through the hub, gracefully.
    wait_until("the task to attach", lambda: env.hub("j:0")["tasks"] == 1)
    env.ctl("cancel", str(running))
    t = env.wait_state(running, ("cancelled", "finished", "failed", "killed"))
    assert t["state"] == "cancelled", t
    # The task was told through its hub (bb_task_run returned BB_E_STOPPED, and it exited 0),
    # not ended by the SIGTERM that follows a stop the hub could not pass on.
    assert t["signal"] == 0 and t["exit_code"] == 0, t
    assert "could not pass on the stop" not in "".join(env.log_lines())
    r = env.ctl("cancel", str(running), check=False)
    assert r.returncode != 0 and "already ended" in r.stderr


def test_trace_and_timeline_show_bubbles_and_steps(env):
    env.trainer("j", 0)
    env.trainer("j", 1)
    env.start_agent()
    tid = env.submit(TASK_GOOD, "40", opts=("--hub", "j:1"))
    assert env.wait_state(tid, ("finished", "failed"))["state"] == "finished"
    trace = os.path.join(env.root, "trace.json")
    env.ctl("trace", "--seconds", "30", "-o", trace)
    with open(trace) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    procs = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {"hub j:0", "hub j:1"}
    assert any(e["name"] == "bubble" and e["ph"] == "X" and e["dur"] > 0 for e in events)
    steps = [e for e in events if e["name"] == "step"]
    assert steps and all(e["ph"] == "X" for e in steps)
    svg = env.ctl("timeline", "--seconds", "30").stdout
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count('class="bubble"') > 0
    assert svg.count('class="step"') > 0
    assert ">j:0<" in svg and ">j:1<" in svg


def test_errors_name_the_problem_and_the_fix(env):
    r = subprocess.run([BUBBLECTL, "--socket", env.socket, "list"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0
    assert f"no agent at {env.socket}: start it with `bubbled`" in r.stderr
    env.start_agent()
    r = env.ctl("submit", "--hub", "bad hub", "--", "/bin/true", check=False)
    assert r.returncode != 0 and "neither `auto` nor JOB:RANK" in r.stderr
    r = env.ctl("submit", "--mem", "lots", "--", "/bin/true", check=False)
    assert r.returncode == 2 and "not a size" in r.stderr
    r = env.ctl("logs", "999", check=False)
    assert r.returncode != 0 and "no task #999" in r.stderr
    # A second agent on the same socket or state directory refuses to start.
    second = env.spawn([env.agent.args[0], "--socket", env.socket + "2", "--state-dir", env.state,
                        "--metrics-port", "off"], "agent2.log")
    assert second.wait(timeout=30) == 1
    with open(os.path.join(env.root, "agent2.log")) as f:
        assert "another bubbled uses the state directory" in f.read()


def _agent_refuses(env, state, name, extra=()):
    p = env.spawn([BUBBLED, "--socket", os.path.join(env.root, name + ".sock"), "--state-dir",
                   state, "--metrics-port", "off", *extra], name + ".log")
    assert p.wait(timeout=30) == 1
    with open(os.path.join(env.root, name + ".log")) as f:
        return f.read()


def test_a_state_directory_others_may_write_in_is_refused(env):
    """What the agent reads back from its state directory it runs (queued tasks, their argv and
    environment): a directory somebody else owns or may write in is refused, not used."""
    shared = os.path.join(env.root, "shared-state")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    text = _agent_refuses(env, shared, "shared")
    assert "is writable by others (mode 777)" in text and "chmod 700" in text, text
    assert not os.path.exists(os.path.join(shared, "bubbled.db"))
    # Its logs directory too, where the agent would open each task's output.
    mine = os.path.join(env.root, "mine")
    os.makedirs(os.path.join(mine, "logs"))
    os.chmod(os.path.join(mine, "logs"), 0o773)
    text = _agent_refuses(env, mine, "mine")
    assert mine + "/logs is writable by others" in text, text
    if os.geteuid() == 0:
        theirs = os.path.join(env.root, "theirs")
        os.mkdir(theirs, 0o700)
        os.chown(theirs, 65534, 65534)
        text = _agent_refuses(env, theirs, "theirs")
        assert "belongs to uid 65534" in text and "--state-dir" in text, text
        # A link to somebody else's directory is refused for where it leads.
        link = os.path.join(env.root, "link")
        os.symlink(theirs, link)
        assert "belongs to uid 65534" in _agent_refuses(env, link, "link")
    # The runtime directory, where trainers' hub sockets are: the refusal names its own risk
    # and option, not the state directory's.
    sockets = os.path.join(env.root, "shared-runtime")
    os.mkdir(sockets)
    os.chmod(sockets, 0o777)
    text = _agent_refuses(env, os.path.join(env.root, "fresh"), "rt",
                          ("--runtime-dir", sockets))
    assert "shared-runtime is writable by others (mode 777)" in text, text
    assert "hub sockets" in text and "--runtime-dir" in text and "--state-dir" not in text, text
    # The same directory, made private, is used.
    os.chmod(shared, 0o700)
    env.state = shared
    env.start_agent()
    assert os.path.exists(os.path.join(shared, "bubbled.db"))


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_killing_the_listed_pid_alone_ends_the_task_and_records_it_once(env):
    """The pid `bubblectl list` shows is the launch wrapper's. Killing it alone must not orphan
    the task: the task (and anything it started) dies too, is recorded once, and no second,
    `attached` row appears for it."""
    env.trainer("j", 0)
    env.start_agent()
    tid = env.submit("/bin/sh", "-c", f"sleep 300 & exec {TASK_GOOD} 0")
    t = env.wait_state(tid, "running")
    wrapper = t["pid"]
    task = wait_until("the task under its wrapper", lambda: children(wrapper))[0]
    grandchild = wait_until("the task's own child", lambda: children(task))[0]
    wait_until("the task to attach", lambda: env.hub("j:0")["tasks"] == 1)
    os.kill(wrapper, signal.SIGKILL)
    wait_until("the task to die with its wrapper", lambda: _gone(task))
    wait_until("what the task started to die too", lambda: _gone(grandchild))
    t = env.wait_state(tid, ("failed", "lost", "killed"))
    assert t["pid"] == wrapper, t
    rows = env.tasks()
    assert len(rows) == 1, rows  # not re-adopted as a second, attached row


def follow_logs(env, tid, meanwhile, *options):
    """Runs `bubblectl logs TID --follow` to its end, calling meanwhile(process) once it runs;
    returns its exit code, stdout and stderr. It is killed if the test fails first."""
    follow = subprocess.Popen([BUBBLECTL, "--socket", env.socket, "logs", str(tid), "--follow",
                               *options],
                              env=env.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        meanwhile(follow)
        out, err = follow.communicate(timeout=30)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    return follow.returncode, out, err


def test_logs_follow_prints_what_the_task_writes_until_it_ends(env):
    env.trainer("j", 0)
    env.start_agent()
    gate = os.path.join(env.root, "gate")
    tid = env.submit("/bin/sh", "-c", "echo line1; while [ ! -e " + gate + " ]; do sleep 0.05; "
                     "done; for i in 2 3 4; do echo line$i; sleep 0.1; done")
    env.wait_state(tid, "running")

    def at_the_gate(follow):
        # The tail as it is while the task waits at the gate; then what it writes after.
        assert follow.stdout.readline() == "line1\n"
        assert follow.poll() is None, "logs --follow returned while the task was still running"
        open(gate, "w").close()
    code, out, err = follow_logs(env, tid, at_the_gate)
    assert code == 0, err
    assert out.splitlines() == ["line2", "line3", "line4"]
    assert env.task(tid)["state"] == "finished"


def test_logs_follow_of_a_silent_task_ends_once_its_reader_goes(env):
    """`bubblectl logs ID --follow | head -1` on a task that then says nothing for long: the
    follower ends when its reader goes (141, SIGPIPE's status), not at the task's next output,
    which may never come."""
    env.trainer("j", 0)
    env.start_agent()
    tid = env.submit("/bin/sh", "-c", "echo line1; exec sleep 300")
    env.wait_state(tid, "running")
    wait_until("the first line", lambda: "line1" in env.ctl("logs", str(tid)).stdout)
    r, w = os.pipe()
    follow = subprocess.Popen([BUBBLECTL, "--socket", env.socket, "logs", str(tid), "--follow"],
                              env=env.env, stdout=w, stderr=subprocess.PIPE, text=True)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as reader:
            assert reader.readline() == b"line1\n"
        # The reader is gone; the task is silent.
        assert follow.wait(timeout=10) == 141, follow.stderr.read()
        assert env.task(tid)["state"] == "running"
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()


def test_what_a_task_leaves_running_in_its_process_group_ends_with_it(env):
    """A launched task ends with its main process: a background job it left behind (here one
    that ignores SIGTERM) is killed, not left to run on unsupervised."""
    env.trainer("j", 0)
    env.start_agent()
    pidfile = os.path.join(env.root, "background.pid")
    tid = env.submit("/bin/sh", "-c",
                     f"(trap '' TERM; exec sleep 300) & echo $! > {pidfile}; exit 0")
    t = env.wait_state(tid, ("finished", "failed", "killed", "lost"))
    assert t["state"] == "finished", t
    background = int(open(pidfile).read())
    wait_until("the task's background job to be killed", lambda: _gone(background))
    assert "it ended; killed what was left of its process group" in env.log_tail()


def test_a_descendant_that_left_the_task_s_process_group_ends_with_it_too(env):
    """A daemon the task started in a session of its own (setsid) is no longer in the task's
    process group, but it is still the task's: it would run on unsupervised, writing the
    task's log without a bound. It ends with the task, found by its launch's mark."""
    env.trainer("j", 0)
    env.start_agent()
    pidfile = os.path.join(env.root, "daemon.pid")
    tid = env.submit("/bin/sh", "-c", f"setsid /bin/sh -c 'echo $$ > {pidfile}; exec sleep 300' "
                     "& while [ ! -s " + pidfile + " ]; do sleep 0.02; done; exit 0")
    t = env.wait_state(tid, ("finished", "failed", "killed", "lost"))
    assert t["state"] == "finished", t
    daemon = int(open(pidfile).read())
    wait_until("the task's daemon to be killed", lambda: _gone(daemon))
    # Not everybody's: a process of the same user, started while a task ran, with that task's
    # id but another launch's mark (another agent's task of that number, say) is left alone.
    gate = os.path.join(env.root, "gate")
    tid2 = env.submit("/bin/sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.02; done")
    env.wait_state(tid2, "running")
    other = subprocess.Popen(["sleep", "300"], start_new_session=True,
                             env=dict(env.env, BUBBLE_TASK_ID=str(tid2),
                                      BUBBLE_LAUNCH="another-agent.1.1"))
    try:
        open(gate, "w").close()
        assert env.wait_state(tid2, ("finished", "failed"))["state"] == "finished"
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_chatty_task_keeps_only_the_newest_output_within_the_log_bound(env):
    """A task that writes without end cannot fill the disk: past --log-max-bytes its oldest
    output is dropped, the newest stays readable, and a follower is told what it missed."""
    env.trainer("j", 0)
    env.start_agent("--log-max-bytes", "65536")
    gate, written = os.path.join(env.root, "gate"), os.path.join(env.root, "written")
    # About 1 MB of numbered lines; then it says so and waits at the gate; then one last line.
    tid = env.submit("/bin/sh", "-c", "i=0; while [ $i -lt 100000 ]; do echo line$i; i=$((i+1)); "
                     f"done; touch {written}; while [ ! -e {gate} ]; do sleep 0.05; done; "
                     "echo last")
    total = sum(len(f"line{i}\n") for i in range(100000))
    out = os.path.join(env.state, "logs", f"{tid}.out")
    wait_until("the task to write its lines", lambda: os.path.exists(written), timeout=60)
    wait_until("the log to be held within its bound",
               lambda: os.stat(out).st_blocks * 512 <= 65536)
    assert os.stat(out).st_size == total  # offsets still count what went
    r = env.ctl("logs", str(tid), "--bytes", "20")
    assert r.stdout.endswith("line99999\n"), r.stdout
    assert "older output was dropped by bubbled --log-max-bytes" in r.stderr, r.stderr
    code, stdout, stderr = follow_logs(env, tid, lambda _: open(gate, "w").close(),
                                       "--bytes", "65536")
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[-2:] == ["line99999", "last"], lines[-3:]
    # What it printed is whole lines in order: the kept output, not a mix.
    numbers = [int(x[4:]) for x in lines[1:-1]]
    assert numbers == list(range(numbers[0], 100000)), numbers[:3]
    assert env.wait_state(tid, "finished")
    from test_metrics import scrape, value
    dropped = value(scrape(env.status()["metrics_port"]), "bubble_task_log_bytes_dropped_total")
    block = os.statvfs(out).f_bsize
    assert dropped and total - 32768 - block <= dropped < total  # half the bound, in blocks


def test_log_max_bytes_must_be_at_least_64_kib(env):
    from conftest import BUBBLED
    r = subprocess.run([BUBBLED, "--log-max-bytes", "100"], capture_output=True, text=True,
                       timeout=10)
    assert r.returncode != 0
    assert "--log-max-bytes 100 must be a whole number of bytes from 65536" in r.stderr


def test_the_wait_for_a_trainers_answer_is_bounded(env):
    """The agent's start and stop wait for opens under way, so --trainer-answer-ms has a
    ceiling, and a value past it, or none, is refused with the range."""
    from conftest import BUBBLED
    for bad in ("0", "30001", "1s"):
        r = subprocess.run([BUBBLED, "--trainer-answer-ms", bad], capture_output=True,
                           text=True, timeout=10)
        assert r.returncode == 2, (bad, r.returncode)
        assert (f"--trainer-answer-ms {bad} must be a whole number of milliseconds from 1 to "
                "30000") in r.stderr, r.stderr


def test_a_stale_hub_socket_is_tried_a_few_times_then_left_alone(env):
    """A trainer killed with SIGKILL leaves its socket behind. The agent tries it a few times
    (the socket may be a moment early) and then waits for the directory to change, rather than
    connecting to it forever."""
    os.makedirs(env.runtime, mode=0o700, exist_ok=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.path.join(env.runtime, "gone.0.sock"))
    stale.close()  # the file stays; nobody listens on it
    env.start_agent("--verbose")

    def attempts():
        return sum("hub gone:0 not ready" in line for line in env.log_lines())
    # The retries span about 4.5 s (10 ms rising to 3 s); then the agent says it gives up.
    wait_until("the agent to give up on the stale hub",
               lambda: any("hub gone:0: no trainer answers" in line for line in env.log_lines()))
    settled = attempts()
    assert 1 <= settled <= 8, f"{settled} attempts at a socket nobody listens on"
    time.sleep(1)  # the old agent tried again every 30 ms: dozens in this second
    assert attempts() == settled, "the agent goes on connecting to a stale socket"
    assert env.agent.poll() is None and env.ctl_ok("status")


def answered(s, request, times):
    """Sends the framed request on connection s that many times, each after the last answer.
    The connection's own timeout (20 s in the tests below, shorter than the 30 s the agent
    is told to wait for a trainer) fails the test when an answer does not come."""
    for _ in range(times):
        s.sendall(request)
        assert read_frame(s) is not None, "the agent closed the connection"


def agent_connection(env):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(env.socket)
    s.sendall(frame(encode(HELLO)))
    assert read_frame(s) is not None
    return s


def test_an_open_its_trainer_does_not_answer_does_not_hold_up_the_agent(env):
    """A trainer stopped before the agent opened its hub (at a debugger's breakpoint) accepts
    connections but answers nobody, and each try to open its hub waits for an answer until
    --trainer-answer-ms runs out. The agent waits for those off its loop. Here the "trainer"
    is a socket the test holds: it takes the agent's connection and never answers, so the
    open is certainly under way while the test's requests go to the agent; they are answered
    (an agent that opened hubs on its loop answered none until the open gave up, 30 s here,
    past the test connection's 20 s timeout)."""
    os.makedirs(env.runtime, mode=0o700, exist_ok=True)
    env.start_agent("--verbose", "--trainer-answer-ms", "30000")
    path = os.path.join(env.runtime, "held.0.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:  # as a hub's
        # Listening before the name appears, so that the agent's first try is the held one.
        hidden = os.path.join(env.root, "held.sock")
        listener.bind(hidden)
        listener.listen(4)
        os.rename(hidden, path)
        listener.settimeout(20)
        held, _ = listener.accept()  # the agent's open, seen by its directory watch
        with held, agent_connection(env) as s:
            held.settimeout(20)
            assert held.recv(4096), "the agent connected but sent no request"
            answered(s, frame(encode("(id = 2, status = void)")), 20)
            assert env.hub("held:0") is None
            assert not any("hub held:0 not ready" in line for line in env.log_lines()), \
                "the open ended before the test closed its connection"
    # The connection closed without an answer: that open fails and the agent says so.
    os.unlink(path)
    wait_until("the agent to see the open fail",
               lambda: any("hub held:0 not ready" in line for line in env.log_lines()))
    assert env.agent.poll() is None and env.ctl_ok("status")


def test_a_trainer_stopped_after_its_hub_was_opened_does_not_hold_up_the_agent(env):
    """A trainer stopped once its hub is open (at a breakpoint) answers none of the agent's
    requests. A cancel passes its stop on through the hub, and the agent only sends it: the
    cancel is answered, as is every request after it, and the task, whose stop never arrives,
    is ended by SIGTERM when the stop timeout runs out. (An agent that waited for the
    trainer's answer kept the cancel waiting on its loop for --trainer-answer-ms, 30 s here,
    past the test connection's 20 s timeout.)"""
    trainer = env.trainer("j", 0)
    env.start_agent("--stop-timeout-ms", "1000", "--trainer-answer-ms", "30000")
    tid = env.submit(TASK_GOOD, "0")
    env.wait_state(tid, "running")
    wait_until("the task to attach", lambda: env.hub("j:0")["tasks"] == 1)
    os.kill(trainer.pid, signal.SIGSTOP)
    try:
        with agent_connection(env) as s:
            s.sendall(frame(encode(f"(id = 2, cancel = {tid})")))
            reply = decode(read_frame(s))
            assert "stopping" in reply, reply
            answered(s, frame(encode("(id = 3, status = void)")), 20)
        t = env.wait_state(tid, ("cancelled", "finished", "failed", "killed"))
        assert t["state"] == "cancelled" and t["signal"] == signal.SIGTERM, t
        assert proc_state(trainer.pid) == "T", "the trainer went on during the test"
    finally:
        os.kill(trainer.pid, signal.SIGCONT)
    # The stop the trainer owed is answered once it goes on (the task had left: a refusal),
    # and the agent goes on reading the hub.
    wait_until("the hub to be seen alive with no task",
               lambda: (h := env.hub("j:0")) and h["alive"] and h["tasks"] == 0)
    again = env.submit(TASK_GOOD, "0")
    env.wait_state(again, "running")
    wait_until("the next task to attach", lambda: env.hub("j:0")["tasks"] == 1)


def test_a_hub_that_closes_or_whose_trainer_is_killed_is_not_tried_again(env):
    """A trainer that closes its hub removes its socket last, and a killed one leaves it: in
    neither case is the agent to connect to it again when the hub hangs up (only a new
    trainer's socket under the name is, or any socket once the directory changes)."""
    env.start_agent("--verbose")

    def tries(name):
        """Tries logged since the hub was last seen gone (one made before its trainer listened,
        while the agent raced the trainer's bind, does not count)."""
        lines = env.log_lines()
        gone = max(i for i, line in enumerate(lines) if f"hub {name} gone" in line)
        return [line for line in lines[gone + 1:]
                if f"hub {name} not ready" in line or f"hub {name}: no trainer answers" in line]

    killed = env.trainer("killed", 0, duration=60)
    wait_until("hub killed:0 seen", lambda: (h := env.hub("killed:0")) and h["alive"])
    killed.kill()
    wait_until("hub killed:0 gone", lambda: not env.hub("killed:0")["alive"])
    # No event says that no try is coming: a try would have been made at the hang-up, and
    # failed within milliseconds (a socket nobody listens on), so a short wait shows it.
    time.sleep(0.3)
    assert not tries("killed:0")
    closing = env.trainer("closes", 0, duration=1)
    wait_until("hub closes:0 seen", lambda: (h := env.hub("closes:0")) and h["alive"])
    assert closing.wait(timeout=30) == 0
    wait_until("hub closes:0 gone", lambda: not env.hub("closes:0")["alive"])
    time.sleep(0.3)
    assert not tries("closes:0")
    # A new trainer under a name is opened.
    again = env.trainer("closes", 0, duration=60)
    wait_until("the new trainer's hub", lambda: (h := env.hub("closes:0")) and h["alive"])
    again.kill()


def test_hubs_whose_trainers_went_away_are_kept_only_up_to_a_bound(env):
    """Every training run may bring a new job id: the agent keeps the newest hubs whose trainers
    went away (listed, with their last events), not all of them for good."""
    env.start_agent()
    for i in range(20):
        p = env.trainer(f"run{i}", 0, duration=60)
        wait_until(f"hub run{i}:0 seen", lambda: (h := env.hub(f"run{i}:0")) and h["alive"])
        p.kill()
        p.wait()
        wait_until(f"hub run{i}:0 gone", lambda: not env.hub(f"run{i}:0")["alive"])
    names = {h["name"] for h in env.status()["hubs"]}
    assert len(names) <= 17, sorted(names)  # at most 16 gone ones, pruned as the next appears
    assert "run19:0" in names and "run18:0" in names  # the newest are kept
    assert "run0:0" not in names


def test_bubblectl_checks_its_arguments_before_it_looks_for_an_agent(env):
    """A usage error is a usage error (exit 2) whether or not an agent runs; sizes are decimal
    numbers with a unit, never nan, hex or exponents."""
    for args in (["list", "--bogus"], ["cancel", "abc"], ["submit", "--mem", "nan", "--", "/bin/true"],
                 ["submit", "--mem", "0x10", "--", "/bin/true"],
                 ["submit", "--mem", "1e3", "--", "/bin/true"], ["logs"]):
        r = env.ctl(*args, check=False)  # no agent yet
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "no agent at" not in r.stderr, (args, r.stderr)
    env.trainer("j", 0)
    env.start_agent()
    tid = env.submit("/bin/true", opts=("--mem", "1.5K"))
    assert env.task(tid)["mem_need"] == 1536, env.task(tid)


def test_bubblectl_ends_when_its_output_cannot_be_written(env):
    """`bubblectl logs ID --follow | head` ends once head has gone (with SIGPIPE's status), not
    when the task does; output that cannot be written otherwise (a full disk) is an error."""
    env.trainer("j", 0)
    env.start_agent()
    tid = env.submit("/bin/sh", "-c", "while :; do echo tick; sleep 0.05; done")
    env.wait_state(tid, "running")
    r, w = os.pipe()
    follow = subprocess.Popen([BUBBLECTL, "--socket", env.socket, "logs", str(tid), "--follow"],
                              env=env.env, stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as reader:
            assert reader.read(5) == b"tick\n"
        assert follow.wait(timeout=30) == 141
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert env.task(tid)["state"] == "running"
    with open("/dev/full", "w") as full:
        p = subprocess.run([BUBBLECTL, "--socket", env.socket, "list"], env=env.env, stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=30)
    assert p.returncode == 1 and "cannot write the output" in p.stderr, (p.returncode, p.stderr)
    env.ctl("cancel", str(tid))


def test_bubblectl_reaches_an_agent_by_its_runtime_dir(env):
    """An agent started with --runtime-dir DIR and no --socket listens in DIR; bubblectl
    --runtime-dir DIR reaches it without the environment that named DIR, and without it (or with
    another DIR) says where it looked."""
    rt = os.path.join(env.root, "elsewhere")
    bare = {k: v for k, v in env.env.items()
            if k not in ("BUBBLE_RUNTIME_DIR", "XDG_RUNTIME_DIR", "BUBBLE_AGENT_SOCKET")}
    bare["XDG_RUNTIME_DIR"] = os.path.join(env.root, "xdg")  # never /run/user of the machine
    env.spawn([BUBBLED, "--runtime-dir", rt, "--state-dir", env.state, "--metrics-port", "off"],
              "agent.log", env=bare)
    sock = os.path.join(rt, "agent", "bubbled.sock")
    wait_until("the agent's socket", lambda: subprocess.run(
        [BUBBLECTL, "--runtime-dir", rt, "status"], env=bare, capture_output=True,
        timeout=30).returncode == 0)
    r = subprocess.run([BUBBLECTL, "--runtime-dir", rt, "list"], env=bare, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([BUBBLECTL, "status"], env=bare, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "no agent at" in r.stderr, (r.returncode, r.stderr)
    assert sock not in r.stderr
    r = subprocess.run([BUBBLECTL, "--runtime-dir", rt, "--socket", sock, "status"], env=bare,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "give one" in r.stderr, (r.returncode, r.stderr)
