// bubblectl: the command line of the libbubble node agent. See docs/AGENT.md.
#include "agent.capnp.h"
#include "core/observer.h"
#include "daemon/frame.h"
#include "daemon/paths.h"
#include "daemon/render.h"

#include <ctype.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <capnp/message.h>
#include <kj/exception.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using namespace bb::daemon;
namespace proto = bb::proto;

const char kUsage[] =
    "usage: bubblectl [--socket PATH | --runtime-dir DIR] COMMAND [ARGS]\n"
    "commands:\n"
    "  submit [--name N] [--hub auto|JOB:RANK] [--gpu N] [--priority P] [--mem SIZE]\n"
    "         [--mps-priority 0|1] [--mps-mem-limit SIZE] [--env KEY=VALUE]... [--cwd DIR]\n"
    "         -- PROGRAM [ARGS...]      queue a side task; prints its id\n"
    "  list [--all] [--json]            tasks (--all: with finished ones)\n"
    "  status [--json]                  the agent and its hubs\n"
    "  cancel ID                        stop a task, or drop it from the queue\n"
    "  drain [--hub JOB:RANK]           stop launching (whole agent), or move tasks off a hub\n"
    "  undrain [--hub JOB:RANK]         undo drain\n"
    "  logs ID [--stderr] [--bytes N] [--follow|-f]\n"
    "                                   the tail of a task's output; --follow: and then what\n"
    "                                   it writes, until it has ended\n"
    "  actions [N]                      the last N enforcement actions (default 50; 0: the\n"
    "                                   newest 10000)\n"
    "  wait ID [--timeout SECONDS] [-v|--verbose]\n"
    "                                   wait until a task ends; exit 0 if it finished, 1 if\n"
    "                                   it ended otherwise, 3 at the timeout, 4 if the agent\n"
    "                                   cannot be reached (for 30 s once it was, or while it\n"
    "                                   is too busy to take the connection) or refuses the\n"
    "                                   request, 5 if it has no such task; -v: say each state\n"
    "                                   it is seen in, on stderr\n"
    "  trace [--seconds S] [-o FILE]    hubs' events as Chrome trace JSON (Perfetto)\n"
    "  timeline [--seconds S] [-o FILE] the last seconds as an SVG, one lane per hub\n"
    "SIZE: bytes, or with K, M, G, T (powers of 1024), e.g. 512M\n"
    "Exit status (besides wait's): 0 done, 2 a usage error, 141 the reader of the output went\n"
    "away, 1 any other failure (the message says which).\n"
    "The socket defaults to $BUBBLE_AGENT_SOCKET, else <runtime dir>/agent/bubbled.sock, the\n"
    "runtime dir being --runtime-dir's (an agent started with bubbled --runtime-dir DIR),\n"
    "else $BUBBLE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/bubble, else /tmp/bubble-<uid>.\n";

[[noreturn]] void die(const std::string& msg, int code = 1) {
  fprintf(stderr, "bubblectl: %s\n", msg.c_str());
  exit(code);
}

[[noreturn]] void usage_error(const std::string& msg) {
  fprintf(stderr, "bubblectl: %s\n%s", msg.c_str(), kUsage);
  exit(2);
}

// The agent could not be reached, or went away mid-request. `wait` tries again (an agent being
// restarted is gone for a moment); every other command exits with the message.
struct AgentUnreachable {
  std::string message;
};
// The agent answered with an error (thrown only for `wait`, as AgentUnreachable is). busy: it
// turned the connection away for now (too many connections), which `wait` rides out too.
struct AgentRefused {
  std::string message;
  bool busy;
};
bool g_unreachable_throws = false;

[[noreturn]] void unreachable(const std::string& msg) {
  if (g_unreachable_throws) throw AgentUnreachable{msg};
  die(msg);
}

// A number of seconds: finite and at least 0 (strtod's "1e999", "nan" and "5s" are refused).
bool parse_seconds(const std::string& s, double hi, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double v = strtod(s.c_str(), &end);
  if (errno || *end || !(v >= 0) || v > hi) return false;
  *out = v;
  return true;
}

// An option's value: the next argument, or a usage error naming the option and what it takes.
const std::string& option_value(const std::vector<std::string>& args, size_t* i,
                                const char* what) {
  if (*i + 1 >= args.size()) usage_error(args[*i] + " needs a value: " + what);
  return args[++*i];
}

