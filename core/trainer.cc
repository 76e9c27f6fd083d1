#include "core/trainer.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <linux/membarrier.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/resource.h>
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
#include "core/closer.h"
#include "core/error.h"
#include "core/grant_wire.h"
#include "core/paths.h"
#include "core/schedule.h"
#include "core/thread.h"
#include "shm/fd_passing.h"
#include "shm/futex.h"
#include "shm/wire.h"

namespace bb::core {

using shm::SlotCtl;
using shm::SlotState;
using shm::TaskPage;

// The trainer-private state of a slot whose dead task's page nobody uses any more (the hub's
// SlotCtl::state stays kDead until the slot is free).
constexpr uint32_t kSlotReleased = 3;

// Trainer-private view of one slot. `state` is the hand-off between the two threads:
//   service: fills the fields, then state = kActive (release), then publish_change();
//   service: on death, state = kDead, then publish_change();
//   bubble thread: on seeing kDead in refresh_slots(), stops touching the page and moves the
//   state from kDead to kSlotReleased, or the service thread does when the bubble thread makes
//   no call for long (release_idle_slots()); only then does the service thread unmap the page
//   and free the slot. A compare-exchange either way: a late one cannot mark the slot's next
//   task, which has its own kActive until it dies.
struct Trainer::Slot {
  std::atomic<uint32_t> state{uint32_t(SlotState::kFree)};
  // Written by the service thread before kActive; read by the bubble thread after it.
  const TaskPage* page = nullptr;
  // The page's wake word, the one word of it the trainer writes (wake_task()).
  std::atomic<uint32_t>* wake = nullptr;
  Candidate cand;
  uint32_t generation = 0;
  // Bubble thread only (reset by the service thread before kActive).
  uint32_t epoch = 0;           // last run epoch given to the task
  // Service thread only.
  shm::Mapping page_map;
  shm::Fd page_fd;
  shm::Fd pidfd;
  int conn = -1;                // index into conns_, -1 if none
  bool pending_free = false;
  uint64_t dead_ns = 0;         // when it was reclaimed (pending_free since)
  uint64_t dropped_seen = 0;
  // What the task's reports may still claim (service thread): step time only within wall time
  // since the attach, each interval after the last one reported; one start and one pause
  // latency per run epoch the trainer gave, in order.
  uint64_t steps_until_ns = 0;
  uint32_t started_seen = 0, paused_seen = 0;
  // Grants. grant_ready is the hand-off to the bubble thread: the grant a START names, 0 while
  // the task holds none or it is being revoked. Written by the service thread only.
  std::atomic<uint64_t> grant_ready{0};
  // Service thread only.
  uint64_t task_id = 0;         // slot | generation << 32, the lender's owner id
  uint64_t grant = 0;           // the grant held (active or revoking), 0 = none
  uint64_t revoke_deadline_ns = 0;
  bool revoking = false;
  bool grant_hold = false;      // not granted automatically (revoked, or gave one back)
  bool killed = false;
};

// A grant call from another thread, carried out by the service thread (which owns the slots'
// connections and grant words), so no lock is ever shared with it beyond the queue.
struct Trainer::Request {
  enum Op { kGrant, kRevoke, kInfo, kWake, kTakeBack, kUnlend, kStop } op = kGrant;
  uint64_t task_id = 0;
  uint64_t bytes = 0;
  uint64_t deadline_ns = 0;
  bb_grant_info_t* info = nullptr;
  uint64_t grant_id = 0;
  bb_status status = BB_OK;
  std::string error;
  bool done = false;
};

// A peer on the hub socket: a connection that has not said hello yet, a task, or an observer.
struct Trainer::Conn {
  enum Kind { kHello, kTask, kObserver } kind = kHello;
  shm::Fd fd;
  uint64_t hello_deadline_ns = 0;
  int slot = -1;
  uint32_t uid = 0;
  // A peer's connection may still hold descriptors it sent (a kernel before 6.16): closed off
  // the service thread, like those it reads (core/closer.h). Shut down here first, which never
  // blocks and lets go of nothing in flight: the peer sees the end at once.
  ~Conn() {
    const int f = fd.release();
    if (f < 0) return;
    ::shutdown(f, SHUT_RDWR);
    close_elsewhere(&f, 1);
  }
};

namespace {

// The hub's liveness mutex (shm::HubStats::alive_mutex) and where its futex word sits.
pthread_mutex_t* alive_mutex(const shm::HubView& hub) {
  return reinterpret_cast<pthread_mutex_t*>(hub.stats()->alive_mutex);
}
static_assert(sizeof(pthread_mutex_t) <= sizeof(shm::HubStats::alive_mutex));
static_assert(alignof(pthread_mutex_t) <= shm::kCacheLine);
#if defined(__GLIBC__)
// glibc keeps the kernel's robust-futex word first in its mutex (bits/struct_mutex.h).
constexpr uint32_t kAliveWordOffset = uint32_t(offsetof(pthread_mutex_t, __data.__lock));
static_assert(kAliveWordOffset % 4 == 0);
#else
constexpr uint32_t kAliveWordOffset = shm::kNoAliveWord;
#endif

bool init_alive_mutex(pthread_mutex_t* m) {
  pthread_mutexattr_t a;
  if (pthread_mutexattr_init(&a) != 0) return false;
  const bool ok = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED) == 0 &&
                  pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST) == 0 &&
                  pthread_mutex_init(m, &a) == 0;
  pthread_mutexattr_destroy(&a);
  return ok;
}

constexpr uint64_t kHelloTimeoutNs = 2'000'000'000ull;

// A time plus a length that a caller may make as long as it likes (UINT64_MAX: "no end"): it
// stays at the end of time rather than wrap into the past.
// Wakes a task that may sleep on its page's wake word, after its doorbell was bumped. The bump
// of the word (release) is what the task's futex wait compares, and carries the doorbell's
// change to a task that reads it (shm/layout.h, TaskPage::wake). Only the task and the trainer
// map the word, so nobody else can take the wake; it wakes one waiter all the same, so a task
// that parks many threads there costs the caller, the bubble thread above all, one wake-up.
void wake_task(std::atomic<uint32_t>* wake) {
  wake->fetch_add(1, std::memory_order_release);
  shm::futex_wake(wake, 1);
}
constexpr size_t kMaxPeers = 64;  // connections holding no task slot
// A flood of connections holds the service thread for at most this many accepts a loop (the
// listening socket stays readable, so the next loop takes the rest) ...
constexpr int kMaxAcceptsPerLoop = 64;
// ... and a refused peer's queued requests for at most this many reads: a request is one
// message, and a peer that queued more gets a reset instead of an answer.
constexpr int kMaxRefusedReads = 4;
// With no descriptor to accept into (and none in reserve), the listening socket is left alone
// this long, rather than polled readable again and again.
constexpr uint64_t kAcceptPauseNs = 100'000'000;
// getsockopt(SO_PEERPIDFD), Linux 6.5 and later (older C headers lack the name).
#ifdef SO_PEERPIDFD
constexpr int kSoPeerPidfd = SO_PEERPIDFD;
#else
constexpr int kSoPeerPidfd = 77;
#endif
constexpr uint64_t kServiceTickNs = 10'000'000ull;  // report draining while tasks are attached
constexpr uint64_t kServiceBusyTickNs = 1'000'000ull;  // ... while a task's reports pile up
// How long a dead task's slot waits for the bubble thread to release it before the service
// thread does (release_idle_slots()): bubbles that keep coming release it sooner, without it.
constexpr uint64_t kIdleReleaseNs = 100'000'000ull;
constexpr uint64_t kMaxSaneNs = 3600'000'000'000ull;

// The process behind a pidfd has exited (its memory is gone).
bool pidfd_dead(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return poll(&p, 1, 0) > 0;
}

constexpr uint64_t kDefaultRevokeNs = 1'000'000'000ull;
constexpr uint64_t kGrantRetryNs = 100'000'000ull;  // after a passing failure of an automatic grant
// A task whose connection closed while it held a grant is given this long to be reported dead
// by its pidfd (an exiting process closes its files a moment before it is reaped, and its memory
// is already gone by then) before it is taken for one that left its slot alive, and killed.
constexpr uint64_t kLeaveGraceNs = 500'000'000ull;
// bb_trainer_close: how long past the take-back deadline it waits for killed tasks to be
// reported dead, and how often it looks.
constexpr uint64_t kCloseDeathWaitNs = 2'000'000'000ull;
constexpr uint64_t kCloseWaitPollNs = 1'000'000ull;
// A task marked bad is never started again: its grant is asked back with this deadline.
constexpr uint64_t kBadTaskRevokeNs = 5'000'000'000ull;
constexpr int kMaxTaskMessages = 16;  // per wake-up, so a chatty task cannot hog the service

uint32_t next_epoch(uint32_t e) { return e + 1 == 0 ? 1 : e + 1; }

// A start or pause report's epoch is believed once, in order, and only for an epoch the trainer
// already gave the slot (its given_epoch): one latency sample per real start or pause.
bool newer_given_epoch(uint32_t epoch, uint32_t* seen, const shm::SlotCtl* ctl) {
  const uint32_t given = ctl->given_epoch.load(std::memory_order_acquire);
  if (epoch == 0 || int32_t(epoch - *seen) <= 0 || int32_t(given - epoch) < 0) return false;
  *seen = epoch;
  return true;
}

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
    if (attempt > 8) {
      lock_fd_.reset();  // a lock on an inode that is no longer the file: shutdown() must not
                         // unlink the path, which is another trainer's lock by now
      return fail(BB_E_BUSY, "hub %s.%u is being opened and closed by another process "
                  "concurrently: retry", job_id, rank);
    }
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
  bubble_ = hub_.bubble();
  slot_ctls_ = hub_.slot(0);
  bubble_->free_mem.store(BB_MEM_UNKNOWN, std::memory_order_relaxed);
  bubble_log_.attach(hub_, shm::EventStream::kBubble);
  service_log_.attach(hub_, shm::EventStream::kService);
  // Taken by the service thread when it starts (serve()); until then tasks are told nothing.
  hub_.stats()->alive_word.store(shm::kNoAliveWord, std::memory_order_relaxed);
  alive_init_ = init_alive_mutex(alive_mutex(hub_));
  if (!shm::seal_read_only(hub_fd_.get(), &err)) return fail_msg(BB_E_SYSTEM, err);

  slots_.reset(new Slot[opts_.max_slots]);
  // For release_idle_slots(). Without it (a kernel before 4.14, a sandbox that refuses the
  // call) a dead task's slot waits for the next bubble, as it always may.
  membarrier_ = syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;

  listen_fd_.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listen_fd_) return fail(BB_E_SYSTEM, "socket() failed: %s", std::strerror(errno));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  write_str(addr.sun_path, sizeof addr.sun_path, socket_path_.c_str());
  if (bind(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return fail(BB_E_SYSTEM, "cannot bind hub socket %s: %s", socket_path_.c_str(),
                std::strerror(errno));
  // Nothing reaches the hub with descriptors; refusing them keeps a task from passing one whose
  // close would block the service thread (a kernel without the option closes what arrives).
  (void)shm::refuse_passed_fds(listen_fd_.get());
  // The directory is 0700 already; the mode is a second fence.
  if (chmod(socket_path_.c_str(), 0600) != 0 || listen(listen_fd_.get(), 64) != 0)
    return fail(BB_E_SYSTEM, "cannot listen on hub socket %s: %s", socket_path_.c_str(),
                std::strerror(errno));
  wake_fd_.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_fd_) return fail(BB_E_SYSTEM, "eventfd() failed: %s", std::strerror(errno));
  reserve_spare_fd();  // none: accepting pauses instead (accept_all)
  try {
    service_ = start_library_thread("bb-hub", [this] { serve(); });
  } catch (const std::exception& e) {
    return fail(BB_E_SYSTEM, "cannot start the hub service thread: %s", e.what());
  }
  return BB_OK;
}

