// The CUDA driver, loaded at run time.
//
// libbubble never links libcuda: it must load and run on machines without a GPU. The driver
// library is opened with dlopen the first time a CUDA grant backend is asked for, and every entry
// point libbubble uses is resolved once into a table (through cuGetProcAddress where the driver
// has it, else dlsym of the versioned symbol). $BUBBLE_CUDA_DRIVER names another library to load
// instead of libcuda.so.1: tests point it at a fake driver, and it helps with unusual installs.
#pragma once

#include <bubble/bubble.h>
#include <cuda.h>

#include <memory>
#include <string>

namespace bb::core {

// The driver ABI version libbubble asks cuGetProcAddress for. Every entry point in the table
// has had the signature that cuda.h now gives it since this version; a driver older than it
// is still served through dlsym of the versioned names.
inline constexpr int kCudaAbiVersion = 12000;

struct CudaDriver {
  // The table. Names follow cuda.h without the "cu" prefix so a call reads drv.MemCreate(...).
#define BB_CUDA_DRIVER_FUNCTIONS(X)                                      \
  X(Init, cuInit, "cuInit")                                              \
  X(DriverGetVersion, cuDriverGetVersion, "cuDriverGetVersion")          \
  X(GetErrorName, cuGetErrorName, "cuGetErrorName")                      \
  X(GetErrorString, cuGetErrorString, "cuGetErrorString")                \
  X(DeviceGetCount, cuDeviceGetCount, "cuDeviceGetCount")                \
  X(DeviceGet, cuDeviceGet, "cuDeviceGet")                               \
  X(DeviceGetAttribute, cuDeviceGetAttribute, "cuDeviceGetAttribute")    \
  X(DeviceGetUuid, cuDeviceGetUuid, "cuDeviceGetUuid_v2")                \
  X(PointerGetAttribute, cuPointerGetAttribute, "cuPointerGetAttribute") \
  X(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") \
  X(DevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2") \
  X(CtxGetCurrent, cuCtxGetCurrent, "cuCtxGetCurrent")                   \
  X(CtxSetCurrent, cuCtxSetCurrent, "cuCtxSetCurrent")                   \
  X(CtxGetDevice, cuCtxGetDevice, "cuCtxGetDevice")                      \
  X(MemAlloc, cuMemAlloc, "cuMemAlloc_v2")                               \
  X(MemFree, cuMemFree, "cuMemFree_v2")                                  \
  X(MemGetAddressRange, cuMemGetAddressRange, "cuMemGetAddressRange_v2") \
  X(IpcGetMemHandle, cuIpcGetMemHandle, "cuIpcGetMemHandle")             \
  X(IpcOpenMemHandle, cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2")       \
  X(IpcCloseMemHandle, cuIpcCloseMemHandle, "cuIpcCloseMemHandle")       \
  X(MemGetAllocationGranularity, cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity") \
  X(MemCreate, cuMemCreate, "cuMemCreate")                               \
  X(MemRelease, cuMemRelease, "cuMemRelease")                            \
  X(MemExportToShareableHandle, cuMemExportToShareableHandle, "cuMemExportToShareableHandle") \
  X(MemImportFromShareableHandle, cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle") \
  X(MemAddressReserve, cuMemAddressReserve, "cuMemAddressReserve")       \
  X(MemAddressFree, cuMemAddressFree, "cuMemAddressFree")                \
  X(MemMap, cuMemMap, "cuMemMap")                                        \
  X(MemUnmap, cuMemUnmap, "cuMemUnmap")                                  \
  X(MemSetAccess, cuMemSetAccess, "cuMemSetAccess")                     \
  X(StreamCreate, cuStreamCreate, "cuStreamCreate")                      \
  X(StreamDestroy, cuStreamDestroy, "cuStreamDestroy_v2")                \
  X(MemsetD8Async, cuMemsetD8Async, "cuMemsetD8Async")                   \
  X(MemcpyAsync, cuMemcpyAsync, "cuMemcpyAsync")                         \
  X(StreamSynchronize, cuStreamSynchronize, "cuStreamSynchronize")      \
  X(ThreadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode,  \
    "cuThreadExchangeStreamCaptureMode")

#define BB_CUDA_DRIVER_MEMBER_(member, fn, versioned) decltype(&::fn) member = nullptr;
  BB_CUDA_DRIVER_FUNCTIONS(BB_CUDA_DRIVER_MEMBER_)
#undef BB_CUDA_DRIVER_MEMBER_

  std::string path;          // what was loaded
  int driver_version = 0;    // cuDriverGetVersion
  int device_count = 0;
  bool via_proc_address = false;  // the table came from cuGetProcAddress (else dlsym)
  void* dl_handle = nullptr;      // kept open for the process's lifetime

  // Loads the library at path (an explicit path: no environment lookup), resolves the table
  // and initialises the driver. Fails with BB_E_UNSUPPORTED and an actionable *error when the
  // library is missing, lacks an entry point, or finds no GPU. Each call resolves afresh.
  static bb_status open(const std::string& path, std::unique_ptr<CudaDriver>* out,
                        std::string* error);

  // "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
  std::string describe(const char* what, CUresult rc) const;
  // The error's name ("CUDA_ERROR_INVALID_HANDLE"), without allocating: for bounded-time paths.
  const char* error_name(CUresult rc) const;
  // The ordinal of the device whose context is current on the calling thread (the one
  // cudaSetDevice made current); false when no context is current.
  bool current_device(int* device) const;
};

// The process's driver: loaded from $BUBBLE_CUDA_DRIVER or libcuda.so.1 on the first call, once,
// thread-safely; later calls return the same table or repeat the same failure. On failure
// returns nullptr, and *error (may be null) receives the reason.
const CudaDriver* cuda_driver(std::string* error);

// The library cuda_driver() loads: $BUBBLE_CUDA_DRIVER if set and non-empty, else libcuda.so.1.
std::string cuda_driver_path();

// Maps a driver result to a libbubble status (out of memory -> BB_E_NOMEM, ...).
bb_status cuda_status(CUresult rc);

// Makes the device's primary context current on the calling thread for its lifetime, and puts
// back whatever was current before. The primary context is the one the CUDA runtime (and so
// PyTorch) uses, so pointers libbubble maps are usable from the caller's kernels.
//
// The thread is in relaxed stream-capture mode meanwhile (its mode is put back after). The
// application may capture a CUDA graph in global mode (the default of torch.cuda.graph and of
// the runtime) on another thread at any time; an allocation, a free, a wait or a copy to host
// memory that libbubble makes then from a thread in global mode is an "unsafe call" to that
// capture, which the driver refuses and invalidates: the application would lose its graph
// through no fault of its own. libbubble's work never touches a captured stream, so nothing
// it does belongs in a graph, and relaxed mode is what it needs. Every CUDA call libbubble
// makes outside device queries runs inside one of these scopes.
class CudaContextScope {
 public:
  CudaContextScope(const CudaDriver& drv, CUcontext ctx);
  ~CudaContextScope();
  CudaContextScope(const CudaContextScope&) = delete;
  CudaContextScope& operator=(const CudaContextScope&) = delete;
  bb_status status() const { return status_; }

