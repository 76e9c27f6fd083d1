// libbubble for C++: a header-only RAII layer over the C ABI in bubble.h.
//
// Handles are move-only and close themselves; a failed call throws bubble::error, which carries
// the status and bb_last_error()'s sentence. Nothing here re-implements the runtime: every call
// is one C call. Requires C++17; the side_task_like concept is used under C++20.
#pragma once

#include <bubble/bubble.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <stdexcept>
#if __cplusplus >= 202002L && __has_include(<span>)
#include <span>
#define BUBBLE_HPP_SPAN 1
#endif
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#if __cplusplus >= 202002L && __has_include(<concepts>)
#include <concepts>
#define BUBBLE_HPP_CONCEPTS 1
#endif

namespace bubble {

// Generated from the same table as the C enum, so the two cannot drift.
enum class status : int {
#define BUBBLE_HPP_STATUS_(name, value, text) name = value,
  BB_STATUS_MAP(BUBBLE_HPP_STATUS_)
#undef BUBBLE_HPP_STATUS_
};

inline const char* name_of(status s) noexcept { return bb_status_name(static_cast<bb_status>(s)); }
inline const char* describe(status s) noexcept { return bb_status_str(static_cast<bb_status>(s)); }

// What every failed call throws. what() is the library's sentence followed by the status name.
class error : public std::runtime_error {
 public:
  error(status code, const std::string& message)
      : std::runtime_error(message + " [" + name_of(code) + "]"), code_(code), message_(message) {}
  status code() const noexcept { return code_; }
  // The library's sentence alone (what() appends the status name).
  const std::string& message() const noexcept { return message_; }

