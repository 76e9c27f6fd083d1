#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "shm/ring.h"

using bb::shm::RingData;
using bb::shm::RingStatus;

namespace {

struct Item {
  uint64_t seq;
  uint64_t check;
};

struct Ring8 {
  RingData<Item, 8> data{};
  std::atomic<uint64_t> head{0};
  uint64_t cached = 0;
};

}  // namespace

TEST_CASE("ring_push_pop_in_order_until_full") {
  Ring8 r;
  for (uint64_t i = 0; i < 8; ++i)
    CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{i, ~i}) == RingStatus::kOk);
  CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{8, 0}) == RingStatus::kFull);
  CHECK_FALSE(bb::shm::ring_has_room(r.data, r.head));
  Item it;
  for (uint64_t i = 0; i < 8; ++i) {
    REQUIRE(bb::shm::ring_pop(r.data, r.head, &it) == RingStatus::kOk);
    CHECK(it.seq == i);
    CHECK(it.check == ~i);
  }
  CHECK(bb::shm::ring_pop(r.data, r.head, &it) == RingStatus::kEmpty);
  CHECK(bb::shm::ring_has_room(r.data, r.head));
}

TEST_CASE("ring_push_keeps_room_for_other_pushes_when_asked") {
  Ring8 r;
  // Pushes that keep 3 entries free stop at 5; plain pushes still fill the rest.
  for (uint64_t i = 0; i < 5; ++i)
    CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{i, 0}, 3) == RingStatus::kOk);
  CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{5, 0}, 3) == RingStatus::kFull);
  for (uint64_t i = 5; i < 8; ++i)
    CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{i, 0}) == RingStatus::kOk);
  CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{8, 0}) == RingStatus::kFull);
  // Once the consumer makes room the reserve counts from its new index.
  Item it;
  for (int i = 0; i < 4; ++i) REQUIRE(bb::shm::ring_pop(r.data, r.head, &it) == RingStatus::kOk);
  CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{8, 0}, 3) == RingStatus::kOk);
  CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{9, 0}, 3) == RingStatus::kFull);
  // A reserve of the whole ring or more still lets a push into an empty ring.
  Ring8 e;
  CHECK(bb::shm::ring_push(e.data, e.head, e.cached, Item{0, 0}, 100) == RingStatus::kOk);
  CHECK(bb::shm::ring_push(e.data, e.head, e.cached, Item{1, 0}, 100) == RingStatus::kFull);
}

TEST_CASE("ring_wraps_around_many_times") {
  Ring8 r;
  Item it;
  for (uint64_t i = 0; i < 1000; ++i) {
    REQUIRE(bb::shm::ring_push(r.data, r.head, r.cached, Item{i, i * 3}) == RingStatus::kOk);
    if (i % 3 == 2) {
      for (int k = 0; k < 3; ++k) REQUIRE(bb::shm::ring_pop(r.data, r.head, &it) == RingStatus::kOk);
      CHECK(it.seq == i);
    }
  }
}

TEST_CASE("ring_consumer_rejects_a_corrupt_producer_index") {
  Ring8 r;
  Item it;
  r.data.tail.store(100);  // a producer claiming 100 entries in an 8-entry ring
  CHECK(bb::shm::ring_pop(r.data, r.head, &it) == RingStatus::kCorrupt);
  r.head.store(200);  // behind the consumer: equally impossible
  CHECK(bb::shm::ring_pop(r.data, r.head, &it) == RingStatus::kCorrupt);
  CHECK(r.head.load() == 200);  // nothing consumed
}

TEST_CASE("ring_producer_rejects_a_corrupt_consumer_index") {
  Ring8 r;
  for (uint64_t i = 0; i < 8; ++i) bb::shm::ring_push(r.data, r.head, r.cached, Item{i, 0});
  r.head.store(1000);  // a consumer claiming to have read entries never written
  CHECK(bb::shm::ring_push(r.data, r.head, r.cached, Item{9, 0}) == RingStatus::kCorrupt);
  CHECK_FALSE(bb::shm::ring_has_room(r.data, r.head));
  CHECK(r.data.tail.load() == 8);
}

TEST_CASE("ring_transfers_every_item_between_threads") {
  Ring8 r;
  constexpr uint64_t kCount = 200000;
  std::thread producer([&] {
    for (uint64_t i = 0; i < kCount;) {
      if (bb::shm::ring_push(r.data, r.head, r.cached, Item{i, i ^ 0x5555}) == RingStatus::kOk) ++i;
    }
  });
  uint64_t expect = 0, bad = 0;
  Item it;
  while (expect < kCount) {
    const RingStatus st = bb::shm::ring_pop(r.data, r.head, &it);
    if (st == RingStatus::kEmpty) continue;
    REQUIRE(st == RingStatus::kOk);
    if (it.seq != expect || it.check != (expect ^ 0x5555)) ++bad;
    ++expect;
  }
  producer.join();
  CHECK(bad == 0);
}
