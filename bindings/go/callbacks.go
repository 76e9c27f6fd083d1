package bubble

/*
#include <stdint.h>
#include <bubble/bubble.h>
*/
import "C"

import (
	"fmt"
	"runtime/cgo"
	"time"
)

// The C side (callbacks.c) passes the cgo.Handle of a runState as the user pointer.
func stateOf(user C.uintptr_t) *runState { return cgo.Handle(user).Value().(*runState) }

// guarded runs one SideTask method, unless an earlier one failed (the runtime is then ending the
// run and only Finish is still called).
func guarded(user C.uintptr_t, f func(*runState) (C.int, error)) C.int {
	st := stateOf(user)
	if st.err != nil || st.panic != nil {
		return -1
	}
	return protect(st, f)
}

// protect runs f; an error or panic is kept for Run (the first one: a later one from Finish
// does not hide it) and reported to C as -1, since a panic must not unwind through the C frames
// of bb_task_run.
func protect(st *runState, f func(*runState) (C.int, error)) (rc C.int) {
	defer func() {
		if p := recover(); p != nil {
			if st.panic == nil && st.err == nil {
				st.panic = p
			}
			rc = -1
		}
	}()
	v, err := f(st)
	if err != nil {
		if st.err == nil && st.panic == nil {
			st.err = err
		}
		return -1
	}
	return v
}

//export bubbleGoInit
func bubbleGoInit(user C.uintptr_t) C.int {
	return guarded(user, func(st *runState) (C.int, error) {
		if i, ok := st.task.(Initer); ok {
			return 0, i.Init()
		}
		return 0, nil
	})
}

//export bubbleGoStep
func bubbleGoStep(user C.uintptr_t, info *C.bb_step_info_t) C.int {
	si := StepInfo{Kind: BubbleKind(info.kind), BubbleSeq: uint64(info.bubble_seq),
		DeadlineNs: uint64(info.deadline_ns), TimeLeft: optionalDuration(info.time_left_ns),
		EstStep: time.Duration(info.est_step_ns), FreeMem: uint64(info.free_mem)}
	return guarded(user, func(st *runState) (C.int, error) {
		si.Grant = grantOf(st.h, st.t, info.grant_id, info.grant_ptr, info.grant_bytes, &st.known)
		r, err := st.task.Step(si)
		switch r {
		case Continue:
			return C.BB_STEP_CONTINUE, err
		case Done:
			return C.BB_STEP_DONE, err
		}
		return -1, fmt.Errorf("Step returned %d, which is neither Continue nor Done", r)
	})
}

//export bubbleGoPause
func bubbleGoPause(user C.uintptr_t) C.int {
	return guarded(user, func(st *runState) (C.int, error) {
		if p, ok := st.task.(Pauser); ok {
			return 0, p.Pause()
		}
		return 0, nil
	})
}

//export bubbleGoResume
func bubbleGoResume(user C.uintptr_t) C.int {
	return guarded(user, func(st *runState) (C.int, error) {
		if r, ok := st.task.(Resumer); ok {
			return 0, r.Resume()
		}
		return 0, nil
	})
}

//export bubbleGoIdle
func bubbleGoIdle(user C.uintptr_t) C.int {
	return guarded(user, func(st *runState) (C.int, error) {
		r, err := st.task.(Idler).Idle()
		switch r {
		case Continue:
			return 0, err
		case Done:
			return C.BB_STEP_DONE, err
		}
		return -1, fmt.Errorf("Idle returned %d, which is neither Continue nor Done", r)
	})
}

//export bubbleGoFinish
func bubbleGoFinish(user C.uintptr_t, status C.bb_status) {
	// Always called, also after another method failed: a Finisher's cleanup must run.
	protect(stateOf(user), func(st *runState) (C.int, error) {
		if f, ok := st.task.(Finisher); ok {
			var err error
			if status != C.BB_OK {
				err = Status(status)
			}
			f.Finish(err)
		}
		return 0, nil
	})
}
