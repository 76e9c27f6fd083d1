#include "core/predictor.h"

namespace bb::core {
namespace {

// The kind arrives from the trainer's caller through the C ABI; anything unknown is "other"
// so it can never index past the per-kind table.
inline uint32_t kind_index(bb_bubble_kind kind) noexcept {
  const auto k = static_cast<uint32_t>(kind);
  return k < BB_BUBBLE_KIND_COUNT_ ? k : static_cast<uint32_t>(BB_BUBBLE_OTHER);
}

}  // namespace

void BubblePredictor::push(History* h, uint64_t duration_ns) noexcept {
  // Done here so predict() is a single load (from a position's second observation on; with one,
  // it also compares it with the position's seed). A full window (the steady state) goes through a
  // 9-comparator sorting network of min/max, which compiles to conditional moves: no branch to
  // mispredict on the bubble path. The first few observations use a plain insertion sort.
  // The window is read before the new value is stored: reading it back right after a narrower
  // store would stall on store-to-load forwarding, which cost more than the network itself.
  uint64_t v[kWindow];
  const uint32_t at = h->next;
  for (uint32_t i = 0; i < kWindow; ++i) v[i] = i == at ? duration_ns : h->window[i];
  h->window[at] = duration_ns;
  h->next = static_cast<uint8_t>(at + 1 == kWindow ? 0 : at + 1);
  if (h->count < kWindow) ++h->count;
  const uint32_t n = h->count;
  static_assert(kWindow == 5, "the sorting network below is for five values");
  if (n == kWindow) {
    auto cas = [&v](int a, int b) {
      const uint64_t lo = v[a] < v[b] ? v[a] : v[b], hi = v[a] < v[b] ? v[b] : v[a];
      v[a] = lo;
      v[b] = hi;
    };
    cas(0, 1); cas(3, 4); cas(2, 4); cas(2, 3); cas(0, 3);
    cas(0, 2); cas(1, 4); cas(1, 3); cas(1, 2);
    h->prediction = v[2];
    return;
  }
  // Not full yet: the n values sit in window[0..n) (next has not wrapped), already copied to v.
  for (uint32_t i = 1; i < n; ++i) {
    const uint64_t x = v[i];
    uint32_t j = i;
    for (; j > 0 && v[j - 1] > x; --j) v[j] = v[j - 1];
    v[j] = x;
  }
  // With an even count take the lower middle: predicting short only leaves a little bubble
  // unused, predicting long lets side-task work spill into the training step.
  h->prediction = v[(n - 1) / 2];
}

void BubblePredictor::begin_iteration() noexcept {
  position_ = 0;
  marked_ = true;
}

uint64_t BubblePredictor::declared_ns(const History& h) const noexcept {
  if (h.seeded == kNanoseconds) return h.declared;
  if (h.seeded != kUnits || scale_ == nullptr || scale_->model_units == 0) return 0;
  const auto ns = static_cast<unsigned __int128>(h.declared) * scale_->observed_ns /
                  scale_->model_units;
  if (ns == 0) return 1;
  return ns > UINT64_MAX ? UINT64_MAX : static_cast<uint64_t>(ns);
}

uint64_t BubblePredictor::predict(bb_bubble_kind kind) const noexcept {
  const uint32_t k = kind_index(kind);
  if (marked_ && position_ < kMaxPositions) {
    const History& h = positions_[position_];
    if (h.count > 1) {
      if (h.kind == k) return h.prediction;
    } else if (h.count == 1) {
      if (h.kind == k) {
        // One observation is not trusted past the declaration: see seed(). A declared 1 ns
        // (the model's "no wait here") bounds nothing: the observation shows there was one.
        const uint64_t d = h.seeded != kNone ? declared_ns(h) : 0;
        return d > 1 && d < h.prediction ? d : h.prediction;
      }
    } else if (h.seeded != kNone) {
      return declared_ns(h);
    }
  }
  const History& h = kinds_[k];
  return h.count > 0 ? h.prediction : 0;
}

void BubblePredictor::observe(bb_bubble_kind kind, uint64_t duration_ns) noexcept {
  const uint32_t k = kind_index(kind);
  if (marked_ && position_ < kMaxPositions) {
    History& h = positions_[position_];
    // Another kind at this position means the schedule changed: its old lengths, and what was
    // declared for it (as a bound and as model units to measure by), say nothing.
    if (h.count > 0 && h.kind != k) {
      h.count = 0;
      h.seeded = kNone;
      h.declared = 0;
    }
    if (h.count == 0) {
      h.next = 0;
      h.kind = static_cast<uint8_t>(k);
    }
    push(&h, duration_ns);
    if (measures_ && position_ > 0 && h.declared > 0) {
      scale_->observed_ns += duration_ns;
      scale_->model_units += h.declared;
    }
  }
  push(&kinds_[k], duration_ns);
  if (position_ != UINT32_MAX) ++position_;
}

void BubblePredictor::skip() noexcept {
  if (position_ != UINT32_MAX) ++position_;
}

void BubblePredictor::clear_seeds() noexcept {
  for (History& h : positions_) {
    h.declared = 0;
    h.seeded = kNone;
  }
  scale_ = nullptr;
  measures_ = false;
}

void BubblePredictor::seed(const uint64_t* durations_ns, uint32_t count) noexcept {
  clear_seeds();
  if (durations_ns == nullptr) return;
  if (count > kMaxPositions) count = kMaxPositions;
  for (uint32_t i = 0; i < count; ++i) {
    History& h = positions_[i];
    if (durations_ns[i] == 0) continue;
    h.declared = durations_ns[i];
    h.seeded = kNanoseconds;
  }
}

void BubblePredictor::seed_units(const uint64_t* units, uint32_t count, UnitScale* scale,
                                 bool measures_scale) noexcept {
  clear_seeds();
  if (units == nullptr || scale == nullptr) return;
  scale_ = scale;
  measures_ = measures_scale;
  if (count > kMaxPositions) count = kMaxPositions;
  for (uint32_t i = 0; i < count; ++i) {
    History& h = positions_[i];
    h.declared = units[i];
    h.seeded = kUnits;
  }
}

void BubblePredictor::reset() noexcept {
  positions_ = {};
  kinds_ = {};
  position_ = 0;
  marked_ = false;
  measures_ = false;
  scale_ = nullptr;
}

}  // namespace bb::core
