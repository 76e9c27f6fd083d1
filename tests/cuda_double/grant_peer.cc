// bubble_grant_peer: a side task for the grant tests, run as its own process.
//
//   bubble_grant_peer <socket-fd> [ignore-revoke]
//
// It maps grants the test sends (with map_grant, loading the CUDA driver the way any task does:
// $BUBBLE_CUDA_DRIVER or libcuda.so.1), writes a pattern through the mapping, and reports what
// it saw. For CUDA grants the "device" pointer is host memory of the fake driver, so the peer
// writes it directly; with a real driver this program is not used (see tests/gpu).
#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/cuda_driver.h"
#include "core/grant.h"
#include "shm/fd_passing.h"
#include "tests/cuda_double/grant_peer.h"

using namespace bb;

namespace {

int count_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n - 1;  // the directory's own descriptor
}

void fill_counts(test::PeerReply* r) {
  std::string ignored;
  const core::CudaDriver* drv = core::cuda_driver(&ignored);
  if (!drv) return;
  auto fn = reinterpret_cast<void (*)(bbdouble_counts*)>(dlsym(drv->dl_handle, "bbdouble_outstanding"));
  if (!fn) return;
  fn(&r->counts);
  r->counts_valid = 1;
}

bool all_zero(const void* p, uint64_t size) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (uint64_t i = 0; i < size; ++i)
    if (b[i]) return false;
  return true;
}

void write_pattern(void* p, uint64_t size, uint32_t seed) {
  auto* w = static_cast<uint32_t*>(p);
  for (uint64_t i = 0; i < size / 4; ++i) w[i] = test::pattern_word(seed, i);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <socket-fd> [ignore-revoke]\n", argv[0]);
    return 2;
  }
  const int sock = std::atoi(argv[1]);
  const bool ignore_revoke = argc > 2 && std::strcmp(argv[2], "ignore-revoke") == 0;
  std::unique_ptr<core::GrantMapping> held;
  for (;;) {
    test::PeerRequest req;
    int fd = -1;
    size_t len = 0, nfds = 0;
    std::string err;
    test::PeerReply rep;
    rep.fds_before = count_fds();
    bb_status st = shm::recv_fds(sock, &req, sizeof req, &len, &fd, 1, &nfds, &err);
    if (st != BB_OK || len == 0) return st == BB_OK ? 0 : 3;  // the test closed the socket
    if (len != sizeof req) return 4;
    rep.grant_id = req.grant.id;
    if (req.op == test::kPeerRevoke) {
      if (ignore_revoke) {
        for (;;) pause();  // a hung task: the test must kill it
      }
      st = held ? held->unmap(&err) : BB_E_STATE;
      held.reset();
    } else {
      std::unique_ptr<core::GrantMapping> m;
      st = core::map_grant(req.grant, fd, &m, &err);
      if (st == BB_OK) {
        rep.was_zero = all_zero(m->ptr(), m->size()) ? 1 : 0;
        write_pattern(m->ptr(), m->size(), req.seed);
        if (req.grant.backend == core::GrantBackend::kHost)
          rep.truncate_errno = ftruncate(fd, 0) == 0 ? 0 : errno;
        if (req.op == test::kPeerMapWriteUnmap) st = m->unmap(&err);
        else held = std::move(m);
      }
    }
    if (fd >= 0) close(fd);
    rep.status = st;
    rep.fds_after = count_fds();
    fill_counts(&rep);
    std::snprintf(rep.error, sizeof rep.error, "%s", err.c_str());
    if (shm::send_fds(sock, &rep, sizeof rep, nullptr, 0, &err) != BB_OK) return 5;
  }
}
