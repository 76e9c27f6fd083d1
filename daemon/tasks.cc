// The task side of the agent: submissions, placement, launch with the task's environment, exit
// supervision (children through libuv, re-adopted processes through a pidfd), graceful stop and
// re-placement, and re-adoption after a restart.
#include "daemon/agent.h"
#include "daemon/logs.h"
#include "daemon/placement.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

extern char** environ;

namespace bb::daemon {

struct TaskCallbacks {
  static void on_exit(uv_process_t* p, int64_t exit_status, int term_signal) {
    auto* lt = static_cast<LiveTask*>(p->data);
    ExitStatus st;
    st.known = true;
    st.code = static_cast<int>(exit_status);
    st.signal = term_signal;
    if (term_signal) st.code = 128 + term_signal;
    lt->agent->on_task_exit(lt, st);
  }
  static void on_pidfd(uv_poll_t* p, int, int) {
    auto* lt = static_cast<LiveTask*>(p->data);
    ExitStatus st;  // not our child: only the launch wrapper's exit file knows the status
    lt->agent->on_task_exit(lt, st);
  }
  static void on_stop_timer(uv_timer_t* t) {
    auto* lt = static_cast<LiveTask*>(t->data);
    lt->agent->on_stop_timer(lt);
  }
  static void on_prune_timer(uv_timer_t* t) { static_cast<Agent*>(t->data)->prune_history(); }
  static void on_log_timer(uv_timer_t* t) { static_cast<Agent*>(t->data)->bound_logs(); }
  static void on_relaunch_timer(uv_timer_t* t) { static_cast<Agent*>(t->data)->schedule(); }
  static void on_save_timer(uv_timer_t* t) { static_cast<Agent*>(t->data)->save_unsaved(); }
};

// How often the logs of live tasks are checked against --log-max-bytes.
constexpr uint64_t kLogBoundIntervalMs = 1000;
// How soon a task whose launch failed for a passing reason (descriptors short) is placed again.
constexpr uint64_t kRelaunchDelayMs = 1000;
// How soon the rows whose save failed are written again.
constexpr uint64_t kSaveRetryMs = 1000;
// What a drain's reply adds when the database refused to keep it.
constexpr const char* kNotSavedYet =
    " (not saved yet: the database refused the write, and the agent tries again every second; "
    "an agent restarted before it succeeds forgets this)";
// Action records kept for the database while it refuses writes.
constexpr size_t kMaxUnsavedActions = 10000;

LiveTask* Agent::live(int64_t id) {
  auto it = live_.find(id);
  return it == live_.end() ? nullptr : it->second.get();
}

void Agent::release_live(int64_t id) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  LiveTask* lt = it->second.get();
  if (lt->proc) close_and_delete(lt->proc);
  if (lt->pidfd_poll) {
    uv_poll_stop(lt->pidfd_poll);
    close_and_delete(lt->pidfd_poll);
  }
  if (lt->pidfd >= 0) close(lt->pidfd);
  if (lt->stop_timer) {
    uv_timer_stop(lt->stop_timer);
    close_and_delete(lt->stop_timer);
  }
  live_.erase(it);
}

bool Agent::save(const TaskRow& row) {
  if (store_.update_task(row)) {
    unsaved_.erase(row.id);
    return true;
  }
  agent_log("cannot save task #%lld: %s (trying again every second)",
            static_cast<long long>(row.id), store_.last_error().c_str());
  unsaved_.insert(row.id);
  retry_saves_soon();
  return false;
}

bool Agent::save_meta(const std::string& key, const std::string& value) {
  if (store_.set_meta(key, value)) {
    unsaved_meta_.erase(key);
    return true;
  }
  agent_log("cannot save the setting %s: %s (trying again every second)", key.c_str(),
            store_.last_error().c_str());
  unsaved_meta_[key] = value;  // the newest value is the one owed
  retry_saves_soon();
  return false;
}

void Agent::retry_saves_soon() {
  if (save_timer_ && !closing_ && !uv_is_active(reinterpret_cast<uv_handle_t*>(save_timer_)))
    uv_timer_start(save_timer_, TaskCallbacks::on_save_timer, kSaveRetryMs, 0);
}

void Agent::save_unsaved() {
  // Settings first (a drain must outlive a restart), then actions in their order, then rows.
  for (auto it = unsaved_meta_.begin(); it != unsaved_meta_.end();) {
    if (!store_.set_meta(it->first, it->second)) return retry_saves_soon();
    agent_log("saved the setting %s a failed write had left behind", it->first.c_str());
    it = unsaved_meta_.erase(it);
  }
  size_t actions = 0;
  while (!unsaved_actions_.empty()) {
    if (!store_.insert_action(unsaved_actions_.front())) return retry_saves_soon();
    unsaved_actions_.pop_front();
    ++actions;
  }
  if (actions) agent_log("saved %zu action records a failed write had left behind", actions);
  const std::set<int64_t> ids = std::move(unsaved_);
  unsaved_.clear();
  size_t saved = 0;
  for (int64_t id : ids) {
    auto it = tasks_.find(id);
    if (it == tasks_.end()) continue;  // deleted meanwhile
    if (!store_.update_task(it->second)) {
      unsaved_.insert(ids.begin(), ids.end());  // all still owed; one try a second
      return retry_saves_soon();
    }
    // The exit file its end was read from was kept for this write (on_task_exit).
    const std::string& state = it->second.state;
    if (state_is_final(state) || state == "queued")
      unlink((cfg_.state_dir + "/run/" + std::to_string(id) + ".exit").c_str());
    ++saved;
  }
  if (saved) agent_log("saved %zu task records a failed write had left behind", saved);
}

