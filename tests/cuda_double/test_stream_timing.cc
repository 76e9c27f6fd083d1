// GPU-timed bubbles through the fake CUDA driver. The double runs no work: an event recorded on a
// stream completes only when the test lets "the GPU" reach it (bbdouble_stream_progress), so the
// tests can hold the device behind the host and check that bubbles follow the device.
#include <bubble/bubble.h>
#include <bubble/bubble_cuda.h>
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <thread>

#include "core/cuda_driver.h"
#include "core/gpu_timing.h"
#include "core/observer.h"
#include "tests/cuda_double/cuda_double.h"
#include "tests/helpers/proc.h"

using bbtest::Child;
using bbtest::RuntimeDir;
using bbtest::eventually;

namespace {

// The double, loaded as the process's CUDA driver, and its control functions.
struct Double {
  void* lib = nullptr;
  int (*progress)(void*, int) = nullptr;
  int (*pending)(void*) = nullptr;
  void (*outstanding)(bbdouble_counts*) = nullptr;
  size_t (*violations)(char*, size_t) = nullptr;
  size_t (*log)(char*, size_t) = nullptr;
  void (*capture)(void*, int) = nullptr;
  int (*capture_status)(void*) = nullptr;
  bb::core::CudaPrimaryContext ctx;
  std::unique_ptr<bb::core::CudaContextScope> scope;

  Double() {
    setenv("BUBBLE_CUDA_DRIVER", BUBBLE_CUDA_DOUBLE_PATH, 1);
    setenv("BUBBLE_CUDA_DOUBLE_DEVICES", "2", 1);  // a node's GPUs, as every rank sees them
    std::string err;
    const bb::core::CudaDriver* drv = bb::core::cuda_driver(&err);
    INFO(err);
    REQUIRE(drv);
    lib = dlopen(BUBBLE_CUDA_DOUBLE_PATH, RTLD_NOW | RTLD_NOLOAD);
    REQUIRE(lib);
    progress = reinterpret_cast<int (*)(void*, int)>(dlsym(lib, "bbdouble_stream_progress"));
    pending = reinterpret_cast<int (*)(void*)>(dlsym(lib, "bbdouble_stream_pending"));
    outstanding = reinterpret_cast<void (*)(bbdouble_counts*)>(dlsym(lib, "bbdouble_outstanding"));
    violations = reinterpret_cast<size_t (*)(char*, size_t)>(dlsym(lib, "bbdouble_violations"));
    log = reinterpret_cast<size_t (*)(char*, size_t)>(dlsym(lib, "bbdouble_log"));
    capture = reinterpret_cast<void (*)(void*, int)>(dlsym(lib, "bbdouble_stream_capture"));
    capture_status = reinterpret_cast<int (*)(void*)>(dlsym(lib, "bbdouble_stream_capture_status"));
    REQUIRE(bool(log));
    REQUIRE(bool(capture));
    REQUIRE(bool(capture_status));
    REQUIRE(bool(progress));
    REQUIRE(bool(outstanding));
    // The training thread works with its device's context current, as the CUDA runtime has it.
    REQUIRE(ctx.retain(*drv, 0, &err) == BB_OK);
    scope = std::make_unique<bb::core::CudaContextScope>(*drv, ctx.get());
  }
  // How many event queries so far found their mark not reached: the stream watcher's polls.
  size_t not_ready_queries() const {
    std::string s(log(nullptr, 0) + 1, '\0');
    s.resize(std::min(s.size() - 1, log(s.data(), s.size())));
    size_t n = 0;
    for (size_t at = 0; (at = s.find("cuEventQuery -> CUDA_ERROR_NOT_READY", at)) !=
                        std::string::npos; ++at)
      ++n;
    return n;
  }
  // Returns once the watcher has polled a mark not reached twice more: whatever it makes of
  // it, it has made by then.
  bool watcher_polled() const {
    const size_t from = not_ready_queries();
    return eventually([&] { return not_ready_queries() >= from + 2; });
  }
  ~Double() {
    scope.reset();
    ctx.reset();
    if (lib) dlclose(lib);
  }
  std::string violation_text() const {
    char buf[4096];
    violations(buf, sizeof buf);
    return buf;
  }
};

struct Hub {
  bb_trainer_h trainer = nullptr;
  std::unique_ptr<bb::core::HubObserver> obs;
  Hub(const RuntimeDir& rt, const char* job) {
    REQUIRE(bb_trainer_open(job, 0, nullptr, &trainer) == BB_OK);
    std::string err;
    REQUIRE(bb::core::HubObserver::open(rt.path(), job, 0, &obs, &err) == BB_OK);
  }
  ~Hub() {
    obs.reset();
    bb_trainer_close(trainer);
  }
  bool in_bubble() const { return obs->snapshot().in_bubble; }
  uint64_t bubbles() const { return obs->snapshot().bubbles; }
};

void* const kStream = reinterpret_cast<void*>(0x5157);  // the trainer's CUstream

struct Timing {
  bb_stream_timing_h h = nullptr;
  // device -2: the options' default
  explicit Timing(bb_trainer_h t, uint32_t marks = 64, int device = -2) {
    bb_stream_timing_options_t o;
    bb_stream_timing_options_init(&o);
    o.marks = marks;
    if (device != -2) o.device = device;
    const bb_status st = bb_stream_timing_open(t, &o, &h);
    INFO(bb_last_error());
    REQUIRE(st == BB_OK);
  }
  ~Timing() { bb_stream_timing_close(h); }
  bb_stream_timing_stats_t stats() const {
    bb_stream_timing_stats_t s{sizeof s};
    REQUIRE(bb_stream_timing_stats(h, &s) == BB_OK);
    return s;
  }
};

}  // namespace

