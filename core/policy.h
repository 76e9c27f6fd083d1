// The one scheduling policy: which attached tasks run in a bubble. Used by the trainer-side
// library at every bubble begin and by the node agent; free of I/O, allocation and clocks.
//
// Rules: higher priority first; round-robin among equal priorities (the scan starts after the
// last task picked); a task is skipped when its memory need exceeds what is left of the bubble's
// free memory, or when its shortest useful step is longer than the bubble. A caller-supplied
// `ready` check (is the task waiting for work, can its channel take a command?) is asked only
// about the task the rules would pick next, so a bubble with many tasks reads few of them.
#pragma once

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

}  // namespace bb::core
