/*
 * libbubble: run side tasks in the idle time ("bubbles") of pipeline-parallel training.
 *
 * This is the whole stable C ABI. The naming contract (docs/C_API.md):
 *   - every symbol starts with bb_ / BB_;
 *   - handles are opaque pointers named *_h; the function that creates one has an
 *     out-parameter, the matching close/detach function frees it and accepts NULL;
 *   - structs end in _t and start with a uint32_t `size` that the caller sets. Option structs
 *     (passed in): use the *_init() helper or the *_INIT macro. Each *_init(p) is a macro over
 *     the exported *_init_sized(p, sizeof(the struct type)), the size in the header the caller
 *     was built with (also when p is a void pointer): the library writes exactly that size
 *     (its defaults for the fields it knows, zeros past them; under 8 bytes, or over 64 KiB,
 *     nothing) and sets p->size to it, so a program built against another version's header
 *     never has its struct overrun, and a binding passes the size of its own mirror of the
 *     struct. Output structs
 *     (bb_trainer_stats_t, bb_task_info_t, bb_start_info_t, bb_grant_info_t, bb_grant_stats_t,
 *     bb_task_grant_t; bb_stream_timing_stats_t in bubble_cuda.h) have neither: set
 *     out->size = sizeof *out before the call (under 8 gives BB_E_INVALID); the library writes
 *     at most that many bytes. Structs only ever grow at the end: the library reads
 *     min(caller size, own size) bytes of an option struct and defaults newer fields;
 *   - every function returns a bb_status (BB_OK is 0) unless its comment says otherwise;
 *     after a failure bb_last_error() holds one sentence saying what went wrong and what to do;
 *   - pointer arguments must not be NULL unless the comment says "may be NULL".
 *
 * Time is always CLOCK_MONOTONIC nanoseconds. Sizes are bytes.
 */
#ifndef BUBBLE_BUBBLE_H
#define BUBBLE_BUBBLE_H

#include <stddef.h>
#include <stdint.h>

#if defined(BUBBLE_STATIC_DEFINE)
#define BB_API
#elif defined(__GNUC__)
#define BB_API __attribute__((visibility("default")))
#else
#define BB_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define BB_VERSION_MAJOR 0
#define BB_VERSION_MINOR 1
#define BB_VERSION_PATCH 0

/* ---------------------------------------------------------------------------------------------
 * Status codes. One table generates the enum, bb_status_name() and bb_status_str().
 */
#define BB_STATUS_MAP(X)                                                                   \
  X(OK, 0, "success")                                                                      \
  X(E_INVALID, -1, "invalid argument")                                                     \
  X(E_NOMEM, -2, "out of memory")                                                          \
  X(E_SYSTEM, -3, "operating system call failed")                                          \
  X(E_NOT_FOUND, -4, "no such hub")                                                        \
  X(E_BUSY, -5, "already in use")                                                          \
  X(E_FULL, -6, "no free slot")                                                            \
  X(E_VERSION, -7, "incompatible layout or protocol version")                              \
  X(E_PERMISSION, -8, "permission denied")                                                 \
  X(E_TIMEOUT, -9, "timed out")                                                            \
  X(E_STOPPED, -10, "the task was told to stop")                                           \
  X(E_TRAINER_GONE, -11, "the trainer closed its hub or exited")                           \
  X(E_CORRUPT, -12, "shared memory failed validation")                                     \
  X(E_STATE, -13, "call not valid in this state")                                          \
  X(E_UNSUPPORTED, -14, "not supported on this machine")                                   \
  X(E_CALLBACK, -15, "a task callback reported failure")

typedef enum bb_status {
#define BB_STATUS_ENUM_(name, value, text) BB_##name = value,
  BB_STATUS_MAP(BB_STATUS_ENUM_)
#undef BB_STATUS_ENUM_
} bb_status;

/* "BB_E_TIMEOUT" etc.; never NULL. */
BB_API const char *bb_status_name(bb_status status);
/* A short description of the code; never NULL. */
BB_API const char *bb_status_str(bb_status status);
/* The message of the last failed call on this thread ("" if none). Valid until the next
 * libbubble call on this thread. Never NULL. */
BB_API const char *bb_last_error(void);
/* "0.1.0" */
BB_API const char *bb_version(void);
/* CLOCK_MONOTONIC now, in nanoseconds (the clock every libbubble time uses). */
BB_API uint64_t bb_now_ns(void);

/* ---------------------------------------------------------------------------------------------
 * Common values.
 */
#define BB_MEM_UNKNOWN UINT64_MAX  /* free device memory not known: no task is skipped for it */
#define BB_MAX_SLOTS_LIMIT 256u    /* hard upper bound of task slots per hub */
#define BB_NAME_MAX 47u            /* longest job id / task name, in bytes */

typedef enum bb_bubble_kind {
  BB_BUBBLE_OTHER = 0,
  BB_BUBBLE_WARMUP = 1,   /* pipeline fill: before the stage's first forward */
  BB_BUBBLE_STEADY = 2,   /* a wait on a point-to-point transfer in the steady state */
  BB_BUBBLE_COOLDOWN = 3, /* pipeline drain: after the stage's last backward */
  BB_BUBBLE_KIND_COUNT_ = 4
} bb_bubble_kind;

