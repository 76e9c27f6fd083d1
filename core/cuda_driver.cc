#include "core/cuda_driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

namespace bb::core {
namespace {

constexpr const char* kDefaultDriver = "libcuda.so.1";

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t,
                                      CUdriverProcAddressQueryResult*);

const char* error_name(const CudaDriver* drv, CUresult rc) {
  const char* s = nullptr;
  if (drv && drv->GetErrorName && drv->GetErrorName(rc, &s) == CUDA_SUCCESS && s) return s;
  return "CUDA_ERROR_UNKNOWN";
}

}  // namespace

bb_status cuda_status(CUresult rc) {
  switch (rc) {
    case CUDA_SUCCESS: return BB_OK;
    case CUDA_ERROR_OUT_OF_MEMORY: return BB_E_NOMEM;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_DEVICE: return BB_E_INVALID;
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: return BB_E_UNSUPPORTED;
    case CUDA_ERROR_NOT_PERMITTED: return BB_E_PERMISSION;
    default: return BB_E_SYSTEM;
  }
}

const char* CudaDriver::error_name(CUresult rc) const { return bb::core::error_name(this, rc); }

bool CudaDriver::current_device(int* device) const {
  CUcontext ctx = nullptr;
  CUdevice dev = -1;
  if (CtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) return false;
  if (CtxGetDevice(&dev) != CUDA_SUCCESS || dev < 0) return false;
  *device = int(dev);
  return true;
}

std::string CudaDriver::describe(const char* what, CUresult rc) const {
  std::string out = what;
  out += " failed: ";
  out += bb::core::error_name(this, rc);
  const char* s = nullptr;
  if (GetErrorString && GetErrorString(rc, &s) == CUDA_SUCCESS && s) {
    out += " (";
    out += s;
    out += ")";
  }
  return out;
}

bb_status CudaDriver::open(const std::string& path, std::unique_ptr<CudaDriver>* out,
                           std::string* error) {
  out->reset();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = dlerror();
    *error = "could not load the CUDA driver '" + path + "' (" + (why ? why : "unknown error") +
             "): install the NVIDIA driver, set BUBBLE_CUDA_DRIVER to the path of libcuda.so.1, "
             "or use the host grant backend";
    return BB_E_UNSUPPORTED;
  }
  auto drv = std::make_unique<CudaDriver>();
  drv->path = path;
  drv->dl_handle = h;
  auto fail = [&](std::string msg) {
    dlclose(h);
    *error = std::move(msg);
    return BB_E_UNSUPPORTED;
  };

  // cuGetProcAddress gives the entry point whose ABI matches the version asked for, which keeps
  // working when a later driver adds a _v3; dlsym of the versioned name covers drivers before 12.0.
  auto gpa = reinterpret_cast<GetProcAddressFn>(dlsym(h, "cuGetProcAddress_v2"));
  bool any_via_gpa = false;
  auto resolve = [&](const char* base, const char* versioned) -> void* {
    if (gpa) {
      void* fn = nullptr;
      CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      if (gpa(base, &fn, kCudaAbiVersion, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status) ==
              CUDA_SUCCESS &&
          fn && status == CU_GET_PROC_ADDRESS_SUCCESS) {
        any_via_gpa = true;
        return fn;
      }
    }
    return dlsym(h, versioned);
  };
