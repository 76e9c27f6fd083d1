#include <doctest/doctest.h>

#include "core/predictor.h"

#include <cstdint>
#include <random>
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
  CHECK(sizeof(BubblePredictor) < 16 * 1024);
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
  // Observations replace seeds entirely.
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