// Allocations made by this thread while `counting` (operator new is this program's: the
// library's calls come here too): the mark calls must make none, on their error paths too.
namespace {
thread_local bool t_counting = false;
thread_local int t_allocations = 0;
}  // namespace

// malloc and free behind new and delete, as the default ones have them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(size_t n) {
  if (t_counting) ++t_allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace {
// The allocations f makes on this thread.
template <typename F>
int allocations_of(F&& f) {
  t_allocations = 0;
  t_counting = true;
  f();
  t_counting = false;
  return t_allocations;
}
}  // namespace

TEST_CASE("stream_bubble_starts_the_task_when_the_gpu_reaches_it_not_when_the_host_calls") {
  Double dbl;
  RuntimeDir rt;
  const std::string job = "st-" + std::to_string(getpid());
  Hub hub(rt, job.c_str());
  Child task({BB_TEST_TASK, job, "0", "t", "imperative", "--step-us", "100"});
  REQUIRE(task.wait_line("ATTACHED") != "");
  REQUIRE(eventually([&] { return hub.obs->snapshot().tasks.size() == 1; }));
  {
    Timing timing(hub.trainer);
    uint64_t mark = 99;
    REQUIRE(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                      &mark) == BB_OK);
    CHECK(mark == 0);
    // The host is past the call; the GPU is not there yet: no bubble, no start.
    REQUIRE(dbl.watcher_polled());
    CHECK_FALSE(hub.in_bubble());
    CHECK(dbl.pending(kStream) == 1);

    CHECK(dbl.progress(kStream, 1) == 1);  // the GPU reaches the mark
    CHECK(eventually([&] { return hub.in_bubble(); }));
    CHECK(task.wait_line("STARTED 1") != "");

    REQUIRE(bb_bubble_end_on_stream(timing.h, kStream, &mark) == BB_OK);
    CHECK(mark == 1);
    REQUIRE(dbl.watcher_polled());
    CHECK(hub.in_bubble());  // the GPU is still in the bubble: the task keeps running
    dbl.progress(kStream, -1);
    CHECK(eventually([&] { return !hub.in_bubble(); }));
    CHECK(eventually([&] {
      auto t = hub.obs->snapshot().tasks;
      return t.size() == 1 && !t[0].started;
    }));
    // The watcher counts an end just after applying it.
    CHECK(eventually([&] { return timing.stats().ends == 1; }));
    const auto s = timing.stats();
    CHECK(s.marks == 2);
    CHECK(s.begins == 1);
    CHECK(s.ends == 1);
    CHECK(s.lag_max_ns >= s.lag_last_ns);
    CHECK(s.lag_sum_ns > 0);
  }
  bbdouble_counts c{};
  dbl.outstanding(&c);
  CHECK(c.events == 0);
  CHECK(c.violations == 0);
  INFO(dbl.violation_text());
}

