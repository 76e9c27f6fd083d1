package bubble

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

var jobs int32

func uniqueJob() string {
	return fmt.Sprintf("go-%d-%d", os.Getpid(), atomic.AddInt32(&jobs, 1))
}

func TestMain(m *testing.M) {
	// A private runtime directory: no hub of another run or user is touched.
	dir, err := os.MkdirTemp("", "bb-go-")
	if err != nil {
		panic(err)
	}
	os.Setenv("BUBBLE_RUNTIME_DIR", dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func eventually(t *testing.T, what string, pred func() bool) {
	t.Helper()
	end := time.Now().Add(20 * time.Second)
	for !pred() {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// bubbleUntil opens bubbles until pred holds inside one. A task that has not yet acked the
// pause of the previous bubble is (rightly) not started, and nothing on the trainer side tells
// when that ack lands: so a bubble in which nothing started is closed and another one opened.
func bubbleUntil(t *testing.T, tr *Trainer, pred func() bool) bool {
	t.Helper()
	for attempt := 0; attempt < 20; attempt++ {
		if err := tr.Begin(50*time.Millisecond, BubbleSteady, MemUnknown); err != nil {
			t.Fatal(err)
		}
		ok := false
		for end := time.Now().Add(time.Second); !ok && time.Now().Before(end); time.Sleep(time.Millisecond) {
			ok = pred()
		}
		if err := tr.End(); err != nil {
			t.Fatal(err)
		}
		if ok {
			return true
		}
	}
	return false
}

func openTrainer(t *testing.T) (*Trainer, string) {
	t.Helper()
	job := uniqueJob()
	tr, err := OpenTrainer(job, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr, job
}

func taskCount(t *testing.T, tr *Trainer) int {
	tasks, err := tr.Tasks()
	if err != nil {
		t.Fatal(err)
	}
	return len(tasks)
}

func TestAttachWithoutTrainerIsNotFound(t *testing.T) {
	_, err := Attach(uniqueJob(), 0, "orphan", nil)
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("want ErrNotFound, got %v", err)
	}
	var e *Error
	if !errors.As(err, &e) || e.Message == "" {
		t.Fatalf("want an *Error with the library's message, got %#v", err)
	}
}

func TestSecondTrainerIsBusy(t *testing.T) {
	_, job := openTrainer(t)
	if _, err := OpenTrainer(job, 0, nil); !errors.Is(err, ErrBusy) {
		t.Fatalf("want ErrBusy, got %v", err)
	}
}

func TestBadNamesAreInvalid(t *testing.T) {
	for _, job := range []string{"has space", "nul\x00byte", ""} {
		if _, err := OpenTrainer(job, 0, nil); !errors.Is(err, ErrInvalid) {
			t.Errorf("job %q: want ErrInvalid, got %v", job, err)
		}
	}
	// A runtime directory with a NUL byte would be cut there by C: another directory.
	dir := t.TempDir() + "\x00rest"
	if _, err := OpenTrainer(uniqueJob(), 0, &TrainerOptions{RuntimeDir: dir}); !errors.Is(err, ErrInvalid) ||
		!strings.Contains(err.Error(), "NUL") {
		t.Errorf("trainer runtime dir with a NUL: want ErrInvalid saying so, got %v", err)
	}
	if _, err := Attach(uniqueJob(), 0, "t", &TaskOptions{RuntimeDir: dir}); !errors.Is(err, ErrInvalid) {
		t.Errorf("task runtime dir with a NUL: want ErrInvalid, got %v", err)
	}
}

func TestCloseTwiceAndUseAfterClose(t *testing.T) {
	tr, job := openTrainer(t)
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	if err := tr.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := tr.Begin(0, BubbleOther, MemUnknown); !errors.Is(err, ErrState) {
		t.Fatalf("want ErrState after Close, got %v", err)
	}
	if _, err := Attach(job, 0, "late", nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the hub should be gone, got %v", err)
	}
}

func TestImperativeLoop(t *testing.T) {
	tr, job := openTrainer(t)
	task, err := Attach(job, 0, "imperative", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer task.Close()
	if start, err := task.WaitStart(time.Millisecond); start != nil || err != nil {
		t.Fatalf("want a timeout, got %v %v", start, err)
	}
	started := make(chan *StartInfo, 1)
	go func() {
		s, err := task.WaitStart(20 * time.Second)
		if err != nil {
			t.Error(err)
		}
		started <- s
	}()
	if err := tr.Begin(50*time.Millisecond, BubbleSteady, MemUnknown); err != nil {
		t.Fatal(err)
	}
	s := <-started
	if s == nil || s.Kind != BubbleSteady {
		t.Fatalf("bad start %+v", s)
	}
	if task.ShouldPause() {
		t.Fatal("paused inside the bubble")
	}
	if err := task.ReportStep(time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if err := tr.End(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "should pause", task.ShouldPause)
	if err := task.AckPause(); err != nil {
		t.Fatal(err)
	}
	if st, err := tr.Stats(); err != nil || st.Bubbles != 1 {
		t.Fatalf("stats %+v %v", st, err)
	}
	// Step reports reach the trainer's counters through its service thread.
	eventually(t, "the step report", func() bool { st, _ := tr.Stats(); return st.Steps == 1 })
}

type counting struct {
	steps, pauses, resumes, inits atomic.Int32
	doneAfter                     int32
	finished                      chan error
	failWith                      error
	panicWith                     interface{}
}

func (c *counting) Init() error { c.inits.Add(1); return nil }
func (c *counting) Step(StepInfo) (StepResult, error) {
	if c.failWith != nil {
		return Continue, c.failWith
	}
	if c.panicWith != nil {
		panic(c.panicWith)
	}
	time.Sleep(time.Millisecond)
	if c.steps.Add(1) == c.doneAfter {
		return Done, nil
	}
	return Continue, nil
}
func (c *counting) Pause() error     { c.pauses.Add(1); return nil }
func (c *counting) Resume() error    { c.resumes.Add(1); return nil }
func (c *counting) Finish(err error) { c.finished <- err }

type runResult struct {
	outcome Outcome
	err     error
}

func runInBackground(t *testing.T, job, name string, c *counting) chan runResult {
	done := make(chan runResult, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				done <- runResult{err: fmt.Errorf("panic: %v", p)}
			}
		}()
		task, err := Attach(job, 0, name, nil)
		if err != nil {
			done <- runResult{err: err}
			return
		}
		defer task.Close()
		o, err := task.Run(c)
		done <- runResult{o, err}
	}()
	return done
}

func TestSideTaskRunsInBubblesAndStops(t *testing.T) {
	tr, job := openTrainer(t)
	c := &counting{finished: make(chan error, 1)}
	done := runInBackground(t, job, "iterative", c)
	eventually(t, "attach and init", func() bool { return taskCount(t, tr) == 1 && c.inits.Load() == 1 })
	for i := int32(1); i <= 3; i++ {
		before := c.steps.Load()
		if !bubbleUntil(t, tr, func() bool { return c.steps.Load() > before }) {
			t.Fatal("the task never stepped in a bubble")
		}
		eventually(t, "a pause", func() bool { return c.pauses.Load() == i })
	}
	if c.resumes.Load() != 3 {
		t.Fatalf("resumes = %d", c.resumes.Load())
	}
	// Its steps ran inside bubbles: its own figure says so (from its reports, a moment later).
	eventually(t, "the task's time inside bubbles", func() bool {
		tasks, err := tr.Tasks()
		return err == nil && len(tasks) == 1 && tasks[0].NsInBubbles > 0
	})
	tasks, _ := tr.Tasks()
	if err := tr.StopTask(tasks[0].ID); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.outcome != Stopped {
		t.Fatalf("run = %v, %v", r.outcome, r.err)
	}
	if err := <-c.finished; !errors.Is(err, ErrStopped) {
		t.Fatalf("finish got %v", err)
	}
}

func TestStepDoneFinishes(t *testing.T) {
	tr, job := openTrainer(t)
	c := &counting{doneAfter: 2, finished: make(chan error, 1)}
	done := runInBackground(t, job, "finisher", c)
	eventually(t, "attach", func() bool { return taskCount(t, tr) == 1 })
	tr.Begin(200*time.Millisecond, BubbleOther, MemUnknown)
	r := <-done
	tr.End()
	if r.err != nil || r.outcome != Finished || c.steps.Load() != 2 {
		t.Fatalf("run = %v, %v after %d steps", r.outcome, r.err, c.steps.Load())
	}
	if err := <-c.finished; err != nil {
		t.Fatalf("finish got %v", err)
	}
}

// closesItself closes its own task from a step, as a task shutting down might.
type closesItself struct {
	task   *Task
	steps  int
	closed error
}

func (c *closesItself) Step(StepInfo) (StepResult, error) {
	c.steps++
	if c.steps == 1 {
		c.closed = c.task.Close()
	}
	if c.steps == 3 {
		return Done, nil
	}
	return Continue, nil
}

func TestCloseFromASideTaskMethodIsDoneAsRunReturns(t *testing.T) {
	tr, job := openTrainer(t)
	c := &closesItself{}
	done := make(chan runResult, 1)
	go func() {
		task, err := Attach(job, 0, "closer", nil)
		if err != nil {
			done <- runResult{err: err}
			return
		}
		c.task = task
		o, err := task.Run(c)
		// Closed once Run returned: the handle is gone, and a second Close does nothing.
		if _, herr := task.handle(); herr == nil {
			err = fmt.Errorf("the task is still attached after Run returned")
		}
		if cerr := task.Close(); cerr != nil {
			err = cerr
		}
		done <- runResult{o, err}
	}()
	eventually(t, "attach", func() bool { return taskCount(t, tr) == 1 })
	tr.Begin(200*time.Millisecond, BubbleOther, MemUnknown)
	r := <-done
	tr.End()
	// The run went on after the Close (the runtime still used the handle): it finished.
	if r.err != nil || r.outcome != Finished || c.steps != 3 || c.closed != nil {
		t.Fatalf("run = %v, %v after %d steps (close said %v)", r.outcome, r.err, c.steps, c.closed)
	}
	eventually(t, "detach", func() bool { return taskCount(t, tr) == 0 })
}

type idler struct{ idles int }

func (i *idler) Step(StepInfo) (StepResult, error) { return Continue, nil }
func (i *idler) Idle() (StepResult, error) {
	i.idles++
	if i.idles == 3 {
		return Done, nil
	}
	return Continue, nil
}

func TestIdleRunsWhileWaitingAndDoneFinishes(t *testing.T) {
	_, job := openTrainer(t)
	task, err := Attach(job, 0, "idler", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer task.Close()
	i := &idler{}
	// No bubble is ever begun: only Idle can end the run.
	if o, err := task.Run(i); err != nil || o != Finished || i.idles != 3 {
		t.Fatalf("run = %v, %v after %d idle calls", o, err, i.idles)
	}
}

var errLost = errors.New("lost the data")

func TestStepErrorComesBackFromRun(t *testing.T) {
	tr, job := openTrainer(t)
	c := &counting{failWith: errLost, finished: make(chan error, 1)}
	done := runInBackground(t, job, "failing", c)
	eventually(t, "attach", func() bool { return taskCount(t, tr) == 1 })
	tr.Begin(50*time.Millisecond, BubbleOther, MemUnknown)
	r := <-done
	tr.End()
	if !errors.Is(r.err, ErrCallbackFailed) || !errors.Is(r.err, errLost) {
		t.Fatalf("want ErrCallbackFailed wrapping errLost, got %v", r.err)
	}
	// Finish still ran, told how the run ended: its cleanup is not skipped.
	select {
	case err := <-c.finished:
		if !errors.Is(err, ErrCallbackFailed) {
			t.Fatalf("finish got %v, want ErrCallbackFailed", err)
		}
	default:
		t.Fatal("Finish was not called after Step failed")
	}
}

func TestStepPanicIsRepanickedAfterRun(t *testing.T) {
	tr, job := openTrainer(t)
	c := &counting{panicWith: "on purpose", finished: make(chan error, 1)}
	done := runInBackground(t, job, "panicking", c)
	eventually(t, "attach", func() bool { return taskCount(t, tr) == 1 })
	tr.Begin(50*time.Millisecond, BubbleOther, MemUnknown)
	r := <-done
	tr.End()
	if r.err == nil || r.err.Error() != "panic: on purpose" {
		t.Fatalf("want the step's panic, got %v", r.err)
	}
	select {
	case <-c.finished:
	default:
		t.Fatal("Finish was not called after Step panicked")
	}
}

func TestTasksListsAttachedTasks(t *testing.T) {
	tr, job := openTrainer(t)
	a, err := Attach(job, 0, "alpha", &TaskOptions{Priority: 5, MemNeed: 4096})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Attach(job, 0, "beta", nil)
	if err != nil {
		t.Fatal(err)
	}
	// The trainer's service thread lists a task shortly after its attach returns.
	eventually(t, "both tasks listed", func() bool { return taskCount(t, tr) == 2 })
	tasks, err := tr.Tasks()
	if err != nil || len(tasks) != 2 {
		t.Fatalf("tasks %+v %v", tasks, err)
	}
	byName := map[string]TaskInfo{}
	for _, ti := range tasks {
		byName[ti.Name] = ti
	}
	if byName["alpha"].Priority != 5 || byName["alpha"].MemNeed != 4096 || int(byName["alpha"].PID) != os.Getpid() {
		t.Fatalf("alpha = %+v", byName["alpha"])
	}
	if byName["alpha"].ID == byName["beta"].ID {
		t.Fatal("ids collide")
	}
	b.Close()
	eventually(t, "beta gone", func() bool { return taskCount(t, tr) == 1 })
}

func TestSetScheduleAcceptsA1F1BPipelineAndNamesWhatItRejects(t *testing.T) {
	tr, _ := openTrainer(t)
	sc := Schedule{Kind: Schedule1F1B, Stages: 4, Microbatches: 8, Stage: 1,
		Fwd: 2 * time.Millisecond, Bwd: 4 * time.Millisecond}
	if err := tr.SetSchedule(sc); err != nil {
		t.Fatal(err)
	}
	sc.Stage = 4
	err := tr.SetSchedule(sc)
	var e *Error
	if !errors.Is(err, ErrInvalid) || !errors.As(err, &e) || !strings.Contains(e.Message, "stage") {
		t.Fatalf("want ErrInvalid naming the stage, got %v", err)
	}
	// Times unknown (measured), one bubble per receive; a forward time alone is refused.
	sc = Schedule{Kind: Schedule1F1B, Stages: 4, Microbatches: 8, Stage: 1,
		Bubbles: ScheduleBubblesReceives}
	if err := tr.SetSchedule(sc); err != nil {
		t.Fatal(err)
	}
	sc.Fwd = time.Millisecond
	if err := tr.SetSchedule(sc); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "bwd_ns") {
		t.Fatalf("want ErrInvalid naming bwd_ns, got %v", err)
	}
}

// Bubble marks wait as a bubble, and its error is Begin's or End's: wait runs even when Begin
// fails (it is the caller's receive), and End's error is not dropped.
func TestBubbleRunsWaitAndReportsBeginAndEndErrors(t *testing.T) {
	tr, _ := openTrainer(t)
	waited := 0
	if err := tr.Bubble(time.Millisecond, BubbleSteady, func() { waited++ }); err != nil {
		t.Fatal(err)
	}
	if s, err := tr.Stats(); err != nil || s.Bubbles != 1 || waited != 1 {
		t.Fatalf("want one bubble and one wait, got %+v, %v, %d waits", s, err, waited)
	}
	// End fails: the trainer is closed during the wait.
	err := tr.Bubble(time.Millisecond, BubbleSteady, func() {
		waited++
		if err := tr.Close(); err != nil {
			t.Error(err)
		}
	})
	if !errors.Is(err, ErrState) || waited != 2 {
		t.Fatalf("End's error: want ErrState after 2 waits, got %v after %d", err, waited)
	}
	// Begin fails: wait still runs, and Begin's error comes back.
	err = tr.Bubble(time.Millisecond, BubbleSteady, func() { waited++ })
	if !errors.Is(err, ErrState) || waited != 3 {
		t.Fatalf("Begin's error: want ErrState after 3 waits, got %v after %d", err, waited)
	}
}

// Close on one goroutine while others are inside calls: it waits for them, and every call after
// it fails with ErrState (none reaches a freed hub).
func TestCloseWaitsForCallsInFlightOnOtherGoroutines(t *testing.T) {
	tr, _ := openTrainer(t)
	var wg sync.WaitGroup
	var calls atomic.Int64
	errs := make(chan error, 4)
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				calls.Add(1)
				if _, err := tr.Stats(); err != nil {
					errs <- err
					return
				}
				if _, err := tr.Tasks(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	eventually(t, "the callers to be looping", func() bool { return calls.Load() >= 100 })
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if !errors.Is(err, ErrState) {
			t.Fatalf("a call after Close got %v, want ErrState", err)
		}
	}
	if err := tr.Begin(time.Millisecond, BubbleOther, MemUnknown); !errors.Is(err, ErrState) {
		t.Fatalf("Begin after Close got %v", err)
	}
}

// A Stats call holds the handle and has not called into the library yet when Close comes on
// another goroutine: Close must wait for it (watched through its wait) and free the hub only
// once the call returned, with the live hub's figures. Held, not raced: the hooks stop the call
// exactly there, so the test fails every time Close frees early.
func TestCloseFreesTheHubOnlyAfterTheCallInFlight(t *testing.T) {
	tr, _ := openTrainer(t)
	entered, release := make(chan struct{}), make(chan struct{})
	waiting, freed := make(chan struct{}), make(chan struct{})
	var waitOnce, freeOnce sync.Once
	testHookStatsHeld = func() {
		close(entered)
		<-release
	}
	testHookCloseWaits = func() { waitOnce.Do(func() { close(waiting) }) }
	testHookCloseFrees = func() { freeOnce.Do(func() { close(freed) }) }
	defer func() { testHookStatsHeld, testHookCloseWaits, testHookCloseFrees = nil, nil, nil }()

	type result struct {
		stats TrainerStats
		err   error
	}
	held := make(chan result, 1)
	go func() {
		s, err := tr.Stats()
		held <- result{s, err}
	}()
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the Stats call never reached its hook")
	}
	closed := make(chan error, 1)
	go func() { closed <- tr.Close() }()
	// Close either frees at once (wrong) or waits for the call: whichever it does comes first.
	select {
	case <-waiting:
	case <-freed:
		t.Fatal("the hub was freed under a call in flight")
	case <-time.After(20 * time.Second):
		t.Fatal("Close neither waited nor freed")
	}
	close(release)
	// The held call ran on the live hub (a freed one would have failed it, or worse).
	r := <-held
	if r.err != nil || r.stats.TasksAttached != 0 {
		t.Fatalf("the held Stats call got %+v, %v; want the live hub's figures", r.stats, r.err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	select {
	case <-freed:
	default:
		t.Fatal("Close returned without freeing the hub")
	}
}
