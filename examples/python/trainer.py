"""A toy training loop that lends the time it waits on its pipeline neighbours to side tasks."""
import sys
import time

import bubble

job = sys.argv[1] if len(sys.argv) > 1 else "example"
with bubble.Trainer(job, 0) as trainer:
    print("hub open", flush=True)
    while not trainer.tasks():
        time.sleep(0.01)  # wait for a side task
    for it in range(20):
        trainer.iteration()
        time.sleep(0.005)  # forward and backward compute
        with trainer.bubble(0.005, kind=bubble.BubbleKind.STEADY):
            time.sleep(0.005)  # waiting for the next stage: a bubble
    s = trainer.stats()
    print(f"{s.bubbles} bubbles, {s.steps} side-task steps")
