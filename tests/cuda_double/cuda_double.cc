// A fake CUDA driver: the entry points libbubble uses, over host memory.
//
// "Device memory" is memfd-backed host memory, so a test can read and write it through the
// pointers the driver hands out, and share it across processes the way the real driver does:
// a VMM export is a dup of the memfd, an IPC handle names (pid, descriptor) and the importer opens
// /proc/<pid>/fd/<n>. Every call is logged; arguments the real driver would reject, and orders
// libbubble promises to keep (unmap before release, no address free while mapped), are recorded
// as violations for the tests to assert on. See cuda_double.h for the environment knobs.
#include "tests/cuda_double/cuda_double.h"

#include <cuda.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <set>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct CUctx_st {
  int device;
};

// An event: its completion lives in a memfd page so that a process that opened it through
// cuIpcOpenEventHandle sees the same state. recorded counts records, done the last one the
// "GPU" finished; the event is complete when done >= recorded (never recorded: complete).
struct EventShared {
  std::atomic<uint64_t> recorded;
  std::atomic<uint64_t> done;
};
// A stream made by cuStreamCreate; the legacy default stream is the null handle.
struct CUstream_st {
  uint32_t magic;
  unsigned flags;
};
struct CUevent_st {
  uint32_t magic;
  unsigned flags;
  int memfd;
  EventShared* sh;
  bool imported;
  uint64_t serial;
  CUcontext ctx;  // current when it was made: as the driver has it, it records only there
};

namespace {

constexpr int kDriverVersion = 13000;
constexpr int kMaxDevices = 8;
constexpr char kIpcMagic[8] = {'B', 'B', 'D', 'B', 'L', 'I', 'P', 'C'};
constexpr char kIpcEventMagic[8] = {'B', 'B', 'D', 'B', 'L', 'E', 'V', 'T'};
constexpr uint32_t kEventMagic = 0x45564e54;
constexpr uint32_t kStreamMagic = 0x5354524d;

struct IpcWire {
  char magic[8];
  int32_t pid;
  int32_t fd;
  uint64_t size;
  uint64_t serial;
  int32_t gpu;  // the physical GPU the allocation is on
};
static_assert(sizeof(IpcWire) <= CU_IPC_HANDLE_SIZE);

struct Physical {
  int memfd = -1;
  size_t size = 0;
  int types = 0;
  int maps = 0;
  bool imported = false;
  int gpu = 0;  // the physical GPU it is on
};
struct Reservation {
  size_t size = 0;
};
struct Mapping {
  size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  int flags = 0;
};
struct DeviceAlloc {
  size_t size = 0;
  int memfd = -1;
  uint64_t serial = 0;
  int gpu = 0;  // the physical GPU it is on
};
struct IpcOpen {
  CUdeviceptr ptr = 0;
  size_t size = 0;
  int refs = 0;
  int gpu = 0;  // the physical GPU the memory is on
};
// A cuMemsetD8Async or cuMemcpyAsync the "GPU" has not run yet: it happens at
// cuStreamSynchronize. A copy has a src; a memset has none.
struct PendingWork {
  CUdeviceptr ptr = 0;
  size_t size = 0;
  unsigned char value = 0;
  CUdeviceptr src = 0;
  bool copy = false;
  bool ptr_device = false;  // a copy's ends that are device memory (else host memory)
  bool src_device = false;
};
struct Failure {
  std::string kind;
  long nth = 0;  // 0 = every call
};

// A physical GPU's UUID: "bbdouble" and its index, and the form CUDA_VISIBLE_DEVICES takes.
CUuuid uuid_of(int gpu) {
  CUuuid u{};
  std::memcpy(u.bytes, "bbdouble", 8);
  u.bytes[15] = static_cast<char>(gpu + 1);
  return u;
}
std::string uuid_string(int gpu) {
  const CUuuid u = uuid_of(gpu);
  std::string s = "GPU-";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(u.bytes[i]));
    s += hex;
    if (i == 3 || i == 5 || i == 7 || i == 9) s += '-';
  }
  return s;
}

struct State {
  std::mutex mu;
  bool initialized = false;
  int devices = 1;          // physical GPUs
  std::vector<int> visible;  // this process's ordinal -> physical GPU (CUDA_VISIBLE_DEVICES)
  size_t granularity = 2u << 20;
  bool no_proc_address = false;
  bool no_vmm = false;
  int fill = 0xa5;  // what new device memory holds: the real driver does not zero it
  std::vector<Failure> failures;
  std::map<std::string, long> calls_of_kind;
  std::vector<std::string> log;
  std::vector<std::string> violations;
  CUctx_st contexts[kMaxDevices];
  int retains[kMaxDevices] = {};
  CUmemGenericAllocationHandle next_handle = 0x1000;
  uint64_t next_serial = 1;
  uint64_t proc_lookups = 0;
  std::map<CUmemGenericAllocationHandle, Physical> physical;
  std::map<CUdeviceptr, Reservation> reservations;
  std::map<CUdeviceptr, Mapping> mappings;
  std::map<CUdeviceptr, DeviceAlloc> allocs;
  std::map<std::pair<int, uint64_t>, IpcOpen> ipc_opens;  // (pid, serial)
  std::set<CUevent> events;
  // Records not yet finished, per stream, in stream order: (event, its record number).
  std::map<CUstream, std::deque<std::pair<CUevent, uint64_t>>> pending;
  std::set<CUstream> streams;
  std::map<CUstream, std::vector<PendingWork>> work;
  // Streams a test says are being captured into a graph (in global mode), and how it stands.
  std::map<CUstream, CUstreamCaptureStatus> captures;