// A size: decimal digits with an optional fraction, then an optional unit ("512M", "1.5G").
// strtod alone would also take "nan", "inf", hex and exponents.
bool parse_size(const std::string& s, uint64_t* out) {
  size_t n = 0, dots = 0;
  while (n < s.size() && (isdigit(static_cast<unsigned char>(s[n])) || (s[n] == '.' && !dots++)))
    ++n;
  if (n == 0 || !isdigit(static_cast<unsigned char>(s[0]))) return false;
  const std::string number = s.substr(0, n);
  errno = 0;
  const double v = strtod(number.c_str(), nullptr);
  if (errno || !std::isfinite(v)) return false;
  std::string suf = s.substr(n);
  if (!suf.empty() && (suf.back() == 'B' || suf.back() == 'b')) suf.pop_back();
  if (suf.size() == 2 && (suf[1] == 'i' || suf[1] == 'I')) suf.pop_back();
  double mul = 1;
  if (suf.empty()) mul = 1;
  else if (suf == "K" || suf == "k") mul = 1024.0;
  else if (suf == "M" || suf == "m") mul = 1024.0 * 1024;
  else if (suf == "G" || suf == "g") mul = 1024.0 * 1024 * 1024;
  else if (suf == "T" || suf == "t") mul = 1024.0 * 1024 * 1024 * 1024;
  else return false;
  double bytes = v * mul;
  if (bytes >= 1.8e19) return false;
  *out = static_cast<uint64_t>(bytes);
  return true;
}

bool parse_int(const std::string& s, long long lo, long long hi, long long* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = strtoll(s.c_str(), &end, 10);
  if (errno || *end || v < lo || v > hi) return false;
  *out = v;
  return true;
}

std::string human_bytes(uint64_t b) {
  if (b == UINT64_MAX) return "unknown";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

std::string human_secs(uint64_t ns) {
  char buf[32];
  snprintf(buf, sizeof buf, "%.3f s", static_cast<double>(ns) / 1e9);
  return buf;
}

std::string when(int64_t ms) {
  if (ms <= 0) return "-";
  time_t t = static_cast<time_t>(ms / 1000);
  struct tm tm;
  localtime_r(&t, &tm);
  char buf[32];
  strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

std::string str(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }

// Standard output that cannot be written is a failure, not success: a reader that went away
// (`bubblectl logs ID --follow | head`) ends bubblectl quietly with the status SIGPIPE would give
// (141; the signal itself is ignored for the agent's socket), any other error (a full disk) with
// a message and 1.
void check_stdout() {
  errno = 0;
  if (fflush(stdout) == 0 && !ferror(stdout)) return;
  int e = errno;
  if (e == 0) {  // the error came with an earlier write: a pipe without readers says so itself
    pollfd p{STDOUT_FILENO, POLLOUT, 0};
    if (poll(&p, 1, 0) == 1 && (p.revents & POLLERR)) e = EPIPE;
  }
  if (e == EPIPE) _exit(141);
  fprintf(stderr, "bubblectl: cannot write the output: %s\n", e ? strerror(e) : "write error");
  _exit(1);
}

// One connection: Hello, then requests. It connects at the first request, so that a command
// checks its arguments before it needs an agent.
class Client {
 public:
  explicit Client(const std::string& path) : path_(path) {}
  ~Client() {
    if (fd_ >= 0) close(fd_);
  }

  // Sends a request and returns the reply; exits with the agent's message on an Error reply.
  std::unique_ptr<capnp::MessageReader> call(capnp::MallocMessageBuilder& msg) {
    if (fd_ < 0) open();
    return exchange(msg);
  }

  uint16_t metrics_port() const { return metrics_port_; }
  int agent_pid() const { return agent_pid_; }
  const std::string& version() const { return version_; }

 private:
  void open() {
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) die(std::string("cannot create a socket: ") + strerror(errno));
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    if (path_.size() >= sizeof sa.sun_path) die("socket path " + path_ + " is too long");
    memcpy(sa.sun_path, path_.c_str(), path_.size());
    if (connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      int e = errno;
      if (e == ENOENT || e == ECONNREFUSED) {
        close(fd_);
        fd_ = -1;
        unreachable("no agent at " + path_ + ": start it with `bubbled` (or pass --socket PATH)");
      }
      if (e == EACCES || e == EPERM) {
        die("permission denied on " + path_ +
            ": the agent belongs to another user; start your own with `bubbled`");
      }
      die("cannot connect to the agent at " + path_ + ": " + strerror(e));
    }
    timeval tv{60, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    capnp::MallocMessageBuilder msg;
    auto req = msg.initRoot<proto::Request>();
    auto h = req.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setClient("bubblectl");
    auto resp = exchange(msg);
    auto hello = resp->getRoot<proto::Response>().getHello();
    metrics_port_ = hello.getMetricsPort();
    agent_pid_ = hello.getPid();
    version_ = str(hello.getAgentVersion());
  }

  std::unique_ptr<capnp::MessageReader> exchange(capnp::MallocMessageBuilder& msg) {
    msg.getRoot<proto::Request>().setId(++next_id_);
    std::string err;
    std::vector<uint8_t> frame;
    if (!encode_frame(msg, proto::MAX_FRAME_BYTES, &frame, &err))
      die("the request is too large to send: " + err +
          "; pass fewer or shorter arguments and environment entries");
    // A write can fail because the agent refused us and closed: its reply says why.
    bool sent = write_frame_fd(fd_, frame, &err);
    std::string write_err = err;
    std::unique_ptr<capnp::MessageReader> reader;
    if (!read_frame_fd(fd_, &frames_, &reader, &err)) {
      if (!sent) unreachable(write_err + " (agent at " + path_ + ")");
      if (errno == EAGAIN) unreachable("the agent at " + path_ + " did not answer within 60 s");
      unreachable(err + " (agent at " + path_ + ")");
    }
    try {
      auto resp = reader->getRoot<proto::Response>();
      if (resp.isError()) {
        auto e = resp.getError();
        if (g_unreachable_throws)
          throw AgentRefused{str(e.getMessage()), e.getCode() == proto::Error::Code::STATE};
        die(str(e.getMessage()));
      }
    } catch (const kj::Exception& e) {
      die(std::string("malformed reply from the agent: ") + e.getDescription().cStr());
    }
    return reader;
  }

  std::string path_;
  int fd_ = -1;
  uint64_t next_id_ = 0;
  FrameReader frames_{proto::MAX_FRAME_BYTES};
  uint16_t metrics_port_ = 0;
  int agent_pid_ = 0;
  std::string version_;
};

void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w;
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) {
      if (w.size() <= i) w.push_back(0);
      w[i] = std::max(w[i], r[i].size());
    }
  }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      line += r[i];
      if (i + 1 < r.size()) line += std::string(w[i] - r[i].size() + 2, ' ');
    }
    puts(line.c_str());
  }
}

