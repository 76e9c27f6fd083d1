// A GPipe pipeline on one node whose stages pass activations and gradients with ncclSend/ncclRecv,
// and whose bubbles nobody reports by hand: the training code below never calls libbubble. Each
// stage process loads libnccl-profiler-bubble.so through NCCL_PROFILER_PLUGIN, which turns its
// receive waits into bubbles on the stage's hub and lends side tasks device memory.
//
//   nccl_pipeline [--stages N] [--micro-batches M] [--iterations I] [--layer-us U]
//                 [--side-tasks] [--job JOB]
//
// Run as above it is the launcher: it starts one stage process per GPU (and, with --side-tasks,
// one nccl_side_task per stage) with the plugin's environment, waits for them and checks their
// reports. Exit 0 when every stage computed the right values and every side task ran inside
// bubbles with its memory grant; 2 when this machine has fewer GPUs than stages.
#include <cuda_runtime.h>
#include <nccl.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

struct Options {
  int stages = 2;
  int micro_batches = 4;
  int iterations = 20;
  int layer_us = 2000;  // GPU time of one stage's forward (backward: twice that)
  bool side_tasks = false;
  std::string job = "nccl-pipeline";
  int stage = -1;       // >= 0: this process is that stage
  std::string id_file;
};

constexpr int kWidth = 1 << 16;  // floats per micro-batch activation

