// The control socket: accepts clients of allowed uids only, cuts their byte stream into frames,
// and answers each Request with one Response. Any malformed, truncated or oversized frame gets
// an Error reply and the connection is closed; nothing a client sends can crash the agent.
#include "agent.capnp.h"
#include "daemon/agent.h"
#include "daemon/control_feed.h"
#include "daemon/frame.h"
#include "daemon/list_fit.h"
#include "daemon/logs.h"
#include "daemon/paths.h"
#include "daemon/placement.h"
#include "shm/fd_passing.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <capnp/message.h>
#include <kj/exception.h>

#include <algorithm>

namespace bb::daemon {

namespace {

constexpr size_t kMaxClients = 128;
// Of those, the ones from other uids (--allow-uid): they may watch, and must never be able to
// take every connection from the agent's own user.
constexpr size_t kMaxGuestClients = 32;
// A client owes the agent bytes while it has not said hello yet or has sent part of a frame: it
// has this long to send them, counted from when it began to owe (not from its last byte, so a
// client that trickles a byte at a time is cut off too). An idle connection after hello (a
// watcher between requests) owes nothing and is never timed out.
constexpr uint64_t kOwedBytesTimeoutMs = 10'000;
// Replies a client has not read yet, at most: one that asks and never reads would otherwise make
// the agent hold every reply (an `events` or `list` reply can be megabytes) until it runs out of
// memory. Twice the largest frame, so a client that reads a large reply late is not cut off.
constexpr size_t kMaxUnreadReplyBytes = 2 * size_t(bb::proto::MAX_FRAME_BYTES);

// All connections together hold at most this much (frames being received, replies not yet
// read). Each alone is bounded (a frame, twice a frame unread), but 128 clients at their bounds
// would hold gigabytes: past this, the one holding the most is closed.
constexpr size_t kMaxHeldBytesAll = size_t(256) << 20;

// Bounds on one submission, so that every record stays small next to the frame limit and a
// `list` of many records still fits one reply.
constexpr size_t kMaxArgs = 256;
constexpr size_t kMaxEnv = 256;
constexpr size_t kMaxEntryBytes = 4 << 10;
constexpr size_t kMaxSpecBytes = 64 << 10;
constexpr size_t kMaxMpsLimitBytes = 256;  // "2G" or "0=2G,1=4G,...": a few per device
// Requests of one connection answered per loop turn, and of all connections together (see
// serve_a_turn): a turn's requests stay a bounded amount of work for the loop's timers
// (enforcement above all) to wait on, however many clients pipeline at once.
constexpr size_t kFramesPerTurn = 16;
constexpr size_t kFramesPerLoopTurn = 64;

struct Conn {
  uv_pipe_t pipe;
  Agent* agent = nullptr;
  FrameReader frames{bb::proto::MAX_FRAME_BYTES};
  uv_timer_t* timer = nullptr;
  bool hello = false;
  bool closing = false;
  // A reply that closes the connection once written is on its way: nothing more is read,
  // answered or sent.
  bool close_pending = false;
  uid_t uid = 0;
  pid_t pid = 0;
  bool admitted = false;  // passed the credential and connection-count checks
  uint64_t frames_served = 0;
  // Set for a connection without a socket (ControlFeed): replies are appended here.
  std::vector<uint8_t>* sink = nullptr;
};

struct WriteReq {
  uv_write_t req;
  std::vector<uint8_t> bytes;
  Conn* conn;
  bool close_after;
};

void close_conn(Conn* c) {
  if (c->closing) return;
  c->closing = true;
  c->agent->clients_.erase(c);
  std::erase(c->agent->backlog_, c);
  if (c->sink) return;  // owned by its ControlFeed
  if (c->timer) {
    uv_timer_stop(c->timer);
    close_and_delete(c->timer);
    c->timer = nullptr;
  }
  uv_close(reinterpret_cast<uv_handle_t*>(&c->pipe),
           [](uv_handle_t* h) { delete static_cast<Conn*>(h->data); });
}

void send_error(Conn* c, uint64_t id, proto::Error::Code code, const std::string& message,
                bool close_after);

// The connection closes once what is queued for it is written: nothing more is read from it,
// answered or sent.
void stop_serving(Conn* c) {
  uv_read_stop(reinterpret_cast<uv_stream_t*>(&c->pipe));
  c->close_pending = true;
  std::erase(c->agent->backlog_, c);
}

size_t held_by(Conn* c) {
  if (c->closing) return 0;
  const size_t unread =
      c->sink ? 0 : uv_stream_get_write_queue_size(reinterpret_cast<uv_stream_t*>(&c->pipe));
  return c->frames.held_bytes() + unread;
}

// Closes the clients holding the most until all together hold at most kMaxHeldBytesAll. A closed
// client's memory goes when libuv has closed its handle (its writes are cancelled).
void bound_held_bytes(Agent* a) {
  for (;;) {
    size_t total = 0, top_bytes = 0;
    Conn* top = nullptr;
    for (void* p : a->clients_) {
      auto* c = static_cast<Conn*>(p);
      const size_t b = held_by(c);
      total += b;
      if (b > top_bytes) {
        top = c;
        top_bytes = b;
      }
    }
    if (total <= kMaxHeldBytesAll || !top) return;
    a->count_protocol_error();
    agent_log("closed the client (pid %d) holding the most memory, %zu bytes: all clients "
              "together held %zu, more than %zu", int(top->pid), top_bytes, total,
              kMaxHeldBytesAll);
    close_conn(top);
  }
}

void send(Conn* c, capnp::MessageBuilder& msg, bool close_after) {
  if (c->closing || c->close_pending) return;
  std::vector<uint8_t> bytes;
  std::string too_large;
  if (!encode_frame(msg, bb::proto::MAX_FRAME_BYTES, &bytes, &too_large)) {
    // Every reply that can grow (list, events, logs, actions) is cut to fit before it gets here;
    // one that still does not fit is answered with an error, never sent for the client to
    // refuse and drop the connection over.
    const uint64_t id = msg.getRoot<proto::Response>().getId();
    agent_log("reply to request %llu not sent: %s", (unsigned long long)id, too_large.c_str());
    send_error(c, id, proto::Error::Code::INTERNAL,
               "the reply is too large for one frame (" + too_large +
                   "): ask for less (a narrower list, fewer events or log bytes)",
               close_after);
    return;
  }
  if (c->sink) {
    c->sink->insert(c->sink->end(), bytes.begin(), bytes.end());
    if (close_after) close_conn(c);
    return;
  }
  auto* w = new WriteReq;
  w->bytes = std::move(bytes);
  w->conn = c;
  w->close_after = close_after;
  uv_buf_t buf = uv_buf_init(reinterpret_cast<char*>(w->bytes.data()),
                             static_cast<unsigned>(w->bytes.size()));
  if (close_after) stop_serving(c);
  int rc = uv_write(&w->req, reinterpret_cast<uv_stream_t*>(&c->pipe), &buf, 1,
                    [](uv_write_t* req, int) {
                      auto* w = reinterpret_cast<WriteReq*>(req);
                      if (w->close_after) close_conn(w->conn);
                      delete w;
                    });
  if (rc < 0) {
    delete w;
    close_conn(c);
    return;
  }
  const size_t queued = uv_stream_get_write_queue_size(reinterpret_cast<uv_stream_t*>(&c->pipe));
  if (queued > kMaxUnreadReplyBytes) {
    c->agent->count_protocol_error();
    agent_log("closed a client that left %zu bytes of replies unread (at most %zu)", queued,
              kMaxUnreadReplyBytes);
    close_conn(c);
    return;
  }
  bound_held_bytes(c->agent);
}

void send_error(Conn* c, uint64_t id, proto::Error::Code code, const std::string& message,
                bool close_after) {
  capnp::MallocMessageBuilder msg;
  auto resp = msg.initRoot<proto::Response>();
  resp.setId(id);
  auto err = resp.initError();
  err.setCode(code);
  err.setMessage(message);
  send(c, msg, close_after);
}

void fill_spec(proto::TaskSpec::Builder b, const TaskSpec& s) {
  b.setName(s.name);
  auto argv = b.initArgv(static_cast<unsigned>(s.argv.size()));
  for (size_t i = 0; i < s.argv.size(); ++i) argv.set(static_cast<unsigned>(i), s.argv[i]);
  auto env = b.initEnv(static_cast<unsigned>(s.env.size()));
  for (size_t i = 0; i < s.env.size(); ++i) env.set(static_cast<unsigned>(i), s.env[i]);
  b.setCwd(s.cwd);
  b.setHub(s.hub);
  b.setGpu(s.gpu);
  b.setPriority(s.priority);
  b.setMemNeed(s.mem_need);
  b.setMpsPriority(s.mps_priority);
  b.setMpsMemLimit(s.mps_mem_limit);
}

std::string text(capnp::Text::Reader t) { return std::string(t.cStr(), t.size()); }

bool printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char ch) {
    return static_cast<unsigned char>(ch) >= 0x20 && ch != 0x7f;
  });
}

