//! The room's error data ([`NcclError`]), how it fills the crate's library-error
//! shape ([`LibraryFailure`]), and the one place it becomes a [`MetraleError`]
//! ([`into_error`]), so a change of `MetraleError`'s shape touches this file only.

use std::borrow::Cow;
use std::ffi::CStr;
use std::fmt;
use std::time::Duration;

use metrale_cuda_sys::nccl::{ncclComm_t, ncclResult_t, Nccl};
use metrale_cuda_sys::{LibraryLoadError, LibraryMissingSymbol};

use crate::error::{LibraryError, LibraryFailure, MetraleError};

/// Which communicator an error is about: its rank, the number of ranks and its
/// device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommInfo {
    /// This communicator's rank.
    pub rank: usize,
    /// The number of ranks.
    pub size: usize,
    /// The device ordinal.
    pub device: usize,
}

impl fmt::Display for CommInfo {
    /// `rank 1 of 2, device 0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {}, device {}",
            self.rank, self.size, self.device
        )
    }
}

/// A status NCCL reported, as [`Communicator::async_status`](super::Communicator::async_status)
/// gives it: success, still in progress (a non-blocking operation running), or
/// an error a peer, the network or the device caused. Any value NCCL returns is
/// a value here, also one newer than this crate's header.
///
/// ```
/// use metrale_runtime::NcclStatus;
/// assert!(NcclStatus::SUCCESS.is_success());
/// assert!(!NcclStatus::IN_PROGRESS.is_error());
/// assert_eq!(NcclStatus::from_code(6).to_string(), "ncclRemoteError (6)");
/// assert!(NcclStatus::from_code(6).is_error());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NcclStatus(ncclResult_t);

impl NcclStatus {
    /// `ncclSuccess` (0).
    pub const SUCCESS: NcclStatus = NcclStatus(ncclResult_t::ncclSuccess);
    /// `ncclInProgress` (7): a non-blocking operation is still running.
    pub const IN_PROGRESS: NcclStatus = NcclStatus(ncclResult_t::ncclInProgress);

    /// The status of NCCL's numeric code.
    pub const fn from_code(code: u32) -> NcclStatus {
        NcclStatus(ncclResult_t(code))
    }

    /// NCCL's numeric code (`ncclRemoteError` is 6).
    pub const fn code(self) -> u32 {
        self.0 .0
    }

    /// The name of NCCL's constant (`"ncclRemoteError"`), or `None` for a code
    /// this crate's header does not define.
    pub const fn name(self) -> Option<&'static str> {
        self.0.name()
    }

    /// Whether this is `ncclSuccess`.
    pub const fn is_success(self) -> bool {
        self.0.is_success()
    }

    /// Whether this is `ncclInProgress`.
    pub const fn is_in_progress(self) -> bool {
        self.0 .0 == ncclResult_t::ncclInProgress.0
    }

    /// Whether this is an error: neither success nor in progress.
    pub const fn is_error(self) -> bool {
        !self.is_success() && !self.is_in_progress()
    }

    /// The raw status, for calls metrale does not wrap.
    pub const fn raw(self) -> ncclResult_t {
        self.0
    }
}

impl From<ncclResult_t> for NcclStatus {
    fn from(raw: ncclResult_t) -> NcclStatus {
        NcclStatus(raw)
    }
}

