// The C ABI: argument checks, option-struct versioning and translation to the core classes.
// Nothing here decides policy.
#include <bubble/bubble.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>
#include <memory>
#include <new>

#include "capi/abi.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/task.h"
#include "core/trainer.h"

using bb::capi::impl;
using bb::capi::init_sized;
using bb::capi::read_options;
using bb::core::fail;

namespace {

// Each option struct's size in the first release: every caller's struct is at least this big.
// (The trainer options have not grown since: when they do, this becomes the offset of the
// first new field.)
constexpr size_t kFirstTrainerOptions = sizeof(bb_trainer_options_t);
constexpr size_t kFirstSchedule = offsetof(bb_schedule_t, bubbles);
constexpr size_t kFirstTaskOptions = offsetof(bb_task_options_t, wake_lead_ns);
constexpr size_t kFirstCallbacks = offsetof(bb_task_callbacks_t, idle);
constexpr size_t kFirstLendOptions = offsetof(bb_lend_options_t, clear_grants);

// For out-structs: write at most the caller's size.
template <typename T>
bb_status write_out(const T& value, T* out, const char* what) {
  if (!out) return fail(BB_E_INVALID, "%s is NULL", what);
  if (out->size < sizeof(uint32_t) * 2)
    return fail(BB_E_INVALID, "%s->size is %u: set it to sizeof the struct before the call", what,
                out->size);
  const uint32_t size = out->size;
  std::memcpy(out, &value, std::min<size_t>(size, sizeof(T)));
  out->size = size;
  return BB_OK;
}

#define BB_GUARD(expr)                                                         \
  try {                                                                        \
    expr;                                                                      \
  } catch (const std::bad_alloc&) {                                            \
    return fail(BB_E_NOMEM, "out of memory");                                  \
  } catch (const std::exception& e) {                                          \
    return fail(BB_E_SYSTEM, "unexpected error: %s", e.what());                \
  }

}  // namespace

extern "C" {

const char* bb_status_name(bb_status status) {
  switch (status) {
#define BB_STATUS_NAME_(name, value, text) \
  case BB_##name:                          \
    return "BB_" #name;
    BB_STATUS_MAP(BB_STATUS_NAME_)
#undef BB_STATUS_NAME_
  }
  return "BB_E_UNKNOWN";
}

const char* bb_status_str(bb_status status) {
  switch (status) {
#define BB_STATUS_STR_(name, value, text) \
  case BB_##name:                         \
    return text;
    BB_STATUS_MAP(BB_STATUS_STR_)
#undef BB_STATUS_STR_
  }
  return "unknown status code";
}

const char* bb_last_error(void) { return bb::core::last_error(); }

const char* bb_version(void) { return "0.1.0"; }

uint64_t bb_now_ns(void) { return bb::core::now_ns(); }

void bb_trainer_options_init_sized(bb_trainer_options_t* opts, size_t size) {
  init_sized(opts, size, bb_trainer_options_t BB_TRAINER_OPTIONS_INIT);
}

bb_status bb_trainer_open(const char* job_id, uint32_t rank, const bb_trainer_options_t* opts,
                          bb_trainer_h* out) {
  if (!out) return fail(BB_E_INVALID, "out is NULL: pass the address of a bb_trainer_h");
  *out = nullptr;
  bb_trainer_options_t o;
  bb_status st = read_options(opts, bb_trainer_options_t BB_TRAINER_OPTIONS_INIT,
                              kFirstTrainerOptions, "bb_trainer_options_t", &o);
  if (st != BB_OK) return st;
  BB_GUARD({
    std::unique_ptr<bb::core::Trainer> t;
    st = bb::core::Trainer::open(job_id, rank, o, &t);
    if (st != BB_OK) return st;
    *out = reinterpret_cast<bb_trainer_h>(t.release());
  });
  return BB_OK;
}

bb_status bb_trainer_close(bb_trainer_h trainer) {
  // A stream timing left open stops first: its watcher calls into the trainer.
  if (trainer) impl(trainer)->detach_bubble_driver();
  delete impl(trainer);
  return BB_OK;
}

bb_status bb_bubble_begin(bb_trainer_h trainer, uint64_t expected_ns, uint64_t free_mem,
                          bb_bubble_kind kind) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  return impl(trainer)->begin(expected_ns, free_mem, kind);
}

bb_status bb_bubble_end(bb_trainer_h trainer) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  return impl(trainer)->end();
}

bb_status bb_trainer_iteration(bb_trainer_h trainer) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  impl(trainer)->iteration();
  return BB_OK;
}

void bb_schedule_init_sized(bb_schedule_t* schedule, size_t size) {
  init_sized(schedule, size, bb_schedule_t BB_SCHEDULE_INIT);
}

