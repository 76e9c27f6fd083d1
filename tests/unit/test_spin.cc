#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "core/clock.h"
#include "shm/futex.h"

using bb::core::now_ns;
using bb::shm::spin_until_changed;

TEST_CASE("spin_until_changed_gives_up_after_its_spin_without_a_time") {
  std::atomic<uint32_t> word{7};
  uint64_t seen = 123;
  CHECK_FALSE(spin_until_changed(&word, 7, 100'000, &seen));
  CHECK(seen == 0);
  CHECK_FALSE(spin_until_changed(&word, 7, 0, &seen));
  CHECK(seen == 0);
}

TEST_CASE("spin_until_changed_on_a_word_already_changed_has_no_time") {
  std::atomic<uint32_t> word{8};
  uint64_t seen = 123;
  CHECK(spin_until_changed(&word, 7, 1'000'000, &seen));
  CHECK(seen == 0);  // no poll was made: the caller reads the clock itself
  CHECK(spin_until_changed(&word, 7, 1'000'000));  // the time is optional
}

// A change made while the waiter polls is seen with the time of the poll that saw it: a clock
// read after the spin began and before it returned, and, as each poll reads the clock anew, one
// well after the spin began when the change came well after (not the read the spin began with).
// A waiter descheduled before its first look finds the word changed there and gets no time, and
// one descheduled for long between polls gets an early one, so the change is made 200 us after
// the waiter is ready, and again until one attempt has polled through.
TEST_CASE("spin_until_changed_times_a_change_seen_while_polling") {
  int polled_through = 0;
  for (int attempt = 0; attempt < 100 && polled_through == 0; ++attempt) {
    std::atomic<uint32_t> word{0};
    std::atomic<bool> ready{false};
    uint64_t called = 0, returned = 0, seen = 0;
    bool changed = false;
    std::thread waiter([&] {
      ready.store(true);
      called = now_ns();
      changed = spin_until_changed(&word, 0, 5'000'000'000ull, &seen);
      returned = now_ns();
    });
    while (!ready.load()) {
    }
    const uint64_t store_after = now_ns() + 200'000;
    while (now_ns() < store_after) {
    }
    word.store(1, std::memory_order_release);
    waiter.join();
    REQUIRE(changed);
    if (seen == 0) continue;
    CHECK(seen >= called);
    CHECK(seen <= returned);
    if (seen >= called + 100'000) ++polled_through;
  }
  CHECK(polled_through == 1);
}
