use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bubble_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::grant::{GrantInfo, GrantStats, LendOptions};
use crate::{c_string, duration_ns};

/// Where in the pipeline schedule a bubble sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BubbleKind {
    #[default]
    Other,
    /// Pipeline fill: before the stage's first forward.
    Warmup,
    /// A wait on a point-to-point transfer in the steady state.
    Steady,
    /// Pipeline drain: after the stage's last backward.
    Cooldown,
}

impl BubbleKind {
    fn to_sys(self) -> sys::bb_bubble_kind {
        match self {
            BubbleKind::Other => sys::bb_bubble_kind::BB_BUBBLE_OTHER,
            BubbleKind::Warmup => sys::bb_bubble_kind::BB_BUBBLE_WARMUP,
            BubbleKind::Steady => sys::bb_bubble_kind::BB_BUBBLE_STEADY,
            BubbleKind::Cooldown => sys::bb_bubble_kind::BB_BUBBLE_COOLDOWN,
        }
    }

    pub(crate) fn from_raw(kind: u32) -> BubbleKind {
        match kind {
            1 => BubbleKind::Warmup,
            2 => BubbleKind::Steady,
            3 => BubbleKind::Cooldown,
            _ => BubbleKind::Other,
        }
    }
}

/// The pipeline schedule a trainer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    GPipe,
    /// One forward, one backward (PipeDream-flush, Megatron).
    #[default]
    OneFOneB,
    /// Interleaved 1F1B with `chunks` model chunks per stage.
    Interleaved,
    /// Zero-bubble H1: the backward split into input- and weight-gradient parts.
    ZbH1,
}

/// What one bubble is, which fixes how bubbles are numbered in an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ScheduleBubbles {
    /// Each idle interval of the stage in the schedule model.
    #[default]
    Idle,
    /// One bubble per point-to-point receive, waited or not (as framework adapters report).
    Receives,
}

/// A declared pipeline schedule, so the predictor knows each bubble's length from the first
/// iteration on; `Default` is 1F1B with nothing else set. Zero `fwd` and `bwd` (and `wgrad`,
/// `comm`) mean the times are unknown: the library measures them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    /// p >= 1.
    pub stages: u32,
    /// m >= 1.
    pub microbatches: u32,
    /// Interleaved only: v >= 2; else 1.
    pub chunks: u32,
    /// This trainer's stage, 0..p-1.
    pub stage: u32,
    /// One micro-batch's forward through the stage.
    pub fwd: Duration,
    /// Its backward (ZB-H1: the input-gradient part).
    pub bwd: Duration,
    /// ZB-H1: the weight-gradient part.
    pub wgrad: Duration,
    /// Point-to-point transfer between stages.
    pub comm: Duration,
    /// What one bubble is.
    pub bubbles: ScheduleBubbles,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            kind: ScheduleKind::OneFOneB,
            stages: 0,
            microbatches: 0,
            chunks: 1,
            stage: 0,
            fwd: Duration::ZERO,
            bwd: Duration::ZERO,
            wgrad: Duration::ZERO,
            comm: Duration::ZERO,
            bubbles: ScheduleBubbles::Idle,
        }
    }
}

/// How the hub is sized; `Default` gives the library's defaults.
#[derive(Debug, Clone)]
pub struct TrainerOptions {
    pub max_slots: u32,
    pub max_running: u32,
    pub event_capacity: u32,
    /// None: $BUBBLE_RUNTIME_DIR, else the library's default directory.
    pub runtime_dir: Option<String>,
    /// A second uid allowed to attach.
    pub allow_uid: Option<u32>,
}

impl Default for TrainerOptions {
    fn default() -> Self {
        TrainerOptions { max_slots: 64, max_running: 1, event_capacity: 4096, runtime_dir: None, allow_uid: None }
    }
}

pub type TrainerStats = sys::bb_trainer_stats_t;

/// One attached side task, as the trainer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskInfo {
    pub id: u64,
    pub slot: u32,
    pub name: String,
    pub pid: i32,
    pub priority: i32,
    pub mem_need: u64,
    pub min_step_ns: u64,
    pub steps: u64,
    pub step_ns: u64,
    pub running: bool,
    pub bad: bool,
    /// Its step time inside bubbles, from its reports.
    pub ns_in_bubbles: u64,
    /// Its step time that spilled past bubbles' ends.
    pub ns_outside: u64,
}