bb_status bb_trainer_set_schedule(bb_trainer_h trainer, const bb_schedule_t* schedule) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  if (!schedule) return fail(BB_E_INVALID, "schedule is NULL");
  bb_schedule_t sc;
  // Callers built before `bubbles` existed pass the shorter struct: they get the default.
  bb_status st = read_options(schedule, bb_schedule_t BB_SCHEDULE_INIT,
                              kFirstSchedule, "bb_schedule_t", &sc);
  if (st != BB_OK) return st;
  BB_GUARD(return impl(trainer)->set_schedule(sc));
}

bb_status bb_trainer_stats(bb_trainer_h trainer, bb_trainer_stats_t* out) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  bb_trainer_stats_t s{};
  s.size = sizeof s;
  impl(trainer)->stats(&s);
  return write_out(s, out, "stats");
}

bb_status bb_trainer_tasks(bb_trainer_h trainer, bb_task_info_t* out, size_t cap,
                           size_t* count) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  if (!count) return fail(BB_E_INVALID, "count is NULL");
  *count = 0;
  if (cap > 0 && !out) return fail(BB_E_INVALID, "out is NULL but cap is %zu", cap);
  // The elements' size is the array's stride: a caller built against an older, shorter
  // bb_task_info_t passes its own and gets the fields it knows (a newer, longer one keeps what
  // lies past ours), as with every other out-struct.
  char* const base = reinterpret_cast<char*>(out);
  auto size_at = [&](size_t i, uint32_t stride) {
    uint32_t size;
    std::memcpy(&size, base + i * stride, sizeof size);
    return size;
  };
  const uint32_t stride = cap ? size_at(0, 0) : 0;
  // The stride places every element: a size no version of the struct has (beyond 64 KiB, or
  // not a whole number of its alignment) is a caller's mistake, never an address to go to.
  if (cap && (stride < sizeof(uint32_t) * 2 || stride > 65536 ||
              stride % alignof(bb_task_info_t) != 0))
    return fail(BB_E_INVALID, "out[0].size is %u: set it to sizeof(bb_task_info_t) in every "
                "element before the call", stride);
  for (size_t i = 1; i < cap; ++i)
    if (size_at(i, stride) != stride)
      return fail(BB_E_INVALID, "out[%zu].size is %u but out[0].size is %u: set the same size "
                  "(sizeof(bb_task_info_t)) in every element", i, size_at(i, stride), stride);
  BB_GUARD({
    // No hub has more tasks than this, whatever the caller's room.
    std::vector<bb_task_info_t> all(std::min<size_t>(cap, BB_MAX_SLOTS_LIMIT));
    for (auto& t : all) t.size = sizeof t;
    const bb_status st = impl(trainer)->tasks(all.data(), all.size(), count);
    if (st != BB_OK) return st;
    for (size_t i = 0; i < all.size() && i < *count; ++i) {
      std::memcpy(base + i * stride, &all[i], std::min<size_t>(stride, sizeof all[i]));
      std::memcpy(base + i * stride, &stride, sizeof stride);
    }
    return BB_OK;
  });
}

bb_status bb_trainer_stop_task(bb_trainer_h trainer, uint64_t task_id) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  BB_GUARD(return impl(trainer)->stop_task(task_id););
}

void bb_task_options_init_sized(bb_task_options_t* opts, size_t size) {
  init_sized(opts, size, bb_task_options_t BB_TASK_OPTIONS_INIT);
}

void bb_task_callbacks_init_sized(bb_task_callbacks_t* cbs, size_t size) {
  init_sized(cbs, size, bb_task_callbacks_t BB_TASK_CALLBACKS_INIT);
}

bb_status bb_task_attach(const char* job_id, uint32_t rank, const char* name,
                         const bb_task_options_t* opts, bb_task_h* out) {
  if (!out) return fail(BB_E_INVALID, "out is NULL: pass the address of a bb_task_h");
  *out = nullptr;
  bb_task_options_t o;
  bb_status st = read_options(opts, bb_task_options_t BB_TASK_OPTIONS_INIT,
                              kFirstTaskOptions, "bb_task_options_t", &o);
  if (st != BB_OK) return st;
  BB_GUARD({
    std::unique_ptr<bb::core::Task> t;
    st = bb::core::Task::attach(job_id, rank, name, o, &t);
    if (st != BB_OK) return st;
    *out = reinterpret_cast<bb_task_h>(t.release());
  });
  return BB_OK;
}

