// Fuzzes the agent's control protocol: the bytes one client sends on its connection, cut into
// frames and answered by the real request handling of a real Agent (its database, its queue,
// its hub directory; no hub is live, so nothing is ever launched), without a socket.
//
// Input: byte 0 bit 0 set = the stream starts with a valid hello (so inputs reach the requests
// past the version check); the rest is the stream. Checked for every input, besides what the
// sanitizers catch: every reply the agent writes is a well-formed frame holding a Response,
// the connection is released, and the agent's libuv handles all close at the end.
#include <kj/exception.h>
#include <uv.h>

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "agent.capnp.h"
#include "daemon/agent.h"
#include "daemon/control_feed.h"
#include "daemon/frame.h"

namespace {

using bb::daemon::Agent;

std::string g_root;
uv_loop_t g_loop;
Agent* g_agent = nullptr;
unsigned g_inputs = 0;
// A fresh agent (empty database) every so many inputs bounds the state inputs accumulate.
constexpr unsigned kInputsPerAgent = 256;

void remove_tree(const std::string& path) {
  if (DIR* d = opendir(path.c_str())) {
    while (dirent* e = readdir(d)) {
      if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
      const std::string p = path + "/" + e->d_name;
      struct stat st;
      if (lstat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_tree(p);
      else unlink(p.c_str());
    }
    closedir(d);
  }
  rmdir(path.c_str());
}

void stop_agent() {
  if (!g_agent) return;
  g_agent->shutdown();
  uv_run(&g_loop, UV_RUN_DEFAULT);
  delete g_agent;
  g_agent = nullptr;
  if (uv_loop_close(&g_loop) != 0) {
    fprintf(stderr, "the agent left libuv handles open after shutdown\n");
    abort();
  }
  remove_tree(g_root + "/state");
}

void start_agent() {
  uv_loop_init(&g_loop);
  bb::daemon::AgentConfig cfg;
  cfg.runtime_dir = g_root + "/rt";
  cfg.socket_path = g_root + "/agent.sock";
  cfg.state_dir = g_root + "/state";
  cfg.metrics_port = -1;
  cfg.self_exe = "/bin/false";  // never used: without a live hub no task is launched
  g_agent = new Agent(cfg);
  const std::string err = g_agent->start(&g_loop);
  if (!err.empty()) {
    fprintf(stderr, "agent did not start: %s\n", err.c_str());
    abort();
  }
}

void teardown() {
  stop_agent();
  remove_tree(g_root);
}

std::vector<uint8_t> hello_frame() {
  capnp::MallocMessageBuilder msg;
  auto req = msg.initRoot<bb::proto::Request>();
  req.setId(1);
  req.initHello().setProtocolVersion(bb::proto::PROTOCOL_VERSION);
  std::vector<uint8_t> frame;
  std::string error;
  if (!bb::daemon::encode_frame(msg, bb::proto::MAX_FRAME_BYTES, &frame, &error)) abort();
  return frame;
}

// Every reply must be a frame the client's own reader accepts and that holds a Response.
void check_replies(const std::vector<uint8_t>& bytes) {
  bb::daemon::FrameReader frames(bb::proto::MAX_FRAME_BYTES);
  frames.feed(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  for (;;) {
    std::unique_ptr<capnp::MessageReader> reader;
    std::string error;
    auto r = frames.next(&reader, &error);
    if (r == bb::daemon::FrameReader::Result::kNeedMore) break;
    if (r == bb::daemon::FrameReader::Result::kError) {
      fprintf(stderr, "the agent wrote a bad reply frame: %s\n", error.c_str());
      abort();
    }
    try {
      auto resp = reader->getRoot<bb::proto::Response>();
      if (resp.isError() && resp.getError().getMessage().size() == 0) {
        fprintf(stderr, "an error reply without a message\n");
        abort();
      }
    } catch (const kj::Exception& e) {
      fprintf(stderr, "a reply does not decode: %s\n", e.getDescription().cStr());
      abort();
    }
  }
  if (frames.pending() != 0) {
    fprintf(stderr, "the agent wrote a partial reply frame\n");
    abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  char tmpl[] = "/tmp/bbfuzz-ctl-XXXXXX";
  if (!mkdtemp(tmpl)) abort();
  g_root = tmpl;
  // The agent logs every submission and refusal; thousands of inputs a second would drown the
  // fuzzer's own output. Only the agent's FILE is redirected: libFuzzer keeps the stream it
  // took at start and the sanitizers write to descriptor 2, so crash reports still show.
  if (!getenv("BUBBLE_FUZZ_VERBOSE")) {
    if (FILE* null = fopen("/dev/null", "w")) stderr = null;
  }
  atexit(teardown);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (!g_agent || g_inputs++ % kInputsPerAgent == 0) {
    stop_agent();
    start_agent();
  }
  {
    bb::daemon::ControlFeed feed(g_agent);
    bool open = true;
    if (data[0] & 1) {
      const std::vector<uint8_t> hello = hello_frame();
      open = feed.feed(hello.data(), hello.size());
    }
    if (open) open = feed.feed(data + 1, size - 1);
    if (open) feed.end();
    check_replies(feed.replies());
  }
  if (!g_agent->clients_.empty()) {
    fprintf(stderr, "a connection outlived its client\n");
    abort();
  }
  return 0;
}