std::string too_big(const char* what, size_t have, size_t limit, const char* unit) {
  return std::string("the task's ") + what + " has " + std::to_string(have) + " " + unit +
         ", more than the limit of " + std::to_string(limit) +
         ": pass large inputs in a file or through the task's working directory instead";
}

// Checks the sizes before anything is copied: a frame may hold millions of tiny entries.
std::string check_sizes(proto::TaskSpec::Reader r) {
  auto argv = r.getArgv();
  auto env = r.getEnv();
  if (argv.size() > kMaxArgs) return too_big("argv", argv.size(), kMaxArgs, "arguments");
  if (env.size() > kMaxEnv) return too_big("env", env.size(), kMaxEnv, "entries");
  size_t total = 0;
  for (auto a : argv) {
    if (a.size() > kMaxEntryBytes) return too_big("argv entry", a.size(), kMaxEntryBytes, "bytes");
    total += a.size();
  }
  for (auto e : env) {
    if (e.size() > kMaxEntryBytes) return too_big("env entry", e.size(), kMaxEntryBytes, "bytes");
    total += e.size();
  }
  if (total > kMaxSpecBytes) return too_big("argv and env together", total, kMaxSpecBytes, "bytes");
  // Kept with the task and sent back in every list: bounded like an argument.
  if (r.getCwd().size() > kMaxEntryBytes)
    return too_big("working directory", r.getCwd().size(), kMaxEntryBytes, "bytes");
  if (r.getMpsMemLimit().size() > kMaxMpsLimitBytes)
    return too_big("MPS memory limit", r.getMpsMemLimit().size(), kMaxMpsLimitBytes, "bytes");
  return "";
}

