// hot_path: what bb_bubble_begin + bb_bubble_end cost the trainer's thread.
//
//   (a) no task attached: a tight loop;
//   (b,c) 1, 16 and 64 attached tasks (real tasks in other processes), either
//         - the started task spins (BB_WAKE_SPIN, priority 1; the others sleep, priority 0, and
//           are never picked): no system call on the path, but the slot's cache lines move, or
//         - every task sleeps (BB_WAKE_SLEEP, spin_ns 0, round-robin): begin pays one futex
//           wake. Beside it, in the same loop, the floor: a bare FUTEX_WAKE of a process
//           sleeping in FUTEX_WAIT on a shared word, after the same gap;
//   (d) 1..16 hubs at once, one trainer process each, no task, a 50 us sleep between bubbles.
//
// begin and end are timed separately with bb_now_ns() around each call (a task has to see the
// start before the end makes sense) and summed; each figure therefore includes the cost of a
// timer read, printed above the tables. Placement: trainers on CPU 0, tasks and the futex
// waiter on CPU 1 (hubs of (d) alternate between the CPUs).

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "bench_support.h"

using namespace bench;

namespace {

constexpr int kTrainerCpu = 0, kTaskCpu = 1;
constexpr uint32_t kMaxSlots = 64;
constexpr uint64_t kSleepGapNs = 300'000;  // time for a task (or the futex waiter) to fall asleep
constexpr uint64_t kTimeoutNs = 2'000'000'000;
constexpr int kBatch = 64;  // begin+end pairs timed as one in the no-task row

struct Ctl {
  char job[64];
  char dir[128];
  std::atomic<uint32_t> hub_ready, attached, failed, quit, detached;
  alignas(64) std::atomic<uint64_t> started;
  alignas(64) std::atomic<uint64_t> acked;
  // The bare futex pair.
  alignas(64) std::atomic<uint32_t> fword;
  alignas(64) std::atomic<uint32_t> fsleeping;
  std::atomic<uint64_t> fwoken;
  // The spin floor: the trainer bumps sword, fences, reads sack (the spinner's line).
  alignas(64) std::atomic<uint32_t> sword;
  alignas(64) std::atomic<uint64_t> sack;
  std::atomic<uint32_t> sgo, sready;
  // Results of one row.
  std::atomic<uint64_t> n, filtered, wakes, starts;
};

long futex(std::atomic<uint32_t>* w, int op, uint32_t val) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), op, val, nullptr, nullptr, 0);
}

bb_trainer_h open_hub(Ctl* c) {
  bb_trainer_options_t o;
  bb_trainer_options_init(&o);
  o.max_slots = kMaxSlots;
  o.runtime_dir = c->dir;
  bb_trainer_h t = nullptr;
  check(bb_trainer_open(c->job, 0, &o, &t), "bb_trainer_open");
  c->hub_ready.store(1);
  return t;
}

// `count` tasks as threads of this process: each waits for starts, polls should_pause while
// running, acks and waits again, until its trainer goes away.
int run_tasks(Ctl* c, uint32_t count, int32_t priority, bb_wake_mode mode) {
  if (!wait_for([&] { return c->hub_ready.load() != 0; }, kTimeoutNs)) return 1;
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < count; ++i)
    threads.emplace_back([c, i, priority, mode] {
      bb_task_options_t o;
      bb_task_options_init(&o);
      o.priority = priority;
      o.wake_mode = mode;
      o.spin_ns = 0;  // SLEEP: straight into the futex
      o.runtime_dir = c->dir;
      char name[32];
      std::snprintf(name, sizeof name, "p%d-t%u", priority, i);
      bb_task_h t = nullptr;
      if (bb_task_attach(c->job, 0, name, &o, &t) != BB_OK) {
        std::fprintf(stderr, "attach: %s\n", bb_last_error());
        c->failed.fetch_add(1);
        return;
      }
      c->attached.fetch_add(1);
      while (bb_task_wait_start(t, -1, nullptr) == BB_OK) {
        c->started.fetch_add(1);
        while (!bb_task_should_pause(t)) __builtin_ia32_pause();
        bb_task_ack_pause(t);
        c->acked.fetch_add(1);
      }
      bb_task_detach(t);
      c->detached.fetch_add(1);
    });
  for (auto& th : threads) th.join();
  return 0;
}

