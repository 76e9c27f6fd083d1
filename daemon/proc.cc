#include "daemon/proc.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

namespace bb::daemon {

bool read_proc_stat(pid_t pid, ProcStat* out) {
  if (pid <= 0) return false;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = 0;
  // The command name may contain spaces and parentheses: fields resume after the last ')'.
  char* rp = strrchr(buf, ')');
  if (!rp || rp[1] == 0) return false;
  char state = 0;
  int ppid = 0, pgid = 0;
  unsigned long long start = 0;
  // Fields 3.. : state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime
  // stime cutime cstime priority nice num_threads itrealvalue starttime
  if (sscanf(rp + 2,
             "%c %d %d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
             &state, &ppid, &pgid, &start) != 4) {
    return false;
  }
  out->pid = pid;
  out->ppid = ppid;
  out->pgid = pgid;
  out->state = state;
  out->start_time = start;
  return true;
}

bool same_process(pid_t pid, uint64_t start_time) {
  ProcStat st;
  if (!read_proc_stat(pid, &st)) return false;
  return st.start_time == start_time && st.state != 'Z' && st.state != 'X';
}

namespace {

// True if /proc/<pid>/environ (the environment the process was started with) holds entry.
bool environ_holds(pid_t pid, const std::string& entry) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/environ", static_cast<int>(pid));
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string env;
  char buf[4096];
  ssize_t n;
  while (env.size() < (1u << 20) && (n = read(fd, buf, sizeof buf)) > 0) env.append(buf, n);
  close(fd);
  for (size_t at = 0; at < env.size();) {
    size_t end = env.find('\0', at);
    if (end == std::string::npos) end = env.size();
    if (env.compare(at, end - at, entry) == 0) return true;
    at = end + 1;
  }
  return false;
}

}  // namespace

int signal_task_group(pid_t pgid, uint64_t since, const std::string& env_entry, int sig,
                      const std::string& anywhere_entry) {
  if (pgid <= 1 || env_entry.empty()) return 0;
  const uid_t me = geteuid();
  DIR* d = opendir("/proc");
  if (!d) return 0;
  int signalled = 0;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const long pid = strtol(e->d_name, &end, 10);
    if (pid <= 0 || !end || *end) continue;
    ProcStat st;
    if (!read_proc_stat(static_cast<pid_t>(pid), &st) || st.start_time < since ||
        st.state == 'Z' || st.state == 'X')
      continue;
    if (st.pgid != pgid) {
      // Outside the group: only by the launch's own mark, and only a process of this user
      // (reading another's environment is refused anyway, unless the agent runs as root).
      struct stat ps;
      char path[64];
      snprintf(path, sizeof path, "/proc/%ld", pid);
      if (anywhere_entry.empty() || stat(path, &ps) != 0 || ps.st_uid != me) continue;
    }
    const long fd = syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0);
    if (fd < 0) continue;  // gone meanwhile
    // The pidfd names one process for good: if the pid still has the start time checked
    // above, the descriptor is that process.
    ProcStat again;
    const bool in_group = st.pgid == pgid;
    if (read_proc_stat(static_cast<pid_t>(pid), &again) && again.start_time == st.start_time &&
        again.pgid == st.pgid &&
        environ_holds(static_cast<pid_t>(pid), in_group ? env_entry : anywhere_entry) &&
        syscall(SYS_pidfd_send_signal, static_cast<int>(fd), sig, nullptr, 0) == 0)
      ++signalled;
    close(static_cast<int>(fd));
  }
  closedir(d);
  return signalled;
}