/* ---------------------------------------------------------------------------------------------
 * Trainer side. One hub per trainer rank (GPU), named by (job id, rank).
 *
 * bb_bubble_begin/bb_bubble_end are bounded-time, allocation-free, lock-free and never wait on
 * a side task; the only system call they can make is a futex wake of a sleeping task. Call them,
 * and bb_trainer_iteration and bb_trainer_set_schedule (which reset what they read), from one
 * thread at a time (the training loop's thread). Every other trainer function may be called from
 * any thread. None may run concurrently with bb_trainer_close, which frees the handle: the caller
 * makes sure every other thread is out of its calls on the handle first, and makes none after.
 */
typedef struct bb_trainer *bb_trainer_h;

typedef struct bb_trainer_options_t {
  uint32_t size;           /* sizeof(bb_trainer_options_t) */
  uint32_t max_slots;      /* task slots in the hub, 1..BB_MAX_SLOTS_LIMIT; default 64 */
  uint32_t max_running;    /* tasks started in one bubble, 1..max_slots; default 1 */
  uint32_t event_capacity; /* entries of each of the hub's two event rings (the bubble thread's
                              and the hub service's), power of two 64..65536; default 4096 */
  const char *runtime_dir; /* where hub sockets live; may be NULL: $BUBBLE_RUNTIME_DIR, else
                              $XDG_RUNTIME_DIR/bubble, else /tmp/bubble-<uid> */
  uint32_t allow_uid;      /* a second uid the trainer lets attach (UINT32_MAX = only our own
                              uid; root may always attach). Only the trainer's check: the runtime
                              directory and socket stay private to the trainer's user, and
                              libbubble's own task and observer trust only a runtime directory
                              of their own and a trainer of their uid or root, so today this
                              serves a peer that speaks the hub protocol itself, given access
                              to the socket by its operator. */
  uint32_t reserved0_;
} bb_trainer_options_t;

#define BB_TRAINER_OPTIONS_INIT {sizeof(bb_trainer_options_t), 64u, 1u, 4096u, NULL, UINT32_MAX, 0u}
BB_API void bb_trainer_options_init_sized(bb_trainer_options_t *opts, size_t size);
#define bb_trainer_options_init(opts) bb_trainer_options_init_sized((opts), sizeof(bb_trainer_options_t))

/* Create the hub (job_id: 1..BB_NAME_MAX of [A-Za-z0-9_.-], not starting with '.'; rank
 * 0..65535). A hub left by a dead trainer with the same name is cleaned up and replaced;
 * one owned by a live trainer gives BB_E_BUSY. opts may be NULL (defaults). Starts the hub's
 * service thread, named "bb-hub", which blocks every asynchronous signal: a signal sent to the
 * process is left to the application's own threads (fault signals stay open). The first
 * connection a hub is done with also starts "bb-closer", which closes what peers handed the hub
 * (masked the same way, and living until the process exits). */
BB_API bb_status bb_trainer_open(const char *job_id, uint32_t rank,
                                 const bb_trainer_options_t *opts, bb_trainer_h *out);
/* Stops every attached task (they see BB_E_TRAINER_GONE or re-attach, by their option), removes
 * the hub's files and frees the handle. NULL is accepted. With memory lent, it first takes every
 * grant back: tasks give theirs back as they leave; one that has not within 1 s is killed, and
 * close returns once it is reported dead (so at most about 3 s with a task that clings on). After
 * it returns no attached task maps the lent memory. No other call on the handle may run meanwhile
 * or after. */
BB_API bb_status bb_trainer_close(bb_trainer_h trainer);

/* A bubble starts now. expected_ns: its expected length (0 = predict it from earlier bubbles of
 * the same position in the iteration); free_mem: device bytes side tasks may use
 * (BB_MEM_UNKNOWN if not known). Picks tasks by priority (round-robin among equals), skipping
 * those that need more memory or a longer step than the bubble offers, and starts them.
 * Calling begin while a bubble is open ends the open one first. */
BB_API bb_status bb_bubble_begin(bb_trainer_h trainer, uint64_t expected_ns, uint64_t free_mem,
                                 bb_bubble_kind kind);
/* The bubble ends now: every started task is told to pause. A no-op if no bubble is open. */
BB_API bb_status bb_bubble_end(bb_trainer_h trainer);
/* Marks the start of a training iteration: the predictor numbers bubbles from here, so the
 * n-th bubble of each iteration is predicted from the n-th bubbles of earlier ones. A bubble
 * open at the mark belongs to the iteration it began in (the new one starts when it ends).
 * Optional. From the thread that calls bb_bubble_begin/end. */
BB_API bb_status bb_trainer_iteration(bb_trainer_h trainer);

/* A declared pipeline schedule, so the predictor knows each bubble's length from the first
 * iteration on (observed lengths replace the declared ones as they come). The times may be
 * left unknown: the library then measures them in the first iteration (see fwd_ns). */
