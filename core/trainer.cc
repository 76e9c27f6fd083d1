#include "core/trainer.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "core/paths.h"
#include "shm/futex.h"
#include "shm/wire.h"

namespace bb::core {

using shm::SlotCtl;
using shm::SlotState;
using shm::TaskPage;

// Trainer-private view of one slot. `state` is the hand-off between the two threads:
//   service: fills the fields, then state = kActive (release), then publish_change();
//   service: on death, state = kDead, then publish_change();
//   bubble thread: on seeing kDead in refresh_slots(), stops touching the page and sets
//   released = 1 (release); only then does the service thread unmap the page and free the slot.
struct Trainer::Slot {
  std::atomic<uint32_t> state{uint32_t(SlotState::kFree)};
  std::atomic<uint32_t> released{0};
  // Written by the service thread before kActive; read by the bubble thread after it.
  const TaskPage* page = nullptr;
  Candidate cand;
  uint32_t generation = 0;
  // Bubble thread only (reset by the service thread before kActive).
  uint32_t epoch = 0;           // last run epoch given to the task
  uint64_t cmd_cached_head = 0;
  bool bad = false;
  // Service thread only.
  shm::Mapping page_map;
  shm::Fd page_fd;
  shm::Fd pidfd;
  int conn = -1;                // index into conns_, -1 if none
  bool pending_free = false;
  uint64_t dropped_seen = 0;
};

// A peer on the hub socket: a connection that has not said hello yet, a task, or an observer.
struct Trainer::Conn {
  enum Kind { kHello, kTask, kObserver } kind = kHello;
  shm::Fd fd;
  uint64_t hello_deadline_ns = 0;
  int slot = -1;
  uint32_t uid = 0;
};

namespace {

constexpr uint64_t kHelloTimeoutNs = 2'000'000'000ull;
constexpr uint64_t kServiceTickNs = 10'000'000ull;  // report draining while tasks are attached
constexpr uint64_t kMaxSaneNs = 3600'000'000'000ull;

int pidfd_open(pid_t pid) { return int(syscall(SYS_pidfd_open, pid, 0)); }

uint32_t next_epoch(uint32_t e) { return e + 1 == 0 ? 1 : e + 1; }

void write_str(char* dst, size_t cap, const char* src) { std::snprintf(dst, cap, "%s", src); }

}  // namespace

bb_status Trainer::open(const char* job_id, uint32_t rank, const bb_trainer_options_t& opts,
                        std::unique_ptr<Trainer>* out) {
  std::unique_ptr<Trainer> t(new Trainer());
  bb_status st = t->init(job_id, rank, opts);
  if (st != BB_OK) return st;  // the destructor undoes whatever init did
  *out = std::move(t);
  return BB_OK;
}

bb_status Trainer::init(const char* job_id, uint32_t rank, const bb_trainer_options_t& opts) {
  bb_status st;
  if ((st = check_job_id(job_id)) != BB_OK || (st = check_rank(rank)) != BB_OK) return st;
  opts_ = opts;
  if (opts_.max_slots == 0 || opts_.max_slots > BB_MAX_SLOTS_LIMIT)
    return fail(BB_E_INVALID, "max_slots %u is out of range 1..%u", opts_.max_slots,
                BB_MAX_SLOTS_LIMIT);
  if (opts_.max_running == 0 || opts_.max_running > opts_.max_slots)
    return fail(BB_E_INVALID, "max_running %u is out of range 1..max_slots (%u)",
                opts_.max_running, opts_.max_slots);
  const uint32_t ec = opts_.event_capacity;
  if (ec < 64 || ec > 65536 || (ec & (ec - 1)) != 0)
    return fail(BB_E_INVALID, "event_capacity %u must be a power of two in 64..65536", ec);
  job_ = job_id;
  rank_ = rank;

  std::string dir;
  if ((st = resolve_runtime_dir(opts_.runtime_dir, true, &dir)) != BB_OK) return st;
  opts_.runtime_dir = nullptr;  // not kept: the caller's string may go away
  if ((st = hub_paths(dir, job_id, rank, &socket_path_, &lock_path_)) != BB_OK) return st;

  // One trainer per hub name: an flock on the lock file, held for the hub's life. flock (unlike
  // POSIX record locks) is not dropped when some other descriptor of the file is closed, and the
  // kernel drops it when the trainer dies, which is how a stale hub is recognised.
  for (int attempt = 0;; ++attempt) {
    lock_fd_.reset(::open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!lock_fd_)
      return fail(BB_E_SYSTEM, "cannot open hub lock file %s: %s", lock_path_.c_str(),
                  std::strerror(errno));
    if (flock(lock_fd_.get(), LOCK_EX | LOCK_NB) != 0) {
      char pid[32] = {0};
      (void)!pread(lock_fd_.get(), pid, sizeof pid - 1, 0);
      lock_fd_.reset();
      return fail(BB_E_BUSY, "hub %s.%u is already open by trainer pid %s: one trainer owns a "
                  "rank's hub; close it first or use another job id or rank",
                  job_id, rank, pid[0] ? pid : "?");
    }
    // The previous owner may have unlinked the file between our open and our lock.
    struct stat a, b;
    if (fstat(lock_fd_.get(), &a) == 0 && stat(lock_path_.c_str(), &b) == 0 &&
        a.st_ino == b.st_ino && a.st_dev == b.st_dev)
      break;
    if (attempt > 8) return fail(BB_E_BUSY, "hub %s.%u is being opened and closed by another "
                                 "process concurrently: retry", job_id, rank);
  }
  const std::string pid = std::to_string(getpid());
  if (ftruncate(lock_fd_.get(), 0) != 0 ||
      pwrite(lock_fd_.get(), pid.data(), pid.size(), 0) != ssize_t(pid.size()))
    return fail(BB_E_SYSTEM, "cannot write hub lock file %s: %s", lock_path_.c_str(),
                std::strerror(errno));
  unlink(socket_path_.c_str());  // we hold the lock: any socket left here is a dead trainer's

  std::string err;
  const shm::HubGeometry g = shm::hub_geometry(opts_.max_slots, ec);
  hub_fd_ = shm::create_segment("bubble-hub", g.layout_size, &err);
  if (!hub_fd_) return fail_msg(BB_E_SYSTEM, err);
  hub_map_ = shm::map_segment(hub_fd_.get(), g.layout_size, true, &err);
  if (!hub_map_) return fail_msg(BB_E_SYSTEM, err);
  shm::init_hub(hub_map_.data(), g, job_id, rank);
  hub_.base = hub_map_.data();
  hub_.bubble()->free_mem.store(BB_MEM_UNKNOWN, std::memory_order_relaxed);
  if (!shm::seal_read_only(hub_fd_.get(), &err)) return fail_msg(BB_E_SYSTEM, err);

  slots_.reset(new Slot[opts_.max_slots]);

  listen_fd_.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listen_fd_) return fail(BB_E_SYSTEM, "socket() failed: %s", std::strerror(errno));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  write_str(addr.sun_path, sizeof addr.sun_path, socket_path_.c_str());
  if (bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return fail(BB_E_SYSTEM, "cannot bind hub socket %s: %s", socket_path_.c_str(),
                std::strerror(errno));
  // The directory is 0700 already; the mode is a second fence.
  if (chmod(socket_path_.c_str(), 0600) != 0 || listen(listen_fd_.get(), 64) != 0)
    return fail(BB_E_SYSTEM, "cannot listen on hub socket %s: %s", socket_path_.c_str(),
                std::strerror(errno));
  wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_) return fail(BB_E_SYSTEM, "eventfd() failed: %s", std::strerror(errno));
  try {
    service_ = std::thread([this] { serve(); });
  } catch (const std::exception& e) {
    return fail(BB_E_SYSTEM, "cannot start the hub service thread: %s", e.what());
  }
  return BB_OK;
}

