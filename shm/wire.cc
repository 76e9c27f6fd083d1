#include "shm/wire.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace bb::shm {

int send_msg(int sock, const void* msg, size_t size, const int* fds, int nfds, int flags) {
  iovec iov{const_cast<void*>(msg), size};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char ctrl[CMSG_SPACE(2 * sizeof(int))];
  if (nfds > 0) {
    if (nfds > 2) return EINVAL;
    std::memset(ctrl, 0, sizeof ctrl);
    mh.msg_control = ctrl;
    mh.msg_controllen = CMSG_SPACE(size_t(nfds) * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(size_t(nfds) * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds, size_t(nfds) * sizeof(int));
  }
  for (;;) {
    ssize_t n = sendmsg(sock, &mh, MSG_NOSIGNAL | flags);
    if (n == ssize_t(size)) return 0;
    if (n < 0 && errno == EINTR) continue;
    return n < 0 ? errno : EMSGSIZE;
  }
}

long recv_msg(int sock, void* buf, int* fds, int* nfds, int flags) {
  fds[0] = fds[1] = -1;
  *nfds = 0;
  iovec iov{buf, kWireMaxMessage};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  alignas(cmsghdr) char ctrl[CMSG_SPACE(2 * sizeof(int))];
  mh.msg_control = ctrl;
  mh.msg_controllen = sizeof ctrl;
  ssize_t n;
  do {
    n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | flags);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -long(errno);
  for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (*nfds < 2) {
        fds[(*nfds)++] = fd;
      } else {
        close(fd);  // more than the protocol allows: never keep what we did not ask for
      }
    }
  }
  if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
    for (int i = 0; i < *nfds; ++i) close(fds[i]);
    fds[0] = fds[1] = -1;
    *nfds = 0;
    return -EMSGSIZE;
  }
  return long(n);
}

bool check_msg(const void* buf, long got, MsgType type, size_t size) {
  if (got < long(sizeof(MsgHeader)) || size_t(got) != size) return false;
  MsgHeader h;
  std::memcpy(&h, buf, sizeof h);
  return h.magic == kWireMagic && h.version == kWireVersion && h.type == uint16_t(type) &&
         h.size == size;
}

}  // namespace bb::shm
