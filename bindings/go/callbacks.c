// Trampolines from bb_task_run's C callbacks to the exported Go functions. The user pointer
// carries a runtime/cgo.Handle (an integer), never a Go pointer.
#include <stdint.h>

#include "_cgo_export.h"

static int on_init(void *user) { return bubbleGoInit((uintptr_t)user); }
static int on_step(void *user, const bb_step_info_t *info) {
  return bubbleGoStep((uintptr_t)user, (bb_step_info_t *)info);
}
static int on_pause(void *user) { return bubbleGoPause((uintptr_t)user); }
static int on_resume(void *user) { return bubbleGoResume((uintptr_t)user); }
static void on_finish(void *user, bb_status status) { bubbleGoFinish((uintptr_t)user, status); }
static int on_idle(void *user) { return bubbleGoIdle((uintptr_t)user); }

/* idle: whether the task has an Idle method (without one the runtime just waits). */
bb_status bubble_go_run(bb_task_h task, uintptr_t handle, int idle) {
  bb_task_callbacks_t cbs;
  bb_task_callbacks_init(&cbs);
  cbs.user = (void *)handle;
  cbs.init = on_init;
  cbs.step = on_step;
  cbs.pause = on_pause;
  cbs.resume = on_resume;
  cbs.finish = on_finish;
  if (idle) cbs.idle = on_idle;
  return bb_task_run(task, &cbs);
}
