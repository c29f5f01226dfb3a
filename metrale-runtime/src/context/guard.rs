//! [`ContextGuard`]: the calling thread's own current context, kept across
//! metrale calls.

use std::fmt;
use std::marker::PhantomData;

use metrale_cuda_sys::{self as sys, CUcontext};

use crate::error::{cu, report_drop_failures, MetraleError, Result};

/// Keeps the calling thread's current CUDA context across metrale calls: saved by
/// [`ContextGuard::save`], made current again when the guard drops.
///
/// metrale binds its own context before each call that needs it and leaves it
/// current (so the next call needs no switch); stream memory operations and host
/// functions on a stream of its own bind nothing (the driver takes the context
/// from the stream; a driver that refuses them unbound gets them bound and made
/// again, and the null stream is always bound), though with no context current
/// driver 580 leaves the stream's current after them.
/// Code that shares a thread with other CUDA libraries and relies on the context
/// it set can hold a guard around metrale calls:
///
/// ```no_run
/// # fn main() -> metrale_runtime::Result<()> {
/// let keep = metrale_runtime::ContextGuard::save()?;
/// // ... metrale calls on any device ...
/// drop(keep); // the thread's previous context (or none) is current again
/// # Ok(()) }
/// ```
#[must_use = "the previous context is restored when the guard drops"]
pub struct ContextGuard {
    driver: &'static sys::Driver,
    saved: CUcontext,
    /// Current contexts are per thread: the guard must drop where it was made.
    _not_send: PhantomData<*const ()>,
}

impl ContextGuard {
    /// Remember the calling thread's current context (possibly none).
    ///
    /// # Errors
    /// Without a driver, or `cuCtxGetCurrent`'s status.
    pub fn save() -> Result<ContextGuard> {
        let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
        let mut saved: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext.
        unsafe { cu!(d, cuCtxGetCurrent(&mut saved)) }
            .map_err(|e| e.about("saving the current context"))?;
        Ok(ContextGuard {
            driver: d,
            saved,
            _not_send: PhantomData,
        })
    }

    /// The context that will be made current again (null: none).
    pub fn saved(&self) -> CUcontext {
        self.saved
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        // SAFETY: restores the handle this thread had current; the driver checks it
        // (a context destroyed meanwhile gives a status, reported below).
        let restored = unsafe { cu!(self.driver, cuCtxSetCurrent(self.saved)) };
        if let Err(e) = restored {
            report_drop_failures(format_args!("restoring the thread's context"), &[e]);
        }
    }
}

impl fmt::Debug for ContextGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextGuard")
            .field("saved", &self.saved)
            .finish()
    }
}