impl fmt::Display for NcclStatus {
    /// `ncclRemoteError (6)`, as NCCL errors name a status.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// Everything that can go wrong with NCCL.
#[derive(Clone)]
#[non_exhaustive]
pub enum NcclError {
    /// The library could not be loaded (every try, with the loader's message).
    Unavailable(LibraryLoadError),
    /// The loaded library lacks a function the operation needs.
    MissingSymbol {
        /// The symbol, the library and its version.
        missing: LibraryMissingSymbol,
        /// The communicator, when there is one.
        comm: Option<CommInfo>,
    },
    /// A call returned an error status.
    Call {
        /// The function (`ncclAllReduce`).
        call: &'static str,
        /// Its status.
        status: ncclResult_t,
        /// `ncclGetErrorString`'s description of the status.
        description: String,
        /// `ncclGetLastError`'s text (empty when NCCL said nothing more).
        last_error: String,
        /// The communicator, when there is one.
        comm: Option<CommInfo>,
    },
    /// `ncclCommGetAsyncError` reported a failure; the communicator was aborted.
    Async {
        /// What was being done (`wait`, `ncclCommInitRankConfig`).
        during: String,
        /// The asynchronous status.
        status: ncclResult_t,
        /// `ncclGetErrorString`'s description of it.
        description: String,
        /// `ncclGetLastError`'s text.
        last_error: String,
        /// The communicator.
        comm: CommInfo,
    },
    /// A bounded wait ran out; the communicator was aborted (`ncclCommAbort`).
    Timeout {
        /// The operation still pending (`ncclAllReduce`, `ncclCommInitRankConfig`).
        pending: String,
        /// How long was waited.
        waited: Duration,
        /// The communicator.
        comm: CommInfo,
    },
    /// Refused before NCCL was called: a length, root, peer or rank out of rule.
    Refused {
        /// The NCCL function that was not called.
        call: &'static str,
        /// The communicator (rank and size), when there is one.
        comm: Option<CommInfo>,
        /// What is wrong, with the sizes.
        reason: String,
    },
    /// The communicator was aborted earlier (by a failed wait, or `abort`).
    Aborted {
        /// The NCCL function that was not called.
        call: &'static str,
        /// The communicator.
        comm: CommInfo,
    },
    /// The loaded NCCL is older than the release that brought the call
    /// (checked against `ncclGetVersion` before the call is looked up).
    Unsupported {
        /// The NCCL function that was not called.
        call: &'static str,
        /// The oldest NCCL that has it, `(major, minor, patch)`.
        needs: (u32, u32, u32),
        /// The loaded library's version (`None`: it does not say).
        found: Option<(u32, u32, u32)>,
        /// The communicator, when there is one.
        comm: Option<CommInfo>,
    },
    /// A bounded wait failed (its timeout passed, or NCCL reported an
    /// asynchronous error) and, as asked
    /// ([`OnFailure::Revoke`](super::OnFailure::Revoke)), the communicator was
    /// revoked, not aborted: shrink it to go on with the live ranks.
    WaitRevoked {
        /// The operation still pending.
        pending: String,
        /// How long was waited.
        waited: Duration,
        /// The asynchronous status (`None`: the timeout passed).
        status: Option<ncclResult_t>,
        /// `ncclGetErrorString`'s description of it (empty without one).
        description: String,
        /// `ncclGetLastError`'s text.
        last_error: String,
        /// The communicator.
        comm: CommInfo,
    },
    /// The communicator was revoked (`ncclCommRevoke`): only
    /// [`shrink`](super::Communicator::shrink) and its Drop remain.
    Revoked {
        /// The NCCL function that was not called.
        call: &'static str,
        /// The communicator.
        comm: CommInfo,
    },
}

impl fmt::Display for NcclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on = |comm: &Option<CommInfo>| match comm {
            Some(c) => format!(" (communicator {c})"),
            None => String::new(),
        };
        match self {
            NcclError::Unavailable(e) => write!(f, "{e}"),
            NcclError::MissingSymbol { missing, comm } => write!(f, "{missing}{}", on(comm)),
            NcclError::Call {
                call,
                status,
                description,
                last_error,
                comm,
            } => {
                write!(f, "{call} failed: {status}: {description}")?;
                if !last_error.is_empty() {
                    write!(f, "; last error: {last_error}")?;
                }
                f.write_str(&on(comm))
            }
            NcclError::Async {
                during,
                status,
                description,
                last_error,
                comm,
            } => {
                write!(
                    f,
                    "{during}: NCCL reported an asynchronous error: {status}: {description}"
                )?;
                if !last_error.is_empty() {
                    write!(f, "; last error: {last_error}")?;
                }
                write!(f, " (communicator {comm}; aborted)")
            }
            NcclError::Timeout {
                pending,
                waited,
                comm,
            } => write!(
                f,
                "{pending} had not completed after {waited:?}; the communicator ({comm}) was \
                 aborted (ncclCommAbort) and cannot be used again"
            ),
            NcclError::Refused { call, comm, reason } => {
                write!(f, "{call} not called{}: {reason}", on(comm))
            }
            NcclError::Aborted { call, comm } => write!(
                f,
                "{call} not called: the communicator ({comm}) was aborted"
            ),
            NcclError::Unsupported {
                call,
                needs: (a, b, c),
                found,
                comm,
            } => {
                write!(
                    f,
                    "{call} not called{}: it needs NCCL {a}.{b}.{c} or newer; ",
                    on(comm)
                )?;
                match found {
                    Some((x, y, z)) => write!(f, "the loaded NCCL is {x}.{y}.{z}"),
                    None => write!(f, "the loaded NCCL does not say its version"),
                }
            }
            NcclError::WaitRevoked {
                pending,
                waited,
                status,
                description,
                last_error,
                comm,
            } => {
                match status {
                    Some(st) => write!(
                        f,
                        "wait for {pending}: NCCL reported an asynchronous error: {st}: {description}"
                    )?,
                    None => write!(f, "{pending} had not completed after {waited:?}")?,
                }
                if !last_error.is_empty() {
                    write!(f, "; last error: {last_error}")?;
                }
                write!(
                    f,
                    "; the communicator ({comm}) was revoked (ncclCommRevoke), not aborted: \
                     shrink it to go on with the live ranks"
                )
            }
            NcclError::Revoked { call, comm } => write!(
                f,
                "{call} not called: the communicator ({comm}) was revoked (ncclCommRevoke); \
                 shrink it or drop it"
            ),
        }
    }
}