// The watcher thread, like the hub's service thread, leaves the process's signals to the
// application's threads.
TEST_CASE("the_stream_watcher_leaves_the_processs_signals_to_the_application") {
  Double dbl;
  RuntimeDir rt;
  const std::string job = "sw-" + std::to_string(getpid());
  Hub hub(rt, job.c_str());
  const auto before = bbtest::thread_ids();
  Timing timing(hub.trainer);
  size_t started = 0;
  CHECK(bbtest::misplaced_signal_masks(before, &started) == "");
  CHECK(started == 1);
}

TEST_CASE("stream_marks_never_wait_for_a_gpu_that_lags_behind") {
  Double dbl;
  RuntimeDir rt;
  Hub hub(rt, ("st-full-" + std::to_string(getpid())).c_str());
  Timing timing(hub.trainer, 4);
  for (int i = 0; i < 2; ++i) {
    REQUIRE(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                      nullptr) == BB_OK);
    REQUIRE(bb_bubble_end_on_stream(timing.h, kStream, nullptr) == BB_OK);
  }
  // Four marks in flight: the fifth is refused at once, with the reason, not waited for, and
  // without allocating (a training thread's call, whatever it returns).
  bb_status st = BB_OK;
  CHECK(allocations_of([&] {
          st = bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                         nullptr);
        }) == 0);
  CHECK(st == BB_E_FULL);
  CHECK(std::string(bb_last_error()).find("marks behind") != std::string::npos);
  dbl.progress(kStream, -1);
  CHECK(eventually([&] { return timing.stats().ends == 2; }));
  CHECK(hub.bubbles() == 2);
  CHECK(timing.stats().dropped == 1);
  // Room again.
  CHECK(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                  nullptr) == BB_OK);
}

TEST_CASE("a_trainer_closed_with_its_stream_timing_open_stops_the_timing_first") {
  // The watcher calls bb_bubble_begin and _end on the trainer: closed first, the trainer was
  // freed under it, and the timing's close released the claim on freed memory.
  Double dbl;
  RuntimeDir rt;
  bb_trainer_h trainer = nullptr;
  REQUIRE(bb_trainer_open(("st-order-" + std::to_string(getpid())).c_str(), 0, nullptr,
                          &trainer) == BB_OK);
  bb_stream_timing_h timing = nullptr;
  REQUIRE(bb_stream_timing_open(trainer, nullptr, &timing) == BB_OK);
  REQUIRE(bb_bubble_begin_on_stream(timing, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                    nullptr) == BB_OK);
  REQUIRE(bb_bubble_end_on_stream(timing, kStream, nullptr) == BB_OK);
  const int threads_open = int(bbtest::list_dir("/proc/self/task").size());
  CHECK(bb_trainer_close(trainer) == BB_OK);
  // The watcher is gone with the trainer's own threads, and the GPU reaching the marks now
  // reaches nobody.
  CHECK(int(bbtest::list_dir("/proc/self/task").size()) < threads_open);
  dbl.progress(kStream, -1);
  CHECK(bb_bubble_begin_on_stream(timing, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                  nullptr) == BB_E_STATE);
  CHECK(std::string(bb_last_error()).find("bb_stream_timing_close") != std::string::npos);
  bb_stream_timing_stats_t st{sizeof st};
  CHECK(bb_stream_timing_stats(timing, &st) == BB_E_STATE);
  CHECK(bb_stream_timing_close(timing) == BB_OK);
  bbdouble_counts c{};
  dbl.outstanding(&c);
  CHECK(c.events == 0);
}

