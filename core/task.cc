#include "core/task.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "core/clock.h"
#include "core/error.h"
#include "core/grant_wire.h"
#include "core/paths.h"
#include "shm/futex.h"
#include "shm/wire.h"

namespace bb::core {
namespace {

// A sleeping task looks at its connection this often, so it notices a trainer that died
// without being able to say so (the futex word will never change again).
constexpr int64_t kLivenessSliceNs = 100'000'000;
constexpr uint64_t kMinSpinNs = 1'000;
constexpr uint64_t kMaxWaitOptionNs = 1'000'000'000;  // wake_lead_ns and spin_ns
constexpr uint64_t kReattachPollNs = 50'000'000;
// How long an attach waits for a trainer to take the connection and answer; a re-attach's try
// waits at least kMinAnswerNs (see reattach).
constexpr uint64_t kAnswerTimeoutNs = 5'000'000'000;
constexpr uint64_t kMinAnswerNs = 250'000'000;

// A number the node agent put in a task's environment (see Task::attach). Absent or empty:
// *found = false. Otherwise it must be a whole number in [lo, hi] (unsigned when lo == 0).
bb_status env_number(const char* var, long long lo, unsigned long long hi,
                     unsigned long long* out, bool* found) {
  *found = false;
  const char* v = std::getenv(var);
  if (!v || !*v) return BB_OK;
  char* end = nullptr;
  errno = 0;
  bool ok = std::isdigit(static_cast<unsigned char>(v[0])) || (lo < 0 && v[0] == '-');
  if (lo < 0) {
    const long long x = std::strtoll(v, &end, 10);
    ok = ok && errno == 0 && *end == 0 && x >= lo && (x < 0 || (unsigned long long)x <= hi);
    *out = static_cast<unsigned long long>(x);
  } else {
    const unsigned long long x = std::strtoull(v, &end, 10);
    ok = ok && errno == 0 && *end == 0 && x <= hi;
    *out = x;
  }
  if (!ok)
    return fail(BB_E_INVALID, "%s is '%s', but must be decimal digits%s, from %lld to %llu: the "
                "node agent sets it from the submission; correct it or unset it", var, v,
                lo < 0 ? " (a leading - allowed)" : "", lo, hi);
  *found = true;
  return BB_OK;
}

}  // namespace

bb_status Task::attach(const char* job_id, uint32_t rank, const char* name,
                       const bb_task_options_t& opts, std::unique_ptr<Task>* out) {
  bb_status st;
  if ((st = check_job_id(job_id)) != BB_OK || (st = check_rank(rank)) != BB_OK ||
      (st = check_task_name(name)) != BB_OK)
    return st;
  if (opts.on_trainer_exit > BB_ON_TRAINER_EXIT_WAIT)
    return fail(BB_E_INVALID, "on_trainer_exit %u is not a bb_on_trainer_exit value",
                opts.on_trainer_exit);
  if (opts.wake_mode > BB_WAKE_SPIN)
    return fail(BB_E_INVALID, "wake_mode %u is not a bb_wake_mode value", opts.wake_mode);
  // Waits spin for these and for small multiples of them; beyond a second they are mistakes.
  if (opts.wake_lead_ns > kMaxWaitOptionNs || opts.spin_ns > kMaxWaitOptionNs)
    return fail(BB_E_INVALID, "%s %llu ns is over 1 s: it is how long a waiting task spins, "
                "microseconds in practice (defaults: wake_lead_ns 50 us, spin_ns 20 us)",
                opts.wake_lead_ns > kMaxWaitOptionNs ? "wake_lead_ns" : "spin_ns",
                (unsigned long long)(opts.wake_lead_ns > kMaxWaitOptionNs ? opts.wake_lead_ns
                                                                          : opts.spin_ns));
  // A task the node agent launched carries its submission's priority and memory need
  // (bubblectl submit --priority, --mem) in its environment: they apply where the options
  // leave 0, so the hub sees what the agent placed the task by.
  bb_task_options_t eff = opts;
  unsigned long long v = 0;
  bool found = false;
  if ((st = env_number("BUBBLE_PRIORITY", INT32_MIN, INT32_MAX, &v, &found)) != BB_OK) return st;
  if (found && eff.priority == 0) eff.priority = int32_t(static_cast<long long>(v));
  if ((st = env_number("BUBBLE_MEM_NEED", 0, UINT64_MAX, &v, &found)) != BB_OK) return st;
  if (found && eff.mem_need == 0) eff.mem_need = v;
  std::unique_ptr<Task> t(new Task());
  if ((st = resolve_runtime_dir(opts.runtime_dir, false, &t->dir_)) != BB_OK) return st;
  t->job_ = job_id;
  t->name_ = name;
  t->rank_ = rank;
  t->opts_ = eff;
  t->opts_.runtime_dir = nullptr;
  t->spin_ns_ = opts.spin_ns;
  if ((st = t->connect()) != BB_OK) return st;
  *out = std::move(t);
  return BB_OK;
}

Task::~Task() {
  if (sock_ && !finished_) {
    if (epoch_ != 0) ack(epoch_, false);
    page_->state.store(uint32_t(shm::TaskRunState::kFinished), std::memory_order_release);
  }
  release();
}

void Task::release() {
  // Give the grant back before the connection closes, and one offered but never mapped too: a
  // task that leaves holding one may be killed by the trainer, since it might go on using it.
  // That includes leaving because the trainer is closing: it waits for its memory to come back.
  if (sock_ && ctl_) {
    // Folded steps still owed: in now, or counted as dropped.
    if (!flush_steps(0)) page_->dropped.fetch_add(pending_steps_.count, std::memory_order_relaxed);
    pending_steps_.count = 0;
    (void)drop_grant();
    GrantWords w;
    if (read_grant(ctl_, &w) && w.grant_id != 0 && w.grant_id != grant_id_ &&
        w.grant_id != grant_refused_)
      give_back(w.grant_id);
  }
  // Without a trainer there is nothing to run for: should_pause() says so without touching the
  // (now unmapped) slot.
  trainer_lost_ = true;
  // The trainer is gone (or we are): its grant goes with it, unacked.
  mapping_.reset();
  grant_id_ = 0;
  grant_backend_ = GrantBackend::kNone;
  grant_synced_ = false;
  grant_refused_ = 0;
  pending_fd_.reset();
  pending_fd_id_ = 0;
  started_report_.count = 0;  // of a run on the old hub
  ctl_ = nullptr;
  alive_word_ = nullptr;
  page_ = nullptr;
  hub_.base = nullptr;
  page_map_.reset();
  hub_map_.reset();
  sock_.reset();
  epoch_ = 0;
  report_cached_head_ = 0;
  unmap_failed_ = 0;  // grant ids are the trainer's: a new one starts them again
}

bb_status Task::connect(uint64_t deadline_ns) {
  std::string path;
  bb_status st = hub_paths(dir_, job_.c_str(), rank_, &path, nullptr);
  if (st != BB_OK) return st;
  shm::Fd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!s) return fail(BB_E_SYSTEM, "socket() failed: %s", std::strerror(errno));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  // A trainer that accepts but never answers must not hang the attach; nor one that stopped
  // accepting (stopped, frozen): its backlog fills, and a connect to a full backlog waits for
  // as long as the send timeout allows. So both are set before the connect.
  const uint64_t now = now_ns();
  const uint64_t wait_ns = std::max<uint64_t>(
      1'000'000, std::min<uint64_t>(kAnswerTimeoutNs, deadline_ns > now ? deadline_ns - now : 0));
  timeval tv{time_t(wait_ns / 1'000'000'000), suseconds_t(wait_ns % 1'000'000'000 / 1000)};
  const unsigned long long wait_ms = wait_ns / 1'000'000;
  setsockopt(s.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(s.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return fail(BB_E_TIMEOUT, "the trainer of hub %s.%u is not accepting connections (its "
                  "backlog stayed full for %llu ms: is it stopped or hung?)", job_.c_str(), rank_,
                  wait_ms);
    if (errno == ENOENT || errno == ECONNREFUSED)
      return fail(BB_E_NOT_FOUND, "no trainer serves hub %s.%u (%s %s): start the trainer first, "
                  "and give both the same job id, rank and runtime directory", job_.c_str(), rank_,
                  path.c_str(), errno == ENOENT ? "does not exist" : "is left from a dead trainer");
    if (errno == EACCES)
      return fail(BB_E_PERMISSION, "no permission to connect to hub socket %s: run the task as "
                  "the trainer's user", path.c_str());
    return fail(BB_E_SYSTEM, "cannot connect to hub socket %s: %s", path.c_str(),
                std::strerror(errno));
  }
  // Only a trainer of our own uid (or root) may hand us memory to map.
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(s.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      (cred.uid != geteuid() && cred.uid != 0))
    return fail(BB_E_PERMISSION, "hub socket %s is served by uid %u, not by our uid %u: refusing "
                "to attach", path.c_str(), cred.uid, unsigned(geteuid()));

  auto m = shm::make_msg<shm::AttachTaskMsg>(shm::MsgType::kAttachTask);
  m.priority = opts_.priority;
  m.pid = int32_t(getpid());
  m.mem_need = opts_.mem_need;
  m.min_step_ns = opts_.min_step_ns;
  std::snprintf(m.name, sizeof m.name, "%s", name_.c_str());
  // A send that finds the connection shut (EPIPE, ECONNRESET) still reads the answer: a trainer
  // that refuses before reading (too many connections) shuts its side first and then answers.
  // No answer means it went away during the attach, as a trainer closing its hub does with a
  // connection still in its backlog (a task that waits for it to reopen the hub tries again).
  const int sent = shm::send_msg(s.get(), &m, sizeof m, nullptr, 0);
  if (sent != 0 && sent != ECONNRESET && sent != EPIPE)
    return fail(BB_E_SYSTEM, "cannot send the attach request to %s: %s", path.c_str(),
                std::strerror(sent));
  alignas(8) char buf[shm::kWireMaxMessage];
  int fds[2], nfds;
  const long n = shm::recv_msg(s.get(), buf, fds, &nfds);
  shm::Fd hub_fd(fds[0]), page_fd(fds[1]);
  if (n == -EAGAIN || n == -EWOULDBLOCK)
    return fail(BB_E_TIMEOUT, "the trainer at %s did not answer the attach request within %llu ms "
                "(is it stopped or hung?)", path.c_str(), wait_ms);
  if (n == -EMFILE)
    return fail_msg(BB_E_SYSTEM, "cannot attach to the trainer at " + path + ": the hub's "
                    "memory comes as descriptors, and " + shm::no_fd_room_message());
  if (n <= 0)
    return fail(BB_E_TRAINER_GONE, "the trainer at %s closed the connection during attach",
                path.c_str());
  shm::MsgHeader h{};
  std::memcpy(&h, buf, std::min(sizeof h, size_t(n)));
  if (h.magic == shm::kWireMagic && h.version != shm::kWireVersion)
    return fail(BB_E_VERSION, "the trainer speaks hub protocol %u but this libbubble speaks %u: "
                "build both against the same libbubble release", h.version, shm::kWireVersion);
  if (!shm::check_msg(buf, n, shm::MsgType::kAttachReply, sizeof(shm::AttachReplyMsg)))
    return fail(BB_E_VERSION, "the peer at %s answered with a malformed attach reply: it is not "
                "a compatible libbubble trainer", path.c_str());
  shm::AttachReplyMsg r;
  std::memcpy(&r, buf, sizeof r);
  r.error[sizeof r.error - 1] = 0;
  if (r.status != BB_OK) return fail_msg(bb_status(r.status), r.error);
  if (nfds != 2) return fail(BB_E_CORRUPT, "the trainer's attach reply lacks its segments");

  // Map the hub read-only and check it before reading anything else from it.
  std::string err;
  const int64_t hub_size = shm::segment_size(hub_fd.get());
  if (hub_size < int64_t(sizeof(shm::HubHeader)) || uint64_t(hub_size) != r.hub_size)
    return fail(BB_E_CORRUPT, "the hub segment's size (%lld bytes) does not match the trainer's "
                "reply (%llu bytes)", (long long)hub_size, (unsigned long long)r.hub_size);
  shm::Mapping hub = shm::map_segment(hub_fd.get(), size_t(hub_size), false, &err);
  if (!hub) return fail_msg(BB_E_SYSTEM, err);
  if (!shm::validate_hub(hub.data(), uint64_t(hub_size), &err))
    return fail_msg(err.find("version") != std::string::npos ? BB_E_VERSION : BB_E_CORRUPT, err);
  if (shm::segment_size(page_fd.get()) != int64_t(shm::kTaskPageSize))
    return fail(BB_E_CORRUPT, "the task page from the trainer has the wrong size");
  shm::Mapping page = shm::map_segment(page_fd.get(), shm::kTaskPageSize, true, &err);
  if (!page) return fail_msg(BB_E_SYSTEM, err);
  shm::HubView view{hub.data()};
  if (r.slot >= view.header()->max_slots)
    return fail(BB_E_CORRUPT, "the trainer assigned slot %u of %u", r.slot,
                view.header()->max_slots);

  sock_ = std::move(s);
  hub_map_ = std::move(hub);
  page_map_ = std::move(page);
  hub_ = view;
  slot_ = r.slot;
  generation_ = r.generation;
  ctl_ = hub_.slot(slot_);
  // Read after the attach was answered, so after the service thread took the mutex; anything
  // but a 4-aligned offset inside the mutex leaves the task without the one-load check.
  const uint32_t alive = hub_.stats()->alive_word.load(std::memory_order_acquire);
  alive_word_ = alive % 4 == 0 && alive <= sizeof(shm::HubStats::alive_mutex) - 4
                    ? reinterpret_cast<const uint32_t*>(hub_.stats()->alive_mutex + alive)
                    : nullptr;
  page_ = reinterpret_cast<shm::TaskPage*>(page_map_.data());
  page_->state.store(uint32_t(shm::TaskRunState::kIdle), std::memory_order_release);
  epoch_ = 0;
  report_cached_head_ = 0;
  grant_synced_ = false;  // whatever grant_change says now, look at the grant words once
  trainer_lost_ = false;
  next_liveness_check_ns_ = 0;
  return BB_OK;
}

bool Task::trainer_gone() const {
  if (!sock_) return true;
  if (slot_lost()) return true;  // for us it is gone, whether it lives or not
  if (hub_.stats()->closing.load(std::memory_order_acquire) || trainer_died()) return true;
  pollfd p{sock_.get(), POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR)) return true;
  char c;
  return recv(sock_.get(), &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

void Task::check_trainer_while_running() const {
  if (epoch_ == 0 || trainer_lost_ || !sock_) return;
  const uint64_t now = now_ns();
  if (now < next_liveness_check_ns_) return;
  next_liveness_check_ns_ = now + kLivenessSliceNs;
  if (trainer_gone()) trainer_lost_ = true;
}

bb_status Task::lose_trainer(uint64_t wait_until) {
  if (!slot_lost() || opts_.on_trainer_exit == BB_ON_TRAINER_EXIT_WAIT) return reattach(wait_until);
  release();
  return fail(BB_E_TRAINER_GONE, "the trainer of hub %s.%u dropped this task from its slot (the "
              "process that attached it exited, or its connection broke): attach again",
              job_.c_str(), rank_);
}

bb_status Task::reattach(uint64_t wait_until) {
  release();
  if (opts_.on_trainer_exit != BB_ON_TRAINER_EXIT_WAIT)
    return fail(BB_E_TRAINER_GONE, "the trainer of hub %s.%u closed its hub or exited",
                job_.c_str(), rank_);
  if (reattach_until_ == 0) {
    // UINT64_MAX (say) waits for good rather than wrapping
    reattach_until_ = add_sat(now_ns(), opts_.reattach_timeout_ns);
  }
  for (;;) {
    // A try waits for an answer until the re-attach timeout, and at least kMinAnswerNs even
    // when the wait's own timeout is shorter: a try given up early would still have cost the
    // new trainer a slot for a moment, and one that answers a little slowly would never be
    // waited for at all.
    const uint64_t answer_by =
        std::min(reattach_until_, std::max(wait_until, add_sat(now_ns(), kMinAnswerNs)));
    const bb_status st = connect(answer_by);
    // Not there yet, gone again, too busy to take us (BB_E_FULL: its slots, or its
    // connections), not answering (BB_E_TIMEOUT: a trainer that is stopped, hung, or whose
    // backlog is full), or short of descriptors or memory, its or ours (BB_E_SYSTEM): tried
    // again until the timeout.
    if (st == BB_OK || (st != BB_E_NOT_FOUND && st != BB_E_TRAINER_GONE && st != BB_E_FULL &&
                        st != BB_E_TIMEOUT && st != BB_E_SYSTEM)) {
      reattach_until_ = 0;
      return st;
    }
    const uint64_t now = now_ns();
    if (now >= reattach_until_) {
      reattach_until_ = 0;
      const unsigned long long ms = opts_.reattach_timeout_ns / 1000000;
      if (st == BB_E_FULL)
        return fail_msg(BB_E_FULL, "the new trainer of hub " + job_ + "." + std::to_string(rank_) +
                        " had no room for this task within " + std::to_string(ms) + " ms: " +
                        last_error());
      if (st == BB_E_SYSTEM)
        return fail_msg(BB_E_SYSTEM, "could not attach again to hub " + job_ + "." +
                        std::to_string(rank_) + " within " + std::to_string(ms) + " ms: " +
                        last_error());
      if (st == BB_E_TIMEOUT)
        return fail_msg(BB_E_TRAINER_GONE, "the trainer of hub " + job_ + "." +
                        std::to_string(rank_) + " exited, and the one now serving the hub did "
                        "not take this task within " + std::to_string(ms) + " ms: " +
                        last_error());
      return fail(BB_E_TRAINER_GONE, "the trainer of hub %s.%u exited and no trainer reopened the "
                  "hub within %llu ms", job_.c_str(), rank_, ms);
    }
    // A wait with a timeout (an idle callback's slice among them) comes back meanwhile.
    if (now >= wait_until)
      return fail(BB_E_TIMEOUT, "no bubble started this task within the timeout (it is waiting "
                  "for its trainer to reopen the hub)");
    sleep_ns(std::min<uint64_t>({kReattachPollNs, reattach_until_ - now, wait_until - now}));
  }
}

bool Task::flush_steps(uint32_t keep_free) {
  if (pending_steps_.count == 0) return true;
  if (shm::ring_push(page_->reports, ctl_->report_head, report_cached_head_, pending_steps_,
                     keep_free) != shm::RingStatus::kOk)
    return false;
  pending_steps_.count = 0;
  return true;
}

void Task::push_report(shm::ReportType type, uint64_t a, uint64_t b, uint64_t ts) {
  if (started_report_.count != 0) {  // the STARTED of the current run goes first
    if (shm::ring_push(page_->reports, ctl_->report_head, report_cached_head_, started_report_) !=
        shm::RingStatus::kOk)
      page_->dropped.fetch_add(1, std::memory_order_relaxed);
    started_report_.count = 0;
  }
  shm::Report r{uint16_t(type), 1, epoch_, ts ? ts : now_ns(), a, b};
  // Steps fill at most half of the ring: the rest stays free for the reports that cannot be
  // folded together (STARTED, PAUSED, FINISHED), so a task stepping faster than the hub service
  // drains loses none of those. Steps past that are folded into one report until there is room.
  // Folded steps are steps too: they never take the room kept for the others, and a report
  // of another kind goes in even when they cannot (they follow it once there is room).
  const bool step = type == shm::ReportType::kStep;
  const uint32_t keep_free = step ? shm::kReportRingSize / 2 : 0;
  const bool flushed = flush_steps(shm::kReportRingSize / 2);
  if ((flushed || !step) && shm::ring_push(page_->reports, ctl_->report_head,
                                           report_cached_head_, r, keep_free) ==
                                shm::RingStatus::kOk) {
    if (!flushed) flush_steps(shm::kReportRingSize / 2);  // once there is room; release() last
    return;
  }
  if (type == shm::ReportType::kStep && pending_steps_.count < UINT16_MAX) {
    if (pending_steps_.count == 0) {
      pending_steps_ = r;
    } else {
      pending_steps_.count++;
      pending_steps_.ts_ns = r.ts_ns;
      pending_steps_.a += a;
      pending_steps_.b += b;
    }
    return;
  }
  page_->dropped.fetch_add(1, std::memory_order_relaxed);
}

void Task::ack(uint32_t epoch, bool yielded) {
  const uint64_t now = now_ns();
  // Pause latency counts from the trainer's pause request; a task that yields before the bubble
  // ends has none (b = 1 marks it).
  uint64_t latency = 0;
  if (!yielded && ctl_->paused_epoch.load(std::memory_order_acquire) == epoch) {
    const uint64_t req = ctl_->pause_requested_ns.load(std::memory_order_relaxed);
    latency = now > req ? now - req : 0;
  }
  const uint32_t saved = epoch_;
  epoch_ = epoch;
  push_report(shm::ReportType::kPaused, latency, yielded ? 1 : 0);
  epoch_ = saved;
  page_->ack_ns.store(now, std::memory_order_relaxed);
  page_->state.store(uint32_t(shm::TaskRunState::kIdle), std::memory_order_relaxed);
  page_->acked_epoch.store(epoch, std::memory_order_release);
}

bb_status Task::ack_pause() {
  if (!sock_) return fail(BB_E_TRAINER_GONE, "the task is not attached (its trainer went away)");
  if (epoch_ != 0) {
    // A task that acks while the bubble still runs is yielding the rest of it.
    const bool yielded = ctl_->run_epoch.load(std::memory_order_acquire) == epoch_;
    ack(epoch_, yielded);
    epoch_ = 0;
  }
  // Paused means the task no longer touches its grant: the moment to give back a revoked one.
  return sync_grant(kUnmap);
}

bb_status Task::wait_start(int64_t timeout_ns, bb_start_info_t* out) {
  if (stopped_) return fail(BB_E_STOPPED, "the task was told to stop: finish and detach");
  const uint64_t start = now_ns();
  const uint64_t until = timeout_ns < 0 ? UINT64_MAX : start + uint64_t(timeout_ns);
  if (!sock_) {
    bb_status st = reattach(until);
    if (st != BB_OK) return st;
  }
  // Dropped by a trainer that lives on (the process that attached exited and left this task to
  // a fork, or the connection broke): the slot's starts are not ours any more, whoever's they
  // are now. Checked here, off the path from a start to its task, and by every liveness look.
  if (trainer_lost_ || slot_lost()) {
    bb_status st = lose_trainer(until);
    if (st != BB_OK) return st;
  }
  if (epoch_ != 0) ack_pause();  // waiting again means the previous run is over
  uint64_t seen_ns = 0;  // when the last wait saw the doorbell move
  for (;;) {
    const uint32_t bell = ctl_->doorbell.load(std::memory_order_acquire);
    // Dropped while we waited, and the slot given to another task: its starts and grants are
    // not ours (the generation is on the line of the bell just read).
    if (slot_reused()) {
      if (const bb_status st = lose_trainer(until); st != BB_OK) return st;
      continue;
    }
    // After loading the bell: a grant change made after this look also moves the bell.
    const uint64_t held = grant_id_;
    if (const bb_status gs = sync_grant(kUnmap | kMap); gs != BB_OK) return gs;
    if (grant_id_ != held) seen_ns = 0;  // a start found now also waited for that (un)mapping
    // A start not taken yet: its block (on the line of the bell just read) is stable until we
    // ack its epoch.
    const uint32_t given = ctl_->given_epoch.load(std::memory_order_acquire);
    // A start given to the slot's next task (we were dropped after the look above): the
    // trainer wrote that task's generation before it gave the start, so this acquire shows it.
    if (given != 0 && slot_reused()) continue;  // the look at the loop's top loses the slot
    if (given != 0 && given != page_->acked_epoch.load(std::memory_order_relaxed)) {
      if (ctl_->run_epoch.load(std::memory_order_acquire) != given) {
        // The bubble ended before we saw its start (a wake-up that came late). It is still a
        // start, and its latency the longest kind: report it (ack pushes it first), then ack at
        // once so the trainer may start us again.
        stamp_started(given, seen_ns);
        ack(given, false);
        seen_ns = 0;
        continue;
      }
      Start cmd;
      cmd.epoch = given;
      cmd.kind = ctl_->start_kind.load(std::memory_order_relaxed);
      cmd.bubble_seq = ctl_->start_seq.load(std::memory_order_relaxed);
      cmd.begin_ns = ctl_->start_begin_ns.load(std::memory_order_relaxed);
      cmd.deadline_ns = ctl_->start_deadline_ns.load(std::memory_order_relaxed);
      cmd.free_mem = ctl_->start_free_mem.load(std::memory_order_relaxed);
      cmd.grant_id = ctl_->start_grant_id.load(std::memory_order_relaxed);
      if (cmd.grant_id != 0 && cmd.grant_id != grant_id_) {
        // Started with a grant we have not looked at yet (the bubble thread raced our look):
        // the start waits for its mapping, so its time is read after it.
        seen_ns = 0;
        if (const bb_status gs = sync_grant(kUnmap | kMap); gs != BB_OK) {
          stamp_started(cmd.epoch, 0);  // every start is reported, a failed one too
          ack(cmd.epoch, false);
          return gs;
        }
        if (grant_id_ != cmd.grant_id && opts_.mem_need != 0) {
          // Taken back before we could map it (revoked after the bubble thread picked us): a
          // task with a mem_need runs only with its grant, so the start is handed back as if
          // yielded at once, and we wait for the next.
          stamp_started(cmd.epoch, 0);
          ack(cmd.epoch, true);
          continue;
        }
      }
      epoch_ = cmd.epoch;
      current_ = cmd;
      stale_slice_ns_ = kFirstStaleSliceNs;
      if (opts_.wake_mode == BB_WAKE_PREDICTIVE) {
        // Bubbles that begin later than predicted widen the spin window after the prediction
        // (up to 8 leads); bubbles caught in it narrow it back towards one lead. The CPU this
        // costs stays bounded by the window.
        const uint64_t lead = opts_.wake_lead_ns;
        if (late_window_ns_ == 0) late_window_ns_ = lead;
        if (missed_window_)
          late_window_ns_ = std::min(late_window_ns_ * 2, 8 * lead);
        else
          late_window_ns_ -= (late_window_ns_ - std::min(late_window_ns_, lead)) / 8;
        missed_window_ = false;
      }
      page_->started_epoch.store(cmd.epoch, std::memory_order_relaxed);
      page_->state.store(uint32_t(shm::TaskRunState::kRunning), std::memory_order_relaxed);
      // Pushed with the task's next report (or ack): writing the report ring here would stand
      // between the start and the task's own work.
      stamp_started(cmd.epoch, seen_ns);
      if (out) {
        out->kind = cmd.kind;
        out->bubble_seq = cmd.bubble_seq;
        out->begin_ns = cmd.begin_ns;
        out->deadline_ns = cmd.deadline_ns;
        out->free_mem = cmd.free_mem;
        fill_grant(&out->grant_id, &out->grant_ptr, &out->grant_bytes);
      }
      return BB_OK;
    }
    if (stopped_ || ctl_->stop.load(std::memory_order_acquire)) {
      // A stop of the slot's next task (we were dropped after the look at the loop's top, and
      // the slot went to another, which was stopped) is not ours: the trainer wrote that task's
      // generation before it could stop it, so this acquire shows it, and the top loses the slot.
      if (!stopped_ && slot_reused()) continue;
      stopped_ = true;
      return fail(BB_E_STOPPED, "the task was told to stop: finish and detach");
    }
    if (hub_.stats()->closing.load(std::memory_order_acquire)) {
      bb_status st = reattach(until);
      if (st != BB_OK) return st;
      continue;
    }
    const uint64_t now = now_ns();
    if (now >= until)
      return fail(BB_E_TIMEOUT, "no bubble started this task within the timeout");

    const bb_status st = wait_for_doorbell(bell, now, until, &seen_ns);
    if (st != BB_OK) return st;
  }
}

void Task::stamp_started(uint32_t epoch, uint64_t seen_ns) {
  // When the wait saw the start: a spinning wait knows it from the clock read of the poll that
  // saw it, a wake-up from the read it makes anyway. A poll's read older than the bubble's
  // begin means the task lost its CPU between that read and the load that saw the start, so
  // the time is read again.
  const uint64_t begin = ctl_->start_begin_ns.load(std::memory_order_relaxed);
  const uint64_t now = seen_ns >= begin && seen_ns != 0 ? seen_ns : now_ns();
  started_report_ = shm::Report{uint16_t(shm::ReportType::kStarted), 1, epoch, now,
                                now > begin ? now - begin : 0, 0};
}

bb_status Task::wait_for_doorbell(uint32_t bell, uint64_t now, uint64_t until,
                                  uint64_t* seen_ns) {
  *seen_ns = 0;
  const std::atomic<uint32_t>* word = &ctl_->doorbell;
  if (word->load(std::memory_order_relaxed) != bell) return BB_OK;
  if (opts_.wake_mode == BB_WAKE_SPIN) {
    if (shm::spin_until_changed(word, bell, std::min<uint64_t>(until - now, kLivenessSliceNs),
                                seen_ns))
      return BB_OK;
    return trainer_gone() ? lose_trainer(until) : BB_OK;
  }
  uint64_t spin = std::min<uint64_t>(spin_ns_, until - now);
  uint64_t sleep_until = until;
  bool adapt = true;
  bool predictive_sleep = false;  // a sleep that should end `head` before the predicted bubble
  if (opts_.wake_mode == BB_WAKE_PREDICTIVE) {
    // The trainer publishes when it expects the next bubble: sleep until just before it, spin
    // through a window around it, and fall back to sleeping when the guess missed. The sleep
    // ends `head` before the bubble: the lead plus how late sleeps have been ending (core/wake.h).
    const uint64_t next = hub_.bubble()->next_begin_ns.load(std::memory_order_relaxed);
    const uint64_t lead = opts_.wake_lead_ns;
    const uint64_t head = wake_head(lead, sleep_late_.mean);
    const uint64_t late = late_window_ns_ ? late_window_ns_ : lead;
    if (next != 0 && now + head >= next && now <= next + late) {
      if (shm::spin_until_changed(word, bell, std::min(next + late - now, until - now), seen_ns))
        return BB_OK;
      // The bubble is later than predicted: the futex wake will bring it, and the window
      // after the prediction widens (see wait_start) so the next late one is still caught.
      missed_window_ = true;
      spin = 0;
      adapt = false;
    } else if (next > now + head) {
      sleep_until = std::min(until, next - head);
      predictive_sleep = sleep_until == next - head;
      spin = 0;
      adapt = false;
    } else if (next != 0) {
      // The prediction is behind us (a long bubble, or a late one): the trainer will publish a
      // new one without ringing our doorbell, so sleep in slices that grow while it stays stale
      // (1 ms, 2 ms, ... up to the liveness slice) to pick the new one up.
      sleep_until = std::min(until, now + stale_slice_ns_);
      stale_slice_ns_ = std::min<uint64_t>(stale_slice_ns_ * 2, kLivenessSliceNs);
      adapt = false;
    }
  }
  if (spin && shm::spin_until_changed(word, bell, spin, seen_ns)) return BB_OK;
  // The sleep is on the page's wake word, which only we and the trainer map (shm/layout.h). Read
  // before we say we sleep: a bump the trainer makes after it (it saw us sleeping) makes the
  // wait return at once; a bump we do see came after the doorbell (release/acquire), so the
  // doorbell check below sees the new doorbell and we do not sleep at all.
  const uint32_t wake = page_->wake.load(std::memory_order_acquire);
  page_->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with the trainer's fence
  const uint64_t slept_at = now_ns();
  shm::WaitResult w = shm::WaitResult::kChanged;
  if (word->load(std::memory_order_relaxed) == bell) {
    const uint64_t left = sleep_until == UINT64_MAX ? UINT64_MAX
                                                    : sleep_until - std::min(sleep_until, slept_at);
    if (left > kLivenessSliceNs) predictive_sleep = false;  // it ends at the slice instead
    w = shm::futex_wait(&page_->wake, wake, int64_t(std::min<uint64_t>(left, kLivenessSliceNs)));
  }
  page_->sleeping.store(0, std::memory_order_relaxed);
  const uint64_t woke = now_ns();
  if (w == shm::WaitResult::kChanged) *seen_ns = woke;
  uint64_t late = 0;
  if (predictive_sleep &&
      sleep_lateness(w == shm::WaitResult::kTimeout, slept_at, sleep_until, woke, &late))
    sleep_late_.observe(late);
  if (adapt) {
    // Adapt the spin: a wake soon after falling asleep says spinning a little longer would
    // have caught it; a long sleep says spinning was wasted.
    const uint64_t slept = woke - slept_at;
    if (w == shm::WaitResult::kChanged && slept < 2 * opts_.spin_ns)
      spin_ns_ = std::min<uint64_t>(opts_.spin_ns, std::max<uint64_t>(spin_ns_ * 2, kMinSpinNs));
    else
      spin_ns_ = std::max<uint64_t>(spin_ns_ / 2, std::min<uint64_t>(kMinSpinNs, opts_.spin_ns));
  }
  // A sleep that timed out looks at the trainer; so does one a signal ended, once a slice has
  // passed since the last look: a handler firing more often than the slice (a profiler's timer,
  // SIGCHLD of a busy process) would otherwise end every sleep early, and a dead trainer would
  // never be noticed.
  if (w == shm::WaitResult::kTimeout ||
      (w == shm::WaitResult::kInterrupted && woke >= next_wait_look_ns_)) {
    next_wait_look_ns_ = woke + kLivenessSliceNs;
    if (trainer_gone()) return lose_trainer(until);
  }
  return BB_OK;
}

bb_status Task::report_step(uint64_t step_ns) {
  if (!sock_) return fail(BB_E_TRAINER_GONE, "the task is not attached (its trainer went away)");
  check_trainer_while_running();
  step_est_.observe(step_ns);
  // The part of the step after the trainer asked us to pause ran outside the bubble.
  uint64_t outside = 0;
  if (epoch_ != 0 && ctl_->paused_epoch.load(std::memory_order_acquire) == epoch_) {
    const uint64_t req = ctl_->pause_requested_ns.load(std::memory_order_relaxed);
    const uint64_t now = now_ns(), began = now - std::min(now, step_ns);
    if (now > req) outside = std::min(step_ns, now - std::max(req, began));
  }
  push_report(shm::ReportType::kStep, step_ns, outside);
  return BB_OK;
}

void Task::time_left(uint64_t* left_ns, uint64_t* est_step_ns) const {
  check_trainer_while_running();
  uint64_t left = 0;
  if (epoch_ != 0 && !should_pause()) {
    if (current_.deadline_ns == 0) {
      left = UINT64_MAX;
    } else {
      const uint64_t now = now_ns();
      left = current_.deadline_ns > now ? current_.deadline_ns - now : 0;
    }
  }
  if (left_ns) *left_ns = left;
  if (est_step_ns) *est_step_ns = step_est_.bound();
}

void Task::finish_report(bool failed) {
  if (!sock_ || finished_) return;
  if (epoch_ != 0) ack_pause();
  push_report(failed ? shm::ReportType::kFailed : shm::ReportType::kFinished, 0, 0);
  page_->state.store(uint32_t(failed ? shm::TaskRunState::kFailed : shm::TaskRunState::kFinished),
                     std::memory_order_release);
  finished_ = true;
}

bb_status Task::run(const bb_task_callbacks_t& cbs) {
  if (!cbs.step) return fail(BB_E_INVALID, "callbacks.step is NULL: the iterative runtime needs a "
                             "step function");
  struct InRun {
    bool& flag;
    explicit InRun(bool& f) : flag(f) { flag = true; }
    ~InRun() { flag = false; }
  } in_run(in_run_);
  void* user = cbs.user;
  bb_status result = BB_OK;
  std::string message;
  auto failed_cb = [&](const char* which) {
    result = fail(BB_E_CALLBACK, "the task's %s callback returned an error", which);
  };
  if (cbs.init && cbs.init(user) < 0) failed_cb("init");
  bool done = false;
  // Idle is due BB_TASK_IDLE_NS after its last call (or the run's start), and called once due and
  // between bubbles: bubbles closer together than that do not put it off.
  uint64_t idle_due = now_ns() + BB_TASK_IDLE_NS;
  while (result == BB_OK && !done) {
    bb_start_info_t info{sizeof info};
    bb_status st = BB_OK;
    for (;;) {
      const uint64_t now = now_ns();
      if (cbs.idle && now >= idle_due) {
        idle_due = now + BB_TASK_IDLE_NS;
        const int rc = cbs.idle(user);
        if (rc < 0) {
          failed_cb("idle");
          break;
        }
        if (rc == BB_STEP_DONE) {
          done = true;
          break;
        }
      }
      st = wait_start(cbs.idle ? int64_t(idle_due - std::min(idle_due, now_ns())) : -1, &info);
      if (st != BB_E_TIMEOUT || !cbs.idle) break;
      clear_error();
    }
    if (result != BB_OK || done) break;
    if (st != BB_OK) {
      result = st;
      break;
    }
    if (cbs.resume && cbs.resume(user) < 0) {
      failed_cb("resume");
      break;
    }
    bool stepped = false, first = true;
    while (!should_pause()) {
      bb_step_info_t si{sizeof si};
      si.kind = info.kind;
      si.bubble_seq = info.bubble_seq;
      si.deadline_ns = info.deadline_ns;
      si.free_mem = info.free_mem;
      fill_grant(&si.grant_id, &si.grant_ptr, &si.grant_bytes);
      time_left(&si.time_left_ns, &si.est_step_ns);
      // The most room a recent bubble left this task when it got to it (its length less how
      // late the task came), forgetting slowly (a 1/64 decay per bubble).
      if (first && info.deadline_ns != 0)
        longest_room_ns_ = std::max(si.time_left_ns, longest_room_ns_ - longest_room_ns_ / 64);
      first = false;
      // Start a step only when it is expected to end before the deadline.
      const uint64_t need = si.est_step_ns ? si.est_step_ns : opts_.min_step_ns;
      if (info.deadline_ns != 0 && need > si.time_left_ns) {
        // An estimate longer than the room of every recent bubble would lock the task out for
        // good after one slow outlier step: then each bubble without a step lowers it a little
        // until a step is tried again. Rooms shorter than the longest never lower it (that
        // would start steps that spill). A tried step that spilled (its steps really are that
        // long) doubles the bubbles to wait before the next try, up to kMaxProbeGap.
        if (!stepped && need > longest_room_ns_) {
          if (probe_wait_ > 0) {
            --probe_wait_;
          } else {
            step_est_.mean -= step_est_.mean / 16;
            step_est_.dev -= step_est_.dev / 4;
          }
        }
        break;
      }
      stepped = true;
      const uint64_t t0 = now_ns();
      const int rc = cbs.step(user, &si);
      const uint64_t t1 = now_ns();
      report_step(t1 - t0);
      if (info.deadline_ns == 0 || t1 <= info.deadline_ns) {
        probe_gap_ = 0;
      } else {
        probe_gap_ = std::min(std::max(2 * probe_gap_, kFirstProbeGap), kMaxProbeGap);
        probe_wait_ = probe_gap_;
      }
      if (rc < 0) {
        failed_cb("step");
        break;
      }
      if (rc == BB_STEP_DONE) {
        done = true;
        break;
      }
    }
    if (result == BB_OK && cbs.pause && cbs.pause(user) < 0) failed_cb("pause");
    if (sock_) ack_pause();
  }
  message = last_error();
  if (result != BB_E_TRAINER_GONE) finish_report(result != BB_OK && result != BB_E_STOPPED);
  if (cbs.finish) cbs.finish(user, result);
  if (result != BB_OK) fail_msg(result, message);
  return result;
}

// ------------------------------------------------------------------------------------------
// Grants. The trainer's words are read under their seqlock (core/grant_wire.h); what the task
// does about them is told back through TaskPage::grant_released plus a GrantAck nudge.

void Task::fill_grant(uint64_t* id, void** ptr, uint64_t* bytes) const {
  const bool held = grant_id_ != 0 && mapping_;
  *id = held ? grant_id_ : 0;
  *ptr = held ? mapping_->ptr() : nullptr;
  *bytes = held ? mapping_->size() : 0;
}

void Task::give_back(uint64_t id) {
  page_->grant_mapped.store(0, std::memory_order_relaxed);
  page_->grant_released.store(id, std::memory_order_release);  // G2
  auto m = shm::make_msg<shm::GrantAckMsg>(shm::MsgType::kGrantAck);
  m.grant_id = id;
  // Only a nudge: if the socket is full the trainer still finds the word at its next tick.
  (void)shm::send_msg(sock_.get(), &m, sizeof m, nullptr, 0, MSG_DONTWAIT);
}

bb_status Task::drop_grant() {
  if (grant_id_ == 0) return BB_OK;
  std::string err;
  const uint64_t id = grant_id_;
  // Not acked, now or ever: the memory may still be mapped, and saying otherwise would let the
  // trainer hand it to another task. The trainer kills us at the revoke's deadline instead. (A
  // mapping forgets what it mapped even when the unmap fails, so a second try would "succeed".)
  if (unmap_failed_ == id)
    return fail(BB_E_SYSTEM, "grant %llu could not be unmapped: it stays held until the "
                "trainer's revoke deadline", (unsigned long long)id);
  const bb_status st = mapping_ ? mapping_->unmap(&err) : BB_OK;
  if (st != BB_OK) {
    unmap_failed_ = id;
    return fail_msg(st, "cannot unmap grant " + std::to_string(id) + ": " + err);
  }
  mapping_.reset();
  grant_id_ = 0;
  grant_backend_ = GrantBackend::kNone;
  give_back(id);
  return BB_OK;
}

bb_status Task::take_grant_fd(uint64_t id, shm::Fd* out) {
  if (pending_fd_ && pending_fd_id_ == id) {
    *out = std::move(pending_fd_);
    pending_fd_id_ = 0;
    return BB_OK;
  }
  for (int k = 0; k < 64; ++k) {
    alignas(8) char buf[shm::kWireMaxMessage];
    int fds[2], nfds;
    const long n = shm::recv_msg(sock_.get(), buf, fds, &nfds, MSG_DONTWAIT);
    shm::Fd f0(fds[0]), f1(fds[1]);
    if (n == -EMFILE)  // maybe this grant's: it is lost either way
      return fail_msg(BB_E_SYSTEM, "cannot map grant " + std::to_string(id) + ": its memory "
                      "comes as a descriptor, and " + shm::no_fd_room_message());
    if (n <= 0) break;  // nothing queued, or the trainer left (noticed by the caller's next look)
    if (nfds != 1 || !shm::check_msg(buf, n, shm::MsgType::kGrantFd, sizeof(shm::GrantFdMsg)))
      continue;
    shm::GrantFdMsg m;
    std::memcpy(&m, buf, sizeof m);
    if (m.grant_id == id) {
      *out = std::move(f0);
      return BB_OK;
    }
    if (m.grant_id > id) {  // a later grant's, sent after we read the words: keep it
      pending_fd_ = std::move(f0);
      pending_fd_id_ = m.grant_id;
      break;
    }
    // An earlier grant's, which came and went unmapped: its descriptor closes here.
  }
  return fail(BB_E_CORRUPT, "grant %llu came without its descriptor: the trainer's libbubble may "
              "be of another version", (unsigned long long)id);
}

bb_status Task::map_offered(const shm::GrantRecord& rec) {
  const Grant g = from_record(rec);
  std::string err;
  bb_status st = validate_grant(g, &err);
  if (st != BB_OK) return fail_msg(st, err);
  shm::Fd fd;
  if (g.backend == GrantBackend::kHost || g.backend == GrantBackend::kCudaVmm) {
    if ((st = take_grant_fd(g.id, &fd)) != BB_OK) return st;
  }
  std::unique_ptr<GrantMapping> m;
  if ((st = map_grant(g, fd.get(), &m, &err)) != BB_OK)
    return fail_msg(st, "cannot map the " + std::string(grant_backend_name(g.backend)) +
                            " grant " + std::to_string(g.id) + " of " + std::to_string(g.size) +
                            " bytes the trainer offered: " + err);
  mapping_ = std::move(m);
  grant_id_ = g.id;
  grant_backend_ = g.backend;
  page_->grant_mapped.store(g.id, std::memory_order_relaxed);
  return BB_OK;
}

bb_status Task::sync_grant(unsigned what) {
  if (!sock_) return BB_OK;
  const uint32_t change = ctl_->grant_change.load(std::memory_order_acquire);  // G1
  if (grant_synced_ && change == grant_seen_) return BB_OK;
  GrantWords w;
  if (!read_grant(ctl_, &w)) return BB_OK;  // mid-update: the next look sees it
  // Words written for the slot's next task (we were dropped since the caller's look; the
  // trainer writes the generation before them, and read_grant's acquire makes it visible): not
  // ours to map, a cuda-ipc grant least of all. The caller's next look at the slot finds out.
  if (slot_reused()) return BB_OK;
  const uint64_t held = grant_id_;
  bool done = true;  // everything the words ask has been done
  if (held != 0 && (w.revoke_id == held || w.grant_id != held)) {
    if (!(what & kUnmap)) return BB_OK;  // keep it until a point where unmapping is safe
    if (const bb_status st = drop_grant(); st != BB_OK) return st;
  } else if (w.revoke_id != 0 && w.revoke_id != held && w.revoke_id != grant_refused_) {
    // Revoked before we ever mapped it: say so now rather than at the deadline, and close its
    // descriptor if it is queued.
    shm::Fd unused;
    (void)take_grant_fd(w.revoke_id, &unused);
    clear_error();
    give_back(w.revoke_id);
  }
  bb_status st = BB_OK;
  const bool offered = w.grant_id != 0 && w.grant_id != grant_id_ && w.revoke_id != w.grant_id &&
                       w.grant_id != grant_refused_;
  if (offered) {
    if (what & kMap) {
      if (w.record.id != w.grant_id) {
        st = fail(BB_E_CORRUPT, "the trainer's grant record does not match grant %llu",
                  (unsigned long long)w.grant_id);
      } else {
        st = map_offered(w.record);
      }
      if (st != BB_OK) {
        // Give it back so the memory is not held for nothing; the trainer offers this task no
        // more grants until it is told to.
        grant_refused_ = w.grant_id;
        give_back(w.grant_id);
      }
    } else {
      done = false;
    }
  }
  if (done) {
    grant_seen_ = change;
    grant_synced_ = true;
  }
  return st;
}

bb_status Task::ack_revoke() {
  if (!sock_) return fail(BB_E_TRAINER_GONE, "the task is not attached (its trainer went away)");
  return sync_grant(kUnmap);
}

bb_status Task::grant(bb_task_grant_t* out) {
  if (!sock_) return fail(BB_E_TRAINER_GONE, "the task is not attached (its trainer went away)");
  if (const bb_status st = sync_grant(kMap); st != BB_OK) return st;
  if (grant_id_ == 0 || !mapping_)
    return fail(BB_E_NOT_FOUND, "this task holds no memory grant: the trainer grants memory it "
                "lent (bb_trainer_lend) to tasks that state a mem_need, or with bb_trainer_grant");
  out->backend = uint32_t(grant_backend_);
  out->id = grant_id_;
  out->ptr = mapping_->ptr();
  out->bytes = mapping_->size();
  out->device = mapping_->device();
  out->revoke_deadline_ns = 0;
  GrantWords w;
  if (read_grant(ctl_, &w) && w.revoke_id == grant_id_) out->revoke_deadline_ns = w.revoke_deadline_ns;
  return BB_OK;
}

}  // namespace bb::core
