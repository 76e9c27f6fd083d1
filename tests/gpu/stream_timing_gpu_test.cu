// GPU-timed bubbles on a real GPU: a bubble marked on a stream behind a long kernel begins only
// once the kernel is done, and ends only once the GPU passes the end mark.
//
//   bubble_stream_timing_gpu_test
// Exit status: 0 passed, 1 failed, 77 skipped (no GPU or no CUDA driver here).
#include <bubble/bubble.h>
#include <bubble/bubble_cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "core/observer.h"

namespace {

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

int failures = 0;
void expect(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

template <typename F>
bool eventually(F&& f, int ms = 5000) {
  for (int i = 0; i < ms; ++i) {
    if (f()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return f();
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  cudaSetDevice(0);
  cudaFree(nullptr);  // the primary context, current on this thread
  char dir[] = "/tmp/bb-stream-XXXXXX";
  if (!mkdtemp(dir)) return 1;
  setenv("BUBBLE_RUNTIME_DIR", dir, 1);
  const std::string job = "stream-gpu-" + std::to_string(getpid());
  bb_trainer_h trainer = nullptr;
  if (bb_trainer_open(job.c_str(), 0, nullptr, &trainer) != BB_OK) {
    std::fprintf(stderr, "%s\n", bb_last_error());
    return 1;
  }
  std::unique_ptr<bb::core::HubObserver> obs;
  std::string err;
  bb::core::HubObserver::open(dir, job, 0, &obs, &err);
  bb_stream_timing_h timing = nullptr;
  if (bb_stream_timing_open(trainer, nullptr, &timing) != BB_OK) {
    std::fprintf(stderr, "%s\n", bb_last_error());
    return 1;
  }
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  const long long cycles_300ms = (long long)khz * 300;

  spin<<<1, 1, 0, s>>>(cycles_300ms);
  bb_bubble_begin_on_stream(timing, s, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY, nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  expect(!obs->snapshot().in_bubble, "no bubble while the kernel before the begin mark runs");
  expect(eventually([&] { return obs->snapshot().in_bubble; }), "bubble once the GPU reaches the mark");
  spin<<<1, 1, 0, s>>>(cycles_300ms);  // the idle time ends: the next kernel is queued...
  bb_bubble_end_on_stream(timing, s, nullptr);  // ...and the end is behind it
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  expect(obs->snapshot().in_bubble, "the bubble lasts until the GPU passes the end mark");
  expect(eventually([&] { return !obs->snapshot().in_bubble; }), "bubble ends at the end mark");
  cudaStreamSynchronize(s);
  bb_stream_timing_stats_t st{};
  st.size = sizeof st;
  // The watcher counts an end after the trainer has applied it, which the observer may see
  // first: the count is waited for too.
  eventually([&] { bb_stream_timing_stats(timing, &st); return st.ends >= 1; });
  std::printf("marks=%llu begins=%llu ends=%llu lag_max=%llu us\n", (unsigned long long)st.marks,
              (unsigned long long)st.begins, (unsigned long long)st.ends,
              (unsigned long long)(st.lag_max_ns / 1000));
  expect(st.begins == 1 && st.ends == 1, "one begin and one end applied");

  // CUDA graphs: while the watcher polls a pending mark, a capture in global mode (the default)
  // on another stream must survive; a mark on the stream being captured is refused.
  cudaStream_t cap;
  cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking);
  spin<<<1, 1, 0, s>>>(cycles_300ms);
  bb_bubble_begin_on_stream(timing, s, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY, nullptr);
  bool began = cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal) == cudaSuccess;
  expect(began, "a graph capture begins");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the watcher polls meanwhile
  spin<<<1, 1, 0, cap>>>(1000);
  expect(bb_bubble_begin_on_stream(timing, cap, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY, nullptr) ==
             BB_E_STATE,
         "a mark on a stream being captured is refused");
  cudaGraph_t graph = nullptr;
  expect(began && cudaStreamEndCapture(cap, &graph) == cudaSuccess && graph != nullptr,
         "the capture was not invalidated by the watcher's queries");
  if (graph) cudaGraphDestroy(graph);
  bb_bubble_end_on_stream(timing, s, nullptr);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(cap);
  bb_stream_timing_close(timing);
  obs.reset();
  bb_trainer_close(trainer);
  cudaStreamDestroy(s);
  rmdir(dir);
  return failures ? 1 : 0;
}
