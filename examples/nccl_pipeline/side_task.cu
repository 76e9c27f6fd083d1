// A CUDA side task for the NCCL pipeline example: it attaches to one stage's hub, and in every
// bubble runs short kernels on the device memory the stage lent it (its grant), until told to
// pause. Between bubbles it checks that the grant still holds exactly what it wrote.
//
//   nccl_side_task JOB RANK [--device D] [--mem BYTES]
//
// Prints "SIDE rank=R starts=N steps=N grant_bytes=B ok" (or "... WRONG ...") when the stage
// closes its hub. Exit 0 only if it ran at least one step and every check held.
#include <bubble/bubble.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

// One step: every word of the grant goes up by one. Short (tens of microseconds), so a pause
// is honoured quickly: the task only checks should_pause between steps.
__global__ void bump(unsigned* w, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x)
    w[i] += 1u;
}

bool check(const unsigned* w, size_t n, unsigned want) {
  unsigned first = 0, last = 0;
  if (cudaMemcpy(&first, w, sizeof first, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  if (cudaMemcpy(&last, w + n - 1, sizeof last, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  return first == want && last == want;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s JOB RANK [--device D] [--mem BYTES]\n", argv[0]);
    return 64;
  }
  const char* job = argv[1];
  const uint32_t rank = uint32_t(std::atoi(argv[2]));
  int device = 0;
  uint64_t mem = 16ull << 20;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--device")) device = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--mem")) mem = std::strtoull(argv[i + 1], nullptr, 0);
  }
  if (cudaSetDevice(device) != cudaSuccess) {
    std::fprintf(stderr, "side task: no CUDA device %d\n", device);
    return 1;
  }
  cudaFree(nullptr);  // the primary context, where libbubble maps the grant

  bb_task_options_t opts;
  bb_task_options_init(&opts);
  opts.mem_need = mem;
  bb_task_h task = nullptr;
  // The stage opens its hub when NCCL initialises its communicator: wait for it (60 s).
  bb_status st = BB_E_NOT_FOUND;
  for (int i = 0; i < 6000 && st == BB_E_NOT_FOUND; ++i) {
    st = bb_task_attach(job, rank, "cuda-side", &opts, &task);
    if (st == BB_E_NOT_FOUND) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (st != BB_OK) {
    std::fprintf(stderr, "side task: %s\n", bb_last_error());
    return 2;
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  uint64_t starts = 0, steps = 0, bytes = 0, grant_id = 0;
  bool ok = true;
  unsigned* words = nullptr;
  size_t n = 0;
  for (;;) {
    bb_start_info_t info;
    std::memset(&info, 0, sizeof info);
    info.size = sizeof info;
    st = bb_task_wait_start(task, -1, &info);
    if (st != BB_OK) break;  // the stage closed its hub (BB_E_TRAINER_GONE) or stopped us
    ++starts;
    if (!info.grant_ptr) {  // started without memory: nothing to do in this bubble
      bb_task_ack_pause(task);
      continue;
    }
    if (info.grant_id != grant_id) {  // a new grant: start counting from its zeroes
      grant_id = info.grant_id;
      words = static_cast<unsigned*>(info.grant_ptr);
      n = size_t(info.grant_bytes / sizeof(unsigned));
      bytes = info.grant_bytes;
      cudaMemsetAsync(words, 0, n * sizeof(unsigned), stream);
      cudaStreamSynchronize(stream);
      steps = 0;
    }
    while (!bb_task_should_pause(task)) {
      const uint64_t t0 = bb_now_ns();
      bump<<<64, 256, 0, stream>>>(words, n);
      cudaStreamSynchronize(stream);
      ++steps;
      bb_task_report_step(task, bb_now_ns() - t0);
    }
    if (!check(words, n, unsigned(steps))) ok = false;
    bb_task_ack_pause(task);
  }
  cudaStreamDestroy(stream);
  bb_task_detach(task);
  ok = ok && steps > 0 && cudaGetLastError() == cudaSuccess;
  std::printf("SIDE rank=%u starts=%llu steps=%llu grant_bytes=%llu %s\n", rank,
              (unsigned long long)starts, (unsigned long long)steps, (unsigned long long)bytes,
              ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
