#include <doctest/doctest.h>

#include <cstring>
#include <vector>

#include "shm/layout.h"

using namespace bb::shm;

namespace {

struct Hub {
  HubGeometry g;
  std::vector<unsigned char> mem;
  explicit Hub(uint32_t slots = 64, uint32_t events = 4096) : g(hub_geometry(slots, events)) {
    mem.assign(g.layout_size + 64, 0);
    init_hub(base(), g, "job", 3);
  }
  // 64-byte aligned view into the vector.
  unsigned char* base() {
    auto p = reinterpret_cast<uintptr_t>(mem.data());
    return mem.data() + ((64 - p % 64) % 64);
  }
  HubHeader* header() { return reinterpret_cast<HubHeader*>(base()); }
  bool valid(std::string* err) { return validate_hub(base(), g.layout_size, err); }
};

}  // namespace

TEST_CASE("layout_fresh_hub_validates") {
  Hub h;
  std::string err;
  CHECK(h.valid(&err));
  CHECK(h.header()->rank == 3);
  CHECK(std::string(h.header()->job) == "job");
  HubView v{h.base()};
  CHECK(reinterpret_cast<uintptr_t>(v.slot(1)) % 64 == 0);
  CHECK(reinterpret_cast<uintptr_t>(v.bubble()) % 64 == 0);
}

TEST_CASE("layout_full_slot_table_stays_under_the_memory_budget") {
  // A hub with its full default table (64 slots, 4096 events) must stay well under 2 MiB.
  const HubGeometry g = hub_geometry(64, 4096);
  CHECK(g.layout_size < 2u * 1024 * 1024);
  const HubGeometry big = hub_geometry(256, 65536);
  CHECK(big.layout_size > g.layout_size);
}

TEST_CASE("layout_version_mismatch_names_both_versions") {
  Hub h;
  h.header()->layout_version = 99;
  std::string err;
  CHECK_FALSE(h.valid(&err));
  CHECK(err.find("version 99") != std::string::npos);
  CHECK(err.find("version " + std::to_string(kLayoutVersion)) != std::string::npos);
}

TEST_CASE("layout_rejects_bad_magic_sizes_and_offsets") {
  std::string err;
  {
    Hub h;
    h.header()->magic ^= 1;
    CHECK_FALSE(h.valid(&err));
    CHECK(err.find("magic") != std::string::npos);
  }
  {
    Hub h;
    h.header()->slot_ctl_size += 8;
    CHECK_FALSE(h.valid(&err));
  }
  {
    Hub h;
    h.header()->events_offset += 64;
    CHECK_FALSE(h.valid(&err));
    CHECK(err.find("offsets") != std::string::npos);
  }
  {
    Hub h;
    h.header()->max_slots = 100000;
    CHECK_FALSE(h.valid(&err));
  }
  {
    Hub h;
    h.header()->event_capacity = 100;  // not a power of two
    CHECK_FALSE(h.valid(&err));
  }
  {
    Hub h;
    std::memset(h.header()->job, 'x', sizeof h.header()->job);  // unterminated
    CHECK_FALSE(h.valid(&err));
  }
  {
    Hub h;
    CHECK_FALSE(validate_hub(h.base(), 16, &err));  // shorter than a header
    CHECK_FALSE(validate_hub(h.base(), h.g.layout_size - 4096, &err));  // truncated
  }
}

TEST_CASE("layout_event_log_keeps_the_newest_entries") {
  Hub h(4, 64);
  HubView v{h.base()};
  EventWriter w;
  w.attach(v, EventStream::kBubble);
  for (uint64_t i = 0; i < 100; ++i) w.append(EventKind::kBubbleBegin, 0xffff, i, i, 0);
  CHECK(v.events(EventStream::kBubble)->next.load() == 100);
  // Entry 99 sits at 99 % 64 and carries commit 100.
  const EventEntry& e = v.event_entries(EventStream::kBubble)[99 % 64];
  CHECK(e.commit.load() == 100);
  CHECK(e.a == 99);
}

TEST_CASE("layout_no_committed_event_reads_as_being_rewritten") {
  // A writer rewriting an entry stores commit 0 first; the entry of index 2^32 - 1 must not
  // commit as 0 too (index + 1's low bits), or a reader would take a torn copy of it.
  Hub h(4, 64);
  HubView v{h.base()};
  v.events(EventStream::kService)->next.store(0xfffffffeull);
  EventWriter w;
  w.attach(v, EventStream::kService);
  for (uint64_t i = 0; i < 3; ++i) w.append(EventKind::kTaskStep, 1, i, i, 0);
  const EventEntry* ring = v.event_entries(EventStream::kService);
  uint32_t seen[3];
  for (uint64_t i = 0; i < 3; ++i) {
    seen[i] = ring[(0xfffffffeull + i) & 63].commit.load();
    CHECK(seen[i] != 0);
    CHECK(seen[i] == event_commit(0xfffffffeull + i));
  }
  CHECK(seen[0] != seen[1]);
  CHECK(seen[1] != seen[2]);
}

TEST_CASE("layout_event_streams_are_separate_rings") {
  Hub h(4, 64);
  HubView v{h.base()};
  EventWriter bubble, service;
  bubble.attach(v, EventStream::kBubble);
  service.attach(v, EventStream::kService);
  for (uint64_t i = 0; i < 3; ++i) bubble.append(EventKind::kBubbleBegin, 0xffff, i, 10 + i, 0);
  service.append(EventKind::kTaskAttach, 2, 7, 4242, 0);
  CHECK(v.events(EventStream::kBubble)->next.load() == 3);
  CHECK(v.events(EventStream::kService)->next.load() == 1);
  const EventEntry& s0 = v.event_entries(EventStream::kService)[0];
  CHECK(s0.commit.load() == 1);
  CHECK(s0.kind.load() == uint16_t(EventKind::kTaskAttach));
  CHECK(s0.a.load() == 4242);
  CHECK(v.event_entries(EventStream::kBubble)[0].a.load() == 10);  // not overwritten
  // Both streams and their entries lie inside the segment.
  const auto end = reinterpret_cast<uintptr_t>(v.event_entries(EventStream::kService) + 64);
  CHECK(end <= reinterpret_cast<uintptr_t>(h.base()) + h.g.layout_size);
  CHECK(reinterpret_cast<uintptr_t>(v.event_entries(EventStream::kBubble) + 64) <=
        reinterpret_cast<uintptr_t>(v.event_entries(EventStream::kService)));
}