typedef enum bb_schedule_kind {
  BB_SCHEDULE_GPIPE = 0,       /* all forwards, then all backwards */
  BB_SCHEDULE_1F1B = 1,        /* one forward, one backward (PipeDream-flush, Megatron) */
  BB_SCHEDULE_INTERLEAVED = 2, /* interleaved 1F1B with `chunks` model chunks per stage */
  BB_SCHEDULE_ZBH1 = 3         /* zero-bubble H1: backward split into input and weight parts */
} bb_schedule_kind;

/* What the trainer reports as one bubble, which fixes how bubbles are numbered in an
 * iteration. */
typedef enum bb_schedule_bubbles {
  /* Each idle interval of this stage in the schedule model (zero-length ones skipped). */
  BB_SCHEDULE_BUBBLES_IDLE = 0,
  /* One bubble per point-to-point receive, as framework adapters report waits: for each op of
   * this stage that needs a tensor from a neighbour (the forward of every virtual stage but the
   * first, the backward of every virtual stage but the last; ZB-H1 weight passes receive
   * nothing), in execution order, the idle time right before it (0 when the input is already
   * there: report such a receive as a bubble too, or the numbering slips). */
  BB_SCHEDULE_BUBBLES_RECEIVES = 1
} bb_schedule_bubbles;

typedef struct bb_schedule_t {
  uint32_t size;
  uint32_t kind;          /* bb_schedule_kind; default 1F1B */
  uint32_t stages;        /* p, 1..1024 */
  uint32_t microbatches;  /* m, 1..65536 (ZB-H1: m >= p) */
  uint32_t chunks;        /* interleaved only: v, 2..64 (m a multiple of p); else 1 */
  uint32_t stage;         /* this trainer's stage, 0..p-1 */
  /* One micro-batch's forward through a whole stage. fwd_ns = bwd_ns = 0 (with wgrad_ns and
   * comm_ns 0) means "unknown, measure them": the model runs with forward 1 and backward 2
   * units (ZB-H1: 1 each for forward, input and weight gradient) and is scaled by the compute
   * the trainer observes between its bubbles, from the second bubble of the first iteration
   * on. Exact when the real times keep those ratios; off by the ratio's error otherwise. */
  uint64_t fwd_ns;
  uint64_t bwd_ns;        /* its backward (ZB-H1: the input-gradient part) */
  uint64_t wgrad_ns;      /* ZB-H1: the weight-gradient part; else 0 */
  uint64_t comm_ns;       /* point-to-point transfer between stages; may be 0. Each time at
                             most an hour. */
  uint32_t bubbles;       /* bb_schedule_bubbles; default BB_SCHEDULE_BUBBLES_IDLE */
  uint32_t reserved0_;
} bb_schedule_t;

#define BB_SCHEDULE_INIT \
  {sizeof(bb_schedule_t), BB_SCHEDULE_1F1B, 0u, 0u, 1u, 0u, 0u, 0u, 0u, 0u, \
   BB_SCHEDULE_BUBBLES_IDLE, 0u}
BB_API void bb_schedule_init_sized(bb_schedule_t *schedule, size_t size);
#define bb_schedule_init(schedule) bb_schedule_init_sized((schedule), sizeof(bb_schedule_t))

/* Declares the schedule: the predictor is seeded with this stage's bubble lengths and the gaps
 * between them, so bb_bubble_begin(expected_ns = 0) and predictive wake are right from the first
 * iteration (with measured times: from the second bubble of it). Seeds take effect by position
 * within an iteration, so mark iterations with bb_trainer_iteration. The predictor keeps 1024
 * positions per iteration: bubbles past the 1024th are not seeded and fall back to the history
 * of their kind. A new declaration replaces the previous one; observed lengths stay. Call it
 * from the bubble thread before an iteration (it runs the schedule model: not bounded-time).
 * BB_E_INVALID names what the schedule model rejects. */
BB_API bb_status bb_trainer_set_schedule(bb_trainer_h trainer, const bb_schedule_t *schedule);

typedef struct bb_trainer_stats_t {
  uint32_t size;
  uint32_t tasks_attached;
  uint64_t bubbles;
  uint64_t bubble_ns;           /* summed length of closed bubbles */
  uint64_t starts;              /* task starts signalled */
  uint64_t pauses;              /* task pauses signalled */
  uint64_t wakes;               /* futex wake calls made on the bubble path */
  uint64_t task_ns_in_bubbles;  /* side-task step time inside bubbles, as reported by tasks */
  uint64_t task_ns_outside;     /* side-task step time that spilled past a bubble's end */
  uint64_t steps;               /* side-task steps reported */
  uint64_t start_latency_p50_ns, start_latency_p99_ns; /* bubble begin -> task running */
  uint64_t pause_latency_p50_ns, pause_latency_p99_ns; /* bubble end -> task acked pause */
  uint64_t tasks_reclaimed;     /* slots freed after their task detached or died (a slot is
                                   freed at the trainer's next bubble call after that, or,
                                   where the kernel allows membarrier, 0.1 s after it while
                                   no bubble is open and none comes) */
  uint64_t tasks_bad;           /* tasks marked bad: their page failed validation */
  uint64_t events_dropped;      /* reports lost to full rings */
} bb_trainer_stats_t;

