#include "daemon/placement.h"

#include "core/error.h"
#include "core/paths.h"

#include <cstdlib>

namespace bb::daemon {

namespace {
constexpr uint64_t kUnknown = UINT64_MAX;

bool fits(const TaskSpec& spec, const HubCandidate& h, uint64_t* left, std::string* why) {
  if (!h.alive) {
    *why = "hub " + h.name + " is not running";
    return false;
  }
  if (h.draining) {
    *why = "hub " + h.name + " is draining";
    return false;
  }
  if (h.free_slots == 0) {
    *why = "hub " + h.name + " has no free task slot";
    return false;
  }
  if (spec.mem_need == 0) {
    *left = h.free_mem == kUnknown ? kUnknown : (h.free_mem > h.granted ? h.free_mem - h.granted : 0);
    return true;
  }
  if (!h.had_bubble) {
    *why = "hub " + h.name + " has not reported its free memory yet";
    return false;
  }
  if (h.free_mem == kUnknown) {
    *left = kUnknown;
    return true;
  }
  uint64_t room = h.free_mem > h.granted ? h.free_mem - h.granted : 0;
  if (room < spec.mem_need) {
    *why = "hub " + h.name + " has " + std::to_string(room >> 20) + " MiB free for side tasks, " +
           "the task needs " + std::to_string(spec.mem_need >> 20) + " MiB";
    return false;
  }
  *left = room - spec.mem_need;
  return true;
}
}  // namespace

bool parse_hub_name(const std::string& s, std::string* job, uint32_t* rank, std::string* why) {
  auto refuse = [why](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  size_t colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 >= s.size()) {
    return refuse("it has no JOB part or no RANK after the last ':'");
  }
  std::string r = s.substr(colon + 1);
  for (char c : r) {
    if (c < '0' || c > '9') return refuse("rank \"" + r + "\" is not a decimal number");
  }
  // Longer than any valid rank: refused before strtoul could wrap.
  if (r.size() > 5) return refuse("rank " + r + " is out of range 0..65535");
  unsigned long v = std::strtoul(r.c_str(), nullptr, 10);
  if (bb::core::check_rank(static_cast<uint32_t>(v)) != BB_OK) {
    return refuse(bb::core::last_error());
  }
  // The same rules as the library's, so the agent never waits for a hub that cannot exist.
  std::string j = s.substr(0, colon);
  if (bb::core::check_job_id(j.c_str()) != BB_OK) return refuse(bb::core::last_error());
  bb::core::clear_error();
  *job = std::move(j);
  *rank = static_cast<uint32_t>(v);
  return true;
}

PlaceResult place_task(const TaskSpec& spec, const std::vector<HubCandidate>& hubs) {
  PlaceResult res;
  if (spec.hub != "auto" && !spec.hub.empty()) {
    for (size_t i = 0; i < hubs.size(); ++i) {
      if (hubs[i].name != spec.hub) continue;
      uint64_t left;
      if (fits(spec, hubs[i], &left, &res.reason)) res.hub = static_cast<int>(i);
      return res;
    }
    res.reason = "hub " + spec.hub + " is not running: waiting for its trainer";
    return res;
  }
  uint64_t best_left = 0;
  std::string why;
  for (size_t i = 0; i < hubs.size(); ++i) {
    uint64_t left = 0;
    std::string w;
    if (!fits(spec, hubs[i], &left, &w)) {
      if (why.empty() || hubs[i].alive) why = w;
      continue;
    }
    if (res.hub < 0) {
      res.hub = static_cast<int>(i);
      best_left = left;
      continue;
    }
    const HubCandidate& b = hubs[static_cast<size_t>(res.hub)];
    const HubCandidate& h = hubs[i];
    bool better = h.tasks < b.tasks ||
                  (h.tasks == b.tasks &&
                   (left > best_left || (left == best_left && h.name < b.name)));
    if (better) {
      res.hub = static_cast<int>(i);
      best_left = left;
    }
  }
  if (res.hub < 0) {
    res.reason = hubs.empty() ? "no hub is running: start a trainer, or wait for one"
                              : "no hub fits: " + why;
  } else {
    res.reason.clear();
  }
  return res;
}

}  // namespace bb::daemon
