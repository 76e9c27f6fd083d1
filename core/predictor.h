// Predicts how long the bubble that begins now will last, from the bubbles of earlier
// iterations at the same position.
//
// Pipeline schedules repeat every iteration: the n-th idle interval of a stage has nearly the
// same length each time. The predictor keeps, per position in the iteration, the last few
// observed lengths and predicts their median, so one or two outliers (a slow all-reduce, a
// preempted kernel) do not move it, while a real change of level (a new sequence length, a
// throttled GPU) takes over after three iterations. Without iteration marks it falls back to
// the history of bubbles of the same kind.
//
// Used on the trainer's bubble path: fixed-size state, no allocation, no locks, no syscalls.
// One instance belongs to the trainer thread; nothing in it is shared.
#pragma once

#include <bubble/bubble.h>

#include <array>
#include <cstdint>

namespace bb::core {

class BubblePredictor {
 public:
  static constexpr uint32_t kMaxPositions = 128;
  // Odd, so the median is an observed value; five tolerates two outliers in a row.
  static constexpr uint32_t kWindow = 5;

  // An iteration starts: positions count from 0 again.
  void begin_iteration() noexcept;
  // Predicted length of the bubble beginning now at the current position; 0 = no idea yet.
  // Returns a value observe() precomputed.
  uint64_t predict(bb_bubble_kind kind) const noexcept;
  // The bubble at the current position lasted duration_ns; advance to the next position.
  void observe(bb_bubble_kind kind, uint64_t duration_ns) noexcept;
  // Seeds positions 0..count-1 (from a declared schedule) until they are observed; a 0 entry
  // leaves its position unseeded. Positions past kMaxPositions are ignored. Seeds apply only
  // when the trainer marks iterations.
  void seed(const uint64_t* durations_ns, uint32_t count) noexcept;
  // Forgets all history and seeds.
  void reset() noexcept;

  // The current position (bubbles observed since the last begin_iteration()).
  uint32_t position() const noexcept { return position_; }
  bool iterations_marked() const noexcept { return marked_; }

 private:
  struct History {
    uint64_t window[kWindow];
    uint64_t prediction;  // median of window[0..count), or the seed while count == 0
    uint8_t count;        // valid entries, <= kWindow
    uint8_t next;         // where the next observation goes
    uint8_t kind;         // kind of the observations held (positions only)
    uint8_t seeded;
  };

  static void push(History* h, uint64_t duration_ns) noexcept;

  std::array<History, kMaxPositions> positions_{};
  std::array<History, BB_BUBBLE_KIND_COUNT_> kinds_{};
  uint32_t position_ = 0;
  bool marked_ = false;
};

}  // namespace bb::core
