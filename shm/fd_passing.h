// Passing file descriptors between processes: SCM_RIGHTS over a Unix socket, and pidfd_getfd.
//
// Grants of the host and cuda-vmm backends are file descriptors; they reach a task as ancillary
// data on its Unix socket. The peer may be hostile, so receiving is strict: every descriptor
// arrives close-on-exec, the count is bounded by the caller, and a message whose data or
// descriptors did not fit is an error that leaves no descriptor behind.
//
// Meant for SOCK_SEQPACKET (or SOCK_DGRAM) sockets, where one send is one message. On a
// SOCK_STREAM socket the descriptors ride with the first byte and the caller must frame the data.
#pragma once

#include <bubble/bubble.h>

#include <sys/types.h>

#include <cstddef>
#include <string>

namespace bb::shm {

// Most descriptors one message may carry (the kernel's own limit, SCM_MAX_FD, is 253).
inline constexpr size_t kMaxPassedFds = 16;

// Sends len bytes (1..64 KiB) and nfds descriptors (0..kMaxPassedFds) as one message. The
// descriptors stay open in the sender. Retries EINTR; on a non-blocking socket that is full,
// returns BB_E_BUSY. MSG_NOSIGNAL: a closed peer gives BB_E_SYSTEM (EPIPE), not SIGPIPE.
bb_status send_fds(int sock, const void* data, size_t len, const int* fds, size_t nfds,
                   std::string* error);

// Receives one message of at most cap bytes carrying at most max_fds (<= kMaxPassedFds)
// descriptors. On success *len and *nfds say what arrived; *len == 0 means the peer closed the
// socket (senders never send empty messages). Fails with BB_E_CORRUPT if the data or the
// descriptors were cut short (MSG_TRUNC, MSG_CTRUNC) or the ancillary data is not SCM_RIGHTS;
// whatever descriptors did arrive are then closed. A non-blocking socket with nothing to read
// gives BB_E_TIMEOUT.
bb_status recv_fds(int sock, void* data, size_t cap, size_t* len, int* fds, size_t max_fds,
                   size_t* nfds, std::string* error);

// pidfd_open(pid): a descriptor that names the process (not a recycled pid), close-on-exec.
bb_status pidfd_open_pid(pid_t pid, int* out, std::string* error);

// pidfd_getfd: a close-on-exec duplicate of descriptor target_fd of the process behind pidfd.
// Needs ptrace access to it (same user and, under Yama ptrace_scope=1, an ancestor) and
// Linux 5.6; fails with BB_E_PERMISSION or BB_E_UNSUPPORTED otherwise, saying which.
bb_status pidfd_get_fd(int pidfd, int target_fd, int* out, std::string* error);

}  // namespace bb::shm