 private:
  status code_;
  std::string message_;
};

namespace detail {

// Must run right after the failing call: bb_last_error() is per thread and reset by any call.
[[noreturn]] inline void throw_status(bb_status s) {
  std::string msg = bb_last_error();
  if (msg.empty()) msg = bb_status_str(s);
  throw error(static_cast<status>(s), msg);
}

inline void check(bb_status s) {
  if (s != BB_OK) throw_status(s);
}

// A move-only owner of one C handle, closed by Close exactly once.
template <typename Handle, bb_status (*Close)(Handle)>
class unique_handle {
 public:
  unique_handle() noexcept = default;
  explicit unique_handle(Handle h) noexcept : h_(h) {}
  unique_handle(const unique_handle&) = delete;
  unique_handle& operator=(const unique_handle&) = delete;
  unique_handle(unique_handle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  unique_handle& operator=(unique_handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  ~unique_handle() { reset(); }

  Handle get() const {
    if (!h_) throw error(status::E_STATE, "the handle was closed or moved from; open a new one");
    return h_;
  }
  explicit operator bool() const noexcept { return h_ != nullptr; }
  // Closes now; a destructor cannot report the status, this can. A close the library refused
  // (E_STATE: the handle is in use by a call in progress) keeps the handle.
  void close() {
    if (!h_) return;
    const bb_status s = Close(h_);
    if (s != BB_E_STATE) h_ = nullptr;
    check(s);
  }
  // Gives the handle up without closing it.
  Handle release() noexcept { return std::exchange(h_, nullptr); }

 private:
  void reset() noexcept {
    if (Handle h = std::exchange(h_, nullptr)) (void)Close(h);
  }
  Handle h_ = nullptr;
};

inline uint64_t to_ns(std::chrono::nanoseconds d) {
  return d.count() <= 0 ? 0 : static_cast<uint64_t>(d.count());
}

// s for a const char* argument. One holding a NUL byte would reach C cut short at it (another,
// shorter name): it throws E_INVALID instead, saying which argument (`what`).
inline const char* c_string(const char* what, const std::string& s, const char* fix = "a name") {
  if (s.find('\0') != std::string::npos) {
    std::string shown;
    for (char c : s) shown += c == '\0' ? std::string("\\0") : std::string(1, c);
    throw error(status::E_INVALID, std::string(what) + " \"" + shown +
                                       "\" contains a NUL byte; pass " + fix + " without one");
  }
  return s.c_str();
}

}  // namespace detail

inline constexpr uint64_t mem_unknown = BB_MEM_UNKNOWN;

inline std::string_view library_version() noexcept { return bb_version(); }
inline uint64_t now_ns() noexcept { return bb_now_ns(); }

enum class bubble_kind : uint32_t {
  other = BB_BUBBLE_OTHER,
  warmup = BB_BUBBLE_WARMUP,
  steady = BB_BUBBLE_STEADY,
  cooldown = BB_BUBBLE_COOLDOWN,
};

// A declared pipeline schedule: the predictor knows each bubble's length from the first
// iteration on (observed lengths replace the declared ones as they come).
enum class schedule_kind : uint32_t {
  gpipe = BB_SCHEDULE_GPIPE,              // all forwards, then all backwards
  one_f_one_b = BB_SCHEDULE_1F1B,         // one forward, one backward (PipeDream-flush)
  interleaved = BB_SCHEDULE_INTERLEAVED,  // interleaved 1F1B with `chunks` chunks per stage
  zbh1 = BB_SCHEDULE_ZBH1,                // zero-bubble H1: backward split in input/weight parts
};

// What one bubble is, which fixes how bubbles are numbered in an iteration.
enum class schedule_bubbles : uint32_t {
  idle = BB_SCHEDULE_BUBBLES_IDLE,          // each idle interval of the stage in the model
  receives = BB_SCHEDULE_BUBBLES_RECEIVES,  // one per point-to-point receive, waited or not
};

// fwd = bwd = 0 (and wgrad, comm 0): times unknown, the library measures them.
struct schedule {
  schedule_kind kind = schedule_kind::one_f_one_b;
  uint32_t stages = 0;        // p >= 1
  uint32_t microbatches = 0;  // m >= 1
  uint32_t chunks = 1;        // interleaved: v >= 2
  uint32_t stage = 0;         // this trainer's stage, 0..p-1
  std::chrono::nanoseconds fwd{0};    // one micro-batch's forward through the stage
  std::chrono::nanoseconds bwd{0};    // its backward (zbh1: the input-gradient part)
  std::chrono::nanoseconds wgrad{0};  // zbh1: the weight-gradient part
  std::chrono::nanoseconds comm{0};   // point-to-point transfer between stages
  schedule_bubbles bubbles = schedule_bubbles::idle;
};

// ------------------------------------------------------------------------------------------
// Memory grants (docs/GRANTS.md): the trainer lends memory, each task is granted a piece.

enum class grant_backend : uint32_t {
  host = BB_GRANT_HOST,          // shared host memory: CPU tasks, machines without a GPU
  cuda_ipc = BB_GRANT_CUDA_IPC,  // a window of one device allocation, by its IPC handle
  cuda_vmm = BB_GRANT_CUDA_VMM,  // a cuMemCreate allocation per grant
};

enum class grant_state : uint32_t {
  none = BB_GRANT_STATE_NONE,
  active = BB_GRANT_STATE_ACTIVE,
  revoking = BB_GRANT_STATE_REVOKING,        // asked back; the task has not acked yet
  quarantined = BB_GRANT_STATE_QUARANTINED,  // giving it back failed; never reused
};

struct lend_options {
  grant_backend backend = grant_backend::host;
  uint64_t bytes = 0;       // required
  uint64_t device_ptr = 0;  // cuda_ipc: lend this range of your own allocation; 0: allocate
  int32_t device = 0;
  uint32_t max_grants = 64;
  uint64_t alignment = 0;   // 0: the backend's own unit
  bool auto_grant = true;   // grant each task with a mem_need that much when it attaches
  bool clear_grants = true; // zero CUDA grants before a task gets them; off: one owner only
};

namespace detail {
// Host memory at an address the library reported, as a typed pointer; anything else is refused
// rather than handed out as a host pointer that would fault.
template <typename T>
T* host_pointer(grant_backend backend, uint64_t address, const char* what) {
  if (backend != grant_backend::host)
    throw error(status::E_STATE, std::string(what) + " is device memory, not host memory: pass "
                "its address to device code instead");
  if (address == 0) throw error(status::E_STATE, std::string(what) + " is not mapped");
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}
}  // namespace detail

// A task's grant as the trainer sees it (bb_grant_info_t).
struct grant_info {
  uint64_t id;
  uint64_t task_id;
  grant_state state;
  grant_backend backend;
  bool mapped;           // the task says it maps the grant (its word: informative only)
  uint64_t bytes;
  uint64_t offset;       // in the lent range
  uint64_t address;      // the trainer's own address: host pointer or CUdeviceptr
  uint64_t deadline_ns;  // revoking: when the task will be killed