int cmd_submit(Client& c, std::vector<std::string> args) {
  capnp::MallocMessageBuilder msg;
  auto spec = msg.initRoot<proto::Request>().initSubmit();
  std::vector<std::string> env, argv;
  spec.setHub("auto");
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.rfind("--", 0) != 0) break;
    if (i + 1 >= args.size()) usage_error("option " + a + " needs a value");
    const std::string& v = args[++i];
    long long n;
    uint64_t sz;
    if (a == "--name") spec.setName(v);
    else if (a == "--hub") spec.setHub(v);
    else if (a == "--gpu") {
      if (!parse_int(v, 0, 1024, &n)) usage_error("--gpu " + v + " is not a device index");
      spec.setGpu(static_cast<int32_t>(n));
    } else if (a == "--priority") {
      if (!parse_int(v, INT32_MIN, INT32_MAX, &n)) usage_error("--priority " + v + " is not a number");
      spec.setPriority(static_cast<int32_t>(n));
    } else if (a == "--mem") {
      if (!parse_size(v, &sz)) usage_error("--mem " + v + " is not a size (e.g. 512M, 2G)");
      spec.setMemNeed(sz);
    } else if (a == "--mps-priority") {
      if (!parse_int(v, 0, 1, &n)) usage_error("--mps-priority must be 0 (normal) or 1 (below normal)");
      spec.setMpsPriority(static_cast<int32_t>(n));
    } else if (a == "--mps-mem-limit") {
      spec.setMpsMemLimit(v);
    } else if (a == "--env") {
      if (v.find('=') == std::string::npos || v[0] == '=') usage_error("--env " + v + " is not KEY=VALUE");
      env.push_back(v);
    } else if (a == "--cwd") {
      char* real = realpath(v.c_str(), nullptr);
      if (!real) die("--cwd " + v + ": " + strerror(errno));
      spec.setCwd(real);
      free(real);
    } else {
      usage_error("unknown submit option " + a);
    }
  }
  for (; i < args.size(); ++i) argv.push_back(args[i]);
  if (argv.empty()) usage_error("submit needs a command after `--`");
  if (spec.getCwd().size() == 0) {
    // Relative programs and paths resolve where the user ran bubblectl, not where the agent runs.
    char* cwd = getcwd(nullptr, 0);
    if (cwd) spec.setCwd(cwd);
    free(cwd);
  }
  auto e = spec.initEnv(static_cast<unsigned>(env.size()));
  for (size_t k = 0; k < env.size(); ++k) e.set(static_cast<unsigned>(k), env[k]);
  auto av = spec.initArgv(static_cast<unsigned>(argv.size()));
  for (size_t k = 0; k < argv.size(); ++k) av.set(static_cast<unsigned>(k), argv[k]);
  auto r = c.call(msg);
  printf("%llu\n", static_cast<unsigned long long>(r->getRoot<proto::Response>().getSubmit()));
  return 0;
}

