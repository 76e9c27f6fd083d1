// Test harness for real processes: children that are always killed and reaped (even when a
// test fails half way), their stdout read line by line with deadlines, and a private runtime
// directory that must be empty again at the end.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace bbtest {

inline std::set<std::string> list_dir(const std::string& dir) {
  std::set<std::string> out;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) out.insert(e->d_name);
    closedir(d);
  }
  return out;
}

// A child process with its stdout on a pipe (and, if asked, its stdin on another, for
// write_stdin). The destructor SIGKILLs and reaps it.
class Child {
 public:
  explicit Child(const std::vector<std::string>& argv, bool with_stdin = false) {
    int p[2], in[2] = {-1, -1};
    if (pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
    // A child that exited makes a write to its stdin fail with EPIPE, not kill the test: the
    // write blocks SIGPIPE for its duration (write_stdin).
    if (with_stdin && pipe2(in, O_CLOEXEC) != 0) {
      close(p[0]);
      close(p[1]);
      throw std::runtime_error("pipe2");
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
    if (with_stdin) posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    // Every child starts with no signal blocked and SIGPIPE at its default, whatever the test
    // process or whoever started it had.
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, pipe_only;
    sigemptyset(&none);
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &pipe_only);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    const int rc = posix_spawn(&pid_, args[0], &fa, &attr, args.data(), environ);
    posix_spawnattr_destroy(&attr);
    posix_spawn_file_actions_destroy(&fa);
    close(p[1]);
    out_ = p[0];
    if (with_stdin) {
      close(in[0]);
      in_ = in[1];
    }
    if (rc != 0) {
      close(out_);
      if (in_ >= 0) close(in_);
      throw std::runtime_error("posix_spawn " + argv[0] + ": " + std::strerror(rc));
    }
  }
  ~Child() {
    if (in_ >= 0) close(in_);
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }
  // Writes text to the child's stdin (a Child made with_stdin); false if it could not (also when
  // the child has exited: the SIGPIPE that write raises is blocked and taken back here).
  bool write_stdin(const std::string& text) {
    if (in_ < 0) return false;
    sigset_t pipe_only, old;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_only, &old);
    size_t done = 0;
    bool ok = true;
    while (ok && done < text.size()) {
      const ssize_t n = write(in_, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) ok = false;
      else done += size_t(n);
    }
    if (!ok && errno == EPIPE) {
      const timespec now{0, 0};
      sigtimedwait(&pipe_only, nullptr, &now);  // the SIGPIPE this thread raised
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    return ok;
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }

  // Waits for a stdout line starting with prefix; returns it ("" on timeout or EOF).
  std::string wait_line(const std::string& prefix, int timeout_ms = 10000) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      size_t nl;
      while ((nl = buf_.find('\n')) != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        lines_.push_back(line);
        if (line.compare(0, prefix.size(), prefix) == 0) return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now()).count();
      if (left <= 0) return "";
      pollfd pf{out_, POLLIN, 0};
      if (poll(&pf, 1, int(left)) <= 0) continue;
      char tmp[4096];
      const ssize_t n = read(out_, tmp, sizeof tmp);
      if (n <= 0) return "";
      buf_.append(tmp, size_t(n));
    }
  }
  const std::vector<std::string>& lines() const { return lines_; }

  void signal(int sig) { kill(pid_, sig); }
  // Its threads' states and signal masks (describe_process), for a wait that failed.
  std::string describe() const;

  // Waits up to timeout_ms for the exit; returns the wait status or -1 on timeout.
  int wait_exit(int timeout_ms = 10000) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      int status;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_ = true;
        return status;
      }
      if (std::chrono::steady_clock::now() >= until) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  int in_ = -1;
  bool exited_ = false;
  std::string buf_;
  std::vector<std::string> lines_;
};

// A private runtime directory, set as BUBBLE_RUNTIME_DIR for this process and its children.
class RuntimeDir {
 public:
  RuntimeDir() {
    char tmpl[] = "/tmp/bbtest-XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp");
    path_ = tmpl;
    setenv("BUBBLE_RUNTIME_DIR", path_.c_str(), 1);
  }
  ~RuntimeDir() {
    for (auto& f : list_dir(path_)) unlink((path_ + "/" + f).c_str());
    rmdir(path_.c_str());
    unsetenv("BUBBLE_RUNTIME_DIR");
  }
  const std::string& path() const { return path_; }
  std::set<std::string> files() const { return list_dir(path_); }

 private:
  std::string path_;
};

