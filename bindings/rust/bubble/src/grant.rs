//! Memory grants (docs/GRANTS.md): the trainer lends one range of memory per hub at a time and
//! each task is granted a piece of it, which the task maps and uses during bubbles.

use std::cell::{RefCell, RefMut};
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::c_void;
use std::time::Duration;

use bubble_sys as sys;

use crate::task::Task;

/// Where lent memory lives and how a grant reaches its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum GrantBackend {
    /// Shared host memory: CPU side tasks, machines without a GPU.
    #[default]
    Host,
    /// A window of one device allocation, named by its CUDA IPC handle.
    CudaIpc,
    /// A `cuMemCreate` allocation per grant, passed as a file descriptor.
    CudaVmm,
    /// A backend newer than this crate.
    Other(u32),
}

impl GrantBackend {
    pub(crate) fn from_raw(raw: u32) -> GrantBackend {
        match raw {
            sys::BB_GRANT_HOST => GrantBackend::Host,
            sys::BB_GRANT_CUDA_IPC => GrantBackend::CudaIpc,
            sys::BB_GRANT_CUDA_VMM => GrantBackend::CudaVmm,
            other => GrantBackend::Other(other),
        }
    }

    /// The C value (`bb_grant_backend`).
    pub fn raw(self) -> u32 {
        match self {
            GrantBackend::Host => sys::BB_GRANT_HOST,
            GrantBackend::CudaIpc => sys::BB_GRANT_CUDA_IPC,
            GrantBackend::CudaVmm => sys::BB_GRANT_CUDA_VMM,
            GrantBackend::Other(raw) => raw,
        }
    }
}

/// Where a held grant is in its life (a task without a grant has none: `task_grant` gives None).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GrantState {
    Active,
    /// Asked back; the task has not acked yet.
    Revoking,
    /// Giving the memory back failed; it is never reused.
    Quarantined,
    Other(u32),
}

impl GrantState {
    fn from_raw(raw: u32) -> GrantState {
        match raw {
            sys::BB_GRANT_STATE_ACTIVE => GrantState::Active,
            sys::BB_GRANT_STATE_REVOKING => GrantState::Revoking,
            sys::BB_GRANT_STATE_QUARANTINED => GrantState::Quarantined,
            other => GrantState::Other(other),
        }
    }
}

/// What `Trainer::lend` lends; `Default` gives the library's defaults (host memory, auto grant)
/// except `bytes`, which must be set.
#[derive(Debug, Clone)]
pub struct LendOptions {
    pub backend: GrantBackend,
    /// Size of the lent range (rounded down to the backend's unit).
    pub bytes: u64,
    /// cuda-ipc: lend this range of an allocation the trainer keeps alive until the hub
    /// closes; None: libbubble allocates the range.
    pub device_ptr: Option<u64>,
    /// CUDA device ordinal.
    pub device: i32,
    /// Live grants at most.
    pub max_grants: u32,
    /// Grant unit, a power of two; None: the backend's own.
    pub alignment: Option<u64>,
    /// Grant each attached task with a `mem_need` that many bytes, without being asked.
    pub auto_grant: bool,
    /// Zero each CUDA grant on the device before a task gets it. Turn it off only when every
    /// task has one owner: a task then sees what the previous holder left.
    pub clear_grants: bool,
}

impl Default for LendOptions {
    fn default() -> Self {
        LendOptions {
            backend: GrantBackend::Host,
            bytes: 0,
            device_ptr: None,
            device: 0,
            max_grants: 64,
            alignment: None,
            auto_grant: true,
            clear_grants: true,
        }
    }
}

impl LendOptions {
    pub(crate) fn to_sys(&self) -> sys::bb_lend_options_t {
        // SAFETY: init_sized writes all `size` bytes (a library that knows fewer fields zeroes
        // the rest).
        let mut o = unsafe {
            let mut o = std::mem::MaybeUninit::<sys::bb_lend_options_t>::uninit();
            let size = std::mem::size_of::<sys::bb_lend_options_t>();
            sys::bb_lend_options_init_sized(o.as_mut_ptr(), size);
            o.assume_init()
        };
        o.backend = self.backend.raw();
        o.bytes = self.bytes;
        o.device_ptr = self.device_ptr.unwrap_or(0);
        o.device = self.device;
        o.max_grants = self.max_grants;
        o.alignment = self.alignment.unwrap_or(0);
        o.auto_grant = u32::from(self.auto_grant);
        o.clear_grants = u32::from(self.clear_grants);
        o
    }
}

