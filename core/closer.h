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
#pragma once

#include <cstddef>
#include <cstdint>

namespace bb::core {

// Closes fds on the closer thread, in order, and returns at once. While kMaxQueuedCloses wait
// (the closer is stuck on one), further ones are closed here instead, and counted: a bound on
// what a stuck close can make the process hold, at the price of this caller's time.
void close_elsewhere(const int* fds, size_t n);

inline constexpr size_t kMaxQueuedCloses = 4096;

struct CloserStats {
  uint64_t queued = 0;         // handed to the closer thread
  uint64_t closed = 0;         // of those, closed
  uint64_t closed_inline = 0;  // closed by the caller because the queue was full
};
CloserStats closer_stats();

}  // namespace bb::core
