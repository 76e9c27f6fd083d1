// A read-only view of a live hub for the node agent, tracers and tools.
//
// An observer connects to the hub's socket like a task does, but takes no slot: it receives the
// hub segment mapped read-only and may ask the trainer's hub service for a few control actions
// (stop a task). It never writes shared memory and never blocks the trainer.
#pragma once

#include <bubble/bubble.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace bb::core {

struct HubName {
  std::string job;
  uint32_t rank = 0;
};

// Hubs whose sockets exist in runtime_dir ("" = the default directory), live or stale; the
// caller finds out which by opening them. Sorted by (job, rank).
std::vector<HubName> list_hubs(const std::string& runtime_dir);

// The directory hub sockets live in: the option if set, else $BUBBLE_RUNTIME_DIR, else
// $XDG_RUNTIME_DIR/bubble, else /tmp/bubble-<uid>.
std::string default_runtime_dir();

// Path of the hub socket for (job, rank) in runtime_dir ("" = default).
std::string hub_socket_path(const std::string& runtime_dir, const std::string& job,
                            uint32_t rank);

enum class TaskRunState : uint32_t { kIdle = 0, kRunning = 1, kFinished = 2, kFailed = 3 };

struct TaskSnapshot {
  uint32_t slot = 0;
  uint64_t id = 0;          // slot | generation << 32, as bb_task_info_t.id
  int32_t pid = 0;
  int32_t priority = 0;
  uint64_t mem_need = 0;
  uint64_t min_step_ns = 0;
  std::string name;
  TaskRunState state = TaskRunState::kIdle;  // as the task reports it (untrusted, validated)
  bool bad = false;         // the trainer found its slot corrupt
  bool started = false;     // started in the current/last bubble and not yet acked a pause
  uint64_t pause_requested_ns = 0;  // when the trainer asked it to pause (0 = not asked)
  uint64_t pause_acked_ns = 0;      // when it acked that pause (0 = not yet)
  uint64_t steps = 0;
  uint64_t step_ns = 0;             // summed step time
  uint64_t ns_in_bubbles = 0;
  uint64_t ns_outside = 0;
};

struct HubSnapshot {
  std::string job;
  uint32_t rank = 0;
  int32_t trainer_pid = 0;
  uint32_t max_slots = 0;
  bool in_bubble = false;
  uint64_t bubble_seq = 0;
  uint64_t bubble_begin_ns = 0;
  uint64_t bubble_deadline_ns = 0;
  uint64_t bubble_end_ns = 0;           // of the last closed bubble
  uint64_t next_begin_ns = 0;           // when the trainer expects the next bubble; 0 = no idea
  uint64_t free_mem = BB_MEM_UNKNOWN;   // of the current or last bubble
  uint64_t bubbles = 0;
  uint64_t bubble_ns = 0;
  // Step time of every task the hub has had inside its bubbles, from their reports; it counts
  // tasks that have left too (TaskSnapshot's figure goes with its slot).
  uint64_t task_ns_in_bubbles = 0;
  std::vector<TaskSnapshot> tasks;
};

enum class EventType : uint16_t {
  kBubbleBegin = 1,  // ts = begin; a = expected_ns (0 unknown), b = free_mem
  kBubbleEnd = 2,    // ts = end; a = duration_ns
  kTaskStart = 3,    // slot; ts = when the task saw its start (and ran, unless the bubble had
                     // ended by then); a = run epoch, b = start latency ns
  kTaskPause = 4,    // slot; ts = the ack; a = run epoch, b = pause latency ns (0 if it yielded)
  kTaskStep = 5,     // slot; ts = step start; a = duration ns, b = ns of it past the bubble's end
  kTaskAttach = 6,   // slot; a = pid
  kTaskDetach = 7,   // slot; a = pid, b = 1 if it died
  kTaskFinish = 8,   // slot; a = 0 finished / 1 failed
  kGrant = 9,          // slot; a = grant id, b = bytes
  kRevoke = 10,        // slot; a = grant id, b = the deadline to unmap by
  kGrantRelease = 11,  // slot; a = grant id, b = 1 if its holder was killed or died
  kTaskKill = 12,      // slot; a = pid, b = the grant id whose revoke it ignored (0: other)
};

struct Event {
  uint64_t ts_ns = 0;
  EventType type{};
  uint16_t slot = 0;
  uint64_t a = 0;
  uint64_t b = 0;
};

// Where a reader stands in each of the hub's event streams (one per writing thread of the
// trainer, shm/layout.h). Value-initialised: the oldest events still kept.
struct EventCursor {
  uint64_t next[2] = {0, 0};
};

class HubObserver {
 public:
  // Connects to the hub of (job, rank). On failure returns the status and sets *error to one
  // actionable sentence. timeout_ms bounds the connect and the wait for each answer (the
  // open's and every later waited-for request's: see set_async). A request not answered in
  // time returns BB_E_TIMEOUT; its answer, when it comes, is dropped, and until then further
  // requests return BB_E_TIMEOUT at once, so no late answer is taken for another request's.
  static bb_status open(const std::string& runtime_dir, const std::string& job, uint32_t rank,
                        std::unique_ptr<HubObserver>* out, std::string* error,
                        uint32_t timeout_ms = 5000);
  ~HubObserver();
  HubObserver(const HubObserver&) = delete;
  HubObserver& operator=(const HubObserver&) = delete;

  HubSnapshot snapshot() const;
  // Events logged since *cursor; advances *cursor. Returns how many were copied (at most cap).
  // Events overwritten before they were read are skipped, and *lost (may be null) receives
  // their count. Each stream's events come in the order they were logged, the two streams
  // interleaved by the timestamps of their heads. The result is not sorted by time: the
  // service stream is not (a step is stamped at its start, reports arrive up to 10 ms late).
  size_t read_events(EventCursor* cursor, Event* out, size_t cap, uint64_t* lost = nullptr) const;
  // False once the trainer closed the hub or died.
  bool alive() const;
  // A descriptor that becomes readable (EOF/HUP) when the trainer goes away: watch it with
  // poll/epoll/uv_poll instead of polling alive().
  int fd() const;
  // Asks the trainer to stop a task (bb_trainer_stop_task semantics). After set_async() it only
  // sends the request: BB_OK says it was sent, and its outcome comes out of pump().
  bb_status stop_task(uint64_t task_id, std::string* error);

  // For an event loop, which must never wait on a trainer (one stopped at a breakpoint accepts
  // requests and answers none): from now on stop_task and the page lookups of snapshot() only
  // send their request, and answers are read by pump(). A task whose page has not come yet
  // shows without the words read from it (state, started, pause ack). At most a few requests
  // are in flight: past that a page waits for a later snapshot, and a stop is queued (once per
  // task) and sent as answers come.
  void set_async();
  struct StopAnswer {
    uint64_t task_id = 0;
    bb_status status = BB_OK;
    std::string error;  // the trainer's reason when status is not BB_OK
  };
  // Reads the answers that came, without waiting: call it when fd() is readable. Pages are
  // mapped for the next snapshot(); the outcomes of stop requests are appended to *stops (may
  // be null). Returns false once the connection is broken: the trainer went away, or sent
  // something that answers no request.
  bool pump(std::vector<StopAnswer>* stops);

  struct Impl;

 private:
  explicit HubObserver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace bb::core