/* Counters from the bubble thread (bubbles, starts, pauses, wakes) are current; those drawn from
 * task reports (steps, task time, latencies, drops) are collected by the hub's service thread
 * every 10 ms while tasks are attached (every 1 ms while a task reports faster than that drains),
 * so they trail by up to that much. A task sends its start
 * latency with its next report after the start (a step, or its ack), so the start-latency
 * figures trail by up to one run of the task. Set out->size first. */
BB_API bb_status bb_trainer_stats(bb_trainer_h trainer, bb_trainer_stats_t *out);

typedef struct bb_task_info_t {
  uint32_t size;
  uint32_t slot;
  uint64_t id;            /* slot and generation: stays unique while the hub lives */
  int32_t pid;
  int32_t priority;
  uint64_t mem_need;
  uint64_t min_step_ns;
  uint64_t steps;
  uint64_t step_ns;
  uint32_t running;       /* 1 while started in the current bubble and not yet paused */
  uint32_t bad;           /* 1 once the task's page failed validation; never started again */
  char name[BB_NAME_MAX + 1];
  /* The task's own share of bb_trainer_stats_t's task_ns_in_bubbles and task_ns_outside (from its
   * reports, trailing as those do): a task whose steps keep spilling past bubbles' ends shows
   * here. (A caller built before these fields passes the shorter size and does not get them.) */
  uint64_t ns_in_bubbles;
  uint64_t ns_outside;
} bb_task_info_t;

/* Copies up to cap attached tasks into out (out may be NULL when cap is 0); *count receives the
 * number attached, which may exceed cap. Set size to sizeof(bb_task_info_t) in every element:
 * it is the array's stride, so a binary built against an older header gets the fields it knows.
 * BB_E_INVALID when out[0].size is under 8, over 65536 or not a multiple of the struct's
 * alignment (8 on 64-bit machines), or another
 * element's differs; *count is 0 then. */
BB_API bb_status bb_trainer_tasks(bb_trainer_h trainer, bb_task_info_t *out, size_t cap,
                                  size_t *count);
/* Tells one task (by bb_task_info_t.id) to stop; it finishes and detaches. Any thread but the
 * bubble thread's hot path: the hub's service thread makes the stop (so it reaches that task and
 * never a later one in its slot), and the call waits for it, which takes one turn of that thread.
 * Once it returns, no bubble begun after starts the task; a bb_bubble_begin made concurrently
 * on another thread may still start it once, as if it came first. BB_E_NOT_FOUND: the task is
 * no longer attached; BB_E_STATE: the hub is closing. */
BB_API bb_status bb_trainer_stop_task(bb_trainer_h trainer, uint64_t task_id);

/* ---------------------------------------------------------------------------------------------
 * Side-task side. A task attaches to one hub and either hands the runtime its callbacks
 * (iterative) or runs its own loop (imperative). A task handle belongs to one thread at a time:
 * no task call is safe concurrently with another on the same handle (bb_task_should_pause
 * included), and bb_task_detach frees it, so no call may run meanwhile or after.
 */
typedef struct bb_task *bb_task_h;

typedef enum bb_on_trainer_exit {
  BB_ON_TRAINER_EXIT_RETURN = 0, /* calls return BB_E_TRAINER_GONE */
  BB_ON_TRAINER_EXIT_WAIT = 1    /* wait for a trainer to reopen the hub, then re-attach */
} bb_on_trainer_exit;

/* How a task waits for the next start. */
typedef enum bb_wake_mode {
  /* Sleep between bubbles and spin from wake_lead_ns before the trainer's predicted next bubble:
   * usually a spin's latency at a small, bounded CPU cost; a futex wake when the guess misses. */
  BB_WAKE_PREDICTIVE = 0,
  BB_WAKE_SLEEP = 1, /* spin up to spin_ns (adapting), then sleep: least CPU, a wake's latency */
  BB_WAKE_SPIN = 2   /* spin all the time: the lowest latency, at a whole core */
} bb_wake_mode;

typedef struct bb_task_options_t {
  uint32_t size;
  int32_t priority;             /* higher runs first; default 0 (a task bubbled launched gets
                                   $BUBBLE_PRIORITY, its submission's, where this is 0) */
  uint64_t mem_need;            /* device bytes the task needs during a bubble; default 0
                                   (likewise $BUBBLE_MEM_NEED) */
  uint64_t min_step_ns;         /* shortest useful step; default 0 */
  uint32_t on_trainer_exit;     /* bb_on_trainer_exit; default RETURN */
  uint32_t wake_mode;           /* bb_wake_mode; default PREDICTIVE */
  uint64_t reattach_timeout_ns; /* with WAIT: give up after this long (a new trainer that is
                                   full, or does not answer yet, is tried again too); default
                                   60 s */
  uint64_t spin_ns;             /* spin this long before sleeping on a wait; default 20 us,
                                   at most 1 s */
  const char *runtime_dir;      /* may be NULL: same default as the trainer */
  uint64_t wake_lead_ns;        /* PREDICTIVE: start spinning this long before the predicted
                                   bubble, and give up spinning as long after it (a window that
                                   widens up to 8 x wake_lead_ns after bubbles that began later
                                   than predicted, and narrows back); default 50 us, at most
                                   1 s. Sleeps end earlier by how late the task's sleeps have
                                   been ending (learned; at most 4 x wake_lead_ns more). */
} bb_task_options_t;

