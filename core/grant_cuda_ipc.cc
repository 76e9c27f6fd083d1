// The cuda-ipc backend: grants are sub-ranges of one device allocation, shared through the legacy
// CUDA IPC handle of that allocation.
//
// An IPC handle names a whole cuMemAlloc allocation, so every grant of a lent range carries the
// same 64 bytes plus its own offset; cuIpcOpenMemHandle reference-counts repeated opens of one
// handle in one context, so each mapping opens and closes it independently. The driver cannot
// restrict an importer to its sub-range: a task can reach the whole allocation (see
// docs/GRANTS.md). Handles cannot be opened by the process that exported them.
//
// A window keeps whatever its previous holder, or the trainer, left in it, so create() zeroes it
// on the device before the grant exists (unless the lender was told all tasks share one owner).
#include <algorithm>
#include <cstring>

#include "core/cuda_driver.h"
#include "core/grant.h"

namespace bb::core {
namespace {

class IpcExporter final : public GrantExporter {
 public:
  IpcExporter(const CudaDriver& drv, bool clear) : drv_(drv), stream_(drv), clear_(clear) {}
  ~IpcExporter() override {
    if (!ctx_.get()) return;
    CudaContextScope scope(drv_, ctx_.get());
    stream_.reset();
    if (owned_) drv_.MemFree(owned_);
  }

  bb_status init(int device, uint64_t device_ptr, uint64_t bytes, uint64_t alignment,
                 std::string* error) {
    bb_status st = ctx_.retain(drv_, device, error);
    if (st != BB_OK) return st;
    if ((st = cuda_device_uuid(drv_, device, uuid_, error)) != BB_OK) return st;
    device_ = device;
    align_ = alignment ? alignment : 256;  // cuMemAlloc's own alignment
    if (align_ & (align_ - 1)) {
      *error = "cuda-ipc grant alignment " + std::to_string(align_) + " is not a power of two";
      return BB_E_INVALID;
    }
    capacity_ = bytes & ~(align_ - 1);
    if (capacity_ == 0) {
      *error = "a cuda-ipc lent range of " + std::to_string(bytes) + " bytes holds no " +
               std::to_string(align_) + "-byte grant unit";
      return BB_E_INVALID;
    }
    CudaContextScope scope(drv_, ctx_.get());
    if (scope.status() != BB_OK) {
      *error = "could not make the GPU's primary context current";
      return scope.status();
    }
    CUresult rc;
    if (device_ptr == 0) {
      CUdeviceptr p = 0;
      if ((rc = drv_.MemAlloc(&p, capacity_)) != CUDA_SUCCESS) {
        *error = drv_.describe(("cuMemAlloc of a " + std::to_string(capacity_) +
                                "-byte cuda-ipc lent range").c_str(), rc);
        return cuda_status(rc);
      }
      owned_ = p;
      device_ptr = p;
    }
    ptr_ = device_ptr;
    CUdeviceptr base = 0;
    size_t alloc_size = 0;
    if ((rc = drv_.MemGetAddressRange(&base, &alloc_size, ptr_)) != CUDA_SUCCESS) {
      *error = drv_.describe("cuMemGetAddressRange of the lent pointer", rc) +
               ": lend memory from cuMemAlloc/cudaMalloc on this device";
      return cuda_status(rc);
    }
    // The memory must be on the lender's device: tasks map it for work on that GPU, and the
    // grants are cleared on its stream.
    int on = -1;
    if ((rc = drv_.PointerGetAttribute(&on, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr_)) !=
        CUDA_SUCCESS) {
      *error = drv_.describe("cuPointerGetAttribute of the lent pointer", rc) +
               ": lend memory from cuMemAlloc/cudaMalloc on this device";
      return cuda_status(rc);
    }
    if (on != device_) {
      *error = "the lent pointer is memory of CUDA device " + std::to_string(on) +
               ", not of device " + std::to_string(device_) +
               " the lender was told: set the lend options' device to " + std::to_string(on);
      return BB_E_INVALID;
    }
    // In differences, not sums: a capacity near 2^64 ("all of it") wraps a sum below the end.
    if (ptr_ < base || capacity_ > alloc_size - std::min<uint64_t>(alloc_size, ptr_ - base)) {
      *error = "the cuda-ipc lent range [" + std::to_string(ptr_) + ", +" +
               std::to_string(capacity_) + ") runs past the end of its allocation (" +
               std::to_string(alloc_size) + " bytes): lend a range inside one allocation";
      return BB_E_INVALID;
    }
    alloc_base_ = base;
    static_assert(sizeof(CUipcMemHandle) == kIpcHandleBytes);
    CUipcMemHandle h;
    if ((rc = drv_.IpcGetMemHandle(&h, base)) != CUDA_SUCCESS) {
      *error = drv_.describe("cuIpcGetMemHandle of the lent allocation", rc) +
               ": cuda-ipc needs memory from cuMemAlloc/cudaMalloc (not cuMemCreate or a "
               "stream-ordered pool); use cuda-vmm otherwise";
      return cuda_status(rc);
    }
    std::memcpy(handle_, &h, kIpcHandleBytes);
    return BB_OK;
  }

  GrantBackend backend() const override { return GrantBackend::kCudaIpc; }
  uint64_t capacity() const override { return capacity_; }
  uint64_t alignment() const override { return align_; }
  uint64_t address(uint64_t offset) const override { return ptr_ + offset; }
  bb_status read(uint64_t offset, void* dst, uint64_t bytes, std::string* error) override {
    return stream_.copy_out(ctx_.get(), ptr_, capacity_, offset, dst, bytes, error);
  }