#define CHECK_CUDA(x)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "stage: %s failed: %s\n", #x, cudaGetErrorString(e_));       \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)
#define CHECK_NCCL(x)                                                                   \
  do {                                                                                  \
    ncclResult_t r_ = (x);                                                              \
    if (r_ != ncclSuccess) {                                                            \
      std::fprintf(stderr, "stage: %s failed: %s\n", #x, ncclGetErrorString(r_));       \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// One "layer": spins for about `ns` of GPU time (the stand-in for real compute), then applies a
// cheap affine map so the last stage can check every value that crossed the pipeline.
__global__ void layer(float* x, int n, float a, float b, long long ns) {
  const long long t0 = clock64();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (threadIdx.x == 0) {
    // clock64 counts SM cycles; ~1 GHz is close enough to size a bubble.
    while (clock64() - t0 < ns) {
    }
  }
  __syncthreads();
  if (i < n) x[i] = x[i] * a + b;
}

__global__ void init_input(float* x, int n, int mb, int it) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = float((i % 97) + mb + it % 5) * 0.01f;
}

float stage_a(int s) { return 1.0f + 0.001f * float(s + 1); }
float stage_b(int s) { return 0.01f * float(s + 1); }

int run_stage(const Options& o) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < o.stages) {
    std::fprintf(stderr, "stage %d: needs %d GPUs, this machine has %d\n", o.stage, o.stages,
                 devices);
    return 2;
  }
  CHECK_CUDA(cudaSetDevice(o.stage));
  ncclUniqueId id;
  if (o.stage == 0) {
    CHECK_NCCL(ncclGetUniqueId(&id));
    const std::string tmp = o.id_file + ".tmp";
    std::ofstream(tmp, std::ios::binary).write(reinterpret_cast<char*>(&id), sizeof id);
    std::rename(tmp.c_str(), o.id_file.c_str());
  } else {
    std::ifstream in;
    for (int i = 0; i < 3000 && !in.is_open(); ++i) {
      in.open(o.id_file, std::ios::binary);
      if (!in.is_open()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!in.read(reinterpret_cast<char*>(&id), sizeof id)) {
      std::fprintf(stderr, "stage %d: no NCCL id from stage 0 in %s\n", o.stage, o.id_file.c_str());
      return 1;
    }
  }
  // The profiler plugin's init runs in here: it opens this stage's hub.
  ncclComm_t comm;
  CHECK_NCCL(ncclCommInitRank(&comm, o.stages, id, o.stage));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const int m = o.micro_batches;
  std::vector<float*> act(static_cast<size_t>(m)), grad(static_cast<size_t>(m));
  for (int i = 0; i < m; ++i) {
    CHECK_CUDA(cudaMalloc(&act[size_t(i)], kWidth * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&grad[size_t(i)], kWidth * sizeof(float)));
  }
  const int threads = 256, blocks = (kWidth + threads - 1) / threads;
  const long long fwd_cycles = 1000ll * o.layer_us, bwd_cycles = 2 * fwd_cycles;
  const bool first = o.stage == 0, last = o.stage == o.stages - 1;
  bool values_ok = true;

  for (int it = 0; it < o.iterations; ++it) {
    for (int mb = 0; mb < m; ++mb) {  // forward
      float* x = act[size_t(mb)];
      if (first) init_input<<<blocks, threads, 0, stream>>>(x, kWidth, mb, it);
      else CHECK_NCCL(ncclRecv(x, kWidth, ncclFloat, o.stage - 1, comm, stream));
      layer<<<blocks, threads, 0, stream>>>(x, kWidth, stage_a(o.stage), stage_b(o.stage),
                                            fwd_cycles);
      if (!last) CHECK_NCCL(ncclSend(x, kWidth, ncclFloat, o.stage + 1, comm, stream));
    }
    if (last) {  // every value crossed every stage exactly once, in order
      std::vector<float> host(kWidth);
      CHECK_CUDA(cudaMemcpyAsync(host.data(), act[size_t(m - 1)], kWidth * sizeof(float),
                                 cudaMemcpyDeviceToHost, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      for (int i = 0; i < kWidth; i += 1021) {
        float want = float((i % 97) + (m - 1) + it % 5) * 0.01f;
        for (int s = 0; s < o.stages; ++s) want = want * stage_a(s) + stage_b(s);
        if (std::fabs(host[size_t(i)] - want) > 1e-3f * std::fabs(want) + 1e-5f) values_ok = false;
      }
    }
    for (int mb = m - 1; mb >= 0; --mb) {  // backward
      float* g = grad[size_t(mb)];
      if (last) CHECK_CUDA(cudaMemsetAsync(g, 0, kWidth * sizeof(float), stream));
      else CHECK_NCCL(ncclRecv(g, kWidth, ncclFloat, o.stage + 1, comm, stream));
      layer<<<blocks, threads, 0, stream>>>(g, kWidth, 1.0f, 0.0f, bwd_cycles);
      if (!first) CHECK_NCCL(ncclSend(g, kWidth, ncclFloat, o.stage - 1, comm, stream));
    }
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  for (int i = 0; i < m; ++i) {
    cudaFree(act[size_t(i)]);
    cudaFree(grad[size_t(i)]);
  }
  CHECK_NCCL(ncclCommDestroy(comm));  // the plugin's finalize closes the hub
  cudaStreamDestroy(stream);
  std::printf("STAGE %d done iterations=%d values=%s\n", o.stage, o.iterations,
              last ? (values_ok ? "ok" : "WRONG") : "n/a");
  std::fflush(stdout);
  return values_ok ? 0 : 1;
}

// ---- the launcher ------------------------------------------------------------------------------

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
            int out_fd) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) env.emplace_back(*e);
  for (const auto& kv : extra_env) env.push_back(kv);
  std::vector<char*> a, e;
  for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  for (const auto& s : env) e.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  e.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (out_fd >= 0) posix_spawn_file_actions_adddup2(&fa, out_fd, 1);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, a[0], &fa, nullptr, a.data(), e.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    std::fprintf(stderr, "nccl_pipeline: cannot start %s: %s\n", a[0], std::strerror(rc));
    return -1;
  }
  return pid;
}