Trainer::~Trainer() { shutdown(); }

void Trainer::shutdown() {
  if (hub_.base) {
    // Tell every task the trainer is leaving: they return BB_E_TRAINER_GONE or wait for a new
    // trainer, by their option. Their connections close below, which they also notice.
    hub_.stats()->closing.store(1, std::memory_order_release);
    for (uint32_t i = 0; i < opts_.max_slots; ++i) {
      SlotCtl* c = hub_.slot(i);
      c->run_epoch.store(0, std::memory_order_release);
      c->doorbell.fetch_add(1, std::memory_order_release);
      shm::futex_wake(&c->doorbell, INT_MAX);
    }
  }
  if (service_.joinable()) {
    uint64_t one = 1;
    (void)!write(wake_fd_.get(), &one, sizeof one);
    service_.join();
  }
  conns_.clear();
  slots_.reset();
  if (listen_fd_) {
    unlink(socket_path_.c_str());
    listen_fd_.reset();
  }
  if (lock_fd_) {
    unlink(lock_path_.c_str());  // while still holding the lock; see init()
    lock_fd_.reset();
  }
  hub_map_.reset();
  hub_.base = nullptr;
}

// ------------------------------------------------------------------------------------------
// Bubble thread.

void Trainer::refresh_slots() {
  const uint64_t changes = slots_changed_.load(std::memory_order_acquire);
  if (changes == seen_changes_) return;
  seen_changes_ = changes;
  span_ = 0;
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    Slot& s = slots_[i];
    const auto st = SlotState(s.state.load(std::memory_order_acquire));
    const SlotCtl* c = hub_.slot(i);
    if (st == SlotState::kDead && !s.released.load(std::memory_order_relaxed)) {
      cands_[i].active = false;
      s.released.store(1, std::memory_order_release);  // we no longer touch s.page
      continue;
    }
    const bool active = st == SlotState::kActive && !s.bad &&
                        c->stop.load(std::memory_order_relaxed) == 0;
    cands_[i] = s.cand;
    cands_[i].active = active;
    if (active) span_ = i + 1;
  }
}

