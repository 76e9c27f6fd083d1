// Closing descriptors off the hub's service thread.
//
// A descriptor a task sends the hub is the hub's to close, and so is the connection the task
// leaves (with whatever descriptors still sit in it). On a kernel that cannot refuse them
// (before Linux 6.16, see shm::refuse_passed_fds) a task can send one whose last close blocks: a
// TCP socket lingering over data its peer never reads, a file on a stalled network or FUSE mount.
// The service thread serves every task's attach, grants and revokes, and the trainer's close
// waits on it, so it never closes what a task could have handed it: it passes the descriptors to
// a closer thread of the library's own ("bb-closer", started on first use, with the process's
// signals left to the application like the hub's thread) and goes on.
//
// What the closer may hold is bounded: a stuck close must not let a task fill the trainer's
// descriptor table (its own opens, NCCL's sockets, CUDA's files would fail). Sockets are made to
// close at once (an abortive close: SO_LINGER with no time), which takes the lingering socket off
// the table; for what remains (a stalled mount) the queue holds at most an eighth of the
// process's descriptor limit, and past that the caller closes for itself.
#pragma once

#include <cstddef>
#include <cstdint>

namespace bb::core {

// Closes fds (negative ones are skipped) on the closer thread, in order, and returns at once;
// the caller no longer owns them. A socket among them is set to close abortively first, so its
// close cannot wait on its peer. Never throws.
void close_elsewhere(const int* fds, size_t n);

struct CloserStats {
  uint64_t queued = 0;         // handed to the closer thread
  uint64_t closed = 0;         // of those, closed
  uint64_t closed_inline = 0;  // closed by the caller: the queue was full, or no thread ran
  uint64_t max_queued = 0;     // the bound on what waits at once
  bool started = false;        // the closer thread is running (the first thing it does)
};
CloserStats closer_stats();

}  // namespace bb::core
