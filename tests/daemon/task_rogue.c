/* A side task that ignores pauses: attaches, waits for its first start, then works forever
 * without ever asking bb_task_should_pause or acking. The agent must stop it, then kill it.
 * It sleeps in its loop so that, stopped or not, it costs little CPU on a shared machine. */
#include <bubble/bubble.h>

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(void) {
  const char *job = getenv("BUBBLE_JOB"), *rank = getenv("BUBBLE_RANK");
  if (!job || !rank) {
    fprintf(stderr, "task_rogue: BUBBLE_JOB and BUBBLE_RANK must name the hub\n");
    return 2;
  }
  bb_task_h task;
  if (bb_task_attach(job, (uint32_t)strtoul(rank, NULL, 10), "rogue", NULL, &task) != BB_OK) {
    fprintf(stderr, "task_rogue: attach: %s\n", bb_last_error());
    return 3;
  }
  bb_status st = bb_task_wait_start(task, -1, NULL);
  printf("started (%s); never pausing\n", bb_status_name(st));
  fflush(stdout);
  for (;;) {
    bb_task_report_step(task, 1000000);
    usleep(1000);
  }
}
