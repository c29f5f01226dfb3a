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
//! - A function the loaded library lacks is a
//!   [`LibraryMissingSymbol`](crate::LibraryMissingSymbol) naming it and the
//!   library's version (`ncclGetVersion`, read once at load).
//! - `cudaStream_t` here is the driver's stream handle under the runtime's name
//!   (the same pointer as [`crate::CUstream`]); the bindings are made against
//!   metrale's stand-ins for the CUDA runtime headers `nccl.h` includes
//!   (`nccl_stub/`), so no CUDA toolkit is needed.

use std::sync::OnceLock;

use crate::library;
use crate::{Api, Library, LibraryLoadError, Names};

generated_bindings!("nccl_bindings.rs");
status_type!(ncclResult_t, "ncclSuccess", "ncclUnknownResult");

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

impl Api for NcclFns {
    const NAMES: Names = Names::new("NCCL", LIBNCCL_PATH_VAR, DEFAULT_LIBRARY_NAMES);
    type Version = (u32, u32, u32);
    type LoadError = LibraryLoadError;

    fn query_version(lib: &Nccl) -> Option<(u32, u32, u32)> {
        // SAFETY: ncclGetVersion writes one int.
        let code = unsafe { library::read_one(lib.ncclGetVersion().ok()?) }?;
        (code > 0).then(|| split_version(code.unsigned_abs()))
    }
}

/// A loaded NCCL library and its function table; [`Nccl::version`] is
/// `ncclGetVersion`'s answer as `(major, minor, patch)`, read once at load.
pub type Nccl = Library<NcclFns>;

impl Nccl {
    /// `ncclGetVersion`'s code (22809 for 2.28.9), read once at load.
    pub fn version_code(&self) -> Option<u32> {
        self.version()
            .map(|(major, minor, patch)| version_code(major, minor, patch))
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
