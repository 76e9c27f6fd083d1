// The trainer side of a hub: owns the segment, the socket and the task slots; reports bubbles.
//
// Two threads touch it:
//   - the bubble thread (the caller of begin/end/iteration): bounded-time, no locks, no
//     allocation; it reads trainer-private state and task pages it has not yet let go of;
//   - the hub service thread: accepts attaches, watches each task's connection and pidfd,
//     drains task reports into statistics and the event log, and frees dead slots once the bubble
//     thread has acknowledged them (so a task page is never unmapped under the bubble thread).
#pragma once

#include <bubble/bubble.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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

  // Any thread.
  void stats(bb_trainer_stats_t* out);
  bb_status tasks(bb_task_info_t* out, size_t cap, size_t* count);
  bb_status stop_task(uint64_t task_id);

  struct Slot;
  struct Conn;

 private:
  Trainer() = default;
  bb_status init(const char* job_id, uint32_t rank, const bb_trainer_options_t& opts);
  void shutdown();

  // Bubble thread helpers.
  void refresh_slots();
  void end_locked(uint64_t now);
  bool task_ready(uint32_t i);
  void mark_bad(uint32_t i);

  // Service thread.
  void serve();
  void accept_all();
  void handle_hello(Conn& c);
  void attach_task(Conn& c, const void* msg);
  void handle_observer_request(Conn& c);
  void reclaim(uint32_t slot, bool died);
  void drain_reports();
  void free_released();
  void publish_change() { slots_changed_.fetch_add(1, std::memory_order_seq_cst); }

  std::string job_;
  uint32_t rank_ = 0;
  bb_trainer_options_t opts_{};
  std::string socket_path_, lock_path_;
  shm::Fd lock_fd_, listen_fd_, hub_fd_, wake_fd_;
  shm::Mapping hub_map_;
  shm::HubView hub_;

  std::unique_ptr<Slot[]> slots_;
  std::atomic<uint64_t> slots_changed_{0};

  // Bubble thread only.
  Candidate cands_[BB_MAX_SLOTS_LIMIT];
  uint32_t span_ = 0;  // one past the highest slot that may be active
  uint64_t seen_changes_ = 0;
  uint32_t rr_cursor_ = 0;
  uint32_t running_[BB_MAX_SLOTS_LIMIT];
  uint32_t running_gen_[BB_MAX_SLOTS_LIMIT];
  uint32_t n_running_ = 0;
  bool open_ = false;
  uint64_t begin_ns_ = 0;
  bb_bubble_kind kind_ = BB_BUBBLE_OTHER;
  BubblePredictor predictor_;      // bubble lengths
  BubblePredictor gap_predictor_;  // time from a bubble's end to the next one's begin
  uint64_t last_end_ns_ = 0;

  // Written by the bubble thread, read by anyone.
  std::atomic<uint64_t> starts_{0}, pauses_{0}, wakes_{0};

  // Service thread state and the statistics it keeps (stats() reads them under the mutex).
  std::thread service_;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::mutex stats_mu_;
  LatencyHistogram start_latency_, pause_latency_;
};

}  // namespace bb::core