Trainer::~Trainer() { shutdown(); }

void Trainer::shutdown() {
  if (hub_.base) {
    // Tell every task the trainer is leaving: they return BB_E_TRAINER_GONE or wait for a new
    // trainer, by their option. Their connections are shut down below (and closed by the closer
    // thread), which they also notice.
    hub_.stats()->closing.store(1, std::memory_order_release);
    // In a call for good: the service thread frees no slot on its own from here on.
    bubble_where_.store(kInBubbleCall, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    for (uint32_t i = 0; i < opts_.max_slots; ++i) {
      SlotCtl* c = slot_ctl(i);
      c->run_epoch.store(0, std::memory_order_release);
      c->doorbell.fetch_add(1, std::memory_order_release);
      // We are the bubble thread (bb_trainer_close's contract): the service thread unmaps a
      // task's page only once this thread released the slot, so an active slot's page stays
      // mapped until we return. A dead slot's task is gone or has hung up, and is not woken.
      if (!slots_) continue;  // init() failed before it made them
      Slot& s = slots_[i];
      if (SlotState(s.state.load(std::memory_order_acquire)) == SlotState::kActive)
        wake_task(s.wake);
    }
  }
  if (service_.joinable()) {
    wait_grants_back();
    stopping_.store(true, std::memory_order_release);
    uint64_t one = 1;
    (void)!write(wake_fd_.get(), &one, sizeof one);
    service_.join();
  }
  if (alive_init_) {
    pthread_mutex_destroy(alive_mutex(hub_));
    alive_init_ = false;
  }
  conns_.clear();
  // Tasks killed for their grants die on their own; the memory goes back with the lender.
  doomed_.clear();
  lender_.store(nullptr, std::memory_order_release);
  lender_owned_.reset();
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
    const SlotCtl* c = slot_ctl(i);
    if (st == SlotState::kDead) {
      cands_[i].active = false;
      // Forget it if it runs in the open bubble: from here on we never touch s.page.
      for (uint32_t k = 0; k < n_running_; ++k)
        if (running_[k] == i) running_[k--] = running_[--n_running_];
      uint32_t dead = uint32_t(SlotState::kDead);  // unless the service thread released it
      s.state.compare_exchange_strong(dead, kSlotReleased, std::memory_order_acq_rel,
                                      std::memory_order_relaxed);
      continue;
    }
    // Only a slot published as active has fields the service thread no longer writes. One it
    // marked bad or asked to stop is started no more.
    const bool active = st == SlotState::kActive && c->bad.load(std::memory_order_relaxed) == 0 &&
                        c->stop.load(std::memory_order_relaxed) == 0;
    if (st == SlotState::kActive) cands_[i] = s.cand;
    cands_[i].active = active;
    if (active) span_ = i + 1;
  }
  pick_index_.build(cands_, span_);
}

bool Trainer::task_ready(uint32_t i) {
  const Slot& s = slots_[i];
  // The task must have acked the pause of the last start (or never been started): the word is
  // the task's, and any other value, sense or not, only keeps it from being started.
  if (s.page->acked_epoch.load(std::memory_order_acquire) != s.epoch) return false;
  // Once memory is lent, a task that needs some runs only while it holds a grant.
  return !(s.cand.mem_need && lender_.load(std::memory_order_relaxed) &&
           s.grant_ready.load(std::memory_order_acquire) == 0);
}

