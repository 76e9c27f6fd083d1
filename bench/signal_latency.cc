// signal_latency: how fast a side task hears from its trainer, beside the other ways two
// processes can wake each other, all measured in one run.
//
//   (a+d) one-way wake latency: bubble begin -> the task's wait_start returns (the trainer
//         stamps bb_now_ns() just before bb_bubble_begin, the task when wait_start returns),
//         with the task asleep
//         (BB_WAKE_SLEEP) or spinning (BB_WAKE_SPIN); beside it, in the matching wait mode, a
//         bare futex wake (the floor of sleeping), a shared-memory spin (the floor of spinning),
//         eventfd, a pipe, a Unix socket, a POSIX message queue, iceoryx and a gRPC unary call
//         (the waker stamps just before its send). Peers take turns in rounds, so drifting
//         load on the machine hits them alike.
//   (b)   pause to ack: bubble end -> the task's ack, for an imperative task polling
//         bb_task_should_pause between tiny units of work, and an iterative one (bb_task_run).
//   (c)   predictive wake with a periodic trainer: start latency and the CPU the waiting costs,
//         for BB_WAKE_PREDICTIVE, BB_WAKE_SLEEP and BB_WAKE_SPIN, beside a bare spin whose
//         waker keeps the trainer's schedule (asleep until shortly before each signal, so it
//         signals with cold caches as a trainer coming from its compute does).
//
// Placement: the waker (trainer) on CPU 0, the waiter (task) on CPU 1.

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "bench_support.h"
#include "channel.h"

extern char** environ;

using namespace bench;

namespace {

constexpr int kWakerCpu = 0, kWaiterCpu = 1;
constexpr size_t kWarmup = 20;  // first wake-ups of every run, left out (connections, caches)
constexpr uint64_t kSleepGapNs = 300'000;
constexpr uint64_t kBusyGapNs = 20'000;
constexpr uint64_t kSecond = 1'000'000'000ull;

struct Words {
  alignas(64) uint32_t futex_word;
  alignas(64) uint32_t spin_word;
  alignas(64) unsigned char spin_timed_line[64];
  alignas(64) unsigned char spin_handshake_lines[128];
};

// ------------------------------------------------------------------------------------------
// One run of a peer channel: n wake-ups after kWarmup.

struct PeerCtl {
  std::atomic<uint32_t> ready, failed;
  alignas(64) std::atomic<uint64_t> done;
};

// The two clock reads of every sample go into two arrays, each written by one side only and
// paired once the run is over: a stamp stored where the other side reads it would make the
// signal wait for that line to come back (a locked bump drains the store first), and count the
// benchmark's own cross-CPU traffic in the figure. Each side first writes every page of its array,
// so that no first write inside a measured interval is a page fault.
struct Stamps {
  explicit Stamps(size_t n) : sent(n), seen(n) {}
  SharedSamples sent, seen;  // by the signalling side; by the side that wakes
  static void prefault(const SharedSamples& a) {
    for (size_t i = 0; i < a.capacity(); i += 512) a.data()[i] = 0;
  }
  // seen - sent of samples [from, to).
  std::vector<uint64_t> latencies(size_t from, size_t to) const {
    std::vector<uint64_t> v;
    for (size_t k = from; k < to && k < sent.capacity(); ++k)
      v.push_back(seen.data()[k] - sent.data()[k]);
    return v;
  }
};

// period_ns: signal every period_ns, sleeping between signals as the trainer of (c) does,
// instead of spinning through a short gap.
bool run_channel(Channel& ch, bool busy, size_t n, std::vector<uint64_t>* out, std::string* why,
                 uint64_t period_ns = 0) {
  if (!ch.prepare(busy, why)) return false;
  Shared<PeerCtl> c;
  const size_t total = n + kWarmup;
  Stamps stamps(total);
  const uint64_t gap = busy ? kBusyGapNs : kSleepGapNs;
  int waiter_rc, waker_rc;
  {
    Child waiter(kWaiterCpu, [&]() -> int {
      size_t k = 0;
      Stamps::prefault(stamps.seen);
      const int rc = ch.run_waiter(
          busy, [&] { c->ready.store(1); },
          [&] {
            stamps.seen.data()[k] = bb_now_ns();
            c->done.store(++k, std::memory_order_release);
            return k < total;
          });
      if (ch.exit_cleanly()) std::exit(rc);
      return rc;
    });
    Child waker(kWakerCpu, [&]() -> int {
      precise_sleeps();
      std::string err;
      if (!ch.setup_waker(&err)) {
        std::fprintf(stderr, "%s: %s\n", ch.name(), err.c_str());
        return 1;
      }
      Stamps::prefault(stamps.sent);
      if (!wait_for([&] { return c->ready.load() != 0; }, 20 * kSecond)) return 2;
      const uint64_t first = bb_now_ns() + 10'000'000;
      for (size_t k = 0; k < total; ++k) {
        if (!wait_for([&] { return c->done.load(std::memory_order_acquire) == k; }, 5 * kSecond))
          return 3;
        if (period_ns) sleep_until(first + k * period_ns);
        else spin_until(bb_now_ns() + gap);
        if (!ch.prepare_signal()) return 4;
        stamps.sent.data()[k] = bb_now_ns();
        if (!ch.signal()) return 4;
      }
      const int rc = wait_for([&] { return c->done.load() == total; }, 5 * kSecond) ? 0 : 5;
      if (ch.exit_cleanly()) std::exit(rc);
      return rc;
    });
    waker_rc = waker.wait(120 * kSecond);
    waiter_rc = waiter.wait(10 * kSecond);
  }
  ch.cleanup();
  if (waker_rc != 0 || waiter_rc != 0) {
    *why = "run failed (waker exit " + std::to_string(waker_rc) + ", waiter exit " +
           std::to_string(waiter_rc) + ")";
    return false;
  }
  const std::vector<uint64_t> v = stamps.latencies(kWarmup, total);
  out->insert(out->end(), v.begin(), v.end());
  return true;
}

// ------------------------------------------------------------------------------------------
// libbubble runs: a trainer child and a task child on a hub in a private runtime directory.

struct BubbleCtl {
  char job[64];
  char dir[128];
  std::atomic<uint32_t> hub_ready, attached, trainer_done;
  alignas(64) std::atomic<uint64_t> started;
  alignas(64) std::atomic<uint64_t> acked;
  // Results.
  std::atomic<uint64_t> wait_cpu_ns, wait_wall_ns, proc_cpu_ns, wall_ns, starts, wakes,
      unit_ns_x1000;
  std::atomic<uint64_t> rt_pause_p50, rt_pause_p99;
};

uint64_t thread_cpu_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return uint64_t(ts.tv_sec) * kSecond + uint64_t(ts.tv_nsec);
}

