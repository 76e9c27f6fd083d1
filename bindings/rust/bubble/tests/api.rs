//! The safe crate against the real library: trainer and task in one process, tasks on threads.
//! Each test uses its own runtime directory (through the options, not the process environment,
//! since tests run in parallel).
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bubble::{
    BubbleKind, GrantBackend, GrantState, LendOptions, Outcome, Schedule, ScheduleBubbles,
    SideTask, Status, Step, StepInfo, Task, TaskOptions, TaskResult, Trainer, TrainerOptions,
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
fn a_shared_trainer_makes_its_bubble_calls_through_its_one_bubble_thread() {
    // Both may move to the thread that makes the bubble calls.
    fn is_send<T: Send>() {}
    is_send::<bubble::BubbleThread<'static>>();
    is_send::<bubble::BubbleGuard<'static>>();
    let env = Env::new();
    let trainer = Arc::new(env.trainer());
    let bubbles_thread = {
        let trainer = Arc::clone(&trainer);
        std::thread::spawn(move || {
            let mut b = trainer.bubble_thread().unwrap();
            b.iteration().unwrap();
            for _ in 0..50 {
                let guard = b.bubble(Duration::from_millis(1), BubbleKind::Steady).unwrap();
                std::thread::sleep(Duration::from_micros(200));
                drop(guard);
                b.begin(Duration::from_millis(1), BubbleKind::Other, Some(1 << 20)).unwrap();
                b.end().unwrap();
            }
        })
    };
    // Meanwhile, the other calls from this thread, on the same trainer.
    let mut looked = 0;
    while !bubbles_thread.is_finished() {
        assert!(trainer.tasks().unwrap().is_empty());
        trainer.stats().unwrap();
        looked += 1;
    }
    bubbles_thread.join().unwrap();
    assert!(looked > 0);
    assert_eq!(trainer.stats().unwrap().bubbles, 100);
    // One at a time: a second is refused while the first lives, and may be taken after it.
    let first = trainer.bubble_thread().unwrap();
    let busy = trainer.bubble_thread().unwrap_err();
    assert_eq!(busy.status, Status::Busy);
    assert!(busy.message.contains("one thread at a time"), "{}", busy.message);
    drop(first);
    let mut again = trainer.bubble_thread().unwrap();
    let mut task = env.attach("shared").unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _g = again.bubble(Duration::from_millis(50), BubbleKind::Steady).unwrap();
            assert!(task.wait_start(Some(Duration::from_secs(20))).unwrap().is_some());
        });
    });
    assert_eq!(again.trainer().stats().unwrap().bubbles, 101);
    drop(again);
    task.detach().unwrap();
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
    // Its steps ran inside bubbles: its own figure says so (from its reports, a moment later).
    assert!(eventually(|| trainer.tasks().unwrap()[0].ns_in_bubbles > 0));
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

