//! A toy training loop that lends the time it waits on its pipeline neighbours to side tasks.
use std::thread::sleep;
use std::time::Duration;

use bubble::{BubbleKind, Trainer, TrainerOptions};

fn main() -> Result<(), bubble::Error> {
    let job = std::env::args().nth(1).unwrap_or_else(|| "example".into());
    let mut trainer = Trainer::open(&job, 0, &TrainerOptions::default())?;
    println!("hub open");
    while trainer.tasks()?.is_empty() {
        sleep(Duration::from_millis(10)); // wait for a side task
    }
    for _ in 0..20 {
        trainer.iteration()?;
        sleep(Duration::from_millis(5)); // forward and backward compute
        let _bubble = trainer.bubble(Duration::from_millis(5), BubbleKind::Steady)?;
        sleep(Duration::from_millis(5)); // waiting for the next stage: a bubble
    }
    let s = trainer.stats()?;
    println!("{} bubbles, {} side-task steps", s.bubbles, s.steps);
    Ok(())
}
