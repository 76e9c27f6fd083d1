// bubbled: the node agent. One libuv loop that
//   - serves the control protocol on a Unix socket (control.cc),
//   - watches the hub runtime directory and keeps a read-only observer per live hub (hubs.cc),
//   - launches, places, supervises and re-adopts side tasks (tasks.cc),
//   - enforces pause deadlines (enforcer.h) and serves Prometheus metrics (metrics.cc).
// Idle (no live hub, no task), the loop has no active timer: it only waits on descriptors.
#pragma once

#include "core/observer.h"
#include "daemon/enforcer.h"
#include "daemon/proc.h"
#include "daemon/store.h"
#include "daemon/task.h"

#include <uv.h>

#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace bb::daemon {

// How long after a launched task ended its process group is taken to be going down with it,
// not a new task to adopt.
constexpr int64_t kGroupEndingMs = 60'000;

struct AgentConfig {
  std::string runtime_dir;  // hub sockets
  std::string socket_path;  // control socket
  std::string state_dir;    // database and logs
  int metrics_port = 9477;  // -1 = off, 0 = any free port
  std::set<uint32_t> allow_uids;
  EnforceConfig enforce;
  uint64_t check_interval_ns = 1'000'000;    // enforcement tick while tasks run
  uint64_t sample_interval_ns = 100'000'000;  // event/metrics sampling while hubs live
  uint64_t stop_timeout_ns = 5'000'000'000;   // graceful stop -> SIGTERM -> SIGKILL
  uint32_t trainer_answer_ms = 1000;          // an open's wait for a trainer (see hubs.cc)
  uint32_t max_attempts = 10;                 // launches per task (re-placement included)
  uint32_t keep_ended = 10000;                // ended tasks kept in the records, newest first
  uint64_t log_max_bytes = 64ull << 20;       // output kept per log file of a running task
  std::map<std::string, int> hub_gpu;         // JOB:RANK -> device; default: the rank
  std::string self_exe;                       // for the launch wrapper
  bool verbose = false;
};

class Agent;
struct HubOpen;

// One live (or recently gone) hub.
struct Hub {
  std::string name, job;
  uint32_t rank = 0;
  std::unique_ptr<core::HubObserver> obs;
  uv_poll_t* poll = nullptr;
  bool alive = false;
  bool draining = false;
  core::HubSnapshot snap;
  core::EventCursor cursor;
  std::deque<core::Event> events;  // bounded history for traces and timelines
  uint64_t lost = 0;
  std::map<uint16_t, std::string> slot_names;
  uint64_t rate_bubbles = 0, rate_ns = 0;
  double bubbles_per_sec = 0;
  uint64_t harvested_ns = 0;
  int32_t harvest_pid = 0;     // the trainer whose total harvest_seen is
  uint64_t harvest_seen = 0;   // of snap.task_ns_in_bubbles, counted into harvested_ns
  std::map<uint64_t, EnforceState> enforce;   // hub task id -> escalation state
  std::map<uint64_t, int64_t> task_rows;      // hub task id -> agent task id
  std::map<uint64_t, uint64_t> adopt_after;   // hub task id -> when to try its row again (ms)
  uint64_t gone_ns = 0;  // when its trainer went away (mono_ns), 0 while alive
  // Its first snapshot since it was opened was reconciled: attached rows of this hub it did not
  // show had detached before (while the agent was down, or from an earlier trainer).
  bool reconciled = false;
  // The socket file its observer was opened on (0: unknown), to tell a new trainer's apart.
  uint64_t sock_ino = 0;
};

// A task process the agent supervises (a child, or re-adopted through a pidfd after a restart).
struct LiveTask {
  Agent* agent = nullptr;
  int64_t id = 0;
  uv_process_t* proc = nullptr;
  uv_poll_t* pidfd_poll = nullptr;
  int pidfd = -1;
  uv_timer_t* stop_timer = nullptr;
  int stop_stage = 0;
  // Stops sent through its hub for this stop (one per slot it holds) and how many the trainer
  // refused: SIGTERM comes at once only when every one was.
  int stops_sent = 0, stops_refused = 0;
  bool killed_by_agent = false;
  bool cancel = false;
  bool replace = false;
  bool exited = false;
  bool watch_failed = false;  // pidfd_open failed for a reason other than its exit
};

