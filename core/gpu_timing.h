// GPU-timed bubbles: bubble marks recorded as CUDA events on the trainer's stream.
//
// A training loop that enqueues work asynchronously reaches bb_bubble_begin long before the GPU
// reaches the idle time it means: the host clock says "now", the device is still busy with the
// kernels queued before. StreamTiming records an event on the trainer's stream instead (one
// cuEventRecord: no synchronization, no wait) and a watcher thread of the trainer process turns
// each mark into a bubble begin or end once the GPU has reached it (cuEventQuery). Side tasks are
// then started and paused on the device's timeline.
//
// Latency this adds to the device timeline: the watcher's poll interval (poll_ns, default 10 us)
// plus one cuEventQuery (about a microsecond), on top of the usual signal path. Why a poll: the
// driver offers no callback into a waiting host thread that does not itself occupy the stream
// (cuLaunchHostFunc runs in the stream and would delay the trainer's next kernel by the
// callback's duration; cuEventSynchronize blocks one host thread per mark). Between marks the
// watcher sleeps on a futex and costs nothing.
//
// The events are created interprocess (CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) so that
// another process (the agent, a tool, a side task) can open a mark's event with
// cuIpcOpenEventHandle and query or wait on it itself.
#pragma once

#include <bubble/bubble.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace bb::core {

struct StreamTimingOptions {
  int device = -1;          // -1: the device of the calling thread's current context, else 0
  uint32_t marks = 64;      // marks in flight (recorded, not yet reached by the GPU); 2..4096
  uint64_t poll_ns = 10000; // watcher's poll interval while a mark is pending
};

struct StreamTimingStats {
  uint64_t marks = 0;          // recorded
  uint64_t begins = 0;         // bubble begins applied when the GPU reached them
  uint64_t ends = 0;
  uint64_t dropped = 0;        // marks refused because `marks` were already in flight
  uint64_t query_errors = 0;   // marks given up because cuEventQuery failed
  uint64_t lag_last_ns = 0;    // record (host) -> GPU reached it (seen by the watcher)
  uint64_t lag_max_ns = 0;
  uint64_t lag_sum_ns = 0;
};

// CUDA types stay inside gpu_timing.cc: streams travel as void* (a CUstream), IPC handles as
// their 64 bytes, so that callers need no CUDA header.
class StreamTiming {
 public:
  // What the watcher does when the GPU reaches a mark (on the watcher thread).
  struct Sink {
    std::function<void(uint64_t expected_ns, uint64_t free_mem, bb_bubble_kind kind)> begin;
    std::function<void()> end;
    std::function<void()> iteration;  // a new training iteration starts (bb_trainer_iteration)
  };

  // Loads the CUDA driver (cuda_driver()), creates the events on the device's primary context
  // and starts the watcher. BB_E_UNSUPPORTED without a usable driver.
  static bb_status open(const StreamTimingOptions& opts, Sink sink,
                        std::unique_ptr<StreamTiming>* out, std::string* error);
  // Stops the watcher (a bubble it opened is ended) and destroys the events.
  virtual ~StreamTiming() = default;

  // The training thread's calls: one cuEventRecord and a ring push, at most one futex wake;
  // bounded time, no allocation, on the error paths too: a failure's sentence goes to the
  // thread's last error (core::fail). Call them from one thread at a time, with the stream's
  // context current. *mark (may be null) receives the mark's number. BB_E_FULL when `marks`
  // are already in flight.
  virtual bb_status mark_begin(void* stream, uint64_t expected_ns, uint64_t free_mem,
                               bb_bubble_kind kind, uint64_t* mark) = 0;
  virtual bb_status mark_end(void* stream, uint64_t* mark) = 0;
  // A training iteration starts when the GPU gets here (the watcher is the bubble thread, so it
  // is the one to number bubbles from here on).
  virtual bb_status mark_iteration(void* stream, uint64_t* mark) = 0;

  // The CUipcEventHandle of the event that carries mark number `mark`; valid while that mark is
  // one of the last `marks` recorded (the event is reused after that).
  virtual bb_status ipc_handle(uint64_t mark, unsigned char out[64], std::string* error) const = 0;

  virtual StreamTimingStats stats() const = 0;
};

}  // namespace bb::core
