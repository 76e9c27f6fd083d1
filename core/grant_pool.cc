#include "core/grant_pool.h"

#include <new>

namespace bb::core {
namespace {

// First index whose offset is >= off (arrays are sorted by offset).
uint32_t lower_bound(const Extent* a, uint32_t n, uint64_t off) {
  uint32_t lo = 0, hi = n;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (a[mid].offset < off) lo = mid + 1; else hi = mid;
  }
  return lo;
}

void insert_at(Extent* a, uint32_t* n, uint32_t i, Extent e) {
  for (uint32_t j = *n; j > i; --j) a[j] = a[j - 1];
  a[i] = e;
  ++*n;
}

void erase_at(Extent* a, uint32_t* n, uint32_t i) {
  for (uint32_t j = i + 1; j < *n; ++j) a[j - 1] = a[j];
  --*n;
}

}  // namespace

bb_status GrantPool::create(uint64_t capacity, uint64_t alignment, uint32_t max_allocs,
                            FitPolicy policy, std::unique_ptr<GrantPool>* out,
                            std::string* error) {
  out->reset();
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    *error = "grant alignment " + std::to_string(alignment) + " is not a power of two";
    return BB_E_INVALID;
  }
  if (max_allocs == 0 || max_allocs > (1u << 20)) {
    *error = "max grants must be 1..1048576, got " + std::to_string(max_allocs);
    return BB_E_INVALID;
  }
  uint64_t cap = capacity & ~(alignment - 1);
  if (cap == 0) {
    *error = "a lent range of " + std::to_string(capacity) + " bytes holds no grant of the " +
             std::to_string(alignment) + "-byte unit: lend at least that much";
    return BB_E_INVALID;
  }
  if (policy != FitPolicy::kFirstFit && policy != FitPolicy::kBestFit) {
    *error = "unknown fit policy";
    return BB_E_INVALID;
  }
  std::unique_ptr<GrantPool> p(new (std::nothrow) GrantPool);
  if (p) {
    p->used_.reset(new (std::nothrow) Extent[max_allocs]);
    p->free_.reset(new (std::nothrow) Extent[size_t{max_allocs} + 1]);
  }
  if (!p || !p->used_ || !p->free_) {
    *error = "out of memory for a grant pool of " + std::to_string(max_allocs) + " grants";
    return BB_E_NOMEM;
  }
  p->capacity_ = cap;
  p->alignment_ = alignment;
  p->max_allocs_ = max_allocs;
  p->policy_ = policy;
  p->free_[0] = Extent{0, cap};
  p->free_count_ = 1;
  *out = std::move(p);
  return BB_OK;
}

GrantPool::~GrantPool() = default;

bb_status GrantPool::alloc(uint64_t size, uint64_t* offset, uint64_t* rounded_size) noexcept {
  if (size == 0) return BB_E_INVALID;
  if (size > capacity_) return BB_E_NOMEM;
  const uint64_t want = (size + alignment_ - 1) & ~(alignment_ - 1);
  if (used_count_ == max_allocs_) return BB_E_FULL;
  uint32_t pick = free_count_;
  for (uint32_t i = 0; i < free_count_; ++i) {
    if (free_[i].size < want) continue;
    if (policy_ == FitPolicy::kFirstFit) {
      pick = i;
      break;
    }
    if (pick == free_count_ || free_[i].size < free_[pick].size) pick = i;
    if (free_[pick].size == want) break;  // an exact fit cannot be beaten
  }
  if (pick == free_count_) return BB_E_NOMEM;
  const Extent got{free_[pick].offset, want};
  // Carve from the front so the remainder keeps its place in the sorted free list.
  free_[pick].offset += want;
  free_[pick].size -= want;
  if (free_[pick].size == 0) erase_at(free_.get(), &free_count_, pick);
  insert_at(used_.get(), &used_count_, lower_bound(used_.get(), used_count_, got.offset), got);
  used_bytes_ += want;
  *offset = got.offset;
  if (rounded_size) *rounded_size = want;
  return BB_OK;
}

bb_status GrantPool::free(uint64_t offset, uint64_t* size) noexcept {
  uint32_t i = lower_bound(used_.get(), used_count_, offset);
  if (i == used_count_ || used_[i].offset != offset) return BB_E_INVALID;
  Extent e = used_[i];
  erase_at(used_.get(), &used_count_, i);
  used_bytes_ -= e.size;
  if (size) *size = e.size;

  // Merge with the free neighbours before inserting, so the free list never needs more than
  // max_allocs_ + 1 entries even transiently.
  uint32_t j = lower_bound(free_.get(), free_count_, e.offset);
  const bool join_prev = j > 0 && free_[j - 1].offset + free_[j - 1].size == e.offset;
  const bool join_next = j < free_count_ && e.offset + e.size == free_[j].offset;
  if (join_prev && join_next) {
    free_[j - 1].size += e.size + free_[j].size;
    erase_at(free_.get(), &free_count_, j);
  } else if (join_prev) {
    free_[j - 1].size += e.size;
  } else if (join_next) {
    free_[j].offset = e.offset;
    free_[j].size += e.size;
  } else {
    insert_at(free_.get(), &free_count_, j, e);
  }
  return BB_OK;
}

uint64_t GrantPool::size_at(uint64_t offset) const noexcept {
  uint32_t i = lower_bound(used_.get(), used_count_, offset);
  return (i < used_count_ && used_[i].offset == offset) ? used_[i].size : 0;
}

uint64_t GrantPool::largest_free() const noexcept {
  uint64_t best = 0;
  for (uint32_t i = 0; i < free_count_; ++i)
    if (free_[i].size > best) best = free_[i].size;
  return best;
}

size_t GrantPool::free_extents(Extent* out, size_t cap) const noexcept {
  for (size_t i = 0; i < free_count_ && i < cap; ++i) out[i] = free_[i];
  return free_count_;
}

size_t GrantPool::live_extents(Extent* out, size_t cap) const noexcept {
  for (size_t i = 0; i < used_count_ && i < cap; ++i) out[i] = used_[i];
  return used_count_;
}

bool GrantPool::check() const noexcept {
  // Walk both sorted lists together: they must tile [0, capacity) exactly, with no two free
  // extents adjacent (they would have been coalesced).
  uint64_t pos = 0, used_sum = 0;
  uint32_t u = 0, f = 0;
  bool last_free = false;
  if (free_count_ > max_allocs_ + 1 || used_count_ > max_allocs_) return false;
  while (u < used_count_ || f < free_count_) {
    bool take_free = f < free_count_ && (u == used_count_ || free_[f].offset < used_[u].offset);
    const Extent& e = take_free ? free_[f++] : used_[u++];
    if (e.offset != pos || e.size == 0) return false;
    if ((e.offset | e.size) & (alignment_ - 1)) return false;
    if (take_free && last_free) return false;
    if (!take_free) used_sum += e.size;
    last_free = take_free;
    pos += e.size;
  }
  return pos == capacity_ && used_sum == used_bytes_;
}

}  // namespace bb::core
