#include <doctest/doctest.h>

#include "core/wake.h"

using bb::core::sleep_lateness;
using bb::core::wake_head;

TEST_CASE("wake_head_is_the_lead_plus_the_mean_lateness") {
  CHECK(wake_head(50'000, 0) == 50'000);
  CHECK(wake_head(50'000, 80'000) == 130'000);
}

TEST_CASE("wake_head_adds_at_most_four_leads_of_lateness") {
  CHECK(wake_head(50'000, 200'000) == 250'000);
  CHECK(wake_head(50'000, 10'000'000) == 250'000);
  CHECK(wake_head(0, 80'000) == 0);  // a lead of 0 asks for no margin, and gets none
  CHECK(wake_head(1'000'000'000, UINT64_MAX / 8) == 5'000'000'000ull);  // the largest lead allowed
}

TEST_CASE("a_sleep_its_timer_ended_late_says_exactly_how_late") {
  uint64_t late = 1;
  REQUIRE(sleep_lateness(true, 1'000, 100'000, 180'000, &late));
  CHECK(late == 80'000);
}

TEST_CASE("a_sleep_its_timer_ended_on_time_says_not_late") {
  uint64_t late = 1;
  REQUIRE(sleep_lateness(true, 1'000, 100'000, 100'000, &late));
  CHECK(late == 0);
}

TEST_CASE("a_sleep_a_wake_ended_after_its_time_says_at_least_that_late") {
  // The trainer's wake came first: the timer had not fired yet, so the sleep would have ended
  // later still. These are the sleeps the lateness is for, so they count.
  uint64_t late = 0;
  REQUIRE(sleep_lateness(false, 1'000, 100'000, 150'000, &late));
  CHECK(late == 50'000);
}

TEST_CASE("a_sleep_a_wake_ended_early_says_nothing") {
  uint64_t late = 7;
  CHECK_FALSE(sleep_lateness(false, 1'000, 100'000, 60'000, &late));
  CHECK(late == 7);
}

TEST_CASE("a_sleep_begun_after_its_time_says_nothing") {
  // The task lost its CPU between deciding to sleep and sleeping: that is not timer lateness.
  uint64_t late = 7;
  CHECK_FALSE(sleep_lateness(true, 100'000, 100'000, 400'000, &late));
  CHECK_FALSE(sleep_lateness(true, 300'000, 100'000, 400'000, &late));
  CHECK(late == 7);
}
