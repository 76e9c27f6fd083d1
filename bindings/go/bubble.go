// Package bubble runs side tasks in the idle time ("bubbles") of pipeline-parallel training.
//
// It is a cgo binding over libbubble's C ABI, found through pkg-config (bubble.pc). A trainer
// marks bubbles on a Trainer; a side task attaches with Attach and either implements SideTask
// and calls Task.Run, or runs its own loop with WaitStart, ShouldPause and AckPause.
//
// Handles are freed by Close (safe to call twice); a finalizer is only a backstop. No Go
// pointer is kept by C: callbacks find their Go value through a runtime/cgo.Handle.
package bubble

/*
#cgo pkg-config: bubble
#include <stdlib.h>
#include <bubble/bubble.h>
*/
import "C"

import (
	"fmt"
	"runtime"
	"time"
)

// Status is a libbubble status code. The non-OK ones are errors themselves, so
// errors.Is(err, bubble.ErrStopped) tells what a failed call meant.
type Status int32

// The status codes of bubble.h.
const (
	StatusOK          Status = C.BB_OK
	ErrInvalid        Status = C.BB_E_INVALID
	ErrNoMemory       Status = C.BB_E_NOMEM
	ErrSystem         Status = C.BB_E_SYSTEM
	ErrNotFound       Status = C.BB_E_NOT_FOUND
	ErrBusy           Status = C.BB_E_BUSY
	ErrFull           Status = C.BB_E_FULL
	ErrVersion        Status = C.BB_E_VERSION
	ErrPermission     Status = C.BB_E_PERMISSION
	ErrTimeout        Status = C.BB_E_TIMEOUT
	ErrStopped        Status = C.BB_E_STOPPED
	ErrTrainerGone    Status = C.BB_E_TRAINER_GONE
	ErrCorrupt        Status = C.BB_E_CORRUPT
	ErrState          Status = C.BB_E_STATE
	ErrUnsupported    Status = C.BB_E_UNSUPPORTED
	ErrCallbackFailed Status = C.BB_E_CALLBACK
)

// Name is the C name of the code ("BB_E_TIMEOUT").
func (s Status) Name() string { return C.GoString(C.bb_status_name(C.bb_status(s))) }

// Error describes the code in general; a failed call returns an *Error with the details.
func (s Status) Error() string { return C.GoString(C.bb_status_str(C.bb_status(s))) }

// Error is what a failed call returns: the status and the library's sentence saying what went
// wrong and what to do.
type Error struct {
	Status  Status
	Message string
	// Cause is what a SideTask method returned, for ErrCallbackFailed.
	Cause error
}

func (e *Error) Error() string { return fmt.Sprintf("%s [%s]", e.Message, e.Status.Name()) }

// Is lets errors.Is match an *Error against a Status.
func (e *Error) Is(target error) bool {
	s, ok := target.(Status)
	return ok && s == e.Status
}

func (e *Error) Unwrap() error { return e.Cause }

// call runs one C call and, if it failed, reads bb_last_error on the same OS thread: the
// message is thread-local and a goroutine may otherwise move between the two cgo calls.
func call(f func() C.bb_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return lastError(f())
}

// lastError must run on the thread of the failed call, before any other libbubble call.
func lastError(s C.bb_status) error {
	if s == C.BB_OK {
		return nil
	}
	msg := C.GoString(C.bb_last_error())
	if msg == "" {
		msg = Status(s).Error()
	}
	return &Error{Status: Status(s), Message: msg}
}

// LibraryVersion is the version of the linked libbubble ("0.1.0").
func LibraryVersion() string { return C.GoString(C.bb_version()) }

// NowNs is CLOCK_MONOTONIC now in nanoseconds: the clock of every libbubble time.
func NowNs() uint64 { return uint64(C.bb_now_ns()) }

// MemUnknown stands for "free device memory not known".
const MemUnknown = ^uint64(0)

func durationNs(d time.Duration) C.uint64_t {
	if d <= 0 {
		return 0
	}
	return C.uint64_t(d)
}

func optionalDuration(ns C.uint64_t) *time.Duration {
	if uint64(ns) == ^uint64(0) {
		return nil
	}
	d := time.Duration(ns)
	return &d
}

func cName(what, s string) (*C.char, error) {
	return cString(what, s, "a name")
}

// cString is s for a const char* argument; ErrInvalid when it holds a NUL byte, which C would
// take for its end (and so use a shorter, other name or path).
func cString(what, s, kind string) (*C.char, error) {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return nil, &Error{Status: ErrInvalid, Message: fmt.Sprintf("%s %q contains a NUL byte; pass %s without one", what, s, kind)}
		}
	}
	return C.CString(s), nil
}
