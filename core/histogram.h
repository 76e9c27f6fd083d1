// A fixed-size latency histogram with log-linear buckets (8 sub-buckets per power of two, about
// 12% resolution) from 1 ns to ~1 hour: no allocation, constant-time record, percentile queries.
#pragma once

#include <bit>
#include <cstdint>

namespace bb::core {

class LatencyHistogram {
 public:
  static constexpr int kSub = 8;
  static constexpr int kBuckets = 42 * kSub;

  void record(uint64_t ns) {
    ++counts_[bucket(ns)];
    ++total_;
  }
  uint64_t total() const { return total_; }
  // The value at quantile q in [0,1] (the bucket's upper bound), 0 if empty.
  uint64_t percentile(double q) const {
    if (total_ == 0) return 0;
    uint64_t rank = uint64_t(q * double(total_ - 1)) + 1, seen = 0;
    for (int b = 0; b < kBuckets; ++b) {
      seen += counts_[b];
      if (seen >= rank) return upper(b);
    }
    return upper(kBuckets - 1);
  }
  void clear() { *this = LatencyHistogram(); }

  static int bucket(uint64_t v) {
    if (v < kSub) return int(v);
    const int msb = 63 - std::countl_zero(v);           // >= 3
    const int sub = int((v >> (msb - 3)) & (kSub - 1));  // next 3 bits
    const int b = (msb - 2) * kSub + sub;
    return b < kBuckets ? b : kBuckets - 1;
  }
  static uint64_t upper(int b) {
    if (b < kSub) return uint64_t(b);
    const int msb = b / kSub + 2, sub = b % kSub;
    return ((uint64_t(kSub + sub + 1)) << (msb - 3)) - 1;
  }

 private:
  uint64_t counts_[kBuckets] = {};
  uint64_t total_ = 0;
};

}  // namespace bb::core
