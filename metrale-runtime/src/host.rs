//! [`CudaHost`]: one device's process-scoped CUDA state — the driver initialised
//! once, the device's retained primary context, and one non-blocking stream.
//!
//! Invariants:
//! - [`host`] returns the same `Arc<CudaHost>` for an ordinal while anything holds
//!   it; the process keeps its own hold until [`release`]. A host is created (and
//!   its context retained) only when none is alive for that ordinal.
//! - A host's handles never change after creation, so shared access needs no lock.
//! - Every operation that needs the context calls [`CudaHost::bind`] first: one
//!   `cuCtxGetCurrent`, and `cuCtxSetCurrent` only when another (or no) context is
//!   current on the calling thread. Any thread may use a host.
//! - Drop destroys the stream and releases the primary context; teardown statuses
//!   (see [`is_teardown_noop`](crate::is_teardown_noop)) count as success, other
//!   failures are one line on stderr, and Drop never panics. The same rule serves
//!   every resource of the context (`release_with`): when the context is gone —
//!   the driver shut down, or the primary context was reset (no longer active, or
//!   its `cuCtxGetId` changed) — there is nothing left to free.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use metrale_cuda_sys::{self as sys, CUcontext, CUdevice, CUdevice_attribute, CUstream};

use crate::error::{cu, report_drop_failures, CallError, MetraleError, Result};

/// The limits of a device that launch validation checks, read once per host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
}

/// The device's retained primary context.
#[derive(Debug)]
pub struct CudaContext {
    raw: CUcontext,
    device: CUdevice,
}

impl CudaContext {
    /// The raw `CUcontext`, for driver calls of your own.
    pub fn raw(&self) -> CUcontext {
        self.raw
    }

    /// The `CUdevice` the context belongs to.
    pub fn device(&self) -> CUdevice {
        self.device
    }
}

/// The host's non-blocking stream.
#[derive(Debug)]
pub struct CudaStream {
    raw: CUstream,
}

impl CudaStream {
    /// The raw `CUstream`, for driver calls of your own.
    pub fn raw(&self) -> CUstream {
        self.raw
    }
}

/// One device's process-scoped CUDA state. Get it with [`host`].
pub struct CudaHost {
    driver: &'static sys::Driver,
    ordinal: usize,
    name: String,
    driver_version: i32,
    limits: DeviceLimits,
    ctx: CudaContext,
    stream: CudaStream,
    /// `cuCtxGetId` of the context at creation (CUDA 12.0+), to notice at teardown
    /// that the context was destroyed and re-created under this host.
    ctx_id: Option<u64>,
}

/// Whether a resource of a host's context can still be released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReleaseState {
    /// The context is the one the resource was created in, and is current.
    Live,
    /// The context is gone (driver shut down, context destroyed or reset): its
    /// resources went with it and there is nothing left to release.
    Gone,
}

// SAFETY: the raw context and stream handles are written once in `CudaHost::new` and
// only read afterwards; the driver API is thread-safe for these handles (any thread
// may make the context current and use the stream). `&'static Driver` is Sync.
unsafe impl Send for CudaHost {}
// SAFETY: as for Send: no interior mutability, and the handles are shareable.
unsafe impl Sync for CudaHost {}

impl fmt::Debug for CudaHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaHost")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("driver_version", &self.driver_version)
            .finish_non_exhaustive()
    }
}

/// `cuInit(0)` once per process; the driver version it then reports.
fn init_driver() -> Result<(&'static sys::Driver, i32)> {
    static INIT: OnceLock<Result<i32>> = OnceLock::new();
    let d = sys::driver().map_err(|e| MetraleError::DriverUnavailable(e.clone()))?;
    let version = INIT.get_or_init(|| {
        // SAFETY: cuInit takes flags (must be 0) and nothing else.
        unsafe { cu!(d, cuInit(0)) }.map_err(|e| e.about("driver initialisation"))?;
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        unsafe { cu!(d, cuDriverGetVersion(&mut version)) }
            .map_err(|e| e.about("driver initialisation"))?;
        Ok(version)
    });
    match version {
        Ok(v) => Ok((d, *v)),
        Err(e) => Err(e.clone()),
    }
}