void Trainer::mark_bad(uint32_t i) {
  slots_[i].bad = true;
  cands_[i].active = false;
  hub_.slot(i)->bad.store(1, std::memory_order_relaxed);
  hub_.stats()->bad.fetch_add(1, std::memory_order_relaxed);
}

bool Trainer::task_ready(uint32_t i) {
  Slot& s = slots_[i];
  const TaskPage* p = s.page;
  // The task must have acked the pause of the last start (or never been started) and be able to
  // take a command. Both words are the task's: a value that makes no sense marks it bad.
  const uint32_t acked = p->acked_epoch.load(std::memory_order_acquire);
  if (acked != s.epoch) return false;
  const uint64_t head = p->cmd_head.load(std::memory_order_acquire);
  const uint64_t tail = hub_.slot(i)->commands.tail.load(std::memory_order_relaxed);
  if (head > tail || tail - head > shm::kCommandRingSize) {
    mark_bad(i);
    return false;
  }
  return tail - head < shm::kCommandRingSize;
}

bb_status Trainer::begin(uint64_t expected_ns, uint64_t free_mem, bb_bubble_kind kind) {
  if (unsigned(kind) >= BB_BUBBLE_KIND_COUNT_)
    return fail(BB_E_INVALID, "bubble kind %d is not a bb_bubble_kind", int(kind));
  refresh_slots();
  const uint64_t now = now_ns();
  if (open_) end_locked(now);

  if (expected_ns == 0) expected_ns = predictor_.predict(kind);
  if (last_end_ns_ != 0) gap_predictor_.observe(BB_BUBBLE_OTHER, now - last_end_ns_);
  const uint64_t deadline = expected_ns ? now + expected_ns : 0;
  kind_ = kind;
  begin_ns_ = now;
  open_ = true;

  shm::BubbleState* b = hub_.bubble();
  const uint64_t seq = b->seq.load(std::memory_order_relaxed) + 1;
  const uint64_t v = b->version.load(std::memory_order_relaxed);
  b->version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  b->seq.store(seq, std::memory_order_relaxed);
  b->kind.store(uint32_t(kind), std::memory_order_relaxed);
  b->begin_ns.store(now, std::memory_order_relaxed);
  b->deadline_ns.store(deadline, std::memory_order_relaxed);
  b->free_mem.store(free_mem, std::memory_order_relaxed);
  b->open.store(1, std::memory_order_relaxed);
  b->version.store(v + 2, std::memory_order_release);

  uint32_t picked[BB_MAX_SLOTS_LIMIT];
  const Offer offer{free_mem, expected_ns};
  const uint32_t n = pick_tasks(cands_, span_, offer, opts_.max_running, rr_cursor_,
                                [this](uint32_t i) { return task_ready(i); }, picked);
  uint64_t wakes = 0;
  for (uint32_t k = 0; k < n; ++k) {
    const uint32_t i = picked[k];
    Slot& s = slots_[i];
    SlotCtl* c = hub_.slot(i);
    s.epoch = next_epoch(s.epoch);
    shm::Command cmd{};
    cmd.type = uint32_t(shm::CommandType::kStart);
    cmd.epoch = s.epoch;
    cmd.bubble_seq = seq;
    cmd.begin_ns = now;
    cmd.deadline_ns = deadline;
    cmd.free_mem = free_mem;
    cmd.kind = uint32_t(kind);
    if (shm::ring_push(c->commands, s.page->cmd_head, s.cmd_cached_head, cmd) !=
        shm::RingStatus::kOk) {
      mark_bad(i);  // task_ready() saw room a moment ago: the task moved its index backwards
      continue;
    }
    c->started_ns.store(now, std::memory_order_relaxed);
    c->given_epoch.store(s.epoch, std::memory_order_relaxed);
    c->run_epoch.store(s.epoch, std::memory_order_release);
    c->doorbell.fetch_add(1, std::memory_order_release);
    // Pairs with the task's store of `sleeping` and fence before its futex wait: either it sees
    // the new doorbell, or we see it sleeping and wake it.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (s.page->sleeping.load(std::memory_order_relaxed)) {
      shm::futex_wake(&c->doorbell, INT_MAX);
      ++wakes;
    }
    running_[n_running_] = i;
    running_gen_[n_running_] = s.generation;
    ++n_running_;
  }
  if (n) starts_.store(starts_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  if (wakes) wakes_.store(wakes_.load(std::memory_order_relaxed) + wakes, std::memory_order_relaxed);
  shm::log_event(hub_, shm::EventKind::kBubbleBegin, 0xffff, now, expected_ns, free_mem);
  return BB_OK;
}

bb_status Trainer::end() {
  if (!open_) return BB_OK;
  refresh_slots();
  end_locked(now_ns());
  return BB_OK;
}

