//! A side task that sums squares, one small chunk per step, only inside the trainer's bubbles.
use bubble::{SideTask, Step, StepInfo, Task, TaskOptions, TaskResult};

#[derive(Default)]
struct SumOfSquares {
    next: u64,
    total: u64,
    steps: u64,
}

impl SideTask for SumOfSquares {
    fn step(&mut self, _info: &StepInfo) -> TaskResult<Step> {
        for _ in 0..10_000 {
            self.total = self.total.wrapping_add(self.next * self.next);
            self.next += 1;
        }
        self.steps += 1;
        Ok(Step::Continue)
    }
}

fn main() -> Result<(), bubble::Error> {
    let job = std::env::args().nth(1).unwrap_or_else(|| "example".into());
    let mut task = Task::attach(&job, 0, "rust-side-task", &TaskOptions::default())?;
    let mut work = SumOfSquares::default();
    task.run(&mut work)?; // until the trainer stops the task or leaves
    println!("{} steps, sum {}", work.steps, work.total);
    Ok(())
}
