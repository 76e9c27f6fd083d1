/* A side task for the multi-process and fault-injection tests, written against the public C
 * ABI only.
 *
 *   bb_test_task JOB RANK NAME MODE [options]
 *   JOB "-" takes the hub from $BUBBLE_JOB / $BUBBLE_RANK (as the agent launches tasks).
 *   MODE: iterative   bb_task_run with busy steps of --step-us
 *         imperative  bb_task_wait_start / should_pause / ack_pause loop
 *         ignore      attaches and then never reads a command or acks (a hung task). It
 *                     sleeps rather than spins: what the trainer sees is the same, and a
 *                     spinning one took a core from the tasks beside it on a 2-core machine
 *         attach-only attaches, prints ATTACHED, sleeps until killed
 *         grant-hang  waits for a start with a grant, writes it, acks the pause, prints
 *                     GRANT, then never calls libbubble again (a task that ignores a revoke)
 *         grant-leave waits for a start with a grant, writes it, then closes its sockets and
 *                     sleeps (a task that leaves its slot still mapping the grant)
 *         fork-stale  forks; the process that attached exits, and the child, which keeps the
 *                     task, prints "FORKED <its pid>", waits for a line on stdin, then
 *                     waits up to 2 s for a start and prints its RESULT (a task its trainer
 *                     dropped with the process that attached it, left to a fork)
 *         fork-stale-waiting  the same, but the process that attached waits to be killed, and
 *                     the child prints "FORKED <its pid>" and WAITING and at once waits
 *                     up to 20 s for a start, then prints its RESULT
 *   --step-us N, --prio N, --mem N, --min-step-us N, --max-steps N (then BB_STEP_DONE),
 *   --idle N (iterative): an idle callback that prints "IDLE <n>" (n counts the calls since the
 *   last bubble, from 1; " in-bubble" follows if it came inside one) and returns BB_STEP_DONE at
 *   the N-th call in a row, or -1 there with --idle-fail,
 *   --slow-step N:US (iterative): the N-th step takes US microseconds instead of --step-us,
 *   --resume-us N (iterative): the resume callback takes N microseconds (a task that gets to
 *   each bubble's work late),
 *   --old-callbacks (iterative): passes bb_task_callbacks_t with the size of a struct from before
 *   idle, and an address in idle that would crash if the library called it,
 *   --wait (re-attach when the trainer goes away), --reattach-ms N,
 *   --attach-uid N (started as root): attaches as uid N (real and effective; the saved uid
 *   stays 0), then is root again: a task its trainer, running as N, cannot signal,
 *   --wake predictive|sleep|spin (how it waits for a start),
 *   --itimer-us N: a SIGALRM every N microseconds, to a handler that does nothing, installed
 *   without SA_RESTART (as Python's signal.signal does), so sleeps in the library end early,
 *   --grant-seed N: fill each new grant with the pattern word(i) = N ^ (i * 2654435761), and
 *   print "GRANT <id> <bytes>" once it is written (iterative, imperative and the grant modes)
 *   --grant-device (iterative, imperative; with --grant-seed): "GRANT" lines end with
 *   " device=<n>", the device bb_task_grant reports for the grant (-2 if it reports none)
 *   --die-at POINT [--die-after N] (imperative): SIGKILL itself the N-th time (default 1) it
 *   reaches POINT, after printing "DYING <point>": never, attached, started, step (inside a
 *   step), grant (holding a written grant), pause-seen (between seeing a pause and acking it),
 *   acked. With --die-at it also prints "WAITING" before each wait for a start, so a driver
 *   that kills it from outside knows where it was.
 *
 *   --fd-room N, --fd-room-attached N: just before attaching (or just after), lowers its
 *   descriptor limit so that N more descriptors can be opened,
 *
 * It prints "ATTACHED" once attached, "STARTED <seq> kind=<k> len=<ns> free=<bytes>" for every
 * start (imperative; len is the announced length, deadline - begin, 0 if none), and a last line
 * "RESULT <status name> steps=<n> starts=<n>". Exit code 0 unless attach failed (2, with the
 * library's message on stderr).
 */
#define _GNU_SOURCE /* setresuid */
#include <bubble/bubble.h>

#include <signal.h>
#include <dirent.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <unistd.h>

static uint64_t step_ns = 200000;
static uint64_t max_steps = 0;
static uint64_t steps = 0, starts = 0;
static volatile uint64_t sink;
static int grant_seed_set = 0;
static uint32_t grant_seed = 0;
static uint64_t grant_written = 0; /* id of the last grant filled */
static const char *die_at = NULL;
static long attach_uid = -1;
static unsigned long die_after = 1, reached = 0;
static const char *const kPoints[] = {"never", "attached", "started", "step", "grant",
                                      "pause-seen", "acked"};

