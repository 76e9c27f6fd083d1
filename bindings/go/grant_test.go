package bubble

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

const grantBytes = 64 * 1024

func patternWord(seed uint32, i int) uint32 { return seed ^ uint32(i)*2654435761 }

func writePattern(mem []byte, seed uint32) {
	for i := 0; i+4 <= len(mem); i += 4 {
		binary.LittleEndian.PutUint32(mem[i:], patternWord(seed, i/4))
	}
}

func patternOK(mem []byte, seed uint32) bool {
	for i := 0; i+4 <= len(mem); i += 4 {
		if binary.LittleEndian.Uint32(mem[i:]) != patternWord(seed, i/4) {
			return false
		}
	}
	return true
}

// within polls pred for up to 20 s or until quit is closed; for goroutines, which may not
// call t.Fatal.
func within(quit chan struct{}, pred func() bool) bool {
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(time.Millisecond) {
		select {
		case <-quit:
			return false
		default:
		}
		if pred() {
			return true
		}
	}
	return false
}

func lendHost(t *testing.T, tr *Trainer) {
	t.Helper()
	if err := tr.Lend(LendOptions{Bytes: 1 << 20}); err != nil {
		t.Fatal(err)
	}
}

func onlyTaskID(t *testing.T, tr *Trainer) uint64 {
	t.Helper()
	eventually(t, "the task listed", func() bool { return taskCount(t, tr) == 1 })
	tasks, err := tr.Tasks()
	if err != nil {
		t.Fatal(err)
	}
	return tasks[0].ID
}