void Trainer::end_locked(uint64_t now) {
  uint64_t wakes = 0, pauses = 0;
  for (uint32_t k = 0; k < n_running_; ++k) {
    const uint32_t i = running_[k];
    Slot& s = slots_[i];
    SlotCtl* c = hub_.slot(i);
    // The slot may have been reclaimed (and even reused) since begin: then leave it alone.
    if (!cands_[i].active && (s.bad || s.released.load(std::memory_order_relaxed))) continue;
    if (s.generation != running_gen_[k]) continue;
    c->run_epoch.store(0, std::memory_order_release);
    if (s.page->acked_epoch.load(std::memory_order_acquire) == s.epoch) continue;  // yielded
    c->pause_requested_ns.store(now, std::memory_order_relaxed);
    c->paused_epoch.store(s.epoch, std::memory_order_release);
    shm::Command cmd{};
    cmd.type = uint32_t(shm::CommandType::kPause);
    cmd.epoch = s.epoch;
    cmd.bubble_seq = hub_.bubble()->seq.load(std::memory_order_relaxed);
    // A full ring only loses the detail: run_epoch already says "pause".
    (void)shm::ring_push(c->commands, s.page->cmd_head, s.cmd_cached_head, cmd);
    c->doorbell.fetch_add(1, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (s.page->sleeping.load(std::memory_order_relaxed)) {
      shm::futex_wake(&c->doorbell, INT_MAX);
      ++wakes;
    }
    ++pauses;
  }
  n_running_ = 0;
  open_ = false;
  const uint64_t dur = now - begin_ns_;
  predictor_.observe(kind_, dur);  // every bubble, so positions stay in step with the iteration
  shm::BubbleState* b = hub_.bubble();
  const uint64_t v = b->version.load(std::memory_order_relaxed);
  b->version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  b->open.store(0, std::memory_order_relaxed);
  b->end_ns.store(now, std::memory_order_relaxed);
  b->bubbles.store(b->bubbles.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  b->bubble_ns.store(b->bubble_ns.load(std::memory_order_relaxed) + dur, std::memory_order_relaxed);
  const uint64_t gap = gap_predictor_.predict(BB_BUBBLE_OTHER);
  b->next_begin_ns.store(gap ? now + gap : 0, std::memory_order_relaxed);
  last_end_ns_ = now;
  b->version.store(v + 2, std::memory_order_release);
  if (pauses) pauses_.store(pauses_.load(std::memory_order_relaxed) + pauses, std::memory_order_relaxed);
  if (wakes) wakes_.store(wakes_.load(std::memory_order_relaxed) + wakes, std::memory_order_relaxed);
  shm::log_event(hub_, shm::EventKind::kBubbleEnd, 0xffff, now, dur, 0);
}

void Trainer::iteration() {
  predictor_.begin_iteration();
  gap_predictor_.begin_iteration();
}

// ------------------------------------------------------------------------------------------
// Any thread.

void Trainer::stats(bb_trainer_stats_t* out) {
  const shm::HubStats* hs = hub_.stats();
  const shm::BubbleState* b = hub_.bubble();
  out->tasks_attached = hs->attached.load(std::memory_order_relaxed);
  out->bubbles = b->bubbles.load(std::memory_order_relaxed);
  out->bubble_ns = b->bubble_ns.load(std::memory_order_relaxed);
  out->starts = starts_.load(std::memory_order_relaxed);
  out->pauses = pauses_.load(std::memory_order_relaxed);
  out->wakes = wakes_.load(std::memory_order_relaxed);
  out->task_ns_in_bubbles = hs->ns_in_bubbles.load(std::memory_order_relaxed);
  out->task_ns_outside = hs->ns_outside.load(std::memory_order_relaxed);
  out->steps = hs->steps.load(std::memory_order_relaxed);
  out->tasks_reclaimed = hs->reclaimed.load(std::memory_order_relaxed);
  out->tasks_bad = hs->bad.load(std::memory_order_relaxed);
  out->events_dropped = hs->dropped.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(stats_mu_);
  out->start_latency_p50_ns = start_latency_.percentile(0.50);
  out->start_latency_p99_ns = start_latency_.percentile(0.99);
  out->pause_latency_p50_ns = pause_latency_.percentile(0.50);
  out->pause_latency_p99_ns = pause_latency_.percentile(0.99);
}

bb_status Trainer::tasks(bb_task_info_t* out, size_t cap, size_t* count) {
  size_t n = 0;
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    const SlotCtl* c = hub_.slot(i);
    if (SlotState(c->state.load(std::memory_order_acquire)) != SlotState::kActive) continue;
    if (n < cap) {
      bb_task_info_t& t = out[n];
      const uint32_t size = t.size;
      std::memset(&t, 0, sizeof t);
      t.size = size;
      t.slot = i;
      t.id = uint64_t(i) | uint64_t(c->generation.load(std::memory_order_relaxed)) << 32;
      t.pid = c->pid;
      t.priority = c->priority;
      t.mem_need = c->mem_need;
      t.min_step_ns = c->min_step_ns;
      t.steps = c->steps.load(std::memory_order_relaxed);
      t.step_ns = c->step_ns.load(std::memory_order_relaxed);
      t.running = c->run_epoch.load(std::memory_order_relaxed) != 0;
      t.bad = c->bad.load(std::memory_order_relaxed);
      std::memcpy(t.name, c->name, sizeof t.name);
      t.name[sizeof t.name - 1] = 0;
    }
    ++n;
  }
  *count = n;
  return BB_OK;
}

bb_status Trainer::stop_task(uint64_t task_id) {
  const uint32_t slot = uint32_t(task_id & 0xffffffffu), gen = uint32_t(task_id >> 32);
  if (slot >= opts_.max_slots)
    return fail(BB_E_NOT_FOUND, "task id %llu names slot %u, but the hub has %u slots: take ids "
                "from bb_trainer_tasks()", (unsigned long long)task_id, slot, opts_.max_slots);
  SlotCtl* c = hub_.slot(slot);
  if (SlotState(c->state.load(std::memory_order_acquire)) != SlotState::kActive ||
      c->generation.load(std::memory_order_relaxed) != gen)
    return fail(BB_E_NOT_FOUND, "task id %llu is not attached (it detached or died)",
                (unsigned long long)task_id);
  c->stop.store(1, std::memory_order_release);
  c->run_epoch.store(0, std::memory_order_release);
  c->doorbell.fetch_add(1, std::memory_order_release);
  shm::futex_wake(&c->doorbell, INT_MAX);
  publish_change();
  return BB_OK;
}

// ------------------------------------------------------------------------------------------
// Service thread.

void Trainer::serve() {
  std::vector<pollfd> pfds;
  std::vector<int> who;  // -1: wake fd, -2: listen fd, >=0 conn index, <= -10: slot pidfd
  for (;;) {
    pfds.clear();
    who.clear();
    pfds.push_back({wake_fd_.get(), POLLIN, 0});
    who.push_back(-1);
    pfds.push_back({listen_fd_.get(), POLLIN, 0});
    who.push_back(-2);
    bool any_task = false, any_hello = false;
    for (size_t k = 0; k < conns_.size(); ++k) {
      if (!conns_[k]) continue;
      pfds.push_back({conns_[k]->fd.get(), POLLIN, 0});
      who.push_back(int(k));
      any_hello |= conns_[k]->kind == Conn::kHello;
    }
    for (uint32_t i = 0; i < opts_.max_slots; ++i) {
      Slot& s = slots_[i];
      if (s.pending_free) any_task = true;
      if (!s.pidfd || s.pending_free) continue;
      any_task = true;
      pfds.push_back({s.pidfd.get(), POLLIN, 0});
      who.push_back(-10 - int(i));
    }
    const int timeout_ms = any_task || any_hello ? int(kServiceTickNs / 1000000) : -1;
    const int rc = poll(pfds.data(), pfds.size(), timeout_ms);
    if (rc < 0 && errno != EINTR) break;
    if (pfds[0].revents & POLLIN) break;  // shutdown
    if (pfds[1].revents & POLLIN) accept_all();
    const uint64_t now = now_ns();
    for (size_t k = 2; k < pfds.size(); ++k) {
      if (!pfds[k].revents) continue;
      if (who[k] <= -10) {
        const uint32_t slot = uint32_t(-10 - who[k]);
        if (!slots_[slot].pending_free) reclaim(slot, true);
        continue;
      }
      Conn* c = conns_[size_t(who[k])].get();
      if (!c) continue;
      if (c->kind == Conn::kHello) {
        handle_hello(*c);
      } else if (c->kind == Conn::kObserver) {
        handle_observer_request(*c);
      } else {
        // A task never sends after attaching: readable means it closed (or misbehaves).
        char buf[shm::kWireMaxMessage];
        int fds[2], nfds;
        const long n = shm::recv_msg(c->fd.get(), buf, fds, &nfds);
        for (int f = 0; f < nfds; ++f) close(fds[f]);
        if (n <= 0 && n != -EAGAIN) reclaim(uint32_t(c->slot), false);
      }
    }
    for (auto& c : conns_)
      if (c && c->kind == Conn::kHello && now > c->hello_deadline_ns) c.reset();
    drain_reports();
    free_released();
  }
  drain_reports();
}

void Trainer::accept_all() {
  for (;;) {
    int fd = accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    auto c = std::make_unique<Conn>();
    c->fd.reset(fd);
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) continue;
    const uint32_t me = uint32_t(geteuid());
    if (cred.uid != me && cred.uid != 0 && cred.uid != opts_.allow_uid) {
      auto r = shm::make_msg<shm::AttachReplyMsg>(shm::MsgType::kAttachReply);
      r.status = BB_E_PERMISSION;
      std::snprintf(r.error, sizeof r.error, "uid %u may not attach to this hub (owned by uid %u): "
                    "run the task as the trainer's user", cred.uid, me);
      shm::send_msg(fd, &r, sizeof r, nullptr, 0);
      continue;
    }
    c->uid = cred.uid;
    c->hello_deadline_ns = now_ns() + kHelloTimeoutNs;
    size_t k = 0;
    while (k < conns_.size() && conns_[k]) ++k;
    if (k == conns_.size()) conns_.emplace_back();
    conns_[k] = std::move(c);
  }
}

