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
// A schedule declared without times is seeded in model units instead (seed_units): until a
// position is observed it predicts its model length times the scale measured so far, so the
// first iteration is predicted from the compute the stage has already done in it.
//
// Used on the trainer's bubble path: fixed-size state, no allocation, no locks, no syscalls.
// One instance belongs to the trainer thread; nothing in it is shared.
#pragma once

#include <bubble/bubble.h>

#include <array>
#include <cstdint>

namespace bb::core {

// Nanoseconds per model unit, learnt from the compute the trainer has observed (the gaps
// between its bubbles): observed_ns over the model's units at the same positions. Other
// stages' delays show in the bubbles, not in a stage's own compute, so this stays true to the
// stage's speed. Shared by the predictors of one trainer (bubbles and gaps), on its thread.
struct UnitScale {
  uint64_t observed_ns = 0;
  uint64_t model_units = 0;
};

class BubblePredictor {
 public:
  // Enough for a middle stage's receives in 1F1B up to m = 512 and interleaved up to m x v = 512
  // (two per micro-batch and chunk); 64 KiB per predictor, of which a bubble touches one entry.
  static constexpr uint32_t kMaxPositions = 1024;
  // Odd, so the median is an observed value; five tolerates two outliers in a row.
  static constexpr uint32_t kWindow = 5;

  // An iteration starts: positions count from 0 again.
  void begin_iteration() noexcept;
  // Predicted length of the bubble beginning now at the current position; 0 = no idea yet.
  // Returns a value observe() precomputed.
  uint64_t predict(bb_bubble_kind kind) const noexcept;
  // The bubble at the current position lasted duration_ns; advance to the next position.
  void observe(bb_bubble_kind kind, uint64_t duration_ns) noexcept;
  // The bubble at the current position gives nothing to observe (the gap before the first
  // bubble ever, which has no bubble before it); advance to the next position.
  void skip() noexcept;
  // Seeds positions 0..count-1 (from a declared schedule); a 0 entry leaves its position
  // unseeded. A seeded position predicts its seed until observed, then the lower of the seed
  // and its one observation (the first iteration is often slow: communicators being set up,
  // allocators and autotuning warming up, and one slow bubble must not become the next
  // iteration's deadline), and from its second observation on what it observed. Replaces any
  // earlier seeds. Positions past kMaxPositions are ignored. Seeds apply only when the trainer
  // marks iterations.
  void seed(const uint64_t* durations_ns, uint32_t count) noexcept;
  // Seeds positions 0..count-1 with lengths in model units, scaled by *scale (as seed() does
  // with nanoseconds: alone until observed, the lower of it and one observation): such a
  // position's seed is 0 (no idea) while the scale is unknown, then units * scale, at least
  // 1 ns (a zero-length model bubble means "no time to hand out", not "no idea"). With
  // measures_scale, every observation at a position 1..count-1 with a nonzero model length
  // adds to *scale; position 0 is left out, as what precedes an iteration's first bubble holds
  // work outside the schedule (the optimizer step, loading data). Positions past
  // kMaxPositions are not seeded and do not measure. *scale must outlive the predictor's use
  // (the trainer owns both). Each seed() or seed_units() replaces the previous declaration.
  void seed_units(const uint64_t* units, uint32_t count, UnitScale* scale,
                  bool measures_scale) noexcept;
  // Forgets all history and seeds.
  void reset() noexcept;

  // The current position (bubbles observed since the last begin_iteration()).
  uint32_t position() const noexcept { return position_; }
  bool iterations_marked() const noexcept { return marked_; }
  // Whether observations feed a UnitScale (seed_units with measures_scale).
  bool measures_scale() const noexcept { return measures_; }

 private:
  enum Seed : uint8_t { kNone = 0, kNanoseconds = 1, kUnits = 2 };
  struct History {
    uint64_t window[kWindow];
    uint64_t prediction;  // median of window[0..count)
    // The declared length: nanoseconds (seed) or model units (seed_units); units are kept
    // after observations, for measuring the scale.
    uint64_t declared;
    uint8_t count;        // valid entries, <= kWindow
    uint8_t next;         // where the next observation goes
    uint8_t kind;         // kind of the observations held (positions only)
    uint8_t seeded;       // a Seed
  };

  static void push(History* h, uint64_t duration_ns) noexcept;
  // What the declaration says of a seeded position, in nanoseconds; 0 = nothing (yet).
  uint64_t declared_ns(const History& h) const noexcept;
  void clear_seeds() noexcept;

  // The scalars and the per-kind table first: every bubble reads them, so they share the
  // first lines of the object rather than follow 8 KiB of positions.
  uint32_t position_ = 0;
  bool marked_ = false;
  bool measures_ = false;
  UnitScale* scale_ = nullptr;
  std::array<History, BB_BUBBLE_KIND_COUNT_> kinds_{};
  std::array<History, kMaxPositions> positions_{};
};

}  // namespace bb::core
