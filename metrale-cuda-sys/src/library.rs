//! The one loader of every library the crate binds: [`Library<T>`] is a loaded
//! library and its function table `T`.
//!
//! Two traits describe a library:
//! - [`Table`]: its function table, generated from the header by `build/gen.rs`
//!   (`DriverFns`, `NvrtcFns`, ...): one entry per function, resolved from the
//!   library, `None` where it lacks one. Sealed: only the generated tables have it.
//! - [`Api`]: what the loader needs besides, written beside the table: how errors
//!   name the library, its `METRALE_LIB*_PATH` variable, the names tried, its
//!   version query, its load-error type and (NVRTC only) a companion library it
//!   needs loaded beside it.
//!
//! Invariants, the same for every library:
//! - Search order: the exact file the variable names (and then only it: an
//!   override that quietly fell back would load a library other than the one asked
//!   for), else [`Names::files`] in order. A failure lists every candidate tried with
//!   the loader's message for each ([`LibraryLoadError`]).
//! - A function the library lacks never fails the load: its accessor returns a
//!   typed missing-symbol error naming it (for the companion libraries
//!   [`LibraryMissingSymbol`], with the version read once at load).
//! - Nothing here panics; the process-wide table of each library is a `OnceLock`
//!   beside its `Api` (`driver()`, `nvrtc::nvrtc()`, ...), one atomic load once
//!   filled.

use std::ffi::{OsStr, OsString};
use std::fmt;

use crate::LoadAttempt;

#[cfg(test)]
mod tests;

pub(crate) mod sealed {
    /// Implemented by the generated tables only.
    pub trait Sealed {}
}

/// A function table generated from one header by `build/gen.rs`.
pub trait Table: sealed::Sealed + Sized + Send + Sync + 'static {
    /// The header's functions, in header order.
    const FUNCTION_NAMES: &'static [&'static str];

    /// Resolve every entry in `lib`; a missing symbol leaves `None`.
    ///
    /// # Safety
    /// `lib` must be a library whose exported functions have the signatures of the
    /// header the table was generated from.
    unsafe fn resolve(lib: &libloading::Library) -> Self;

    /// Whether each entry of [`FUNCTION_NAMES`](Table::FUNCTION_NAMES) was found,
    /// in the same order.
    fn presence(&self) -> Vec<bool>;
}

/// How one library is found and named, beside its generated [`Table`].
pub trait Api: Table {
    /// How the library is named, in errors and when searched for.
    const NAMES: Names;
    /// What [`Library::version`] gives: `(major, minor)`, for NCCL
    /// `(major, minor, patch)`.
    type Version: LibraryVersion;
    /// The error a failed load returns (the driver keeps its own [`crate::LoadError`]).
    type LoadError: From<LibraryLoadError> + std::error::Error + Send + Sync + 'static;

    /// Ask the library just loaded its version (once, at load); `None` when it
    /// lacks the query or it fails.
    fn query_version(lib: &Library<Self>) -> Option<Self::Version>;

    /// A library this one opens by name later, loaded beside it before it is
    /// used (NVRTC's builtins); `Ok(None)` when it needs none, the default.
    ///
    /// # Errors
    /// The companion's name (as the library will open it) and every try.
    fn load_companion(
        path: &OsStr,
        version: Option<Self::Version>,
    ) -> Result<Option<Companion>, (String, Vec<LoadAttempt>)> {
        let _ = (path, version);
        Ok(None)
    }
}

/// How a library is named: in errors, by its environment variable, and by the
/// file names tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Names {
    /// How errors name the library (`"NVRTC"`).
    pub library: &'static str,
    /// The environment variable naming its exact file (`METRALE_LIBNVRTC_PATH`).
    pub path_var: &'static str,
    /// The names tried, in order, when `path_var` is not set.
    pub files: &'static [&'static str],
}

impl Names {
    /// `library`, found by `path_var` or else `files`.
    pub const fn new(
        library: &'static str,
        path_var: &'static str,
        files: &'static [&'static str],
    ) -> Names {
        Names {
            library,
            path_var,
            files,
        }
    }
}

/// A library's version as [`Api::query_version`] reads it.
pub trait LibraryVersion: Copy + fmt::Debug + Send + Sync + 'static {
    /// `(major, minor)`, the part a missing-symbol error shows.
    fn major_minor(self) -> (u32, u32);
}

impl LibraryVersion for (u32, u32) {
    fn major_minor(self) -> (u32, u32) {
        self
    }
}