TEST_CASE("stream_timing_makes_its_events_on_the_device_its_thread_made_current") {
  // Each rank of a job that sees every GPU of its node makes its own current (set_device) and
  // runs its stream there. Events made on GPU 0, as the options' old default had it, record on
  // no stream of another GPU: every mark of ranks 1..N failed.
  Double dbl;
  RuntimeDir rt;
  Hub hub(rt, ("st-dev-" + std::to_string(getpid())).c_str());
  std::string err;
  const bb::core::CudaDriver* drv = bb::core::cuda_driver(&err);
  REQUIRE(drv);
  REQUIRE(drv->device_count == 2);
  bb::core::CudaPrimaryContext second;
  REQUIRE(second.retain(*drv, 1, &err) == BB_OK);
  {
    bb::core::CudaContextScope on_gpu1(*drv, second.get());
    {
      Timing timing(hub.trainer);  // the default: the current device
      CHECK(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                      nullptr) == BB_OK);
      CHECK(bb_bubble_end_on_stream(timing.h, kStream, nullptr) == BB_OK);
      dbl.progress(kStream, -1);
      CHECK(eventually([&] { return timing.stats().ends == 1; }));
    }
    // Told another device than the stream's, the mark is refused with the call and the fix.
    Timing wrong(hub.trainer, 64, 0);
    CHECK(bb_bubble_begin_on_stream(wrong.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                    nullptr) != BB_OK);
    const std::string why = bb_last_error();
    CHECK_MESSAGE(why.find("cuEventRecord") != std::string::npos, why);
    CHECK_MESSAGE(why.find("device given to the stream timing") != std::string::npos, why);
  }
  CHECK(hub.bubbles() == 1);
}

TEST_CASE("stream_timing_keeps_out_of_cuda_graph_captures") {
  Double dbl;
  RuntimeDir rt;
  Hub hub(rt, ("st-graph-" + std::to_string(getpid())).c_str());
  Timing timing(hub.trainer);
  void* const captured = reinterpret_cast<void*>(0x6a7a);
  dbl.capture(captured, 1);
  // A mark on a stream being captured would be a node of the graph, never reached as a mark.
  // Refused without allocating, as every mark call returns: none beyond those of the double's
  // own capture query (it logs every call), which the real driver, a C library, does not make.
  auto is_capturing = reinterpret_cast<CUresult (*)(CUstream, CUstreamCaptureStatus*)>(
      dlsym(dbl.lib, "cuStreamIsCapturing"));
  REQUIRE(bool(is_capturing));
  CUstreamCaptureStatus cs{};
  const int query = allocations_of([&] { is_capturing(static_cast<CUstream>(captured), &cs); });
  bb_status st = BB_OK;
  CHECK(allocations_of([&] {
          st = bb_bubble_begin_on_stream(timing.h, captured, 0, BB_MEM_UNKNOWN,
                                         BB_BUBBLE_STEADY, nullptr);
        }) == query);
  CHECK(st == BB_E_STATE);
  CHECK(std::string(bb_last_error()).find("CUDA graph") != std::string::npos);
  CHECK(dbl.pending(captured) == 0);
  // Nor on the legacy default stream meanwhile: the driver's capture query fails there, and a
  // record would invalidate the capture (a mark went ahead when the query failed).
  CHECK(bb_bubble_begin_on_stream(timing.h, nullptr, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                  nullptr) == BB_E_STATE);
  const std::string why = bb_last_error();
  CHECK_MESSAGE(why.find("CUDA_ERROR_STREAM_CAPTURE_IMPLICIT") != std::string::npos, why);
  CHECK(dbl.capture_status(captured) == int(CU_STREAM_CAPTURE_STATUS_ACTIVE));
  // While that capture goes on, the watcher polls a mark of another stream. In the driver's
  // default (global) mode its queries would invalidate the capture; it polls in relaxed mode.
  REQUIRE(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                    nullptr) == BB_OK);
  REQUIRE(dbl.watcher_polled());
  CHECK(dbl.capture_status(captured) == int(CU_STREAM_CAPTURE_STATUS_ACTIVE));
  dbl.capture(captured, 0);
  dbl.progress(kStream, -1);
  CHECK(eventually([&] { return hub.in_bubble(); }));
  CHECK(timing.stats().query_errors == 0);
}

