#include "shm/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>

namespace bb::shm {
namespace {

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

}  // namespace

WaitResult futex_wait(const std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{};
  timespec* tsp = nullptr;
  if (timeout_ns >= 0) {
    ts.tv_sec = time_t(timeout_ns / 1000000000);
    ts.tv_nsec = long(timeout_ns % 1000000000);
    tsp = &ts;
  }
  // Relative timeout with FUTEX_WAIT measures CLOCK_MONOTONIC.
  long rc = syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAIT, expected,
                    tsp, nullptr, 0);
  if (rc == 0) return WaitResult::kChanged;
  if (errno == EAGAIN) return WaitResult::kChanged;  // the word already differed
  if (errno == ETIMEDOUT) return WaitResult::kTimeout;
  return WaitResult::kInterrupted;  // EINTR
}

int futex_wake(std::atomic<uint32_t>* word, int count) {
  long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count, nullptr,
                    nullptr, 0);
  return rc < 0 ? 0 : int(rc);
}

bool spin_until_changed(const std::atomic<uint32_t>* word, uint32_t expected, uint64_t spin_ns,
                        uint64_t* seen_ns) {
  if (seen_ns) *seen_ns = 0;
  if (word->load(std::memory_order_acquire) != expected) return true;
  if (spin_ns == 0) return false;
  uint64_t now = now_ns();
  const uint64_t until = now + spin_ns;
  for (;;) {
    if (word->load(std::memory_order_acquire) != expected) {
      if (seen_ns) *seen_ns = now;
      return true;
    }
    if (now >= until) return false;
    cpu_relax();
    now = now_ns();
  }
}

}  // namespace bb::shm
