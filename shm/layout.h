// The hub: the shared-memory layout that is the contract between a trainer, its side tasks and
// observers. Everything here crosses process (and libbubble version) boundaries, so:
//   - offsets, never pointers; fixed-width integers; every atomic is always lock-free;
//   - a header (magic, layout version, sizes) lets a reader reject what it does not understand;
//   - the hub segment is written by the trainer process only and is mapped read-only into tasks
//     (a memfd sealed with F_SEAL_FUTURE_WRITE, so it cannot be remapped writable);
//   - each task writes only its own TaskPage, a separate memfd the trainer validates on every
//     read (and hands to observers of its own uid only: its descriptor can write). The trainer
//     writes one word of it, TaskPage::wake, the futex a sleeping task waits on: a word in the
//     hub would be one every holder of the hub can wait on, and take the task's wakes.
// Bump kLayoutVersion on any change to these structs.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "shm/ring.h"

namespace bb::shm {

constexpr uint64_t kHubMagic = 0x3142554842425542ull;   // "BUBBHUB1" little-endian
constexpr uint64_t kPageMagic = 0x3147415042425542ull;  // "BUBBPAG1"
// 2: the event log became one stream per writer; the slot's first line became its signal line.
// 4: the command ring is gone (the signal line carries every start and pause).
// 5: HubStats::alive, the trainer's life readable with one load.
// 6: SlotCtl::signal_generation, the slot's attach on its signal line.
// 7: GrantRecord::device_uuid.
// 8: TaskPage::wake, the futex word of a sleeping task (it was the slot's doorbell, in the hub).
constexpr uint32_t kLayoutVersion = 8;
constexpr size_t kCacheLine = 64;
constexpr size_t kNameBytes = 48;  // BB_NAME_MAX + NUL
constexpr uint32_t kReportRingSize = 64;

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct HubHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t header_size;
  uint64_t layout_size;      // bytes of the whole segment
  uint32_t max_slots;
  uint32_t event_capacity;   // entries per event stream, power of two
  uint32_t slot_ctl_size;
  uint32_t event_size;
  uint64_t bubble_offset;
  uint64_t stats_offset;
  uint64_t slots_offset;
  uint64_t events_offset;
  int32_t creator_pid;
  uint32_t creator_uid;
  uint64_t created_ns;
  uint32_t rank;
  uint32_t task_page_size;
  char job[kNameBytes];
};

// Bubble state, written by the trainer thread only. Readers that need a consistent view
// (observers) use `version` as a seqlock: odd while the trainer writes.
struct alignas(kCacheLine) BubbleState {
  std::atomic<uint64_t> version;
  std::atomic<uint64_t> seq;          // bubbles begun so far; the open one's number while open
  std::atomic<uint32_t> open;
  std::atomic<uint32_t> kind;
  std::atomic<uint64_t> begin_ns;
  std::atomic<uint64_t> end_ns;       // of the last closed bubble
  std::atomic<uint64_t> deadline_ns;  // 0 = unknown
  std::atomic<uint64_t> free_mem;
  std::atomic<uint64_t> bubbles;      // closed bubbles
  std::atomic<uint64_t> bubble_ns;    // their summed length
  // When the trainer expects the next bubble to begin (0 = no prediction yet): waiting tasks
  // sleep until shortly before it and spin from there (predictive wake).
  std::atomic<uint64_t> next_begin_ns;
};

// Hub-wide counters kept by the trainer's hub service (drained from task reports).
struct alignas(kCacheLine) HubStats {
  std::atomic<uint64_t> starts;
  std::atomic<uint64_t> pauses;
  std::atomic<uint64_t> steps;
  std::atomic<uint64_t> ns_in_bubbles;
  std::atomic<uint64_t> ns_outside;
  std::atomic<uint64_t> reclaimed;
  std::atomic<uint64_t> bad;
  std::atomic<uint64_t> dropped;
  std::atomic<uint64_t> wakes;
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> closing;      // the trainer is closing the hub
  // Whether the trainer process lives, for a running task that only polls should_pause: a
  // process-shared robust mutex that the hub service thread holds from before it accepts any
  // task until the hub closes. When the trainer dies (killed, crashed, exec'd), the kernel
  // marks the mutex's futex word with FUTEX_OWNER_DIED; a task reads the word (one load, no
  // system call) and learns that nobody will end its bubble. Only the word is part of this
  // contract, not the libc's mutex around it: `alive_word` is its byte offset in `alive_mutex`
  // (4-aligned), or kNoAliveWord where the trainer's libc lays the mutex out in a way the
  // library does not know (tasks then notice a dead trainer from their connection, within
  // 100 ms of a call that looks).
  alignas(kCacheLine) unsigned char alive_mutex[48];
  std::atomic<uint32_t> alive_word;
};
constexpr uint32_t kNoAliveWord = UINT32_MAX;
// The kernel's robust-futex word: the holder's thread id in the low 30 bits, and this bit once
// the holder died without unlocking (linux/futex.h).
constexpr uint32_t kFutexOwnerDied = 0x40000000u;