/// The hub of one trainer rank. Dropping it stops every attached task and removes the hub.
///
/// The bubble calls (`begin`, `end`, `bubble`, `iteration`, `set_schedule`) come from one
/// thread at a time, so on a `Trainer` they take `&mut self`. To make them on one thread while
/// others share the trainer (`&Trainer` in an `Arc` or a scoped thread: `stats`, `tasks`,
/// `grant`, `unlend`, ...), that thread takes the trainer's [`BubbleThread`], without a lock.
#[derive(Debug)]
pub struct Trainer {
    raw: NonNull<sys::bb_trainer>,
    bubble_thread_taken: AtomicBool,
}

// SAFETY: every trainer function may be called from any thread; the bubble calls, which must
// come from one thread at a time, take `&mut self` here or on the one `BubbleThread`.
unsafe impl Send for Trainer {}
unsafe impl Sync for Trainer {}

/// The right to make a shared trainer's bubble calls: one at a time per trainer (see
/// [`Trainer::bubble_thread`]). It may move to another thread but its calls take `&mut self`,
/// so they come from one thread at a time; dropping it lets another be taken.
#[derive(Debug)]
pub struct BubbleThread<'t> {
    trainer: &'t Trainer,
}

impl BubbleThread<'_> {
    /// As [`Trainer::begin`].
    pub fn begin(&mut self, expected: Duration, kind: BubbleKind, free_mem: Option<u64>) -> Result<()> {
        self.trainer.begin_unchecked(expected, kind, free_mem)
    }

    /// As [`Trainer::end`].
    pub fn end(&mut self) -> Result<()> {
        self.trainer.end_unchecked()
    }

    /// As [`Trainer::bubble`].
    pub fn bubble(&mut self, expected: Duration, kind: BubbleKind) -> Result<BubbleGuard<'_>> {
        self.trainer.begin_unchecked(expected, kind, None)?;
        Ok(BubbleGuard { raw: self.trainer.raw, _bubble_thread: PhantomData })
    }

    /// As [`Trainer::iteration`].
    pub fn iteration(&mut self) -> Result<()> {
        self.trainer.iteration_unchecked()
    }

    /// As [`Trainer::set_schedule`].
    pub fn set_schedule(&mut self, schedule: &Schedule) -> Result<()> {
        self.trainer.set_schedule_unchecked(schedule)
    }

    /// The trainer it makes the bubble calls of.
    pub fn trainer(&self) -> &Trainer {
        self.trainer
    }
}

impl Drop for BubbleThread<'_> {
    fn drop(&mut self) {
        self.trainer.bubble_thread_taken.store(false, Ordering::Release);
    }
}

impl Trainer {
    /// Creates the hub of (job_id, rank). Fails with `Status::Busy` if a live trainer owns it.
    pub fn open(job_id: &str, rank: u32, options: &TrainerOptions) -> Result<Trainer> {
        let job = c_string("job id", job_id)?;
        let dir = options.runtime_dir.as_deref().map(|d| c_string("runtime dir", d)).transpose()?;
        // SAFETY: init_sized writes all `size` bytes (a library that knows fewer fields zeroes
        // the rest).
        let mut opts = unsafe {
            let mut o = std::mem::MaybeUninit::<sys::bb_trainer_options_t>::uninit();
            let size = std::mem::size_of::<sys::bb_trainer_options_t>();
            sys::bb_trainer_options_init_sized(o.as_mut_ptr(), size);
            o.assume_init()
        };
        opts.max_slots = options.max_slots;
        opts.max_running = options.max_running;
        opts.event_capacity = options.event_capacity;
        opts.runtime_dir = dir.as_ref().map_or(std::ptr::null(), |d| d.as_ptr());
        if let Some(uid) = options.allow_uid {
            opts.allow_uid = uid;
        }
        let mut out = std::ptr::null_mut();
        // SAFETY: the strings outlive the call; out is a valid out-parameter.
        check(unsafe { sys::bb_trainer_open(job.as_ptr(), rank, &opts, &mut out) })?;
        Ok(Trainer {
            raw: NonNull::new(out).expect("bb_trainer_open returned OK and no handle"),
            bubble_thread_taken: AtomicBool::new(false),
        })
    }