uint64_t process_cpu_ns() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return (uint64_t(u.ru_utime.tv_sec) + uint64_t(u.ru_stime.tv_sec)) * kSecond +
         (uint64_t(u.ru_utime.tv_usec) + uint64_t(u.ru_stime.tv_usec)) * 1000;
}

bb_trainer_h open_trainer(BubbleCtl* c) {
  bb_trainer_options_t o;
  bb_trainer_options_init(&o);
  o.runtime_dir = c->dir;
  bb_trainer_h t = nullptr;
  check(bb_trainer_open(c->job, 0, &o, &t), "bb_trainer_open");
  c->hub_ready.store(1);
  return t;
}

bb_task_h attach_task(BubbleCtl* c, bb_wake_mode mode) {
  if (!wait_for([&] { return c->hub_ready.load() != 0; }, 10 * kSecond)) _exit(2);
  bb_task_options_t o;
  bb_task_options_init(&o);
  o.wake_mode = mode;
  o.runtime_dir = c->dir;
  bb_task_h t = nullptr;
  check(bb_task_attach(c->job, 0, "bench-task", &o, &t), "bb_task_attach");
  c->attached.store(1);
  return t;
}

void init_ctl(BubbleCtl* c, const RuntimeDir& dir, const char* what) {
  std::snprintf(c->job, sizeof c->job, "%s", job_id(what).c_str());
  std::snprintf(c->dir, sizeof c->dir, "%s", dir.path());
}

