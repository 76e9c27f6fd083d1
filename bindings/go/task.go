package bubble

/*
#include <stdlib.h>
#include <stdint.h>
#include <bubble/bubble.h>
bb_status bubble_go_run(bb_task_h task, uintptr_t handle, int idle);
*/
import "C"

import (
	"errors"
	"runtime"
	"runtime/cgo"
	"time"
	"unsafe"
)

// OnTrainerExit says what a task does when its trainer goes away.
type OnTrainerExit uint32

const (
	ReturnOnTrainerExit OnTrainerExit = C.BB_ON_TRAINER_EXIT_RETURN // calls fail with ErrTrainerGone
	WaitOnTrainerExit   OnTrainerExit = C.BB_ON_TRAINER_EXIT_WAIT   // wait for the hub to reopen
)

// WakeMode says how a task waits for its next start.
type WakeMode uint32

const (
	WakePredictive WakeMode = C.BB_WAKE_PREDICTIVE // sleep, spin from WakeLead before the predicted bubble
	WakeSleep      WakeMode = C.BB_WAKE_SLEEP      // spin briefly, then sleep: least CPU
	WakeSpin       WakeMode = C.BB_WAKE_SPIN       // spin all the time: lowest latency, a whole core
)

// TaskOptions presents the task to the scheduler; the zero value means the library's defaults.
type TaskOptions struct {
	Priority        int32 // higher runs first
	MemNeed         uint64
	MinStep         time.Duration
	OnTrainerExit   OnTrainerExit
	ReattachTimeout time.Duration // 0: the default (60 s)
	Spin            time.Duration // 0: the default (20 µs)
	RuntimeDir      string
	WakeMode        WakeMode
	WakeLead        time.Duration // 0: the default (50 µs)
}

// StartInfo describes the bubble a task was started in.
type StartInfo struct {
	Kind       BubbleKind
	BubbleSeq  uint64
	BeginNs    uint64
	DeadlineNs uint64 // 0 if unknown
	FreeMem    uint64 // MemUnknown if unknown
	// Grant is the memory grant the task holds in this run (nil: none); Task.Grant tells
	// whether it is being revoked.
	Grant *TaskGrant
}

// StepInfo describes the bubble a step runs in.
type StepInfo struct {
	Kind       BubbleKind
	BubbleSeq  uint64
	DeadlineNs uint64         // 0 if unknown
	TimeLeft   *time.Duration // nil if unknown
	EstStep    time.Duration  // 0 before the first step
	FreeMem    uint64
	// Grant is the memory grant for this step (nil: none). A revoked grant is unmapped between
	// steps: take it from every step's info and do not keep it past the step.
	Grant *TaskGrant
}

// StepResult is what SideTask.Step says about the remaining work.
type StepResult int

const (
	Continue StepResult = iota
	Done
)

// Outcome is how Run ended when nothing failed.
type Outcome int

const (
	Finished    Outcome = iota // Step returned Done
	Stopped                    // the trainer (or agent) told the task to stop
	TrainerGone                // the trainer closed its hub or exited
)

// SideTask is the iterative interface: the runtime calls Step only inside bubbles, while the
// measured step time fits. A task may also implement Initer, Pauser, Resumer and Finisher.
// An error or a panic in any method ends Run, which returns the error or re-panics.
type SideTask interface {
	Step(info StepInfo) (StepResult, error)
}

// Initer is called once before the first bubble.
type Initer interface{ Init() error }

// Pauser is called when a bubble ends, before the pause is acknowledged.
type Pauser interface{ Pause() error }

// Resumer is called when a bubble starts, before the first step in it.
type Resumer interface{ Resume() error }

// Idler is called about every 100 ms while the task waits for a bubble (never inside one):
// the place to notice a shutdown asked of the task (a signal, a closed channel). Done ends the
// run as finished, an error ends it failed. A task without it just waits.
type Idler interface{ Idle() (StepResult, error) }

// Finisher is called once when Run ends, also after another method failed or panicked, so its
// cleanup always runs. err is nil when the task finished by itself, else the Status the run
// ended with: ErrStopped when it was told to stop (Run then returns Stopped and a nil error),
// ErrTrainerGone, or ErrCallbackFailed after a method failed (Run returns that method's error).
type Finisher interface{ Finish(err error) }

// Task is a side task's attachment to one hub. Use it from one goroutine at a time.
type Task struct {
	h             C.bb_task_h
	known         *TaskGrant // the last grant looked up, for its backend
	running       bool       // inside Run
	closeAfterRun bool       // Close from a SideTask method, done as Run returns
}

// Attach joins the hub of (jobID, rank) under name. errors.Is(err, ErrNotFound) when no
// trainer serves it, ErrFull when its slot table is full. opts may be nil.
func Attach(jobID string, rank uint32, name string, opts *TaskOptions) (*Task, error) {
	job, err := cName("job id", jobID)
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(job))
	cname, err := cName("task name", name)
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(cname))
	var o C.bb_task_options_t
	C.bb_task_options_init_sized(&o, C.sizeof_bb_task_options_t)
	if opts != nil {
		o.priority = C.int32_t(opts.Priority)
		o.mem_need = C.uint64_t(opts.MemNeed)
		o.min_step_ns = durationNs(opts.MinStep)
		o.on_trainer_exit = C.uint32_t(opts.OnTrainerExit)
		if opts.ReattachTimeout > 0 {
			o.reattach_timeout_ns = durationNs(opts.ReattachTimeout)
		}
		if opts.Spin > 0 {
			o.spin_ns = durationNs(opts.Spin)
		}
		o.wake_mode = C.uint32_t(opts.WakeMode)
		if opts.WakeLead > 0 {
			o.wake_lead_ns = durationNs(opts.WakeLead)
		}
		if opts.RuntimeDir != "" {
			dir, err := cString("runtime dir", opts.RuntimeDir, "a path")
			if err != nil {
				return nil, err
			}
			defer C.free(unsafe.Pointer(dir))
			o.runtime_dir = dir
		}
	}
	t := &Task{}
	if err := call(func() C.bb_status { return C.bb_task_attach(job, C.uint32_t(rank), cname, &o, &t.h) }); err != nil {
		return nil, err
	}
	runtime.SetFinalizer(t, (*Task).Close)
	return t, nil
}