// A call a task's own callbacks make inside bb_task_run that would pull the run's state (its
// wait, its acks, its grant mapping, the handle itself) from under it.
static bool refused_in_run(bb_task_h task, const char* fn) {
  if (!task || !impl(task)->in_run()) return false;
  fail(BB_E_STATE, "%s was called from inside bb_task_run (a callback of the task's own run): "
       "the run waits, acks pauses and revokes itself; return from the callback instead "
       "(BB_STEP_DONE ends the run), and detach after bb_task_run returned", fn);
  return true;
}

bb_status bb_task_detach(bb_task_h task) {
  if (refused_in_run(task, "bb_task_detach")) return BB_E_STATE;
  delete impl(task);
  return BB_OK;
}

bb_status bb_task_wait_start(bb_task_h task, int64_t timeout_ns, bb_start_info_t* out) {
  if (!task) return fail(BB_E_INVALID, "task is NULL");
  if (refused_in_run(task, "bb_task_wait_start")) return BB_E_STATE;
  if (out && out->size < sizeof(uint32_t) * 2)
    return fail(BB_E_INVALID, "out->size is %u: set it to sizeof(bb_start_info_t)", out->size);
  bb_start_info_t info{};
  info.size = sizeof info;
  bb_status st = BB_OK;
  BB_GUARD(st = impl(task)->wait_start(timeout_ns, &info));
  if (st == BB_OK && out) write_out(info, out, "out");
  return st;
}

int bb_task_should_pause(bb_task_h task) { return task ? impl(task)->should_pause() : 1; }

bb_status bb_task_ack_pause(bb_task_h task) {
  if (!task) return fail(BB_E_INVALID, "task is NULL");
  if (refused_in_run(task, "bb_task_ack_pause")) return BB_E_STATE;
  BB_GUARD(return impl(task)->ack_pause());
}

bb_status bb_task_report_step(bb_task_h task, uint64_t step_ns) {
  if (!task) return fail(BB_E_INVALID, "task is NULL");
  return impl(task)->report_step(step_ns);
}

bb_status bb_task_time_left(bb_task_h task, uint64_t* left_ns, uint64_t* est_step_ns) {
  if (!task) return fail(BB_E_INVALID, "task is NULL");
  impl(task)->time_left(left_ns, est_step_ns);
  return BB_OK;
}

bb_status bb_task_run(bb_task_h task, const bb_task_callbacks_t* callbacks) {
  if (!task) return fail(BB_E_INVALID, "task is NULL");
  if (refused_in_run(task, "bb_task_run")) return BB_E_STATE;
  if (!callbacks) return fail(BB_E_INVALID, "callbacks is NULL");
  bb_task_callbacks_t cbs;
  // A struct from before idle ends where idle begins: it has none.
  bb_status st = read_options(callbacks, bb_task_callbacks_t BB_TASK_CALLBACKS_INIT,
                              kFirstCallbacks, "bb_task_callbacks_t", &cbs);
  if (st != BB_OK) return st;
  BB_GUARD(return impl(task)->run(cbs));
}

// ---- Memory grants ----

void bb_lend_options_init_sized(bb_lend_options_t* opts, size_t size) {
  init_sized(opts, size, bb_lend_options_t BB_LEND_OPTIONS_INIT);
}

// The initialisers programs built against the first headers call (the header now makes each
// name a macro over its _sized form). They assigned the library's own struct, which overruns a
// caller's smaller one once the struct grows: now they write the first release's size, which
// every caller's struct has, and the fields past it take their defaults.
#undef bb_trainer_options_init
#undef bb_schedule_init
#undef bb_task_options_init
#undef bb_task_callbacks_init
#undef bb_lend_options_init
BB_API void bb_trainer_options_init(bb_trainer_options_t* opts) {
  init_sized(opts, kFirstTrainerOptions, bb_trainer_options_t BB_TRAINER_OPTIONS_INIT);
}
BB_API void bb_schedule_init(bb_schedule_t* schedule) {
  init_sized(schedule, kFirstSchedule, bb_schedule_t BB_SCHEDULE_INIT);
}
BB_API void bb_task_options_init(bb_task_options_t* opts) {
  init_sized(opts, kFirstTaskOptions, bb_task_options_t BB_TASK_OPTIONS_INIT);
}
BB_API void bb_task_callbacks_init(bb_task_callbacks_t* cbs) {
  init_sized(cbs, kFirstCallbacks, bb_task_callbacks_t BB_TASK_CALLBACKS_INIT);
}
BB_API void bb_lend_options_init(bb_lend_options_t* opts) {
  init_sized(opts, kFirstLendOptions, bb_lend_options_t BB_LEND_OPTIONS_INIT);
}

