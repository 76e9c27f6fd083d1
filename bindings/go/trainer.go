package bubble

/*
#include <stdlib.h>
#include <bubble/bubble.h>
*/
import "C"

import (
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"
)

// BubbleKind says where in the pipeline schedule a bubble sits.
type BubbleKind uint32

const (
	BubbleOther    BubbleKind = C.BB_BUBBLE_OTHER
	BubbleWarmup   BubbleKind = C.BB_BUBBLE_WARMUP   // pipeline fill
	BubbleSteady   BubbleKind = C.BB_BUBBLE_STEADY   // a point-to-point wait in the steady state
	BubbleCooldown BubbleKind = C.BB_BUBBLE_COOLDOWN // pipeline drain
)

// ScheduleKind is the pipeline schedule a trainer runs.
type ScheduleKind uint32

const (
	ScheduleGPipe       ScheduleKind = C.BB_SCHEDULE_GPIPE       // all forwards, then all backwards
	Schedule1F1B        ScheduleKind = C.BB_SCHEDULE_1F1B        // one forward, one backward
	ScheduleInterleaved ScheduleKind = C.BB_SCHEDULE_INTERLEAVED // interleaved 1F1B, Chunks per stage
	ScheduleZBH1        ScheduleKind = C.BB_SCHEDULE_ZBH1        // zero-bubble H1
)

// ScheduleBubbles says what one bubble is, which fixes how bubbles are numbered in an iteration.
type ScheduleBubbles uint32

const (
	ScheduleBubblesIdle     ScheduleBubbles = C.BB_SCHEDULE_BUBBLES_IDLE     // idle intervals of the model
	ScheduleBubblesReceives ScheduleBubbles = C.BB_SCHEDULE_BUBBLES_RECEIVES // one per receive, waited or not
)

// Schedule declares a pipeline schedule, so the predictor knows each bubble's length from the
// first iteration on. Kind's zero value is ScheduleGPipe: set it. Zero Fwd and Bwd (and Wgrad,
// Comm) mean the times are unknown: the library measures them.
type Schedule struct {
	Kind         ScheduleKind
	Stages       uint32        // p >= 1
	Microbatches uint32        // m >= 1
	Chunks       uint32        // interleaved: v >= 2; 0 means 1
	Stage        uint32        // this trainer's stage, 0..p-1
	Fwd, Bwd     time.Duration // one micro-batch's forward and backward (ZB-H1: input part)
	Wgrad        time.Duration // ZB-H1: the weight-gradient part
	Comm         time.Duration // point-to-point transfer between stages
	Bubbles      ScheduleBubbles
}

// TrainerOptions sizes the hub; the zero value means the library's defaults.
type TrainerOptions struct {
	MaxSlots      uint32
	MaxRunning    uint32
	EventCapacity uint32
	RuntimeDir    string // "": $BUBBLE_RUNTIME_DIR, else the library's default
	AllowUID      *uint32
}

// TrainerStats are the hub's counters (times in nanoseconds).
type TrainerStats struct {
	TasksAttached                         uint32
	Bubbles, BubbleNs                     uint64
	Starts, Pauses, Wakes                 uint64
	TaskNsInBubbles, TaskNsOutside, Steps uint64
	StartLatencyP50Ns, StartLatencyP99Ns  uint64
	PauseLatencyP50Ns, PauseLatencyP99Ns  uint64
	TasksReclaimed, TasksBad              uint64
	EventsDropped                         uint64
}

// TaskInfo is one attached side task as the trainer sees it.
type TaskInfo struct {
	ID        uint64
	Slot      uint32
	Name      string
	PID       int32
	Priority  int32
	MemNeed   uint64
	MinStepNs uint64
	Steps     uint64
	StepNs    uint64
	Running   bool
	Bad       bool
	// Its step time inside bubbles and past bubbles' ends, from its reports.
	NsInBubbles, NsOutside uint64
}

// Trainer owns the hub of one trainer rank. Begin, End, Iteration and SetSchedule must come
// from one goroutine at a time; the other methods may be called from any.
type Trainer struct {
	h C.bb_trainer_h
	// Calls in flight, and whether Close has begun: Close waits for the calls already inside the
	// library before it frees the hub, and later calls fail, so a Close on one goroutine never
	// frees the handle under a call on another. Two atomic adds: the bubble calls take no lock.
	inflight atomic.Int64
	closed   atomic.Bool
}