func (t *Task) handle() (C.bb_task_h, error) {
	if t == nil || t.h == nil {
		return nil, &Error{Status: ErrState, Message: "the task is detached; attach again with Attach"}
	}
	return t.h, nil
}

// Close acks any pending pause and releases the slot. Calling it again does nothing. From a
// SideTask method inside Run it is done as Run returns: the run still uses the handle.
func (t *Task) Close() error {
	if t == nil || t.h == nil {
		return nil
	}
	if t.running {
		t.closeAfterRun = true
		return nil
	}
	h := t.h
	t.h = nil
	runtime.SetFinalizer(t, nil)
	return call(func() C.bb_status { return C.bb_task_detach(h) })
}

// runState is what the C callbacks reach through a cgo.Handle.
type runState struct {
	task  SideTask
	err   error
	panic interface{}
	h     C.bb_task_h
	t     *Task
	known *TaskGrant
}

// Run hands the loop to the runtime until the work is done, the task is stopped or the
// trainer leaves.
func (t *Task) Run(task SideTask) (Outcome, error) {
	h, err := t.handle()
	if err != nil {
		return 0, err
	}
	if t.running {
		return 0, &Error{Status: ErrState, Message: "Run was called from inside Run (a SideTask method): return from the method instead"}
	}
	st := &runState{task: task, h: h, t: t}
	handle := cgo.NewHandle(st)
	defer handle.Delete()
	// The callbacks run on this thread inside bb_task_run; keep it for bb_last_error too.
	runtime.LockOSThread()
	idle := C.int(0)
	if _, ok := task.(Idler); ok {
		idle = 1
	}
	t.running = true
	code := C.bubble_go_run(h, C.uintptr_t(handle), idle)
	failure := lastError(code)
	t.running = false
	if t.closeAfterRun {
		t.closeAfterRun = false
		_ = t.Close()
	}
	runtime.UnlockOSThread()
	runtime.KeepAlive(t)
	if st.panic != nil {
		panic(st.panic)
	}
	if st.err != nil {
		return 0, &Error{Status: ErrCallbackFailed, Message: "the side task failed: " + st.err.Error(), Cause: st.err}
	}
	switch {
	case failure == nil:
		return Finished, nil
	case errors.Is(failure, ErrStopped):
		return Stopped, nil
	case errors.Is(failure, ErrTrainerGone):
		return TrainerGone, nil
	}
	return 0, failure
}

// WaitStart blocks until the trainer starts this task in a bubble. It returns nil, nil after
// timeout (negative: wait forever), ErrStopped when told to stop, ErrTrainerGone when the
// trainer left.
func (t *Task) WaitStart(timeout time.Duration) (*StartInfo, error) {
	h, err := t.handle()
	if err != nil {
		return nil, err
	}
	var info C.bb_start_info_t
	info.size = C.uint32_t(unsafe.Sizeof(info))
	ns := C.int64_t(timeout)
	if timeout < 0 {
		ns = -1
	}
	err = call(func() C.bb_status { return C.bb_task_wait_start(h, ns, &info) })
	runtime.KeepAlive(t)
	if errors.Is(err, ErrTimeout) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	grant := grantOf(h, t, info.grant_id, info.grant_ptr, info.grant_bytes, &t.known)
	runtime.KeepAlive(t)
	return &StartInfo{Kind: BubbleKind(info.kind), BubbleSeq: uint64(info.bubble_seq),
		BeginNs: uint64(info.begin_ns), DeadlineNs: uint64(info.deadline_ns), FreeMem: uint64(info.free_mem),
		Grant: grant}, nil
}

// ShouldPause is true once the bubble ended or a stop was asked. One shared-memory load.
func (t *Task) ShouldPause() bool {
	h, err := t.handle()
	if err != nil {
		return true
	}
	p := C.bb_task_should_pause(h) != 0
	runtime.KeepAlive(t)
	return p
}

// AckPause says the task stopped its device work for this bubble.
func (t *Task) AckPause() error {
	h, err := t.handle()
	if err != nil {
		return err
	}
	err = call(func() C.bb_status { return C.bb_task_ack_pause(h) })
	runtime.KeepAlive(t)
	return err
}

// ReportStep reports one step's duration (statistics and the time-fits check).
func (t *Task) ReportStep(d time.Duration) error {
	h, err := t.handle()
	if err != nil {
		return err
	}
	err = call(func() C.bb_status { return C.bb_task_report_step(h, durationNs(d)) })
	runtime.KeepAlive(t)
	return err
}

// TimeLeft returns what remains of the current bubble (nil if the trainer gave no deadline)
// and the runtime's estimate of one step (0 before the first).
func (t *Task) TimeLeft() (*time.Duration, time.Duration, error) {
	h, err := t.handle()
	if err != nil {
		return nil, 0, err
	}
	var left, est C.uint64_t
	err = call(func() C.bb_status { return C.bb_task_time_left(h, &left, &est) })
	runtime.KeepAlive(t)
	if err != nil {
		return nil, 0, err
	}
	return optionalDuration(left), time.Duration(est), nil
}