pid_t find_exec_wrapper(const std::string& exit_file, uint64_t* start_time) {
  DIR* d = opendir("/proc");
  if (!d) return 0;
  pid_t found = 0;
  // argv[1..3] as launch() writes them, each with its NUL.
  std::string want = std::string("--exec-task") + '\0' + exit_file + '\0' + "--" + '\0';
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const long pid = strtol(e->d_name, &end, 10);
    if (pid <= 0 || !end || *end) continue;
    char path[64];
    snprintf(path, sizeof path, "/proc/%ld/cmdline", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st;
    // argv[0], then the three arguments: read no more than that can take.
    std::string cmd;
    char buf[4096];
    ssize_t n;
    while (cmd.size() < want.size() + 8192 && (n = read(fd, buf, sizeof buf)) > 0)
      cmd.append(buf, static_cast<size_t>(n));
    const bool ours = fstat(fd, &st) == 0 && st.st_uid == geteuid();
    close(fd);
    const size_t arg1 = cmd.find('\0');
    if (!ours || arg1 == std::string::npos || cmd.compare(arg1 + 1, want.size(), want) != 0)
      continue;
    ProcStat ps;
    if (!read_proc_stat(static_cast<pid_t>(pid), &ps) || ps.pgid != pid || ps.state == 'Z' ||
        ps.state == 'X')
      continue;
    found = static_cast<pid_t>(pid);
    *start_time = ps.start_time;
    break;
  }
  closedir(d);
  return found;
}

std::string boot_id() {
  FILE* f = fopen("/proc/sys/kernel/random/boot_id", "re");
  if (!f) return "";
  char buf[64] = {0};
  const bool ok = fgets(buf, sizeof buf, f) != nullptr;
  fclose(f);
  if (!ok) return "";
  std::string id = buf;
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

bool read_exit_file(const std::string& path, ExitStatus* out) {
  FILE* f = fopen(path.c_str(), "re");
  if (!f) return false;
  char kind[16] = {0};
  int value = 0;
  bool ok = fscanf(f, "%15s %d", kind, &value) == 2;
  fclose(f);
  if (!ok) return false;
  out->known = true;
  if (strcmp(kind, "signal") == 0) {
    out->signal = value;
    out->code = 128 + value;
  } else {
    out->signal = 0;
    out->code = value;
  }
  return true;
}

void run_exec_wrapper(const std::string& exit_file, char** argv) {
  const pid_t wrapper = getpid();
  pid_t child = fork();
  if (child < 0) {
    fprintf(stderr, "bubbled: cannot start the task: fork: %s\n", strerror(errno));
    _exit(127);
  }
  if (child == 0) {
    // The task must not outlive its wrapper: `bubblectl list` shows the wrapper's pid, and a
    // SIGKILL of that pid alone would otherwise leave the task running unsupervised. The
    // setting survives exec. If the wrapper died before prctl took effect, nobody is left to
    // deliver the signal, so check the parent after setting it.
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
      fprintf(stderr, "bubbled: cannot start the task: prctl(PR_SET_PDEATHSIG): %s\n",
              strerror(errno));
      _exit(127);
    }
    if (getppid() != wrapper) _exit(127);
    execvp(argv[0], argv);
    fprintf(stderr, "bubbled: cannot run %s: %s (check the command and PATH)\n", argv[0],
            strerror(errno));
    _exit(127);
  }
  signal(SIGTERM, SIG_IGN);
  signal(SIGINT, SIG_IGN);
  signal(SIGHUP, SIG_IGN);
  signal(SIGQUIT, SIG_IGN);
  int status = 0;
  while (waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) _exit(127);
  }
  char line[64];
  int code;
  if (WIFSIGNALED(status)) {
    snprintf(line, sizeof line, "signal %d\n", WTERMSIG(status));
    code = 128 + WTERMSIG(status);
  } else {
    snprintf(line, sizeof line, "exit %d\n", WEXITSTATUS(status));
    code = WEXITSTATUS(status);
  }
  std::string tmp = exit_file + ".tmp";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd >= 0) {
    ssize_t w = write(fd, line, strlen(line));
    fsync(fd);
    close(fd);
    if (w > 0) rename(tmp.c_str(), exit_file.c_str());
  }
  _exit(code);
}

}  // namespace bb::daemon
