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

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, CStr};
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use metrale_cuda_sys::{self as sys, CUcontext, CUdevice, CUdevice_attribute};

use crate::error::{
    cu, invalid_arg, is_teardown_noop, report_drop_failures, CallError, ErrorKind, MetraleError,
    Result,
};

/// The limits and capabilities of a device that launches and allocations check,
/// read once per context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceLimits {
    /// Threads in one block.
    pub max_threads_per_block: u32,
    /// Block dimensions x, y, z.
    pub max_block_dim: [u32; 3],
    /// Grid dimensions x, y, z.
    pub max_grid_dim: [u32; 3],
    /// Dynamic plus static shared memory per block without opting in (48 KiB).
    pub max_shared_per_block: u32,
    /// Shared memory per block a kernel may opt in to.
    pub max_shared_per_block_optin: u32,
    /// Streaming multiprocessors.
    pub multiprocessor_count: u32,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// Whether thread-block clusters can be launched.
    pub cluster_launch: bool,
    /// Whether cooperative launches are supported.
    pub cooperative_launch: bool,
    /// Whether stream-ordered allocation (memory pools) is supported.
    pub memory_pools: bool,
    /// Whether managed (unified) memory can be allocated.
    pub managed_memory: bool,
    /// Whether the host may access managed memory while kernels run
    /// (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`).
    pub concurrent_managed_access: bool,
}

/// Initialise the driver (`cuInit(0)`) once and return the table and its version.
/// Success is remembered; a failure is returned and tried again next time.
pub(crate) fn init_driver() -> Result<(&'static sys::Driver, i32)> {
    static VERSION: OnceLock<i32> = OnceLock::new();
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    if let Some(&v) = VERSION.get() {
        return Ok((d, v));
    }
    // SAFETY: cuInit takes flags (must be 0) and nothing else; calling it again after
    // a success is harmless.
    unsafe { cu!(d, cuInit(0)) }.map_err(|e| e.about("driver initialisation"))?;
    let mut version: c_int = 0;
    // SAFETY: writes one int.
    unsafe { cu!(d, cuDriverGetVersion(&mut version)) }
        .map_err(|e| e.about("driver initialisation"))?;
    Ok((d, *VERSION.get_or_init(|| version)))
}

