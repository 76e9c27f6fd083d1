// Client-side rendering of the hubs' event logs: Chrome trace JSON (opens in Perfetto and
// chrome://tracing) and an SVG timeline of the last seconds.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace bb::daemon {

struct TraceEvent {
  uint64_t ts_ns = 0;
  uint16_t type = 0;  // core::EventType values
  uint16_t slot = 0;
  uint64_t a = 0, b = 0;
};

struct HubTrace {
  std::string hub;
  std::map<uint16_t, std::string> slot_names;
  std::vector<TraceEvent> events;  // oldest first
  uint64_t lost = 0;
};

std::string render_trace_json(const std::vector<HubTrace>& hubs, uint64_t now_ns);
std::string render_timeline_svg(const std::vector<HubTrace>& hubs, uint64_t now_ns,
                                double seconds);
std::string json_escape(const std::string& s);

}  // namespace bb::daemon
