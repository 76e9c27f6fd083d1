#include "core/closer.h"

#include <dlfcn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>

#include "core/thread.h"

namespace bb::core {

namespace {

// An eighth of the soft descriptor limit, within [16, 4096].
size_t queue_bound() {
  rlimit r{};
  const uint64_t soft = getrlimit(RLIMIT_NOFILE, &r) == 0 ? r.rlim_cur : 1024;
  return size_t(std::clamp<uint64_t>(soft / 8, 16, 4096));
}

// The closer's thread runs this library's code until the process exits. A module that may be
// unloaded (the NCCL profiler plugin, which carries the library inside it, is dlclose'd with the
// last communicator) must then stay mapped: pinned here, once.
void pin_this_module() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&pin_this_module), &info) && info.dli_fname)
    (void)dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
}

class Closer {
 public:
  Closer() : max_(queue_bound()), owner_(getpid()) {
    stats_.max_queued = max_;
    try {
      pin_this_module();
      start_library_thread("bb-closer", [this] { run(); }).detach();
      running_ = true;
    } catch (...) {
      // No thread to be had (the process is at its limit): the callers close for themselves.
    }
  }

  pid_t owner() const { return owner_; }

  void add(const int* fds, size_t n) noexcept {
    size_t taken = 0;
    try {
      std::lock_guard<std::mutex> lock(mu_);
      for (; running_ && taken < n && queue_.size() < max_; ++taken) {
        if (fds[taken] < 0) continue;
        queue_.push_back(fds[taken]);
        ++stats_.queued;
      }
      for (size_t i = taken; i < n; ++i) stats_.closed_inline += fds[i] >= 0;
    } catch (...) {
      // Out of memory for the queue: whatever was not queued is closed here, below.
    }
    cv_.notify_one();
    for (size_t i = taken; i < n; ++i)
      if (fds[i] >= 0) ::close(fds[i]);
  }

  CloserStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    stats_.started = true;
    for (;;) {
      cv_.wait(lock, [this] { return !queue_.empty(); });
      const int fd = queue_.front();
      queue_.pop_front();
      lock.unlock();
      ::close(fd);  // may block: that is why it is here
      lock.lock();
      ++stats_.closed;
    }
  }

  const size_t max_;
  const pid_t owner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queue_;
  CloserStats stats_;
  bool running_ = false;
};

// Made on first use and never destroyed: its thread lives until the process exits, and a
// destructor at exit would race it. A child forked after it started has no such thread (and may
// have been forked while the parent's closer held its lock): it makes its own.
std::atomic<Closer*> g_closer{nullptr};
std::mutex g_make_mu;

Closer& closer() {
  Closer* c = g_closer.load(std::memory_order_acquire);
  if (c && c->owner() == getpid()) return *c;
  std::lock_guard<std::mutex> lock(g_make_mu);
  c = g_closer.load(std::memory_order_acquire);
  if (!c || c->owner() != getpid()) {
    c = new Closer;
    g_closer.store(c, std::memory_order_release);
  }
  return *c;
}

// A socket's close then resets its connection instead of waiting to deliver what it holds.
void make_abortive(int fd) {
  int type = 0;
  socklen_t len = sizeof type;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) return;  // not a socket
  const linger now{1, 0};
  (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &now, sizeof now);
}

}  // namespace

void close_elsewhere(const int* fds, size_t n) {
  bool any = false;
  for (size_t i = 0; i < n; ++i) {
    if (fds[i] < 0) continue;
    make_abortive(fds[i]);
    any = true;
  }
  if (!any) return;
  Closer* c = nullptr;
  try {
    c = &closer();
  } catch (...) {
    // The closer cannot even be made (out of memory): close here rather than throw from a
    // destructor.
  }
  if (c) {
    c->add(fds, n);
    return;
  }
  for (size_t i = 0; i < n; ++i)
    if (fds[i] >= 0) ::close(fds[i]);
}

CloserStats closer_stats() { return closer().stats(); }

}  // namespace bb::core