#define BB_CUDA_DRIVER_RESOLVE_(member, fn, versioned)                                     \
  drv->member = reinterpret_cast<decltype(drv->member)>(resolve(#fn, versioned));          \
  if (!drv->member)                                                                        \
    return fail("the CUDA driver '" + path + "' has no entry point " versioned             \
                ": it is too old or not a CUDA driver; libbubble needs driver API 11.4 or newer");
  BB_CUDA_DRIVER_FUNCTIONS(BB_CUDA_DRIVER_RESOLVE_)
#undef BB_CUDA_DRIVER_RESOLVE_
  drv->via_proc_address = any_via_gpa;

  CUresult rc = drv->Init(0);
  if (rc == CUDA_ERROR_NO_DEVICE)
    return fail("the CUDA driver '" + path + "' found no GPU (CUDA_ERROR_NO_DEVICE): run on a "
                "machine with a GPU, check CUDA_VISIBLE_DEVICES, or use the host grant backend");
  if (rc != CUDA_SUCCESS)
    return fail("the CUDA driver '" + path + "' did not initialise: " + drv->describe("cuInit", rc) +
                "; check the driver installation (nvidia-smi) or use the host grant backend");
  if ((rc = drv->DriverGetVersion(&drv->driver_version)) != CUDA_SUCCESS)
    return fail(drv->describe("cuDriverGetVersion", rc));
  if ((rc = drv->DeviceGetCount(&drv->device_count)) != CUDA_SUCCESS)
    return fail(drv->describe("cuDeviceGetCount", rc));
  if (drv->device_count <= 0)
    return fail("the CUDA driver '" + path + "' reports no GPU: run on a machine with a GPU, "
                "check CUDA_VISIBLE_DEVICES, or use the host grant backend");
  *out = std::move(drv);
  return BB_OK;
}

std::string cuda_driver_path() {
  const char* env = std::getenv("BUBBLE_CUDA_DRIVER");
  return (env && *env) ? std::string(env) : std::string(kDefaultDriver);
}

const CudaDriver* cuda_driver(std::string* error) {
  struct Loaded {
    std::unique_ptr<CudaDriver> drv;
    std::string error;
  };
  // A function-local static: initialised exactly once even when threads race here. The table is
  // never freed, so pointers into the driver stay valid until exit.
  static const Loaded* loaded = [] {
    auto* l = new Loaded;
    CudaDriver::open(cuda_driver_path(), &l->drv, &l->error);
    return l;
  }();
  if (!loaded->drv && error) *error = loaded->error;
  return loaded->drv.get();
}

CudaContextScope::CudaContextScope(const CudaDriver& drv, CUcontext ctx) : drv_(drv) {
  prev_mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
  restore_mode_ = drv_.ThreadExchangeStreamCaptureMode(&prev_mode_) == CUDA_SUCCESS;
  if (drv_.CtxGetCurrent(&prev_) != CUDA_SUCCESS) prev_ = nullptr;
  if (prev_ == ctx) return;
  status_ = cuda_status(drv_.CtxSetCurrent(ctx));
  restore_ = status_ == BB_OK;
}

CudaContextScope::~CudaContextScope() {
  if (restore_) drv_.CtxSetCurrent(prev_);
  if (restore_mode_) drv_.ThreadExchangeStreamCaptureMode(&prev_mode_);
}

bb_status CudaPrivateStream::ensure(std::string* error) {
  if (stream_) return BB_OK;
  const CUresult rc = drv_.StreamCreate(&stream_, CU_STREAM_NON_BLOCKING);
  if (rc == CUDA_SUCCESS) return BB_OK;
  stream_ = nullptr;
  *error = drv_.describe("cuStreamCreate of the lender's stream", rc);
  return cuda_status(rc);
}

bb_status CudaPrivateStream::finish(const char* what, CUresult rc, const char* wait,
                                    const char* outcome, std::string* error) {
  if (rc == CUDA_SUCCESS) {
    what = wait;
    rc = drv_.StreamSynchronize(stream_);
  }
  if (rc == CUDA_SUCCESS) return BB_OK;
  *error = drv_.describe(what, rc) + outcome;
  // Whatever the stream still holds is abandoned with it; the next call gets a clean one.
  reset();
  return cuda_status(rc);
}

bb_status CudaPrivateStream::clear(CUdeviceptr ptr, uint64_t bytes, std::string* error) {
  if (const bb_status st = ensure(error); st != BB_OK) return st;
  return finish("cuMemsetD8Async clearing a grant", drv_.MemsetD8Async(ptr, 0, bytes, stream_),
                "cuStreamSynchronize waiting for a grant to be cleared", ": the grant was not made",
                error);
}

bb_status CudaPrivateStream::copy(CUdeviceptr dst, CUdeviceptr src, uint64_t bytes,
                                  std::string* error) {
  if (const bb_status st = ensure(error); st != BB_OK) return st;
  return finish("cuMemcpyAsync copying a grant out", drv_.MemcpyAsync(dst, src, bytes, stream_),
                "cuStreamSynchronize waiting for a grant to be copied out",
                ": the copy may be incomplete", error);
}

bb_status CudaPrivateStream::copy_out(CUcontext ctx, CUdeviceptr base, uint64_t capacity,
                                      uint64_t offset, void* dst, uint64_t bytes,
                                      std::string* error) {
  if (bytes == 0 || offset > capacity || bytes > capacity - offset) {
    *error = "the range to copy lies outside the lent range";
    return BB_E_INVALID;
  }
  CudaContextScope scope(drv_, ctx);
  if (scope.status() != BB_OK) {
    *error = "could not make the GPU's primary context current to copy a grant out";
    return scope.status();
  }
  return copy(reinterpret_cast<CUdeviceptr>(dst), base + offset, bytes, error);
}

void CudaPrivateStream::reset() {
  if (stream_) drv_.StreamDestroy(stream_);
  stream_ = nullptr;
}

bb_status CudaPrimaryContext::retain(const CudaDriver& drv, int device, std::string* error) {
  reset();
  if (device < 0 || device >= drv.device_count) {
    *error = "CUDA device " + std::to_string(device) + " does not exist: this machine has " +
             std::to_string(drv.device_count) + " visible GPU(s); pick an ordinal below that";
    return BB_E_INVALID;
  }
  CUresult rc = drv.DeviceGet(&dev_, device);
  if (rc == CUDA_SUCCESS) rc = drv.DevicePrimaryCtxRetain(&ctx_, dev_);
  if (rc != CUDA_SUCCESS) {
    ctx_ = nullptr;
    *error = drv.describe("retaining the primary context of the GPU", rc);
    return cuda_status(rc);
  }
  drv_ = &drv;
  ordinal_ = device;
  return BB_OK;
}

bb_status cuda_device_uuid(const CudaDriver& drv, int device, uint8_t out[kCudaUuidBytes],
                           std::string* error) {
  CUdevice dev = 0;
  CUuuid u{};
  CUresult rc = drv.DeviceGet(&dev, device);
  if (rc == CUDA_SUCCESS) rc = drv.DeviceGetUuid(&u, dev);
  if (rc != CUDA_SUCCESS) {
    *error = drv.describe(("reading the UUID of CUDA device " + std::to_string(device)).c_str(),
                          rc);
    return cuda_status(rc);
  }
  std::memcpy(out, u.bytes, kCudaUuidBytes);
  return BB_OK;
}

std::string cuda_uuid_string(const uint8_t uuid[kCudaUuidBytes]) {
  std::string s = "GPU-";
  char hex[3];
  for (size_t i = 0; i < kCudaUuidBytes; ++i) {
    std::snprintf(hex, sizeof hex, "%02x", uuid[i]);
    s += hex;
    if (i == 3 || i == 5 || i == 7 || i == 9) s += '-';
  }
  return s;
}

bb_status cuda_device_by_uuid(const CudaDriver& drv, const uint8_t uuid[kCudaUuidBytes],
                              int* device, std::string* error) {
  for (int d = 0; d < drv.device_count; ++d) {
    uint8_t u[kCudaUuidBytes];
    if (const bb_status st = cuda_device_uuid(drv, d, u, error); st != BB_OK) return st;
    if (std::memcmp(u, uuid, kCudaUuidBytes) == 0) {
      *device = d;
      return BB_OK;
    }
  }
  const char* vis = std::getenv("CUDA_VISIBLE_DEVICES");
  *error = "the memory is on GPU " + cuda_uuid_string(uuid) + ", which this process does not "
           "see (it sees " + std::to_string(drv.device_count) + " GPU(s); CUDA_VISIBLE_DEVICES=" +
           (vis ? std::string(vis) : std::string("(unset)")) +
           "): run the task where that GPU is visible";
  return BB_E_UNSUPPORTED;
}

bb_status CudaPrimaryContext::retain_by_uuid(const CudaDriver& drv,
                                             const uint8_t uuid[kCudaUuidBytes],
                                             std::string* error) {
  int device = -1;
  const bb_status st = cuda_device_by_uuid(drv, uuid, &device, error);
  return st != BB_OK ? st : retain(drv, device, error);
}

void CudaPrimaryContext::reset() {
  if (ctx_ && drv_) drv_->DevicePrimaryCtxRelease(dev_);
  ctx_ = nullptr;
  drv_ = nullptr;
}

}  // namespace bb::core
