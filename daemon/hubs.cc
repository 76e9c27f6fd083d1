// The hub side of the agent: discover hubs without the trainer ever waiting for us (a watch on
// the runtime directory plus a scan at start), observe them read-only, notice their trainer's
// exit through the observer's descriptor, and sample snapshots and event logs while they live.
#include "daemon/agent.h"
#include "core/paths.h"
#include "daemon/placement.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <system_error>
#include <thread>

namespace bb::daemon {

namespace {
// The inode of hub (job, rank)'s socket file, 0 when there is none.
uint64_t socket_inode(const std::string& runtime_dir, const std::string& job, uint32_t rank) {
  std::string path;
  struct stat st;
  if (core::hub_paths(runtime_dir, job.c_str(), rank, &path, nullptr) != BB_OK ||
      stat(path.c_str(), &st) != 0)
    return 0;
  return uint64_t(st.st_ino);
}

constexpr size_t kMaxEventsPerHub = 131072;
// A hub whose trainer went away stays listed (status, metrics, traces of its last events) with
// the newest of its events, until more than this many such hubs are kept: a long-lived agent
// sees a new job id with every training run.
constexpr size_t kMaxEventsPerGoneHub = 8192;
constexpr size_t kMaxGoneHubs = 16;
// How long an open waits for a trainer to accept and answer is AgentConfig::trainer_answer_ms
// (--trainer-answer-ms, default 1 s): a live trainer's service thread answers in microseconds,
// a stopped (a debugger's breakpoint) or hung one never. Opens wait on the thread pool, or, at
// the agent's start, on threads of their own before the loop runs; once a hub is open the loop
// never waits on its trainer (HubObserver::set_async).
constexpr int kMaxOpenRetries = 6;
const uint64_t kRetryDelaysMs[kMaxOpenRetries] = {10, 30, 100, 300, 1000, 3000};
// Past those, a socket something listens on but does not answer through (a trainer stopped in
// a debugger, a suspended job) is tried this often for as long as it is there.
constexpr uint64_t kHungRetryMs = 10'000;
// Opens at start run this many at a time, each on a thread of its own.
constexpr size_t kStartOpenThreads = 16;
}  // namespace

// One open of a hub's observer, off the loop.
struct HubOpen {
  uv_work_t req{};
  Agent* agent = nullptr;
  std::string runtime_dir, job, name;
  uint32_t rank = 0;
  uint32_t answer_ms = 1000;
  bool cancelled = false;
  bb_status st = BB_OK;
  std::unique_ptr<core::HubObserver> obs;
  std::string error;

