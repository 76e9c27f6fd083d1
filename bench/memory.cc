// memory: the shared memory of a hub with its slot table full, and the resident memory the
// side-task runtime adds to a task process.
//
//   hub: a trainer opens a hub of 64 or 256 slots (default event log) and a helper process
//        attaches that many tasks; the trainer's /proc/self/smaps then shows the hub segment
//        and every task page (memfds "bubble-hub" and "bubble-task"): their size and the part
//        resident. The trainer process's VmRSS before the open and with the table full is
//        printed beside them.
//   task: a task process reads /proc/self/smaps_rollup before bb_task_attach, after it, and
//        after its first bb_task_wait_start has returned with a start.
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"

using namespace bench;

namespace {

constexpr uint64_t kSecond = 1'000'000'000ull;

struct Segments {
  uint64_t hub_size = 0, hub_rss = 0;
  uint64_t pages = 0, pages_size = 0, pages_rss = 0;
};

// Sums the mappings of the hub's memfds in this process (/proc/self/smaps, sizes in kB).
Segments read_segments() {
  Segments s;
  std::ifstream f("/proc/self/smaps");
  std::string line;
  int kind = 0;  // 1: hub, 2: task page, 0: anything else
  while (std::getline(f, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
        line.find('-') != std::string::npos && line.find(' ') > line.find('-')) {
      kind = line.find("memfd:bubble-hub") != std::string::npos    ? 1
             : line.find("memfd:bubble-task") != std::string::npos ? 2
                                                                   : 0;
      if (kind == 2) ++s.pages;
      continue;
    }
    if (!kind) continue;
    uint64_t kb = 0;
    if (std::sscanf(line.c_str(), "Size: %lu kB", &kb) == 1)
      (kind == 1 ? s.hub_size : s.pages_size) += kb * 1024;
    else if (std::sscanf(line.c_str(), "Rss: %lu kB", &kb) == 1)
      (kind == 1 ? s.hub_rss : s.pages_rss) += kb * 1024;
  }
  return s;
}

// A field of /proc/self/status or smaps_rollup, in bytes.
uint64_t proc_field(const char* file, const char* field) {
  std::ifstream f(file);
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') {
      uint64_t kb = 0;
      std::sscanf(line.c_str() + n + 1, "%lu", &kb);
      return kb * 1024;
    }
  return 0;
}

struct Rollup {
  uint64_t rss = 0, pss = 0, priv = 0, shared = 0;
};

// One read of /proc/self/smaps_rollup, so all fields describe the same moment.
Rollup rollup() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::stringstream all;
  all << f.rdbuf();
  Rollup r;
  std::string line;
  while (std::getline(all, line)) {
    uint64_t kb = 0;
    char name[64];
    if (std::sscanf(line.c_str(), "%63[^:]: %lu kB", name, &kb) != 2) continue;
    const std::string n = name;
    if (n == "Rss") r.rss = kb * 1024;
    else if (n == "Pss") r.pss = kb * 1024;
    else if (n == "Private_Clean" || n == "Private_Dirty") r.priv += kb * 1024;
    else if (n == "Shared_Clean" || n == "Shared_Dirty") r.shared += kb * 1024;
  }
  return r;
}

struct Result {
  Segments seg;
  uint64_t trainer_rss_before, trainer_rss_open, trainer_rss_full;
  Rollup task[3];  // before attach, after attach, after the first wait
};

struct Ctl {
  char job[64];
  char dir[128];
  std::atomic<uint32_t> hub_ready, attached, failed, measured, started;
  Result r;
};

std::string mib(uint64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f", double(b) / (1024.0 * 1024.0));
  return s;
}

std::string kib(int64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%+.0f", double(b) / 1024.0);
  return s;
}