// Checks a submission. "" or what is wrong and how to fix it.
std::string read_spec(proto::TaskSpec::Reader r, TaskSpec* s) {
  if (std::string err = check_sizes(r); !err.empty()) return err;
  for (auto a : r.getArgv()) s->argv.push_back(text(a));
  if (s->argv.empty() || s->argv[0].empty()) {
    return "the task has no command: give it after `--`, e.g. `bubblectl submit -- ./task`";
  }
  for (const auto& a : s->argv) {
    if (a.find('\0') != std::string::npos) return "a task argument contains a NUL byte";
  }
  s->name = text(r.getName());
  if (s->name.empty()) {
    std::string base = s->argv[0].substr(s->argv[0].rfind('/') + 1);
    s->name = base.substr(0, 47);
  }
  if (s->name.size() > 47 || !printable(s->name)) {
    return "task name \"" + s->name + "\" must be 1..47 printable characters";
  }
  for (auto e : r.getEnv()) {
    std::string kv = text(e);
    size_t eq = kv.find('=');
    if (eq == 0 || eq == std::string::npos || kv.find('\0') != std::string::npos) {
      return "environment entry \"" + kv + "\" is not KEY=VALUE";
    }
    s->env.push_back(kv);
  }
  s->cwd = text(r.getCwd());
  if (s->cwd.find('\0') != std::string::npos) return "the working directory contains a NUL byte";
  if (!s->cwd.empty() && s->cwd[0] != '/') {
    return "working directory \"" + s->cwd + "\" must be an absolute path";
  }
  s->hub = text(r.getHub());
  if (s->hub.empty()) s->hub = "auto";
  std::string job;
  uint32_t rank;
  std::string why;
  if (s->hub != "auto" && !parse_hub_name(s->hub, &job, &rank, &why)) {
    return "hub \"" + s->hub + "\" is neither `auto` nor JOB:RANK (e.g. myjob:0): " + why;
  }
  s->gpu = r.getGpu();
  if (s->gpu < -1) return "GPU index " + std::to_string(s->gpu) + " is negative";
  s->priority = r.getPriority();
  s->mem_need = r.getMemNeed();
  s->mps_priority = r.getMpsPriority();
  if (s->mps_priority < -1 || s->mps_priority > 1) {
    return "MPS client priority must be 0 (normal) or 1 (below normal)";
  }
  s->mps_mem_limit = text(r.getMpsMemLimit());
  if (!printable(s->mps_mem_limit) || s->mps_mem_limit.find(' ') != std::string::npos) {
    return "MPS memory limit \"" + s->mps_mem_limit + "\" is malformed (e.g. 2G or 0=2G)";
  }
  return "";
}

void fill_record(proto::TaskRecord::Builder b, const TaskRow& r) {
  b.setId(static_cast<uint64_t>(r.id));
  fill_spec(b.initSpec(), r.spec);
  b.setState(r.state);
  b.setOrigin(r.origin);
  b.setHub(r.hub);
  b.setPid(r.pid);
  b.setExitCode(r.exit_code);
  b.setSignal(r.signal);
  b.setViolations(r.violations);
  b.setAttempts(r.attempts);
  b.setSubmittedAt(r.submitted_at);
  b.setStartedAt(r.started_at);
  b.setEndedAt(r.ended_at);
  b.setMessage(r.message);
  b.setSteps(r.steps);
  b.setNsInBubbles(r.ns_in_bubbles);
  b.setNsOutside(r.ns_outside);
}

