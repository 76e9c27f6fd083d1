// A single-producer single-consumer ring that lives in shared memory and survives a hostile
// peer. The producer's index and the entries sit in memory the producer writes; the consumer's
// index sits in memory the consumer writes (usually another segment), so neither side ever
// writes the other's memory. Each side validates the other's index before trusting it: a peer
// that corrupts its index makes the operation fail (Status::kCorrupt), never read or write out of
// bounds.
//
// Sync points (acquire/release pairs):
//   S1: producer stores entry, then tail (release)  ->  consumer loads tail (acquire), reads entry.
//   S2: consumer copies entry, then head (release)  ->  producer loads head (acquire), reuses slot.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace bb::shm {

template <typename T, uint32_t N>
struct RingData {
  static_assert((N & (N - 1)) == 0, "ring size must be a power of two");
  static_assert(std::is_trivially_copyable_v<T>);
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) T entries[N];
};

enum class RingStatus { kOk, kEmpty, kFull, kCorrupt };

// Producer side. `head` is the consumer's index (another party's memory: validated).
// `cached_head` is the producer's private copy, reread only when the ring looks full.
// `keep_free` entries are left for other pushes: a producer whose records differ in worth keeps
// room for the ones it cannot fold together (the ring counts as full for this push when fewer
// than keep_free + 1 entries are free).
template <typename T, uint32_t N>
RingStatus ring_push(RingData<T, N>& ring, const std::atomic<uint64_t>& head,
                     uint64_t& cached_head, const T& value, uint32_t keep_free = 0) {
  const uint64_t tail = ring.tail.load(std::memory_order_relaxed);
  const uint64_t limit = N - std::min<uint64_t>(keep_free, N - 1);
  if (tail - cached_head >= limit) {
    cached_head = head.load(std::memory_order_acquire);  // S2
    if (cached_head > tail) return RingStatus::kCorrupt;
    if (tail - cached_head >= limit) return RingStatus::kFull;
  }
  std::memcpy(&ring.entries[tail & (N - 1)], &value, sizeof(T));
  ring.tail.store(tail + 1, std::memory_order_release);  // S1
  return RingStatus::kOk;
}

// Room left, for a producer that must not push into a ring it cannot check later.
template <typename T, uint32_t N>
bool ring_has_room(const RingData<T, N>& ring, const std::atomic<uint64_t>& head) {
  const uint64_t tail = ring.tail.load(std::memory_order_relaxed);
  const uint64_t h = head.load(std::memory_order_acquire);
  return h <= tail && tail - h < N;
}

// Consumer side. `head` is the consumer's own index. The entry is copied out before the index
// moves, so a producer overwriting it later cannot change what was read.
template <typename T, uint32_t N>
RingStatus ring_pop(const RingData<T, N>& ring, std::atomic<uint64_t>& head, T* out) {
  const uint64_t h = head.load(std::memory_order_relaxed);
  const uint64_t tail = ring.tail.load(std::memory_order_acquire);  // S1
  if (tail == h) return RingStatus::kEmpty;
  if (tail < h || tail - h > N) return RingStatus::kCorrupt;
  std::memcpy(out, &ring.entries[h & (N - 1)], sizeof(T));
  head.store(h + 1, std::memory_order_release);  // S2
  return RingStatus::kOk;
}

}  // namespace bb::shm
