#include <doctest/doctest.h>

#include <vector>

#include "core/histogram.h"
#include "core/policy.h"

using bb::core::Candidate;
using bb::core::Offer;
using bb::core::pick_tasks;

namespace {

std::vector<uint32_t> pick(const std::vector<Candidate>& c, Offer offer, uint32_t max_pick,
                           uint32_t& cursor, std::vector<bool> ready = {}) {
  std::vector<uint32_t> out(c.size() + 1);
  auto is_ready = [&](uint32_t i) { return ready.empty() || ready[i]; };
  const uint32_t n = pick_tasks(c.data(), uint32_t(c.size()), offer, max_pick, cursor, is_ready,
                                out.data());
  out.resize(n);
  return out;
}

}  // namespace

TEST_CASE("policy_higher_priority_first") {
  std::vector<Candidate> c = {{true, 0, 0, 0}, {true, 5, 0, 0}, {true, 1, 0, 0}};
  uint32_t cursor = 0;
  CHECK(pick(c, {}, 1, cursor) == std::vector<uint32_t>{1});
  CHECK(pick(c, {}, 1, cursor) == std::vector<uint32_t>{1});
  CHECK(pick(c, {}, 3, cursor) == std::vector<uint32_t>{1, 2, 0});
}

TEST_CASE("policy_round_robin_among_equals") {
  std::vector<Candidate> c(4, Candidate{true, 2, 0, 0});
  uint32_t cursor = 0;
  std::vector<uint32_t> order;
  for (int i = 0; i < 8; ++i) order.push_back(pick(c, {}, 1, cursor)[0]);
  CHECK(order == std::vector<uint32_t>{0, 1, 2, 3, 0, 1, 2, 3});
  // Two at a time still rotates.
  CHECK(pick(c, {}, 2, cursor) == std::vector<uint32_t>{0, 1});
  CHECK(pick(c, {}, 2, cursor) == std::vector<uint32_t>{2, 3});
}

TEST_CASE("policy_skips_tasks_that_do_not_fit_memory") {
  std::vector<Candidate> c = {{true, 9, 8ull << 30, 0}, {true, 1, 1ull << 30, 0}, {true, 1, 2ull << 30, 0}};
  uint32_t cursor = 0;
  // 3 GiB free: the 8 GiB task is skipped despite its priority; the other two fit together.
  CHECK(pick(c, {3ull << 30, 0}, 3, cursor) == std::vector<uint32_t>{1, 2});
  // 2.5 GiB: only one of them fits after the first is placed.
  cursor = 0;
  CHECK(pick(c, {(5ull << 30) / 2, 0}, 3, cursor) == std::vector<uint32_t>{1});
  // Unknown free memory skips nobody.
  cursor = 0;
  CHECK(pick(c, {UINT64_MAX, 0}, 1, cursor) == std::vector<uint32_t>{0});
}

TEST_CASE("policy_skips_tasks_whose_shortest_step_exceeds_the_bubble") {
  std::vector<Candidate> c = {{true, 5, 0, 10'000'000}, {true, 0, 0, 1'000'000}};
  uint32_t cursor = 0;
  CHECK(pick(c, {UINT64_MAX, 5'000'000}, 1, cursor) == std::vector<uint32_t>{1});
  cursor = 0;
  CHECK(pick(c, {UINT64_MAX, 0}, 1, cursor) == std::vector<uint32_t>{0});  // unknown length
}

TEST_CASE("policy_asks_ready_only_for_the_next_choice_and_falls_through") {
  std::vector<Candidate> c = {{true, 3, 0, 0}, {true, 2, 0, 0}, {true, 1, 0, 0}, {false, 9, 0, 0}};
  uint32_t cursor = 0;
  // The best task is busy: the next best is picked, the inactive one never.
  CHECK(pick(c, {}, 1, cursor, {false, true, true, true}) == std::vector<uint32_t>{1});
  cursor = 0;
  CHECK(pick(c, {}, 1, cursor, {false, false, false, true}).empty());
  cursor = 0;
  CHECK(pick({}, {}, 1, cursor).empty());
}

TEST_CASE("histogram_percentiles_within_bucket_resolution") {
  bb::core::LatencyHistogram h;
  CHECK(h.percentile(0.5) == 0);
  for (uint64_t v = 1; v <= 1000; ++v) h.record(v * 1000);  // 1 us .. 1 ms
  CHECK(h.total() == 1000);
  const double p50 = double(h.percentile(0.5)), p99 = double(h.percentile(0.99));
  CHECK(p50 >= 500'000 * 0.99);
  CHECK(p50 <= 500'000 * 1.13);
  CHECK(p99 >= 990'000 * 0.99);
  CHECK(p99 <= 990'000 * 1.13);
  CHECK(bb::core::LatencyHistogram::bucket(7) == 7);
  for (uint64_t v : {8ull, 100ull, 123456ull, 1ull << 40})
    CHECK(bb::core::LatencyHistogram::upper(bb::core::LatencyHistogram::bucket(v)) >= v);
}

TEST_CASE("policy_index_picks_exactly_what_the_scan_picks") {
  // Random slot tables, offers, readiness and cursors: the grouped index must agree with the
  // reference scan on every pick and on the cursor it leaves.
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  auto next = [&rng](uint32_t bound) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return uint32_t(rng % bound);
  };
  bb::core::PickIndex index;
  for (int round = 0; round < 20000; ++round) {
    const uint32_t n = 1 + next(round % 10 == 0 ? 256 : 12);
    std::vector<Candidate> c(n);
    for (auto& t : c) {
      t.active = next(4) != 0;
      t.priority = int32_t(next(4)) - 1;
      t.mem_need = next(3) ? 0 : uint64_t(next(8)) << 30;
      t.min_step_ns = next(3) ? 0 : uint64_t(next(5)) * 1'000'000;
    }
    index.build(c.data(), n);
    std::vector<bool> ready(n);
    for (uint32_t i = 0; i < n; ++i) ready[i] = next(5) != 0;
    // Some candidates turn inactive after the build (a task marked bad): both skip them.
    if (next(4) == 0) c[next(n)].active = false;
    Offer offer;
    if (next(2)) offer.free_mem = uint64_t(next(12)) << 30;
    if (next(2)) offer.length_ns = uint64_t(next(6)) * 1'000'000;
    const uint32_t max_pick = 1 + next(4);
    const uint32_t start = next(n + 2);
    auto is_ready = [&](uint32_t i) { return bool(ready[i]); };
    uint32_t cursor_a = start, cursor_b = start;
    std::vector<uint32_t> a(n + 1), b(n + 1);
    const uint32_t na = pick_tasks(c.data(), n, offer, max_pick, cursor_a, is_ready, a.data());
    const uint32_t nb = index.pick(c.data(), n, offer, max_pick, cursor_b, is_ready, b.data());
    a.resize(na);
    b.resize(nb);
    INFO("round " << round << " n " << n);
    REQUIRE(a == b);
    REQUIRE(cursor_a == cursor_b);
  }
}

TEST_CASE("policy_index_built_for_another_table_picks_nothing") {
  std::vector<Candidate> c(4, Candidate{true, 1, 0, 0});
  bb::core::PickIndex index;
  index.build(c.data(), 4);
  uint32_t cursor = 0, out[8];
  auto ready = [](uint32_t) { return true; };
  CHECK(index.pick(c.data(), 4, {}, 1, cursor, ready, out) == 1);
  CHECK(index.pick(c.data(), 3, {}, 1, cursor, ready, out) == 0);  // built for 4 slots
}
