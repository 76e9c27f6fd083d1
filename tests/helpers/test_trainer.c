/* A trainer process for the multi-process tests (public C ABI only).
 *
 *   bb_test_trainer JOB RANK [--bubble-us N] [--gap-us N] [--max-slots N] [--free-mem N]
 *                   [--lend host|cuda-ipc|cuda-vmm:BYTES] [--await-tasks N]
 *
 * Opens the hub, prints "OPEN <pid>", lends memory if asked ("LENT", or "LEND_FAILED <status>
 * <message>" and exit code 3), waits until N tasks are attached if asked, then runs bubbles of --bubble-us separated by --gap-us
 * until SIGTERM/SIGINT (clean close, prints "CLOSED") or SIGKILL (the stale-hub case).
 */
#define _POSIX_C_SOURCE 200809L
#include <bubble/bubble.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop_flag;
static void on_signal(int sig) {
  (void)sig;
  stop_flag = 1;
}

static void sleep_us(uint64_t us) {
  struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s JOB RANK [--bubble-us N] [--gap-us N] [--max-slots N]\n", argv[0]);
    return 64;
  }
  uint64_t bubble_us = 2000, gap_us = 1000, free_mem = BB_MEM_UNKNOWN;
  const char *lend = NULL;
  uint32_t await_tasks = 0;
  bb_trainer_options_t opts;
  bb_trainer_options_init(&opts);
  for (int i = 3; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--bubble-us")) bubble_us = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--gap-us")) gap_us = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--max-slots")) opts.max_slots = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--free-mem")) free_mem = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--lend")) lend = argv[i + 1];
    else if (!strcmp(argv[i], "--await-tasks")) await_tasks = (uint32_t)atoi(argv[i + 1]);
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  bb_trainer_h t;
  bb_status st = bb_trainer_open(argv[1], (uint32_t)atoi(argv[2]), &opts, &t);
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
    st = bb_trainer_lend(t, &lo);
    if (st != BB_OK) {
      printf("LEND_FAILED %s %s\n", bb_status_name(st), bb_last_error());
      fflush(stdout);
      bb_trainer_close(t);
      return 3;
    }
    printf("LENT\n");
    fflush(stdout);
  }
  for (;;) {  /* the first bubble should find the tasks the test is about */
    bb_trainer_stats_t stats = {sizeof stats};
    bb_trainer_stats(t, &stats);
    if (stats.tasks_attached >= await_tasks || stop_flag) break;
    sleep_us(1000);
  }
  while (!stop_flag) {
    bb_bubble_begin(t, bubble_us * 1000, free_mem, BB_BUBBLE_STEADY);
    sleep_us(bubble_us);
    bb_bubble_end(t);
    sleep_us(gap_us);
  }
  bb_trainer_close(t);
  printf("CLOSED\n");
  return 0;
}
