// Memory grants: a range of (device) memory a side task may use during bubbles.
//
// The trainer lends a range; a GrantLender (grant_lender.h) carves grants out of it with a
// GrantPool and makes each one shareable through a backend's GrantExporter. A task receives the
// Grant record (inside the hub) plus, for fd backends, a descriptor (over its Unix socket), and
// maps it with map_grant(). Backends:
//   host      memfd per grant, mapped into the trainer's reserved range; for CPU tasks and
//             machines without a GPU;
//   cuda-ipc  a sub-range of one cuMemAlloc allocation, named by its 64-byte IPC handle;
//   cuda-vmm  cuMemCreate per grant, exported as a POSIX fd, mapped with cuMemMap.
// See docs/GRANTS.md for which to use and what revocation guarantees.
#pragma once

#include <bubble/bubble.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

namespace bb::core {

struct CudaDriver;

enum class GrantBackend : uint32_t { kNone = 0, kHost = 1, kCudaIpc = 2, kCudaVmm = 3 };

// "host", "cuda-ipc", "cuda-vmm" ("none" for anything else).
const char* grant_backend_name(GrantBackend b);
// Parses those names; false for anything else.
bool parse_grant_backend(const char* name, GrantBackend* out);

inline constexpr size_t kIpcHandleBytes = 64;  // CU_IPC_HANDLE_SIZE

// What an importer needs to map a grant, besides the descriptor of fd backends.
struct GrantHandle {
  uint64_t map_offset = 0;  // where the grant starts inside what the handle names
  uint64_t map_size = 0;    // bytes to map: the grant's size rounded up to the backend's unit
  // The exporter's CUDA device ordinal (-1 for host). Another process may number its GPUs
  // otherwise (CUDA_VISIBLE_DEVICES): importers find the GPU by device_uuid.
  int32_t device = -1;
  // The exporter's descriptor for host and cuda-vmm. Meaningful only in the exporting process:
  // it is never valid on the wire (wire_copy sets it to -1) and importers ignore it.
  int32_t fd = -1;
  uint8_t ipc[kIpcHandleBytes] = {};  // cuda-ipc: the CUipcMemHandle bytes
  uint8_t device_uuid[16] = {};       // CUDA backends: the GPU's UUID (cuDeviceGetUuid)
};

// The grant record. Trivially copyable with a fixed layout, so the hub can store it in a task
// slot as is; importers must validate_grant() a record they read from shared memory.
struct Grant {
  uint64_t id = 0;      // unique for the lender's lifetime, never 0
  uint64_t offset = 0;  // where the grant sits in the lent range
  uint64_t size = 0;    // bytes the task may use, as asked (map_size may be larger)
  GrantBackend backend = GrantBackend::kNone;
  uint32_t reserved0_ = 0;
  GrantHandle handle;
};
static_assert(std::is_trivially_copyable_v<Grant> && std::is_standard_layout_v<Grant>);
static_assert(sizeof(GrantHandle) == 104 && sizeof(Grant) == 136, "Grant is part of the wire ABI");

// A copy fit for another process: the process-local descriptor removed.
inline Grant wire_copy(const Grant& g) {
  Grant w = g;
  w.handle.fd = -1;
  return w;
}

// Checks a record read from an untrusted place: known backend, non-zero id and size,
// map_size >= size, no overflow, a device for CUDA backends. *error says what is wrong.
bb_status validate_grant(const Grant& g, std::string* error);

// Exporter side (the trainer): turns ranges of the lent memory into shareable grants. Called
// from one thread at a time (the lender serialises).
class GrantExporter {
 public:
  virtual ~GrantExporter() = default;
  virtual GrantBackend backend() const = 0;
  // Usable bytes of the lent range (the request rounded down to the backend's unit).
  virtual uint64_t capacity() const = 0;
  // Offsets and sizes handed to create() are multiples of this (a power of two).
  virtual uint64_t alignment() const = 0;
  // Makes [offset, offset + size) shareable; fills handle (map_offset, map_size, device, fd or
  // ipc). The memory holds nothing of an earlier holder (unless the lender was told not to
  // clear). On failure nothing stays allocated.
  virtual bb_status create(uint64_t offset, uint64_t size, GrantHandle* handle,
                           std::string* error) = 0;
  // Gives the memory behind a grant back. After it the descriptor in handle is closed. A
  // failure means the range's state is unknown: the caller must never reuse it.
  virtual bb_status destroy(uint64_t offset, uint64_t size, GrantHandle* handle,
                            std::string* error) = 0;
  // The grant's descriptor reached its task: the exporter closes its own, so that no process
  // forked from the trainer (a data loader's workers) keeps the memory alive after destroy().
  // By default it closes handle->fd.
  virtual void descriptor_sent(uint64_t offset, GrantHandle* handle);
  // The exporter's own address of offset in the lent range: a host pointer for host, a device
  // pointer (CUdeviceptr) for CUDA backends. The trainer may read what a task wrote there.
  virtual uint64_t address(uint64_t offset) const = 0;
  // Copies [offset, offset + bytes) of the lent range, which a live grant holds, to dst: host
  // memory for host; host memory or device memory of the lender's GPU for CUDA backends. Returns
  // once the copy is done. The lender calls it under its lock, so no release unmaps the range
  // meanwhile.
  virtual bb_status read(uint64_t offset, void* dst, uint64_t bytes, std::string* error) = 0;
};

// bytes of host memory (rounded down to pages).
bb_status make_host_exporter(uint64_t bytes, std::unique_ptr<GrantExporter>* out,
                             std::string* error);
// Lends [device_ptr, device_ptr + bytes) of an existing cuMemAlloc/cudaMalloc allocation on
// device, or, with device_ptr == 0, a new allocation of bytes that the exporter owns. With clear,
// create() zeroes each grant's range on the device (and waits for it) before returning.
bb_status make_cuda_ipc_exporter(const CudaDriver& drv, int device, uint64_t device_ptr,
                                 uint64_t bytes, uint64_t alignment, bool clear,
                                 std::unique_ptr<GrantExporter>* out, std::string* error);
// Reserves bytes (rounded down to the allocation granularity) of virtual address space on
// device; physical memory is created per grant, and zeroed before it is exported with clear.
bb_status make_cuda_vmm_exporter(const CudaDriver& drv, int device, uint64_t bytes, bool clear,
                                 std::unique_ptr<GrantExporter>* out, std::string* error);

// Importer side (the task): a grant mapped into this process.
class GrantMapping {
 public:
  virtual ~GrantMapping() = default;  // unmaps if unmap() was not called
  // A host pointer for host, a device pointer for CUDA backends; size() bytes from it belong to
  // the grant.
  void* ptr() const { return ptr_; }
  uint64_t size() const { return size_; }
  uint64_t grant_id() const { return id_; }
  // CUDA backends: this process's ordinal of the GPU the grant is mapped on (the trainer's GPU,
  // found by UUID: a process may number its GPUs otherwise); -1 for host memory.
  int device() const { return device_; }
  // Unmaps now, reporting a failure (the destructor cannot). Idempotent.
  virtual bb_status unmap(std::string* error) = 0;

 protected:
  void* ptr_ = nullptr;
  uint64_t size_ = 0;
  uint64_t id_ = 0;
  int device_ = -1;
};

// Maps grant g. fd is the descriptor received with it (host, cuda-vmm; ignored for cuda-ipc);
// it is not consumed: close it after the call. drv == nullptr loads the process's driver
// (cuda_driver()); without a CUDA driver a CUDA grant fails with BB_E_UNSUPPORTED.
bb_status map_grant(const Grant& g, int fd, std::unique_ptr<GrantMapping>* out,
                    std::string* error, const CudaDriver* drv = nullptr);

// Backend entry points behind map_grant (g already validated).
bb_status map_host_grant(const Grant& g, int fd, std::unique_ptr<GrantMapping>* out,
                         std::string* error);
bb_status map_cuda_ipc_grant(const CudaDriver& drv, const Grant& g,
                             std::unique_ptr<GrantMapping>* out, std::string* error);
bb_status map_cuda_vmm_grant(const CudaDriver& drv, const Grant& g, int fd,
                             std::unique_ptr<GrantMapping>* out, std::string* error);

}  // namespace bb::core
