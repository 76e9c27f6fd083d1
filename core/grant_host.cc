// The host backend: one sealed memfd per grant.
//
// The trainer reserves the lent range as inaccessible address space and maps each grant's memfd
// over its place in it, so the trainer sees one contiguous range while every task can reach only
// the memfd of its own grant. Each memfd is sealed against shrinking and growing: a task that
// holds the descriptor could otherwise ftruncate it and make the trainer's next read of the
// range fault with SIGBUS.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "core/grant.h"

namespace bb::core {
namespace {

uint64_t page_size() { return static_cast<uint64_t>(sysconf(_SC_PAGESIZE)); }

std::string errno_text() { return std::string(strerror(errno)); }

// A process the trainer forks without an exec (a data loader's workers) gets none of the lent
// range: a child holding grant pages would keep them alive after their release and could read
// what a task wrote. Set after every mapping made there, since each MAP_FIXED makes a new VMA.
void dont_fork(void* at, uint64_t size) { madvise(at, size, MADV_DONTFORK); }

class HostExporter final : public GrantExporter {
 public:
  ~HostExporter() override {
    // With a hole in the reservation, another mapping of this process may sit in it: the range
    // is left reserved (address space only) rather than unmapped over it.
    if (base_ != MAP_FAILED && !hole_) munmap(base_, capacity_);
  }
  bb_status init(uint64_t bytes, std::string* error) {
    align_ = page_size();
    capacity_ = bytes & ~(align_ - 1);
    if (capacity_ == 0) {
      *error = "a host lent range of " + std::to_string(bytes) +
               " bytes is smaller than one page: lend at least " + std::to_string(align_);
      return BB_E_INVALID;
    }
    // Address space only: no memory is committed until a grant is created.
    base_ = mmap(nullptr, capacity_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base_ == MAP_FAILED) {
      *error = "reserving " + std::to_string(capacity_) + " bytes of address space failed: " +
               errno_text();
      return BB_E_NOMEM;
    }
    dont_fork(base_, capacity_);
    return BB_OK;
  }

  GrantBackend backend() const override { return GrantBackend::kHost; }
  uint64_t capacity() const override { return capacity_; }
  uint64_t alignment() const override { return align_; }
  uint64_t address(uint64_t offset) const override {
    return reinterpret_cast<uint64_t>(base_) + offset;
  }
  bb_status read(uint64_t offset, void* dst, uint64_t bytes, std::string* error) override {
    if (bytes == 0 || offset > capacity_ || bytes > capacity_ - offset) {
      *error = "the range to copy lies outside the lent range";
      return BB_E_INVALID;
    }
    // The grant's memfd is sealed against shrinking, so its pages stay for the copy.
    std::memcpy(dst, static_cast<const char*>(base_) + offset, bytes);
    return BB_OK;
  }

  bb_status create(uint64_t offset, uint64_t size, GrantHandle* h, std::string* error) override {
    if (!range_ok(offset, size, error)) return BB_E_INVALID;
    if (hole_) {
      *error = "the lent host range lost part of its address-space reservation when a mapping "
               "failed, so nothing more is mapped into it: unlend and lend again";
      return BB_E_STATE;
    }
    // A new memfd every time, never a recycled one: the kernel hands out its pages zero-filled,
    // so no grant shows what an earlier holder left, and no memset is needed.
    int fd = memfd_create("bubble-grant", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
      *error = "memfd_create for a host grant failed: " + errno_text();
      return errno == EMFILE || errno == ENFILE ? BB_E_FULL : BB_E_SYSTEM;
    }
    auto fail = [&](const char* what, bb_status st) {
      *error = std::string(what) + " for a host grant of " + std::to_string(size) +
               " bytes failed: " + errno_text();
      close(fd);
      return st;
    };
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) return fail("ftruncate", BB_E_NOMEM);
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
      return fail("sealing the memfd", BB_E_SYSTEM);
    void* at = reinterpret_cast<void*>(address(offset));
    if (mmap(at, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      // The kernel may have unmapped the reservation before it failed: reserve the range again,
      // or another mmap of this process could land there and a later grant map over it.
      const int e = errno;
      if (mmap(at, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
               0) == MAP_FAILED)
        hole_ = true;
      else
        dont_fork(at, size);
      errno = e;
      return fail("mapping the memfd into the lent range", BB_E_NOMEM);
    }
    dont_fork(at, size);
    *h = GrantHandle{};
    h->map_offset = 0;
    h->map_size = size;
    h->device = -1;
    h->fd = fd;
    return BB_OK;
  }