  // The trainer's view of a host grant. Valid while the grant is active or revoking: once it is
  // released the range may be unmapped or granted to another task.
  template <typename T = std::byte>
  T* host_data() const {
    return detail::host_pointer<T>(backend, address, "the grant");
  }
#ifdef BUBBLE_HPP_SPAN
  std::span<std::byte> host_bytes() const { return {host_data(), static_cast<size_t>(bytes)}; }
#endif
};

using grant_stats = bb_grant_stats_t;

// ------------------------------------------------------------------------------------------
// Trainer side.

struct trainer_options {
  uint32_t max_slots = 64;
  uint32_t max_running = 1;
  uint32_t event_capacity = 4096;
  std::string runtime_dir;  // empty: $BUBBLE_RUNTIME_DIR, else the default
  std::optional<uint32_t> allow_uid;
};

using trainer_stats = bb_trainer_stats_t;

struct task_info {
  uint64_t id;
  uint32_t slot;
  std::string name;
  int32_t pid;
  int32_t priority;
  uint64_t mem_need;
  uint64_t min_step_ns;
  uint64_t steps;
  uint64_t step_ns;
  bool running;
  bool bad;
  uint64_t ns_in_bubbles;  // its step time inside bubbles, from its reports
  uint64_t ns_outside;     // its step time that spilled past bubbles' ends
};

class trainer {
 public:
  // Creates the hub of (job_id, rank). Throws with status E_BUSY if a live trainer owns it.
  trainer(const std::string& job_id, uint32_t rank, const trainer_options& o = {}) {
    bb_trainer_options_t opts;
    bb_trainer_options_init(&opts);
    opts.max_slots = o.max_slots;
    opts.max_running = o.max_running;
    opts.event_capacity = o.event_capacity;
    opts.runtime_dir =
        o.runtime_dir.empty() ? nullptr : detail::c_string("runtime dir", o.runtime_dir, "a path");
    if (o.allow_uid) opts.allow_uid = *o.allow_uid;
    bb_trainer_h h = nullptr;
    detail::check(bb_trainer_open(detail::c_string("job id", job_id), rank, &opts, &h));
    h_ = handle(h);
  }

  // A bubble starts now. expected == 0 asks the predictor; free_mem empty means unknown.
  void begin(std::chrono::nanoseconds expected = {}, bubble_kind kind = bubble_kind::other,
             std::optional<uint64_t> free_mem = std::nullopt) {
    detail::check(bb_bubble_begin(h_.get(), detail::to_ns(expected),
                                  free_mem.value_or(BB_MEM_UNKNOWN),
                                  static_cast<bb_bubble_kind>(kind)));
  }
  void end() { detail::check(bb_bubble_end(h_.get())); }
  void iteration() { detail::check(bb_trainer_iteration(h_.get())); }
  // Declares the pipeline schedule (from the bubble thread, before an iteration; not
  // bounded-time). E_INVALID names what the schedule model rejects.
  void set_schedule(const schedule& sc) {
    bb_schedule_t c;
    bb_schedule_init(&c);
    c.kind = static_cast<uint32_t>(sc.kind);
    c.stages = sc.stages;
    c.microbatches = sc.microbatches;
    c.chunks = sc.chunks;
    c.stage = sc.stage;
    c.fwd_ns = detail::to_ns(sc.fwd);
    c.bwd_ns = detail::to_ns(sc.bwd);
    c.wgrad_ns = detail::to_ns(sc.wgrad);
    c.comm_ns = detail::to_ns(sc.comm);
    c.bubbles = static_cast<uint32_t>(sc.bubbles);
    detail::check(bb_trainer_set_schedule(h_.get(), &c));
  }