/// A task's grant as the trainer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantInfo {
    pub id: u64,
    pub task_id: u64,
    pub state: GrantState,
    pub backend: GrantBackend,
    /// The task says it maps the grant (its word: informative only).
    pub mapped: bool,
    pub bytes: u64,
    /// Where the grant sits in the lent range.
    pub offset: u64,
    /// The trainer's own address of the grant: a host pointer for `Host`, a `CUdeviceptr`
    /// for the CUDA backends.
    pub address: u64,
    /// While revoking: when the task will be killed.
    pub revoke_deadline_ns: Option<u64>,
}

impl GrantInfo {
    pub(crate) fn from_sys(g: &sys::bb_grant_info_t) -> Option<GrantInfo> {
        (g.state != sys::BB_GRANT_STATE_NONE).then(|| GrantInfo {
            id: g.id,
            task_id: g.task_id,
            state: GrantState::from_raw(g.state),
            backend: GrantBackend::from_raw(g.backend),
            mapped: g.mapped != 0,
            bytes: g.bytes,
            offset: g.offset,
            address: g.address,
            revoke_deadline_ns: (g.deadline_ns != 0).then_some(g.deadline_ns),
        })
    }

    /// The trainer's host pointer to the grant; None for device memory.
    pub fn host_ptr(&self) -> Option<*const u8> {
        (self.backend == GrantBackend::Host && self.address != 0).then_some(self.address as *const u8)
    }

    /// The grant's host memory, as the trainer maps it. `Trainer::read_grant` copies it out
    /// safely instead.
    ///
    /// # Safety
    /// The grant must stay granted (not released by an ack, the task's exit or the trainer's
    /// close) while the slice lives, since a released range is unmapped or granted to another
    /// task; and the task must not write the bytes meanwhile.
    pub unsafe fn as_host_slice(&self) -> Option<&[u8]> {
        self.host_ptr().map(|p| std::slice::from_raw_parts(p, self.bytes as usize))
    }
}

/// The lender's exact byte counts and the revoke protocol's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GrantStats {
    /// None before `Trainer::lend`.
    pub backend: Option<GrantBackend>,
    pub capacity: u64,
    pub granted_bytes: u64,
    pub requested_bytes: u64,
    pub free_bytes: u64,
    pub largest_free: u64,
    pub revoking_bytes: u64,
    pub quarantined_bytes: u64,
    pub active: u32,
    pub revoking: u32,
    pub quarantined: u32,
    pub grants_made: u64,
    pub grants_failed: u64,
    pub revokes: u64,
    pub revokes_acked: u64,
    pub tasks_killed: u64,
    pub released_dead: u64,
}

impl GrantStats {
    pub(crate) fn from_sys(s: &sys::bb_grant_stats_t) -> GrantStats {
        GrantStats {
            backend: (s.backend != 0).then(|| GrantBackend::from_raw(s.backend)),
            capacity: s.capacity,
            granted_bytes: s.granted_bytes,
            requested_bytes: s.requested_bytes,
            free_bytes: s.free_bytes,
            largest_free: s.largest_free,
            revoking_bytes: s.revoking_bytes,
            quarantined_bytes: s.quarantined_bytes,
            active: s.active,
            revoking: s.revoking,
            quarantined: s.quarantined,
            grants_made: s.grants_made,
            grants_failed: s.grants_failed,
            revokes: s.revokes,
            revokes_acked: s.revokes_acked,
            tasks_killed: s.tasks_killed,
            released_dead: s.released_dead,
        }
    }
}

/// The grant named in a start or step: its id, size and the task's raw pointer to it (host or
/// device). Reading through the pointer is up to the caller; `Task::grant` and
/// `StepInfo::grant_memory` give checked access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantRegion {
    pub id: u64,
    pub bytes: u64,
    pub ptr: *mut c_void,
}

// SAFETY: only an address; every dereference is the caller's unsafe code.
unsafe impl Send for GrantRegion {}
unsafe impl Sync for GrantRegion {}

