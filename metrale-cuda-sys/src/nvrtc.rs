//! Raw bindings to NVRTC (`nvrtc.h`), the run-time CUDA C++ compiler, with the
//! library loaded at run time (feature `nvrtc`).
//!
//! This module owns the generated types and signatures of `nvrtc.h`, [`Nvrtc`] (one
//! entry per header function, filled through `libloading`) and [`nvrtc()`], the
//! process-wide table.
//!
//! Invariants:
//! - Search order: [`LIBNVRTC_PATH_VAR`] names an exact file (and then only it is
//!   tried), else [`DEFAULT_LIBRARY_NAMES`] in order. A failure lists every try
//!   with the loader's message ([`LibraryLoadError`]).
//! - NVRTC opens `libnvrtc-builtins.so.<major>.<minor>` by name when it compiles,
//!   so a libnvrtc loaded from a folder the system loader does not search would
//!   compile nothing. Loading from a path therefore loads the builtins from the
//!   same folder first (`RTLD_GLOBAL`, kept loaded as long as the table), or fails
//!   naming them.
//! - A function the library lacks never fails the load: its accessor returns
//!   [`LibraryMissingSymbol`] naming it and the library's version.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::Path;
use std::sync::OnceLock;

use crate::library::{self, LibraryLoadError, LibraryMissingSymbol};
use crate::LoadAttempt;

generated_bindings!("nvrtc_bindings.rs");

pub use bindings::*;

/// Environment variable naming the exact NVRTC library file to load.
pub const LIBNVRTC_PATH_VAR: &str = "METRALE_LIBNVRTC_PATH";

/// The library names tried, in order, when [`LIBNVRTC_PATH_VAR`] is not set.
pub const DEFAULT_LIBRARY_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// The name every NVRTC builtins library starts with.
pub const BUILTINS_PREFIX: &str = "libnvrtc-builtins.so";

/// A loaded NVRTC library and its function table.
///
/// Each header function has an accessor of the same name returning the function
/// pointer, or [`LibraryMissingSymbol`] when the library does not export it.
pub struct Nvrtc {
    pub(crate) fns: NvrtcFns,
    path: String,
    version: Option<(u32, u32)>,
    builtins: Option<String>,
    // Dropped after the table; the builtins after the library that uses them.
    _library: libloading::Library,
    _builtins: Option<libloading::Library>,
}

impl Nvrtc {
    /// Load NVRTC from `path`. A path with a folder (it contains `/`) is an exact
    /// file: its builtins are loaded from the same folder (see the module docs). A
    /// bare name is searched by the system loader, which finds the builtins too.
    ///
    /// # Errors
    /// [`LibraryLoadError`] with the loader's message, or naming the builtins when
    /// the library loaded but they could not.
    pub fn load_from(path: impl AsRef<OsStr>) -> Result<Nvrtc, LibraryLoadError> {
        let path = path.as_ref();
        let error = |attempts, companion_of| LibraryLoadError {
            library: "NVRTC",
            env_var: LIBNVRTC_PATH_VAR,
            attempts,
            companion_of,
        };
        let library = library::open(path).map_err(|a| error(vec![a], None))?;
        // SAFETY: the library was asked for as NVRTC, whose exports have the
        // signatures of nvrtc.h; absent symbols stay `None`.
        let fns = unsafe { NvrtcFns::resolve(&library) };
        let mut nvrtc = Nvrtc {
            fns,
            path: path.to_string_lossy().into_owned(),
            version: None,
            builtins: None,
            _library: library,
            _builtins: None,
        };
        nvrtc.version = nvrtc.query_version();
        if nvrtc.path.contains('/') {
            match load_builtins(Path::new(path), nvrtc.version) {
                Ok((lib, at)) => {
                    nvrtc._builtins = Some(lib);
                    nvrtc.builtins = Some(at);
                }
                Err((name, attempts)) => return Err(error(attempts, Some((name, nvrtc.path)))),
            }
        }
        Ok(nvrtc)
    }

