// A trainer opened in the test process through the public C ABI, closed at the end of the test,
// with the few things the multi-process tests keep doing with one: read its statistics and
// tasks, and run bubbles (a sleep stands for the GPU computing elsewhere) until a condition
// holds. Needs doctest and bubble.h included first.
#pragma once

#include <bubble/bubble.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tests/helpers/proc.h"

namespace bbtest {

struct TrainerFixture {
  bb_trainer_h h = nullptr;
  explicit TrainerFixture(const char* job, uint32_t rank = 0, uint32_t max_slots = 64,
                          uint32_t max_running = 1) {
    bb_trainer_options_t o;
    bb_trainer_options_init(&o);
    o.max_slots = max_slots;
    o.max_running = max_running;
    const bb_status st = bb_trainer_open(job, rank, &o, &h);
    INFO(bb_last_error());
    REQUIRE(st == BB_OK);
  }
  ~TrainerFixture() { bb_trainer_close(h); }
  TrainerFixture(const TrainerFixture&) = delete;
  TrainerFixture& operator=(const TrainerFixture&) = delete;

  bb_trainer_stats_t stats() const {
    bb_trainer_stats_t s{sizeof s};
    bb_trainer_stats(h, &s);
    return s;
  }
  std::vector<bb_task_info_t> tasks() const {
    std::vector<bb_task_info_t> v(64);
    for (auto& t : v) t.size = sizeof t;
    size_t n = 0;
    bb_trainer_tasks(h, v.data(), v.size(), &n);
    v.resize(std::min<size_t>(n, 64));
    return v;
  }
  // The id of the attached task of that name (0 if it does not show up).
  uint64_t task_id(const char* name) const {
    uint64_t id = 0;
    eventually([&] {
      for (auto& t : tasks())
        if (std::string(t.name) == name) id = t.id;
      return id != 0;
    });
    return id;
  }
  // One bubble of `len_us` (the sleep stands for the GPU computing elsewhere), then a gap.
  void bubble(uint64_t len_us = 2000, uint64_t gap_us = 500, uint64_t free_mem = BB_MEM_UNKNOWN) {
    CHECK(bb_bubble_begin(h, len_us * 1000, free_mem, BB_BUBBLE_STEADY) == BB_OK);
    std::this_thread::sleep_for(std::chrono::microseconds(len_us));
    CHECK(bb_bubble_end(h) == BB_OK);
    std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
  }
  // Runs bubbles until cond holds, returning whether it held. With max_bubbles the bound is that
  // many bubbles (for what must happen within so many); without, it is a generous 60 s, so a
  // task starved of CPU on a loaded machine still gets its turn (a count of bubbles would shrink
  // to a few seconds of the task's own time when two cores run a dozen processes).
  template <typename F>
  bool bubbles_until(F&& cond, int max_bubbles = 0) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (int i = 0; max_bubbles ? i < max_bubbles : std::chrono::steady_clock::now() < until;
         ++i) {
      if (cond()) return true;
      bubble();
    }
    return cond();
  }
};

}  // namespace bbtest
