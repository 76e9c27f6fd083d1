/* A trainer process for the multi-process and fault-injection tests (public C ABI only).
 *
 *   bb_test_trainer JOB RANK [--bubble-us N] [--gap-us N] [--max-slots N] [--free-mem N]
 *                   [--lend host|cuda-ipc|cuda-vmm:BYTES] [--lend-device N] [--await-tasks N]
 *                   [--commands]
 *                   [--uid N]
 *
 * Opens the hub, prints "OPEN <pid>", lends memory if asked ("LENT", or "LEND_FAILED <status>
 * <message>" and exit code 3), waits until N tasks are attached if asked, then runs bubbles of
 * --bubble-us separated by --gap-us until SIGTERM/SIGINT (clean close: prints "STOPPING", then
 * "CLOSED <status>" once bb_trainer_close returned, and exits 0 if it returned BB_OK) or SIGKILL
 * (the stale-hub case).
 *
 * --commands: also reads commands on stdin between bubbles, one per line:
 *   S  print "STATS key=value ..." (bubble calls made and failed, hub counters, grant counters,
 *      and "pids=<p1,p2,...>" of the attached tasks)
 *   U MS  bb_trainer_unlend with a deadline MS milliseconds away; prints "UNLENT <status>"
 *      and, unless BB_OK, the library's message after it
 *   Q  close the hub cleanly as on SIGTERM
 * End of stdin (the driver died) also closes the hub: such a trainer never outlives its driver.
 * Every bb_bubble_begin / bb_bubble_end that does not return BB_OK is counted, never retried.
 * --uid N (started as root): runs as uid and gid N from before it opens the hub, so it cannot
 * signal tasks that run as root.
 * --fd-room N: once the awaited tasks are attached, lowers RLIMIT_NOFILE so that exactly N more
 * descriptors can be opened (the limit bounds descriptor numbers, and a new one takes the lowest
 * free number), and prints "LIMITED".
 * --nofile N: once the awaited tasks are attached, lowers RLIMIT_NOFILE to N (below the
 * descriptors the hub service polls, so its poll fails with EINVAL) and prints "LIMITED".
 * --no-robust-list: threads started from then on cannot register a robust futex list
 * (set_robust_list fails, as in a sandbox that denies it), so the kernel will not mark the
 * hub's liveness word when this process dies; tasks must notice its death another way.
 */
#define _GNU_SOURCE
#include <bubble/bubble.h>

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop_flag;
static unsigned long long bubbles_ok, begin_fail, end_fail;
static bb_trainer_h trainer;
static int lent, with_commands;

static void on_signal(int sig) {
  (void)sig;
  stop_flag = 1;
}

static struct timespec span(uint64_t us) {
  struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
  return ts;
}

static void sleep_us(uint64_t us) {
  const struct timespec ts = span(us);
  nanosleep(&ts, NULL);
}

