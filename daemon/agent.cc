#include "daemon/agent.h"

#include "daemon/paths.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

namespace bb::daemon {

void close_all_clients(Agent* agent);  // control.cc
void close_all_http(Agent* agent);     // metrics.cc

uint64_t mono_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void agent_log(const char* fmt, ...) {
  char when[32];
  time_t t = time(nullptr);
  struct tm tm;
  localtime_r(&t, &tm);
  strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
  fprintf(stderr, "%s bubbled[%d]: ", when, getpid());
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
}

Agent::Agent(AgentConfig cfg) : cfg_(std::move(cfg)) {}

Agent::~Agent() {
  if (lock_fd_ >= 0) close(lock_fd_);
}

std::string Agent::start(uv_loop_t* loop) {
  loop_ = loop;
  loop_->data = this;
  for (const std::string& d : {cfg_.runtime_dir, cfg_.state_dir, cfg_.state_dir + "/logs",
                               cfg_.state_dir + "/run"}) {
    const bool runtime = d == cfg_.runtime_dir;
    std::string e = make_dirs(d, 0700);
    if (e.empty())
      e = check_private_dir(
          d, runtime ? "put hub sockets of its own there, which the agent would observe and "
                       "place tasks on as if they were trainers'"
                     : "plant tasks for the agent to run",
          runtime ? "--runtime-dir, BUBBLE_RUNTIME_DIR" : "--state-dir, BUBBLE_STATE_DIR");
    if (!e.empty()) return e;
  }
  // One agent per state directory: two would launch every queued task twice.
  std::string lock = cfg_.state_dir + "/bubbled.lock";
  lock_fd_ = open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) return "cannot open " + lock + ": " + strerror(errno);
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    return "another bubbled uses the state directory " + cfg_.state_dir +
           ": stop it, or give this one its own --state-dir";
  }
  std::string e = store_.open(cfg_.state_dir + "/bubbled.db");
  if (!e.empty()) return e;
  {
    struct stat sd;
    if (stat(cfg_.state_dir.c_str(), &sd) != 0)
      return "cannot inspect " + cfg_.state_dir + ": " + strerror(errno);
    char id[64];
    snprintf(id, sizeof id, "%llx.%llx", static_cast<unsigned long long>(sd.st_dev),
             static_cast<unsigned long long>(sd.st_ino));
    state_dir_id_ = id;
  }
  prune_timer_ = new_timer(loop_, this);
  log_timer_ = new_timer(loop_, this);
  relaunch_timer_ = new_timer(loop_, this);
  save_timer_ = new_timer(loop_, this);
  // What can fail for a passing reason (a port or socket in use) first: an agent that fails
  // to start must not have acted on its tasks (continued, stopped them) on its way out.
  e = start_metrics();
  if (!e.empty()) return e;
  e = start_control();
  if (!e.empty()) return e;
  // An agent that went on with part of its records would launch none of the rest, and delete
  // their logs as orphans.
  e = readopt_tasks();
  if (!e.empty()) return e;
  e = start_hub_watch();
  if (!e.empty()) return e;
  settle_dead_tasks();
  prune_history();  // also when --keep-ended was lowered since the last run
  sweep_logs();
  schedule();
  update_timers();
  agent_log("serving %s; hubs in %s; state in %s; metrics %s", cfg_.socket_path.c_str(),
            cfg_.runtime_dir.c_str(), cfg_.state_dir.c_str(),
            metrics_port_ ? ("http://127.0.0.1:" + std::to_string(metrics_port_) + "/metrics").c_str()
                          : "off");
  return "";
}

void Agent::shutdown() {
  if (closing_) return;
  closing_ = true;
  if (control_) {
    close_and_delete(control_);
    control_ = nullptr;
    unlink(cfg_.socket_path.c_str());
  }
  if (metrics_) {
    close_and_delete(metrics_);
    metrics_ = nullptr;
  }
  if (dir_watch_) {
    uv_fs_event_stop(dir_watch_);
    close_and_delete(dir_watch_);
    dir_watch_ = nullptr;
  }
  // A last try: what is still owed was logged when its write failed.
  if (!unsaved_.empty() || !unsaved_meta_.empty() || !unsaved_actions_.empty()) save_unsaved();
  for (uv_timer_t** t : {&tick_, &retry_timer_, &prune_timer_, &log_timer_, &relaunch_timer_,
                         &save_timer_}) {
    if (*t) {
      uv_timer_stop(*t);
      close_and_delete(*t);
      *t = nullptr;
    }
  }
  cancel_opens();
  for (auto& [name, hub] : hubs_) close_hub_handles(hub.get());
  // Tasks keep running: the next agent re-adopts them. One that enforcement stopped would stay
  // stopped until then (or for good, with no agent to come): it is continued now.
  for (auto& [id, row] : tasks_)
    if (row.state == "stopped") continue_stopped(&row, row.hub, "the agent is stopping");
  std::vector<int64_t> ids;
  for (const auto& [id, lt] : live_) ids.push_back(id);
  for (int64_t id : ids) release_live(id);
  close_all_clients(this);
  close_all_http(this);
}

std::vector<TaskRow> Agent::tasks(bool all) const {
  std::vector<TaskRow> out;
  for (const auto& [id, row] : tasks_) {
    if (all || !state_is_final(row.state)) out.push_back(row);
  }
  return out;
}

const TaskRow* Agent::task(int64_t id) const {
  auto it = tasks_.find(id);
  return it == tasks_.end() ? nullptr : &it->second;
}

}  // namespace bb::daemon
