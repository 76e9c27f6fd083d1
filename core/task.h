// The side-task runtime: attach to a hub, wait for starts (spin on the slot's doorbell, then sleep
// on the wake word of the task's own page), tell the trainer about pauses and steps, and the iterative loop that decides
// whether the next step fits before the bubble's deadline. It also maps the memory grant the
// trainer offers and unmaps it when the trainer revokes it, at points where the task is known
// not to be using it (see bubble.h, "Memory grants").
#pragma once

#include <bubble/bubble.h>

#include <memory>
#include <string>

#include "core/estimate.h"
#include "core/grant.h"
#include "core/wake.h"
#include "shm/layout.h"
#include "shm/segment.h"

namespace bb::core {

class Task {
 public:
  static bb_status attach(const char* job_id, uint32_t rank, const char* name,
                          const bb_task_options_t& opts, std::unique_ptr<Task>* out);
  ~Task();
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;

  bb_status wait_start(int64_t timeout_ns, bb_start_info_t* out);
  // A task holding a grant also pauses when the grant words change (a revoke): the load is of
  // the same cache line as run_epoch.
  bool should_pause() const {
    if (trainer_lost_ || ctl_->run_epoch.load(std::memory_order_acquire) != epoch_ ||
        trainer_died() ||
        (grant_id_ != 0 && ctl_->grant_change.load(std::memory_order_relaxed) != grant_seen_))
      return true;
    // A trainer the kernel could not mark (its death still being dumped, or a kernel that
    // lost its robust list) is noticed from the connection: every 64th call reads the clock,
    // and at most every 100 ms looks (check_trainer_while_running).
    if ((++pause_polls_ & 63) != 0) return false;
    check_trainer_while_running();
    return trainer_lost_;
  }
  bb_status ack_pause();
  bb_status report_step(uint64_t step_ns);
  void time_left(uint64_t* left_ns, uint64_t* est_step_ns) const;
  bb_status run(const bb_task_callbacks_t& cbs);
  // Inside run(), callbacks included: the C ABI refuses the calls that would pull the run's
  // state from under it (wait, acks, a nested run, detach).
  bool in_run() const { return in_run_; }
  bb_status grant(bb_task_grant_t* out);
  bb_status ack_revoke();

 private:
  Task() = default;
  // One attach attempt; a trainer that does not answer is given 5 s, or until deadline_ns if
  // that comes sooner (at least 1 ms).
  bb_status connect(uint64_t deadline_ns = UINT64_MAX);
  // After the trainer went away, by option. Waits at most until wait_until (then BB_E_TIMEOUT;
  // the next call goes on toward the same reattach deadline).
  bb_status reattach(uint64_t wait_until = UINT64_MAX);
  void release();             // drop the connection and mappings
  bool trainer_gone() const;  // the connection closed or the hub is closing
  // One load, no system call: the futex word of the mutex the trainer's hub service holds for
  // its life (shm::HubStats::alive_mutex) says the trainer died (or closed the hub).
  bool trainer_died() const {
    if (!alive_word_) return false;
    const uint32_t w = __atomic_load_n(alive_word_, __ATOMIC_RELAXED);
    return w == 0 || (w & shm::kFutexOwnerDied) != 0;
  }
  // While running: a trainer that dies mid-bubble never clears run_epoch. Where the kernel did
  // not mark its death (trainer_died()), the calls a running task makes anyway (report_step,
  // time_left, every 64th should_pause; every step of bb_task_run) look at the connection every
  // 100 ms and make should_pause() true once it is gone.
  void check_trainer_while_running() const;
  // Waits for the doorbell to move from `bell`; *seen_ns is when it saw it move, from a clock
  // read the wait made anyway (0 when it did not see it, or has no such read).
  bb_status wait_for_doorbell(uint32_t bell, uint64_t now, uint64_t until, uint64_t* seen_ns);
  // Keeps the STARTED report of run `epoch` (its block is the slot's current start) for the
  // next report; seen_ns as wait_for_doorbell gave it.
  void stamp_started(uint32_t epoch, uint64_t seen_ns);
  void push_report(shm::ReportType type, uint64_t a, uint64_t b, uint64_t ts = 0);
  bool flush_steps(uint32_t keep_free);
  void ack(uint32_t epoch, bool yielded);
  void finish_report(bool failed);
  // Grants: apply what the trainer's grant words say (unmap a revoked grant, map an offered one).
  enum GrantSync : unsigned { kUnmap = 1, kMap = 2 };
  bb_status sync_grant(unsigned what);
  bb_status map_offered(const shm::GrantRecord& rec);
  bb_status take_grant_fd(uint64_t id, shm::Fd* out);
  bb_status drop_grant();
  void give_back(uint64_t id);
  void fill_grant(uint64_t* id, void** ptr, uint64_t* bytes) const;