enum class ReportType : uint32_t {
  kNone = 0, kStarted = 1, kPaused = 2, kStep = 3, kFinished = 4, kFailed = 5
};

struct Report {
  uint16_t type;       // ReportType
  uint16_t count;      // kStep: steps merged into this report (>= 1) when the ring was full
  uint32_t epoch;
  uint64_t ts_ns;
  uint64_t a;          // kStarted: start latency; kPaused: pause latency; kStep: duration
  uint64_t b;          // kStep: part of the duration past the bubble's end
};
static_assert(sizeof(Report) == 32);

// A memory grant as it crosses to the task: the fields of core::Grant (core/grant.h) without
// the exporter's descriptor. The task validates it (core::validate_grant) before mapping.
struct GrantRecord {
  uint64_t id;
  uint64_t offset;      // in the trainer's lent range
  uint64_t size;        // bytes the task may use
  uint32_t backend;     // core::GrantBackend
  int32_t device;       // the trainer's CUDA device ordinal, -1 for host
  uint64_t map_offset;  // where the grant starts inside what the handle names
  uint64_t map_size;    // bytes to map
  uint8_t ipc[64];      // cuda-ipc: the CUipcMemHandle
  uint8_t device_uuid[16];  // CUDA backends: the GPU's UUID, which every process names alike
};
static_assert(sizeof(GrantRecord) == 128);

enum class SlotState : uint32_t { kFree = 0, kActive = 1, kDead = 2 };

// One task slot as the trainer process writes it (read-only to the task).
struct alignas(kCacheLine) SlotCtl {
  // The signal line, read by the task on every wait and should_pause. A start is complete on
  // this one cache line: the bubble thread fills the start block, then run_epoch, then rings the
  // doorbell, so a waiting task learns all of its start from the line it already watches, and a
  // running one its pause (run_epoch). The trainer rewrites the block only after the task acked
  // the start it describes, so it is stable while the task reads it.
  std::atomic<uint32_t> doorbell;      // bumped after every start, pause and stop
  std::atomic<uint32_t> run_epoch;     // nonzero while the task may run; the task compares
  std::atomic<uint32_t> given_epoch;   // the epoch of the last start: the block describes it
  std::atomic<uint32_t> start_kind;    // bb_bubble_kind
  std::atomic<uint64_t> start_seq;     // the bubble's number
  std::atomic<uint64_t> start_begin_ns;
  std::atomic<uint64_t> start_deadline_ns;  // 0 = unknown
  std::atomic<uint64_t> start_free_mem;
  std::atomic<uint64_t> start_grant_id;     // the grant to use in this bubble, 0 = none
  // Bumped by the hub service after every change of the grant words below (a grant offered, a
  // revoke asked, a grant taken back). A task holding a grant compares it in should_pause, so it
  // sits on the line the task reads anyway; it changes rarely.
  std::atomic<uint32_t> grant_change;
  // The attach this slot serves (= generation), where a waiting task reads it with its start:
  // a task the trainer dropped (and whose slot went to another) takes no start of the next.
  std::atomic<uint32_t> signal_generation;
  // Slot control, read when the task acks, attaches or stops.
  alignas(kCacheLine) std::atomic<uint32_t> stop;  // 1: finish and detach
  std::atomic<uint32_t> state;       // SlotState
  std::atomic<uint32_t> generation;  // bumped on every attach to this slot
  std::atomic<uint32_t> paused_epoch;  // the epoch pause_requested_ns belongs to
  std::atomic<uint32_t> bad;         // its page failed validation: never started again
  uint32_t reserved1;
  std::atomic<uint64_t> report_head; // consumer index of the task's report ring
  std::atomic<uint64_t> pause_requested_ns;
  std::atomic<uint64_t> started_ns;  // when the trainer last started it
  // Identity, written before state becomes kActive.
  int32_t pid;
  int32_t priority;
  uint64_t mem_need;
  uint64_t min_step_ns;
  char name[kNameBytes];
  // Per-task totals kept by the hub service from validated reports.
  std::atomic<uint64_t> steps;
  std::atomic<uint64_t> step_ns;
  std::atomic<uint64_t> ns_in_bubbles;
  std::atomic<uint64_t> ns_outside;
  // Memory grant, written by the hub service thread only (never the bubble thread). The
  // record is a seqlock: grant_seq is odd while the service writes it. For fd backends the
  // descriptor reaches the task over its connection (GrantFdMsg) before grant_id names it.
  alignas(kCacheLine) std::atomic<uint32_t> grant_seq;
  uint32_t reserved2;
  std::atomic<uint64_t> grant_id;            // the grant the task may map, 0 = none
  std::atomic<uint64_t> revoke_id;           // the grant the task must unmap and ack, 0 = none
  std::atomic<uint64_t> revoke_deadline_ns;  // after it the task is killed
  GrantRecord grant;                         // what grant_id names
};
static_assert(offsetof(SlotCtl, stop) == kCacheLine, "the signal line is one cache line");

