#include "shm/fd_passing.h"

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace bb::shm {
namespace {

constexpr size_t kMaxMessage = 64 * 1024;

std::string errno_text(int err) { return std::string(strerror(err)); }

// Big enough for kMaxPassedFds descriptors in one SCM_RIGHTS header, and aligned for cmsghdr.
union ControlBuffer {
  char buf[CMSG_SPACE(sizeof(int) * kMaxPassedFds)];
  cmsghdr align;
};

// The most descriptors the kernel lets one sendmsg carry (SCM_MAX_FD).
constexpr size_t kKernelMaxFds = 253;

// Room for every descriptor one message can carry: the kernel then hands each one over rather
// than dropping what does not fit, which would close it in the receiving thread.
union ReceiveBuffer {
  char buf[CMSG_SPACE(sizeof(int) * kKernelMaxFds)];
  cmsghdr align;
};

void close_each(const int* fds, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (fds[i] >= 0) ::close(fds[i]);
}

}  // namespace

int send_with_fds(int sock, const void* data, size_t len, const int* fds, size_t nfds,
                  int flags) {
  if (nfds > kMaxPassedFds || (nfds && !fds)) return EINVAL;
  iovec iov{const_cast<void*>(data), len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  ControlBuffer control;
  if (nfds) {
    std::memset(&control, 0, sizeof control);
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  for (;;) {
    const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | flags);
    if (n >= 0) return size_t(n) == len ? 0 : EMSGSIZE;
    if (errno != EINTR) return errno;
  }
}

std::string fd_limit_note() {
  rlimit rl{};
  return getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
             ? " (RLIMIT_NOFILE " + std::to_string(rl.rlim_cur) + ", `ulimit -n`)"
             : "";
}

std::string no_fd_room_message() {
  return "this process is at its limit of open descriptors" + fd_limit_note() +
         ", so the ones sent to it were dropped; close descriptors it no longer needs, or raise "
         "the limit";
}

long recv_with_fds(int sock, void* data, size_t cap, int* fds, size_t max_fds, size_t* nfds,
                   int flags, RecvProblem* problem, DisposeFds dispose) {
  *nfds = 0;
  *problem = RecvProblem::kNone;
  if (max_fds > kMaxPassedFds || (max_fds && !fds)) return -EINVAL;
  if (!dispose) dispose = close_each;
  for (size_t i = 0; i < max_fds; ++i) fds[i] = -1;
  iovec iov{data, cap};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for every descriptor a message can carry, whatever max_fds is: the kernel drops what
  // does not fit, and dropping closes it here, which can block. Whatever is not kept goes to
  // dispose instead.
  ReceiveBuffer control;
  msg.msg_control = control.buf;
  msg.msg_controllen = sizeof control.buf;
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -long(errno);
  // Collect every SCM_RIGHTS descriptor first so that nothing leaks on any failure below.
  int extra[kKernelMaxFds];
  size_t got = 0, dropped = 0;
  bool foreign = false;
  for (cmsghdr* c = msg.msg_controllen ? CMSG_FIRSTHDR(&msg) : nullptr; c;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
      foreign = true;
      continue;
    }
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (got < max_fds) {
        fds[got++] = fd;
      } else if (dropped < kKernelMaxFds) {
        extra[dropped++] = fd;
      } else {
        dispose(&fd, 1);
        ++dropped;
      }
    }
  }
  if (dropped) dispose(extra, std::min(dropped, kKernelMaxFds));
  // A truncation with room left in the buffer is the kernel failing to install descriptors
  // (EMFILE, ENFILE), not a sender passing more than fit.
  if ((msg.msg_flags & MSG_CTRUNC) && !dropped)
    *problem = RecvProblem::kNoRoom;
  else if ((msg.msg_flags & MSG_CTRUNC) || dropped) *problem = RecvProblem::kTooManyFds;
  else if (msg.msg_flags & MSG_TRUNC) *problem = RecvProblem::kTooLong;
  else if (foreign) *problem = RecvProblem::kForeign;
  if (*problem != RecvProblem::kNone) {
    dispose(fds, got);
    for (size_t i = 0; i < got; ++i) fds[i] = -1;
    return long(n);
  }
  *nfds = got;
  return long(n);
}

