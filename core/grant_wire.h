// How a grant crosses the hub: the record in a task's SlotCtl (a seqlock the hub service thread
// writes) and the words around it. Both sides use these, so the order of stores and loads that
// makes the record consistent lives in one place.
//
// Sync points:
//   G1: service writes the record, grant_id, revoke_id and its deadline between two grant_seq
//       stores (odd, then even, release), then bumps grant_change (release)
//       -> task loads grant_change (acquire), then reads the words and the record under grant_seq.
//   G2: task stores TaskPage::grant_released (release) after unmapping
//       -> service loads it (acquire) and only then releases the memory.
#pragma once

#include <atomic>
#include <cstring>

#include "core/grant.h"
#include "shm/futex.h"
#include "shm/layout.h"

namespace bb::core {

inline shm::GrantRecord to_record(const Grant& g) {
  shm::GrantRecord r{};
  r.id = g.id;
  r.offset = g.offset;
  r.size = g.size;
  r.backend = static_cast<uint32_t>(g.backend);
  r.device = g.handle.device;
  r.map_offset = g.handle.map_offset;
  r.map_size = g.handle.map_size;
  static_assert(sizeof r.ipc == sizeof g.handle.ipc);
  std::memcpy(r.ipc, g.handle.ipc, sizeof r.ipc);
  static_assert(sizeof r.device_uuid == sizeof g.handle.device_uuid);
  std::memcpy(r.device_uuid, g.handle.device_uuid, sizeof r.device_uuid);
  return r;
}

// The record as a Grant to validate_grant() and map: never a descriptor.
inline Grant from_record(const shm::GrantRecord& r) {
  Grant g;
  g.id = r.id;
  g.offset = r.offset;
  g.size = r.size;
  g.backend = static_cast<GrantBackend>(r.backend);
  g.handle.device = r.device;
  g.handle.map_offset = r.map_offset;
  g.handle.map_size = r.map_size;
  g.handle.fd = -1;
  std::memcpy(g.handle.ipc, r.ipc, sizeof r.ipc);
  std::memcpy(g.handle.device_uuid, r.device_uuid, sizeof r.device_uuid);
  return g;
}

// Service thread: one change of the grant words (record, grant_id, revoke_id and its deadline)
// under the grant_seq seqlock, so a task reads all of a change or none of it (a grant_id from
// before a release beside a record from after it read as a corrupt record). The caller bumps
// grant_change once the words are set.
template <typename Change>
inline void change_grant_words(shm::SlotCtl* c, Change&& change) {
  const uint32_t s = c->grant_seq.load(std::memory_order_relaxed);
  c->grant_seq.store(s + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  change();
  c->grant_seq.store(s + 2, std::memory_order_release);
}

// The grant offered to the task (record and id), or none (g == nullptr); no revoke asked.
inline void write_grant(shm::SlotCtl* c, const Grant* g) {
  const shm::GrantRecord r = g ? to_record(*g) : shm::GrantRecord{};
  change_grant_words(c, [&] {
    // The record is plain memory the task reads concurrently under the seqlock; copying it
    // with memcpy between the two fences is the usual seqlock write.
    std::memcpy(&c->grant, &r, sizeof r);
    c->grant_id.store(g ? g->id : 0, std::memory_order_relaxed);
    c->revoke_id.store(0, std::memory_order_relaxed);
    c->revoke_deadline_ns.store(0, std::memory_order_relaxed);
  });
}

// The revoke of grant `id` asked, by deadline_ns (the grant itself stays as it is).
inline void write_revoke(shm::SlotCtl* c, uint64_t id, uint64_t deadline_ns) {
  change_grant_words(c, [&] {
    c->revoke_deadline_ns.store(deadline_ns, std::memory_order_relaxed);
    c->revoke_id.store(id, std::memory_order_relaxed);
  });
}

struct GrantWords {
  uint64_t grant_id = 0;
  uint64_t revoke_id = 0;
  uint64_t revoke_deadline_ns = 0;
  shm::GrantRecord record{};  // valid when grant_id != 0 and record.id == grant_id
};

// Task: a consistent copy of the grant words. False when the record kept changing (the writer
// is mid-update far more often than it should be): try again later.
inline bool read_grant(const shm::SlotCtl* c, GrantWords* out) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    const uint32_t s0 = c->grant_seq.load(std::memory_order_acquire);
    if (s0 & 1) {
      shm::cpu_relax();
      continue;
    }
    out->grant_id = c->grant_id.load(std::memory_order_acquire);
    out->revoke_id = c->revoke_id.load(std::memory_order_acquire);
    out->revoke_deadline_ns = c->revoke_deadline_ns.load(std::memory_order_relaxed);
    std::memcpy(&out->record, &c->grant, sizeof out->record);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (c->grant_seq.load(std::memory_order_relaxed) == s0) return true;
  }
  return false;
}

}  // namespace bb::core
