// The side-task runtime: attach to a hub, wait for starts (spin briefly, then sleep on the slot's
// doorbell futex), tell the trainer about pauses and steps, and the iterative loop that decides
// whether the next step fits before the bubble's deadline.
#pragma once

#include <bubble/bubble.h>

#include <memory>
#include <string>

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
  bool should_pause() const {
    return ctl_->run_epoch.load(std::memory_order_acquire) != epoch_;
  }
  bb_status ack_pause();
  bb_status report_step(uint64_t step_ns);
  void time_left(uint64_t* left_ns, uint64_t* est_step_ns) const;
  bb_status run(const bb_task_callbacks_t& cbs);

 private:
  Task() = default;
  bb_status connect();        // one attach attempt
  bb_status reattach();       // after the trainer went away, by option
  void release();             // drop the connection and mappings
  bool trainer_gone();        // the connection closed or the hub is closing
  bb_status wait_for_doorbell(uint32_t bell, uint64_t now, uint64_t until);
  void push_report(shm::ReportType type, uint64_t a, uint64_t b);
  bool flush_steps();
  void ack(uint32_t epoch, bool yielded);
  void finish_report(bool failed);

  // Attach parameters, kept for re-attaching.
  std::string job_, name_, dir_;
  uint32_t rank_ = 0;
  bb_task_options_t opts_{};

  shm::Fd sock_;
  shm::Mapping hub_map_, page_map_;
  shm::HubView hub_;
  const shm::SlotCtl* ctl_ = nullptr;
  shm::TaskPage* page_ = nullptr;
  uint32_t slot_ = 0;

  uint32_t epoch_ = 0;          // the epoch we run in; 0 = not running
  shm::Command current_{};      // the START we run under
  uint64_t report_cached_head_ = 0;
  // Steps that found the report ring full, merged into one report sent when room appears, so
  // a task with many short steps loses no time from the statistics.
  shm::Report pending_steps_{};
  uint64_t spin_ns_ = 0;        // adaptive spin before sleeping
  bool stopped_ = false;
  bool finished_ = false;

  // Step-time estimate: a smoothed mean plus twice the smoothed deviation (as TCP estimates
  // round-trip times), so a step starts only when it is likely to fit.
  uint64_t est_mean_ = 0, est_dev_ = 0;
  uint64_t steps_ = 0;
  uint64_t longest_bubble_ns_ = 0;  // the longest recent bubble, decaying slowly
};

}  // namespace bb::core