void Trainer::handle_hello(Conn& c) {
  alignas(8) char buf[shm::kWireMaxMessage];
  int fds[2], nfds;
  const long n = shm::recv_msg(c.fd.get(), buf, fds, &nfds);
  for (int f = 0; f < nfds; ++f) close(fds[f]);  // a hello carries no descriptors
  if (n == -EAGAIN) return;
  auto reply_error = [&](bb_status st, const char* text) {
    auto r = shm::make_msg<shm::AttachReplyMsg>(shm::MsgType::kAttachReply);
    r.status = st;
    r.layout_version = shm::kLayoutVersion;
    std::snprintf(r.error, sizeof r.error, "%s", text);
    shm::send_msg(c.fd.get(), &r, sizeof r, nullptr, 0);
  };
  Conn* self = &c;
  auto drop = [&] {
    for (auto& p : conns_)
      if (p.get() == self) p.reset();
  };
  if (n <= 0) return drop();
  shm::MsgHeader h{};
  if (n >= long(sizeof h)) std::memcpy(&h, buf, sizeof h);
  if (h.magic == shm::kWireMagic && h.version != shm::kWireVersion) {
    char text[160];
    std::snprintf(text, sizeof text, "the trainer speaks hub protocol %u but the task %u: build "
                  "both against the same libbubble release", shm::kWireVersion, h.version);
    reply_error(BB_E_VERSION, text);
    return drop();
  }
  if (shm::check_msg(buf, n, shm::MsgType::kAttachTask, sizeof(shm::AttachTaskMsg))) {
    attach_task(c, buf);
    if (c.kind != Conn::kTask) drop();
    return;
  }
  if (shm::check_msg(buf, n, shm::MsgType::kAttachObserver, sizeof(shm::AttachObserverMsg))) {
    if (hub_.stats()->closing.load(std::memory_order_relaxed)) {
      reply_error(BB_E_TRAINER_GONE, "the trainer is closing this hub");
      return drop();
    }
    auto r = shm::make_msg<shm::AttachReplyMsg>(shm::MsgType::kAttachReply);
    r.status = BB_OK;
    r.layout_version = shm::kLayoutVersion;
    r.hub_size = hub_map_.size();
    const int fd = hub_fd_.get();
    if (shm::send_msg(c.fd.get(), &r, sizeof r, &fd, 1) != 0) return drop();
    c.kind = Conn::kObserver;
    return;
  }
  reply_error(BB_E_INVALID, "malformed attach message: the peer does not speak the libbubble "
              "hub protocol");
  drop();
}

