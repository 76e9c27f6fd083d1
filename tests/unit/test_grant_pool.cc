// GrantPool: placement policies, coalescing, limits, and exact accounting under random use.
#include <doctest/doctest.h>

#include <map>
#include <random>
#include <vector>

#include "core/grant_pool.h"

using bb::core::Extent;
using bb::core::FitPolicy;
using bb::core::GrantPool;

namespace {

std::unique_ptr<GrantPool> make_pool(uint64_t cap, uint64_t align, uint32_t max, FitPolicy p) {
  std::unique_ptr<GrantPool> pool;
  std::string err;
  REQUIRE(GrantPool::create(cap, align, max, p, &pool, &err) == BB_OK);
  return pool;
}

uint64_t alloc(GrantPool& p, uint64_t size) {
  uint64_t off = ~0ull;
  REQUIRE(p.alloc(size, &off, nullptr) == BB_OK);
  return off;
}

}  // namespace

TEST_CASE("grant pool rejects bad parameters with a reason") {
  std::unique_ptr<GrantPool> p;
  std::string err;
  CHECK(GrantPool::create(1 << 20, 3, 8, FitPolicy::kFirstFit, &p, &err) == BB_E_INVALID);
  CHECK(err.find("power of two") != std::string::npos);
  CHECK(GrantPool::create(1000, 4096, 8, FitPolicy::kFirstFit, &p, &err) == BB_E_INVALID);
  CHECK(err.find("4096") != std::string::npos);
  CHECK(GrantPool::create(1 << 20, 4096, 0, FitPolicy::kFirstFit, &p, &err) == BB_E_INVALID);
  CHECK(!p);
}

TEST_CASE("grant pool rounds capacity down and sizes up to the alignment") {
  auto p = make_pool(10 * 4096 + 100, 4096, 8, FitPolicy::kFirstFit);
  CHECK(p->capacity() == 10 * 4096);
  uint64_t off = 0, rounded = 0;
  REQUIRE(p->alloc(1, &off, &rounded) == BB_OK);
  CHECK(off == 0);
  CHECK(rounded == 4096);
  CHECK(p->used() == 4096);
  CHECK(p->size_at(0) == 4096);
  CHECK(p->alloc(0, &off, &rounded) == BB_E_INVALID);
  CHECK(p->alloc(10 * 4096, &off, &rounded) == BB_E_NOMEM);  // only 9 pages left
  CHECK(p->alloc(~0ull, &off, &rounded) == BB_E_NOMEM);
  CHECK(p->check());
}

TEST_CASE("first fit takes the lowest hole, best fit the tightest") {
  for (FitPolicy policy : {FitPolicy::kFirstFit, FitPolicy::kBestFit}) {
    auto p = make_pool(100, 1, 16, policy);
    uint64_t a = alloc(*p, 30), b = alloc(*p, 10), c = alloc(*p, 10), d = alloc(*p, 10);
    (void)d;
    CHECK(a == 0);
    CHECK(b == 30);
    CHECK(c == 40);
    REQUIRE(p->free(a) == BB_OK);  // hole [0, 30)
    REQUIRE(p->free(c) == BB_OK);  // hole [40, 50); tail [60, 100)
    uint64_t e = alloc(*p, 8);
    CHECK(e == (policy == FitPolicy::kFirstFit ? 0u : 40u));
    CHECK(p->check());
  }
}

TEST_CASE("freed neighbours coalesce back into one extent") {
  auto p = make_pool(1 << 16, 256, 8, FitPolicy::kBestFit);
  uint64_t a = alloc(*p, 1000), b = alloc(*p, 1000), c = alloc(*p, 1000);
  REQUIRE(p->free(b) == BB_OK);
  CHECK(p->free_extent_count() == 2);
  REQUIRE(p->free(a) == BB_OK);  // joins b's hole on its right
  CHECK(p->free_extent_count() == 2);
  REQUIRE(p->free(c) == BB_OK);  // joins both sides
  CHECK(p->free_extent_count() == 1);
  Extent e[2];
  REQUIRE(p->free_extents(e, 2) == 1);
  CHECK(e[0].offset == 0);
  CHECK(e[0].size == p->capacity());
  CHECK(p->used() == 0);
  CHECK(p->largest_free() == p->capacity());
}

