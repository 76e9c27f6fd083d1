#include "core/grant_lender.h"

#include <algorithm>
#include <thread>

#include "core/cuda_driver.h"

namespace bb::core {

bb_status GrantLender::create(const LendOptions& opts, std::unique_ptr<GrantLender>* out,
                              std::string* error) {
  out->reset();
  if (opts.bytes == 0) {
    *error = "a lent range of 0 bytes: set LendOptions.bytes to the memory side tasks may use";
    return BB_E_INVALID;
  }
  if (opts.alignment & (opts.alignment - 1)) {
    *error = "grant alignment " + std::to_string(opts.alignment) + " is not a power of two";
    return BB_E_INVALID;
  }
  if (opts.device_ptr && opts.backend != GrantBackend::kCudaIpc) {
    *error = "LendOptions.device_ptr lends existing memory, which only the cuda-ipc backend can "
             "share; leave it 0 for other backends";
    return BB_E_INVALID;
  }
  std::unique_ptr<GrantLender> l(new GrantLender);
  l->backend_ = opts.backend;
  l->next_id_ = opts.first_id ? opts.first_id : 1;  // 0 means "no grant" everywhere
  bb_status st;
  const CudaDriver* drv = opts.driver;
  if (opts.backend == GrantBackend::kCudaIpc || opts.backend == GrantBackend::kCudaVmm) {
    std::string why;
    if (!drv) drv = cuda_driver(&why);
    if (!drv) {
      *error = std::string("the ") + grant_backend_name(opts.backend) +
               " grant backend needs the CUDA driver: " + why;
      return BB_E_UNSUPPORTED;
    }
  }
  switch (opts.backend) {
    case GrantBackend::kHost: st = make_host_exporter(opts.bytes, &l->exporter_, error); break;
    case GrantBackend::kCudaIpc:
      st = make_cuda_ipc_exporter(*drv, opts.device, opts.device_ptr, opts.bytes, opts.alignment,
                                  opts.clear, &l->exporter_, error);
      break;
    case GrantBackend::kCudaVmm:
      st = make_cuda_vmm_exporter(*drv, opts.device, opts.bytes, opts.clear, &l->exporter_,
                                  error);
      break;
    default:
      *error = "unknown grant backend " + std::to_string(static_cast<uint32_t>(opts.backend)) +
               ": use host, cuda-ipc or cuda-vmm";
      return BB_E_INVALID;
  }
  if (st != BB_OK) return st;
  const uint64_t align = std::max(l->exporter_->alignment(), opts.alignment);
  if ((st = GrantPool::create(l->exporter_->capacity(), align, opts.max_grants, opts.fit,
                              &l->pool_, error)) != BB_OK)
    return st;
  l->records_.reserve(opts.max_grants);
  *out = std::move(l);
  return BB_OK;
}

GrantLender::~GrantLender() {
  std::string ignored;
  for (Record& r : records_) {
    if (r.state != GrantState::kQuarantined)
      exporter_->destroy(r.grant.offset, r.rounded, &r.grant.handle, &ignored);
  }
}

GrantLender::Record* GrantLender::find_locked(uint64_t grant_id) {
  for (Record& r : records_)
    if (r.grant.id == grant_id) return &r;
  return nullptr;
}

const GrantLender::Record* GrantLender::find_locked(uint64_t grant_id) const {
  for (const Record& r : records_)
    if (r.grant.id == grant_id) return &r;
  return nullptr;
}

bb_status GrantLender::grant(uint64_t size, uint64_t owner, Grant* out, std::string* error) {
  const std::unique_lock<std::mutex> held = lock();
  uint64_t offset = 0, rounded = 0;
  bb_status st = pool_->alloc(size, &offset, &rounded);
  if (st == BB_E_NOMEM && size > pool_->capacity()) st = BB_E_INVALID;  // waiting cannot help
  if (st != BB_OK) {
    ++failed_;
    if (st == BB_E_INVALID && size > pool_->capacity())
      *error = "a grant of " + std::to_string(size) + " bytes is larger than all the lent memory (" +
               std::to_string(pool_->capacity()) + " bytes): lend more, or ask for less (the "
               "task's mem_need)";
    else if (st == BB_E_INVALID)
      *error = "a grant of 0 bytes: ask for the bytes the task needs";
    else if (st == BB_E_FULL)
      *error = "all " + std::to_string(pool_->max_allocs()) + " grants of this lent range are in "
               "use: release one, or lend with a higher max_grants";
    else
      *error = "no room for a grant of " + std::to_string(size) + " bytes: " +
               std::to_string(pool_->free_bytes()) + " of " + std::to_string(pool_->capacity()) +
               " lent bytes are free, the largest free extent is " +
               std::to_string(pool_->largest_free()) + "; wait for grants to be released";
    return st;
  }
  Record r;
  if ((st = exporter_->create(offset, rounded, &r.grant.handle, error)) != BB_OK) {
    pool_->free(offset);
    ++failed_;
    return st;
  }
  r.grant.id = next_id_++;
  r.grant.offset = offset;
  r.grant.size = size;
  r.grant.backend = backend_;
  r.owner = owner;
  r.rounded = rounded;
  r.state = GrantState::kActive;
  records_.push_back(r);  // never reallocates: reserved to max_grants, and the pool caps count
  ++made_;
  *out = r.grant;
  return BB_OK;
}

void GrantLender::descriptor_sent(uint64_t grant_id) {
  const std::unique_lock<std::mutex> held = lock();
  if (Record* r = find_locked(grant_id)) exporter_->descriptor_sent(r->grant.offset, &r->grant.handle);
}

bb_status GrantLender::revoke(uint64_t grant_id, uint64_t deadline_ns, std::string* error) {
  const std::unique_lock<std::mutex> held = lock();
  Record* r = find_locked(grant_id);
  if (!r) {
    *error = "no grant " + std::to_string(grant_id) + " in this lent range";
    return BB_E_NOT_FOUND;
  }
  if (r->state != GrantState::kActive) {
    *error = "grant " + std::to_string(grant_id) + " is already being revoked or was lost";
    return BB_E_STATE;
  }
  r->state = GrantState::kRevoking;
  r->deadline_ns = deadline_ns;
  return BB_OK;
}

bool GrantLender::hasten(uint64_t grant_id, uint64_t deadline_ns) {
  const std::unique_lock<std::mutex> held = lock();
  Record* r = find_locked(grant_id);
  if (!r || r->state != GrantState::kRevoking) return false;
  r->deadline_ns = std::min(r->deadline_ns, deadline_ns);
  return true;
}

bb_status GrantLender::release_locked(size_t i, std::string* error) {
  Record& r = records_[i];
  bb_status st = exporter_->destroy(r.grant.offset, r.rounded, &r.grant.handle, error);
  if (st != BB_OK) {
    // The memory's state is unknown: keep its range allocated forever rather than risk handing
    // it to another task.
    r.state = GrantState::kQuarantined;
    return st;
  }
  pool_->free(r.grant.offset);
  records_[i] = records_.back();
  records_.pop_back();
  return BB_OK;
}

bb_status GrantLender::release(uint64_t grant_id, std::string* error) {
  const std::unique_lock<std::mutex> held = lock();
  for (size_t i = 0; i < records_.size(); ++i) {
    if (records_[i].grant.id != grant_id) continue;
    if (records_[i].state == GrantState::kQuarantined) {
      *error = "grant " + std::to_string(grant_id) + " failed to release before; its range is "
               "kept out of use";
      return BB_E_STATE;
    }
    return release_locked(i, error);
  }
  *error = "no grant " + std::to_string(grant_id) + " in this lent range";
  return BB_E_NOT_FOUND;
}

size_t GrantLender::release_owner(uint64_t owner) {
  const std::unique_lock<std::mutex> held = lock();
  size_t n = 0;
  for (size_t i = records_.size(); i-- > 0;) {
    if (records_[i].owner != owner || records_[i].state == GrantState::kQuarantined) continue;
    std::string ignored;
    if (release_locked(i, &ignored) == BB_OK) ++n;
  }
  return n;
}

size_t GrantLender::overdue(uint64_t now_ns, uint64_t* ids, size_t cap) const {
  const std::unique_lock<std::mutex> held = lock();
  size_t n = 0;
  for (const Record& r : records_) {
    if (r.state != GrantState::kRevoking || r.deadline_ns > now_ns) continue;
    if (n < cap) ids[n] = r.grant.id;
    ++n;
  }
  return n;
}

namespace {
// read()'s hand-over between two pieces yields this many times at most.
constexpr int kMaxHandOverYields = 1000;
}  // namespace

std::unique_lock<std::mutex> GrantLender::lock() const {
  waiting_.fetch_add(1);
  std::unique_lock<std::mutex> held(mu_);
  waiting_.fetch_sub(1);
  return held;
}

bb_status GrantLender::find(uint64_t grant_id, Grant* out, GrantState* state,
                            uint64_t* owner) const {
  const std::unique_lock<std::mutex> held = lock();
  const Record* r = find_locked(grant_id);
  if (!r) return BB_E_NOT_FOUND;
  if (out) *out = r->grant;
  if (state) *state = r->state;
  if (owner) *owner = r->owner;
  return BB_OK;
}

uint64_t GrantLender::address(uint64_t grant_id) const {
  const std::unique_lock<std::mutex> held = lock();
  const Record* r = find_locked(grant_id);
  return r ? exporter_->address(r->grant.offset) : 0;
}

bb_status GrantLender::read(uint64_t grant_id, uint64_t offset, void* dst, uint64_t bytes,
                           std::string* error) {
  std::unique_lock<std::mutex> held = lock();
  const Record* r = find_locked(grant_id);
  if (!r || r->state == GrantState::kQuarantined) {
    *error = "grant " + std::to_string(grant_id) + (r ? " could not be given back (quarantined)"
                                                       : " is not live") +
             ": its task gave it back, left or died, and its memory went with it; read a "
             "task's results while it holds its grant (the id from bb_trainer_task_grant)";
    return BB_E_NOT_FOUND;
  }
  if (offset > r->grant.size || bytes > r->grant.size - offset) {
    *error = "bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
             ") lie outside grant " + std::to_string(grant_id) + ", which has " +
             std::to_string(r->grant.size) + " bytes";
    return BB_E_INVALID;
  }
  if (bytes == 0) return BB_OK;
  // Under the lock, so that no release() unmaps the range while the copy runs; a piece at a
  // time, and every thread that waits for the lock meanwhile (the hub's service thread, whose
  // grant work takes it) goes first between two pieces, so it waits at most one piece. A grant
  // released between two pieces ends the copy with BB_E_NOT_FOUND.
  constexpr uint64_t kPiece = 4ull << 20;
  const uint64_t first = r->grant.offset;  // ids are never reused: a live id is this grant
  for (uint64_t done = 0; done < bytes;) {
    if (done != 0) {
      held.unlock();
      // Bounded: a waiter held up behind a third thread (a long grant clear) is not waited for
      // with a spinning CPU; the lock's own queue takes over.
      for (int k = 0; k < kMaxHandOverYields && waiting_.load() != 0; ++k)
        std::this_thread::yield();
      held.lock();
      const Record* again = find_locked(grant_id);
      if (!again || again->state == GrantState::kQuarantined) {
        *error = "grant " + std::to_string(grant_id) + " was given back during the copy (its "
                 "task left or died): only its first " + std::to_string(done) + " bytes were "
                 "copied";
        return BB_E_NOT_FOUND;
      }
    }
    const uint64_t n = std::min(kPiece, bytes - done);
    const bb_status st =
        exporter_->read(first + offset + done, static_cast<char*>(dst) + done, n, error);
    if (st != BB_OK) return st;
    done += n;
  }
  return BB_OK;
}

uint64_t GrantLender::next_id() const {
  const std::unique_lock<std::mutex> held = lock();
  return next_id_;
}

LenderStats GrantLender::stats() const {
  const std::unique_lock<std::mutex> held = lock();
  LenderStats s;
  s.capacity = pool_->capacity();
  s.granted_bytes = pool_->used();
  s.free_bytes = pool_->free_bytes();
  s.largest_free = pool_->largest_free();
  for (const Record& r : records_) {
    s.requested_bytes += r.grant.size;
    switch (r.state) {
      case GrantState::kActive: ++s.active; break;
      case GrantState::kRevoking: ++s.revoking; s.revoking_bytes += r.rounded; break;
      case GrantState::kQuarantined: ++s.quarantined; s.quarantined_bytes += r.rounded; break;
    }
  }
  s.grants_made = made_;
  s.grants_failed = failed_;
  return s;
}

}  // namespace bb::core