  bb_status destroy(uint64_t offset, uint64_t size, GrantHandle* h, std::string* error) override {
    if (!range_ok(offset, size, error)) return BB_E_INVALID;
    // Replace the mapping with reserved address space in one step, so no other mmap in the
    // process can land in the hole; a task that still maps the memfd keeps its own pages. The
    // space stays readable: the trainer may be reading what its task wrote when the task dies
    // or leaves (this runs on the service thread, at any moment), and such a read must find
    // zeros, not fault. Read-only, it commits no memory (a writable private mapping would be
    // charged in full under vm.overcommit_memory=2); a write there is the trainer's bug.
    void* at = reinterpret_cast<void*>(address(offset));
    bb_status st = BB_OK;
    if (mmap(at, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
             0) == MAP_FAILED) {
      *error = "unmapping a host grant failed: " + errno_text();
      st = BB_E_SYSTEM;
      hole_ = true;  // the kernel may have unmapped it before failing
    } else {
      dont_fork(at, size);
    }
    if (h->fd >= 0) close(h->fd);
    h->fd = -1;
    return st;
  }

 private:
  bool hole_ = false;  // a failed map left part of the range unreserved: no more grants
  bool range_ok(uint64_t offset, uint64_t size, std::string* error) const {
    if (size == 0 || ((offset | size) & (align_ - 1)) || offset > capacity_ ||
        size > capacity_ - offset) {
      *error = "host grant range [" + std::to_string(offset) + ", +" + std::to_string(size) +
               ") is not page-aligned inside the lent range";
      return false;
    }
    return true;
  }

  void* base_ = MAP_FAILED;
  uint64_t capacity_ = 0;
  uint64_t align_ = 4096;
};

class HostMapping final : public GrantMapping {
 public:
  HostMapping(void* p, uint64_t map_size, uint64_t size, uint64_t id) : map_size_(map_size) {
    ptr_ = p;
    size_ = size;
    id_ = id;
  }
  ~HostMapping() override {
    std::string ignored;
    unmap(&ignored);
  }
  bb_status unmap(std::string* error) override {
    if (!ptr_) return BB_OK;
    int rc = munmap(ptr_, map_size_);
    ptr_ = nullptr;
    if (rc != 0) {
      *error = "munmap of a host grant failed: " + errno_text();
      return BB_E_SYSTEM;
    }
    return BB_OK;
  }

 private:
  uint64_t map_size_;
};

}  // namespace

bb_status make_host_exporter(uint64_t bytes, std::unique_ptr<GrantExporter>* out,
                             std::string* error) {
  out->reset();
  auto e = std::make_unique<HostExporter>();
  bb_status st = e->init(bytes, error);
  if (st == BB_OK) *out = std::move(e);
  return st;
}

bb_status map_host_grant(const Grant& g, int fd, std::unique_ptr<GrantMapping>* out,
                         std::string* error) {
  if (fd < 0) {
    *error = "a host grant needs the descriptor that came with it; none was passed";
    return BB_E_INVALID;
  }
  // The descriptor came from another process: check it is what the record says before mapping,
  // since touching pages past the end of a file faults with SIGBUS.
  struct stat st;
  if (fstat(fd, &st) != 0) {
    *error = "fstat of the host grant's descriptor failed: " + errno_text();
    return BB_E_INVALID;
  }
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < g.handle.map_size) {
    *error = "the descriptor passed with host grant " + std::to_string(g.id) + " is " +
             std::to_string(st.st_size) + " bytes, the grant says " +
             std::to_string(g.handle.map_size) + ": it is not the grant's memory";
    return BB_E_CORRUPT;
  }
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    *error = "the descriptor passed with host grant " + std::to_string(g.id) +
             " is not a sealed memfd: it is not the grant's memory";
    return BB_E_CORRUPT;
  }
  void* p = mmap(nullptr, g.handle.map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *error = "mapping host grant " + std::to_string(g.id) + " failed: " + errno_text();
    return BB_E_NOMEM;
  }
  *out = std::make_unique<HostMapping>(p, g.handle.map_size, g.size, g.id);
  return BB_OK;
}

}  // namespace bb::core
