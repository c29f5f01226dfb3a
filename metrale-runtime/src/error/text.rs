//! The driver's words for a status ([`cuda_error_text`]) and the teardown rule
//! ([`is_teardown_noop`]).

use std::ffi::{c_char, CStr};

use metrale_cuda_sys::{self as sys, CUresult};

/// `CUDA_ERROR_DEINITIALIZED` (4): the driver is shutting down.
pub const CUDA_ERROR_DEINITIALIZED: CUresult = CUresult::CUDA_ERROR_DEINITIALIZED;
/// `CUDA_ERROR_INVALID_CONTEXT` (201): no (or no valid) context is current.
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = CUresult::CUDA_ERROR_INVALID_CONTEXT;
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709): the context was destroyed.
pub const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED;

/// Whether `status` means the driver or context is already gone, so a free, unload,
/// destroy or release has nothing left to do: `CUDA_ERROR_DEINITIALIZED` (4),
/// `CUDA_ERROR_INVALID_CONTEXT` (201) or `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709).
#[inline]
pub fn is_teardown_noop(status: CUresult) -> bool {
    status == CUDA_ERROR_DEINITIALIZED
        || status == CUDA_ERROR_INVALID_CONTEXT
        || status == CUDA_ERROR_CONTEXT_IS_DESTROYED
}

/// `"<NAME> (<status>): <description>"` for a status.
///
/// The name and description come from the driver (`cuGetErrorName`,
/// `cuGetErrorString`). Where the driver cannot be loaded or has no name for the
/// status, the name comes from the header's constants, and `CUDA_UNKNOWN` for a
/// status the header does not know either; a missing description reads
/// `(no message)`.
pub fn cuda_error_text(status: CUresult) -> String {
    let (name, description) = match sys::driver() {
        Ok(d) => (
            driver_string(d.cuGetErrorName().ok(), status),
            driver_string(d.cuGetErrorString().ok(), status),
        ),
        Err(_) => (None, None),
    };
    let name = name
        .or_else(|| status.name().map(str::to_owned))
        .unwrap_or_else(|| "CUDA_UNKNOWN".to_owned());
    let description = description.unwrap_or_else(|| "(no message)".to_owned());
    format!("{name} ({}): {description}", status.0)
}

/// Ask `cuGetErrorName`/`cuGetErrorString` (same signature) about `status`.
fn driver_string(
    f: Option<unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult>,
    status: CUresult,
) -> Option<String> {
    let f = f?;
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: the driver writes a pointer to a static NUL-terminated string, or
    // leaves NULL and returns an error for a status it does not know.
    let ok = unsafe { f(status, &mut text) }.is_success();
    if !ok || text.is_null() {
        return None;
    }
    // SAFETY: checked non-null; the driver's strings are static and NUL-terminated.
    Some(
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The version the loaded driver reports, when it can be asked.
pub(crate) fn loaded_driver_version() -> Option<i32> {
    let d = sys::driver().ok()?;
    let f = d.cuDriverGetVersion().ok()?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { f(&mut version) }.is_success().then_some(version)
}

pub(super) fn version_suffix(version: Option<i32>) -> String {
    match version {
        Some(v) => format!(" (driver version {}.{}, {v})", v / 1000, v % 1000 / 10),
        None => String::new(),
    }
}