void Trainer::attach_task(Conn& c, const void* raw) {
  shm::AttachTaskMsg m;
  std::memcpy(&m, raw, sizeof m);
  auto r = shm::make_msg<shm::AttachReplyMsg>(shm::MsgType::kAttachReply);
  r.layout_version = shm::kLayoutVersion;
  auto reject = [&](bb_status st, const std::string& text) {
    r.status = st;
    std::snprintf(r.error, sizeof r.error, "%s", text.c_str());
    shm::send_msg(c.fd.get(), &r, sizeof r, nullptr, 0);
  };
  m.name[sizeof m.name - 1] = 0;
  if (check_task_name(m.name) != BB_OK) return reject(BB_E_INVALID, last_error());
  if (hub_.stats()->closing.load(std::memory_order_relaxed))
    return reject(BB_E_TRAINER_GONE, "the trainer is closing this hub");
  ucred cred{};
  socklen_t len = sizeof cred;
  getsockopt(c.fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len);

  uint32_t i = 0;
  while (i < opts_.max_slots &&
         (slots_[i].state.load(std::memory_order_relaxed) != uint32_t(SlotState::kFree) ||
          slots_[i].pending_free))
    ++i;
  if (i == opts_.max_slots)
    return reject(BB_E_FULL, "hub " + job_ + "." + std::to_string(rank_) + " has all " +
                                 std::to_string(opts_.max_slots) +
                                 " task slots in use: detach a task, or open the hub with a "
                                 "larger max_slots");
  Slot& s = slots_[i];
  std::string err;
  s.page_fd = shm::create_segment("bubble-task", shm::kTaskPageSize, &err);
  if (!s.page_fd) return reject(BB_E_SYSTEM, err);
  {
    shm::Mapping rw = shm::map_segment(s.page_fd.get(), shm::kTaskPageSize, true, &err);
    if (!rw) {
      s.page_fd.reset();
      return reject(BB_E_SYSTEM, err);
    }
    auto* p = reinterpret_cast<TaskPage*>(rw.data());
    p->magic = shm::kPageMagic;
    p->layout_version = shm::kLayoutVersion;
    p->slot = i;
  }
  s.page_map = shm::map_segment(s.page_fd.get(), shm::kTaskPageSize, false, &err);
  if (!s.page_map) {
    s.page_fd.reset();
    return reject(BB_E_SYSTEM, err);
  }
  s.pidfd.reset(pidfd_open(cred.pid));

  SlotCtl* ctl = hub_.slot(i);
  const uint32_t gen = ctl->generation.load(std::memory_order_relaxed) + 1;
  ctl->generation.store(gen, std::memory_order_relaxed);
  ctl->run_epoch.store(0, std::memory_order_relaxed);
  ctl->stop.store(0, std::memory_order_relaxed);
  ctl->bad.store(0, std::memory_order_relaxed);
  ctl->report_head.store(0, std::memory_order_relaxed);
  ctl->pause_requested_ns.store(0, std::memory_order_relaxed);
  ctl->started_ns.store(0, std::memory_order_relaxed);
  ctl->paused_epoch.store(0, std::memory_order_relaxed);
  ctl->given_epoch.store(0, std::memory_order_relaxed);
  ctl->commands.tail.store(0, std::memory_order_relaxed);
  ctl->steps.store(0, std::memory_order_relaxed);
  ctl->step_ns.store(0, std::memory_order_relaxed);
  ctl->ns_in_bubbles.store(0, std::memory_order_relaxed);
  ctl->ns_outside.store(0, std::memory_order_relaxed);
  ctl->pid = cred.pid;
  ctl->priority = m.priority;
  ctl->mem_need = m.mem_need;
  ctl->min_step_ns = m.min_step_ns;
  std::memcpy(ctl->name, m.name, sizeof ctl->name);

  s.page = reinterpret_cast<const TaskPage*>(s.page_map.data());
  s.cand = Candidate{true, m.priority, m.mem_need, m.min_step_ns};
  s.generation = gen;
  s.epoch = 0;
  s.cmd_cached_head = 0;
  s.bad = false;
  s.dropped_seen = 0;
  s.released.store(0, std::memory_order_relaxed);
  for (size_t k = 0; k < conns_.size(); ++k)
    if (conns_[k].get() == &c) s.conn = int(k);

  r.status = BB_OK;
  r.slot = i;
  r.generation = gen;
  r.hub_size = hub_map_.size();
  const int fds[2] = {hub_fd_.get(), s.page_fd.get()};
  if (shm::send_msg(c.fd.get(), &r, sizeof r, fds, 2) != 0) {
    s.page = nullptr;
    s.page_map.reset();
    s.page_fd.reset();
    s.pidfd.reset();
    s.conn = -1;
    return;
  }
  c.kind = Conn::kTask;
  c.slot = int(i);
  ctl->state.store(uint32_t(SlotState::kActive), std::memory_order_release);
  s.state.store(uint32_t(SlotState::kActive), std::memory_order_release);
  hub_.stats()->attached.fetch_add(1, std::memory_order_relaxed);
  publish_change();
  shm::log_event(hub_, shm::EventKind::kTaskAttach, uint16_t(i), now_ns(), uint64_t(cred.pid), 0);
}