// The share of a task's step time that ran past bubbles' ends, "-" before any.
std::string spill(uint64_t in_ns, uint64_t out_ns) {
  if (in_ns + out_ns == 0) return "-";
  char buf[32];
  snprintf(buf, sizeof buf, "%.1f%%", 100.0 * static_cast<double>(out_ns) /
                                          static_cast<double>(in_ns + out_ns));
  return buf;
}

std::string task_json(proto::TaskRecord::Reader t) {
  char buf[640];  // fourteen numbers of up to 20 digits and their keys
  std::string o = "{";
  snprintf(buf, sizeof buf,
           "\"id\":%llu,\"pid\":%d,\"exit_code\":%d,\"signal\":%d,\"violations\":%u,"
           "\"attempts\":%u,\"priority\":%d,\"mem_need\":%llu,\"steps\":%llu,"
           "\"ns_in_bubbles\":%llu,\"ns_outside\":%llu,\"submitted_at\":%lld,\"started_at\":%lld,"
           "\"ended_at\":%lld,",
           static_cast<unsigned long long>(t.getId()), t.getPid(), t.getExitCode(),
           t.getSignal(), t.getViolations(), t.getAttempts(), t.getSpec().getPriority(),
           static_cast<unsigned long long>(t.getSpec().getMemNeed()),
           static_cast<unsigned long long>(t.getSteps()),
           static_cast<unsigned long long>(t.getNsInBubbles()),
           static_cast<unsigned long long>(t.getNsOutside()),
           static_cast<long long>(t.getSubmittedAt()), static_cast<long long>(t.getStartedAt()),
           static_cast<long long>(t.getEndedAt()));
  o += buf;
  o += "\"name\":\"" + json_escape(str(t.getSpec().getName())) + "\",";
  o += "\"state\":\"" + json_escape(str(t.getState())) + "\",";
  o += "\"origin\":\"" + json_escape(str(t.getOrigin())) + "\",";
  o += "\"hub\":\"" + json_escape(str(t.getHub())) + "\",";
  o += "\"hub_spec\":\"" + json_escape(str(t.getSpec().getHub())) + "\",";
  o += "\"message\":\"" + json_escape(str(t.getMessage())) + "\",\"argv\":[";
  bool first = true;
  for (auto a : t.getSpec().getArgv()) {
    o += (first ? "\"" : ",\"") + json_escape(str(a)) + "\"";
    first = false;
  }
  return o + "]}";
}

