// A hostile side task: attaches at the wire level, then writes random bytes over everything it
// can write (its own task page) as fast as it can for the given time, then tries to write into
// the trainer's hub segment, which must fault in this process only.
//
//   bb_hostile_task SOCKET_PATH SECONDS
// Prints "ATTACHED", then "SCRIBBLED <n>" before the write that faults. Never returns normally.
//
//   bb_hostile_task SOCKET_PATH SECONDS --resize
// Tries to shrink its page to nothing and to grow it (which would leave the trainer's mapping
// of it reading past the end of the file), prints "SHRINK <result>" and "GROW <result>" (OK or
// the error), stays attached for SECONDS and exits 0.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "shm/segment.h"
#include "tests/helpers/raw_attach.h"

int main(int argc, char** argv) {
  const bool resize = argc == 4 && std::strcmp(argv[3], "--resize") == 0;
  if (argc != 3 && !resize) {
    std::fprintf(stderr, "usage: %s SOCKET_PATH SECONDS [--resize]\n", argv[0]);
    return 64;
  }
  bbtest::RawAttach a;
  if (!bbtest::raw_attach(argv[1], "hostile", &a)) {
    std::printf("ATTACH-FAILED\n");
    return 2;
  }
  auto* page = static_cast<uint64_t*>(mmap(nullptr, bb::shm::kTaskPageSize,
                                            PROT_READ | PROT_WRITE, MAP_SHARED, a.page_fd, 0));
  const int64_t hub_size = bb::shm::segment_size(a.hub_fd);
  auto* hub = static_cast<volatile unsigned char*>(
      mmap(nullptr, size_t(hub_size), PROT_READ, MAP_SHARED, a.hub_fd, 0));
  if (page == MAP_FAILED || hub == MAP_FAILED) return 3;
  std::printf("ATTACHED\n");
  std::fflush(stdout);
  if (resize) {
    const int shrink = ftruncate(a.page_fd, 0) == 0 ? 0 : errno;
    const int grow = ftruncate(a.page_fd, off_t(bb::shm::kTaskPageSize) * 4) == 0 ? 0 : errno;
    std::printf("SHRINK %s\nGROW %s\n", shrink ? std::strerror(shrink) : "OK",
                grow ? std::strerror(grow) : "OK");
    std::fflush(stdout);
    const double seconds = std::atof(argv[2]);
    timespec ts{time_t(seconds), long((seconds - double(time_t(seconds))) * 1e9)};
    nanosleep(&ts, nullptr);
    return 0;
  }
  uint64_t x = 0x9e3779b97f4a7c15ull, n = 0;
  timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  const double seconds = std::atof(argv[2]);
  for (;;) {
    for (size_t i = 0; i < bb::shm::kTaskPageSize / 8; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      page[i] = x;
    }
    ++n;
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (double(t.tv_sec - t0.tv_sec) + double(t.tv_nsec - t0.tv_nsec) * 1e-9 > seconds) break;
  }
  std::printf("SCRIBBLED %llu\n", (unsigned long long)n);
  std::fflush(stdout);
  // The hub is mapped read-only and sealed: this store must kill us with SIGSEGV.
  for (int64_t i = 0; i < hub_size; i += 4096) hub[i] = 0xff;
  std::printf("WROTE-HUB\n");  // never reached
  return 0;
}
