#include "core/closer.h"

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>

#include "core/thread.h"

namespace bb::core {

namespace {

class Closer {
 public:
  Closer() {
    try {
      start_library_thread("bb-closer", [this] { run(); }).detach();
      running_ = true;
    } catch (const std::system_error&) {
      // No thread to be had (the process is at its limit): the callers close for themselves.
    }
  }

  void add(const int* fds, size_t n) {
    size_t taken = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (; running_ && taken < n && queue_.size() < kMaxQueuedCloses; ++taken)
        if (fds[taken] >= 0) {
          queue_.push_back(fds[taken]);
          ++stats_.queued;
        }
      for (size_t i = taken; i < n; ++i) stats_.closed_inline += fds[i] >= 0;
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

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queue_;
  CloserStats stats_;
  bool running_ = false;
};

// Made on first use and never destroyed: its thread lives until the process exits, and a
// destructor at exit would race it.
Closer& closer() {
  static Closer* c = new Closer;
  return *c;
}

}  // namespace

void close_elsewhere(const int* fds, size_t n) {
  if (n) closer().add(fds, n);
}

CloserStats closer_stats() { return closer().stats(); }

}  // namespace bb::core
