#include "core/gpu_timing.h"

#include <cuda.h>
#include <dlfcn.h>
#include <sys/prctl.h>
#include <time.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/cuda_driver.h"
#include "core/error.h"
#include "core/thread.h"
#include "shm/futex.h"

namespace bb::core {
namespace {

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t,
                                      CUdriverProcAddressQueryResult*);

constexpr uint32_t kEventFlags = CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;

// The event entry points, resolved from the driver library CudaDriver loaded (the shared table
// of CudaDriver stays as it is: only stream timing needs these).
struct CudaEventApi {
  decltype(&::cuEventCreate) EventCreate = nullptr;
  decltype(&::cuEventRecord) EventRecord = nullptr;
  decltype(&::cuEventQuery) EventQuery = nullptr;
  decltype(&::cuEventDestroy) EventDestroy = nullptr;
  decltype(&::cuStreamWaitEvent) StreamWaitEvent = nullptr;
  decltype(&::cuIpcGetEventHandle) IpcGetEventHandle = nullptr;
  decltype(&::cuIpcOpenEventHandle) IpcOpenEventHandle = nullptr;
  decltype(&::cuStreamIsCapturing) StreamIsCapturing = nullptr;

  static bb_status resolve(const CudaDriver& drv, CudaEventApi* out, std::string* error);
};

class StreamTimingImpl final : public StreamTiming {
 public:
  static bb_status create(const CudaDriver& drv, const StreamTimingOptions& opts, Sink sink,
                          std::unique_ptr<StreamTiming>* out, std::string* error);
  // Stops the watcher (a bubble it opened is ended) and destroys the events.
  ~StreamTimingImpl() override;
  StreamTimingImpl(const StreamTimingImpl&) = delete;
  StreamTimingImpl& operator=(const StreamTimingImpl&) = delete;

  // The training thread's calls: one cuEventRecord and a ring push, at most one futex wake.
  // Call them from one thread at a time, with the stream's context current. *mark (may be
  // null) receives the mark's number. BB_E_FULL when `marks` are already in flight.
  bb_status mark_begin(void* stream, uint64_t expected_ns, uint64_t free_mem,
                       bb_bubble_kind kind, uint64_t* mark) override;
  bb_status mark_end(void* stream, uint64_t* mark) override;
  bb_status mark_iteration(void* stream, uint64_t* mark) override;

  // The IPC handle of the event that carries mark number `mark`; valid while that mark is one
  // of the last `marks` recorded (the event is reused after that).
  bb_status ipc_handle(uint64_t mark, unsigned char out[64], std::string* error) const override;
  StreamTimingStats stats() const override;

 private:
  enum : uint32_t { kBegin = 1, kEnd = 2, kIteration = 3 };
  struct Mark {
    uint32_t type = 0;
    uint32_t kind = 0;
    uint64_t expected_ns = 0;
    uint64_t free_mem = 0;
    uint64_t recorded_ns = 0;
  };

  StreamTimingImpl(const CudaDriver& drv, const CudaEventApi& api, const StreamTimingOptions& o,
                   Sink sink)
      : drv_(drv), api_(api), opts_(o), sink_(std::move(sink)) {}
  bb_status push(void* stream, const Mark& m, uint64_t* mark);
  void watch();
  void apply(const Mark& m);

  const CudaDriver& drv_;
  CudaEventApi api_;
  StreamTimingOptions opts_;
  Sink sink_;
  CudaPrimaryContext ctx_;
  std::vector<CUevent> events_;
  std::vector<Mark> ring_;
  alignas(64) std::atomic<uint64_t> tail_{0};  // written by the training thread
  alignas(64) std::atomic<uint64_t> head_{0};  // written by the watcher
  std::atomic<uint32_t> wake_seq_{0};
  std::atomic<uint32_t> sleeping_{0};
  std::atomic<bool> stop_{false};
  bool open_bubble_ = false;  // watcher only
  bool host_open_ = false;    // the marking thread's: a begin taken whose end is not yet
  std::thread watcher_;

  std::atomic<uint64_t> begins_{0}, ends_{0}, dropped_{0}, errors_{0};
  std::atomic<uint64_t> lag_last_{0}, lag_max_{0}, lag_sum_{0};
};

}  // namespace