impl CudaHost {
    fn new(ordinal: usize) -> Result<CudaHost> {
        let (d, driver_version) = init_driver()?;
        let subject = format!("device {ordinal}");
        let mut count: c_int = 0;
        // SAFETY: writes one int.
        unsafe { cu!(d, cuDeviceGetCount(&mut count)) }.map_err(|e| e.about(&subject))?;
        let index = c_int::try_from(ordinal).ok().filter(|&i| i < count);
        let Some(index) = index else {
            return Err(MetraleError::InvalidArgument(format!(
                "device ordinal {ordinal} is out of range: the driver reports {count} CUDA device(s)"
            )));
        };
        let mut device: CUdevice = 0;
        // SAFETY: writes one CUdevice; the ordinal was checked against the count.
        unsafe { cu!(d, cuDeviceGet(&mut device, index)) }.map_err(|e| e.about(&subject))?;

        let mut name_buf = [0 as c_char; 256];
        // SAFETY: the buffer's length is passed with it.
        unsafe { cu!(d, cuDeviceGetName(name_buf.as_mut_ptr(), 256, device)) }
            .map_err(|e| e.about(&subject))?;
        // SAFETY: the driver wrote a NUL-terminated name into the zeroed buffer, and
        // the last byte was never written (it asked for at most 256 with the NUL).
        let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let limits = read_limits(d, device).map_err(|e| e.about(&subject))?;

        let mut raw_ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext for a valid device.
        unsafe { cu!(d, cuDevicePrimaryCtxRetain(&mut raw_ctx, device)) }
            .map_err(|e| e.about(&subject))?;
        // From here on, a failure must give the retained context back.
        let release = |e: CallError| {
            // SAFETY: releases the retain made above, once.
            let _ = unsafe { cu!(d, cuDevicePrimaryCtxRelease_v2(device)) };
            e.about(&subject)
        };
        // SAFETY: the context was just retained and is valid.
        unsafe { cu!(d, cuCtxSetCurrent(raw_ctx)) }.map_err(release)?;
        let mut raw_stream: CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
        // SAFETY: writes one CUstream; the context is current on this thread.
        unsafe { cu!(d, cuStreamCreate(&mut raw_stream, flags)) }.map_err(release)?;
        let mut id: std::ffi::c_ulonglong = 0;
        // SAFETY: writes one integer for the live context. An older driver lacks
        // the call; the teardown check then relies on statuses alone.
        let ctx_id = unsafe { cu!(d, cuCtxGetId(raw_ctx, &mut id)) }
            .ok()
            .map(|()| id);

        Ok(CudaHost {
            ctx_id,
            driver: d,
            ordinal,
            name,
            driver_version,
            limits,
            ctx: CudaContext {
                raw: raw_ctx,
                device,
            },
            stream: CudaStream { raw: raw_stream },
        })
    }

    /// Make this host's context current on the calling thread, unless it already is.
    #[inline]
    pub fn bind(&self) -> Result<(), CallError> {
        let mut current: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext.
        unsafe { cu!(self.driver, cuCtxGetCurrent(&mut current)) }?;
        if current != self.ctx.raw {
            // SAFETY: the context is retained for as long as this host lives.
            unsafe { cu!(self.driver, cuCtxSetCurrent(self.ctx.raw)) }?;
        }
        Ok(())
    }

    /// Bind the context before releasing one of its resources, and say whether
    /// there is still anything to release. The context counts as gone when the
    /// driver reports a teardown status, when the primary context is no longer
    /// active (it was reset), or when the current context's id differs from the
    /// one this host created its resources in (it was re-created).
    fn bind_for_release(&self) -> Result<ReleaseState, CallError> {
        use crate::error::is_teardown_noop;
        let d = self.driver;
        let gone = |e: CallError| e.status().is_some_and(is_teardown_noop);
        let (mut flags, mut active): (std::ffi::c_uint, c_int) = (0, 0);
        // SAFETY: writes two integers for a valid device.
        match unsafe {
            cu!(
                d,
                cuDevicePrimaryCtxGetState(self.ctx.device, &mut flags, &mut active)
            )
        } {
            Ok(()) if active == 0 => return Ok(ReleaseState::Gone),
            Err(e) if gone(e) => return Ok(ReleaseState::Gone),
            _ => {}
        }
        match self.bind() {
            Ok(()) => {}
            Err(e) if gone(e) => return Ok(ReleaseState::Gone),
            Err(e) => return Err(e),
        }
        if let Some(created) = self.ctx_id {
            let mut id: std::ffi::c_ulonglong = 0;
            // SAFETY: writes one integer; the handle is this host's context.
            match unsafe { cu!(d, cuCtxGetId(self.ctx.raw, &mut id)) } {
                Ok(()) if id != created => return Ok(ReleaseState::Gone),
                Err(e) if gone(e) => return Ok(ReleaseState::Gone),
                _ => {}
            }
        }
        Ok(ReleaseState::Live)
    }

    /// Release resources of this host's context: bind it, run `free` (which pushes
    /// what failed) unless the context is already gone, and report real failures
    /// as one line on stderr. The shared body of every Drop; never panics.
    pub(crate) fn release_with(
        &self,
        what: fmt::Arguments<'_>,
        free: impl FnOnce(&mut Vec<CallError>),
    ) {
        let mut failures = Vec::new();
        match self.bind_for_release() {
            Ok(ReleaseState::Gone) => return,
            Ok(ReleaseState::Live) => {}
            Err(e) => failures.push(e),
        }
        free(&mut failures);
        report_drop_failures(what, &failures);
    }

