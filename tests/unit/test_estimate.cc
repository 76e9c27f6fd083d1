#include <doctest/doctest.h>

#include "core/estimate.h"

using bb::core::SmoothedEstimate;

TEST_CASE("smoothed_estimate_knows_nothing_before_a_sample") {
  SmoothedEstimate e;
  CHECK(e.bound() == 0);
  CHECK(e.mean == 0);
}

TEST_CASE("smoothed_estimate_starts_at_its_first_sample_with_a_quarter_of_it_as_deviation") {
  SmoothedEstimate e;
  e.observe(80'000);
  CHECK(e.mean == 80'000);
  CHECK(e.dev == 20'000);
  CHECK(e.bound() == 120'000);
}

TEST_CASE("smoothed_estimate_settles_on_a_steady_value") {
  SmoothedEstimate e;
  e.observe(10'000);
  for (int i = 0; i < 200; ++i) e.observe(80'000);
  // Integer steps of 1/8 stop within 8 ns of the value; the deviation decays towards nothing.
  CHECK(e.mean <= 80'000);
  CHECK(e.mean >= 80'000 - 8);
  CHECK(e.dev <= 4);
}

TEST_CASE("smoothed_estimate_moves_an_eighth_towards_one_outlier") {
  SmoothedEstimate e;
  for (int i = 0; i < 200; ++i) e.observe(80'000);
  const uint64_t before = e.mean;
  e.observe(80'000 + 800'000);  // one sleep that ended 0.8 ms late
  CHECK(e.mean == before - before / 8 + (80'000 + 800'000) / 8);
  CHECK(e.mean < 200'000);  // far from the outlier
  for (int i = 0; i < 60; ++i) e.observe(80'000);
  CHECK(e.mean < 81'000);  // and back within some tens of samples
}

TEST_CASE("smoothed_estimate_follows_a_change_within_tens_of_samples") {
  SmoothedEstimate e;
  for (int i = 0; i < 100; ++i) e.observe(30'000);
  for (int i = 0; i < 40; ++i) e.observe(90'000);
  CHECK(e.mean > 89'000);
  CHECK(e.mean <= 90'000);
}
