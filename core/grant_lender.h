// The trainer's side of memory grants: one lent range, one backend, the grants carved from it
// and where each stands in the revocation protocol.
//
// Revocation is a protocol, not a driver feature (no backend can pull memory out from under a
// live importer). The hub drives it: revoke() marks a grant REVOKING with a deadline and the hub
// sends REVOKE; when the task acks (it unmapped), or dies, or is killed because overdue() listed
// it, the hub calls release(). Until release() the range stays allocated, so a grant's memory is
// never handed to anyone else while its holder may still write to it.
//
// All methods are thread-safe (one internal mutex; none waits on a task). They are meant for the
// hub's service thread, never for the bubble path: grant() and release() make system and driver
// calls.
#pragma once

#include <bubble/bubble.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/grant.h"
#include "core/grant_pool.h"

namespace bb::core {

struct LendOptions {
  GrantBackend backend = GrantBackend::kHost;
  uint64_t bytes = 0;             // size of the lent range (rounded down to the backend's unit)
  uint32_t max_grants = 64;       // live grants at most
  FitPolicy fit = FitPolicy::kBestFit;
  int32_t device = 0;             // CUDA device ordinal
  uint64_t device_ptr = 0;        // cuda-ipc: lend this part of an existing allocation (0 = the
                                  // lender allocates the range itself)
  uint64_t alignment = 0;         // grant unit; 0 = the backend's (page, 256 B, granularity)
  const CudaDriver* driver = nullptr;  // nullptr = cuda_driver() (for CUDA backends)
  // CUDA backends: zero each grant on the device before a task gets it. Off only when every
  // task belongs to one owner. Host grants are always fresh memfds, zero-filled by the kernel.
  bool clear = true;
  // The first grant's id. A hub that lends again continues after its last lender's ids: a task's
  // page may still name one of those, and an old id taken for a new grant would read as an ack.
  uint64_t first_id = 1;
};

enum class GrantState : uint8_t {
  kActive = 1,       // held by its owner
  kRevoking = 2,     // REVOKE sent; the range waits for release()
  kQuarantined = 3,  // giving the memory back failed: the range is never reused
};

struct LenderStats {
  uint64_t capacity = 0;         // usable bytes of the lent range
  uint64_t granted_bytes = 0;    // allocated ranges (rounded), active + revoking + quarantined
  uint64_t requested_bytes = 0;  // what grant() callers asked for, of live grants
  uint64_t free_bytes = 0;       // capacity - granted_bytes
  uint64_t largest_free = 0;     // the biggest grant that would succeed now
  uint64_t revoking_bytes = 0;
  uint64_t quarantined_bytes = 0;
  uint32_t active = 0;
  uint32_t revoking = 0;
  uint32_t quarantined = 0;
  uint64_t grants_made = 0;      // since creation
  uint64_t grants_failed = 0;    // grant() calls that failed
};

class GrantLender {
 public:
  // Reserves the lent range with the chosen backend. Without a CUDA driver a CUDA backend gives
  // BB_E_UNSUPPORTED and an *error that says why and what to do.
  static bb_status create(const LendOptions& opts, std::unique_ptr<GrantLender>* out,
                          std::string* error);
  // Gives all memory back, whatever state grants are in: the caller ends every task's use first.
  ~GrantLender();
  GrantLender(const GrantLender&) = delete;
  GrantLender& operator=(const GrantLender&) = delete;

  // A new grant of at least size bytes for owner (an opaque id, e.g. the task id). *out holds
  // the record to publish (wire_copy() it) and, for fd backends, the descriptor to send; that
  // descriptor stays owned by the lender until descriptor_sent() or release(). BB_E_NOMEM when no free extent fits,
  // BB_E_FULL at max_grants.
  bb_status grant(uint64_t size, uint64_t owner, Grant* out, std::string* error);
  // The descriptor of grant() reached the task: the lender closes it (the memory stays until
  // release()).
  void descriptor_sent(uint64_t grant_id);
  // Starts revoking: the grant must be ACTIVE; deadline_ns (CLOCK_MONOTONIC) is when overdue()
  // starts to list it.
  bb_status revoke(uint64_t grant_id, uint64_t deadline_ns, std::string* error);
  // Brings a REVOKING grant's deadline forward to deadline_ns; a later one leaves it as it is.
  // False when the grant is not being revoked.
  bool hasten(uint64_t grant_id, uint64_t deadline_ns);
  // The holder no longer maps the grant (it acked, exited, or was killed): the memory goes back
  // and the range may be granted again. Accepts ACTIVE and REVOKING grants.
  bb_status release(uint64_t grant_id, std::string* error);
  // Releases every grant of owner (its task died); returns how many.
  size_t release_owner(uint64_t owner);
  // REVOKING grants whose deadline is <= now_ns: their holders must be killed, then released.
  // Copies up to cap ids; returns how many there are.
  size_t overdue(uint64_t now_ns, uint64_t* ids, size_t cap) const;

  // The record, state and owner of a live grant; BB_E_NOT_FOUND if there is none.
  bb_status find(uint64_t grant_id, Grant* out, GrantState* state = nullptr,
                 uint64_t* owner = nullptr) const;
  // The trainer's own address of a grant (host pointer or CUdeviceptr), 0 if none.
  uint64_t address(uint64_t grant_id) const;
  // Copies bytes of a live (ACTIVE or REVOKING) grant, from offset into it, to dst (see
  // GrantExporter::read). Holds the lock for the copy, so the grant cannot be released (and its
  // range unmapped) under it: the task dying meanwhile is released after the copy.
  // BB_E_NOT_FOUND when the grant is not live, BB_E_INVALID when the range is outside it.
  bb_status read(uint64_t grant_id, uint64_t offset, void* dst, uint64_t bytes,
                 std::string* error);

  LenderStats stats() const;
  GrantBackend backend() const { return backend_; }
  uint64_t capacity() const { return pool_->capacity(); }
  uint64_t alignment() const { return pool_->alignment(); }
  uint64_t next_id() const;  // the id the next grant gets

 private:
  struct Record {
    Grant grant;
    uint64_t owner = 0;
    uint64_t rounded = 0;
    uint64_t deadline_ns = 0;
    GrantState state = GrantState::kActive;
  };
  GrantLender() = default;
  Record* find_locked(uint64_t grant_id);
  const Record* find_locked(uint64_t grant_id) const;
  bb_status release_locked(size_t index, std::string* error);

  // mu_, taken by everyone but a read's later pieces through lock(): a thread waiting for it
  // counts itself in waiting_, so that read() lets every such thread in between two pieces
  // (an unlock and a relock of a std::mutex hands nothing over: the unlocking thread, still
  // running, takes it back before the woken one runs).
  std::unique_lock<std::mutex> lock() const;
  mutable std::mutex mu_;
  mutable std::atomic<uint32_t> waiting_{0};
  GrantBackend backend_ = GrantBackend::kNone;
  std::unique_ptr<GrantExporter> exporter_;
  std::unique_ptr<GrantPool> pool_;
  std::vector<Record> records_;  // reserved to max_grants at creation
  uint64_t next_id_ = 1;
  uint64_t made_ = 0;
  uint64_t failed_ = 0;
};

}  // namespace bb::core