/* Flushes first so the driver learns where the task died. */
static void point(const char *name) {
  if (!die_at || strcmp(die_at, name) != 0 || ++reached < die_after) return;
  printf("DYING %s\n", name);
  fflush(stdout);
  raise(SIGKILL);
}

static void say_waiting(void) {
  if (!die_at) return;
  printf("WAITING\n");
  fflush(stdout);
}

/* Fills a grant the first time it is seen. With the fake CUDA driver of the tests, "device"
 * pointers are host memory, so the same loop serves every backend. */
static int grant_device = 0;  /* --grant-device */
static long fd_room = -1, fd_room_attached = -1;
static bb_task_h the_task = NULL;
static void announce_grant(uint64_t id, uint64_t bytes) {
  printf("GRANT %llu %llu", (unsigned long long)id, (unsigned long long)bytes);
  if (grant_device) {
    bb_task_grant_t g = {sizeof g};
    const int ok = the_task && bb_task_grant(the_task, &g) == BB_OK && g.id == id;
    printf(" device=%d", ok ? (int)g.device : -2);
  }
  printf("\n");
  fflush(stdout);
}

/* Writes the pattern into a grant not written yet; returns whether it did. */
static int fill_grant(uint64_t id, void *ptr, uint64_t bytes) {
  if (!grant_seed_set || id == 0 || !ptr || id == grant_written) return 0;
  uint32_t *w = (uint32_t *)ptr;
  for (uint64_t i = 0; i < bytes / 4; ++i) w[i] = grant_seed ^ (uint32_t)(i * 2654435761u);
  grant_written = id;
  return 1;
}

static void use_grant(uint64_t id, void *ptr, uint64_t bytes) {
  if (fill_grant(id, ptr, bytes)) announce_grant(id, bytes);
}

/* Closes every socket of the process: the hub connection goes away without a word. */
static void close_sockets(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return;
  int fds[256], n = 0;
  struct dirent *e;
  while ((e = readdir(d)) && n < 256) {
    struct stat st;
    const int fd = atoi(e->d_name);
    if (e->d_name[0] != '.' && fd != dirfd(d) && fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode))
      fds[n++] = fd;
  }
  closedir(d);
  for (int i = 0; i < n; ++i) close(fds[i]);
}

static void busy(uint64_t ns) {
  const uint64_t until = bb_now_ns() + ns;
  while (bb_now_ns() < until) sink++;
}

static void on_alarm(int sig) { (void)sig; }

/* Lowers the descriptor limit so that exactly `room` more descriptors can be opened: the
 * limit bounds descriptor numbers, and a new one takes the lowest free number. */
static int limit_fds(long room) {
  const int lowest_free = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (lowest_free < 0) return -1;
  close(lowest_free);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
  rl.rlim_cur = (rlim_t)(lowest_free + room);
  return setrlimit(RLIMIT_NOFILE, &rl);
}

static unsigned long slow_step_at = 0; /* --slow-step N:US: the N-th step takes US instead */
static uint64_t slow_step_ns = 0, resume_ns = 0;

static int on_step(void *user, const bb_step_info_t *info) {
  (void)user;
  use_grant(info->grant_id, info->grant_ptr, info->grant_bytes);
  busy(steps + 1 == slow_step_at ? slow_step_ns : step_ns);
  ++steps;
  return max_steps && steps >= max_steps ? BB_STEP_DONE : BB_STEP_CONTINUE;
}

static unsigned long idle_at = 0, idles = 0;
static int idle_fail = 0, in_bubble = 0, old_callbacks = 0;
/* --no-reports: the imperative loop polls should_pause only (never report_step), as the
 * simplest task does. */
static int no_reports = 0;

static int on_idle(void *user) {
  (void)user;
  printf("IDLE %lu%s\n", ++idles, in_bubble ? " in-bubble" : "");
  fflush(stdout);
  if (idles < idle_at) return 0;
  return idle_fail ? -1 : BB_STEP_DONE;
}

static int on_pause(void *user) {
  (void)user;
  in_bubble = 0;
  return 0;
}