func grantStats(t *testing.T, tr *Trainer) GrantStats {
	t.Helper()
	s, err := tr.GrantStats()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestHostGrantWrittenByTaskIsReadByTrainerThenRevokedAndAcked(t *testing.T) {
	tr, job := openTrainer(t)
	lendHost(t, tr)
	if err := tr.Lend(LendOptions{Bytes: 1 << 20}); !errors.Is(err, ErrBusy) {
		t.Fatalf("lending twice: want ErrBusy, got %v", err)
	}

	var written, acked, rewritten atomic.Uint64
	var paused atomic.Bool
	quit := make(chan struct{})
	defer close(quit)
	done := make(chan error, 1)
	go func() {
		done <- func() error {
			task, err := Attach(job, 0, "granted", &TaskOptions{MemNeed: grantBytes})
			if err != nil {
				return err
			}
			defer task.Close()
			start, err := task.WaitStart(20 * time.Second)
			if err != nil || start == nil {
				return fmt.Errorf("never started: %v", err)
			}
			if start.Grant == nil || start.Grant.Bytes != grantBytes || start.Grant.Backend != GrantHost {
				return fmt.Errorf("started without its host grant: %+v", start.Grant)
			}
			g, err := task.Grant()
			if err != nil || g == nil || g.ID != start.Grant.ID || g.Ptr != start.Grant.Ptr || g.Revoking() {
				return fmt.Errorf("Grant() = %+v, %v; the start named %+v", g, err, start.Grant)
			}
			if g.Device != -1 || start.Grant.Device != -1 {
				return fmt.Errorf("a host grant names GPU %d (its start: %d)", g.Device, start.Grant.Device)
			}
			writePattern(g.Memory(), 7)
			written.Store(g.ID)
			within(quit, task.ShouldPause)
			if err := task.AckPause(); err != nil {
				return err
			}
			paused.Store(true)
			// Idle now: wait for the trainer to ask the grant back, then give it.
			if !within(quit, func() bool { g, err = task.Grant(); return err != nil || g.Revoking() }) || err != nil {
				return fmt.Errorf("no revoke: %v", err)
			}
			if g.RevokeDeadlineNs <= NowNs() {
				return errors.New("the revoke deadline already passed")
			}
			if err := task.AckRevoke(); err != nil {
				return err
			}
			if g, err := task.Grant(); g != nil || err != nil {
				return fmt.Errorf("still mapped after AckRevoke: %+v %v", g, err)
			}
			acked.Store(g.ID)
			// The trainer grants again on request: the new grant is mapped on the next look.
			if !within(quit, func() bool { g, err = task.Grant(); return err != nil || g != nil }) || err != nil {
				return fmt.Errorf("no new grant: %v", err)
			}
			writePattern(g.Memory(), 11)
			rewritten.Store(g.ID)
			for {
				select {
				case <-quit:
					return errors.New("quit")
				default:
				}
				if _, err := task.WaitStart(100 * time.Millisecond); err != nil {
					if errors.Is(err, ErrStopped) {
						return task.Close()
					}
					return err
				}
			}
		}()
	}()

	id := onlyTaskID(t, tr)
	// Auto grant: the attach with a MemNeed is granted without being asked.
	eventually(t, "the auto grant", func() bool { g, _ := tr.TaskGrant(id); return g != nil })
	if !bubbleUntil(t, tr, func() bool { return written.Load() != 0 }) {
		t.Fatal("the task never wrote its grant")
	}
	g, err := tr.TaskGrant(id)
	if err != nil || g == nil {
		t.Fatalf("TaskGrant = %+v, %v", g, err)
	}
	if g.ID != written.Load() || g.TaskID != id || g.State != GrantActive || g.Backend != GrantHost ||
		g.Bytes != grantBytes || !g.Mapped {
		t.Fatalf("grant %+v", g)
	}
	// The trainer reads what the task wrote at its own address of the grant.
	if !patternOK(g.HostMemory(), 7) {
		t.Fatal("the trainer does not see the task's pattern")
	}
	// ... or copies it out, which a release waits for.
	copied := make([]byte, grantBytes)
	if err := tr.ReadGrant(g.ID, 0, copied); err != nil || !patternOK(copied, 7) {
		t.Fatalf("ReadGrant: %v (pattern %v)", err, patternOK(copied, 7))
	}
	part := make([]byte, 8)
	if err := tr.ReadGrant(g.ID, 16, part); err != nil || !bytes.Equal(part, copied[16:24]) {
		t.Fatalf("ReadGrant at 16: %v", err)
	}
	if err := tr.ReadGrant(g.ID, grantBytes-4, part); !errors.Is(err, ErrInvalid) ||
		!strings.Contains(err.Error(), "outside grant") {
		t.Fatalf("ReadGrant past the grant: want ErrInvalid, got %v", err)
	}
	if s := grantStats(t, tr); s.Backend != GrantHost || s.Capacity != 1<<20 || s.Active != 1 ||
		s.GrantedBytes != grantBytes || s.GrantsMade != 1 {
		t.Fatalf("stats %+v", s)
	}

	// Revoked once idle: a pending revoke would be acked by the pause's ack already.
	eventually(t, "the task idle", paused.Load)
	if err := tr.Revoke(id, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := tr.Revoke(id, 0); err == nil {
		t.Fatal("a second revoke succeeded")
	}
	eventually(t, "the revoke ack", func() bool { return grantStats(t, tr).RevokesAcked == 1 })
	// The task says so after its ack.
	eventually(t, "the task's word on its ack", func() bool { return acked.Load() == g.ID })
	if now, err := tr.TaskGrant(id); now != nil || err != nil {
		t.Fatalf("after the ack: %+v %v", now, err)
	}
	if err := tr.ReadGrant(g.ID, 0, part); !errors.Is(err, ErrNotFound) {
		t.Fatalf("ReadGrant of a grant given back: want ErrNotFound, got %v", err)
	}
	if s := grantStats(t, tr); s.Revokes != 1 || s.TasksKilled != 0 || s.Active != 0 || s.GrantedBytes != 0 ||
		s.FreeBytes != s.Capacity {
		t.Fatalf("stats after the ack %+v", s)
	}

	again, err := tr.Grant(id, 0)
	if err != nil || again <= g.ID {
		t.Fatalf("Grant = %d, %v", again, err)
	}
	if _, err := tr.Grant(id, 0); !errors.Is(err, ErrBusy) {
		t.Fatalf("a second grant to one task: want ErrBusy, got %v", err)
	}
	eventually(t, "the new grant written", func() bool { return rewritten.Load() == again })
	if g, err = tr.TaskGrant(id); err != nil || !patternOK(g.HostMemory(), 11) {
		t.Fatalf("the new grant %+v, %v", g, err)
	}

	if err := tr.StopTask(id); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// Detaching gave the grant back.
	eventually(t, "the grant back", func() bool { return grantStats(t, tr).Active == 0 })
	if s := grantStats(t, tr); s.TasksKilled != 0 {
		t.Fatalf("killed %d", s.TasksKilled)
	}
}

type grantWriter struct {
	written, withoutGrant atomic.Uint64
}

func (w *grantWriter) Step(info StepInfo) (StepResult, error) {
	mem := info.Grant.Memory()
	if mem == nil || uint64(len(mem)) != info.Grant.Bytes {
		w.withoutGrant.Add(1)
	} else if w.written.Load() != info.Grant.ID {
		writePattern(mem, 5)
		w.written.Store(info.Grant.ID)
	}
	time.Sleep(time.Millisecond)
	return Continue, nil
}

func TestSideTaskWritesItsGrantInStepsAndTheRuntimeAcksTheRevoke(t *testing.T) {
	tr, job := openTrainer(t)
	lendHost(t, tr)
	w := &grantWriter{}
	done := make(chan runResult, 1)
	go func() {
		task, err := Attach(job, 0, "iterative-grant", &TaskOptions{MemNeed: grantBytes})
		if err != nil {
			done <- runResult{err: err}
			return
		}
		defer task.Close()
		o, err := task.Run(w)
		done <- runResult{o, err}
	}()
	id := onlyTaskID(t, tr)
	if !bubbleUntil(t, tr, func() bool { return w.written.Load() != 0 }) {
		t.Fatal("the task never wrote its grant")
	}
	g, err := tr.TaskGrant(id)
	if err != nil || g == nil || g.ID != w.written.Load() || !patternOK(g.HostMemory(), 5) {
		t.Fatalf("grant %+v, %v", g, err)
	}
	// Between bubbles the runtime unmaps the revoked grant and acks by itself.
	if err := tr.Revoke(id, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the revoke ack", func() bool { return grantStats(t, tr).RevokesAcked == 1 })
	if now, _ := tr.TaskGrant(id); now != nil {
		t.Fatalf("still granted: %+v", now)
	}
	if err := tr.StopTask(id); err != nil {
		t.Fatal(err)
	}
	if r := <-done; r.err != nil || r.outcome != Stopped {
		t.Fatalf("run = %v, %v", r.outcome, r.err)
	}
	// A task that needs memory is started only while it holds a grant.
	if n := w.withoutGrant.Load(); n != 0 {
		t.Fatalf("%d steps without the grant", n)
	}
	eventually(t, "the grant back", func() bool { return grantStats(t, tr).Active == 0 })
}

func TestDeviceGrantHasNoHostMemory(t *testing.T) {
	g := &GrantInfo{ID: 1, State: GrantActive, Backend: GrantCudaVMM, Bytes: 4096, Address: 1 << 40}
	if g.HostMemory() != nil {
		t.Fatal("a device address became host memory")
	}
	if (&TaskGrant{ID: 1, Backend: GrantCudaIPC, Bytes: 4096}).Memory() != nil {
		t.Fatal("a device pointer became host memory")
	}
}

func TestUnlendGivesTheMemoryBackAndLendMayLendAgain(t *testing.T) {
	tr, _ := openTrainer(t)
	if err := tr.Unlend(0); !errors.Is(err, ErrState) {
		t.Fatalf("unlend with nothing lent: want ErrState, got %v", err)
	}
	lendHost(t, tr)
	if err := tr.Unlend(time.Second); err != nil {
		t.Fatal(err)
	}
	if s := grantStats(t, tr); s.Backend != 0 || s.Capacity != 0 {
		t.Fatalf("after Unlend the hub still lends: %+v", s)
	}
	if err := tr.Lend(LendOptions{Bytes: 2 << 20}); err != nil {
		t.Fatalf("lending again after Unlend: %v", err)
	}
	if s := grantStats(t, tr); s.Backend != GrantHost || s.Capacity != 2<<20 {
		t.Fatalf("lent again: %+v", s)
	}
}

// A grant kept keeps its task attached: the dropped Task's finalizer would detach it and unmap
// the memory under the grant's Memory(). Once the grant is dropped too, the finalizer detaches.
func TestAGrantKeptKeepsItsTaskAttached(t *testing.T) {
	tr, job := openTrainer(t)
	lendHost(t, tr)
	grantOnly := func() *TaskGrant {
		task, err := Attach(job, 0, "kept", &TaskOptions{MemNeed: grantBytes})
		if err != nil {
			t.Fatal(err)
		}
		var g *TaskGrant
		eventually(t, "the task's grant", func() bool { g, err = task.Grant(); return err != nil || g != nil })
		if err != nil {
			t.Fatal(err)
		}
		return g // the Task itself is dropped here
	}
	g := grantOnly()
	for i := 0; i < 3; i++ {
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	if n := taskCount(t, tr); n != 1 {
		t.Fatalf("%d tasks attached while the grant is kept", n)
	}
	writePattern(g.Memory(), 3)
	if !patternOK(g.Memory(), 3) {
		t.Fatal("the kept grant's memory does not hold what was written")
	}
	runtime.KeepAlive(g)
	g = nil
	eventually(t, "the dropped task detached by its finalizer", func() bool {
		runtime.GC()
		return taskCount(t, tr) == 0
	})
}

// A Task dropped without Close after a start that named its grant is still finalized: what it
// keeps of that grant refers to nothing that leads back to it.
func TestATaskDroppedAfterAStartWithAGrantIsFinalized(t *testing.T) {
	tr, job := openTrainer(t)
	lendHost(t, tr)
	started := make(chan error, 1)
	go func() {
		task, err := Attach(job, 0, "dropped", &TaskOptions{MemNeed: grantBytes})
		if err == nil {
			var s *StartInfo
			if s, err = task.WaitStart(20 * time.Second); err == nil && (s == nil || s.Grant == nil) {
				err = fmt.Errorf("started without its grant: %+v", s)
			}
		}
		started <- err // the Task is dropped here, without Close
	}()
	eventually(t, "the task attached", func() bool { return taskCount(t, tr) == 1 })
	var err error
	got := false
	if !bubbleUntil(t, tr, func() bool {
		select {
		case err = <-started:
			got = true
		default:
		}
		return got
	}) {
		t.Fatal("the task never started")
	}
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the dropped task detached by its finalizer", func() bool {
		runtime.GC()
		return taskCount(t, tr) == 0
	})
}
