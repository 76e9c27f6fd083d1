use std::any::Any;
use std::cell::{RefCell, RefMut};
use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::time::Duration;

use bubble_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::grant::{Grant, GrantRegion, StepMemory};
use crate::trainer::BubbleKind;
use crate::{c_string, duration_ns};

/// What a side task's methods return on failure: any error, carried to `Task::run`'s caller.
pub type TaskResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// What `SideTask::step` says about the remaining work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Continue,
    Done,
}

/// How `Task::run` ended when nothing failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// `step` returned `Step::Done`.
    Finished,
    /// The trainer (or the agent) told the task to stop.
    Stopped,
    /// The trainer closed its hub or exited.
    TrainerGone,
}

/// The bubble a step runs in, and the task's grant for this step.
#[derive(Debug)]
pub struct StepInfo<'a> {
    pub kind: BubbleKind,
    pub bubble_seq: u64,
    /// None if the trainer gave no deadline.
    pub deadline_ns: Option<u64>,
    pub time_left: Option<Duration>,
    /// The runtime's estimate of one step (None before the first).
    pub est_step: Option<Duration>,
    pub free_mem: Option<u64>,
    /// The memory grant the task holds in this step. A revoked grant is unmapped between
    /// steps: take it from every step's info, never keep it.
    pub grant: Option<GrantRegion>,
    pub(crate) memory: Option<StepMemory<'a>>,
    /// The running task, for should_pause (the one call a step may make on it).
    pub(crate) handle: sys::bb_task_h,
}

impl StepInfo<'_> {
    /// The grant's host memory for this step; None without a grant or for device memory.
    /// Panics if the memory is already borrowed in this step (as `RefCell` does).
    pub fn grant_memory(&self) -> Option<RefMut<'_, [u8]>> {
        self.memory.as_ref().map(StepMemory::borrow_mut)
    }

    /// True once the bubble ended, the task was told to stop, or its grant is being revoked:
    /// a long step can ask it between pieces of work and return early (one shared-memory load).
    pub fn should_pause(&self) -> bool {
        // SAFETY: the handle is the running task's, valid for the step this info belongs to;
        // bb_task_should_pause is allowed inside bb_task_run's callbacks.
        unsafe { sys::bb_task_should_pause(self.handle) != 0 }
    }
}

/// Why the task was started: the bubble it runs in.
#[derive(Debug, Clone, Copy)]
pub struct StartInfo {
    pub kind: BubbleKind,
    pub bubble_seq: u64,
    pub begin_ns: u64,
    pub deadline_ns: Option<u64>,
    pub free_mem: Option<u64>,
    /// The memory grant the task holds in this run; `Task::grant` gives checked access to it.
    pub grant: Option<GrantRegion>,
}

/// What remains of the current bubble.
#[derive(Debug, Clone, Copy)]
pub struct TimeLeft {
    /// None if the trainer gave no deadline.
    pub left: Option<Duration>,
    pub est_step: Option<Duration>,
}

