// libnccl-profiler-bubble.so driven through its exported tables exactly as NCCL drives it: the
// event sequences below are those NCCL emits for ncclSend/ncclRecv in a group (API events the
// plugin did not ask for included), with the P2p event stopped at enqueue, before the proxy
// thread reports its kernel-channel and proxy events. The plugin opens a real hub; a real side
// task process and a hub observer check the bubbles it reports.
#include <bubble/bubble.h>
#include <cuda.h>
#include <dlfcn.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/observer.h"
#include "plugins/nccl_profiler/nccl_profiler_abi.h"
#include "tests/helpers/proc.h"

using bbtest::Child;
using bbtest::RuntimeDir;
using bbtest::eventually;

namespace {

// Sets an environment variable for one test and puts the old value back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old, had_ = true;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

// The plugin loaded the way NCCL loads it (dlopen RTLD_LOCAL, dlsym of the version table). The
// destructor finalizes every context a test left open before unloading, so a failed test never
// unmaps code under the hub's service thread.
class Plugin {
 public:
  Plugin() {
    lib_ = dlopen(BB_NCCL_PLUGIN, RTLD_NOW | RTLD_LOCAL);
    INFO(dlerror());
    REQUIRE(lib_);
    v5 = static_cast<ncclProfiler_v5_t*>(dlsym(lib_, "ncclProfiler_v5"));
    v4 = static_cast<ncclProfiler_v4_t*>(dlsym(lib_, "ncclProfiler_v4"));
    v3 = static_cast<ncclProfiler_v3_t*>(dlsym(lib_, "ncclProfiler_v3"));
    REQUIRE(v5);
    REQUIRE(v4);
    REQUIRE(v3);
  }
  ~Plugin() {
    for (void* c : open_) v5->finalize(c);
    dlclose(lib_);
  }
  void* init_v5(int rank, int* mask, ncclResult_t expect = ncclSuccess) {
    void* ctx = nullptr;
    CHECK(v5->init(&ctx, 0x1234, mask, "pp", 1, 2, rank, nullptr) == expect);
    if (ctx) open_.push_back(ctx);
    return ctx;
  }
  void finalize(void* ctx) {
    std::erase(open_, ctx);
    CHECK(v5->finalize(ctx) == ncclSuccess);
  }
  void track(void* ctx) { open_.push_back(ctx); }
  void untrack(void* ctx) { std::erase(open_, ctx); }

  ncclProfiler_v5_t* v5 = nullptr;
  ncclProfiler_v4_t* v4 = nullptr;
  ncclProfiler_v3_t* v3 = nullptr;

 private:
  void* lib_ = nullptr;
  std::vector<void*> open_;
};

// One communicator's events, as NCCL 2.28+ (v5) reports them. A null handle is never passed
// back, as NCCL never does.
struct CommV5 {
  Plugin& pl;
  void* ctx;

  void* start(ncclProfilerEventDescr_v5_t d) {
    void* h = reinterpret_cast<void*>(0xdead);
    REQUIRE(pl.v5->startEvent(ctx, &h, &d) == ncclSuccess);
    return h;
  }
  void stop(void* h) {
    if (h) CHECK(pl.v5->stopEvent(h) == ncclSuccess);
  }
  void state(void* h, ncclProfilerEventState_t s, ncclProfilerEventStateArgs_v5_t* a = nullptr) {
    if (h) CHECK(pl.v5->recordEventState(h, s, a) == ncclSuccess);
  }