    /// The driver table this host calls through.
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

    /// The device limits launch validation uses.
    pub fn limits(&self) -> &DeviceLimits {
        &self.limits
    }

    /// The retained primary context.
    pub fn ctx(&self) -> &CudaContext {
        &self.ctx
    }

    /// The host's non-blocking stream.
    pub fn stream(&self) -> &CudaStream {
        &self.stream
    }

    /// Block until all work queued on `stream` has finished; the error names the
    /// device and carries the first failure of that work.
    ///
    /// `stream` is this host's stream, another stream of its context, or null (the
    /// legacy default stream). The handle is only passed to the driver.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn synchronize(&self, stream: CUstream) -> Result<()> {
        let subject = || format!("device {} stream synchronize", self.ordinal);
        self.bind().map_err(|e| e.about(subject()))?;
        // SAFETY: `stream` is a stream of this context, or null for the default one
        // (the caller's handle; the driver checks it).
        unsafe { cu!(self.driver, cuStreamSynchronize(stream)) }.map_err(|e| e.about(subject()))
    }
}

fn read_limits(d: &sys::Driver, device: CUdevice) -> Result<DeviceLimits, CallError> {
    use sys::CUdevice_attribute as A;
    let get = |attr: CUdevice_attribute| -> Result<u32, CallError> {
        let mut v: c_int = 0;
        // SAFETY: writes one int for a valid device.
        unsafe { cu!(d, cuDeviceGetAttribute(&mut v, attr, device)) }?;
        Ok(u32::try_from(v).unwrap_or(0))
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
    })
}

impl Drop for CudaHost {
    fn drop(&mut self) {
        let d = self.driver;
        let mut failures = Vec::new();
        // The stream belongs to the context: bind it first. A context that is
        // already gone took the stream with it.
        let state = self.bind_for_release().unwrap_or_else(|e| {
            failures.push(e);
            ReleaseState::Live
        });
        if state == ReleaseState::Live {
            // SAFETY: the stream was created by this host and is destroyed once, here.
            if let Err(e) = unsafe { cu!(d, cuStreamDestroy_v2(self.stream.raw)) } {
                failures.push(e);
            }
        }
        // SAFETY: gives back the one retain this host made (a reset does not undo
        // a retain, so it is given back in every state).
        if let Err(e) = unsafe { cu!(d, cuDevicePrimaryCtxRelease_v2(self.ctx.device)) } {
            failures.push(e);
        }
        report_drop_failures(
            format_args!("releasing CUDA device {}", self.ordinal),
            &failures,
        );
    }
}

#[derive(Default)]
struct Slot {
    /// The process's own hold, dropped by [`release`].
    held: Option<Arc<CudaHost>>,
    /// Finds the host again while any other holder keeps it alive.
    weak: Weak<CudaHost>,
}

fn hosts() -> std::sync::MutexGuard<'static, HashMap<usize, Slot>> {
    static HOSTS: OnceLock<Mutex<HashMap<usize, Slot>>> = OnceLock::new();
    // A panic elsewhere while holding the lock leaves the map consistent (every
    // update is a single insert), so a poisoned lock is taken as it is.
    HOSTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The process's [`CudaHost`] for device `ordinal`, created on first use.
///
/// Returns the same host while any holder lives (the process's own hold, a
/// registry, a buffer). Creating one initialises the driver (once per process),
/// retains the device's primary context and creates the host's stream.
///
/// # Errors
/// [`MetraleError::DriverUnavailable`] without a driver, `InvalidArgument` for an
/// ordinal the driver does not have (naming the device count), or the failing call.
pub fn host(ordinal: usize) -> Result<Arc<CudaHost>> {
    let mut map = hosts();
    let slot = map.entry(ordinal).or_default();
    if let Some(h) = &slot.held {
        return Ok(Arc::clone(h));
    }
    if let Some(h) = slot.weak.upgrade() {
        slot.held = Some(Arc::clone(&h));
        return Ok(h);
    }
    let h = Arc::new(CudaHost::new(ordinal)?);
    slot.weak = Arc::downgrade(&h);
    slot.held = Some(Arc::clone(&h));
    Ok(h)
}

/// Drop the process's own hold on device `ordinal`'s host. The host is torn down
/// when its last other holder (registries, buffers) goes; a later [`host`] call
/// creates a new one. Does nothing when the process holds none.
pub fn release(ordinal: usize) {
    let held = hosts().get_mut(&ordinal).and_then(|slot| slot.held.take());
    // Dropped outside the lock: the host's Drop calls the driver.
    drop(held);
}