#[test]
fn a_long_step_sees_its_bubble_end_through_its_info_and_returns_early() {
    struct Long {
        started: Arc<AtomicBool>,
        saw_pause: Arc<AtomicBool>,
    }
    impl SideTask for Long {
        fn step(&mut self, info: &StepInfo<'_>) -> TaskResult<Step> {
            self.started.store(true, Ordering::SeqCst);
            // Pieces of work until the bubble ends (a cap keeps a broken runtime from hanging).
            let cap = Instant::now() + Duration::from_secs(30);
            while !info.should_pause() && Instant::now() < cap {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.saw_pause.store(info.should_pause(), Ordering::SeqCst);
            Ok(Step::Done)
        }
    }
    let env = Env::new();
    let mut trainer = env.trainer();
    let started = Arc::new(AtomicBool::new(false));
    let saw_pause = Arc::new(AtomicBool::new(false));
    let (opts, job) = (env.task_options(), env.job.clone());
    let (s2, p2) = (started.clone(), saw_pause.clone());
    let runner = std::thread::spawn(move || {
        let mut task = Task::attach(&job, 0, "long-step", &opts).unwrap();
        task.run(&mut Long { started: s2, saw_pause: p2 })
    });
    assert!(eventually(|| trainer.tasks().unwrap().len() == 1));
    trainer.begin(Duration::from_secs(10), BubbleKind::Other, None).unwrap();
    assert!(eventually(|| started.load(Ordering::SeqCst)));
    assert!(!saw_pause.load(Ordering::SeqCst));
    trainer.end().unwrap();
    assert_eq!(runner.join().unwrap().unwrap(), Outcome::Finished);
    assert!(saw_pause.load(Ordering::SeqCst));
}

#[test]
fn idle_runs_while_the_task_waits_and_done_finishes_the_run() {
    struct Idler {
        idles: u32,
    }
    impl SideTask for Idler {
        fn step(&mut self, _: &StepInfo<'_>) -> TaskResult<Step> {
            Ok(Step::Continue)
        }
        fn idle(&mut self) -> TaskResult<Step> {
            self.idles += 1;
            Ok(if self.idles == 3 { Step::Done } else { Step::Continue })
        }
    }
    let env = Env::new();
    let _trainer = env.trainer();
    let mut task = Task::attach(&env.job, 0, "idler", &env.task_options()).unwrap();
    let mut idler = Idler { idles: 0 };
    // No bubble is ever begun: only idle can end the run.
    assert_eq!(task.run(&mut idler).unwrap(), Outcome::Finished);
    assert_eq!(idler.idles, 3);
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
fn an_error_from_step_comes_back_from_run_and_finish_still_runs() {
    struct Failing {
        finished: Option<Option<Status>>,
    }
    impl SideTask for Failing {
        fn step(&mut self, _: &StepInfo) -> TaskResult<Step> {
            Err(Box::new(Lost))
        }
        fn finish(&mut self, status: Option<Status>) {
            self.finished = Some(status);
        }
    }
    let env = Env::new();
    let mut trainer = env.trainer();
    let (opts, job) = (env.task_options(), env.job.clone());
    let runner = std::thread::spawn(move || {
        let mut failing = Failing { finished: None };
        let result = Task::attach(&job, 0, "failing", &opts).unwrap().run(&mut failing);
        (result, failing.finished)
    });
    assert!(eventually(|| trainer.tasks().unwrap().len() == 1));
    trainer.begin(Duration::from_millis(50), BubbleKind::Other, None).unwrap();
    let (result, finished) = runner.join().unwrap();
    trainer.end().unwrap();
    let err = result.unwrap_err();
    assert_eq!(err.status, Status::Callback);
    let source = std::error::Error::source(&err).expect("the step's error is the source");
    assert!(source.downcast_ref::<Lost>().is_some());
    // Its cleanup is not skipped: finish ran, told how the run ended.
    assert_eq!(finished, Some(Some(Status::Callback)));
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

fn pattern_word(seed: u32, i: usize) -> u32 {
    seed ^ (i as u32).wrapping_mul(2654435761)
}

fn write_pattern(mem: &mut [u8], seed: u32) {
    for (i, w) in mem.chunks_exact_mut(4).enumerate() {
        w.copy_from_slice(&pattern_word(seed, i).to_ne_bytes());
    }
}

fn pattern_ok(mem: &[u8], seed: u32) -> bool {
    mem.chunks_exact(4).enumerate().all(|(i, w)| w == pattern_word(seed, i).to_ne_bytes())
}

const GRANT: u64 = 64 * 1024;

fn lend_host(trainer: &Trainer) {
    trainer.lend(&LendOptions { bytes: 1 << 20, ..Default::default() }).unwrap();
}

/// Sets a flag when dropped, so a task thread gives up its bounded waits when the test fails.
struct QuitOnDrop(Arc<AtomicBool>);
impl Drop for QuitOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn host_grant_written_by_an_imperative_task_is_read_by_the_trainer_then_revoked_and_acked() {
    let env = Env::new();
    let trainer = env.trainer();
    lend_host(&trainer);
    assert_eq!(trainer.lend(&LendOptions { bytes: 1 << 20, ..Default::default() }).unwrap_err().status, Status::Busy);

    let written = Arc::new(AtomicU64::new(0));
    let acked = Arc::new(AtomicU64::new(0));
    let rewritten = Arc::new(AtomicU64::new(0));
    let quit = Arc::new(AtomicBool::new(false));
    let paused = Arc::new(AtomicBool::new(false));
    let _quit_guard = QuitOnDrop(quit.clone());
    let (opts, job) = (TaskOptions { mem_need: GRANT, ..env.task_options() }, env.job.clone());
    let (w2, a2, r2, q2, p2) = (written.clone(), acked.clone(), rewritten.clone(), quit.clone(), paused.clone());
    let task_side = std::thread::spawn(move || -> Result<(), String> {
        let quit = || q2.load(Ordering::SeqCst);
        let mut task = Task::attach(&job, 0, "granted", &opts).map_err(|e| e.to_string())?;
        let start = task.wait_start(Some(Duration::from_secs(20))).unwrap().ok_or("never started")?;
        let region = start.grant.ok_or("started without its grant")?;
        assert_eq!(region.bytes, GRANT);
        {
            let mut g = task.grant().unwrap().ok_or("grant() found none")?;
            assert_eq!((g.id(), g.as_ptr()), (region.id, region.ptr));
            assert_eq!(g.backend(), GrantBackend::Host);
            assert_eq!(g.device(), None, "host memory is on no GPU");
            assert!(!g.is_revoking());
            write_pattern(g.as_mut_slice().unwrap(), 7);
            w2.store(g.id(), Ordering::SeqCst);
            while !g.should_pause() && !quit() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        task.ack_pause().unwrap();
        p2.store(true, Ordering::SeqCst);
        // Idle now: wait for the trainer to ask the grant back, then give it.
        let mut revoked = 0;
        eventually(|| {
            if let Some(g) = task.grant().unwrap() {
                if g.is_revoking() {
                    assert!(g.revoke_time_left().unwrap() > Duration::ZERO);
                    revoked = g.id();
                }
            }
            revoked != 0 || quit()
        });
        if revoked == 0 {
            return Err("no revoke".into());
        }
        task.ack_revoke().unwrap();
        assert!(task.grant().unwrap().is_none(), "the grant is still mapped after ack_revoke");
        a2.store(revoked, Ordering::SeqCst);
        // The trainer grants again on request: the new grant is mapped on the next look.
        let mut again = 0;
        eventually(|| {
            if let Some(mut g) = task.grant().unwrap() {
                write_pattern(g.as_mut_slice().unwrap(), 11);
                again = g.id();
            }
            again != 0 || quit()
        });
        r2.store(again, Ordering::SeqCst);
        loop {
            match task.wait_start(Some(Duration::from_millis(100))) {
                Err(e) if e.status == Status::Stopped => return task.detach().map_err(|e| e.to_string()),
                Err(e) => return Err(e.to_string()),
                Ok(_) if quit() => return Err("quit".into()),
                Ok(_) => {}
            }
        }
    });

    assert!(eventually(|| trainer.tasks().unwrap().len() == 1));
    let id = trainer.tasks().unwrap()[0].id;
    // auto_grant: the attach with a mem_need is granted without being asked.
    assert!(eventually(|| trainer.task_grant(id).unwrap().is_some()));
    let mut trainer = trainer;
    assert!(bubble_until(&mut trainer, || written.load(Ordering::SeqCst) != 0));
    let g = trainer.task_grant(id).unwrap().unwrap();
    assert_eq!(g.id, written.load(Ordering::SeqCst));
    assert_eq!(g.task_id, id);
    assert_eq!(g.state, GrantState::Active);
    assert_eq!(g.backend, GrantBackend::Host);
    assert_eq!(g.bytes, GRANT);
    assert!(g.mapped);
    // The trainer reads what the task wrote at its own address of the grant.
    // SAFETY: the grant stays active until the revoke below; the task wrote before saying so.
    assert!(pattern_ok(unsafe { g.as_host_slice() }.unwrap(), 7));
    // ... or copies it out, which a release waits for.
    let mut copy = vec![0u8; GRANT as usize];
    trainer.read_grant(g.id, 0, &mut copy).unwrap();
    assert!(pattern_ok(&copy, 7));
    let mut part = [0u8; 8];
    trainer.read_grant(g.id, 16, &mut part).unwrap();
    assert_eq!(&part[..], &copy[16..24]);
    let past = trainer.read_grant(g.id, GRANT - 4, &mut part).unwrap_err();
    assert_eq!(past.status, Status::Invalid);
    assert!(past.message.contains("outside grant"), "{}", past.message);
    let s = trainer.grant_stats().unwrap();
    assert_eq!(s.backend, Some(GrantBackend::Host));
    assert_eq!((s.capacity, s.active, s.granted_bytes, s.grants_made), (1 << 20, 1, GRANT, 1));

    // Revoked once idle: a pending revoke would be acked by the pause's ack already.
    assert!(eventually(|| paused.load(Ordering::SeqCst)));
    trainer.revoke(id, Some(Duration::from_secs(30))).unwrap();
    // Already revoking, or already given back.
    assert!(trainer.revoke(id, None).is_err());
    assert!(eventually(|| trainer.grant_stats().unwrap().revokes_acked == 1));
    assert!(eventually(|| acked.load(Ordering::SeqCst) == g.id)); // the task says so after its ack
    assert!(trainer.task_grant(id).unwrap().is_none());
    // Given back: its bytes went with it.
    assert_eq!(trainer.read_grant(g.id, 0, &mut part).unwrap_err().status, Status::NotFound);
    let s = trainer.grant_stats().unwrap();
    assert_eq!((s.revokes, s.tasks_killed, s.active, s.granted_bytes), (1, 0, 0, 0));
    assert_eq!(s.free_bytes, s.capacity);

    let again = trainer.grant(id, None).unwrap();
    assert!(again > g.id);
    assert_eq!(trainer.grant(id, None).unwrap_err().status, Status::Busy); // one grant per task
    assert!(eventually(|| rewritten.load(Ordering::SeqCst) == again));
    let g = trainer.task_grant(id).unwrap().unwrap();
    // SAFETY: as above.
    assert!(pattern_ok(unsafe { g.as_host_slice() }.unwrap(), 11));

    trainer.stop_task(id).unwrap();
    task_side.join().unwrap().unwrap();
    // Detaching gave the grant back.
    assert!(eventually(|| trainer.grant_stats().unwrap().active == 0));
    assert_eq!(trainer.grant_stats().unwrap().tasks_killed, 0);
}

#[test]
fn side_task_writes_its_grant_through_step_info_and_the_runtime_acks_the_revoke() {
    struct Writer {
        written: Arc<AtomicU64>,
        seen_without: Arc<AtomicU32>,
    }
    impl SideTask for Writer {
        fn step(&mut self, info: &StepInfo) -> TaskResult<Step> {
            match (info.grant, info.grant_memory()) {
                (Some(g), Some(mut mem)) => {
                    assert_eq!(mem.len() as u64, g.bytes);
                    if self.written.load(Ordering::SeqCst) != g.id {
                        write_pattern(&mut mem, 5);
                        self.written.store(g.id, Ordering::SeqCst);
                    }
                }
                _ => {
                    self.seen_without.fetch_add(1, Ordering::SeqCst);
                }
            }
            std::thread::sleep(Duration::from_millis(1));
            Ok(Step::Continue)
        }
    }
    let env = Env::new();
    let mut trainer = env.trainer();
    lend_host(&trainer);
    let written = Arc::new(AtomicU64::new(0));
    let seen_without = Arc::new(AtomicU32::new(0));
    let (opts, job) = (TaskOptions { mem_need: GRANT, ..env.task_options() }, env.job.clone());
    let (w2, s2) = (written.clone(), seen_without.clone());
    let runner = std::thread::spawn(move || {
        Task::attach(&job, 0, "iterative-grant", &opts)?.run(&mut Writer { written: w2, seen_without: s2 })
    });
    assert!(eventually(|| trainer.tasks().unwrap().len() == 1));
    let id = trainer.tasks().unwrap()[0].id;
    assert!(bubble_until(&mut trainer, || written.load(Ordering::SeqCst) != 0));
    let g = trainer.task_grant(id).unwrap().unwrap();
    assert_eq!(g.id, written.load(Ordering::SeqCst));
    // SAFETY: the grant stays active until the revoke below.
    assert!(pattern_ok(unsafe { g.as_host_slice() }.unwrap(), 5));
    // Between bubbles the runtime unmaps the revoked grant and acks by itself.
    trainer.revoke(id, Some(Duration::from_secs(30))).unwrap();
    assert!(eventually(|| trainer.grant_stats().unwrap().revokes_acked == 1));
    assert!(trainer.task_grant(id).unwrap().is_none());
    trainer.stop_task(id).unwrap();
    assert_eq!(runner.join().unwrap().unwrap(), Outcome::Stopped);
    // A task that needs memory is started only while it holds a grant.
    assert_eq!(seen_without.load(Ordering::SeqCst), 0);
    assert!(eventually(|| trainer.grant_stats().unwrap().active == 0));
    assert_eq!(trainer.grant_stats().unwrap().tasks_killed, 0);
}

#[test]
fn set_schedule_accepts_a_1f1b_pipeline_and_names_what_it_rejects() {
    let env = Env::new();
    let mut trainer = env.trainer();
    let mut sc = Schedule {
        stages: 4,
        microbatches: 8,
        stage: 1,
        fwd: Duration::from_millis(2),
        bwd: Duration::from_millis(4),
        ..Default::default()
    };
    trainer.set_schedule(&sc).unwrap();
    sc.stage = 4;
    let err = trainer.set_schedule(&sc).unwrap_err();
    assert_eq!(err.status, Status::Invalid);
    assert!(err.message.contains("stage"), "{err}");
    // Times unknown (measured), one bubble per receive; a forward time alone is refused.
    let mut measured = Schedule {
        stages: 4,
        microbatches: 8,
        stage: 1,
        bubbles: ScheduleBubbles::Receives,
        ..Default::default()
    };
    trainer.set_schedule(&measured).unwrap();
    measured.fwd = Duration::from_millis(1);
    let err = trainer.set_schedule(&measured).unwrap_err();
    assert!(err.message.contains("bwd_ns"), "{err}");
}

#[test]
fn unlend_gives_the_memory_back_and_lend_may_lend_again() {
    let env = Env::new();
    let trainer = env.trainer();
    assert_eq!(trainer.unlend(None).unwrap_err().status, Status::State);
    lend_host(&trainer);
    trainer.unlend(Some(Duration::from_secs(1))).unwrap();
    let s = trainer.grant_stats().unwrap();
    assert_eq!((s.backend, s.capacity), (None, 0));
    trainer.lend(&LendOptions { bytes: 2 << 20, ..Default::default() }).unwrap();
    let s = trainer.grant_stats().unwrap();
    assert_eq!((s.backend, s.capacity), (Some(GrantBackend::Host), 2 << 20));
}

#[test]
fn every_status_code_has_its_variant_and_an_unknown_one_keeps_its_number() {
    for code in -15..=-1 {
        let s = Status::from_raw(code);
        assert_eq!(s.raw(), code);
        assert!(!matches!(s, Status::Other(_)), "{code} has no variant");
        assert!(s.name().starts_with("BB_E_") && s.name() != "BB_E_UNKNOWN", "{code}");
    }
    assert_eq!(Status::from_raw(-13), Status::State);
    let newer = Status::from_raw(-99);
    assert!(matches!(newer, Status::Other(_)));
    assert_eq!((newer.raw(), newer.name()), (-99, "BB_E_UNKNOWN"));
    assert_eq!(newer, Status::from_raw(-99));
}
