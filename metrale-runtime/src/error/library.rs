//! The one shape every companion library's error fills: [`LibraryFailure`], carried
//! as a [`LibraryError`] in [`ErrorKind::Library`](super::ErrorKind::Library).
//!
//! NCCL, NVRTC and nvJitLink (and next cuBLAS) each keep their own error type in
//! their own room, with the data a caller of that library matches on. That type
//! implements [`LibraryFailure`], which asks it for what every library failure
//! has: the library, the call, the status number and name, the library's text for
//! the status, the subject, and any further detail (a log, a last-error text).
//! This room never names a library room: a new library adds an impl in its own
//! room, no variant here, and no import upward. The library's room gives its own
//! typed view back with [`LibraryError::downcast_ref`] (`MetraleError::as_nccl`,
//! `MetraleError::as_nvrtc`).

use std::any::Any;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// What a companion library's error gives: implemented by each library room's own
/// error type (`NcclError`, `NvrtcError`, ...).
///
/// `Display` is the whole message: the library room words it (with the call, the
/// status, the library's text and the subject), as the crate's other errors are
/// worded. The methods give the same facts as data. A failure refused before the
/// library was called has no status.
///
/// A library room fills it for its own error type, turns that into a
/// [`MetraleError`](super::MetraleError) in one function, and gives its typed
/// view back by downcast:
///
/// ```
/// use std::borrow::Cow;
/// use std::fmt;
/// use metrale_runtime::{ErrorKind, LibraryError, LibraryFailure, MetraleError};
///
/// /// A library's own error (here: one call that returned a status).
/// struct BlasError { call: &'static str, status: i32, subject: String }
///
/// impl fmt::Display for BlasError {
///     fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
///         write!(f, "{}: {} failed: BLAS_STATUS ({})", self.subject, self.call, self.status)
///     }
/// }
///
/// impl LibraryFailure for BlasError {
///     fn library(&self) -> &'static str { "cuBLAS" }
///     fn call(&self) -> Option<&'static str> { Some(self.call) }
///     fn status_code(&self) -> Option<i64> { Some(self.status.into()) }
///     fn status_name(&self) -> Option<Cow<'_, str>> { Some("BLAS_STATUS".into()) }
///     fn text(&self) -> Option<Cow<'_, str>> { None }
///     fn subject(&self) -> Option<Cow<'_, str>> { Some(Cow::Borrowed(&self.subject)) }
/// }
///
/// let e: MetraleError =
///     LibraryError::new(BlasError { call: "cublasCreate_v2", status: 3, subject: "device 0".into() })
///         .into();
/// assert_eq!(e.to_string(), "device 0: cublasCreate_v2 failed: BLAS_STATUS (3)");
/// assert!(matches!(e.kind(), ErrorKind::Library(_)));
/// let lib = e.as_library().unwrap();
/// assert_eq!((lib.library(), lib.call(), lib.status_code()), ("cuBLAS", Some("cublasCreate_v2"), Some(3)));
/// assert_eq!(lib.downcast_ref::<BlasError>().unwrap().status, 3);
/// ```
pub trait LibraryFailure: fmt::Display + Send + Sync + Any {
    /// The library (`"NCCL"`, `"NVRTC"`, `"nvJitLink"`).
    fn library(&self) -> &'static str;

    /// The library function that failed or was not called (`"ncclAllReduce"`),
    /// when there is one.
    fn call(&self) -> Option<&'static str>;

    /// The library's status number, when the library returned one.
    fn status_code(&self) -> Option<i64>;

    /// The name of that status (`"ncclRemoteError"`, `"NVRTC_ERROR_COMPILATION"`),
    /// when the library returned one.
    fn status_name(&self) -> Option<Cow<'_, str>>;

    /// The library's own description of the status (`ncclGetErrorString`), when
    /// it has one.
    fn text(&self) -> Option<Cow<'_, str>>;

    /// What was being worked on (a communicator, a program, a link).
    fn subject(&self) -> Option<Cow<'_, str>>;

    /// More the library said: a compile or link log, NCCL's last-error text.
    fn detail(&self) -> Option<&str> {
        None
    }
}

/// A companion library's failure, as
/// [`ErrorKind::Library`](super::ErrorKind::Library) carries it: one pointer to
/// the library room's own error.
#[derive(Clone)]
pub struct LibraryError(Arc<dyn LibraryFailure>);

impl LibraryError {
    /// Wrap a library room's error.
    #[cold]
    pub fn new(failure: impl LibraryFailure) -> LibraryError {
        LibraryError(Arc::new(failure))
    }

    /// See [`LibraryFailure::library`].
    pub fn library(&self) -> &'static str {
        self.0.library()
    }

    /// See [`LibraryFailure::call`].
    pub fn call(&self) -> Option<&'static str> {
        self.0.call()
    }

    /// See [`LibraryFailure::status_code`].
    pub fn status_code(&self) -> Option<i64> {
        self.0.status_code()
    }

    /// See [`LibraryFailure::status_name`].
    pub fn status_name(&self) -> Option<Cow<'_, str>> {
        self.0.status_name()
    }

    /// See [`LibraryFailure::text`].
    pub fn text(&self) -> Option<Cow<'_, str>> {
        self.0.text()
    }

    /// See [`LibraryFailure::subject`].
    pub fn subject(&self) -> Option<Cow<'_, str>> {
        self.0.subject()
    }

    /// See [`LibraryFailure::detail`].
    pub fn detail(&self) -> Option<&str> {
        self.0.detail()
    }

    /// The library room's own error, when it is a `T`.
    pub fn downcast_ref<T: LibraryFailure>(&self) -> Option<&T> {
        let any: &dyn Any = &*self.0;
        any.downcast_ref::<T>()
    }
}

impl fmt::Display for LibraryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl fmt::Debug for LibraryError {
    /// The message itself, like [`MetraleError`](super::MetraleError)'s.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for LibraryError {}
