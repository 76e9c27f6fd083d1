// Passing file descriptors between processes (SCM_RIGHTS over a Unix socket), and pidfds.
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

// The system-call layer under both the hub's attach protocol (shm/wire.h) and the calls below:
// errno values, no messages.
//
// Sends len bytes and nfds (<= kMaxPassedFds) descriptors as one message, MSG_NOSIGNAL plus
// flags, retrying EINTR. Returns 0, EMSGSIZE if only part was sent (a stream socket), or errno.
int send_with_fds(int sock, const void* data, size_t len, const int* fds, size_t nfds, int flags);

// kNoRoom: descriptors came that this process had no room for (at RLIMIT_NOFILE, or the
// system's limit): the kernel installed what it could and dropped the rest.
enum class RecvProblem { kNone, kTooManyFds, kTooLong, kForeign, kNoRoom };

// What a receiver does with descriptors it does not keep: by default (nullptr) they are closed at
// once. A receiver that must never block (the hub's service thread) passes one that closes them
// on another thread: the close of some blocks (see refuse_passed_fds).
using DisposeFds = void (*)(const int* fds, size_t n);

// What went wrong when descriptors came that this process had no room for (RecvProblem::kNoRoom),
// naming its descriptor limit and what to do.
std::string no_fd_room_message();
// " (RLIMIT_NOFILE <n>, `ulimit -n`)", the process's descriptor limit for a message, or "" when
// it is unknown or unlimited.
std::string fd_limit_note();

// Receives one message of at most cap bytes with at most max_fds (<= kMaxPassedFds)
// close-on-exec descriptors, retrying EINTR. Returns the byte count (0: the peer closed) or
// -errno. When the message broke the bounds (*problem != kNone) every descriptor that came with
// it goes to dispose and *nfds is 0. The kernel is given room for every descriptor a message can
// carry, so it never drops (and so closes, in this thread) any of them itself.
long recv_with_fds(int sock, void* data, size_t cap, int* fds, size_t max_fds, size_t* nfds,
                   int flags, RecvProblem* problem, DisposeFds dispose = nullptr);

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

// Has the kernel refuse descriptors sent to `sock` and, for a listening socket, to every socket
// it accepts (SO_PASSRIGHTS = 0, inherited at connect; Linux 6.16+): the sender's sendmsg fails
// with EPERM. A receiver must close what it is sent, and the close of some descriptors blocks
// (a TCP socket lingering with unsent data, a file on a stalled FUSE mount), so a peer that may
// not be trusted could otherwise stall the thread that reads it. Returns false where the kernel
// has no such option; everything else works as before there.
bool refuse_passed_fds(int sock);

// pidfd_open(pid): a descriptor that names the process (not a recycled pid), close-on-exec.
bb_status pidfd_open_pid(pid_t pid, int* out, std::string* error);

}  // namespace bb::shm