TEST_CASE("bad frees are refused and change nothing") {
  auto p = make_pool(1 << 16, 4096, 8, FitPolicy::kFirstFit);
  uint64_t a = alloc(*p, 8192);
  CHECK(p->free(a + 4096) == BB_E_INVALID);  // inside a range
  CHECK(p->free(1 << 15) == BB_E_INVALID);   // a free place
  uint64_t size = 0;
  CHECK(p->free(a, &size) == BB_OK);
  CHECK(size == 8192);
  CHECK(p->free(a) == BB_E_INVALID);  // double free
  CHECK(p->used() == 0);
  CHECK(p->check());
}

TEST_CASE("the live-range limit gives BB_E_FULL, and frees make room again") {
  auto p = make_pool(1 << 20, 4096, 3, FitPolicy::kFirstFit);
  uint64_t a = alloc(*p, 1), b = alloc(*p, 1), c = alloc(*p, 1);
  uint64_t off;
  CHECK(p->alloc(1, &off, nullptr) == BB_E_FULL);
  REQUIRE(p->free(b) == BB_OK);
  CHECK(alloc(*p, 1) == b);
  (void)a;
  (void)c;
  CHECK(p->live() == 3);
  CHECK(p->check());
}

TEST_CASE("random alloc/free sequences never overlap and account exactly") {
  for (FitPolicy policy : {FitPolicy::kFirstFit, FitPolicy::kBestFit}) {
    for (uint64_t align : {1ull, 256ull, 2ull << 20}) {
      CAPTURE(static_cast<int>(policy));
      CAPTURE(align);
      const uint64_t cap = align * 997;
      const uint32_t max = 64;
      auto p = make_pool(cap, align, max, policy);
      std::mt19937_64 rng(align * 31 + static_cast<uint64_t>(policy));
      std::map<uint64_t, uint64_t> live;  // offset -> rounded size, the test's own model
      uint64_t model_used = 0;
      for (int step = 0; step < 20000; ++step) {
        const bool do_alloc = live.empty() || (rng() % 100) < 55;
        if (do_alloc) {
          uint64_t size = 1 + rng() % (align * 40);
          uint64_t off = 0, rounded = 0;
          bb_status st = p->alloc(size, &off, &rounded);
          if (st != BB_OK) {
            // Refusals must be honest: full table, or truly no extent large enough.
            uint64_t want = (size + align - 1) / align * align;
            if (st == BB_E_FULL) CHECK(live.size() == max);
            else CHECK((st == BB_E_NOMEM && p->largest_free() < want));
            continue;
          }
          CHECK(rounded >= size);
          CHECK(rounded - size < align);
          CHECK(off % align == 0);
          CHECK(off + rounded <= cap);
          // No overlap with any live range of the model.
          auto next = live.lower_bound(off);
          if (next != live.end()) CHECK(off + rounded <= next->first);
          if (next != live.begin()) {
            auto prev = std::prev(next);
            CHECK(prev->first + prev->second <= off);
          }
          live[off] = rounded;
          model_used += rounded;
        } else {
          auto it = live.begin();
          std::advance(it, rng() % live.size());
          uint64_t size = 0;
          REQUIRE(p->free(it->first, &size) == BB_OK);
          CHECK(size == it->second);
          model_used -= it->second;
          live.erase(it);
        }
        REQUIRE(p->used() == model_used);
        REQUIRE(p->used() + p->free_bytes() == cap);
        REQUIRE(p->live() == live.size());
        if (step % 97 == 0) REQUIRE(p->check());
      }
      for (auto& [off, size] : live) REQUIRE(p->free(off) == BB_OK);
      CHECK(p->used() == 0);
      CHECK(p->free_extent_count() == 1);
      CHECK(p->check());
    }
  }
}
