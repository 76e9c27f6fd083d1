// bubbled: the libbubble node agent. See docs/AGENT.md.
#include "daemon/agent.h"
#include "daemon/paths.h"

#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <string>

namespace {

const char kUsage[] =
    "usage: bubbled [options]\n"
    "  --socket PATH         control socket (default: $BUBBLE_AGENT_SOCKET, else\n"
    "                        <runtime dir>/agent/bubbled.sock)\n"
    "  --runtime-dir DIR     where trainers' hub sockets live (default: $BUBBLE_RUNTIME_DIR,\n"
    "                        else $XDG_RUNTIME_DIR/bubble, else /tmp/bubble-<uid>)\n"
    "  --state-dir DIR       database and task logs (default: $BUBBLE_STATE_DIR, else\n"
    "                        $XDG_STATE_HOME/bubble, else ~/.local/state/bubble, else\n"
    "                        /var/tmp/bubble-<uid> without HOME)\n"
    "  --metrics-port N      Prometheus metrics on 127.0.0.1:N (default 9477; 0 = any free\n"
    "                        port, shown by `bubblectl status`; off = none)\n"
    "  --allow-uid UID       also let clients of this uid watch: list, status, logs, actions,\n"
    "                        trace, timeline, wait (not submit, cancel, drain or undrain;\n"
    "                        repeatable)\n"
    "  --grace-ms MS         time a task has to ack a pause (default 5)\n"
    "  --kill-after N        the violation that kills a task (default 3)\n"
    "  --check-ms MS         enforcement check interval while tasks run (default 1)\n"
    "  --sample-ms MS        hub sampling interval while hubs live (default 100)\n"
    "  --stop-timeout-ms MS  graceful stop before SIGTERM, and SIGTERM before SIGKILL\n"
    "                        (default 5000)\n"
    "  --trainer-answer-ms MS  how long opening a hub waits for its trainer to answer;\n"
    "                        one that does not (stopped, hung) is tried again later;\n"
    "                        the agent's start and stop wait for opens under way\n"
    "                        (default 1000, at most 30000)\n"
    "  --hub-gpu JOB:RANK=N  the GPU of a hub (default: its rank)\n"
    "  --keep-ended N        ended tasks kept in the records, with their logs and actions;\n"
    "                        older ones are deleted (default 10000)\n"
    "  --log-max-bytes N     output kept of each of a task's stdout and stderr; past it the\n"
    "                        oldest output is dropped (default 67108864, 64 MiB)\n"
    "  --verbose             log more\n";

bool parse_u64(const char* s, uint64_t* out) {
  if (!s || !*s) return false;
  char* end = nullptr;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end || s[0] == '-') return false;
  *out = v;
  return true;
}

[[noreturn]] void bad(const std::string& msg) {
  fprintf(stderr, "bubbled: %s\n%s", msg.c_str(), kUsage);
  exit(2);
}