  // Attach parameters, kept for re-attaching.
  std::string job_, name_, dir_;
  uint32_t rank_ = 0;
  bb_task_options_t opts_{};

  shm::Fd sock_;
  shm::Mapping hub_map_, page_map_;
  shm::HubView hub_;
  const shm::SlotCtl* ctl_ = nullptr;
  const uint32_t* alive_word_ = nullptr;  // see trainer_died(); null where the hub has none
  shm::TaskPage* page_ = nullptr;
  uint32_t slot_ = 0;
  uint32_t generation_ = 0;  // of our attach to the slot
  // The trainer no longer has us in our slot (it reclaimed it, maybe for another task): read off
  // the start path, where the slot's second line costs nothing extra.
  bool slot_lost() const {
    return ctl_->generation.load(std::memory_order_relaxed) != generation_ ||
           ctl_->state.load(std::memory_order_acquire) != uint32_t(shm::SlotState::kActive);
  }
  // The same, on the signal line a waiting task reads anyway: whether the slot is another's now.
  bool slot_reused() const {
    return ctl_->signal_generation.load(std::memory_order_relaxed) != generation_;
  }
  // The trainer is gone for us (it closed or exited, or dropped us from our slot): re-attaches
  // (BB_ON_TRAINER_EXIT_WAIT) or says which of the two it was.
  bb_status lose_trainer(uint64_t wait_until);

  uint32_t epoch_ = 0;          // the epoch we run in; 0 = not running
  // The start we run under, as the slot's start block gave it.
  struct Start {
    uint32_t epoch = 0;
    uint32_t kind = 0;
    uint64_t bubble_seq = 0;
    uint64_t begin_ns = 0;
    uint64_t deadline_ns = 0;
    uint64_t free_mem = 0;
    uint64_t grant_id = 0;
  };
  Start current_{};
  uint64_t report_cached_head_ = 0;
  // Steps that found the report ring full, merged into one report sent when room appears, so
  // a task with many short steps loses no time from the statistics.
  shm::Report pending_steps_{};
  shm::Report started_report_{};  // count 0: none waiting to be pushed
  uint64_t spin_ns_ = 0;        // adaptive spin before sleeping
  uint64_t stale_slice_ns_ = kFirstStaleSliceNs;  // predictive wake: see wait_for_doorbell
  uint64_t late_window_ns_ = 0;  // predictive wake: spin this long past the predicted begin
  mutable bool trainer_lost_ = false;           // see check_trainer_while_running
  mutable uint32_t pause_polls_ = 0;            // should_pause calls, for its backstop
  mutable uint64_t next_liveness_check_ns_ = 0;
  // When a sleep a signal interrupted next looks at the trainer (wait_for_doorbell).
  uint64_t next_wait_look_ns_ = 0;
  bool missed_window_ = false;   // the last spin window ended before the bubble began
  static constexpr uint64_t kFirstStaleSliceNs = 1'000'000;
  bool stopped_ = false;
  bool in_run_ = false;
  bool finished_ = false;

  // Step time (bound(): a step starts only when it is likely to fit) and how late a predictive
  // sleep ends past the time asked for (timer slack, the wake-up of an idle CPU): the task ends
  // its sleeps that much earlier (the mean), so it is spinning when the predicted bubble begins.
  SmoothedEstimate step_est_, sleep_late_;
  uint64_t longest_room_ns_ = 0;  // the most room a recent bubble left the task, decaying slowly
  // Bubbles without a step to wait before the estimate is lowered again, and the current gap:
  // it doubles with each step that spills past its bubble, and a step that fits resets it.
  static constexpr uint32_t kFirstProbeGap = 8, kMaxProbeGap = 1024;
  uint32_t probe_wait_ = 0, probe_gap_ = 0;
  uint64_t reattach_until_ = 0;     // while re-attaching: when to give up (0: not re-attaching)

  // The mapped grant (grant_id_ != 0) and the trainer's grant words last applied.
  std::unique_ptr<GrantMapping> mapping_;
  uint64_t grant_id_ = 0;
  GrantBackend grant_backend_ = GrantBackend::kNone;
  uint32_t grant_seen_ = 0;
  bool grant_synced_ = false;      // grant_seen_ holds a value read from the slot
  uint64_t grant_refused_ = 0;     // a grant we could not map and gave back: not retried
  uint64_t unmap_failed_ = 0;      // a grant whose unmap failed: never given back
  // A grant descriptor received ahead of its record (the trainer sends it first).
  shm::Fd pending_fd_;
  uint64_t pending_fd_id_ = 0;
};

}  // namespace bb::core
