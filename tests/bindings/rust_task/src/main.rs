//! The Rust side task of the cross-language test; same protocol as xlang_task.c, plus the
//! grant-run mode (an iterative task that fills its host grant in a step).
use std::time::{Duration, Instant};

use bubble::{SideTask, Status, Step, StepInfo, Task, TaskOptions, TaskResult};

fn emit(line: &str) {
    println!("{line}"); // Rust's stdout is line-buffered even into a pipe
}

fn work(step: Duration) {
    let slow = std::env::var_os("BUBBLE_XLANG_SLOW_FILE");
    let step = if slow.map_or(false, |p| std::path::Path::new(&p).exists()) {
        emit("slow");
        Duration::from_secs(60)
    } else {
        step
    };
    std::thread::sleep(step);
}

struct Xlang(Duration);

impl SideTask for Xlang {
    fn step(&mut self, info: &StepInfo) -> TaskResult<Step> {
        work(self.0);
        emit(&format!("step {}", info.bubble_seq));
        Ok(Step::Continue)
    }
    fn pause(&mut self) -> TaskResult<()> {
        emit("pause");
        Ok(())
    }
}

const GRANT_BYTES: u64 = 64 * 1024;

/// Fills each new grant with the test's pattern in a step.
struct GrantFiller {
    seed: u32,
    written: u64,
}

impl SideTask for GrantFiller {
    fn step(&mut self, info: &StepInfo) -> TaskResult<Step> {
        let grant = info.grant.ok_or("started without a grant")?;
        if grant.id != self.written {
            let mut mem = info.grant_memory().ok_or("the grant is not host memory")?;
            for (i, w) in mem.chunks_exact_mut(4).enumerate() {
                w.copy_from_slice(&(self.seed ^ (i as u32).wrapping_mul(2654435761)).to_le_bytes());
            }
            self.written = grant.id;
            emit(&format!("granted {}", grant.id));
        }
        std::thread::sleep(Duration::from_millis(1));
        Ok(Step::Continue)
    }
    fn pause(&mut self) -> TaskResult<()> {
        emit("pause");
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        eprintln!("usage: {} JOB RANK NAME run|loop STEP_MS | grant-run SEED", args[0]);
        std::process::exit(2);
    }
    let step = Duration::from_millis(args[5].parse()?);
    let grant_run = args[4] == "grant-run";
    let opts = TaskOptions { mem_need: if grant_run { GRANT_BYTES } else { 0 }, ..Default::default() };
    let mut task = Task::attach(&args[1], args[2].parse()?, &args[3], &opts)?;
    emit("attached");
    if grant_run {
        let outcome = task.run(&mut GrantFiller { seed: args[5].parse()?, written: 0 })?;
        assert_eq!(outcome, bubble::Outcome::Stopped);
    } else if args[4] == "run" {
        let outcome = task.run(&mut Xlang(step))?;
        assert_eq!(outcome, bubble::Outcome::Stopped);
    } else {
        loop {
            let start = match task.wait_start(None) {
                Ok(Some(start)) => start,
                Ok(None) => continue,
                Err(e) if e.status == Status::Stopped => break,
                Err(e) => return Err(e.into()),
            };
            while !task.should_pause() {
                let t0 = Instant::now();
                work(step);
                task.report_step(t0.elapsed())?;
                emit(&format!("step {}", start.bubble_seq));
            }
            task.ack_pause()?;
            emit("pause");
        }
    }
    emit("stopped");
    task.detach()?;
    Ok(())
}