/// How many CUDA devices the driver reports (initialising it first).
///
/// # Errors
/// [`ErrorKind::DriverUnavailable`] without a driver, or the failing call.
pub fn device_count() -> Result<usize> {
    let (d, _) = init_driver()?;
    let mut count: c_int = 0;
    // SAFETY: writes one int.
    unsafe { cu!(d, cuDeviceGetCount(&mut count)) }.map_err(|e| e.about("device count"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The `CUdevice` of `ordinal`, checked against the device count.
pub(crate) fn device_handle(d: &sys::Driver, ordinal: usize) -> Result<CUdevice> {
    let subject = || format!("device {ordinal}");
    let mut count: c_int = 0;
    // SAFETY: writes one int.
    unsafe { cu!(d, cuDeviceGetCount(&mut count)) }.map_err(|e| e.about(subject()))?;
    let Some(index) = c_int::try_from(ordinal).ok().filter(|&i| i < count) else {
        return Err(invalid_arg(format!(
            "device ordinal {ordinal} is out of range: the driver reports {count} CUDA device(s)"
        )));
    };
    let mut device: CUdevice = 0;
    // SAFETY: writes one CUdevice; the ordinal was checked against the count.
    unsafe { cu!(d, cuDeviceGet(&mut device, index)) }.map_err(|e| e.about(subject()))?;
    Ok(device)
}

/// A device's name (`NVIDIA H200`).
pub(crate) fn device_name(d: &sys::Driver, device: CUdevice) -> Result<String, CallError> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: the buffer's length is passed with it.
    unsafe { cu!(d, cuDeviceGetName(buf.as_mut_ptr(), 256, device)) }?;
    buf[255] = 0;
    // SAFETY: NUL-terminated: the driver writes at most 256 bytes with the NUL, and
    // the last byte is zero either way.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// One device attribute.
pub(crate) fn device_attribute(
    d: &sys::Driver,
    device: CUdevice,
    attr: CUdevice_attribute,
) -> Result<i32, CallError> {
    let mut v: c_int = 0;
    // SAFETY: writes one int for a valid device.
    unsafe { cu!(d, cuDeviceGetAttribute(&mut v, attr, device)) }?;
    Ok(v)
}

fn read_limits(d: &sys::Driver, device: CUdevice) -> Result<DeviceLimits, CallError> {
    use sys::CUdevice_attribute as A;
    let get = |attr| -> Result<u32, CallError> {
        Ok(u32::try_from(device_attribute(d, device, attr)?).unwrap_or(0))
    };
    Ok(DeviceLimits {
        max_threads_per_block: get(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
        max_block_dim: [
            get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?,
            get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?,
            get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?,
        ],
        max_grid_dim: [
            get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
            get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
        ],
        max_shared_per_block: get(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?,
        max_shared_per_block_optin: get(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        multiprocessor_count: get(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        compute_capability: (
            get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        cluster_launch: get(A::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH)? != 0,
        cooperative_launch: get(A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? != 0,
        memory_pools: get(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0,
        managed_memory: get(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? != 0,
        concurrent_managed_access: get(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)? != 0,
    })
}

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

/// A context-wide free in flight (see `CudaContext::enter_context_wide_free`).
pub(crate) struct ContextWideFree<'a>(&'a AtomicUsize);

impl Drop for ContextWideFree<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits counted in a context's `pending_waits` whose host function could not
/// be queued: each is counted down (its host function's work done here) once
/// its completion event, or its stream, says it passed (see
/// `CudaContext::note_unseen_wait`). Process-wide, like the drop-later list,
/// so that an entry (which holds its stream and words, and so the context)
/// is not held by the context itself.
static UNSEEN_WAITS: Mutex<Vec<UnseenWait>> = Mutex::new(Vec::new());
/// Whether `UNSEEN_WAITS` may hold anything (one load on the paths that read
/// `pending_waits` and at each drain).
static UNSEEN_ANY: AtomicBool = AtomicBool::new(false);

/// A wait on mapped words whose host function was refused: what tells that it
/// passed, and what that host function would have done.
struct UnseenWait {
    /// The context of the event and stream.
    ctx: Arc<CudaContext>,
    /// An event recorded right after the wait (destroyed here), or null when
    /// none could be: then the stream's idleness says.
    event: sys::CUevent,
    /// The stream the wait was queued on, held alive by `finish`.
    stream: sys::CUstream,
    /// The context generation the event was made in.
    made: Generation,
    /// The host function's work: counts the waits passed and hands on the
    /// words it held (run here, outside any host function).
    finish: Box<dyn FnOnce() + Send>,
}

// SAFETY: the event and stream are opaque handles the driver lets any thread
// query once their context is bound (the stream is kept alive by `finish`);
// the context and `finish` are Send.
unsafe impl Send for UnseenWait {}

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

/// Whether a resource of a context can still be released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReleaseState {
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
pub(crate) struct Generation(Option<u64>);

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

    /// Bind and run `f`, leaving the [`CallError`] to the caller to describe.
    #[inline]
    pub(crate) fn with<R>(
        &self,
        f: impl FnOnce(&'static sys::Driver) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        self.bind_fast().and_then(|()| f(self.driver))
    }

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
    fn state(&self, made: Generation) -> Result<ReleaseState, CallError> {
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
    fn report_reset(&self, what: fmt::Arguments<'_>) {
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
    fn bind_for_release(&self, made: Generation) -> Result<ReleaseState, CallError> {
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

    /// Call `f`, a stream-ordered call whose stream names this context, without
    /// binding first: the driver accepts these calls whatever context is current
    /// (measured on CUDA 13.0; 16 ns saved per call). A driver that answers
    /// INVALID_CONTEXT gets the context bound and the call repeated.
    #[inline]
    pub(crate) fn call_on_stream<R>(
        &self,
        f: impl Fn(&'static sys::Driver) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        match f(self.driver) {
            Err(CallError::Status { status, .. })
                if status == crate::error::CUDA_ERROR_INVALID_CONTEXT =>
            {
                self.bind_fast()?;
                f(self.driver)
            }
            other => other,
        }
    }

    /// Whether a stream-ordered free of a resource made in `made` may run: one
    /// `cuCtxGetId` says whether that generation still exists (a reset context's
    /// stream handles are dangling: the driver crashes on them, measured on CUDA
    /// 13.0). `false` after a reset (reported once) or at shutdown; a failed check
    /// is reported as a leak.
    pub(crate) fn may_release(&self, made: Generation, what: fmt::Arguments<'_>) -> bool {
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
        drain_dropped_later();
        done
    }

    /// GPU-side waits on mapped (host) words metrale queued on this context's
    /// streams ([`CudaStream::wait_value32`](crate::CudaStream::wait_value32)
    /// and the others, outside captures) that the stream has not yet passed: the
    /// host passes them, and may not. A wait is counted until the host function
    /// queued after it has run, or, when that host function could not be
    /// queued, until an event recorded after the wait (or its stream, idle)
    /// says it passed: whatever happened to the host function, a wait is
    /// counted down once its completion is known. While this is non-zero, a wait for the
    /// whole context (`cuCtxSynchronize`) could block for ever, so freeing
    /// virtual memory or closing an IPC buffer leaks it (one line on stderr), a
    /// `cuMemFree` is deferred until they have passed (retried at the next
    /// synchronize), and `sleep` / `unmap` return an error instead. Waits on device words are not counted: they are
    /// GPU work like a kernel's, and one that never passes blocks what waits for
    /// the context as an endless kernel does. A wait whose stream faulted (its
    /// host functions never run) stays counted for good.
    pub fn pending_waits(&self) -> usize {
        triage_unseen_waits();
        self.pending_waits.load(Ordering::Acquire)
    }

    /// Note a counted wait whose host function could not be queued: `event`
    /// (recorded right after it, or null) or, without one, `stream`'s
    /// idleness says when it passed; then `finish` (the host function's work)
    /// runs, outside any host function. `finish` keeps the stream alive.
    pub(crate) fn note_unseen_wait(
        self: &Arc<Self>,
        event: sys::CUevent,
        stream: sys::CUstream,
        finish: Box<dyn FnOnce() + Send>,
    ) {
        UNSEEN_WAITS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(UnseenWait {
                ctx: Arc::clone(self),
                event,
                stream,
                made: self.generation(),
                finish,
            });
        UNSEEN_ANY.store(true, Ordering::Release);
    }

    /// Enter a free that waits for the whole context (`cuMemFreeHost`): held
    /// from its pending-wait check through the driver's call. Either the check
    /// sees a wait counted meanwhile (and the free is deferred), or that
    /// wait's queueing sees this free in flight and waits for it
    /// ([`CudaContext::wait_out_context_wide_frees`]): a free never waits
    /// behind a GPU-side wait queued after its check.
    pub(crate) fn enter_context_wide_free(&self) -> ContextWideFree<'_> {
        self.context_wide_frees.fetch_add(1, Ordering::SeqCst);
        ContextWideFree(&self.context_wide_frees)
    }

    /// Before queueing a wait on a mapped word (already counted in
    /// `pending_waits`): wait until no context-wide free that may have missed
    /// the count is in flight (they wait only for work queued before them).
    pub(crate) fn wait_out_context_wide_frees(&self) {
        while self.context_wide_frees.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
    }

    /// The shared counter behind [`CudaContext::pending_waits`], for the host
    /// function queued after a wait to count it passed.
    pub(crate) fn pending_waits_counter(&self) -> &Arc<AtomicUsize> {
        &self.pending_waits
    }

    /// Refuse `what`, a wait for the whole context, while GPU-side waits are
    /// pending (it could block for ever).
    pub(crate) fn refuse_with_pending_waits(&self, what: &dyn fmt::Display) -> Result<()> {
        match self.pending_waits() {
            0 => Ok(()),
            n => Err(crate::error::invalid_arg(format!(
                "{what}: device {} has {n} pending GPU-side wait(s) (wait_value32/64 or a \
                 batch wait) queued through metrale; cuCtxSynchronize could block for ever \
                 on a word nobody writes, so it is not called (write the word, then \
                 synchronize, and retry)",
                self.ordinal
            ))),
        }
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

thread_local! {
    /// Whether this thread is running a host function metrale queued (the
    /// driver's thread, inside [`crate::CudaStream::launch_host_fn`]'s closure).
    static IN_HOST_FUNCTION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Values a host function had to keep rather than drop (their Drop calls the
/// driver, which a host function may not): see [`drop_later`].
static DROP_LATER: Mutex<Vec<Box<dyn Send>>> = Mutex::new(Vec::new());
/// Whether `DROP_LATER` may hold anything (one load on the draining paths).
static DROP_LATER_ANY: AtomicBool = AtomicBool::new(false);

/// Keep `value` until the next [`drain_dropped_later`]: what a host function
/// does with the last handle to memory that queued work used (freeing it there
/// is refused by the driver, and would leak it).
pub(crate) fn drop_later(value: Box<dyn Send>) {
    DROP_LATER
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(value);
    DROP_LATER_ANY.store(true, Ordering::Release);
}

/// Count down the unseen waits that have passed (see
/// `CudaContext::note_unseen_wait`): their event (or stream) is complete, or
/// their context will run nothing more. One load while there is none; not
/// inside a host function (no driver call there). Run where `pending_waits`
/// is read and at each drain.
pub(crate) fn triage_unseen_waits() {
    if !UNSEEN_ANY.load(Ordering::Acquire) || in_host_function() {
        return;
    }
    let passed: Vec<UnseenWait> = {
        let mut list = UNSEEN_WAITS.lock().unwrap_or_else(PoisonError::into_inner);
        let mut passed = Vec::new();
        let mut i = 0;
        while i < list.len() {
            let Some(w) = list.get(i) else { break };
            let (ev, st) = (w.event, w.stream);
            // The generation first, without binding: after a reset the handles
            // are dangling (never given to the driver), and the reset ended
            // the wait.
            let done = match w.ctx.state(w.made) {
                Ok(ReleaseState::Reset | ReleaseState::Gone) => true,
                Err(_) => false,
                Ok(ReleaseState::Live) => {
                    let status = w.ctx.with(|d| {
                        if ev.is_null() {
                            // Never `cuStreamQuery` a capturing stream (it
                            // invalidates the capture): the wait stays listed
                            // while the stream is captured.
                            let mut cs = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
                            // SAFETY: a live stream (kept alive by the entry's
                            // `finish`) of this, bound, context; writes the
                            // status only (the other outputs are null).
                            unsafe {
                                cu!(
                                    d,
                                    cuStreamGetCaptureInfo_v3(
                                        st,
                                        &mut cs,
                                        std::ptr::null_mut(),
                                        std::ptr::null_mut(),
                                        std::ptr::null_mut(),
                                        std::ptr::null_mut(),
                                        std::ptr::null_mut()
                                    )
                                )
                            }?;
                            if cs != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                                return Ok(false);
                            }
                            // SAFETY: as above, and not being captured; only
                            // the status is read.
                            unsafe { cu!(d, cuStreamQuery(st)) }.map(|()| true)
                        } else {
                            // SAFETY: a live event made for this entry; only the
                            // status is read.
                            unsafe { cu!(d, cuEventQuery(ev)) }.map(|()| true)
                        }
                    });
                    match status {
                        Ok(done) => done,
                        Err(CallError::Status { status, .. }) => {
                            crate::stream::work_abandoned(status)
                        }
                        Err(_) => false,
                    }
                }
            };
            if done {
                passed.push(list.swap_remove(i));
            } else {
                i += 1;
            }
        }
        UNSEEN_ANY.store(!list.is_empty(), Ordering::Release);
        passed
    };
    // Outside the lock: destroying the events and the host functions' work
    // (which drops a stream handle) call the driver.
    for w in passed {
        if !w.event.is_null() {
            let ev = w.event;
            w.ctx.release_with(
                w.made,
                format_args!(
                    "destroying the event after a wait on device {}",
                    w.ctx.ordinal()
                ),
                |d, failures| {
                    // SAFETY: the event made for this entry, destroyed once.
                    if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(ev)) } {
                        failures.push(e);
                    }
                },
            );
        }
        // Counts the waits down; what it held goes to the drop-later list.
        (w.finish)();
    }
}

/// Drop what host functions left in [`drop_later`], outside any host function.
/// Called by [`CudaContext::synchronize`], [`CudaStream::synchronize`]
/// (crate::CudaStream::synchronize) and [`MappedWords::new`](crate::MappedWords::new).
pub(crate) fn drain_dropped_later() {
    // Waits whose host function was refused hand their words on here once
    // passed.
    triage_unseen_waits();
    if !DROP_LATER_ANY.load(Ordering::Acquire) || in_host_function() {
        return;
    }
    let taken = {
        let mut list = DROP_LATER.lock().unwrap_or_else(PoisonError::into_inner);
        DROP_LATER_ANY.store(false, Ordering::Release);
        std::mem::take(&mut *list)
    };
    // Dropped outside the lock: their Drop calls the driver.
    drop(taken);
    // Releases deferred behind pending waits may go now (those still blocked
    // set the flag again).
    crate::memory::retry_deferred_frees();
}

/// A free was deferred behind pending waits: the next drain retries it.
pub(crate) fn note_deferred_free() {
    DROP_LATER_ANY.store(true, Ordering::Release);
}

/// Whether the calling thread is inside a host function (one thread-local load).
#[inline]
pub(crate) fn in_host_function() -> bool {
    IN_HOST_FUNCTION.with(std::cell::Cell::get)
}

/// Marks the thread as running a host function until dropped (also on unwind).
pub(crate) struct HostFunctionScope {
    was: bool,
}

impl HostFunctionScope {
    /// Enter a host function on this thread.
    pub(crate) fn enter() -> HostFunctionScope {
        HostFunctionScope {
            was: IN_HOST_FUNCTION.with(|c| c.replace(true)),
        }
    }
}

impl Drop for HostFunctionScope {
    fn drop(&mut self) {
        let was = self.was;
        IN_HOST_FUNCTION.with(|c| c.set(was));
    }
}