int cmd_list(Client& c, const std::vector<std::string>& args) {
  bool all = false, json = false;
  for (const auto& a : args) {
    if (a == "--all") all = true;
    else if (a == "--json") json = true;
    else usage_error("unknown list option " + a);
  }
  capnp::MallocMessageBuilder msg;
  msg.initRoot<proto::Request>().initList().setAll(all);
  auto r = c.call(msg);
  auto list = r->getRoot<proto::Response>().getList();
  if (const uint32_t omitted = r->getRoot<proto::Response>().getOmitted())
    fprintf(stderr,
            "bubblectl: the %u task records that ended longest ago were left out to keep the reply inside one "
            "message; they stay in the agent's records (list without --all shows only queued "
            "and live tasks)\n",
            omitted);
  if (json) {
    std::string o = "[";
    for (unsigned i = 0; i < list.size(); ++i) o += (i ? ",\n" : "") + task_json(list[i]);
    puts((o + "]").c_str());
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {
      {"ID", "NAME", "STATE", "HUB", "PID", "PRIO", "MEM", "VIOL", "STEPS", "SPILL", "ORIGIN",
       "STARTED", "MESSAGE"}};
  for (auto t : list) {
    std::string msgtext = str(t.getMessage());
    if (msgtext.size() > 70) msgtext = msgtext.substr(0, 67) + "...";
    rows.push_back({std::to_string(t.getId()), str(t.getSpec().getName()), str(t.getState()),
                    t.getHub().size() ? str(t.getHub()) : "-",
                    t.getPid() ? std::to_string(t.getPid()) : "-",
                    std::to_string(t.getSpec().getPriority()),
                    human_bytes(t.getSpec().getMemNeed()), std::to_string(t.getViolations()),
                    std::to_string(t.getSteps()), spill(t.getNsInBubbles(), t.getNsOutside()),
                    str(t.getOrigin()), when(t.getStartedAt()), msgtext});
  }
  if (list.size() == 0) {
    puts(all ? "no tasks" : "no queued or running tasks (--all shows finished ones)");
    return 0;
  }
  print_table(rows);
  return 0;
}

int cmd_status(Client& c, const std::vector<std::string>& args) {
  bool json = false;
  for (const auto& a : args) {
    if (a == "--json") json = true;
    else usage_error("unknown status option " + a);
  }
  capnp::MallocMessageBuilder msg;
  msg.initRoot<proto::Request>().setStatus();
  auto r = c.call(msg);
  auto st = r->getRoot<proto::Response>().getStatus();
  if (json) {
    char buf[512];
    snprintf(buf, sizeof buf,
             "{\"agent_pid\":%d,\"version\":\"%s\",\"metrics_port\":%u,\"queued\":%u,"
             "\"running\":%u,\"draining\":%s,\"actions\":%llu,\"pruned\":%llu,"
             "\"keep_ended\":%u,\"hubs\":[",
             c.agent_pid(), json_escape(c.version()).c_str(), c.metrics_port(), st.getQueued(),
             st.getRunning(), st.getDraining() ? "true" : "false",
             static_cast<unsigned long long>(st.getActions()),
             static_cast<unsigned long long>(st.getPruned()), st.getKeepEnded());
    std::string o = buf;
    bool first = true;
    for (auto h : st.getHubs()) {
      snprintf(buf, sizeof buf,
               "%s{\"name\":\"%s\",\"trainer_pid\":%d,\"alive\":%s,\"draining\":%s,"
               "\"bubbles\":%llu,\"bubble_ns\":%llu,\"bubbles_per_sec\":%.3f,"
               "\"harvested_ns\":%llu,\"tasks\":%u,\"mem_granted\":%llu,\"free_mem\":%llu,"
               "\"gpu\":%d}",
               first ? "" : ",", json_escape(str(h.getName())).c_str(), h.getTrainerPid(),
               h.getAlive() ? "true" : "false", h.getDraining() ? "true" : "false",
               static_cast<unsigned long long>(h.getBubbles()),
               static_cast<unsigned long long>(h.getBubbleNs()), h.getBubblesPerSec(),
               static_cast<unsigned long long>(h.getHarvestedNs()), h.getTasks(),
               static_cast<unsigned long long>(h.getMemGranted()),
               static_cast<unsigned long long>(h.getFreeMem()), h.getGpu());
      o += buf;
      first = false;
    }
    puts((o + "]}").c_str());
    return 0;
  }
  printf("agent pid %d (libbubble %s), metrics %s\n", c.agent_pid(), c.version().c_str(),
         c.metrics_port()
             ? ("http://127.0.0.1:" + std::to_string(c.metrics_port()) + "/metrics").c_str()
             : "off");
  printf("tasks: %u queued, %u running%s; %llu enforcement actions recorded\n", st.getQueued(),
         st.getRunning(), st.getDraining() ? "; DRAINING (bubblectl undrain)" : "",
         static_cast<unsigned long long>(st.getActions()));
  if (st.getKeepEnded())  // 0: an agent from before retention, which keeps every task
    printf("records: the newest %u ended tasks are kept; %llu older deleted\n",
           st.getKeepEnded(), static_cast<unsigned long long>(st.getPruned()));
  if (st.getHubs().size() == 0) {
    puts("no hubs: no trainer has opened a hub in this runtime directory");
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {{"HUB", "STATE", "TRAINER", "GPU", "BUBBLES/S",
                                                 "BUBBLES", "BUBBLE TIME", "HARVESTED", "TASKS",
                                                 "MEM GRANTED", "FREE MEM"}};
  for (auto h : st.getHubs()) {
    char bps[32];
    snprintf(bps, sizeof bps, "%.1f", h.getBubblesPerSec());
    std::string state = !h.getAlive() ? "gone" : h.getDraining() ? "draining" : "live";
    rows.push_back({str(h.getName()), state, std::to_string(h.getTrainerPid()),
                    std::to_string(h.getGpu()), bps, std::to_string(h.getBubbles()),
                    human_secs(h.getBubbleNs()), human_secs(h.getHarvestedNs()),
                    std::to_string(h.getTasks()), human_bytes(h.getMemGranted()),
                    human_bytes(h.getFreeMem())});
  }
  print_table(rows);
  return 0;
}

uint64_t parse_id(const std::string& s) {
  long long n;
  if (!parse_int(s, 1, INT64_MAX, &n)) usage_error("\"" + s + "\" is not a task id (see `bubblectl list`)");
  return static_cast<uint64_t>(n);
}

int cmd_cancel(Client& c, const std::vector<std::string>& args) {
  if (args.size() != 1) usage_error("cancel needs one task id");
  capnp::MallocMessageBuilder msg;
  msg.initRoot<proto::Request>().setCancel(parse_id(args[0]));
  auto r = c.call(msg);
  puts(str(r->getRoot<proto::Response>().getOk()).c_str());
  return 0;
}

int cmd_drain(Client& c, const std::vector<std::string>& args, bool undo) {
  capnp::MallocMessageBuilder msg;
  auto d = msg.initRoot<proto::Request>().initDrain();
  d.setUndo(undo);
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--hub") d.setHub(option_value(args, &i, "the hub, as JOB:RANK"));
    else usage_error("unknown drain option " + args[i]);
  }
  auto r = c.call(msg);
  puts(str(r->getRoot<proto::Response>().getOk()).c_str());
  return 0;
}

int cmd_logs(Client& c, const std::vector<std::string>& args) {
  if (args.empty()) usage_error("logs needs a task id");
  const uint64_t task = parse_id(args[0]);
  bool err_stream = false, follow = false;
  uint32_t max_bytes = 65536;
  for (size_t i = 1; i < args.size(); ++i) {
    long long n;
    if (args[i] == "--stderr") err_stream = true;
    else if (args[i] == "--follow" || args[i] == "-f") follow = true;
    else if (args[i] == "--bytes") {
      const std::string& v = option_value(args, &i, "a byte count, 1..8388608");
      if (!parse_int(v, 1, 1 << 23, &n)) usage_error("--bytes " + v + " must be 1..8388608");
      max_bytes = static_cast<uint32_t>(n);
    } else {
      usage_error("unknown logs option " + args[i]);
    }
  }
  // The tail first; with --follow, then whatever the log gains, until the task has ended and
  // everything it wrote has been printed.
  int64_t offset = -1;
  for (;;) {
    capnp::MallocMessageBuilder msg;
    auto l = msg.initRoot<proto::Request>().initLogs();
    l.setTask(task);
    l.setStderr(err_stream);
    l.setMaxBytes(max_bytes);
    l.setOffset(offset);
    auto r = c.call(msg);
    auto lr = r->getRoot<proto::Response>().getLogs();
    if (lr.getTruncated() && offset >= 0)
      fprintf(stderr, "(%llu bytes of older output were dropped: the agent keeps each log within "
                      "bubbled --log-max-bytes)\n",
              static_cast<unsigned long long>(lr.getEnd() - lr.getData().size() -
                                              static_cast<uint64_t>(offset)));
    else if (lr.getTruncated())
      fprintf(stderr, "(only the tail of %s%s)\n", str(lr.getPath()).c_str(),
              lr.getDropped() ? "; older output was dropped by bubbled --log-max-bytes" : "");
    auto data = lr.getData();
    fwrite(data.begin(), 1, data.size(), stdout);
    check_stdout();  // a follower whose reader left ends here, not when the task does
    if (!follow) return 0;
    const bool caught_up = static_cast<int64_t>(lr.getEnd()) == offset || data.size() < max_bytes;
    offset = static_cast<int64_t>(lr.getEnd());
    if (lr.getFinal() && caught_up) return 0;
    // Caught up with a task that is silent for now: wait 200 ms, but end at once if the
    // reader of the output goes meanwhile (a pipe's write end then reports POLLERR, a socket's
    // POLLHUP), not only at the task's next output, which may never come.
    if (caught_up) {
      pollfd p{STDOUT_FILENO, 0, 0};
      if (poll(&p, 1, 200) == 1 && (p.revents & (POLLERR | POLLHUP))) _exit(141);
    }
  }
}

int cmd_actions(Client& c, const std::vector<std::string>& args) {
  long long n = 50;
  if (args.size() > 1 || (args.size() == 1 && !parse_int(args[0], 0, 1 << 30, &n))) {
    usage_error("actions takes one optional count");
  }
  capnp::MallocMessageBuilder msg;
  msg.initRoot<proto::Request>().setActions(static_cast<uint32_t>(n));
  auto r = c.call(msg);
  auto list = r->getRoot<proto::Response>().getActions();
  if (list.size() == 0) {
    puts("no enforcement actions recorded");
    return 0;
  }
  std::vector<std::vector<std::string>> rows = {{"TIME", "TASK", "PID", "HUB", "ACTION", "DETAIL"}};
  for (auto a : list) {
    rows.push_back({when(a.getAtMs()), a.getTask() ? std::to_string(a.getTask()) : "-",
                    std::to_string(a.getPid()), str(a.getHub()), str(a.getAction()),
                    str(a.getDetail())});
  }
  print_table(rows);
  return 0;
}

bool final_state(const std::string& s) {
  return s == "finished" || s == "failed" || s == "killed" || s == "cancelled" || s == "lost";
}

int cmd_wait(const std::string& socket, const std::vector<std::string>& args) {
  if (args.empty()) usage_error("wait needs a task id");
  uint64_t id = parse_id(args[0]);
  double timeout = -1;
  bool verbose = false;     // say each state the task is seen in, on stderr
  std::string last_state;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--verbose" || args[i] == "-v") {
      verbose = true;
    } else if (args[i] == "--timeout") {
      const std::string& v = option_value(args, &i, "seconds, 0 or more");
      if (!parse_seconds(v, 1e9, &timeout))
        usage_error("--timeout " + v + " is not a number of seconds (0 or more, e.g. 90 or 1.5)");
    } else {
      usage_error("unknown wait option " + args[i]);
    }
  }
  auto elapsed = [](const timespec& from) {
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return static_cast<double>(now.tv_sec - from.tv_sec) + (now.tv_nsec - from.tv_nsec) / 1e9;
  };
  struct timespec t0, lost_at{};
  clock_gettime(CLOCK_MONOTONIC, &t0);
  unsigned delay_us = 100000;
  bool looked = false, lost = false;
  // The agent being restarted (an upgrade) is not the task failing: once it was reached, `wait`
  // tries again for this long before it gives up with exit code 4.
  constexpr double kAgentGoneS = 30;
  g_unreachable_throws = true;
  // The agent is gone or full for now: said once, then tried again for kAgentGoneS.
  auto ride_out = [&](const std::string& said, const std::string& at_the_end) {
    if (!lost) {
      lost = true;
      clock_gettime(CLOCK_MONOTONIC, &lost_at);
      fprintf(stderr, "bubblectl: %s; trying again for %.0f s\n", said.c_str(), kAgentGoneS);
    } else if (elapsed(lost_at) > kAgentGoneS) {
      die(at_the_end + " within 30 s", 4);
    }
  };
  for (;;) {
    try {
      Client c(socket);
      capnp::MallocMessageBuilder msg;
      msg.initRoot<proto::Request>().initList().setAll(true);
      auto r = c.call(msg);
      bool found = false;
      for (auto t : r->getRoot<proto::Response>().getList()) {
        if (t.getId() != id) continue;
        found = true;
        std::string st = str(t.getState());
        if (verbose && st != last_state) {
          fprintf(stderr, "task #%llu: %s\n", static_cast<unsigned long long>(id), st.c_str());
          last_state = st;
        }
        if (final_state(st)) {
          printf("%s: %s\n", st.c_str(), str(t.getMessage()).c_str());
          return st == "finished" ? 0 : 1;
        }
      }
      if (!found) die("no task #" + std::to_string(id) + ": see `bubblectl list --all`", 5);
      looked = true;
      lost = false;
    } catch (const AgentUnreachable& e) {
      if (!looked) die(e.message, 4);
      ride_out("lost the agent (" + e.message + ")", e.message + "; no agent came back");
    } catch (const AgentRefused& e) {
      // Not the task's fate: a refusal (permission, a version it does not speak) is final, a
      // full agent is waited out like a restarting one.
      if (!e.busy) die(e.message, 4);
      ride_out(e.message, e.message + "; still so");
    }
    if (timeout >= 0 && elapsed(t0) > timeout)
      die("task #" + std::to_string(id) + " still runs after the timeout", 3);
    // Each look is a full list on the agent's loop: back off from 0.1 s to 0.5 s between them.
    usleep(delay_us);
    delay_us = std::min(2 * delay_us, 500000u);
  }
}

