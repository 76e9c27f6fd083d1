#include "daemon/render.h"

#include <stdio.h>

#include <algorithm>

namespace bb::daemon {

namespace {

// Event types as the hub logs them (core/observer.h EventType); kept as numbers here so the
// CLI does not depend on the hub library.
enum : uint16_t {
  kBubbleBegin = 1,
  kBubbleEnd = 2,
  kTaskStart = 3,
  kTaskPause = 4,
  kTaskStep = 5,
  kTaskAttach = 6,
  kTaskDetach = 7,
  kTaskFinish = 8
};

std::string us(uint64_t ns, uint64_t base) {
  char buf[48];
  snprintf(buf, sizeof buf, "%.3f", static_cast<double>(ns - std::min(ns, base)) / 1e3);
  return buf;
}

std::string slot_name(const HubTrace& h, uint16_t slot) {
  auto it = h.slot_names.find(slot);
  return it == h.slot_names.end() ? "slot " + std::to_string(slot) : it->second;
}

// A step's [start, start + duration). observer.h documents a = start, b = duration; the hub
// writes ts = start, a = duration (b = the part past the bubble's end). A start time is close
// to ts while a duration is far smaller, which tells the two apart.
void step_span(const TraceEvent& e, uint64_t* start, uint64_t* dur) {
  if (e.a > e.ts_ns / 2) {
    *start = e.a;
    *dur = e.b;
  } else {
    *start = e.ts_ns;
    *dur = e.a;
  }
}

struct Span {
  uint64_t begin, end;
  uint16_t slot;
  uint64_t a, b;
};

// Bubbles as [begin, end) spans; one still open at now ends at now.
std::vector<Span> bubbles(const HubTrace& h, uint64_t now_ns) {
  std::vector<Span> out;
  bool open = false;
  Span cur{};
  for (const TraceEvent& e : h.events) {
    if (e.type == kBubbleBegin) {
      if (open) out.push_back({cur.begin, e.ts_ns, 0, cur.a, cur.b});
      open = true;
      cur = {e.ts_ns, 0, 0, e.a, e.b};
    } else if (e.type == kBubbleEnd) {
      uint64_t begin = open ? cur.begin : e.ts_ns - std::min(e.ts_ns, e.a);
      out.push_back({begin, e.ts_ns, 0, open ? cur.a : 0, open ? cur.b : 0});
      open = false;
    }
  }
  if (open) out.push_back({cur.begin, std::max(now_ns, cur.begin), 0, cur.a, cur.b});
  return out;
}

std::string xml(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o.push_back(c);
    }
  }
  return o;
}

}  // namespace

std::string json_escape(const std::string& s) {
  std::string o;
  for (unsigned char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\t': o += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          snprintf(buf, sizeof buf, "\\u%04x", c);
          o += buf;
        } else {
          o.push_back(static_cast<char>(c));
        }
    }
  }
  return o;
}

std::string render_trace_json(const std::vector<HubTrace>& hubs, uint64_t now_ns) {
  uint64_t base = now_ns;
  for (const auto& h : hubs) {
    if (!h.events.empty()) base = std::min(base, h.events.front().ts_ns);
  }
  std::string o = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto add = [&](const std::string& ev) {
    if (!first) o += ",\n";
    first = false;
    o += ev;
  };
  for (size_t i = 0; i < hubs.size(); ++i) {
    const HubTrace& h = hubs[i];
    std::string pid = std::to_string(i + 1);
    add("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid +
        ",\"args\":{\"name\":\"hub " + json_escape(h.hub) + "\"}}");
    add("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid +
        ",\"tid\":0,\"args\":{\"name\":\"bubbles\"}}");
    for (const auto& [slot, name] : h.slot_names) {
      add("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" +
          std::to_string(slot + 1) + ",\"args\":{\"name\":\"" + json_escape(name) + "\"}}");
    }
    for (const Span& b : bubbles(h, now_ns)) {
      std::string args = "\"expected_ms\":" + us(b.a, 0) + "e-3";
      if (b.b != UINT64_MAX) args += ",\"free_mem\":" + std::to_string(b.b);
      add("{\"name\":\"bubble\",\"cat\":\"bubble\",\"ph\":\"X\",\"pid\":" + pid +
          ",\"tid\":0,\"ts\":" + us(b.begin, base) + ",\"dur\":" + us(b.end, b.begin) +
          ",\"args\":{" + args + "}}");
    }
    for (const TraceEvent& e : h.events) {
      std::string tid = std::to_string(e.slot + 1);
      std::string name = json_escape(slot_name(h, e.slot));
      switch (e.type) {
        case kTaskStep: {
          uint64_t start, dur;
          step_span(e, &start, &dur);
          add("{\"name\":\"step\",\"cat\":\"task\",\"ph\":\"X\",\"pid\":" + pid + ",\"tid\":" +
              tid + ",\"ts\":" + us(start, base) + ",\"dur\":" + us(dur, 0) +
              ",\"args\":{\"task\":\"" + name + "\"}}");
          break;
        }
        case kTaskStart:
        case kTaskPause: {
          const char* what = e.type == kTaskStart ? "start" : "pause";
          add(std::string("{\"name\":\"") + what + "\",\"cat\":\"task\",\"ph\":\"i\",\"s\":\"t\"," +
              "\"pid\":" + pid + ",\"tid\":" + tid + ",\"ts\":" + us(e.ts_ns, base) +
              ",\"args\":{\"bubble\":" + std::to_string(e.a) + ",\"latency_us\":" + us(e.b, 0) +
              "}}");
          break;
        }
        case kTaskAttach:
        case kTaskDetach:
        case kTaskFinish: {
          const char* what = e.type == kTaskAttach   ? "attach"
                             : e.type == kTaskDetach ? (e.b ? "died" : "detach")
                                                     : (e.a ? "failed" : "finished");
          add(std::string("{\"name\":\"") + what + "\",\"cat\":\"task\",\"ph\":\"i\",\"s\":\"t\"," +
              "\"pid\":" + pid + ",\"tid\":" + tid + ",\"ts\":" + us(e.ts_ns, base) + "}");
          break;
        }
        default: break;
      }
    }
  }
  o += "\n]}\n";
  return o;
}