void Trainer::handle_observer_request(Conn& c) {
  alignas(8) char buf[shm::kWireMaxMessage];
  int fds[2], nfds;
  const long n = shm::recv_msg(c.fd.get(), buf, fds, &nfds);
  for (int f = 0; f < nfds; ++f) close(fds[f]);
  if (n == -EAGAIN) return;
  Conn* self = &c;
  auto drop = [&] {
    for (auto& p : conns_)
      if (p.get() == self) p.reset();
  };
  if (n <= 0) return drop();
  auto r = shm::make_msg<shm::ReplyMsg>(shm::MsgType::kReply);
  shm::SlotRequestMsg q;
  const bool stop = shm::check_msg(buf, n, shm::MsgType::kStopTask, sizeof q);
  const bool page = shm::check_msg(buf, n, shm::MsgType::kGetTaskPage, sizeof q);
  if (!stop && !page) {
    r.status = BB_E_INVALID;
    std::snprintf(r.error, sizeof r.error, "malformed observer request");
    shm::send_msg(c.fd.get(), &r, sizeof r, nullptr, 0);
    return drop();
  }
  std::memcpy(&q, buf, sizeof q);
  const uint64_t id = uint64_t(q.slot) | uint64_t(q.generation) << 32;
  int fd = -1;
  if (stop) {
    r.status = stop_task(id);
  } else if (q.slot < opts_.max_slots && slots_[q.slot].generation == q.generation &&
             slots_[q.slot].state.load() == uint32_t(SlotState::kActive) && !slots_[q.slot].pending_free) {
    r.status = BB_OK;
    fd = slots_[q.slot].page_fd.get();
  } else {
    r.status = fail(BB_E_NOT_FOUND, "task id %llu is not attached", (unsigned long long)id);
  }
  if (r.status != BB_OK) std::snprintf(r.error, sizeof r.error, "%s", last_error());
  shm::send_msg(c.fd.get(), &r, sizeof r, fd >= 0 ? &fd : nullptr, fd >= 0 ? 1 : 0);
}