// Reads up to max bytes of the log at path: its tail (offset < 0; *truncated says whether
// earlier bytes were left out), or what follows byte `offset`. *end is the byte after what was
// read.
void handle(Conn* c, capnp::MessageReader& msg) {
  Agent* a = c->agent;
  auto req = msg.getRoot<proto::Request>();
  uint64_t id = req.getId();
  capnp::MallocMessageBuilder out;
  auto resp = out.initRoot<proto::Response>();
  resp.setId(id);
  auto which = req.which();
  if (which == proto::Request::HELLO) {
    uint32_t v = req.getHello().getProtocolVersion();
    if (v != proto::PROTOCOL_VERSION) {
      a->count_protocol_error();
      send_error(c, id, proto::Error::Code::BAD_VERSION,
                 "client speaks protocol version " + std::to_string(v) + ", this bubbled speaks " +
                     std::to_string(proto::PROTOCOL_VERSION) +
                     ": use the bubblectl of the same libbubble release",
                 true);
      return;
    }
    c->hello = true;
    auto h = resp.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setAgentVersion(bb_version());
    h.setPid(getpid());
    h.setMetricsPort(a->metrics_port());
    h.setRuntimeDir(a->config().runtime_dir);
    h.setStateDir(a->config().state_dir);
    send(c, out, false);
    return;
  }
  if (!c->hello) {
    a->count_protocol_error();
    send_error(c, id, proto::Error::Code::BAD_REQUEST,
               "the first request on a connection must be hello (protocol version check)", true);
    return;
  }
  // Clients let in with --allow-uid watch; only the agent's own uid changes what it runs. A task
  // is started with the agent's uid and rights, so a submission from another uid would run its
  // command as the agent (as root, for an agent run by root).
  if ((which == proto::Request::SUBMIT || which == proto::Request::CANCEL ||
       which == proto::Request::DRAIN) &&
      c->uid != getuid()) {
    send_error(c, id, proto::Error::Code::PERMISSION,
               "uid " + std::to_string(c->uid) + " may watch this agent (--allow-uid) but not " +
                   (which == proto::Request::SUBMIT ? "submit tasks"
                    : which == proto::Request::CANCEL ? "cancel tasks"
                                                      : "drain hubs") +
                   ": tasks run as the agent's uid (" + std::to_string(getuid()) +
                   "), so only that uid may change them; run your own `bubbled` to run tasks "
                   "as yourself",
               false);
    return;
  }
  switch (which) {
    case proto::Request::SUBMIT: {
      TaskSpec spec;
      std::string err = read_spec(req.getSubmit(), &spec);
      if (err.empty()) {
        int64_t tid = 0;
        err = a->submit(spec, &tid);
        if (err.empty()) {
          resp.setSubmit(static_cast<uint64_t>(tid));
          break;
        }
        send_error(c, id, proto::Error::Code::INTERNAL, err, false);
        return;
      }
      send_error(c, id, proto::Error::Code::BAD_REQUEST, err, false);
      return;
    }
    case proto::Request::LIST: {
      a->refresh_all();
      std::vector<TaskRow> rows = a->tasks(req.getList().getAll());
      const size_t omitted = fit_list(&rows, ListBudget{}, kMaxEntryBytes);
      resp.setOmitted(static_cast<uint32_t>(std::min<size_t>(omitted, UINT32_MAX)));
      auto list = resp.initList(static_cast<unsigned>(rows.size()));
      for (size_t i = 0; i < rows.size(); ++i) fill_record(list[static_cast<unsigned>(i)], rows[i]);
      break;
    }
    case proto::Request::STATUS: {
      a->refresh_all();
      auto st = resp.initStatus();
      std::vector<const Hub*> hubs;
      for (const auto& [name, hub] : a->hubs()) hubs.push_back(hub.get());
      auto list = st.initHubs(static_cast<unsigned>(hubs.size()));
      for (size_t i = 0; i < hubs.size(); ++i) {
        const Hub* h = hubs[i];
        auto b = list[static_cast<unsigned>(i)];
        b.setName(h->name);
        b.setTrainerPid(h->snap.trainer_pid);
        b.setAlive(h->alive);
        b.setDraining(h->draining);
        b.setBubbles(h->snap.bubbles);
        b.setBubbleNs(h->snap.bubble_ns);
        b.setBubblesPerSec(h->bubbles_per_sec);
        b.setHarvestedNs(h->harvested_ns);
        b.setTasks(h->alive ? static_cast<uint32_t>(h->snap.tasks.size()) : 0);
        b.setMemGranted(a->granted_on(h->name));
        b.setFreeMem(h->snap.free_mem);
        b.setInBubble(h->alive && h->snap.in_bubble);
        auto g = a->config().hub_gpu.find(h->name);
        b.setGpu(g != a->config().hub_gpu.end() ? g->second : static_cast<int>(h->rank));
      }
      uint32_t queued = 0, running = 0;
      for (const TaskRow& r : a->tasks(false)) {
        if (r.state == "queued") ++queued;
        else ++running;
      }
      st.setQueued(queued);
      st.setRunning(running);
      st.setDraining(a->draining());
      st.setActions(a->store().count_actions());
      st.setPruned(a->store().pruned_tasks());
      st.setKeepEnded(a->config().keep_ended);
      break;
    }
    case proto::Request::CANCEL: {
      std::string done;
      bool not_found = false;
      std::string err = a->cancel(static_cast<int64_t>(req.getCancel()), &done, &not_found);
      if (!err.empty()) {
        send_error(c, id, not_found ? proto::Error::Code::NOT_FOUND : proto::Error::Code::STATE,
                   err, false);
        return;
      }
      resp.setOk(done);
      break;
    }
    case proto::Request::DRAIN: {
      std::string done;
      auto d = req.getDrain();
      std::string err = a->drain(text(d.getHub()), d.getUndo(), &done);
      if (!err.empty()) {
        send_error(c, id, proto::Error::Code::NOT_FOUND, err, false);
        return;
      }
      resp.setOk(done);
      break;
    }
    case proto::Request::LOGS: {
      auto l = req.getLogs();
      int64_t tid = static_cast<int64_t>(l.getTask());
      if (!a->task(tid)) {
        send_error(c, id, proto::Error::Code::NOT_FOUND,
                   "no task #" + std::to_string(tid) + ": see `bubblectl list --all` (the " +
                       "agent keeps the newest " + std::to_string(a->config().keep_ended) +
                       " ended tasks and their logs; bubbled --keep-ended)",
                   false);
        return;
      }
      if (a->task(tid)->origin == "attached") {
        send_error(c, id, proto::Error::Code::STATE,
                   "task #" + std::to_string(tid) +
                       " was started outside the agent: its output is wherever its starter "
                       "sent it",
                   false);
        return;
      }
      std::string path = a->log_path(tid, l.getStderr());
      // Whether the task had ended before the read: then the read saw all it will ever write.
      const bool final = state_is_final(a->task(tid)->state);
      LogRead got;
      std::string err;
      if (!read_log(path, l.getOffset(), std::min<uint32_t>(l.getMaxBytes(), 8u << 20),
                    a->log_kept_from(tid, l.getStderr()), &got, &err)) {
        send_error(c, id, proto::Error::Code::NOT_FOUND, err, false);
        return;
      }
      auto lr = resp.initLogs();
      lr.setPath(path);
      lr.setData(kj::arrayPtr(reinterpret_cast<const kj::byte*>(got.data.data()),
                              got.data.size()));
      lr.setTruncated(got.truncated);
      lr.setEnd(got.end);
      lr.setFinal(final);
      lr.setDropped(got.dropped);
      break;
    }
    case proto::Request::EVENTS: {
      a->refresh_all();
      double secs = req.getEvents().getSeconds();
      if (!(secs > 0) || secs > 86400) secs = 10;
      uint64_t now = mono_ns();
      uint64_t from = now > static_cast<uint64_t>(secs * 1e9) ? now - static_cast<uint64_t>(secs * 1e9) : 0;
      auto er = resp.initEvents();
      er.setNowNs(now);
      std::vector<const Hub*> hubs;
      for (const auto& [name, hub] : a->hubs()) {
        if (!hub->events.empty()) hubs.push_back(hub.get());
      }
      auto list = er.initHubs(static_cast<unsigned>(hubs.size()));
      const size_t budget = 400000 / std::max<size_t>(1, hubs.size());
      for (size_t i = 0; i < hubs.size(); ++i) {
        const Hub* h = hubs[i];
        auto b = list[static_cast<unsigned>(i)];
        b.setHub(h->name);
        b.setLost(h->lost);
        auto names = b.initTaskNames(static_cast<unsigned>(h->slot_names.size()));
        unsigned k = 0;
        for (const auto& [slot, name] : h->slot_names) {
          names[k].setSlot(slot);
          names[k].setName(name);
          ++k;
        }
        // The newest events of the window, kept in their order. The history is not sorted by
        // time (a step is stamped at its start, task reports arrive up to 10 ms late), so the
        // whole bounded history is looked at rather than stopping at the first older event.
        std::vector<size_t> picked;
        for (size_t j = h->events.size(); j-- > 0 && picked.size() < budget;)
          if (h->events[j].ts_ns >= from) picked.push_back(j);
        std::reverse(picked.begin(), picked.end());
        unsigned n = static_cast<unsigned>(picked.size());
        auto ts = b.initTsNs(n);
        auto ty = b.initType(n);
        auto sl = b.initSlot(n);
        auto ea = b.initA(n);
        auto eb = b.initB(n);
        for (unsigned j = 0; j < n; ++j) {
          const core::Event& e = h->events[picked[j]];
          ts.set(j, e.ts_ns);
          ty.set(j, static_cast<uint16_t>(e.type));
          sl.set(j, e.slot);
          ea.set(j, e.a);
          eb.set(j, e.b);
        }
      }
      break;
    }
    case proto::Request::ACTIONS: {
      std::vector<ActionRow> rows = a->store().load_actions(req.getActions());
      auto list = resp.initActions(static_cast<unsigned>(rows.size()));
      for (size_t i = 0; i < rows.size(); ++i) {
        auto b = list[static_cast<unsigned>(i)];
        b.setAtMs(rows[i].at_ms);
        b.setTask(static_cast<uint64_t>(rows[i].task));
        b.setPid(rows[i].pid);
        b.setHub(rows[i].hub);
        b.setAction(rows[i].action);
        b.setDetail(rows[i].detail);
      }
      break;
    }
    default:
      a->count_protocol_error();
      send_error(c, id, proto::Error::Code::BAD_REQUEST,
                 "unknown request (a newer client?): use the bubblectl of this release", false);
      return;
  }
  send(c, out, false);
}