#define BB_TASK_OPTIONS_INIT                                                                   \
  {sizeof(bb_task_options_t), 0, 0u, 0u, BB_ON_TRAINER_EXIT_RETURN, BB_WAKE_PREDICTIVE,        \
   60000000000ull, 20000ull, NULL, 50000ull}
BB_API void bb_task_options_init_sized(bb_task_options_t *opts, size_t size);
#define bb_task_options_init(opts) bb_task_options_init_sized((opts), sizeof(bb_task_options_t))

/* Attach to the hub of (job_id, rank) under a name (1..BB_NAME_MAX printable characters).
 * opts may be NULL. Fails with BB_E_NOT_FOUND when no trainer serves that hub, BB_E_FULL when
 * its slot table is full (or it holds 64 connections that have no slot), BB_E_VERSION when the
 * trainer's libbubble speaks another layout, BB_E_PERMISSION when the trainer cannot watch the
 * calling process (it must be the process that connects, alive, and visible in the trainer's
 * pid namespace; BB_E_UNSUPPORTED on a kernel without pidfd_open), BB_E_TRAINER_GONE when the
 * trainer closed the connection during the attach, BB_E_TIMEOUT when it did not answer within
 * 5 s, BB_E_SYSTEM when this process has no room for the descriptors the hub comes as (its
 * RLIMIT_NOFILE). */
BB_API bb_status bb_task_attach(const char *job_id, uint32_t rank, const char *name,
                                const bb_task_options_t *opts, bb_task_h *out);
/* Acks any pending pause, releases the slot and frees the handle. NULL is accepted. */
BB_API bb_status bb_task_detach(bb_task_h task);

typedef struct bb_start_info_t {
  uint32_t size;
  uint32_t kind;         /* bb_bubble_kind */
  uint64_t bubble_seq;   /* the trainer's bubble number */
  uint64_t begin_ns;     /* when the trainer began the bubble */
  uint64_t deadline_ns;  /* when the bubble is expected to end (0 if unknown) */
  uint64_t free_mem;     /* device bytes free during this bubble, or BB_MEM_UNKNOWN */
  /* The task's memory grant during this run (see "Memory grants"); 0/NULL when it holds none. */
  uint64_t grant_id;
  void *grant_ptr;
  uint64_t grant_bytes;
} bb_start_info_t;

/* Imperative: wait until the trainer starts this task in a bubble. timeout_ns < 0 waits
 * forever. BB_E_TIMEOUT, BB_E_STOPPED (finish and detach) and BB_E_TRAINER_GONE are the
 * expected non-OK results. The timeout holds while the task waits for its trainer to come back
 * (BB_ON_TRAINER_EXIT_WAIT) too: the next call goes on waiting toward the same
 * reattach_timeout_ns. out may be NULL; if not, set out->size first (checked before the wait).
 * *out is written only on BB_OK. */
BB_API bb_status bb_task_wait_start(bb_task_h task, int64_t timeout_ns, bb_start_info_t *out);
/* Imperative: 1 when the task must pause (the bubble ended, it was told to stop, its memory
 * grant is being revoked, or the trainer died or closed its hub), else 0. Two loads from shared
 * memory (three while the task holds a grant): a loop that only polls this learns at once that
 * its trainer was killed mid-bubble (the kernel marks a word the trainer's glibc registered).
 * Every 64th call also reads the clock and, at most every 100 ms, looks at the connection (one
 * poll), so a trainer whose death was not marked is noticed too. Returns an int, not a
 * bb_status, and never fails. */
BB_API int bb_task_should_pause(bb_task_h task);
/* Imperative: the task has stopped running device work for this bubble. */
BB_API bb_status bb_task_ack_pause(bb_task_h task);
/* Imperative: report one step's duration (for statistics and the time-fits check). */
BB_API bb_status bb_task_report_step(bb_task_h task, uint64_t step_ns);
/* Time left in the current bubble (0 if none or past its deadline; UINT64_MAX if the trainer
 * gave no deadline) and the runtime's estimate of this task's step time (0 before any step). */
BB_API bb_status bb_task_time_left(bb_task_h task, uint64_t *left_ns, uint64_t *est_step_ns);

typedef struct bb_step_info_t {
  uint32_t size;
  uint32_t kind;
  uint64_t bubble_seq;
  uint64_t deadline_ns;  /* 0 if unknown */
  uint64_t time_left_ns; /* UINT64_MAX if unknown */
  uint64_t est_step_ns;  /* the runtime's estimate of one step (0 before the first) */
  uint64_t free_mem;
  /* The task's memory grant for this step; 0/NULL when it holds none. A revoked grant is
   * unmapped between steps, so take the pointer from each step's info. */
  uint64_t grant_id;
  void *grant_ptr;
  uint64_t grant_bytes;
} bb_step_info_t;

#define BB_STEP_CONTINUE 0 /* step() return: more work to do */
#define BB_STEP_DONE 1     /* step() return: the task's work is finished */

