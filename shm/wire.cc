#include "shm/wire.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "shm/fd_passing.h"

namespace bb::shm {

int send_msg(int sock, const void* msg, size_t size, const int* fds, int nfds, int flags) {
  if (nfds < 0 || nfds > 2) return EINVAL;
  return send_with_fds(sock, msg, size, fds, size_t(nfds), flags);
}

long recv_msg(int sock, void* buf, int* fds, int* nfds, int flags, DisposeFds dispose) {
  size_t got = 0;
  RecvProblem problem;
  const long n =
      recv_with_fds(sock, buf, kWireMaxMessage, fds, 2, &got, flags, &problem, dispose);
  *nfds = int(got);
  if (n < 0) return n;
  if (problem == RecvProblem::kNoRoom) return -EMFILE;
  return problem == RecvProblem::kNone ? n : -EMSGSIZE;
}

bool check_msg(const void* buf, long got, MsgType type, size_t size) {
  if (got < long(sizeof(MsgHeader)) || size_t(got) != size) return false;
  MsgHeader h;
  std::memcpy(&h, buf, sizeof h);
  return h.magic == kWireMagic && h.version == kWireVersion && h.type == uint16_t(type) &&
         h.size == size;
}

}  // namespace bb::shm