std::string self_exe() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "";
  buf[n] = 0;
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bb::daemon;
  if (argc >= 4 && strcmp(argv[1], "--exec-task") == 0 && strcmp(argv[3], "--") == 0 && argc >= 5) {
    run_exec_wrapper(argv[2], argv + 4);
  }
  AgentConfig cfg;
  std::string socket, runtime, state;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) bad("option " + a + " needs a value");
      return argv[++i];
    };
    uint64_t v = 0;
    if (a == "--socket") {
      socket = value();
    } else if (a == "--runtime-dir") {
      runtime = value();
    } else if (a == "--state-dir") {
      state = value();
    } else if (a == "--metrics-port") {
      const char* s = value();
      if (strcmp(s, "off") == 0) cfg.metrics_port = -1;
      else if (parse_u64(s, &v) && v <= 65535) cfg.metrics_port = static_cast<int>(v);
      else bad(std::string("--metrics-port ") + s + " is not a port number (0..65535) or off");
    } else if (a == "--allow-uid") {
      const char* s = value();
      if (!parse_u64(s, &v) || v > UINT32_MAX) bad(std::string("--allow-uid ") + s + " is not a uid");
      cfg.allow_uids.insert(static_cast<uint32_t>(v));
    } else if (a == "--grace-ms" || a == "--check-ms" || a == "--sample-ms" ||
               a == "--stop-timeout-ms" || a == "--kill-after") {
      const char* s = value();
      if (!parse_u64(s, &v) || v == 0 || v > 86'400'000) {
        bad(a + " " + s + " must be a positive whole number");
      }
      if (a == "--grace-ms") cfg.enforce.grace_ns = v * 1'000'000;
      if (a == "--check-ms") cfg.check_interval_ns = v * 1'000'000;
      if (a == "--sample-ms") cfg.sample_interval_ns = v * 1'000'000;
      if (a == "--stop-timeout-ms") cfg.stop_timeout_ns = v * 1'000'000;
      if (a == "--kill-after") cfg.enforce.kill_after = static_cast<uint32_t>(v);
    } else if (a == "--trainer-answer-ms") {
      const char* s = value();
      // At most 30 s: the agent's start, and its stop, wait for the opens under way.
      if (!parse_u64(s, &v) || v == 0 || v > 30'000)
        bad(std::string("--trainer-answer-ms ") + s +
            " must be a whole number of milliseconds from 1 to 30000");
      cfg.trainer_answer_ms = static_cast<uint32_t>(v);
    } else if (a == "--keep-ended") {
      const char* s = value();
      if (!parse_u64(s, &v) || v == 0 || v > 100'000'000)
        bad(std::string("--keep-ended ") + s + " must be a whole number from 1 to 100000000");
      cfg.keep_ended = static_cast<uint32_t>(v);
    } else if (a == "--log-max-bytes") {
      const char* s = value();
      if (!parse_u64(s, &v) || v < 65536 || v > (1ull << 50))
        bad(std::string("--log-max-bytes ") + s +
            " must be a whole number of bytes from 65536 to 1125899906842624");
      cfg.log_max_bytes = v;
    } else if (a == "--hub-gpu") {
      std::string s = value();
      size_t eq = s.rfind('=');
      if (eq == std::string::npos || !parse_u64(s.c_str() + eq + 1, &v) || v > 1024) {
        bad("--hub-gpu " + s + " is not JOB:RANK=DEVICE");
      }
      cfg.hub_gpu[s.substr(0, eq)] = static_cast<int>(v);
    } else if (a == "--verbose") {
      cfg.verbose = true;
    } else if (a == "-h" || a == "--help") {
      fputs(kUsage, stdout);
      return 0;
    } else {
      bad("unknown option " + a);
    }
  }
  if (!runtime.empty()) setenv("BUBBLE_RUNTIME_DIR", runtime.c_str(), 1);
  // Absolute: tasks run in their own directories and are given these paths (a relative
  // runtime dir would name another directory there, and the launch wrapper would write its
  // exit status where no agent looks).
  cfg.runtime_dir = absolute_path(bb::core::default_runtime_dir());
  cfg.socket_path = absolute_path(socket.empty() ? default_agent_socket(cfg.runtime_dir) : socket);
  cfg.state_dir = absolute_path(state.empty() ? default_state_dir() : state);
  cfg.self_exe = self_exe();
  if (cfg.self_exe.empty()) bad("cannot find its own executable in /proc/self/exe");

  signal(SIGPIPE, SIG_IGN);
  uv_loop_t* loop = uv_default_loop();
  Agent agent(cfg);
  std::string err = agent.start(loop);
  if (!err.empty()) {
    fprintf(stderr, "bubbled: %s\n", err.c_str());
    agent.shutdown();
    uv_run(loop, UV_RUN_DEFAULT);
    uv_loop_close(loop);
    return 1;
  }
  struct Signals {
    Agent* agent;
    uv_signal_t term, intr;
  } sigs;
  sigs.agent = &agent;
  uv_signal_init(loop, &sigs.term);
  uv_signal_init(loop, &sigs.intr);
  sigs.term.data = sigs.intr.data = &sigs;
  auto on_signal = [](uv_signal_t* s, int signum) {
    auto* sg = static_cast<Signals*>(s->data);
    agent_log("signal %d: shutting down (tasks keep running)", signum);
    sg->agent->shutdown();
    uv_close(reinterpret_cast<uv_handle_t*>(&sg->term), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&sg->intr), nullptr);
  };
  uv_signal_start(&sigs.term, on_signal, SIGTERM);
  uv_signal_start(&sigs.intr, on_signal, SIGINT);
  uv_run(loop, UV_RUN_DEFAULT);
  uv_loop_close(loop);
  return 0;
}