// The bubble thread's mark for release_idle_slots(): in a call from construction, and at
// destruction whether a bubble is left open. The release store orders the call's accesses to
// task pages before it; the entry's store needs no fence (the service thread's membarrier).
struct Trainer::BubbleCall {
  explicit BubbleCall(Trainer* t) : t_(t) {
    t_->bubble_where_.store(kInBubbleCall, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
  ~BubbleCall() { t_->bubble_where_.store(t_->open_ ? kBubbleOpen : 0, std::memory_order_release); }
  BubbleCall(const BubbleCall&) = delete;
  BubbleCall& operator=(const BubbleCall&) = delete;
  Trainer* t_;
};

bb_status Trainer::begin(uint64_t expected_ns, uint64_t free_mem, bb_bubble_kind kind) {
  prefetch_warm();
  const BubbleCall call(this);
  if (unsigned(kind) >= BB_BUBBLE_KIND_COUNT_)
    return fail(BB_E_INVALID, "bubble kind %d is not a bb_bubble_kind", int(kind));
  refresh_slots();
  const uint64_t now = now_ns();
  const bool closed_open = open_;  // a begin that also ends the last bubble
  if (open_) end_locked(now);
  // The gap before this bubble. The first bubble ever has none; its position still counts,
  // or every later gap of the first iteration would land one position early. With measured
  // times the gap is what scales the model, so this bubble's prediction should include the
  // compute just done: then it goes in first; otherwise after the tasks are started.
  // A begin that ended the last bubble itself follows it with no gap at all: with measured
  // times that 0 would be taken for compute that took no time (every model unit 0 ns, every
  // prediction 1 ns, no task started), so then the position only counts.
  const bool gap_first = gap_predictor_.measures_scale();
  auto observe_gap = [&] {
    if (last_end_ns_ != 0 && !(closed_open && gap_first))
      gap_predictor_.observe(BB_BUBBLE_OTHER, now - last_end_ns_);
    else
      gap_predictor_.skip();
  };
  if (gap_first) observe_gap();
  if (expected_ns == 0) expected_ns = predictor_.predict(kind);
  const uint64_t deadline = expected_ns ? add_sat(now, expected_ns) : 0;
  shm::BubbleState* b = bubble_;
  const uint64_t seq = seq_ + 1;

  // Start the tasks first: what follows is bookkeeping no waiting task needs.
  uint32_t picked[BB_MAX_SLOTS_LIMIT];
  const Offer offer{free_mem, expected_ns};
  const uint32_t n = pick_index_.pick(cands_, span_, offer, opts_.max_running, rr_cursor_,
                                      [this](uint32_t i) { return task_ready(i); }, picked);
  uint64_t wakes = 0;
  for (uint32_t k = 0; k < n; ++k) {
    const uint32_t i = picked[k];
    Slot& s = slots_[i];
    SlotCtl* c = slot_ctl(i);
    // Read once: the pick saw a grant, but the service thread may have taken it since, and a
    // task that needs memory runs only with the grant its START names.
    const uint64_t grant = s.grant_ready.load(std::memory_order_acquire);
    if (grant == 0 && s.cand.mem_need && lender_.load(std::memory_order_relaxed)) continue;
    s.epoch = next_epoch(s.epoch);
    // The start block first, then the epoch that makes it current, then the bell: a waiting
    // task reads all three from one cache line.
    c->start_kind.store(uint32_t(kind), std::memory_order_relaxed);
    c->start_seq.store(seq, std::memory_order_relaxed);
    c->start_begin_ns.store(now, std::memory_order_relaxed);
    c->start_deadline_ns.store(deadline, std::memory_order_relaxed);
    c->start_free_mem.store(free_mem, std::memory_order_relaxed);
    c->start_grant_id.store(grant, std::memory_order_relaxed);
    // run_epoch before given_epoch: a task that sees the new start (given_epoch, acquire) then
    // also sees it running, and does not take it for one whose bubble already ended.
    c->run_epoch.store(s.epoch, std::memory_order_release);
    c->given_epoch.store(s.epoch, std::memory_order_release);  // publishes the block
    c->doorbell.fetch_add(1, std::memory_order_release);
    // Pairs with the task's store of `sleeping` and fence before its futex wait: either it sees
    // the new doorbell, or we see it sleeping and wake it.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (s.page->sleeping.load(std::memory_order_relaxed)) {
      wake_task(s.wake);
      ++wakes;
    }
    running_[n_running_++] = i;
  }
  // The rest no waiting task needs: when each was started (for observers), and the lines the
  // next end and begin will touch for these tasks.
  const uint32_t started = n_running_;  // the picked, less any whose grant went meanwhile
  for (uint32_t k = 0; k < started; ++k) {
    const uint32_t i = running_[k];
    slot_ctl(i)->started_ns.store(now, std::memory_order_relaxed);
    if (k >= kWarmLines / 4) continue;
    const void** w = warm_ + 4 * k;
    w[0] = &slots_[i];
    w[1] = &cands_[i];
    w[2] = &slots_[i].page->acked_epoch;
    w[3] = slot_ctl(i);
  }

  if (!gap_first) observe_gap();
  // When the next bubble should begin: this one's expected end plus the gap that followed this
  // position before. Tasks waiting for it sleep until shortly before (predictive wake).
  const uint64_t gap = gap_predictor_.predict(BB_BUBBLE_OTHER);
  kind_ = kind;
  begin_ns_ = now;
  open_ = true;
  const uint64_t v = b->version.load(std::memory_order_relaxed);
  b->version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  b->seq.store(seq, std::memory_order_relaxed);
  seq_ = seq;
  b->kind.store(uint32_t(kind), std::memory_order_relaxed);
  b->begin_ns.store(now, std::memory_order_relaxed);
  b->deadline_ns.store(deadline, std::memory_order_relaxed);
  b->free_mem.store(free_mem, std::memory_order_relaxed);
  b->open.store(1, std::memory_order_relaxed);
  b->next_begin_ns.store(deadline && gap ? add_sat(deadline, gap) : 0,
                         std::memory_order_relaxed);
  b->version.store(v + 2, std::memory_order_release);
  if (started)
    starts_.store(starts_.load(std::memory_order_relaxed) + started, std::memory_order_relaxed);
  if (wakes) wakes_.store(wakes_.load(std::memory_order_relaxed) + wakes, std::memory_order_relaxed);
  log_bubble(shm::EventKind::kBubbleBegin, now, expected_ns, free_mem);
  return BB_OK;
}

bb_status Trainer::end() {
  if (!open_) return BB_OK;
  prefetch_warm();  // the tasks to pause are the ones the begin started
  const BubbleCall call(this);
  refresh_slots();
  end_locked(now_ns());
  return BB_OK;
}

void Trainer::end_locked(uint64_t now) {
  shm::BubbleState* b = bubble_;
  // Publish the next bubble's predicted begin before pausing anyone, so a task that acks and
  // goes back to waiting already sees it. An iteration marked while this bubble was open
  // starts now: the next gap is the new iteration's first.
  if (iteration_pending_) gap_predictor_.begin_iteration();
  const uint64_t gap = gap_predictor_.predict(BB_BUBBLE_OTHER);
  b->next_begin_ns.store(gap ? add_sat(now, gap) : 0, std::memory_order_relaxed);
  uint64_t wakes = 0, pauses = 0;
  for (uint32_t k = 0; k < n_running_; ++k) {
    const uint32_t i = running_[k];
    Slot& s = slots_[i];
    SlotCtl* c = slot_ctl(i);
    // refresh_slots() dropped any slot reclaimed since begin, so s.page is still mapped.
    // When the pause was asked goes out before the pause itself: a task that sees run_epoch
    // change then also sees this, and times its pause from it (published after, a task quick
    // enough to ack in between reported a pause latency of 0). For a task that already yielded
    // the words say a pause was asked that it had answered; the agent looks only at tasks
    // whose start is not yet acked.
    c->pause_requested_ns.store(now, std::memory_order_relaxed);
    c->paused_epoch.store(s.epoch, std::memory_order_release);
    c->run_epoch.store(0, std::memory_order_release);
    if (s.page->acked_epoch.load(std::memory_order_acquire) == s.epoch) continue;  // yielded
    c->doorbell.fetch_add(1, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    // A task that acked meanwhile is waiting for the next start, not for this pause.
    if (s.page->sleeping.load(std::memory_order_relaxed) &&
        s.page->acked_epoch.load(std::memory_order_relaxed) != s.epoch) {
      wake_task(s.wake);
      ++wakes;
    }
    ++pauses;
  }
  n_running_ = 0;
  open_ = false;
  const uint64_t dur = now - begin_ns_;
  predictor_.observe(kind_, dur);  // every bubble, so positions stay in step with the iteration
  if (iteration_pending_) {
    iteration_pending_ = false;
    predictor_.begin_iteration();  // the gap predictor's began above
  }
  const uint64_t v = b->version.load(std::memory_order_relaxed);
  b->version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  b->open.store(0, std::memory_order_relaxed);
  b->end_ns.store(now, std::memory_order_relaxed);
  b->bubbles.store(b->bubbles.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  b->bubble_ns.store(b->bubble_ns.load(std::memory_order_relaxed) + dur, std::memory_order_relaxed);
  b->version.store(v + 2, std::memory_order_release);
  last_end_ns_ = now;
  if (pauses) pauses_.store(pauses_.load(std::memory_order_relaxed) + pauses, std::memory_order_relaxed);
  if (wakes) wakes_.store(wakes_.load(std::memory_order_relaxed) + wakes, std::memory_order_relaxed);
  log_bubble(shm::EventKind::kBubbleEnd, now, dur, 0);
}

bb_status Trainer::set_schedule(const bb_schedule_t& sc) {
  if (sc.kind > BB_SCHEDULE_ZBH1)
    return fail(BB_E_INVALID, "schedule kind %u is not a bb_schedule_kind", sc.kind);
  if (sc.stage >= sc.stages)
    return fail(BB_E_INVALID, "stage %u is out of range 0..%u (stages - 1)", sc.stage,
                sc.stages ? sc.stages - 1 : 0);
  if (sc.bubbles > BB_SCHEDULE_BUBBLES_RECEIVES)
    return fail(BB_E_INVALID, "bubbles %u is not a bb_schedule_bubbles (0: idle intervals, "
                "1: one per receive)", sc.bubbles);
  const bool measure = sc.fwd_ns == 0 && sc.bwd_ns == 0;
  if (!measure && (sc.fwd_ns == 0 || sc.bwd_ns == 0))
    return fail(BB_E_INVALID, "the schedule has fwd_ns %llu and bwd_ns %llu: give both, or leave "
                "both 0 to have them measured", (unsigned long long)sc.fwd_ns,
                (unsigned long long)sc.bwd_ns);
  if (measure && (sc.wgrad_ns != 0 || sc.comm_ns != 0))
    return fail(BB_E_INVALID, "wgrad_ns and comm_ns need fwd_ns and bwd_ns: with those unknown "
                "(0), leave them 0 too and the library measures all times");
  if (sc.kind != BB_SCHEDULE_INTERLEAVED && sc.chunks > 1)
    return fail(BB_E_INVALID, "chunks is %u, but only an interleaved schedule has model chunks: "
                "set kind to BB_SCHEDULE_INTERLEAVED, or chunks to 1", sc.chunks);
  ScheduleParams p;
  p.kind = ScheduleKind(sc.kind);
  p.stages = sc.stages;
  p.microbatches = sc.microbatches;
  p.chunks = sc.kind == BB_SCHEDULE_INTERLEAVED ? sc.chunks : 1;
  p.fwd_ns = sc.fwd_ns;
  p.bwd_ns = sc.bwd_ns;
  p.wgrad_ns = sc.wgrad_ns;
  p.comm_ns = sc.comm_ns;
  if (measure) p = unit_times(p);
  Schedule model;
  std::string err;
  if (simulate_schedule(p, &model, &err) != BB_OK) return fail_msg(BB_E_INVALID, err);
  const bool receives = sc.bubbles == BB_SCHEDULE_BUBBLES_RECEIVES;
  const std::vector<ScheduledBubble> bubbles =
      receives ? receive_waits(model, sc.stage) : model.stages[sc.stage].bubbles;
  const std::vector<uint64_t> gaps = gaps_before(bubbles, model.iteration_ns);
  // Positions past the predictor's table are not seeded: they fall back to per-kind history.
  const uint32_t n = uint32_t(std::min<size_t>(bubbles.size(), BubblePredictor::kMaxPositions));
  uint64_t lengths[BubblePredictor::kMaxPositions];
  for (uint32_t i = 0; i < n; ++i) {
    lengths[i] = bubbles[i].duration_ns;
    // A receive the model says needs no wait is a bubble of (almost) nothing, not an unknown.
    if (receives && !measure && lengths[i] == 0) lengths[i] = 1;
  }
  if (measure) {
    unit_scale_ = UnitScale{};
    predictor_.seed_units(lengths, n, &unit_scale_, false);
    gap_predictor_.seed_units(gaps.data(), n, &unit_scale_, true);
  } else {
    predictor_.seed(lengths, n);
    gap_predictor_.seed(gaps.data(), n);
  }
  return BB_OK;
}

void Trainer::iteration() {
  // A bubble still open belongs to the iteration that is ending: it is observed at its own
  // position when it ends, and the new iteration starts then (starting it now would record the
  // open bubble as the new iteration's first, and put every later position one off).
  if (open_) {
    iteration_pending_ = true;
    return;
  }
  predictor_.begin_iteration();
  gap_predictor_.begin_iteration();
  // The last end published when the next bubble should begin from the gap that follows the
  // last position; the gap before an iteration's first bubble (the optimizer step, loading
  // data) is another one.
  if (last_end_ns_ != 0) {
    const uint64_t gap = gap_predictor_.predict(BB_BUBBLE_OTHER);
    bubble_->next_begin_ns.store(gap ? add_sat(last_end_ns_, gap) : 0, std::memory_order_relaxed);
  }
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
    const SlotCtl* c = slot_ctl(i);
    if (SlotState(c->state.load(std::memory_order_acquire)) != SlotState::kActive) continue;
    if (n < cap) {
      bb_task_info_t& t = out[n];
      const uint32_t size = t.size;
      std::memset(&t, 0, sizeof t);
      t.size = size;
      t.slot = i;
      const uint32_t gen = c->generation.load(std::memory_order_acquire);
      t.id = uint64_t(i) | uint64_t(gen) << 32;
      t.pid = c->pid;
      t.priority = c->priority;
      t.mem_need = c->mem_need;
      t.min_step_ns = c->min_step_ns;
      t.steps = c->steps.load(std::memory_order_relaxed);
      t.step_ns = c->step_ns.load(std::memory_order_relaxed);
      t.running = c->run_epoch.load(std::memory_order_relaxed) != 0;
      t.bad = c->bad.load(std::memory_order_relaxed);
      t.ns_in_bubbles = c->ns_in_bubbles.load(std::memory_order_relaxed);
      t.ns_outside = c->ns_outside.load(std::memory_order_relaxed);
      std::memcpy(t.name, c->name, sizeof t.name);
      t.name[sizeof t.name - 1] = 0;
      // The slot went to another task while we copied it (its task left and the service thread
      // freed and gave it again): the row would mix the two. The slot is left out, as if read
      // a moment later, before its next task was listed.
      if (!shm::slot_still(c, gen)) continue;
    }
    ++n;
  }
  *count = n;
  return BB_OK;
}

// Any thread: the stop is made on the service thread, which alone frees and reuses slots, so the
// slot's generation cannot change between its check and the stop (made on a user's thread, a
// stop could land on the task that attached to the slot meanwhile).
bb_status Trainer::stop_task(uint64_t task_id) {
  Request r;
  r.op = Request::kStop;
  r.task_id = task_id;
  return submit(&r);
}

bb_status Trainer::stop_slot(uint64_t task_id) {
  const uint32_t slot = uint32_t(task_id & 0xffffffffu), gen = uint32_t(task_id >> 32);
  if (slot >= opts_.max_slots)
    return fail(BB_E_NOT_FOUND, "task id %llu names slot %u, but the hub has %u slots: take ids "
                "from bb_trainer_tasks()", (unsigned long long)task_id, slot, opts_.max_slots);
  SlotCtl* c = slot_ctl(slot);
  if (SlotState(c->state.load(std::memory_order_acquire)) != SlotState::kActive ||
      c->generation.load(std::memory_order_relaxed) != gen)
    return fail(BB_E_NOT_FOUND, "task id %llu is not attached (it detached or died)",
                (unsigned long long)task_id);
  c->stop.store(1, std::memory_order_release);
  c->run_epoch.store(0, std::memory_order_release);
  c->doorbell.fetch_add(1, std::memory_order_release);
  if (slots_[slot].wake) wake_task(slots_[slot].wake);
  publish_change();
  return BB_OK;
}

// ------------------------------------------------------------------------------------------
// Service thread.

void Trainer::serve() {
  // Held for as long as this thread serves, so the kernel marks it if the trainer process dies
  // (shm::HubStats::alive): the word is published only once held, before any task attaches.
  // Published only where the kernel will walk this thread's robust list when it dies (glibc
  // registers one per thread; a kernel or sandbox that refused it leaves the head null), else
  // a dead trainer would look alive to tasks that trust the word.
  const bool alive_held = alive_init_ && pthread_mutex_lock(alive_mutex(hub_)) == 0;
  void* robust_head = nullptr;
  size_t robust_len = 0;
  const bool robust = syscall(SYS_get_robust_list, 0, &robust_head, &robust_len) == 0 &&
                      robust_head != nullptr;
  if (alive_held && robust && kAliveWordOffset != shm::kNoAliveWord)
    hub_.stats()->alive_word.store(kAliveWordOffset, std::memory_order_release);
  std::vector<pollfd> pfds;
  // What each pollfd is: -1 wake fd, -2 listen fd, >= 0 conn index, -10 - i slot i's pidfd,
  // kDoomedBase - k doomed_[k]'s pidfd.
  constexpr int kDoomedBase = -100000;
  std::vector<int> who;
  for (;;) {
    pfds.clear();
    who.clear();
    pfds.push_back({wake_fd_.get(), POLLIN, 0});
    who.push_back(-1);
    // Left out (-1 is ignored) while accepting is paused for want of a descriptor.
    const bool accepting = now_ns() >= accept_paused_until_ns_;
    pfds.push_back({accepting ? listen_fd_.get() : -1, POLLIN, 0});
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
    for (size_t k = 0; k < doomed_.size(); ++k) {
      pfds.push_back({doomed_[k].pidfd.get(), POLLIN, 0});
      who.push_back(kDoomedBase - int(k));
    }
    // A task whose report ring was found half full or more is reporting faster than one tick
    // drains: look again sooner, so its reports find room.
    const uint64_t tick = reports_busy_ ? kServiceBusyTickNs : kServiceTickNs;
    int timeout_ms = any_task || any_hello || !doomed_.empty() ? int(tick / 1000000) : -1;
    if (!accepting) timeout_ms = timeout_ms < 0 ? int(kAcceptPauseNs / 1000000)
                                                : std::min(timeout_ms, int(kAcceptPauseNs / 1000000));
    // A revoke's deadline is kept to the millisecond, not to the next tick.
    if (const uint64_t d = next_grant_deadline()) {
      const uint64_t now = now_ns();
      const int until = d > now ? int(std::min<uint64_t>((d - now) / 1000000 + 1, 1000)) : 0;
      timeout_ms = timeout_ms < 0 ? until : std::min(timeout_ms, until);
    }
    const int rc = poll(pfds.data(), pfds.size(), timeout_ms);
    if (rc < 0 && errno != EINTR) {
      // Out of kernel memory, or more descriptors than RLIMIT_NOFILE: nothing here can fix
      // it, but leaving would unlock the liveness mutex and tell every task its trainer died
      // while the bubble thread goes on. Keep answering the API's requests and its close, and
      // try again shortly.
      if (stopping_.load(std::memory_order_acquire)) break;
      serve_requests();
      usleep(10'000);
      continue;
    }
    if (pfds[0].revents & POLLIN) {
      uint64_t v;
      (void)!read(wake_fd_.get(), &v, sizeof v);
      if (stopping_.load(std::memory_order_acquire)) break;
    }
    serve_requests();
    if (pfds[1].revents & POLLIN) accept_all();
    const uint64_t now = now_ns();
    std::vector<size_t> dead_doomed;
    for (size_t k = 2; k < pfds.size(); ++k) {
      if (!pfds[k].revents) continue;
      if (who[k] <= kDoomedBase) {
        dead_doomed.push_back(size_t(kDoomedBase - who[k]));
        continue;
      }
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
        task_message(*c);
      }
    }
    for (Doomed& d : doomed_)
      if (!d.killed && now >= d.kill_at_ns) d.killed = send_kill(d.pidfd.get(), d.slot, d.pid, 0);
    // A killed task is gone: nobody maps its grants any more.
    for (size_t k = dead_doomed.size(); k-- > 0;) {
      Doomed& d = doomed_[dead_doomed[k]];
      if (GrantLender* l = lender_.load(std::memory_order_acquire)) {
        const size_t n = l->release_owner(d.owner);
        released_dead_.fetch_add(n, std::memory_order_relaxed);
        if (n) retry_grants_ = true;
      }
      doomed_.erase(doomed_.begin() + long(dead_doomed[k]));
    }
    for (auto& c : conns_)
      if (c && c->kind == Conn::kHello && now > c->hello_deadline_ns) c.reset();
    drain_reports();
    grant_tick(now_ns());
    release_idle_slots(now_ns());
    free_released();
  }
  drain_reports();
  // The hub is closing (tasks were told): the word reads 0 from here on, which a task also
  // takes for a trainer that is gone.
  if (alive_held) pthread_mutex_unlock(alive_mutex(hub_));
  // Fail whatever is still queued: nobody will serve it.
  std::lock_guard<std::mutex> lock(req_mu_);
  service_done_ = true;
  req_cv_.notify_all();
}

// A task only ever sends GrantAck after attaching; anything else is ignored, and a closed or
// broken connection means the task is gone.
void Trainer::task_message(Conn& c) {
  const uint32_t slot = uint32_t(c.slot);
  for (int k = 0; k < kMaxTaskMessages; ++k) {
    alignas(8) char buf[shm::kWireMaxMessage];
    int fds[2], nfds;
    const long n = shm::recv_msg(c.fd.get(), buf, fds, &nfds, MSG_DONTWAIT, close_elsewhere);
    close_elsewhere(fds, size_t(nfds));  // a task sends no descriptors
    if (n == -EAGAIN || n == -EWOULDBLOCK) return;
    if (n <= 0) {
      reclaim(slot, false);  // resets c
      return;
    }
    if (shm::check_msg(buf, n, shm::MsgType::kGrantAck, sizeof(shm::GrantAckMsg)))
      check_grant_ack(slot);
  }
}

namespace {

// Answers a connection it will not take with the reason, unread. Closing with its request still
// queued would reset the connection, and the peer would read ECONNRESET instead of the answer:
// shut our side first (a later send gets EPIPE) and drop what came before.
void refuse_unread(int fd, bb_status status, const char* why) {
  ::shutdown(fd, SHUT_RD);
  bool drained = false;
  for (int k = 0; k < kMaxRefusedReads && !drained; ++k) {
    alignas(8) char buf[shm::kWireMaxMessage];
    int fds[2], nfds;
    const long n = shm::recv_msg(fd, buf, fds, &nfds, MSG_DONTWAIT, close_elsewhere);
    close_elsewhere(fds, size_t(nfds));
    drained = n <= 0 && n != -EMSGSIZE && n != -EMFILE;  // one out of bounds was consumed too
  }
  if (!drained) return;  // more than a request: closed, which the peer reads as a reset
  auto r = shm::make_msg<shm::AttachReplyMsg>(shm::MsgType::kAttachReply);
  r.status = status;
  std::snprintf(r.error, sizeof r.error, "%s", why);
  shm::send_msg(fd, &r, sizeof r, nullptr, 0);
}

}  // namespace

void Trainer::reserve_spare_fd() { spare_fd_.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC)); }