  // Marks a scope (typically a blocking receive) as a bubble; ends it even on exceptions.
  // A bubble that ends with the scope. It follows its trainer: moved inside the scope, the
  // bubble ends on the trainer it was moved to; closed or destroyed, there is none to end.
  class scoped_bubble {
   public:
    scoped_bubble(trainer& t, std::chrono::nanoseconds expected = {},
                  bubble_kind kind = bubble_kind::other)
        : t_(&t) {
      t.begin(expected, kind);
      outer_ = t.scope_;
      t.scope_ = this;
    }
    scoped_bubble(const scoped_bubble&) = delete;
    scoped_bubble& operator=(const scoped_bubble&) = delete;
    // Never throws: a trainer closed inside the scope has no bubble left to end.
    ~scoped_bubble() {
      if (!t_) return;
      if (t_->h_) (void)bb_bubble_end(t_->h_.get());
      for (scoped_bubble** s = &t_->scope_; *s; s = &(*s)->outer_)
        if (*s == this) {
          *s = outer_;
          break;
        }
    }

   private:
    friend class trainer;
    trainer* t_;
    scoped_bubble* outer_ = nullptr;  // the scope opened before this one on the same trainer
  };
  trainer(trainer&& o) noexcept : h_(std::move(o.h_)), scope_(std::exchange(o.scope_, nullptr)) {
    follow(this);
  }
  trainer& operator=(trainer&& o) noexcept {
    if (this == &o) return *this;
    follow(nullptr);  // this trainer's bubble ends with its handle, closed here
    h_ = std::move(o.h_);
    scope_ = std::exchange(o.scope_, nullptr);
    follow(this);
    return *this;
  }
  ~trainer() { follow(nullptr); }

  [[nodiscard]] scoped_bubble bubble(std::chrono::nanoseconds expected = {},
                                     bubble_kind kind = bubble_kind::other) {
    return scoped_bubble(*this, expected, kind);
  }

  trainer_stats stats() const {
    bb_trainer_stats_t s{};
    s.size = sizeof s;
    detail::check(bb_trainer_stats(h_.get(), &s));
    return s;
  }

  std::vector<task_info> tasks() const {
    size_t count = 0;
    detail::check(bb_trainer_tasks(h_.get(), nullptr, 0, &count));
    std::vector<bb_task_info_t> raw;
    do {  // tasks may attach between the calls: grow until everything fits
      bb_task_info_t proto{};
      proto.size = sizeof proto;
      raw.assign(count + 4, proto);
      detail::check(bb_trainer_tasks(h_.get(), raw.data(), raw.size(), &count));
    } while (count > raw.size());
    std::vector<task_info> out;
    out.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      const auto& r = raw[i];
      out.push_back({r.id, r.slot, std::string(r.name, strnlen(r.name, sizeof r.name)), r.pid,
                     r.priority, r.mem_need, r.min_step_ns, r.steps, r.step_ns, r.running != 0,
                     r.bad != 0, r.ns_in_bubbles, r.ns_outside});
    }
    return out;
  }

  void stop_task(uint64_t task_id) { detail::check(bb_trainer_stop_task(h_.get(), task_id)); }

