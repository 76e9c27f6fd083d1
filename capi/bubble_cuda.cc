// The C ABI of GPU-timed bubbles: argument checks and translation to core/gpu_timing.
#include <bubble/bubble_cuda.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>

#include "capi/abi.h"
#include "core/error.h"
#include "core/gpu_timing.h"
#include "core/trainer.h"

using bb::capi::impl;

namespace {

// The options' size in the first release. The struct has not grown since: when it does, this
// becomes the offset of the first new field.
constexpr size_t kFirstStreamTimingOptions = sizeof(bb_stream_timing_options_t);
}  // namespace

struct bb_stream_timing {
  bb_trainer_h trainer = nullptr;
  bool driving = false;  // holds the trainer's claim_bubble_driver()
  std::unique_ptr<bb::core::StreamTiming> impl;  // null once its trainer was closed
  ~bb_stream_timing() {
    impl.reset();  // its watcher's last bubble end comes first
    if (driving) bb::capi::impl(trainer)->release_bubble_driver();
  }
  // The trainer closes (bb_trainer_close) with this timing still open: the watcher ends the
  // bubble it opened and stops, the events go, and the handle only waits to be closed.
  static void trainer_closing(void* self) {
    auto* t = static_cast<bb_stream_timing*>(self);
    t->impl.reset();
    t->driving = false;
    t->trainer = nullptr;
  }
};

using bb::core::fail;
using bb::core::fail_msg;

namespace {
bb_status trainer_closed() {
  return fail(BB_E_STATE, "the trainer of this stream timing was closed (which stopped the "
              "timing): close the timing too, with bb_stream_timing_close");
}
}  // namespace