TEST_CASE("an_iteration_marked_on_a_stream_starts_when_the_gpu_gets_there") {
  Double dbl;
  std::atomic<int> iterations{0}, begins{0}, ends{0};
  bb::core::StreamTiming::Sink sink;
  sink.begin = [&](uint64_t, uint64_t, bb_bubble_kind) { ++begins; };
  sink.end = [&] { ++ends; };
  sink.iteration = [&] { ++iterations; };
  bb::core::StreamTimingOptions so;
  so.marks = 4;
  std::unique_ptr<bb::core::StreamTiming> t;
  std::string err;
  REQUIRE(bb::core::StreamTiming::open(so, sink, &t, &err) == BB_OK);
  REQUIRE(t->mark_iteration(kStream, nullptr) == BB_OK);
  REQUIRE(t->mark_begin(kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY, nullptr) == BB_OK);
  REQUIRE(t->mark_iteration(kStream, nullptr) == BB_OK);
  // One slot left, kept for the open bubble's end: no other mark takes it.
  CHECK(t->mark_iteration(kStream, nullptr) == BB_E_FULL);
  REQUIRE(t->mark_end(kStream, nullptr) == BB_OK);
  REQUIRE(dbl.watcher_polled());
  CHECK(iterations.load() == 0);  // the GPU is not there yet
  dbl.progress(kStream, 1);
  CHECK(eventually([&] { return iterations.load() == 1; }));
  CHECK(begins.load() == 0);  // the begin is behind it
  dbl.progress(kStream, -1);
  CHECK(eventually([&] { return ends.load() == 1; }));
  CHECK(iterations.load() == 2);
  CHECK(begins.load() == 1);
  // Through the C ABI, on a trainer: the mark goes to the same ring.
  RuntimeDir rt;
  Hub hub(rt, ("st-iter-" + std::to_string(getpid())).c_str());
  Timing timing(hub.trainer, 4);
  CHECK(bb_trainer_iteration_on_stream(nullptr, kStream, nullptr) == BB_E_INVALID);
  uint64_t mark = 99;
  REQUIRE(bb_trainer_iteration_on_stream(timing.h, kStream, &mark) == BB_OK);
  CHECK(mark == 0);
  dbl.progress(kStream, -1);
}

TEST_CASE("a_stream_begin_is_taken_only_with_room_for_its_end") {
  Double dbl;
  RuntimeDir rt;
  Hub hub(rt, ("st-pair-" + std::to_string(getpid())).c_str());
  Timing timing(hub.trainer, 4);
  REQUIRE(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                    nullptr) == BB_OK);
  REQUIRE(bb_bubble_end_on_stream(timing.h, kStream, nullptr) == BB_OK);
  REQUIRE(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                    nullptr) == BB_OK);
  // One slot left: it is the end's of the begin just taken, so a further begin is refused
  CHECK(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                  nullptr) == BB_E_FULL);
  // ... and that end is not (refused, the bubble would stay open through the next compute).
  CHECK(bb_bubble_end_on_stream(timing.h, kStream, nullptr) == BB_OK);
  dbl.progress(kStream, -1);
  CHECK(eventually([&] { return timing.stats().ends == 2; }));
  CHECK(hub.bubbles() == 2);
  CHECK_FALSE(hub.in_bubble());
}

TEST_CASE("stream_mark_event_is_seen_by_another_process_through_its_ipc_handle") {
  Double dbl;
  RuntimeDir rt;
  Hub hub(rt, ("st-ipc-" + std::to_string(getpid())).c_str());
  Timing timing(hub.trainer);
  uint64_t mark = 0;
  REQUIRE(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_WARMUP,
                                    &mark) == BB_OK);
  unsigned char handle[64];
  REQUIRE(bb_stream_timing_event_handle(timing.h, mark, handle) == BB_OK);
  char hex[129];
  for (int i = 0; i < 64; ++i) std::snprintf(hex + 2 * i, 3, "%02x", handle[i]);
  Child peer({BB_EVENT_PEER, hex});
  REQUIRE(peer.wait_line("OPENED") != "");
  CHECK(peer.wait_line("NOT_READY") != "");
  dbl.progress(kStream, 1);
  CHECK(peer.wait_line("READY") != "");
  CHECK(peer.wait_exit() == 0);
  CHECK(eventually([&] { return hub.in_bubble(); }));
  // A mark never recorded, or one whose event was reused, has no handle.
  CHECK(bb_stream_timing_event_handle(timing.h, mark + 1, handle) == BB_E_NOT_FOUND);
}

