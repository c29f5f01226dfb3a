//! [`CudaContext`]: the driver initialised once, one device's retained primary
//! context, binding it on the calling thread, and the release rule every Drop of
//! the crate goes through.
//!
//! Invariants:
//! - `cuInit` succeeds once per process; a failure is not remembered, so a later
//!   call tries again (a transient OUT_OF_MEMORY does not poison the process).
//! - [`context`] returns the same `Arc<CudaContext>` for an ordinal while anything
//!   holds it, so "same device" is a pointer compare of contexts. A context is
//!   created (and the primary context retained) only when none is alive.
//! - A context's handles and facts never change after creation: shared access
//!   needs no lock, and any thread may use it.
//! - Every driver call that needs the context binds it first ([`CudaContext::bind`]:
//!   one `cuCtxGetCurrent`, and `cuCtxSetCurrent` only when another or no context is
//!   current). metrale leaves its context current afterwards; code that shares the
//!   thread with other CUDA libraries keeps its own with a [`ContextGuard`]. Calls
//!   whose only handle is a stream (stream memory operations, host functions) and
//!   host-side encodes bind nothing: they neither need nor switch the current
//!   context (a driver that refuses them unbound gets them bound and made again).
//! - `CudaContext::release_with` is the body of every Drop: it binds the context
//!   and frees unless the context is already gone (driver shut down, primary
//!   context reset or re-created), in which case there is nothing left to free. When
//!   binding fails for another reason the free is skipped and the leak is reported:
//!   freeing on a thread without the context would only fail quietly.
//!
//! `mod.rs` owns [`CudaContext`] and [`context`]; `init.rs` the driver's
//! initialisation and device facts; `release.rs` generations and the release rule;
//! `waits.rs` the pending waits on mapped words; `guard.rs` [`ContextGuard`];
//! `version.rs` [`Version`], the one version type of every library.
//! `user_object.rs` a graph's hold on a value through a CUDA user object.

mod guard;
mod init;
mod release;
mod user_object;
mod version;
mod waits;

use std::collections::HashMap;
use std::ffi::{c_int, c_ulonglong};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use metrale_cuda_sys::{self as sys, CUcontext, CUdevice};

pub use guard::ContextGuard;
pub(crate) use init::{device_attribute, device_handle, device_name, init_driver};
pub use init::{device_count, DeviceLimits};
pub(crate) use release::Generation;
pub use version::Version;
pub(crate) use waits::ContextWideWait;

use crate::error::{cu, report_drop_failures, CallError, ErrorKind, Result};
use init::read_limits;

/// One device's retained primary context. Get it with [`context`] (or from a
/// [`CudaHost`](crate::CudaHost), a stream or a registry).
///
/// ```no_run
/// # fn main() -> metrale_runtime::Result<()> {
/// let ctx = metrale_runtime::context(0)?;
/// println!("{} (sm_{}{})", ctx.device_name(), ctx.limits().compute_capability.0,
///          ctx.limits().compute_capability.1);
/// # Ok(()) }
/// ```
pub struct CudaContext {
    driver: &'static sys::Driver,
    ordinal: usize,
    device: CUdevice,
    raw: CUcontext,
    /// `cuCtxGetId` at creation (CUDA 12.0+), to notice at teardown that the
    /// context was destroyed and re-created under this handle.
    id: Option<u64>,
    name: String,
    driver_version: i32,
    limits: DeviceLimits,
    /// Whether skipped resources of a reset have been reported (once).
    reset_reported: AtomicBool,
    /// GPU-side waits (stream wait-value operations) metrale queued on this
    /// context's streams that a host function after them has not yet seen passed
    /// (see [`CudaContext::pending_waits`]); shared with those host functions.
    pending_waits: Arc<AtomicUsize>,
    /// Frees that wait for the whole context (`cuMemFreeHost`) between their
    /// "no pending wait" check and the driver's call: a wait on a mapped word
    /// is counted first and queued only once none is in flight (see
    /// [`CudaContext::enter_context_wide_free`]).
    context_wide_frees: AtomicUsize,
}

// SAFETY: the raw handles are written once in `CudaContext::new` and only read
// afterwards; the driver API is thread-safe for them (any thread may make the context
// current). `&'static Driver` is Sync.
unsafe impl Send for CudaContext {}
// SAFETY: as for Send; the only mutable state is atomics (`reset_reported`,
// `pending_waits`).
unsafe impl Sync for CudaContext {}

impl fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaContext")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("raw", &self.raw)
            .finish_non_exhaustive()
    }
}

fn contexts() -> std::sync::MutexGuard<'static, HashMap<usize, Weak<CudaContext>>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, Weak<CudaContext>>>> = OnceLock::new();
    // Every update is a single insert, so a poisoned lock still holds a consistent map.
    CONTEXTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The process's context for device `ordinal`: the live one when anything holds