typedef struct bb_task_callbacks_t {
  uint32_t size;
  uint32_t reserved0_;
  void *user;
  /* Each may be NULL except step. A negative return from init/step/pause/resume makes bb_task_run
   * report FAILED and return BB_E_CALLBACK. */
  int (*init)(void *user);
  int (*step)(void *user, const bb_step_info_t *info);
  int (*pause)(void *user);
  int (*resume)(void *user);
  void (*finish)(void *user, bb_status status);
  /* Called between bubbles, never inside one, once BB_TASK_IDLE_NS has passed since its last
   * call (or since the run began): about every 100 ms while the task waits, also while it waits
   * for its trainer to come back. The place to notice a request to end the run (a signal
   * handler's flag, a shutdown channel). Return BB_STEP_DONE to end the run as finished (BB_OK),
   * a negative value to end it failed (BB_E_CALLBACK), anything else to go on waiting. NULL, or
   * past the end of an older caller's shorter struct: the task just waits. */
  int (*idle)(void *user);
} bb_task_callbacks_t;

#define BB_TASK_IDLE_NS 100000000ull /* 100 ms */

#define BB_TASK_CALLBACKS_INIT \
  {sizeof(bb_task_callbacks_t), 0u, NULL, NULL, NULL, NULL, NULL, NULL, NULL}
BB_API void bb_task_callbacks_init_sized(bb_task_callbacks_t *cbs, size_t size);
#define bb_task_callbacks_init(cbs) bb_task_callbacks_init_sized((cbs), sizeof(bb_task_callbacks_t))

/* Iterative: runs init, then in every bubble resume, steps while the measured step time fits
 * before the deadline and no pause is asked, then pause and an ack; idle between bubbles.
 * Returns BB_OK when step or idle returned BB_STEP_DONE, BB_E_STOPPED when told to stop,
 * BB_E_TRAINER_GONE, or BB_E_CALLBACK; or the error that ended the run otherwise, with its
 * reason in bb_last_error(): a grant the task could not map (BB_E_UNSUPPORTED without a CUDA
 * driver, say; the grant went back) or unmap (it stays held until the revoke's deadline), or,
 * with BB_ON_TRAINER_EXIT_WAIT, a new trainer that refused the re-attach (BB_E_PERMISSION,
 * BB_E_VERSION, ...). finish is called once with that status before returning. Its callbacks
 * may not call bb_task_wait_start, bb_task_ack_pause, bb_task_ack_revoke, bb_task_run or
 * bb_task_detach on the task (the run does those itself): each returns BB_E_STATE and does
 * nothing. */
BB_API bb_status bb_task_run(bb_task_h task, const bb_task_callbacks_t *callbacks);

/* ---------------------------------------------------------------------------------------------
 * Memory grants (docs/GRANTS.md).
 *
 * The trainer lends one range of memory per hub at a time; libbubble carves a grant out of it for
 * each task
 * and the task maps it. Backends: host (shared host memory, for CPU tasks and machines without a
 * GPU), cuda-ipc (a window of a cuMemAlloc/cudaMalloc allocation, named by its IPC handle) and
 * cuda-vmm (cuMemCreate memory per grant, passed as a file descriptor). The CUDA driver is loaded
 * at run time; without it the CUDA backends give BB_E_UNSUPPORTED.
 *
 * Once memory is lent, a task that states a mem_need is started only while it holds a grant;
 * with auto_grant (the default) each such task is granted mem_need bytes when it attaches (or
 * as soon as enough lent memory is free). Granting, revoking and releasing run on the hub's
 * service thread: bb_bubble_begin/end never wait for them, they only read which tasks hold one.
 *
 * Revocation is a protocol: the task is asked to unmap the grant and ack by a deadline; a task
 * that has not acked by then is killed (SIGKILL), and the memory is reused only once the task no
 * longer maps it (it acked, exited, or was killed and is gone). A revoked task is not granted
 * again until bb_trainer_grant names it.
 */
typedef enum bb_grant_backend {
  BB_GRANT_HOST = 1,     /* shared host memory (a sealed memfd per grant) */
  BB_GRANT_CUDA_IPC = 2, /* a window of one device allocation, by its CUDA IPC handle */
  BB_GRANT_CUDA_VMM = 3  /* a cuMemCreate allocation per grant, by a POSIX descriptor handle */
} bb_grant_backend;

typedef struct bb_lend_options_t {
  uint32_t size;
  uint32_t backend;     /* bb_grant_backend; default BB_GRANT_HOST */
  uint64_t bytes;       /* size of the lent range; required (rounded down to the backend's unit) */
  uint64_t device_ptr;  /* cuda-ipc: lend [device_ptr, +bytes) of an existing cuMemAlloc or
                           cudaMalloc allocation the trainer keeps alive until the hub closes
                           or bb_trainer_unlend returns BB_OK;
                           0 (default) = libbubble allocates the range */
  int32_t device;       /* CUDA device ordinal; default 0 */
  uint32_t max_grants;  /* live grants at most, 1..4096; default 64 */
  uint64_t alignment;   /* grant unit, a power of two; 0 (default) = the backend's own */
  uint32_t auto_grant;  /* 1 (default): grant each attached task with mem_need > 0 that much */
  uint32_t reserved0_;
  uint32_t clear_grants; /* 1 (default): zero each cuda-ipc/cuda-vmm grant on the device before
                            a task gets it (one memset of the grant's size, on the hub's service
                            thread). 0 skips it: only when every task has one owner, as a task
                            then sees what the previous holder left. Host grants always start
                            zeroed. */
  uint32_t reserved1_;
} bb_lend_options_t;

