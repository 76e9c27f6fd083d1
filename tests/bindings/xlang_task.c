// A side task in C for the cross-language test. Usage: xlang_task JOB RANK NAME run|loop STEP_MS
// Prints one line per event (attached, step SEQ, pause, slow, stopped) for the test to follow.
// With $BUBBLE_XLANG_SLOW_FILE present, a step sleeps for a minute: the test kills it there.
#include <bubble/bubble.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static long step_ms;

static void work(void) {
  const char *slow = getenv("BUBBLE_XLANG_SLOW_FILE");
  long ms = step_ms;
  if (slow && access(slow, F_OK) == 0) {
    printf("slow\n");
    fflush(stdout);
    ms = 60000;
  }
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static int on_step(void *user, const bb_step_info_t *info) {
  (void)user;
  work();
  printf("step %llu\n", (unsigned long long)info->bubble_seq);
  fflush(stdout);
  return BB_STEP_CONTINUE;
}

static int on_pause(void *user) {
  (void)user;
  printf("pause\n");
  fflush(stdout);
  return 0;
}

static int fail(const char *what, bb_status s) {
  fprintf(stderr, "%s: %s (%s)\n", what, bb_last_error(), bb_status_name(s));
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s JOB RANK NAME run|loop STEP_MS\n", argv[0]);
    return 2;
  }
  step_ms = atol(argv[5]);
  bb_task_h task = NULL;
  bb_status s = bb_task_attach(argv[1], (uint32_t)atoi(argv[2]), argv[3], NULL, &task);
  if (s != BB_OK) return fail("attach", s);
  printf("attached\n");
  fflush(stdout);
  if (argv[4][0] == 'r') {
    bb_task_callbacks_t cbs = BB_TASK_CALLBACKS_INIT;
    cbs.step = on_step;
    cbs.pause = on_pause;
    s = bb_task_run(task, &cbs);
  } else {
    bb_start_info_t start = {sizeof start};
    while ((s = bb_task_wait_start(task, -1, &start)) == BB_OK) {
      while (!bb_task_should_pause(task)) {
        uint64_t t0 = bb_now_ns();
        work();
        bb_task_report_step(task, bb_now_ns() - t0);
        printf("step %llu\n", (unsigned long long)start.bubble_seq);
        fflush(stdout);
      }
      bb_task_ack_pause(task);
      on_pause(NULL);
    }
  }
  if (s != BB_E_STOPPED) return fail("run", s);
  printf("stopped\n");
  fflush(stdout);
  bb_task_detach(task);
  return 0;
}
