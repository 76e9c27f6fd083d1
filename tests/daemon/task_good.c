/* A side task that behaves: attaches to the hub named by BUBBLE_JOB/BUBBLE_RANK (as the agent
 * sets them), runs STEPS steps of about STEP_US microseconds inside bubbles through the
 * iterative runtime (which acks every pause), and exits 0.
 * usage: task_good [STEPS [STEP_US [LINGER_S]]]   (STEPS 0 = run until stopped; LINGER_S: stay
 * alive that many seconds after detaching, as a process that goes on without its hub). SIGUSR1
 * ends its run at the next step, as if its work were done. It prints each grant its steps are
 * given (BUBBLE_MEM_NEED asks for one). BUBBLE_SECOND_SLOT=1: the process also holds a second
 * slot of the hub (task name "second"), run on a thread until SIGUSR2, then detached (printing
 * "second detached") once the first slot has left. */
#include <bubble/bubble.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static unsigned long long g_steps, g_done;
static unsigned long long g_step_ns;
static volatile sig_atomic_t g_done_asked, g_second_asked;

static void on_usr1(int sig) {
  (void)sig;
  g_done_asked = 1;
}

static void on_usr2(int sig) {
  (void)sig;
  g_second_asked = 1;
}

static int second_step(void *user, const bb_step_info_t *info) {
  (void)user;
  (void)info;
  uint64_t end = bb_now_ns() + 100000;
  while (bb_now_ns() < end) {
  }
  return g_second_asked ? BB_STEP_DONE : BB_STEP_CONTINUE;
}

static void *run_second(void *task) {
  bb_task_callbacks_t cbs;
  bb_task_callbacks_init(&cbs);
  cbs.step = second_step;
  bb_task_run((bb_task_h)task, &cbs);
  return NULL;
}

static int step(void *user, const bb_step_info_t *info) {
  (void)user;
  static uint64_t shown;
  if (info->grant_id != 0 && info->grant_id != shown) {  /* what it was lent, once per grant */
    shown = info->grant_id;
    printf("grant %llu: %llu bytes\n", (unsigned long long)info->grant_id,
           (unsigned long long)info->grant_bytes);
    fflush(stdout);
  }
  uint64_t end = bb_now_ns() + g_step_ns;
  while (bb_now_ns() < end) {
  }
  ++g_done;
  return g_done_asked || (g_steps && g_done >= g_steps) ? BB_STEP_DONE : BB_STEP_CONTINUE;
}

int main(int argc, char **argv) {
  const char *job = getenv("BUBBLE_JOB"), *rank = getenv("BUBBLE_RANK");
  const char *name = getenv("BUBBLE_TASK_NAME");
  if (!job || !rank) {
    fprintf(stderr, "task_good: BUBBLE_JOB and BUBBLE_RANK must name the hub\n");
    return 2;
  }
  signal(SIGUSR1, on_usr1);
  g_steps = argc > 1 ? strtoull(argv[1], NULL, 10) : 20;
  g_step_ns = (argc > 2 ? strtoull(argv[2], NULL, 10) : 200) * 1000ull;
  bb_task_options_t opts;
  bb_task_options_init(&opts);
  if (getenv("BUBBLE_MEM_NEED")) opts.mem_need = strtoull(getenv("BUBBLE_MEM_NEED"), NULL, 10);
  if (getenv("BUBBLE_PRIORITY")) opts.priority = atoi(getenv("BUBBLE_PRIORITY"));
  bb_task_h task;
  bb_status st = bb_task_attach(job, (uint32_t)strtoul(rank, NULL, 10), name ? name : "task_good",
                                &opts, &task);
  if (st != BB_OK) {
    fprintf(stderr, "task_good: attach: %s\n", bb_last_error());
    return 3;
  }
  printf("attached to %s:%s\n", job, rank);
  fflush(stdout);
  bb_task_h second = NULL;
  pthread_t second_thread;
  if (getenv("BUBBLE_SECOND_SLOT")) {
    bb_task_options_t o2;
    bb_task_options_init(&o2);
    signal(SIGUSR2, on_usr2);
    if (bb_task_attach(job, (uint32_t)strtoul(rank, NULL, 10), "second", &o2, &second) != BB_OK ||
        pthread_create(&second_thread, NULL, run_second, second) != 0) {
      fprintf(stderr, "task_good: second slot: %s\n", bb_last_error());
      return 3;
    }
    printf("second attached\n");
    fflush(stdout);
  }
  bb_task_callbacks_t cbs;
  bb_task_callbacks_init(&cbs);
  cbs.step = step;
  st = bb_task_run(task, &cbs);
  printf("done: %s after %llu steps\n", bb_status_name(st), g_done);
  bb_task_detach(task);
  if (argc > 3) {
    printf("detached\n");
    fflush(stdout);
  }
  if (second) {
    pthread_join(second_thread, NULL);
    bb_task_detach(second);
    printf("second detached\n");
    fflush(stdout);
  }
  if (argc > 3) sleep((unsigned)strtoul(argv[3], NULL, 10));
  return st == BB_OK ? 0 : st == BB_E_STOPPED ? 0 : 4;
}