class Agent {
 public:
  explicit Agent(AgentConfig cfg);
  ~Agent();

  // Opens the database, binds the sockets, scans hubs, re-adopts tasks. "" or an error.
  std::string start(uv_loop_t* loop);
  // Closes every handle; the loop then runs out. Tasks keep running (they are durable).
  void shutdown();

  const AgentConfig& config() const { return cfg_; }
  uint16_t metrics_port() const { return metrics_port_; }

  // --- used by control.cc / metrics.cc
  void refresh_all();
  // Tasks whose pidfd could not be opened (say, out of descriptors): tried again each tick.
  void retry_pidfd_watches();
  std::string submit(const TaskSpec& spec, int64_t* id);
  // "" and *done, or the reason it cannot be done; *not_found tells an unknown id from a task
  // that cannot be cancelled now (already ended, or its trainer refused).
  std::string cancel(int64_t id, std::string* done, bool* not_found);
  std::string drain(const std::string& hub, bool undo, std::string* done);
  std::vector<TaskRow> tasks(bool all) const;
  const TaskRow* task(int64_t id) const;
  const std::map<std::string, std::unique_ptr<Hub>>& hubs() const { return hubs_; }
  bool draining() const { return draining_; }
  Store& store() { return store_; }
  uint64_t granted_on(const std::string& hub) const;
  std::string log_path(int64_t id, bool err) const;
  // Where the kept output of a task's log begins, past what the bound dropped (0: nothing known
  // dropped).
  uint64_t log_kept_from(int64_t id, bool err) const;
  void count_protocol_error() { ++protocol_errors_; }
  void count_refused() { ++refused_clients_; }
  std::string render_metrics();

  // --- hubs.cc
  void scan_hubs();
  void prune_gone_hubs();
  void on_hub_gone(Hub* hub, const char* why);
  void update_timers();

  // --- tasks.cc
  void schedule();
  void on_task_exit(LiveTask* live, ExitStatus status);
  void on_stop_timer(LiveTask* live);

 private:
  friend struct HubCallbacks;
  friend struct TaskCallbacks;

  // hubs.cc
  std::string start_hub_watch();
  // Opens hub (job, rank) on libuv's thread pool (the open waits for its trainer's answer, and
  // a stopped trainer gives none); open_done() takes the result on the loop.
  void try_open_hub(const std::string& job, uint32_t rank);
  // The directory changed: opens hub (job, rank) with a new series of tries, or once more after
  // the open under way.
  void open_hub_afresh(const std::string& job, uint32_t rank);
  void cancel_opens();
  // The hubs listed now, opened in parallel before this returns (at start, before any client
  // is served, so the first request already sees them).
  void open_hubs_now(const std::vector<core::HubName>& hubs);
  void open_done(HubOpen* o);
  void open_failed(const std::string& name, const std::string& error, bb_status st);
  void install_hub(const std::string& job, uint32_t rank, std::unique_ptr<core::HubObserver> obs);
  void arm_open_retry();
  void refresh_hub(Hub* hub, uint64_t now);
  // Reads the hub's answers to the agent's requests; false once its connection is broken.
  bool pump_hub(Hub* hub);
  void reconcile_tasks(Hub* hub);
  void enforce_hub(Hub* hub, uint64_t now);
  void close_hub_handles(Hub* hub);
  // Whether a task seen on a hub but not known to us should be adopted (see hubs.cc).
  bool adoptable(pid_t pid) const;
  int64_t match_task(Hub* hub, const core::TaskSnapshot& t);

