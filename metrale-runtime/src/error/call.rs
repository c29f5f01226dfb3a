//! [`CallError`]: a failed driver call before its subject is attached; the `cu!`
//! macro that makes one; the drop report and [`invalid_arg`].

use std::fmt;

use metrale_cuda_sys::{self as sys, CUresult};

use super::text::{cuda_error_text, is_teardown_noop, loaded_driver_version, version_suffix};
use super::{ErrorKind, LaunchFailure, LaunchShape, MetraleError, NameKind};

/// A failed driver call before context is attached: cheap to make and to pass up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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
    /// Refused without calling the driver: the thread is running a host function.
    InHostFunction,
}

impl fmt::Display for CallError {
    /// `call failed: NAME (n): description`, or the missing-symbol sentence.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CallError::Status { call, status } => {
                write!(f, "{call} failed: {}", cuda_error_text(status))
            }
            CallError::Missing(m) => write!(
                f,
                "{} is not exported by the loaded CUDA driver{}",
                m.name,
                version_suffix(loaded_driver_version())
            ),
            CallError::InHostFunction => {
                f.write_str("CUDA call refused inside a host function (the driver forbids it)")
            }
        }
    }
}

impl std::error::Error for CallError {}

impl CallError {
    /// The status, for a call that returned one.
    pub fn status(self) -> Option<CUresult> {
        match self {
            CallError::Status { status, .. } => Some(status),
            CallError::Missing(_) | CallError::InHostFunction => None,
        }
    }

    /// The error for a call made while working on `subject` (`device 0`, ...).
    #[cold]
    pub fn about(self, subject: impl fmt::Display) -> MetraleError {
        match self {
            CallError::Status { call, status } => ErrorKind::Driver {
                call,
                status,
                subject: subject.to_string(),
            }
            .into(),
            CallError::Missing(m) => ErrorKind::MissingSymbol {
                symbol: m.name,
                driver_version: loaded_driver_version(),
                subject: subject.to_string(),
            }
            .into(),
            CallError::InHostFunction => ErrorKind::InHostFunction {
                subject: subject.to_string(),
            }
            .into(),
        }
    }

    /// A lookup of `name` (a kernel or symbol) in `module` failed: NOT_FOUND is a
    /// [`ErrorKind::NotFound`], other statuses a [`ErrorKind::Driver`] about
    /// `module::name`.
    #[cold]
    pub(crate) fn lookup(self, kind: NameKind, module: &str, name: &str) -> MetraleError {
        match self {
            CallError::Status { call, status } if status == CUresult::CUDA_ERROR_NOT_FOUND => {
                ErrorKind::NotFound {
                    kind,
                    module: module.to_owned(),
                    name: Some(name.to_owned()),
                    call: Some(call),
                    status: Some(status),
                }
                .into()
            }
            _ => self.about(format_args!("{module}::{name}")),
        }
    }

    /// A launch failed in the driver: a [`ErrorKind::KernelLaunch`] with the
    /// shape, or a missing-symbol error about the kernel.
    #[cold]
    pub(crate) fn launch(self, kernel: &str, shape: LaunchShape) -> MetraleError {
        match self {
            CallError::Missing(_) | CallError::InHostFunction => {
                self.about(format_args!("kernel '{kernel}'"))
            }
            CallError::Status { call, status } => ErrorKind::KernelLaunch {
                kernel: kernel.to_owned(),
                shape,
                failure: LaunchFailure::Driver { call, status },
            }
            .into(),
        }
    }
}

impl From<sys::MissingSymbol> for CallError {
    fn from(m: sys::MissingSymbol) -> Self {
        CallError::Missing(m)
    }
}

/// Call a driver function through a table and check its status:
/// `cu!(driver, cuCtxSetCurrent(ctx))` is a `Result<(), CallError>`.
///
/// The macro expands to an `unsafe` call; each use site carries the `// SAFETY:`
/// reasoning for its arguments. On a thread running a host function it returns
/// [`CallError::InHostFunction`] without calling (one thread-local load).
macro_rules! cu {
    ($driver:expr, $func:ident ( $($arg:expr),* $(,)? )) => {
        if $crate::lifetime::in_host_function() {
            // The driver forbids CUDA calls in host functions: refuse, never call.
            Err($crate::error::CallError::InHostFunction)
        } else {
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
        }
    };
}
pub(crate) use cu;

/// Report a failure met while dropping a resource: teardown no-ops are success,
/// anything else is one line on stderr. Never panics.
pub(crate) fn report_drop_failures(what: fmt::Arguments<'_>, failures: &[CallError]) {
    let real: Vec<String> = failures
        .iter()
        .filter(|f| !f.status().is_some_and(is_teardown_noop))
        .map(ToString::to_string)
        .collect();
    if !real.is_empty() {
        report_line(format_args!("{what}: {}", real.join("; ")));
    }
}

/// One line on stderr, `metrale: ...`; a failed write cannot be reported anywhere.
pub(crate) fn report_line(text: fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "metrale: {text}");
}

/// An [`ErrorKind::InvalidArgument`]: input refused before any call, `text` saying
/// which rule it broke.
#[cold]
pub(crate) fn invalid_arg(text: impl Into<String>) -> MetraleError {
    ErrorKind::InvalidArgument(text.into()).into()
}
