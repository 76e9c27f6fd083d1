// Placement: which hub a queued task goes to.
//
// The trainer-side policy in core/ ranks tasks for one bubble of one hub; placement is the
// other direction (one task, many hubs) and decides for the task's whole life, so it lives here.
// Rules, in order:
//   1. a task names a hub ("JOB:RANK") or "auto";
//   2. a hub is a candidate if it is alive, not draining, has a free task slot and the task's
//      memory fits: its memNeed <= free memory of the hub's last bubble minus the memory already
//      granted to the tasks placed on it (tasks keep their allocations between bubbles, so grants
//      add up). A hub that has not had a bubble yet does not know its free memory and takes only
//      tasks that need none; one whose trainer reports BB_MEM_UNKNOWN takes any task, as the
//      trainer itself does;
//   3. among candidates: fewest tasks first (fairness across GPUs), then the most memory left
//      after placing, then the name (deterministic);
//   4. no candidate: the task stays queued, with the reason.
// Queued tasks are considered by priority (higher first), then submission order; a task that
// fits nowhere does not hold back smaller ones behind it.
#pragma once

#include "core/clock.h"  // add_sat: memory needs are the tasks' word, summed without wrapping
#include "daemon/task.h"

#include <cstdint>
#include <string>
#include <vector>

namespace bb::daemon {

using bb::core::add_sat;

struct HubCandidate {
  std::string name;       // JOB:RANK
  bool alive = false;
  bool draining = false;
  bool had_bubble = false;
  uint64_t free_mem = UINT64_MAX;  // UINT64_MAX = unknown
  uint64_t granted = 0;
  uint32_t tasks = 0;
  uint32_t free_slots = 0;
};

struct PlaceResult {
  int hub = -1;        // index into the candidates, -1 = keep queued
  std::string reason;  // why it stays queued
};

PlaceResult place_task(const TaskSpec& spec, const std::vector<HubCandidate>& hubs);

// Parses "JOB:RANK", holding JOB and RANK to the library's rules (bb::core::check_job_id,
// check_rank). False if malformed, with the reason in *why when given.
bool parse_hub_name(const std::string& s, std::string* job, uint32_t* rank,
                    std::string* why = nullptr);

}  // namespace bb::daemon
