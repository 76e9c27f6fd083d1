// Shared pieces of the grant tests: descriptor counting, the peer process, the fake driver.
//
// Paths come from the build: BUBBLE_CUDA_DOUBLE_PATH (libbubble_cuda_double.so) and
// BUBBLE_GRANT_PEER_PATH (bubble_grant_peer).
#pragma once

#include <dirent.h>
#include <doctest/doctest.h>
#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ctime>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_driver.h"
#include "shm/fd_passing.h"
#include "tests/cuda_double/cuda_double.h"
#include "tests/cuda_double/grant_peer.h"

// Without them the build still works and the tests that need them fail saying so.
#ifndef BUBBLE_CUDA_DOUBLE_PATH
#define BUBBLE_CUDA_DOUBLE_PATH \
  "(BUBBLE_CUDA_DOUBLE_PATH not defined: add tests/cuda_double to the build, see its CMakeLists)"
#endif
#ifndef BUBBLE_GRANT_PEER_PATH
#define BUBBLE_GRANT_PEER_PATH \
  "(BUBBLE_GRANT_PEER_PATH not defined: add tests/cuda_double to the build, see its CMakeLists)"
#endif

extern char** environ;

namespace bb::test {

inline int count_open_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n - 1;
}

inline uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

inline bool cloexec(int fd) { return (fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0; }

// True if [addr, addr + size) holds the pattern a peer writes with seed.
inline bool pattern_ok(uint64_t addr, uint64_t size, uint32_t seed) {
  auto* w = reinterpret_cast<const uint32_t*>(addr);
  for (uint64_t i = 0; i < size / 4; ++i)
    if (w[i] != pattern_word(seed, i)) return false;
  return true;
}

// A request of op about grant g (its wire record); a writing op fills it with seed's pattern.
inline PeerRequest peer_request(PeerOp op, const core::Grant& g, uint32_t seed = 0) {
  PeerRequest req;
  req.op = op;
  req.seed = seed;
  req.grant = core::wire_copy(g);
  return req;
}

// The fake driver's control functions, reached through the loader's handle.
struct Double {
  void (*reset_)(void) = nullptr;
  void (*outstanding_)(bbdouble_counts*) = nullptr;
  size_t (*log_)(char*, size_t) = nullptr;
  size_t (*violations_)(char*, size_t) = nullptr;
  void (*capture_)(void*, int) = nullptr;
  int (*capture_status_)(void*) = nullptr;

  explicit Double(const core::CudaDriver& drv) {
    capture_ = reinterpret_cast<decltype(capture_)>(dlsym(drv.dl_handle, "bbdouble_stream_capture"));
    capture_status_ = reinterpret_cast<decltype(capture_status_)>(
        dlsym(drv.dl_handle, "bbdouble_stream_capture_status"));
    reset_ = reinterpret_cast<decltype(reset_)>(dlsym(drv.dl_handle, "bbdouble_reset"));
    outstanding_ =
        reinterpret_cast<decltype(outstanding_)>(dlsym(drv.dl_handle, "bbdouble_outstanding"));
    log_ = reinterpret_cast<decltype(log_)>(dlsym(drv.dl_handle, "bbdouble_log"));
    violations_ =
        reinterpret_cast<decltype(violations_)>(dlsym(drv.dl_handle, "bbdouble_violations"));
  }
  bool ok() const {
    return reset_ && outstanding_ && log_ && violations_ && capture_ && capture_status_;
  }
  void reset() { reset_(); }
  // The application captures a CUDA graph on stream (global mode) until capture(stream, false).
  void capture(void* stream, bool on) { capture_(stream, on ? 1 : 0); }
  // A CUstreamCaptureStatus: active, or invalidated by an unsafe call meanwhile.
  int capture_status(void* stream) { return capture_status_(stream); }
  bbdouble_counts counts() {
    bbdouble_counts c{};
    outstanding_(&c);
    return c;
  }
  std::string log() {
    std::string s(log_(nullptr, 0) + 1, '\0');
    s.resize(log_(s.data(), s.size()));
    return s;
  }
  std::string violations() {
    std::string s(violations_(nullptr, 0) + 1, '\0');
    s.resize(violations_(s.data(), s.size()));
    return s;
  }
  // The logged calls' names in order, optionally only those starting with prefix.
  std::vector<std::string> calls(const std::string& only = "") {
    std::vector<std::string> out;
    std::string all = log();
    size_t pos = 0;
    while (pos < all.size()) {
      size_t nl = all.find('\n', pos);
      std::string line = all.substr(pos, nl - pos);
      pos = nl == std::string::npos ? all.size() : nl + 1;
      std::string name = line.substr(0, line.find(' '));
      bool keep = only.empty();
      for (size_t i = 0, j; !keep && i <= only.size(); i = j + 1) {
        j = only.find(',', i);
        if (j == std::string::npos) j = only.size();
        keep = name == only.substr(i, j - i);
      }
      if (keep) out.push_back(name);
    }
    return out;
  }
};

// Sets (or with value == nullptr unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value) setenv(name, value, 1); else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1); else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

// A bubble_grant_peer process on the other end of a SOCK_SEQPACKET socket. Killed and reaped by
// the destructor whatever happened, within a bounded time.
class Peer {
 public:
  ~Peer() { stop(); }

  // env: extra NAME=VALUE entries for the child (they override inherited ones).
  bool start(const std::vector<std::string>& env, const char* extra_arg = nullptr) {
    if (access(BUBBLE_GRANT_PEER_PATH, X_OK) != 0) {
      FAIL_CHECK("cannot run the peer program " BUBBLE_GRANT_PEER_PATH);
      return false;
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return false;
    std::vector<std::string> envs = env;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      bool overridden = false;
      for (const auto& o : env)
        if (kv.compare(0, o.find('=') + 1, o, 0, o.find('=') + 1) == 0) overridden = true;
      if (!overridden) envs.push_back(kv);
    }
    std::vector<char*> envp;
    for (auto& s : envs) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = BUBBLE_GRANT_PEER_PATH, fdarg = "3", extra = extra_arg ? extra_arg : "";
    std::vector<char*> argv{exe.data(), fdarg.data()};
    if (extra_arg) argv.push_back(extra.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ < 0) {
      close(sv[0]);
      close(sv[1]);
      return false;
    }
    if (pid_ == 0) {
      // Only async-signal-safe calls between fork and exec.
      if (sv[1] == 3) {
        fcntl(3, F_SETFD, 0);
      } else {
        dup2(sv[1], 3);
      }
      execve(exe.c_str(), argv.data(), envp.data());
      _exit(127);
    }
    close(sv[1]);
    sock_ = sv[0];
    timeval tv{20, 0};  // a wedged peer fails the test instead of hanging it
    setsockopt(sock_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return true;
  }

  bool send(const PeerRequest& req, int fd, std::string* error) {
    return shm::send_fds(sock_, &req, sizeof req, fd >= 0 ? &fd : nullptr, fd >= 0 ? 1 : 0,
                         error) == BB_OK;
  }
  bool receive(PeerReply* rep, std::string* error) {
    size_t len = 0, nfds = 0;
    if (shm::recv_fds(sock_, rep, sizeof *rep, &len, nullptr, 0, &nfds, error) != BB_OK)
      return false;
    if (len != sizeof *rep) {
      *error = "peer reply of " + std::to_string(len) + " bytes";
      return false;
    }
    return true;
  }
  bool request(const PeerRequest& req, int fd, PeerReply* rep, std::string* error) {
    return send(req, fd, error) && receive(rep, error);
  }
  // request() that requires the exchange itself to work (the reply may still say the peer's
  // work failed).
  PeerReply exchange(const PeerRequest& req, int fd = -1) {
    PeerReply rep;
    std::string err;
    REQUIRE_MESSAGE(request(req, fd, &rep, &err), err);
    return rep;
  }
  // True if a reply is waiting within timeout_ms.
  bool readable(int timeout_ms) {
    pollfd p{sock_, POLLIN, 0};
    return poll(&p, 1, timeout_ms) == 1;
  }

  // SIGKILL and reap; returns the wait status.
  int kill_now() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

  // Closes the socket (the peer exits on EOF), waits up to 5 s, then kills. Returns the exit
  // code, or -1 if it had to be killed.
  int stop() {
    if (sock_ >= 0) close(sock_);
    sock_ = -1;
    if (pid_ <= 0) return -1;
    for (int i = 0; i < 500; ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
      usleep(10000);
    }
    kill_now();
    return -1;
  }

  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int sock_ = -1;
};

// Runs fn in a forked child and returns its exit code (fn's return value), or -1 if it crashed.
// Lets a test change process-wide state (the once-loaded CUDA driver) without touching others.
template <class Fn>
int run_in_child(Fn fn) {
  pid_t pid = fork();
  if (pid == 0) _exit(fn());
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace bb::test