    fn query_version(&self) -> Option<(u32, u32)> {
        let f = self.nvrtcVersion().ok()?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        let status = unsafe { f(&mut major, &mut minor) };
        if !status.is_success() {
            return None;
        }
        Some((u32::try_from(major).ok()?, u32::try_from(minor).ok()?))
    }

    /// Try [`LIBNVRTC_PATH_VAR`] when it is set (and then only it), else each of
    /// [`DEFAULT_LIBRARY_NAMES`] in order.
    ///
    /// # Errors
    /// [`LibraryLoadError`] listing every candidate tried with the loader's message.
    pub fn load_default() -> Result<Nvrtc, LibraryLoadError> {
        library::load_first("NVRTC", LIBNVRTC_PATH_VAR, DEFAULT_LIBRARY_NAMES, |p| {
            Nvrtc::load_from(p)
        })
    }

    /// The path or name the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `nvrtcVersion`'s answer (major, minor), read once at load.
    pub fn version(&self) -> Option<(u32, u32)> {
        self.version
    }

    /// The builtins library loaded beside it (for a library loaded from a path).
    pub fn builtins_path(&self) -> Option<&str> {
        self.builtins.as_deref()
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
            library: "NVRTC",
            name,
            version: self.version,
        }
    }
}

impl fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nvrtc")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("builtins", &self.builtins)
            .finish_non_exhaustive()
    }
}

/// Load the builtins for the libnvrtc at `library`: `libnvrtc-builtins.so.M.m` in
/// its folder, then any other `libnvrtc-builtins.so*` there, then the exact name
/// through the system loader. On failure: the name NVRTC will open, and the tries.
fn load_builtins(
    library: &Path,
    version: Option<(u32, u32)>,
) -> Result<(libloading::Library, String), (String, Vec<LoadAttempt>)> {
    let folder = library.parent().unwrap_or(Path::new("."));
    let exact = version.map(|(major, minor)| format!("{BUILTINS_PREFIX}.{major}.{minor}"));
    let mut candidates: Vec<OsString> = Vec::new();
    if let Some(name) = &exact {
        candidates.push(folder.join(name).into());
    }
    let mut others: Vec<OsString> = std::fs::read_dir(folder)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| {
            entry
                .file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(BUILTINS_PREFIX))
        })
        .map(|entry| entry.path().into_os_string())
        .filter(|p| !candidates.contains(p))
        .collect();
    // Newest first: `.so.13.1` before `.so.13.0` before `.so`.
    others.sort_by(|a, b| b.cmp(a));
    candidates.append(&mut others);
    if let Some(name) = &exact {
        candidates.push(name.into());
    }
    let shown = exact.unwrap_or_else(|| format!("{BUILTINS_PREFIX}*"));
    if candidates.is_empty() {
        return Err((
            shown,
            vec![LoadAttempt {
                candidate: format!("{}/{BUILTINS_PREFIX}*", folder.display()),
                message: "no such file (and the library's version is unknown)".to_owned(),
            }],
        ));
    }
    let mut attempts = Vec::new();
    for candidate in candidates {
        match library::open_global(&candidate) {
            Ok(lib) => return Ok((lib, candidate.to_string_lossy().into_owned())),
            Err(attempt) => attempts.push(attempt),
        }
    }
    Err((shown, attempts))
}

static NVRTC: OnceLock<Result<Nvrtc, LibraryLoadError>> = OnceLock::new();

/// The process-wide NVRTC table, loaded by [`Nvrtc::load_default`] on the first
/// call; later calls cost one atomic load, and a failed load is remembered.
///
/// # Errors
/// The [`LibraryLoadError`] of the first attempt.
pub fn nvrtc() -> Result<&'static Nvrtc, &'static LibraryLoadError> {
    NVRTC.get_or_init(Nvrtc::load_default).as_ref()
}

impl nvrtcResult {
    /// Whether this is `NVRTC_SUCCESS`.
    #[inline]
    pub const fn is_success(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for nvrtcResult {
    /// `NVRTC_ERROR_COMPILATION (6)`, or `NVRTC_UNKNOWN (99)` for a status the
    /// header does not define.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name().unwrap_or("NVRTC_UNKNOWN"), self.0)
    }
}
