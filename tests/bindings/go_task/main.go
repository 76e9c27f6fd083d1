// The Go side task of the cross-language test; same protocol as xlang_task.c.
package main

import (
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

func main() {
	if len(os.Args) != 6 {
		fmt.Fprintf(os.Stderr, "usage: %s JOB RANK NAME run|loop STEP_MS\n", os.Args[0])
		os.Exit(2)
	}
	rank, _ := strconv.Atoi(os.Args[2])
	ms, _ := strconv.Atoi(os.Args[5])
	step := time.Duration(ms) * time.Millisecond
	task, err := bubble.Attach(os.Args[1], uint32(rank), os.Args[3], nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer task.Close()
	fmt.Println("attached")
	if os.Args[4] == "run" {
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
