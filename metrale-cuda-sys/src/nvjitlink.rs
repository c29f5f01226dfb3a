//! Raw bindings to nvJitLink (`nvJitLink.h`), the JIT linker of device code, with
//! the library loaded at run time (feature `nvrtc`).
//!
//! This module owns the generated types and signatures of `nvJitLink.h`,
//! [`NvJitLink`] (one entry per header function, filled through `libloading`) and
//! [`nvjitlink()`], the process-wide table.
//!
//! Invariants:
//! - Search order: [`LIBNVJITLINK_PATH_VAR`] names an exact file (and then only it
//!   is tried), else [`DEFAULT_LIBRARY_NAMES`] in order; a failure lists every try
//!   with the loader's message ([`LibraryLoadError`]).
//! - The header maps its API to versioned symbols (`nvJitLinkCreate` is
//!   `__nvJitLinkCreate_13_0`); the table resolves exactly those, so a library of
//!   another major version reports them as missing instead of being called with
//!   another ABI. A missing function is a [`LibraryMissingSymbol`] naming it and
//!   the library's version (`nvJitLinkVersion`).

use std::ffi::OsStr;
use std::fmt;
use std::sync::OnceLock;

use crate::library::{self, LibraryLoadError, LibraryMissingSymbol};

generated_bindings!("nvjitlink_bindings.rs");

pub use bindings::*;

/// Environment variable naming the exact nvJitLink library file to load.
pub const LIBNVJITLINK_PATH_VAR: &str = "METRALE_LIBNVJITLINK_PATH";

/// The library names tried, in order, when [`LIBNVJITLINK_PATH_VAR`] is not set.
pub const DEFAULT_LIBRARY_NAMES: &[&str] = &[
    "libnvJitLink.so.13",
    "libnvJitLink.so.12",
    "libnvJitLink.so",
];

/// A loaded nvJitLink library and its function table.
pub struct NvJitLink {
    pub(crate) fns: NvJitLinkFns,
    path: String,
    version: Option<(u32, u32)>,
    // Declared last so it is dropped after the table that points into it.
    _library: libloading::Library,
}

impl NvJitLink {
    /// Load nvJitLink from `path` (a file path or a name the system loader
    /// searches for).
    ///
    /// # Errors
    /// [`LibraryLoadError`] with the loader's message.
    pub fn load_from(path: impl AsRef<OsStr>) -> Result<NvJitLink, LibraryLoadError> {
        let path = path.as_ref();
        let library = library::open(path).map_err(|a| LibraryLoadError {
            library: "nvJitLink",
            env_var: LIBNVJITLINK_PATH_VAR,
            attempts: vec![a],
            companion_of: None,
        })?;
        // SAFETY: the library was asked for as nvJitLink, whose exports have the
        // signatures of nvJitLink.h; absent symbols stay `None`.
        let fns = unsafe { NvJitLinkFns::resolve(&library) };
        let mut lib = NvJitLink {
            fns,
            path: path.to_string_lossy().into_owned(),
            version: None,
            _library: library,
        };
        lib.version = lib.nvJitLinkVersion().ok().and_then(|f| {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: nvJitLinkVersion writes two unsigned ints.
            let status = unsafe { f(&mut major, &mut minor) };
            status.is_success().then_some((major, minor))
        });
        Ok(lib)
    }

    /// Try [`LIBNVJITLINK_PATH_VAR`] when it is set (and then only it), else each of
    /// [`DEFAULT_LIBRARY_NAMES`] in order.
    ///
    /// # Errors
    /// [`LibraryLoadError`] listing every candidate tried with the loader's message.
    pub fn load_default() -> Result<NvJitLink, LibraryLoadError> {
        library::load_first(
            "nvJitLink",
            LIBNVJITLINK_PATH_VAR,
            DEFAULT_LIBRARY_NAMES,
            |p| NvJitLink::load_from(p),
        )
    }

    /// The path or name the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `nvJitLinkVersion`'s answer (major, minor), read once at load.
    pub fn version(&self) -> Option<(u32, u32)> {
        self.version
    }

    /// Whether the loaded library exports `name`; `None` when `name` is not a
    /// function of the header.
    pub fn has_function(&self, name: &str) -> Option<bool> {
        library::has_function(&FUNCTION_NAMES, &self.fns.presence(), name)
    }

    /// The header functions the loaded library does not export, in header order.
    pub fn missing_functions(&self) -> Vec<&'static str> {
        library::missing_functions(&FUNCTION_NAMES, &self.fns.presence())
    }

    #[cold]
    fn missing(&self, name: &'static str) -> LibraryMissingSymbol {
        LibraryMissingSymbol {
            library: "nvJitLink",
            name,
            version: self.version,
        }
    }
}

impl fmt::Debug for NvJitLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvJitLink")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

static NVJITLINK: OnceLock<Result<NvJitLink, LibraryLoadError>> = OnceLock::new();

/// The process-wide nvJitLink table, loaded by [`NvJitLink::load_default`] on the
/// first call; a failed load is remembered.
///
/// # Errors
/// The [`LibraryLoadError`] of the first attempt.
pub fn nvjitlink() -> Result<&'static NvJitLink, &'static LibraryLoadError> {
    NVJITLINK.get_or_init(NvJitLink::load_default).as_ref()
}

impl nvJitLinkResult {
    /// Whether this is `NVJITLINK_SUCCESS`.
    #[inline]
    pub const fn is_success(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for nvJitLinkResult {
    /// `NVJITLINK_ERROR_MISSING_ARCH (2)`, or `NVJITLINK_UNKNOWN (99)` for a
    /// status the header does not define.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({})",
            self.name().unwrap_or("NVJITLINK_UNKNOWN"),
            self.0
        )
    }
}
