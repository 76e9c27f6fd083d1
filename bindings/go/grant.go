package bubble

/*
#include <stdint.h>
#include <bubble/bubble.h>
// The trainer's address of a grant, as a pointer (the conversion lives in C so Go never turns
// an integer into an unsafe.Pointer).
static inline void *bubble_go_addr(uint64_t address) { return (void *)(uintptr_t)address; }
*/
import "C"

import (
	"errors"
	"runtime"
	"time"
	"unsafe"
)

// GrantBackend says where lent memory lives and how a grant reaches its task.
type GrantBackend uint32

const (
	GrantHost    GrantBackend = C.BB_GRANT_HOST     // shared host memory: CPU tasks, no GPU needed
	GrantCudaIPC GrantBackend = C.BB_GRANT_CUDA_IPC // a window of one device allocation
	GrantCudaVMM GrantBackend = C.BB_GRANT_CUDA_VMM // a cuMemCreate allocation per grant
)

// GrantState is where a grant is in its life.
type GrantState uint32

const (
	GrantNone        GrantState = C.BB_GRANT_STATE_NONE
	GrantActive      GrantState = C.BB_GRANT_STATE_ACTIVE
	GrantRevoking    GrantState = C.BB_GRANT_STATE_REVOKING    // asked back, not acked yet
	GrantQuarantined GrantState = C.BB_GRANT_STATE_QUARANTINED // giving it back failed; never reused
)

// LendOptions says what Trainer.Lend lends; zero fields mean the library's defaults, and Bytes
// is required.
type LendOptions struct {
	Backend     GrantBackend // 0: GrantHost
	Bytes       uint64       // size of the lent range
	DevicePtr   uint64       // cuda-ipc: lend this range of your own allocation; 0: allocate it
	Device      int32        // CUDA device ordinal
	MaxGrants   uint32       // 0: 64
	Alignment   uint64       // grant unit, a power of two; 0: the backend's own
	NoAutoGrant bool         // do not grant tasks their MemNeed when they attach
	// Do not zero CUDA grants before a task gets them: only when every task has one owner,
	// since a task then sees what the previous holder left.
	NoClearGrants bool
}

// GrantInfo is a task's grant as the trainer sees it.
type GrantInfo struct {
	ID, TaskID uint64
	State      GrantState
	Backend    GrantBackend
	Mapped     bool     // the task says it maps the grant (its word: informative only)
	Bytes      uint64   // what was granted
	Offset     uint64   // where the grant sits in the lent range
	Address    uint64   // the trainer's own address: host pointer, or CUdeviceptr for CUDA
	DeadlineNs uint64   // while revoking: when the task will be killed
	owner      *Trainer // kept open while this is reachable (its finalizer would close the hub)
}

// HostMemory is the trainer's view of a host grant (nil for device memory). It holds the
// task's data while the grant is active or revoking; released (the task may leave at any
// moment) the range reads zeros, and a later grant there is another task's. After Unlend or
// Close the lent range is unmapped and touching it faults. The slice alone does not keep the Trainer open:
// keep the GrantInfo (or the Trainer) reachable while using it.
func (g *GrantInfo) HostMemory() []byte {
	if g == nil || g.Backend != GrantHost || g.Address == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(C.bubble_go_addr(C.uint64_t(g.Address))), int(g.Bytes))
}

// GrantStats are the lender's exact byte counts and the revoke protocol's counters.
type GrantStats struct {
	Backend                                GrantBackend // 0 before Lend
	Capacity, GrantedBytes, RequestedBytes uint64
	FreeBytes, LargestFree                 uint64
	RevokingBytes, QuarantinedBytes        uint64
	Active, Revoking, Quarantined          uint32
	GrantsMade, GrantsFailed               uint64
	Revokes, RevokesAcked, TasksKilled     uint64
	ReleasedDead                           uint64
}

// TaskGrant is the grant a task maps. Its memory stays mapped until the task's next WaitStart,
// AckPause, AckRevoke or Close (for a step's grant: until the step returns); Grant only maps.
type TaskGrant struct {
	ID      uint64
	Backend GrantBackend
	Ptr     unsafe.Pointer // host memory, or a device pointer for the CUDA backends
	Bytes   uint64
	// RevokeDeadlineNs is nonzero while the trainer asks the grant back: stop using it and call
	// AckRevoke (or AckPause) before then. Set by Task.Grant only.
	RevokeDeadlineNs uint64
	// Device is, for the CUDA backends, this process's ordinal of the GPU the grant is mapped on
	// (the trainer's GPU found by UUID, so it differs from the trainer's ordinal where
	// CUDA_VISIBLE_DEVICES does): device work on Ptr belongs there. -1 for host memory, and
	// when not known (a grant of a start or step whose mapping the task could not look up).
	Device int
	// The task that maps it: a grant kept keeps its task attached (the Task's finalizer would
	// detach it and unmap the memory).
	owner *Task
}