// After copying an active slot's identity (pid, name, priority: plain words its next task's
// attach rewrites), whether the slot still serves the attach `generation` read (acquire) before
// the copy: if not, the copy may mix two tasks. An attach writes the identity, then the
// generation, then kActive, so a copy that saw any of the next task's identity finds the slot
// not active, or another generation. The fence keeps the copy's loads before the checks, as a
// seqlock's reader does.
inline bool slot_still(const SlotCtl* c, uint32_t generation) {
  std::atomic_thread_fence(std::memory_order_acquire);
  return c->state.load(std::memory_order_acquire) == uint32_t(SlotState::kActive) &&
         c->generation.load(std::memory_order_relaxed) == generation;
}

enum class TaskRunState : uint32_t { kIdle = 0, kRunning = 1, kFinished = 2, kFailed = 3 };

// The page a task writes. Nothing in it is trusted by the trainer.
//
// The words the bubble thread reads sit on lines of their own, apart from the ones the task
// writes when it starts: a line the task has just written costs the trainer a cache miss to
// read, and the trainer reads the ack line when it picks tasks and when a bubble ends, and the
// sleep line after every signal. So a task that starts and runs (or spins) leaves both in the
// trainer's cache; only its ack moves the ack line.
struct alignas(kCacheLine) TaskPage {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t slot;
  // The ack line: written when the task acks a run.
  alignas(kCacheLine) std::atomic<uint32_t> acked_epoch;   // last run epoch it acked a pause for
  // The sleep line: written only around a futex wait.
  alignas(kCacheLine) std::atomic<uint32_t> sleeping;      // 1 while in (or entering) futex wait
  // The futex word a sleeping task waits on; the one word of the page the trainer writes: bumped
  // (release) before each wake, after the doorbell. The task reads it (acquire) before it says
  // it sleeps, so a bump it did not see makes its wait return at once. Only the task, its
  // trainer and observers of the trainer's uid map the page, so a mere holder of the hub (a task
  // of another uid) cannot wait here and take the task's wakes, as it could on the doorbell.
  std::atomic<uint32_t> wake;
  // Status for observers, written at every start and ack; off the bubble thread's path.
  alignas(kCacheLine) std::atomic<uint32_t> state;         // TaskRunState
  std::atomic<uint32_t> started_epoch;
  std::atomic<uint64_t> ack_ns;
  std::atomic<uint64_t> dropped;                           // reports lost to a full ring
  // Report channel: the task produces, the trainer's hub service consumes (SlotCtl::report_head).
  RingData<Report, kReportRingSize> reports;
  // Grants, as the task tells it. The trainer believes only an exact match with the id it
  // gave: grant_released == SlotCtl::grant_id means the task unmapped that grant for good.
  alignas(kCacheLine) std::atomic<uint64_t> grant_mapped;    // the grant mapped now, 0 = none
  std::atomic<uint64_t> grant_released;                      // the last grant let go of
};

enum class EventKind : uint16_t {
  kBubbleBegin = 1, kBubbleEnd = 2, kTaskStart = 3, kTaskPause = 4, kTaskStep = 5,
  kTaskAttach = 6, kTaskDetach = 7, kTaskFinish = 8,
  // Grants: a = grant id, b = bytes (kGrant), deadline (kRevoke), 1 if the holder was killed or
  // died (kGrantRelease); kTaskKill: a = pid, b = grant id whose revoke it ignored (0: other).
  kGrant = 9, kRevoke = 10, kGrantRelease = 11, kTaskKill = 12,
};