/// it, else a new one (initialising the driver and retaining the primary context).
///
/// # Errors
/// [`ErrorKind::DriverUnavailable`] without a driver, `InvalidArgument` for an
/// ordinal the driver does not have (naming the device count), or the failing call.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let mut map = contexts();
    if let Some(ctx) = map.get(&ordinal).and_then(Weak::upgrade) {
        return Ok(ctx);
    }
    let ctx = Arc::new(CudaContext::new(ordinal)?);
    map.insert(ordinal, Arc::downgrade(&ctx));
    Ok(ctx)
}

impl CudaContext {
    fn new(ordinal: usize) -> Result<CudaContext> {
        let (d, driver_version) = init_driver()?;
        let subject = || format!("device {ordinal}");
        let device = device_handle(d, ordinal)?;
        let name = device_name(d, device).map_err(|e| e.about(subject()))?;
        let limits = read_limits(d, device).map_err(|e| e.about(subject()))?;
        let mut raw: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext for a valid device.
        unsafe { cu!(d, cuDevicePrimaryCtxRetain(&mut raw, device)) }
            .map_err(|e| e.about(subject()))?;
        let mut id: c_ulonglong = 0;
        // SAFETY: writes one integer for the live context. An older driver lacks the
        // call; the teardown check then relies on statuses alone.
        let id = unsafe { cu!(d, cuCtxGetId(raw, &mut id)) }
            .ok()
            .map(|()| id);
        Ok(CudaContext {
            driver: d,
            ordinal,
            device,
            raw,
            id,
            name,
            driver_version,
            limits,
            reset_reported: AtomicBool::new(false),
            pending_waits: Arc::new(AtomicUsize::new(0)),
            context_wide_frees: AtomicUsize::new(0),
        })
    }

    /// Make this context current on the calling thread, unless it already is.
    ///
    /// # Errors
    /// The failing `cuCtxGetCurrent` / `cuCtxSetCurrent`, naming the device.
    pub fn bind(&self) -> Result<()> {
        self.bind_fast()
            .map_err(|e| e.about(format_args!("device {}", self.ordinal)))
    }

    /// [`CudaContext::bind`] without building an error: the launch path's check.
    /// Refused inside a host function, like every `cu!` call.
    #[inline]
    pub(crate) fn bind_fast(&self) -> Result<(), CallError> {
        let mut current: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext.
        unsafe { cu!(self.driver, cuCtxGetCurrent(&mut current)) }?;
        if current != self.raw {
            // SAFETY: the context is retained for as long as this value lives.
            unsafe { cu!(self.driver, cuCtxSetCurrent(self.raw)) }?;
        }
        Ok(())
    }

