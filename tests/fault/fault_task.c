/* A side task for fault injection: an imperative task (public C ABI only) that can SIGKILL
 * itself at a chosen point of the protocol, so the driver can hit points it could not time
 * from outside (between seeing a pause and acking it, inside a step, holding a grant).
 *
 *   bb_fault_task JOB RANK NAME [--die-at POINT] [--die-after N] [--mem BYTES] [--wait]
 *                 [--step-us N] [--prio N]
 *   JOB "-" takes the hub from $BUBBLE_JOB / $BUBBLE_RANK (as the agent launches tasks).
 *   POINT: never (default), attached, started, step, pause-seen, acked, grant
 *   --die-after N: die at the N-th time the point is reached (default 1).
 *
 * Prints "ATTACHED", "WAITING" before each wait for a start, "RUN" once started, "DYING <point>"
 * just before the SIGKILL, and "RESULT <status name> starts=<n>" when the hub goes away or
 * stops it.
 */
#include <bubble/bubble.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *die_at = "never";
static unsigned long die_after = 1, reached = 0;
static volatile unsigned long sink;

/* Flushes first so the driver learns where the task died. */
static void point(const char *name) {
  if (strcmp(die_at, name) != 0 || ++reached < die_after) return;
  printf("DYING %s\n", name);
  fflush(stdout);
  raise(SIGKILL);
}

static void busy(uint64_t ns) {
  const uint64_t until = bb_now_ns() + ns;
  while (bb_now_ns() < until) sink++;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s JOB RANK NAME [--die-at POINT] [--die-after N] [--mem BYTES] "
                    "[--wait] [--step-us N] [--prio N]\n", argv[0]);
    return 64;
  }
  const char *job = argv[1], *name = argv[3];
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
  uint64_t step_ns = 100000;
  bb_task_options_t opts;
  bb_task_options_init(&opts);
  opts.wake_mode = BB_WAKE_SLEEP;
  for (int i = 4; i < argc; ++i) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "0";
    if (!strcmp(a, "--die-at")) die_at = v, ++i;
    else if (!strcmp(a, "--die-after")) die_after = strtoul(v, NULL, 10), ++i;
    else if (!strcmp(a, "--mem")) opts.mem_need = strtoull(v, NULL, 10), ++i;
    else if (!strcmp(a, "--step-us")) step_ns = strtoull(v, NULL, 10) * 1000, ++i;
    else if (!strcmp(a, "--prio")) opts.priority = atoi(v), ++i;
    else if (!strcmp(a, "--wait")) {
      opts.on_trainer_exit = BB_ON_TRAINER_EXIT_WAIT;
      opts.reattach_timeout_ns = 30000000000ull;
    } else {
      fprintf(stderr, "unknown option %s\n", a);
      return 64;
    }
  }
  bb_task_h task;
  bb_status st = bb_task_attach(job, rank, name, &opts, &task);
  if (st != BB_OK) {
    fprintf(stderr, "attach: %s: %s\n", bb_status_name(st), bb_last_error());
    printf("RESULT %s starts=0\n", bb_status_name(st));
    return 2;
  }
  printf("ATTACHED\n");
  fflush(stdout);
  point("attached");
  unsigned long starts = 0;
  for (;;) {
    printf("WAITING\n");
    fflush(stdout);
    bb_start_info_t info = {sizeof info};
    st = bb_task_wait_start(task, -1, &info);
    if (st != BB_OK) break;
    ++starts;
    printf("RUN\n");
    fflush(stdout);
    point("started");
    if (info.grant_ptr) {
      /* Touch the grant (host backend: plain memory) so a death holds a used mapping. */
      memset(info.grant_ptr, 0x5a, info.grant_bytes < 4096 ? info.grant_bytes : 4096);
      point("grant");
    }
    while (!bb_task_should_pause(task)) {
      const uint64_t t0 = bb_now_ns();
      busy(step_ns / 2);
      point("step");
      busy(step_ns / 2);
      bb_task_report_step(task, bb_now_ns() - t0);
    }
    point("pause-seen");
    bb_task_ack_pause(task);
    point("acked");
  }
  printf("RESULT %s starts=%lu\n", bb_status_name(st), starts);
  fflush(stdout);
  bb_task_detach(task);
  return 0;
}
