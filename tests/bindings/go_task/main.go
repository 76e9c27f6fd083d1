// The Go side task of the cross-language test; same protocol as xlang_task.c, plus the
// grant-loop mode (an imperative task that fills its host grant, then acks its revoke).
package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"libbubble/go/bubble"
)

func work(step time.Duration) {
	if slow := os.Getenv("BUBBLE_XLANG_SLOW_FILE"); slow != "" {
		if _, err := os.Stat(slow); err == nil {
			fmt.Println("slow")
			step = time.Minute
		}
	}
	time.Sleep(step)
}

type xlang struct{ step time.Duration }

func (x xlang) Step(info bubble.StepInfo) (bubble.StepResult, error) {
	work(x.step)
	fmt.Printf("step %d\n", info.BubbleSeq)
	return bubble.Continue, nil
}

func (x xlang) Pause() error {
	fmt.Println("pause")
	return nil
}

const grantBytes = 64 * 1024

// grantLoop fills the grant a start names with the test's pattern, then gives it back when
// revoked, and waits until told to stop.
func grantLoop(task *bubble.Task, seed uint32) error {
	start, err := task.WaitStart(-1)
	if err != nil {
		return err
	}
	g, err := task.Grant()
	if err != nil {
		return err
	}
	if g == nil || start.Grant == nil || g.ID != start.Grant.ID || g.Ptr != start.Grant.Ptr {
		return fmt.Errorf("started with grant %+v, Grant() says %+v", start.Grant, g)
	}
	mem := g.Memory()
	for i := 0; i+4 <= len(mem); i += 4 {
		binary.LittleEndian.PutUint32(mem[i:], seed^uint32(i/4)*2654435761)
	}
	fmt.Printf("granted %d\n", g.ID)
	for !task.ShouldPause() {
		time.Sleep(time.Millisecond)
	}
	if err := task.AckPause(); err != nil {
		return err
	}
	fmt.Println("pause")
	for ; ; time.Sleep(time.Millisecond) {
		if g, err = task.Grant(); err != nil {
			return err
		}
		if g.Revoking() {
			if err := task.AckRevoke(); err != nil {
				return err
			}
			fmt.Printf("acked %d\n", g.ID)
			break
		}
	}
	for {
		if _, err := task.WaitStart(-1); err != nil {
			return err
		}
	}
}

func main() {
	if len(os.Args) != 6 {
		fmt.Fprintf(os.Stderr, "usage: %s JOB RANK NAME run|loop STEP_MS | grant-loop SEED\n", os.Args[0])
		os.Exit(2)
	}
	rank, _ := strconv.Atoi(os.Args[2])
	ms, _ := strconv.Atoi(os.Args[5])
	step := time.Duration(ms) * time.Millisecond
	var opts bubble.TaskOptions
	if os.Args[4] == "grant-loop" {
		opts.MemNeed = grantBytes
	}
	task, err := bubble.Attach(os.Args[1], uint32(rank), os.Args[3], &opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer task.Close()
	fmt.Println("attached")
	if os.Args[4] == "grant-loop" {
		if err := grantLoop(task, uint32(ms)); !errors.Is(err, bubble.ErrStopped) {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	} else if os.Args[4] == "run" {
		outcome, err := task.Run(xlang{step})
		if err != nil || outcome != bubble.Stopped {
			fmt.Fprintln(os.Stderr, "run ended with", outcome, err)
			os.Exit(1)
		}
	} else {
		for {
			start, err := task.WaitStart(-1)
			if errors.Is(err, bubble.ErrStopped) {
				break
			} else if err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
			for !task.ShouldPause() {
				t0 := time.Now()
				work(step)
				task.ReportStep(time.Since(t0))
				fmt.Printf("step %d\n", start.BubbleSeq)
			}
			task.AckPause()
			fmt.Println("pause")
		}
	}
	fmt.Println("stopped")
}