int run_futex_waiter(Ctl* c) {
  uint32_t seen = c->fword.load();
  while (!c->quit.load()) {
    c->fsleeping.store(1);
    while (c->fword.load() == seen && !c->quit.load()) {
      timespec ts{0, 100'000'000};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&c->fword), FUTEX_WAIT, seen, &ts, nullptr, 0);
    }
    c->fsleeping.store(0);
    seen = c->fword.load();
    c->fwoken.fetch_add(1);
  }
  return 0;
}

// Sleeps until the trainer is done with the spinning task, then spins on sword and acks every
// change on its own cache line.
int run_spinner(Ctl* c) {
  while (!c->sgo.load() && !c->quit.load()) usleep(1000);
  uint32_t seen = c->sword.load();
  c->sready.store(1);
  while (!c->quit.load()) {
    const uint32_t w = c->sword.load(std::memory_order_acquire);
    if (w == seen) {
      __builtin_ia32_pause();
      continue;
    }
    seen = w;
    c->sack.fetch_add(1, std::memory_order_release);
  }
  return 0;
}

// The id of the attached task with the given priority (0 if none).
uint64_t task_with_priority(bb_trainer_h t, int32_t priority) {
  bb_task_info_t info[kMaxSlots];
  for (auto& i : info) i.size = sizeof i;
  size_t n = 0;
  bb_trainer_tasks(t, info, kMaxSlots, &n);
  for (size_t i = 0; i < n && i < kMaxSlots; ++i)
    if (info[i].priority == priority) return info[i].id;
  return 0;
}

uint64_t stat_wakes(bb_trainer_h t, uint64_t* starts) {
  bb_trainer_stats_t s{sizeof s};
  bb_trainer_stats(t, &s);
  *starts = s.starts;
  return s.wakes;
}

struct RowResult {
  Summary cost, begin, end, floor, floor2;
  double wakes_per_bubble = 0;
  uint64_t filtered = 0;
};

enum class Row { kIdle, kSpin, kSleep };

