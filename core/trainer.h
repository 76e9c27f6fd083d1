// The trainer side of a hub: owns the segment, the socket and the task slots; reports bubbles.
//
// Two threads touch it:
//   - the bubble thread (the caller of begin/end/iteration): bounded-time, no locks, no
//     allocation; it reads trainer-private state and task pages it has not yet let go of;
//   - the hub service thread: accepts attaches, watches each task's connection and pidfd,
//     drains task reports into statistics and the event log, and frees dead slots once the bubble
//     thread has acknowledged them, or once a membarrier showed it in no call and no bubble open
//     (so a task page is never unmapped under the bubble thread).
//     It also does all memory-grant work: grants, revocations, kills of tasks that ignore a
//     revoke, and releases. The bubble thread only reads, per slot, which grant a task holds.
#pragma once

#include <bubble/bubble.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/grant_lender.h"
#include "core/histogram.h"
#include "core/policy.h"
#include "core/predictor.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace bb::core {

class Trainer {
 public:
  static bb_status open(const char* job_id, uint32_t rank, const bb_trainer_options_t& opts,
                        std::unique_ptr<Trainer>* out);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Bubble thread.
  bb_status begin(uint64_t expected_ns, uint64_t free_mem, bb_bubble_kind kind);
  bb_status end();
  void iteration();
  bb_status set_schedule(const bb_schedule_t& schedule);

  // A thread of the library's that takes over as the bubble thread (bb_stream_timing_open's
  // watcher): one at a time, or two would call begin and end at once. Any thread. `stop`, called
  // with `owner` by detach_bubble_driver(), stops that thread for good: a trainer closed while
  // its driver is open stops it first, so it never calls into the freed trainer.
  bool claim_bubble_driver(void* owner, void (*stop)(void*)) {
    if (driven_.exchange(true, std::memory_order_acq_rel)) return false;
    driver_owner_ = owner;
    driver_stop_ = stop;
    return true;
  }
  void release_bubble_driver() {
    driver_owner_ = nullptr;
    driver_stop_ = nullptr;
    driven_.store(false, std::memory_order_release);
  }
  // bb_trainer_close: stops the driver thread, if one is open (never with another call).
  void detach_bubble_driver() {
    if (driven_.load(std::memory_order_acquire) && driver_stop_) driver_stop_(driver_owner_);
  }

  // Any thread.
  void stats(bb_trainer_stats_t* out);
  bb_status tasks(bb_task_info_t* out, size_t cap, size_t* count);
  bb_status stop_task(uint64_t task_id);

  // Memory grants; any thread. lend() creates the lender on the caller's thread; the others
  // hand their work to the service thread and wait for it (never for a task).
  bb_status lend(const LendOptions& opts, bool auto_grant);
  // Takes every grant back (revoked by deadline_ns, 0 = in 1 s; holders killed at it) and gives
  // the lent memory back; waits for that, as bb_trainer_close does. Then lend() may lend again.
  bb_status unlend(uint64_t deadline_ns);
  bb_status grant(uint64_t task_id, uint64_t bytes, uint64_t* grant_id);
  bb_status revoke(uint64_t task_id, uint64_t deadline_ns);
  bb_status task_grant(uint64_t task_id, bb_grant_info_t* out);
  // Copies a live grant's bytes out on the caller's thread, a piece at a time under the
  // lender's lock: a task that leaves or dies meanwhile has its grant released between pieces
  // (the copy then ends with BB_E_NOT_FOUND), never under one.
  bb_status read_grant(uint64_t grant_id, uint64_t offset, void* dst, uint64_t bytes);
  void grant_stats(bb_grant_stats_t* out);

  struct Slot;
  struct Conn;
  struct Request;
  struct BubbleCall;

 private:
  Trainer() = default;
  bb_status init(const char* job_id, uint32_t rank, const bb_trainer_options_t& opts);
  void shutdown();
  bb_status stop_slot(uint64_t task_id);  // service thread: the work of stop_task

