// What every benchmark here shares: samples and their percentiles, CPU pinning, forked children
// that are always killed and reaped, shared memory for results, a private runtime directory,
// and the description of the machine printed above each table.
//
// The orchestrating process never opens a libbubble handle, a gRPC channel or an iceoryx
// runtime: it only forks. Every measuring party is a child forked from a process with a single
// thread, so no lock can be inherited held.
#pragma once

#include <bubble/bubble.h>

#include <cstdint>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include <sys/types.h>

namespace bench {

// Order statistics of a set of nanosecond samples.
struct Summary {
  size_t n = 0;
  double p50 = 0, p99 = 0, p999 = 0, max = 0, mean = 0;
};
Summary summarize(std::vector<uint64_t> samples);

// Pins the calling thread (and threads it creates later) to one CPU; false if that failed.
bool pin_cpu(int cpu);
// Timed sleeps of the calling thread end on time (1 ns of timer slack instead of 50 us): for a
// waker or trainer keeping a schedule, never for a measured task.
void precise_sleeps();

// Spins until bb_now_ns() >= t.
void spin_until(uint64_t t_ns);
// Sleeps most of the way to t, then spins the last `spin_ns` (a punctual wake-up).
void sleep_until(uint64_t t_ns, uint64_t spin_ns = 100'000);

// Polls cond (spinning, yielding now and then) until it holds or timeout_ns passes.
bool wait_for(const std::function<bool()>& cond, uint64_t timeout_ns);

// A forked child running fn on `cpu` (-1: not pinned); its exit code is fn's result. The child
// dies with its parent (PR_SET_PDEATHSIG). The destructor SIGKILLs and reaps it if it is still
// running.
class Child {
 public:
  Child(int cpu, std::function<int()> fn);
  ~Child();
  Child(Child&& o) noexcept : pid_(o.pid_), done_(o.done_) { o.pid_ = -1; }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  pid_t pid() const { return pid_; }
  // Waits up to timeout_ns for the exit; returns the exit code, or -1 (killed on timeout or by a
  // signal).
  int wait(uint64_t timeout_ns);

 private:
  pid_t pid_ = -1;
  bool done_ = false;
};

// Anonymous MAP_SHARED memory, visible to children forked after it is made. Zero-filled.
class SharedBytes {
 public:
  explicit SharedBytes(size_t bytes);
  ~SharedBytes();
  SharedBytes(const SharedBytes&) = delete;
  SharedBytes& operator=(const SharedBytes&) = delete;
  void* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

template <typename T>
class Shared {
 public:
  Shared() : mem_(sizeof(T)) { new (mem_.data()) T(); }
  T* operator->() const { return static_cast<T*>(mem_.data()); }
  T& operator*() const { return *static_cast<T*>(mem_.data()); }

 private:
  SharedBytes mem_;
};

// A sample array in shared memory.
class SharedSamples {
 public:
  explicit SharedSamples(size_t cap) : mem_(cap * sizeof(uint64_t)), cap_(cap) {}
  uint64_t* data() const { return static_cast<uint64_t*>(mem_.data()); }
  size_t capacity() const { return cap_; }
  std::vector<uint64_t> take(size_t n) const {
    return std::vector<uint64_t>(data(), data() + (n < cap_ ? n : cap_));
  }

 private:
  SharedBytes mem_;
  size_t cap_;
};

// A private runtime directory for hubs (0700, removed with everything in it at the end).
class RuntimeDir {
 public:
  RuntimeDir();
  ~RuntimeDir();
  const char* path() const { return path_.c_str(); }

 private:
  std::string path_;
};

// "--quick" and friends.
struct Args {
  bool quick = false;
  bool has(const char* flag) const;
  std::vector<std::string> argv;
};
Args parse_args(int argc, char** argv, const char* usage);

// Prints the command, date, CPU model, CPU count, kernel and load average.
void print_machine(int argc, char** argv);

// The median cost of reading bb_now_ns() twice in a row: what a timed call's figure includes
// beyond the call itself.
double timer_overhead_ns();

// A nanosecond figure printed in ns, or in us with two decimals.
// The differences two back-to-back bb_now_ns() reads take, those seen in at least 1% of 20000
// pairs, as "20 ns (52%), 30 ns (46%)": how finely the clock resolves this machine's figures.
std::string clock_steps();

std::string fmt_ns(double ns);
std::string fmt_us(double ns);
// "0.85x (met)" against a target that the figure must stay at or below.
std::string vs_target(double value, double target);

// Job ids unique to this run, so parallel runs and leftovers never collide.
std::string job_id(const char* what);

// Aborts the child with a message when a libbubble call fails.
void check(bb_status st, const char* what);

}  // namespace bench