// One row: forks the trainer, the tasks and (for kSleep) the futex waiter; returns the figures.
RowResult run_row(Row row, uint32_t tasks, size_t iters, const RuntimeDir& dir) {
  Shared<Ctl> c;
  std::snprintf(c->job, sizeof c->job, "%s", job_id("hot").c_str());
  std::snprintf(c->dir, sizeof c->dir, "%s", dir.path());
  SharedSamples begin(iters), end(iters), floor(iters);
  std::vector<Child> kids;
  if (row == Row::kSpin) {
    kids.emplace_back(kTaskCpu, [&] { return run_tasks(&*c, 1, 1, BB_WAKE_SPIN); });
    kids.emplace_back(kTaskCpu, [&] { return run_spinner(&*c); });
    if (tasks > 1)
      kids.emplace_back(kTaskCpu, [&] { return run_tasks(&*c, tasks - 1, 0, BB_WAKE_SLEEP); });
  } else if (row == Row::kSleep) {
    kids.emplace_back(kTaskCpu, [&] { return run_tasks(&*c, tasks, 0, BB_WAKE_SLEEP); });
    kids.emplace_back(kTaskCpu, [&] { return run_futex_waiter(&*c); });
  }
  Child trainer(kTrainerCpu, [&]() -> int {
    bb_trainer_h t = open_hub(&*c);
    if (!wait_for([&] { return c->attached.load() + c->failed.load() == tasks; }, 10 * kTimeoutNs) ||
        c->failed.load())
      return 1;
    // Warm up: caches, branch predictors and the hub service's first drains.
    for (int i = 0; row == Row::kIdle && i < 1000; ++i) {
      bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
      bb_bubble_end(t);
    }
    size_t n = 0, filtered = 0;
    uint64_t wakes_total = 0;
    for (size_t k = 0; k < iters; ++k) {
      if (row == Row::kIdle) {
        // Alternately: one pair with begin and end timed apart (each figure then holds a timer
        // delta), and a batch of kBatch pairs timed as a whole, whose mean per pair holds no
        // timer (floor.data() keeps the batch means for this row).
        const uint64_t t0 = bb_now_ns();
        bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
        const uint64_t t1 = bb_now_ns();
        bb_bubble_end(t);
        const uint64_t t2 = bb_now_ns();
        begin.data()[n] = t1 - t0;
        end.data()[n] = t2 - t1;
        const uint64_t b0 = bb_now_ns();
        for (int i = 0; i < kBatch; ++i) {
          bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
          bb_bubble_end(t);
        }
        floor.data()[n] = (bb_now_ns() - b0 + kBatch / 2) / kBatch;
        ++n;
        continue;
      }
      const uint64_t acked = c->acked.load();
      if (row == Row::kSleep) spin_until(bb_now_ns() + kSleepGapNs);
      else spin_until(bb_now_ns() + 5'000);
      uint64_t starts0, starts1;
      const uint64_t wakes0 = stat_wakes(t, &starts0);
      const uint64_t t0 = bb_now_ns();
      bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
      const uint64_t t1 = bb_now_ns();
      const bool ran = wait_for([&] { return c->started.load() > acked; }, kTimeoutNs / 20);
      const uint64_t t2 = bb_now_ns();
      bb_bubble_end(t);
      const uint64_t t3 = bb_now_ns();
      const uint64_t wakes = stat_wakes(t, &starts1) - wakes0;
      wait_for([&] { return c->acked.load() > acked; }, kTimeoutNs);
      // Only bubbles that started a task in the state this row is about count.
      const bool wanted = row == Row::kSpin ? wakes == 0 : wakes >= 1;
      if (!ran || starts1 - starts0 != 1 || !wanted) {
        ++filtered;
      } else {
        begin.data()[n] = t1 - t0;
        end.data()[n] = t3 - t2;
        wakes_total += wakes;
        ++n;
      }
      if (row == Row::kSleep) {
        // The floor, after the same gap: one FUTEX_WAKE of a sleeping process.
        const uint64_t woken = c->fwoken.load();
        wait_for([&] { return c->fsleeping.load() != 0; }, kTimeoutNs);
        spin_until(bb_now_ns() + kSleepGapNs);
        const uint64_t f0 = bb_now_ns();
        c->fword.fetch_add(1);
        futex(&c->fword, FUTEX_WAKE, INT_MAX);
        const uint64_t f1 = bb_now_ns();
        floor.data()[k] = f1 - f0;
        wait_for([&] { return c->fwoken.load() > woken; }, kTimeoutNs);
      }
    }
    if (row == Row::kSpin) {
      // The floor, once the spinning task has left the CPU to the bare spinner: a store to the
      // word it polls, the full fence the sleeping-flag handshake needs, and a load of a line
      // the spinner wrote (as begin reads the task's page).
      check(bb_trainer_stop_task(t, task_with_priority(t, 1)), "bb_trainer_stop_task");
      wait_for([&] { return c->detached.load() != 0; }, kTimeoutNs);
      c->sgo.store(1);
      wait_for([&] { return c->sready.load() != 0; }, kTimeoutNs);
      for (size_t k = 0; k < iters; ++k) {
        const uint64_t acks = c->sack.load();
        spin_until(bb_now_ns() + 5'000);
        const uint64_t f0 = bb_now_ns();
        c->sword.fetch_add(1, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_seq_cst);
        const uint64_t seen = c->sack.load(std::memory_order_relaxed);
        const uint64_t f1 = bb_now_ns();
        floor.data()[k] = f1 - f0;
        (void)seen;
        if (!wait_for([&] { return c->sack.load() > acks; }, kTimeoutNs)) break;
      }
    }
    c->n.store(n);
    c->filtered.store(filtered);
    c->wakes.store(wakes_total);
    c->quit.store(1);
    c->fword.fetch_add(1);
    futex(&c->fword, FUTEX_WAKE, INT_MAX);
    bb_trainer_close(t);
    return 0;
  });
  const int rc = trainer.wait(600 * 1'000'000'000ull);
  c->quit.store(1);
  for (auto& k : kids) k.wait(5 * kTimeoutNs);
  RowResult r;
  if (rc != 0) {
    std::fprintf(stderr, "hot_path: a trainer row failed (exit %d)\n", rc);
    return r;
  }
  const size_t n = c->n.load();
  std::vector<uint64_t> sum(n);
  for (size_t i = 0; i < n; ++i) sum[i] = begin.data()[i] + end.data()[i];
  r.cost = summarize(sum);
  r.begin = summarize(begin.take(n));
  r.end = summarize(end.take(n));
  r.floor = summarize(floor.take(row == Row::kIdle ? n : iters));
  if (row == Row::kSpin) {
    // A begin and an end each tell a task on the other CPU something and read what it wrote:
    // two handshakes, summed pairwise.
    std::vector<uint64_t> one = floor.take(iters), two(iters / 2);
    for (size_t i = 0; i < two.size(); ++i) two[i] = one[2 * i] + one[2 * i + 1];
    r.floor2 = summarize(two);
  }
  r.filtered = c->filtered.load();
  r.wakes_per_bubble = n ? double(c->wakes.load()) / double(n) : 0;
  return r;
}

// (d): `hubs` trainer processes at once, each timing its own begin+end.
struct HubsResult {
  Summary pooled, clocks;
  double worst_p50 = 0, worst_p99 = 0;
};

HubsResult run_hubs(uint32_t hubs, size_t iters, const RuntimeDir& dir) {
  struct HubsCtl {
    std::atomic<uint32_t> ready, go;
  };
  Shared<HubsCtl> c;
  SharedSamples samples(size_t(hubs) * iters), clocks(size_t(hubs) * iters);
  std::vector<Child> kids;
  const std::string job = job_id("hubs");
  for (uint32_t h = 0; h < hubs; ++h)
    kids.emplace_back(int(h % 2), [&, h]() -> int {
      bb_trainer_options_t o;
      bb_trainer_options_init(&o);
      o.runtime_dir = dir.path();
      bb_trainer_h t = nullptr;
      check(bb_trainer_open(job.c_str(), h, &o, &t), "bb_trainer_open");
      c->ready.fetch_add(1);
      if (!wait_for([&] { return c->go.load() != 0; }, 10 * kTimeoutNs)) return 1;
      uint64_t* out = samples.data() + size_t(h) * iters;
      uint64_t* floor = clocks.data() + size_t(h) * iters;
      timespec ts{0, 50'000};
      for (size_t k = 0; k < iters; ++k) {
        const uint64_t t0 = bb_now_ns();
        bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
        bb_bubble_end(t);
        out[k] = bb_now_ns() - t0;
        nanosleep(&ts, nullptr);
        // The floor in the same place: the two clock reads a begin and an end make, timed the
        // same way after the same sleep (so with the same cold caches and timer delta).
        const uint64_t f0 = bb_now_ns();
        (void)bb_now_ns();
        (void)bb_now_ns();
        floor[k] = bb_now_ns() - f0;
        nanosleep(&ts, nullptr);
      }
      bb_trainer_close(t);
      return 0;
    });
  HubsResult r;
  if (!wait_for([&] { return c->ready.load() == hubs; }, 10 * kTimeoutNs)) {
    std::fprintf(stderr, "hot_path: hubs did not open\n");
    return r;
  }
  c->go.store(1);
  bool ok = true;
  for (auto& k : kids) ok &= k.wait(600 * 1'000'000'000ull) == 0;
  if (!ok) {
    std::fprintf(stderr, "hot_path: a hub process failed\n");
    return r;
  }
  r.pooled = summarize(samples.take(size_t(hubs) * iters));
  r.clocks = summarize(clocks.take(size_t(hubs) * iters));
  for (uint32_t h = 0; h < hubs; ++h) {
    const Summary s = summarize(std::vector<uint64_t>(samples.data() + size_t(h) * iters,
                                                      samples.data() + size_t(h + 1) * iters));
    r.worst_p50 = std::max(r.worst_p50, s.p50);
    r.worst_p99 = std::max(r.worst_p99, s.p99);
  }
  return r;
}

const char kUsage[] =
    "usage: hot_path [--quick]\n"
    "Times bb_bubble_begin + bb_bubble_end on the trainer with 0..64 attached tasks and 1..16\n"
    "hubs, beside a bare futex wake. --quick: a short run with fewer samples.\n";

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv, kUsage);
  print_machine(argc, argv);
  RuntimeDir dir;
  const size_t idle_iters = args.quick ? 20000 : 200000;
  const size_t spin_iters = args.quick ? 2000 : 20000;
  const size_t sleep_iters = args.quick ? 300 : 3000;
  const size_t hub_iters = args.quick ? 500 : 5000;
  pin_cpu(kTrainerCpu);
  const double timer = timer_overhead_ns();
  std::vector<uint64_t> batches(200);
  for (auto& b : batches) {
    const uint64_t c0 = bb_now_ns();
    for (int i = 0; i < 1000; ++i) (void)bb_now_ns();
    b = bb_now_ns() - c0;
  }
  const double clock_ns = summarize(batches).p50 / 1000;
  pin_cpu(-1);
  std::printf("- placement: trainers on CPU %d, tasks and floor peers on CPU %d.\n"
              "- clock: one bb_now_ns() call costs %.1f ns (median of 200 batches of 1000); begin and end read it "
              "once each, so %.0f ns of every begin+end is the clock.\n"
              "- timing: two bb_now_ns() back to back differ by %s ns (p50; seen: %s, so single "
              "timings here move in those steps); the figures include "
              "that per timed call, except the row of %d pairs timed as one (the mean per pair "
              "of each batch; the target is read there).\n"
              "- floor: spinning rows, two handshakes (each a store to a word a peer spins on + a "
              "seq_cst fence + a load of a line the peer wrote, timed like begin and end with a "
              "timer delta each) plus the two clock reads begin and end make; sleeping rows, a bare FUTEX_WAKE of a process in "
              "FUTEX_WAIT on a shared word, after the same gap (%.0f us).\n\n",
              kTrainerCpu, kTaskCpu, clock_ns, 2 * clock_ns, fmt_ns(timer).c_str(),
              clock_steps().c_str(), kBatch,
              double(kSleepGapNs) / 1e3);

  std::printf("(a-c) begin+end on one hub (max_slots %u), ns\n\n", kMaxSlots);
  std::printf("| attached tasks | started task | samples | begin+end p50 | p99 | begin p50 | "
              "end p50 | futex wakes/bubble | floor p50 | floor p99 | ratio p50 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  const RowResult idle = run_row(Row::kIdle, 0, idle_iters, dir);
  std::printf("| 0 | none | %zu | %s | %s | %s | %s | 0 | %s (2 clock reads) | | %.2f |\n",
              idle.cost.n, fmt_ns(idle.cost.p50).c_str(), fmt_ns(idle.cost.p99).c_str(),
              fmt_ns(idle.begin.p50).c_str(), fmt_ns(idle.end.p50).c_str(),
              fmt_ns(2 * clock_ns).c_str(), idle.cost.p50 / (2 * clock_ns));
  std::printf("| 0 | none, %d pairs timed as one | %zu batches | %s | %s | | | 0 | %s (2 clock "
              "reads) | | %.2f |\n",
              kBatch, idle.floor.n, fmt_ns(idle.floor.p50).c_str(), fmt_ns(idle.floor.p99).c_str(),
              fmt_ns(2 * clock_ns).c_str(), idle.floor.p50 / (2 * clock_ns));
  std::fflush(stdout);
  double spin64 = 0, spin64_floor = 0, sleep1_ratio = 0, sleep64_ratio = 0, worst_sleep_ratio = 0;
  for (uint32_t n : {1u, 16u, 64u}) {
    const RowResult s = run_row(Row::kSpin, n, spin_iters, dir);
    const double spin_floor = s.floor2.p50 + 2 * clock_ns;
    std::printf("| %u | spins | %zu | %s | %s | %s | %s | %.2f | %s (2 x %s + 2 clock reads) | "
                "%s | %.2f |\n", n,
                s.cost.n, fmt_ns(s.cost.p50).c_str(), fmt_ns(s.cost.p99).c_str(),
                fmt_ns(s.begin.p50).c_str(), fmt_ns(s.end.p50).c_str(), s.wakes_per_bubble,
                fmt_ns(spin_floor).c_str(), fmt_ns(s.floor.p50).c_str(),
                fmt_ns(s.floor2.p99 + 2 * clock_ns).c_str(),
                spin_floor > 0 ? s.cost.p50 / spin_floor : 0.0);
    std::fflush(stdout);
    if (n == 64) {
      spin64 = s.cost.p50;
      spin64_floor = spin_floor;
    }
    const RowResult z = run_row(Row::kSleep, n, sleep_iters, dir);
    const double ratio = z.floor.p50 > 0 ? z.cost.p50 / z.floor.p50 : 0;
    std::printf("| %u | sleeps | %zu | %s | %s | %s | %s | %.2f | %s | %s | %.2f |\n", n,
                z.cost.n, fmt_ns(z.cost.p50).c_str(), fmt_ns(z.cost.p99).c_str(),
                fmt_ns(z.begin.p50).c_str(), fmt_ns(z.end.p50).c_str(), z.wakes_per_bubble,
                fmt_ns(z.floor.p50).c_str(), fmt_ns(z.floor.p99).c_str(), ratio);
    std::fflush(stdout);
    if (n == 1) sleep1_ratio = ratio;
    if (n == 64) sleep64_ratio = ratio;
    worst_sleep_ratio = std::max(worst_sleep_ratio, ratio);
    if (s.filtered + z.filtered)
      std::printf("|   | (left out: %llu spin, %llu sleep bubbles that found the task in another "
                  "state) | | | | | | | | | |\n",
                  (unsigned long long)s.filtered, (unsigned long long)z.filtered);
  }

  std::printf("\n(d) hubs on the node: one trainer process per hub (hub i on CPU i%%2), no task, "
              "50 us sleep between bubbles; begin+end, ns\n\n");
  std::printf("| hubs | samples | p50 (all hubs) | p99 (all hubs) | worst hub p50 | worst hub p99 "
              "| floor p50: 2 clock reads, same place | ratio p50 |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  double hubs16 = 0, hubs16_floor = 0;
  for (uint32_t h : {1u, 2u, 4u, 8u, 16u}) {
    const HubsResult r = run_hubs(h, hub_iters, dir);
    std::printf("| %u | %zu | %s | %s | %s | %s | %s | %.2f |\n", h, r.pooled.n,
                fmt_ns(r.pooled.p50).c_str(), fmt_ns(r.pooled.p99).c_str(),
                fmt_ns(r.worst_p50).c_str(), fmt_ns(r.worst_p99).c_str(),
                fmt_ns(r.clocks.p50).c_str(), r.clocks.p50 > 0 ? r.pooled.p50 / r.clocks.p50 : 0);
    std::fflush(stdout);
    if (h == 16) {
      hubs16 = r.worst_p50;
      hubs16_floor = r.clocks.p50;
    }
  }

  std::printf("\ntargets:\n");
  std::printf("- no task attached, begin+end p50 %s ns <= 100 ns (mean per pair over batches of "
              "%d; timed one pair at a time, with two timer deltas, %s ns): %s\n",
              fmt_ns(idle.floor.p50).c_str(), kBatch, fmt_ns(idle.cost.p50).c_str(),
              vs_target(idle.floor.p50, 100).c_str());
  std::printf("- 64 tasks, started one spinning, p50 %s ns <= 100 ns: %s; the floor of a begin "
              "and an end that each signal a task on the other CPU is %s ns here (ratio %.2f)\n",
              fmt_ns(spin64).c_str(), vs_target(spin64, 100).c_str(), fmt_ns(spin64_floor).c_str(),
              spin64_floor > 0 ? spin64 / spin64_floor : 0.0);
  std::printf("- 16 hubs, worst hub p50 %s ns <= 100 ns: %s; two clock reads in the same place "
              "(cold, one timer delta) cost %s ns\n", fmt_ns(hubs16).c_str(),
              vs_target(hubs16, 100).c_str(), fmt_ns(hubs16_floor).c_str());
  std::printf("- 1 sleeping task, begin+end / bare futex wake = %.2f <= 1.2: %s\n", sleep1_ratio,
              vs_target(sleep1_ratio, 1.2).c_str());
  std::printf("- 64 sleeping tasks, begin+end / bare futex wake = %.2f <= 1.2: %s\n",
              sleep64_ratio, vs_target(sleep64_ratio, 1.2).c_str());
  (void)worst_sleep_ratio;
  return 0;
}