bool measure_hub(uint32_t slots, const RuntimeDir& dir, Result* out) {
  Shared<Ctl> c;
  std::snprintf(c->job, sizeof c->job, "%s", job_id("mem").c_str());
  std::snprintf(c->dir, sizeof c->dir, "%s", dir.path());
  Child tasks(1, [&]() -> int {
    if (!wait_for([&] { return c->hub_ready.load() != 0; }, 10 * kSecond)) return 1;
    std::vector<bb_task_h> handles;
    for (uint32_t i = 0; i < slots; ++i) {
      bb_task_options_t o;
      bb_task_options_init(&o);
      o.runtime_dir = c->dir;
      char name[32];
      std::snprintf(name, sizeof name, "t%u", i);
      bb_task_h t = nullptr;
      if (bb_task_attach(c->job, 0, name, &o, &t) != BB_OK) {
        std::fprintf(stderr, "attach %u: %s\n", i, bb_last_error());
        c->failed.store(1);
        break;
      }
      handles.push_back(t);
      c->attached.fetch_add(1);
    }
    wait_for([&] { return c->measured.load() != 0; }, 60 * kSecond);
    for (bb_task_h t : handles) bb_task_detach(t);
    return 0;
  });
  Child trainer(0, [&]() -> int {
    c->r.trainer_rss_before = proc_field("/proc/self/status", "VmRSS");
    bb_trainer_options_t o;
    bb_trainer_options_init(&o);
    o.max_slots = slots;
    o.runtime_dir = c->dir;
    bb_trainer_h t = nullptr;
    check(bb_trainer_open(c->job, 0, &o, &t), "bb_trainer_open");
    c->r.trainer_rss_open = proc_field("/proc/self/status", "VmRSS");
    c->hub_ready.store(1);
    if (!wait_for([&] { return c->attached.load() == slots || c->failed.load(); }, 60 * kSecond) ||
        c->failed.load())
      return 1;
    // A bubble and its end touch what the bubble path touches.
    bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
    bb_bubble_end(t);
    usleep(50000);
    c->r.seg = read_segments();
    c->r.trainer_rss_full = proc_field("/proc/self/status", "VmRSS");
    c->measured.store(1);
    bb_trainer_close(t);
    return 0;
  });
  const bool ok = trainer.wait(120 * kSecond) == 0;
  c->measured.store(1);
  tasks.wait(60 * kSecond);
  *out = c->r;
  return ok;
}

bool measure_task(const RuntimeDir& dir, Result* out) {
  Shared<Ctl> c;
  std::snprintf(c->job, sizeof c->job, "%s", job_id("memtask").c_str());
  std::snprintf(c->dir, sizeof c->dir, "%s", dir.path());
  Child task(1, [&]() -> int {
    if (!wait_for([&] { return c->hub_ready.load() != 0; }, 10 * kSecond)) return 1;
    bb_task_options_t o;
    bb_task_options_init(&o);
    o.runtime_dir = c->dir;
    c->r.task[0] = rollup();
    bb_task_h t = nullptr;
    check(bb_task_attach(c->job, 0, "mem-task", &o, &t), "bb_task_attach");
    c->r.task[1] = rollup();
    c->attached.store(1);
    bb_start_info_t info{sizeof info};
    check(bb_task_wait_start(t, int64_t(10 * kSecond), &info), "bb_task_wait_start");
    c->r.task[2] = rollup();
    c->started.store(1);
    while (!bb_task_should_pause(t)) usleep(100);
    bb_task_detach(t);
    return 0;
  });
  Child trainer(0, [&]() -> int {
    bb_trainer_h t = nullptr;
    bb_trainer_options_t o;
    bb_trainer_options_init(&o);
    o.runtime_dir = c->dir;
    check(bb_trainer_open(c->job, 0, &o, &t), "bb_trainer_open");
    c->hub_ready.store(1);
    if (!wait_for([&] { return c->attached.load() != 0; }, 10 * kSecond)) return 1;
    usleep(10000);
    bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
    const bool ok = wait_for([&] { return c->started.load() != 0; }, 10 * kSecond);
    bb_bubble_end(t);
    usleep(10000);
    bb_trainer_close(t);
    return ok ? 0 : 1;
  });
  const bool ok = trainer.wait(60 * kSecond) == 0 && task.wait(10 * kSecond) == 0;
  *out = c->r;
  return ok;
}

