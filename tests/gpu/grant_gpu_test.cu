// Memory grants on a real GPU: the trainer lends, grants and revokes; a side-task process maps
// the grant, finds it all zero (the previous round's holder wrote the same range), a kernel
// writes a pattern, the trainer reads it back. Lent with clearing off, a cuda-ipc grant shows
// the previous holder's words instead. And the lender's work on another thread leaves a graph
// capture in global mode intact.
//
//   bubble_grant_gpu_test [cuda-vmm|cuda-ipc|all]     (default: all)
//
// Exit status: 0 passed, 1 failed, 77 skipped (no GPU or no CUDA driver here). The task side is
// this same program started as "bubble_grant_gpu_test --task <socket-fd>".
#include <cuda_runtime.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda_driver.h"
#include "core/grant_lender.h"
#include "shm/fd_passing.h"

using namespace bb;

namespace {

constexpr uint32_t kOpGrant = 1;   // map the grant, count its non-zero words, run the kernel, reply
constexpr uint32_t kOpRevoke = 2;  // unmap, reply (the ack)

struct Request {
  uint32_t op;
  uint32_t seed;
  core::Grant grant;
};

struct Reply {
  int32_t status;
  uint32_t reserved;
  uint64_t nonzero_words;  // of the grant as the task found it, before its kernel ran
  char error[500];
};

__host__ __device__ inline uint32_t pattern_word(uint32_t seed, uint64_t i) {
  return seed ^ static_cast<uint32_t>(i * 2654435761u);
}

__global__ void fill(uint32_t* p, uint64_t words, uint32_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < words;
       i += uint64_t{gridDim.x} * blockDim.x)
    p[i] = pattern_word(seed, i);
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

bool reply(int sock, bb_status st, const std::string& msg, uint64_t nonzero = 0) {
  Reply r{};
  r.status = st;
  r.nonzero_words = nonzero;
  std::snprintf(r.error, sizeof r.error, "%s", msg.c_str());
  std::string err;
  return shm::send_fds(sock, &r, sizeof r, nullptr, 0, &err) == BB_OK;
}

// The side task: serves requests until the socket closes.
int run_task(int sock) {
  std::unique_ptr<core::GrantMapping> held;
  for (;;) {
    Request req;
    int fd = -1;
    size_t len = 0, nfds = 0;
    std::string err;
    if (shm::recv_fds(sock, &req, sizeof req, &len, &fd, 1, &nfds, &err) != BB_OK) return 3;
    if (len == 0) return 0;
    if (req.op == kOpRevoke) {
      bb_status st = held ? held->unmap(&err) : BB_E_STATE;
      held.reset();
      if (!reply(sock, st, err)) return 4;
      continue;
    }
    bb_status st = core::map_grant(req.grant, fd, &held, &err);
    if (fd >= 0) close(fd);
    uint64_t nonzero = 0;
    if (st == BB_OK) {
      // The grant says which of this process's GPUs it is on; the work goes there.
      const cudaError_t sd = held->device() < 0 ? cudaErrorInvalidDevice : cudaSetDevice(held->device());
      if (sd != cudaSuccess) {
        if (!reply(sock, BB_E_SYSTEM, "the CUDA grant names device " +
                                          std::to_string(held->device()) + ": " + cudaGetErrorString(sd)))
          return 4;
        continue;
      }
      std::vector<uint32_t> seen(held->size() / 4);
      const cudaError_t rc =
          cudaMemcpy(seen.data(), held->ptr(), seen.size() * 4, cudaMemcpyDeviceToHost);
      if (rc != cudaSuccess) {
        if (!reply(sock, BB_E_SYSTEM, std::string("reading the grant: ") + cudaGetErrorString(rc)))
          return 4;
        continue;
      }
      for (uint32_t w : seen) nonzero += w != 0;
      fill<<<128, 256>>>(static_cast<uint32_t*>(held->ptr()), held->size() / 4, req.seed);
      cudaError_t ce = cudaDeviceSynchronize();
      if (ce != cudaSuccess) {
        st = BB_E_SYSTEM;
        err = std::string("the kernel writing the grant failed: ") + cudaGetErrorString(ce);
      }
    }
    if (!reply(sock, st, err, nonzero)) return 4;
  }
}

struct Child {
  pid_t pid = -1;
  int sock = -1;
  ~Child() { stop(); }
  // Closes its socket, which ends it, and reaps it (killed if it has not ended within 10 s;
  // its pidfd turns readable when it exits).
  void stop() {
    if (sock >= 0) close(sock);
    sock = -1;
    if (pid > 0) {
      const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
      pollfd p{pidfd, POLLIN, 0};
      if (pidfd < 0 || poll(&p, 1, 10000) != 1) kill(pid, SIGKILL);
      if (pidfd >= 0) close(pidfd);
      waitpid(pid, nullptr, 0);
    }
    pid = -1;
  }
};

// visible: the task's CUDA_VISIBLE_DEVICES ("" leaves the trainer's), as the agent launches a
// task with only its GPU visible.
bool start_task(Child* c, const std::string& visible = "") {
  static const char self[] = "/proc/self/exe";
  // The environment is made before the fork: the child only execs.
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e)
    if (visible.empty() || std::strncmp(*e, "CUDA_VISIBLE_DEVICES=", 21) != 0) env.push_back(*e);
  if (!visible.empty()) env.push_back("CUDA_VISIBLE_DEVICES=" + visible);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return false;
  c->pid = fork();
  if (c->pid == 0) {
    if (sv[1] == 3) fcntl(3, F_SETFD, 0); else dup2(sv[1], 3);
    execle(self, "bubble_grant_gpu_test", "--task", "3", static_cast<char*>(nullptr),
           envp.data());
    _exit(127);
  }
  close(sv[1]);
  c->sock = sv[0];
  timeval tv{60, 0};
  setsockopt(c->sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return c->pid > 0;
}

bool request(Child& c, const Request& req, int fd, Reply* rep, std::string* err) {
  size_t len = 0, nfds = 0;
  if (shm::send_fds(c.sock, &req, sizeof req, fd >= 0 ? &fd : nullptr, fd >= 0 ? 1 : 0, err) !=
      BB_OK)
    return false;
  if (shm::recv_fds(c.sock, rep, sizeof *rep, &len, nullptr, 0, &nfds, err) != BB_OK) return false;
  if (len != sizeof *rep) {
    *err = "the task closed its socket";
    return false;
  }
  return true;
}

#define EXPECT(cond, ...)                                              \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                               \
      std::fprintf(stderr, "\n");                                      \
      return false;                                                    \
    }                                                                  \
  } while (0)