impl fmt::Debug for NcclError {
    /// The message itself, like [`MetraleError`]'s.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for NcclError {}

impl NcclError {
    /// The NCCL status behind this error, when a call or the communicator
    /// returned one.
    pub fn status(&self) -> Option<ncclResult_t> {
        match self {
            NcclError::Call { status, .. } | NcclError::Async { status, .. } => Some(*status),
            NcclError::WaitRevoked { status, .. } => *status,
            _ => None,
        }
    }
}

/// The one constructor of the crate's error from this room's.
#[cold]
pub(crate) fn into_error(e: NcclError) -> MetraleError {
    LibraryError::new(e).into()
}

impl MetraleError {
    /// This error's NCCL data, when it came from a communicator or NCCL itself
    /// (feature `nccl`).
    pub fn as_nccl(&self) -> Option<&NcclError> {
        self.as_library()?.downcast_ref()
    }
}

impl LibraryFailure for NcclError {
    fn library(&self) -> &'static str {
        "NCCL"
    }

    fn call(&self) -> Option<&'static str> {
        match self {
            NcclError::MissingSymbol { missing, .. } => Some(missing.name),
            NcclError::Call { call, .. }
            | NcclError::Refused { call, .. }
            | NcclError::Aborted { call, .. }
            | NcclError::Unsupported { call, .. }
            | NcclError::Revoked { call, .. } => Some(call),
            _ => None,
        }
    }

    fn status_code(&self) -> Option<i64> {
        self.status().map(|s| i64::from(s.0))
    }

    fn status_name(&self) -> Option<Cow<'_, str>> {
        self.status()
            .map(|s| Cow::Borrowed(s.name().unwrap_or("ncclUnknownResult")))
    }

    /// `ncclGetErrorString`'s description of the status.
    fn text(&self) -> Option<Cow<'_, str>> {
        match self {
            NcclError::Call { description, .. } | NcclError::Async { description, .. } => {
                Some(Cow::Borrowed(description))
            }
            NcclError::WaitRevoked { description, .. } if !description.is_empty() => {
                Some(Cow::Borrowed(description))
            }
            _ => None,
        }
    }

    /// The communicator (`rank 1 of 2, device 0`), when there is one.
    fn subject(&self) -> Option<Cow<'_, str>> {
        let comm = match self {
            NcclError::Unavailable(_) => None,
            NcclError::MissingSymbol { comm, .. }
            | NcclError::Call { comm, .. }
            | NcclError::Refused { comm, .. }
            | NcclError::Unsupported { comm, .. } => *comm,
            NcclError::Async { comm, .. }
            | NcclError::Timeout { comm, .. }
            | NcclError::Aborted { comm, .. }
            | NcclError::WaitRevoked { comm, .. }
            | NcclError::Revoked { comm, .. } => Some(*comm),
        };
        comm.map(|c| Cow::Owned(format!("communicator {c}")))
    }

    /// `ncclGetLastError`'s text, when NCCL said more.
    fn detail(&self) -> Option<&str> {
        match self {
            NcclError::Call { last_error, .. }
            | NcclError::Async { last_error, .. }
            | NcclError::WaitRevoked { last_error, .. } => {
                Some(last_error.as_str()).filter(|t| !t.is_empty())
            }
            _ => None,
        }
    }
}