void on_owed_timeout(uv_timer_t* t) {
  auto* c = static_cast<Conn*>(t->data);
  c->agent->count_protocol_error();
  // A client that does not read what it was sent would never let the error reply through, and
  // the connection would stay: close it without one (also when a closing reply is on its way).
  if (c->close_pending ||
      uv_stream_get_write_queue_size(reinterpret_cast<uv_stream_t*>(&c->pipe)) > 0) {
    close_conn(c);
    return;
  }
  const std::string within = std::to_string(kOwedBytesTimeoutMs / 1000) + " s";
  if (c->frames.pending() > 0)
    send_error(c, 0, proto::Error::Code::BAD_FRAME,
               "truncated frame: the rest did not arrive within " + within, true);
  else
    send_error(c, 0, proto::Error::Code::BAD_REQUEST,
               "no hello within " + within + " of connecting: a client says hello first "
               "(protocol version check); the connection is closed",
               true);
}

// Starts the owed-bytes deadline if c owes the agent bytes and has none running, and stops it
// once c owes nothing. A client that completed a frame made progress: a partial frame after it
// gets a deadline of its own (progressed).
void track_owed(Conn* c, bool progressed) {
  const bool owes = !c->hello || c->frames.pending() > 0;
  if (owes && c->timer && progressed) {
    uv_timer_start(c->timer, on_owed_timeout, kOwedBytesTimeoutMs, 0);  // restarts it
  } else if (owes && !c->timer) {
    c->timer = new_timer(c->pipe.loop, c);
    uv_timer_start(c->timer, on_owed_timeout, kOwedBytesTimeoutMs, 0);
  } else if (!owes && c->timer) {
    uv_timer_stop(c->timer);
    close_and_delete(c->timer);
    c->timer = nullptr;
  }
}

