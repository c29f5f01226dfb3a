//! The room's error data ([`NvrtcError`]), how it fills the crate's library-error
//! shape ([`LibraryFailure`]), and the one place it becomes a [`MetraleError`]
//! ([`into_error`]), so a change of `MetraleError`'s shape touches this file only.

use std::borrow::Cow;
use std::fmt;

use metrale_cuda_sys::nvjitlink::nvJitLinkResult;
use metrale_cuda_sys::nvrtc::nvrtcResult;
use metrale_cuda_sys::{self as sys};

use crate::error::{LibraryError, LibraryFailure, MetraleError};

use super::Target;

/// A status of NVRTC or nvJitLink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibraryStatus {
    /// An `nvrtcResult`.
    Nvrtc(nvrtcResult),
    /// An `nvJitLinkResult`.
    NvJitLink(nvJitLinkResult),
}

impl fmt::Display for LibraryStatus {
    /// `NVRTC_ERROR_COMPILATION (6)` (the name from `nvrtcGetErrorString` when the
    /// library can say), `NVJITLINK_ERROR_PTX_COMPILE (4)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LibraryStatus::Nvrtc(s) => write!(f, "{} ({})", nvrtc_status_name(s), s.0),
            LibraryStatus::NvJitLink(s) => write!(f, "{s}"),
        }
    }
}

/// NVRTC's own name for `status` (`nvrtcGetErrorString`), else the header's.
fn nvrtc_status_name(status: nvrtcResult) -> String {
    let from_library = sys::nvrtc::nvrtc()
        .ok()
        .and_then(|lib| lib.nvrtcGetErrorString().ok())
        .and_then(|f| {
            // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string
            // (or NULL), for any status value.
            let text = unsafe { f(status) };
            // SAFETY: checked non-null; the string is static.
            (!text.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(text) })
        })
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty() && !s.contains("unknown"));
    from_library
        .or_else(|| status.name().map(str::to_owned))
        .unwrap_or_else(|| "NVRTC_UNKNOWN".to_owned())
}

/// Everything that can go wrong compiling or linking at run time.
#[derive(Clone)]
#[non_exhaustive]
pub enum NvrtcError {
    /// The library could not be loaded (every try, with the loader's message).
    Unavailable(sys::LibraryLoadError),
    /// The loaded library lacks a function the operation needs.
    MissingSymbol {
        /// The symbol, the library and its version.
        missing: sys::LibraryMissingSymbol,
        /// What was being done (`program 'a.cu'`).
        subject: String,
    },
    /// A call returned an error status.
    Call {
        /// The function (`nvrtcCreateProgram`).
        call: &'static str,
        /// Its status.
        status: LibraryStatus,
        /// What was being done.
        subject: String,
    },
    /// `nvrtcCompileProgram` failed: the status and the whole program log.
    Compile {
        /// The program's (source's) name.
        program: String,
        /// What it was compiled for.
        target: Target,
        /// NVRTC's status (`NVRTC_ERROR_COMPILATION`).
        status: nvrtcResult,
        /// The program log, whole.
        log: String,
    },
    /// An nvJitLink call failed: the status and the linker's error log.
    Link {
        /// The function (`__nvJitLinkComplete_13_0`).
        call: &'static str,
        /// Its status.
        status: nvJitLinkResult,
        /// What was being linked.
        subject: String,
        /// The error log (empty when the linker wrote none).
        log: String,
    },
    /// Input the library cannot be given (an interior NUL, nothing to link, ...).
    Invalid {
        /// What was being done.
        subject: String,
        /// What is wrong.
        reason: String,
    },
    /// The on-disk cache folder could not be used.
    Cache {
        /// The folder or file.
        path: String,
        /// The operation and the system's message.
        reason: String,
    },
}

impl fmt::Display for NvrtcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NvrtcError::Unavailable(e) => write!(f, "{e}"),
            NvrtcError::MissingSymbol { missing, subject } => write!(f, "{subject}: {missing}"),
            NvrtcError::Call {
                call,
                status,
                subject,
            } => write!(f, "{subject}: {call} failed: {status}"),
            NvrtcError::Compile {
                program,
                target,
                status,
                log,
            } => {
                write!(
                    f,
                    "program '{program}': nvrtcCompileProgram failed: {} [{target}]",
                    LibraryStatus::Nvrtc(*status)
                )?;
                if log.trim().is_empty() {
                    f.write_str("; the program log is empty")
                } else {
                    write!(f, "\nprogram log:\n{}", log.trim_end())
                }
            }
            NvrtcError::Link {
                call,
                status,
                subject,
                log,
            } => {
                write!(f, "{subject}: {call} failed: {status}")?;
                if log.trim().is_empty() {
                    f.write_str("; the link log is empty")
                } else {
                    write!(f, "\nlink log:\n{}", log.trim_end())
                }
            }
            NvrtcError::Invalid { subject, reason } => write!(f, "{subject}: {reason}"),
            NvrtcError::Cache { path, reason } => {
                write!(f, "compile cache at {path}: {reason}")
            }
        }
    }
}