  // Lends memory to the hub's tasks; one lent range at a time (E_BUSY while one is lent).
  // E_UNSUPPORTED for a CUDA backend without a usable CUDA driver.
  void lend(const lend_options& o) {
    bb_lend_options_t lo;
    bb_lend_options_init(&lo);
    lo.backend = static_cast<uint32_t>(o.backend);
    lo.bytes = o.bytes;
    lo.device_ptr = o.device_ptr;
    lo.device = o.device;
    lo.max_grants = o.max_grants;
    lo.alignment = o.alignment;
    lo.auto_grant = o.auto_grant ? 1u : 0u;
    lo.clear_grants = o.clear_grants ? 1u : 0u;
    detail::check(bb_trainer_lend(h_.get(), &lo));
  }
  // Takes every grant back (holders that have not given theirs back within grace, default 1 s,
  // are killed) and gives the lent memory back, so that lend() may lend again. Blocks until
  // then (at most grace + 2 s), so call it where the trainer can wait. E_STATE when nothing
  // is lent, E_TIMEOUT when a holder the kill cannot reach keeps the memory lent.
  void unlend(std::optional<std::chrono::nanoseconds> grace = std::nullopt) {
    const uint64_t deadline = grace ? bb_now_ns() + detail::to_ns(*grace) : 0;
    detail::check(bb_trainer_unlend(h_.get(), deadline));
  }
  // Grants bytes (0: its mem_need) to a task that holds none; returns the grant's id.
  // E_NOMEM when no free extent is large enough, E_BUSY when the task holds a grant.
  uint64_t grant(uint64_t task_id, uint64_t bytes = 0) {
    uint64_t id = 0;
    detail::check(bb_trainer_grant(h_.get(), task_id, bytes, &id));
    return id;
  }
  // Asks the task's grant back; a task that has not acked within grace (default 1 s) is
  // killed. Returns at once: task_grant() and grants() show the progress.
  void revoke(uint64_t task_id, std::optional<std::chrono::nanoseconds> grace = std::nullopt) {
    const uint64_t deadline = grace ? bb_now_ns() + detail::to_ns(*grace) : 0;
    detail::check(bb_trainer_revoke(h_.get(), task_id, deadline));
  }
  // The task's grant; empty when it holds none. E_NOT_FOUND when no such task is attached.
  std::optional<grant_info> task_grant(uint64_t task_id) const {
    bb_grant_info_t g{};
    g.size = sizeof g;
    detail::check(bb_trainer_task_grant(h_.get(), task_id, &g));
    if (g.state == BB_GRANT_STATE_NONE) return std::nullopt;
    return grant_info{g.id, g.task_id, static_cast<grant_state>(g.state),
                      static_cast<grant_backend>(g.backend), g.mapped != 0, g.bytes, g.offset,
                      g.address, g.deadline_ns};
  }
  // Copies bytes of grant grant_id, from offset into it, to dst: the safe way to read what a
  // task wrote. The task may leave or die at any moment, which releases the grant, but never
  // while a piece of the copy (4 MiB) is under way (the release waits for it). dst is host
  // memory, or for the CUDA backends device memory of the lender's GPU. Throws E_NOT_FOUND once
  // the grant is no longer live, also when it was released between two pieces (dst then holds
  // a part), E_INVALID when the range is not inside the grant's bytes.
  void read_grant(uint64_t grant_id, uint64_t offset, void* dst, uint64_t bytes) const {
    detail::check(bb_trainer_read_grant(h_.get(), grant_id, offset, dst, bytes));
  }
  // The lender's byte counts and the revoke protocol's counters.
  grant_stats grants() const {
    bb_grant_stats_t s{};
    s.size = sizeof s;
    detail::check(bb_trainer_grant_stats(h_.get(), &s));
    return s;
  }

  // Stops every task and removes the hub now (the destructor does the same, silently).
  void close() { h_.close(); }
  bb_trainer_h native_handle() const { return h_.get(); }

 private:
  using handle = detail::unique_handle<bb_trainer_h, bb_trainer_close>;
  // Points this trainer's open scoped bubbles at t (nullptr: at no trainer).
  void follow(trainer* t) noexcept {
    for (scoped_bubble* s = scope_; s; s = s->outer_) s->t_ = t;
    if (!t) scope_ = nullptr;
  }
  handle h_;
  scoped_bubble* scope_ = nullptr;  // the innermost open scoped bubble
};

// ------------------------------------------------------------------------------------------
// Side-task side.

enum class on_trainer_exit : uint32_t {
  return_error = BB_ON_TRAINER_EXIT_RETURN,
  wait = BB_ON_TRAINER_EXIT_WAIT,
};

// How a task waits for its next start.
enum class wake_mode : uint32_t {
  predictive = BB_WAKE_PREDICTIVE,  // sleep, and spin from wake_lead before the predicted bubble
  sleep = BB_WAKE_SLEEP,            // spin briefly, then sleep: least CPU, a wake-up's latency
  spin = BB_WAKE_SPIN,              // spin all the time: lowest latency, a whole core
};

struct task_options {
  int32_t priority = 0;
  uint64_t mem_need = 0;
  std::chrono::nanoseconds min_step{0};
  on_trainer_exit trainer_exit = on_trainer_exit::return_error;
  std::chrono::nanoseconds reattach_timeout = std::chrono::seconds(60);
  std::chrono::nanoseconds spin = std::chrono::microseconds(20);
  std::string runtime_dir;
  bubble::wake_mode wake = bubble::wake_mode::predictive;
  std::chrono::nanoseconds wake_lead = std::chrono::microseconds(50);
};

using start_info = bb_start_info_t;
using step_info = bb_step_info_t;

// The grant a task maps (bb_task_grant_t). The memory stays mapped until the task's next
// wait_start, ack_pause, ack_revoke or detach: do not keep the pointer past that. grant()
// only maps, never unmaps.
struct task_grant {
  uint64_t id;
  grant_backend backend;
  void* ptr;                                 // host pointer, or device pointer for CUDA
  uint64_t bytes;
  std::optional<uint64_t> revoke_deadline_ns;  // set while the trainer asks it back
  // CUDA backends: this process's ordinal of the GPU the grant is mapped on (cudaSetDevice
  // takes it; it differs from the trainer's where CUDA_VISIBLE_DEVICES does); -1 for host.
  int device = -1;

