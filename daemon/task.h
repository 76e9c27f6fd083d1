// The agent's record of a side task: what was submitted and what became of it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace bb::daemon {

struct TaskSpec {
  std::string name;
  std::vector<std::string> argv;
  std::vector<std::string> env;  // KEY=VALUE
  std::string cwd;
  std::string hub = "auto";      // "auto" or "JOB:RANK"
  int32_t gpu = -1;
  int32_t priority = 0;
  uint64_t mem_need = 0;
  int32_t mps_priority = -1;
  std::string mps_mem_limit;
};

// Task states. Live states: queued, running, stopped (SIGSTOPped by enforcement), stopping
// (cancel or re-placement asked, waiting for the exit). Final: finished, failed, killed,
// cancelled, lost (gone while the agent was down, with no recorded status). On disk only:
// launching (recorded before the spawn; a restarted agent settles it, see settle_launch).
inline bool state_is_final(const std::string& s) {
  return s == "finished" || s == "failed" || s == "killed" || s == "cancelled" || s == "lost";
}

// What a task did: steps, and its step time inside and past bubbles.
struct TaskFigures {
  uint64_t steps = 0;
  uint64_t ns_in_bubbles = 0;
  uint64_t ns_outside = 0;
};

struct TaskRow {
  int64_t id = 0;
  TaskSpec spec;
  std::string state = "queued";
  std::string origin = "submitted";  // or "attached"
  std::string hub;                   // JOB:RANK placed on
  pid_t pid = 0;                     // the launch wrapper (process group leader); or the
                                     // attached task's own pid
  uint64_t pid_start = 0;            // its start time, to tell a reused pid apart
  int32_t exit_code = 0;
  int32_t signal = 0;
  uint32_t violations = 0;
  uint32_t attempts = 0;
  int64_t submitted_at = 0;          // Unix ms
  int64_t started_at = 0;
  int64_t ended_at = 0;
  std::string message;
  uint64_t steps = 0;
  uint64_t ns_in_bubbles = 0;
  uint64_t ns_outside = 0;  // its step time past bubbles' ends
  std::string requeue_note;  // why a launched task waits again (kept in memory only)

  // In memory only. A task's figures add up every hub slot it held, over all its attempts,
  // and never go back: each slot's latest counts (key: hub name, the hub's task id), the counts
  // of slots gone, and the figures the row had when the agent loaded it (a restarted agent
  // sees only the slots still held). See update_figures().
  std::map<std::pair<std::string, uint64_t>, TaskFigures> slot_figures;
  TaskFigures slots_gone;
  TaskFigures loaded;
};

// Records slot `key`'s latest counts in row (a slot whose counts went back is a new slot: the
// old one's go to slots_gone) and sets the row's figures.
void update_figures(TaskRow* row, const std::pair<std::string, uint64_t>& key,
                    const TaskFigures& now);
// The slot left: its counts stay in the row's figures, its entry goes.
void slot_gone(TaskRow* row, const std::pair<std::string, uint64_t>& key);

struct ActionRow {
  int64_t at_ms = 0;
  int64_t task = 0;
  pid_t pid = 0;
  std::string hub;
  std::string action;
  std::string detail;
};

int64_t wall_ms();

}  // namespace bb::daemon
