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
//
//   bb_hostile_task SOCKET_PATH SECONDS --park N
// Parks N threads in FUTEX_WAIT on its page's wake word while it always looks asleep and ready
// (its page says sleeping, and it acks every start at once), so every start the trainer gives
// it ends in a wake. Prints "PARKED"; at a line on stdin (or after SECONDS) prints "WAKES <n>",
// the number of those threads woken by a FUTEX_WAKE, and exits 0.
//
//   bb_hostile_task SOCKET_PATH SECONDS --park-on SLOT N
// A stranger: parks N threads on another task's wait words, those it can reach (the doorbell of
// slot SLOT, in the hub it maps like every task), and stays out of the way itself (never
// acks, so it is started once at most). Prints "PARKED" and "WAKES <n>" as --park does.
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include <cerrno>
#include <cstring>
#include <ctime>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "shm/segment.h"
#include "tests/helpers/raw_attach.h"

namespace {

// --park, --park-on: N threads parked on a wait word (the task's own, or a victim's that a
// stranger can reach), and for --park one thread acking every start; prints the number of
// wakes they saw and exits.
[[noreturn]] void park(unsigned char* hub, const bbtest::RawAttach& a, bb::shm::TaskPage* page,
                       int stranger_slot, int n, double seconds) {
  bb::shm::HubView v{hub};
  const bool stranger = stranger_slot >= 0;
  bb::shm::SlotCtl* c = v.slot(stranger ? uint32_t(stranger_slot) : a.reply.slot);
  // A task waits on its page's wake word; a stranger has no other task's page, only the hub.
  std::atomic<uint32_t>* word = stranger ? &c->doorbell : &page->wake;
  static std::atomic<uint64_t> wakes{0};
  static std::atomic<int> parked{0};
  for (int i = 0; i < n; ++i) {
    std::thread([word] {
      bool counted = false;
      for (;;) {
        const uint32_t seen = word->load(std::memory_order_acquire);
        if (!counted) counted = true, parked.fetch_add(1);
        // A wake returns 0; a word that moved before the wait returns EAGAIN (not counted).
        if (syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, nullptr,
                    nullptr, 0) == 0)
          wakes.fetch_add(1);
      }
    }).detach();
  }
  if (!stranger) {
    std::thread([c, page] {
      for (;;) {  // always ready: acks every start as soon as it sees it
        page->sleeping.store(1, std::memory_order_relaxed);
        const uint32_t e = c->given_epoch.load(std::memory_order_acquire);
        if (page->acked_epoch.load(std::memory_order_relaxed) != e)
          page->acked_epoch.store(e, std::memory_order_release);
        usleep(20);
      }
    }).detach();
  }
  while (parked.load() < n) usleep(1000);
  usleep(20000);  // the last ones from their count into their wait
  std::printf("PARKED\n");
  std::fflush(stdout);
  timeval tv{time_t(seconds), suseconds_t((seconds - double(time_t(seconds))) * 1e6)};
  fd_set in;
  FD_ZERO(&in);
  FD_SET(0, &in);
  select(1, &in, nullptr, nullptr, &tv);  // a line on stdin, or SECONDS
  std::printf("WAKES %llu\n", static_cast<unsigned long long>(wakes.load()));
  std::fflush(stdout);
  _exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  const bool resize = argc == 4 && std::strcmp(argv[3], "--resize") == 0;
  int park_n = argc == 5 && std::strcmp(argv[3], "--park") == 0 ? std::atoi(argv[4]) : 0;
  int stranger_slot = -1;
  if (argc == 6 && std::strcmp(argv[3], "--park-on") == 0) {
    stranger_slot = std::atoi(argv[4]);
    park_n = std::atoi(argv[5]);
  }
  if (argc != 3 && !resize && park_n <= 0) {
    std::fprintf(stderr, "usage: %s SOCKET_PATH SECONDS [--resize | --park N | --park-on SLOT N]\n",
                 argv[0]);
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
  if (park_n > 0)
    park(const_cast<unsigned char*>(hub), a, reinterpret_cast<bb::shm::TaskPage*>(page),
         stranger_slot, park_n, std::atof(argv[2]));
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