    /// Takes the right to make the bubble calls through `&self`, for a trainer shared with
    /// other threads. `Status::Busy` while another `BubbleThread` of this trainer lives.
    pub fn bubble_thread(&self) -> Result<BubbleThread<'_>> {
        if self.bubble_thread_taken.swap(true, Ordering::Acquire) {
            return Err(Error {
                status: Status::Busy,
                message: "this trainer's BubbleThread is taken: the bubble calls come from one \
                          thread at a time; drop the other one first"
                    .to_owned(),
                source: None,
            });
        }
        Ok(BubbleThread { trainer: self })
    }

    /// A bubble starts now. `expected`: its length (zero: predicted from earlier bubbles);
    /// `free_mem`: device bytes side tasks may use (None: unknown).
    pub fn begin(&mut self, expected: Duration, kind: BubbleKind, free_mem: Option<u64>) -> Result<()> {
        self.begin_unchecked(expected, kind, free_mem)
    }

    /// The bubble ends now; started tasks are told to pause.
    pub fn end(&mut self) -> Result<()> {
        self.end_unchecked()
    }

    /// Begins a bubble that ends when the guard drops (so also on `?` and panics).
    pub fn bubble(&mut self, expected: Duration, kind: BubbleKind) -> Result<BubbleGuard<'_>> {
        self.begin_unchecked(expected, kind, None)?;
        Ok(BubbleGuard { raw: self.raw, _bubble_thread: PhantomData })
    }

    /// Marks the start of a training iteration (numbers bubbles for the predictor).
    pub fn iteration(&mut self) -> Result<()> {
        self.iteration_unchecked()
    }

    /// Declares the pipeline schedule (from the bubble thread, before an iteration; not
    /// bounded-time). `Status::Invalid` names what the schedule model rejects.
    pub fn set_schedule(&mut self, schedule: &Schedule) -> Result<()> {
        self.set_schedule_unchecked(schedule)
    }

    // The bubble calls through `&self`: callers hold `&mut Trainer` or the one `BubbleThread`.
    fn begin_unchecked(&self, expected: Duration, kind: BubbleKind, free_mem: Option<u64>) -> Result<()> {
        let mem = free_mem.unwrap_or(sys::BB_MEM_UNKNOWN);
        // SAFETY: the handle is live while self is.
        check(unsafe { sys::bb_bubble_begin(self.raw.as_ptr(), duration_ns(expected), mem, kind.to_sys()) })
    }

    fn end_unchecked(&self) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::bb_bubble_end(self.raw.as_ptr()) })
    }

    fn iteration_unchecked(&self) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::bb_trainer_iteration(self.raw.as_ptr()) })
    }

    fn set_schedule_unchecked(&self, schedule: &Schedule) -> Result<()> {
        // SAFETY: init_sized writes all `size` bytes (a library that knows fewer fields zeroes
        // the rest).
        let mut c = unsafe {
            let mut c = std::mem::MaybeUninit::<sys::bb_schedule_t>::uninit();
            let size = std::mem::size_of::<sys::bb_schedule_t>();
            sys::bb_schedule_init_sized(c.as_mut_ptr(), size);
            c.assume_init()
        };
        c.kind = match schedule.kind {
            ScheduleKind::GPipe => sys::BB_SCHEDULE_GPIPE,
            ScheduleKind::OneFOneB => sys::BB_SCHEDULE_1F1B,
            ScheduleKind::Interleaved => sys::BB_SCHEDULE_INTERLEAVED,
            ScheduleKind::ZbH1 => sys::BB_SCHEDULE_ZBH1,
        };
        c.stages = schedule.stages;
        c.microbatches = schedule.microbatches;
        c.chunks = schedule.chunks;
        c.stage = schedule.stage;
        c.fwd_ns = duration_ns(schedule.fwd);
        c.bwd_ns = duration_ns(schedule.bwd);
        c.wgrad_ns = duration_ns(schedule.wgrad);
        c.comm_ns = duration_ns(schedule.comm);
        c.bubbles = match schedule.bubbles {
            ScheduleBubbles::Idle => sys::BB_SCHEDULE_BUBBLES_IDLE,
            ScheduleBubbles::Receives => sys::BB_SCHEDULE_BUBBLES_RECEIVES,
        };
        // SAFETY: live handle, valid schedule.
        check(unsafe { sys::bb_trainer_set_schedule(self.raw.as_ptr(), &c) })
    }

    pub fn stats(&self) -> Result<TrainerStats> {
        // SAFETY: an all-zero stats struct is valid; size tells the library how much to fill.
        let mut s: TrainerStats = unsafe { std::mem::zeroed() };
        s.size = std::mem::size_of::<TrainerStats>() as u32;
        // SAFETY: live handle, valid out-parameter.
        check(unsafe { sys::bb_trainer_stats(self.raw.as_ptr(), &mut s) })?;
        Ok(s)
    }

    /// The tasks attached now.
    pub fn tasks(&self) -> Result<Vec<TaskInfo>> {
        let mut count = 0usize;
        // SAFETY: cap 0 with a NULL array only asks for the count.
        check(unsafe { sys::bb_trainer_tasks(self.raw.as_ptr(), std::ptr::null_mut(), 0, &mut count) })?;
        loop {
            // Room for tasks that attach between the two calls.
            let cap = count + 4;
            // SAFETY: all-zero is a valid bb_task_info_t.
            let mut proto: sys::bb_task_info_t = unsafe { std::mem::zeroed() };
            proto.size = std::mem::size_of::<sys::bb_task_info_t>() as u32;
            let mut raw = vec![proto; cap];
            // SAFETY: raw holds cap initialised entries.
            check(unsafe { sys::bb_trainer_tasks(self.raw.as_ptr(), raw.as_mut_ptr(), cap, &mut count) })?;
            if count <= cap {
                return Ok(raw[..count].iter().map(task_info).collect());
            }
        }
    }

    /// Tells one task (by `TaskInfo::id`) to stop; it finishes and detaches.
    pub fn stop_task(&self, task_id: u64) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::bb_trainer_stop_task(self.raw.as_ptr(), task_id) })
    }

    /// Lends memory to the hub's tasks; one lent range at a time (`Status::Busy` while one is
    /// lent: `unlend` first to lend differently).
    /// `Status::Unsupported` for a CUDA backend without a usable CUDA driver.
    pub fn lend(&self, options: &LendOptions) -> Result<()> {
        let o = options.to_sys();
        // SAFETY: live handle, valid options.
        check(unsafe { sys::bb_trainer_lend(self.raw.as_ptr(), &o) })
    }

    /// Takes every grant back and gives the lent memory back, so that `lend` may lend again. A
    /// holder that has not given its grant back within `grace` (None: 1 s) is killed. Blocks
    /// until then, at most `grace` + 2 s, so call it where the trainer can wait.
    /// `Status::State` when nothing is lent, `Status::Timeout` when a holder the kill cannot
    /// reach keeps the memory lent.
    pub fn unlend(&self, grace: Option<Duration>) -> Result<()> {
        let deadline = grace.map_or(0, |g| crate::now_ns().saturating_add(duration_ns(g)));
        // SAFETY: live handle.
        check(unsafe { sys::bb_trainer_unlend(self.raw.as_ptr(), deadline) })
    }

    /// Grants `bytes` (None: the task's `mem_need`) of the lent memory to a task that holds no
    /// grant, and returns the grant's id. `Status::NoMemory` when no free extent is large
    /// enough, `Status::Busy` when the task already holds one.
    pub fn grant(&self, task_id: u64, bytes: Option<u64>) -> Result<u64> {
        let mut id = 0u64;
        // SAFETY: live handle, valid out-parameter.
        check(unsafe { sys::bb_trainer_grant(self.raw.as_ptr(), task_id, bytes.unwrap_or(0), &mut id) })?;
        Ok(id)
    }

    /// Asks a task's grant back; a task that has not acked within `grace` (None: 1 s) is
    /// killed. Returns at once: `task_grant` and `grant_stats` show the progress.
    pub fn revoke(&self, task_id: u64, grace: Option<Duration>) -> Result<()> {
        let deadline = grace.map_or(0, |g| crate::now_ns().saturating_add(duration_ns(g)));
        // SAFETY: live handle.
        check(unsafe { sys::bb_trainer_revoke(self.raw.as_ptr(), task_id, deadline) })
    }

    /// The grant of one task (by `TaskInfo::id`); None when it holds none.
    /// `Status::NotFound` when no such task is attached.
    pub fn task_grant(&self, task_id: u64) -> Result<Option<GrantInfo>> {
        // SAFETY: all-zero is valid; size set below.
        let mut g: sys::bb_grant_info_t = unsafe { std::mem::zeroed() };
        g.size = std::mem::size_of::<sys::bb_grant_info_t>() as u32;
        // SAFETY: live handle, valid out-parameter.
        check(unsafe { sys::bb_trainer_task_grant(self.raw.as_ptr(), task_id, &mut g) })?;
        Ok(GrantInfo::from_sys(&g))
    }

    /// Copies `dst.len()` bytes of grant `grant_id`, from `offset` into it, to `dst`: the safe
    /// way to read what a task wrote. The task may leave or die at any moment, which releases
    /// the grant, but never while a piece of the copy (4 MiB) is under way (the release waits
    /// for it). `Status::NotFound` once the grant is no longer live, also when it was released
    /// between two pieces (`dst` then holds a part), `Status::Invalid` when the range is not
    /// inside the grant's bytes. For the CUDA backends the copy lands in host memory; see `read_grant_raw` for
    /// device memory. The hub's grants and releases wait for the copy: copy what you need.
    pub fn read_grant(&self, grant_id: u64, offset: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: dst is valid for dst.len() bytes of writes.
        unsafe { self.read_grant_raw(grant_id, offset, dst.as_mut_ptr().cast(), dst.len() as u64) }
    }

    /// `read_grant` to any memory: host memory, or for the CUDA backends device memory of the
    /// lender's GPU (a device pointer as `*mut c_void`).
    ///
    /// # Safety
    /// `dst` must be valid for `bytes` bytes of writes, and not in use by work the caller has
    /// queued on a GPU stream (the copy runs on the lender's own stream).
    pub unsafe fn read_grant_raw(
        &self,
        grant_id: u64,
        offset: u64,
        dst: *mut std::ffi::c_void,
        bytes: u64,
    ) -> Result<()> {
        // SAFETY: live handle; dst as the caller promised.
        check(sys::bb_trainer_read_grant(self.raw.as_ptr(), grant_id, offset, dst, bytes))
    }

    /// The lender's byte counts and the revoke protocol's counters.
    pub fn grant_stats(&self) -> Result<GrantStats> {
        // SAFETY: all-zero is valid; size set below.
        let mut s: sys::bb_grant_stats_t = unsafe { std::mem::zeroed() };
        s.size = std::mem::size_of::<sys::bb_grant_stats_t>() as u32;
        // SAFETY: live handle, valid out-parameter.
        check(unsafe { sys::bb_trainer_grant_stats(self.raw.as_ptr(), &mut s) })?;
        Ok(GrantStats::from_sys(&s))
    }

    /// Closes now and reports the status, which `Drop` cannot.
    pub fn close(self) -> Result<()> {
        let raw = self.raw.as_ptr();
        std::mem::forget(self);
        // SAFETY: ownership moved out of self, which will not close it again.
        check(unsafe { sys::bb_trainer_close(raw) })
    }

    pub fn as_raw(&self) -> sys::bb_trainer_h {
        self.raw.as_ptr()
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        // SAFETY: the handle is closed exactly once, here or in close().
        unsafe { sys::bb_trainer_close(self.raw.as_ptr()) };
    }
}

