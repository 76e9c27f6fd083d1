// The one scheduling policy: which attached tasks run in a bubble. Used by the trainer-side
// library at every bubble begin and by the node agent; free of I/O, allocation and clocks.
//
// Rules: higher priority first; round-robin among equal priorities (the scan starts after the
// last task picked); a task is skipped when its memory need exceeds what is left of the bubble's
// free memory, or when its shortest useful step is longer than the bubble. A caller-supplied
// `ready` check (has the task acked its last run, does it hold the grant it needs?) is asked only
// about the task the rules would pick next, so a bubble with many tasks reads few of them.
#pragma once

#include <algorithm>
#include <cstdint>

namespace bb::core {

struct Candidate {
  bool active = false;       // attached, alive, not marked bad, not told to stop
  int32_t priority = 0;
  uint64_t mem_need = 0;
  uint64_t min_step_ns = 0;
};

struct Offer {
  uint64_t free_mem = UINT64_MAX;  // UINT64_MAX: unknown, nothing is skipped for memory
  uint64_t length_ns = 0;          // 0: unknown, nothing is skipped for step length
};

// Picks at most max_pick of candidates[0..n) (n <= 256) into out, in order, and returns the
// count. rr_cursor carries the round-robin position from one call to the next.
template <typename Ready>
uint32_t pick_tasks(const Candidate* c, uint32_t n, const Offer& offer, uint32_t max_pick,
                    uint32_t& rr_cursor, Ready&& ready, uint32_t* out) {
  uint64_t excluded[4] = {0, 0, 0, 0};
  auto is_excluded = [&](uint32_t i) { return (excluded[i >> 6] >> (i & 63)) & 1u; };
  auto exclude = [&](uint32_t i) { excluded[i >> 6] |= uint64_t(1) << (i & 63); };
  uint64_t mem_left = offer.free_mem;
  uint32_t picked = 0;
  if (n == 0 || n > 256) return 0;
  if (rr_cursor >= n) rr_cursor = 0;
  while (picked < max_pick) {
    int64_t best = -1;
    for (uint32_t k = 0; k < n; ++k) {
      uint32_t i = rr_cursor + k;
      if (i >= n) i -= n;
      const Candidate& t = c[i];
      if (!t.active || is_excluded(i)) continue;
      if (mem_left != UINT64_MAX && t.mem_need > mem_left) continue;
      if (offer.length_ns != 0 && t.min_step_ns > offer.length_ns) continue;
      if (best < 0 || t.priority > c[best].priority) best = i;
    }
    if (best < 0) break;
    exclude(uint32_t(best));
    if (!ready(uint32_t(best))) continue;
    out[picked++] = uint32_t(best);
    if (mem_left != UINT64_MAX) mem_left -= c[best].mem_need;
  }
  if (picked > 0) rr_cursor = out[picked - 1] + 1 >= n ? 0 : out[picked - 1] + 1;
  return picked;
}

// The same policy, faster when many tasks are attached: the active candidates grouped by
// priority (highest first), each group in slot order. Built when the slot table changes (no
// allocation; a sort of at most 256 entries), it lets a pick look only at the highest groups
// with a task to start, rather than at every candidate to find the highest priority. pick()
// returns exactly what pick_tasks() returns for the same inputs (a test compares them), provided
// the index was built from the same candidates; a candidate that turned inactive since is
// skipped, one that turned active is not seen until the next build.
class PickIndex {
 public:
  void build(const Candidate* c, uint32_t n) {
    count_ = 0;
    levels_ = 0;
    if (n > 256) return;
    for (uint32_t i = 0; i < n; ++i)
      if (c[i].active) order_[count_++] = uint16_t(i);
    std::sort(order_, order_ + count_, [c](uint16_t a, uint16_t b) {
      return c[a].priority != c[b].priority ? c[a].priority > c[b].priority : a < b;
    });
    for (uint32_t k = 0; k < count_; ++k)
      if (k == 0 || c[order_[k]].priority != c[order_[k - 1]].priority)
        level_begin_[levels_++] = uint16_t(k);
    level_begin_[levels_] = uint16_t(count_);
    n_ = n;
  }

  template <typename Ready>
  uint32_t pick(const Candidate* c, uint32_t n, const Offer& offer, uint32_t max_pick,
                uint32_t& rr_cursor, Ready&& ready, uint32_t* out) const {
    if (n == 0 || n > 256 || n != n_) return 0;
    if (rr_cursor >= n) rr_cursor = 0;
    uint64_t mem_left = offer.free_mem;
    uint32_t picked = 0;
    for (uint32_t l = 0; l < levels_ && picked < max_pick; ++l) {
      const uint16_t* members = order_ + level_begin_[l];
      const uint32_t m = uint32_t(level_begin_[l + 1] - level_begin_[l]);
      // Round-robin within the group: from the first member at or after the cursor, wrapping.
      const uint32_t first = uint32_t(std::lower_bound(members, members + m, rr_cursor) - members);
      for (uint32_t k = 0; k < m && picked < max_pick; ++k) {
        const uint32_t at = first + k;
        const uint32_t i = members[at >= m ? at - m : at];
        const Candidate& t = c[i];
        if (!t.active) continue;
        if (mem_left != UINT64_MAX && t.mem_need > mem_left) continue;
        if (offer.length_ns != 0 && t.min_step_ns > offer.length_ns) continue;
        if (!ready(i)) continue;
        out[picked++] = i;
        if (mem_left != UINT64_MAX) mem_left -= t.mem_need;
      }
    }
    if (picked > 0) rr_cursor = out[picked - 1] + 1 >= n ? 0 : out[picked - 1] + 1;
    return picked;
  }

 private:
  uint16_t order_[256];
  uint16_t level_begin_[257];
  uint32_t count_ = 0, levels_ = 0, n_ = 0;
};

}  // namespace bb::core
