// CLOCK_MONOTONIC in nanoseconds: the one clock every libbubble time uses (vDSO, no syscall).
#pragma once

#include <time.h>

#include <cstdint>

namespace bb::core {

inline uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

}  // namespace bb::core