  // The user thread's part of ncclGroupStart(); ncclRecv/ncclSend(...); ncclGroupEnd(): API
  // events, the group and the task event, all stopped once the kernel is enqueued. Returns the
  // task (P2p) handle, the parent of the proxy thread's events.
  void* enqueue(const char* func, int peer, uint8_t nchannels) {
    ncclProfilerEventDescr_v5_t d{};
    d.type = ncclProfileGroupApi;
    d.groupApi.groupDepth = 1;
    void* group_api = start(d);
    d = {};
    d.type = ncclProfileP2pApi;
    d.parentObj = group_api;
    d.p2pApi.func = func;
    d.p2pApi.count = 1024;
    d.p2pApi.datatype = "ncclFloat32";
    void* p2p_api = start(d);
    stop(p2p_api);
    state(group_api, ncclProfilerGroupStartApiStop);
    state(group_api, ncclProfilerGroupEndApiStart);
    d = {};
    d.type = ncclProfileKernelLaunch;
    d.parentObj = group_api;
    void* launch = start(d);
    d = {};
    d.type = ncclProfileGroup;
    void* group = start(d);
    d = {};
    d.type = ncclProfileP2p;
    d.parentObj = p2p_api;
    d.p2p.func = func;
    d.p2p.datatype = "ncclFloat32";
    d.p2p.count = 1024;
    d.p2p.peer = peer;
    d.p2p.nChannels = nchannels;
    d.p2p.parentGroup = group;
    void* task = start(d);
    stop(launch);
    stop(task);
    stop(group);
    stop(group_api);
    return task;
  }
  void* kernel_channel(void* task, uint8_t ch) {
    ncclProfilerEventDescr_v5_t d{};
    d.type = ncclProfileKernelCh;
    d.parentObj = task;
    d.kernelCh.channelId = ch;
    d.kernelCh.pTimer = 1000 + ch;
    return start(d);
  }
  void kernel_channel_done(void* k) {
    ncclProfilerEventStateArgs_v5_t a{};
    a.kernelCh.pTimer = 5000;
    state(k, ncclProfilerKernelChStop, &a);
    stop(k);
  }
  void* proxy_op(void* task, uint8_t ch, int is_send, pid_t pid) {
    ncclProfilerEventDescr_v5_t d{};
    d.type = ncclProfileProxyOp;
    d.parentObj = task;
    d.proxyOp.pid = pid;
    d.proxyOp.channelId = ch;
    d.proxyOp.peer = 0;
    d.proxyOp.nSteps = 2;
    d.proxyOp.chunkSize = 512;
    d.proxyOp.isSend = is_send;
    return start(d);
  }
  void* proxy_step(void* op, int step) {
    ncclProfilerEventDescr_v5_t d{};
    d.type = ncclProfileProxyStep;
    d.parentObj = op;
    d.proxyStep.step = step;
    return start(d);
  }
};

struct Hub {
  std::unique_ptr<bb::core::HubObserver> obs;
  Hub(const RuntimeDir& rt, const std::string& job, uint32_t rank) {
    std::string err;
    const bb_status st = bb::core::HubObserver::open(rt.path(), job, rank, &obs, &err);
    INFO(err);
    REQUIRE(st == BB_OK);
  }
  bb::core::HubSnapshot snap() const { return obs->snapshot(); }
};

std::string unique_job(const char* base) { return std::string(base) + "-" + std::to_string(getpid()); }

// Whether a task can attach to the hub of (job, 0) now; it detaches at once.
bb_status attach_once(const std::string& job) {
  bb_task_h task = nullptr;
  const bb_status st = bb_task_attach(job.c_str(), 0, "once", nullptr, &task);
  bb_task_detach(task);
  return st;
}

}  // namespace

