//! Errors: [`MetraleError`], [`Result`], the status text ([`cuda_error_text`]) and
//! the teardown rule ([`is_teardown_noop`]).
//!
//! This module is the one place where a `CUresult` becomes an error. Driver calls go
//! through the crate's `cu!` macro, which yields a small `Copy` [`CallError`] (the
//! call's name and its status, or the missing symbol); the caller attaches what it
//! was working on while turning it into a [`MetraleError`]. Variants carry data (the
//! call, the status, the module, kernel or symbol, the launch shape, the JIT log);
//! text is made only when an error is displayed, never on success.
//!
//! Invariants:
//! - Every [`MetraleError`] text names the driver call that failed (or the check
//!   that refused the input), the status name and number with the driver's
//!   description, and the device, module, kernel, symbol or copy involved.
//! - `{:?}` of an error is its message, so `fn main() -> Result<()>` prints words.
//!
//! Companion libraries (NCCL, NVRTC, nvJitLink, next cuBLAS) fill one shape,
//! [`LibraryFailure`], carried as [`ErrorKind::Library`]; this room names none of
//! them (`library.rs`).
//!
//! Files: `mod.rs` [`MetraleError`]; `kind.rs` [`ErrorKind`] and its words;
//! `call.rs` [`CallError`] and `cu!`; `library.rs` the library shape; `text.rs`
//! [`cuda_error_text`] and [`is_teardown_noop`].

use std::fmt;

use metrale_cuda_sys::{self as sys, CUresult};

mod call;
mod kind;
mod library;
mod text;

pub(crate) use call::cu;
pub use call::CallError;
pub(crate) use call::{invalid_arg, report_drop_failures, report_line};
pub use kind::{ErrorKind, LaunchFailure, LaunchShape, NameKind};
pub use library::{LibraryError, LibraryFailure};
pub use text::{
    cuda_error_text, is_teardown_noop, CUDA_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_DEINITIALIZED,
    CUDA_ERROR_INVALID_CONTEXT,
};

/// The crate's result type.
pub type Result<T, E = MetraleError> = std::result::Result<T, E>;

/// Everything that can go wrong in metrale: one pointer wide, so a `Result<()>` is
/// 8 bytes on the hot path, with the failure's data in [`ErrorKind`] behind it.
///
/// `Display` (and `Debug`, which prints the same message) puts the failure into
/// words: the call, the status name and number with the library's description,
/// and what was being worked on. [`MetraleError::kind`] gives the data to match on.
///
/// # Matching on errors
///
/// Match on [`e.kind()`](MetraleError::kind), an [`ErrorKind`]: `MetraleError`
/// itself is one pointer with no variants, so `MetraleError::ArgumentMismatch {
/// .. }` does not name anything (rustc says E0223, "ambiguous associated type").
/// `ErrorKind` grows with the crate: end with a `_` arm. [`MetraleError::status`]
/// gives the driver's status whatever the kind, [`MetraleError::is_unavailable`]
/// says "no GPU stack here". Each common kind:
///
/// ```
/// use metrale_runtime::sys::CUresult;
/// use metrale_runtime::{ErrorKind, LaunchFailure, MetraleError, NameKind};
///
/// fn advice(e: &MetraleError) -> &'static str {
///     match e.kind() {
///         ErrorKind::DriverUnavailable(_) => "no driver here: fall back to the CPU",
///         ErrorKind::MissingSymbol { .. } => "the installed driver is too old for this call",
///         ErrorKind::Driver { status, .. } if *status == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
///             "out of device memory: free some and retry"
///         }
///         ErrorKind::Driver { .. } => "a driver call failed (the message names it)",
///         ErrorKind::ModuleLoad { .. } => "the driver refused a blob (the message has the JIT log)",
///         ErrorKind::InvalidBlob { .. } => "not a PTX, cubin or fatbin",
///         ErrorKind::NotFound { kind: NameKind::Kernel, .. } => "no kernel of that name",
///         ErrorKind::NotFound { .. } => "no module or symbol of that name",
///         ErrorKind::KernelLaunch { failure: LaunchFailure::Refused(_), .. } => {
///             "the launch shape was refused before the driver"
///         }
///         ErrorKind::KernelLaunch { .. } => "the driver refused the launch",
///         ErrorKind::ArgumentMismatch { .. } => "the arguments do not match the kernel's parameters",
///         ErrorKind::WrongDevice { .. } => "a handle of one device used with another",
///         ErrorKind::InvalidArgument(_) => "refused before any driver call",
///         _ => "something else: show the message",
///     }
/// }
///
/// let oom = MetraleError::from(ErrorKind::Driver {
///     call: "cuMemAlloc_v2",
///     status: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
///     subject: "device 0: allocating 1 GiB".into(),
/// });
/// assert_eq!(advice(&oom), "out of device memory: free some and retry");
/// assert_eq!(oom.status(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
///
/// let args = MetraleError::from(ErrorKind::ArgumentMismatch {
///     kernel: "kernels::vec_add".into(),
///     index: Some(2),
///     expected: 8,
///     given: 4,
/// });
/// assert_eq!(advice(&args), "the arguments do not match the kernel's parameters");
/// // The fields, when the handling needs them:
/// if let ErrorKind::ArgumentMismatch { index: Some(i), expected, given, .. } = args.kind() {
///     assert_eq!((*i, *expected, *given), (2, 8, 4));
/// }
///
/// let bad = MetraleError::from(ErrorKind::InvalidArgument("a launch dimension is zero".into()));
/// assert_eq!(advice(&bad), "refused before any driver call");
/// assert!(!bad.is_unavailable());
/// ```
///
/// The variants live on `ErrorKind`, not on `MetraleError`:
///
/// ```compile_fail,E0223
/// # use metrale_runtime::MetraleError;
/// fn is_mismatch(e: &MetraleError) -> bool {
///     matches!(e, MetraleError::ArgumentMismatch { .. })
/// }
/// ```
///
/// Loading, with the kinds a load can fail with:
///
/// ```no_run
/// use metrale_runtime::{ErrorKind, MetraleRegistry, NameKind};
/// # fn main() {
/// match MetraleRegistry::load(0, &[("kernels", b".version 8.0\nnot ptx")]) {
///     Ok(_) => {}
///     Err(e) => match e.kind() {
///         ErrorKind::DriverUnavailable(why) => eprintln!("no GPU here: {why}"),
///         ErrorKind::ModuleLoad { .. } => {
///             // "kernels: cuModuleLoadDataEx failed: CUDA_ERROR_INVALID_PTX (218): ...
///             //  JIT error log: ..."
///             eprintln!("{e}");
///             assert!(e.status().is_some());
///         }
///         ErrorKind::NotFound { kind: NameKind::Kernel, name, .. } => {
///             eprintln!("no kernel {name:?}")
///         }
///         _ => eprintln!("{e}"),
///     },
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct MetraleError(Box<ErrorKind>);