std::string render_timeline_svg(const std::vector<HubTrace>& hubs, uint64_t now_ns,
                                double seconds) {
  const int label_w = 150, plot_w = 1000, lane_h = 44, top = 40, gap = 8;
  const int height = top + static_cast<int>(hubs.size()) * (lane_h + gap) + 30;
  const uint64_t span = static_cast<uint64_t>(seconds * 1e9);
  const uint64_t t0 = now_ns > span ? now_ns - span : 0;
  auto x = [&](uint64_t t) {
    t = std::clamp(t, t0, now_ns);
    return label_w + static_cast<double>(t - t0) / static_cast<double>(span) * plot_w;
  };
  char buf[512];
  std::string o;
  snprintf(buf, sizeof buf,
           "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
           "font-family=\"sans-serif\" font-size=\"12\">\n"
           "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
           "<text x=\"10\" y=\"20\" font-size=\"14\">bubbles (blue) and side-task steps "
           "(orange), last %.1f s</text>\n",
           label_w + plot_w + 20, height, seconds);
  o += buf;
  for (int s = 0; s <= static_cast<int>(seconds); ++s) {
    double xs = label_w + (seconds - s) / seconds * plot_w;
    snprintf(buf, sizeof buf,
             "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#ddd\"/>"
             "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\" fill=\"#666\">-%ds</text>\n",
             xs, top - 4, xs, height - 24, xs, height - 10, s);
    o += buf;
  }
  for (size_t i = 0; i < hubs.size(); ++i) {
    const HubTrace& h = hubs[i];
    int y = top + static_cast<int>(i) * (lane_h + gap);
    snprintf(buf, sizeof buf,
             "<g><title>hub %s</title><rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" "
             "fill=\"#f4f4f4\"/><text x=\"8\" y=\"%d\">%s</text></g>\n",
             xml(h.hub).c_str(), label_w, y, plot_w, lane_h, y + lane_h / 2 + 4,
             xml(h.hub).c_str());
    o += buf;
    for (const Span& b : bubbles(h, now_ns)) {
      if (b.end < t0) continue;
      double x0 = x(b.begin), x1 = x(b.end);
      snprintf(buf, sizeof buf,
               "<rect class=\"bubble\" x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" "
               "fill=\"#9cc3e6\"><title>bubble %.3f ms</title></rect>\n",
               x0, y, std::max(0.5, x1 - x0), lane_h, static_cast<double>(b.end - b.begin) / 1e6);
      o += buf;
    }
    for (const TraceEvent& e : h.events) {
      if (e.type != kTaskStep) continue;
      uint64_t start, dur;
      step_span(e, &start, &dur);
      if (start + dur < t0) continue;
      double x0 = x(start), x1 = x(start + dur);
      snprintf(buf, sizeof buf,
               "<rect class=\"step\" x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" "
               "fill=\"#f39c3c\"><title>%s step %.3f ms</title></rect>\n",
               x0, y + lane_h / 4, std::max(0.5, x1 - x0), lane_h / 2,
               xml(slot_name(h, e.slot)).c_str(), static_cast<double>(dur) / 1e6);
      o += buf;
    }
  }
  o += "</svg>\n";
  return o;
}

}  // namespace bb::daemon