// OpenTrainer creates the hub of (jobID, rank); errors.Is(err, ErrBusy) when a live trainer
// owns it. opts may be nil.
func OpenTrainer(jobID string, rank uint32, opts *TrainerOptions) (*Trainer, error) {
	job, err := cName("job id", jobID)
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(job))
	var o C.bb_trainer_options_t
	C.bb_trainer_options_init_sized(&o, C.sizeof_bb_trainer_options_t)
	if opts != nil {
		if opts.MaxSlots != 0 {
			o.max_slots = C.uint32_t(opts.MaxSlots)
		}
		if opts.MaxRunning != 0 {
			o.max_running = C.uint32_t(opts.MaxRunning)
		}
		if opts.EventCapacity != 0 {
			o.event_capacity = C.uint32_t(opts.EventCapacity)
		}
		if opts.RuntimeDir != "" {
			dir, err := cString("runtime dir", opts.RuntimeDir, "a path")
			if err != nil {
				return nil, err
			}
			defer C.free(unsafe.Pointer(dir))
			o.runtime_dir = dir
		}
		if opts.AllowUID != nil {
			o.allow_uid = C.uint32_t(*opts.AllowUID)
		}
	}
	t := &Trainer{}
	if err := call(func() C.bb_status { return C.bb_trainer_open(job, C.uint32_t(rank), &o, &t.h) }); err != nil {
		return nil, err
	}
	runtime.SetFinalizer(t, (*Trainer).Close)
	return t, nil
}

var errTrainerClosed = &Error{Status: ErrState, Message: "the trainer is closed; open a new one with OpenTrainer"}

// acquire returns the hub's handle for one call, and done to call when the call has returned.
func (t *Trainer) acquire() (C.bb_trainer_h, func(), error) {
	if t == nil {
		return nil, nil, errTrainerClosed
	}
	t.inflight.Add(1)
	if t.closed.Load() {
		t.inflight.Add(-1)
		return nil, nil, errTrainerClosed
	}
	return t.h, t.release, nil
}

func (t *Trainer) release() { t.inflight.Add(-1) }

// Test hooks, nil outside this package's tests: a Stats call holding the handle before it calls
// into the library, Close waiting for calls in flight, and Close about to free the hub.
var (
	testHookStatsHeld  func()
	testHookCloseWaits func()
	testHookCloseFrees func()
)

// Close stops every attached task and removes the hub, once the calls other goroutines have
// in flight have returned; calls made after it fail. Calling it again does nothing.
func (t *Trainer) Close() error {
	if t == nil || !t.closed.CompareAndSwap(false, true) {
		return nil
	}
	// Calls in flight are short, but one (Unlend) may block for seconds: back off to 1 ms.
	for wait := 50 * time.Microsecond; t.inflight.Load() > 0; {
		if testHookCloseWaits != nil {
			testHookCloseWaits()
		}
		time.Sleep(wait)
		if wait < time.Millisecond {
			wait *= 2
		}
	}
	h := t.h
	t.h = nil
	runtime.SetFinalizer(t, nil)
	if testHookCloseFrees != nil {
		testHookCloseFrees()
	}
	return call(func() C.bb_status { return C.bb_trainer_close(h) })
}

// Begin says a bubble starts now. expected 0 asks the predictor; freeMem MemUnknown if unknown.
func (t *Trainer) Begin(expected time.Duration, kind BubbleKind, freeMem uint64) error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	err = call(func() C.bb_status {
		return C.bb_bubble_begin(h, durationNs(expected), C.uint64_t(freeMem), C.bb_bubble_kind(kind))
	})
	runtime.KeepAlive(t)
	return err
}

// End says the bubble ends now; started tasks are told to pause.
func (t *Trainer) End() error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	err = call(func() C.bb_status { return C.bb_bubble_end(h) })
	runtime.KeepAlive(t)
	return err
}

// Bubble runs wait (typically a blocking receive) inside a bubble, ended even if wait panics.
// wait always runs, being the caller's own work: when Begin fails, it runs outside a bubble
// and Bubble returns Begin's error after it. Otherwise it returns End's error.
func (t *Trainer) Bubble(expected time.Duration, kind BubbleKind, wait func()) (err error) {
	if err = t.Begin(expected, kind, MemUnknown); err != nil {
		wait()
		return err
	}
	defer func() {
		if endErr := t.End(); err == nil {
			err = endErr
		}
	}()
	wait()
	return nil
}

// Iteration marks the start of a training iteration (numbers bubbles for the predictor).
func (t *Trainer) Iteration() error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	err = call(func() C.bb_status { return C.bb_trainer_iteration(h) })
	runtime.KeepAlive(t)
	return err
}