impl fmt::Debug for NvrtcError {
    /// The message itself, like [`MetraleError`]'s.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for NvrtcError {}

impl NvrtcError {
    /// The program log of a failed compile, or the link log of a failed link.
    pub fn log(&self) -> Option<&str> {
        match self {
            NvrtcError::Compile { log, .. } | NvrtcError::Link { log, .. } => Some(log),
            _ => None,
        }
    }
}

/// The one constructor of the crate's error from this room's.
#[cold]
pub(crate) fn into_error(e: NvrtcError) -> MetraleError {
    LibraryError::new(e).into()
}

impl MetraleError {
    /// This error's NVRTC / nvJitLink data, when it came from run-time
    /// compilation (feature `nvrtc`).
    pub fn as_nvrtc(&self) -> Option<&NvrtcError> {
        self.as_library()?.downcast_ref()
    }
}

impl LibraryStatus {
    fn library(self) -> &'static str {
        match self {
            LibraryStatus::Nvrtc(_) => "NVRTC",
            LibraryStatus::NvJitLink(_) => "nvJitLink",
        }
    }

    fn code(self) -> i64 {
        match self {
            LibraryStatus::Nvrtc(s) => i64::from(s.0),
            LibraryStatus::NvJitLink(s) => i64::from(s.0),
        }
    }

    fn name(self) -> Cow<'static, str> {
        match self {
            LibraryStatus::Nvrtc(s) => Cow::Owned(nvrtc_status_name(s)),
            LibraryStatus::NvJitLink(s) => match s.name() {
                Some(n) => Cow::Borrowed(n),
                None => Cow::Borrowed("NVJITLINK_UNKNOWN"),
            },
        }
    }
}

impl LibraryFailure for NvrtcError {
    /// `"NVRTC"` or `"nvJitLink"`: the library that failed (NVRTC for this room's
    /// own refusals and the compile cache).
    fn library(&self) -> &'static str {
        match self {
            NvrtcError::Unavailable(e) => e.library,
            NvrtcError::MissingSymbol { missing, .. } => missing.library,
            NvrtcError::Call { status, .. } => status.library(),
            NvrtcError::Link { .. } => "nvJitLink",
            NvrtcError::Compile { .. } | NvrtcError::Invalid { .. } | NvrtcError::Cache { .. } => {
                "NVRTC"
            }
        }
    }

    fn call(&self) -> Option<&'static str> {
        match self {
            NvrtcError::MissingSymbol { missing, .. } => Some(missing.name),
            NvrtcError::Call { call, .. } | NvrtcError::Link { call, .. } => Some(call),
            NvrtcError::Compile { .. } => Some("nvrtcCompileProgram"),
            _ => None,
        }
    }

    fn status_code(&self) -> Option<i64> {
        match self {
            NvrtcError::Call { status, .. } => Some(status.code()),
            NvrtcError::Compile { status, .. } => Some(LibraryStatus::Nvrtc(*status).code()),
            NvrtcError::Link { status, .. } => Some(LibraryStatus::NvJitLink(*status).code()),
            _ => None,
        }
    }

    fn status_name(&self) -> Option<Cow<'_, str>> {
        match self {
            NvrtcError::Call { status, .. } => Some(status.name()),
            NvrtcError::Compile { status, .. } => Some(LibraryStatus::Nvrtc(*status).name()),
            NvrtcError::Link { status, .. } => Some(LibraryStatus::NvJitLink(*status).name()),
            _ => None,
        }
    }

    /// NVRTC's and nvJitLink's only words for a status are its name: `None`.
    fn text(&self) -> Option<Cow<'_, str>> {
        None
    }

    fn subject(&self) -> Option<Cow<'_, str>> {
        match self {
            NvrtcError::Unavailable(_) => None,
            NvrtcError::MissingSymbol { subject, .. }
            | NvrtcError::Call { subject, .. }
            | NvrtcError::Link { subject, .. }
            | NvrtcError::Invalid { subject, .. } => Some(Cow::Borrowed(subject)),
            NvrtcError::Compile { program, .. } => Some(Cow::Owned(format!("program '{program}'"))),
            NvrtcError::Cache { path, .. } => Some(Cow::Owned(format!("compile cache at {path}"))),
        }
    }

    /// The program log of a failed compile, or the link log of a failed link,
    /// when not empty.
    fn detail(&self) -> Option<&str> {
        self.log().filter(|l| !l.trim().is_empty())
    }
}