/// The iterative interface: the runtime calls `step` only inside bubbles, while the measured
/// step time fits, and `pause`/`resume` around each bubble. An error or a panic in any method
/// ends the run; `Task::run` returns the error (status `Callback`) or resumes the panic.
/// `finish` is called once at the end of every run, also after such a failure, so cleanup put
/// there always runs. `idle` is called about every 100 ms while the task waits for a bubble
/// (never inside one): `Step::Done` from it ends the run as finished, the place to notice a
/// shutdown asked of the task.
pub trait SideTask {
    fn init(&mut self) -> TaskResult<()> {
        Ok(())
    }
    fn step(&mut self, info: &StepInfo<'_>) -> TaskResult<Step>;
    fn pause(&mut self) -> TaskResult<()> {
        Ok(())
    }
    fn resume(&mut self) -> TaskResult<()> {
        Ok(())
    }
    fn finish(&mut self, _status: Option<Status>) {}
    fn idle(&mut self) -> TaskResult<Step> {
        Ok(Step::Continue)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnTrainerExit {
    /// Calls fail with `Status::TrainerGone`.
    #[default]
    Return,
    /// Wait for a trainer to reopen the hub, then re-attach.
    Wait,
}

/// How a task waits for its next start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WakeMode {
    /// Sleep, and spin from `wake_lead` before the predicted next bubble.
    #[default]
    Predictive,
    /// Spin briefly, then sleep: least CPU, a wake-up's latency.
    Sleep,
    /// Spin all the time: the lowest latency, a whole core.
    Spin,
}

/// How the task presents itself to the scheduler; `Default` gives the library's defaults.
#[derive(Debug, Clone)]
pub struct TaskOptions {
    /// Higher runs first.
    pub priority: i32,
    /// Device bytes the task needs during a bubble.
    pub mem_need: u64,
    pub min_step: Duration,
    pub on_trainer_exit: OnTrainerExit,
    pub reattach_timeout: Duration,
    /// Spin this long before sleeping on a wait.
    pub spin: Duration,
    pub runtime_dir: Option<String>,
    pub wake_mode: WakeMode,
    pub wake_lead: Duration,
}

impl Default for TaskOptions {
    fn default() -> Self {
        TaskOptions {
            priority: 0,
            mem_need: 0,
            min_step: Duration::ZERO,
            on_trainer_exit: OnTrainerExit::Return,
            reattach_timeout: Duration::from_secs(60),
            spin: Duration::from_micros(20),
            runtime_dir: None,
            wake_mode: WakeMode::Predictive,
            wake_lead: Duration::from_micros(50),
        }
    }
}

/// A side task's attachment to one hub. Dropping it acks any pending pause and detaches.
#[derive(Debug)]
pub struct Task {
    raw: NonNull<sys::bb_task>,
}

// SAFETY: a task handle belongs to one thread at a time, which `&mut self` and !Sync ensure;
// moving it to another thread is allowed.
unsafe impl Send for Task {}

fn known(v: u64) -> Option<u64> {
    (v != u64::MAX).then_some(v)
}
fn nonzero(v: u64) -> Option<u64> {
    (v != 0).then_some(v)
}

impl Task {
    /// Attaches to the hub of (job_id, rank) under `name`. Fails with `Status::NotFound` when
    /// no trainer serves that hub and `Status::Full` when its slot table is full.
    pub fn attach(job_id: &str, rank: u32, name: &str, options: &TaskOptions) -> Result<Task> {
        let job = c_string("job id", job_id)?;
        let cname = c_string("task name", name)?;
        let dir = options.runtime_dir.as_deref().map(|d| c_string("runtime dir", d)).transpose()?;
        // SAFETY: init_sized writes all `size` bytes (a library that knows fewer fields zeroes
        // the rest).
        let mut opts = unsafe {
            let mut o = std::mem::MaybeUninit::<sys::bb_task_options_t>::uninit();
            let size = std::mem::size_of::<sys::bb_task_options_t>();
            sys::bb_task_options_init_sized(o.as_mut_ptr(), size);
            o.assume_init()
        };
        opts.priority = options.priority;
        opts.mem_need = options.mem_need;
        opts.min_step_ns = duration_ns(options.min_step);
        opts.on_trainer_exit = match options.on_trainer_exit {
            OnTrainerExit::Return => sys::bb_on_trainer_exit::BB_ON_TRAINER_EXIT_RETURN as u32,
            OnTrainerExit::Wait => sys::bb_on_trainer_exit::BB_ON_TRAINER_EXIT_WAIT as u32,
        };
        opts.reattach_timeout_ns = duration_ns(options.reattach_timeout);
        opts.spin_ns = duration_ns(options.spin);
        opts.runtime_dir = dir.as_ref().map_or(std::ptr::null(), |d| d.as_ptr());
        opts.wake_mode = match options.wake_mode {
            WakeMode::Predictive => sys::bb_wake_mode::BB_WAKE_PREDICTIVE,
            WakeMode::Sleep => sys::bb_wake_mode::BB_WAKE_SLEEP,
            WakeMode::Spin => sys::bb_wake_mode::BB_WAKE_SPIN,
        } as u32;
        opts.wake_lead_ns = duration_ns(options.wake_lead);
        let mut out = std::ptr::null_mut();
        // SAFETY: strings outlive the call; out is a valid out-parameter.
        check(unsafe { sys::bb_task_attach(job.as_ptr(), rank, cname.as_ptr(), &opts, &mut out) })?;
        Ok(Task { raw: NonNull::new(out).expect("bb_task_attach returned OK and no handle") })
    }

    /// Hands the loop to the runtime until the work is done, the task is stopped or the
    /// trainer leaves.
    pub fn run<T: SideTask>(&mut self, side_task: &mut T) -> Result<Outcome> {
        let mut bridge = Bridge { task: side_task, failure: None, handle: self.raw.as_ptr() };
        // SAFETY: init_sized writes all `size` bytes (a library that knows fewer fields zeroes
        // the rest).
        let mut cbs = unsafe {
            let mut c = std::mem::MaybeUninit::<sys::bb_task_callbacks_t>::uninit();
            let size = std::mem::size_of::<sys::bb_task_callbacks_t>();
            sys::bb_task_callbacks_init_sized(c.as_mut_ptr(), size);
            c.assume_init()
        };
        cbs.user = &mut bridge as *mut Bridge<T> as *mut c_void;
        cbs.init = Some(Bridge::<T>::init);
        cbs.step = Some(Bridge::<T>::step);
        cbs.pause = Some(Bridge::<T>::pause);
        cbs.resume = Some(Bridge::<T>::resume);
        cbs.finish = Some(Bridge::<T>::finish);
        cbs.idle = Some(Bridge::<T>::idle);
        // SAFETY: bridge outlives the call; the callbacks only run inside it, on this thread.
        let code = unsafe { sys::bb_task_run(self.raw.as_ptr(), &cbs) };
        let last = (code != sys::BB_OK).then(|| Error::last(code));
        match bridge.failure.take() {
            Some(Failure::Panic(payload)) => resume_unwind(payload),
            Some(Failure::Error(e)) => {
                return Err(Error { status: Status::Callback, message: format!("the side task failed: {e}"), source: Some(e) })
            }
            None => {}
        }
        match code {
            sys::BB_OK => Ok(Outcome::Finished),
            sys::BB_E_STOPPED => Ok(Outcome::Stopped),
            sys::BB_E_TRAINER_GONE => Ok(Outcome::TrainerGone),
            _ => Err(last.expect("a non-OK status has an error")),
        }
    }

    /// Waits until the trainer starts this task in a bubble; `Ok(None)` after `timeout`
    /// (None waits forever). Fails with `Status::Stopped` when told to stop and
    /// `Status::TrainerGone` when the trainer left.
    pub fn wait_start(&mut self, timeout: Option<Duration>) -> Result<Option<StartInfo>> {
        // SAFETY: all-zero is valid; size set below.
        let mut info: sys::bb_start_info_t = unsafe { std::mem::zeroed() };
        info.size = std::mem::size_of::<sys::bb_start_info_t>() as u32;
        let t = timeout.map_or(-1, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        // SAFETY: live handle, valid out-parameter.
        let code = unsafe { sys::bb_task_wait_start(self.raw.as_ptr(), t, &mut info) };
        if code == sys::BB_E_TIMEOUT {
            return Ok(None);
        }
        check(code)?;
        Ok(Some(StartInfo {
            kind: BubbleKind::from_raw(info.kind),
            bubble_seq: info.bubble_seq,
            begin_ns: info.begin_ns,
            deadline_ns: nonzero(info.deadline_ns),
            free_mem: known(info.free_mem),
            grant: GrantRegion::from_raw(info.grant_id, info.grant_ptr, info.grant_bytes),
        }))
    }

    /// True once the bubble ended or the task was told to stop. One shared-memory load.
    pub fn should_pause(&self) -> bool {
        // SAFETY: live handle; the call never fails.
        unsafe { sys::bb_task_should_pause(self.raw.as_ptr()) != 0 }
    }

    /// The task stopped its device work for this bubble.
    pub fn ack_pause(&mut self) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::bb_task_ack_pause(self.raw.as_ptr()) })
    }

