//! The safe crate against the real library: trainer and task in one process, tasks on threads.
//! Each test uses its own runtime directory (through the options, not the process environment,
//! since tests run in parallel).
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bubble::{
    BubbleKind, Outcome, SideTask, Status, Step, StepInfo, Task, TaskOptions, TaskResult, Trainer,
    TrainerOptions,
};

struct Env {
    dir: PathBuf,
    job: String,
}

impl Env {
    fn new() -> Env {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("bb-rs-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Env { dir, job: format!("rs-{}-{n}", std::process::id()) }
    }
    fn dir(&self) -> Option<String> {
        Some(self.dir.to_str().unwrap().to_owned())
    }
    fn trainer(&self) -> Trainer {
        Trainer::open(&self.job, 0, &TrainerOptions { runtime_dir: self.dir(), ..Default::default() }).unwrap()
    }
    fn task_options(&self) -> TaskOptions {
        TaskOptions { runtime_dir: self.dir(), ..Default::default() }
    }
    fn attach(&self, name: &str) -> bubble::Result<Task> {
        Task::attach(&self.job, 0, name, &self.task_options())
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn eventually(pred: impl FnMut() -> bool) -> bool {
    eventually_within(Duration::from_secs(20), pred)
}

fn eventually_within(limit: Duration, mut pred: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while !pred() {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// Opens bubbles until pred() holds inside one. A task that has not yet acked the pause of the
/// previous bubble is (rightly) not started, and nothing on the trainer side tells when that
/// ack lands: so a bubble in which nothing started is closed and another one opened.
fn bubble_until(trainer: &mut Trainer, mut pred: impl FnMut() -> bool) -> bool {
    for _ in 0..20 {
        let guard = trainer.bubble(Duration::from_millis(50), BubbleKind::Steady).unwrap();
        let ok = eventually_within(Duration::from_secs(1), &mut pred);
        guard.end().unwrap();
        if ok {
            return true;
        }
    }
    false
}

#[derive(Default)]
struct Counts {
    inits: u32,
    steps: u32,
    pauses: u32,
    resumes: u32,
    finished: Option<Option<Status>>,
}

struct Counting {
    counts: Arc<Mutex<Counts>>,
    done_after: Option<u32>,
}

impl SideTask for Counting {
    fn init(&mut self) -> TaskResult<()> {
        self.counts.lock().unwrap().inits += 1;
        Ok(())
    }
    fn step(&mut self, _info: &StepInfo) -> TaskResult<Step> {
        let mut c = self.counts.lock().unwrap();
        c.steps += 1;
        Ok(if Some(c.steps) == self.done_after { Step::Done } else { Step::Continue })
    }
    fn pause(&mut self) -> TaskResult<()> {
        self.counts.lock().unwrap().pauses += 1;
        Ok(())
    }
    fn resume(&mut self) -> TaskResult<()> {
        self.counts.lock().unwrap().resumes += 1;
        Ok(())
    }
    fn finish(&mut self, status: Option<Status>) {
        self.counts.lock().unwrap().finished = Some(status);
    }
}

#[test]
fn attach_without_a_trainer_is_not_found_with_a_message() {
    let env = Env::new();
    let err = env.attach("orphan").unwrap_err();
    assert_eq!(err.status, Status::NotFound);
    assert!(!err.message.is_empty());
    assert!(err.to_string().contains("BB_E_NOT_FOUND"));
}

#[test]
fn a_second_trainer_on_one_hub_is_busy() {
    let env = Env::new();
    let _t = env.trainer();
    let opts = TrainerOptions { runtime_dir: env.dir(), ..Default::default() };
    let err = Trainer::open(&env.job, 0, &opts).unwrap_err();
    assert_eq!(err.status, Status::Busy);
}

#[test]
fn bad_names_are_invalid() {
    let env = Env::new();
    let opts = TrainerOptions { runtime_dir: env.dir(), ..Default::default() };
    assert_eq!(Trainer::open("has space", 0, &opts).unwrap_err().status, Status::Invalid);
    assert_eq!(Trainer::open("nul\0byte", 0, &opts).unwrap_err().status, Status::Invalid);
}

#[test]
fn dropping_the_trainer_removes_the_hub() {
    let env = Env::new();
    drop(env.trainer());
    assert_eq!(env.attach("late").unwrap_err().status, Status::NotFound);
    env.trainer().close().unwrap();
}

#[test]
fn imperative_wait_start_should_pause_ack_pause() {
    let env = Env::new();
    let mut trainer = env.trainer();
    let mut task = env.attach("imperative").unwrap();
    assert!(task.wait_start(Some(Duration::from_millis(1))).unwrap().is_none());
    let waiter = std::thread::spawn(move || {
        let start = task.wait_start(Some(Duration::from_secs(20))).unwrap();
        (task, start)
    });
    trainer.begin(Duration::from_millis(50), BubbleKind::Steady, None).unwrap();
    let (mut task, start) = waiter.join().unwrap();
    let start = start.expect("started");
    assert_eq!(start.kind, BubbleKind::Steady);
    assert!(!task.should_pause());
    task.report_step(Duration::from_millis(1)).unwrap();
    trainer.end().unwrap();
    assert!(eventually(|| task.should_pause()));
    task.ack_pause().unwrap();
    assert_eq!(trainer.stats().unwrap().bubbles, 1);
    // Step reports reach the trainer's counters through its service thread.
    assert!(eventually(|| trainer.stats().unwrap().steps == 1));
    task.detach().unwrap();
}

#[test]
fn side_task_steps_in_bubbles_pauses_after_them_and_stops() {
    let env = Env::new();
    let mut trainer = env.trainer();
    let counts = Arc::new(Mutex::new(Counts::default()));
    let (opts, job, c2) = (env.task_options(), env.job.clone(), counts.clone());
    let runner = std::thread::spawn(move || {
        let mut task = Task::attach(&job, 0, "iterative", &opts).unwrap();
        task.run(&mut Counting { counts: c2, done_after: None })
    });
    assert!(eventually(|| counts.lock().unwrap().inits == 1));
    for i in 1..=3 {
        let before = counts.lock().unwrap().steps;
        assert!(bubble_until(&mut trainer, || counts.lock().unwrap().steps > before));
        assert!(eventually(|| counts.lock().unwrap().pauses == i));
    }
    assert_eq!(counts.lock().unwrap().resumes, 3);
    let id = trainer.tasks().unwrap()[0].id;
    trainer.stop_task(id).unwrap();
    assert_eq!(runner.join().unwrap().unwrap(), Outcome::Stopped);
    assert_eq!(counts.lock().unwrap().finished, Some(Some(Status::Stopped)));
}

#[test]
fn step_done_finishes_the_run() {
    let env = Env::new();
    let mut trainer = env.trainer();
    let counts = Arc::new(Mutex::new(Counts::default()));
    let (opts, job, c2) = (env.task_options(), env.job.clone(), counts.clone());
    let runner = std::thread::spawn(move || {
        let mut task = Task::attach(&job, 0, "finisher", &opts).unwrap();
        task.run(&mut Counting { counts: c2, done_after: Some(2) })
    });
    assert!(eventually(|| trainer.tasks().unwrap().len() == 1));
    trainer.begin(Duration::from_millis(200), BubbleKind::Other, None).unwrap();
    assert_eq!(runner.join().unwrap().unwrap(), Outcome::Finished);
    trainer.end().unwrap();
    let c = counts.lock().unwrap();
    assert_eq!(c.steps, 2);
    assert_eq!(c.finished, Some(None));
}

#[derive(Debug)]
struct Lost;
impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("lost the data")
    }
}
impl std::error::Error for Lost {}

#[test]
fn an_error_from_step_comes_back_from_run() {
    struct Failing;
    impl SideTask for Failing {
        fn step(&mut self, _: &StepInfo) -> TaskResult<Step> {
            Err(Box::new(Lost))
        }
    }
    let env = Env::new();
    let mut trainer = env.trainer();
    let (opts, job) = (env.task_options(), env.job.clone());
    let runner = std::thread::spawn(move || Task::attach(&job, 0, "failing", &opts).unwrap().run(&mut Failing));
    assert!(eventually(|| trainer.tasks().unwrap().len() == 1));
    trainer.begin(Duration::from_millis(50), BubbleKind::Other, None).unwrap();
    let err = runner.join().unwrap().unwrap_err();
    trainer.end().unwrap();
    assert_eq!(err.status, Status::Callback);
    let source = std::error::Error::source(&err).expect("the step's error is the source");
    assert!(source.downcast_ref::<Lost>().is_some());
}

#[test]
fn a_panic_in_step_resumes_after_run() {
    struct Panicking;
    impl SideTask for Panicking {
        fn step(&mut self, _: &StepInfo) -> TaskResult<Step> {
            panic!("step panicked on purpose");
        }
    }
    let env = Env::new();
    let mut trainer = env.trainer();
    let (opts, job) = (env.task_options(), env.job.clone());
    let runner = std::thread::spawn(move || {
        let mut task = Task::attach(&job, 0, "panicking", &opts).unwrap();
        let _ = task.run(&mut Panicking);
    });
    assert!(eventually(|| trainer.tasks().unwrap().len() == 1));
    trainer.begin(Duration::from_millis(50), BubbleKind::Other, None).unwrap();
    let payload = runner.join().unwrap_err();
    trainer.end().unwrap();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"step panicked on purpose"));
}

#[test]
fn tasks_lists_names_priorities_and_detach_removes_them() {
    let env = Env::new();
    let trainer = env.trainer();
    let alpha = Task::attach(&env.job, 0, "alpha", &TaskOptions { priority: 5, mem_need: 4096, ..env.task_options() }).unwrap();
    let beta = env.attach("beta").unwrap();
    // The trainer's service thread lists a task shortly after its attach returns.
    assert!(eventually(|| trainer.tasks().unwrap().len() == 2));
    let mut tasks = trainer.tasks().unwrap();
    tasks.sort_by(|a, b| a.name.cmp(&b.name));
    assert_eq!(tasks.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["alpha", "beta"]);
    assert_eq!(tasks[0].priority, 5);
    assert_eq!(tasks[0].mem_need, 4096);
    assert_eq!(tasks[0].pid, std::process::id() as i32);
    assert_ne!(tasks[0].id, tasks[1].id);
    drop(beta);
    assert!(eventually(|| trainer.tasks().unwrap().len() == 1));
    alpha.detach().unwrap();
}
