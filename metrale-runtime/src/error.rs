//! Errors: [`MetraleError`], [`Result`], the status text ([`cuda_error_text`]) and
//! the teardown rule ([`is_teardown_noop`]).
//!
//! This module is the one place where a `CUresult` becomes an error. Driver calls go
//! through the crate's `cu!` macro, which yields a small `Copy` [`CallError`] (the call's
//! name and its status, or the missing symbol); the caller then attaches what it was
//! working on (module, kernel, symbol, launch shape) while turning it into a
//! [`MetraleError`]. Text is built only on that error path, never on success.
//!
//! Invariant: every [`MetraleError`] text names the driver call that failed (or the
//! check that refused the input), the status name and number with the driver's
//! description, and the module, kernel or symbol involved.

use std::ffi::{c_char, CStr};
use std::fmt;

use metrale_cuda_sys::{self as sys, CUresult};

/// The crate's result type.
pub type Result<T, E = MetraleError> = std::result::Result<T, E>;

/// `CUDA_ERROR_DEINITIALIZED` (4): the driver is shutting down.
pub const CUDA_ERROR_DEINITIALIZED: CUresult = CUresult::CUDA_ERROR_DEINITIALIZED;
/// `CUDA_ERROR_INVALID_CONTEXT` (201): no (or no valid) context is current.
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = CUresult::CUDA_ERROR_INVALID_CONTEXT;
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709): the context was destroyed.
pub const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED;

/// Whether `status` means the driver or context is already gone, so a free, unload,
/// destroy or release has nothing left to do: `CUDA_ERROR_DEINITIALIZED` (4),
/// `CUDA_ERROR_INVALID_CONTEXT` (201) or `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709).
#[inline]
pub fn is_teardown_noop(status: CUresult) -> bool {
    status == CUDA_ERROR_DEINITIALIZED
        || status == CUDA_ERROR_INVALID_CONTEXT
        || status == CUDA_ERROR_CONTEXT_IS_DESTROYED
}

/// `"<NAME> (<status>): <description>"` for a status.
///
/// The name and description come from the driver (`cuGetErrorName`,
/// `cuGetErrorString`). Where the driver cannot be loaded or has no name for the
/// status, the name comes from the header's constants, and `CUDA_UNKNOWN` for a
/// status the header does not know either; a missing description reads
/// `(no message)`.
pub fn cuda_error_text(status: CUresult) -> String {
    let (name, description) = match sys::driver() {
        Ok(d) => (
            driver_string(d.cuGetErrorName().ok(), status),
            driver_string(d.cuGetErrorString().ok(), status),
        ),
        Err(_) => (None, None),
    };
    let name = name
        .or_else(|| status.name().map(str::to_owned))
        .unwrap_or_else(|| "CUDA_UNKNOWN".to_owned());
    let description = description.unwrap_or_else(|| "(no message)".to_owned());
    format!("{name} ({}): {description}", status.0)
}

/// Ask `cuGetErrorName`/`cuGetErrorString` (same signature) about `status`.
fn driver_string(
    f: Option<unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult>,
    status: CUresult,
) -> Option<String> {
    let f = f?;
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: the driver writes a pointer to a static NUL-terminated string, or
    // leaves NULL and returns an error for a status it does not know.
    let ok = unsafe { f(status, &mut text) }.is_success();
    if !ok || text.is_null() {
        return None;
    }
    // SAFETY: checked non-null; the driver's strings are static and NUL-terminated.
    Some(
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The version the loaded driver reports, when it can be asked.
pub(crate) fn loaded_driver_version() -> Option<i32> {
    let d = sys::driver().ok()?;
    let f = d.cuDriverGetVersion().ok()?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { f(&mut version) }.is_success().then_some(version)
}

/// Everything that can go wrong in metrale.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MetraleError {
    /// The driver library could not be loaded (the loader's list of what was tried).
    #[error(transparent)]
    DriverUnavailable(#[from] sys::LoadError),

    /// The loaded driver lacks a function the operation needs.
    #[error(
        "{subject}: {symbol} is not exported by the loaded CUDA driver{}",
        version_suffix(*driver_version)
    )]
    MissingSymbol {
        /// The symbol, as the header maps it.
        symbol: &'static str,
        /// `cuDriverGetVersion`'s answer, when it could be asked.
        driver_version: Option<i32>,
        /// What was being done (`module 'm'`, `kernel 'm::k'`, `device 0`).
        subject: String,
    },

    /// A driver call returned an error status.
    #[error("{subject}: {call} failed: {text}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its status.
        status: CUresult,
        /// [`cuda_error_text`] of the status.
        text: String,
        /// What was being done (`device 0`, `stream synchronize`).
        subject: String,
    },

    /// A module could not be loaded, or a name could not be found in one.
    #[error("{message}")]
    ModuleLoad {
        /// The module's name.
        module: String,
        /// The full text: module (and kernel or symbol), call, status, JIT log.
        message: String,
        /// The driver's status, when a driver call failed.
        status: Option<CUresult>,
    },

    /// A launch was refused (before or by the driver).
    #[error("{message}")]
    KernelLaunch {
        /// `module::kernel`, or the raw handle when the registry does not know it.
        kernel: String,
        /// The full text: kernel, call, status, grid, block and shared memory.
        message: String,
        /// The driver's status, when a driver call failed.
        status: Option<CUresult>,
    },

    /// Input the driver would reject (or crash on) was refused before any call.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