void Agent::record(const TaskRow* row, pid_t pid, const std::string& hub,
                   const std::string& action, const std::string& detail) {
  ActionRow a;
  a.at_ms = wall_ms();
  a.task = row ? row->id : 0;
  a.pid = pid;
  a.hub = hub;
  a.action = action;
  a.detail = detail;
  ++actions_by_kind_[action];
  // Behind ones go first, so that actions stay in order.
  if (!unsaved_actions_.empty() || !store_.insert_action(a)) {
    if (unsaved_actions_.empty())
      agent_log("cannot record an action: %s (trying again every second)",
                store_.last_error().c_str());
    // A task misbehaving without end while the database refuses writes: the oldest owed go.
    if (unsaved_actions_.size() >= kMaxUnsavedActions) {
      unsaved_actions_.pop_front();
      if (unsaved_actions_dropped_++ == 0)
        agent_log("more than %zu action records are owed to the database: the oldest are "
                  "dropped (they stay in the log)", kMaxUnsavedActions);
    }
    unsaved_actions_.push_back(std::move(a));
    retry_saves_soon();
  }
  // A task that keeps misbehaving without ever ending adds actions without end: trim them now
  // and then, not only when old tasks go.
  if (++actions_since_trim_ >= 1000 && store_.trim_actions()) actions_since_trim_ = 0;
  agent_log("%s task #%lld (pid %d) on %s: %s", action.c_str(),
            static_cast<long long>(a.task), pid, hub.c_str(), detail.c_str());
}

void Agent::finish_row(TaskRow* row, const std::string& state, const std::string& message) {
  // What it wrote since the last check is held to the bound too.
  if (row->origin != "attached" && !logs_unbounded_) bound_task_logs(row->id);
  row->state = state;
  row->message = message;
  row->ended_at = wall_ms();
  ++ended_by_state_[state];
  save(*row);
  agent_log("task #%lld %s: %s", static_cast<long long>(row->id), state.c_str(),
            message.c_str());
  // The caller may be walking tasks_: the oldest records go from a timer, right after.
  if (prune_timer_ && !closing_ && !uv_is_active(reinterpret_cast<uv_handle_t*>(prune_timer_)))
    uv_timer_start(prune_timer_, TaskCallbacks::on_prune_timer, 0, 0);
}

void Agent::sweep_logs() {
  const std::string dir = cfg_.state_dir + "/logs";
  DIR* d = opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> orphans;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const long long id = strtoll(e->d_name, &end, 10);
    if (end == e->d_name || id <= 0 || (strcmp(end, ".out") != 0 && strcmp(end, ".err") != 0))
      continue;  // not a task's log
    if (!tasks_.count(id)) orphans.push_back(dir + "/" + e->d_name);
  }
  closedir(d);
  for (const std::string& f : orphans) unlink(f.c_str());
  if (!orphans.empty())
    agent_log("deleted %zu log files of tasks no longer in the records", orphans.size());
}

void Agent::prune_history() {
  std::vector<std::pair<int64_t, int64_t>> ended;  // (ended_at, id)
  for (const auto& [id, row] : tasks_)
    if (state_is_final(row.state) && !live(id)) ended.emplace_back(row.ended_at, id);
  if (ended.size() <= cfg_.keep_ended) return;
  const size_t drop = ended.size() - cfg_.keep_ended;
  std::nth_element(ended.begin(), ended.begin() + static_cast<ptrdiff_t>(drop - 1), ended.end());
  std::vector<int64_t> ids;
  for (size_t i = 0; i < drop; ++i) ids.push_back(ended[i].second);
  if (!store_.delete_tasks(ids)) {
    // Kept in memory too, so the records and what the agent shows stay the same; tried again
    // when the next task ends.
    agent_log("cannot delete %zu old task records: %s (check the disk holding %s)", ids.size(),
              store_.last_error().c_str(), cfg_.state_dir.c_str());
    return;
  }
  const int64_t now = wall_ms();
  for (auto it = recent_groups_.begin(); it != recent_groups_.end();)
    it = now - it->second >= kGroupEndingMs ? recent_groups_.erase(it) : std::next(it);
  for (int64_t id : ids) {
    const TaskRow& row = tasks_.at(id);
    if (row.origin != "attached" && row.pid > 0 && now - row.ended_at < kGroupEndingMs)
      recent_groups_[row.pid] = row.ended_at;
    tasks_.erase(id);
    unlink(log_path(id, false).c_str());
    unlink(log_path(id, true).c_str());
    log_kept_from_.erase({id, false});
    log_kept_from_.erase({id, true});
  }
  pruned_ += ids.size();
  if (cfg_.verbose)
    agent_log("deleted the records and logs of %zu ended tasks beyond the newest %u", ids.size(),
              cfg_.keep_ended);
}

void Agent::arm_log_timer() {
  if (log_timer_ && !closing_ && !logs_unbounded_ &&
      !uv_is_active(reinterpret_cast<uv_handle_t*>(log_timer_)))
    uv_timer_start(log_timer_, TaskCallbacks::on_log_timer, kLogBoundIntervalMs,
                   kLogBoundIntervalMs);
}

void Agent::bound_task_logs(int64_t id) {
  for (bool err : {false, true}) {
    std::string why;
    const LogBound b = bound_log(log_path(id, err), cfg_.log_max_bytes,
                                 &log_kept_from_[{id, err}], &why);
    log_bytes_dropped_ += static_cast<uint64_t>(b.dropped);
    if (!b.failed) continue;
    if (why != last_log_bound_error_) agent_log("%s", why.c_str());  // not every second
    last_log_bound_error_ = why;
    if (b.unsupported) {
      // No log in the state directory can be bounded: stop trying.
      logs_unbounded_ = true;
      if (log_timer_) uv_timer_stop(log_timer_);
      return;
    }
  }
}

