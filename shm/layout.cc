#include "shm/layout.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <ctime>

namespace bb::shm {
namespace {

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

}  // namespace

HubGeometry hub_geometry(uint32_t max_slots, uint32_t event_capacity) {
  HubGeometry g{};
  g.max_slots = max_slots;
  g.event_capacity = event_capacity;
  uint64_t off = align_up(sizeof(HubHeader), kCacheLine);
  g.bubble_offset = off;
  off = align_up(off + sizeof(BubbleState), kCacheLine);
  g.stats_offset = off;
  off = align_up(off + sizeof(HubStats), kCacheLine);
  g.slots_offset = off;
  off = align_up(off + uint64_t(max_slots) * sizeof(SlotCtl), kCacheLine);
  g.events_offset = off;
  g.entries_offset = off + kEventStreams * sizeof(EventLog);
  off = align_up(g.entries_offset + uint64_t(kEventStreams) * event_capacity * sizeof(EventEntry),
                 4096);
  g.layout_size = off;
  return g;
}

void init_hub(unsigned char* base, const HubGeometry& g, const char* job, uint32_t rank) {
  auto* h = reinterpret_cast<HubHeader*>(base);
  h->magic = kHubMagic;
  h->layout_version = kLayoutVersion;
  h->header_size = sizeof(HubHeader);
  h->layout_size = g.layout_size;
  h->max_slots = g.max_slots;
  h->event_capacity = g.event_capacity;
  h->slot_ctl_size = sizeof(SlotCtl);
  h->event_size = sizeof(EventEntry);
  h->bubble_offset = g.bubble_offset;
  h->stats_offset = g.stats_offset;
  h->slots_offset = g.slots_offset;
  h->events_offset = g.events_offset;
  h->creator_pid = int32_t(getpid());
  h->creator_uid = uint32_t(geteuid());
  h->created_ns = monotonic_ns();
  h->rank = rank;
  h->task_page_size = kTaskPageSize;
  std::snprintf(h->job, sizeof(h->job), "%s", job);
}

bool validate_hub(const unsigned char* base, uint64_t mapped_size, std::string* error) {
  char msg[256];
  auto fail = [&](const char* text) {
    if (error) *error = text;
    return false;
  };
  if (mapped_size < sizeof(HubHeader)) {
    std::snprintf(msg, sizeof msg, "hub segment is %llu bytes, smaller than its header",
                  (unsigned long long)mapped_size);
    return fail(msg);
  }
  HubHeader h;
  std::memcpy(&h, base, sizeof h);  // one copy: the fields cannot change while we check them
  if (h.magic != kHubMagic) return fail("the segment is not a libbubble hub (bad magic)");
  if (h.layout_version != kLayoutVersion) {
    std::snprintf(msg, sizeof msg,
                  "hub layout version %u is not supported by this libbubble (it speaks version "
                  "%u): build the task and the trainer against the same libbubble release",
                  h.layout_version, kLayoutVersion);
    return fail(msg);
  }
  if (h.header_size != sizeof(HubHeader) || h.slot_ctl_size != sizeof(SlotCtl) ||
      h.event_size != sizeof(EventEntry) || h.task_page_size != kTaskPageSize)
    return fail("hub header sizes do not match this libbubble's layout: the hub is corrupt");
  if (h.max_slots == 0 || h.max_slots > 256 || h.event_capacity < 64 ||
      h.event_capacity > 65536 || (h.event_capacity & (h.event_capacity - 1)) != 0)
    return fail("hub header has an out-of-range slot count or event capacity: the hub is corrupt");
  const HubGeometry g = hub_geometry(h.max_slots, h.event_capacity);
  if (h.layout_size != g.layout_size || h.bubble_offset != g.bubble_offset ||
      h.stats_offset != g.stats_offset || h.slots_offset != g.slots_offset ||
      h.events_offset != g.events_offset)
    return fail("hub header offsets are inconsistent: the hub is corrupt");
  if (h.layout_size > mapped_size) {
    std::snprintf(msg, sizeof msg, "hub declares %llu bytes but only %llu are mapped",
                  (unsigned long long)h.layout_size, (unsigned long long)mapped_size);
    return fail(msg);
  }
  if (std::memchr(h.job, 0, sizeof h.job) == nullptr)
    return fail("hub job id is not terminated: the hub is corrupt");
  return true;
}

void EventWriter::attach(const HubView& hub, EventStream stream) {
  log = hub.events(stream);
  entries = hub.event_entries(stream);
  mask = hub.header()->event_capacity - 1;
  next = log->next.load(std::memory_order_relaxed);
}

void EventWriter::append(EventKind kind, uint16_t slot, uint64_t ts_ns, uint64_t a, uint64_t b) {
  const uint64_t idx = next++;
  EventEntry& e = entries[idx & mask];
  e.commit.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e.kind.store(uint16_t(kind), std::memory_order_relaxed);
  e.slot.store(slot, std::memory_order_relaxed);
  e.ts_ns.store(ts_ns, std::memory_order_relaxed);
  e.a.store(a, std::memory_order_relaxed);
  e.b.store(b, std::memory_order_relaxed);
  e.commit.store(event_commit(idx), std::memory_order_release);
  log->next.store(idx + 1, std::memory_order_release);
}

}  // namespace bb::shm
