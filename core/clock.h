// CLOCK_MONOTONIC in nanoseconds: the one clock every libbubble time uses (vDSO, no syscall).
#pragma once

#include <time.h>

#include <cerrno>
#include <cstdint>

namespace bb::core {

// a + b, or UINT64_MAX where it would wrap: deadlines "at the end of time", and sums of
// amounts a peer states.
inline uint64_t add_sat(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

inline uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// Sleeps the whole of ns, signals or not. Never on the bubble path.
inline void sleep_ns(uint64_t ns) {
  timespec ts{time_t(ns / 1000000000), long(ns % 1000000000)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

}  // namespace bb::core