/* A seccomp filter that fails set_robust_list with EPERM and allows everything else. */
static int deny_robust_lists(void) {
  struct sock_filter f[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_set_robust_list, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {(unsigned short)(sizeof f / sizeof f[0]), f};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

static void print_stats(void) {
  bb_trainer_stats_t s;
  memset(&s, 0, sizeof s);
  s.size = sizeof s;
  bb_trainer_stats(trainer, &s);
  bb_grant_stats_t g;
  memset(&g, 0, sizeof g);
  g.size = sizeof g;
  if (lent) bb_trainer_grant_stats(trainer, &g);
  bb_task_info_t tasks[BB_MAX_SLOTS_LIMIT];
  for (unsigned i = 0; i < BB_MAX_SLOTS_LIMIT; ++i) tasks[i].size = sizeof tasks[i];
  size_t n = 0;
  bb_trainer_tasks(trainer, tasks, BB_MAX_SLOTS_LIMIT, &n);
  char pids[BB_MAX_SLOTS_LIMIT * 12] = "";
  size_t off = 0;
  for (size_t i = 0; i < n && i < BB_MAX_SLOTS_LIMIT; ++i)
    off += (size_t)snprintf(pids + off, sizeof pids - off, "%s%d", i ? "," : "", tasks[i].pid);
  printf("STATS calls=%llu begin_fail=%llu end_fail=%llu hub_bubbles=%llu attached=%u "
         "reclaimed=%llu bad=%llu starts=%llu lent=%d capacity=%llu granted=%llu free=%llu "
         "active=%u revoking=%u quarantined=%u made=%llu released_dead=%llu killed=%llu "
         "pids=%s\n",
         bubbles_ok, begin_fail, end_fail, (unsigned long long)s.bubbles,
         s.tasks_attached, (unsigned long long)s.tasks_reclaimed, (unsigned long long)s.tasks_bad,
         (unsigned long long)s.starts, lent, (unsigned long long)g.capacity,
         (unsigned long long)g.granted_bytes, (unsigned long long)g.free_bytes, g.active,
         g.revoking, g.quarantined, (unsigned long long)g.grants_made,
         (unsigned long long)g.released_dead, (unsigned long long)g.tasks_killed,
         n ? pids : "-");
  fflush(stdout);
}

static void unlend(uint64_t ms) {
  const bb_status st = bb_trainer_unlend(trainer, bb_now_ns() + ms * 1000000);
  if (st == BB_OK) printf("UNLENT %s\n", bb_status_name(st));
  else printf("UNLENT %s %s\n", bb_status_name(st), bb_last_error());
  fflush(stdout);
}

/* The gap between bubbles; with --commands it is spent waiting on stdin, so the commands are
 * served on this one thread, between bubbles, never while the hub is being closed. */
static void gap(uint64_t us) {
  if (!with_commands) {
    sleep_us(us);
    return;
  }
  struct pollfd p = {0, POLLIN, 0};
  const struct timespec ts = span(us);
  if (ppoll(&p, 1, &ts, NULL) != 1) return;
  static char line[256];
  static size_t len;
  char buf[256];
  const ssize_t n = read(0, buf, sizeof buf);
  if (n == 0 || (n < 0 && errno != EINTR)) stop_flag = 1;
  for (ssize_t i = 0; i < n; ++i) {
    if (buf[i] != '\n') {
      if (len + 1 < sizeof line) line[len++] = buf[i];
      continue;
    }
    line[len] = 0;
    len = 0;
    if (line[0] == 'S') print_stats();
    else if (line[0] == 'Q') stop_flag = 1;
    else if (line[0] == 'U') unlend(strtoull(line + 1, NULL, 10));
  }
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s JOB RANK [--bubble-us N] [--gap-us N] [--max-slots N] "
                    "[--free-mem N] [--lend BACKEND[:BYTES]] [--lend-device N] [--await-tasks N] "
                    "[--commands] "
                    "[--uid N] [--nofile N] [--fd-room N] [--no-robust-list]\n",
            argv[0]);
    return 64;
  }
  uint64_t bubble_us = 2000, gap_us = 1000, free_mem = BB_MEM_UNKNOWN;
  const char *lend = NULL;
  int lend_device = 0;
  uint32_t await_tasks = 0;
  long uid = -1, nofile = -1, fd_room = -1;
  bb_trainer_options_t opts;
  bb_trainer_options_init(&opts);
  for (int i = 3; i < argc; ++i) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "0";
    if (!strcmp(a, "--commands")) with_commands = 1;
    else if (!strcmp(a, "--bubble-us")) bubble_us = strtoull(v, NULL, 10), ++i;
    else if (!strcmp(a, "--gap-us")) gap_us = strtoull(v, NULL, 10), ++i;
    else if (!strcmp(a, "--max-slots")) opts.max_slots = (uint32_t)atoi(v), ++i;
    else if (!strcmp(a, "--free-mem")) free_mem = strtoull(v, NULL, 10), ++i;
    else if (!strcmp(a, "--lend")) lend = v, ++i;
    else if (!strcmp(a, "--lend-device")) lend_device = atoi(v), ++i;
    else if (!strcmp(a, "--await-tasks")) await_tasks = (uint32_t)atoi(v), ++i;
    else if (!strcmp(a, "--uid")) uid = atol(v), ++i;
    else if (!strcmp(a, "--nofile")) nofile = atol(v), ++i;
    else if (!strcmp(a, "--fd-room")) fd_room = atol(v), ++i;
    else if (!strcmp(a, "--no-robust-list")) {
      if (deny_robust_lists() != 0) {
        perror("--no-robust-list: seccomp");
        return 64;
      }
    } else {
      fprintf(stderr, "unknown option %s\n", a);
      return 64;
    }
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  if (uid >= 0 && (setgroups(0, NULL) != 0 || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) != 0 ||
                   setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) != 0)) {
    perror("--uid");
    return 64;
  }
  bb_status st = bb_trainer_open(argv[1], (uint32_t)atoi(argv[2]), &opts, &trainer);
  if (st != BB_OK) {
    fprintf(stderr, "open: %s: %s\n", bb_status_name(st), bb_last_error());
    printf("FAILED %s\n", bb_status_name(st));
    return 2;
  }
  printf("OPEN %d\n", (int)getpid());
  fflush(stdout);
  if (lend) {
    bb_lend_options_t lo;
    bb_lend_options_init(&lo);
    const char *colon = strchr(lend, ':');
    const size_t len = colon ? (size_t)(colon - lend) : strlen(lend);
    lo.backend = !strncmp(lend, "cuda-ipc", len) && len == 8   ? BB_GRANT_CUDA_IPC
                 : !strncmp(lend, "cuda-vmm", len) && len == 8 ? BB_GRANT_CUDA_VMM
                                                               : BB_GRANT_HOST;
    lo.bytes = colon ? strtoull(colon + 1, NULL, 10) : 1u << 20;
    lo.device = lend_device;
    st = bb_trainer_lend(trainer, &lo);
    if (st != BB_OK) {
      printf("LEND_FAILED %s %s\n", bb_status_name(st), bb_last_error());
      fflush(stdout);
      bb_trainer_close(trainer);
      return 3;
    }
    lent = 1;
    printf("LENT\n");
    fflush(stdout);
  }
  for (;;) {  /* the first bubble should find the tasks the test is about */
    bb_trainer_stats_t stats = {sizeof stats};
    bb_trainer_stats(trainer, &stats);
    if (stats.tasks_attached >= await_tasks || stop_flag) break;
    sleep_us(1000);
  }
  if (fd_room >= 0) {
    const int lowest_free = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (lowest_free >= 0) close(lowest_free);
    nofile = lowest_free < 0 ? 0 : lowest_free + fd_room;
  }
  if (nofile >= 0) {
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = (rlim_t)nofile;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      perror("--nofile");
      return 64;
    }
    printf("LIMITED\n");
    fflush(stdout);
  }
  while (!stop_flag) {
    if (bb_bubble_begin(trainer, bubble_us * 1000, free_mem, BB_BUBBLE_STEADY) != BB_OK)
      ++begin_fail;
    sleep_us(bubble_us);
    if (bb_bubble_end(trainer) != BB_OK) ++end_fail;
    else ++bubbles_ok;
    gap(gap_us);
  }
  /* Each step of the way out is printed at once, so a test that waits in vain can tell a stop
   * never seen from a close that does not return from an exit that does not end. */
  printf("STOPPING\n");
  fflush(stdout);
  st = bb_trainer_close(trainer);
  printf("CLOSED %s\n", bb_status_name(st));
  fflush(stdout);
  return st == BB_OK ? 0 : 1;
}