int run_launcher(const Options& o, const std::string& self) {
  const std::string here = dir_of(self);
  const char* plugin_env = std::getenv("BUBBLE_NCCL_PLUGIN");
  const std::string plugin = plugin_env ? plugin_env : BB_NCCL_PLUGIN_PATH;
  const std::string side = here + "/nccl_side_task";
  char tmpl[] = "/tmp/nccl-pipeline-XXXXXX";
  if (!mkdtemp(tmpl)) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string work = tmpl, id_file = work + "/nccl.id";
  std::printf("nccl_pipeline: %d stages, %d micro-batches, %d iterations; plugin %s\n", o.stages,
              o.micro_batches, o.iterations, plugin.c_str());
  std::fflush(stdout);

  std::vector<pid_t> stages, tasks;
  std::vector<std::string> task_logs;
  for (int s = 0; s < o.stages; ++s) {
    std::vector<std::string> env = {
        "NCCL_PROFILER_PLUGIN=" + plugin, "BUBBLE_JOB=" + o.job, "BUBBLE_RANK=" + std::to_string(s),
        "BUBBLE_NCCL_DEVICE=" + std::to_string(s)};
    if (o.side_tasks) env.push_back("BUBBLE_NCCL_LEND=cuda-vmm:64M");
    stages.push_back(spawn({self, "--stage", std::to_string(s), "--id-file", id_file, "--stages",
                            std::to_string(o.stages), "--micro-batches",
                            std::to_string(o.micro_batches), "--iterations",
                            std::to_string(o.iterations), "--layer-us", std::to_string(o.layer_us)},
                           env, -1));
  }
  if (o.side_tasks) {
    for (int s = 0; s < o.stages; ++s) {
      task_logs.push_back(work + "/side." + std::to_string(s) + ".log");
      const int fd = open(task_logs.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      tasks.push_back(spawn({side, o.job, std::to_string(s), "--device", std::to_string(s)}, {}, fd));
      close(fd);
    }
  }
  int failed = 0, skipped = 0;
  for (pid_t p : stages) {
    int st = 0;
    if (p < 0 || waitpid(p, &st, 0) != p || !WIFEXITED(st)) ++failed;
    else if (WEXITSTATUS(st) == 2) ++skipped;
    else if (WEXITSTATUS(st) != 0) ++failed;
  }
  // The hubs are closed now; the side tasks see that and report. Bounded: 20 s, then killed.
  for (size_t i = 0; i < tasks.size(); ++i) {
    int st = 0;
    bool done = false;
    for (int k = 0; k < 2000 && !done; ++k) {
      done = tasks[i] > 0 && waitpid(tasks[i], &st, WNOHANG) == tasks[i];
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!done && tasks[i] > 0) {
      kill(tasks[i], SIGKILL);
      waitpid(tasks[i], &st, 0);
    }
    std::ifstream in(task_logs[i]);
    std::string line, report;
    while (std::getline(in, line)) {
      std::printf("  side task %zu: %s\n", i, line.c_str());
      if (line.rfind("SIDE ", 0) == 0) report = line;
    }
    if (skipped == 0 && (report.empty() || report.find(" ok") == std::string::npos)) ++failed;
    std::remove(task_logs[i].c_str());
  }
  std::remove(id_file.c_str());
  rmdir(work.c_str());
  if (skipped) {
    std::printf("nccl_pipeline: skipped, fewer GPUs than stages\n");
    return 2;
  }
  std::printf("nccl_pipeline: %s\n", failed ? "FAILED" : "ok");
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "nccl_pipeline: %s needs a value\n", a.c_str());
        std::exit(64);
      }
      return argv[++i];
    };
    if (a == "--stages") o.stages = std::atoi(next());
    else if (a == "--micro-batches") o.micro_batches = std::atoi(next());
    else if (a == "--iterations") o.iterations = std::atoi(next());
    else if (a == "--layer-us") o.layer_us = std::atoi(next());
    else if (a == "--side-tasks") o.side_tasks = true;
    else if (a == "--job") o.job = next();
    else if (a == "--stage") o.stage = std::atoi(next());
    else if (a == "--id-file") o.id_file = next();
    else {
      std::fprintf(stderr, "usage: %s [--stages N] [--micro-batches M] [--iterations I] "
                           "[--layer-us U] [--side-tasks] [--job JOB]\n", argv[0]);
      return 64;
    }
  }
  if (o.stages < 2 || o.micro_batches < 1 || o.iterations < 1 || o.layer_us < 0) {
    std::fprintf(stderr, "nccl_pipeline: need --stages >= 2, --micro-batches >= 1, "
                         "--iterations >= 1\n");
    return 64;
  }
  if (o.stage >= 0) return run_stage(o);
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) {
    std::perror("readlink /proc/self/exe");
    return 1;
  }
  self[n] = 0;
  return run_launcher(o, self);
}
