// Prometheus text exposition, served on loopback by the agent's own loop. Values are read from
// the hubs at request time, so the endpoint costs nothing between scrapes.
#include "daemon/agent.h"

#include <string.h>

#include <algorithm>
#include <vector>

namespace bb::daemon {

namespace {

constexpr size_t kMaxRequestBytes = 8192;
// The port is open to every local user (loopback TCP has no peer credentials): a bounded number
// of connections, each closed after a deadline, so idle ones cannot use up the agent's
// descriptors (which it needs to launch tasks and watch them).
constexpr size_t kMaxHttpConns = 16;
constexpr uint64_t kHttpDeadlineMs = 5000;

struct HttpConn {
  uv_tcp_t tcp;
  uv_timer_t deadline;
  Agent* agent = nullptr;
  std::string request;
  bool done = false;
  bool closing = false;
  int handles = 1;  // tcp, and the deadline once started
};

struct HttpWrite {
  uv_write_t req;
  std::string body;
};

std::string label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

std::string num(double v) {
  char buf[64];
  snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void close_http(HttpConn* c) {
  if (c->closing) return;
  c->closing = true;
  auto closed = [](uv_handle_t* h) {
    auto* c = static_cast<HttpConn*>(h->data);
    if (--c->handles > 0) return;
    c->agent->http_conns_.erase(c);
    delete c;
  };
  uv_close(reinterpret_cast<uv_handle_t*>(&c->tcp), closed);
  if (c->handles == 2) uv_close(reinterpret_cast<uv_handle_t*>(&c->deadline), closed);
}

void respond(HttpConn* c, const char* status, const std::string& type, const std::string& body) {
  c->done = true;
  uv_read_stop(reinterpret_cast<uv_stream_t*>(&c->tcp));
  auto* w = new HttpWrite;
  w->body = std::string("HTTP/1.1 ") + status + "\r\nContent-Type: " + type +
            "\r\nContent-Length: " + std::to_string(body.size()) +
            "\r\nConnection: close\r\n\r\n" + body;
  w->req.data = c;
  uv_buf_t buf = uv_buf_init(w->body.data(), static_cast<unsigned>(w->body.size()));
  int rc = uv_write(&w->req, reinterpret_cast<uv_stream_t*>(&c->tcp), &buf, 1,
                    [](uv_write_t* req, int) {
                      auto* w = reinterpret_cast<HttpWrite*>(req);
                      close_http(static_cast<HttpConn*>(w->req.data));
                      delete w;
                    });
  if (rc < 0) {
    delete w;
    close_http(c);
  }
}

void on_http_read(uv_stream_t* s, ssize_t nread, const uv_buf_t* buf) {
  auto* c = static_cast<HttpConn*>(s->data);
  if (nread > 0) c->request.append(buf->base, static_cast<size_t>(nread));
  delete[] buf->base;
  if (c->done) return;
  if (nread < 0) {
    close_http(c);
    return;
  }
  if (c->request.size() > kMaxRequestBytes) {
    respond(c, "431 Request Header Fields Too Large", "text/plain", "request too large\n");
    return;
  }
  if (c->request.find("\r\n\r\n") == std::string::npos &&
      c->request.find("\n\n") == std::string::npos) {
    return;
  }
  size_t sp1 = c->request.find(' ');
  size_t sp2 = sp1 == std::string::npos ? sp1 : c->request.find(' ', sp1 + 1);
  std::string method = c->request.substr(0, sp1);
  std::string path = sp2 == std::string::npos ? "" : c->request.substr(sp1 + 1, sp2 - sp1 - 1);
  if (method != "GET") {
    respond(c, "405 Method Not Allowed", "text/plain", "only GET is served\n");
  } else if (path == "/metrics") {
    ++c->agent->metrics_requests_;
    respond(c, "200 OK", "text/plain; version=0.0.4; charset=utf-8", c->agent->render_metrics());
  } else if (path == "/") {
    respond(c, "200 OK", "text/plain", "bubbled: metrics at /metrics\n");
  } else {
    respond(c, "404 Not Found", "text/plain", "not found: metrics are at /metrics\n");
  }
}

void on_http_connection(uv_stream_t* server, int status) {
  if (status < 0) return;
  auto* c = new HttpConn;
  c->agent = static_cast<Agent*>(server->data);
  c->agent->http_conns_.insert(c);
  uv_tcp_init(server->loop, &c->tcp);
  c->tcp.data = c;
  if (uv_accept(server, reinterpret_cast<uv_stream_t*>(&c->tcp)) != 0 ||
      c->agent->http_conns_.size() > kMaxHttpConns) {
    close_http(c);
    return;
  }
  uv_timer_init(server->loop, &c->deadline);
  c->deadline.data = c;
  c->handles = 2;
  uv_timer_start(
      &c->deadline, [](uv_timer_t* t) { close_http(static_cast<HttpConn*>(t->data)); },
      kHttpDeadlineMs, 0);
  uv_read_start(
      reinterpret_cast<uv_stream_t*>(&c->tcp),
      [](uv_handle_t*, size_t suggested, uv_buf_t* buf) {
        *buf = uv_buf_init(new char[suggested], static_cast<unsigned>(suggested));
      },
      on_http_read);
}

}  // namespace

void close_all_http(Agent* agent) {
  std::vector<void*> all(agent->http_conns_.begin(), agent->http_conns_.end());
  for (void* c : all) close_http(static_cast<HttpConn*>(c));
}

std::string Agent::start_metrics() {
  if (cfg_.metrics_port < 0) return "";
  metrics_ = new uv_tcp_t;
  uv_tcp_init(loop_, metrics_);
  metrics_->data = this;
  sockaddr_in addr;
  uv_ip4_addr("127.0.0.1", cfg_.metrics_port, &addr);
  int rc = uv_tcp_bind(metrics_, reinterpret_cast<const sockaddr*>(&addr), 0);
  if (rc == 0) rc = uv_listen(reinterpret_cast<uv_stream_t*>(metrics_), 16, on_http_connection);
  if (rc < 0) {
    return "cannot serve metrics on 127.0.0.1:" + std::to_string(cfg_.metrics_port) + ": " +
           uv_strerror(rc) + " (choose another --metrics-port, 0 for any free port, or off)";
  }
  sockaddr_storage bound{};
  int len = sizeof bound;
  uv_tcp_getsockname(metrics_, reinterpret_cast<sockaddr*>(&bound), &len);
  metrics_port_ = ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return "";
}

std::string Agent::render_metrics() {
  refresh_all();
  std::string o;
  auto head = [&](const char* name, const char* type, const char* help) {
    o += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  // A metric without labels: its head and its one sample.
  auto single = [&](const char* name, const char* type, const char* help, uint64_t value) {
    head(name, type, help);
    o += std::string(name) + " " + std::to_string(value) + "\n";
  };
  uint32_t live_hubs = 0;
  for (const auto& [n, h] : hubs_) live_hubs += h->alive;
  single("bubble_hubs", "gauge", "Hubs (trainer ranks) the agent observes.", live_hubs);

  head("bubble_bubbles_total", "counter", "Bubbles the trainer reported.");
  for (const auto& [n, h] : hubs_) {
    o += "bubble_bubbles_total{hub=\"" + label(n) + "\"} " + std::to_string(h->snap.bubbles) + "\n";
  }
  head("bubble_seconds_total", "counter", "Summed length of closed bubbles.");
  for (const auto& [n, h] : hubs_) {
    o += "bubble_seconds_total{hub=\"" + label(n) + "\"} " + num(h->snap.bubble_ns / 1e9) + "\n";
  }
  head("bubble_harvested_seconds_total", "counter",
       "Side-task step time inside bubbles, summed over the hub's tasks.");
  for (const auto& [n, h] : hubs_) {
    o += "bubble_harvested_seconds_total{hub=\"" + label(n) + "\"} " + num(h->harvested_ns / 1e9) +
         "\n";
  }
  head("bubble_free_memory_bytes", "gauge", "Device memory free for side tasks in the last bubble.");
  for (const auto& [n, h] : hubs_) {
    if (h->alive && h->snap.free_mem != BB_MEM_UNKNOWN) {
      o += "bubble_free_memory_bytes{hub=\"" + label(n) + "\"} " + std::to_string(h->snap.free_mem) +
           "\n";
    }
  }
  head("bubble_granted_memory_bytes", "gauge", "Device memory needed by the tasks placed on a hub.");
  for (const auto& [n, h] : hubs_) {
    o += "bubble_granted_memory_bytes{hub=\"" + label(n) + "\"} " + std::to_string(granted_on(n)) +
         "\n";
  }
  head("bubble_in_bubble", "gauge", "1 while the hub is inside a bubble.");
  for (const auto& [n, h] : hubs_) {
    o += "bubble_in_bubble{hub=\"" + label(n) + "\"} " +
         std::to_string(h->alive && h->snap.in_bubble ? 1 : 0) + "\n";
  }
  head("bubble_events_lost_total", "counter", "Hub events overwritten before the agent read them.");
  for (const auto& [n, h] : hubs_) {
    o += "bubble_events_lost_total{hub=\"" + label(n) + "\"} " + std::to_string(h->lost) + "\n";
  }

  head("bubble_side_task_seconds_total", "counter", "A side task's step time inside bubbles.");
  std::string steps, outside;
  for (const auto& [n, h] : hubs_) {
    if (!h->alive) continue;
    for (const auto& t : h->snap.tasks) {
      auto rit = h->task_rows.find(t.id);
      // The slot tells apart two slots of one process (one row), or two tasks not adopted.
      std::string labels = "{task=\"" + label(t.name) + "\",hub=\"" + label(n) + "\",id=\"" +
                           std::to_string(rit != h->task_rows.end() ? rit->second : 0) +
                           "\",slot=\"" + std::to_string(t.slot) + "\"}";
      o += "bubble_side_task_seconds_total" + labels + " " + num(t.ns_in_bubbles / 1e9) + "\n";
      outside += "bubble_side_task_outside_seconds_total" + labels + " " +
                 num(t.ns_outside / 1e9) + "\n";
      steps += "bubble_side_task_steps_total" + labels + " " + std::to_string(t.steps) + "\n";
    }
  }
  head("bubble_side_task_outside_seconds_total", "counter",
       "A side task's step time that spilled past the end of a bubble.");
  o += outside;
  head("bubble_side_task_steps_total", "counter", "Steps a side task reported.");
  o += steps;

  std::map<std::string, uint64_t> by_state;
  for (const char* s : {"queued", "running", "stopped", "stopping"}) by_state[s] = 0;
  for (const auto& [id, r] : tasks_) {
    if (!state_is_final(r.state)) ++by_state[r.state];
  }
  head("bubble_tasks", "gauge", "Tasks the agent tracks, by state.");
  for (const auto& [s, v] : by_state) {
    o += "bubble_tasks{state=\"" + s + "\"} " + std::to_string(v) + "\n";
  }
  single("bubble_tasks_submitted_total", "counter",
         "Tasks submitted since the agent started.", submitted_);
  single("bubble_task_records_pruned_total", "counter",
         "Ended tasks deleted from the records since the agent started (bubbled --keep-ended).",
         pruned_);
  single("bubble_task_log_bytes_dropped_total", "counter",
         "Oldest task output dropped to keep each log within bubbled --log-max-bytes.",
         log_bytes_dropped_);
  single("bubble_task_launches_total", "counter",
         "Task processes launched since the agent started.", launches_);
  head("bubble_tasks_ended_total", "counter", "Tasks that ended since the agent started, by state.");
  for (const char* s : {"finished", "failed", "killed", "cancelled", "lost"}) {
    auto it = ended_by_state_.find(s);
    o += std::string("bubble_tasks_ended_total{state=\"") + s + "\"} " +
         std::to_string(it == ended_by_state_.end() ? 0 : it->second) + "\n";
  }
  head("bubble_enforcement_actions_total", "counter",
       "Enforcement and supervision actions since the agent started, by action.");
  // Every kind Agent::record() writes: "unenforced" (a task inside its trainer's process,
  // never signalled) and "bad" (its trainer found its slot corrupt) too.
  for (const char* s : {"stop", "continue", "kill", "replace", "cancel", "unenforced", "bad"}) {
    auto it = actions_by_kind_.find(s);
    o += std::string("bubble_enforcement_actions_total{action=\"") + s + "\"} " +
         std::to_string(it == actions_by_kind_.end() ? 0 : it->second) + "\n";
  }
  single("bubble_agent_protocol_errors_total", "counter",
         "Control connections closed for a malformed, truncated or oversized frame.",
         protocol_errors_);
  single("bubble_agent_refused_clients_total", "counter",
         "Control connections refused for their peer credentials.", refused_clients_);
  single("bubble_agent_control_requests_most_per_turn", "gauge",
         "The most control requests the agent answered in one turn of its loop (at most 64).",
         frames_most_per_turn_);
  single("bubble_agent_metrics_requests_total", "counter",
         "Scrapes of this endpoint.", metrics_requests_);
  return o;
}

}  // namespace bb::daemon