// The bounded event log: one ring per writing thread of the trainer process, read by observers.
// A single writer appends with plain stores, so the bubble thread never pays an atomic
// read-modify-write to log (two per bubble were a sixth of the path's cost). Observers merge
// the streams by timestamp (core::HubObserver::read_events).
enum class EventStream : uint32_t {
  kBubble = 0,   // the trainer's bubble thread: kBubbleBegin, kBubbleEnd
  kService = 1,  // the hub service thread: everything else
};
constexpr uint32_t kEventStreams = 2;

// `commit` is written last: event_commit(index). Readers check it before and after copying
// the entry, so one being rewritten a lap later is skipped rather than torn. The writer stores 0
// while it rewrites an entry, so no committed entry may carry 0: the value runs 1..2^32-1
// (index + 1 modulo 2^32 - 1), where index + 1's low 32 bits are 0 once every 2^32 entries.
inline uint32_t event_commit(uint64_t index) { return uint32_t(index % 0xffffffffu) + 1; }
struct alignas(32) EventEntry {
  std::atomic<uint32_t> commit;
  // Atomic (relaxed) because the writer may rewrite the entry while a reader copies it.
  std::atomic<uint16_t> kind;
  std::atomic<uint16_t> slot;
  std::atomic<uint64_t> ts_ns;
  std::atomic<uint64_t> a;
  std::atomic<uint64_t> b;
};
static_assert(sizeof(EventEntry) == 32);

struct alignas(kCacheLine) EventLog {
  std::atomic<uint64_t> next;  // index of the stream's next entry; stored by its writer only
};

// Where everything sits for a given slot count and event capacity.
struct HubGeometry {
  uint32_t max_slots;
  uint32_t event_capacity;
  // events_offset: kEventStreams EventLog headers, then each stream's event_capacity entries.
  uint64_t bubble_offset, stats_offset, slots_offset, events_offset, entries_offset;
  uint64_t layout_size;
};
HubGeometry hub_geometry(uint32_t max_slots, uint32_t event_capacity);

constexpr size_t kTaskPageSize = 4096;
static_assert(sizeof(TaskPage) <= kTaskPageSize);

// Typed views over a mapped hub (base must point at a validated hub).
struct HubView {
  unsigned char* base = nullptr;
  const HubHeader* header() const { return reinterpret_cast<const HubHeader*>(base); }
  HubHeader* header_rw() const { return reinterpret_cast<HubHeader*>(base); }
  BubbleState* bubble() const {
    return reinterpret_cast<BubbleState*>(base + header()->bubble_offset);
  }
  HubStats* stats() const { return reinterpret_cast<HubStats*>(base + header()->stats_offset); }
  SlotCtl* slot(uint32_t i) const {
    return reinterpret_cast<SlotCtl*>(base + header()->slots_offset) + i;
  }
  EventLog* events(EventStream s) const {
    return reinterpret_cast<EventLog*>(base + header()->events_offset) + uint32_t(s);
  }
  EventEntry* event_entries(EventStream s) const {
    return reinterpret_cast<EventEntry*>(base + header()->events_offset +
                                         kEventStreams * sizeof(EventLog)) +
           uint64_t(uint32_t(s)) * header()->event_capacity;
  }
};

// Writes a fresh header for the geometry (the rest of the segment must be zero).
void init_hub(unsigned char* base, const HubGeometry& g, const char* job, uint32_t rank);

// Checks a mapped hub of `mapped_size` bytes written by another process: magic, version, sizes
// and offsets all consistent and in bounds. On failure returns false and sets *error to a
// sentence naming the problem (and the fix for a version mismatch).
bool validate_hub(const unsigned char* base, uint64_t mapped_size, std::string* error);

// The writer of one event stream, held by the one thread that appends to it: where the ring
// lies and its next index, kept here so an append reads nothing of the hub (the shared `next`
// is stored, never read back). Bounded, plain stores, no read-modify-write.
struct EventWriter {
  EventLog* log = nullptr;
  EventEntry* entries = nullptr;
  uint64_t mask = 0;
  uint64_t next = 0;

  void attach(const HubView& hub, EventStream stream);
  void append(EventKind kind, uint16_t slot, uint64_t ts_ns, uint64_t a, uint64_t b);
};


}  // namespace bb::shm
