// Another process looking at a trainer's bubble mark: opens the event by its CUDA IPC handle
// and reports when the GPU reached it. Driver calls only (through $BUBBLE_CUDA_DRIVER), as a
// tool or side task in any language would make them.
//
//   bubble_event_peer <128 hex digits of the CUipcEventHandle>
// Prints "OPENED" then "NOT_READY" or "READY" each time the event's state changes, and exits 0
// after READY (or 1 with a message, or after 30 s).
#include <cuda.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

int main(int argc, char** argv) {
  const char* path = std::getenv("BUBBLE_CUDA_DRIVER");
  if (argc != 2 || std::strlen(argv[1]) != 128 || !path) {
    std::fprintf(stderr, "usage: BUBBLE_CUDA_DRIVER=lib %s <hex handle>\n", argv[0]);
    return 1;
  }
  CUipcEventHandle h;
  for (int i = 0; i < 64; ++i) {
    unsigned v = 0;
    std::sscanf(argv[1] + 2 * i, "%2x", &v);
    reinterpret_cast<unsigned char*>(&h)[i] = static_cast<unsigned char>(v);
  }
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "event peer: %s\n", dlerror());
    return 1;
  }
  auto init = reinterpret_cast<decltype(&cuInit)>(dlsym(lib, "cuInit"));
  auto retain = reinterpret_cast<decltype(&cuDevicePrimaryCtxRetain)>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
  auto release = reinterpret_cast<CUresult (*)(CUdevice)>(dlsym(lib, "cuDevicePrimaryCtxRelease_v2"));
  auto set_ctx = reinterpret_cast<decltype(&cuCtxSetCurrent)>(dlsym(lib, "cuCtxSetCurrent"));
  auto open_ev = reinterpret_cast<decltype(&cuIpcOpenEventHandle)>(dlsym(lib, "cuIpcOpenEventHandle"));
  auto query = reinterpret_cast<decltype(&cuEventQuery)>(dlsym(lib, "cuEventQuery"));
  auto destroy = reinterpret_cast<CUresult (*)(CUevent)>(dlsym(lib, "cuEventDestroy_v2"));
  CUcontext ctx = nullptr;
  CUevent ev = nullptr;
  if (!init || !retain || !release || !set_ctx || !open_ev || !query || !destroy ||
      init(0) != CUDA_SUCCESS || retain(&ctx, 0) != CUDA_SUCCESS || set_ctx(ctx) != CUDA_SUCCESS ||
      open_ev(&ev, h) != CUDA_SUCCESS) {
    std::fprintf(stderr, "event peer: could not open the event\n");
    return 1;
  }
  std::printf("OPENED\n");
  std::fflush(stdout);
  CUresult last = CUDA_ERROR_UNKNOWN;
  int rc = 1;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < until) {
    const CUresult r = query(ev);
    if (r != last) {
      std::printf("%s\n", r == CUDA_SUCCESS ? "READY" : r == CUDA_ERROR_NOT_READY ? "NOT_READY" : "ERROR");
      std::fflush(stdout);
      last = r;
    }
    if (r == CUDA_SUCCESS) {
      rc = 0;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  destroy(ev);
  set_ctx(nullptr);
  release(0);
  return rc;
}
