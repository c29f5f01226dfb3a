//! What the companion libraries (NVRTC, nvJitLink, NCCL) share: the typed errors of a
//! failed load and of a missing symbol, and the search over candidates.
//!
//! The pattern is the driver's ([`crate::Driver::load_default`]): an exact file
//! named by the library's own environment variable (and then only it), else a list
//! of sonames in order; a failure lists every candidate with the loader's message.

use std::ffi::{OsStr, OsString};
use std::fmt;

use crate::LoadAttempt;

/// A companion library (NVRTC, nvJitLink, NCCL) could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryLoadError {
    /// Which library (`"NVRTC"`, `"nvJitLink"`, `"NCCL"`).
    pub library: &'static str,
    /// The environment variable that names its file (`METRALE_LIBNVRTC_PATH`).
    pub env_var: &'static str,
    /// Every candidate tried, in order, with the loader's message.
    pub attempts: Vec<LoadAttempt>,
    /// When the library itself loaded but a library it opens by name later did
    /// not (NVRTC's builtins): that library's name and the loaded file's path.
    pub companion_of: Option<(String, String)>,
}

impl fmt::Display for LibraryLoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.companion_of {
            Some((companion, path)) => write!(
                f,
                "{} at `{path}` loaded, but not {companion}, which it opens by name when it \
                 compiles; tried ",
                self.library
            )?,
            None => write!(f, "could not load the {} library; tried ", self.library)?,
        }
        for (i, attempt) in self.attempts.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "`{}`: {}", attempt.candidate, attempt.message)?;
        }
        match &self.companion_of {
            Some((companion, _)) => write!(
                f,
                ". Put {companion} beside the library (a wheel's lib folder has both)"
            ),
            None => write!(
                f,
                ". Install it, or set {} to the library file",
                self.env_var
            ),
        }
    }
}

impl std::error::Error for LibraryLoadError {}

/// A function of a companion header that the loaded library does not export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LibraryMissingSymbol {
    /// Which library (`"NVRTC"`, `"nvJitLink"`, `"NCCL"`).
    pub library: &'static str,
    /// The symbol (`nvrtcGetLTOIR`, `__nvJitLinkCreate_13_0`).
    pub name: &'static str,
    /// The loaded library's version (major, minor), when it could say.
    pub version: Option<(u32, u32)>,
}

impl fmt::Display for LibraryMissingSymbol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the loaded {} library does not export `{}`",
            self.library, self.name
        )?;
        match self.version {
            Some((major, minor)) => write!(f, " (it is version {major}.{minor})"),
            None => f.write_str(" (its version is unknown: it does not say)"),
        }
    }
}

impl std::error::Error for LibraryMissingSymbol {}

/// The candidates for a library: the file `env_var` names when it is set and not
/// empty (and then only it), else `names` in order.
pub(crate) fn candidates(env_var: &str, names: &[&str]) -> Vec<OsString> {
    match std::env::var_os(env_var) {
        Some(path) if !path.is_empty() => vec![path],
        _ => names.iter().map(Into::into).collect(),
    }
}

/// Load the first candidate that loads (see [`candidates`]), collecting every
/// failed try; `stop` says which failures end the search at once (a library that
/// loaded but lacks a companion it needs).
#[cfg(any(feature = "nvrtc", feature = "nccl"))]
pub(crate) fn load_first<L>(
    library: &'static str,
    env_var: &'static str,
    names: &[&str],
    load_from: impl Fn(&OsStr) -> Result<L, LibraryLoadError>,
) -> Result<L, LibraryLoadError> {
    let mut attempts = Vec::new();
    for candidate in candidates(env_var, names) {
        match load_from(&candidate) {
            Ok(lib) => return Ok(lib),
            Err(e) if e.companion_of.is_some() => return Err(e),
            Err(mut e) => attempts.append(&mut e.attempts),
        }
    }
    Err(LibraryLoadError {
        library,
        env_var,
        attempts,
        companion_of: None,
    })
}

/// Whether the function `name` of a header (`names`, in header order) is among
/// those a table found (`presence`, in the same order); `None` for a name the
/// header lacks.
#[cfg(any(feature = "nvrtc", feature = "nccl"))]
pub(crate) fn has_function(names: &[&'static str], presence: &[bool], name: &str) -> Option<bool> {
    let index = names.iter().position(|&n| n == name)?;
    presence.get(index).copied()
}

/// The functions of a header (`names`) a table did not find, in header order.
#[cfg(any(feature = "nvrtc", feature = "nccl"))]
pub(crate) fn missing_functions(names: &[&'static str], presence: &[bool]) -> Vec<&'static str> {
    names
        .iter()
        .zip(presence)
        .filter_map(|(&name, &present)| (!present).then_some(name))
        .collect()
}

/// Open `path` with the loader's default flags; the failure as an attempt.
pub(crate) fn open(path: &std::ffi::OsStr) -> Result<libloading::Library, LoadAttempt> {
    // SAFETY: opening a library runs its initialisers; NVIDIA's compiler and linker
    // libraries (the only ones asked for here) are safe to initialise in any
    // process, which is the premise of loading them at all.
    unsafe { libloading::Library::new(path) }.map_err(|e| LoadAttempt {
        candidate: path.to_string_lossy().into_owned(),
        message: crate::loader_message(&e),
    })
}

/// Open `path` with `RTLD_NOW | RTLD_GLOBAL` (Unix), so a later `dlopen` of its
/// soname by another library finds it already loaded.
#[cfg(all(unix, feature = "nvrtc"))]
pub(crate) fn open_global(path: &std::ffi::OsStr) -> Result<libloading::Library, LoadAttempt> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: as in `open`: a library of NVIDIA's compiler, safe to initialise.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map(Into::into)
        .map_err(|e| LoadAttempt {
            candidate: path.to_string_lossy().into_owned(),
            message: crate::loader_message(&e),
        })
}

/// Elsewhere there is no global namespace to put it in: open it as usual.
#[cfg(all(not(unix), feature = "nvrtc"))]
pub(crate) fn open_global(path: &std::ffi::OsStr) -> Result<libloading::Library, LoadAttempt> {
    open(path)
}