// device: the GPU the trainer lends from; a task started for another GPU than 0 sees only that
// one (its device 0), so the grant must find it by UUID, not by the trainer's ordinal.
bool run_backend(core::GrantBackend backend, bool clear = true, int device = 0) {
  std::string err;
  core::LendOptions o;
  o.backend = backend;
  o.bytes = 256ull << 20;
  o.clear = clear;
  o.device = device;
  EXPECT(cudaSetDevice(device) == cudaSuccess && cudaFree(nullptr) == cudaSuccess,
         "cannot use GPU %d", device);
  // Device memory before lending, to check that it all comes back when the lender goes (as at
  // bb_trainer_unlend and bb_trainer_close).
  size_t free_before = 0, total = 0;
  EXPECT(cudaMemGetInfo(&free_before, &total) == cudaSuccess, "cudaMemGetInfo failed");
  std::unique_ptr<core::GrantLender> lender;
  bb_status st = core::GrantLender::create(o, &lender, &err);
  EXPECT(st == BB_OK, "lend: %s", err.c_str());
  Child task;
  // By UUID: the trainer's ordinal names another GPU where CUDA_VISIBLE_DEVICES is already set
  // (a scheduler's), and CUDA_VISIBLE_DEVICES takes UUIDs.
  std::string visible;
  if (device != 0) {
    uint8_t uuid[core::kCudaUuidBytes];
    const core::CudaDriver* drv = core::cuda_driver(&err);
    EXPECT(drv && core::cuda_device_uuid(*drv, device, uuid, &err) == BB_OK, "%s", err.c_str());
    visible = core::cuda_uuid_string(uuid);
  }
  EXPECT(start_task(&task, visible), "could not start the task process");

  for (uint32_t round = 0; round < 3; ++round) {
    const uint64_t size = (uint64_t{round} + 1) * (24ull << 20) + 4 * round;
    core::Grant g;
    st = lender->grant(size, 1, &g, &err);
    EXPECT(st == BB_OK, "grant: %s", err.c_str());
    Request req{kOpGrant, 0x5eed0000u + round, core::wire_copy(g)};
    Reply rep{};
    EXPECT(request(task, req, g.handle.fd, &rep, &err), "%s", err.c_str());
    lender->descriptor_sent(g.id);  // as the trainer does: the task has its own now
    EXPECT(rep.status == BB_OK, "task: %s", rep.error);
    // Every round's grant starts where the last one's holder wrote its pattern.
    if (clear)
      EXPECT(rep.nonzero_words == 0, "the task found %llu non-zero words in its new grant",
             static_cast<unsigned long long>(rep.nonzero_words));
    else if (round > 0)
      EXPECT(rep.nonzero_words > 0, "lent without clearing, the previous holder's words are gone");

    // The trainer reads what the task's kernel wrote, through its own address of the grant.
    std::vector<uint32_t> host(size / 4);
    cudaError_t ce = cudaMemcpy(host.data(), reinterpret_cast<void*>(lender->address(g.id)),
                                host.size() * 4, cudaMemcpyDeviceToHost);
    EXPECT(ce == cudaSuccess, "cudaMemcpy: %s", cudaGetErrorString(ce));
    for (uint64_t i = 0; i < host.size(); ++i)
      EXPECT(host[i] == pattern_word(req.seed, i), "word %llu is %08x, expected %08x",
             static_cast<unsigned long long>(i), host[i], pattern_word(req.seed, i));
    // The same bytes through the lender's copy (bb_trainer_read_grant), to host memory and to
    // device memory of the same GPU.
    std::vector<uint32_t> copied(size / 4);
    st = lender->read(g.id, 0, copied.data(), size, &err);
    EXPECT(st == BB_OK, "read to host: %s", err.c_str());
    EXPECT(copied == host, "the lender's copy to host memory differs from the grant");
    void* dev = nullptr;
    EXPECT(cudaMalloc(&dev, size) == cudaSuccess, "cudaMalloc of %llu bytes failed",
           static_cast<unsigned long long>(size));
    st = lender->read(g.id, 0, dev, size, &err);
    EXPECT(st == BB_OK, "read to device memory: %s", err.c_str());
    std::fill(copied.begin(), copied.end(), 0u);
    EXPECT(cudaMemcpy(copied.data(), dev, size, cudaMemcpyDeviceToHost) == cudaSuccess,
           "cudaMemcpy of the copy failed");
    EXPECT(copied == host, "the lender's copy to device memory differs from the grant");
    cudaFree(dev);

    // Revocation: REVOKE with a deadline, the task unmaps and acks, then the memory goes back.
    st = lender->revoke(g.id, now_ns() + 5'000'000'000ull, &err);
    EXPECT(st == BB_OK, "revoke: %s", err.c_str());
    req.op = kOpRevoke;
    EXPECT(request(task, req, -1, &rep, &err), "%s", err.c_str());
    EXPECT(rep.status == BB_OK, "task unmap: %s", rep.error);
    st = lender->release(g.id, &err);
    EXPECT(st == BB_OK, "release: %s", err.c_str());
  }
  core::LenderStats s = lender->stats();
  EXPECT(s.granted_bytes == 0 && s.active == 0 && s.revoking == 0, "grants left behind");
  // The task's own CUDA context counts in the device's free memory too: it goes first.
  task.stop();
  lender.reset();
  size_t free_after = 0;
  EXPECT(cudaMemGetInfo(&free_after, &total) == cudaSuccess, "cudaMemGetInfo failed");
  // The driver may keep a little for itself; a lent range it kept would be 256 MiB. (Another
  // process allocating on the same GPU meanwhile would show here too: run this on an idle GPU.)
  constexpr size_t kSlack = 16u << 20;
  EXPECT(free_after + kSlack >= free_before, "device memory did not come back when the lender "
         "went: %zu MiB free before lending, %zu MiB after", free_before >> 20, free_after >> 20);
  std::printf("ok   %s%s on GPU %d%s: 3 grants %s, written by a kernel in another process, read "
              "back, revoked\n", core::grant_backend_name(backend), clear ? "" : " (clear off)",
              device, device ? " (the task seeing only it)" : "",
              clear ? "found zeroed" : "found holding the previous holder's words");
  return true;
}

// The application captures a CUDA graph in global mode (torch.cuda.graph's default) while the
// lender works on another thread, as a trainer's hub service thread does: lending, a cleared
// grant, a copy out to host memory, the release and the unlend must leave the capture intact.
bool run_during_capture(core::GrantBackend backend) {
  std::string err;
  EXPECT(cudaSetDevice(0) == cudaSuccess, "cannot use GPU 0");
  cudaStream_t cap = nullptr;
  EXPECT(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking) == cudaSuccess,
         "cudaStreamCreateWithFlags failed");
  uint32_t* scratch = nullptr;
  EXPECT(cudaMalloc(&scratch, 4096) == cudaSuccess, "cudaMalloc failed");
  EXPECT(cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal) == cudaSuccess,
         "a graph capture begins");
  fill<<<1, 256, 0, cap>>>(scratch, 1024, 7);
  std::string lender_err;
  bool lender_ok = false;
  std::thread service([&] {
    cudaSetDevice(0);
    core::LendOptions o;
    o.backend = backend;
    o.bytes = 64ull << 20;
    std::unique_ptr<core::GrantLender> lender;
    std::string e;
    core::Grant g;
    std::vector<uint32_t> host((8u << 20) / 4);
    if (core::GrantLender::create(o, &lender, &e) != BB_OK) {
      lender_err = "lend: " + e;
    } else if (lender->grant(8u << 20, 1, &g, &e) != BB_OK) {
      lender_err = "grant: " + e;
    } else if (lender->read(g.id, 0, host.data(), 8u << 20, &e) != BB_OK) {
      lender_err = "read to host: " + e;
    } else if (lender->release(g.id, &e) != BB_OK) {
      lender_err = "release: " + e;
    } else {
      lender_ok = std::all_of(host.begin(), host.end(), [](uint32_t w) { return w == 0; });
      if (!lender_ok) lender_err = "the cleared grant did not read as zeros";
    }
    lender.reset();  // the unlend, still during the capture
  });
  service.join();
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(cap, &graph);
  if (graph) cudaGraphDestroy(graph);
  cudaFree(scratch);
  cudaStreamDestroy(cap);
  EXPECT(lender_ok, "%s", lender_err.c_str());
  EXPECT(end == cudaSuccess && graph != nullptr,
         "the capture was invalidated by the lender's work (%s)", cudaGetErrorString(end));
  std::printf("ok   %s during a graph capture in global mode on another thread: lent, cleared, "
              "copied out, released, unlent; the capture stayed intact\n",
              core::grant_backend_name(backend));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--task") == 0) return run_task(std::atoi(argv[2]));
  std::string which = argc > 1 ? argv[1] : "all";
  std::string err;
  const core::CudaDriver* drv = core::cuda_driver(&err);
  if (!drv) {
    std::printf("skip: %s\n", err.c_str());
    return 77;
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("skip: the CUDA runtime sees no GPU\n");
    return 77;
  }
  cudaSetDevice(0);
  cudaFree(nullptr);  // make the primary context, which libbubble shares
  std::printf("driver %d.%d from %s, %d GPU(s)\n", drv->driver_version / 1000,
              drv->driver_version % 1000 / 10, drv->path.c_str(), n);
  bool ok = true;
  if (which == "all" || which == "cuda-vmm") ok &= run_backend(core::GrantBackend::kCudaVmm);
  if (which == "all" || which == "cuda-ipc") {
    ok &= run_backend(core::GrantBackend::kCudaIpc);
    ok &= run_backend(core::GrantBackend::kCudaIpc, false);
  }
  if (which == "all" || which == "cuda-vmm") ok &= run_during_capture(core::GrantBackend::kCudaVmm);
  if (which == "all" || which == "cuda-ipc") ok &= run_during_capture(core::GrantBackend::kCudaIpc);
  // A trainer's last GPU lent to a task that sees only that GPU, as the agent launches tasks.
  if (n >= 2) {
    if (which == "all" || which == "cuda-vmm")
      ok &= run_backend(core::GrantBackend::kCudaVmm, true, n - 1);
    if (which == "all" || which == "cuda-ipc")
      ok &= run_backend(core::GrantBackend::kCudaIpc, true, n - 1);
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