void Trainer::accept_all() {
  // Lost to another thread of the process when it was last used (the number it freed taken
  // before it could be opened again): taken back as soon as a number is free.
  if (!spare_fd_) reserve_spare_fd();
  for (int accepted = 0; accepted < kMaxAcceptsPerLoop; ++accepted) {
    int fd = accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
      // At the descriptor limit the connection would stay in the backlog, the socket readable,
      // and this thread polling it in a loop while the peer waits for nothing. The descriptor
      // in reserve takes it, to say why it is refused; without one, accepting pauses.
      if (spare_fd_) {
        spare_fd_.reset();
        fd = accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) {
          const std::string why = "the trainer is at its limit of open descriptors" +
                                  shm::fd_limit_note() +
                                  " and cannot take a connection: raise its limit, or detach tasks";
          refuse_unread(fd, BB_E_SYSTEM, why.c_str());
          ::close(fd);
        }
        reserve_spare_fd();
        if (fd >= 0 && spare_fd_) continue;
      }
      accept_paused_until_ns_ = now_ns() + kAcceptPauseNs;
      return;
    }
    if (fd < 0) {
      if (errno == ENOMEM || errno == ENOBUFS) accept_paused_until_ns_ = now_ns() + kAcceptPauseNs;
      return;
    }
    auto c = std::make_unique<Conn>();
    c->fd.reset(fd);
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) continue;
    // Peers that hold no slot (saying hello, or observing) are bounded, so a process cannot make
    // the trainer hold descriptors without end. Tasks are bounded by the slot table.
    size_t peers = 0;
    for (const auto& p : conns_) peers += p && p->kind != Conn::kTask;
    if (peers >= kMaxPeers) {
      char why[160];
      std::snprintf(why, sizeof why, "the hub has %zu connections that hold no task slot "
                    "(attaching or observing): close some and retry", peers);
      refuse_unread(fd, BB_E_FULL, why);
      continue;
    }
    // The uid is checked when the peer's request has arrived (handle_hello), so the refusal
    // is read as an answer rather than lost to a connection reset.
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
  const long n = shm::recv_msg(c.fd.get(), buf, fds, &nfds, 0, close_elsewhere);
  close_elsewhere(fds, size_t(nfds));  // a hello carries no descriptors
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
  if (n == -EMSGSIZE) {
    reply_error(BB_E_INVALID, "the attach message is larger than the hub protocol allows or "
                "carries descriptors it does not: the peer does not speak the libbubble hub "
                "protocol");
    return drop();
  }
  if (n <= 0) return drop();
  const uint32_t me = uint32_t(geteuid());
  if (c.uid != me && c.uid != 0 && c.uid != opts_.allow_uid) {
    char text[160];
    std::snprintf(text, sizeof text, "uid %u may not attach to this hub (owned by uid %u): run the "
                  "task as the trainer's user", c.uid, me);
    reply_error(BB_E_PERMISSION, text);
    return drop();
  }
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
  if (i == opts_.max_slots) {
    uint32_t freeing = 0;
    for (uint32_t k = 0; k < opts_.max_slots; ++k) freeing += slots_[k].pending_free ? 1 : 0;
    if (freeing)  // let go of at the bubble thread's next call, or within about 0.1 s
      return reject(BB_E_FULL, "hub " + job_ + "." + std::to_string(rank_) + " has no free "
                    "task slot: " + std::to_string(freeing) + " of its " +
                    std::to_string(opts_.max_slots) + " held tasks that left and are being "
                    "freed (" + (membarrier_ ? "within about 0.1 s, or " : "at the trainer's "
                    "next bubble call, or ") + "at the end of the bubble open now); try again "
                    "then");
    return reject(BB_E_FULL, "hub " + job_ + "." + std::to_string(rank_) + " has all " +
                                 std::to_string(opts_.max_slots) +
                                 " task slots in use: detach a task, or open the hub with a "
                                 "larger max_slots");
  }
  // Without a pidfd the process could never be killed for a grant it keeps past its revoke's
  // deadline, nor its death told apart from a closed connection: refuse it. SO_PEERCRED names
  // the process that called connect(), which may have exited since (or live in a pid namespace
  // this one cannot see, pid 0).
  shm::Fd pidfd;
  {
    int fd = -1;
    std::string why;
    if (cred.pid <= 0)
      return reject(BB_E_PERMISSION, "the connecting process is not visible from the trainer's "
                                     "pid namespace: attach from the trainer's namespace or a "
                                     "parent of it");
    // The kernel's own pidfd of the peer (Linux 6.5+) names the process that connected even if
    // its pid was reused since; pidfd_open of the pid is the fallback on older kernels.
    socklen_t plen = sizeof fd;
    bb_status ps = BB_OK;
    if (getsockopt(c.fd.get(), SOL_SOCKET, kSoPeerPidfd, &fd, &plen) != 0) {
      fd = -1;
      if (errno == ENOPROTOOPT) {  // a kernel without it: the pid, which may have been reused
        ps = shm::pidfd_open_pid(cred.pid, &fd, &why);
      } else if (errno == EMFILE || errno == ENFILE || errno == ENOMEM) {  // the trainer's lack
        ps = BB_E_SYSTEM;
        const bool at_limit = errno == EMFILE;
        why = std::string("the trainer cannot open a descriptor for it: ") + std::strerror(errno) +
              (at_limit ? shm::fd_limit_note() + "; raise the trainer's limit, or detach tasks"
                        : std::string());
      } else {  // the kernel knows the peer and cannot name it: it has exited
        ps = BB_E_NOT_FOUND;
        why = std::string("it has exited (") + std::strerror(errno) + ")";
      }
    } else if (fd < 0 || pidfd_dead(fd)) {  // newer kernels give a pidfd of an exited process too
      if (fd >= 0) close(fd);
      fd = -1;
      ps = BB_E_NOT_FOUND;
      why = "it has exited";
    }
    // The trainer's own failure (out of descriptors or memory) is said as such; any other
    // means the process that connected is not there to watch.
    if (ps == BB_E_SYSTEM) return reject(ps, "cannot watch the process that connected: " + why);
    if (ps != BB_OK)
      return reject(ps == BB_E_UNSUPPORTED ? ps : BB_E_PERMISSION,
                    "cannot watch the process that connected (" + why +
                        "): a task must attach from the process that connected to the hub, "
                        "and stay alive");
    pidfd.reset(fd);
  }
  Slot& s = slots_[i];
  std::string err;
  s.page_fd = shm::create_segment("bubble-task", shm::kTaskPageSize, &err);
  if (!s.page_fd) return reject(BB_E_SYSTEM, err);
  // The task maps its page writable and could shrink it under the trainer's (and observers')
  // mappings, which would then fault on their next read.
  if (!shm::seal_size(s.page_fd.get(), &err)) {
    s.page_fd.reset();
    return reject(BB_E_SYSTEM, err);
  }
  // Mapped writable for one word, the task's wake word (wake_task()); everything else on the
  // page is the task's, read and validated, never written.
  s.page_map = shm::map_segment(s.page_fd.get(), shm::kTaskPageSize, true, &err);
  if (!s.page_map) {
    s.page_fd.reset();
    return reject(BB_E_SYSTEM, err);
  }
  {
    auto* p = reinterpret_cast<TaskPage*>(s.page_map.data());
    p->magic = shm::kPageMagic;
    p->layout_version = shm::kLayoutVersion;
    p->slot = i;
    s.wake = &p->wake;
  }
  s.pidfd = std::move(pidfd);

  SlotCtl* ctl = slot_ctl(i);
  const uint32_t gen = ctl->generation.load(std::memory_order_relaxed) + 1;
  ctl->signal_generation.store(gen, std::memory_order_relaxed);
  ctl->run_epoch.store(0, std::memory_order_relaxed);
  ctl->stop.store(0, std::memory_order_relaxed);
  ctl->bad.store(0, std::memory_order_relaxed);
  ctl->report_head.store(0, std::memory_order_relaxed);
  ctl->pause_requested_ns.store(0, std::memory_order_relaxed);
  ctl->started_ns.store(0, std::memory_order_relaxed);
  ctl->paused_epoch.store(0, std::memory_order_relaxed);
  ctl->given_epoch.store(0, std::memory_order_relaxed);
  ctl->steps.store(0, std::memory_order_relaxed);
  ctl->step_ns.store(0, std::memory_order_relaxed);
  ctl->ns_in_bubbles.store(0, std::memory_order_relaxed);
  ctl->ns_outside.store(0, std::memory_order_relaxed);
  write_grant(ctl, nullptr);
  ctl->pid = cred.pid;
  ctl->priority = m.priority;
  ctl->mem_need = m.mem_need;
  ctl->min_step_ns = m.min_step_ns;
  std::memcpy(ctl->name, m.name, sizeof ctl->name);
  // After the identity: a reader that copied it and then finds this generation unchanged
  // (shm::slot_still) copied the identity of the attach it names, not half of the next one's.
  ctl->generation.store(gen, std::memory_order_release);

  s.page = reinterpret_cast<const TaskPage*>(s.page_map.data());
  s.cand = Candidate{true, m.priority, m.mem_need, m.min_step_ns};
  s.generation = gen;
  s.epoch = 0;
  s.dropped_seen = 0;
  s.steps_until_ns = now_ns();
  s.started_seen = s.paused_seen = 0;
  s.grant_ready.store(0, std::memory_order_relaxed);
  s.task_id = uint64_t(i) | uint64_t(gen) << 32;
  s.grant = 0;
  s.revoke_deadline_ns = 0;
  s.revoking = false;
  s.grant_hold = false;
  s.killed = false;
  for (size_t k = 0; k < conns_.size(); ++k)
    if (conns_[k].get() == &c) s.conn = int(k);

  r.status = BB_OK;
  r.slot = i;
  r.generation = gen;
  r.hub_size = hub_map_.size();
  // Publish before replying, so that once bb_task_attach returns the trainer lists the task.
  c.kind = Conn::kTask;
  c.slot = int(i);
  ctl->state.store(uint32_t(SlotState::kActive), std::memory_order_release);
  s.state.store(uint32_t(SlotState::kActive), std::memory_order_release);
  hub_.stats()->attached.fetch_add(1, std::memory_order_relaxed);
  retry_grants_ = true;
  publish_change();
  log_service(shm::EventKind::kTaskAttach, i, now_ns(), uint64_t(cred.pid), 0);
  const int fds[2] = {hub_fd_.get(), s.page_fd.get()};
  if (shm::send_msg(c.fd.get(), &r, sizeof r, fds, 2) != 0) {
    // The task went away during the attach. The caller drops the connection (it is still a
    // hello to it); reclaim frees the slot through the usual hand-off with the bubble thread.
    s.conn = -1;
    c.kind = Conn::kHello;
    c.slot = -1;
    reclaim(i, true);
  }
}