  bb_status create(uint64_t offset, uint64_t size, GrantHandle* h, std::string* error) override {
    if (size == 0 || offset > capacity_ || size > capacity_ - offset) {
      *error = "cuda-ipc grant range outside the lent range";
      return BB_E_INVALID;
    }
    // Nothing to allocate: the grant is a window on memory the trainer already lent.
    if (clear_) {
      CudaContextScope scope(drv_, ctx_.get());
      if (scope.status() != BB_OK) {
        *error = "could not make the GPU's primary context current to clear a cuda-ipc grant";
        return scope.status();
      }
      bb_status st = stream_.clear(ptr_ + offset, size, error);
      if (st != BB_OK) return st;
    }
    *h = GrantHandle{};
    h->map_offset = (ptr_ - alloc_base_) + offset;
    h->map_size = size;
    h->device = device_;
    std::memcpy(h->device_uuid, uuid_, sizeof uuid_);
    h->fd = -1;
    std::memcpy(h->ipc, handle_, kIpcHandleBytes);
    return BB_OK;
  }

  bb_status destroy(uint64_t, uint64_t, GrantHandle* h, std::string*) override {
    std::memset(h->ipc, 0, kIpcHandleBytes);
    return BB_OK;
  }

 private:
  const CudaDriver& drv_;
  CudaPrimaryContext ctx_;
  CudaPrivateStream stream_;
  bool clear_ = true;
  int device_ = 0;
  uint8_t uuid_[kCudaUuidBytes] = {};
  uint64_t align_ = 256;
  uint64_t capacity_ = 0;
  CUdeviceptr ptr_ = 0;
  CUdeviceptr alloc_base_ = 0;
  CUdeviceptr owned_ = 0;
  uint8_t handle_[kIpcHandleBytes] = {};
};

class IpcMapping final : public GrantMapping {
 public:
  IpcMapping(const CudaDriver& drv) : drv_(drv) {}
  ~IpcMapping() override {
    std::string ignored;
    unmap(&ignored);
  }

  bb_status open(const Grant& g, std::string* error) {
    // The trainer's GPU by its UUID: this process may number it otherwise.
    bb_status st = ctx_.retain_by_uuid(drv_, g.handle.device_uuid, error);
    if (st != BB_OK) return st;
    CudaContextScope scope(drv_, ctx_.get());
    CUipcMemHandle h;
    std::memcpy(&h, g.handle.ipc, kIpcHandleBytes);
    CUresult rc = drv_.IpcOpenMemHandle(&base_, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (rc != CUDA_SUCCESS) {
      base_ = 0;
      *error = drv_.describe(("opening the IPC handle of cuda-ipc grant " +
                              std::to_string(g.id)).c_str(), rc) +
               ": the trainer may have freed the memory, or this process exported it itself";
      return cuda_status(rc);
    }
    // The handle names a whole allocation; make sure the grant's window is inside it before
    // handing out a pointer.
    CUdeviceptr b = 0;
    size_t alloc_size = 0;
    rc = drv_.MemGetAddressRange(&b, &alloc_size, base_);
    if (rc != CUDA_SUCCESS || g.handle.map_offset > alloc_size ||
        g.handle.map_size > alloc_size - g.handle.map_offset) {
      std::string ignored;
      unmap(&ignored);
      *error = "cuda-ipc grant " + std::to_string(g.id) + " lies outside the allocation its "
               "handle names: the grant record is corrupt";
      return BB_E_CORRUPT;
    }
    ptr_ = reinterpret_cast<void*>(base_ + g.handle.map_offset);
    size_ = g.size;
    id_ = g.id;
    device_ = ctx_.ordinal();
    return BB_OK;
  }

  bb_status unmap(std::string* error) override {
    if (!base_) return BB_OK;
    CUresult rc;
    {
      CudaContextScope scope(drv_, ctx_.get());
      rc = drv_.IpcCloseMemHandle(base_);
    }
    base_ = 0;
    ptr_ = nullptr;
    ctx_.reset();
    if (rc != CUDA_SUCCESS) {
      *error = drv_.describe("cuIpcCloseMemHandle", rc);
      return cuda_status(rc);
    }
    return BB_OK;
  }

 private:
  const CudaDriver& drv_;
  CudaPrimaryContext ctx_;
  CUdeviceptr base_ = 0;
};

}  // namespace

bb_status make_cuda_ipc_exporter(const CudaDriver& drv, int device, uint64_t device_ptr,
                                 uint64_t bytes, uint64_t alignment, bool clear,
                                 std::unique_ptr<GrantExporter>* out, std::string* error) {
  out->reset();
  auto e = std::make_unique<IpcExporter>(drv, clear);
  bb_status st = e->init(device, device_ptr, bytes, alignment, error);
  if (st == BB_OK) *out = std::move(e);
  return st;
}

bb_status map_cuda_ipc_grant(const CudaDriver& drv, const Grant& g,
                             std::unique_ptr<GrantMapping>* out, std::string* error) {
  auto m = std::make_unique<IpcMapping>(drv);
  bb_status st = m->open(g, error);
  if (st == BB_OK) *out = std::move(m);
  return st;
}

}  // namespace bb::core