// Answers the complete frames buffered on c, at most `most` of them (*more: it stopped there with
// more perhaps left); false once c is closing.
bool process_frames(Conn* c, size_t most = SIZE_MAX, bool* more = nullptr) {
  for (size_t n = 0;; ++n) {
    if (n == most) {
      if (more) *more = true;
      return true;
    }
    std::unique_ptr<capnp::MessageReader> reader;
    std::string error;
    FrameReader::Result r = c->frames.next(&reader, &error);
    if (r == FrameReader::Result::kNeedMore) return true;
    if (r == FrameReader::Result::kError) {
      c->agent->count_protocol_error();
      send_error(c, 0, proto::Error::Code::BAD_FRAME, error, true);
      return false;
    }
    ++c->frames_served;
    try {
      handle(c, *reader);
    } catch (const kj::Exception& e) {
      c->agent->count_protocol_error();
      send_error(c, 0, proto::Error::Code::BAD_FRAME,
                 std::string("malformed request: ") + e.getDescription().cStr(), true);
      return false;
    } catch (const std::exception& e) {
      c->agent->count_protocol_error();
      send_error(c, 0, proto::Error::Code::INTERNAL, std::string("request failed: ") + e.what(),
                 true);
      return false;
    }
    if (c->closing || c->close_pending) return false;
  }
}

void on_read(uv_stream_t* s, ssize_t nread, const uv_buf_t* buf);
void on_backlog(uv_idle_t* idle);

void alloc_read(uv_handle_t*, size_t suggested, uv_buf_t* buf) {
  *buf = uv_buf_init(new char[suggested], static_cast<unsigned>(suggested));
}

