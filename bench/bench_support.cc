#include "bench_support.h"

#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <stdexcept>

namespace bench {

Summary summarize(std::vector<uint64_t> v) {
  Summary s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  // Nearest rank: the value below which the given share of samples falls.
  auto at = [&](double q) {
    size_t i = size_t(std::ceil(q * double(v.size())));
    i = i == 0 ? 0 : i - 1;
    return double(v[std::min(i, v.size() - 1)]);
  };
  s.p50 = at(0.50);
  s.p99 = at(0.99);
  s.p999 = at(0.999);
  s.max = double(v.back());
  double sum = 0;
  for (uint64_t x : v) sum += double(x);
  s.mean = sum / double(v.size());
  return s;
}

bool pin_cpu(int cpu) {
  if (cpu < 0) return true;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof set, &set) == 0;
}

void spin_until(uint64_t t) {
  while (bb_now_ns() < t) __builtin_ia32_pause();
}

void sleep_until(uint64_t t, uint64_t spin_ns) {
  const uint64_t now = bb_now_ns();
  if (t > now + spin_ns) {
    const uint64_t wake = t - spin_ns;
    timespec ts{time_t(wake / 1000000000), long(wake % 1000000000)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, nullptr) == EINTR) {
    }
  }
  spin_until(t);
}

bool wait_for(const std::function<bool()>& cond, uint64_t timeout_ns) {
  const uint64_t until = bb_now_ns() + timeout_ns;
  for (uint32_t i = 0;; ++i) {
    if (cond()) return true;
    if (bb_now_ns() >= until) return cond();
    if ((i & 255) == 255) sched_yield();
    else __builtin_ia32_pause();
  }
}

void precise_sleeps() { prctl(PR_SET_TIMERSLACK, 1); }

Child::Child(int cpu, std::function<int()> fn) {
  std::fflush(nullptr);  // or the child would flush the parent's buffered output again
  const pid_t parent = getpid();
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid_ == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(99);
    // The timer slack stays the default: a task's timed sleeps (predictive wake) end as late as
    // they would in any process. The sides that only keep a schedule ask for precise_sleeps().
    if (!pin_cpu(cpu)) {
      std::fprintf(stderr, "cannot pin to CPU %d: %s\n", cpu, std::strerror(errno));
      _exit(98);
    }
    int rc = 97;
    try {
      rc = fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child failed: %s\n", e.what());
    }
    std::fflush(nullptr);
    _exit(rc);
  }
}

Child::~Child() {
  if (pid_ > 0 && !done_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

int Child::wait(uint64_t timeout_ns) {
  if (pid_ <= 0 || done_) return -1;
  const uint64_t until = bb_now_ns() + timeout_ns;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      done_ = true;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    if (bb_now_ns() >= until) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      done_ = true;
      return -1;
    }
    usleep(1000);
  }
}

SharedBytes::SharedBytes(size_t bytes) : n_(bytes ? bytes : 1) {
  p_ = mmap(nullptr, n_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p_ == MAP_FAILED) throw std::runtime_error("mmap of shared results failed");
}

SharedBytes::~SharedBytes() { munmap(p_, n_); }

RuntimeDir::RuntimeDir() {
  char tmpl[] = "/tmp/bubble-bench-XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

RuntimeDir::~RuntimeDir() {
  if (DIR* d = opendir(path_.c_str())) {
    while (dirent* e = readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, ".."))
        unlink((path_ + "/" + e->d_name).c_str());
    closedir(d);
  }
  rmdir(path_.c_str());
}

bool Args::has(const char* flag) const {
  return std::find(argv.begin(), argv.end(), std::string(flag)) != argv.end();
}

Args parse_args(int argc, char** argv, const char* usage) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--help" || s == "-h") {
      std::printf("%s", usage);
      std::exit(0);
    }
    if (s == "--quick") {
      a.quick = true;
    } else if (s.rfind("--", 0) != 0) {
      std::fprintf(stderr, "unexpected argument '%s'\n%s", s.c_str(), usage);
      std::exit(2);
    }
    a.argv.push_back(s);
  }
  return a;
}

static std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  return "unknown";
}

void print_machine(int argc, char** argv) {
  const char* slash = std::strrchr(argv[0], '/');
  std::string cmd = "./";
  cmd += slash ? slash + 1 : argv[0];
  for (int i = 1; i < argc; ++i) {
    cmd += ' ';
    cmd += argv[i];
  }
  utsname u{};
  uname(&u);
  char date[64];
  const time_t t = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", gmtime(&t));
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  std::printf("- command: `%s` (in the build directory's bench/)\n", cmd.c_str());
  std::printf("- date: %s; libbubble %s\n", date, bb_version());
  std::printf("- machine: %s, %ld CPUs online, kernel %s %s; load average at start %.2f\n",
              cpu_model().c_str(), sysconf(_SC_NPROCESSORS_ONLN), u.sysname, u.release, load[0]);
}

double timer_overhead_ns() {
  std::vector<uint64_t> v(20000);
  for (auto& x : v) {
    const uint64_t a = bb_now_ns();
    const uint64_t b = bb_now_ns();
    x = b - a;
  }
  return summarize(std::move(v)).p50;
}

std::string clock_steps() {
  // Back-to-back reads differ by the call's cost rounded to the clock's step: a clock that
  // counts nanoseconds shows every value near the cost, a coarser one only multiples of its step.
  constexpr size_t kN = 20000;
  std::map<uint64_t, size_t> count;
  for (size_t i = 0; i < kN; ++i) {
    const uint64_t a = bb_now_ns();
    const uint64_t b = bb_now_ns();
    ++count[b - a];
  }
  std::string out;
  for (const auto& [delta, n] : count) {
    if (n * 100 < kN) continue;  // under 1%: preemption and the like
    char b[48];
    std::snprintf(b, sizeof b, "%s%llu ns (%.0f%%)", out.empty() ? "" : ", ",
                  (unsigned long long)delta, 100.0 * double(n) / kN);
    out += b;
  }
  return out;
}

std::string fmt_ns(double ns) {
  char b[32];
  std::snprintf(b, sizeof b, ns < 10 ? "%.1f" : "%.0f", ns);
  return b;
}

std::string fmt_us(double ns) {
  char b[32];
  // Three decimals below a microsecond, where spinning figures live.
  std::snprintf(b, sizeof b, ns < 1000 ? "%.3f" : ns < 100000 ? "%.2f" : "%.0f", ns / 1e3);
  return b;
}

std::string vs_target(double value, double target) {
  char b[48];
  std::snprintf(b, sizeof b, "%.2fx of target (%s)", value / target,
                value <= target ? "met" : "MISSED");
  return b;
}

std::string job_id(const char* what) {
  return std::string("bench-") + what + "-" + std::to_string(getpid());
}

void check(bb_status st, const char* what) {
  if (st == BB_OK) return;
  std::fprintf(stderr, "%s failed: %s: %s\n", what, bb_status_name(st), bb_last_error());
  std::fflush(nullptr);
  _exit(90);
}

}  // namespace bench
