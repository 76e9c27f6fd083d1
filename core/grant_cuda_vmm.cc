// The cuda-vmm backend: physical memory per grant (cuMemCreate), shared as a POSIX descriptor.
//
// The trainer reserves the lent range as virtual address space and maps each grant's physical
// allocation at its place, so it can read what a task wrote; the task imports the descriptor and
// maps the same physical memory at an address of its own. A task reaches only its grant. The
// driver maps whole handles only (cuMemMap's offset must be 0), hence one allocation per grant
// and grants rounded up to the allocation granularity.
//
// The driver does not zero what cuMemCreate returns (it may hold another process's data), so
// create() zeroes each grant on the device before exporting it, unless the lender was told all
// tasks share one owner.
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <map>

#include "core/cuda_driver.h"
#include "core/grant.h"

namespace bb::core {
namespace {

CUmemAllocationProp grant_prop(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

CUmemAccessDesc rw_access(CUdevice dev) {
  CUmemAccessDesc d{};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = dev;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return d;
}

// Checks the device can do what this backend needs, and returns its granularity.
bb_status vmm_granularity(const CudaDriver& drv, CUdevice dev, uint64_t* gran,
                          std::string* error) {
  int vmm = 0, posix = 0;
  CUresult rc =
      drv.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (rc == CUDA_SUCCESS)
    rc = drv.DeviceGetAttribute(
        &posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev);
  if (rc != CUDA_SUCCESS) {
    *error = drv.describe("cuDeviceGetAttribute", rc);
    return cuda_status(rc);
  }
  if (!vmm || !posix) {
    *error = std::string("this GPU or driver does not support ") +
             (!vmm ? "virtual memory management" : "POSIX descriptor export of device memory") +
             ": use the cuda-ipc backend";
    return BB_E_UNSUPPORTED;
  }
  CUmemAllocationProp prop = grant_prop(dev);
  size_t g = 0;
  rc = drv.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (rc != CUDA_SUCCESS || g == 0 || (g & (g - 1))) {
    *error = rc != CUDA_SUCCESS ? drv.describe("cuMemGetAllocationGranularity", rc)
                                : "the driver reported an unusable allocation granularity";
    return rc != CUDA_SUCCESS ? cuda_status(rc) : BB_E_SYSTEM;
  }
  *gran = g;
  return BB_OK;
}

class VmmExporter final : public GrantExporter {
 public:
  VmmExporter(const CudaDriver& drv, bool clear) : drv_(drv), stream_(drv), clear_(clear) {}
  ~VmmExporter() override {
    // The lender destroys its grants first; anything left here is torn down the same way.
    if (!ctx_.get()) return;
    CudaContextScope scope(drv_, ctx_.get());
    stream_.reset();
    for (auto& [offset, g] : live_) {
      std::string ignored;
      destroy_one(offset, g, &ignored);
    }
    if (base_) drv_.MemAddressFree(base_, capacity_);
  }

  bb_status init(int device, uint64_t bytes, std::string* error) {
    bb_status st = ctx_.retain(drv_, device, error);
    if (st != BB_OK) return st;
    if ((st = cuda_device_uuid(drv_, device, uuid_, error)) != BB_OK) return st;
    device_ = device;
    CudaContextScope scope(drv_, ctx_.get());
    if ((st = vmm_granularity(drv_, ctx_.device(), &gran_, error)) != BB_OK) return st;
    capacity_ = bytes & ~(gran_ - 1);
    if (capacity_ == 0) {
      *error = "a cuda-vmm lent range of " + std::to_string(bytes) +
               " bytes is below the GPU's allocation granularity: lend at least " +
               std::to_string(gran_);
      return BB_E_INVALID;
    }
    CUdeviceptr base = 0;
    CUresult rc = drv_.MemAddressReserve(&base, capacity_, gran_, 0, 0);
    if (rc != CUDA_SUCCESS) {
      *error = drv_.describe(("cuMemAddressReserve of " + std::to_string(capacity_) +
                              " bytes for the cuda-vmm lent range").c_str(), rc);
      return cuda_status(rc);
    }
    base_ = base;
    return BB_OK;
  }

  GrantBackend backend() const override { return GrantBackend::kCudaVmm; }
  uint64_t capacity() const override { return capacity_; }
  uint64_t alignment() const override { return gran_; }
  uint64_t address(uint64_t offset) const override { return base_ + offset; }
  bb_status read(uint64_t offset, void* dst, uint64_t bytes, std::string* error) override {
    return stream_.copy_out(ctx_.get(), base_, capacity_, offset, dst, bytes, error);
  }

  bb_status create(uint64_t offset, uint64_t size, GrantHandle* h, std::string* error) override {
    if (size == 0 || ((offset | size) & (gran_ - 1)) || offset > capacity_ ||
        size > capacity_ - offset || live_.count(offset)) {
      *error = "cuda-vmm grant range is not a free, granularity-aligned part of the lent range";
      return BB_E_INVALID;
    }
    CudaContextScope scope(drv_, ctx_.get());
    if (scope.status() != BB_OK) {
      *error = "could not make the GPU's primary context current to create a cuda-vmm grant";
      return scope.status();
    }
    Physical p;
    CUmemAllocationProp prop = grant_prop(ctx_.device());
    CUresult rc = drv_.MemCreate(&p.handle, size, &prop, 0);
    if (rc != CUDA_SUCCESS) {
      *error = drv_.describe(("cuMemCreate of a " + std::to_string(size) + "-byte grant").c_str(),
                             rc);
      return cuda_status(rc);
    }
    // Unwinds whatever succeeded, in reverse, so a failure leaves nothing allocated.
    auto undo = [&] {
      if (p.fd >= 0) close(p.fd);
      if (p.mapped) drv_.MemUnmap(base_ + offset, size);
      drv_.MemRelease(p.handle);
    };
    auto fail = [&](const char* what, CUresult r) {
      *error = drv_.describe(what, r);
      undo();
      return cuda_status(r);
    };
    if ((rc = drv_.MemMap(base_ + offset, size, 0, p.handle, 0)) != CUDA_SUCCESS)
      return fail("cuMemMap of a grant into the lent range", rc);
    p.mapped = true;
    CUmemAccessDesc access = rw_access(ctx_.device());
    if ((rc = drv_.MemSetAccess(base_ + offset, size, &access, 1)) != CUDA_SUCCESS)
      return fail("cuMemSetAccess on a grant", rc);
    // Cleared before it is exported: no descriptor to uncleared memory ever exists.
    if (clear_) {
      const bb_status st = stream_.clear(base_ + offset, size, error);
      if (st != BB_OK) {
        undo();
        return st;
      }
    }
    int fd = -1;
    rc = drv_.MemExportToShareableHandle(&fd, p.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (rc != CUDA_SUCCESS) return fail("cuMemExportToShareableHandle of a grant", rc);
    p.fd = fd;
    // The driver's descriptor is inheritable; a trainer that forks workers must not leak grants
    // into them.
    int flags = fcntl(fd, F_GETFD);
    if (flags < 0 || fcntl(fd, F_SETFD, flags | FD_CLOEXEC) != 0)
      return fail("marking the grant descriptor close-on-exec", CUDA_ERROR_OPERATING_SYSTEM);
    p.size = size;
    live_[offset] = p;
    *h = GrantHandle{};
    h->map_offset = 0;
    h->map_size = size;
    h->device = device_;
    std::memcpy(h->device_uuid, uuid_, sizeof uuid_);
    h->fd = fd;
    return BB_OK;
  }

  void descriptor_sent(uint64_t offset, GrantHandle* h) override {
    auto it = live_.find(offset);
    if (it != live_.end() && it->second.fd >= 0) {
      close(it->second.fd);
      it->second.fd = -1;
    }
    h->fd = -1;
  }

  bb_status destroy(uint64_t offset, uint64_t size, GrantHandle* h, std::string* error) override {
    auto it = live_.find(offset);
    if (it == live_.end() || it->second.size != size) {
      *error = "cuda-vmm exporter has no grant at offset " + std::to_string(offset);
      return BB_E_INVALID;
    }
    Physical p = it->second;
    live_.erase(it);
    h->fd = -1;
    CudaContextScope scope(drv_, ctx_.get());
    return destroy_one(offset, p, error);
  }

 private:
  struct Physical {
    CUmemGenericAllocationHandle handle = 0;
    uint64_t size = 0;
    int fd = -1;
    bool mapped = false;
  };

  // Unmap before release: the memory goes back to the device once the last mapping and the
  // last handle (a task's import included) are gone.
  bb_status destroy_one(uint64_t offset, const Physical& p, std::string* error) {
    bb_status st = BB_OK;
    if (p.fd >= 0) close(p.fd);
    CUresult rc = drv_.MemUnmap(base_ + offset, p.size);
    if (rc != CUDA_SUCCESS) {
      *error = drv_.describe("cuMemUnmap of a grant", rc);
      st = cuda_status(rc);
    }
    rc = drv_.MemRelease(p.handle);
    if (rc != CUDA_SUCCESS && st == BB_OK) {
      *error = drv_.describe("cuMemRelease of a grant", rc);
      st = cuda_status(rc);
    }
    return st;
  }

  const CudaDriver& drv_;
  CudaPrimaryContext ctx_;
  CudaPrivateStream stream_;
  bool clear_ = true;
  int device_ = 0;
  uint8_t uuid_[kCudaUuidBytes] = {};
  uint64_t gran_ = 0;
  uint64_t capacity_ = 0;
  CUdeviceptr base_ = 0;
  std::map<uint64_t, Physical> live_;
};

class VmmMapping final : public GrantMapping {
 public:
  explicit VmmMapping(const CudaDriver& drv) : drv_(drv) {}
  ~VmmMapping() override {
    std::string ignored;
    unmap(&ignored);
  }

  bb_status open(const Grant& g, int fd, std::string* error) {
    if (fd < 0) {
      *error = "a cuda-vmm grant needs the descriptor that came with it; none was passed";
      return BB_E_INVALID;
    }
    // The trainer's GPU by its UUID: this process may number it otherwise.
    bb_status st = ctx_.retain_by_uuid(drv_, g.handle.device_uuid, error);
    if (st != BB_OK) return st;
    CudaContextScope scope(drv_, ctx_.get());
    uint64_t gran = 0;
    if ((st = vmm_granularity(drv_, ctx_.device(), &gran, error)) != BB_OK) return st;
    if (g.handle.map_size % gran) {
      *error = "cuda-vmm grant " + std::to_string(g.id) + " has a size of " +
               std::to_string(g.handle.map_size) + " bytes, not a multiple of this GPU's " +
               std::to_string(gran) + "-byte granularity: the grant record is corrupt";
      return BB_E_CORRUPT;
    }
    // The driver does not take the descriptor: the caller still owns and closes it.
    CUresult rc = drv_.MemImportFromShareableHandle(
        &handle_, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc != CUDA_SUCCESS) {
      *error = drv_.describe(("importing the descriptor of cuda-vmm grant " +
                              std::to_string(g.id)).c_str(), rc);
      return cuda_status(rc);
    }
    have_handle_ = true;
    map_size_ = g.handle.map_size;
    if ((rc = drv_.MemAddressReserve(&base_, map_size_, gran, 0, 0)) != CUDA_SUCCESS) {
      base_ = 0;
      return fail("cuMemAddressReserve for a grant", rc, error);
    }
    if ((rc = drv_.MemMap(base_, map_size_, 0, handle_, 0)) != CUDA_SUCCESS)
      return fail("cuMemMap of a grant", rc, error);
    mapped_ = true;
    CUmemAccessDesc access = rw_access(ctx_.device());
    if ((rc = drv_.MemSetAccess(base_, map_size_, &access, 1)) != CUDA_SUCCESS)
      return fail("cuMemSetAccess on a grant", rc, error);
    ptr_ = reinterpret_cast<void*>(base_);
    size_ = g.size;
    id_ = g.id;
    device_ = ctx_.ordinal();
    return BB_OK;
  }

  bb_status unmap(std::string* error) override {
    if (!have_handle_ && !base_) return BB_OK;
    bb_status st = BB_OK;
    auto note = [&](const char* what, CUresult rc) {
      if (rc != CUDA_SUCCESS && st == BB_OK) {
        *error = drv_.describe(what, rc);
        st = cuda_status(rc);
      }
    };
    {
      CudaContextScope scope(drv_, ctx_.get());
      if (mapped_) note("cuMemUnmap of a grant", drv_.MemUnmap(base_, map_size_));
      if (have_handle_) note("cuMemRelease of an imported grant", drv_.MemRelease(handle_));
      if (base_) note("cuMemAddressFree of a grant", drv_.MemAddressFree(base_, map_size_));
    }
    mapped_ = have_handle_ = false;
    base_ = 0;
    ptr_ = nullptr;
    ctx_.reset();
    return st;
  }

 private:
  bb_status fail(const char* what, CUresult rc, std::string* error) {
    std::string ignored;
    unmap(&ignored);
    *error = drv_.describe(what, rc);
    return cuda_status(rc);
  }

  const CudaDriver& drv_;
  CudaPrimaryContext ctx_;
  CUmemGenericAllocationHandle handle_ = 0;
  bool have_handle_ = false;
  bool mapped_ = false;
  CUdeviceptr base_ = 0;
  uint64_t map_size_ = 0;
};

}  // namespace

bb_status make_cuda_vmm_exporter(const CudaDriver& drv, int device, uint64_t bytes, bool clear,
                                 std::unique_ptr<GrantExporter>* out, std::string* error) {
  out->reset();
  auto e = std::make_unique<VmmExporter>(drv, clear);
  bb_status st = e->init(device, bytes, error);
  if (st == BB_OK) *out = std::move(e);
  return st;
}

bb_status map_cuda_vmm_grant(const CudaDriver& drv, const Grant& g, int fd,
                             std::unique_ptr<GrantMapping>* out, std::string* error) {
  auto m = std::make_unique<VmmMapping>(drv);
  bb_status st = m->open(g, fd, error);
  if (st == BB_OK) *out = std::move(m);
  return st;
}

}  // namespace bb::core