int cmd_events(Client& c, const std::vector<std::string>& args, bool svg) {
  double seconds = svg ? 5 : 10;
  std::string out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--seconds") {
      const std::string& v = option_value(args, &i, "seconds, in (0, 86400]");
      if (!parse_seconds(v, 86400, &seconds) || seconds == 0)
        usage_error("--seconds " + v + " must be a number of seconds in (0, 86400]");
    } else if (args[i] == "-o") {
      out = option_value(args, &i, "the file to write");
    } else {
      usage_error("unknown option " + args[i]);
    }
  }
  capnp::MallocMessageBuilder msg;
  msg.initRoot<proto::Request>().initEvents().setSeconds(seconds);
  auto r = c.call(msg);
  auto ev = r->getRoot<proto::Response>().getEvents();
  std::vector<HubTrace> hubs;
  for (auto h : ev.getHubs()) {
    HubTrace t;
    t.hub = str(h.getHub());
    t.lost = h.getLost();
    for (auto sn : h.getTaskNames()) t.slot_names[sn.getSlot()] = str(sn.getName());
    auto ts = h.getTsNs();
    auto ty = h.getType();
    auto sl = h.getSlot();
    auto a = h.getA();
    auto b = h.getB();
    unsigned n = std::min<unsigned>({ts.size(), ty.size(), sl.size(), a.size(), b.size()});
    for (unsigned i = 0; i < n; ++i) t.events.push_back({ts[i], ty[i], sl[i], a[i], b[i]});
    hubs.push_back(std::move(t));
  }
  std::string text = svg ? render_timeline_svg(hubs, ev.getNowNs(), seconds)
                         : render_trace_json(hubs, ev.getNowNs());
  if (out.empty() || out == "-") {
    fwrite(text.data(), 1, text.size(), stdout);
  } else {
    FILE* f = fopen(out.c_str(), "we");
    if (!f) die("cannot write " + out + ": " + strerror(errno));
    fwrite(text.data(), 1, text.size(), f);
    if (fclose(f) != 0) die("cannot write " + out + ": " + strerror(errno));
    size_t events = 0;
    for (const auto& h : hubs) events += h.events.size();
    fprintf(stderr, "wrote %s: %zu hubs, %zu events%s\n", out.c_str(), hubs.size(), events,
            svg ? "" : " (open it in https://ui.perfetto.dev)");
  }
  return 0;
}