    /// Reports one step's duration (statistics and the time-fits check).
    pub fn report_step(&mut self, step: Duration) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::bb_task_report_step(self.raw.as_ptr(), duration_ns(step)) })
    }

    pub fn time_left(&self) -> Result<TimeLeft> {
        let (mut left, mut est) = (0u64, 0u64);
        // SAFETY: live handle, valid out-parameters.
        check(unsafe { sys::bb_task_time_left(self.raw.as_ptr(), &mut left, &mut est) })?;
        Ok(TimeLeft {
            left: known(left).map(Duration::from_nanos),
            est_step: nonzero(est).map(Duration::from_nanos),
        })
    }

    /// The grant this task maps now (mapping one just offered); None when it holds none.
    /// Fails with `Status::Unsupported` (once) for a CUDA grant in a process without a CUDA
    /// driver, and that grant goes back to the trainer.
    pub fn grant(&mut self) -> Result<Option<Grant<'_>>> {
        // SAFETY: all-zero is valid; size set below.
        let mut g: sys::bb_task_grant_t = unsafe { std::mem::zeroed() };
        g.size = std::mem::size_of::<sys::bb_task_grant_t>() as u32;
        // SAFETY: live handle, valid out-parameter.
        let code = unsafe { sys::bb_task_grant(self.raw.as_ptr(), &mut g) };
        if code == sys::BB_E_NOT_FOUND {
            return Ok(None);
        }
        check(code)?;
        Ok(Some(Grant { raw: g, task: self.raw.as_ptr(), _task: PhantomData }))
    }

    /// If the trainer is revoking this task's grant: unmaps it and acks; otherwise nothing.
    /// Stop all use of the grant (device work included) first.
    pub fn ack_revoke(&mut self) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::bb_task_ack_revoke(self.raw.as_ptr()) })
    }

    /// Detaches now and reports the status, which `Drop` cannot.
    pub fn detach(self) -> Result<()> {
        let raw = self.raw.as_ptr();
        std::mem::forget(self);
        // SAFETY: ownership moved out of self.
        check(unsafe { sys::bb_task_detach(raw) })
    }

    pub fn as_raw(&self) -> sys::bb_task_h {
        self.raw.as_ptr()
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        // SAFETY: detached exactly once, here or in detach().
        unsafe { sys::bb_task_detach(self.raw.as_ptr()) };
    }
}

