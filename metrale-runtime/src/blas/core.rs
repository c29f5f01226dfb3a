//! [`LtCore`]: what a cuBLASLt handle and its plans share (the library, the
//! context, the raw handle, the per-stream workspaces), and the room's one
//! path into cuBLASLt ([`LtCore::call`]).
//!
//! Invariants: every call binds the handle's context first; the handle is
//! destroyed once, under the release rule, when the last holder goes (a
//! `BlasLt` clone or a plan), and its workspaces after it.

use std::fmt;
use std::sync::Arc;

use metrale_cuda_sys::cublas::{cublasLtHandle_t, cublasStatus_t, CublasLt};
use metrale_cuda_sys::LibraryMissingSymbol;

use crate::context::{CudaContext, Generation};
use crate::error::Result;

use super::error::{lt_call_error, missing};
use super::workspace::Workspaces;

/// What a handle and its plans share: the library, the context, the raw
/// handle and the workspaces.
pub(crate) struct LtCore {
    pub(crate) lib: &'static CublasLt,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) raw: cublasLtHandle_t,
    pub(crate) made: Generation,
    pub(crate) workspaces: Workspaces,
}

// SAFETY: the raw handle is written once and only read; cuBLASLt lets any
// thread use a handle (its matmul and heuristic calls keep no per-handle
// state a call changes: the workspace and stream are arguments).
unsafe impl Send for LtCore {}
// SAFETY: as for Send; the workspaces are behind a lock.
unsafe impl Sync for LtCore {}

impl LtCore {
    /// Bind the context, then call `f` (a cuBLASLt call returning a status):
    /// the room's one path into cuBLASLt. `subject` is evaluated on failure.
    #[inline]
    pub(crate) fn call<S: fmt::Display>(
        &self,
        call: &'static str,
        subject: impl FnOnce() -> S,
        f: impl FnOnce(&'static CublasLt) -> std::result::Result<cublasStatus_t, LibraryMissingSymbol>,
    ) -> Result<()> {
        if let Err(e) = self.ctx.bind_fast() {
            return Err(e.about(subject()));
        }
        match f(self.lib) {
            Ok(s) if s.is_success() => Ok(()),
            Ok(s) => Err(lt_call_error(self.lib, call, s, subject())),
            Err(m) => Err(missing(m, subject())),
        }
    }
}

impl Drop for LtCore {
    fn drop(&mut self) {
        let (lib, raw) = (self.lib, self.raw);
        self.ctx.release_with(
            self.made,
            format_args!(
                "destroying the cuBLASLt handle of device {}",
                self.ctx.ordinal()
            ),
            |_, failures| {
                let Ok(destroy) = lib.cublasLtDestroy() else {
                    crate::error::report_line(format_args!(
                        "the cuBLASLt handle {raw:p}: leaked, the library lacks cublasLtDestroy"
                    ));
                    return;
                };
                // SAFETY: the handle was made by cublasLtCreate and is destroyed once.
                let status = unsafe { destroy(raw) };
                if !status.is_success() {
                    let _ = failures;
                    crate::error::report_line(format_args!(
                        "destroying the cuBLASLt handle {raw:p}: cublasLtDestroy failed: {status}"
                    ));
                }
            },
        );
    }
}