void Trainer::handle_observer_request(Conn& c) {
  alignas(8) char buf[shm::kWireMaxMessage];
  int fds[2], nfds;
  const long n = shm::recv_msg(c.fd.get(), buf, fds, &nfds, 0, close_elsewhere);
  close_elsewhere(fds, size_t(nfds));  // a request carries no descriptors
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
  const bool own_uid = c.uid == uint32_t(geteuid()) || c.uid == 0;
  if (stop && !own_uid) {
    // Other uids (allow_uid) watch: a stop from one would let any task of that uid stop every
    // task on the hub.
    r.status = fail(BB_E_PERMISSION, "stops come only from the trainer's own uid (and root), "
                    "not from uid %u, which may only watch this hub", c.uid);
  } else if (stop) {
    r.status = stop_slot(id);
  } else if (!own_uid) {
    // The page's descriptor can write (its task writes it): across uids it would let the
    // allow_uid user write any task's acks, grant words and reports. Within one uid a process
    // can reach the trainer's descriptors through /proc anyway.
    r.status = fail(BB_E_PERMISSION, "task pages go only to the trainer's own uid (and root), "
                    "not to uid %u: run the observer as the trainer's user", c.uid);
  } else if (q.slot < opts_.max_slots && slots_[q.slot].generation == q.generation &&
             slots_[q.slot].state.load() == uint32_t(SlotState::kActive) && !slots_[q.slot].pending_free) {
    r.status = BB_OK;
    fd = slots_[q.slot].page_fd.get();
  } else {
    r.status = fail(BB_E_NOT_FOUND, "task id %llu is not attached", (unsigned long long)id);
  }
  if (r.status != BB_OK) std::snprintf(r.error, sizeof r.error, "%s", last_error());
  // An observer pairs answers with its requests by their order: one it does not get (its
  // socket full, say) would shift every later answer onto the wrong request. It is dropped
  // instead, sees the end, and opens again.
  if (shm::send_msg(c.fd.get(), &r, sizeof r, fd >= 0 ? &fd : nullptr, fd >= 0 ? 1 : 0) != 0)
    return drop();
}

