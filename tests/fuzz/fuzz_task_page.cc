// Fuzzes the trainer against a hostile task page: a real hub, a task attached at the wire level,
// and each input written over the task's page while the trainer runs bubbles and its service
// thread drains reports. The trainer must neither crash nor read out of bounds (ASan), whatever
// the page holds.
#include <bubble/bubble.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "core/paths.h"
#include "shm/layout.h"
#include "shm/segment.h"
#include "tests/helpers/raw_attach.h"

namespace {

struct World {
  bb_trainer_h trainer = nullptr;
  bbtest::RawAttach task;
  unsigned char* page = nullptr;
  std::string dir;
  // libFuzzer ends with exit(): close the hub and remove its directory then.
  ~World() {
    bb_trainer_close(trainer);
    rmdir(dir.c_str());
  }
  World() {
    char tmpl[] = "/tmp/bbfuzz-XXXXXX";
    if (!mkdtemp(tmpl)) abort();
    dir = tmpl;
    setenv("BUBBLE_RUNTIME_DIR", tmpl, 1);
    if (bb_trainer_open("fuzz", 0, nullptr, &trainer) != BB_OK) abort();
    std::string sock;
    if (bb::core::hub_paths(tmpl, "fuzz", 0, &sock, nullptr) != BB_OK) abort();
    if (!bbtest::raw_attach(sock, "hostile", &task)) abort();
    page = static_cast<unsigned char*>(mmap(nullptr, bb::shm::kTaskPageSize,
                                            PROT_READ | PROT_WRITE, MAP_SHARED, task.page_fd, 0));
    if (page == MAP_FAILED) abort();
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World w;
  // The input lands at an offset it chooses (first two bytes), so small inputs reach the rings.
  size_t off = 0;
  if (size >= 2) {
    off = (size_t(data[0]) | size_t(data[1]) << 8) % bb::shm::kTaskPageSize;
    data += 2;
    size -= 2;
  }
  const size_t n = std::min(size, bb::shm::kTaskPageSize - off);
  std::memcpy(w.page + off, data, n);
  bb_bubble_begin(w.trainer, 1000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
  bb_bubble_end(w.trainer);
  bb_trainer_stats_t s{sizeof s};
  if (bb_trainer_stats(w.trainer, &s) != BB_OK) __builtin_trap();
  return 0;
}
