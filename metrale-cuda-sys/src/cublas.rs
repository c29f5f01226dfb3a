//! Raw bindings to cuBLAS (`cublas_api.h`, the v2 API) and cuBLASLt
//! (`cublasLt.h`), each library loaded at run time (feature `cublas`).
//!
//! This module owns the generated types and signatures of both headers, two
//! function tables filled through `libloading` ([`Cublas`], [`CublasLt`]) and
//! the process-wide tables [`cublas()`] and [`cublas_lt()`].
//!
//! Invariants:
//! - Search order: [`LIBCUBLAS_PATH_VAR`] / [`LIBCUBLASLT_PATH_VAR`] names an
//!   exact file (and then only it is tried), else [`CUBLAS_LIBRARY_NAMES`] /
//!   [`CUBLASLT_LIBRARY_NAMES`] in order; a failure lists every try with the
//!   loader's message ([`LibraryLoadError`]).
//! - A function the loaded library lacks is a
//!   [`LibraryMissingSymbol`](crate::LibraryMissingSymbol) naming it and the
//!   library's version, read once at load: `cublasLtGetVersion` for cuBLASLt,
//!   `cublasGetProperty` (major, minor, patch: the one version query that needs
//!   no handle; `cublasGetVersion_v2` takes one) for cuBLAS.
//! - The plain cuBLAS bindings keep only the handle, stream, workspace, mode and
//!   status functions and every GEMM of the header (the allowlist is in
//!   `build/gen.rs`); the cuBLASLt bindings keep the whole header except its
//!   logger's `FILE*` entry point. The types the two headers share
//!   (`cublasStatus_t`, `cublasComputeType_t`, `cudaDataType`, ...) are those
//!   of the plain cuBLAS bindings.
//! - `cudaStream_t` is the driver's stream handle under the runtime's name (the
//!   same pointer as [`crate::CUstream`]); both headers are bound against
//!   metrale's stand-ins for the CUDA runtime headers they include
//!   (`cublas_stub/`), so no CUDA toolkit is needed.

use std::sync::OnceLock;

use crate::{Api, Library, LibraryLoadError, Names};

generated_bindings!(bindings, "cublas_bindings.rs");
generated_bindings!(lt_bindings, "cublaslt_bindings.rs");
status_type!(
    cublasStatus_t,
    "CUBLAS_STATUS_SUCCESS",
    "CUBLAS_STATUS_UNKNOWN"
);

// Both generated files define `FUNCTION_NAMES` and `FUNCTION_COUNT`; here
// the plain names are cuBLAS's (explicit imports win over the globs), and the
// `CUBLAS_`/`CUBLASLT_` names below say which is which.
pub use bindings::*;
pub use bindings::{FUNCTION_COUNT, FUNCTION_NAMES};
pub use lt_bindings::*;

/// How many functions the plain cuBLAS table holds.
pub use bindings::FUNCTION_COUNT as CUBLAS_FUNCTION_COUNT;
/// The names of the plain cuBLAS table's functions, in header order.
pub use bindings::FUNCTION_NAMES as CUBLAS_FUNCTION_NAMES;
/// How many functions the cuBLASLt table holds.
pub use lt_bindings::FUNCTION_COUNT as CUBLASLT_FUNCTION_COUNT;
/// The names of the cuBLASLt table's functions, in header order.
pub use lt_bindings::FUNCTION_NAMES as CUBLASLT_FUNCTION_NAMES;

/// Environment variable naming the exact cuBLAS library file to load.
pub const LIBCUBLAS_PATH_VAR: &str = "METRALE_LIBCUBLAS_PATH";
/// Environment variable naming the exact cuBLASLt library file to load.
pub const LIBCUBLASLT_PATH_VAR: &str = "METRALE_LIBCUBLASLT_PATH";

/// The cuBLAS library names tried, in order, when [`LIBCUBLAS_PATH_VAR`] is not set.
pub const CUBLAS_LIBRARY_NAMES: &[&str] = &["libcublas.so.13", "libcublas.so.12"];
/// The cuBLASLt library names tried, in order, when [`LIBCUBLASLT_PATH_VAR`] is
/// not set.
pub const CUBLASLT_LIBRARY_NAMES: &[&str] = &["libcublasLt.so.13", "libcublasLt.so.12"];