// Revoking is true while the trainer asks the grant back.
func (g *TaskGrant) Revoking() bool { return g != nil && g.RevokeDeadlineNs != 0 }

// Memory is the grant's host memory (nil for device memory), valid as long as the grant is.
// The slice alone does not keep the task attached: keep the TaskGrant (or the Task) reachable
// while using it (runtime.KeepAlive).
func (g *TaskGrant) Memory() []byte {
	if g == nil || g.Backend != GrantHost || g.Ptr == nil {
		return nil
	}
	return unsafe.Slice((*byte)(g.Ptr), int(g.Bytes))
}

// Lend lends memory to the hub's tasks; one lent range at a time (ErrBusy while one is lent:
// Unlend first to lend differently). ErrUnsupported for a CUDA backend without a usable CUDA
// driver.
func (t *Trainer) Lend(opts LendOptions) error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	var o C.bb_lend_options_t
	C.bb_lend_options_init_sized(&o, C.sizeof_bb_lend_options_t)
	if opts.Backend != 0 {
		o.backend = C.uint32_t(opts.Backend)
	}
	o.bytes = C.uint64_t(opts.Bytes)
	o.device_ptr = C.uint64_t(opts.DevicePtr)
	o.device = C.int32_t(opts.Device)
	if opts.MaxGrants != 0 {
		o.max_grants = C.uint32_t(opts.MaxGrants)
	}
	o.alignment = C.uint64_t(opts.Alignment)
	if opts.NoAutoGrant {
		o.auto_grant = 0
	}
	if opts.NoClearGrants {
		o.clear_grants = 0
	}
	err = call(func() C.bb_status { return C.bb_trainer_lend(h, &o) })
	runtime.KeepAlive(t)
	return err
}

// Unlend takes every grant back and gives the lent memory back, so that Lend may lend again. A
// holder that has not given its grant back within grace (0: 1 s) is killed. It blocks until
// then, at most grace + 2 s, so call it where the trainer can wait or from another goroutine.
// ErrState when nothing is lent, ErrTimeout when a holder the kill cannot reach keeps the memory
// lent.
func (t *Trainer) Unlend(grace time.Duration) error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	err = call(func() C.bb_status { return C.bb_trainer_unlend(h, graceDeadline(grace)) })
	runtime.KeepAlive(t)
	return err
}

// Grant grants bytes (0: the task's MemNeed) of the lent memory to a task holding none and
// returns the grant's id. ErrNoMemory when no free extent is large enough, ErrBusy when the
// task already holds a grant.
func (t *Trainer) Grant(taskID, bytes uint64) (uint64, error) {
	h, done, err := t.acquire()
	if err != nil {
		return 0, err
	}
	defer done()
	var id C.uint64_t
	err = call(func() C.bb_status { return C.bb_trainer_grant(h, C.uint64_t(taskID), C.uint64_t(bytes), &id) })
	runtime.KeepAlive(t)
	return uint64(id), err
}

// Revoke asks a task's grant back; a task that has not acked within grace (0: 1 s) is killed.
// It returns at once: TaskGrant and GrantStats show the progress.
func (t *Trainer) Revoke(taskID uint64, grace time.Duration) error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	err = call(func() C.bb_status { return C.bb_trainer_revoke(h, C.uint64_t(taskID), graceDeadline(grace)) })
	runtime.KeepAlive(t)
	return err
}

// TaskGrant returns a task's grant, nil when it holds none; ErrNotFound when no such task is
// attached.
func (t *Trainer) TaskGrant(taskID uint64) (*GrantInfo, error) {
	h, done, err := t.acquire()
	if err != nil {
		return nil, err
	}
	defer done()
	var g C.bb_grant_info_t
	g.size = C.uint32_t(unsafe.Sizeof(g))
	err = call(func() C.bb_status { return C.bb_trainer_task_grant(h, C.uint64_t(taskID), &g) })
	runtime.KeepAlive(t)
	if err != nil || g.state == C.BB_GRANT_STATE_NONE {
		return nil, err
	}
	return &GrantInfo{ID: uint64(g.id), TaskID: uint64(g.task_id), State: GrantState(g.state),
		Backend: GrantBackend(g.backend), Mapped: g.mapped != 0, Bytes: uint64(g.bytes),
		Offset: uint64(g.offset), Address: uint64(g.address), DeadlineNs: uint64(g.deadline_ns),
		owner: t}, nil
}