  bool revoking() const noexcept { return revoke_deadline_ns.has_value(); }
  template <typename T = std::byte>
  T* host_data() const {
    return detail::host_pointer<T>(backend, reinterpret_cast<uintptr_t>(ptr), "the grant");
  }
#ifdef BUBBLE_HPP_SPAN
  std::span<std::byte> host_bytes() const { return {host_data(), static_cast<size_t>(bytes)}; }
#endif
};

enum class step_result { more, done };
// How task::run ended when nothing failed.
enum class outcome { finished, stopped, trainer_gone };

// The iterative interface: derive and override step (and any of the others). An exception
// thrown from any of them ends the run, and task::run rethrows it. idle is called about every
// 100 ms while the task waits for a bubble (never inside one): done from it ends the run as
// finished, the place to notice a shutdown asked of the task.
class side_task {
 public:
  virtual ~side_task() = default;
  virtual void init() {}
  virtual step_result step(const step_info& info) = 0;
  virtual void pause() {}
  virtual void resume() {}
  virtual void finish(status) {}
  virtual step_result idle() { return step_result::more; }
};

#ifdef BUBBLE_HPP_CONCEPTS
// Anything with step(const step_info&) -> step_result can run without deriving from side_task;
// init/pause/resume/finish/idle are called when present.
template <typename T>
concept side_task_like = requires(T& t, const step_info& i) {
  { t.step(i) } -> std::same_as<step_result>;
};
#endif

class task {
 public:
  task(const std::string& job_id, uint32_t rank, const std::string& name,
       const task_options& o = {}) {
    bb_task_options_t opts;
    bb_task_options_init(&opts);
    opts.priority = o.priority;
    opts.mem_need = o.mem_need;
    opts.min_step_ns = detail::to_ns(o.min_step);
    opts.on_trainer_exit = static_cast<uint32_t>(o.trainer_exit);
    opts.reattach_timeout_ns = detail::to_ns(o.reattach_timeout);
    opts.spin_ns = detail::to_ns(o.spin);
    opts.runtime_dir =
        o.runtime_dir.empty() ? nullptr : detail::c_string("runtime dir", o.runtime_dir, "a path");
    opts.wake_mode = static_cast<uint32_t>(o.wake);
    opts.wake_lead_ns = detail::to_ns(o.wake_lead);
    const char* job = detail::c_string("job id", job_id);
    const char* cname = detail::c_string("task name", name);
    bb_task_h h = nullptr;
    detail::check(bb_task_attach(job, rank, cname, &opts, &h));
    h_ = handle(h);
  }
  // A task may be moved, and destroyed, even from a side_task method inside its own run():
  // the run goes on with the handle, and detaches it as it returns if no task owns it then.
  task(task&& o) noexcept : h_(std::move(o.h_)), run_(std::exchange(o.run_, nullptr)) {
    if (run_) run_->owner = this;
  }
  task& operator=(task&& o) noexcept {
    if (this != &o) {
      give_up();
      h_ = std::move(o.h_);
      run_ = std::exchange(o.run_, nullptr);
      if (run_) run_->owner = this;
    }
    return *this;
  }
  ~task() { give_up(); }

  // Iterative: the runtime drives t until it is done, stopped or the trainer leaves.
  outcome run(side_task& t) { return run_with(t); }
#ifdef BUBBLE_HPP_CONCEPTS
  template <side_task_like T>
    requires(!std::derived_from<T, side_task>)
  outcome run(T& t) { return run_with(t); }
#endif