// Answers a batch of c's buffered requests. With more left, c is not read meanwhile (what it
// sends waits in its socket) and the rest comes in a later loop turn, after whatever else is
// due: one client's pipelined requests (each may scan every task and hub) never hold the loop
// for their whole run. True when c stays open and has nothing left over.
bool serve_a_turn(Conn* c) {
  Agent* a = c->agent;
  const uint64_t served = c->frames_served;
  bool more = false;
  const size_t left = kFramesPerLoopTurn - std::min(kFramesPerLoopTurn, a->frames_this_turn_);
  if (!process_frames(c, std::min(kFramesPerTurn, left), &more)) return false;
  a->frames_this_turn_ += c->frames_served - served;
  track_owed(c, c->frames_served != served);
  if (more) {
    uv_read_stop(reinterpret_cast<uv_stream_t*>(&c->pipe));
    if (std::find(a->backlog_.begin(), a->backlog_.end(), c) == a->backlog_.end())
      a->backlog_.push_back(c);

    if (!a->backlog_idle_) {
      a->backlog_idle_ = new uv_idle_t;
      uv_idle_init(c->pipe.loop, a->backlog_idle_);
      a->backlog_idle_->data = a;
    }
    uv_idle_start(a->backlog_idle_, on_backlog);
  }
  bound_held_bytes(a);
  return !more && !c->closing;
}

void on_read(uv_stream_t* s, ssize_t nread, const uv_buf_t* buf) {
  auto* c = static_cast<Conn*>(s->data);
  if (nread > 0) c->frames.feed(buf->base, static_cast<size_t>(nread));
  delete[] buf->base;
  if (c->closing) return;
  if (nread < 0) {
    if (nread == UV_EOF && c->frames.pending() > 0) {
      c->agent->count_protocol_error();
      send_error(c, 0, proto::Error::Code::BAD_FRAME,
                 "truncated frame: the connection ended " + std::to_string(c->frames.pending()) +
                     " bytes into a frame",
                 true);
    } else if (nread == UV_EOF && !c->sink &&
               uv_stream_get_write_queue_size(reinterpret_cast<uv_stream_t*>(&c->pipe)) > 0) {
      // The client shut its side after its requests (a half-close) and may still be reading:
      // the replies queued for it go out before the connection closes.
      stop_serving(c);
      auto* req = new uv_shutdown_t;
      req->data = c;
      // Runs before the handle's close callback frees c, also when a close cancels it.
      if (uv_shutdown(req, s, [](uv_shutdown_t* r, int) {
            close_conn(static_cast<Conn*>(r->data));
            delete r;
          }) < 0) {
        delete req;
        close_conn(c);
      }
    } else {
      close_conn(c);
    }
    return;
  }
  serve_a_turn(c);
}

void on_backlog(uv_idle_t* idle) {
  auto* a = static_cast<Agent*>(idle->data);
  // In the order they were left; one the turn's budget does not reach goes back to the end.
  std::vector<void*> turn(a->backlog_.begin(), a->backlog_.end());
  a->backlog_.clear();
  for (void* p : turn) {
    auto* c = static_cast<Conn*>(p);
    if (c->closing) continue;  // close_conn took it out of the backlog; not freed before uv_close
    if (serve_a_turn(c))
      uv_read_start(reinterpret_cast<uv_stream_t*>(&c->pipe), alloc_read, on_read);
  }
  if (a->backlog_.empty()) uv_idle_stop(idle);
}

void on_connection(uv_stream_t* server, int status) {
  if (status < 0) return;
  auto* agent = static_cast<Agent*>(server->data);
  auto* c = new Conn;
  c->agent = agent;
  uv_pipe_init(server->loop, &c->pipe, 0);
  c->pipe.data = c;
  if (uv_accept(server, reinterpret_cast<uv_stream_t*>(&c->pipe)) != 0) {
    uv_close(reinterpret_cast<uv_handle_t*>(&c->pipe),
             [](uv_handle_t* h) { delete static_cast<Conn*>(h->data); });
    return;
  }
  agent->clients_.insert(c);
  uv_os_fd_t fd;
  uv_fileno(reinterpret_cast<uv_handle_t*>(&c->pipe), &fd);
  struct ucred cred {};
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    agent->count_refused();
    send_error(c, 0, proto::Error::Code::PERMISSION,
               "cannot read the client's credentials; connection refused", true);
    return;
  }
  c->uid = cred.uid;
  c->pid = cred.pid;
  const auto& allow = agent->config().allow_uids;
  if (cred.uid != getuid() && !allow.count(cred.uid)) {
    agent->count_refused();
    agent_log("refused a client of uid %u (pid %d)", cred.uid, cred.pid);
    send_error(c, 0, proto::Error::Code::PERMISSION,
               "uid " + std::to_string(cred.uid) + " may not use this agent (it runs as uid " +
                   std::to_string(getuid()) +
                   "): use your own `bubbled`, or start this one with --allow-uid " +
                   std::to_string(cred.uid),
               true);
    return;
  }
  // Only admitted connections count: the ones being refused (and closed once their reply is
  // written, in a later loop turn) must not make room scarce for the next.
  size_t admitted = 0, guests = 0;
  for (void* p : agent->clients_) {
    const Conn* o = static_cast<Conn*>(p);
    admitted += o->admitted;
    guests += o->admitted && o->uid != getuid();
  }
  if (cred.uid != getuid() && guests >= kMaxGuestClients) {
    agent->count_refused();
    send_error(c, 0, proto::Error::Code::STATE,
               "the agent serves at most " + std::to_string(kMaxGuestClients) +
                   " connections from users other than its own at once; close some and retry",
               true);
    return;
  }
  if (admitted >= kMaxClients) {
    send_error(c, 0, proto::Error::Code::STATE,
               "the agent has too many open connections; retry shortly", true);
    return;
  }
  c->admitted = true;
  track_owed(c, false);  // its hello is owed from now
  uv_read_start(reinterpret_cast<uv_stream_t*>(&c->pipe), alloc_read, on_read);
}

}  // namespace