bb_status CudaEventApi::resolve(const CudaDriver& drv, CudaEventApi* out, std::string* error) {
  // The same two ways CudaDriver resolves its table: cuGetProcAddress by base name at the ABI
  // version libbubble was written against, else dlsym of the versioned export.
  auto gpa = reinterpret_cast<GetProcAddressFn>(dlsym(drv.dl_handle, "cuGetProcAddress_v2"));
  auto resolve = [&](const char* base, const char* versioned) -> void* {
    if (gpa) {
      void* fn = nullptr;
      CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      if (gpa(base, &fn, kCudaAbiVersion, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &st) ==
              CUDA_SUCCESS &&
          fn && st == CU_GET_PROC_ADDRESS_SUCCESS)
        return fn;
    }
    return dlsym(drv.dl_handle, versioned);
  };
  CudaEventApi api;
#define BB_EVENT_RESOLVE_(member, base, versioned)                                          \
  api.member = reinterpret_cast<decltype(api.member)>(resolve(base, versioned));            \
  if (!api.member) {                                                                        \
    *error = "the CUDA driver '" + drv.path + "' has no entry point " versioned             \
             ": it is too old or not a CUDA driver; GPU-timed bubbles need driver API 11.0+";  \
    return BB_E_UNSUPPORTED;                                                                \
  }
  BB_EVENT_RESOLVE_(EventCreate, "cuEventCreate", "cuEventCreate")
  BB_EVENT_RESOLVE_(EventRecord, "cuEventRecord", "cuEventRecord")
  BB_EVENT_RESOLVE_(EventQuery, "cuEventQuery", "cuEventQuery")
  BB_EVENT_RESOLVE_(EventDestroy, "cuEventDestroy", "cuEventDestroy_v2")
  BB_EVENT_RESOLVE_(StreamWaitEvent, "cuStreamWaitEvent", "cuStreamWaitEvent")
  BB_EVENT_RESOLVE_(IpcGetEventHandle, "cuIpcGetEventHandle", "cuIpcGetEventHandle")
  BB_EVENT_RESOLVE_(IpcOpenEventHandle, "cuIpcOpenEventHandle", "cuIpcOpenEventHandle")
  BB_EVENT_RESOLVE_(StreamIsCapturing, "cuStreamIsCapturing", "cuStreamIsCapturing")
#undef BB_EVENT_RESOLVE_
  *out = api;
  return BB_OK;
}

bb_status StreamTimingImpl::create(const CudaDriver& drv, const StreamTimingOptions& opts,
                                   Sink sink, std::unique_ptr<StreamTiming>* out,
                                   std::string* error) {
  out->reset();
  if (opts.marks < 2 || opts.marks > 4096) {
    *error = "marks is " + std::to_string(opts.marks) + ": allow 2..4096 marks in flight";
    return BB_E_INVALID;
  }
  if (opts.poll_ns == 0 || opts.poll_ns > 100000000) {
    *error = "poll_ns is " + std::to_string(opts.poll_ns) + ": use 1 ns .. 100 ms";
    return BB_E_INVALID;
  }
  CudaEventApi api;
  bb_status st = CudaEventApi::resolve(drv, &api, error);
  if (st != BB_OK) return st;
  std::unique_ptr<StreamTimingImpl> t(new StreamTimingImpl(drv, api, opts, std::move(sink)));
  if ((st = t->ctx_.retain(drv, opts.device, error)) != BB_OK) return st;
  {
    CudaContextScope scope(drv, t->ctx_.get());
    if (scope.status() != BB_OK) {
      *error = "could not make the primary context of GPU " + std::to_string(opts.device) +
               " current";
      return scope.status();
    }
    t->events_.reserve(opts.marks);
    for (uint32_t i = 0; i < opts.marks; ++i) {
      CUevent e = nullptr;
      const CUresult rc = api.EventCreate(&e, kEventFlags);
      if (rc != CUDA_SUCCESS) {
        *error = drv.describe("cuEventCreate", rc) + " while creating stream-timing events";
        return cuda_status(rc);  // the destructor destroys the ones made
      }
      t->events_.push_back(e);
    }
  }
  t->ring_.resize(opts.marks);
  t->watcher_ = start_library_thread("bb-stream", [p = t.get()] { p->watch(); });
  *out = std::move(t);
  return BB_OK;
}

StreamTimingImpl::~StreamTimingImpl() {
  stop_.store(true);
  wake_seq_.fetch_add(1);
  shm::futex_wake(&wake_seq_, 1);
  if (watcher_.joinable()) watcher_.join();
  if (open_bubble_ && sink_.end) sink_.end();
  if (ctx_.get()) {
    CudaContextScope scope(drv_, ctx_.get());
    for (CUevent e : events_) api_.EventDestroy(e);
  }
}

