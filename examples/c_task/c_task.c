/* c_task: a side task doing real CPU work in bubbles — PageRank on a generated graph.
 *
 *   c_task [--job J] [--rank R] [--name N] [--nodes N] [--degree D] [--chunk E] [--prio P]
 *          [--mem BYTES] [--elastic] [--wait] [--iterations K]
 *
 * The job and rank default to $BUBBLE_JOB and $BUBBLE_RANK (set by the node agent), else "demo"
 * and 0. One step relaxes --chunk edges of the current PageRank iteration; with --elastic a step
 * shrinks its chunk to what fits in the time left in the bubble (measured ns per edge), so short
 * bubbles are used too. It runs until --iterations PageRank iterations are done (0 = forever),
 * the trainer stops it, or the trainer goes away, then prints what it computed.
 */
#include <bubble/bubble.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  uint32_t nodes, degree;
  uint32_t *dst;        /* dst[i*degree + k]: k-th out-edge of node i */
  double *rank, *next;  /* current and next rank vectors */
  uint64_t edge_pos;    /* next edge to relax in this iteration */
  uint64_t chunk;
  int elastic;
  double ns_per_edge;   /* measured */
  uint64_t iterations, max_iterations, steps;
  double residual;
} pagerank;

static uint64_t xorshift(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static int pr_init(void *user) {
  pagerank *p = user;
  const uint64_t edges = (uint64_t)p->nodes * p->degree;
  p->dst = malloc(edges * sizeof *p->dst);
  p->rank = malloc(p->nodes * sizeof *p->rank);
  p->next = calloc(p->nodes, sizeof *p->next);
  if (!p->dst || !p->rank || !p->next) return -1;
  uint64_t seed = 88172645463325252ull;
  for (uint64_t e = 0; e < edges; ++e) {
    /* Skewed targets (square of a uniform draw), so some pages are far more popular. */
    const double u = (double)(xorshift(&seed) % 1000003) / 1000003.0;
    p->dst[e] = (uint32_t)(u * u * p->nodes);
  }
  for (uint32_t i = 0; i < p->nodes; ++i) p->rank[i] = 1.0 / p->nodes;
  return 0;
}

static void finish_iteration(pagerank *p) {
  const double damping = 0.85, base = (1.0 - damping) / p->nodes;
  double diff = 0;
  for (uint32_t i = 0; i < p->nodes; ++i) {
    const double r = base + damping * p->next[i];
    diff += r > p->rank[i] ? r - p->rank[i] : p->rank[i] - r;
    p->rank[i] = r;
    p->next[i] = 0;
  }
  p->residual = diff;
  p->edge_pos = 0;
  ++p->iterations;
}

static int pr_step(void *user, const bb_step_info_t *info) {
  pagerank *p = user;
  const uint64_t edges = (uint64_t)p->nodes * p->degree;
  uint64_t chunk = p->chunk;
  if (p->elastic && p->ns_per_edge > 0 && info->time_left_ns != UINT64_MAX) {
    /* Fill what is left of the bubble, keeping a 10% margin, but do at least a little. */
    const double fit = 0.9 * (double)info->time_left_ns / p->ns_per_edge;
    if (fit < (double)chunk) chunk = fit < 1024 ? 1024 : (uint64_t)fit;
  }
  const uint64_t t0 = bb_now_ns();
  uint64_t end = p->edge_pos + chunk;
  if (end > edges) end = edges;
  for (uint64_t e = p->edge_pos; e < end; ++e) {
    const uint32_t src = (uint32_t)(e / p->degree);
    p->next[p->dst[e]] += p->rank[src] / p->degree;
  }
  const uint64_t done = end - p->edge_pos;
  p->edge_pos = end;
  if (done) p->ns_per_edge = 0.8 * p->ns_per_edge + 0.2 * (double)(bb_now_ns() - t0) / done;
  if (p->ns_per_edge == 0 && done) p->ns_per_edge = (double)(bb_now_ns() - t0) / done;
  if (p->edge_pos == edges) finish_iteration(p);
  ++p->steps;
  return p->max_iterations && p->iterations >= p->max_iterations ? BB_STEP_DONE : BB_STEP_CONTINUE;
}

static void pr_finish(void *user, bb_status status) {
  pagerank *p = user;
  uint32_t top = 0;
  for (uint32_t i = 1; i < p->nodes && p->rank; ++i)
    if (p->rank[i] > p->rank[top]) top = i;
  printf("c_task: %s after %llu steps, %llu PageRank iterations, residual %.3g, top page %u\n",
         bb_status_name(status), (unsigned long long)p->steps, (unsigned long long)p->iterations,
         p->residual, top);
  fflush(stdout);
}

static const char *arg_value(int argc, char **argv, int *i) {
  if (*i + 1 >= argc) {
    fprintf(stderr, "c_task: %s needs a value\n", argv[*i]);
    exit(64);
  }
  return argv[++*i];
}

int main(int argc, char **argv) {
  const char *job = getenv("BUBBLE_JOB") ? getenv("BUBBLE_JOB") : "demo";
  uint32_t rank = getenv("BUBBLE_RANK") ? (uint32_t)atoi(getenv("BUBBLE_RANK")) : 0;
  const char *name = "pagerank";
  pagerank p = {.nodes = 200000, .degree = 8, .chunk = 100000};
  bb_task_options_t opts;
  bb_task_options_init(&opts);
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i];
    if (!strcmp(a, "--job")) job = arg_value(argc, argv, &i);
    else if (!strcmp(a, "--rank")) rank = (uint32_t)atoi(arg_value(argc, argv, &i));
    else if (!strcmp(a, "--name")) name = arg_value(argc, argv, &i);
    else if (!strcmp(a, "--nodes")) p.nodes = (uint32_t)atoi(arg_value(argc, argv, &i));
    else if (!strcmp(a, "--degree")) p.degree = (uint32_t)atoi(arg_value(argc, argv, &i));
    else if (!strcmp(a, "--chunk")) p.chunk = strtoull(arg_value(argc, argv, &i), NULL, 10);
    else if (!strcmp(a, "--prio")) opts.priority = atoi(arg_value(argc, argv, &i));
    else if (!strcmp(a, "--mem")) opts.mem_need = strtoull(arg_value(argc, argv, &i), NULL, 10);
    else if (!strcmp(a, "--iterations")) p.max_iterations = strtoull(arg_value(argc, argv, &i), NULL, 10);
    else if (!strcmp(a, "--elastic")) p.elastic = 1;
    else if (!strcmp(a, "--wait")) opts.on_trainer_exit = BB_ON_TRAINER_EXIT_WAIT;
    else {
      fprintf(stderr, "c_task: unknown option %s (see the comment at the top of c_task.c)\n", a);
      return 64;
    }
  }
  if (p.nodes == 0 || p.degree == 0 || p.chunk == 0) {
    fprintf(stderr, "c_task: --nodes, --degree and --chunk must be positive\n");
    return 64;
  }
  bb_task_h task;
  bb_status st = bb_task_attach(job, rank, name, &opts, &task);
  if (st != BB_OK) {
    fprintf(stderr, "c_task: cannot attach to hub %s.%u: %s\n", job, rank, bb_last_error());
    return 2;
  }
  bb_task_callbacks_t cbs;
  bb_task_callbacks_init(&cbs);
  cbs.user = &p;
  cbs.init = pr_init;
  cbs.step = pr_step;
  cbs.finish = pr_finish;
  st = bb_task_run(task, &cbs);
  bb_task_detach(task);
  free(p.dst);
  free(p.rank);
  free(p.next);
  return st == BB_OK || st == BB_E_STOPPED || st == BB_E_TRAINER_GONE ? 0 : 1;
}