static int on_resume(void *user) {
  busy(resume_ns); /* --resume-us: gets to each bubble's work late */
  in_bubble = 1;
  idles = 0; /* a starved task can see a bubble late and go on waiting: count calls in a row */
  (void)user;
  ++starts;
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s JOB RANK NAME MODE [options]\n", argv[0]);
    return 64;
  }
  const char *job = argv[1], *name = argv[3], *mode = argv[4];
  uint32_t rank = (uint32_t)strtoul(argv[2], NULL, 10);
  if (!strcmp(job, "-")) {
    job = getenv("BUBBLE_JOB");
    const char *r = getenv("BUBBLE_RANK");
    if (!job || !r) {
      fprintf(stderr, "JOB is \"-\" but BUBBLE_JOB/BUBBLE_RANK are not set: launch through "
                      "bubbled or name the hub\n");
      return 64;
    }
    rank = (uint32_t)strtoul(r, NULL, 10);
  }
  bb_task_options_t opts;
  bb_task_options_init(&opts);
  for (int i = 5; i < argc; ++i) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : "0";
    if (!strcmp(a, "--step-us")) step_ns = strtoull(v, NULL, 10) * 1000, ++i;
    else if (!strcmp(a, "--prio")) opts.priority = atoi(v), ++i;
    else if (!strcmp(a, "--mem")) opts.mem_need = strtoull(v, NULL, 10), ++i;
    else if (!strcmp(a, "--min-step-us")) opts.min_step_ns = strtoull(v, NULL, 10) * 1000, ++i;
    else if (!strcmp(a, "--max-steps")) max_steps = strtoull(v, NULL, 10), ++i;
    else if (!strcmp(a, "--idle")) idle_at = strtoul(v, NULL, 10), ++i;
    else if (!strcmp(a, "--idle-fail")) idle_fail = 1;
    else if (!strcmp(a, "--slow-step")) {
      unsigned long long us = 0;
      if (sscanf(v, "%lu:%llu", &slow_step_at, &us) != 2) {
        fprintf(stderr, "--slow-step %s: use N:US (the N-th step takes US microseconds)\n", v);
        return 64;
      }
      slow_step_ns = us * 1000;
      ++i;
    } else if (!strcmp(a, "--resume-us")) resume_ns = strtoull(v, NULL, 10) * 1000, ++i;
    else if (!strcmp(a, "--old-callbacks")) old_callbacks = 1;
    else if (!strcmp(a, "--no-reports")) no_reports = 1;
    else if (!strcmp(a, "--wait")) opts.on_trainer_exit = BB_ON_TRAINER_EXIT_WAIT;
    else if (!strcmp(a, "--reattach-ms")) opts.reattach_timeout_ns = strtoull(v, NULL, 10) * 1000000, ++i;
    else if (!strcmp(a, "--grant-device")) grant_device = 1;
    else if (!strcmp(a, "--fd-room")) fd_room = atol(v), ++i;
    else if (!strcmp(a, "--fd-room-attached")) fd_room_attached = atol(v), ++i;
    else if (!strcmp(a, "--itimer-us")) {
      const long us = atol(v);
      struct sigaction sa;
      memset(&sa, 0, sizeof sa);
      sa.sa_handler = on_alarm; /* no SA_RESTART */
      struct itimerval it = {{us / 1000000, us % 1000000}, {us / 1000000, us % 1000000}};
      if (us <= 0 || sigaction(SIGALRM, &sa, NULL) != 0 || setitimer(ITIMER_REAL, &it, NULL) != 0) {
        fprintf(stderr, "--itimer-us %s: give a positive number of microseconds\n", v);
        return 64;
      }
      ++i;
    }
    else if (!strcmp(a, "--grant-seed")) grant_seed = (uint32_t)strtoul(v, NULL, 10), grant_seed_set = 1, ++i;
    else if (!strcmp(a, "--die-at")) die_at = v, ++i;
    else if (!strcmp(a, "--attach-uid")) attach_uid = atol(v), ++i;
    else if (!strcmp(a, "--die-after")) die_after = strtoul(v, NULL, 10), ++i;
    else if (!strcmp(a, "--wake")) {
      if (!strcmp(v, "predictive")) opts.wake_mode = BB_WAKE_PREDICTIVE;
      else if (!strcmp(v, "sleep")) opts.wake_mode = BB_WAKE_SLEEP;
      else if (!strcmp(v, "spin")) opts.wake_mode = BB_WAKE_SPIN;
      else {
        fprintf(stderr, "--wake %s: use predictive, sleep or spin\n", v);
        return 64;
      }
      ++i;
    } else {
      fprintf(stderr, "unknown option %s\n", a);
      return 64;
    }
  }
  int known = !die_at;
  for (size_t p = 0; !known && p < sizeof kPoints / sizeof *kPoints; ++p)
    known = !strcmp(die_at, kPoints[p]);
  if (!known) {
    fprintf(stderr, "--die-at %s: use never, attached, started, step, grant, pause-seen or "
                    "acked\n", die_at);
    return 64;
  }
  if (attach_uid >= 0 && setresuid((uid_t)attach_uid, (uid_t)attach_uid, 0) != 0) {
    perror("--attach-uid: setresuid");
    return 64;
  }
  if (fd_room >= 0 && limit_fds(fd_room) != 0) {
    perror("--fd-room");
    return 64;
  }
  bb_task_h task = NULL;
  bb_status st = bb_task_attach(job, rank, name, &opts, &task);
  the_task = task;
  if (attach_uid >= 0 && setresuid(0, 0, 0) != 0) {
    perror("--attach-uid: back to root");
    return 64;
  }
  if (st != BB_OK) {
    fprintf(stderr, "attach: %s: %s\n", bb_status_name(st), bb_last_error());
    printf("RESULT %s steps=0 starts=0 error=%s\n", bb_status_name(st), bb_last_error());
    return 2;
  }
  if (fd_room_attached >= 0 && limit_fds(fd_room_attached) != 0) {
    perror("--fd-room-attached");
    return 64;
  }
  printf("ATTACHED\n");
  fflush(stdout);
  point("attached");

  if (!strcmp(mode, "iterative")) {
    bb_task_callbacks_t cbs;
    bb_task_callbacks_init(&cbs);
    cbs.step = on_step;
    cbs.resume = on_resume;
    cbs.pause = on_pause;
    if (idle_at) cbs.idle = on_idle;
    if (old_callbacks) {
      cbs.size = (uint32_t)offsetof(bb_task_callbacks_t, idle);
      cbs.idle = (int (*)(void *))(uintptr_t)1;
    }
    st = bb_task_run(task, &cbs);
  } else if (!strcmp(mode, "imperative")) {
    for (;;) {
      say_waiting();
      bb_start_info_t info = {sizeof info};
      st = bb_task_wait_start(task, -1, &info);
      if (st != BB_OK) break;
      ++starts;
      printf("STARTED %llu kind=%u len=%llu free=%llu\n", (unsigned long long)info.bubble_seq,
             (unsigned)info.kind,
             (unsigned long long)(info.deadline_ns ? info.deadline_ns - info.begin_ns : 0),
             (unsigned long long)info.free_mem);
      fflush(stdout);
      point("started");
      use_grant(info.grant_id, info.grant_ptr, info.grant_bytes);
      if (info.grant_ptr) point("grant");
      while (!bb_task_should_pause(task)) {
        const uint64_t t0 = bb_now_ns();
        busy(step_ns);
        point("step");
        ++steps;
        if (!no_reports) bb_task_report_step(task, bb_now_ns() - t0);
      }
      point("pause-seen");
      bb_task_ack_pause(task);
      point("acked");
    }
  } else if (!strcmp(mode, "fork-stale") || !strcmp(mode, "fork-stale-waiting")) {
    const int at_once = !strcmp(mode, "fork-stale-waiting");
    const pid_t child = fork();
    if (child < 0) {
      perror("fork");
      return 1;
    }
    if (child > 0) {
      if (at_once)
        for (;;) pause();
      _exit(0);
    }
    /* Both lines from the child, so they come in this order whichever process runs first. */
    printf("FORKED %d\n", (int)getpid());
    if (at_once) printf("WAITING\n");
    fflush(stdout);
    if (!at_once) {
      char line[16];
      if (!fgets(line, sizeof line, stdin)) return 1;
    }
    bb_start_info_t info = {sizeof info};
    st = bb_task_wait_start(task, at_once ? 20000000000 : 2000000000, &info);
    starts += st == BB_OK;
  } else if (!strcmp(mode, "ignore")) {
    for (;;) pause();
  } else if (!strcmp(mode, "attach-only")) {
    for (;;) pause();
  } else if (!strcmp(mode, "grant-hang") || !strcmp(mode, "grant-leave")) {
    for (;;) {
      bb_start_info_t info = {sizeof info};
      st = bb_task_wait_start(task, -1, &info);
      if (st != BB_OK) break;
      ++starts;
      if (!info.grant_ptr) continue;
      const int filled = fill_grant(info.grant_id, info.grant_ptr, info.grant_bytes);
      /* Said only after the ack: an ack gives back a grant revoked by then, so a test that
       * revokes on "GRANT" must find this task past its last libbubble call. */
      bb_task_ack_pause(task);
      if (filled) announce_grant(info.grant_id, info.grant_bytes);
      if (!strcmp(mode, "grant-leave")) {
        printf("LEAVING\n"); /* first: the trainer may kill us as soon as the socket closes */
        fflush(stdout);
        close_sockets();
      }
      for (;;) pause();
    }
  } else {
    fprintf(stderr, "unknown mode %s\n", mode);
    bb_task_detach(task);
    return 64;
  }
  printf("RESULT %s steps=%llu starts=%llu", bb_status_name(st), (unsigned long long)steps,
         (unsigned long long)starts);
  if (st != BB_OK) printf(" error=%s", bb_last_error());
  printf("\n");
  bb_task_detach(task);
  return 0;
}
