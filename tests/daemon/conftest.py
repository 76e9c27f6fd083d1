"""Fixtures for the agent's end-to-end tests: a private runtime dir, state dir and socket per
test, real bubbled / trainer_sim / task processes, and a teardown that kills every process the
test started (found by the private runtime dir in their environment) even when the test fails."""
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import tempfile

import pytest

from procs import kill_marked, wait_until

BUBBLED = os.environ.get("BUBBLED", "")
BUBBLECTL = os.environ.get("BUBBLECTL", "")
TRAINER_SIM = os.environ.get("TRAINER_SIM", "")
TASK_GOOD = os.environ.get("TASK_GOOD", "")
TASK_ROGUE = os.environ.get("TASK_ROGUE", "")
HOSTILE_TASK = os.environ.get("HOSTILE_TASK", "")
AGENT_SCHEMA = os.environ.get("AGENT_SCHEMA", "")

for _name, _path in [("BUBBLED", BUBBLED), ("BUBBLECTL", BUBBLECTL), ("TRAINER_SIM", TRAINER_SIM),
                     ("TASK_GOOD", TASK_GOOD), ("TASK_ROGUE", TASK_ROGUE)]:
    if not _path or not os.access(_path, os.X_OK):
        raise RuntimeError(f"{_name} must point to the built program (run these tests through ctest)")

DEADLINE_S = 30.0


# --- the control protocol by hand (Cap'n Proto through the `capnp` tool)
def encode(text, type_name="Request"):
    return subprocess.run(["capnp", "encode", AGENT_SCHEMA, type_name], input=text.encode(),
                          capture_output=True, check=True, timeout=30).stdout


def decode(body, type_name="Response"):
    return subprocess.run(["capnp", "decode", AGENT_SCHEMA, type_name], input=body,
                          capture_output=True, check=True, timeout=30).stdout.decode()


def frame(body):
    return struct.pack("<I", len(body)) + body


HELLO = '(id = 1, hello = (protocolVersion = 1, client = "test"))'


def read_frame(s):
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack("<I", head)
    body = bytearray()
    while len(body) < n:
        chunk = s.recv(min(1 << 20, n - len(body)))
        assert chunk, "connection closed inside a frame"
        body += chunk
    return bytes(body)


class Env:
    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="bbd-", dir="/tmp")
        self.runtime = os.path.join(self.root, "rt")
        self.state = os.path.join(self.root, "state")
        self.socket = os.path.join(self.root, "agent.sock")
        self.marker = "BUBBLE_RUNTIME_DIR=" + self.runtime
        self.env = dict(os.environ, BUBBLE_RUNTIME_DIR=self.runtime)
        self.env.pop("BUBBLE_AGENT_SOCKET", None)
        self.procs = []
        self.agent = None
        self.agent_log = os.path.join(self.root, "agent.log")

    # --- processes
    def spawn(self, argv, log_name, **kw):
        log = open(os.path.join(self.root, log_name), "ab")
        p = subprocess.Popen(argv, env=kw.pop("env", self.env), stdout=log, stderr=log,
                             stdin=subprocess.DEVNULL, **kw)
        log.close()
        self.procs.append(p)
        return p

    def trainer(self, job="j", rank=0, free_mib=4096, duration=120, fwd=4, bwd=8, extra=()):
        p = self.spawn([TRAINER_SIM, "--job", job, "--rank", str(rank), "--stages", "4",
                        "--microbatches", "4", "--schedule", "1f1b", "--fwd-ms", str(fwd),
                        "--bwd-ms", str(bwd), "--free-mem-mib", str(free_mib),
                        "--activation-share", "0", "--duration-s", str(duration),
                        "--progress-s", "0", *extra], f"trainer-{job}-{rank}.log")
        wait_until(f"hub {job}:{rank}",
                   lambda: os.path.exists(os.path.join(self.runtime, f"{job}.{rank}.sock")))
        return p

    def start_agent(self, *args, metrics="0", max_fds=None):
        assert self.agent is None or self.agent.poll() is not None
        # A well-behaved task on a starved machine can take longer than the 5 ms default grace
        # to ack a pause, and would be stopped and killed for it: tests that are not about
        # enforcement give it 500 ms. Tests of enforcement pass their own --grace-ms.
        if "--grace-ms" not in args:
            args = ("--grace-ms", "500", *args)
        kw = {}
        if max_fds:
            kw["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                          (max_fds, max_fds))
        self.agent = self.spawn([BUBBLED, "--socket", self.socket, "--state-dir", self.state,
                                 "--metrics-port", metrics, *args], "agent.log", **kw)
        wait_until("the agent's socket", lambda: self.ctl_ok("status"))
        return self.agent

    def kill_agent(self, sig=signal.SIGKILL):
        self.agent.send_signal(sig)
        self.agent.wait(timeout=20)

    # --- the CLI
    def ctl(self, *args, check=True, timeout=30, env=None, prefix=(), program=None):
        r = subprocess.run([*prefix, program or BUBBLECTL, "--socket", self.socket, *args],
                           env=env or self.env,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"bubblectl {' '.join(args)} failed ({r.returncode}): "
                                 f"{r.stderr.strip()}\nagent log:\n{self.log_tail()}")
        return r

    def ctl_ok(self, *args):
        return self.ctl(*args, check=False).returncode == 0

    def submit(self, *argv, opts=()):
        return int(self.ctl("submit", *opts, "--", *argv).stdout.strip())

    def tasks(self):
        return {t["id"]: t for t in json.loads(self.ctl("list", "--all", "--json").stdout)}

    def task(self, tid):
        return self.tasks()[tid]

    def wait_state(self, tid, states, timeout=DEADLINE_S):
        states = (states,) if isinstance(states, str) else tuple(states)
        return wait_until(f"task {tid} in {states}",
                          lambda: (t := self.task(tid))["state"] in states and t, timeout)

    def status(self):
        return json.loads(self.ctl("status", "--json").stdout)

    def hub(self, name):
        for h in self.status()["hubs"]:
            if h["name"] == name:
                return h
        return None

    def log_tail(self):
        return "".join(self.log_lines()[-40:])

    def log_lines(self):
        try:
            with open(self.agent_log, errors="replace") as f:
                return f.readlines()
        except OSError:
            return []

    # --- teardown
    def dump_logs(self):
        """Printed at teardown; pytest shows it when the test failed."""
        for name in sorted(os.listdir(self.root)):
            if name.endswith(".log"):
                with open(os.path.join(self.root, name), errors="replace") as f:
                    print(f"----- {name}\n" + "".join(f.readlines()[-30:]))

    def cleanup(self):
        try:
            self.dump_logs()
        except OSError:
            pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        kill_marked(self.marker)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def children(pid):
    """The pids of a process's children (none once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def proc_state(pid):
    """A process's state letter from /proc (T: stopped), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@pytest.fixture
def env():
    e = Env()
    try:
        yield e
    finally:
        e.cleanup()