bb_status bb_trainer_lend(bb_trainer_h trainer, const bb_lend_options_t* opts) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  if (!opts)
    return fail(BB_E_INVALID, "opts is NULL: lending needs at least the bytes to lend "
                "(bb_lend_options_init, then set bytes)");
  bb_lend_options_t o;
  // Callers built before `clear_grants` existed pass the shorter struct: they get the default.
  bb_status st = read_options(opts, bb_lend_options_t BB_LEND_OPTIONS_INIT,
                              kFirstLendOptions, "bb_lend_options_t", &o);
  if (st != BB_OK) return st;
  bb::core::LendOptions lo;
  switch (o.backend) {
    case BB_GRANT_HOST: lo.backend = bb::core::GrantBackend::kHost; break;
    case BB_GRANT_CUDA_IPC: lo.backend = bb::core::GrantBackend::kCudaIpc; break;
    case BB_GRANT_CUDA_VMM: lo.backend = bb::core::GrantBackend::kCudaVmm; break;
    default:
      return fail(BB_E_INVALID, "backend %u is not a bb_grant_backend: use BB_GRANT_HOST, "
                  "BB_GRANT_CUDA_IPC or BB_GRANT_CUDA_VMM", o.backend);
  }
  if (o.max_grants == 0 || o.max_grants > 4096)
    return fail(BB_E_INVALID, "max_grants %u is out of range 1..4096", o.max_grants);
  if (o.device < 0) return fail(BB_E_INVALID, "device %d is not a CUDA device ordinal", o.device);
  if (o.auto_grant > 1) return fail(BB_E_INVALID, "auto_grant is %u: use 0 or 1", o.auto_grant);
  if (o.clear_grants > 1)
    return fail(BB_E_INVALID, "clear_grants is %u: use 1 (zero every grant) or 0", o.clear_grants);
  lo.bytes = o.bytes;
  lo.max_grants = o.max_grants;
  lo.device = o.device;
  lo.device_ptr = o.device_ptr;
  lo.alignment = o.alignment;
  lo.clear = o.clear_grants != 0;
  BB_GUARD(return impl(trainer)->lend(lo, o.auto_grant != 0));
}

bb_status bb_trainer_unlend(bb_trainer_h trainer, uint64_t deadline_ns) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  BB_GUARD(return impl(trainer)->unlend(deadline_ns));
}

bb_status bb_trainer_grant(bb_trainer_h trainer, uint64_t task_id, uint64_t bytes,
                           uint64_t* grant_id) {
  if (grant_id) *grant_id = 0;
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  BB_GUARD(return impl(trainer)->grant(task_id, bytes, grant_id));
}

bb_status bb_trainer_revoke(bb_trainer_h trainer, uint64_t task_id, uint64_t deadline_ns) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  BB_GUARD(return impl(trainer)->revoke(task_id, deadline_ns));
}

bb_status bb_trainer_task_grant(bb_trainer_h trainer, uint64_t task_id, bb_grant_info_t* out) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  if (!out) return fail(BB_E_INVALID, "out is NULL");
  bb_grant_info_t info{};
  info.size = sizeof info;
  bb_status st;
  BB_GUARD(st = impl(trainer)->task_grant(task_id, &info));
  if (st != BB_OK) return st;
  return write_out(info, out, "out");
}

bb_status bb_trainer_read_grant(bb_trainer_h trainer, uint64_t grant_id, uint64_t offset,
                                void* dst, uint64_t bytes) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  if (!dst) return fail(BB_E_INVALID, "dst is NULL: pass the buffer to copy the grant's bytes to");
  BB_GUARD(return impl(trainer)->read_grant(grant_id, offset, dst, bytes));
}

bb_status bb_trainer_grant_stats(bb_trainer_h trainer, bb_grant_stats_t* out) {
  if (!trainer) return fail(BB_E_INVALID, "trainer is NULL");
  bb_grant_stats_t s{};
  s.size = sizeof s;
  impl(trainer)->grant_stats(&s);
  return write_out(s, out, "out");
}

bb_status bb_task_grant(bb_task_h task, bb_task_grant_t* out) {
  if (!task) return fail(BB_E_INVALID, "task is NULL");
  if (!out || out->size < sizeof(uint32_t) * 2)
    return fail(BB_E_INVALID, "out is NULL or out->size is not set: set it to "
                "sizeof(bb_task_grant_t)");
  bb_task_grant_t g{};
  g.size = sizeof g;
  bb_status st;
  BB_GUARD(st = impl(task)->grant(&g));
  if (st != BB_OK) return st;
  return write_out(g, out, "out");
}

bb_status bb_task_ack_revoke(bb_task_h task) {
  if (!task) return fail(BB_E_INVALID, "task is NULL");
  if (refused_in_run(task, "bb_task_ack_revoke")) return BB_E_STATE;
  BB_GUARD(return impl(task)->ack_revoke());
}

}  // extern "C"
