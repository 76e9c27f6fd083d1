/* A trainer for fault injection (public C ABI only) that counts what the driver checks.
 *
 *   bb_fault_trainer JOB RANK [--lend BYTES] [--bubble-us N] [--gap-us N] [--max-slots N]
 *
 * Opens the hub, lends BYTES of host memory (auto grants) when asked, prints "OPEN <pid>" and
 * runs bubbles until told to stop. Commands on stdin, one per line:
 *   S  print "STATS key=value ..." (bubble calls made and failed, hub counters, grant counters,
 *      and "pids=<p1,p2,...>" of the attached tasks)
 *   Q  close the hub cleanly, print "CLOSED" and exit 0
 * End of stdin (the driver died) also closes the hub: the trainer never outlives its driver.
 * Every bb_bubble_begin / bb_bubble_end that does not return BB_OK is counted, never retried:
 * the driver asserts that none failed and that the count only grows.
 */
#define _GNU_SOURCE
#include <bubble/bubble.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_int stop_flag;
static atomic_ullong bubbles_ok, begin_fail, end_fail;
static bb_trainer_h trainer;
static int lent;
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;

static void sleep_us(uint64_t us) {
  struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
  nanosleep(&ts, NULL);
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
  pthread_mutex_lock(&out_lock);
  printf("STATS calls=%llu begin_fail=%llu end_fail=%llu hub_bubbles=%llu attached=%u "
         "reclaimed=%llu bad=%llu starts=%llu lent=%d capacity=%llu granted=%llu free=%llu "
         "active=%u revoking=%u quarantined=%u made=%llu released_dead=%llu killed=%llu "
         "pids=%s\n",
         (unsigned long long)atomic_load(&bubbles_ok), (unsigned long long)atomic_load(&begin_fail),
         (unsigned long long)atomic_load(&end_fail), (unsigned long long)s.bubbles,
         s.tasks_attached, (unsigned long long)s.tasks_reclaimed, (unsigned long long)s.tasks_bad,
         (unsigned long long)s.starts, lent, (unsigned long long)g.capacity,
         (unsigned long long)g.granted_bytes, (unsigned long long)g.free_bytes, g.active,
         g.revoking, g.quarantined, (unsigned long long)g.grants_made,
         (unsigned long long)g.released_dead, (unsigned long long)g.tasks_killed,
         n ? pids : "-");
  fflush(stdout);
  pthread_mutex_unlock(&out_lock);
}

static void *commands(void *arg) {
  (void)arg;
  char line[64];
  while (fgets(line, sizeof line, stdin)) {
    if (line[0] == 'S') print_stats();
    else if (line[0] == 'Q') break;
  }
  atomic_store(&stop_flag, 1);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s JOB RANK [--lend BYTES] [--bubble-us N] [--gap-us N] "
                    "[--max-slots N]\n", argv[0]);
    return 64;
  }
  uint64_t bubble_us = 1000, gap_us = 500, lend = 0;
  bb_trainer_options_t opts;
  bb_trainer_options_init(&opts);
  for (int i = 3; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--bubble-us")) bubble_us = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--gap-us")) gap_us = strtoull(argv[i + 1], NULL, 10);
    else if (!strcmp(argv[i], "--max-slots")) opts.max_slots = (uint32_t)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--lend")) lend = strtoull(argv[i + 1], NULL, 10);
    else {
      fprintf(stderr, "unknown option %s\n", argv[i]);
      return 64;
    }
  }
  bb_status st = bb_trainer_open(argv[1], (uint32_t)atoi(argv[2]), &opts, &trainer);
  if (st != BB_OK) {
    fprintf(stderr, "open: %s: %s\n", bb_status_name(st), bb_last_error());
    printf("FAILED %s\n", bb_status_name(st));
    return 2;
  }
  if (lend) {
    bb_lend_options_t lo;
    bb_lend_options_init(&lo);
    lo.backend = BB_GRANT_HOST;
    lo.bytes = lend;
    st = bb_trainer_lend(trainer, &lo);
    if (st != BB_OK) {
      fprintf(stderr, "lend: %s: %s\n", bb_status_name(st), bb_last_error());
      printf("FAILED lend %s\n", bb_status_name(st));
      bb_trainer_close(trainer);
      return 2;
    }
    lent = 1;
  }
  pthread_t cmd;
  if (pthread_create(&cmd, NULL, commands, NULL) != 0) return 3;
  pthread_mutex_lock(&out_lock);
  printf("OPEN %d\n", (int)getpid());
  fflush(stdout);
  pthread_mutex_unlock(&out_lock);
  while (!atomic_load(&stop_flag)) {
    if (bb_bubble_begin(trainer, bubble_us * 1000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY) != BB_OK)
      atomic_fetch_add(&begin_fail, 1);
    sleep_us(bubble_us);
    if (bb_bubble_end(trainer) != BB_OK) atomic_fetch_add(&end_fail, 1);
    else atomic_fetch_add(&bubbles_ok, 1);
    sleep_us(gap_us);
  }
  pthread_join(cmd, NULL);
  st = bb_trainer_close(trainer);
  printf("CLOSED %s\n", bb_status_name(st));
  fflush(stdout);
  return st == BB_OK ? 0 : 1;
}
