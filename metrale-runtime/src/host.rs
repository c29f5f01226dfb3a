//! [`CudaHost`]: the seed's per-device facade — one device's context and its
//! default [`CudaStream`], process-scoped through [`host`] and [`release`].
//!
//! Invariants:
//! - [`host`] returns the same `Arc<CudaHost>` for an ordinal while anything holds
//!   it; the process keeps its own hold until [`release`]. A host is created only
//!   when none is alive for that ordinal, and then shares the device's live
//!   [`CudaContext`] when there is one ([`crate::context()`]).
//! - The host owns its stream; the stream knows only the context. Dropping the host
//!   destroys the stream, then gives back the context's hold (the release rule of
//!   [`CudaContext`] applies to both).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};

use metrale_cuda_sys as sys;

use crate::context::{self, AsContext, CudaContext, DeviceLimits};
use crate::error::Result;
use crate::stream::CudaStream;

/// One device's process-scoped CUDA state: the context and a default non-blocking
/// stream. Get it with [`host`].
///
/// ```no_run
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = metrale_runtime::host(0)?;
/// println!("{} on driver {}", h.device_name(), h.driver_version());
/// h.stream().synchronize()?;
/// # Ok(()) }
/// ```
pub struct CudaHost {
    // Field order is drop order: the stream goes before the context it needs.
    stream: CudaStream,
    ctx: Arc<CudaContext>,
}

impl fmt::Debug for CudaHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaHost")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.ctx.device_name())
            .field("driver_version", &self.ctx.driver_version())
            .finish_non_exhaustive()
    }
}

impl CudaHost {
    fn new(ordinal: usize) -> Result<CudaHost> {
        let ctx = context::context(ordinal)?;
        let stream = CudaStream::new(&ctx)?;
        Ok(CudaHost { stream, ctx })
    }

    /// The driver table this host calls through.
    pub fn driver(&self) -> &'static sys::Driver {
        self.ctx.driver()
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name (`NVIDIA H200`).
    pub fn device_name(&self) -> &str {
        self.ctx.device_name()
    }

    /// `cuDriverGetVersion`'s answer (13000 for CUDA 13.0).
    pub fn driver_version(&self) -> i32 {
        self.ctx.driver_version()
    }

    /// The CUDA version the driver supports, as a [`Version`](crate::Version).
    pub fn cuda_version(&self) -> crate::Version {
        self.ctx.cuda_version()
    }

    /// The device limits launch validation uses.
    pub fn limits(&self) -> &DeviceLimits {
        self.ctx.limits()
    }

    /// The device's retained primary context.
    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The host's non-blocking stream.
    pub fn stream(&self) -> &CudaStream {
        &self.stream
    }

    /// Make the host's context current on the calling thread, unless it already is.
    ///
    /// # Errors
    /// The failing context call, naming the device.
    pub fn bind(&self) -> Result<()> {
        self.ctx.bind()
    }

    /// Block until all work queued on the host's stream has finished.
    ///
    /// # Errors
    /// `cuStreamSynchronize`'s status (the first failure of that work).
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }
}

impl crate::stream::AsStream for CudaHost {
    fn stream(&self) -> &CudaStream {
        &self.stream
    }
}

impl AsContext for CudaHost {
    fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
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
    // Every update is a single insert, so a poisoned lock still holds a consistent map.
    HOSTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The process's [`CudaHost`] for device `ordinal`, created on first use.
///
/// Returns the same host while any holder lives (the process's own hold, a
/// registry). Creating one initialises the driver (once per process), retains the
/// device's primary context and creates the host's stream.
///
/// # Errors
/// [`ErrorKind::DriverUnavailable`](crate::ErrorKind::DriverUnavailable)
/// without a driver, `InvalidArgument` for an ordinal the driver does not have
/// (naming the device count), or the failing call.
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
/// when its last other holder (registries) goes; a later [`host`] call creates a
/// new one. Does nothing when the process holds none.
pub fn release(ordinal: usize) {
    let held = hosts().get_mut(&ordinal).and_then(|slot| slot.held.take());
    // Dropped outside the lock: the host's Drop calls the driver.
    drop(held);
}
