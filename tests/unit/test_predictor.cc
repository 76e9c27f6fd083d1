#include <doctest/doctest.h>

#include "core/predictor.h"
#include "core/schedule.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

using bb::core::BubblePredictor;

namespace {

struct Slot {
  bb_bubble_kind kind;
  uint64_t ns;
};

// One iteration of a 1F1B middle stage: warm-up, a few steady waits, cool-down.
const std::vector<Slot> kIteration = {{BB_BUBBLE_WARMUP, 3'000'000},
                                      {BB_BUBBLE_STEADY, 400'000},
                                      {BB_BUBBLE_STEADY, 250'000},
                                      {BB_BUBBLE_STEADY, 250'000},
                                      {BB_BUBBLE_COOLDOWN, 6'000'000}};

// Feeds one iteration scaled by `scale`; returns the predictions made before each bubble.
std::vector<uint64_t> feed(BubblePredictor& pr, const std::vector<Slot>& it, double scale = 1.0,
                           bool mark = true) {
  std::vector<uint64_t> predicted;
  if (mark) pr.begin_iteration();
  for (const auto& s : it) {
    predicted.push_back(pr.predict(s.kind));
    pr.observe(s.kind, static_cast<uint64_t>(s.ns * scale));
  }
  return predicted;
}

}  // namespace

TEST_CASE("predictor_state_is_fixed_size") {
  // No heap behind it: the trainer embeds it and copies nothing on the bubble path.
  CHECK(std::is_trivially_copyable_v<BubblePredictor>);
  CHECK(sizeof(BubblePredictor) <= 72 * 1024);
}

TEST_CASE("predictor_knows_nothing_before_history") {
  BubblePredictor pr;
  for (int k = 0; k < BB_BUBBLE_KIND_COUNT_; ++k) CHECK(pr.predict(static_cast<bb_bubble_kind>(k)) == 0);
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 0);
}

TEST_CASE("predictor_learns_each_position_after_one_iteration") {
  BubblePredictor pr;
  const auto first = feed(pr, kIteration);
  // During the first iteration only per-kind history exists: the 2nd steady bubble is guessed
  // from the 1st.
  CHECK(first[0] == 0);
  CHECK(first[2] == 400'000);
  for (int i = 0; i < 3; ++i) {
    const auto pred = feed(pr, kIteration);
    for (size_t j = 0; j < kIteration.size(); ++j) CHECK(pred[j] == kIteration[j].ns);
  }
  CHECK(pr.position() == kIteration.size());
  CHECK(pr.iterations_marked());
}

TEST_CASE("predictor_converges_under_noise") {
  BubblePredictor pr;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> noise(0.95, 1.05);
  for (int it = 0; it < 50; ++it) {
    pr.begin_iteration();
    for (const auto& s : kIteration) {
      const uint64_t p = pr.predict(s.kind);
      if (it >= 3) {
        CHECK(p >= static_cast<uint64_t>(s.ns * 0.95));
        CHECK(p <= static_cast<uint64_t>(s.ns * 1.05));
      }
      pr.observe(s.kind, static_cast<uint64_t>(s.ns * noise(rng)));
    }
  }
}

TEST_CASE("predictor_follows_a_new_iteration_time_within_three_iterations") {
  BubblePredictor pr;
  for (int i = 0; i < 10; ++i) feed(pr, kIteration);
  // The iteration gets twice as long (a longer sequence length, say).
  feed(pr, kIteration, 2.0);
  auto pred = feed(pr, kIteration, 2.0);
  for (size_t j = 0; j < kIteration.size(); ++j) CHECK(pred[j] == kIteration[j].ns);  // not yet
  feed(pr, kIteration, 2.0);
  pred = feed(pr, kIteration, 2.0);
  for (size_t j = 0; j < kIteration.size(); ++j) CHECK(pred[j] == kIteration[j].ns * 2);
  // And back.
  for (int i = 0; i < 3; ++i) feed(pr, kIteration);
  pred = feed(pr, kIteration);
  for (size_t j = 0; j < kIteration.size(); ++j) CHECK(pred[j] == kIteration[j].ns);
}

TEST_CASE("predictor_ignores_two_outliers_in_a_row") {
  BubblePredictor pr;
  for (int i = 0; i < 5; ++i) feed(pr, kIteration);
  feed(pr, kIteration, 20.0);  // a stall
  auto pred = feed(pr, kIteration, 0.01);  // a truncated iteration
  for (size_t j = 0; j < kIteration.size(); ++j) CHECK(pred[j] == kIteration[j].ns);
  pred = feed(pr, kIteration);
  for (size_t j = 0; j < kIteration.size(); ++j) CHECK(pred[j] == kIteration[j].ns);
  pred = feed(pr, kIteration);
  for (size_t j = 0; j < kIteration.size(); ++j) CHECK(pred[j] == kIteration[j].ns);
}

TEST_CASE("predictor_with_short_history_prefers_the_shorter_value") {
  BubblePredictor pr;
  pr.begin_iteration();
  pr.observe(BB_BUBBLE_STEADY, 1000);
  pr.begin_iteration();
  pr.observe(BB_BUBBLE_STEADY, 3000);
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_STEADY) == 1000);
}

TEST_CASE("predictor_without_iteration_marks_uses_per_kind_history") {
  BubblePredictor pr;
  for (int i = 0; i < 300; ++i) feed(pr, kIteration, 1.0, /*mark=*/false);
  CHECK_FALSE(pr.iterations_marked());
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 3'000'000);
  CHECK(pr.predict(BB_BUBBLE_COOLDOWN) == 6'000'000);
  // Steady bubbles of two lengths: the median of the recent ones, one of the two.
  const uint64_t steady = pr.predict(BB_BUBBLE_STEADY);
  CHECK((steady == 250'000 || steady == 400'000));
  CHECK(pr.predict(BB_BUBBLE_OTHER) == 0);
  // Still robust to an outlier, and still adapting.
  pr.observe(BB_BUBBLE_WARMUP, 1);
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 3'000'000);
  for (int i = 0; i < 3; ++i) pr.observe(BB_BUBBLE_WARMUP, 5'000'000);
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 5'000'000);
}