/// `(major, minor, patch)` of a cuBLAS version code (`130100` is 13.1.0).
pub const fn split_version(code: u32) -> (u32, u32, u32) {
    (code / 10000, code % 10000 / 100, code % 100)
}

/// The version code of `(major, minor, patch)`, as `CUBLAS_VERSION` and
/// `cublasLtGetVersion` write it.
pub const fn version_code(major: u32, minor: u32, patch: u32) -> u32 {
    major * 10000 + minor * 100 + patch
}

impl Api for CublasFns {
    const NAMES: Names = Names::new("cuBLAS", LIBCUBLAS_PATH_VAR, CUBLAS_LIBRARY_NAMES);
    type Version = (u32, u32, u32);
    type LoadError = LibraryLoadError;

    fn query_version(lib: &Cublas) -> Option<(u32, u32, u32)> {
        let get = lib.cublasGetProperty().ok()?;
        let mut parts = [0u32; 3];
        for (part, which) in parts.iter_mut().zip([
            libraryPropertyType::MAJOR_VERSION,
            libraryPropertyType::MINOR_VERSION,
            libraryPropertyType::PATCH_LEVEL,
        ]) {
            let mut value = 0;
            // SAFETY: cublasGetProperty writes one int for a property it knows.
            let status = unsafe { get(which, &mut value) };
            if !status.is_success() {
                return None;
            }
            *part = u32::try_from(value).ok()?;
        }
        Some((parts[0], parts[1], parts[2]))
    }
}

impl Api for CublasLtFns {
    const NAMES: Names = Names::new("cuBLASLt", LIBCUBLASLT_PATH_VAR, CUBLASLT_LIBRARY_NAMES);
    type Version = (u32, u32, u32);
    type LoadError = LibraryLoadError;

    fn query_version(lib: &CublasLt) -> Option<(u32, u32, u32)> {
        let get = lib.cublasLtGetVersion().ok()?;
        // SAFETY: cublasLtGetVersion takes nothing and returns a number.
        let code = unsafe { get() };
        let code = u32::try_from(code).ok().filter(|&c| c > 0)?;
        Some(split_version(code))
    }
}

/// A loaded cuBLAS library and its function table; [`Cublas::version`] is
/// `(major, minor, patch)`, read once at load.
pub type Cublas = Library<CublasFns>;

/// A loaded cuBLASLt library and its function table; [`CublasLt::version`] is
/// `cublasLtGetVersion`'s answer as `(major, minor, patch)`, read once at load.
pub type CublasLt = Library<CublasLtFns>;

impl Cublas {
    /// The version as one code (`130100` for 13.1.0), read once at load.
    pub fn version_code(&self) -> Option<u32> {
        self.version().map(|(a, b, c)| version_code(a, b, c))
    }
}

impl CublasLt {
    /// `cublasLtGetVersion`'s code (`130100` for 13.1.0), read once at load.
    pub fn version_code(&self) -> Option<u32> {
        self.version().map(|(a, b, c)| version_code(a, b, c))
    }
}

static CUBLAS: OnceLock<Result<Cublas, LibraryLoadError>> = OnceLock::new();
static CUBLASLT: OnceLock<Result<CublasLt, LibraryLoadError>> = OnceLock::new();

/// The process-wide cuBLAS table, loaded by [`Cublas::load_default`] on the
/// first call; a failed load is remembered.
///
/// # Errors
/// The [`LibraryLoadError`] of the first attempt.
pub fn cublas() -> Result<&'static Cublas, &'static LibraryLoadError> {
    CUBLAS.get_or_init(Cublas::load_default).as_ref()
}

/// The process-wide cuBLASLt table, loaded by [`CublasLt::load_default`] on the
/// first call; a failed load is remembered.
///
/// # Errors
/// The [`LibraryLoadError`] of the first attempt.
pub fn cublas_lt() -> Result<&'static CublasLt, &'static LibraryLoadError> {
    CUBLASLT.get_or_init(CublasLt::load_default).as_ref()
}
