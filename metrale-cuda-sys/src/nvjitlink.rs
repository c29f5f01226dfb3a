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
//!   another ABI. A missing function is a
//!   [`LibraryMissingSymbol`](crate::LibraryMissingSymbol) naming it and the
//!   library's version (`nvJitLinkVersion`).

use std::sync::OnceLock;

use crate::library;
use crate::{Api, Library, LibraryLoadError, Names};

generated_bindings!("nvjitlink_bindings.rs");
status_type!(nvJitLinkResult, "NVJITLINK_SUCCESS", "NVJITLINK_UNKNOWN");

pub use bindings::*;

/// Environment variable naming the exact nvJitLink library file to load.
pub const LIBNVJITLINK_PATH_VAR: &str = "METRALE_LIBNVJITLINK_PATH";

/// The library names tried, in order, when [`LIBNVJITLINK_PATH_VAR`] is not set.
pub const DEFAULT_LIBRARY_NAMES: &[&str] = &[
    "libnvJitLink.so.13",
    "libnvJitLink.so.12",
    "libnvJitLink.so",
];

impl Api for NvJitLinkFns {
    const NAMES: Names = Names::new("nvJitLink", LIBNVJITLINK_PATH_VAR, DEFAULT_LIBRARY_NAMES);
    type Version = (u32, u32);
    type LoadError = LibraryLoadError;

    fn query_version(lib: &NvJitLink) -> Option<(u32, u32)> {
        // SAFETY: nvJitLinkVersion writes two unsigned ints.
        unsafe { library::read_two(lib.nvJitLinkVersion().ok()?) }
    }
}

/// A loaded nvJitLink library and its function table; [`NvJitLink::version`] is
/// `nvJitLinkVersion`'s answer, read once at load.
pub type NvJitLink = Library<NvJitLinkFns>;

static NVJITLINK: OnceLock<Result<NvJitLink, LibraryLoadError>> = OnceLock::new();

/// The process-wide nvJitLink table, loaded by [`NvJitLink::load_default`] on the
/// first call; a failed load is remembered.
///
/// # Errors
/// The [`LibraryLoadError`] of the first attempt.
pub fn nvjitlink() -> Result<&'static NvJitLink, &'static LibraryLoadError> {
    NVJITLINK.get_or_init(NvJitLink::load_default).as_ref()
}