fn version_suffix(version: Option<i32>) -> String {
    match version {
        Some(v) => format!(" (driver version {}.{}, {v})", v / 1000, v % 1000 / 10),
        None => String::new(),
    }
}

impl MetraleError {
    /// The driver status behind this error, when a driver call returned one.
    pub fn status(&self) -> Option<CUresult> {
        match self {
            MetraleError::Driver { status, .. } => Some(*status),
            MetraleError::ModuleLoad { status, .. } | MetraleError::KernelLaunch { status, .. } => {
                *status
            }
            _ => None,
        }
    }
}

/// A failed driver call before context is attached: cheap to make and to pass up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallError {
    /// The call returned a status other than success.
    Status {
        /// The driver function.
        call: &'static str,
        /// What it returned.
        status: CUresult,
    },
    /// The driver does not export the function.
    Missing(sys::MissingSymbol),
}

impl CallError {
    /// The status, for a call that returned one.
    pub fn status(self) -> Option<CUresult> {
        match self {
            CallError::Status { status, .. } => Some(status),
            CallError::Missing(_) => None,
        }
    }

    /// `call failed: NAME (n): description`, or the missing-symbol sentence.
    fn describe(self) -> String {
        match self {
            CallError::Status { call, status } => {
                format!("{call} failed: {}", cuda_error_text(status))
            }
            CallError::Missing(m) => format!(
                "{} is not exported by the loaded CUDA driver{}",
                m.name,
                version_suffix(loaded_driver_version())
            ),
        }
    }

    /// The error for a call made while working on `subject` (`device 0`, ...).
    pub fn about(self, subject: impl fmt::Display) -> MetraleError {
        match self {
            CallError::Status { call, status } => MetraleError::Driver {
                call,
                status,
                text: cuda_error_text(status),
                subject: subject.to_string(),
            },
            CallError::Missing(m) => MetraleError::MissingSymbol {
                symbol: m.name,
                driver_version: loaded_driver_version(),
                subject: subject.to_string(),
            },
        }
    }

    /// A [`MetraleError::ModuleLoad`] for `module`; `prefix` names the module and
    /// the kernel or symbol (`vec_add::vadd`), `extra` is appended (a JIT log). A
    /// missing driver symbol stays a [`MetraleError::MissingSymbol`] about `prefix`.
    pub(crate) fn module_error(self, module: &str, prefix: &str, extra: &str) -> MetraleError {
        match self {
            CallError::Missing(_) => self.about(prefix),
            CallError::Status { .. } => MetraleError::ModuleLoad {
                module: module.to_owned(),
                message: format!("{prefix}: {}{extra}", self.describe()),
                status: self.status(),
            },
        }
    }

    /// A [`MetraleError::KernelLaunch`] for `kernel`, with the launch's shape. A
    /// missing driver symbol stays a [`MetraleError::MissingSymbol`] about the kernel.
    pub(crate) fn launch_error(self, kernel: &str, shape: &dyn fmt::Display) -> MetraleError {
        match self {
            CallError::Missing(_) => self.about(format_args!("kernel '{kernel}'")),
            CallError::Status { .. } => MetraleError::KernelLaunch {
                kernel: kernel.to_owned(),
                message: format!("kernel '{kernel}': {} {shape}", self.describe()),
                status: self.status(),
            },
        }
    }
}

impl From<sys::MissingSymbol> for CallError {
    fn from(m: sys::MissingSymbol) -> Self {
        CallError::Missing(m)
    }
}

/// Call a driver function through the process table and check its status:
/// `cu!(driver, cuCtxSetCurrent(ctx))` is a `Result<(), CallError>`.
///
/// The macro expands to an `unsafe` call; each use site carries the `// SAFETY:`
/// reasoning for its arguments.
macro_rules! cu {
    ($driver:expr, $func:ident ( $($arg:expr),* $(,)? )) => {
        match $driver.$func() {
            Ok(f) => {
                let status = f($($arg),*);
                if status.is_success() {
                    Ok(())
                } else {
                    Err($crate::error::CallError::Status { call: stringify!($func), status })
                }
            }
            Err(missing) => Err($crate::error::CallError::Missing(missing)),
        }
    };
}
pub(crate) use cu;

/// Report a failure met while dropping a resource: teardown no-ops are success,
/// anything else is one line on stderr. Never panics.
pub(crate) fn report_drop_failures(what: fmt::Arguments<'_>, failures: &[CallError]) {
    use std::io::Write as _;
    let real: Vec<String> = failures
        .iter()
        .filter(|f| !f.status().is_some_and(is_teardown_noop))
        .map(|f| f.describe())
        .collect();
    if !real.is_empty() {
        // A failed write to stderr cannot be reported anywhere else.
        let _ = writeln!(std::io::stderr(), "metrale: {what}: {}", real.join("; "));
    }
}