bb_status StreamTimingImpl::push(void* stream, const Mark& m, uint64_t* mark) {
  const uint64_t t = tail_.load(std::memory_order_relaxed);
  // A begin is taken only with room for its end as well, and nothing else takes the room kept
  // for the end of an open one: a begin applied with its end refused would leave the bubble open
  // through the compute that follows.
  const uint64_t need = m.type == kEnd ? 1 : m.type == kBegin || host_open_ ? 2 : 1;
  if (t - head_.load(std::memory_order_acquire) + need > ring_.size()) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return fail(BB_E_FULL, "the GPU is %zu bubble marks behind this thread: the mark was "
                "dropped; raise marks in the stream-timing options", ring_.size());
  }
  // Recorded on a stream being captured into a CUDA graph, the event would become a node of the
  // graph, reached when the graph runs, never as a mark of this stream: the watcher would wait
  // for it in vain (and an end would come at once instead of when the GPU gets there).
  // A failed query is a refusal too: the legacy stream, asked about while another stream is
  // being captured, gives CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and recording on it then would
  // invalidate that capture.
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult qrc = api_.StreamIsCapturing(static_cast<CUstream>(stream), &capture);
  if (qrc == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    return fail(BB_E_STATE, "cuStreamIsCapturing on the trainer's stream failed: %s: another "
                "stream is being captured into a CUDA graph, and a mark on the legacy default "
                "stream would break that capture; mark the bubble outside the capture, or on a "
                "stream of its own", drv_.error_name(qrc));
  if (qrc != CUDA_SUCCESS)
    return fail(cuda_status(qrc), "cuStreamIsCapturing on the trainer's stream failed: %s: pass "
                "a live stream of the device given to the stream timing, from a thread where "
                "its context is current", drv_.error_name(qrc));
  if (capture != CU_STREAM_CAPTURE_STATUS_NONE)
    return fail(BB_E_STATE, "the stream is being captured into a CUDA graph, where a bubble "
                "mark is never reached as such: mark the bubble outside the capture (around the "
                "graph's launch)");
  const size_t slot = size_t(t % ring_.size());
  const CUresult rc = api_.EventRecord(events_[slot], static_cast<CUstream>(stream));
  if (rc != CUDA_SUCCESS)
    return fail(cuda_status(rc), "cuEventRecord on the trainer's stream failed: %s: pass a "
                "stream of the device given to the stream timing, from a thread where its "
                "context is current", drv_.error_name(rc));
  ring_[slot] = m;
  ring_[slot].recorded_ns = now_ns();
  if (m.type == kBegin) host_open_ = true;
  if (m.type == kEnd) host_open_ = false;
  // Dekker pair with the watcher: either it sees the new tail before sleeping, or we see it
  // sleeping and wake it.
  tail_.store(t + 1, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst)) {
    wake_seq_.fetch_add(1, std::memory_order_seq_cst);
    shm::futex_wake(&wake_seq_, 1);
  }
  if (mark) *mark = t;
  return BB_OK;
}

bb_status StreamTimingImpl::mark_begin(void* stream, uint64_t expected_ns, uint64_t free_mem,
                                   bb_bubble_kind kind, uint64_t* mark) {
  Mark m;
  m.type = kBegin;
  m.kind = uint32_t(kind);
  m.expected_ns = expected_ns;
  m.free_mem = free_mem;
  return push(stream, m, mark);
}

bb_status StreamTimingImpl::mark_end(void* stream, uint64_t* mark) {
  Mark m;
  m.type = kEnd;
  return push(stream, m, mark);
}

bb_status StreamTimingImpl::mark_iteration(void* stream, uint64_t* mark) {
  Mark m;
  m.type = kIteration;
  return push(stream, m, mark);
}

bb_status StreamTimingImpl::ipc_handle(uint64_t mark, unsigned char out[64],
                                       std::string* error) const {
  const uint64_t t = tail_.load(std::memory_order_acquire);
  if (mark >= t || t - mark > ring_.size()) {
    *error = "mark " + std::to_string(mark) + " is not one of the last " +
             std::to_string(ring_.size()) + " recorded (the next is " + std::to_string(t) + ")";
    return BB_E_NOT_FOUND;
  }
  CudaContextScope scope(drv_, ctx_.get());
  CUipcEventHandle h;
  static_assert(sizeof h == 64);
  const CUresult rc = api_.IpcGetEventHandle(&h, events_[size_t(mark % ring_.size())]);
  if (rc != CUDA_SUCCESS) {
    *error = drv_.describe("cuIpcGetEventHandle", rc);
    return cuda_status(rc);
  }
  std::memcpy(out, &h, sizeof h);
  return BB_OK;
}