extern "C" {

BB_API void bb_stream_timing_options_init_sized(bb_stream_timing_options_t* opts, size_t size) {
  bb::capi::init_sized(opts, size, bb_stream_timing_options_t BB_STREAM_TIMING_OPTIONS_INIT);
}

// The initialiser programs built against the first header call (the header now makes the name
// a macro over the _sized form): that struct has not grown, so its size is the first's.
#undef bb_stream_timing_options_init
BB_API void bb_stream_timing_options_init(bb_stream_timing_options_t* opts) {
  bb_stream_timing_options_init_sized(opts, kFirstStreamTimingOptions);
}

BB_API bb_status bb_stream_timing_open(bb_trainer_h trainer, const bb_stream_timing_options_t* opts,
                                       bb_stream_timing_h* out) {
  if (!out) return fail(BB_E_INVALID, "out is NULL: pass the address of a bb_stream_timing_h");
  *out = nullptr;
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL: open one with bb_trainer_open");
  bb_stream_timing_options_t o;
  const bb_status read = bb::capi::read_options(
      opts, bb_stream_timing_options_t BB_STREAM_TIMING_OPTIONS_INIT, kFirstStreamTimingOptions,
      "bb_stream_timing_options_t", &o);
  if (read != BB_OK) return read;
  std::string error;
  try {
    auto h = std::make_unique<bb_stream_timing>();
    h->trainer = trainer;
    if (!impl(trainer)->claim_bubble_driver(h.get(), &bb_stream_timing::trainer_closing))
      return fail(BB_E_BUSY, "this trainer already has a stream timing open, whose watcher "
                  "thread is its bubble thread: close that one first (one per trainer)");
    h->driving = true;
    bb::core::StreamTiming::Sink sink;
    // The watcher thread becomes the trainer's bubble thread: begin/end stay bounded and
    // non-blocking, and only this thread calls them while the timing is open.
    sink.begin = [trainer](uint64_t expected, uint64_t free_mem, bb_bubble_kind kind) {
      bb_bubble_begin(trainer, expected, free_mem, kind);
    };
    sink.end = [trainer] { bb_bubble_end(trainer); };
    sink.iteration = [trainer] { bb_trainer_iteration(trainer); };
    bb::core::StreamTimingOptions so;
    so.device = o.device;
    so.marks = o.marks;
    so.poll_ns = o.poll_ns;
    const bb_status st = bb::core::StreamTiming::open(so, std::move(sink), &h->impl, &error);
    if (st != BB_OK) return fail_msg(st, error);
    *out = h.release();
    return BB_OK;
  } catch (const std::bad_alloc&) {
    return fail(BB_E_NOMEM, "out of memory");
  } catch (const std::exception& e) {  // no thread for the watcher (a thread limit), say
    return fail(BB_E_SYSTEM, "cannot open stream timing: %s", e.what());
  }
}

BB_API bb_status bb_stream_timing_close(bb_stream_timing_h timing) {
  delete timing;
  return BB_OK;
}

BB_API bb_status bb_bubble_begin_on_stream(bb_stream_timing_h timing, void* stream,
                                           uint64_t expected_ns, uint64_t free_mem,
                                           bb_bubble_kind kind, uint64_t* mark) {
  if (!timing) return fail(BB_E_INVALID, "timing is NULL: open it with bb_stream_timing_open");
  if (!timing->impl) return trainer_closed();
  if (uint32_t(kind) >= BB_BUBBLE_KIND_COUNT_)
    return fail(BB_E_INVALID, "kind %d is not a bb_bubble_kind", int(kind));
  // Bounded time and no allocation, failures too: the sentence goes straight to the last error.
  return timing->impl->mark_begin(stream, expected_ns, free_mem, kind, mark);
}

BB_API bb_status bb_bubble_end_on_stream(bb_stream_timing_h timing, void* stream, uint64_t* mark) {
  if (!timing) return fail(BB_E_INVALID, "timing is NULL: open it with bb_stream_timing_open");
  if (!timing->impl) return trainer_closed();
  return timing->impl->mark_end(stream, mark);
}

BB_API bb_status bb_trainer_iteration_on_stream(bb_stream_timing_h timing, void* stream,
                                                uint64_t* mark) {
  if (!timing) return fail(BB_E_INVALID, "timing is NULL: open it with bb_stream_timing_open");
  if (!timing->impl) return trainer_closed();
  return timing->impl->mark_iteration(stream, mark);
}

BB_API bb_status bb_stream_timing_event_handle(bb_stream_timing_h timing, uint64_t mark,
                                               unsigned char handle[64]) {
  if (!timing || !handle) return fail(BB_E_INVALID, "timing and handle must not be NULL");
  if (!timing->impl) return trainer_closed();
  std::string error;
  const bb_status st = timing->impl->ipc_handle(mark, handle, &error);
  return st == BB_OK ? BB_OK : fail_msg(st, error);
}

BB_API bb_status bb_stream_timing_stats(bb_stream_timing_h timing, bb_stream_timing_stats_t* out) {
  if (!timing) return fail(BB_E_INVALID, "timing is NULL: open it with bb_stream_timing_open");
  if (!out) return fail(BB_E_INVALID, "out is NULL");
  if (out->size < sizeof(uint32_t) * 2)
    return fail(BB_E_INVALID, "out->size is %u: set it to sizeof(bb_stream_timing_stats_t)",
                out->size);
  if (!timing->impl) return trainer_closed();
  const bb::core::StreamTimingStats s = timing->impl->stats();
  bb_stream_timing_stats_t v{};
  v.size = sizeof v;
  v.marks = s.marks;
  v.begins = s.begins;
  v.ends = s.ends;
  v.dropped = s.dropped;
  v.query_errors = s.query_errors;
  v.lag_last_ns = s.lag_last_ns;
  v.lag_max_ns = s.lag_max_ns;
  v.lag_sum_ns = s.lag_sum_ns;
  const uint32_t size = out->size;
  std::memcpy(out, &v, std::min<size_t>(size, sizeof v));
  out->size = size;
  return BB_OK;
}

}  // extern "C"