// SetSchedule declares the pipeline schedule (from the bubble goroutine, before an iteration;
// not bounded-time). ErrInvalid names what the schedule model rejects.
func (t *Trainer) SetSchedule(s Schedule) error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	var c C.bb_schedule_t
	C.bb_schedule_init_sized(&c, C.sizeof_bb_schedule_t)
	c.kind = C.uint32_t(s.Kind)
	c.stages = C.uint32_t(s.Stages)
	c.microbatches = C.uint32_t(s.Microbatches)
	if s.Chunks != 0 {
		c.chunks = C.uint32_t(s.Chunks)
	}
	c.stage = C.uint32_t(s.Stage)
	c.fwd_ns = durationNs(s.Fwd)
	c.bwd_ns = durationNs(s.Bwd)
	c.wgrad_ns = durationNs(s.Wgrad)
	c.comm_ns = durationNs(s.Comm)
	c.bubbles = C.uint32_t(s.Bubbles)
	err = call(func() C.bb_status { return C.bb_trainer_set_schedule(h, &c) })
	runtime.KeepAlive(t)
	return err
}

// Stats returns the hub's counters.
func (t *Trainer) Stats() (TrainerStats, error) {
	h, done, err := t.acquire()
	if err != nil {
		return TrainerStats{}, err
	}
	defer done()
	if testHookStatsHeld != nil {
		testHookStatsHeld()
	}
	s := (*C.bb_trainer_stats_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.bb_trainer_stats_t{}))))
	defer C.free(unsafe.Pointer(s))
	s.size = C.uint32_t(unsafe.Sizeof(*s))
	err = call(func() C.bb_status { return C.bb_trainer_stats(h, s) })
	runtime.KeepAlive(t)
	if err != nil {
		return TrainerStats{}, err
	}
	return TrainerStats{
		TasksAttached: uint32(s.tasks_attached), Bubbles: uint64(s.bubbles), BubbleNs: uint64(s.bubble_ns),
		Starts: uint64(s.starts), Pauses: uint64(s.pauses), Wakes: uint64(s.wakes),
		TaskNsInBubbles: uint64(s.task_ns_in_bubbles), TaskNsOutside: uint64(s.task_ns_outside),
		Steps: uint64(s.steps), StartLatencyP50Ns: uint64(s.start_latency_p50_ns),
		StartLatencyP99Ns: uint64(s.start_latency_p99_ns), PauseLatencyP50Ns: uint64(s.pause_latency_p50_ns),
		PauseLatencyP99Ns: uint64(s.pause_latency_p99_ns), TasksReclaimed: uint64(s.tasks_reclaimed),
		TasksBad: uint64(s.tasks_bad), EventsDropped: uint64(s.events_dropped),
	}, nil
}

// Tasks lists the tasks attached now.
func (t *Trainer) Tasks() ([]TaskInfo, error) {
	h, done, err := t.acquire()
	if err != nil {
		return nil, err
	}
	defer done()
	defer runtime.KeepAlive(t)
	var count C.size_t
	if err := call(func() C.bb_status { return C.bb_trainer_tasks(h, nil, 0, &count) }); err != nil {
		return nil, err
	}
	for {
		// Room for tasks that attach between the two calls. C memory: C writes into it.
		n := count + 4
		raw := (*C.bb_task_info_t)(C.calloc(n, C.size_t(unsafe.Sizeof(C.bb_task_info_t{}))))
		if raw == nil {
			return nil, &Error{Status: ErrNoMemory, Message: "out of memory listing tasks"}
		}
		infos := unsafe.Slice(raw, int(n))
		for i := range infos {
			infos[i].size = C.uint32_t(unsafe.Sizeof(infos[i]))
		}
		err := call(func() C.bb_status { return C.bb_trainer_tasks(h, raw, n, &count) })
		if err == nil && count <= n {
			out := make([]TaskInfo, int(count))
			for i := range out {
				r := &infos[i]
				out[i] = TaskInfo{ID: uint64(r.id), Slot: uint32(r.slot), Name: cArrayString(r.name[:]),
					PID: int32(r.pid), Priority: int32(r.priority), MemNeed: uint64(r.mem_need),
					MinStepNs: uint64(r.min_step_ns), Steps: uint64(r.steps), StepNs: uint64(r.step_ns),
					Running: r.running != 0, Bad: r.bad != 0,
					NsInBubbles: uint64(r.ns_in_bubbles), NsOutside: uint64(r.ns_outside)}
			}
			C.free(unsafe.Pointer(raw))
			return out, nil
		}
		C.free(unsafe.Pointer(raw))
		if err != nil {
			return nil, err
		}
	}
}

// StopTask tells one task (by TaskInfo.ID) to stop; it finishes and detaches.
func (t *Trainer) StopTask(id uint64) error {
	h, done, err := t.acquire()
	if err != nil {
		return err
	}
	defer done()
	err = call(func() C.bb_status { return C.bb_trainer_stop_task(h, C.uint64_t(id)) })
	runtime.KeepAlive(t)
	return err
}

// cArrayString reads a NUL-terminated name, bounded by its array even if the NUL is missing.
func cArrayString(a []C.char) string {
	b := make([]byte, 0, len(a))
	for _, c := range a {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}