void StreamTimingImpl::apply(const Mark& m) {
  if (m.type == kBegin) {
    if (sink_.begin) sink_.begin(m.expected_ns, m.free_mem, bb_bubble_kind(m.kind));
    open_bubble_ = true;
    begins_.fetch_add(1, std::memory_order_relaxed);
  } else if (m.type == kIteration) {
    if (sink_.iteration) sink_.iteration();
  } else if (open_bubble_) {
    if (sink_.end) sink_.end();
    open_bubble_ = false;
    ends_.fetch_add(1, std::memory_order_relaxed);
  }
}

void StreamTimingImpl::watch() {
  // Polls sleep poll_ns; the default timer slack (50 us) would stretch every one of them.
  prctl(PR_SET_TIMERSLACK, 1000ul, 0, 0, 0);
  // For the thread's life: the context, and relaxed capture mode, so its event queries are no
  // "unsafe call" to a graph capture in global mode (the default of torch.cuda.graph and the
  // CUDA runtime) that the application runs meanwhile on any other thread, which they would
  // invalidate.
  CudaContextScope scope(drv_, ctx_.get());
  const timespec poll{time_t(opts_.poll_ns / 1000000000ull), long(opts_.poll_ns % 1000000000ull)};
  while (!stop_.load(std::memory_order_acquire)) {
    const uint64_t h = head_.load(std::memory_order_relaxed);
    const uint32_t seq = wake_seq_.load(std::memory_order_seq_cst);
    if (tail_.load(std::memory_order_acquire) == h) {
      sleeping_.store(1, std::memory_order_seq_cst);
      if (tail_.load(std::memory_order_seq_cst) == h && !stop_.load())
        shm::futex_wait(&wake_seq_, seq, 100000000);
      sleeping_.store(0, std::memory_order_relaxed);
      continue;
    }
    const size_t slot = size_t(h % ring_.size());
    const CUresult rc = api_.EventQuery(events_[slot]);
    if (rc == CUDA_ERROR_NOT_READY) {
      nanosleep(&poll, nullptr);
      continue;
    }
    const Mark m = ring_[slot];
    if (rc == CUDA_SUCCESS) {
      const uint64_t now = now_ns();
      const uint64_t lag = now > m.recorded_ns ? now - m.recorded_ns : 0;
      lag_last_.store(lag, std::memory_order_relaxed);
      lag_sum_.fetch_add(lag, std::memory_order_relaxed);
      if (lag > lag_max_.load(std::memory_order_relaxed))
        lag_max_.store(lag, std::memory_order_relaxed);
      apply(m);
    } else {
      // The stream or its context is gone: the GPU will never report this mark. An end still
      // closes the bubble so tasks are not left running in it.
      errors_.fetch_add(1, std::memory_order_relaxed);
      if (m.type == kEnd) apply(m);
    }
    head_.store(h + 1, std::memory_order_release);
  }
}

bb_status StreamTiming::open(const StreamTimingOptions& opts, Sink sink,
                             std::unique_ptr<StreamTiming>* out, std::string* error) {
  const CudaDriver* drv = cuda_driver(error);
  if (!drv) return BB_E_UNSUPPORTED;
  StreamTimingOptions o = opts;
  if (o.device < 0) {
    // The trainer's stream is on the device its thread made current (cudaSetDevice, as each
    // rank of a job that sees every GPU of its node does); its events must be on that device,
    // or every record on the stream fails.
    if (!drv->current_device(&o.device)) o.device = 0;
  }
  return StreamTimingImpl::create(*drv, o, std::move(sink), out, error);
}

StreamTimingStats StreamTimingImpl::stats() const {
  StreamTimingStats s;
  s.marks = tail_.load();
  s.begins = begins_.load();
  s.ends = ends_.load();
  s.dropped = dropped_.load();
  s.query_errors = errors_.load();
  s.lag_last_ns = lag_last_.load();
  s.lag_max_ns = lag_max_.load();
  s.lag_sum_ns = lag_sum_.load();
  return s;
}

}  // namespace bb::core