TEST_CASE("plugin_v5_intra_node_recv_is_one_bubble_that_starts_a_task") {
  RuntimeDir rt;
  const std::string job = unique_job("nccl-v5");
  ScopedEnv e1("BUBBLE_JOB", job.c_str()), e2("BUBBLE_RANK", "1");
  Plugin pl;
  int mask = 0;
  void* ctx = pl.init_v5(1, &mask);
  REQUIRE(ctx);
  CHECK((mask & ncclProfileP2p));
  CHECK((mask & ncclProfileKernelCh));
  Hub hub(rt, job, 1);
  Child task({BB_TEST_TASK, job, "1", "t", "imperative", "--step-us", "100"});
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return hub.snap().tasks.size() == 1; }));
  CommV5 comm{pl, ctx};

  // A send: its kernel channel runs, but a send is not a receive wait.
  void* send = comm.enqueue("Send", 0, 1);
  CHECK(send == nullptr);
  comm.stop(comm.kernel_channel(send, 0));
  CHECK(hub.snap().bubbles == 0);

  // A receive on two channels (intra-node: no proxy events): the bubble opens with the first
  // channel the GPU starts and closes with the last one it finishes.
  void* recv = comm.enqueue("Recv", 0, 2);
  REQUIRE(recv != nullptr);
  CHECK_FALSE(hub.snap().in_bubble);
  void* k0 = comm.kernel_channel(recv, 0);
  CHECK(hub.snap().in_bubble);
  CHECK(task.wait_line("STARTED 1") != "");
  void* k1 = comm.kernel_channel(recv, 1);
  comm.kernel_channel_done(k0);
  CHECK(hub.snap().in_bubble);
  comm.kernel_channel_done(k1);
  auto s = hub.snap();
  CHECK_FALSE(s.in_bubble);
  CHECK(s.bubbles == 1);
  // The task was told to pause, and acks it.
  CHECK(eventually([&] {
    auto t = hub.snap().tasks;
    return t.size() == 1 && !t[0].started;
  }));

  // The next iteration's receive is the hub's second bubble.
  void* recv2 = comm.enqueue("Recv", 0, 1);
  void* k = comm.kernel_channel(recv2, 0);
  CHECK(task.wait_line("STARTED 2") != "");
  comm.kernel_channel_done(k);
  CHECK(hub.snap().bubbles == 2);

  pl.finalize(ctx);
  CHECK(eventually([&] { return !hub.obs->alive(); }));
  CHECK(task.wait_line("RESULT") != "");
}

TEST_CASE("plugin_v5_network_recv_wait_ends_when_the_data_arrives") {
  RuntimeDir rt;
  const std::string job = unique_job("nccl-net");
  ScopedEnv e1("BUBBLE_JOB", job.c_str()), e2("BUBBLE_RANK", nullptr), e3("RANK", nullptr);
  Plugin pl;
  int mask = 0;
  void* ctx = pl.init_v5(3, &mask);  // no variable: the communicator's rank names the hub
  REQUIRE(ctx);
  Hub hub(rt, job, 3);
  CommV5 comm{pl, ctx};

  // The proxy posts the receive before the kernel reaches the channel; the kernel then waits
  // until the network delivers the first step.
  void* recv = comm.enqueue("Recv", 0, 1);
  void* op = comm.proxy_op(recv, 0, 0, getpid());
  REQUIRE(op != nullptr);
  void* step0 = comm.proxy_step(op, 0);
  REQUIRE(step0 != nullptr);
  comm.state(step0, ncclProfilerProxyStepRecvWait);
  void* k = comm.kernel_channel(recv, 0);
  CHECK(hub.snap().in_bubble);
  comm.state(step0, ncclProfilerProxyStepRecvFlushWait);
  CHECK_FALSE(hub.snap().in_bubble);  // data is here: the GPU copies, it no longer idles
  comm.state(step0, ncclProfilerProxyStepRecvGPUWait);
  comm.stop(step0);
  void* step1 = comm.proxy_step(op, 1);
  comm.state(step1, ncclProfilerProxyStepRecvWait);
  comm.state(step1, ncclProfilerProxyStepRecvFlushWait);
  comm.stop(step1);
  comm.kernel_channel_done(k);
  comm.stop(op);
  CHECK(hub.snap().bubbles == 1);

  // Data that arrived before the kernel reached the channel: no wait, no bubble.
  void* early = comm.enqueue("Recv", 0, 1);
  void* op2 = comm.proxy_op(early, 0, 0, getpid());
  void* st = comm.proxy_step(op2, 0);
  comm.state(st, ncclProfilerProxyStepRecvWait);
  comm.state(st, ncclProfilerProxyStepRecvFlushWait);
  comm.stop(st);
  void* k2 = comm.kernel_channel(early, 0);
  CHECK_FALSE(hub.snap().in_bubble);
  comm.kernel_channel_done(k2);
  comm.stop(op2);
  CHECK(hub.snap().bubbles == 1);

  // Under PXN another process's proxy reports the op: its parent pointer is not ours to read.
  void* pxn = comm.enqueue("Recv", 0, 1);
  CHECK(comm.proxy_op(pxn, 0, 0, getpid() + 1) == nullptr);
  // Proxy events of collectives and sends have no receive record behind them.
  CHECK(comm.proxy_op(nullptr, 0, 0, getpid()) == nullptr);
  CHECK(comm.proxy_op(pxn, 0, 1, getpid()) == nullptr);
  comm.kernel_channel_done(comm.kernel_channel(pxn, 0));
  CHECK(hub.snap().bubbles == 2);
  pl.finalize(ctx);
}

