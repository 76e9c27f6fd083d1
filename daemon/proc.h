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

// Sends sig to every live process of process group pgid that started at or after since (clock
// ticks since boot) and whose environment holds env_entry ("KEY=value", as the agent gave it to
// the task): the members a task's group can have. A bare kill(-pgid) is not safe once the
// group's leader is gone: when its last member exits the number is free, and the kernel may
// hand it to any new session or job, which started later and so passes the time check but not
// the environment's. Each member is signalled through a pidfd opened before its identity is
// checked again, so a pid reused in between is not hit either. A process whose environment
// cannot be read (not dumpable) is left alone. anywhere_entry (if not empty) names one launch
// of one task alone (BUBBLE_LAUNCH): a live process of any group that started at or after
// since and holds it is signalled as well, so a descendant that left the group (setsid, a
// daemon) is reached too. Returns how many processes were signalled.
int signal_task_group(pid_t pgid, uint64_t since, const std::string& env_entry, int sig,
                      const std::string& anywhere_entry = "");

// The launch wrapper (below) left running for exit_file: a live process of this effective uid,
// leading its own process group, whose command line is `... --exec-task EXIT_FILE -- ...`.
// The exit file's path names one task of one state directory, so this finds a task the agent
// started but had not recorded as started when it died. 0 if there is none; else its pid, and
// *start_time its start time.
pid_t find_exec_wrapper(const std::string& exit_file, uint64_t* start_time);

// The kernel's id of this boot (/proc/sys/kernel/random/boot_id), "" if unreadable. Pids and
// start times name processes only within one boot.
std::string boot_id();

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