/// `ncclGetErrorString(status)`, or the header's name when the library lacks it.
pub(crate) fn description(lib: &Nccl, status: ncclResult_t) -> String {
    let text = lib.ncclGetErrorString().ok().and_then(|f| {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string (or
        // NULL) for any status value.
        let p = unsafe { f(status) };
        // SAFETY: checked non-null; the string is static.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    });
    text.unwrap_or_else(|| status.name().unwrap_or("unknown status").to_owned())
}

/// `ncclGetLastError(comm)` (the library's last message, for this communicator
/// or, with a null one, the thread), or empty.
pub(crate) fn last_error(lib: &Nccl, comm: ncclComm_t) -> String {
    lib.ncclGetLastError()
        .ok()
        .and_then(|f| {
            // SAFETY: ncclGetLastError accepts a live communicator or NULL and
            // returns a NUL-terminated string it owns (or NULL).
            let p = unsafe { f(comm) };
            // SAFETY: checked non-null; read at once, before any other NCCL call.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// The error of `call` returning `status`.
#[cold]
pub(crate) fn call_error(
    lib: &Nccl,
    call: &'static str,
    status: ncclResult_t,
    raw: ncclComm_t,
    comm: Option<CommInfo>,
) -> MetraleError {
    into_error(NcclError::Call {
        call,
        status,
        description: description(lib, status),
        last_error: last_error(lib, raw),
        comm,
    })
}

/// A refusal before `call`.
#[cold]
pub(crate) fn refused(
    call: &'static str,
    comm: Option<CommInfo>,
    reason: impl Into<String>,
) -> MetraleError {
    into_error(NcclError::Refused {
        call,
        comm,
        reason: reason.into(),
    })
}

/// Refuse `call` unless the loaded NCCL `lib` is at least `needs`.
pub(crate) fn require_version(
    lib: &Nccl,
    call: &'static str,
    needs: (u32, u32, u32),
    comm: Option<CommInfo>,
) -> Result<(), MetraleError> {
    let found = lib.version();
    if found.is_some_and(|v| v >= needs) {
        return Ok(());
    }
    Err(into_error(NcclError::Unsupported {
        call,
        needs,
        found,
        comm,
    }))
}

/// A missing symbol of the loaded library.
#[cold]
pub(crate) fn missing(missing: LibraryMissingSymbol, comm: Option<CommInfo>) -> MetraleError {
    into_error(NcclError::MissingSymbol { missing, comm })
}