  HubOpen(Agent* a, const AgentConfig& cfg, const std::string& j, uint32_t r)
      : agent(a), runtime_dir(cfg.runtime_dir), job(j), name(j + ":" + std::to_string(r)),
        rank(r), answer_ms(cfg.trainer_answer_ms) {
    req.data = this;
  }
  void run() { st = core::HubObserver::open(runtime_dir, job, rank, &obs, &error, answer_ms); }
};

struct HubCallbacks {
  static void on_dir_event(uv_fs_event_t* h, const char*, int, int status) {
    auto* agent = static_cast<Agent*>(h->data);
    if (status < 0) {
      agent_log("watching the hub directory failed: %s", uv_strerror(status));
      return;
    }
    agent->scan_hubs();
  }
  static void on_hub_poll(uv_poll_t* p, int status, int events) {
    auto* hub = static_cast<Hub*>(p->data);
    Agent* agent = static_cast<Agent*>(p->loop->data);
    // Readable: answers to the observer's requests (read them all, so the level-triggered
    // descriptor is quiet again), or the hang-up.
    if (status < 0 || (events & UV_DISCONNECT) || !hub->obs || !agent->pump_hub(hub) ||
        !hub->obs->alive()) {
      agent->on_hub_gone(hub, "its trainer closed the hub or exited");
      return;
    }
  }
  static void on_retry(uv_timer_t* t) {
    auto* agent = static_cast<Agent*>(t->data);
    const uint64_t now = uv_now(agent->loop_);
    std::vector<std::string> due;
    for (auto& [name, r] : agent->retry_hubs_)
      if (r.due_ms <= now) {
        r.due_ms = UINT64_MAX;  // until this try's answer
        due.push_back(name);
      }
    for (const auto& name : due) {
      std::string job;
      uint32_t rank;
      if (parse_hub_name(name, &job, &rank)) agent->try_open_hub(job, rank);
      else agent->retry_hubs_.erase(name);
    }
    agent->arm_open_retry();
  }
  static void on_open_work(uv_work_t* w) { static_cast<HubOpen*>(w->data)->run(); }
  static void on_open_done(uv_work_t* w, int status) {
    std::unique_ptr<HubOpen> o(static_cast<HubOpen*>(w->data));
    o->cancelled = status == UV_ECANCELED;
    o->agent->open_done(o.get());
  }
  static void on_tick(uv_timer_t* t) {
    auto* agent = static_cast<Agent*>(t->data);
    agent->retry_pidfd_watches();
    agent->refresh_all();
    agent->update_timers();
  }
};

std::string Agent::start_hub_watch() {
  dir_watch_ = new uv_fs_event_t;
  uv_fs_event_init(loop_, dir_watch_);
  dir_watch_->data = this;
  int rc = uv_fs_event_start(dir_watch_, HubCallbacks::on_dir_event, cfg_.runtime_dir.c_str(), 0);
  if (rc < 0) {
    return "cannot watch the hub directory " + cfg_.runtime_dir + ": " + uv_strerror(rc);
  }
  tick_ = new_timer(loop_, this);
  retry_timer_ = new_timer(loop_, this);
  open_hubs_now(core::list_hubs(cfg_.runtime_dir));
  update_timers();
  // Rows of tasks that attached by themselves to a hub that is gone now (its trainer closed it
  // while the agent was down): no snapshot will ever show them again. (Only when the directory
  // could be listed: an empty list for an error would end every such row.)
  if (DIR* d = opendir(cfg_.runtime_dir.c_str())) {
    closedir(d);
    std::set<std::string> present;
    for (const core::HubName& h : core::list_hubs(cfg_.runtime_dir))
      present.insert(h.job + ":" + std::to_string(h.rank));
    for (auto& [id, row] : tasks_)
      if (row.origin == "attached" && !state_is_final(row.state) && !present.count(row.hub))
        finish_row(&row, "lost", "its hub " + row.hub + " was gone when the agent came back");
  }
  return "";
}

void Agent::end_attached_rows(const std::string& hub, const std::string& why) {
  auto it = hubs_.find(hub);
  if (it != hubs_.end() && it->second->alive) return;
  for (auto& [id, row] : tasks_)
    if (row.origin == "attached" && row.hub == hub && !state_is_final(row.state))
      finish_row(&row, "lost", why);
}

void Agent::scan_hubs() {
  if (closing_) return;
  prune_gone_hubs();
  for (const core::HubName& h : core::list_hubs(cfg_.runtime_dir)) {
    std::string name = h.job + ":" + std::to_string(h.rank);
    auto it = hubs_.find(name);
    if (it != hubs_.end() && it->second->alive) continue;
    open_hub_afresh(h.job, h.rank);
  }
  arm_open_retry();
  update_timers();
}

void Agent::open_hub_afresh(const std::string& job, uint32_t rank) {
  const std::string name = job + ":" + std::to_string(rank);
  // An open under way may have connected before this change (to the socket a new trainer just
  // replaced): it is tried once more when it fails.
  if (opening_.count(name)) {
    open_again_.insert(name);
    return;
  }
  // The directory changed: a new series of tries, not one more of the last.
  retry_hubs_.erase(name);
  try_open_hub(job, rank);
}

void Agent::open_hubs_now(const std::vector<core::HubName>& hubs) {
  std::vector<std::unique_ptr<HubOpen>> opens;
  for (const core::HubName& h : hubs)
    opens.push_back(std::make_unique<HubOpen>(this, cfg_, h.job, h.rank));
  // In parallel: trainers that do not answer cost the start one timeout per batch, not one
  // each. Where no thread can be had (a limit on processes), the rest are opened one by one.
  for (size_t from = 0; from < opens.size(); from += kStartOpenThreads) {
    std::vector<std::thread> threads;
    const size_t to = std::min(opens.size(), from + kStartOpenThreads);
    size_t k = from;
    try {
      for (; k < to; ++k) threads.emplace_back([o = opens[k].get()] { o->run(); });
    } catch (const std::system_error&) {
      for (; k < to; ++k) opens[k]->run();
    }
    for (std::thread& t : threads) t.join();
  }
  for (auto& o : opens) open_done(o.get());
}

void Agent::try_open_hub(const std::string& job, uint32_t rank) {
  if (closing_) return;
  std::string name = job + ":" + std::to_string(rank);
  auto it = hubs_.find(name);
  if (it != hubs_.end() && it->second->alive) return;
  if (opening_.count(name)) return;  // its answer is on the way
  auto o = std::make_unique<HubOpen>(this, cfg_, job, rank);
  const int rc = uv_queue_work(loop_, &o->req, HubCallbacks::on_open_work,
                               HubCallbacks::on_open_done);
  if (rc < 0) {
    open_failed(name, std::string("cannot queue the open: ") + uv_strerror(rc), BB_E_SYSTEM);
    return;
  }
  opening_[name] = o.release();  // on_open_done frees it
}

void Agent::open_done(HubOpen* o) {
  opening_.erase(o->name);
  const bool again = open_again_.erase(o->name) != 0;
  if (closing_ || o->cancelled) return;  // the observer, if any, closes with o
  if (o->st != BB_OK) {
    if (again) {  // the directory changed while it was under way
      open_hub_afresh(o->job, o->rank);
      arm_open_retry();
      return;
    }
    open_failed(o->name, o->error, o->st);
    return;
  }
  install_hub(o->job, o->rank, std::move(o->obs));
}

void Agent::cancel_opens() {
  // Opens not started yet are dropped (their callbacks run with UV_ECANCELED); the ones under
  // way end within the answer timeout, and their results are dropped.
  for (auto& [name, o] : opening_) uv_cancel(reinterpret_cast<uv_req_t*>(&o->req));
}

void Agent::open_failed(const std::string& name, const std::string& error, bb_status st) {
  // The socket may exist a moment before its trainer listens, or be left by a dead trainer
  // (which the next trainer of that name replaces), or its trainer may be stopped: try again a
  // few times, then wait for the directory to change again.
  if (cfg_.verbose) agent_log("hub %s not ready: %s", name.c_str(), error.c_str());
  auto it = hubs_.find(name);
  if (it != hubs_.end() && it->second->alive) {  // a try made meanwhile got in
    retry_hubs_.erase(name);
    return;
  }
  std::string job;
  uint32_t rank;
  if (parse_hub_name(name, &job, &rank) && socket_inode(cfg_.runtime_dir, job, rank) == 0) {
    // Its socket is gone (its trainer closed the hub): the directory watch sees a new one. The
    // tasks that had attached to it by themselves (rows kept from before an agent restart while
    // it did not answer) went with it: no snapshot of it will ever end their rows.
    retry_hubs_.erase(name);
    end_attached_rows(name, "its hub " + name + " closed before the agent could observe it "
                      "again");
    return;
  }
  OpenRetry& r = retry_hubs_[name];
  if (r.round < kMaxOpenRetries) {
    r.due_ms = uv_now(loop_) + kRetryDelaysMs[r.round++];
    arm_open_retry();
    return;
  }
  if (st == BB_E_TIMEOUT) {
    // Its trainer accepts or holds the connection but does not answer: stopped or hung, not
    // gone. It may go on, so it keeps being tried, slowly, and its tasks keep their rows.
    if (!r.hung)
      agent_log("hub %s: its trainer does not answer (%s); stopped or hung? tried again every "
                "%llu s", name.c_str(), error.c_str(),
                static_cast<unsigned long long>(kHungRetryMs / 1000));
    r.hung = true;
    r.due_ms = uv_now(loop_) + kHungRetryMs;
    arm_open_retry();
    return;
  }
  retry_hubs_.erase(name);
  agent_log("hub %s: no trainer answers on its socket (%s); tried again when the runtime "
            "directory changes", name.c_str(), error.c_str());
  // A socket its trainer left when it died: the tasks that had attached to it by themselves
  // (rows from before an agent restart) are not coming back through it.
  end_attached_rows(name, "its hub " + name + " does not answer (its trainer is gone or hung)");
}

void Agent::arm_open_retry() {
  if (!retry_timer_) return;
  uint64_t next = UINT64_MAX;
  for (const auto& [name, r] : retry_hubs_) next = std::min(next, r.due_ms);
  if (next == UINT64_MAX) {
    uv_timer_stop(retry_timer_);
    return;
  }
  const uint64_t now = uv_now(loop_);
  uv_timer_start(retry_timer_, HubCallbacks::on_retry, next > now ? next - now : 0, 0);
}

void Agent::install_hub(const std::string& job, uint32_t rank,
                        std::unique_ptr<core::HubObserver> obs) {
  std::string name = job + ":" + std::to_string(rank);
  retry_hubs_.erase(name);
  arm_open_retry();
  auto it = hubs_.find(name);
  if (it != hubs_.end() && it->second->alive) return;  // opened twice: keep the first
  if (it == hubs_.end()) {
    it = hubs_.emplace(name, std::make_unique<Hub>()).first;
  }
  Hub* hub = it->second.get();
  // A new trainer under an old name starts from zero: its counters and slots are its own.
  bool draining = hub->draining || drained_hubs_.count(name);
  *hub = Hub();
  hub->draining = draining;
  hub->name = name;
  hub->job = job;
  hub->rank = rank;
  hub->obs = std::move(obs);
  hub->obs->set_async();  // the loop never waits on a trainer's answer
  hub->sock_ino = socket_inode(cfg_.runtime_dir, job, rank);
  hub->alive = true;
  hub->poll = new uv_poll_t;
  uv_poll_init(loop_, hub->poll, hub->obs->fd());
  hub->poll->data = hub;
  uv_poll_start(hub->poll, UV_READABLE | UV_DISCONNECT, HubCallbacks::on_hub_poll);
  hub->rate_ns = mono_ns();
  agent_log("hub %s attached (trainer pid %d)", name.c_str(), hub->obs->snapshot().trainer_pid);
  refresh_hub(hub, mono_ns());
  schedule();
  update_timers();
}

void Agent::close_hub_handles(Hub* hub) {
  if (hub->poll) {
    uv_poll_stop(hub->poll);
    close_and_delete(hub->poll);
    hub->poll = nullptr;
  }
  hub->obs.reset();
}

void Agent::prune_gone_hubs() {
  std::vector<std::pair<uint64_t, std::string>> gone;
  for (const auto& [name, hub] : hubs_)
    if (!hub->alive && !hub->draining) gone.emplace_back(hub->gone_ns, name);  // a drain stays
  if (gone.size() <= kMaxGoneHubs) return;
  std::sort(gone.begin(), gone.end());
  for (size_t k = 0; k + kMaxGoneHubs < gone.size(); ++k) hubs_.erase(gone[k].second);
}

void Agent::on_hub_gone(Hub* hub, const char* why) {
  if (!hub->alive) return;
  // Take the last events and counters before the view goes away.
  refresh_hub(hub, mono_ns());
  hub->alive = false;
  hub->gone_ns = mono_ns();
  if (hub->events.size() > kMaxEventsPerGoneHub) {
    hub->events.erase(hub->events.begin(), hub->events.end() - kMaxEventsPerGoneHub);
    hub->events.shrink_to_fit();
  }
  close_hub_handles(hub);
  agent_log("hub %s gone: %s", hub->name.c_str(), why);
  for (auto& [id, row] : tasks_) {
    if (row.hub != hub->name || state_is_final(row.state) || row.state == "queued") continue;
    if (row.origin == "attached") {
      if (row.state == "stopped") signal_task(row, SIGCONT);
      finish_row(&row, "lost", "its hub " + hub->name + " went away while it was attached");
      continue;
    }
    LiveTask* lt = live(id);
    if (lt && !lt->cancel) {
      lt->replace = true;
      record(&row, row.pid, hub->name, "replace", "its hub went away: re-placing the task");
      terminate(&row, "its hub went away");
    }
  }
  for (const auto& [hid, rid] : hub->task_rows) {
    auto rit = tasks_.find(rid);
    if (rit != tasks_.end()) slot_gone(&rit->second, {hub->name, hid});
  }
  hub->task_rows.clear();
  hub->enforce.clear();
  // Another socket under its name: a new trainer's, bound before this one's hang-up was seen
  // (the change of the directory found this hub still open). Its own socket, which a closing
  // trainer removes last and a killed one leaves, is not tried.
  const uint64_t ino = socket_inode(cfg_.runtime_dir, hub->job, hub->rank);
  if (ino != 0 && ino != hub->sock_ino) {
    open_hub_afresh(hub->job, hub->rank);
    arm_open_retry();
  }
  schedule();
  update_timers();
}

void Agent::refresh_all() {
  uint64_t now = mono_ns();
  std::vector<Hub*> gone;
  for (auto& [name, hub] : hubs_) {
    if (!hub->alive) continue;
    if (!hub->obs->alive()) {
      gone.push_back(hub.get());
      continue;
    }
    refresh_hub(hub.get(), now);
  }
  for (Hub* h : gone) on_hub_gone(h, "its trainer closed the hub or exited");
  // Placement of queued tasks goes with the sampling interval: this tick may be the much
  // faster enforcement one, and placement looks at every record.
  if (now - last_placement_ns_ < cfg_.sample_interval_ns) return;
  last_placement_ns_ = now;
  bool queued = false;
  for (const auto& [id, row] : tasks_) queued |= row.state == "queued";
  if (queued) schedule();
}

bool Agent::pump_hub(Hub* hub) {
  std::vector<core::HubObserver::StopAnswer> stops;
  const bool ok = hub->obs->pump(&stops);
  for (const auto& a : stops) {
    if (a.status == BB_OK) continue;
    auto rit = hub->task_rows.find(a.task_id);
    auto tit = rit == hub->task_rows.end() ? tasks_.end() : tasks_.find(rit->second);
    if (tit == tasks_.end()) continue;  // the task left its hub meanwhile
    on_stop_refused(&tit->second, a.error);
  }
  return ok;
}

void Agent::refresh_hub(Hub* hub, uint64_t now) {
  if (!hub->obs) return;
  pump_hub(hub);  // a hang-up is the poll's and refresh_all's to see
  hub->snap = hub->obs->snapshot();
  core::Event buf[512];
  for (;;) {
    uint64_t lost = 0;
    size_t n = hub->obs->read_events(&hub->cursor, buf, 512, &lost);
    hub->lost += lost;
    for (size_t i = 0; i < n; ++i) hub->events.push_back(buf[i]);
    if (n < 512) break;
  }
  while (hub->events.size() > kMaxEventsPerHub) hub->events.pop_front();
  if (now - hub->rate_ns >= 1'000'000'000ull) {
    double dt = static_cast<double>(now - hub->rate_ns) / 1e9;
    hub->bubbles_per_sec = static_cast<double>(hub->snap.bubbles - std::min(hub->snap.bubbles,
                                                                            hub->rate_bubbles)) / dt;
    hub->rate_bubbles = hub->snap.bubbles;
    hub->rate_ns = now;
  }
  reconcile_tasks(hub);
  enforce_hub(hub, now);
}

int64_t Agent::match_task(Hub* hub, const core::TaskSnapshot& t) {
  ProcStat ps;
  bool have = read_proc_stat(t.pid, &ps);
  for (auto& [id, row] : tasks_) {
    if (state_is_final(row.state) || row.state == "queued" || row.pid <= 0) continue;
    if (row.origin == "attached") {
      if (row.pid == t.pid && row.hub == hub->name) return id;
      continue;
    }
    // The launch wrapper leads the task's process group; the task may be its child or any
    // descendant that kept the group.
    if (row.pid == t.pid || (have && (ps.pgid == row.pid || ps.ppid == row.pid))) return id;
  }
  return 0;
}

bool Agent::adoptable(pid_t pid) const {
  ProcStat ps;
  // Dead (or dying) already: the slot is one the trainer has not reclaimed yet.
  if (!read_proc_stat(pid, &ps) || ps.state == 'Z' || ps.state == 'X') return false;
  // In the process group of a task we launched whose wrapper ended within the last minute: it
  // is being taken down with its group (the wrapper's death signal), not a new task.
  const int64_t now = wall_ms();
  for (const auto& [id, row] : tasks_)
    if (row.origin != "attached" && row.pid > 0 && ps.pgid == row.pid &&
        (!state_is_final(row.state) || now - row.ended_at < kGroupEndingMs))
      return false;
  auto recent = recent_groups_.find(ps.pgid);  // its row may be deleted already
  return recent == recent_groups_.end() || now - recent->second >= kGroupEndingMs;
}

void Agent::reconcile_tasks(Hub* hub) {
  std::set<uint64_t> present;
  // Harvested time from the hub's own total, which also counts a task that ended between two
  // snapshots. A new trainer on the same hub name starts its total from zero.
  const uint64_t total = hub->snap.task_ns_in_bubbles;
  if (hub->snap.trainer_pid != hub->harvest_pid || total < hub->harvest_seen) {
    hub->harvest_pid = hub->snap.trainer_pid;
    hub->harvest_seen = 0;
  }
  hub->harvested_ns += total - hub->harvest_seen;
  hub->harvest_seen = total;
  for (const core::TaskSnapshot& t : hub->snap.tasks) {
    present.insert(t.id);
    hub->slot_names[static_cast<uint16_t>(t.slot)] = t.name;
    int64_t rid = 0;
    auto it = hub->task_rows.find(t.id);
    if (it != hub->task_rows.end()) {
      rid = it->second;
    } else {
      rid = match_task(hub, t);
      if (rid == 0 && !adoptable(t.pid)) continue;  // looked at again in the next snapshot
      if (rid == 0) {
        // Started outside the agent: adopt it so it is shown, counted and enforced.
        TaskRow row;
        row.origin = "attached";
        row.state = "running";
        row.spec.name = t.name;
        row.spec.hub = hub->name;
        row.spec.priority = t.priority;
        row.spec.mem_need = t.mem_need;
        row.hub = hub->name;
        row.pid = t.pid;
        ProcStat ps;
        if (read_proc_stat(t.pid, &ps)) row.pid_start = ps.start_time;
        row.submitted_at = row.started_at = wall_ms();
        row.attempts = 1;
        row.message = "attached to the hub by itself";
        // Without an id it cannot be kept: tried again a second later, said once.
        auto after = hub->adopt_after.find(t.id);
        if (after != hub->adopt_after.end() && uv_now(loop_) < after->second) continue;
        if (!store_.insert_task(&row)) {
          if (after == hub->adopt_after.end())
            agent_log("cannot record attached task %s (pid %d): %s; trying again every second",
                      t.name.c_str(), t.pid, store_.last_error().c_str());
          hub->adopt_after[t.id] = uv_now(loop_) + 1000;
          continue;
        }
        hub->adopt_after.erase(t.id);
        rid = row.id;
        tasks_[rid] = row;
        agent_log("adopted task %s (pid %d) on hub %s as #%lld", t.name.c_str(), t.pid,
                  hub->name.c_str(), static_cast<long long>(rid));
      }
      hub->task_rows[t.id] = rid;
    }
    auto rit = tasks_.find(rid);
    if (rit != tasks_.end()) {
      TaskRow& row = rit->second;
      // A process may hold several slots (of this hub or others), all one row: its figures
      // are their sum, and a slot that leaves keeps its share.
      update_figures(&row, {hub->name, t.id}, {t.steps, t.ns_in_bubbles, t.ns_outside});
      if (row.origin == "attached") {
        if (t.state == core::TaskRunState::kFailed) row.message = "reported failure";
        if (t.state == core::TaskRunState::kFinished) row.message = "reported it finished";
      }
    }
  }
  std::set<int64_t> still_held;  // rows one of whose slots is still on the hub
  for (const auto& [hid, rid] : hub->task_rows)
    if (present.count(hid)) still_held.insert(rid);
  for (auto it = hub->task_rows.begin(); it != hub->task_rows.end();) {
    if (present.count(it->first)) {
      ++it;
      continue;
    }
    auto rit = tasks_.find(it->second);
    if (rit != tasks_.end() && rit->second.state == "stopped") {
      // Its slot left while enforcement had it stopped (its trainer killed it at a revoke's
      // deadline, say): the continue that the next bubble would have brought never comes, and
      // a launched task's wrapper, stopped with its group, could not even reap it.
      rit->second.message = "continued: its slot left the hub while it was stopped";
      continue_stopped(&rit->second, hub->name,
                       "its slot left hub " + hub->name + " while it was stopped");
    }
    // A process that left one of its slots and keeps another has not detached.
    if (rit != tasks_.end() && rit->second.origin == "attached" &&
        !state_is_final(rit->second.state) && !still_held.count(it->second)) {
      TaskRow& row = rit->second;
      bool failed = row.message == "reported failure";
      finish_row(&row, failed ? "failed" : "finished", "detached from hub " + hub->name);
    }
    if (rit != tasks_.end()) slot_gone(&rit->second, {hub->name, it->first});
    hub->enforce.erase(it->first);
    it = hub->task_rows.erase(it);
  }
  if (!hub->reconciled) {
    hub->reconciled = true;
    // A task that attached by itself and left while the agent was down is in no snapshot, and
    // an agent restarted meanwhile would otherwise keep its row running for good.
    std::set<int64_t> shown;
    for (const auto& [hid, rid] : hub->task_rows) shown.insert(rid);
    for (auto& [id, row] : tasks_)
      if (row.origin == "attached" && row.hub == hub->name && !state_is_final(row.state) &&
          !shown.count(id))
        finish_row(&row, "finished", "detached from hub " + hub->name +
                                         " while the agent was down");
  }
}

void Agent::enforce_hub(Hub* hub, uint64_t now) {
  HubMoment moment{hub->snap.in_bubble, hub->snap.bubble_seq};
  for (const core::TaskSnapshot& t : hub->snap.tasks) {
    auto it = hub->task_rows.find(t.id);
    if (it == hub->task_rows.end()) continue;
    auto rit = tasks_.find(it->second);
    if (rit == tasks_.end() || state_is_final(rit->second.state)) continue;
    TaskRow& row = rit->second;
    EnforceState& st = hub->enforce[t.id];
    if (t.bad && !st.marked_bad) {
      // The trainer validates every word a task writes and stops starting one that corrupted
      // its slot; the agent records that, once, and shows it on the task.
      st.marked_bad = true;
      // A stopping task's message says why it stops (a cancel), which a restarted agent reads.
      if (row.state != "stopping")
        row.message = "marked bad: it corrupted its slot, and its trainer no longer starts it";
      record(&row, row.origin == "attached" ? row.pid : t.pid, hub->name, "bad",
             "the trainer found the task's slot corrupt (it wrote outside the protocol)");
      save(row);
    }
    // A task being stopped has the stop's own escalation (its timer ends in SIGKILL): stopping it
    // again would only delay that, and "running" would hide the stop from an agent restarted
    // before it is gone.
    if (row.state == "stopping" || st.unsignalable) continue;
    Verdict v = enforce_step(cfg_.enforce, &st, moment, {t.pause_requested_ns, t.pause_acked_ns, t.started},
                             now);
    if (v == Verdict::kNone) continue;
    if (in_trainer_process(row)) {
      // A task on a thread of its trainer (the C ABI allows it): a signal would stop or kill
      // the trainer, and every rank with it. Its trainer decides about its threads; the agent
      // records the first violation and signals nothing.
      if (!st.in_trainer_noted && (v == Verdict::kStop || v == Verdict::kKill)) {
        st.in_trainer_noted = true;
        note_unenforced(&row, st, hub, row.pid, "runs inside its trainer's process",
                        "the task runs inside its trainer's process (pid " +
                            std::to_string(row.pid) + "), which the agent never signals");
      }
      continue;
    }
    row.violations = std::max(row.violations, st.violations);
    char detail[200];
    switch (v) {
      case Verdict::kStop:
        snprintf(detail, sizeof detail,
                 "pause not acked within %.1f ms (hub at bubble %llu; violation %u of %u)",
                 static_cast<double>(cfg_.enforce.grace_ns) / 1e6,
                 static_cast<unsigned long long>(hub->snap.bubble_seq), st.violations,
                 cfg_.enforce.kill_after);
        if (!signal_task(row, SIGSTOP)) {
          unsignalable(&row, &st, hub, t.pid);
          continue;
        }
        row.state = "stopped";
        row.message = "stopped for not pausing: continued at its hub's next bubble";
        break;
      case Verdict::kContinue:
        snprintf(detail, sizeof detail, "bubble %llu began",
                 static_cast<unsigned long long>(hub->snap.bubble_seq));
        signal_task(row, SIGCONT);
        row.state = "running";
        break;
      case Verdict::kKill: {
        snprintf(detail, sizeof detail, "pause not acked %u times (limit %u)", st.violations,
                 cfg_.enforce.kill_after);
        if (!signal_task(row, SIGKILL)) {
          unsignalable(&row, &st, hub, t.pid);
          continue;
        }
        LiveTask* lt = live(row.id);
        if (lt) lt->killed_by_agent = true;
        if (row.origin == "attached") {
          row.signal = SIGKILL;
          finish_row(&row, "killed", detail);
        } else {
          row.message = detail;
        }
        break;
      }
      case Verdict::kNone: break;
    }
    record(&row, row.origin == "attached" ? row.pid : t.pid, hub->name, verdict_name(v), detail);
    save(row);
  }
}

void Agent::unsignalable(TaskRow* row, EnforceState* st, Hub* hub, int32_t pid) {
  // Not stopped, nor killed, whatever the verdict: recorded once, and enforced no more (its
  // trainer still pauses it; only the agent's signals cannot reach it).
  st->unsignalable = true;
  note_unenforced(row, *st, hub, row->origin == "attached" ? row->pid : pid,
                  "runs as another user than the agent's",
                  "the agent may not signal pid " + std::to_string(row->pid) +
                      " (EPERM: another user's process): run the agent as root or as the "
                      "task's user to enforce it");
}

void Agent::note_unenforced(TaskRow* row, const EnforceState& st, Hub* hub, int32_t pid,
                            const std::string& why, const std::string& detail) {
  row->violations = std::max(row->violations, st.violations);
  if (row->state != "stopping") row->message = "ignores pauses, but " + why + ": not signalled";
  record(row, pid, hub->name, "unenforced",
         "pause not acked within the grace period; " + detail);
  save(*row);
}

void Agent::update_timers() {
  if (closing_ || !tick_) return;
  bool any_hub = false, any_task = false;
  for (const auto& [name, hub] : hubs_) {
    if (!hub->alive) continue;
    any_hub = true;
    if (!hub->snap.tasks.empty()) any_task = true;
  }
  for (const auto& [id, row] : tasks_) {
    if (row.state == "running" || row.state == "stopped" || row.state == "stopping") {
      auto it = hubs_.find(row.hub);
      if (it != hubs_.end() && it->second->alive) any_task = true;
    }
  }
  // A re-adopted task the agent could not watch yet (out of descriptors) is tried again at
  // every tick: the tick runs while there is one, hub or not.
  bool unwatched = false;
  for (const auto& [id, lt] : live_) unwatched |= !lt->exited && !lt->proc && lt->pidfd < 0;
  uint64_t want = any_task ? cfg_.check_interval_ns
                  : any_hub || unwatched ? cfg_.sample_interval_ns
                                         : 0;
  if (want == tick_interval_) return;
  tick_interval_ = want;
  if (want == 0) {
    uv_timer_stop(tick_);
    return;
  }
  uint64_t ms = std::max<uint64_t>(1, want / 1'000'000);
  uv_timer_start(tick_, HubCallbacks::on_tick, ms, ms);
}

}  // namespace bb::daemon
