//! The room's error data ([`BlasError`]), how it fills the crate's
//! library-error shape ([`LibraryFailure`]), and the one place it becomes a
//! [`MetraleError`] ([`into_error`]).

use std::borrow::Cow;
use std::ffi::CStr;
use std::fmt;

use metrale_cuda_sys::cublas::{cublasStatus_t, Cublas, CublasLt};
use metrale_cuda_sys::{LibraryLoadError, LibraryMissingSymbol};

use crate::error::{LibraryError, LibraryFailure, MetraleError};

/// Everything that can go wrong with cuBLAS or cuBLASLt.
#[derive(Clone)]
#[non_exhaustive]
pub enum BlasError {
    /// The library could not be loaded (every try, with the loader's message).
    Unavailable(LibraryLoadError),
    /// The loaded library lacks a function the operation needs (named, with the
    /// library's version).
    MissingSymbol {
        /// The symbol, the library and its version.
        missing: LibraryMissingSymbol,
        /// What was being worked on.
        subject: String,
    },
    /// A call returned an error status.
    Call {
        /// `"cuBLASLt"` or `"cuBLAS"`.
        library: &'static str,
        /// The function (`cublasLtMatmul`).
        call: &'static str,
        /// Its status.
        status: cublasStatus_t,
        /// The library's description of the status (`cublasLtGetStatusString`).
        description: String,
        /// What was being worked on (the plan, the handle, the device).
        subject: String,
    },
    /// The heuristic found no algorithm for the problem.
    NoAlgorithm {
        /// The problem: shapes, types, layouts, epilogue, workspace limit.
        problem: String,
    },
    /// Refused before the library was called: a shape, length, type,
    /// alignment, device, overlap, scale or capture rule.
    Refused {
        /// The library function that was not called.
        call: &'static str,
        /// What was being worked on (plan, operand).
        subject: String,
        /// What is wrong: what was expected, and what was given.
        reason: String,
    },
    /// The loaded library is older than the operation needs.
    TooOld {
        /// The function that was not called.
        call: &'static str,
        /// The version it needs (`(12, 5)`).
        needs: (u32, u32),
        /// The loaded library's version, when it said.
        version: Option<(u32, u32, u32)>,
    },
}

impl fmt::Display for BlasError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlasError::Unavailable(e) => write!(f, "{e}"),
            BlasError::MissingSymbol { missing, subject } => write!(f, "{subject}: {missing}"),
            BlasError::Call {
                call,
                status,
                description,
                subject,
                ..
            } => write!(f, "{subject}: {call} failed: {status}: {description}"),
            BlasError::NoAlgorithm { problem } => write!(
                f,
                "cublasLtMatmulAlgoGetHeuristic returned no algorithm for {problem} (the GPU or \
                 the library does not support this combination, or the workspace limit is too \
                 small)"
            ),
            BlasError::Refused {
                call,
                subject,
                reason,
            } => write!(f, "{subject}: {call} not called: {reason}"),
            BlasError::TooOld {
                call,
                needs,
                version,
            } => {
                write!(f, "{call} needs cuBLAS {}.{} or newer", needs.0, needs.1)?;
                match version {
                    Some((a, b, c)) => write!(f, "; the loaded library is {a}.{b}.{c}"),
                    None => f.write_str("; the loaded library does not say its version"),
                }
            }
        }
    }
}

impl fmt::Debug for BlasError {
    /// The message itself, like [`MetraleError`]'s.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for BlasError {}

impl BlasError {
    /// The library status behind this error, when a call returned one.
    pub fn status(&self) -> Option<cublasStatus_t> {
        match self {
            BlasError::Call { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Whether the library was called and failed (not refused before, not
    /// missing).
    pub fn is_call(&self) -> bool {
        matches!(self, BlasError::Call { .. })
    }
}

/// The one constructor of the crate's error from this room's.
#[cold]
pub(crate) fn into_error(e: BlasError) -> MetraleError {
    LibraryError::new(e).into()
}

impl MetraleError {
    /// This error's cuBLAS / cuBLASLt data, when it came from the `blas` room
    /// (feature `cublas`).
    pub fn as_cublas(&self) -> Option<&BlasError> {
        self.as_library()?.downcast_ref()
    }
}

impl LibraryFailure for BlasError {
    fn library(&self) -> &'static str {
        match self {
            BlasError::Unavailable(e) => e.library,
            BlasError::MissingSymbol { missing, .. } => missing.library,
            BlasError::Call { library, .. } => library,
            BlasError::NoAlgorithm { .. } => "cuBLASLt",
            BlasError::Refused { call, .. } | BlasError::TooOld { call, .. } => {
                if call.starts_with("cublasLt") {
                    "cuBLASLt"
                } else {
                    "cuBLAS"
                }
            }
        }
    }

    fn call(&self) -> Option<&'static str> {
        match self {
            BlasError::Unavailable(_) => None,
            BlasError::MissingSymbol { missing, .. } => Some(missing.name),
            BlasError::NoAlgorithm { .. } => Some("cublasLtMatmulAlgoGetHeuristic"),
            BlasError::Call { call, .. }
            | BlasError::Refused { call, .. }
            | BlasError::TooOld { call, .. } => Some(call),
        }
    }

    fn status_code(&self) -> Option<i64> {
        self.status().map(|s| i64::from(s.0))
    }

    fn status_name(&self) -> Option<Cow<'_, str>> {
        self.status()
            .map(|s| Cow::Borrowed(s.name().unwrap_or("CUBLAS_STATUS_UNKNOWN")))
    }

    /// The library's description of the status.
    fn text(&self) -> Option<Cow<'_, str>> {
        match self {
            BlasError::Call { description, .. } => Some(Cow::Borrowed(description)),
            _ => None,
        }
    }