void Agent::bound_logs() {
  bool any = false;
  for (const auto& [id, lt] : live_) {
    const TaskRow* row = task(id);
    if (!row || row->origin == "attached") continue;  // its output is not the agent's
    any = true;
    bound_task_logs(id);
    if (logs_unbounded_) return;
  }
  if (!any) uv_timer_stop(log_timer_);  // armed again by the next launch
}

uint64_t Agent::log_kept_from(int64_t id, bool err) const {
  auto it = log_kept_from_.find({id, err});
  return it == log_kept_from_.end() ? 0 : it->second;
}

namespace {
// Why a task being stopped is placed again, from the message its stop wrote ("stopping: its hub
// is draining" or "... went away", kept across agent restarts); "" if it does not say.
std::string replace_reason(const TaskRow& row) {
  if (row.message.find("draining") != std::string::npos) return "hub " + row.hub + " drained";
  if (row.message.find("went away") != std::string::npos) return "hub " + row.hub + " went away";
  return "";
}
}  // namespace

std::string Agent::log_path(int64_t id, bool err) const {
  return cfg_.state_dir + "/logs/" + std::to_string(id) + (err ? ".err" : ".out");
}

uint64_t Agent::granted_on(const std::string& hub) const {
  uint64_t sum = 0;
  for (const auto& [id, row] : tasks_) {
    if (row.hub == hub && !state_is_final(row.state) && row.state != "queued") {
      sum = add_sat(sum, row.spec.mem_need);
    }
  }
  return sum;
}

std::string Agent::submit(const TaskSpec& spec, int64_t* id) {
  TaskRow row;
  row.spec = spec;
  row.state = "queued";
  row.submitted_at = wall_ms();
  row.message = "waiting for placement";
  if (!store_.insert_task(&row)) {
    return "cannot record the submission: " + store_.last_error() +
           " (check the disk holding " + cfg_.state_dir + ")";
  }
  *id = row.id;
  tasks_[row.id] = row;
  ++submitted_;
  agent_log("task #%lld %s submitted", static_cast<long long>(row.id), spec.name.c_str());
  schedule();
  update_timers();
  return "";
}

void Agent::schedule() {
  if (closing_) return;
  std::vector<TaskRow*> queue;
  for (auto& [id, row] : tasks_) {
    if (row.state == "queued") queue.push_back(&row);
  }
  if (queue.empty()) return;
  std::stable_sort(queue.begin(), queue.end(), [](const TaskRow* a, const TaskRow* b) {
    return a->spec.priority > b->spec.priority;
  });
  std::vector<HubCandidate> cands;
  std::vector<Hub*> hubs;
  for (auto& [name, hub] : hubs_) {
    HubCandidate c;
    c.name = name;
    c.alive = hub->alive;
    c.draining = hub->draining;
    c.had_bubble = hub->snap.bubbles > 0 || hub->snap.in_bubble;
    c.free_mem = hub->snap.free_mem;
    c.granted = granted_on(name);
    uint32_t placed = 0;
    for (const auto& [id, row] : tasks_) {
      if (row.hub == name && !state_is_final(row.state) && row.state != "queued") ++placed;
    }
    c.tasks = std::max<uint32_t>(placed, static_cast<uint32_t>(hub->snap.tasks.size()));
    c.free_slots = hub->snap.max_slots > c.tasks ? hub->snap.max_slots - c.tasks : 0;
    cands.push_back(c);
    hubs.push_back(hub.get());
  }
  for (TaskRow* row : queue) {
    if (draining_) {
      if (row->message != "the agent is draining: run `bubblectl undrain` to launch tasks") {
        row->message = "the agent is draining: run `bubblectl undrain` to launch tasks";
      }
      continue;
    }
    PlaceResult pr = place_task(row->spec, cands);
    if (pr.hub < 0) {
      row->message = (row->requeue_note.empty() ? "queued: "
                                                : "re-placing (" + row->requeue_note + "): ") +
                     pr.reason;
      continue;
    }
    Hub* hub = hubs[static_cast<size_t>(pr.hub)];
    bool passing = false;
    std::string err = launch(row, hub, &passing);
    if (!err.empty() && passing) {
      // Out of descriptors or memory for a moment: the task stays queued, placed again soon.
      const std::string why = "queued: " + err + " (tried again in a second)";
      if (row->message != why)  // once, not at every try
        agent_log("task #%lld not launched yet: %s", static_cast<long long>(row->id), err.c_str());
      row->message = why;
      if (relaunch_timer_ && !uv_is_active(reinterpret_cast<uv_handle_t*>(relaunch_timer_)))
        uv_timer_start(relaunch_timer_, TaskCallbacks::on_relaunch_timer, kRelaunchDelayMs, 0);
      continue;
    }
    if (!err.empty()) {
      row->exit_code = 127;
      finish_row(row, "failed", err);
      continue;
    }
    HubCandidate& c = cands[static_cast<size_t>(pr.hub)];
    c.granted = add_sat(c.granted, row->spec.mem_need);
    c.tasks += 1;
    if (c.free_slots) c.free_slots -= 1;
  }
}

