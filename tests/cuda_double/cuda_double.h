/* Control interface of the fake CUDA driver (libbubble_cuda_double.so).
 *
 * The double implements the driver entry points libbubble uses, with host memory standing in for
 * device memory, and records what it was asked. Tests reach these functions with dlsym on the
 * handle the loader opened (CudaDriver::dl_handle), never by linking.
 *
 * Environment, read when the library loads and again by bbdouble_reset():
 *   BUBBLE_CUDA_DOUBLE_FAIL         comma-separated failures to inject, each KIND or KIND@N (the
 *                                   N-th call of that kind fails, counting from 1; without @N
 *                                   every call does). Kinds: oom (cuMemCreate, cuMemAlloc),
 *                                   export (cuMemExportToShareableHandle, cuIpcGetMemHandle),
 *                                   import (cuMemImportFromShareableHandle, cuIpcOpenMemHandle),
 *                                   map (cuMemMap), access (cuMemSetAccess),
 *                                   reserve (cuMemAddressReserve), event (cuEventCreate),
 *                                   stream (cuStreamCreate), memset (cuMemsetD8Async),
 *                                   memcpy (cuMemcpyAsync),
 *                                   sync (cuStreamSynchronize: the stream's queued work is
 *                                   dropped undone); export and import also cover
 *                                   cuIpcGet/OpenEventHandle.
 *   BUBBLE_CUDA_DOUBLE_DEVICES      GPUs to pretend (default 1; 0 makes cuInit fail NO_DEVICE).
 *   CUDA_VISIBLE_DEVICES            as the real driver reads it: which of those GPUs the
 *                                   process sees, and its ordinals for them. Each GPU has a
 *                                   UUID (cuDeviceGetUuid) and its memory remembers its GPU:
 *                                   an IPC handle or a VMM descriptor opened or given access
 *                                   from another GPU's context is recorded as a violation
 *                                   (peer access), and one of a GPU the process cannot see
 *                                   does not open (CUDA_ERROR_INVALID_DEVICE).
 *   BUBBLE_CUDA_DOUBLE_GRANULARITY  allocation granularity in bytes (default 2 MiB).
 *   BUBBLE_CUDA_DOUBLE_NO_PROC_ADDRESS=1  cuGetProcAddress finds nothing (loaders fall back).
 *   BUBBLE_CUDA_DOUBLE_NO_VMM=1     devices report no virtual memory management support.
 *   BUBBLE_CUDA_DOUBLE_FILL         the byte new cuMemAlloc/cuMemCreate memory holds (default
 *                                   0xa5): like the real driver, the double never zeroes it.
 *
 * cuMemsetD8Async and cuMemcpyAsync only queue their work on the stream; it lands when
 * cuStreamSynchronize (or cuStreamDestroy) of that stream lets "the GPU" reach it, so a caller
 * that does not wait reads the old bytes. An address inside a cuMemAlloc allocation or a VMM
 * reservation is device memory (it must be mapped when the copy is queued and when it runs, or
 * a violation is recorded); any other address is host memory.
 */
#ifndef BUBBLE_TESTS_CUDA_DOUBLE_H
#define BUBBLE_TESTS_CUDA_DOUBLE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct bbdouble_counts {
  uint64_t physical;      /* cuMemCreate/cuMemImportFromShareableHandle handles not released */
  uint64_t mappings;      /* cuMemMap ranges not unmapped */
  uint64_t reservations;  /* cuMemAddressReserve ranges not freed */
  uint64_t device_allocs; /* cuMemAlloc allocations not freed */
  uint64_t ipc_opens;     /* cuIpcOpenMemHandle references not closed */
  uint64_t ctx_retains;   /* primary context references not released */
  uint64_t proc_lookups;  /* symbols served by cuGetProcAddress since the last reset */
  uint64_t violations;    /* misuses seen since the last reset */
  uint64_t events;        /* cuEventCreate events not destroyed */
  uint64_t ipc_event_opens; /* cuIpcOpenEventHandle events not destroyed */
  uint64_t streams;       /* cuStreamCreate streams not destroyed */
} bbdouble_counts;

/* Re-reads the environment, clears the call log, the violations and the failure counters.
 * Allocations stay (they are real state). */
void bbdouble_reset(void);
void bbdouble_outstanding(bbdouble_counts *out);
/* The call log since the last reset, one "name key=value ... -> CUDA_..." line per call.
 * Copies up to cap - 1 bytes and a NUL; returns the full length. */
size_t bbdouble_log(char *buf, size_t cap);
/* The violations since the last reset, one per line; same convention. */
size_t bbdouble_violations(char *buf, size_t cap);

/* Stream order. The double runs no work: an event recorded on a stream stays not ready
 * (cuEventQuery gives CUDA_ERROR_NOT_READY) until the test lets "the GPU" reach it.
 * bbdouble_stream_progress completes the next n records of that stream in order (n < 0: all)
 * and returns how many; bbdouble_stream_pending says how many wait. Completion is seen by every
 * process that opened the event through cuIpcOpenEventHandle. */
int bbdouble_stream_progress(void *stream, int n);
int bbdouble_stream_pending(void *stream);

/* Graph capture. bbdouble_stream_capture marks a stream as being captured in global mode (or no
 * longer); cuStreamIsCapturing reports it. As with the driver, a potentially unsafe call from a
 * thread not in relaxed mode (cuThreadExchangeStreamCaptureMode) meanwhile fails with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates the capture, which
 * bbdouble_stream_capture_status then says (a CUstreamCaptureStatus). The double counts as
 * unsafe: cuEventQuery, cuStreamSynchronize, cuMemAlloc, cuMemFree, cuMemCreate, cuMemRelease,
 * and cuMemcpyAsync with an end in host memory. */
void bbdouble_stream_capture(void *stream, int capturing);
int bbdouble_stream_capture_status(void *stream);

#ifdef __cplusplus
}
#endif

#endif