  void read_env() {
    auto num = [](const char* name, long dflt) {
      const char* v = std::getenv(name);
      return (v && *v) ? std::strtol(v, nullptr, 0) : dflt;
    };
    devices = static_cast<int>(num("BUBBLE_CUDA_DOUBLE_DEVICES", 1));
    if (devices > kMaxDevices) devices = kMaxDevices;
    // As the real driver reads CUDA_VISIBLE_DEVICES: a comma-separated list of physical
    // indices or GPU UUIDs ("GPU-..."), in the order the process numbers them; the list ends
    // at the first entry that names no GPU, or repeats one.
    visible.clear();
    const char* vis = std::getenv("CUDA_VISIBLE_DEVICES");
    if (!vis) {
      for (int i = 0; i < devices; ++i) visible.push_back(i);
    } else {
      std::string list = vis;
      size_t at = 0;
      while (at <= list.size()) {
        size_t end = list.find(',', at);
        if (end == std::string::npos) end = list.size();
        const std::string item = list.substr(at, end - at);
        at = end + 1;
        int gpu = -1;
        for (int i = 0; i < devices; ++i)
          if (item == uuid_string(i)) gpu = i;
        char* e = nullptr;
        const long n = std::strtol(item.c_str(), &e, 10);
        if (gpu < 0 && !item.empty() && *e == 0 && n >= 0 && n < devices) gpu = int(n);
        if (gpu < 0 || std::find(visible.begin(), visible.end(), gpu) != visible.end()) break;
        visible.push_back(gpu);
      }
    }
    granularity = static_cast<size_t>(num("BUBBLE_CUDA_DOUBLE_GRANULARITY", 2l << 20));
    no_proc_address = num("BUBBLE_CUDA_DOUBLE_NO_PROC_ADDRESS", 0) != 0;
    no_vmm = num("BUBBLE_CUDA_DOUBLE_NO_VMM", 0) != 0;
    fill = static_cast<int>(num("BUBBLE_CUDA_DOUBLE_FILL", 0xa5) & 0xff);
    failures.clear();
    calls_of_kind.clear();
    const char* spec = std::getenv("BUBBLE_CUDA_DOUBLE_FAIL");
    std::string s = spec ? spec : "";
    size_t pos = 0;
    while (pos < s.size()) {
      size_t end = s.find(',', pos);
      if (end == std::string::npos) end = s.size();
      std::string item = s.substr(pos, end - pos);
      pos = end + 1;
      if (item.empty()) continue;
      Failure f;
      size_t at = item.find('@');
      f.kind = item.substr(0, at);
      if (at != std::string::npos) f.nth = std::strtol(item.c_str() + at + 1, nullptr, 10);
      failures.push_back(f);
    }
    for (int i = 0; i < kMaxDevices; ++i) contexts[i].device = i;
  }
};

State& st() {
  static State* s = [] {
    auto* n = new State;
    n->read_env();
    return n;
  }();
  return *s;
}

thread_local CUcontext current_ctx = nullptr;

// The GPUs this process sees, and the physical GPU of one of its ordinals (-1: none).
int visible_count() { return static_cast<int>(st().visible.size()); }
int gpu_of(int ordinal) {
  return ordinal >= 0 && ordinal < visible_count() ? st().visible[size_t(ordinal)] : -1;
}
// The legacy default stream, and whether some stream is being captured now.
bool is_legacy(CUstream s) { return s == nullptr || s == CU_STREAM_LEGACY; }
bool any_capture() {
  for (const auto& [s, status] : st().captures)
    if (status == CU_STREAM_CAPTURE_STATUS_ACTIVE) return true;
  return false;
}
// The calling thread's capture mode (cuThreadExchangeStreamCaptureMode); the driver's default.
thread_local CUstreamCaptureMode t_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
// As the driver: while a stream is captured in global mode, a potentially unsafe call from a
// thread not in relaxed mode fails (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) and invalidates the
// capture; the application loses its graph. The double counts as unsafe: cuEventQuery,
// cuStreamSynchronize, allocations and frees (cuMemAlloc, cuMemFree, cuMemCreate,
// cuMemRelease) and a cuMemcpyAsync with an end in host memory (pageable: the double has no
// pinned memory). True when the call must fail.
bool unsafe_during_capture() {
  if (t_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return false;
  bool broke = false;
  for (auto& [stream, status] : st().captures)
    if (status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
      status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
      broke = true;
    }
  return broke;
}

// This process's ordinal of a physical GPU, -1 when it does not see it.
int ordinal_of(int gpu) {
  for (int i = 0; i < visible_count(); ++i)
    if (st().visible[size_t(i)] == gpu) return i;
  return -1;
}

const char* result_name(CUresult rc) {
  switch (rc) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_MAP_FAILED: return "CUDA_ERROR_MAP_FAILED";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_NOT_PERMITTED: return "CUDA_ERROR_NOT_PERMITTED";
    case CUDA_ERROR_ALREADY_MAPPED: return "CUDA_ERROR_ALREADY_MAPPED";
    case CUDA_ERROR_OPERATING_SYSTEM: return "CUDA_ERROR_OPERATING_SYSTEM";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
    case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: return "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT";
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    default: return nullptr;
  }
}

// One call in progress: holds the lock, builds the log line, records the result.
class Call {
 public:
  explicit Call(const char* name) : lock_(st().mu), line_(name) {}
  ~Call() {
    const char* n = result_name(rc_);
    line_ += " -> ";
    line_ += n ? n : std::to_string(rc_);
    st().log.push_back(line_);
  }
  Call& arg(const char* key, unsigned long long v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s=%llu", key, v);
    line_ += buf;
    return *this;
  }
  Call& arg(const char* key, const char* v) {
    line_ += ' ';
    line_ += key;
    line_ += '=';
    line_ += v;
    return *this;
  }
  CUresult ret(CUresult rc) { return rc_ = rc; }
  // A misuse the real driver would reject or libbubble promised not to do.
  CUresult violation(CUresult rc, const char* fmt, ...) {
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    st().violations.push_back(line_ + ": " + buf);
    return rc_ = rc;
  }
  bool inject(const char* kind) {
    State& s = st();
    long n = ++s.calls_of_kind[kind];
    for (const Failure& f : s.failures) {
      if (f.kind == kind && (f.nth == 0 || f.nth == n)) {
        line_ += " [injected]";
        return true;
      }
    }
    return false;
  }
  bool need_init() { return !st().initialized; }
  bool need_ctx() { return current_ctx == nullptr; }
  // The GPU runs work while the host goes on: other threads' calls may come in meanwhile.
  void let_others_in() {
    lock_.unlock();
    std::this_thread::yield();
    lock_.lock();
  }

 private:
  std::unique_lock<std::mutex> lock_;
  std::string line_;
  CUresult rc_ = CUDA_SUCCESS;
};

bool aligned(size_t v) { return v % st().granularity == 0; }

int make_memfd(size_t size, const char* name = "cuda-double") {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return -1;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// New device memory, holding what the last user of those pages left (the fill byte), as the
// real driver's does: only an explicit memset makes it zero.
int make_device_memfd(size_t size, int gpu) {
  // Named for its GPU, so that an importer in another process knows where the memory is.
  const std::string name = "cuda-double-gpu" + std::to_string(gpu);
  int fd = make_memfd(size, name.c_str());
  if (fd < 0) return -1;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return -1;
  }
  std::memset(p, st().fill, size);
  munmap(p, size);
  return fd;
}

// Mapping covering [p, p + size) entirely inside the reservation, or end().
bool inside_reservation(CUdeviceptr p, size_t size) {
  auto& r = st().reservations;
  auto it = r.upper_bound(p);
  if (it == r.begin()) return false;
  --it;
  return p >= it->first && p + size <= it->first + it->second.size;
}

