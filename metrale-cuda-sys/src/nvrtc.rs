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
//!   [`LibraryMissingSymbol`](crate::LibraryMissingSymbol) naming it and the
//!   library's version.

use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::sync::OnceLock;

use crate::library;
use crate::{Api, Companion, Library, LibraryLoadError, LoadAttempt, Names};

generated_bindings!("nvrtc_bindings.rs");
status_type!(nvrtcResult, "NVRTC_SUCCESS", "NVRTC_UNKNOWN");

pub use bindings::*;

/// Environment variable naming the exact NVRTC library file to load.
pub const LIBNVRTC_PATH_VAR: &str = "METRALE_LIBNVRTC_PATH";

/// The library names tried, in order, when [`LIBNVRTC_PATH_VAR`] is not set.
pub const DEFAULT_LIBRARY_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// The name every NVRTC builtins library starts with.
pub const BUILTINS_PREFIX: &str = "libnvrtc-builtins.so";

impl Api for NvrtcFns {
    const NAMES: Names = Names::new("NVRTC", LIBNVRTC_PATH_VAR, DEFAULT_LIBRARY_NAMES);
    type Version = (u32, u32);
    type LoadError = LibraryLoadError;

    fn query_version(lib: &Nvrtc) -> Option<(u32, u32)> {
        // SAFETY: nvrtcVersion writes two ints.
        let (major, minor) = unsafe { library::read_two(lib.nvrtcVersion().ok()?) }?;
        Some((u32::try_from(major).ok()?, u32::try_from(minor).ok()?))
    }

    /// A path with a folder (it contains `/`) is an exact file: its builtins are
    /// loaded from the same folder (see the module docs). A bare name is searched
    /// by the system loader, which finds the builtins too.
    fn load_companion(
        path: &OsStr,
        version: Option<(u32, u32)>,
    ) -> Result<Option<Companion>, (String, Vec<LoadAttempt>)> {
        if !path.to_string_lossy().contains('/') {
            return Ok(None);
        }
        let (library, at) = load_builtins(Path::new(path), version)?;
        Ok(Some(Companion::new(library, at)))
    }
}

/// A loaded NVRTC library and its function table.
///
/// Each header function has an accessor of the same name returning the function
/// pointer, or [`LibraryMissingSymbol`](crate::LibraryMissingSymbol) when the
/// library does not export it. [`Nvrtc::version`] is `nvrtcVersion`'s answer,
/// read once at load.
pub type Nvrtc = Library<NvrtcFns>;

impl Nvrtc {
    /// The builtins library loaded beside it (for a library loaded from a path).
    pub fn builtins_path(&self) -> Option<&str> {
        self.companion_path()
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