// (a): n starts with a gap between them; the task stamps when wait_start returns.
bool run_bubble_start(bb_wake_mode mode, size_t n, const RuntimeDir& dir,
                      std::vector<uint64_t>* out, std::string* why) {
  Shared<BubbleCtl> c;
  init_ctl(&*c, dir, "start");
  const size_t total = n + kWarmup;
  Stamps stamps(total);  // sent just before bb_bubble_begin, seen when wait_start returned
  const uint64_t gap = mode == BB_WAKE_SPIN ? kBusyGapNs : kSleepGapNs;
  int task_rc, trainer_rc;
  {
    Child task(kWaiterCpu, [&]() -> int {
      Stamps::prefault(stamps.seen);
      bb_task_h t = attach_task(&*c, mode);
      bb_start_info_t info{sizeof info};
      size_t k = 0;
      while (bb_task_wait_start(t, -1, &info) == BB_OK) {
        const uint64_t t1 = bb_now_ns();
        if (k < total) stamps.seen.data()[k] = t1;
        c->started.store(++k);
        while (!bb_task_should_pause(t)) __builtin_ia32_pause();
        bb_task_ack_pause(t);
        c->acked.store(k);
      }
      bb_task_detach(t);
      return 0;
    });
    Child trainer(kWakerCpu, [&]() -> int {
      precise_sleeps();
      Stamps::prefault(stamps.sent);
      bb_trainer_h t = open_trainer(&*c);
      if (!wait_for([&] { return c->attached.load() != 0; }, 10 * kSecond)) return 2;
      for (size_t k = 0; k < total; ++k) {
        if (!wait_for([&] { return c->acked.load() == k; }, 5 * kSecond)) return 3;
        spin_until(bb_now_ns() + gap);
        // Stamped before the call, as every peer stamps before its send: the latency counts
        // all of bb_bubble_begin, not only what follows the begin time it records.
        stamps.sent.data()[k] = bb_now_ns();
        bb_bubble_begin(t, 1'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
        if (!wait_for([&] { return c->started.load() == k + 1; }, 5 * kSecond)) return 4;
        bb_bubble_end(t);
      }
      wait_for([&] { return c->acked.load() == total; }, 5 * kSecond);
      bb_trainer_close(t);
      return 0;
    });
    trainer_rc = trainer.wait(120 * kSecond);
    task_rc = task.wait(10 * kSecond);
  }
  if (trainer_rc != 0 || task_rc != 0) {
    *why = "run failed (trainer exit " + std::to_string(trainer_rc) + ", task exit " +
           std::to_string(task_rc) + ")";
    return false;
  }
  const std::vector<uint64_t> v = stamps.latencies(kWarmup, total);
  out->insert(out->end(), v.begin(), v.end());
  return true;
}

// A tiny unit of work (about 0.1 us) between two should_pause polls.
inline void tiny_unit() {
  static volatile uint64_t sink;
  uint64_t x = sink;
  for (int i = 0; i < 40; ++i) x = x * 6364136223846793005ull + 1442695040888963407ull;
  sink = x;
}

struct PauseResult {
  Summary lat;
  double unit_ns = 0, rt_p50 = 0, rt_p99 = 0;
};

struct IterState {
  BubbleCtl* c;
  uint64_t* seen;
  size_t k = 0, total = 0;
  uint64_t units = 0, unit_ns = 0;
};

// (b): the trainer ends the bubble 20 us into the task's work; the task stamps its ack.
bool run_pause(bool iterative, size_t n, const RuntimeDir& dir, PauseResult* r, std::string* why) {
  Shared<BubbleCtl> c;
  init_ctl(&*c, dir, "pause");
  const size_t total = n + kWarmup;
  Stamps stamps(total);  // sent just before bb_bubble_end, seen at the task's ack
  int task_rc, trainer_rc;
  {
    Child task(kWaiterCpu, [&]() -> int {
      Stamps::prefault(stamps.seen);
      bb_task_h t = attach_task(&*c, BB_WAKE_SLEEP);
      uint64_t units = 0, unit_ns = 0;
      if (iterative) {
        IterState s{&*c, stamps.seen.data(), 0, total};
        bb_task_callbacks_t cb;
        bb_task_callbacks_init(&cb);
        cb.user = &s;
        cb.resume = [](void* u) {
          auto* s = static_cast<IterState*>(u);
          s->c->started.store(s->k + 1);
          return 0;
        };
        cb.step = [](void* u, const bb_step_info_t*) {
          auto* s = static_cast<IterState*>(u);
          const uint64_t a = bb_now_ns();
          tiny_unit();
          s->unit_ns += bb_now_ns() - a;
          ++s->units;
          return BB_STEP_CONTINUE;
        };
        // Called when the runtime stops stepping, right before it acks.
        cb.pause = [](void* u) {
          auto* s = static_cast<IterState*>(u);
          if (s->k < s->total) s->seen[s->k] = bb_now_ns();
          s->c->acked.store(++s->k);
          return 0;
        };
        bb_task_run(t, &cb);
        units = s.units;
        unit_ns = s.unit_ns;
      } else {
        size_t k = 0;
        while (bb_task_wait_start(t, -1, nullptr) == BB_OK) {
          c->started.store(k + 1);
          for (;;) {
            const uint64_t a = bb_now_ns();
            tiny_unit();
            unit_ns += bb_now_ns() - a;
            ++units;
            if (bb_task_should_pause(t)) break;
          }
          bb_task_ack_pause(t);
          if (k < total) stamps.seen.data()[k] = bb_now_ns();
          c->acked.store(++k);
        }
      }
      c->unit_ns_x1000.store(units ? unit_ns * 1000 / units : 0);
      bb_task_detach(t);
      return 0;
    });
    Child trainer(kWakerCpu, [&]() -> int {
      precise_sleeps();
      Stamps::prefault(stamps.sent);
      bb_trainer_h t = open_trainer(&*c);
      if (!wait_for([&] { return c->attached.load() != 0; }, 10 * kSecond)) return 2;
      for (size_t k = 0; k < total; ++k) {
        if (!wait_for([&] { return c->acked.load() == k; }, 5 * kSecond)) return 3;
        spin_until(bb_now_ns() + 50'000);
        bb_bubble_begin(t, 10'000'000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
        if (!wait_for([&] { return c->started.load() == k + 1; }, 5 * kSecond)) return 4;
        spin_until(bb_now_ns() + 20'000);
        stamps.sent.data()[k] = bb_now_ns();
        bb_bubble_end(t);
      }
      wait_for([&] { return c->acked.load() == total; }, 5 * kSecond);
      usleep(30000);  // the hub service drains the last reports every 10 ms
      bb_trainer_stats_t s{sizeof s};
      bb_trainer_stats(t, &s);
      c->rt_pause_p50.store(s.pause_latency_p50_ns);
      c->rt_pause_p99.store(s.pause_latency_p99_ns);
      bb_trainer_close(t);
      c->trainer_done.store(1);
      return 0;
    });
    trainer_rc = trainer.wait(120 * kSecond);
    task_rc = task.wait(10 * kSecond);
  }
  if (trainer_rc != 0 || task_rc != 0) {
    *why = "run failed (trainer exit " + std::to_string(trainer_rc) + ", task exit " +
           std::to_string(task_rc) + ")";
    return false;
  }
  r->lat = summarize(stamps.latencies(kWarmup, total));
  r->unit_ns = double(c->unit_ns_x1000.load()) / 1000;
  r->rt_p50 = double(c->rt_pause_p50.load());
  r->rt_p99 = double(c->rt_pause_p99.load());
  return true;
}

// (c)'s figures of one wake mode, summed over its rounds.
struct PeriodicResult {
  std::vector<uint64_t> lat;         // bb_bubble_begin's caller stamp -> wait_start returned
  std::vector<uint64_t> begin_cost;  // the trainer's bb_bubble_begin call, stamp to return
  uint64_t wait_cpu_ns = 0, wait_wall_ns = 0, proc_cpu_ns = 0, wall_ns = 0, starts = 0, wakes = 0;
  std::string why;  // the last failed round's reason
  int failed_rounds = 0;

  // Of the time the task spent waiting (inside bb_task_wait_start), the share its thread ran.
  double wait_cpu_share() const {
    return wait_wall_ns ? double(wait_cpu_ns) / double(wait_wall_ns) : 0;
  }
  double proc_cpu_share() const { return wall_ns ? double(proc_cpu_ns) / double(wall_ns) : 0; }
  // Wakes include the pause wakes of end, which a task polling should_pause never needs.
  double woken_share() const { return starts ? double(wakes) / double(starts) : 0; }
};

// What the task of (c) does with a bubble.
enum class Use {
  kRunOut,      // polls should_pause until the bubble ends, acks, waits for the next
  kRunOutLate,  // the same, but waits 5 us after the pause before acking and waiting
  kYield,       // gives the bubble back at once (wait_start acks it) and waits for the next
};

// (c): a trainer with one bubble of len_ns every period_ns, begun punctually; the task uses each
// bubble as `use` says and waits for the next.
// Adds its figures to *r.
bool run_periodic(bb_wake_mode mode, Use use, uint64_t duration_ns, uint64_t period_ns,
                  uint64_t len_ns, const RuntimeDir& dir, PeriodicResult* r, std::string* why) {
  Shared<BubbleCtl> c;
  init_ctl(&*c, dir, "periodic");
  const size_t cap = duration_ns / period_ns + 16;
  // The task's measured starts: when wait_start returned, and which bubble it was.
  SharedSamples seen(cap), seen_seq(cap);
  // Bubble k (numbered k + 1) stamped just before its bb_bubble_begin, in an array only the
  // trainer writes (see Stamps); paired with the task's stamps by bubble number after the run.
  const uint64_t iters = duration_ns / period_ns + kWarmup;
  SharedSamples begun(iters);
  SharedSamples begin_cost(iters);  // measured bubbles only
  int task_rc, trainer_rc;
  {
    Child task(kWaiterCpu, [&]() -> int {
      Stamps::prefault(seen);
      Stamps::prefault(seen_seq);
      bb_task_h t = attach_task(&*c, mode);
      bb_start_info_t info{sizeof info};
      size_t k = 0;
      uint64_t wait_cpu = 0, wait_wall = 0, cpu_start = 0, wall_start = 0, cpu_end = 0,
               wall_end = 0;
      for (;;) {
        const uint64_t cpu0 = thread_cpu_ns();
        const uint64_t t0 = bb_now_ns();
        if (bb_task_wait_start(t, -1, &info) != BB_OK) break;
        const uint64_t t1 = bb_now_ns();
        if (k == kWarmup) {
          cpu_start = process_cpu_ns();
          wall_start = t1;
        }
        if (k >= kWarmup) {
          wait_cpu += thread_cpu_ns() - cpu0;
          wait_wall += t1 - t0;
          if (k - kWarmup < cap) {
            seen.data()[k - kWarmup] = t1;
            seen_seq.data()[k - kWarmup] = info.bubble_seq;
          }
          // The run ends with the last start: the wait after it ends with the trainer leaving.
          wall_end = t1;
          cpu_end = process_cpu_ns();
        }
        c->started.store(++k);
        if (use == Use::kYield) continue;
        while (!bb_task_should_pause(t)) __builtin_ia32_pause();
        if (use == Use::kRunOutLate) spin_until(bb_now_ns() + 5'000);
        bb_task_ack_pause(t);
        if (c->trainer_done.load()) break;
      }
      c->wall_ns.store(wall_end - wall_start);
      c->proc_cpu_ns.store(cpu_end - cpu_start);
      c->wait_cpu_ns.store(wait_cpu);
      c->wait_wall_ns.store(wait_wall);
      c->acked.store(k);
      bb_task_detach(t);
      return 0;
    });
    Child trainer(kWakerCpu, [&]() -> int {
      precise_sleeps();
      Stamps::prefault(begun);
      Stamps::prefault(begin_cost);
      bb_trainer_h t = open_trainer(&*c);
      if (!wait_for([&] { return c->attached.load() != 0; }, 10 * kSecond)) return 2;
      const uint64_t t0 = bb_now_ns() + 10'000'000;
      uint64_t starts0 = 0, wakes0 = 0;
      for (uint64_t k = 0; k < iters; ++k) {
        if (k == kWarmup) {
          bb_trainer_stats_t s{sizeof s};
          bb_trainer_stats(t, &s);
          starts0 = s.starts;
          wakes0 = s.wakes;
        }
        const uint64_t at = t0 + k * period_ns;
        sleep_until(at);
        const uint64_t stamp = bb_now_ns();
        begun.data()[k] = stamp;  // as in (a)
        bb_bubble_begin(t, len_ns, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
        // After the call, so not counted in the start: what the trainer's thread gave.
        if (k >= kWarmup) begin_cost.data()[k - kWarmup] = bb_now_ns() - stamp;
        sleep_until(at + len_ns);
        bb_bubble_end(t);
      }
      bb_trainer_stats_t s{sizeof s};
      bb_trainer_stats(t, &s);
      c->starts.store(s.starts - starts0);
      c->wakes.store(s.wakes - wakes0);
      c->trainer_done.store(1);
      usleep(20000);
      bb_trainer_close(t);
      return 0;
    });
    trainer_rc = trainer.wait(120 * kSecond + 2 * duration_ns);
    task_rc = task.wait(10 * kSecond);
  }
  if (trainer_rc != 0 || task_rc != 0) {
    *why = "run failed (trainer exit " + std::to_string(trainer_rc) + ", task exit " +
           std::to_string(task_rc) + ")";
    return false;
  }
  const uint64_t got = c->acked.load();
  const size_t n = got > kWarmup ? std::min<size_t>(got - kWarmup, cap) : 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t seq = seen_seq.data()[i];
    if (seq >= 1 && seq <= iters) r->lat.push_back(seen.data()[i] - begun.data()[seq - 1]);
  }
  const std::vector<uint64_t> b = begin_cost.take(iters - kWarmup);
  r->begin_cost.insert(r->begin_cost.end(), b.begin(), b.end());
  r->wall_ns += c->wall_ns.load();
  r->wait_cpu_ns += c->wait_cpu_ns.load();
  r->wait_wall_ns += c->wait_wall_ns.load();
  r->proc_cpu_ns += c->proc_cpu_ns.load();
  r->starts += c->starts.load();
  r->wakes += c->wakes.load();
  return true;
}

// ------------------------------------------------------------------------------------------
// RouDi, the iceoryx broker: started for the run and stopped at the end.

class Roudi {
 public:
  explicit Roudi(const std::string& dir) {
    if (roudi_running()) {
      why_ = "another iox-roudi runs on this machine; not touching it";
      return;
    }
    // A small memory pool: the default configuration maps hundreds of MiB.
    config_ = dir + "/roudi.toml";
    std::ofstream(config_) << "[general]\nversion = 1\n\n[[segment]]\n\n[[segment.mempool]]\n"
                              "size = 128\ncount = 256\n";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    const char* log = getenv("BENCH_ROUDI_LOG");  // RouDi's own output, for debugging
    posix_spawn_file_actions_addopen(&fa, 1, log ? log : "/dev/null", O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const char* argv[] = {"iox-roudi", "-c", config_.c_str(), "-l", log ? "info" : "off", nullptr};
    const int rc = posix_spawnp(&pid_, "iox-roudi", &fa, nullptr, const_cast<char**>(argv), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid_ = -1;
      why_ = std::string("cannot start iox-roudi: ") + std::strerror(rc);
      return;
    }
    // A RouDi that died left its segments; the new one replaces them, so wait for a fresh one.
    const uint64_t started = uint64_t(time(nullptr));
    auto fresh = [started] {
      struct stat st{};
      return stat("/dev/shm/iceoryx_mgmt", &st) == 0 && uint64_t(st.st_mtime) + 1 >= started;
    };
    if (!wait_for(fresh, 10 * kSecond)) {
      why_ = "iox-roudi did not come up within 10 s";
      return;
    }
    usleep(200000);  // its discovery loop starts after the segments exist
  }
  ~Roudi() {
    if (pid_ > 0) {
      // RouDi removes its segments on SIGTERM, after a grace period for its clients.
      kill(pid_, SIGTERM);
      const uint64_t until = bb_now_ns() + 60 * kSecond;
      int st = 0;
      while (waitpid(pid_, &st, WNOHANG) == 0) {
        if (bb_now_ns() > until) {
          kill(pid_, SIGKILL);
          waitpid(pid_, &st, 0);
          break;
        }
        usleep(10000);
      }
      if (getenv("BENCH_DEBUG_ROUDI"))
        std::fprintf(stderr, "roudi: exited=%d code=%d signaled=%d sig=%d\n", WIFEXITED(st),
                     WEXITSTATUS(st), WIFSIGNALED(st), WTERMSIG(st));
    }
    if (!config_.empty()) unlink(config_.c_str());
  }
  bool ok() const { return why_.empty(); }

  static bool roudi_running() {
    DIR* d = opendir("/proc");
    if (!d) return false;
    bool found = false;
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
      std::string path = "/proc/";
      path += e->d_name;
      path += "/comm";
      std::ifstream f(path);
      std::string comm;
      if (std::getline(f, comm) && comm == "iox-roudi") found = true;
    }
    closedir(d);
    return found;
  }
  const std::string& why() const { return why_; }

 private:
  pid_t pid_ = -1;
  std::string config_, why_;
};

// ------------------------------------------------------------------------------------------

struct Row {
  std::string name;
  std::vector<uint64_t> samples;
  std::string why;  // not measured: why (or the last failed round's reason)
  int failed_rounds = 0;  // rounds whose samples were dropped (a lost wake-up ends a round)
};

const char kUsage[] =
    "usage: signal_latency [--quick] [--no-peers]\n"
    "Wake-up latency of libbubble side tasks beside futex, spin, eventfd, pipe, Unix socket,\n"
    "POSIX mq, iceoryx and gRPC; pause-to-ack latency; predictive wake's latency and CPU.\n"
    "--quick: a short run with fewer samples. --no-peers: libbubble rows only.\n";

void print_latency_table(const char* title, const std::vector<Row>& rows, double floor_p50,
                         const char* floor_name) {
  std::printf("%s\n\n", title);
  std::printf("| mechanism | samples | p50 us | p99 us | p99.9 us | max us | p50 / %s |\n",
              floor_name);
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    if (!r.why.empty() && r.samples.empty()) {
      std::printf("| %s | - | - | - | - | - | not measured: %s |\n", r.name.c_str(), r.why.c_str());
      continue;
    }
    const Summary s = summarize(r.samples);
    std::printf("| %s | %zu | %s | %s | %s | %s | %.2f |\n", r.name.c_str(), s.n,
                fmt_us(s.p50).c_str(), fmt_us(s.p99).c_str(), fmt_us(s.p999).c_str(),
                fmt_us(s.max).c_str(), floor_p50 > 0 ? s.p50 / floor_p50 : 0);
  }
  // A failed round's samples are not in its row: say so, or a lost wake-up would only show as a
  // smaller sample count.
  for (const Row& r : rows)
    if (r.failed_rounds && !r.samples.empty())
      std::printf("\n%s: %d round(s) failed and are not counted (last: %s)", r.name.c_str(),
                  r.failed_rounds, r.why.c_str());
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv, kUsage);
  const bool peers = !args.has("--no-peers");
  print_machine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  RuntimeDir dir;
  const size_t sleep_n = args.quick ? 500 : 6000, busy_n = args.quick ? 2000 : 20000;
  // Many short rounds: the VM's wake-up cost drifts over seconds, and a drift that lands on one
  // mechanism's run and not another's moves their ratio.
  const int rounds = args.quick ? 1 : 12;
  std::printf("- placement: waker / trainer on CPU %d, waiter / task on CPU %d; gap before each "
              "signal %.0f us (blocking) or %.0f us (busy); %d round(s), peers taking turns; "
              "the first %zu wake-ups of every run left out\n"
              "- clock: two bb_now_ns() back to back differ by %s, so a latency here moves in "
              "those steps\n\n",
              kWakerCpu, kWaiterCpu, double(kSleepGapNs) / 1e3, double(kBusyGapNs) / 1e3, rounds,
              kWarmup, clock_steps().c_str());

  Shared<Words> words;
  std::unique_ptr<Roudi> roudi;
  if (peers) roudi = std::make_unique<Roudi>(dir.path());

  double libbubble_p50[2] = {0, 0}, floor_p50[2] = {0, 0}, iceoryx_p50[2] = {0, 0};
  double timed_p50 = 0;  // the spin carrying the waker's clock read: the floor of a start
  double handshake_p50 = 0;  // and with the readiness check in front
  for (int busy = 0; busy <= 1; ++busy) {
    std::vector<std::unique_ptr<Channel>> chans;
    if (peers) {
      if (busy) chans.push_back(make_spin_channel(&words->spin_word));
      if (busy) chans.push_back(make_spin_timed_channel(words->spin_timed_line));
      if (busy) chans.push_back(make_spin_handshake_channel(words->spin_handshake_lines));
      else chans.push_back(make_futex_channel(&words->futex_word));
      chans.push_back(make_eventfd_channel());
      chans.push_back(make_pipe_channel());
      chans.push_back(make_unix_socket_channel());
      chans.push_back(make_mqueue_channel());
      chans.push_back(make_iceoryx_channel(dir.path()));
      chans.push_back(make_grpc_channel());
    }
    std::vector<Row> rows(chans.size() + 1);
    const bb_wake_mode mode = busy ? BB_WAKE_SPIN : BB_WAKE_SLEEP;
    rows[0].name = busy ? "libbubble, BB_WAKE_SPIN" : "libbubble, BB_WAKE_SLEEP";
    for (size_t i = 0; i < chans.size(); ++i) rows[i + 1].name = chans[i]->name();
    const size_t per_round = (busy ? busy_n : sleep_n) / size_t(rounds);
    for (int round = 0; round < rounds; ++round) {
      std::string why;
      if (!run_bubble_start(mode, per_round, dir, &rows[0].samples, &why)) {
        rows[0].why = why;
        ++rows[0].failed_rounds;
      }
      for (size_t i = 0; i < chans.size(); ++i) {
        Row& row = rows[i + 1];
        if (!row.why.empty() && row.samples.empty() && round > 0) continue;  // failed before
        why.clear();
        if (std::strncmp(chans[i]->name(), "iceoryx", 7) == 0 && !roudi->ok()) {
          row.why = roudi->why();
          continue;
        }
        if (!run_channel(*chans[i], busy != 0, per_round, &row.samples, &why)) {
          row.why = why;
          ++row.failed_rounds;
        }
      }
    }
    // Floor first, libbubble second, the rest as they came.
    std::vector<Row> ordered;
    if (peers) ordered.push_back(rows[1]);
    ordered.push_back(rows[0]);
    for (size_t i = 2; i < rows.size(); ++i) ordered.push_back(rows[i]);
    const double fl = peers && !rows[1].samples.empty() ? summarize(rows[1].samples).p50 : 0;
    floor_p50[busy] = fl;
    libbubble_p50[busy] = summarize(rows[0].samples).p50;
    for (const Row& r : rows) {
      if (r.name.rfind("iceoryx", 0) == 0 && !r.samples.empty())
        iceoryx_p50[busy] = summarize(r.samples).p50;
      if (r.name.find("waker's clock read") != std::string::npos && !r.samples.empty())
        timed_p50 = summarize(r.samples).p50;
      if (r.name.find("took the last signal") != std::string::npos && !r.samples.empty())
        handshake_p50 = summarize(r.samples).p50;
    }
    print_latency_table(busy ? "(a,d) one-way wake latency, waiter busy-polling"
                             : "(a,d) one-way wake latency, waiter blocked",
                        ordered, fl, busy ? "spin floor" : "futex floor");
    std::fflush(stdout);
  }
  roudi.reset();

  std::printf("(b) pause to ack: bubble end (trainer stamps just before bb_bubble_end) -> the "
              "task's ack, 20 us into the bubble's work\n\n");
  std::printf("| task | samples | unit of work us | p50 us | p99 us | p99.9 us | max us | "
              "runtime's own p50 / p99 us |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  double pause_p50 = 0;
  for (bool iterative : {false, true}) {
    PauseResult r;
    std::string why;
    const char* name = iterative ? "iterative (bb_task_run; stamped in the pause callback)"
                                 : "imperative (should_pause polls; stamped after the ack)";
    if (!run_pause(iterative, args.quick ? 500 : 5000, dir, &r, &why)) {
      std::printf("| %s | not measured: %s |\n", name, why.c_str());
      continue;
    }
    if (!iterative) pause_p50 = r.lat.p50;
    std::printf("| %s | %zu | %.2f | %s | %s | %s | %s | %s / %s |\n", name, r.lat.n,
                r.unit_ns / 1e3, fmt_us(r.lat.p50).c_str(), fmt_us(r.lat.p99).c_str(),
                fmt_us(r.lat.p999).c_str(), fmt_us(r.lat.max).c_str(), fmt_us(r.rt_p50).c_str(),
                fmt_us(r.rt_p99).c_str());
    std::fflush(stdout);
  }

  const uint64_t period = 2'000'000, len = 500'000;
  const uint64_t duration = args.quick ? kSecond : 5 * kSecond;
  // Rounds of one second, the modes taking turns, for the reason (a) has rounds: this VM's
  // cross-CPU cost moves over seconds (a begin measured 140 ns in one quick run and 440 ns in the
  // next), and a shift that lands on one mode's run and not on the floor's moves their ratio.
  const int prounds = int(duration / kSecond);
  std::printf("\n(c) periodic trainer: a %.1f ms bubble every %.1f ms for %.0f s per mode, in %d "
              "round(s) of 1 s, the modes taking turns (bubbles begun punctually); the task runs "
              "each bubble out polling should_pause, unless the row says otherwise\n\n",
              double(len) / 1e6, double(period) / 1e6, double(duration) / 1e9, prounds);
  std::printf("| wake mode | starts | start p50 us | p99 us | p99.9 us | CPU waiting (share of a "
              "core) | task process CPU | futex wakes per start | trainer's bb_bubble_begin p50 / "
              "p99 us |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  struct Variant {
    bb_wake_mode mode;
    Use use;
    const char* name;
  };
  const Variant variants[] = {
      {BB_WAKE_PREDICTIVE, Use::kRunOut, "PREDICTIVE (lead 50 us)"},
      {BB_WAKE_SLEEP, Use::kRunOut, "SLEEP"},
      {BB_WAKE_SPIN, Use::kRunOut, "SPIN"},
      {BB_WAKE_PREDICTIVE, Use::kRunOutLate, "PREDICTIVE, task waits 5 us after each pause"},
      {BB_WAKE_PREDICTIVE, Use::kYield, "PREDICTIVE, task yields each bubble at once"},
  };
  constexpr size_t kVariants = sizeof variants / sizeof variants[0];
  constexpr size_t kTarget = 0;  // the row the target is read on: PREDICTIVE, bubbles run out
  // The floor of this table: a bare spin, its waker keeping the trainer's schedule (asleep
  // until shortly before each signal), its waiter spinning all the time.
  const char* floor_name = "bare shared-memory spin (floor), waker on the same schedule";
  std::unique_ptr<Channel> floor_spin = make_spin_channel(&words->spin_word);
  std::vector<uint64_t> floor_samples;
  std::string floor_why;
  PeriodicResult results[kVariants];
  // Each round's p50 of the floor and of the first (the target's) mode.
  std::vector<std::pair<double, double>> per_round;
  for (int round = 0; round < prounds; ++round) {
    std::vector<uint64_t> f;
    if (peers && floor_why.empty() &&
        !run_channel(*floor_spin, true, kSecond / period, &f, &floor_why, period))
      f.clear();
    floor_samples.insert(floor_samples.end(), f.begin(), f.end());
    for (size_t i = 0; i < kVariants; ++i) {
      const size_t had = results[i].lat.size();
      std::string why;
      if (!run_periodic(variants[i].mode, variants[i].use, kSecond, period, len, dir, &results[i],
                        &why))
      {
        results[i].why = why;
        ++results[i].failed_rounds;
      }
      if (i == kTarget && !f.empty() && results[kTarget].lat.size() > had)
        per_round.emplace_back(
            summarize(f).p50,
            summarize(std::vector<uint64_t>(results[kTarget].lat.begin() + long(had),
                                            results[kTarget].lat.end())).p50);
    }
  }
  double periodic_floor_p50 = 0;
  if (peers) {
    if (floor_samples.empty()) {
      std::printf("| %s | not measured: %s |\n", floor_name, floor_why.c_str());
    } else {
      const Summary f = summarize(floor_samples);
      periodic_floor_p50 = f.p50;
      std::printf("| %s | %zu | %s | %s | %s | 100%% (it spins) | 100%% (it spins) | 0.00 | - |\n",
                  floor_name, f.n,
                  fmt_us(f.p50).c_str(), fmt_us(f.p99).c_str(), fmt_us(f.p999).c_str());
    }
  }
  for (size_t i = 0; i < kVariants; ++i) {
    const PeriodicResult& r = results[i];
    if (r.lat.empty()) {
      std::printf("| %s | not measured: %s |\n", variants[i].name, r.why.c_str());
      continue;
    }
    const Summary l = summarize(r.lat), b = summarize(r.begin_cost);
    std::string name = variants[i].name;
    if (r.failed_rounds)
      name += " (" + std::to_string(r.failed_rounds) + " of " + std::to_string(prounds) +
              " rounds failed: " + r.why + ")";
    std::printf("| %s | %llu | %s | %s | %s | %.1f%% | %.1f%% | %.2f | %s / %s |\n",
                name.c_str(), (unsigned long long)r.starts, fmt_us(l.p50).c_str(),
                fmt_us(l.p99).c_str(), fmt_us(l.p999).c_str(), 100 * r.wait_cpu_share(),
                100 * r.proc_cpu_share(), r.woken_share(), fmt_us(b.p50).c_str(),
                fmt_us(b.p99).c_str());
  }
  std::fflush(stdout);
  const PeriodicResult& pred = results[kTarget];
  const double pred_p50 = pred.lat.empty() ? 0 : summarize(pred.lat).p50;
  if (!per_round.empty()) {
    std::printf("\nper round, p50 of the floor / of PREDICTIVE (us):");
    for (const auto& [f, p] : per_round)
      std::printf(" %s / %s;", fmt_us(f).c_str(), fmt_us(p).c_str());
    std::printf("\n");
  }
  std::printf("\nCPU waiting: the task thread's CPU time inside bb_task_wait_start "
              "(CLOCK_THREAD_CPUTIME_ID) over the wall time it spent inside it (the waiting, whatever the share of each period the task runs); task process CPU: getrusage of the "
              "task process, which also counts the bubble time the task spends polling; "
              "trainer's bb_bubble_begin: the call as the trainer's thread sees it, stamp to "
              "return (a futex wake inside it shows here).\n");

  std::printf("\ntargets:\n");
  if (floor_p50[0] > 0)
    std::printf("- task asleep: libbubble p50 %s us / futex floor %s us = %.2f <= 1.1: %s\n",
                fmt_us(libbubble_p50[0]).c_str(), fmt_us(floor_p50[0]).c_str(),
                libbubble_p50[0] / floor_p50[0],
                vs_target(libbubble_p50[0] / floor_p50[0], 1.1).c_str());
  if (floor_p50[1] > 0)
    std::printf("- task spinning: libbubble p50 %s us / spin floor %s us = %.2f <= 1.1: %s\n",
                fmt_us(libbubble_p50[1]).c_str(), fmt_us(floor_p50[1]).c_str(),
                libbubble_p50[1] / floor_p50[1],
                vs_target(libbubble_p50[1] / floor_p50[1], 1.1).c_str());
  if (floor_p50[1] > 0 && timed_p50 > 0)
    std::printf("  (a start carries its bubble's begin time, read from the clock before it is "
                "stored; the spin carrying the waker's clock read: %s us, %.2f of the bare spin; "
                "libbubble / that = %.2f)\n",
                fmt_us(timed_p50).c_str(), timed_p50 / floor_p50[1], libbubble_p50[1] / timed_p50);
  if (floor_p50[1] > 0 && handshake_p50 > 0)
    std::printf("  (and a start goes only to a task that acked its last run, learnt from a line the "
                "task wrote; that spin with the check in front: %s us, %.2f of the bare spin; "
                "libbubble / that = %.2f)\n",
                fmt_us(handshake_p50).c_str(), handshake_p50 / floor_p50[1],
                libbubble_p50[1] / handshake_p50);
  for (int busy = 0; busy <= 1; ++busy)
    if (iceoryx_p50[busy] > 0)
      std::printf("- %s: libbubble p50 %s us vs iceoryx %s us: %s\n",
                  busy ? "busy" : "blocking", fmt_us(libbubble_p50[busy]).c_str(),
                  fmt_us(iceoryx_p50[busy]).c_str(),
                  libbubble_p50[busy] < iceoryx_p50[busy] ? "below (met)" : "NOT below (MISSED)");
  std::printf("- pause to ack p50 %s us <= 10 us: %s\n", fmt_us(pause_p50).c_str(),
              vs_target(pause_p50, 10'000).c_str());
  std::printf("- predictive wake p50 %s us <= 0.5 us: %s; CPU waiting %.1f%% <= 5%%: %s\n",
              fmt_us(pred_p50).c_str(), vs_target(pred_p50, 500).c_str(),
              100 * pred.wait_cpu_share(), vs_target(pred.wait_cpu_share(), 0.05).c_str());
  if (periodic_floor_p50 > 0) {
    std::printf("  (a bare spin with a waker on the same schedule: %s us; predictive / that = "
                "%.2f",
                fmt_us(periodic_floor_p50).c_str(), pred_p50 / periodic_floor_p50);
    double lo = HUGE_VAL, hi = 0;
    for (const auto& [f, p] : per_round) {
      const double q = f > 0 ? p / f : 0;
      lo = std::min(lo, q);
      hi = std::max(hi, q);
    }
    if (per_round.size() > 1) std::printf("; per round %.2f to %.2f", lo, hi);
    std::printf(")\n");
  }
  return 0;
}