void Trainer::reclaim(uint32_t i, bool died) {
  Slot& s = slots_[i];
  if (s.state.load(std::memory_order_relaxed) != uint32_t(SlotState::kActive)) return;
  SlotCtl* ctl = hub_.slot(i);
  ctl->state.store(uint32_t(SlotState::kDead), std::memory_order_release);
  ctl->run_epoch.store(0, std::memory_order_release);
  s.state.store(uint32_t(SlotState::kDead), std::memory_order_release);
  s.pending_free = true;
  publish_change();
  if (s.conn >= 0 && size_t(s.conn) < conns_.size()) conns_[size_t(s.conn)].reset();
  s.conn = -1;
  s.pidfd.reset();
  hub_.stats()->attached.fetch_sub(1, std::memory_order_relaxed);
  shm::log_event(hub_, shm::EventKind::kTaskDetach, uint16_t(i), now_ns(), uint64_t(ctl->pid),
                 died ? 1 : 0);
}

void Trainer::free_released() {
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (!s.pending_free || !s.released.load(std::memory_order_acquire)) continue;
    drain_reports();  // last words of the task, while its page is still mapped
    s.page = nullptr;
    s.page_map.reset();
    s.page_fd.reset();
    s.pending_free = false;
    hub_.slot(i)->state.store(uint32_t(SlotState::kFree), std::memory_order_release);
    s.state.store(uint32_t(SlotState::kFree), std::memory_order_release);
    hub_.stats()->reclaimed.fetch_add(1, std::memory_order_relaxed);
  }
}

void Trainer::drain_reports() {
  shm::HubStats* hs = hub_.stats();
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (!s.page_map) continue;
    SlotCtl* ctl = hub_.slot(i);
    if (ctl->bad.load(std::memory_order_relaxed)) continue;
    const TaskPage* p = reinterpret_cast<const TaskPage*>(s.page_map.data());
    shm::Report rep;
    for (uint32_t k = 0; k < shm::kReportRingSize; ++k) {
      const shm::RingStatus st = shm::ring_pop(p->reports, ctl->report_head, &rep);
      if (st == shm::RingStatus::kEmpty) break;
      if (st == shm::RingStatus::kCorrupt) {
        ctl->bad.store(1, std::memory_order_relaxed);
        hs->bad.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      // Every field is the task's word: keep only what is plausible.
      const uint64_t now = now_ns();
      if (rep.ts_ns > now || rep.a > kMaxSaneNs) continue;
      switch (shm::ReportType(rep.type)) {
        case shm::ReportType::kStarted: {
          std::lock_guard<std::mutex> lock(stats_mu_);
          start_latency_.record(rep.a);
          shm::log_event(hub_, shm::EventKind::kTaskStart, uint16_t(i), rep.ts_ns, rep.epoch, rep.a);
          break;
        }
        case shm::ReportType::kPaused:
          if (rep.b == 0) {  // b = 1 marks a task that yielded before the bubble ended
            std::lock_guard<std::mutex> lock(stats_mu_);
            pause_latency_.record(rep.a);
          }
          shm::log_event(hub_, shm::EventKind::kTaskPause, uint16_t(i), rep.ts_ns, rep.epoch, rep.a);
          break;
        case shm::ReportType::kStep: {
          if (rep.b > rep.a || rep.count == 0) continue;
          hs->steps.fetch_add(rep.count, std::memory_order_relaxed);
          hs->ns_in_bubbles.fetch_add(rep.a - rep.b, std::memory_order_relaxed);
          hs->ns_outside.fetch_add(rep.b, std::memory_order_relaxed);
          ctl->steps.fetch_add(rep.count, std::memory_order_relaxed);
          ctl->step_ns.fetch_add(rep.a, std::memory_order_relaxed);
          ctl->ns_in_bubbles.fetch_add(rep.a - rep.b, std::memory_order_relaxed);
          ctl->ns_outside.fetch_add(rep.b, std::memory_order_relaxed);
          shm::log_event(hub_, shm::EventKind::kTaskStep, uint16_t(i), rep.ts_ns - rep.a, rep.a,
                         rep.b);
          break;
        }
        case shm::ReportType::kFinished:
        case shm::ReportType::kFailed:
          shm::log_event(hub_, shm::EventKind::kTaskFinish, uint16_t(i), rep.ts_ns,
                         rep.type == uint32_t(shm::ReportType::kFailed), 0);
          break;
        default:
          break;
      }
    }
    // The task's own count of reports it could not push; only forward progress is believed.
    const uint64_t dropped = p->dropped.load(std::memory_order_relaxed);
    if (dropped > s.dropped_seen && dropped - s.dropped_seen < (1u << 30)) {
      hs->dropped.fetch_add(dropped - s.dropped_seen, std::memory_order_relaxed);
      s.dropped_seen = dropped;
    }
  }
}

}  // namespace bb::core