// Polls cond every millisecond until it holds or timeout_ms passes. For waiting on another
// process's progress, where there is no event to wait on in the test process itself.
template <typename F>
bool eventually(F&& cond, int timeout_ms = 10000) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!cond()) {
    if (std::chrono::steady_clock::now() >= until) return cond();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

inline std::set<std::string> dev_shm() { return list_dir("/dev/shm"); }

// A process's state letter from /proc/<pid>/stat ('R', 'S', 'T' when stopped, ...), 0 if gone.
inline char proc_state(pid_t pid) {
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');  // the name may hold spaces and parentheses
  return paren && paren[1] == ' ' ? paren[2] : 0;
}

// True once every thread of process pid is stopped ('T'): a SIGSTOP is delivered
// asynchronously, and a thread still finishing a call may answer one more request.
inline bool all_threads_stopped(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  const std::set<std::string> tids = list_dir(dir);
  if (tids.empty()) return false;
  for (const std::string& t : tids)
    if (proc_state(pid_t(std::atoi(t.c_str()))) != 'T') return false;
  return true;
}

// What each thread of process pid is doing, for a test that waited on it in vain: its name, state
// letter, the kernel function it sleeps in (wchan), its pending, blocked and caught signal masks,
// and the process's shared pending mask. A stopped process, a signal sitting blocked and a thread
// asleep in a lock read differently here.
inline std::string describe_process(pid_t pid) {
  auto read_file = [](const std::string& path) {
    std::string out;
    if (FILE* f = std::fopen(path.c_str(), "re")) {
      char buf[4096];
      size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
      std::fclose(f);
    }
    while (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
  };
  auto status_fields = [](const std::string& status, std::initializer_list<const char*> keys) {
    std::string out;
    size_t at = 0;
    while (at < status.size()) {
      size_t nl = status.find('\n', at);
      if (nl == std::string::npos) nl = status.size();
      const std::string line = status.substr(at, nl - at);
      for (const char* k : keys)
        if (line.compare(0, std::strlen(k), k) == 0 && line[std::strlen(k)] == ':')
          out += " " + line;
      at = nl + 1;
    }
    return out;
  };
  const std::string base = "/proc/" + std::to_string(pid);
  const std::string status = read_file(base + "/status");
  if (status.empty()) return "process " + std::to_string(pid) + " is gone";
  std::string out = "process " + std::to_string(pid) + ":" + status_fields(status, {"ShdPnd"});
  for (auto& tid : list_dir(base + "/task")) {
    const std::string t = base + "/task/" + tid;
    out += "\n  thread " + tid + " (" + read_file(t + "/comm") + ") wchan=" +
           read_file(t + "/wchan") +
           status_fields(read_file(t + "/status"), {"State", "SigPnd", "SigBlk", "SigCgt"});
  }
  return out;
}

// The ids of this process's threads.
inline std::set<pid_t> thread_ids() {
  std::set<pid_t> out;
  for (auto& name : list_dir("/proc/self/task")) out.insert(pid_t(std::atoi(name.c_str())));
  return out;
}

// Whether the thread tid of this process blocks the signal sig (its SigBlk mask, the one the
// kernel consults when it picks the thread that takes a signal sent to the process).
inline bool thread_blocks(pid_t tid, int sig) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/status", int(tid));
  FILE* f = std::fopen(path, "re");
  if (!f) throw std::runtime_error(std::string("cannot read ") + path);
  char line[256];
  unsigned long long mask = 0;
  bool found = false;
  while (!found && std::fgets(line, sizeof line, f))
    found = std::sscanf(line, "SigBlk: %llx", &mask) == 1;
  std::fclose(f);
  if (!found) throw std::runtime_error(std::string("no SigBlk line in ") + path);
  return (mask >> (sig - 1)) & 1;
}

// A thread's name (its comm), "" if it is gone.
inline std::string thread_name(pid_t tid) {
  char path[64], name[32] = "";
  std::snprintf(path, sizeof path, "/proc/self/task/%d/comm", int(tid));
  if (FILE* f = std::fopen(path, "re")) {
    if (!std::fgets(name, sizeof name, f)) name[0] = 0;
    std::fclose(f);
  }
  std::string out(name);
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// What is wrong with the signal masks of the library's threads (named "bb-...") started since
// `before` was taken: each must block the asynchronous signals (so a signal sent to the process
// reaches the application's own threads) and leave a fault's signals open. "" when all is well;
// *started counts those threads. (A sanitizer may start a thread of its own meanwhile.)
// A new thread starts with every signal blocked and sets the mask it was made with a moment later
// (glibc), so this looks again for up to 2 s before it answers.
inline std::string misplaced_signal_masks(const std::set<pid_t>& before, size_t* started) {
  std::string wrong;
  eventually([&] {
    wrong.clear();
    *started = 0;
    for (pid_t tid : thread_ids()) {
      if (before.count(tid) || thread_name(tid).compare(0, 3, "bb-") != 0) continue;
      ++*started;
      for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2, SIGCHLD, SIGALRM, SIGPIPE})
        if (!thread_blocks(tid, sig))
          wrong += "thread " + std::to_string(tid) + " takes " + strsignal(sig) + "; ";
      for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL})
        if (thread_blocks(tid, sig))
          wrong += "thread " + std::to_string(tid) + " blocks " + strsignal(sig) + "; ";
    }
    return wrong.empty() && *started > 0;  // a new thread names itself a moment later, too
  }, 2000);
  return wrong;
}

inline std::string Child::describe() const { return describe_process(pid_); }

}  // namespace bbtest
