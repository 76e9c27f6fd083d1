// The trainer-side allocator of grant ranges inside a lent range.
//
// Offsets only: the pool never touches memory, the exporter does. Every range it hands out is
// aligned, inside [0, capacity) and disjoint from every other live range; freed neighbours
// coalesce; used() + free_bytes() == capacity() at all times. All storage is allocated in
// create(): alloc/free/queries never allocate, never block and never throw, so the hub's service
// thread may call them at any time. Not thread-safe: one owner serialises calls.
#pragma once

#include <bubble/bubble.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace bb::core {

enum class FitPolicy : uint8_t {
  kFirstFit = 0,  // lowest offset that fits: fast, keeps the top of the range free
  kBestFit = 1,   // smallest free extent that fits (lowest offset among equals): less splitting
};

struct Extent {
  uint64_t offset = 0;
  uint64_t size = 0;
};

class GrantPool {
 public:
  // capacity is rounded down to alignment (a power of two); max_allocs live ranges at most.
  static bb_status create(uint64_t capacity, uint64_t alignment, uint32_t max_allocs,
                          FitPolicy policy, std::unique_ptr<GrantPool>* out, std::string* error);
  ~GrantPool();
  GrantPool(const GrantPool&) = delete;
  GrantPool& operator=(const GrantPool&) = delete;

  // Reserves size bytes rounded up to the alignment. BB_E_INVALID for size 0, BB_E_FULL when
  // max_allocs ranges are live, BB_E_NOMEM when no free extent is large enough (which may
  // happen with enough free bytes in total: see largest_free()).
  bb_status alloc(uint64_t size, uint64_t* offset, uint64_t* rounded_size) noexcept;
  // Frees the live range that starts at offset. BB_E_INVALID if none does (double free, or an
  // offset inside a range). *size (may be null) receives its size.
  bb_status free(uint64_t offset, uint64_t* size = nullptr) noexcept;
  // The size of the live range starting at offset, 0 if none.
  uint64_t size_at(uint64_t offset) const noexcept;

  uint64_t capacity() const noexcept { return capacity_; }
  uint64_t alignment() const noexcept { return alignment_; }
  uint64_t used() const noexcept { return used_bytes_; }
  uint64_t free_bytes() const noexcept { return capacity_ - used_bytes_; }
  uint64_t largest_free() const noexcept;
  uint32_t live() const noexcept { return used_count_; }
  uint32_t max_allocs() const noexcept { return max_allocs_; }
  uint32_t free_extent_count() const noexcept { return free_count_; }
  FitPolicy policy() const noexcept { return policy_; }

  // Copies up to cap extents, sorted by offset; returns how many there are.
  size_t free_extents(Extent* out, size_t cap) const noexcept;
  size_t live_extents(Extent* out, size_t cap) const noexcept;
  // Re-derives every invariant from scratch (sorted, disjoint, coalesced, aligned, tiling the
  // range exactly, byte counts). For tests and debug checks.
  bool check() const noexcept;

 private:
  GrantPool() = default;
  uint64_t capacity_ = 0;
  uint64_t alignment_ = 1;
  uint64_t used_bytes_ = 0;
  uint32_t max_allocs_ = 0;
  uint32_t used_count_ = 0;
  uint32_t free_count_ = 0;
  FitPolicy policy_ = FitPolicy::kBestFit;
  // Sorted by offset. free_ holds at most max_allocs_ + 1 extents: free extents are separated by
  // live ones, so there is at most one more of them than live ranges.
  std::unique_ptr<Extent[]> used_;
  std::unique_ptr<Extent[]> free_;
};

}  // namespace bb::core