TEST_CASE("plugin_receives_of_two_communicators_share_one_hub_and_one_bubble") {
  RuntimeDir rt;
  const std::string job = unique_job("nccl-comms");
  ScopedEnv e1("BUBBLE_JOB", job.c_str()), e2("BUBBLE_RANK", "0");
  Plugin pl;
  int mask = 0;
  void* world = pl.init_v5(0, &mask);
  void* pair = pl.init_v5(0, &mask);
  REQUIRE(world);
  REQUIRE(pair);
  Hub hub(rt, job, 0);
  CommV5 a{pl, world}, b{pl, pair};

  void* ka = a.kernel_channel(a.enqueue("Recv", 1, 1), 0);
  void* kb = b.kernel_channel(b.enqueue("Recv", 2, 1), 0);
  a.kernel_channel_done(ka);
  CHECK(hub.snap().in_bubble);  // still waiting on the other receive
  b.kernel_channel_done(kb);
  CHECK_FALSE(hub.snap().in_bubble);
  CHECK(hub.snap().bubbles == 1);

  // A finalize of a context NCCL never got (its init failed) counts nothing.
  CHECK(pl.v5->finalize(nullptr) == ncclSuccess);
  pl.finalize(world);
  CHECK(hub.obs->alive());  // the other communicator still uses the hub
  void* kc = b.kernel_channel(b.enqueue("Recv", 2, 1), 0);
  CHECK(hub.snap().in_bubble);
  pl.finalize(pair);
  CHECK(eventually([&] { return !hub.obs->alive(); }));
  CHECK(rt.files().empty());
  // Events that come after the last communicator went away (NCCL's threads of one whose init
  // failed, say) reach no hub, and harm nothing.
  b.kernel_channel_done(kc);
  b.stop(b.enqueue("Recv", 2, 1));
}

TEST_CASE("plugin_communicator_torn_down_mid_receive_closes_the_bubble") {
  RuntimeDir rt;
  const std::string job = unique_job("nccl-abort");
  ScopedEnv e1("BUBBLE_JOB", job.c_str()), e2("BUBBLE_RANK", "0");
  Plugin pl;
  int mask = 0;
  void* ctx = pl.init_v5(0, &mask);
  Hub hub(rt, job, 0);
  Child task({BB_TEST_TASK, job, "0", "t", "imperative", "--step-us", "100"});
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return hub.snap().tasks.size() == 1; }));
  CommV5 comm{pl, ctx};
  comm.kernel_channel(comm.enqueue("Recv", 1, 1), 0);  // never finishes: the peer died
  REQUIRE(task.wait_line("STARTED 1") != "");
  pl.finalize(ctx);
  CHECK(task.wait_line("RESULT") != "");  // told the trainer is gone, not left running
  CHECK(eventually([&] { return rt.files().empty(); }));
}

