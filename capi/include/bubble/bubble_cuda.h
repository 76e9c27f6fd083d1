/*
 * libbubble: GPU-timed bubbles. Stream-ordered bubble begin/end for trainers that enqueue work
 * on a CUDA stream asynchronously (docs/FIND_MY_BUBBLES.md).
 *
 * bb_bubble_begin/bb_bubble_end read the host clock, but a training thread that enqueues kernels
 * asynchronously reaches them before its GPU reaches the idle time they mean. The calls below
 * record a CUDA event on the trainer's stream instead (never synchronizing, never waiting); a
 * watcher thread of the trainer process begins or ends the bubble when the GPU reaches the event,
 * so side tasks start and pause on the device's timeline. The watcher polls the pending event
 * every poll_ns (default 10 us): that, plus about a microsecond for the query, is the latency
 * added over the device's own timeline; between bubbles it sleeps.
 *
 * CUDA graphs: a mark on a stream being captured into a graph is refused (BB_E_STATE), since it
 * would become a node of the graph rather than a point of the stream; mark bubbles around the
 * graph's launch. So is a mark on the legacy default stream (0) while any stream is being
 * captured: recording there would break the capture. The watcher's event queries run in relaxed
 * capture mode, so they never invalidate a capture the application makes meanwhile (in the
 * default, global mode).
 *
 * The CUDA driver is loaded at run time as for memory grants; without one these functions fail
 * with BB_E_UNSUPPORTED. The naming contract of bubble.h applies.
 */
#ifndef BUBBLE_BUBBLE_CUDA_H
#define BUBBLE_BUBBLE_CUDA_H

#include <bubble/bubble.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bb_stream_timing *bb_stream_timing_h;

/* The device of the CUDA context current on the thread that opens the stream timing (the one
 * cudaSetDevice made current), else 0. */
#define BB_STREAM_TIMING_CURRENT_DEVICE (-1)

typedef struct bb_stream_timing_options_t {
  uint32_t size;    /* sizeof(bb_stream_timing_options_t) */
  int32_t device;   /* CUDA device ordinal of the trainer's stream (its events must be on that
                       device); default BB_STREAM_TIMING_CURRENT_DEVICE */
  uint32_t marks;   /* marks the GPU may lag behind the host, 2..4096; default 64 */
  uint32_t reserved0_;
  uint64_t poll_ns; /* watcher's poll interval while a mark is pending; default 10000 */
} bb_stream_timing_options_t;

#define BB_STREAM_TIMING_OPTIONS_INIT \
  {sizeof(bb_stream_timing_options_t), BB_STREAM_TIMING_CURRENT_DEVICE, 64u, 0u, 10000ull}
/* Writes exactly `size` bytes, as the *_init_sized functions of bubble.h do. */
BB_API void bb_stream_timing_options_init_sized(bb_stream_timing_options_t *opts, size_t size);
#define bb_stream_timing_options_init(opts) \
  bb_stream_timing_options_init_sized((opts), sizeof(bb_stream_timing_options_t))

/* Starts stream timing for a trainer: creates the events and the watcher thread ("bb-stream",
 * which blocks asynchronous signals like the hub's service thread). From then on
 * the watcher thread is the trainer's bubble thread: do not call bb_bubble_begin/end on this
 * trainer yourself while it is open, nor the other calls bubble.h reserves to the bubble thread:
 * mark iterations with bb_trainer_iteration_on_stream, and call bb_trainer_set_schedule before
 * opening. One per trainer: a second open gives BB_E_BUSY until the first is closed. opts may be
 * NULL. Close it before bb_trainer_close; a trainer closed with its timing still open stops the
 * timing first (its watcher ends the bubble it opened), after which the timing's calls give
 * BB_E_STATE, and the handle must still be closed. */
BB_API bb_status bb_stream_timing_open(bb_trainer_h trainer, const bb_stream_timing_options_t *opts,
                                       bb_stream_timing_h *out);
/* Stops the watcher (ending a bubble it opened; marks the GPU has not reached are dropped) and
 * frees the handle. NULL is accepted. */
BB_API bb_status bb_stream_timing_close(bb_stream_timing_h timing);

/* A bubble starts when the GPU reaches this point of `stream` (a CUstream / cudaStream_t; NULL
 * is the legacy default stream). Arguments as bb_bubble_begin. One cuEventRecord: no wait, no
 * synchronization; call from one thread at a time where the stream's context is current (any
 * thread that uses the CUDA runtime on that device). *mark (may be NULL) receives the mark's
 * number, for bb_stream_timing_event_handle. BB_E_FULL when the GPU is `marks` marks behind (a
 * begin needs room for its end too, so the end of a begin taken is never refused). */
BB_API bb_status bb_bubble_begin_on_stream(bb_stream_timing_h timing, void *stream,
                                           uint64_t expected_ns, uint64_t free_mem,
                                           bb_bubble_kind kind, uint64_t *mark);
/* The bubble ends when the GPU reaches this point of `stream`. */
BB_API bb_status bb_bubble_end_on_stream(bb_stream_timing_h timing, void *stream, uint64_t *mark);
/* A training iteration starts when the GPU reaches this point of `stream`: the stream-ordered
 * bb_trainer_iteration (which, while the timing is open, is not called directly). Marks share
 * the `marks` in flight with the bubble marks. */
BB_API bb_status bb_trainer_iteration_on_stream(bb_stream_timing_h timing, void *stream,
                                                uint64_t *mark);

/* The CUDA IPC handle (CUipcEventHandle, 64 bytes) of the event that carries a mark, for another
 * process to open with cuIpcOpenEventHandle and query (done = the GPU reached the mark) or wait
 * on with cuStreamWaitEvent. Valid while the mark is one of the last `marks` recorded:
 * BB_E_NOT_FOUND otherwise. */
BB_API bb_status bb_stream_timing_event_handle(bb_stream_timing_h timing, uint64_t mark,
                                               unsigned char handle[64]);

typedef struct bb_stream_timing_stats_t {
  uint32_t size;
  uint32_t reserved0_;
  uint64_t marks;        /* recorded */
  uint64_t begins;       /* bubbles begun when the GPU reached them */
  uint64_t ends;
  uint64_t dropped;      /* marks refused with BB_E_FULL */
  uint64_t query_errors; /* marks given up because the driver could not query them */
  uint64_t lag_last_ns;  /* host record -> GPU reached it, as the watcher saw it: how far */
  uint64_t lag_max_ns;   /* ahead of its GPU the training thread ran */
  uint64_t lag_sum_ns;
} bb_stream_timing_stats_t;

/* Set out->size first (BB_E_INVALID below 8). */
BB_API bb_status bb_stream_timing_stats(bb_stream_timing_h timing, bb_stream_timing_stats_t *out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* BUBBLE_BUBBLE_CUDA_H */