  // Imperative: waits for the next start; empty after the timeout (none = wait forever).
  // Throws with E_STOPPED when told to stop and E_TRAINER_GONE when the trainer left.
  std::optional<start_info> wait_start(std::optional<std::chrono::nanoseconds> timeout = {}) {
    bb_start_info_t info{};
    info.size = sizeof info;
    int64_t t = timeout ? (timeout->count() < 0 ? 0 : timeout->count()) : -1;
    bb_status s = bb_task_wait_start(h_.get(), t, &info);
    if (s == BB_E_TIMEOUT) return std::nullopt;
    detail::check(s);
    return info;
  }
  // One load from shared memory; true once the bubble ended or a stop was asked.
  bool should_pause() { return bb_task_should_pause(h_.get()) != 0; }
  void ack_pause() { detail::check(bb_task_ack_pause(h_.get())); }
  void report_step(std::chrono::nanoseconds d) {
    detail::check(bb_task_report_step(h_.get(), detail::to_ns(d)));
  }
  struct time_budget {
    std::optional<uint64_t> left_ns;  // empty when the trainer gave no deadline
    uint64_t est_step_ns;             // 0 before the first step
  };
  time_budget time_left() {
    uint64_t left = 0, est = 0;
    detail::check(bb_task_time_left(h_.get(), &left, &est));
    return {left == UINT64_MAX ? std::nullopt : std::optional<uint64_t>(left), est};
  }

  // The grant this task maps now (mapping one just offered); empty when it holds none.
  // Throws E_UNSUPPORTED (once) for a CUDA grant in a process without a CUDA driver.
  std::optional<task_grant> grant() {
    bb_task_grant_t g{};
    g.size = sizeof g;
    bb_status s = bb_task_grant(h_.get(), &g);
    if (s == BB_E_NOT_FOUND) return std::nullopt;
    detail::check(s);
    return task_grant{g.id, static_cast<grant_backend>(g.backend), g.ptr, g.bytes,
                      g.revoke_deadline_ns ? std::optional<uint64_t>(g.revoke_deadline_ns)
                                           : std::nullopt,
                      g.device};
  }
  // If the trainer is revoking the grant: unmaps it and acks. Stop all use of it first.
  void ack_revoke() { detail::check(bb_task_ack_revoke(h_.get())); }

  // Acks any pending pause and releases the slot now (the destructor does it silently). From a
  // side_task method inside run() it is done as run() returns: the run still uses the handle.
  void detach() {
    if (run_)
      run_->detach_after = true;
    else
      h_.close();
  }
  bb_task_h native_handle() const { return h_.get(); }

 private:
  template <typename T>
  struct bridge {
    T& task;
    std::exception_ptr failure;

    // Runs one method, unless an earlier one threw (the runtime is then ending the run; only
    // finish is still called, with always set, so its cleanup runs). Exceptions must not unwind
    // through C frames: the first is carried across and rethrown in run().
    template <typename F>
    static int guarded(void* user, F&& f, bool always = false) noexcept {
      auto* self = static_cast<bridge*>(user);
      if (self->failure && !always) return -1;
      try {
        return f(self->task);
      } catch (...) {
        if (!self->failure) self->failure = std::current_exception();
        return -1;
      }
    }
    static int init(void* u) noexcept {
      return guarded(u, [](T& t) {
        if constexpr (requires_init) t.init();
        return 0;
      });
    }
    static int step(void* u, const bb_step_info_t* i) noexcept {
      return guarded(u, [i](T& t) {
        return t.step(*i) == step_result::done ? BB_STEP_DONE : BB_STEP_CONTINUE;
      });
    }
    static int pause(void* u) noexcept {
      return guarded(u, [](T& t) {
        if constexpr (requires_pause) t.pause();
        return 0;
      });
    }
    static int resume(void* u) noexcept {
      return guarded(u, [](T& t) {
        if constexpr (requires_resume) t.resume();
        return 0;
      });
    }
    static int idle(void* u) noexcept {
      return guarded(u, [](T& t) {
        if constexpr (requires_idle)
          return t.idle() == step_result::done ? BB_STEP_DONE : BB_STEP_CONTINUE;
        return BB_STEP_CONTINUE;
      });
    }
    static void finish(void* u, bb_status s) noexcept {
      (void)guarded(
          u,
          [s](T& t) {
            if constexpr (requires_finish) t.finish(static_cast<status>(s));
            return 0;
          },
          true);
    }