TEST_CASE("plugin_v4_and_v3_tables_report_the_same_waits") {
  RuntimeDir rt;
  const std::string job = unique_job("nccl-old");
  ScopedEnv e1("BUBBLE_JOB", job.c_str()), e2("BUBBLE_RANK", "2");
  Plugin pl;

  // As NCCL before 2.28 does: a group's task (P2p) events are started only under a group
  // handle that is not null.
  SUBCASE("v4") {
    int mask = 0;
    void* ctx = nullptr;
    REQUIRE(pl.v4->init(&ctx, &mask, "pp", 0x99, 1, 4, 2, nullptr) == ncclSuccess);
    pl.track(ctx);
    Hub hub(rt, job, 2);
    void* group = nullptr;
    ncclProfilerEventDescr_v4_t d{};
    d.type = ncclProfileGroup;
    REQUIRE(pl.v4->startEvent(ctx, &group, &d) == ncclSuccess);
    REQUIRE(group != nullptr);
    void* task = nullptr;
    d = {};
    d.type = ncclProfileP2p;
    d.parentObj = group;
    d.p2p.func = "Recv";
    d.p2p.nChannels = 1;
    REQUIRE(pl.v4->startEvent(ctx, &task, &d) == ncclSuccess);
    REQUIRE(task);
    pl.v4->stopEvent(task);
    pl.v4->stopEvent(group);
    d = {};
    d.type = ncclProfileKernelCh;
    d.parentObj = task;
    d.kernelCh.channelId = 0;
    void* k = nullptr;
    pl.v4->startEvent(ctx, &k, &d);
    CHECK(hub.snap().in_bubble);
    ncclProfilerEventStateArgs_v4_t a{};
    pl.v4->recordEventState(k, ncclProfilerKernelChStop, &a);
    pl.v4->stopEvent(k);
    CHECK_FALSE(hub.snap().in_bubble);
    CHECK(hub.snap().bubbles == 1);
  }
  SUBCASE("v3") {
    int mask = 0;
    void* ctx = nullptr;
    REQUIRE(pl.v3->init(&ctx, &mask) == ncclSuccess);
    pl.track(ctx);
    CHECK((mask & ncclProfileKernelCh));
    Hub hub(rt, job, 2);
    void* group = nullptr;
    ncclProfilerEventDescr_v3_t d{};
    d.type = ncclProfileGroup;
    REQUIRE(pl.v3->startEvent(ctx, &group, &d) == ncclSuccess);
    REQUIRE(group != nullptr);
    void* task = nullptr;
    d = {};
    d.type = ncclProfileP2p;
    d.parentObj = group;
    d.p2p.func = "Recv";
    REQUIRE(pl.v3->startEvent(ctx, &task, &d) == ncclSuccess);
    REQUIRE(task);
    pl.v3->stopEvent(task);
    pl.v3->stopEvent(group);
    d = {};
    d.type = ncclProfileKernelCh;
    d.parentObj = task;
    void* k = nullptr;
    pl.v3->startEvent(ctx, &k, &d);
    CHECK(hub.snap().in_bubble);
    pl.v3->stopEvent(k);  // v3 has no KernelChStop state: the stop ends the channel
    CHECK_FALSE(hub.snap().in_bubble);
  }
}

