use std::ffi::CStr;
use std::fmt;

use bubble_sys as sys;

/// The status codes of `bubble.h` (without `Ok`: success is `Result::Ok`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    Invalid,
    NoMemory,
    System,
    NotFound,
    Busy,
    Full,
    Version,
    Permission,
    Timeout,
    Stopped,
    TrainerGone,
    Corrupt,
    State,
    Unsupported,
    Callback,
    /// A code newer than this crate (`raw()` gives its number). Only `from_raw` makes one, and
    /// only for a number no variant above names, so equal statuses always compare equal.
    Other(UnknownStatus),
}

/// The number of a status newer than this crate. It cannot be built outside the crate: a code
/// a later version names gets its own variant, never `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UnknownStatus(i32);

impl Status {
    /// The status of a C value (`bb_status`); an unknown one is `Other`.
    pub fn from_raw(code: sys::bb_status) -> Status {
        match code {
            sys::BB_E_INVALID => Status::Invalid,
            sys::BB_E_NOMEM => Status::NoMemory,
            sys::BB_E_SYSTEM => Status::System,
            sys::BB_E_NOT_FOUND => Status::NotFound,
            sys::BB_E_BUSY => Status::Busy,
            sys::BB_E_FULL => Status::Full,
            sys::BB_E_VERSION => Status::Version,
            sys::BB_E_PERMISSION => Status::Permission,
            sys::BB_E_TIMEOUT => Status::Timeout,
            sys::BB_E_STOPPED => Status::Stopped,
            sys::BB_E_TRAINER_GONE => Status::TrainerGone,
            sys::BB_E_CORRUPT => Status::Corrupt,
            sys::BB_E_STATE => Status::State,
            sys::BB_E_UNSUPPORTED => Status::Unsupported,
            sys::BB_E_CALLBACK => Status::Callback,
            other => Status::Other(UnknownStatus(other)),
        }
    }

    /// The C value of this status.
    pub fn raw(self) -> i32 {
        match self {
            Status::Invalid => sys::BB_E_INVALID,
            Status::NoMemory => sys::BB_E_NOMEM,
            Status::System => sys::BB_E_SYSTEM,
            Status::NotFound => sys::BB_E_NOT_FOUND,
            Status::Busy => sys::BB_E_BUSY,
            Status::Full => sys::BB_E_FULL,
            Status::Version => sys::BB_E_VERSION,
            Status::Permission => sys::BB_E_PERMISSION,
            Status::Timeout => sys::BB_E_TIMEOUT,
            Status::Stopped => sys::BB_E_STOPPED,
            Status::TrainerGone => sys::BB_E_TRAINER_GONE,
            Status::Corrupt => sys::BB_E_CORRUPT,
            Status::State => sys::BB_E_STATE,
            Status::Unsupported => sys::BB_E_UNSUPPORTED,
            Status::Callback => sys::BB_E_CALLBACK,
            Status::Other(UnknownStatus(code)) => code,
        }
    }

    /// "BB_E_TIMEOUT" etc.
    pub fn name(self) -> &'static str {
        // SAFETY: bb_status_name never returns NULL and its strings are static.
        unsafe { CStr::from_ptr(sys::bb_status_name(self.raw())) }.to_str().unwrap_or("?")
    }
}

/// A failed libbubble call: the status and the library's sentence about what to do.
#[derive(Debug)]
pub struct Error {
    pub status: Status,
    pub message: String,
    /// For `Status::Callback`: what the side task's method returned.
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Builds the error of a failed call. Must run right after it, on the same thread:
    /// `bb_last_error()` is per thread and reset by the next call.
    pub(crate) fn last(code: sys::bb_status) -> Error {
        // SAFETY: never NULL; copied before any other libbubble call.
        let mut message = unsafe { CStr::from_ptr(sys::bb_last_error()) }.to_string_lossy().into_owned();
        if message.is_empty() {
            // SAFETY: never NULL, static.
            message = unsafe { CStr::from_ptr(sys::bb_status_str(code)) }.to_string_lossy().into_owned();
        }
        Error { status: Status::from_raw(code), message, source: None }
    }
}

pub(crate) fn check(code: sys::bb_status) -> Result<()> {
    if code == sys::BB_OK {
        Ok(())
    } else {
        Err(Error::last(code))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]", self.message, self.status.name())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}
