// A side task that sums squares, one small chunk per step, only inside the trainer's bubbles.
package main

import (
	"fmt"
	"log"
	"os"

	"libbubble/go/bubble"
)

type sumOfSquares struct{ next, total, steps uint64 }

func (s *sumOfSquares) Step(bubble.StepInfo) (bubble.StepResult, error) {
	for i := 0; i < 10000; i, s.next = i+1, s.next+1 {
		s.total += s.next * s.next
	}
	s.steps++
	return bubble.Continue, nil
}

func main() {
	job := append(os.Args[1:], "example")[0]
	task, err := bubble.Attach(job, 0, "go-side-task", nil)
	if err != nil {
		log.Fatal(err)
	}
	defer task.Close()
	work := &sumOfSquares{}
	if _, err := task.Run(work); err != nil { // until the trainer stops the task or leaves
		log.Fatal(err)
	}
	fmt.Printf("%d steps, sum %d\n", work.steps, work.total)
}