TEST_CASE("plugin_init_failure_disables_it_cleanly") {
  // An init that cannot report still succeeds, asking for no events and giving no context: an
  // error makes NCCL 2.26 and 2.27 drop the plugin, and then crash logging its name.
  RuntimeDir rt;
  const std::string job = unique_job("nccl-fail");
  ScopedEnv e1("BUBBLE_JOB", job.c_str());
  Plugin pl;
  int mask = -1;

  SUBCASE("v3 cannot learn the rank") {
    ScopedEnv e2("BUBBLE_RANK", nullptr), e3("RANK", nullptr), e4("OMPI_COMM_WORLD_RANK", nullptr),
        e5("SLURM_PROCID", nullptr), e6("PMI_RANK", nullptr);
    void* ctx = reinterpret_cast<void*>(1);
    CHECK(pl.v3->init(&ctx, &mask) == ncclSuccess);
    CHECK(ctx == nullptr);
    CHECK(mask == 0);
    CHECK(pl.v3->finalize(ctx) == ncclSuccess);
  }
  SUBCASE("a bad rank variable") {
    ScopedEnv e2("BUBBLE_RANK", "seven");
    CHECK(pl.init_v5(0, &mask) == nullptr);
    CHECK(mask == 0);
  }
  SUBCASE("a bad lend specification") {
    ScopedEnv e2("BUBBLE_RANK", "0"), e3("BUBBLE_NCCL_LEND", "gpu:lots");
    CHECK(pl.init_v5(0, &mask) == nullptr);
    CHECK(mask == 0);
  }
  SUBCASE("the hub is owned by a live trainer") {
    ScopedEnv e2("BUBBLE_RANK", "0");
    bb_trainer_h t = nullptr;
    REQUIRE(bb_trainer_open(job.c_str(), 0, nullptr, &t) == BB_OK);
    CHECK(pl.init_v5(0, &mask) == nullptr);
    CHECK(mask == 0);
    bb_trainer_close(t);
    // Once it is free, the next communicator's init succeeds.
    void* ctx = pl.init_v5(0, &mask);
    CHECK(ctx != nullptr);
    if (ctx) pl.finalize(ctx);
  }
  CHECK(eventually([&] { return rt.files().empty(); }));
}

TEST_CASE("plugin_max_running_above_the_default_slot_count_gets_a_hub_that_large") {
  RuntimeDir rt;
  const std::string job = unique_job("nccl-wide");
  ScopedEnv e1("BUBBLE_JOB", job.c_str()), e2("BUBBLE_RANK", "0"),
      e3("BUBBLE_NCCL_MAX_RUNNING", "100");
  Plugin pl;
  int mask = 0;
  void* ctx = pl.init_v5(0, &mask);
  REQUIRE(ctx != nullptr);
  CHECK(attach_once(job) == BB_OK);
  pl.finalize(ctx);
}

namespace {
[[noreturn]] void throwing_logger(ncclDebugLogLevel, unsigned long, const char*, int, const char*,
                                  ...) {
  throw std::runtime_error("the logger failed");
}
}  // namespace

TEST_CASE("plugin_a_logger_that_throws_neither_disables_it_nor_leaks_its_hub") {
  // What the logger throws stays in the plugin: the init succeeds, and its finalize closes the
  // hub (an init that failed after publishing the hub left it open for good).
  RuntimeDir rt;
  const std::string job = unique_job("nccl-log");
  ScopedEnv e1("BUBBLE_JOB", job.c_str()), e2("BUBBLE_RANK", "0");
  Plugin pl;
  int mask = 0;
  void* ctx = nullptr;
  REQUIRE(pl.v5->init(&ctx, 0x1234, &mask, "pp", 1, 2, 0, throwing_logger) == ncclSuccess);
  REQUIRE(ctx != nullptr);
  pl.track(ctx);
  CHECK(mask != 0);
  CHECK(attach_once(job) == BB_OK);
  pl.finalize(ctx);
  CHECK(attach_once(job) == BB_E_NOT_FOUND);
  CHECK(eventually([&] { return rt.files().empty(); }));
}