// [p, p + size) is device memory this process may write: inside one cuMemAlloc allocation, or
// covered by VMM mappings made writable with cuMemSetAccess.
bool writable_device_range(CUdeviceptr p, size_t size) {
  for (auto& [b, a] : st().allocs)
    if (p >= b && p + size <= b + a.size) return true;
  auto& m = st().mappings;
  CUdeviceptr pos = p;
  while (pos < p + size) {
    auto it = m.upper_bound(pos);
    if (it == m.begin()) return false;
    --it;
    if (pos >= it->first + it->second.size || !(it->second.flags & PROT_WRITE)) return false;
    pos = it->first + it->second.size;
  }
  return size > 0;
}

// [p, p + size) touches device address space: a cuMemAlloc allocation or a VMM reservation.
bool device_address_space(CUdeviceptr p, size_t size) {
  for (auto& [b, a] : st().allocs)
    if (p < b + a.size && b < p + size) return true;
  for (auto& [b, r] : st().reservations)
    if (p < b + r.size && b < p + size) return true;
  return false;
}

bool overlaps_mapping(CUdeviceptr p, size_t size) {
  for (auto& [b, m] : st().mappings)
    if (p < b + m.size && b < p + size) return true;
  return false;
}

size_t copy_out(const std::string& s, char* buf, size_t cap) {
  if (buf && cap) {
    size_t n = s.size() < cap - 1 ? s.size() : cap - 1;
    std::memcpy(buf, s.data(), n);
    buf[n] = 0;
  }
  return s.size();
}

}  // namespace

