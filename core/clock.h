// CLOCK_MONOTONIC in nanoseconds: the one clock every libbubble time uses (vDSO, no syscall).
#pragma once

#include <time.h>

#include <cerrno>
#include <cstdint>

namespace bb::core {

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