void Trainer::reclaim(uint32_t i, bool died) {
  Slot& s = slots_[i];
  if (s.state.load(std::memory_order_relaxed) != uint32_t(SlotState::kActive)) return;
  SlotCtl* ctl = slot_ctl(i);
  ctl->state.store(uint32_t(SlotState::kDead), std::memory_order_release);
  ctl->run_epoch.store(0, std::memory_order_release);
  s.state.store(uint32_t(SlotState::kDead), std::memory_order_release);
  s.pending_free = true;
  s.dead_ns = now_ns();
  publish_change();
  grant_on_reclaim(i, died);
  if (s.conn >= 0 && size_t(s.conn) < conns_.size()) conns_[size_t(s.conn)].reset();
  s.conn = -1;
  s.pidfd.reset();
  hub_.stats()->attached.fetch_sub(1, std::memory_order_relaxed);
  log_service(shm::EventKind::kTaskDetach, i, now_ns(), uint64_t(ctl->pid), died ? 1 : 0);
}

void Trainer::release_idle_slots(uint64_t now) {
  // A dead task's slot is freed once the bubble thread released it, at its next begin or end. A
  // trainer between bubbles for long (an evaluation, a checkpoint) would hold the slot, its page
  // and its descriptor until then, and tasks that come and go meanwhile could fill the table.
  // So a slot dead for kIdleReleaseNs is released here, if the bubble thread is in no call and
  // no bubble is open. The membarrier has every thread of the process execute a full fence
  // while it runs: afterwards either the bubble thread's mark shows it in a call (tried again
  // at the next tick), or any call it starts later sees the slot dead (refresh_slots(), through
  // slots_changed_, bumped when the slot died) and never touches its page. Its last call's
  // accesses came before its mark's release store, which the acquire load below reads.
  if (!membarrier_) return;
  bool any = false;
  for (uint32_t i = 0; i < opts_.max_slots && !any; ++i) {
    const Slot& s = slots_[i];
    any = s.pending_free &&
          s.state.load(std::memory_order_relaxed) == uint32_t(SlotState::kDead) &&
          now - std::min(now, s.dead_ns) >= kIdleReleaseNs;
  }
  // In a call, or a bubble open (which keeps its started tasks' pages to its end): the syscall
  // would say no more than this look does.
  if (!any || bubble_where_.load(std::memory_order_relaxed) != 0) return;
  if (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0) return;
  if (bubble_where_.load(std::memory_order_acquire) != 0) return;
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    if (!slots_[i].pending_free) continue;
    uint32_t dead = uint32_t(SlotState::kDead);  // unless the bubble thread did meanwhile
    slots_[i].state.compare_exchange_strong(dead, kSlotReleased, std::memory_order_acq_rel,
                                            std::memory_order_relaxed);
  }
}

void Trainer::free_released() {
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (!s.pending_free || s.state.load(std::memory_order_acquire) != kSlotReleased) continue;
    drain_reports();  // last words of the task, while its page is still mapped
    s.page = nullptr;
    s.wake = nullptr;
    s.page_map.reset();
    s.page_fd.reset();
    s.pending_free = false;
    slot_ctl(i)->state.store(uint32_t(SlotState::kFree), std::memory_order_release);
    s.state.store(uint32_t(SlotState::kFree), std::memory_order_release);
    hub_.stats()->reclaimed.fetch_add(1, std::memory_order_relaxed);
  }
}

void Trainer::mark_bad(uint32_t i) {
  slot_ctl(i)->bad.store(1, std::memory_order_relaxed);
  hub_.stats()->bad.fetch_add(1, std::memory_order_relaxed);
  publish_change();  // the bubble thread drops it from the candidates at its next call
}