// ReadGrant copies len(dst) bytes of grant grantID, from offset into it, to dst: the safe way to
// read what a task wrote. The task may leave or die at any moment, which releases the grant, but
// never during the copy (the release waits for it). ErrNotFound once the grant is no longer live,
// ErrInvalid when the range is not inside the grant's bytes. The hub's grants and releases wait
// for the copy: copy what you need.
func (t *Trainer) ReadGrant(grantID, offset uint64, dst []byte) error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	var none byte
	p := unsafe.Pointer(&none) // C refuses NULL; an empty copy still checks the grant is live
	if len(dst) > 0 {
		p = unsafe.Pointer(&dst[0])
	}
	err = call(func() C.bb_status {
		return C.bb_trainer_read_grant(h, C.uint64_t(grantID), C.uint64_t(offset), p, C.uint64_t(len(dst)))
	})
	runtime.KeepAlive(t)
	runtime.KeepAlive(dst)
	return err
}

// GrantStats returns the lender's counts.
func (t *Trainer) GrantStats() (GrantStats, error) {
	h, done, err := t.acquire()
	if err != nil {
		return GrantStats{}, err
	}
	defer done()
	var s C.bb_grant_stats_t
	s.size = C.uint32_t(unsafe.Sizeof(s))
	err = call(func() C.bb_status { return C.bb_trainer_grant_stats(h, &s) })
	runtime.KeepAlive(t)
	if err != nil {
		return GrantStats{}, err
	}
	return GrantStats{Backend: GrantBackend(s.backend), Capacity: uint64(s.capacity),
		GrantedBytes: uint64(s.granted_bytes), RequestedBytes: uint64(s.requested_bytes),
		FreeBytes: uint64(s.free_bytes), LargestFree: uint64(s.largest_free),
		RevokingBytes: uint64(s.revoking_bytes), QuarantinedBytes: uint64(s.quarantined_bytes),
		Active: uint32(s.active), Revoking: uint32(s.revoking), Quarantined: uint32(s.quarantined),
		GrantsMade: uint64(s.grants_made), GrantsFailed: uint64(s.grants_failed),
		Revokes: uint64(s.revokes), RevokesAcked: uint64(s.revokes_acked),
		TasksKilled: uint64(s.tasks_killed), ReleasedDead: uint64(s.released_dead)}, nil
}

// Grant returns the grant this task maps now (mapping one just offered), nil when it holds
// none. ErrUnsupported (once) for a CUDA grant in a process without a CUDA driver; that grant
// goes back to the trainer.
func (t *Task) Grant() (*TaskGrant, error) {
	h, err := t.handle()
	if err != nil {
		return nil, err
	}
	g, err := taskGrant(h, t)
	runtime.KeepAlive(t)
	return g, err
}

func taskGrant(h C.bb_task_h, owner *Task) (*TaskGrant, error) {
	var g C.bb_task_grant_t
	g.size = C.uint32_t(unsafe.Sizeof(g))
	err := call(func() C.bb_status { return C.bb_task_grant(h, &g) })
	if errors.Is(err, ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &TaskGrant{ID: uint64(g.id), Backend: GrantBackend(g.backend), Ptr: g.ptr,
		Bytes: uint64(g.bytes), RevokeDeadlineNs: uint64(g.revoke_deadline_ns),
		Device: int(g.device), owner: owner}, nil
}

// AckRevoke, if the trainer is revoking this task's grant, unmaps it and acks; otherwise it
// does nothing. Stop all use of the grant (device work included) first.
func (t *Task) AckRevoke() error {
	h, err := t.handle()
	if err != nil {
		return err
	}
	err = call(func() C.bb_status { return C.bb_task_ack_revoke(h) })
	runtime.KeepAlive(t)
	return err
}

// grantOf describes the grant a start or step names. The infos carry neither its backend nor its
// device; a
// bb_task_grant on the task's own thread right after the start, or between the runtime's steps,
// reports that same mapping (it maps, never unmaps). known caches the last answer.
func grantOf(h C.bb_task_h, owner *Task, id C.uint64_t, ptr unsafe.Pointer, bytes C.uint64_t, known **TaskGrant) *TaskGrant {
	if id == 0 || ptr == nil {
		return nil
	}
	g := &TaskGrant{ID: uint64(id), Ptr: ptr, Bytes: uint64(bytes), Device: -1, owner: owner}
	if *known == nil || (*known).ID != g.ID || (*known).Ptr != ptr {
		// Cached without its owner: the Task holds the cache, and a Task that reaches itself
		// would never be finalized.
		if k, err := taskGrant(h, nil); err == nil && k != nil && k.ID == g.ID && k.Ptr == ptr {
			*known = k
		}
	}
	if *known != nil && (*known).ID == g.ID && (*known).Ptr == ptr {
		g.Backend = (*known).Backend
		g.Device = (*known).Device
	}
	return g
}

// graceDeadline is the deadline grace from now, or 0 (the library's default) for no grace.
func graceDeadline(grace time.Duration) C.uint64_t {
	if grace <= 0 {
		return 0
	}
	return C.uint64_t(NowNs()) + durationNs(grace)
}