impl GrantRegion {
    pub(crate) fn from_raw(id: u64, ptr: *mut c_void, bytes: u64) -> Option<GrantRegion> {
        (id != 0 && !ptr.is_null()).then_some(GrantRegion { id, bytes, ptr })
    }
}

/// The grant a task maps now, borrowed from the task: the calls that may unmap it
/// (`wait_start`, `ack_pause`, `ack_revoke`, `grant`, `detach`) need the task back, so the
/// memory cannot be reached after it is gone.
pub struct Grant<'a> {
    pub(crate) raw: sys::bb_task_grant_t,
    pub(crate) task: sys::bb_task_h,
    pub(crate) _task: PhantomData<&'a mut Task>,
}

impl Grant<'_> {
    pub fn id(&self) -> u64 {
        self.raw.id
    }
    pub fn backend(&self) -> GrantBackend {
        GrantBackend::from_raw(self.raw.backend)
    }
    pub fn len(&self) -> usize {
        self.raw.bytes as usize
    }
    pub fn is_empty(&self) -> bool {
        self.raw.bytes == 0
    }
    /// The task's pointer to the grant: host memory for `Host`, a device pointer for the CUDA
    /// backends (pass it to kernels).
    pub fn as_ptr(&self) -> *mut c_void {
        self.raw.ptr
    }
    /// For the CUDA backends, this process's ordinal of the GPU the grant is mapped on (the
    /// trainer's GPU found by UUID, so it differs from the trainer's ordinal where
    /// `CUDA_VISIBLE_DEVICES` does): device work on the pointer belongs there. None for host.
    pub fn device(&self) -> Option<i32> {
        (self.raw.device >= 0).then_some(self.raw.device)
    }
    /// While the trainer asks the grant back: the deadline to stop using it and call
    /// `Task::ack_revoke` (or `Task::ack_pause`); the task is killed after it.
    pub fn revoke_deadline_ns(&self) -> Option<u64> {
        (self.raw.revoke_deadline_ns != 0).then_some(self.raw.revoke_deadline_ns)
    }
    pub fn is_revoking(&self) -> bool {
        self.raw.revoke_deadline_ns != 0
    }
    /// Time left before the revoke deadline (zero once past it); None when not revoking.
    pub fn revoke_time_left(&self) -> Option<Duration> {
        self.revoke_deadline_ns().map(|d| Duration::from_nanos(d.saturating_sub(crate::now_ns())))
    }
    /// True once the bubble ended, a stop was asked or the grant is being revoked: the one
    /// task call allowed while the grant is borrowed.
    pub fn should_pause(&self) -> bool {
        // SAFETY: the task is alive and borrowed for as long as self is.
        unsafe { sys::bb_task_should_pause(self.task) != 0 }
    }
    /// The grant's host memory; None for device memory.
    pub fn as_slice(&self) -> Option<&[u8]> {
        // SAFETY: a host grant is mapped for `bytes` bytes until one of the calls that need the
        // task, which is borrowed for as long as self is.
        self.host().then(|| unsafe { std::slice::from_raw_parts(self.raw.ptr as *const u8, self.len()) })
    }
    /// The grant's host memory, writable; None for device memory.
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        // SAFETY: as in as_slice, and &mut self makes this the only slice of it.
        self.host().then(|| unsafe { std::slice::from_raw_parts_mut(self.raw.ptr as *mut u8, self.len()) })
    }
    fn host(&self) -> bool {
        self.raw.backend == sys::BB_GRANT_HOST && !self.raw.ptr.is_null()
    }
}

impl fmt::Debug for Grant<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grant")
            .field("id", &self.id())
            .field("backend", &self.backend())
            .field("ptr", &self.as_ptr())
            .field("bytes", &self.raw.bytes)
            .field("revoke_deadline_ns", &self.revoke_deadline_ns())
            .finish()
    }
}

/// The host memory of a step's grant, reachable for the duration of that step.
pub(crate) struct StepMemory<'a>(pub(crate) RefCell<&'a mut [u8]>);

impl<'a> StepMemory<'a> {
    pub(crate) fn borrow_mut(&self) -> RefMut<'_, [u8]> {
        RefMut::map(self.0.borrow_mut(), |s| &mut **s)
    }
}

impl fmt::Debug for StepMemory<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.try_borrow() {
            Ok(s) => write!(f, "[{} bytes]", s.len()),
            Err(_) => f.write_str("[borrowed]"),
        }
    }
}