impl LibraryVersion for (u32, u32, u32) {
    fn major_minor(self) -> (u32, u32) {
        (self.0, self.1)
    }
}

/// A library loaded beside another because that one opens it by name later; kept
/// loaded as long as the table.
#[derive(Debug)]
pub struct Companion {
    path: String,
    _library: libloading::Library,
}

impl Companion {
    /// `library`, opened from `path`.
    #[cfg(feature = "nvrtc")]
    pub(crate) fn new(library: libloading::Library, path: String) -> Companion {
        Companion {
            path,
            _library: library,
        }
    }
}

/// A loaded library and its function table `T`.
///
/// Each function of the header has an accessor of the same name returning the
/// function pointer, or the typed missing-symbol error when the library does not
/// export it: `unsafe { (driver.cuInit()?)(0) }`.
pub struct Library<T: Api> {
    pub(crate) fns: T,
    path: String,
    version: Option<T::Version>,
    // Dropped after the table that points into it; the companion after the
    // library that uses it.
    _library: libloading::Library,
    companion: Option<Companion>,
}

impl<T: Api> Library<T> {
    /// Load the library at `path` (a file path or a name the system loader
    /// searches for), resolve every function of its header and read its version.
    ///
    /// # Errors
    /// The loader's message when the file cannot be opened as a shared library, or
    /// the tries for a companion it needs; missing functions are not an error here.
    pub fn load_from(path: impl AsRef<OsStr>) -> Result<Library<T>, T::LoadError> {
        Library::open(path.as_ref()).map_err(Into::into)
    }

    /// Try the file its variable ([`Names::path_var`]) names when it is set and not
    /// empty (and then only it), else each of [`Names::files`] in order.
    ///
    /// # Errors
    /// Every candidate tried, with the loader's message for each.
    pub fn load_default() -> Result<Library<T>, T::LoadError> {
        let candidates: Vec<OsString> = match std::env::var_os(T::NAMES.path_var) {
            Some(path) if !path.is_empty() => vec![path],
            _ => T::NAMES.files.iter().map(Into::into).collect(),
        };
        let mut attempts = Vec::with_capacity(candidates.len());
        for candidate in candidates {
            match Library::open(&candidate) {
                Ok(lib) => return Ok(lib),
                // It loaded but cannot work: another candidate would hide why.
                Err(e) if e.companion_of.is_some() => return Err(e.into()),
                Err(mut e) => attempts.append(&mut e.attempts),
            }
        }
        Err(load_error::<T>(attempts, None).into())
    }

    fn open(path: &OsStr) -> Result<Library<T>, LibraryLoadError> {
        let library = open(path).map_err(|a| load_error::<T>(vec![a], None))?;
        // SAFETY: the library was asked for as `T::NAMES.library`, whose exports have the
        // signatures of the header `T` was generated from; absent symbols stay `None`.
        let fns = unsafe { T::resolve(&library) };
        let mut lib = Library {
            fns,
            path: path.to_string_lossy().into_owned(),
            version: None,
            _library: library,
            companion: None,
        };
        lib.version = T::query_version(&lib);
        lib.companion = T::load_companion(path, lib.version).map_err(|(name, attempts)| {
            load_error::<T>(attempts, Some((name, lib.path.clone())))
        })?;
        Ok(lib)
    }

    /// The path or name the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The library's version, read once at load ([`Api::query_version`]).
    pub fn version(&self) -> Option<T::Version> {
        self.version
    }

    /// The path of the companion library loaded beside it, if any.
    pub(crate) fn companion_path(&self) -> Option<&str> {
        self.companion.as_ref().map(|c| c.path.as_str())
    }

    /// Whether the loaded library exports `name` (any function of the header).
    /// `None` when `name` is not a function of the header at all.
    pub fn has_function(&self, name: &str) -> Option<bool> {
        let index = T::FUNCTION_NAMES.iter().position(|&n| n == name)?;
        self.fns.presence().get(index).copied()
    }

    /// The header functions the loaded library does not export, in header order.
    pub fn missing_functions(&self) -> Vec<&'static str> {
        T::FUNCTION_NAMES
            .iter()
            .zip(self.fns.presence())
            .filter_map(|(&name, present)| (!present).then_some(name))
            .collect()
    }

    /// The error an accessor of a companion library returns for `name`.
    #[cfg(any(test, feature = "nvrtc", feature = "nccl", feature = "cublas"))]
    #[cold]
    pub(crate) fn missing(&self, name: &'static str) -> LibraryMissingSymbol {
        LibraryMissingSymbol {
            library: T::NAMES.library,
            name,
            version: self.version.map(LibraryVersion::major_minor),
        }
    }
}