ControlFeed::ControlFeed(Agent* agent) {
  auto* c = new Conn;
  c->agent = agent;
  c->sink = &replies_;
  c->uid = getuid();
  c->pid = getpid();
  c->admitted = true;
  agent->clients_.insert(c);
  conn_ = c;
}

ControlFeed::~ControlFeed() {
  auto* c = static_cast<Conn*>(conn_);
  close_conn(c);
  delete c;
}

bool ControlFeed::feed(const uint8_t* data, size_t len) {
  auto* c = static_cast<Conn*>(conn_);
  if (c->closing) return false;
  c->frames.feed(reinterpret_cast<const char*>(data), len);
  return process_frames(c);
}

bool ControlFeed::end() {
  auto* c = static_cast<Conn*>(conn_);
  if (c->closing) return false;
  if (c->frames.pending() > 0) {
    c->agent->count_protocol_error();
    send_error(c, 0, proto::Error::Code::BAD_FRAME,
               "truncated frame: the connection ended " + std::to_string(c->frames.pending()) +
                   " bytes into a frame",
               true);
    return false;
  }
  close_conn(c);
  return true;
}

std::string Agent::start_control() {
  const std::string& path = cfg_.socket_path;
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return "socket path " + path + " is longer than " +
           std::to_string(sizeof(sockaddr_un::sun_path) - 1) + " bytes: choose a shorter --socket";
  }
  std::string dir = path.substr(0, path.rfind('/'));
  if (!dir.empty()) {
    std::string e = make_dirs(dir, 0700);
    if (!e.empty()) return e;
  }
  // A socket file may be left by an agent that died: remove it only if nobody answers on it.
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return path + " exists and is not a socket: remove it or choose another --socket";
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path.c_str(), path.size());
    bool live = fd >= 0 && connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
    if (fd >= 0) close(fd);
    if (live) return "another bubbled already serves " + path + ": stop it first";
    unlink(path.c_str());
  }
  control_ = new uv_pipe_t;
  uv_pipe_init(loop_, control_, 0);
  control_->data = this;
  // The socket is created owner-only: no window in which another user could connect.
  mode_t old = umask(0177);
  int rc = uv_pipe_bind(control_, path.c_str());
  umask(old);
  if (rc < 0) return "cannot bind " + path + ": " + uv_strerror(rc);
  chmod(path.c_str(), 0600);
  // No client passes descriptors. The kernel would close any that came with a read on the
  // loop's thread, and some closes block (a TCP socket lingering with unsent data): refuse them
  // at the sender instead (Linux 6.16+; accepted sockets inherit it).
  uv_os_fd_t lfd = -1;
  if (uv_fileno(reinterpret_cast<uv_handle_t*>(control_), &lfd) == 0)
    (void)shm::refuse_passed_fds(lfd);
  rc = uv_listen(reinterpret_cast<uv_stream_t*>(control_), 64, on_connection);
  if (rc < 0) return "cannot listen on " + path + ": " + uv_strerror(rc);
  // The requests' budget of a loop turn starts over after each poll for I/O.
  turn_check_ = new uv_check_t;
  uv_check_init(loop_, turn_check_);
  turn_check_->data = this;
  uv_check_start(turn_check_, [](uv_check_t* h) {
    auto* a = static_cast<Agent*>(h->data);
    a->frames_most_per_turn_ = std::max(a->frames_most_per_turn_, a->frames_this_turn_);
    a->frames_this_turn_ = 0;
  });
  uv_unref(reinterpret_cast<uv_handle_t*>(turn_check_));  // never what keeps the loop alive
  return "";
}

void close_all_clients(Agent* agent) {
  std::vector<void*> all(agent->clients_.begin(), agent->clients_.end());
  for (void* c : all) close_conn(static_cast<Conn*>(c));
  if (agent->turn_check_) {
    uv_check_stop(agent->turn_check_);
    close_and_delete(agent->turn_check_);
    agent->turn_check_ = nullptr;
  }
  if (agent->backlog_idle_) {
    uv_idle_stop(agent->backlog_idle_);
    close_and_delete(agent->backlog_idle_);
    agent->backlog_idle_ = nullptr;
  }
}

}  // namespace bb::daemon