    /// Bind, run `f` with the driver table, and name `subject` on failure: the one
    /// path of the crate's driver calls. `subject` is only evaluated on failure.
    #[inline]
    pub(crate) fn call<R, S: fmt::Display>(
        &self,
        subject: impl FnOnce() -> S,
        f: impl FnOnce(&'static sys::Driver) -> Result<R, CallError>,
    ) -> Result<R> {
        match self.bind_fast().and_then(|()| f(self.driver)) {
            Ok(r) => Ok(r),
            Err(e) => Err(e.about(subject())),
        }
    }

    /// Run `f` with the driver table without binding, naming `subject` on failure:
    /// for host-side calls that need no current context (tensor-map encoding).
    #[inline]
    pub(crate) fn call_unbound<R, S: fmt::Display>(
        &self,
        subject: impl FnOnce() -> S,
        f: impl FnOnce(&'static sys::Driver) -> Result<R, CallError>,
    ) -> Result<R> {
        f(self.driver).map_err(|e| e.about(subject()))
    }

    /// Call `f`, a call whose only handle is a stream of this context, without
    /// binding first: for the calls a probe of driver 580 showed taking the
    /// context from the stream, with no context and with another context
    /// current (stream memory operations, host functions, pinned copies,
    /// stream-ordered allocation and free; a bind costs a `cuCtxGetCurrent`,
    /// 8 ns on the H200, 14 ns on an H100 host). Not for other calls: an
    /// executable graph's node update crashed the driver with no context
    /// current. A driver that wants the context current anyway refuses before
    /// doing anything (`INVALID_CONTEXT` with none current, `INVALID_HANDLE`
    /// with another one, `CONTEXT_IS_DESTROYED` with a destroyed one): the
    /// context is then bound and `f` called again, so the unbound attempt can
    /// cost a retry but never a wrong result. `f` may run twice.
    #[inline(always)]
    pub(crate) fn call_by_handle<R>(
        &self,
        mut f: impl FnMut(&'static sys::Driver) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        match f(self.driver) {
            Err(e) if e.status().is_some_and(refused_for_context) => {
                self.bind_fast()?;
                f(self.driver)
            }
            other => other,
        }
    }

    /// Bind and run `f`, leaving the [`CallError`] to the caller to describe.
    #[inline]
    pub(crate) fn with<R>(
        &self,
        f: impl FnOnce(&'static sys::Driver) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        self.bind_fast().and_then(|()| f(self.driver))
    }

    /// Block until all work queued in this context, on every stream, has finished.
    /// Afterwards, what host functions left to drop is dropped, and releases that
    /// waited for GPU-side waits to pass are retried.
    ///
    /// # Errors
    /// `cuCtxSynchronize`'s status (the first failure of that work).
    pub fn synchronize(&self) -> Result<()> {
        let done = self.call(
            || format!("device {} synchronize", self.ordinal),
            // SAFETY: no arguments; the context is current.
            |d| unsafe { cu!(d, cuCtxSynchronize()) },
        );
        crate::lifetime::drain();
        done
    }

    /// The stream priorities this device offers: `(least, greatest)`. Greater
    /// priority is the numerically lower value (on an H200: `(0, -5)`).
    ///
    /// # Errors
    /// `cuCtxGetStreamPriorityRange`'s status.
    pub fn stream_priority_range(&self) -> Result<(i32, i32)> {
        let (mut least, mut greatest): (c_int, c_int) = (0, 0);
        self.call(
            || format!("device {} stream priority range", self.ordinal),
            // SAFETY: writes two ints; the context is current.
            |d| unsafe { cu!(d, cuCtxGetStreamPriorityRange(&mut least, &mut greatest)) },
        )?;
        Ok((least, greatest))
    }

    /// The driver table this context calls through.
    pub fn driver(&self) -> &'static sys::Driver {
        self.driver
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name (`NVIDIA H200`).
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// `cuDriverGetVersion`'s answer (13000 for CUDA 13.0).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// The CUDA version the driver supports, as a [`Version`] (13.0.0), ordered
    /// like the other libraries' versions.
    pub fn cuda_version(&self) -> Version {
        Version::from_cuda(self.driver_version)
    }

    /// The device limits launches and allocations check.
    pub fn limits(&self) -> &DeviceLimits {
        &self.limits
    }

    /// The raw `CUcontext`, for driver calls of your own.
    pub fn raw(&self) -> CUcontext {
        self.raw
    }

    /// The `CUdevice` the context belongs to.
    pub fn device(&self) -> CUdevice {
        self.device
    }

    /// Whether `other` is this very context (one pointer compare).
    #[inline]
    pub(crate) fn same(self: &Arc<Self>, other: &Arc<CudaContext>) -> bool {
        Arc::ptr_eq(self, other)
    }

    /// `Ok` when `other` is this context, else [`ErrorKind::WrongDevice`] saying
    /// which handle (`what`) was used with what.
    #[inline]
    pub(crate) fn check_same(
        self: &Arc<Self>,
        other: &Arc<CudaContext>,
        what: impl FnOnce() -> String,
        used_with: &str,
    ) -> Result<()> {
        if Arc::ptr_eq(self, other) {
            Ok(())
        } else {
            Err(ErrorKind::WrongDevice {
                what: what(),
                belongs_to: other.ordinal,
                used_with: used_with.to_owned(),
                used_device: self.ordinal,
            }
            .into())
        }
    }
}

/// Whether `status`, from a call made without binding, may be the driver
/// wanting the handle's context current (see [`CudaContext::call_by_handle`]).
fn refused_for_context(status: sys::CUresult) -> bool {
    status == sys::CUresult::CUDA_ERROR_INVALID_CONTEXT
        || status == sys::CUresult::CUDA_ERROR_INVALID_HANDLE
        || status == sys::CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
}

impl Drop for CudaContext {
    fn drop(&mut self) {
        let mut failures = Vec::new();
        // SAFETY: gives back the one retain this context made (a reset does not undo
        // a retain, so it is given back in every state).
        if let Err(e) = unsafe { cu!(self.driver, cuDevicePrimaryCtxRelease_v2(self.device)) } {
            failures.push(e);
        }
        report_drop_failures(
            format_args!("releasing CUDA device {}", self.ordinal),
            &failures,
        );
    }
}

/// Something that belongs to one device's context: a context, a host, a stream, a
/// registry. Allocations and streams are created from any of them.
pub trait AsContext {
    /// The context.
    fn context(&self) -> &Arc<CudaContext>;
}

impl AsContext for Arc<CudaContext> {
    fn context(&self) -> &Arc<CudaContext> {
        self
    }
}

impl<T: AsContext + ?Sized> AsContext for &T {
    fn context(&self) -> &Arc<CudaContext> {
        (**self).context()
    }
}

impl<T: AsContext + ?Sized> AsContext for Arc<T> {
    fn context(&self) -> &Arc<CudaContext> {
        (**self).context()
    }
}