const char kUsage[] =
    "usage: memory [--quick]\n"
    "Shared memory of a full hub (64 and 256 slots) and the resident memory a task's runtime\n"
    "adds. --quick is accepted for symmetry; the run is short either way.\n";

}  // namespace

int main(int argc, char** argv) {
  parse_args(argc, argv, kUsage);
  print_machine(argc, argv);
  RuntimeDir dir;
  const long page = sysconf(_SC_PAGESIZE);
  std::printf("- page size %ld bytes; trainer on CPU 0, tasks on CPU 1\n\n", page);

  std::printf("hub with a full slot table (default event log: two rings of 4096 entries), MiB\n\n");
  std::printf("| slots | hub segment | hub resident | task pages | their size | their resident "
              "| total shared | per task | trainer VmRSS before open / open / full |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  uint64_t total256 = 0, total64 = 0, resident256 = 0;
  for (uint32_t slots : {64u, 256u}) {
    Result c;
    if (!measure_hub(slots, dir, &c)) {
      std::printf("| %u | not measured: the run failed |\n", slots);
      continue;
    }
    const Segments& s = c.seg;
    const uint64_t total = s.hub_size + s.pages_size;
    (slots == 64 ? total64 : total256) = total;
    if (slots == 256) resident256 = s.hub_rss + s.pages_rss;
    std::printf("| %u | %s | %s | %lu | %s | %s | %s | %s | %s / %s / %s |\n", slots,
                mib(s.hub_size).c_str(), mib(s.hub_rss).c_str(), (unsigned long)s.pages,
                mib(s.pages_size).c_str(), mib(s.pages_rss).c_str(), mib(total).c_str(),
                mib(s.pages ? s.pages_size / s.pages : 0).c_str(),
                mib(c.trainer_rss_before).c_str(), mib(c.trainer_rss_open).c_str(),
                mib(c.trainer_rss_full).c_str());
    std::fflush(stdout);
  }

  std::printf("\na task process (one task), /proc/self/smaps_rollup, KiB\n\n");
  std::printf("| moment | Rss | Pss | private | shared | Rss added |\n");
  std::printf("|---|---|---|---|---|---|\n");
  Result t;
  int64_t added = -1;
  if (measure_task(dir, &t)) {
    const char* names[3] = {"before bb_task_attach", "after bb_task_attach",
                            "after the first bb_task_wait_start"};
    for (int i = 0; i < 3; ++i)
      std::printf("| %s | %.0f | %.0f | %.0f | %.0f | %s |\n", names[i], double(t.task[i].rss) / 1024,
                  double(t.task[i].pss) / 1024, double(t.task[i].priv) / 1024,
                  double(t.task[i].shared) / 1024,
                  i ? kib(int64_t(t.task[i].rss) - int64_t(t.task[0].rss)).c_str() : "");
    added = int64_t(t.task[2].rss) - int64_t(t.task[0].rss);
  } else {
    std::printf("| not measured: the run failed | | | | | |\n");
  }

  std::printf("\ntargets:\n");
  std::printf("- hub of 256 slots, all shared memory %s MiB <= 2 MiB: %s (resident: %s MiB)\n",
              mib(total256).c_str(), vs_target(double(total256), 2.0 * 1024 * 1024).c_str(),
              mib(resident256).c_str());
  std::printf("- hub of 64 slots, all shared memory %s MiB <= 2 MiB: %s\n", mib(total64).c_str(),
              vs_target(double(total64), 2.0 * 1024 * 1024).c_str());
  if (added >= 0)
    std::printf("- resident memory a task's runtime adds %s KiB <= 1024 KiB: %s\n",
                kib(added).c_str(), vs_target(double(added), 1024.0 * 1024).c_str());
  return 0;
}