extern "C" {

// ---- control ----------------------------------------------------------------------------------

__attribute__((visibility("default"))) void bbdouble_reset(void) {
  std::lock_guard<std::mutex> lock(st().mu);
  st().read_env();
  st().log.clear();
  st().violations.clear();
  st().proc_lookups = 0;
}

__attribute__((visibility("default"))) void bbdouble_outstanding(bbdouble_counts* out) {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  *out = bbdouble_counts{};
  out->physical = s.physical.size();
  out->mappings = s.mappings.size();
  out->reservations = s.reservations.size();
  out->device_allocs = s.allocs.size();
  for (auto& [k, o] : s.ipc_opens) out->ipc_opens += o.refs;
  for (int i = 0; i < kMaxDevices; ++i) out->ctx_retains += s.retains[i];
  out->proc_lookups = s.proc_lookups;
  out->violations = s.violations.size();
  out->streams = s.streams.size();
  for (CUevent e : s.events) (e->imported ? out->ipc_event_opens : out->events) += 1;
}

__attribute__((visibility("default"))) int bbdouble_stream_progress(void* stream, int n) {
  std::lock_guard<std::mutex> lock(st().mu);
  auto it = st().pending.find(static_cast<CUstream>(stream));
  if (it == st().pending.end()) return 0;
  int done = 0;
  while (!it->second.empty() && (n < 0 || done < n)) {
    auto [ev, gen] = it->second.front();
    it->second.pop_front();
    uint64_t cur = ev->sh->done.load();
    if (gen > cur) ev->sh->done.store(gen);
    ++done;
  }
  return done;
}

__attribute__((visibility("default"))) void bbdouble_stream_capture(void* stream, int capturing) {
  std::lock_guard<std::mutex> lock(st().mu);
  if (capturing)
    st().captures[static_cast<CUstream>(stream)] = CU_STREAM_CAPTURE_STATUS_ACTIVE;
  else
    st().captures.erase(static_cast<CUstream>(stream));
}

__attribute__((visibility("default"))) int bbdouble_stream_capture_status(void* stream) {
  std::lock_guard<std::mutex> lock(st().mu);
  auto it = st().captures.find(static_cast<CUstream>(stream));
  return it == st().captures.end() ? int(CU_STREAM_CAPTURE_STATUS_NONE) : int(it->second);
}

__attribute__((visibility("default"))) int bbdouble_stream_pending(void* stream) {
  std::lock_guard<std::mutex> lock(st().mu);
  auto it = st().pending.find(static_cast<CUstream>(stream));
  return it == st().pending.end() ? 0 : int(it->second.size());
}

__attribute__((visibility("default"))) size_t bbdouble_log(char* buf, size_t cap) {
  std::lock_guard<std::mutex> lock(st().mu);
  std::string all;
  for (auto& l : st().log) all += l + "\n";
  return copy_out(all, buf, cap);
}

__attribute__((visibility("default"))) size_t bbdouble_violations(char* buf, size_t cap) {
  std::lock_guard<std::mutex> lock(st().mu);
  std::string all;
  for (auto& l : st().violations) all += l + "\n";
  return copy_out(all, buf, cap);
}

// ---- initialisation, devices, contexts, errors ------------------------------------------------

CUresult CUDAAPI cuInit(unsigned int flags) {
  Call c("cuInit");
  c.arg("flags", flags);
  if (flags != 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (visible_count() <= 0) return c.ret(CUDA_ERROR_NO_DEVICE);
  st().initialized = true;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDriverGetVersion(int* v) {
  Call c("cuDriverGetVersion");
  if (!v) return c.violation(CUDA_ERROR_INVALID_VALUE, "null pointer");
  *v = kDriverVersion;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuGetErrorName(CUresult rc, const char** out) {
  const char* n = result_name(rc);
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = n;
  return n ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorString(CUresult rc, const char** out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  switch (rc) {
    case CUDA_SUCCESS: *out = "no error"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *out = "out of memory"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "invalid argument"; break;
    case CUDA_ERROR_NO_DEVICE: *out = "no CUDA-capable device is detected"; break;
    case CUDA_ERROR_MAP_FAILED: *out = "mapping of buffer object failed"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *out = "operation not supported"; break;
    case CUDA_ERROR_INVALID_HANDLE: *out = "invalid resource handle"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *out = "unspecified launch failure"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *out = "an illegal memory access was encountered"; break;
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
      *out = "operation would make the legacy stream depend on a capturing blocking stream";
      break;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
      *out = "operation not permitted when stream is capturing";
      break;
    default: *out = "unknown error"; break;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int* n) {
  Call c("cuDeviceGetCount");
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  *n = visible_count();
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDeviceGet(CUdevice* dev, int ordinal) {
  Call c("cuDeviceGet");
  c.arg("ordinal", ordinal);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (ordinal < 0 || ordinal >= visible_count()) return c.ret(CUDA_ERROR_INVALID_DEVICE);
  *dev = ordinal;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDeviceGetAttribute(int* v, CUdevice_attribute attr, CUdevice dev) {
  Call c("cuDeviceGetAttribute");
  c.arg("attr", attr).arg("dev", dev);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (dev < 0 || dev >= visible_count()) return c.ret(CUDA_ERROR_INVALID_DEVICE);
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
      *v = st().no_vmm ? 0 : 1;
      break;
    default: *v = 0; break;
  }
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  Call c("cuDeviceGetUuid");
  c.arg("dev", dev);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (!uuid) return c.violation(CUDA_ERROR_INVALID_VALUE, "null pointer");
  if (dev < 0 || dev >= visible_count()) return c.ret(CUDA_ERROR_INVALID_DEVICE);
  *uuid = uuid_of(gpu_of(dev));
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  Call c("cuDevicePrimaryCtxRetain");
  c.arg("dev", dev);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (dev < 0 || dev >= visible_count()) return c.ret(CUDA_ERROR_INVALID_DEVICE);
  ++st().retains[dev];
  *ctx = &st().contexts[dev];
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
  Call c("cuDevicePrimaryCtxRelease");
  c.arg("dev", dev);
  if (dev < 0 || dev >= visible_count()) return c.ret(CUDA_ERROR_INVALID_DEVICE);
  if (st().retains[dev] == 0)
    return c.violation(CUDA_ERROR_INVALID_CONTEXT, "released a primary context not retained");
  if (--st().retains[dev] == 0 && current_ctx == &st().contexts[dev]) current_ctx = nullptr;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext* ctx) {
  Call c("cuCtxGetCurrent");
  *ctx = current_ctx;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice* dev) {
  Call c("cuCtxGetDevice");
  if (!dev) return c.violation(CUDA_ERROR_INVALID_VALUE, "null pointer");
  if (!current_ctx) return c.ret(CUDA_ERROR_INVALID_CONTEXT);
  *dev = current_ctx->device;
  c.arg("dev", *dev);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
  Call c("cuCtxSetCurrent");
  c.arg("dev", ctx ? ctx->device : -1);
  if (ctx && (ctx < &st().contexts[0] || ctx >= &st().contexts[kMaxDevices] ||
              st().retains[ctx->device] == 0))
    return c.violation(CUDA_ERROR_INVALID_CONTEXT, "not a retained primary context");
  current_ctx = ctx;
  return c.ret(CUDA_SUCCESS);
}

// ---- cuMemAlloc and legacy IPC ----------------------------------------------------------------

CUresult CUDAAPI cuMemAlloc(CUdeviceptr* dptr, size_t size) {
  Call c("cuMemAlloc");
  c.arg("size", size);
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (size == 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "size 0");
  if (unsafe_during_capture()) return c.ret(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  if (c.inject("oom")) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  const int gpu = gpu_of(current_ctx->device);
  int fd = make_device_memfd(size, gpu);
  if (fd < 0) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  }
  *dptr = reinterpret_cast<CUdeviceptr>(p);
  st().allocs[*dptr] = DeviceAlloc{size, fd, st().next_serial++, gpu};
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
  Call c("cuMemFree");
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  auto it = st().allocs.find(dptr);
  if (it == st().allocs.end())
    return c.violation(CUDA_ERROR_INVALID_VALUE, "not the base of a cuMemAlloc allocation");
  if (unsafe_during_capture()) return c.ret(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  munmap(reinterpret_cast<void*>(dptr), it->second.size);
  close(it->second.memfd);
  st().allocs.erase(it);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr dptr) {
  Call c("cuMemGetAddressRange");
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  for (auto& [b, a] : st().allocs) {
    if (dptr >= b && dptr < b + a.size) {
      if (base) *base = b;
      if (size) *size = a.size;
      return c.ret(CUDA_SUCCESS);
    }
  }
  for (auto& [k, o] : st().ipc_opens) {
    if (dptr >= o.ptr && dptr < o.ptr + o.size) {
      if (base) *base = o.ptr;
      if (size) *size = o.size;
      return c.ret(CUDA_SUCCESS);
    }
  }
  return c.ret(CUDA_ERROR_NOT_FOUND);
}

CUresult CUDAAPI cuPointerGetAttribute(void* data, CUpointer_attribute attr, CUdeviceptr dptr) {
  Call c("cuPointerGetAttribute");
  c.arg("attr", attr);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (!data) return c.violation(CUDA_ERROR_INVALID_VALUE, "null pointer");
  if (attr != CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) return c.ret(CUDA_ERROR_INVALID_VALUE);
  int gpu = -1;
  for (auto& [b, a] : st().allocs)
    if (dptr >= b && dptr < b + a.size) gpu = a.gpu;
  for (auto& [k, o] : st().ipc_opens)
    if (dptr >= o.ptr && dptr < o.ptr + o.size) gpu = o.gpu;
  for (auto& [b, m] : st().mappings) {
    const auto p = st().physical.find(m.handle);
    if (dptr >= b && dptr < b + m.size && p != st().physical.end()) gpu = p->second.gpu;
  }
  if (gpu < 0) return c.ret(CUDA_ERROR_INVALID_VALUE);  // not device memory the driver knows
  *static_cast<int*>(data) = ordinal_of(gpu);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr dptr) {
  Call c("cuIpcGetMemHandle");
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  auto it = st().allocs.find(dptr);
  if (it == st().allocs.end())
    return c.violation(CUDA_ERROR_INVALID_VALUE, "not the base of a cuMemAlloc allocation");
  if (c.inject("export")) return c.ret(CUDA_ERROR_NOT_SUPPORTED);
  IpcWire w{};
  std::memcpy(w.magic, kIpcMagic, sizeof w.magic);
  w.pid = getpid();
  w.fd = it->second.memfd;
  w.size = it->second.size;
  w.serial = it->second.serial;
  w.gpu = it->second.gpu;
  std::memset(handle, 0, sizeof *handle);
  std::memcpy(handle, &w, sizeof w);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr* dptr, CUipcMemHandle handle, unsigned int flags) {
  Call c("cuIpcOpenMemHandle");
  c.arg("flags", flags);
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    return c.violation(CUDA_ERROR_INVALID_VALUE, "flags must be CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS");
  IpcWire w;
  std::memcpy(&w, &handle, sizeof w);
  if (std::memcmp(w.magic, kIpcMagic, sizeof w.magic) != 0) return c.ret(CUDA_ERROR_INVALID_VALUE);
  // The real driver refuses to open a handle in the process that exported it.
  if (w.pid == getpid()) return c.ret(CUDA_ERROR_INVALID_CONTEXT);
  if (c.inject("import")) return c.ret(CUDA_ERROR_INVALID_HANDLE);
  // The real driver maps memory of a GPU this process cannot see nowhere, and memory of
  // another GPU it sees through peer access: work meant for the context's GPU would run on
  // one GPU against another's memory.
  if (ordinal_of(w.gpu) < 0) return c.ret(CUDA_ERROR_INVALID_DEVICE);
  if (gpu_of(current_ctx->device) != w.gpu)
    c.violation(CUDA_SUCCESS, "opened in the context of GPU %d memory of GPU %d (peer access)",
                gpu_of(current_ctx->device), w.gpu);
  auto key = std::make_pair(static_cast<int>(w.pid), w.serial);
  auto it = st().ipc_opens.find(key);
  if (it != st().ipc_opens.end()) {
    ++it->second.refs;
    *dptr = it->second.ptr;
    return c.ret(CUDA_SUCCESS);
  }
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/fd/%d", w.pid, w.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return c.ret(CUDA_ERROR_INVALID_HANDLE);
  struct stat sb;
  if (fstat(fd, &sb) != 0 || static_cast<uint64_t>(sb.st_size) != w.size) {
    close(fd);
    return c.ret(CUDA_ERROR_INVALID_HANDLE);
  }
  void* p = mmap(nullptr, w.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  IpcOpen o;
  o.ptr = reinterpret_cast<CUdeviceptr>(p);
  o.size = w.size;
  o.refs = 1;
  o.gpu = w.gpu;
  st().ipc_opens[key] = o;
  *dptr = o.ptr;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr) {
  Call c("cuIpcCloseMemHandle");
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  for (auto it = st().ipc_opens.begin(); it != st().ipc_opens.end(); ++it) {
    if (it->second.ptr != dptr) continue;
    if (--it->second.refs == 0) {
      munmap(reinterpret_cast<void*>(dptr), it->second.size);
      st().ipc_opens.erase(it);
    }
    return c.ret(CUDA_SUCCESS);
  }
  return c.violation(CUDA_ERROR_INVALID_VALUE, "not a pointer from cuIpcOpenMemHandle");
}

// ---- virtual memory management ----------------------------------------------------------------

CUresult CUDAAPI cuMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp* prop,
                                                CUmemAllocationGranularity_flags option) {
  Call c("cuMemGetAllocationGranularity");
  c.arg("option", option);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 ||
      prop->location.id >= visible_count())
    return c.violation(CUDA_ERROR_INVALID_VALUE, "prop must be pinned memory on a valid device");
  *g = st().granularity;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                             const CUmemAllocationProp* prop, unsigned long long flags) {
  Call c("cuMemCreate");
  c.arg("size", size).arg("types", prop ? prop->requestedHandleTypes : 0);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (st().no_vmm) return c.ret(CUDA_ERROR_NOT_SUPPORTED);
  if (flags != 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 ||
      prop->location.id >= visible_count() || prop->win32HandleMetaData)
    return c.violation(CUDA_ERROR_INVALID_VALUE, "prop must be pinned memory on a valid device");
  if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE &&
      prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return c.violation(CUDA_ERROR_NOT_SUPPORTED, "only POSIX descriptor handles exist on Linux");
  if (size == 0 || !aligned(size))
    return c.violation(CUDA_ERROR_INVALID_VALUE, "size %zu is not a multiple of granularity %zu",
                       size, st().granularity);
  if (unsafe_during_capture()) return c.ret(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  if (c.inject("oom")) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  const int gpu = gpu_of(prop->location.id);
  int fd = make_device_memfd(size, gpu);
  if (fd < 0) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  *handle = st().next_handle++;
  st().physical[*handle] = Physical{fd, size, prop->requestedHandleTypes, 0, false, gpu};
  c.arg("handle", *handle);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
  Call c("cuMemRelease");
  c.arg("handle", handle);
  auto it = st().physical.find(handle);
  if (it == st().physical.end()) return c.violation(CUDA_ERROR_INVALID_VALUE, "unknown handle");
  if (unsafe_during_capture()) return c.ret(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  // Legal for the real driver (memory lives on until unmapped), but libbubble always unmaps
  // first so that releasing is the moment the memory goes back.
  if (it->second.maps > 0) c.violation(CUDA_SUCCESS, "released while still mapped");
  close(it->second.memfd);
  st().physical.erase(it);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemExportToShareableHandle(void* shareable, CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType type,
                                              unsigned long long flags) {
  Call c("cuMemExportToShareableHandle");
  c.arg("handle", handle).arg("type", type);
  auto it = st().physical.find(handle);
  if (it == st().physical.end()) return c.violation(CUDA_ERROR_INVALID_VALUE, "unknown handle");
  if (flags != 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !(it->second.types & type))
    return c.violation(CUDA_ERROR_INVALID_VALUE,
                       "handle type %d was not requested at cuMemCreate (requested %d)", type,
                       it->second.types);
  if (it->second.imported) return c.violation(CUDA_ERROR_INVALID_VALUE, "re-export of an import");
  if (c.inject("export")) return c.ret(CUDA_ERROR_NOT_SUPPORTED);
  // Like the real driver, the descriptor is not close-on-exec: the caller must see to it.
  int fd = dup(it->second.memfd);
  if (fd < 0) return c.ret(CUDA_ERROR_OPERATING_SYSTEM);
  *static_cast<int*>(shareable) = fd;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* handle, void* os,
                                                CUmemAllocationHandleType type) {
  Call c("cuMemImportFromShareableHandle");
  c.arg("type", type);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return c.violation(CUDA_ERROR_INVALID_VALUE, "handle type must be POSIX descriptor");
  int fd = static_cast<int>(reinterpret_cast<intptr_t>(os));
  struct stat sb;
  if (fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size <= 0)
    return c.ret(CUDA_ERROR_INVALID_VALUE);
  char path[64], target[128] = {};
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  if (readlink(path, target, sizeof target - 1) <= 0 ||
      std::strncmp(target, "/memfd:cuda-double", 18) != 0)
    return c.ret(CUDA_ERROR_INVALID_VALUE);  // not a descriptor this driver exported
  if (c.inject("import")) return c.ret(CUDA_ERROR_INVALID_HANDLE);
  // The exporter's GPU, from the name its memfd was given ("cuda-double-gpuN").
  const char* g = std::strstr(target, "-gpu");
  const int gpu = g ? std::atoi(g + 4) : 0;
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);  // the caller keeps its descriptor
  if (own < 0) return c.ret(CUDA_ERROR_OPERATING_SYSTEM);
  *handle = st().next_handle++;
  st().physical[*handle] = Physical{own, static_cast<size_t>(sb.st_size),
                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0, true, gpu};
  c.arg("handle", *handle);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment,
                                     CUdeviceptr addr, unsigned long long flags) {
  Call c("cuMemAddressReserve");
  c.arg("size", size).arg("alignment", alignment);
  if (c.need_init()) return c.violation(CUDA_ERROR_NOT_INITIALIZED, "before cuInit");
  if (size == 0 || !aligned(size) || flags != 0 || addr != 0 ||
      (alignment && (alignment & (alignment - 1))))
    return c.violation(CUDA_ERROR_INVALID_VALUE, "size %zu / alignment %zu not granular", size,
                       alignment);
  if (c.inject("reserve")) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  size_t align = alignment ? alignment : st().granularity;
  size_t span = size + align;
  void* raw = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  uintptr_t r = reinterpret_cast<uintptr_t>(raw);
  uintptr_t a = (r + align - 1) & ~(uintptr_t{align} - 1);
  if (a > r) munmap(raw, a - r);
  if (a + size < r + span) munmap(reinterpret_cast<void*>(a + size), r + span - (a + size));
  *ptr = a;
  st().reservations[a] = Reservation{size};
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  Call c("cuMemAddressFree");
  c.arg("size", size);
  auto it = st().reservations.find(ptr);
  if (it == st().reservations.end() || it->second.size != size)
    return c.violation(CUDA_ERROR_INVALID_VALUE, "not a reservation made with this size");
  if (overlaps_mapping(ptr, size))
    return c.violation(CUDA_ERROR_INVALID_VALUE, "freed address range still has mappings");
  munmap(reinterpret_cast<void*>(ptr), size);
  st().reservations.erase(it);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                          CUmemGenericAllocationHandle handle, unsigned long long flags) {
  Call c("cuMemMap");
  c.arg("size", size).arg("offset", offset).arg("handle", handle);
  auto it = st().physical.find(handle);
  if (it == st().physical.end()) return c.violation(CUDA_ERROR_INVALID_VALUE, "unknown handle");
  if (offset != 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "offset must be 0");
  if (flags != 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "flags must be 0");
  if (!aligned(ptr) || !aligned(size) || size == 0 || size > it->second.size)
    return c.violation(CUDA_ERROR_INVALID_VALUE, "ptr/size not granular or larger than handle");
  if (!inside_reservation(ptr, size))
    return c.violation(CUDA_ERROR_INVALID_VALUE, "range not inside a reservation");
  if (overlaps_mapping(ptr, size))
    return c.violation(CUDA_ERROR_ALREADY_MAPPED, "range already mapped");
  if (c.inject("map")) return c.ret(CUDA_ERROR_MAP_FAILED);
  if (mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED,
           it->second.memfd, 0) == MAP_FAILED)
    return c.ret(CUDA_ERROR_MAP_FAILED);
  ++it->second.maps;
  st().mappings[ptr] = Mapping{size, handle, 0};
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
  Call c("cuMemUnmap");
  c.arg("size", size);
  if (c.inject("unmap")) return c.ret(CUDA_ERROR_INVALID_VALUE);
  auto it = st().mappings.find(ptr);
  if (it == st().mappings.end() || it->second.size != size)
    return c.violation(CUDA_ERROR_INVALID_VALUE, "not exactly one mapping");
  mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  auto p = st().physical.find(it->second.handle);
  if (p != st().physical.end()) --p->second.maps;
  st().mappings.erase(it);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                                size_t count) {
  Call c("cuMemSetAccess");
  c.arg("size", size).arg("count", count);
  if (!desc || count == 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "no access descriptor");
  int prot = PROT_NONE;
  for (size_t i = 0; i < count; ++i) {
    c.arg("dev", desc[i].location.id).arg("flags", desc[i].flags);
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id < 0 ||
        desc[i].location.id >= visible_count())
      return c.violation(CUDA_ERROR_INVALID_DEVICE, "access location is not a valid device");
    if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE) prot = PROT_READ | PROT_WRITE;
    else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ) prot |= PROT_READ;
    else if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE)
      return c.violation(CUDA_ERROR_INVALID_VALUE, "unknown access flags %d", desc[i].flags);
  }
  // The whole range must be covered by mappings, exactly as the driver requires.
  CUdeviceptr pos = ptr;
  while (pos < ptr + size) {
    auto it = st().mappings.find(pos);
    if (it == st().mappings.end())
      return c.violation(CUDA_ERROR_INVALID_VALUE, "range is not fully mapped");
    pos += it->second.size;
  }
  if (pos != ptr + size) return c.violation(CUDA_ERROR_INVALID_VALUE, "range ends mid-mapping");
  // Access from another GPU than the memory's is peer access: legal where the GPUs allow it,
  // but libbubble means to map memory for work on the GPU it is on.
  for (pos = ptr; pos < ptr + size; pos += st().mappings[pos].size) {
    const auto p = st().physical.find(st().mappings[pos].handle);
    for (size_t i = 0; p != st().physical.end() && i < count; ++i)
      if (gpu_of(desc[i].location.id) != p->second.gpu)
        c.violation(CUDA_SUCCESS, "access for GPU %d to memory of GPU %d (peer access)",
                    gpu_of(desc[i].location.id), p->second.gpu);
  }
  if (c.inject("access")) return c.ret(CUDA_ERROR_NOT_PERMITTED);
  mprotect(reinterpret_cast<void*>(ptr), size, prot);
  for (pos = ptr; pos < ptr + size; pos += st().mappings[pos].size)
    st().mappings[pos].flags = prot;
  return c.ret(CUDA_SUCCESS);
}

}  // extern "C"

// ---- events and stream order ------------------------------------------------------------------

namespace {

bool valid_event(CUevent e) { return e && st().events.count(e) && e->magic == kEventMagic; }

CUevent new_event(int memfd, unsigned flags, bool imported, uint64_t serial) {
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (p == MAP_FAILED) return nullptr;
  auto* e = new CUevent_st{kEventMagic, flags,    memfd,      static_cast<EventShared*>(p),
                           imported,    serial,   current_ctx};
  st().events.insert(e);
  return e;
}

}  // namespace

extern "C" {

CUresult CUDAAPI cuEventCreate(CUevent* out, unsigned int flags) {
  Call c("cuEventCreate");
  c.arg("flags", flags);
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (!out) return c.violation(CUDA_ERROR_INVALID_VALUE, "null pointer");
  if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
    return c.violation(CUDA_ERROR_INVALID_VALUE, "CU_EVENT_INTERPROCESS needs CU_EVENT_DISABLE_TIMING");
  if (c.inject("event")) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  const int fd = make_memfd(4096);
  if (fd < 0) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  *out = new_event(fd, flags, false, st().next_serial++);
  if (!*out) {
    close(fd);
    return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  }
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuEventRecord(CUevent e, CUstream stream) {
  Call c("cuEventRecord");
  c.arg("stream", reinterpret_cast<uintptr_t>(stream));
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (!valid_event(e)) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live event");
  // The driver records an event only on a stream of the event's context. The double's streams
  // are the caller's pointers, taken to be of the context current on the recording thread.
  if (e->ctx != current_ctx)
    return c.violation(CUDA_ERROR_INVALID_HANDLE, "an event of another context than the stream's");
  // Work on the legacy stream synchronises with every blocking stream: while one is captured,
  // the driver refuses it and invalidates that capture.
  if (is_legacy(stream) && any_capture()) {
    for (auto& [s, status] : st().captures) status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    return c.violation(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                       "recorded on the legacy stream during a capture (which it invalidated)");
  }
  const uint64_t gen = e->sh->recorded.fetch_add(1) + 1;
  st().pending[stream].emplace_back(e, gen);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  Call c("cuStreamIsCapturing");
  c.arg("stream", reinterpret_cast<uintptr_t>(stream));
  if (!status) return c.violation(CUDA_ERROR_INVALID_VALUE, "status is NULL");
  // As the driver documents: the legacy stream asked about while a blocking stream is being
  // captured gives this error, and the status is unspecified.
  if (is_legacy(stream) && any_capture()) {
    *status = CU_STREAM_CAPTURE_STATUS_ACTIVE;  // unspecified: a caller must not read it
    return c.ret(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
  }
  auto it = st().captures.find(stream);
  *status = it == st().captures.end() ? CU_STREAM_CAPTURE_STATUS_NONE : it->second;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  Call c("cuThreadExchangeStreamCaptureMode");
  if (!mode) return c.violation(CUDA_ERROR_INVALID_VALUE, "mode is NULL");
  c.arg("mode", uint64_t(*mode));
  std::swap(*mode, t_capture_mode);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuEventQuery(CUevent e) {
  Call c("cuEventQuery");
  if (!valid_event(e)) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live event");
  if (unsafe_during_capture()) return c.ret(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  return c.ret(e->sh->done.load() >= e->sh->recorded.load() ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY);
}

CUresult CUDAAPI cuEventDestroy(CUevent e) {
  Call c("cuEventDestroy");
  if (!valid_event(e)) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live event");
  for (auto& [stream, q] : st().pending)
    for (auto it = q.begin(); it != q.end();) it = it->first == e ? q.erase(it) : it + 1;
  munmap(e->sh, 4096);
  close(e->memfd);
  st().events.erase(e);
  e->magic = 0;
  delete e;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuStreamWaitEvent(CUstream stream, CUevent e, unsigned int flags) {
  Call c("cuStreamWaitEvent");
  c.arg("stream", reinterpret_cast<uintptr_t>(stream)).arg("flags", flags);
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (!valid_event(e)) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live event");
  if (flags != 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "flags must be CU_EVENT_WAIT_DEFAULT");
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuIpcGetEventHandle(CUipcEventHandle* handle, CUevent e) {
  Call c("cuIpcGetEventHandle");
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (!valid_event(e) || !handle) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live event");
  if (!(e->flags & CU_EVENT_INTERPROCESS) || !(e->flags & CU_EVENT_DISABLE_TIMING))
    return c.violation(CUDA_ERROR_INVALID_VALUE,
                       "event not created with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING");
  if (c.inject("export")) return c.ret(CUDA_ERROR_NOT_SUPPORTED);
  IpcWire w{};
  std::memcpy(w.magic, kIpcEventMagic, sizeof w.magic);
  w.pid = getpid();
  w.fd = e->memfd;
  w.size = 4096;
  w.serial = e->serial;
  std::memset(handle, 0, sizeof *handle);
  std::memcpy(handle, &w, sizeof w);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuIpcOpenEventHandle(CUevent* out, CUipcEventHandle handle) {
  Call c("cuIpcOpenEventHandle");
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  IpcWire w;
  std::memcpy(&w, &handle, sizeof w);
  if (std::memcmp(w.magic, kIpcEventMagic, sizeof w.magic) != 0) return c.ret(CUDA_ERROR_INVALID_VALUE);
  if (c.inject("import")) return c.ret(CUDA_ERROR_INVALID_HANDLE);
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/fd/%d", w.pid, w.fd);
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return c.ret(CUDA_ERROR_INVALID_HANDLE);
  *out = new_event(fd, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING, true, w.serial);
  if (!*out) {
    close(fd);
    return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  }
  return c.ret(CUDA_SUCCESS);
}

}  // extern "C"

// ---- streams, memsets, copies -----------------------------------------------------------------

namespace {

bool valid_stream(CUstream s) {
  return s == nullptr || (st().streams.count(s) && s->magic == kStreamMagic);
}

// The "GPU" reaches the end of a stream: its memsets and copies land (in order) and its events
// complete.
void run_stream(Call& c, CUstream s) {
  auto m = st().work.find(s);
  if (m != st().work.end()) {
    std::vector<PendingWork> todo;
    todo.swap(m->second);
    st().work.erase(m);
    for (const PendingWork& p : todo) {
      if (!p.copy) {
        // Device memory may have gone between the call and the "GPU" reaching it: a real GPU
        // faults there, which is recorded, never done.
        if (!writable_device_range(p.ptr, p.size)) {
          c.violation(CUDA_SUCCESS, "a memset ran on memory freed or unmapped before it ran");
          continue;
        }
        std::memset(reinterpret_cast<void*>(p.ptr), p.value, p.size);
        continue;
      }
      // A copy runs a piece at a time, with the other threads' calls (an unmap, say) in
      // between, as on a GPU; every piece must find its device memory still mapped.
      constexpr size_t kPiece = 64 * 1024;
      for (size_t at = 0; at < p.size; at += kPiece) {
        const size_t n = std::min(kPiece, p.size - at);
        if ((p.ptr_device && !writable_device_range(p.ptr + at, n)) ||
            (p.src_device && !writable_device_range(p.src + at, n))) {
          c.violation(CUDA_SUCCESS, "a copy met device memory freed or unmapped before or "
                      "while it ran");
          break;
        }
        std::memmove(reinterpret_cast<void*>(p.ptr + at), reinterpret_cast<const void*>(p.src + at),
                     n);
        c.let_others_in();
      }
    }
  }
  auto e = st().pending.find(s);
  if (e != st().pending.end()) {
    for (auto& [ev, gen] : e->second)
      if (gen > ev->sh->done.load()) ev->sh->done.store(gen);
    e->second.clear();
  }
}

}  // namespace

extern "C" {

CUresult CUDAAPI cuStreamCreate(CUstream* out, unsigned int flags) {
  Call c("cuStreamCreate");
  c.arg("flags", flags);
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (!out) return c.violation(CUDA_ERROR_INVALID_VALUE, "null pointer");
  if (flags & ~unsigned{CU_STREAM_NON_BLOCKING})
    return c.violation(CUDA_ERROR_INVALID_VALUE, "unknown stream flags %u", flags);
  if (c.inject("stream")) return c.ret(CUDA_ERROR_OUT_OF_MEMORY);
  *out = new CUstream_st{kStreamMagic, flags};
  st().streams.insert(*out);
  c.arg("stream", reinterpret_cast<uintptr_t>(*out));
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuStreamDestroy(CUstream s) {
  Call c("cuStreamDestroy");
  c.arg("stream", reinterpret_cast<uintptr_t>(s));
  if (!s || !valid_stream(s)) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live stream");
  // Like the real driver, work still queued runs before the stream goes away.
  run_stream(c, s);
  st().pending.erase(s);
  st().streams.erase(s);
  s->magic = 0;
  delete s;
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr ptr, unsigned char value, size_t n, CUstream s) {
  Call c("cuMemsetD8Async");
  c.arg("ptr", ptr).arg("size", n).arg("value", value).arg("stream", reinterpret_cast<uintptr_t>(s));
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (!valid_stream(s)) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live stream");
  if (!writable_device_range(ptr, n))
    return c.violation(CUDA_ERROR_INVALID_VALUE,
                       "range is not writable device memory of this process");
  if (c.inject("memset")) return c.ret(CUDA_ERROR_LAUNCH_FAILED);
  st().work[s].push_back(PendingWork{ptr, n, value});
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  Call c("cuMemcpyAsync");
  c.arg("dst", dst).arg("src", src).arg("size", n).arg("stream", reinterpret_cast<uintptr_t>(s));
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (!valid_stream(s)) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live stream");
  if (!dst || !src || n == 0) return c.violation(CUDA_ERROR_INVALID_VALUE, "null pointer or size");
  // Unified addressing: an address in device address space must be mapped device memory of
  // this process; any other is host memory.
  PendingWork w{dst, n, 0, src, true};
  for (auto [p, device] : {std::pair<CUdeviceptr, bool*>{dst, &w.ptr_device},
                           std::pair<CUdeviceptr, bool*>{src, &w.src_device}}) {
    *device = device_address_space(p, n);
    if (*device && !writable_device_range(p, n))
      return c.violation(CUDA_ERROR_INVALID_VALUE,
                         "range is in device address space but not mapped device memory of this "
                         "process");
  }
  if ((!w.ptr_device || !w.src_device) && unsafe_during_capture())
    return c.ret(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  if (c.inject("memcpy")) return c.ret(CUDA_ERROR_LAUNCH_FAILED);
  st().work[s].push_back(w);
  return c.ret(CUDA_SUCCESS);
}

CUresult CUDAAPI cuStreamSynchronize(CUstream s) {
  Call c("cuStreamSynchronize");
  c.arg("stream", reinterpret_cast<uintptr_t>(s));
  if (c.need_ctx()) return c.violation(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (!valid_stream(s)) return c.violation(CUDA_ERROR_INVALID_HANDLE, "not a live stream");
  if (unsafe_during_capture()) return c.ret(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  if (c.inject("sync")) {
    // The work faulted: none of it is done.
    st().work.erase(s);
    return c.ret(CUDA_ERROR_ILLEGAL_ADDRESS);
  }
  run_stream(c, s);
  return c.ret(CUDA_SUCCESS);
}

}  // extern "C"

extern "C" {

// ---- entry point lookup -----------------------------------------------------------------------

CUresult CUDAAPI cuGetProcAddress(const char* symbol, void** pfn, int version, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult* status) {
  struct Entry {
    const char* name;
    void* fn;
  };
#define BBD_ENTRY_(fn) {#fn, reinterpret_cast<void*>(&fn)}
  static const Entry table[] = {
      BBD_ENTRY_(cuInit), BBD_ENTRY_(cuDriverGetVersion), BBD_ENTRY_(cuGetErrorName),
      BBD_ENTRY_(cuGetErrorString), BBD_ENTRY_(cuDeviceGetCount), BBD_ENTRY_(cuDeviceGet),
      BBD_ENTRY_(cuDeviceGetAttribute), BBD_ENTRY_(cuDeviceGetUuid),
      BBD_ENTRY_(cuPointerGetAttribute), BBD_ENTRY_(cuDevicePrimaryCtxRetain),
      BBD_ENTRY_(cuDevicePrimaryCtxRelease), BBD_ENTRY_(cuCtxGetCurrent),
      BBD_ENTRY_(cuCtxSetCurrent), BBD_ENTRY_(cuCtxGetDevice), BBD_ENTRY_(cuMemAlloc), BBD_ENTRY_(cuMemFree),
      BBD_ENTRY_(cuMemGetAddressRange), BBD_ENTRY_(cuIpcGetMemHandle),
      BBD_ENTRY_(cuIpcOpenMemHandle), BBD_ENTRY_(cuIpcCloseMemHandle),
      BBD_ENTRY_(cuMemGetAllocationGranularity), BBD_ENTRY_(cuMemCreate),
      BBD_ENTRY_(cuMemRelease), BBD_ENTRY_(cuMemExportToShareableHandle),
      BBD_ENTRY_(cuMemImportFromShareableHandle), BBD_ENTRY_(cuMemAddressReserve),
      BBD_ENTRY_(cuMemAddressFree), BBD_ENTRY_(cuMemMap), BBD_ENTRY_(cuMemUnmap),
      BBD_ENTRY_(cuMemSetAccess), BBD_ENTRY_(cuEventCreate), BBD_ENTRY_(cuEventRecord),
      BBD_ENTRY_(cuEventQuery), BBD_ENTRY_(cuEventDestroy), BBD_ENTRY_(cuStreamWaitEvent),
      BBD_ENTRY_(cuStreamIsCapturing), BBD_ENTRY_(cuThreadExchangeStreamCaptureMode),
      BBD_ENTRY_(cuIpcGetEventHandle), BBD_ENTRY_(cuIpcOpenEventHandle),
      BBD_ENTRY_(cuStreamCreate), BBD_ENTRY_(cuStreamDestroy), BBD_ENTRY_(cuMemsetD8Async),
      BBD_ENTRY_(cuMemcpyAsync), BBD_ENTRY_(cuStreamSynchronize),
  };
#undef BBD_ENTRY_
  if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
  *pfn = nullptr;
  if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  std::lock_guard<std::mutex> lock(st().mu);
  if (version > kDriverVersion || (flags & ~cuuint64_t{3})) return CUDA_ERROR_INVALID_VALUE;
  if (st().no_proc_address) return CUDA_SUCCESS;
  for (const Entry& e : table) {
    // #fn spells the base name; the macros of cuda.h made the definitions the versioned ones.
    if (std::strcmp(e.name, symbol) == 0) {
      *pfn = e.fn;
      if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
      ++st().proc_lookups;
      return CUDA_SUCCESS;
    }
  }
  return CUDA_SUCCESS;
}

}  // extern "C"