bb_status send_fds(int sock, const void* data, size_t len, const int* fds, size_t nfds,
                   std::string* error) {
  if (len == 0 || len > kMaxMessage || !data) {
    *error = "send_fds needs 1.." + std::to_string(kMaxMessage) + " bytes of data, got " +
             std::to_string(len) + ": an empty message would read as a closed socket";
    return BB_E_INVALID;
  }
  if (nfds > kMaxPassedFds || (nfds && !fds)) {
    *error = "send_fds can pass at most " + std::to_string(kMaxPassedFds) +
             " descriptors in one message, got " + std::to_string(nfds) + ": split the message";
    return BB_E_INVALID;
  }
  for (size_t i = 0; i < nfds; ++i) {
    if (fds[i] < 0) {
      *error = "send_fds got descriptor " + std::to_string(fds[i]) + " at index " +
               std::to_string(i) + ": pass only open descriptors";
      return BB_E_INVALID;
    }
  }
  const int err = send_with_fds(sock, data, len, fds, nfds, 0);
  if (err == 0) return BB_OK;
  if (err == EMSGSIZE) {
    // Only a stream socket sends part of a message; the descriptors went with the first byte.
    *error = "send_fds sent part of " + std::to_string(len) +
             " bytes: use a SOCK_SEQPACKET socket so messages stay whole";
    return BB_E_SYSTEM;
  }
  if (err == EAGAIN || err == EWOULDBLOCK) {
    *error = "the socket's send buffer is full: the peer is not reading; retry later";
    return BB_E_BUSY;
  }
  *error = "sendmsg of " + std::to_string(nfds) + " descriptor(s) failed: " + errno_text(err) +
           (err == EPIPE || err == ECONNRESET ? " (the peer closed the socket)" : "");
  return BB_E_SYSTEM;
}

bb_status recv_fds(int sock, void* data, size_t cap, size_t* len, int* fds, size_t max_fds,
                   size_t* nfds, std::string* error) {
  *len = 0;
  *nfds = 0;
  if (!data || cap == 0 || max_fds > kMaxPassedFds || (max_fds && !fds)) {
    *error = "recv_fds needs a data buffer and at most " + std::to_string(kMaxPassedFds) +
             " descriptor slots";
    return BB_E_INVALID;
  }
  RecvProblem problem;
  const long n = recv_with_fds(sock, data, cap, fds, max_fds, nfds, 0, &problem);
  if (n < 0) {
    if (n == -EAGAIN || n == -EWOULDBLOCK) {
      *error = "no message is waiting on the socket";
      return BB_E_TIMEOUT;
    }
    *error = "recvmsg failed: " + errno_text(int(-n));
    return BB_E_SYSTEM;
  }
  switch (problem) {
    case RecvProblem::kNone:
      *len = size_t(n);
      return BB_OK;
    case RecvProblem::kTooManyFds:
      *error = "a message carried more than the " + std::to_string(max_fds) +
               " descriptor(s) expected; the peer does not follow the protocol, so the message "
               "was discarded";
      break;
    case RecvProblem::kTooLong:
      *error = "a message was longer than the " + std::to_string(cap) +
               " bytes expected; the peer does not follow the protocol, so the message was "
               "discarded";
      break;
    case RecvProblem::kForeign:
      *error = "a message carried ancillary data other than descriptors; it was discarded";
      break;
    case RecvProblem::kNoRoom:
      *error = no_fd_room_message();
      return BB_E_SYSTEM;
  }
  return BB_E_CORRUPT;
}

bool refuse_passed_fds(int sock) {
  constexpr int kSoPassRights = 83;  // SO_PASSRIGHTS, not in the C library's headers yet
  const int off = 0;
  return setsockopt(sock, SOL_SOCKET, kSoPassRights, &off, sizeof off) == 0;
}

bb_status pidfd_open_pid(pid_t pid, int* out, std::string* error) {
  *out = -1;
  long fd = ::syscall(SYS_pidfd_open, pid, 0);
  if (fd < 0) {
    int err = errno;
    if (err == ENOSYS) {
      *error = "pidfd_open is not available: libbubble needs Linux 5.3 or newer";
      return BB_E_UNSUPPORTED;
    }
    *error = "pidfd_open(" + std::to_string(pid) + ") failed: " + errno_text(err) +
             (err == ESRCH ? " (no such process)" : "");
    return err == ESRCH ? BB_E_NOT_FOUND : BB_E_SYSTEM;
  }
  // pidfd_open returns close-on-exec descriptors already.
  *out = static_cast<int>(fd);
  return BB_OK;
}

}  // namespace bb::shm