    template <typename U, typename = void>
    struct has_init : std::false_type {};
    template <typename U>
    struct has_init<U, std::void_t<decltype(std::declval<U&>().init())>> : std::true_type {};
    template <typename U, typename = void>
    struct has_pause : std::false_type {};
    template <typename U>
    struct has_pause<U, std::void_t<decltype(std::declval<U&>().pause())>> : std::true_type {};
    template <typename U, typename = void>
    struct has_resume : std::false_type {};
    template <typename U>
    struct has_resume<U, std::void_t<decltype(std::declval<U&>().resume())>> : std::true_type {};
    template <typename U, typename = void>
    struct has_finish : std::false_type {};
    template <typename U>
    struct has_finish<U, std::void_t<decltype(std::declval<U&>().finish(status::OK))>>
        : std::true_type {};
    template <typename U, typename = void>
    struct has_idle : std::false_type {};
    template <typename U>
    struct has_idle<U, std::void_t<decltype(std::declval<U&>().idle())>>
        : std::is_same<decltype(std::declval<U&>().idle()), step_result> {};
    static constexpr bool requires_init = has_init<T>::value;
    static constexpr bool requires_idle = has_idle<T>::value;
    static constexpr bool requires_pause = has_pause<T>::value;
    static constexpr bool requires_resume = has_resume<T>::value;
    static constexpr bool requires_finish = has_finish<T>::value;
  };

  template <typename T>
  outcome run_with(T& t) {
    using B = bridge<T>;
    B b{t, nullptr};
    bb_task_callbacks_t cbs;
    bb_task_callbacks_init(&cbs);
    cbs.user = &b;
    cbs.init = &B::init;
    cbs.step = &B::step;
    cbs.pause = &B::pause;
    cbs.resume = &B::resume;
    cbs.finish = &B::finish;
    if constexpr (B::requires_idle) cbs.idle = &B::idle;  // without it the runtime just waits
    if (run_)
      throw error(status::E_STATE,
                  "run() called from inside this task's own run(): return from the callback "
                  "instead (its step is called again)");
    // A detach() asked for by a method is done on the way out, after the outcome (and any
    // error sentence) was taken. The scope lives on this stack, not in the task, which a
    // method may move or destroy meanwhile.
    struct run_scope {
      run_frame f;
      ~run_scope() {
        if (f.owner) {
          f.owner->run_ = nullptr;
          if (f.detach_after) (void)bb_task_detach(f.owner->h_.release());
        }
        if (f.orphan) (void)bb_task_detach(f.orphan);
      }
    } scope{{this, nullptr, false}};
    bb_task_h h = h_.get();
    run_ = &scope.f;
    bb_status s = bb_task_run(h, &cbs);
    if (b.failure) std::rethrow_exception(b.failure);
    switch (s) {
      case BB_OK: return outcome::finished;
      case BB_E_STOPPED: return outcome::stopped;
      case BB_E_TRAINER_GONE: return outcome::trainer_gone;
      default: detail::throw_status(s);
    }
  }

  // The run in progress, on run()'s stack: who owns the task now (a method may move or destroy
  // it), and what to detach when the run returns.
  struct run_frame {
    task* owner;         // the task object holding the handle; null once destroyed
    bb_task_h orphan;    // the handle, once no task object holds it
    bool detach_after;   // detach() was called inside the run
  };
  // Inside a run, the handle goes to the run, which detaches it as it returns; otherwise now.
  void give_up() noexcept {
    if (run_) {
      if (bb_task_h h = h_.release()) run_->orphan = h;
      run_->owner = nullptr;
      run_ = nullptr;
    }
    h_ = handle();
  }

  using handle = detail::unique_handle<bb_task_h, bb_task_detach>;
  handle h_;
  run_frame* run_ = nullptr;  // the run this task is inside, if any
};

}  // namespace bubble
