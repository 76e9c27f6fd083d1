// A toy training loop that lends the time it waits on its pipeline neighbours to side tasks.
package main

import (
	"fmt"
	"log"
	"os"
	"time"

	"libbubble/go/bubble"
)

func main() {
	job := append(os.Args[1:], "example")[0]
	trainer, err := bubble.OpenTrainer(job, 0, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer trainer.Close()
	fmt.Println("hub open")
	for tasks, _ := trainer.Tasks(); len(tasks) == 0; tasks, _ = trainer.Tasks() {
		time.Sleep(10 * time.Millisecond) // wait for a side task
	}
	for it := 0; it < 20; it++ {
		trainer.Iteration()
		time.Sleep(5 * time.Millisecond) // forward and backward compute
		trainer.Bubble(5*time.Millisecond, bubble.BubbleSteady, func() {
			time.Sleep(5 * time.Millisecond) // waiting for the next stage: a bubble
		})
	}
	s, _ := trainer.Stats()
	fmt.Printf("%d bubbles, %d side-task steps\n", s.Bubbles, s.Steps)
}
