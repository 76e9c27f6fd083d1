/* A side task that ignores pauses: attaches, waits for its first start, then works forever
 * without ever asking bb_task_should_pause or acking. The agent must stop it, then kill it.
 * It sleeps in its loop so that, stopped or not, it costs little CPU on a shared machine.
 *
 * With --own-trainer it first opens the hub BUBBLE_JOB.BUBBLE_RANK itself and runs its bubbles
 * (4 ms, every 12 ms) on a thread, so the rogue task runs inside its trainer's process, as the
 * C ABI allows: an agent must never signal that process. With --own-trainer JOB the hub it
 * opens is JOB.BUBBLE_RANK, and the task attaches to another trainer's hub: its process is still
 * a trainer's. With $ROGUE_GO set (a FIFO) it attaches once something opens that FIFO for
 * writing: the test first lets the agent see the hub it opened. */
#include <bubble/bubble.h>

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void* bubbles(void* trainer) {
  for (;;) {
    bb_bubble_begin((bb_trainer_h)trainer, 4000000, BB_MEM_UNKNOWN, BB_BUBBLE_STEADY);
    usleep(4000);
    bb_bubble_end((bb_trainer_h)trainer);
    usleep(8000);
  }
  return NULL;
}

int main(int argc, char** argv) {
  const char *job = getenv("BUBBLE_JOB"), *rank = getenv("BUBBLE_RANK");
  if (!job || !rank) {
    fprintf(stderr, "task_rogue: BUBBLE_JOB and BUBBLE_RANK must name the hub\n");
    return 2;
  }
  const uint32_t r = (uint32_t)strtoul(rank, NULL, 10);
  if ((argc == 2 || argc == 3) && strcmp(argv[1], "--own-trainer") == 0) {
    bb_trainer_h trainer;
    pthread_t th;
    if (bb_trainer_open(argc == 3 ? argv[2] : job, r, NULL, &trainer) != BB_OK) {
      fprintf(stderr, "task_rogue: open: %s\n", bb_last_error());
      return 3;
    }
    if (pthread_create(&th, NULL, bubbles, trainer) != 0) return 3;
    printf("trainer open (pid %d)\n", (int)getpid());
    fflush(stdout);
    const char* go = getenv("ROGUE_GO");
    if (go) {
      const int fd = open(go, O_RDONLY);  // returns once a writer opens it
      if (fd < 0) return 4;
      close(fd);
    }
  }
  bb_task_h task;
  if (bb_task_attach(job, r, "rogue", NULL, &task) != BB_OK) {
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