 private:
  const CudaDriver& drv_;
  CUcontext prev_ = nullptr;
  CUstreamCaptureMode prev_mode_ = CU_STREAM_CAPTURE_MODE_GLOBAL;
  bb_status status_ = BB_OK;
  bool restore_ = false;
  bool restore_mode_ = false;
};

// The lender's own stream: zeroes device memory before it is lent again, and copies a grant's
// bytes out for the trainer (bb_trainer_read_grant). The work runs on a private non-blocking
// stream and only that stream is waited for: the trainer's own kernels on the same context are
// never synchronised with (no cuCtxSynchronize, no legacy default stream). The stream is created
// on first use; use and reset() it with its context current (CudaContextScope).
class CudaPrivateStream {
 public:
  explicit CudaPrivateStream(const CudaDriver& drv) : drv_(drv) {}
  ~CudaPrivateStream() { reset(); }
  CudaPrivateStream(const CudaPrivateStream&) = delete;
  CudaPrivateStream& operator=(const CudaPrivateStream&) = delete;

  // Sets [ptr, ptr + bytes) to zero and returns once the device has done it. On failure *error
  // names the driver call; the stream is dropped (a later call starts a fresh one).
  bb_status clear(CUdeviceptr ptr, uint64_t bytes, std::string* error);
  // Copies bytes from src to dst (each device memory of this context or host memory: unified
  // addressing tells them apart) and returns once the copy is done. Failures as for clear().
  bb_status copy(CUdeviceptr dst, CUdeviceptr src, uint64_t bytes, std::string* error);
  // GrantExporter::read for a lent range [base, base + capacity) of ctx's GPU: copies
  // [offset, offset + bytes) of it to dst with ctx current.
  bb_status copy_out(CUcontext ctx, CUdeviceptr base, uint64_t capacity, uint64_t offset,
                     void* dst, uint64_t bytes, std::string* error);
  // Destroys the stream, if any.
  void reset();

 private:
  bb_status ensure(std::string* error);
  bb_status finish(const char* what, CUresult rc, const char* wait, const char* outcome,
                   std::string* error);

  const CudaDriver& drv_;
  CUstream stream_ = nullptr;
};

// A GPU's UUID, the name of a GPU that holds across processes: an ordinal depends on what each
// process sees (CUDA_VISIBLE_DEVICES), so a grant names its GPU by UUID.
inline constexpr size_t kCudaUuidBytes = 16;
bb_status cuda_device_uuid(const CudaDriver& drv, int device, uint8_t out[kCudaUuidBytes],
                           std::string* error);
// This process's ordinal of the GPU with that UUID. BB_E_UNSUPPORTED when it sees no such GPU,
// with an *error that names the UUID and CUDA_VISIBLE_DEVICES.
bb_status cuda_device_by_uuid(const CudaDriver& drv, const uint8_t uuid[kCudaUuidBytes],
                              int* device, std::string* error);
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi and CUDA_VISIBLE_DEVICES spell it.
std::string cuda_uuid_string(const uint8_t uuid[kCudaUuidBytes]);

// A retained primary context of one device; released on destruction.
class CudaPrimaryContext {
 public:
  CudaPrimaryContext() = default;
  ~CudaPrimaryContext() { reset(); }
  CudaPrimaryContext(const CudaPrimaryContext&) = delete;
  CudaPrimaryContext& operator=(const CudaPrimaryContext&) = delete;

  // Checks the ordinal, retains the context. *error explains a failure.
  bb_status retain(const CudaDriver& drv, int device, std::string* error);
  // The same for the GPU with that UUID, whatever this process's ordinal of it
  // (cuda_device_by_uuid).
  bb_status retain_by_uuid(const CudaDriver& drv, const uint8_t uuid[kCudaUuidBytes],
                           std::string* error);
  void reset();
  CUcontext get() const { return ctx_; }
  CUdevice device() const { return dev_; }
  // This process's ordinal of the GPU (what cudaSetDevice takes), -1 while none is retained.
  int ordinal() const { return ctx_ ? ordinal_ : -1; }

 private:
  const CudaDriver* drv_ = nullptr;
  CUdevice dev_ = 0;
  int ordinal_ = -1;
  CUcontext ctx_ = nullptr;
};

}  // namespace bb::core