  // tasks.cc
  // Loads the records and re-adopts live tasks; "" or why the records cannot be read.
  std::string readopt_tasks();
  // A row the store says was being launched when the agent died (state "launching"): adopts
  // the wrapper if it runs, ends it by its exit file if it ran, else queues it again.
  void settle_launch(TaskRow* row);
  void settle_dead_tasks();
  // Launches the task on hub; "" or why not, with *passing set when trying again later may
  // work (out of descriptors or memory for a moment).
  std::string launch(TaskRow* row, Hub* hub, bool* passing);
  void watch_pidfd(TaskRow* row);
  void start_pidfd_watch(LiveTask* lt, pid_t pid);
  void terminate(TaskRow* row, const std::string& why);
  // The trainer refused to pass on a stop the agent asked of it (the task left its slot, say).
  void on_stop_refused(TaskRow* row, const std::string& why);
  // Kills what is left of a submitted task's process group once its wrapper is gone, and its
  // descendants that left the group.
  void kill_orphans(const TaskRow& row, bool wrapper_died);
  // "BUBBLE_LAUNCH=..." for one launch (attempt) of one task of this state directory: given
  // to the task, it finds the task's descendants wherever they went, and nobody else's.
  std::string launch_mark(int64_t id, uint32_t attempt) const;
  // False only when the process cannot be signalled (EPERM: it runs as another user than the
  // agent's); a process gone, or one the agent never signals, counts as done.
  bool signal_task(const TaskRow& row, int sig);
  // A self-attached task whose pid is a trainer's (it runs on a thread of a trainer process).
  bool in_trainer_process(const TaskRow& row) const;
  // Ends as lost the rows of tasks that attached by themselves to `hub`, unless it is open.
  void end_attached_rows(const std::string& hub, const std::string& why);
  // Continues a task that enforcement stopped, records why, and saves it as running.
  void continue_stopped(TaskRow* row, const std::string& hub, const std::string& why);
  // Enforcement found a task it may not signal (EPERM): says so once, and leaves it alone.
  void unsignalable(TaskRow* row, EnforceState* st, Hub* hub, int32_t pid);
  // Records once-noted enforcement the agent will not carry out: `why` ends the row's message,
  // `detail` the action's reason.
  void note_unenforced(TaskRow* row, const EnforceState& st, Hub* hub, int32_t pid,
                       const std::string& why, const std::string& detail);
  void record(const TaskRow* row, pid_t pid, const std::string& hub, const std::string& action,
              const std::string& detail);
  // Writes the row; a failed write (disk full, the database locked) is logged and tried again
  // every second until it succeeds. False when this write failed.
  bool save(const TaskRow& row);
  // The same for a meta setting (the drains) and an action record.
  bool save_meta(const std::string& key, const std::string& value);
  void save_unsaved();
  void retry_saves_soon();
  void finish_row(TaskRow* row, const std::string& state, const std::string& message);
  // Deletes the oldest ended tasks beyond cfg_.keep_ended (records, actions, logs). Runs from its
  // own timer, never inside a walk over tasks_.
  void prune_history();
  // Deletes log files whose task is not in the records: left by an agent that stopped between
  // deleting old records and their logs. At start only.
  void sweep_logs();
  // Keeps the log files of the tasks the agent launched within cfg_.log_max_bytes (logs.h).
  // Runs every second while any is live, from log_timer_, and for a task as it ends.
  void bound_logs();
  void bound_task_logs(int64_t id);
  void arm_log_timer();
  LiveTask* live(int64_t id);
  void release_live(int64_t id);

  // control.cc / metrics.cc
  std::string start_control();
  std::string start_metrics();

 public:
  // Counters for metrics.
  uint64_t protocol_errors_ = 0, refused_clients_ = 0, submitted_ = 0, launches_ = 0;
  uint64_t pruned_ = 0;  // ended tasks deleted from the records since the agent started
  uint64_t log_bytes_dropped_ = 0;  // task output dropped to keep logs within their bound
  bool logs_unbounded_ = false;     // the state directory's file system cannot punch holes
  std::map<std::pair<int64_t, bool>, uint64_t> log_kept_from_;  // (task, stderr) -> offset
  std::string last_log_bound_error_;  // said once in a row, not every second
  std::map<std::string, uint64_t> ended_by_state_;
  std::map<std::string, uint64_t> actions_by_kind_;
  uint64_t metrics_requests_ = 0;
  std::set<void*> http_conns_;  // open metrics connections (metrics.cc)
  uv_loop_t* loop_ = nullptr;
  std::set<void*> clients_;  // open control connections (control.cc)
  // Connections with complete requests left for a later loop turn, in the order they were
  // left: one client's pipelined requests are answered a batch per turn, and all clients
  // together a bounded number per turn, between everything else the loop does (control.cc).
  std::deque<void*> backlog_;
  uv_idle_t* backlog_idle_ = nullptr;
  uv_check_t* turn_check_ = nullptr;  // ends a loop turn's request budget
  size_t frames_this_turn_ = 0;       // requests answered since the last poll for I/O
  size_t frames_most_per_turn_ = 0;   // the most of them one turn answered (metrics)