void Trainer::drain_reports() {
  shm::HubStats* hs = hub_.stats();
  reports_busy_ = false;
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (!s.page_map) continue;
    SlotCtl* ctl = slot_ctl(i);
    if (ctl->bad.load(std::memory_order_relaxed)) continue;
    const TaskPage* p = reinterpret_cast<const TaskPage*>(s.page_map.data());
    shm::Report rep;
    for (uint32_t k = 0; k < shm::kReportRingSize; ++k) {
      const shm::RingStatus st = shm::ring_pop(p->reports, ctl->report_head, &rep);
      if (st == shm::RingStatus::kEmpty) break;
      if (k == shm::kReportRingSize / 2) reports_busy_ = true;
      if (st == shm::RingStatus::kCorrupt) {
        mark_bad(i);
        break;
      }
      // Every field is the task's word: keep only what is plausible.
      const uint64_t now = now_ns();
      if (rep.ts_ns > now || rep.a > kMaxSaneNs) continue;
      switch (shm::ReportType(rep.type)) {
        case shm::ReportType::kStarted: {
          if (!newer_given_epoch(rep.epoch, &s.started_seen, ctl)) continue;
          std::lock_guard<std::mutex> lock(stats_mu_);
          start_latency_.record(rep.a);
          log_service(shm::EventKind::kTaskStart, i, rep.ts_ns, rep.epoch, rep.a);
          break;
        }
        case shm::ReportType::kPaused:
          if (!newer_given_epoch(rep.epoch, &s.paused_seen, ctl)) continue;
          if (rep.b == 0) {  // b = 1 marks a task that yielded before the bubble ended
            std::lock_guard<std::mutex> lock(stats_mu_);
            pause_latency_.record(rep.a);
          }
          log_service(shm::EventKind::kTaskPause, i, rep.ts_ns, rep.epoch, rep.a);
          break;
        case shm::ReportType::kStep: {
          if (rep.b > rep.a || rep.a > rep.ts_ns || rep.count == 0) continue;
          // Steps follow one another: a report claims at most the time since the last one
          // ended (or since the attach), so a task's step time never exceeds its wall time.
          // Its steps still count when that leaves no time (two reports stamped alike).
          const uint64_t room = rep.ts_ns > s.steps_until_ns ? rep.ts_ns - s.steps_until_ns : 0;
          const uint64_t a = std::min(rep.a, room);
          const uint64_t b = std::min(rep.b, a);
          s.steps_until_ns = std::max(s.steps_until_ns, rep.ts_ns);
          hs->steps.fetch_add(rep.count, std::memory_order_relaxed);
          hs->ns_in_bubbles.fetch_add(a - b, std::memory_order_relaxed);
          hs->ns_outside.fetch_add(b, std::memory_order_relaxed);
          ctl->steps.fetch_add(rep.count, std::memory_order_relaxed);
          ctl->step_ns.fetch_add(a, std::memory_order_relaxed);
          ctl->ns_in_bubbles.fetch_add(a - b, std::memory_order_relaxed);
          ctl->ns_outside.fetch_add(b, std::memory_order_relaxed);
          log_service(shm::EventKind::kTaskStep, i, rep.ts_ns - a, a, b);
          break;
        }
        case shm::ReportType::kFinished:
        case shm::ReportType::kFailed:
          log_service(shm::EventKind::kTaskFinish, i, rep.ts_ns,
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

// ------------------------------------------------------------------------------------------
// Memory grants. All slot-side work happens on the service thread; the API calls below queue a
// Request and wait for it. The bubble thread reads only Slot::grant_ready and lender_.

bb_status Trainer::lend(const LendOptions& opts, bool auto_grant) {
  std::lock_guard<std::mutex> lock(lend_mu_);
  if (lender_owned_)
    return fail(BB_E_BUSY, "this hub already lends %llu bytes of %s memory: take it back with "
                "bb_trainer_unlend before lending again",
                (unsigned long long)lender_owned_->capacity(),
                grant_backend_name(lender_owned_->backend()));
  std::unique_ptr<GrantLender> l;
  std::string err;
  LendOptions o = opts;
  o.first_id = next_grant_id_;
  const bb_status st = GrantLender::create(o, &l, &err);
  if (st != BB_OK) return fail_msg(st, err);
  lender_owned_ = std::move(l);
  auto_grant_.store(auto_grant, std::memory_order_relaxed);
  lender_.store(lender_owned_.get(), std::memory_order_release);
  // Tasks that attached before the memory was lent get their grants now.
  Request r;
  r.op = Request::kWake;
  submit(&r);
  clear_error();
  return BB_OK;
}

bb_status Trainer::unlend(uint64_t deadline_ns) {
  std::lock_guard<std::mutex> lock(lend_mu_);
  if (!lender_owned_) return fail(BB_E_STATE, "no memory is lent: there is nothing to take back");
  // The grants come back as in bb_trainer_close: every holder is asked by the deadline and
  // killed at it, and no grant is made meanwhile. Whether all came back, the service thread
  // decides below, where no grant can be made between its look and its letting go.
  const bb_status back = take_back_grants_and_wait(
      lender_owned_.get(), deadline_ns ? deadline_ns : now_ns() + kDefaultRevokeNs);
  if (back != BB_OK && back != BB_E_TIMEOUT) return back;
  // The service thread lets go of the lender (or, if a grant is still out, resumes granting and
  // says so); from then on it never touches it again.
  Request u;
  u.op = Request::kUnlend;
  if (const bb_status st = submit(&u); st != BB_OK) return st;
  std::unique_ptr<GrantLender> gone = std::move(lender_owned_);
  next_grant_id_ = gone->next_id();
  {
    // A grant_stats() that read lender_ before the service cleared it is done with it after this.
    std::lock_guard<std::mutex> readers(lender_read_mu_);
  }
  gone.reset();  // the lent memory goes back (cuda-ipc over the caller's range: it is theirs again)
  clear_error();
  return BB_OK;
}

bb_status Trainer::grant(uint64_t task_id, uint64_t bytes, uint64_t* grant_id) {
  Request r;
  r.op = Request::kGrant;
  r.task_id = task_id;
  r.bytes = bytes;
  const bb_status st = submit(&r);
  if (st == BB_OK && grant_id) *grant_id = r.grant_id;
  return st;
}

bb_status Trainer::revoke(uint64_t task_id, uint64_t deadline_ns) {
  Request r;
  r.op = Request::kRevoke;
  r.task_id = task_id;
  r.deadline_ns = deadline_ns ? deadline_ns : now_ns() + kDefaultRevokeNs;
  return submit(&r);
}

bb_status Trainer::task_grant(uint64_t task_id, bb_grant_info_t* out) {
  Request r;
  r.op = Request::kInfo;
  r.task_id = task_id;
  r.info = out;
  return submit(&r);
}

bb_status Trainer::read_grant(uint64_t grant_id, uint64_t offset, void* dst, uint64_t bytes) {
  std::unique_lock<std::mutex> readers(lender_read_mu_);  // unlend() frees the lender
  GrantLender* l = lender_.load(std::memory_order_acquire);
  if (!l) return fail(BB_E_STATE, "no memory is lent: there is no grant to read");
  std::string err;
  if (const bb_status st = l->read(grant_id, offset, dst, bytes, &err); st != BB_OK)
    return fail_msg(st, err);
  clear_error();
  return BB_OK;
}

void Trainer::grant_stats(bb_grant_stats_t* out) {
  std::unique_lock<std::mutex> readers(lender_read_mu_);  // unlend() frees the lender
  if (const GrantLender* l = lender_.load(std::memory_order_acquire)) {
    const LenderStats ls = l->stats();
    out->backend = uint32_t(l->backend());
    out->capacity = ls.capacity;
    out->granted_bytes = ls.granted_bytes;
    out->requested_bytes = ls.requested_bytes;
    out->free_bytes = ls.free_bytes;
    out->largest_free = ls.largest_free;
    out->revoking_bytes = ls.revoking_bytes;
    out->quarantined_bytes = ls.quarantined_bytes;
    out->active = ls.active;
    out->revoking = ls.revoking;
    out->quarantined = ls.quarantined;
    out->grants_made = ls.grants_made;
    out->grants_failed = ls.grants_failed;
  }
  out->revokes = revokes_.load(std::memory_order_relaxed);
  out->revokes_acked = revokes_acked_.load(std::memory_order_acquire);
  out->tasks_killed = kills_.load(std::memory_order_relaxed);
  out->released_dead = released_dead_.load(std::memory_order_relaxed);
}

bb_status Trainer::submit(Request* r) {
  {
    std::lock_guard<std::mutex> lock(req_mu_);
    if (service_done_) return fail(BB_E_STATE, "the hub is closing");
    requests_.push_back(r);
  }
  uint64_t one = 1;
  (void)!write(wake_fd_.get(), &one, sizeof one);
  std::unique_lock<std::mutex> lock(req_mu_);
  // The service thread never waits on a task, so this wait is bounded by one loop of it.
  req_cv_.wait(lock, [&] { return r->done || service_done_; });
  if (!r->done) {
    for (auto it = requests_.begin(); it != requests_.end(); ++it)
      if (*it == r) {
        requests_.erase(it);
        break;
      }
    return fail(BB_E_STATE, "the hub is closing");
  }
  if (r->status != BB_OK) return fail_msg(r->status, r->error);
  return BB_OK;
}

void Trainer::serve_requests() {
  std::vector<Request*> batch;
  {
    std::lock_guard<std::mutex> lock(req_mu_);
    if (requests_.empty()) return;
    batch.swap(requests_);
  }
  for (Request* r : batch) do_request(*r);
  std::lock_guard<std::mutex> lock(req_mu_);
  for (Request* r : batch) r->done = true;
  req_cv_.notify_all();
}

void Trainer::do_request(Request& r) {
  auto error = [&](bb_status st, const std::string& text) {
    r.status = st;
    r.error = text;
  };
  GrantLender* l = lender_.load(std::memory_order_acquire);
  if (r.op == Request::kWake) {
    retry_grants_ = true;  // lend(): new memory to hand out
    return;
  }
  if (r.op == Request::kTakeBack) {
    take_back_grants(r.deadline_ns);
    return;
  }
  if (r.op == Request::kStop) {
    if (const bb_status st = stop_slot(r.task_id); st != BB_OK) error(st, last_error());
    return;
  }
  if (r.op == Request::kUnlend) {
    taking_back_ = false;
    if (!l) return;
    const LenderStats st = l->stats();
    if (st.active + st.revoking != 0) {
      // A holder the kill did not reach (another uid) still maps lent memory: freeing it now
      // would hand that process whatever comes next. The tasks that gave theirs back may be
      // granted again; the holders still out stay revoking.
      for (uint32_t i = 0; i < opts_.max_slots; ++i)
        if (!slots_[i].grant) slots_[i].grant_hold = false;
      retry_grants_ = true;
      return error(BB_E_TIMEOUT, std::to_string(st.active + st.revoking) + " grant(s) were not "
                   "given back by their deadline, nor their holders reported dead (a process "
                   "the kill cannot reach?): the memory stays lent; call bb_trainer_unlend "
                   "again, or see bb_trainer_grant_stats");
    }
    lender_.store(nullptr, std::memory_order_release);
    // A later lend starts afresh: every attached task with a mem_need may be granted again.
    for (uint32_t i = 0; i < opts_.max_slots; ++i) slots_[i].grant_hold = false;
    return;
  }
  const uint32_t i = uint32_t(r.task_id & 0xffffffffu);
  if (i >= opts_.max_slots || slots_[i].state.load(std::memory_order_relaxed) !=
                                  uint32_t(SlotState::kActive) ||
      slots_[i].pending_free || slots_[i].task_id != r.task_id)
    return error(BB_E_NOT_FOUND, "task id " + std::to_string(r.task_id) + " is not attached (it "
                 "detached or died): take ids from bb_trainer_tasks()");
  Slot& s = slots_[i];
  std::string err;
  switch (r.op) {
    case Request::kGrant: {
      if (!l) return error(BB_E_STATE, "no memory is lent: call bb_trainer_lend first");
      if (taking_back_)
        return error(BB_E_STATE, "the lent memory is being taken back (bb_trainer_unlend or "
                     "bb_trainer_close): no grant is made meanwhile");
      if (s.grant)
        return error(BB_E_BUSY, "task " + std::to_string(r.task_id) + " already holds grant " +
                     std::to_string(s.grant) + ": revoke it first (a task holds one grant)");
      uint64_t bytes = r.bytes ? r.bytes : s.cand.mem_need;
      if (bytes == 0)
        return error(BB_E_INVALID, "bytes is 0 and the task stated no mem_need: say how many "
                     "bytes to grant");
      const bb_status st = offer_grant(i, bytes, &r.grant_id, &err);
      if (st != BB_OK) return error(st, err);
      s.grant_hold = false;
      return;
    }
    case Request::kRevoke: {
      if (!s.grant)
        return error(BB_E_NOT_FOUND, "task " + std::to_string(r.task_id) + " holds no grant");
      if (s.revoking)
        return error(BB_E_STATE, "the grant of task " + std::to_string(r.task_id) +
                     " is already being revoked");
      const bb_status st = start_revoke(i, r.deadline_ns, &err);
      if (st != BB_OK) return error(st, err);
      return;
    }
    case Request::kWake:
    case Request::kTakeBack:
    case Request::kUnlend:
    case Request::kStop:
      return;
    case Request::kInfo: {
      bb_grant_info_t& o = *r.info;
      o.task_id = r.task_id;
      Grant g;
      GrantState state;
      if (!l || !s.grant || l->find(s.grant, &g, &state) != BB_OK) return;
      o.state = uint32_t(state);
      o.id = g.id;
      o.backend = uint32_t(g.backend);
      o.bytes = g.size;
      o.offset = g.offset;
      o.address = l->address(g.id);
      o.deadline_ns = s.revoking ? s.revoke_deadline_ns : 0;
      o.mapped = s.page && s.page->grant_mapped.load(std::memory_order_relaxed) == g.id;
      return;
    }
  }
}

void Trainer::ring_doorbell(uint32_t i) {
  SlotCtl* c = slot_ctl(i);
  c->grant_change.fetch_add(1, std::memory_order_release);  // G1
  c->doorbell.fetch_add(1, std::memory_order_release);
  if (slots_[i].wake) wake_task(slots_[i].wake);
}

bb_status Trainer::offer_grant(uint32_t i, uint64_t bytes, uint64_t* id, std::string* error) {
  GrantLender* l = lender_.load(std::memory_order_acquire);
  Slot& s = slots_[i];
  Grant g;
  bb_status st = l->grant(bytes, s.task_id, &g, error);
  if (st != BB_OK) return st;
  if (g.handle.fd >= 0) {
    // The descriptor goes first: a task that sees the id finds it already queued.
    Conn* c = s.conn >= 0 && size_t(s.conn) < conns_.size() ? conns_[size_t(s.conn)].get() : nullptr;
    auto m = shm::make_msg<shm::GrantFdMsg>(shm::MsgType::kGrantFd);
    m.grant_id = g.id;
    m.map_size = g.handle.map_size;
    const int fd = g.handle.fd;
    const int e = c ? shm::send_msg(c->fd.get(), &m, sizeof m, &fd, 1) : ENOTCONN;
    if (e != 0) {
      std::string ignored;
      l->release(g.id, &ignored);
      *error = std::string("cannot send the grant's descriptor to the task: ") + std::strerror(e);
      // Passing: the task's socket is full (it has not read it yet), or this user has too many
      // descriptors in flight on sockets nobody has read yet (ETOOMANYREFS, counted against
      // RLIMIT_NOFILE without CAP_SYS_RESOURCE). An automatic grant is tried again for both.
      const bool passing = e == EAGAIN || e == ETOOMANYREFS || e == ENOBUFS;
      if (passing) *error += " (descriptors wait unread on its connection: try again shortly)";
      return passing ? BB_E_BUSY : BB_E_SYSTEM;
    }
    // The task has its own now. The trainer keeps none: a process forked from it without an
    // exec (a data loader's workers) would inherit it and hold the memory after release.
    l->descriptor_sent(g.id);
  }
  write_grant(slot_ctl(i), &g);
  s.grant = g.id;
  s.revoking = false;
  s.revoke_deadline_ns = 0;
  // The task is told before the bubble thread may name the grant in a START, so a START that
  // names it always finds grant_change moved.
  ring_doorbell(i);
  s.grant_ready.store(g.id, std::memory_order_release);
  log_service(shm::EventKind::kGrant, i, now_ns(), g.id, g.size);
  if (id) *id = g.id;
  return BB_OK;
}

bb_status Trainer::start_revoke(uint32_t i, uint64_t deadline_ns, std::string* error) {
  GrantLender* l = lender_.load(std::memory_order_acquire);
  Slot& s = slots_[i];
  const bb_status st = l->revoke(s.grant, deadline_ns, error);
  if (st != BB_OK) return st;
  s.revoking = true;
  s.revoke_deadline_ns = deadline_ns;
  s.grant_hold = true;
  s.grant_ready.store(0, std::memory_order_release);  // no START names it any more
  write_revoke(slot_ctl(i), s.grant, deadline_ns);
  ring_doorbell(i);
  revokes_.fetch_add(1, std::memory_order_relaxed);
  log_service(shm::EventKind::kRevoke, i, now_ns(), s.grant, deadline_ns);
  check_grant_ack(i);  // a task that already gave it back
  return BB_OK;
}

void Trainer::check_grant_ack(uint32_t i) {
  Slot& s = slots_[i];
  if (!s.grant || !s.page) return;
  // G2. Only the exact id we gave counts; any other value is the task's noise.
  if (s.page->grant_released.load(std::memory_order_acquire) != s.grant) return;
  const bool revoked = s.revoking;
  if (!revoked) s.grant_hold = true;  // it gave the grant back unasked (e.g. it could not map it)
  release_grant(i, false);
  // Counted once the range is back in the lender: whoever sees the ack sees the memory free.
  if (revoked) revokes_acked_.fetch_add(1, std::memory_order_release);
}

void Trainer::release_grant(uint32_t i, bool dead) {
  Slot& s = slots_[i];
  GrantLender* l = lender_.load(std::memory_order_acquire);
  const uint64_t id = s.grant;
  std::string err;
  // No START names it from here on (before the bytes can go to anybody else).
  s.grant_ready.store(0, std::memory_order_release);
  // A failure quarantines the range inside the lender (never reused, counted in its stats).
  if (l) (void)l->release(id, &err);
  SlotCtl* c = slot_ctl(i);
  write_grant(c, nullptr);
  c->grant_change.fetch_add(1, std::memory_order_release);
  s.grant = 0;
  s.revoking = false;
  s.revoke_deadline_ns = 0;
  retry_grants_ = true;
  if (dead) released_dead_.fetch_add(1, std::memory_order_relaxed);
  log_service(shm::EventKind::kGrantRelease, i, now_ns(), id, dead ? 1 : 0);
}

void Trainer::kill_task(uint32_t i, uint64_t grant_id) {
  Slot& s = slots_[i];
  if (s.killed || !s.pidfd) return;
  s.killed = true;
  send_kill(s.pidfd.get(), i, slot_ctl(i)->pid, grant_id);
}

// Returns true when no further attempt is useful (sent, or the process is already gone).
bool Trainer::send_kill(int pidfd, uint32_t slot, int32_t pid, uint64_t grant_id) {
  // A task in this very process (attached from one of the application's threads) is never
  // killed: that would end the trainer. Its grant stays out, as for a holder of another uid.
  if (pid == getpid()) return true;
  // pidfd, not the pid: the pid may already name another process.
  if (syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0) == 0) {
    kills_.fetch_add(1, std::memory_order_relaxed);
    log_service(shm::EventKind::kTaskKill, slot, now_ns(), uint64_t(pid), grant_id);
  }
  // On a failure other than ESRCH (EPERM: another uid) the grant simply stays out of use until
  // the process exits, which the pidfd still tells.
  return true;
}

void Trainer::grant_on_reclaim(uint32_t i, bool died) {
  Slot& s = slots_[i];
  if (!s.grant) return;
  if (died || (s.pidfd && pidfd_dead(s.pidfd.get()))) {
    release_grant(i, true);
    if (GrantLender* l = lender_.load(std::memory_order_acquire)) {
      const size_t n = l->release_owner(s.task_id);  // nothing else is expected: one per task
      released_dead_.fetch_add(n, std::memory_order_relaxed);
    }
    return;
  }
  if (s.page && s.page->grant_released.load(std::memory_order_acquire) == s.grant) {
    const bool revoked = s.revoking;
    release_grant(i, false);
    if (revoked) revokes_acked_.fetch_add(1, std::memory_order_release);
    return;
  }
  // A task that says it never mapped a host or cuda-vmm grant is believed: if it lied, it keeps
  // only memory of its own (the range gets new memory when granted again). A cuda-ipc handle
  // sits in the hub, readable and openable without a word, so that case is never believed.
  GrantLender* l = lender_.load(std::memory_order_acquire);
  if (l && l->backend() != GrantBackend::kCudaIpc && s.page &&
      s.page->grant_mapped.load(std::memory_order_acquire) != s.grant)
    return release_grant(i, false);
  // It left without giving the grant back and may still map the memory: unless the kernel
  // reports it dead within the grace, it is killed; the grant goes back once it is gone.
  Doomed d;
  d.pidfd = std::move(s.pidfd);
  d.owner = s.task_id;
  d.pid = slot_ctl(i)->pid;
  d.slot = i;
  d.killed = s.killed;
  d.kill_at_ns = now_ns() + kLeaveGraceNs;
  doomed_.push_back(std::move(d));
  s.grant = 0;
  s.revoking = false;
  s.grant_ready.store(0, std::memory_order_release);
}

void Trainer::wait_grants_back() {
  GrantLender* l = lender_.load(std::memory_order_acquire);
  if (!l) return;
  // Through the service thread even when no grant looks out: one may be in the making in the
  // loop it is in now (a task just attached), and only taking_back_, set there, stops more.
  // The tasks were told the trainer is closing and let go of their grants as they notice; a
  // revoke with a deadline covers the ones that do not (killed at it, like any revoke). Only
  // then may the lent memory go: a task still mapping it could otherwise reach whatever the
  // trainer (or, with cuda-ipc over the caller's allocation, the caller) puts there next.
  (void)take_back_grants_and_wait(l, now_ns() + kDefaultRevokeNs);
}

bb_status Trainer::take_back_grants_and_wait(const GrantLender* l, uint64_t deadline_ns) {
  Request r;
  r.op = Request::kTakeBack;
  r.deadline_ns = deadline_ns;
  if (const bb_status st = submit(&r); st != BB_OK) return st;
  // Past the deadline a killed task needs a moment to be reported dead. A process the kill
  // cannot reach (another uid) is not waited for beyond this; docs/GRANTS.md says so. (A
  // deadline already past still gets that moment; one at the end of time waits for good.)
  const uint64_t from = std::max(deadline_ns, now_ns());
  const uint64_t give_up = add_sat(from, kCloseDeathWaitNs);
  for (;;) {
    const LenderStats now = l->stats();
    if (now.active + now.revoking == 0) return BB_OK;
    if (now_ns() >= give_up) return BB_E_TIMEOUT;
    sleep_ns(kCloseWaitPollNs);
  }
}

void Trainer::take_back_grants(uint64_t deadline_ns) {
  taking_back_ = true;  // and no new grant from here on
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (!s.grant || s.pending_free) continue;
    if (s.revoking) {
      // An earlier revoke's later deadline comes forward: the lender's copy is the one that
      // kills, the slot's the one the task is shown.
      if (deadline_ns < s.revoke_deadline_ns) {
        s.revoke_deadline_ns = deadline_ns;
        if (GrantLender* l = lender_.load(std::memory_order_acquire)) l->hasten(s.grant, deadline_ns);
        write_revoke(slot_ctl(i), s.grant, deadline_ns);
        ring_doorbell(i);
      }
      continue;
    }
    std::string ignored;
    (void)start_revoke(i, deadline_ns, &ignored);
  }
  // Tasks that left their slot still holding a grant are killed at the same deadline at the
  // latest.
  for (Doomed& d : doomed_) d.kill_at_ns = std::min(d.kill_at_ns, deadline_ns);
}

uint64_t Trainer::next_grant_deadline() const {
  uint64_t d = 0;
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    const Slot& s = slots_[i];
    if (s.revoking && !s.killed && (d == 0 || s.revoke_deadline_ns < d)) d = s.revoke_deadline_ns;
  }
  return d;
}

void Trainer::grant_tick(uint64_t now) {
  GrantLender* l = lender_.load(std::memory_order_acquire);
  if (!l) return;
  bool any_revoking = false;
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (!s.grant || s.pending_free) continue;
    check_grant_ack(i);
    if (s.grant && !s.revoking && slot_ctl(i)->bad.load(std::memory_order_relaxed)) {
      std::string ignored;
      (void)start_revoke(i, now + kBadTaskRevokeNs, &ignored);
    }
    any_revoking |= s.revoking;
  }
  if (any_revoking) {
    // Every overdue grant at once: one left out would keep next_grant_deadline() in the past
    // (a busy service loop) and its holder alive.
    std::vector<uint64_t> ids(64);
    size_t n = l->overdue(now, ids.data(), ids.size());
    if (n > ids.size()) {
      ids.resize(n);
      n = std::min(l->overdue(now, ids.data(), ids.size()), ids.size());
    }
    for (size_t k = 0; k < n; ++k) {
      uint64_t owner = 0;
      if (l->find(ids[k], nullptr, nullptr, &owner) != BB_OK) continue;
      const uint32_t i = uint32_t(owner & 0xffffffffu);
      if (i < opts_.max_slots && slots_[i].task_id == owner && slots_[i].grant == ids[k] &&
          !slots_[i].pending_free)
        kill_task(i, ids[k]);  // released when its pidfd reports the death
    }
  }
  if (grant_retry_ns_ && now >= grant_retry_ns_) {
    grant_retry_ns_ = 0;
    retry_grants_ = true;
  }
  if (!retry_grants_ || !auto_grant_.load(std::memory_order_relaxed) || taking_back_) return;
  retry_grants_ = false;
  for (uint32_t i = 0; i < opts_.max_slots; ++i) {
    Slot& s = slots_[i];
    if (s.state.load(std::memory_order_relaxed) != uint32_t(SlotState::kActive) ||
        s.pending_free || s.grant || s.grant_hold || s.cand.mem_need == 0)
      continue;
    const SlotCtl* c = slot_ctl(i);
    if (c->bad.load(std::memory_order_relaxed) || c->stop.load(std::memory_order_relaxed))
      continue;
    std::string err;
    const bb_status st = offer_grant(i, s.cand.mem_need, nullptr, &err);
    // No room now: tried again when memory is released or a task attaches. The task's socket
    // full (it has not read its connection yet) passes: tried again a moment later. Anything
    // else would fail again the same way (and some failures cost the GPU work to find out).
    if (st == BB_E_BUSY) {
      if (grant_retry_ns_ == 0) grant_retry_ns_ = now + kGrantRetryNs;
    } else if (st != BB_OK && st != BB_E_NOMEM && st != BB_E_FULL) {
      s.grant_hold = true;
    }
  }
}

}  // namespace bb::core
