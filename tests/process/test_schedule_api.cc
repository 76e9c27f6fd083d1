// bb_trainer_set_schedule: a declared schedule seeds the predictor from the first iteration.
#include <bubble/bubble.h>
#include <doctest/doctest.h>

#include <string>

#include "core/observer.h"
#include "core/schedule.h"
#include "tests/helpers/proc.h"

TEST_CASE("declared_schedule_predicts_bubbles_from_the_first_iteration") {
  bbtest::RuntimeDir dir;
  bb_trainer_h t = nullptr;
  REQUIRE(bb_trainer_open("sched", 1, nullptr, &t) == BB_OK);
  bb_schedule_t sc;
  bb_schedule_init(&sc);
  sc.kind = BB_SCHEDULE_1F1B;
  sc.stages = 4;
  sc.microbatches = 8;
  sc.stage = 1;
  sc.fwd_ns = 1'000'000;
  sc.bwd_ns = 2'000'000;
  REQUIRE(bb_trainer_set_schedule(t, &sc) == BB_OK);

  bb::core::ScheduleParams p;
  p.kind = bb::core::ScheduleKind::k1F1B;
  p.stages = 4;
  p.microbatches = 8;
  p.fwd_ns = 1'000'000;
  p.bwd_ns = 2'000'000;
  bb::core::Schedule model;
  std::string err;
  REQUIRE(bb::core::simulate_schedule(p, &model, &err) == BB_OK);
  const auto& bubbles = model.stages[1].bubbles;
  REQUIRE(bubbles.size() >= 2);

  std::unique_ptr<bb::core::HubObserver> obs;
  REQUIRE(bb::core::HubObserver::open("", "sched", 1, &obs, &err) == BB_OK);
  bb_trainer_iteration(t);
  for (size_t i = 0; i < bubbles.size(); ++i) {
    // expected_ns = 0: the library predicts; the deadline it publishes is the declared length.
    REQUIRE(bb_bubble_begin(t, 0, BB_MEM_UNKNOWN, bubbles[i].kind) == BB_OK);
    const auto snap = obs->snapshot();
    CHECK(snap.bubble_deadline_ns - snap.bubble_begin_ns == bubbles[i].duration_ns);
    REQUIRE(bb_bubble_end(t) == BB_OK);
  }
  obs.reset();

  // What the schedule model rejects comes back as a clear error.
  sc.stage = 4;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("stage 4 is out of range") != std::string::npos);
  sc.stage = 0;
  sc.fwd_ns = 0;
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  sc.fwd_ns = 1;
  sc.kind = BB_SCHEDULE_INTERLEAVED;
  sc.chunks = 2;
  sc.microbatches = 6;  // not a multiple of the 4 stages
  CHECK(bb_trainer_set_schedule(t, &sc) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).size() > 10);
  bb_trainer_close(t);
}