#define BB_LEND_OPTIONS_INIT \
  {sizeof(bb_lend_options_t), BB_GRANT_HOST, 0u, 0u, 0, 64u, 0u, 1u, 0u, 1u, 0u}
BB_API void bb_lend_options_init_sized(bb_lend_options_t *opts, size_t size);
#define bb_lend_options_init(opts) bb_lend_options_init_sized((opts), sizeof(bb_lend_options_t))

/* Lends memory to the hub's tasks. One lent range at a time (BB_E_BUSY while one is lent); the
 * lent memory is given back by bb_trainer_unlend or when the hub closes. BB_E_UNSUPPORTED for a
 * CUDA backend without a usable CUDA driver. */
BB_API bb_status bb_trainer_lend(bb_trainer_h trainer, const bb_lend_options_t *opts);
/* Takes every grant back and gives the lent memory back, after which bb_trainer_lend may lend
 * again (another size, backend or range: this is how lent memory is resized). Every holder is
 * asked to give its grant back by deadline_ns (CLOCK_MONOTONIC; 0 = now + 1 s; an earlier
 * revoke's later deadline comes forward to it) and killed at it, as with bb_trainer_revoke; no
 * grant is made meanwhile, and a task that needs memory is not started while its grant is out.
 * Blocks until every grant is back, at most until the deadline plus 2 s for a killed holder to
 * be reported dead: call it where the trainer can wait (between iterations), or from another
 * thread while bubbles go on; a running holder gives its grant back inside its bubble. When it
 * returns BB_OK, every holder acked or is dead and the lent memory is freed (with cuda-ipc over
 * your own allocation the range is yours again; a cuda-ipc holder that kept its mapping against
 * the protocol can still reach it, see docs/GRANTS.md), and the hub is as before its first lend:
 * tasks are started without grants. BB_E_STATE when nothing is lent; BB_E_TIMEOUT when a holder
 * neither gave its grant back nor was reported dead (one the kill cannot reach): the memory
 * stays lent, and grants resume for every task but the holders still out. */
BB_API bb_status bb_trainer_unlend(bb_trainer_h trainer, uint64_t deadline_ns);
/* Grants bytes (0 = its mem_need) of the lent memory to one task (by bb_task_info_t.id), which
 * must hold no grant; also lifts the hold a revoke put on it. *grant_id (may be NULL) receives
 * the grant's id, 0 on failure. BB_E_NOMEM when no free extent is large enough, BB_E_FULL when max_grants are
 * live, BB_E_BUSY when the task holds a grant (or its connection is full: try again shortly),
 * BB_E_STATE when nothing is lent or it is being taken back, BB_E_NOT_FOUND when the task is not
 * attached, BB_E_INVALID when bytes is 0 and the task stated no mem_need, or when they are more
 * than all the lent memory (a task whose mem_need is larger is not granted automatically either). */
BB_API bb_status bb_trainer_grant(bb_trainer_h trainer, uint64_t task_id, uint64_t bytes,
                                  uint64_t *grant_id);
/* Asks a task to give its grant back by deadline_ns (CLOCK_MONOTONIC; 0 = now + 1 s). Returns
 * once the request is sent; bb_trainer_task_grant and bb_trainer_grant_stats show its progress.
 * BB_E_NOT_FOUND when the task holds no grant (or is not attached), BB_E_STATE when it is already
 * being revoked. */
BB_API bb_status bb_trainer_revoke(bb_trainer_h trainer, uint64_t task_id, uint64_t deadline_ns);

typedef enum bb_grant_state {
  BB_GRANT_STATE_NONE = 0,
  BB_GRANT_STATE_ACTIVE = 1,
  BB_GRANT_STATE_REVOKING = 2,    /* asked back; the task has not acked yet */
  BB_GRANT_STATE_QUARANTINED = 3  /* giving the memory back failed; never reused */
} bb_grant_state;

typedef struct bb_grant_info_t {
  uint32_t size;
  uint32_t state;       /* bb_grant_state */
  uint64_t id;          /* 0 when the task holds no grant */
  uint64_t task_id;
  uint32_t backend;     /* bb_grant_backend */
  uint32_t mapped;      /* 1 when the task says it maps the grant (its word: informative only) */
  uint64_t bytes;       /* what was granted (the task may use this many bytes) */
  uint64_t offset;      /* where the grant sits in the lent range */
  uint64_t address;     /* the trainer's own address of it: a host pointer for host, a device
                           pointer (CUdeviceptr) for the CUDA backends. The task may leave at
                           any moment, which releases the grant: a host range then reads zeros
                           (never faults, but takes no writes); a cuda-vmm range is unmapped; a
                           cuda-ipc range is the trainer's own memory, cleared before its next
                           grant. bb_trainer_read_grant copies it out safely */
  uint64_t deadline_ns; /* REVOKING: when the task will be killed */
} bb_grant_info_t;

