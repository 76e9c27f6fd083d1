// A hostile task scribbling over all it can write, beside a well-behaved one.
#include <bubble/bubble.h>
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <string>

#include "core/observer.h"
#include "core/paths.h"
#include "tests/helpers/proc.h"

using bbtest::Child;
using bbtest::RuntimeDir;

TEST_CASE("hostile_task_cannot_crash_stall_or_corrupt_the_trainer") {
  RuntimeDir dir;
  bb_trainer_h t = nullptr;
  bb_trainer_options_t o;
  bb_trainer_options_init(&o);
  o.max_running = 2;
  REQUIRE(bb_trainer_open("hostile", 0, &o, &t) == BB_OK);
  std::string sock;
  REQUIRE(bb::core::hub_paths(dir.path(), "hostile", 0, &sock, nullptr) == BB_OK);
  Child good({BB_TEST_TASK, "hostile", "0", "good", "iterative", "--step-us", "100"});
  REQUIRE(good.wait_line("ATTACHED") != "");
  // Under a sanitizer the fault must still be a plain SIGSEGV, not a sanitizer report.
  setenv("ASAN_OPTIONS", "handle_segv=0", 1);
  setenv("TSAN_OPTIONS", "handle_segv=0", 1);
  Child evil({BB_HOSTILE_TASK, sock, "1.5"});
  unsetenv("ASAN_OPTIONS");
  unsetenv("TSAN_OPTIONS");
  REQUIRE(evil.wait_line("ATTACHED") != "");

  // The trainer runs bubbles all through the attack. Every call returns at once with BB_OK
  // (counted, not timed), and the bubble count is exact.
  uint64_t calls = 0, failures = 0;
  bool evil_done = false;
  int evil_status = -1;
  for (int i = 0; i < 20000 && !evil_done; ++i) {
    failures += bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) != BB_OK;
    std::this_thread::sleep_for(std::chrono::microseconds(300));  // the GPU computing elsewhere
    failures += bb_bubble_end(t) != BB_OK;
    calls += 2;
    if (i % 50 == 0) {
      evil_status = evil.wait_exit(0);
      evil_done = evil_status != -1;
    }
  }
  REQUIRE(evil_done);
  CHECK(failures == 0);
  bb_trainer_stats_t s{sizeof s};
  REQUIRE(bb_trainer_stats(t, &s) == BB_OK);
  CHECK(s.bubbles == calls / 2);
  // The write into the trainer's pages faulted in the hostile task only.
  CHECK(evil.lines().size() >= 1);
  CHECK(evil.wait_line("SCRIBBLED", 100).find("SCRIBBLED") == 0);
  CHECK(WIFSIGNALED(evil_status));
  CHECK(WTERMSIG(evil_status) == SIGSEGV);
  // It was marked bad while it scribbled, and the good task kept working beside it.
  CHECK(s.tasks_bad >= 1);
  uint64_t good_steps = 0;
  bb_task_info_t info[4];
  for (auto& i : info) i.size = sizeof i;
  size_t n = 0;
  REQUIRE(bb_trainer_tasks(t, info, 4, &n) == BB_OK);
  for (size_t i = 0; i < n && i < 4; ++i)
    if (std::string(info[i].name) == "good") good_steps = info[i].steps;
  CHECK(good_steps > 0);
  // The hub itself still validates for an observer.
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  CHECK(bb::core::HubObserver::open("", "hostile", 0, &obs, &err) == BB_OK);
  obs.reset();
  bb_trainer_close(t);
  CHECK(dir.files().empty());
}
