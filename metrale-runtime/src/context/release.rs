//! The release rule every Drop of the crate goes through: a resource records
//! the context's generation at creation, and its release binds the context and
//! frees unless that generation is gone (driver shut down, primary context
//! reset or re-created), in which case the reset freed it. Never panics.

use std::ffi::{c_int, c_uint, c_ulonglong};
use std::fmt;
use std::sync::atomic::Ordering;

use metrale_cuda_sys as sys;

use super::CudaContext;
use crate::error::{cu, is_teardown_noop, report_drop_failures, CallError};
use crate::lifetime::in_host_function;

/// Whether a resource of a context can still be released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReleaseState {
    /// The context is the generation the resource was created in, and is current.
    Live,
    /// The driver is shutting down: everything goes with it, silently.
    Gone,
    /// The context was reset (destroyed, and perhaps created anew) since the
    /// resource was made: the reset freed it; skipping it is reported once.
    Reset,
}

/// The generation of a context a resource was made in (see
/// `CudaContext::generation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Generation(pub(super) Option<u64>);

impl CudaContext {
    /// The generation of the context as it is now: `cuCtxGetId` (CUDA 12.0+), which
    /// changes when the primary context is reset and created anew. Every resource
    /// records it at creation, so its Drop can tell its own generation from a later
    /// one. `None` on drivers without the call (the release check then falls back
    /// to the primary context's state) or when the call fails.
    pub(crate) fn generation(&self) -> Generation {
        let mut id: c_ulonglong = 0;
        // SAFETY: writes one integer; the handle is this (retained) context.
        Generation(
            unsafe { cu!(self.driver, cuCtxGetId(self.raw, &mut id)) }
                .ok()
                .map(|()| id),
        )
    }

    /// Whether resources made in generation `made` can still be released, without
    /// binding (binding a reset primary context would create it anew). With
    /// `cuCtxGetId` one call answers: an error for a destroyed context, another id
    /// for one created anew since. Without it, whether the primary context is
    /// active.
    pub(super) fn state(&self, made: Generation) -> Result<ReleaseState, CallError> {
        if in_host_function() {
            // No driver call on the driver's thread: the caller leaks and says so.
            return Err(CallError::InHostFunction);
        }
        let d = self.driver;
        let gone = |e: CallError| e.status().is_some_and(is_teardown_noop);
        if let Some(made) = made.0.or(self.id) {
            let mut id: c_ulonglong = 0;
            // SAFETY: writes one integer; the handle is this (retained) context.
            return match unsafe { cu!(d, cuCtxGetId(self.raw, &mut id)) } {
                Ok(()) if id == made => Ok(ReleaseState::Live),
                Ok(()) => Ok(ReleaseState::Reset),
                Err(CallError::Status { status, .. })
                    if status == crate::error::CUDA_ERROR_DEINITIALIZED =>
                {
                    Ok(ReleaseState::Gone)
                }
                Err(e) if gone(e) => Ok(ReleaseState::Reset),
                Err(e) => Err(e),
            };
        }
        let (mut flags, mut active): (c_uint, c_int) = (0, 0);
        // SAFETY: writes two integers for a valid device.
        match unsafe {
            cu!(
                d,
                cuDevicePrimaryCtxGetState(self.device, &mut flags, &mut active)
            )
        } {
            Ok(()) if active == 0 => Ok(ReleaseState::Reset),
            Ok(()) => Ok(ReleaseState::Live),
            Err(e) if gone(e) => Ok(ReleaseState::Gone),
            Err(e) => Err(e),
        }
    }

    /// Say once per reset that resources of an earlier generation are skipped: the
    /// reset freed them, so there is nothing to free, but a skip is never silent.
    #[cold]
    pub(super) fn report_reset(&self, what: fmt::Arguments<'_>) {
        if !self.reset_reported.swap(true, Ordering::AcqRel) {
            crate::error::report_line(format_args!(
                "device {}: the context was reset outside metrale; resources made before the \
                 reset are not freed again, the reset freed them (first: {what})",
                self.ordinal
            ));
        }
    }

    /// Bind the context before releasing one of its resources, and say whether
    /// there is still anything to release (see `state`).
    pub(super) fn bind_for_release(&self, made: Generation) -> Result<ReleaseState, CallError> {
        match self.state(made)? {
            ReleaseState::Live => {}
            other => return Ok(other),
        }
        match self.bind_fast() {
            Ok(()) => Ok(ReleaseState::Live),
            Err(e) if e.status().is_some_and(is_teardown_noop) => Ok(ReleaseState::Gone),
            Err(e) => Err(e),
        }
    }

    /// Whether a stream-ordered free of a resource made in `made` may run: one
    /// `cuCtxGetId` says whether that generation still exists (a reset context's
    /// stream handles are dangling: the driver crashes on them, measured on CUDA
    /// 13.0). `false` after a reset (reported once) or at shutdown; a failed check
    /// is reported as a leak.
    #[inline]
    pub(crate) fn may_release(&self, made: Generation, what: fmt::Arguments<'_>) -> bool {
        if self.live_fast(made) {
            return true;
        }
        self.may_release_slow(made, what)
    }

    /// The common answer of `state` in one inlined call: `cuCtxGetId` says the
    /// context is still generation `made`. `false` means "ask `state`".
    #[inline(always)]
    fn live_fast(&self, made: Generation) -> bool {
        let Some(made) = made.0 else {
            return false;
        };
        if in_host_function() {
            return false;
        }
        let Ok(get_id) = self.driver.cuCtxGetId() else {
            return false;
        };
        let mut id: c_ulonglong = 0;
        // SAFETY: writes one integer; the handle is this (retained) context.
        let status = unsafe { get_id(self.raw, &mut id) };
        status.is_success() && id == made
    }

    #[cold]
    #[inline(never)]
    fn may_release_slow(&self, made: Generation, what: fmt::Arguments<'_>) -> bool {
        match self.state(made) {
            Ok(ReleaseState::Live) => true,
            Ok(ReleaseState::Gone) => false,
            Ok(ReleaseState::Reset) => {
                self.report_reset(what);
                false
            }
            Err(e) => {
                crate::error::report_line(format_args!(
                    "{what}: leaked, the context of device {} could not be checked: {e}",
                    self.ordinal
                ));
                false
            }
        }
    }

    /// Release resources made in generation `made` of this context: bind it, run
    /// `free` (which pushes what failed) unless that generation is gone, and report
    /// real failures as one line on stderr. When the context cannot be bound for
    /// another reason, `free` does not run and the line says what leaked. The body
    /// of every Drop; never panics.
    pub(crate) fn release_with(
        &self,
        made: Generation,
        what: fmt::Arguments<'_>,
        free: impl FnOnce(&'static sys::Driver, &mut Vec<CallError>),
    ) {
        if in_host_function() {
            crate::error::report_line(format_args!(
                "{what}: leaked: dropped inside a host function, where the driver may not \
                 be called (drop metrale handles after the host function instead)"
            ));
            return;
        }
        let mut failures = Vec::new();
        match self.bind_for_release(made) {
            Ok(ReleaseState::Gone) => return,
            Ok(ReleaseState::Reset) => {
                self.report_reset(what);
                return;
            }
            Ok(ReleaseState::Live) => free(self.driver, &mut failures),
            Err(e) => {
                crate::error::report_line(format_args!(
                    "{what}: leaked, the context of device {} could not be made current: {e}",
                    self.ordinal
                ));
                return;
            }
        }
        report_drop_failures(what, &failures);
    }
}
