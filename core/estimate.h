// A smoothed estimate of a duration that recurs: a mean and a mean deviation with the gains TCP
// uses for round-trip times (1/8 and 1/4, RFC 6298). bound() = mean + 2 x deviation covers most
// samples, follows a change within some tens of samples, and one outlier moves it by a fraction.
// Used by a task for its step time (will the next step fit?) and for how late its timed sleeps
// end (how much earlier to go to sleep).
#pragma once

#include <cstdint>

namespace bb::core {

struct SmoothedEstimate {
  uint64_t mean = 0, dev = 0;
  uint64_t count = 0;

  void observe(uint64_t x) {
    if (count++ == 0) {
      mean = x;
      dev = x / 4;
      return;
    }
    const uint64_t diff = x > mean ? x - mean : mean - x;
    dev = dev - dev / 4 + diff / 4;
    mean = mean - mean / 8 + x / 8;
  }
  // 0 before the first sample.
  uint64_t bound() const { return count ? mean + 2 * dev : 0; }
};

}  // namespace bb::core