 private:
  AgentConfig cfg_;
  Store store_;
  int lock_fd_ = -1;
  std::string state_dir_id_;  // the state directory's device and inode, for launch marks
  bool draining_ = false;
  std::set<std::string> drained_hubs_;  // `drain --hub`: kept in meta across restarts
  bool closing_ = false;
  uint16_t metrics_port_ = 0;

  std::map<int64_t, TaskRow> tasks_;
  std::map<int64_t, std::unique_ptr<LiveTask>> live_;
  std::map<std::string, std::unique_ptr<Hub>> hubs_;
  // Hubs whose open is under way on the thread pool, and those to try once more if it fails
  // (the directory changed meanwhile).
  std::map<std::string, HubOpen*> opening_;
  std::set<std::string> open_again_;
  // Hubs whose open failed, waiting for their next try: the rounds made so far and when the
  // next is due (uv_now ms; UINT64_MAX while a try is under way).
  struct OpenRetry {
    int round = 0;
    uint64_t due_ms = 0;
    bool hung = false;  // said once: its trainer listens but does not answer; tried slowly
  };
  std::map<std::string, OpenRetry> retry_hubs_;
  std::vector<int64_t> pending_dead_;

  uv_pipe_t* control_ = nullptr;
  uv_tcp_t* metrics_ = nullptr;
  uv_fs_event_t* dir_watch_ = nullptr;
  uv_timer_t* tick_ = nullptr;
  uint64_t tick_interval_ = 0;
  uv_timer_t* retry_timer_ = nullptr;
  uv_timer_t* prune_timer_ = nullptr;
  uv_timer_t* log_timer_ = nullptr;
  uv_timer_t* relaunch_timer_ = nullptr;  // placement again after a passing launch failure
  uv_timer_t* save_timer_ = nullptr;      // rows whose save failed, tried again
  std::set<int64_t> unsaved_;             // ids of rows the database is behind on
  std::map<std::string, std::string> unsaved_meta_;  // settings it is behind on
  std::deque<ActionRow> unsaved_actions_;            // actions it is behind on, oldest first
  uint64_t unsaved_actions_dropped_ = 0;             // ... and those past the bound
  uint32_t actions_since_trim_ = 0;
  // Process groups of launched tasks that ended less than a minute ago and whose rows were
  // deleted: adoptable() must still know them (pgid -> ended_at, Unix ms).
  std::map<pid_t, int64_t> recent_groups_;
  bool earlier_boot_ = false;           // the rows were written before the node restarted
  bool settling_earlier_boot_ = false;  // settle_dead_tasks is ending those rows
  std::string boot_to_record_;          // this boot's id, stored once the old rows are settled
  uint64_t last_placement_ns_ = 0;  // when refresh_all last looked for queued tasks
};

// A timer allocated with new, initialised on loop, carrying data; freed with close_and_delete.
inline uv_timer_t* new_timer(uv_loop_t* loop, void* data) {
  auto* t = new uv_timer_t;
  uv_timer_init(loop, t);
  t->data = data;
  return t;
}

// Closes a uv handle allocated with new and deletes it once libuv is done with it.
template <typename T>
void close_and_delete(T* h) {
  if (!h) return;
  uv_close(reinterpret_cast<uv_handle_t*>(h),
           [](uv_handle_t* x) { delete reinterpret_cast<T*>(x); });
}

uint64_t mono_ns();
void agent_log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace bb::daemon