TEST_CASE("predictor_positions_beyond_the_table_fall_back_to_kind") {
  BubblePredictor pr;
  std::vector<Slot> many;
  for (uint32_t i = 0; i < BubblePredictor::kMaxPositions + 10; ++i)
    many.push_back({BB_BUBBLE_STEADY, 1000 + i});
  for (int it = 0; it < 3; ++it) feed(pr, many);
  const auto pred = feed(pr, many);
  for (uint32_t i = 0; i < BubblePredictor::kMaxPositions; ++i) CHECK(pred[i] == 1000 + i);
  // Past the table: the median of the latest steady bubbles, all from the overflow tail.
  for (uint32_t i = BubblePredictor::kMaxPositions; i < many.size(); ++i) {
    CHECK(pred[i] >= 1000 + BubblePredictor::kMaxPositions - 5);
    CHECK(pred[i] <= 1000 + many.size());
  }
}

TEST_CASE("predictor_seed_serves_until_observed") {
  BubblePredictor pr;
  const uint64_t seeds[] = {2'000'000, 0, 500'000};
  pr.seed(seeds, 3);
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 2'000'000);
  pr.observe(BB_BUBBLE_WARMUP, 2'500'000);
  CHECK(pr.predict(BB_BUBBLE_STEADY) == 0);  // position 1 was left unseeded
  pr.observe(BB_BUBBLE_STEADY, 100'000);
  CHECK(pr.predict(BB_BUBBLE_COOLDOWN) == 500'000);
  pr.observe(BB_BUBBLE_COOLDOWN, 700'000);
  // One observation longer than the seed: the seed still bounds the prediction (the first
  // iteration is often the slow one); an unseeded position predicts what it saw.
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 2'000'000);
  pr.observe(BB_BUBBLE_WARMUP, 2'500'000);
  CHECK(pr.predict(BB_BUBBLE_STEADY) == 100'000);
  pr.observe(BB_BUBBLE_STEADY, 100'000);
  CHECK(pr.predict(BB_BUBBLE_COOLDOWN) == 500'000);
  pr.observe(BB_BUBBLE_COOLDOWN, 700'000);
  // From the second observation on, observations replace seeds entirely.
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 2'500'000);
  pr.observe(BB_BUBBLE_WARMUP, 2'500'000);
  pr.observe(BB_BUBBLE_STEADY, 100'000);
  CHECK(pr.predict(BB_BUBBLE_COOLDOWN) == 700'000);
  // A later seed does not override what was observed; null and oversize inputs are safe.
  const uint64_t late[] = {9, 9, 9};
  pr.seed(late, 3);
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 2'500'000);
  pr.seed(nullptr, 5);
  std::vector<uint64_t> big(BubblePredictor::kMaxPositions + 50, 42);
  pr.seed(big.data(), static_cast<uint32_t>(big.size()));
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 2'500'000);
}

TEST_CASE("predictor_a_slow_first_iteration_does_not_become_the_next_deadline") {
  // Declared: 3 ms and 0.4 ms. The first iteration is 600 times slower (communicators being
  // set up): the second is still predicted from the declaration, a shorter one is believed at
  // once, and from the third iteration on the lower of the two observations counts.
  BubblePredictor pr;
  const uint64_t seeds[] = {3'000'000, 400'000};
  pr.seed(seeds, 2);
  pr.begin_iteration();
  pr.observe(BB_BUBBLE_WARMUP, 1'800'000'000);
  pr.observe(BB_BUBBLE_STEADY, 300'000);
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 3'000'000);
  pr.observe(BB_BUBBLE_WARMUP, 3'100'000);
  CHECK(pr.predict(BB_BUBBLE_STEADY) == 300'000);
  pr.observe(BB_BUBBLE_STEADY, 350'000);
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 3'100'000);
  pr.observe(BB_BUBBLE_WARMUP, 3'100'000);
  CHECK(pr.predict(BB_BUBBLE_STEADY) == 300'000);
  // The same with lengths in model units, once the scale is known (1 ms per unit here).
  bb::core::UnitScale scale{2'000'000, 2};
  BubblePredictor units;
  const uint64_t model[] = {3, 1};
  units.seed_units(model, 2, &scale, false);
  units.begin_iteration();
  CHECK(units.predict(BB_BUBBLE_WARMUP) == 3'000'000);
  units.observe(BB_BUBBLE_WARMUP, 900'000'000);
  units.begin_iteration();
  CHECK(units.predict(BB_BUBBLE_WARMUP) == 3'000'000);
}

TEST_CASE("predictor_forgets_a_position_whose_kind_changes") {
  BubblePredictor pr;
  for (int i = 0; i < 4; ++i) {
    pr.begin_iteration();
    pr.observe(BB_BUBBLE_WARMUP, 1'000'000);
  }
  // The schedule changed: position 0 is now a steady wait.
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_STEADY) == 0);  // no steady history anywhere yet
  pr.observe(BB_BUBBLE_STEADY, 30'000);
  pr.begin_iteration();
  CHECK(pr.predict(BB_BUBBLE_STEADY) == 30'000);
  // A kind the caller never declared is kept apart from the warm-up history.
  CHECK(pr.predict(BB_BUBBLE_WARMUP) == 1'000'000);
}

TEST_CASE("predictor_tolerates_out_of_range_kinds") {
  BubblePredictor pr;
  const auto bogus = static_cast<bb_bubble_kind>(77);
  pr.observe(bogus, 1234);
  CHECK(pr.predict(bogus) == 1234);
  CHECK(pr.predict(BB_BUBBLE_OTHER) == 1234);
  CHECK(pr.predict(BB_BUBBLE_STEADY) == 0);
}

TEST_CASE("predictor_reset_forgets_everything") {
  BubblePredictor pr;
  for (int i = 0; i < 3; ++i) feed(pr, kIteration);
  pr.reset();
  CHECK_FALSE(pr.iterations_marked());
  CHECK(pr.position() == 0);
  for (const auto& s : kIteration) CHECK(pr.predict(s.kind) == 0);
}

// ---- a schedule declared without times: model units scaled by measured compute -------------

namespace {

using bb::core::ScheduledBubble;

std::vector<ScheduledBubble> receive_waits_of(uint64_t f, uint64_t b, bool units) {
  bb::core::ScheduleParams sp;
  sp.kind = bb::core::ScheduleKind::k1F1B;
  sp.stages = 4;
  sp.microbatches = 8;
  sp.fwd_ns = f;
  sp.bwd_ns = b;
  if (units) sp = bb::core::unit_times(sp);
  bb::core::Schedule s;
  std::string err;
  REQUIRE(bb::core::simulate_schedule(sp, &s, &err) == BB_OK);
  return bb::core::receive_waits(s, 2);
}

struct Measured {
  bb::core::UnitScale scale;
  BubblePredictor lengths, gaps;
  std::vector<uint64_t> unit_len, unit_gap, true_len, true_gap;

  // Declares 1F1B p=4 m=8, stage 2, receive waits, in units; the truth runs at f and b.
  Measured(uint64_t f, uint64_t b) {
    const auto u = receive_waits_of(0, 0, true), t = receive_waits_of(f, b, false);
    REQUIRE(u.size() == t.size());
    const uint64_t unit_iter = 3 * (8 + 3), true_iter = (f + b) * (8 + 3);  // (m+p-1)(F+B)
    unit_gap = bb::core::gaps_before(u, unit_iter);
    true_gap = bb::core::gaps_before(t, true_iter);
    for (size_t i = 0; i < u.size(); ++i) {
      unit_len.push_back(u[i].duration_ns);
      true_len.push_back(t[i].duration_ns);
    }
    lengths.seed_units(unit_len.data(), uint32_t(unit_len.size()), &scale, false);
    gaps.seed_units(unit_gap.data(), uint32_t(unit_gap.size()), &scale, true);
  }

  // One iteration in the trainer's order: observe the gap before the bubble (none before the
  // very first), predict the length, observe the length. Returns the length predictions.
  std::vector<uint64_t> iterate(bool first, std::vector<uint64_t>* gap_predictions = nullptr) {
    std::vector<uint64_t> predicted;
    lengths.begin_iteration();
    gaps.begin_iteration();
    for (size_t i = 0; i < true_len.size(); ++i) {
      if (first && i == 0) gaps.skip();
      else gaps.observe(BB_BUBBLE_OTHER, true_gap[i]);
      predicted.push_back(lengths.predict(BB_BUBBLE_STEADY));
      if (gap_predictions) gap_predictions->push_back(gaps.predict(BB_BUBBLE_OTHER));
      lengths.observe(BB_BUBBLE_STEADY, true_len[i]);
    }
    return predicted;
  }
};

}  // namespace

TEST_CASE("predictor_units_scale_by_the_compute_seen_in_the_first_iteration") {
  // Real times 1.3 ms forward, 2.6 ms backward: the library was told neither.
  Measured m(1'300'000, 2'600'000);
  REQUIRE(m.true_len.size() == 16);
  // Nothing observed yet: no scale, no prediction.
  m.lengths.begin_iteration();
  CHECK(m.lengths.predict(BB_BUBBLE_STEADY) == 0);
  std::vector<uint64_t> gap_pred;
  const auto first = m.iterate(true, &gap_pred);
  // The first wait comes before any compute; from the second on the scale is known.
  CHECK(first[0] == 0);
  size_t predicted = 0;
  for (size_t i = 1; i < first.size(); ++i) {
    CAPTURE(i);
    // A wait the model says is zero is predicted as 1 ns: "nothing to hand out", not "no idea".
    const double truth = double(m.true_len[i]), err = double(first[i]) - truth;
    CHECK(first[i] > 0);
    CHECK(std::abs(err) <= 0.001 * truth + 1);
    if (m.true_len[i] > 0) ++predicted;
  }
  CHECK(predicted > 0);  // the steady waits of this stage are not all zero
  // Predictive wake: each gap after a bubble is known once the scale is.
  for (size_t i = 1; i + 1 < gap_pred.size(); ++i)
    CHECK(double(gap_pred[i]) == doctest::Approx(double(m.true_gap[i + 1])).epsilon(0.001));
  CHECK(m.scale.model_units > 0);
  CHECK(double(m.scale.observed_ns) / double(m.scale.model_units) ==
        doctest::Approx(1'300'000.0).epsilon(1e-9));
}

TEST_CASE("predictor_observations_replace_unit_seeds") {
  Measured m(1'000'000, 2'000'000);
  m.iterate(true);
  m.iterate(false);
  // Every position observed twice: the third iteration predicts what was seen, whatever the
  // model said (here the truth shifts to show whose number comes back).
  for (auto& t : m.true_len) t += 12'345;
  const auto third = m.iterate(false);
  for (size_t i = 0; i < third.size(); ++i) CHECK(third[i] == m.true_len[i] - 12'345);
  // A new declaration does not override observations either.
  m.lengths.seed_units(m.unit_len.data(), uint32_t(m.unit_len.size()), &m.scale, false);
  m.lengths.begin_iteration();
  CHECK(m.lengths.predict(BB_BUBBLE_STEADY) == m.true_len[0] - 12'345);
}

TEST_CASE("predictor_unit_seeds_with_skewed_times_stay_in_range") {
  // Backward three times the forward, not the model's two: the scale still lands between
  // the two real times, so no prediction is off by more than that ratio.
  Measured m(1'000'000, 3'000'000);
  const auto first = m.iterate(true);
  const double per_unit = double(m.scale.observed_ns) / double(m.scale.model_units);
  CHECK(per_unit > 1'000'000.0);
  CHECK(per_unit < 1'500'000.0);
  for (size_t i = 1; i < first.size(); ++i) {
    CHECK(double(first[i]) >= double(m.unit_len[i]) * 1'000'000.0);
    CHECK(double(first[i]) <= double(m.unit_len[i]) * 1'500'000.0 + 1);
  }
}

TEST_CASE("predictor_unit_seeds_past_the_table_and_a_new_declaration") {
  bb::core::UnitScale scale;
  BubblePredictor gaps, lengths;
  std::vector<uint64_t> units(BubblePredictor::kMaxPositions + 20, 3);
  // More positions than the table holds: the rest is simply not seeded.
  gaps.seed_units(units.data(), uint32_t(units.size()), &scale, true);
  lengths.seed_units(units.data(), uint32_t(units.size()), &scale, false);
  gaps.begin_iteration();
  lengths.begin_iteration();
  for (uint32_t i = 0; i < BubblePredictor::kMaxPositions + 10; ++i) {
    gaps.observe(BB_BUBBLE_OTHER, 3000);
    lengths.observe(BB_BUBBLE_STEADY, 1);
  }
  // Position 0 does not measure (work outside the schedule precedes it), 1..127 do.
  CHECK(scale.model_units == 3 * (BubblePredictor::kMaxPositions - 1));
  CHECK(scale.observed_ns == 3000 * (BubblePredictor::kMaxPositions - 1));
  // A known-times declaration replaces the unit seeds of positions not yet observed.
  BubblePredictor fresh;
  fresh.seed_units(units.data(), 4, &scale, false);
  fresh.begin_iteration();
  CHECK(fresh.predict(BB_BUBBLE_STEADY) == 3000);  // 3 units at 1000 ns per unit
  const uint64_t ns[] = {777};
  fresh.seed(ns, 1);
  CHECK(fresh.predict(BB_BUBBLE_STEADY) == 777);
  fresh.observe(BB_BUBBLE_STEADY, 5);
  CHECK(fresh.predict(BB_BUBBLE_COOLDOWN) == 0);  // position 1: the unit seed went with it
  fresh.reset();
  fresh.begin_iteration();
  CHECK(fresh.predict(BB_BUBBLE_STEADY) == 0);
}