TEST_CASE("plugin_lends_memory_that_a_task_receives_as_a_grant") {
  RuntimeDir rt;
  const std::string job = unique_job("nccl-lend");
  ScopedEnv e1("BUBBLE_JOB", job.c_str()), e2("BUBBLE_RANK", "0"),
      e3("BUBBLE_NCCL_LEND", "host:4M");
  Plugin pl;
  int mask = 0;
  void* ctx = pl.init_v5(0, &mask);
  REQUIRE(ctx);
  Hub hub(rt, job, 0);
  Child task({BB_TEST_TASK, job, "0", "g", "imperative", "--mem", "1048576", "--grant-seed", "7"});
  REQUIRE(task.wait_line("ATTACHED") != "");
  CommV5 comm{pl, ctx};
  // Grants are made by the hub's service thread after the attach; receive until one is used.
  std::string granted;
  for (int i = 0; i < 200 && granted.empty(); ++i) {
    void* k = comm.kernel_channel(comm.enqueue("Recv", 1, 1), 0);
    granted = task.wait_line("GRANT", 20);
    comm.kernel_channel_done(k);
  }
  CHECK(granted.rfind("GRANT ", 0) == 0);
  pl.finalize(ctx);
}

TEST_CASE("plugin_lends_on_the_device_nccl_made_current_not_local_ranks") {
  // LOCAL_RANK counts the node's GPUs, but a rank numbers only those it sees, in its own order
  // (one each, with a CUDA_VISIBLE_DEVICES per rank). NCCL calls init on the thread where it made
  // the communicator's device current: the lend goes there. Here the device is 0, LOCAL_RANK 1,
  // and two GPUs are visible, so LOCAL_RANK would have named another rank's GPU.
  RuntimeDir rt;
  const std::string job = unique_job("nccl-dev");
  ScopedEnv e0("BUBBLE_CUDA_DRIVER", BUBBLE_CUDA_DOUBLE_PATH), e1("BUBBLE_CUDA_DOUBLE_DEVICES", "2"),
      e2("CUDA_VISIBLE_DEVICES", nullptr), e3("BUBBLE_JOB", job.c_str()), e4("BUBBLE_RANK", "0"),
      e5("LOCAL_RANK", "1"), e6("BUBBLE_NCCL_DEVICE", nullptr),
      e7("BUBBLE_NCCL_LEND", "cuda-vmm:4M");
  void* cuda = dlopen(BUBBLE_CUDA_DOUBLE_PATH, RTLD_NOW);
  REQUIRE(cuda);
  auto sym = [&](const char* name) {
    void* f = dlsym(cuda, name);
    REQUIRE(f);
    return f;
  };
  reinterpret_cast<void (*)()>(sym("bbdouble_reset"))();
  auto retain = reinterpret_cast<CUresult (*)(CUcontext*, CUdevice)>(sym("cuDevicePrimaryCtxRetain"));
  auto release = reinterpret_cast<CUresult (*)(CUdevice)>(sym("cuDevicePrimaryCtxRelease_v2"));
  auto set_current = reinterpret_cast<CUresult (*)(CUcontext)>(sym("cuCtxSetCurrent"));
  auto log = reinterpret_cast<size_t (*)(char*, size_t)>(sym("bbdouble_log"));
  REQUIRE(reinterpret_cast<CUresult (*)(unsigned)>(sym("cuInit"))(0) == CUDA_SUCCESS);
  CUcontext ctx = nullptr;
  REQUIRE(retain(&ctx, 0) == CUDA_SUCCESS);  // as cudaSetDevice(0) does
  REQUIRE(set_current(ctx) == CUDA_SUCCESS);
  {
    Plugin pl;
    int mask = 0;
    void* c = pl.init_v5(0, &mask);
    REQUIRE(c);
    std::string calls(1 << 20, '\0');
    calls.resize(log(calls.data(), calls.size()));
    INFO(calls);
    CHECK(calls.find("cuMemAddressReserve") != std::string::npos);  // it lent GPU memory
    // ... and nothing of it named the second GPU.
    CHECK(calls.find("dev=1") == std::string::npos);
    CHECK(calls.find("ordinal=1") == std::string::npos);
    pl.finalize(c);
  }
  set_current(nullptr);
  release(0);
  dlclose(cuda);
}