enum Failure {
    Error(Box<dyn std::error::Error + Send + Sync>),
    Panic(Box<dyn Any + Send>),
}

struct Bridge<'a, T: SideTask> {
    task: &'a mut T,
    failure: Option<Failure>,
    handle: sys::bb_task_h,
}

impl<T: SideTask> Bridge<'_, T> {
    /// Runs one method, unless an earlier one failed (the runtime is then ending the run, and
    /// only `finish` is still called).
    unsafe fn guarded(user: *mut c_void, f: impl FnOnce(&mut T) -> TaskResult<c_int>) -> c_int {
        if (*(user as *mut Self)).failure.is_some() {
            return -1;
        }
        Self::protected(user, f)
    }

    /// Runs f; an error or a panic is kept for `run` (the first one: a later one from `finish`
    /// does not hide it) and reported to C as -1, since unwinding must not cross the C frames.
    unsafe fn protected(user: *mut c_void, f: impl FnOnce(&mut T) -> TaskResult<c_int>) -> c_int {
        let bridge = &mut *(user as *mut Self);
        let failure = match catch_unwind(AssertUnwindSafe(|| f(bridge.task))) {
            Ok(Ok(v)) => return v,
            Ok(Err(e)) => Failure::Error(e),
            Err(payload) => Failure::Panic(payload),
        };
        if bridge.failure.is_none() {
            bridge.failure = Some(failure);
        } else {
            // Dropped here, a later failure would run the user's Drop (of a panic payload, or
            // of the error type) inside this extern "C" frame, where a panic cannot unwind.
            std::mem::forget(failure);
        }
        -1
    }

    unsafe extern "C" fn init(user: *mut c_void) -> c_int {
        Self::guarded(user, |t| t.init().map(|_| 0))
    }
    /// Whether the step's grant is host memory. The step info does not say which backend a
    /// grant has; bb_task_grant does, and on the runtime's own thread between its steps it
    /// only reports the mapping the step was given (it never unmaps). Asked at every step
    /// with a grant: an id alone does not name a grant for good (a trainer that replaced the
    /// one the task re-attached from numbers its grants from 1 again, perhaps on a device).
    unsafe fn is_host(user: *mut c_void, grant: &GrantRegion) -> bool {
        let bridge = &mut *(user as *mut Self);
        let mut g: sys::bb_task_grant_t = std::mem::zeroed();
        g.size = std::mem::size_of::<sys::bb_task_grant_t>() as u32;
        sys::bb_task_grant(bridge.handle, &mut g) == sys::BB_OK
            && g.id == grant.id
            && g.ptr == grant.ptr
            && g.bytes >= grant.bytes
            && g.backend == sys::BB_GRANT_HOST
    }

    unsafe extern "C" fn step(user: *mut c_void, info: *const sys::bb_step_info_t) -> c_int {
        let i = &*info;
        let grant = GrantRegion::from_raw(i.grant_id, i.grant_ptr, i.grant_bytes);
        let memory = match grant {
            Some(g) if Self::is_host(user, &g) => {
                // SAFETY: a host grant is mapped for its size until this step returns.
                let s = std::slice::from_raw_parts_mut(g.ptr as *mut u8, g.bytes as usize);
                Some(StepMemory(RefCell::new(s)))
            }
            _ => None,
        };
        let info = StepInfo {
            kind: BubbleKind::from_raw(i.kind),
            bubble_seq: i.bubble_seq,
            deadline_ns: nonzero(i.deadline_ns),
            time_left: known(i.time_left_ns).map(Duration::from_nanos),
            est_step: nonzero(i.est_step_ns).map(Duration::from_nanos),
            free_mem: known(i.free_mem),
            grant,
            memory,
            handle: (*(user as *mut Self)).handle,
        };
        Self::guarded(user, |t| {
            t.step(&info).map(|s| match s {
                Step::Continue => sys::BB_STEP_CONTINUE as c_int,
                Step::Done => sys::BB_STEP_DONE as c_int,
            })
        })
    }
    unsafe extern "C" fn pause(user: *mut c_void) -> c_int {
        Self::guarded(user, |t| t.pause().map(|_| 0))
    }
    unsafe extern "C" fn resume(user: *mut c_void) -> c_int {
        Self::guarded(user, |t| t.resume().map(|_| 0))
    }
    unsafe extern "C" fn idle(user: *mut c_void) -> c_int {
        Self::guarded(user, |t| {
            t.idle().map(|s| match s {
                Step::Continue => sys::BB_STEP_CONTINUE as c_int,
                Step::Done => sys::BB_STEP_DONE as c_int,
            })
        })
    }
    unsafe extern "C" fn finish(user: *mut c_void, status: sys::bb_status) {
        let status = (status != sys::BB_OK).then(|| Status::from_raw(status));
        // Always called, also after another method failed: its cleanup must run.
        Self::protected(user, |t| {
            t.finish(status);
            Ok(0)
        });
    }
}