    fn subject(&self) -> Option<Cow<'_, str>> {
        match self {
            BlasError::MissingSymbol { subject, .. }
            | BlasError::Call { subject, .. }
            | BlasError::Refused { subject, .. } => Some(Cow::Borrowed(subject)),
            BlasError::NoAlgorithm { problem } => Some(Cow::Borrowed(problem)),
            BlasError::Unavailable(_) | BlasError::TooOld { .. } => None,
        }
    }

    /// The reason of a refusal.
    fn detail(&self) -> Option<&str> {
        match self {
            BlasError::Refused { reason, .. } => Some(reason),
            _ => None,
        }
    }
}

/// A static C string from a status-text function, or `None`.
fn read_text(p: *const std::ffi::c_char) -> Option<String> {
    // SAFETY: the status-text functions return a static NUL-terminated string
    // (or NULL, checked) for any status.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// `cublasLtGetStatusString(status)`, or the header's name.
fn lt_description(lib: &CublasLt, status: cublasStatus_t) -> String {
    lib.cublasLtGetStatusString()
        .ok()
        // SAFETY: takes a status value, returns a static string (see read_text).
        .and_then(|f| read_text(unsafe { f(status) }))
        .unwrap_or_else(|| status.name().unwrap_or("unknown status").to_owned())
}

/// `cublasGetStatusString(status)`, or the header's name.
fn plain_description(lib: &Cublas, status: cublasStatus_t) -> String {
    lib.cublasGetStatusString()
        .ok()
        // SAFETY: takes a status value, returns a static string (see read_text).
        .and_then(|f| read_text(unsafe { f(status) }))
        .unwrap_or_else(|| status.name().unwrap_or("unknown status").to_owned())
}

/// The error of cuBLASLt's `call` returning `status`.
#[cold]
pub(crate) fn lt_call_error(
    lib: &CublasLt,
    call: &'static str,
    status: cublasStatus_t,
    subject: impl fmt::Display,
) -> MetraleError {
    into_error(BlasError::Call {
        library: "cuBLASLt",
        call,
        status,
        description: lt_description(lib, status),
        subject: subject.to_string(),
    })
}

/// The error of cuBLAS's `call` returning `status`.
#[cold]
pub(crate) fn plain_call_error(
    lib: &Cublas,
    call: &'static str,
    status: cublasStatus_t,
    subject: impl fmt::Display,
) -> MetraleError {
    into_error(BlasError::Call {
        library: "cuBLAS",
        call,
        status,
        description: plain_description(lib, status),
        subject: subject.to_string(),
    })
}

/// A refusal before `call`.
#[cold]
pub(crate) fn refused(
    call: &'static str,
    subject: impl fmt::Display,
    reason: impl fmt::Display,
) -> MetraleError {
    into_error(BlasError::Refused {
        call,
        subject: subject.to_string(),
        reason: reason.to_string(),
    })
}

/// A missing symbol of the loaded library.
#[cold]
pub(crate) fn missing(missing: LibraryMissingSymbol, subject: impl fmt::Display) -> MetraleError {
    into_error(BlasError::MissingSymbol {
        missing,
        subject: subject.to_string(),
    })
}

/// The library could not be loaded.
#[cold]
pub(crate) fn unavailable(e: &LibraryLoadError) -> MetraleError {
    into_error(BlasError::Unavailable(e.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_name_call_subject_and_reason() {
        let e = refused(
            "cublasLtMatmul",
            "plan 4x4x4 f32 on device 0, operand A",
            "needs 16 elements, the buffer has 15",
        );
        assert_eq!(
            e.to_string(),
            "plan 4x4x4 f32 on device 0, operand A: cublasLtMatmul not called: needs 16 \
             elements, the buffer has 15"
        );
        let lib = e.as_library().unwrap();
        assert_eq!(lib.library(), "cuBLASLt");
        assert_eq!(lib.call(), Some("cublasLtMatmul"));
        assert_eq!(lib.status_code(), None);
        assert!(e.as_cublas().is_some());
    }

    #[test]
    fn too_old_names_both_versions() {
        let e = into_error(BlasError::TooOld {
            call: "cublasGemmGroupedBatchedEx",
            needs: (12, 5),
            version: Some((12, 4, 0)),
        });
        assert_eq!(
            e.to_string(),
            "cublasGemmGroupedBatchedEx needs cuBLAS 12.5 or newer; the loaded library is 12.4.0"
        );
        assert_eq!(e.as_library().unwrap().library(), "cuBLAS");
    }
}