  // Bubble thread helpers.
  void refresh_slots();
  void end_locked(uint64_t now);
  bool task_ready(uint32_t i);
  // Issued before the clock read, whose ordering instruction holds back every later load: the
  // misses overlap it and each other instead of following one another. A prefetch never
  // faults, so a line of a slot reclaimed since is harmless.
  void prefetch_warm() const {
    if (warm_[0] == nullptr) return;  // no task started yet
    for (const void* line : warm_) __builtin_prefetch(line);
  }
  // Each thread appends to its own event stream, which keeps an append free of atomic
  // read-modify-writes (shm/layout.h).
  void log_bubble(shm::EventKind kind, uint64_t ts_ns, uint64_t a, uint64_t b) {
    bubble_log_.append(kind, 0xffff, ts_ns, a, b);
  }
  void log_service(shm::EventKind kind, uint32_t slot, uint64_t ts_ns, uint64_t a, uint64_t b) {
    service_log_.append(kind, uint16_t(slot), ts_ns, a, b);
  }

  // Service thread.
  void mark_bad(uint32_t i);  // its page failed validation: it is started no more
  void serve();
  void accept_all();
  void handle_hello(Conn& c);
  void attach_task(Conn& c, const void* msg);
  void handle_observer_request(Conn& c);
  void reclaim(uint32_t slot, bool died);
  void drain_reports();  // sets reports_busy_
  void release_idle_slots(uint64_t now);
  void free_released();
  void publish_change() { slots_changed_.fetch_add(1, std::memory_order_seq_cst); }
  void task_message(Conn& c);

  // Service thread: grants.
  bb_status submit(Request* r);
  void serve_requests();
  void do_request(Request& r);
  void grant_tick(uint64_t now);
  bb_status offer_grant(uint32_t slot, uint64_t bytes, uint64_t* id, std::string* error);
  bb_status start_revoke(uint32_t slot, uint64_t deadline_ns, std::string* error);
  void check_grant_ack(uint32_t slot);
  void release_grant(uint32_t slot, bool dead);
  void grant_on_reclaim(uint32_t slot, bool died);
  void kill_task(uint32_t slot, uint64_t grant_id);
  bool send_kill(int pidfd, uint32_t slot, int32_t pid, uint64_t grant_id);
  void ring_doorbell(uint32_t slot);
  uint64_t next_grant_deadline() const;
  void wait_grants_back();                     // bb_trainer_close, before the service stops
  // Has the service thread take every grant back by deadline_ns, then waits until none is out
  // (BB_OK) or a killed holder would have been reported dead by now (BB_E_TIMEOUT).
  bb_status take_back_grants_and_wait(const GrantLender* l, uint64_t deadline_ns);
  void take_back_grants(uint64_t deadline_ns);  // service thread

  std::string job_;
  uint32_t rank_ = 0;
  bb_trainer_options_t opts_{};
  std::string socket_path_, lock_path_;
  shm::Fd lock_fd_, listen_fd_, hub_fd_, wake_fd_;
  // A descriptor kept in reserve (/dev/null): at the process's descriptor limit, closed to
  // accept a connection and refuse it with the reason, then taken back (accept_all).
  shm::Fd spare_fd_;
  void reserve_spare_fd();
  uint64_t accept_paused_until_ns_ = 0;  // service thread: no accept before (no spare to use)
  shm::Mapping hub_map_;
  shm::HubView hub_;

  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> slots_changed_{0};
  std::atomic<bool> driven_{false};  // claim_bubble_driver()
  void* driver_owner_ = nullptr;
  void (*driver_stop_)(void*) = nullptr;