impl<T: Api> fmt::Debug for Library<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Library");
        d.field("library", &T::NAMES.library)
            .field("path", &self.path)
            .field("version", &self.version);
        if let Some(path) = self.companion_path() {
            d.field("companion", &path);
        }
        d.finish_non_exhaustive()
    }
}

fn load_error<T: Api>(
    attempts: Vec<LoadAttempt>,
    companion_of: Option<(String, String)>,
) -> LibraryLoadError {
    LibraryLoadError {
        library: T::NAMES.library,
        env_var: T::NAMES.path_var,
        attempts,
        companion_of,
    }
}

/// A library could not be loaded.
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
        write_attempts(f, &self.attempts)?;
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

/// "`candidate`: message; `candidate`: message", every try in order.
pub(crate) fn write_attempts(f: &mut fmt::Formatter<'_>, attempts: &[LoadAttempt]) -> fmt::Result {
    for (i, attempt) in attempts.iter().enumerate() {
        if i > 0 {
            f.write_str("; ")?;
        }
        write!(f, "`{}`: {}", attempt.candidate, attempt.message)?;
    }
    Ok(())
}

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

/// A status type of the generated bindings (`CUresult`, `nvrtcResult`, ...).
pub(crate) trait Status: Copy {
    /// Whether it is the header's success (0).
    fn is_success(self) -> bool;
}

/// Call a query that writes one number (`cuDriverGetVersion`): the number, when
/// the call succeeds.
///
/// # Safety
/// `f` must write at most one `N` through its pointer.
pub(crate) unsafe fn read_one<N: Default, S: Status>(
    f: unsafe extern "C" fn(*mut N) -> S,
) -> Option<N> {
    let mut n = N::default();
    // SAFETY: `n` is a valid place for the one `N` the caller says `f` writes.
    let status = unsafe { f(&mut n) };
    status.is_success().then_some(n)
}

/// Call a query that writes two numbers (`nvrtcVersion`): both, when the call
/// succeeds.
///
/// # Safety
/// `f` must write at most one `N` through each pointer.
#[cfg(feature = "nvrtc")]
pub(crate) unsafe fn read_two<N: Default, S: Status>(
    f: unsafe extern "C" fn(*mut N, *mut N) -> S,
) -> Option<(N, N)> {
    let (mut a, mut b) = (N::default(), N::default());
    // SAFETY: two valid places for the `N` each pointer gets.
    let status = unsafe { f(&mut a, &mut b) };
    status.is_success().then_some((a, b))
}

/// Open `path` with the loader's default flags; the failure as an attempt.
pub(crate) fn open(path: &OsStr) -> Result<libloading::Library, LoadAttempt> {
    // SAFETY: opening a library runs its initialisers. The libraries asked for here
    // (the CUDA driver, NVIDIA's compiler, linker and NCCL, or stand-ins for them)
    // are safe to initialise in any process; that is the premise of loading them.
    unsafe { libloading::Library::new(path) }.map_err(|e| LoadAttempt {
        candidate: path.to_string_lossy().into_owned(),
        message: loader_message(&e),
    })
}

/// Open `path` with `RTLD_NOW | RTLD_GLOBAL` (Unix), so a later `dlopen` of its
/// soname by another library finds it already loaded.
#[cfg(all(unix, feature = "nvrtc"))]
pub(crate) fn open_global(path: &OsStr) -> Result<libloading::Library, LoadAttempt> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: as in `open`: a library of NVIDIA's compiler, safe to initialise.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map(Into::into)
        .map_err(|e| LoadAttempt {
            candidate: path.to_string_lossy().into_owned(),
            message: loader_message(&e),
        })
}

/// Elsewhere there is no global namespace to put it in: open it as usual.
#[cfg(all(not(unix), feature = "nvrtc"))]
pub(crate) fn open_global(path: &OsStr) -> Result<libloading::Library, LoadAttempt> {
    open(path)
}

/// The loader's own words: libloading's error says which call failed and keeps the
/// system loader's description (`dlerror`) as its source.
fn loader_message(e: &libloading::Error) -> String {
    use std::error::Error as _;
    match e.source() {
        Some(source) => format!("{e}: {source}"),
        None => e.to_string(),
    }
}
