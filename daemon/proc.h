// Process identity and supervision helpers.
//
// A pid alone does not name a process across an agent restart (pids are reused), so the agent
// identifies its tasks by (pid, start time) as the kernel reports it in /proc/<pid>/stat.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace bb::daemon {

struct ProcStat {
  pid_t pid = 0;
  pid_t ppid = 0;
  pid_t pgid = 0;
  char state = 0;           // R, S, T (stopped), Z (zombie), ...
  uint64_t start_time = 0;  // clock ticks since boot
};

// Reads /proc/<pid>/stat. False if the process does not exist.
bool read_proc_stat(pid_t pid, ProcStat* out);

// True if pid names the same live (non-zombie) process that started at start_time.
bool same_process(pid_t pid, uint64_t start_time);

// How a task ended, as the launch wrapper records it next to the logs.
struct ExitStatus {
  bool known = false;
  int code = 0;    // exit code when signal == 0
  int signal = 0;  // the signal that ended it
};

bool read_exit_file(const std::string& path, ExitStatus* out);

// The launch wrapper: `bubbled --exec-task EXITFILE -- PROGRAM ARGS...`. Runs the program as its
// child and writes its exit status to EXITFILE (atomically), so the status survives an agent
// that was down when the task ended. Ignores terminal signals itself: the agent signals the
// whole process group, and the wrapper must outlive its child to record it. The child gets
// PR_SET_PDEATHSIG(SIGKILL), so killing the wrapper alone (the pid `bubblectl list` shows) ends
// the task too instead of orphaning it. Never returns.
[[noreturn]] void run_exec_wrapper(const std::string& exit_file, char** argv);

}  // namespace bb::daemon