TEST_CASE("stream_timing_closed_mid_bubble_ends_it_and_frees_everything") {
  Double dbl;
  RuntimeDir rt;
  Hub hub(rt, ("st-close-" + std::to_string(getpid())).c_str());
  bbdouble_counts before{};
  dbl.outstanding(&before);
  {
    Timing timing(hub.trainer);
    REQUIRE(bb_bubble_begin_on_stream(timing.h, kStream, 0, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY,
                                      nullptr) == BB_OK);
    dbl.progress(kStream, -1);
    REQUIRE(eventually([&] { return hub.in_bubble(); }));
    // An end the GPU never reaches (the stream's work was abandoned).
    REQUIRE(bb_bubble_end_on_stream(timing.h, kStream, nullptr) == BB_OK);
  }
  CHECK_FALSE(hub.in_bubble());
  bbdouble_counts after{};
  dbl.outstanding(&after);
  CHECK(after.events == before.events);
  CHECK(after.ctx_retains == before.ctx_retains);
  CHECK(dbl.pending(kStream) == 0);
}

TEST_CASE("stream_timing_rejects_bad_arguments_with_a_reason") {
  Double dbl;
  RuntimeDir rt;
  Hub hub(rt, ("st-bad-" + std::to_string(getpid())).c_str());
  bb_stream_timing_h h = nullptr;
  bb_stream_timing_options_t o;
  bb_stream_timing_options_init(&o);
  o.marks = 1;
  CHECK(bb_stream_timing_open(hub.trainer, &o, &h) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("2..4096") != std::string::npos);
  o.marks = 8;
  o.device = 5;
  CHECK(bb_stream_timing_open(hub.trainer, &o, &h) == BB_E_INVALID);
  CHECK(std::string(bb_last_error()).find("does not exist") != std::string::npos);
  o.device = 0;
  o.size = 4;
  CHECK(bb_stream_timing_open(hub.trainer, &o, &h) == BB_E_INVALID);
  CHECK(bb_stream_timing_open(nullptr, nullptr, &h) == BB_E_INVALID);
  CHECK(h == nullptr);
  CHECK(bb_bubble_begin_on_stream(nullptr, kStream, 0, 0, BB_BUBBLE_STEADY, nullptr) ==
        BB_E_INVALID);
  CHECK(bb_stream_timing_close(nullptr) == BB_OK);
  Timing timing(hub.trainer);
  // Its watcher is the trainer's bubble thread: a second one would call begin and end at once.
  bb_stream_timing_h second = nullptr;
  CHECK(bb_stream_timing_open(hub.trainer, nullptr, &second) == BB_E_BUSY);
  CHECK(std::string(bb_last_error()).find("already has a stream timing open") !=
        std::string::npos);
  CHECK(second == nullptr);
  {  // A size that ends inside a field.
    bb_stream_timing_options_t odd;
    bb_stream_timing_options_init(&odd);
    odd.size = sizeof odd + 4;
    CHECK(bb_stream_timing_open(hub.trainer, &odd, &second) == BB_E_INVALID);
  }
  CHECK(bb_bubble_begin_on_stream(timing.h, kStream, 0, 0, bb_bubble_kind(9), nullptr) ==
        BB_E_INVALID);
  // Closed, the trainer takes another.
  bb_stream_timing_close(timing.h);
  timing.h = nullptr;
  CHECK(bb_stream_timing_open(hub.trainer, nullptr, &second) == BB_OK);
  bb_stream_timing_close(second);
}
