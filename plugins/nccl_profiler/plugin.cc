// libnccl-profiler-bubble.so: NCCL's profiler plugin interface (v3, v4, v5), reporting each
// rank's receive waits as bubbles to that rank's hub. Load it with
//   NCCL_PROFILER_PLUGIN=/path/to/libnccl-profiler-bubble.so   (or =bubble, found on the path)
// NCCL picks the newest version it knows. Every entry point returns ncclSuccess, an init that
// cannot open the hub too: it asks for no events (mask 0) and gives no context, so the plugin
// stays inert for that communicator. (An init error is no way out: NCCL 2.26 and 2.27 then
// drop the plugin and, when their last communicator goes, log its name through the pointer
// they just cleared.)
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "plugins/nccl_profiler/nccl_profiler_abi.h"
#include "plugins/nccl_profiler/rank_hub.h"
#include "plugins/nccl_profiler/recv_waits.h"

namespace bb::nccl {
namespace {

constexpr const char* kName = "bubble";
// What the plugin listens to. P2p gives the receive records, KernelCh the GPU's start and end of
// each channel, ProxyOp/ProxyStep the network arrival that ends a wait early.
constexpr int kMask = ncclProfileP2p | ncclProfileKernelCh | ncclProfileProxyOp |
                      ncclProfileProxyStep;

struct Context {
  int comm_rank;
};

// One hub per process while a communicator uses it, shared by every communicator, and one
// tracker for the life of the process: NCCL's threads may still deliver events of a communicator
// whose init failed (the event mask is NCCL's, not the communicator's) after the last one that
// opened the hub went away, so the tracker is never freed; it only stops reporting to the hub.
std::mutex g_mu;
int g_refs = 0;
RankHub* g_hub = nullptr;
std::atomic<RecvWaits*> g_waits{nullptr};
pid_t g_pid = 0;

// NCCL's logger (or a test's) must not undo an init: whatever it throws stays here.
void log(ncclDebugLogger_t logfn, ncclDebugLogLevel level, const std::string& msg) noexcept {
  if (!logfn) return;
  try {
    logfn(level, kNcclLogInit, __FILE__, __LINE__, "PROFILER/bubble: %s", msg.c_str());
  } catch (...) {
  }
}

// The event mask is NCCL's, for the whole process since v4 (NCCL's threads read it atomically):
// written under g_mu only, and 0 only while no communicator of ours reports, so another
// communicator's failed init never drops the events of one that works.
void set_mask(int* mask, int value) {
  if (mask) __atomic_store_n(mask, value, __ATOMIC_RELAXED);
}

// Says why the plugin reports nothing, once per reason: NCCL 2.28 calls init again for every
// communicator, and Megatron makes dozens.
void say_disabled(ncclDebugLogger_t logfn, const char* why) noexcept {
  // NCCL prints its own lines only with NCCL_DEBUG set; the user must learn why no bubbles.
  try {
    static std::string last;
    if (why == last) return;
    last = why;
    std::fprintf(stderr, "libnccl-profiler-bubble: disabled: %s\n", why);
    log(logfn, NCCL_LOG_WARN, std::string("disabled: ") + why);
  } catch (...) {  // out of memory as it is: say it without a string
    std::fprintf(stderr, "libnccl-profiler-bubble: disabled: %s\n", why);
  }
}

void init_locked(void** context, int* mask, int comm_rank, ncclDebugLogger_t logfn) {
  // Allocated first: nothing to undo if it fails.
  auto ctx = std::make_unique<Context>(Context{comm_rank});
  static RecvWaits* const waits = new RecvWaits(nullptr);  // for good: see above
  if (g_refs == 0) {
    HubConfig cfg;
    std::string error, warning;
    RankHub* hub = nullptr;
    if (!hub_config_from_env(comm_rank, &cfg, &error) ||
        RankHub::open(cfg, &hub, &error, &warning) != BB_OK) {
      set_mask(mask, 0);
      say_disabled(logfn, error.c_str());
      return;
    }
    // Closed again if anything below throws before the hub is published.
    std::unique_ptr<RankHub> owned(hub);
    if (!warning.empty()) {
      std::fprintf(stderr, "libnccl-profiler-bubble: %s\n", warning.c_str());
      log(logfn, NCCL_LOG_WARN, warning);
    }
    const std::string reporting = "reporting receive waits to hub " + cfg.job + "." +
                                  std::to_string(cfg.rank) + " (rank from " + cfg.rank_source +
                                  ")";
    // From here nothing throws: the hub is published and counted together.
    g_hub = owned.release();
    g_pid = getpid();
    waits->set_sink(hub);
    g_waits.store(waits, std::memory_order_release);
    log(logfn, NCCL_LOG_INFO, reporting);
  }
  ++g_refs;
  *context = ctx.release();
  set_mask(mask, kMask);
}

ncclResult_t init_common(void** context, int* mask, int comm_rank, ncclDebugLogger_t logfn) {
  *context = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  // Nothing may be thrown into NCCL: an allocation that fails leaves this communicator without
  // the plugin instead.
  try {
    init_locked(context, mask, comm_rank, logfn);
  } catch (const std::exception& e) {
    if (g_refs == 0) set_mask(mask, 0);
    say_disabled(logfn, e.what());
  }
  return ncclSuccess;
}

ncclResult_t finalize(void* context) {
  if (!context) return ncclSuccess;  // an init that failed counted nothing
  delete static_cast<Context*>(context);
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_refs > 0 && --g_refs == 0) {
    // Closes a bubble left open by a communicator torn down mid-receive, and waits for any call
    // still reporting to the hub before it goes.
    if (RecvWaits* w = g_waits.exchange(nullptr, std::memory_order_acq_rel)) w->set_sink(nullptr);
    delete g_hub;
    g_hub = nullptr;
  }
  return ncclSuccess;
}

Transition transition(ncclProfilerEventState_t s) {
  switch (s) {
    case ncclProfilerKernelChStop: return Transition::kKernelChannelDone;
    case ncclProfilerProxyStepRecvFlushWait:
    case ncclProfilerProxyStepRecvGPUWait:
    case ncclProfilerProxyOpRecvReceived: return Transition::kRecvDataArrived;
    default: return Transition::kOther;
  }
}

bool is_recv(const char* func) { return func && std::strcmp(func, "Recv") == 0; }

// The descriptors of every version name the same fields; only their layout differs.
template <typename Descr>
void* start(const Descr* d, int nchannels) {
  RecvWaits* w = g_waits.load(std::memory_order_acquire);
  if (!w || !d) return nullptr;
  switch (d->type) {
    case ncclProfileGroup: return RecvWaits::group_handle();
    case ncclProfileP2p: return w->p2p_start(is_recv(d->p2p.func), nchannels);
    case ncclProfileKernelCh: return w->kernel_channel_start(d->parentObj, d->kernelCh.channelId);
    case ncclProfileProxyOp:
      return w->proxy_op_start(d->parentObj, d->proxyOp.pid == g_pid, d->proxyOp.channelId,
                               d->proxyOp.isSend != 0);
    case ncclProfileProxyStep: return w->proxy_step_start(d->parentObj);
    default: return nullptr;
  }
}

ncclResult_t stop_event(void* handle) {
  if (RecvWaits* w = g_waits.load(std::memory_order_acquire)) w->stop(handle);
  return ncclSuccess;
}

ncclResult_t record(void* handle, ncclProfilerEventState_t state) {
  if (RecvWaits* w = g_waits.load(std::memory_order_acquire)) w->record(handle, transition(state));
  return ncclSuccess;
}

// ---- v5 ------------------------------------------------------------------------------------

ncclResult_t init_v5(void** context, uint64_t, int* mask, const char*, int, int, int rank,
                     ncclDebugLogger_t logfn) {
  return init_common(context, mask, rank, logfn);
}
ncclResult_t start_v5(void*, void** handle, ncclProfilerEventDescr_v5_t* d) {
  *handle = start(d, d && d->type == ncclProfileP2p ? d->p2p.nChannels : 0);
  return ncclSuccess;
}
ncclResult_t record_v5(void* handle, ncclProfilerEventState_t s, ncclProfilerEventStateArgs_v5_t*) {
  return record(handle, s);
}

// ---- v4 ------------------------------------------------------------------------------------

ncclResult_t init_v4(void** context, int* mask, const char*, uint64_t, int, int, int rank,
                     ncclDebugLogger_t logfn) {
  return init_common(context, mask, rank, logfn);
}
ncclResult_t start_v4(void*, void** handle, ncclProfilerEventDescr_v4_t* d) {
  *handle = start(d, d && d->type == ncclProfileP2p ? d->p2p.nChannels : 0);
  return ncclSuccess;
}
ncclResult_t record_v4(void* handle, ncclProfilerEventState_t s, ncclProfilerEventStateArgs_v4_t*) {
  return record(handle, s);
}

// ---- v3: no rank at init and no channel count ----------------------------------------------

ncclResult_t init_v3(void** context, int* mask) { return init_common(context, mask, -1, nullptr); }
ncclResult_t start_v3(void*, void** handle, ncclProfilerEventDescr_v3_t* d) {
  *handle = start(d, 0);
  return ncclSuccess;
}
ncclResult_t record_v3(void* handle, ncclProfilerEventState_t s, ncclProfilerEventStateArgs_v3_t*) {
  return record(handle, s);
}

}  // namespace
}  // namespace bb::nccl

extern "C" {

__attribute__((visibility("default"))) ncclProfiler_v5_t ncclProfiler_v5 = {
    bb::nccl::kName,       bb::nccl::init_v5,   bb::nccl::start_v5,
    bb::nccl::stop_event,  bb::nccl::record_v5, bb::nccl::finalize};

__attribute__((visibility("default"))) ncclProfiler_v4_t ncclProfiler_v4 = {
    bb::nccl::kName,       bb::nccl::init_v4,   bb::nccl::start_v4,
    bb::nccl::stop_event,  bb::nccl::record_v4, bb::nccl::finalize};

__attribute__((visibility("default"))) ncclProfiler_v3_t ncclProfiler_v3 = {
    bb::nccl::kName,       bb::nccl::init_v3,   bb::nccl::start_v3,
    bb::nccl::stop_event,  bb::nccl::record_v3, bb::nccl::finalize};

}  // extern "C"
