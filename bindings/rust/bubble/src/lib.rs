//! libbubble for Rust: run side tasks in the idle time ("bubbles") of pipeline-parallel training.
//!
//! A trainer marks its bubbles on a [`Trainer`]; a side task attaches with [`Task::attach`] and
//! either implements [`SideTask`] and calls [`Task::run`], or runs its own loop with
//! [`Task::wait_start`], [`Task::should_pause`] and [`Task::ack_pause`]. Every call is one call
//! into the C ABI of libbubble (through `bubble-sys`).
//!
//! ```no_run
//! use bubble::{SideTask, Step, StepInfo, Task, TaskOptions, TaskResult};
//! struct Count(u32);
//! impl SideTask for Count {
//!     fn step(&mut self, _: &StepInfo) -> TaskResult<Step> {
//!         self.0 += 1;
//!         Ok(if self.0 == 100 { Step::Done } else { Step::Continue })
//!     }
//! }
//! let mut task = Task::attach("job", 0, "counter", &TaskOptions::default())?;
//! task.run(&mut Count(0))?;
//! # Ok::<(), bubble::Error>(())
//! ```
//!
//! ## What the compiler refuses
//!
//! The memory of a grant is reachable only while no call that may unmap it can be made. Each
//! example below fails to compile, and `cargo test` checks that it does. The error each gets
//! says why (the task borrowed twice, E0499; a step's memory outliving the step, a lifetime
//! error without a number; a type not `Sync`, E0277): the numbers are checked by a nightly
//! rustdoc only, a stable one checks just that compiling fails.
//!
//! A [`Grant`] borrows its task: `ack_revoke` (like `ack_pause`, `wait_start` or dropping the
//! task) cannot run while the grant's slice is still used.
//! ```compile_fail,E0499
//! use bubble::{Task, TaskOptions};
//! let mut task = Task::attach("job", 0, "t", &TaskOptions::default())?;
//! if let Some(mut g) = task.grant()? {
//!     task.ack_revoke()?;
//!     g.as_mut_slice();
//! }
//! # Ok::<(), bubble::Error>(())
//! ```
//! A step's memory cannot be kept past the step.
//! ```compile_fail
//! use bubble::{SideTask, Step, StepInfo, TaskResult};
//! use std::cell::RefMut;
//! struct Keep<'m>(Option<RefMut<'m, [u8]>>);
//! impl<'m> SideTask for Keep<'m> {
//!     fn step(&mut self, info: &StepInfo) -> TaskResult<Step> {
//!         self.0 = info.grant_memory();
//!         Ok(Step::Continue)
//!     }
//! }
//! ```
//! A task is used by one thread at a time: it may move to another thread, not be shared.
//! ```compile_fail,E0277
//! fn shared<T: Sync>() {}
//! shared::<bubble::Task>();
//! ```
//! ```
//! fn moved<T: Send>() {}
//! moved::<bubble::Task>();
//! ```

mod error;
mod grant;
mod task;
mod trainer;

pub use error::{Error, Result, Status, UnknownStatus};
pub use grant::{Grant, GrantBackend, GrantInfo, GrantRegion, GrantState, GrantStats, LendOptions};
pub use task::{
    OnTrainerExit, Outcome, SideTask, StartInfo, Step, StepInfo, Task, TaskOptions, TaskResult,
    TimeLeft, WakeMode,
};
pub use trainer::{
    BubbleGuard, BubbleKind, BubbleThread, Schedule, ScheduleBubbles, ScheduleKind, TaskInfo, Trainer,
    TrainerOptions, TrainerStats,
};

/// The version of the loaded libbubble ("0.1.0").
pub fn library_version() -> &'static str {
    // SAFETY: bb_version returns a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(bubble_sys::bb_version()) }.to_str().unwrap_or("?")
}

/// CLOCK_MONOTONIC now in nanoseconds: the clock of every libbubble time.
pub fn now_ns() -> u64 {
    // SAFETY: no arguments, no state.
    unsafe { bubble_sys::bb_now_ns() }
}

pub(crate) fn c_string(what: &str, value: &str) -> Result<std::ffi::CString> {
    std::ffi::CString::new(value).map_err(|_| Error {
        status: Status::Invalid,
        message: format!("{what} {value:?} contains a NUL byte; pass a name without one"),
        source: None,
    })
}

pub(crate) fn duration_ns(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