/// Ends its bubble when dropped.
#[must_use = "the bubble ends when the guard is dropped"]
pub struct BubbleGuard<'a> {
    raw: NonNull<sys::bb_trainer>,
    // Borrows the trainer (or its BubbleThread) mutably: no other bubble call meanwhile.
    _bubble_thread: PhantomData<&'a mut ()>,
}

// SAFETY: the guard only ends its bubble, which may be done from any thread (one at a time:
// the guard is not Sync and is used through `self`).
unsafe impl Send for BubbleGuard<'_> {}

impl BubbleGuard<'_> {
    /// Ends the bubble now and reports the status.
    pub fn end(self) -> Result<()> {
        let raw = self.raw.as_ptr();
        std::mem::forget(self);
        // SAFETY: live handle (borrowed for 'a).
        check(unsafe { sys::bb_bubble_end(raw) })
    }
}

impl Drop for BubbleGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: live handle (borrowed for 'a).
        unsafe { sys::bb_bubble_end(self.raw.as_ptr()) };
    }
}

fn task_info(r: &sys::bb_task_info_t) -> TaskInfo {
    // Bounded by the array even if a NUL were missing.
    let bytes: Vec<u8> = r.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    let name = String::from_utf8_lossy(&bytes).into_owned();
    TaskInfo {
        id: r.id,
        slot: r.slot,
        name,
        pid: r.pid,
        priority: r.priority,
        mem_need: r.mem_need,
        min_step_ns: r.min_step_ns,
        steps: r.steps,
        step_ns: r.step_ns,
        running: r.running != 0,
        bad: r.bad != 0,
        ns_in_bubbles: r.ns_in_bubbles,
        ns_outside: r.ns_outside,
    }
}