int run(int argc, char** argv) {
  std::string socket, runtime;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--socket" && i + 1 < argc) {
      socket = argv[++i];
    } else if (a == "--runtime-dir" && i + 1 < argc) {
      runtime = argv[++i];
    } else if (a == "-h" || a == "--help" || a == "help") {
      fputs(kUsage, stdout);
      return 0;
    } else {
      break;
    }
  }
  if (i >= argc) usage_error("no command given");
  std::string cmd = argv[i++];
  std::vector<std::string> args(argv + i, argv + argc);
  if (!socket.empty() && !runtime.empty())
    usage_error("--socket and --runtime-dir both name the agent's socket: give one");
  if (socket.empty())
    socket = default_agent_socket(runtime.empty() ? bb::core::default_runtime_dir() : runtime);
  try {
    if (cmd == "wait") return cmd_wait(socket, args);
    static const char* known[] = {"submit", "list",    "status", "cancel", "drain",
                                  "undrain", "logs",   "actions", "trace", "timeline"};
    bool ok = false;
    for (const char* k : known) ok |= cmd == k;
    if (!ok) usage_error("unknown command " + cmd);
    Client c(socket);
    if (cmd == "submit") return cmd_submit(c, args);
    if (cmd == "list") return cmd_list(c, args);
    if (cmd == "status") return cmd_status(c, args);
    if (cmd == "cancel") return cmd_cancel(c, args);
    if (cmd == "drain") return cmd_drain(c, args, false);
    if (cmd == "undrain") return cmd_drain(c, args, true);
    if (cmd == "logs") return cmd_logs(c, args);
    if (cmd == "actions") return cmd_actions(c, args);
    if (cmd == "trace") return cmd_events(c, args, false);
    if (cmd == "timeline") return cmd_events(c, args, true);
  } catch (const kj::Exception& e) {
    die(std::string("malformed reply from the agent: ") + e.getDescription().cStr());
  }
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  const int code = run(argc, argv);
  check_stdout();
  return code;
}