impl MetraleError {
    /// What failed, with its data.
    #[inline]
    pub fn kind(&self) -> &ErrorKind {
        &self.0
    }

    /// The failure's data, by value.
    pub fn into_kind(self) -> ErrorKind {
        *self.0
    }

    /// Whether the driver (or another library metrale loads) could not be loaded:
    /// the machine has no GPU stack, as opposed to a failure on a working one.
    pub fn is_unavailable(&self) -> bool {
        matches!(*self.0, ErrorKind::DriverUnavailable(_))
    }
}

impl From<ErrorKind> for MetraleError {
    #[cold]
    fn from(kind: ErrorKind) -> Self {
        MetraleError(Box::new(kind))
    }
}

impl From<sys::LoadError> for MetraleError {
    #[cold]
    fn from(e: sys::LoadError) -> Self {
        ErrorKind::DriverUnavailable(e).into()
    }
}

impl fmt::Display for MetraleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for MetraleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)
    }
}
impl fmt::Debug for MetraleError {
    /// The message itself, so `main` returning an error prints words, not a struct.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
impl MetraleError {
    /// The driver status behind this error, when a driver call returned one.
    pub fn status(&self) -> Option<CUresult> {
        match &*self.0 {
            ErrorKind::Driver { status, .. } | ErrorKind::ModuleLoad { status, .. } => {
                Some(*status)
            }
            ErrorKind::NotFound { status, .. } => *status,
            ErrorKind::GraphUpdate { status, .. } => Some(*status),
            ErrorKind::KernelLaunch {
                failure: LaunchFailure::Driver { status, .. },
                ..
            } => Some(*status),
            _ => None,
        }
    }
}

impl From<LibraryError> for MetraleError {
    #[cold]
    fn from(e: LibraryError) -> Self {
        ErrorKind::Library(e).into()
    }
}

impl MetraleError {
    /// This error's companion-library data (NCCL, NVRTC, nvJitLink), when a
    /// library call failed or was refused.
    pub fn as_library(&self) -> Option<&LibraryError> {
        match self.kind() {
            ErrorKind::Library(e) => Some(e),
            _ => None,
        }
    }
}
