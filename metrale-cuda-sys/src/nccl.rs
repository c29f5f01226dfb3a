//! Raw bindings to NCCL (`nccl.h`), the collective communication library, with
//! the library loaded at run time (feature `nccl`).
//!
//! This module owns the generated types and signatures of `nccl.h`, [`Nccl`] (one
//! entry per header function, filled through `libloading`), [`nccl()`], the
//! process-wide table, and [`config_initializer`], the Rust form of the header's
//! `NCCL_CONFIG_INITIALIZER` macro (which bindgen cannot emit).
//!
//! Invariants:
//! - Search order: [`LIBNCCL_PATH_VAR`] names an exact file (and then only it is
//!   tried), else [`DEFAULT_LIBRARY_NAMES`] in order; a failure lists every try
//!   with the loader's message ([`LibraryLoadError`]).
//! - A function the loaded library lacks is a [`LibraryMissingSymbol`] naming it
//!   and the library's version (`ncclGetVersion`, read once at load).
//! - `cudaStream_t` here is the driver's stream handle under the runtime's name
//!   (the same pointer as [`crate::CUstream`]); the bindings are made against
//!   metrale's stand-ins for the CUDA runtime headers `nccl.h` includes
//!   (`nccl_stub/`), so no CUDA toolkit is needed.

use std::ffi::OsStr;
use std::fmt;
use std::sync::OnceLock;

use crate::library::{self, LibraryLoadError, LibraryMissingSymbol};

generated_bindings!("nccl_bindings.rs");

pub use bindings::*;

/// Environment variable naming the exact NCCL library file to load.
pub const LIBNCCL_PATH_VAR: &str = "METRALE_LIBNCCL_PATH";

/// The library names tried, in order, when [`LIBNCCL_PATH_VAR`] is not set.
pub const DEFAULT_LIBRARY_NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

/// `NCCL_CONFIG_UNDEF_INT`: a config field NCCL should choose itself.
pub const CONFIG_UNDEF_INT: i32 = i32::MIN;

/// The magic number of `ncclConfig_t` (`NCCL_CONFIG_INITIALIZER`).
pub const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// The header's `NCCL_VERSION(X, Y, Z)`: the version code of a release.
pub const fn version_code(major: u32, minor: u32, patch: u32) -> u32 {
    if major <= 2 && minor <= 8 {
        major * 1000 + minor * 100 + patch
    } else {
        major * 10000 + minor * 100 + patch
    }
}

/// `(major, minor, patch)` of an `ncclGetVersion` code (both encodings).
pub const fn split_version(code: u32) -> (u32, u32, u32) {
    if code < 10000 {
        (code / 1000, code % 1000 / 100, code % 100)
    } else {
        (code / 10000, code % 10000 / 100, code % 100)
    }
}

/// `NCCL_CONFIG_INITIALIZER`: a config of this header's version (size, magic,
/// version set; every other field undefined, so NCCL picks its default).
pub const fn config_initializer() -> ncclConfig_t {
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: version_code(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH),
        blocking: CONFIG_UNDEF_INT,
        cgaClusterSize: CONFIG_UNDEF_INT,
        minCTAs: CONFIG_UNDEF_INT,
        maxCTAs: CONFIG_UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: CONFIG_UNDEF_INT,
        trafficClass: CONFIG_UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: CONFIG_UNDEF_INT,
        CTAPolicy: CONFIG_UNDEF_INT,
        shrinkShare: CONFIG_UNDEF_INT,
        nvlsCTAs: CONFIG_UNDEF_INT,
        nChannelsPerNetPeer: CONFIG_UNDEF_INT,
        nvlinkCentricSched: CONFIG_UNDEF_INT,
    }
}

/// A loaded NCCL library and its function table.
pub struct Nccl {
    pub(crate) fns: NcclFns,
    path: String,
    version: Option<u32>,
    // Declared last so it is dropped after the table that points into it.
    _library: libloading::Library,
}

impl Nccl {
    /// Load NCCL from `path` (a file path or a name the system loader searches
    /// for).
    ///
    /// # Errors
    /// [`LibraryLoadError`] with the loader's message.
    pub fn load_from(path: impl AsRef<OsStr>) -> Result<Nccl, LibraryLoadError> {
        let path = path.as_ref();
        let library = library::open(path).map_err(|a| LibraryLoadError {
            library: "NCCL",
            env_var: LIBNCCL_PATH_VAR,
            attempts: vec![a],
            companion_of: None,
        })?;
        // SAFETY: the library was asked for as NCCL, whose exports have the
        // signatures of nccl.h; absent symbols stay `None`.
        let fns = unsafe { NcclFns::resolve(&library) };
        let mut lib = Nccl {
            fns,
            path: path.to_string_lossy().into_owned(),
            version: None,
            _library: library,
        };
        lib.version = lib.ncclGetVersion().ok().and_then(|f| {
            let mut code = 0;
            // SAFETY: ncclGetVersion writes one int.
            let status = unsafe { f(&mut code) };
            (status.is_success() && code > 0).then_some(code.unsigned_abs())
        });
        Ok(lib)
    }

    /// Try [`LIBNCCL_PATH_VAR`] when it is set (and then only it), else each of
    /// [`DEFAULT_LIBRARY_NAMES`] in order.
    ///
    /// # Errors
    /// [`LibraryLoadError`] listing every candidate tried with the loader's message.
    pub fn load_default() -> Result<Nccl, LibraryLoadError> {
        library::load_first("NCCL", LIBNCCL_PATH_VAR, DEFAULT_LIBRARY_NAMES, |p| {
            Nccl::load_from(p)
        })
    }

    /// The path or name the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// `ncclGetVersion`'s code (22809 for 2.28.9), read once at load.
    pub fn version_code(&self) -> Option<u32> {
        self.version
    }

    /// `(major, minor, patch)` of the loaded library, read once at load.
    pub fn version(&self) -> Option<(u32, u32, u32)> {
        self.version.map(split_version)
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
            library: "NCCL",
            name,
            version: self.version().map(|(major, minor, _)| (major, minor)),
        }
    }
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.path)
            .field("version", &self.version())
            .finish_non_exhaustive()
    }
}

static NCCL: OnceLock<Result<Nccl, LibraryLoadError>> = OnceLock::new();

/// The process-wide NCCL table, loaded by [`Nccl::load_default`] on the first
/// call; a failed load is remembered.
///
/// # Errors
/// The [`LibraryLoadError`] of the first attempt.
pub fn nccl() -> Result<&'static Nccl, &'static LibraryLoadError> {
    NCCL.get_or_init(Nccl::load_default).as_ref()
}

impl ncclResult_t {
    /// Whether this is `ncclSuccess`.
    #[inline]
    pub const fn is_success(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for ncclResult_t {
    /// `ncclInvalidArgument (4)`, or `ncclUnknownResult (99)` for a status the
    /// header does not define.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({})",
            self.name().unwrap_or("ncclUnknownResult"),
            self.0
        )
    }
}