/* The grant of one task (by bb_task_info_t.id). A task without a grant gives BB_OK with
 * state BB_GRANT_STATE_NONE; a task id that is not attached gives BB_E_NOT_FOUND. Set out->size
 * first. */
BB_API bb_status bb_trainer_task_grant(bb_trainer_h trainer, uint64_t task_id,
                                       bb_grant_info_t *out);

/* Copies bytes of grant grant_id, from offset into it, to dst, and returns once the copy is
 * done: this is how the trainer reads what a task wrote. The task may leave or die at any moment,
 * which releases its grant, but never while a piece of the copy is under way (the release waits
 * for it), so unlike reading bb_grant_info_t.address directly it never touches unmapped memory. dst is host
 * memory for host grants; for the CUDA backends, host memory or device memory of the lender's
 * GPU (unified addressing tells them apart). The copy runs on the calling thread (CUDA: on the
 * lender's own stream, which it waits for; the caller's streams are not waited for, so dst must
 * not be in use by the caller's queued work), 4 MiB at a time; the hub's grants and releases
 * wait for each piece, so copy what you need. BB_E_NOT_FOUND when the grant is no longer live
 * (its task gave it back, left or died), also when it is given back between two pieces (dst then
 * holds a part), BB_E_INVALID when [offset, offset + bytes) is not inside the grant's bytes or dst is
 * NULL, BB_E_STATE when nothing is lent. */
BB_API bb_status bb_trainer_read_grant(bb_trainer_h trainer, uint64_t grant_id, uint64_t offset,
                                       void *dst, uint64_t bytes);

typedef struct bb_grant_stats_t {
  uint32_t size;
  uint32_t backend;          /* bb_grant_backend, 0 before bb_trainer_lend */
  uint64_t capacity;         /* usable bytes of the lent range */
  uint64_t granted_bytes;    /* allocated (rounded) bytes: active + revoking + quarantined */
  uint64_t requested_bytes;  /* bytes asked for by live grants */
  uint64_t free_bytes;       /* capacity - granted_bytes */
  uint64_t largest_free;     /* the largest grant that would succeed now */
  uint64_t revoking_bytes;
  uint64_t quarantined_bytes;
  uint32_t active;           /* grants in each state */
  uint32_t revoking;
  uint32_t quarantined;
  uint32_t reserved0_;
  uint64_t grants_made;      /* since the memory was lent */
  uint64_t grants_failed;    /* grant attempts that found no room (or failed otherwise) */
  uint64_t revokes;          /* revocations asked */
  uint64_t revokes_acked;    /* ... that the task acked in time */
  uint64_t tasks_killed;     /* tasks killed for not acking a revoke, or for leaving without
                                giving a grant back */
  uint64_t released_dead;    /* grants taken back from tasks that died or were killed */
} bb_grant_stats_t;

/* The lender's byte counts and the revoke protocol's counters. Set out->size first. */
BB_API bb_status bb_trainer_grant_stats(bb_trainer_h trainer, bb_grant_stats_t *out);

/* Task side. The runtime maps a grant when it is offered and unmaps it when it is revoked.
 * Unmapping happens only inside bb_task_wait_start, bb_task_ack_pause, bb_task_ack_revoke and
 * bb_task_detach (and between steps of bb_task_run), so a pointer stays valid until the task's
 * next call of one of those; bb_task_grant only ever maps (it never unmaps the grant the task
 * holds), so it is safe to call inside a step. While a grant is being revoked,
 * bb_task_should_pause returns 1, and the next bb_task_ack_pause unmaps it and acks. */
typedef struct bb_task_grant_t {
  uint32_t size;
  uint32_t backend;  /* bb_grant_backend */
  uint64_t id;
  void *ptr;         /* a host pointer for host, a device pointer for the CUDA backends */
  uint64_t bytes;
  uint64_t revoke_deadline_ns; /* nonzero while the trainer revokes it: stop using it and call
                                  bb_task_ack_revoke (or bb_task_ack_pause) before then; in a
                                  step of bb_task_run, return from the step (the run gives it
                                  back) */
  int32_t device;    /* CUDA backends: this process's ordinal of the GPU the grant is mapped on
                        (cudaSetDevice / cuDeviceGet take it; the trainer's GPU found by UUID,
                        so it differs from the trainer's ordinal when CUDA_VISIBLE_DEVICES
                        does); -1 for host. Device work on ptr belongs on this GPU. */
  uint32_t reserved; /* 0 */
} bb_task_grant_t;

/* The grant this task maps now (mapping one that was just offered). BB_E_NOT_FOUND when it holds
 * none; a mapping failure (e.g. BB_E_UNSUPPORTED: a CUDA grant without a CUDA driver in the task)
 * is reported once, and that grant is given back. Set out->size first. */
BB_API bb_status bb_task_grant(bb_task_h task, bb_task_grant_t *out);
/* If the trainer is revoking this task's grant: unmaps it and acks. Otherwise does nothing.
 * Stop all use of the grant (device work included) before calling. */
BB_API bb_status bb_task_ack_revoke(bb_task_h task);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* BUBBLE_BUBBLE_H */