  // Bubble thread only. The scalars every bubble reads come first, on one or two cache lines
  // (a trainer computes between bubbles, so the path often starts with cold caches).
  uint32_t span_ = 0;  // one past the highest slot that may be active
  uint32_t rr_cursor_ = 0;
  uint32_t n_running_ = 0;
  // Where the bubble thread is, for release_idle_slots(): kInBubbleCall inside begin, end or the
  // close, else kBubbleOpen while a bubble is open, else 0. A plain store on entry and one on
  // return (no fence on the bubble path): the service thread's membarrier orders them.
  static constexpr uint32_t kInBubbleCall = 1, kBubbleOpen = 2;
  std::atomic<uint32_t> bubble_where_{0};
  bool open_ = false;
  bool iteration_pending_ = false;  // iteration() came while a bubble was open: see iteration()
  bb_bubble_kind kind_ = BB_BUBBLE_OTHER;
  uint64_t seen_changes_ = 0;
  uint64_t begin_ns_ = 0;
  uint64_t last_end_ns_ = 0;
  // In the hub, cached: the bubble path reaches them without reading the hub's header, and
  // numbers bubbles without reading the bubble state (which it writes after the signals).
  shm::BubbleState* bubble_ = nullptr;
  shm::SlotCtl* slot_ctls_ = nullptr;
  uint64_t seq_ = 0;  // the last bubble's number, as bubble_->seq; bubble thread only
  shm::SlotCtl* slot_ctl(uint32_t i) const { return slot_ctls_ + i; }
  // The lines the last begin touched for the tasks it started, prefetched when the next begin
  // enters: a trainer comes back from its compute with cold caches, and without this the path
  // to a start is a chain of dependent misses (slot, task page, signal line). Four lines a
  // task (its Slot, its candidate, its ack line, the slot's signal line) for the first two
  // tasks started.
  static constexpr uint32_t kWarmLines = 8;
  const void* warm_[kWarmLines] = {};
  shm::EventWriter bubble_log_;
  UnitScale unit_scale_;           // a schedule declared without times: ns per model unit
  BubblePredictor predictor_;      // bubble lengths
  BubblePredictor gap_predictor_;  // time from a bubble's end to the next one's begin
  Candidate cands_[BB_MAX_SLOTS_LIMIT];
  PickIndex pick_index_;  // cands_ grouped by priority, rebuilt with them
  uint32_t running_[BB_MAX_SLOTS_LIMIT];

  shm::EventWriter service_log_;  // the service thread's
  bool reports_busy_ = false;     // service thread: a report ring was half full at the last drain

  // Written by the bubble thread, read by anyone.
  std::atomic<uint64_t> starts_{0}, pauses_{0}, wakes_{0};

  // Service thread state and the statistics it keeps (stats() reads them under the mutex).
  std::thread service_;
  std::atomic<bool> stopping_{false};
  std::vector<std::unique_ptr<Conn>> conns_;
  std::mutex stats_mu_;
  LatencyHistogram start_latency_, pause_latency_;

  // Grants. lend() creates the lender and lender_ publishes it (the bubble thread only tests it
  // for null). It lives until unlend(), after the service thread cleared lender_ and readers of
  // the old value left lender_read_mu_, or until shutdown, after the service thread stopped.
  std::mutex lend_mu_;       // lend() and unlend()
  std::mutex lender_read_mu_;  // grant_stats() on any thread, against unlend()'s free
  uint64_t next_grant_id_ = 1;  // lend_mu_: grant ids never repeat within the hub's life
  std::unique_ptr<GrantLender> lender_owned_;
  std::atomic<GrantLender*> lender_{nullptr};
  std::atomic<bool> auto_grant_{false};
  // Requests from API callers to the service thread.
  std::mutex req_mu_;
  std::condition_variable req_cv_;
  std::vector<Request*> requests_;
  bool service_done_ = false;
  bool alive_init_ = false;  // the hub's liveness mutex is initialised (shm::HubStats::alive_mutex)
  // The process is registered for MEMBARRIER_CMD_PRIVATE_EXPEDITED (release_idle_slots()).
  bool membarrier_ = false;
  // Service thread only: tasks killed after leaving their slot, whose grants are released when
  // the kernel says they are gone; and whether a grant was released since one failed for room.
  struct Doomed {
    shm::Fd pidfd;
    uint64_t owner = 0;
    int32_t pid = 0;
    uint32_t slot = 0;
    uint64_t kill_at_ns = 0;  // still alive then: killed
    bool killed = false;
  };
  std::vector<Doomed> doomed_;
  bool retry_grants_ = true;
  uint64_t grant_retry_ns_ = 0;  // service thread: when to try automatic grants again, 0 = no
  bool taking_back_ = false;  // bb_trainer_close or unlend() is taking every grant back
  std::atomic<uint64_t> revokes_{0}, revokes_acked_{0}, kills_{0}, released_dead_{0};
};

}  // namespace bb::core