std::string Agent::launch(TaskRow* row, Hub* hub, bool* passing) {
  // Failures that may be gone in a moment: descriptors or memory short, fork refused.
  auto passing_errno = [](int e) {
    return e == EMFILE || e == ENFILE || e == ENOMEM || e == EAGAIN;
  };
  if (row->attempts >= cfg_.max_attempts) {
    return "launched " + std::to_string(row->attempts) + " times without finishing (limit " +
           std::to_string(cfg_.max_attempts) + ")";
  }
  std::string logs = cfg_.state_dir + "/logs";
  int out = open(log_path(row->id, false).c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  int err = open(log_path(row->id, true).c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  auto close_fds = [&] {
    if (out >= 0) close(out);
    if (err >= 0) close(err);
    if (devnull >= 0) close(devnull);
  };
  if (out < 0 || err < 0 || devnull < 0) {
    *passing = passing_errno(errno);
    std::string e = "cannot open the task's log files in " + logs + ": " + strerror(errno);
    close_fds();
    return e;
  }
  std::string exit_file = cfg_.state_dir + "/run/" + std::to_string(row->id) + ".exit";
  unlink(exit_file.c_str());

  // Environment: the agent's, then the submission's, then what tells the task where it runs.
  std::vector<std::string> env;
  std::map<std::string, size_t> index;
  auto put = [&](const std::string& kv) {
    std::string key = kv.substr(0, kv.find('='));
    auto it = index.find(key);
    if (it != index.end()) {
      env[it->second] = kv;
    } else {
      index[key] = env.size();
      env.push_back(kv);
    }
  };
  for (char** e = environ; *e; ++e) put(*e);
  for (const auto& kv : row->spec.env) put(kv);
  int gpu = row->spec.gpu;
  if (gpu < 0) {
    auto it = cfg_.hub_gpu.find(hub->name);
    gpu = it != cfg_.hub_gpu.end() ? it->second : static_cast<int>(hub->rank);
  }
  put("BUBBLE_JOB=" + hub->job);
  put("BUBBLE_RANK=" + std::to_string(hub->rank));
  put("BUBBLE_RUNTIME_DIR=" + cfg_.runtime_dir);
  put("BUBBLE_TASK_ID=" + std::to_string(row->id));
  put(launch_mark(row->id, row->attempts + 1));
  put("BUBBLE_TASK_NAME=" + row->spec.name);
  put("BUBBLE_PRIORITY=" + std::to_string(row->spec.priority));
  put("BUBBLE_MEM_NEED=" + std::to_string(row->spec.mem_need));
  put("CUDA_VISIBLE_DEVICES=" + std::to_string(gpu));
  if (row->spec.mps_priority >= 0) {
    put("CUDA_MPS_CLIENT_PRIORITY=" + std::to_string(row->spec.mps_priority));
  }
  if (!row->spec.mps_mem_limit.empty()) {
    // With one visible device the task sees it as device 0.
    std::string v = row->spec.mps_mem_limit;
    if (v.find('=') == std::string::npos) v = "0=" + v;
    put("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + v);
  }

  std::vector<std::string> args = {cfg_.self_exe, "--exec-task", exit_file, "--"};
  for (const auto& a : row->spec.argv) args.push_back(a);
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  uv_stdio_container_t stdio[3];
  stdio[0].flags = UV_INHERIT_FD;
  stdio[0].data.fd = devnull;
  stdio[1].flags = UV_INHERIT_FD;
  stdio[1].data.fd = out;
  stdio[2].flags = UV_INHERIT_FD;
  stdio[2].data.fd = err;

  // The launch is on disk before the task runs: an agent that dies before it records the pid
  // finds the task again by its wrapper's command line (readopt_tasks), instead of launching a
  // second copy next to one nobody supervises. No record, no launch: tried again in a second.
  TaskRow launching = *row;
  launching.state = "launching";
  launching.hub = hub->name;
  launching.attempts += 1;
  launching.pid = 0;
  launching.pid_start = 0;
  launching.message = "launching on hub " + hub->name;
  if (!store_.update_task(launching)) {
    *passing = true;
    close_fds();
    return "cannot record the launch in " + cfg_.state_dir + "/bubbled.db: " +
           store_.last_error();
  }
  unsaved_.erase(row->id);  // the row on disk is newer than any write owed for it
  auto lt = std::make_unique<LiveTask>();
  lt->agent = this;
  lt->id = row->id;
  lt->proc = new uv_process_t;
  lt->proc->data = lt.get();
  uv_process_options_t opts{};
  opts.exit_cb = TaskCallbacks::on_exit;
  opts.file = cfg_.self_exe.c_str();
  opts.args = argv.data();
  opts.env = envp.data();
  opts.cwd = row->spec.cwd.empty() ? nullptr : row->spec.cwd.c_str();
  // Its own session and process group: signals reach the whole task, and the task outlives an
  // agent restart.
  opts.flags = UV_PROCESS_DETACHED;
  opts.stdio_count = 3;
  opts.stdio = stdio;
  int rc = uv_spawn(loop_, lt->proc, &opts);
  close_fds();
  if (rc < 0) {
    *passing = passing_errno(-rc);
    close_and_delete(lt->proc);
    lt->proc = nullptr;
    if (*passing) save(*row);  // queued again, on disk too (else the caller's finish saves it)
    const bool cwd_may_be_why = rc == UV_ENOENT || rc == UV_EACCES || rc == UV_ENOTDIR;
    return std::string("cannot start the task: ") + uv_strerror(rc) +
           (row->spec.cwd.empty() || !cwd_may_be_why ? "" : " (check --cwd " + row->spec.cwd + ")");
  }
  row->pid = lt->proc->pid;
  ProcStat ps;
  row->pid_start = read_proc_stat(row->pid, &ps) ? ps.start_time : 0;
  row->hub = hub->name;
  row->state = "running";
  row->started_at = wall_ms();
  row->ended_at = 0;
  row->exit_code = 0;
  row->signal = 0;
  row->attempts += 1;
  row->requeue_note.clear();
  row->message = "launched on hub " + hub->name + " (GPU " + std::to_string(gpu) + ")";
  live_[row->id] = std::move(lt);
  arm_log_timer();
  ++launches_;
  save(*row);
  agent_log("task #%lld launched on %s, pid %d", static_cast<long long>(row->id),
            hub->name.c_str(), row->pid);
  update_timers();
  return "";
}

void Agent::on_task_exit(LiveTask* lt, ExitStatus st) {
  if (lt->exited) return;
  lt->exited = true;
  auto it = tasks_.find(lt->id);
  if (it == tasks_.end()) {
    release_live(lt->id);
    return;
  }
  TaskRow& row = it->second;
  ExitStatus file;
  std::string exit_file = cfg_.state_dir + "/run/" + std::to_string(row.id) + ".exit";
  const bool recorded = read_exit_file(exit_file, &file);
  if (recorded) st = file;  // the task's own status, not the wrapper's
  kill_orphans(row, !recorded);
  bool killed = lt->killed_by_agent, cancel = lt->cancel, replace = lt->replace;
  // Why it is placed again, as its stop said when it was decided (a new trainer may serve a hub
  // that went away under the same name by the time the task exits).
  const std::string replace_why = replace_reason(row);
  release_live(row.id);
  row.exit_code = st.known ? st.code : -1;
  row.signal = st.signal;
  for (auto& [name, hub] : hubs_) {
    for (auto h = hub->task_rows.begin(); h != hub->task_rows.end();) {
      if (h->second != row.id) {
        ++h;
        continue;
      }
      slot_gone(&row, {name, h->first});
      h = hub->task_rows.erase(h);
    }
  }
  auto hub = hubs_.find(row.hub);
  bool hub_alive = hub != hubs_.end() && hub->second->alive;
  std::string how = !st.known ? "exit status unknown"
                    : st.signal ? "killed by signal " + std::to_string(st.signal)
                                : "exit code " + std::to_string(st.code);
  if (killed) {
    finish_row(&row, "killed", "killed for not pausing (" + row.message + ")");
  } else if (cancel) {
    finish_row(&row, "cancelled", "cancelled (" + how + ")");
  } else if (replace || (!hub_alive && !(st.known && st.signal == 0 && st.code == 0))) {
    if (row.attempts >= cfg_.max_attempts) {
      finish_row(&row, "failed", "its hub went away " + std::to_string(row.attempts) +
                                     " times (" + how + ")");
    } else {
      row.state = "queued";
      row.requeue_note = !replace_why.empty() ? replace_why
                         : hub_alive          ? "hub " + row.hub + " drained"
                                              : "hub " + row.hub + " went away";
      row.message = "re-placing: " + row.requeue_note + " (" + how + ")";
      row.pid = 0;
      row.pid_start = 0;
      row.hub.clear();
      save(row);
      agent_log("task #%lld queued again: %s", static_cast<long long>(row.id),
                row.message.c_str());
    }
  } else if (st.known && st.signal == 0 && st.code == 0) {
    finish_row(&row, "finished", "finished (exit code 0)");
  } else {
    finish_row(&row, "failed", "failed (" + how + "; see `bubblectl logs " +
                                   std::to_string(row.id) + " --stderr`)");
  }
  // Only once the row that records the status is saved: an agent killed before that finds the
  // file when it comes back, instead of calling the task lost. (Before schedule(), which may
  // launch a re-placed task under the same id, and which removes a file left by a failed save.)
  if (!unsaved_.count(row.id)) unlink(exit_file.c_str());
  schedule();
  update_timers();
}

std::string Agent::launch_mark(int64_t id, uint32_t attempt) const {
  return "BUBBLE_LAUNCH=" + state_dir_id_ + "." + std::to_string(id) + "." +
         std::to_string(attempt);
}

void Agent::kill_orphans(const TaskRow& row, bool wrapper_died) {
  // A launched task ends with its main process: whatever is left in its process group (a
  // background job, a worker that ignored SIGTERM) would otherwise run on unsupervised, maybe on
  // the GPU of a task placed there next. If the wrapper died without recording a status, it was
  // killed, not its task: the task's direct child has PR_SET_PDEATHSIG, and this takes the rest.
  // Only processes that started with or after the wrapper, with the task's id in their
  // environment, are taken for members: once the group is empty its number may name somebody
  // else's job (after a pid wrap or a reboot). A descendant that left the group (setsid: a
  // daemon, which would keep writing the task's log unbounded) is found by the launch's own
  // mark. A process that cleared its environment is missed.
  if (row.origin == "attached" || row.pid <= 0 || row.pid_start == 0) return;
  if (settling_earlier_boot_) return;  // nothing of that boot runs any more
  if (signal_task_group(row.pid, row.pid_start, "BUBBLE_TASK_ID=" + std::to_string(row.id),
                        SIGKILL, launch_mark(row.id, row.attempts)) > 0) {
    agent_log("task #%lld: %s; killed what was left of its process group",
              static_cast<long long>(row.id),
              wrapper_died ? "its launch wrapper died without a status" : "it ended");
  }
}

bool Agent::in_trainer_process(const TaskRow& row) const {
  if (row.origin != "attached" || row.pid <= 0) return false;
  // Any live trainer (a task may serve another trainer's hub); a gone hub's trainer is dead,
  // and its pid may name a task now.
  for (const auto& [name, hub] : hubs_)
    if (hub->alive && hub->snap.trainer_pid == row.pid) return true;
  return false;
}

bool Agent::signal_task(const TaskRow& row, int sig) {
  if (row.pid <= 0) return true;
  // Never signal a process that merely reuses the pid.
  if (row.pid_start && !same_process(row.pid, row.pid_start)) return true;
  // Nor a trainer: a task attached from a thread of a trainer has that trainer's pid.
  if (in_trainer_process(row)) {
    agent_log("task #%lld runs inside its trainer's process (pid %d): not sent %s",
              static_cast<long long>(row.id), row.pid, strsignal(sig));
    return true;
  }
  const int rc = row.origin == "attached" ? kill(row.pid, sig) : kill(-row.pid, sig);
  return rc == 0 || errno != EPERM;
}

void Agent::continue_stopped(TaskRow* row, const std::string& hub, const std::string& why) {
  signal_task(*row, SIGCONT);
  record(row, row->pid, hub, "continue", why);
  row->state = "running";
  save(*row);
}

void Agent::terminate(TaskRow* row, const std::string& why) {
  LiveTask* lt = live(row->id);
  // Already on its way out: asking again (a second cancel) must not start the escalation over,
  // or a task that ignores the stop could put its SIGKILL off for good. The reason is kept (a
  // cancel after a re-placement's stop is what an agent restarted meanwhile must remember).
  if (row->state == "stopping" && lt && lt->stop_timer &&
      uv_is_active(reinterpret_cast<uv_handle_t*>(lt->stop_timer))) {
    row->message = "stopping: " + why;
    save(*row);
    return;
  }
  if (row->state == "stopped") {
    signal_task(*row, SIGCONT);
    record(row, row->pid, row->hub, "continue", "to let it stop: " + why);
  }
  row->state = "stopping";
  row->message = "stopping: " + why;
  save(*row);
  // Gracefully first, through the hub (the task sees BB_E_STOPPED), else by SIGTERM. The
  // request is only sent: a refusal comes later (on_stop_refused), no answer at all ends with
  // the stop timer.
  int asked = 0;
  std::string failed;  // why the hub could not pass on a stop, if it could not
  auto hit = hubs_.find(row->hub);
  if (hit != hubs_.end() && hit->second->alive && hit->second->obs) {
    for (const auto& [hid, rid] : hit->second->task_rows) {
      if (rid != row->id) continue;
      std::string err;
      if (hit->second->obs->stop_task(hid, &err) == BB_OK)
        ++asked;
      else if (failed.empty())
        failed = err;
    }
  }
  if (!failed.empty())  // one line per stop, whatever the number of slots
    agent_log("task #%lld: its hub could not pass on the stop (%s)%s",
              static_cast<long long>(row->id), failed.c_str(),
              asked ? "; it was passed on for its other slots" : lt ? ": SIGTERM instead" : "");
  if (!lt) return;
  lt->stops_sent = asked;
  lt->stops_refused = 0;
  lt->stop_stage = asked ? 0 : 1;
  if (!asked) signal_task(*row, SIGTERM);
  if (!lt->stop_timer) lt->stop_timer = new_timer(loop_, lt);
  uv_timer_start(lt->stop_timer, TaskCallbacks::on_stop_timer, cfg_.stop_timeout_ns / 1'000'000,
                 0);
}

void Agent::on_stop_refused(TaskRow* row, const std::string& why) {
  if (row->origin == "attached") {  // a cancel: it was told the stop was asked for
    agent_log("task #%lld: its trainer refused the stop (%s)", static_cast<long long>(row->id),
              why.c_str());
    record(row, row->pid, row->hub, "cancel", "its trainer refused the stop: " + why);
    return;
  }
  LiveTask* lt = live(row->id);
  if (!lt || lt->exited || !lt->stop_timer || row->state != "stopping" || lt->stop_stage != 0 ||
      ++lt->stops_refused < lt->stops_sent)
    return;
  agent_log("task #%lld: its hub could not pass on the stop (%s): SIGTERM instead",
            static_cast<long long>(row->id), why.c_str());
  lt->stop_stage = 1;
  signal_task(*row, SIGTERM);
  uv_timer_start(lt->stop_timer, TaskCallbacks::on_stop_timer, cfg_.stop_timeout_ns / 1'000'000,
                 0);
}

void Agent::on_stop_timer(LiveTask* lt) {
  auto it = tasks_.find(lt->id);
  if (it == tasks_.end() || lt->exited) return;
  TaskRow& row = it->second;
  if (lt->stop_stage == 0) {
    lt->stop_stage = 1;
    signal_task(row, SIGTERM);
    uv_timer_start(lt->stop_timer, TaskCallbacks::on_stop_timer,
                   cfg_.stop_timeout_ns / 1'000'000, 0);
  } else {
    signal_task(row, SIGKILL);
    record(&row, row.pid, row.hub, "kill", "did not stop within the stop timeout");
  }
}

std::string Agent::cancel(int64_t id, std::string* done, bool* not_found) {
  auto it = tasks_.find(id);
  *not_found = it == tasks_.end();
  if (it == tasks_.end()) {
    return "no task #" + std::to_string(id) + ": see `bubblectl list --all`";
  }
  TaskRow& row = it->second;
  if (state_is_final(row.state)) {
    return "task #" + std::to_string(id) + " already ended (" + row.state + ")";
  }
  if (row.state == "queued") {
    finish_row(&row, "cancelled", "cancelled before it was placed");
    *done = "task #" + std::to_string(id) + " cancelled";
    return "";
  }
  if (row.origin == "attached") {
    auto hit = hubs_.find(row.hub);
    auto retry = retry_hubs_.find(row.hub);
    std::string err = retry != retry_hubs_.end() && retry->second.hung
                          ? "the trainer of its hub " + row.hub + " does not answer (stopped or "
                            "hung?); cancel it again once the trainer goes on"
                          : "its hub is gone";
    bool ok = false;
    if (hit != hubs_.end() && hit->second->obs) {
      for (const auto& [hid, rid] : hit->second->task_rows) {
        if (rid == id && hit->second->obs->stop_task(hid, &err) == BB_OK) ok = true;
      }
    }
    if (!ok) return "cannot stop attached task #" + std::to_string(id) + ": " + err;
    record(&row, row.pid, row.hub, "cancel", "asked the attached task to stop");
    *done = "task #" + std::to_string(id) + " asked to stop";
    return "";
  }
  LiveTask* lt = live(id);
  if (lt) lt->cancel = true;
  record(&row, row.pid, row.hub, "cancel", "cancel requested");
  terminate(&row, "cancel requested");
  *done = "task #" + std::to_string(id) + " is stopping";
  return "";
}

std::string Agent::drain(const std::string& hub_name, bool undo, std::string* done) {
  if (hub_name.empty()) {
    draining_ = !undo;
    const bool saved = save_meta("draining", draining_ ? "1" : "0");
    *done = draining_ ? "the agent is draining: running tasks go on, queued ones wait"
                      : "the agent launches queued tasks again";
    if (!saved) *done += kNotSavedYet;
    schedule();
    return "";
  }
  // Kept across restarts like the agent's own drain: an upgrade must not put tasks back on a
  // hub the operator took out of service.
  bool saved = true;
  auto remember = [&] {
    if (undo)
      drained_hubs_.erase(hub_name);
    else
      drained_hubs_.insert(hub_name);
    std::string list;
    for (const std::string& h : drained_hubs_) list += (list.empty() ? "" : "\n") + h;
    saved = save_meta("drained_hubs", list);
  };
  auto it = hubs_.find(hub_name);
  if (it == hubs_.end()) {
    if (undo && drained_hubs_.count(hub_name)) {  // drained before a restart, not back yet
      remember();
      *done = "hub " + hub_name + " takes tasks again when it comes back";
      if (!saved) *done += kNotSavedYet;
      return "";
    }
    return "no hub " + hub_name + ": see `bubblectl status` for the hubs the agent knows";
  }
  Hub* hub = it->second.get();
  hub->draining = !undo;
  remember();
  if (undo) {
    *done = "hub " + hub_name + " takes tasks again";
    if (!saved) *done += kNotSavedYet;
    schedule();
    return "";
  }
  int moved = 0;
  for (auto& [id, row] : tasks_) {
    if (row.hub != hub_name || row.origin != "submitted") continue;
    if (row.state != "running" && row.state != "stopped") continue;
    LiveTask* lt = live(id);
    if (!lt) continue;
    lt->replace = true;
    record(&row, row.pid, hub_name, "replace", "its hub is draining: re-placing the task");
    terminate(&row, "its hub is draining");
    ++moved;
  }
  *done = "hub " + hub_name + " is draining: " + std::to_string(moved) +
          " task(s) moving to other hubs";
  if (!saved) *done += kNotSavedYet;
  return "";
}

void Agent::watch_pidfd(TaskRow* row) {
  auto lt = std::make_unique<LiveTask>();
  lt->agent = this;
  lt->id = row->id;
  LiveTask* raw = lt.get();
  live_[row->id] = std::move(lt);
  arm_log_timer();
  start_pidfd_watch(raw, row->pid);
}

void Agent::retry_pidfd_watches() {
  std::vector<std::pair<LiveTask*, pid_t>> unwatched;
  for (auto& [id, lt] : live_) {
    auto row = tasks_.find(id);
    if (!lt->exited && !lt->proc && lt->pidfd < 0 && row != tasks_.end())
      unwatched.emplace_back(lt.get(), row->second.pid);
  }
  for (auto& [lt, pid] : unwatched) start_pidfd_watch(lt, pid);
}

void Agent::start_pidfd_watch(LiveTask* raw, pid_t pid) {
  int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0 && errno == ESRCH) {
    // Gone between the check and now.
    on_task_exit(raw, ExitStatus{});
    return;
  }
  if (fd < 0) {
    // Out of descriptors, say: the task still runs. Tried again at every tick.
    if (!raw->watch_failed)
      agent_log("task #%lld (pid %d): cannot watch it yet (pidfd_open: %s); trying again",
                static_cast<long long>(raw->id), pid, strerror(errno));
    raw->watch_failed = true;
    return;
  }
  // Opened late (a retry), the pid may name another process by now: the descriptor holds the
  // pid, so a start time that still matches is the task's.
  auto row = tasks_.find(raw->id);
  if (row != tasks_.end() && row->second.pid_start &&
      !same_process(pid, row->second.pid_start)) {
    close(fd);
    on_task_exit(raw, ExitStatus{});
    return;
  }
  raw->pidfd = fd;
  raw->pidfd_poll = new uv_poll_t;
  uv_poll_init(loop_, raw->pidfd_poll, fd);
  raw->pidfd_poll->data = raw;
  uv_poll_start(raw->pidfd_poll, UV_READABLE, TaskCallbacks::on_pidfd);
}

std::string Agent::readopt_tasks() {
  std::vector<TaskRow> rows;
  if (!store_.load_tasks(&rows))
    return "cannot read the task records in " + cfg_.state_dir + "/bubbled.db (" +
           store_.last_error() + "): repair or move the database (sqlite3 .recover), or give "
           "the agent another --state-dir";
  for (TaskRow& row : rows) {
    row.loaded = {row.steps, row.ns_in_bubbles, row.ns_outside};
    tasks_[row.id] = row;
  }
  draining_ = store_.get_meta("draining") == "1";
  {
    const std::string list = store_.get_meta("drained_hubs");
    size_t from = 0;
    while (from < list.size()) {
      const size_t end = std::min(list.find('\n', from), list.size());
      if (end > from) drained_hubs_.insert(list.substr(from, end - from));
      from = end + 1;
    }
  }
  // A pid and a start time name a process within one boot only: after a restart of the node,
  // every task the rows call running is gone, and their pids may be anybody's now.
  const std::string boot = boot_id(), last_boot = store_.get_meta("boot_id");
  earlier_boot_ = !boot.empty() && !last_boot.empty() && boot != last_boot;
  // Recorded once the rows of the earlier boot are settled (settle_dead_tasks): an agent that
  // stopped before that must still know them for what they are.
  boot_to_record_ = boot != last_boot ? boot : "";
  for (auto& [id, row] : tasks_) {
    if (state_is_final(row.state) || row.state == "queued") continue;
    bool alive = !earlier_boot_ && row.pid > 0 && same_process(row.pid, row.pid_start);
    if (row.origin == "attached") {
      if (!alive) {
        finish_row(&row, "lost", "ended while the agent was down");
      } else if (row.state == "stopped") {
        // As a launched task below: its escalation state died with the old agent.
        continue_stopped(&row, row.hub, "the agent restarted");
      }
      // Alive: matched again by pid when its hub's snapshot shows it.
      continue;
    }
    if (row.state == "launching") {
      settle_launch(&row);
      continue;
    }
    if (alive) {
      agent_log("re-adopting task #%lld (pid %d)", static_cast<long long>(id), row.pid);
      watch_pidfd(&row);
      if (row.state == "stopped") {
        // Its escalation state died with the old agent: let it run; a new violation counts.
        continue_stopped(&row, row.hub, "the agent restarted");
      } else if (row.state == "stopping") {
        LiveTask* lt = live(id);
        if (lt) lt->cancel = row.message.find("cancel") != std::string::npos;
        if (lt) lt->replace = !lt->cancel;
        // The stop goes on for the reason it was asked for: the message is what the next agent
        // reads it from (a cancel must stay a cancel however many restarts come).
        const std::string prefix = "stopping: ";
        terminate(&row, row.message.rfind(prefix, 0) == 0
                            ? row.message.substr(prefix.size())
                            : "stop requested before the agent restarted");
      }
      continue;
    }
    pending_dead_.push_back(id);
  }
  return "";
}

void Agent::settle_launch(TaskRow* row) {
  // The agent died between recording a launch and recording its pid: the wrapper may run, may
  // have run and ended (its exit file says how), or may never have started.
  const std::string exit_file = cfg_.state_dir + "/run/" + std::to_string(row->id) + ".exit";
  uint64_t start = 0;
  const pid_t pid = earlier_boot_ ? 0 : find_exec_wrapper(exit_file, &start);
  if (pid > 0) {
    agent_log("task #%lld: found its launch wrapper (pid %d) from before the restart; adopting it",
              static_cast<long long>(row->id), pid);
    row->pid = pid;
    row->pid_start = start;
    row->state = "running";
    row->started_at = wall_ms();
    row->message = "launched on " + row->hub + " (found running after the agent restarted)";
    save(*row);
    watch_pidfd(row);
    return;
  }
  ExitStatus st;
  if (read_exit_file(exit_file, &st)) {
    row->state = "running";  // it ran: its exit file ends it, as for any task that ended meanwhile
    pending_dead_.push_back(row->id);
    return;
  }
  agent_log("task #%lld: the agent stopped while launching it and it is not running; placing it "
            "again", static_cast<long long>(row->id));
  row->state = "queued";
  row->requeue_note = "the agent stopped while launching it";
  row->message = "re-placing: " + row->requeue_note;
  row->hub.clear();
  save(*row);
}

void Agent::settle_dead_tasks() {
  std::vector<int64_t> dead;
  dead.swap(pending_dead_);
  settling_earlier_boot_ = earlier_boot_;
  for (int64_t id : dead) {
    auto it = tasks_.find(id);
    if (it == tasks_.end()) continue;
    TaskRow& row = it->second;
    // Ended while the agent was down: the launch wrapper left its status.
    ExitStatus st;
    std::string exit_file = cfg_.state_dir + "/run/" + std::to_string(id) + ".exit";
    if (!read_exit_file(exit_file, &st)) {
      kill_orphans(row, true);
      finish_row(&row, "lost", earlier_boot_
                                   ? "the node restarted while it ran (no exit status recorded)"
                                   : "ended while the agent was down, with no exit status recorded");
      continue;
    }
    auto lt = std::make_unique<LiveTask>();
    lt->agent = this;
    lt->id = id;
    lt->cancel = row.state == "stopping" && row.message.find("cancel") != std::string::npos;
    // Stopped for another hub (its own drained or gone): placed again, as a running agent does.
    // An older agent wrote a stop asked again after a restart without its reason: that one is
    // ended by its exit status, never run again (it may have been a cancel).
    lt->replace = row.state == "stopping" && !lt->cancel &&
                  row.message.find("stop requested before the agent restarted") ==
                      std::string::npos;
    LiveTask* raw = lt.get();
    live_[id] = std::move(lt);
    on_task_exit(raw, st);
  }
  settling_earlier_boot_ = false;
  if (!boot_to_record_.empty()) save_meta("boot_id", boot_to_record_);
  boot_to_record_.clear();
}

}  // namespace bb::daemon
