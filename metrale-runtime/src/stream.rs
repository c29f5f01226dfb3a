//! [`CudaStream`] and [`CudaEvent`]: the queues work is submitted to, and the
//! markers that order and time work across them.
//!
//! Invariants:
//! - A stream or event holds the [`CudaContext`] it was created in, so the context
//!   outlives it; its raw handle never changes.
//! - `CudaStream` is a shared handle (clones queue on the same stream); the stream
//!   is destroyed when the last clone goes, under the release rule
//!   (`CudaContext::release_with`). A stream wrapped with
//!   [`CudaStream::from_raw`] is borrowed and never destroyed by metrale.
//! - Recording an event needs the event and the stream in one context (checked);
//!   waiting may cross devices (the driver allows it).
//! - Streams know nothing of hosts or registries: work is queued on them by the
//!   modules above (launch, memory, graph) through `impl CudaStream` blocks.

use std::ffi::{c_int, c_uint};
use std::fmt;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUevent, CUresult, CUstream};

use crate::context::{AsContext, CudaContext};
use crate::error::{cu, invalid_arg, CallError, Result};

/// How a stream is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamOptions {
    /// Whether the stream does not synchronise with the legacy default stream
    /// (`CU_STREAM_NON_BLOCKING`). Default: `true`.
    pub non_blocking: bool,
    /// The priority, within [`CudaContext::stream_priority_range`]; `None` for the
    /// default (least) priority.
    pub priority: Option<i32>,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            non_blocking: true,
            priority: None,
        }
    }
}

struct StreamInner {
    raw: CUstream,
    ctx: Arc<CudaContext>,
    /// Whether metrale created the stream (and so destroys it).
    owned: bool,
}

// SAFETY: the handle is written once at creation and only read; the driver lets any
// thread queue work on a stream once its context is bound, which every use does.
unsafe impl Send for StreamInner {}
// SAFETY: as for Send; no interior mutability.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let raw = self.raw;
        self.ctx.release_with(
            format_args!("destroying stream {raw:p} on device {}", self.ctx.ordinal()),
            |d, failures| {
                // SAFETY: the stream was created by metrale and is destroyed once, here.
                if let Err(e) = unsafe { cu!(d, cuStreamDestroy_v2(raw)) } {
                    failures.push(e);
                }
            },
        );
    }
}

/// A CUDA stream of one device: work queued on it runs in order.
///
/// Cloning is cheap and gives another handle to the same stream; the stream is
/// destroyed when the last handle goes. Kernels are launched, memory copied and
/// graphs replayed through methods on the stream ([`CudaStream::launch`],
/// [`CudaStream::copy_h2d`], ...).
///
/// ```no_run
/// use metrale_runtime::{context, CudaEvent, CudaStream};
/// # fn main() -> metrale_runtime::Result<()> {
/// let ctx = context(0)?;
/// let (a, b) = (CudaStream::new(&ctx)?, CudaStream::new(&ctx)?);
/// let ready = CudaEvent::new(&ctx)?;
/// // ... queue work on a ...
/// ready.record(&a)?;
/// b.wait(&ready)?; // work queued on b from now on runs after a's work so far
/// b.synchronize()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct CudaStream {
    inner: Arc<StreamInner>,
}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStream")
            .field("device", &self.inner.ctx.ordinal())
            .field("raw", &self.inner.raw)
            .field("owned", &self.inner.owned)
            .finish()
    }
}

impl CudaStream {
    /// A new non-blocking stream of default priority on `ctx`'s device.
    ///
    /// # Errors
    /// The failing `cuStreamCreateWithPriority`, naming the device.
    pub fn new(ctx: &impl AsContext) -> Result<CudaStream> {
        CudaStream::with_options(ctx, StreamOptions::default())
    }

    /// A new stream with the given flag and priority.
    ///
    /// # Errors
    /// `InvalidArgument` for a priority outside the device's range (saying the
    /// range); the failing driver call otherwise.
    pub fn with_options(ctx: &impl AsContext, options: StreamOptions) -> Result<CudaStream> {
        let ctx = ctx.context();
        let priority = match options.priority {
            None => 0,
            Some(p) => {
                let (least, greatest) = ctx.stream_priority_range()?;
                if p > least || p < greatest {
                    return Err(invalid_arg(format!(
                        "stream priority {p} is outside device {}'s range {greatest} (greatest) ..= {least} (least)",
                        ctx.ordinal()
                    )));
                }
                p
            }
        };
        let flags = if options.non_blocking {
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0
        } else {
            sys::CUstream_flags::CU_STREAM_DEFAULT.0
        };
        let mut raw: CUstream = std::ptr::null_mut();
        ctx.call(
            || format!("device {}: creating a stream", ctx.ordinal()),
            // SAFETY: writes one CUstream; the context is current.
            |d| unsafe {
                cu!(
                    d,
                    cuStreamCreateWithPriority(&mut raw, flags as c_uint, priority as c_int)
                )
            },
        )?;
        Ok(CudaStream {
            inner: Arc::new(StreamInner {
                raw,
                ctx: Arc::clone(ctx),
                owned: true,
            }),
        })
    }

    /// Wrap a stream created elsewhere (another library, your own driver calls).
    /// metrale queues work on it and never destroys it.
    ///
    /// # Safety
    /// `raw` must be a stream of `ctx`'s context (or null, the legacy default
    /// stream), and stay valid for as long as any clone of the returned handle, and
    /// anything queued through it, is alive.
    pub unsafe fn from_raw(ctx: &impl AsContext, raw: CUstream) -> CudaStream {
        CudaStream {
            inner: Arc::new(StreamInner {
                raw,
                ctx: Arc::clone(ctx.context()),
                owned: false,
            }),
        }
    }

    /// The raw `CUstream`, for driver calls of your own.
    #[inline]
    pub fn raw(&self) -> CUstream {
        self.inner.raw
    }

    /// The context the stream belongs to.
    #[inline]
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
    }

    /// Whether `other` is a handle to this very stream.
    pub fn same_stream(&self, other: &CudaStream) -> bool {
        self.inner.raw == other.inner.raw && Arc::ptr_eq(&self.inner.ctx, &other.inner.ctx)
    }

    /// Bind the context and call `f` with the driver; name the stream on failure.
    #[inline]
    pub(crate) fn call<R>(
        &self,
        what: &'static str,
        f: impl FnOnce(&'static sys::Driver, CUstream) -> Result<R, CallError>,
    ) -> Result<R> {
        let raw = self.inner.raw;
        self.inner.ctx.call(|| self.subject(what), |d| f(d, raw))
    }

    /// `device N stream 0x..: what` for error texts.
    pub(crate) fn subject(&self, what: &str) -> String {
        format!(
            "device {} stream {:p} {what}",
            self.inner.ctx.ordinal(),
            self.inner.raw
        )
    }

    /// Block until all work queued on the stream has finished; the error carries
    /// the first failure of that work (a kernel's illegal address, ...).
    ///
    /// # Errors
    /// `cuStreamSynchronize`'s status.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream of the bound context.
        self.call("synchronize", |d, s| unsafe {
            cu!(d, cuStreamSynchronize(s))
        })
    }

    /// Whether all work queued on the stream has finished (`cuStreamQuery`).
    ///
    /// # Errors
    /// A status other than success or `CUDA_ERROR_NOT_READY`.
    pub fn query(&self) -> Result<bool> {
        self.call("query", |d, s| {
            // SAFETY: a live stream of the bound context.
            match unsafe { cu!(d, cuStreamQuery(s)) } {
                Ok(()) => Ok(true),
                Err(CallError::Status { status, .. })
                    if status == CUresult::CUDA_ERROR_NOT_READY =>
                {
                    Ok(false)
                }
                Err(e) => Err(e),
            }
        })
    }

    /// Make work queued on this stream from now on wait until `event` (as last
    /// recorded) has completed. The event may belong to another device.
    ///
    /// # Errors
    /// `cuStreamWaitEvent`'s status.
    pub fn wait(&self, event: &CudaEvent) -> Result<()> {
        let e = event.raw;
        // SAFETY: a live stream and a live event; flags must be 0.
        self.call("waiting for an event", |d, s| unsafe {
            cu!(d, cuStreamWaitEvent(s, e, 0))
        })
    }

    /// The stream's priority (`cuStreamGetPriority`).
    ///
    /// # Errors
    /// `cuStreamGetPriority`'s status.
    pub fn priority(&self) -> Result<i32> {
        let mut p: c_int = 0;
        // SAFETY: writes one int for a live stream.
        self.call("priority", |d, s| unsafe {
            cu!(d, cuStreamGetPriority(s, &mut p))
        })?;
        Ok(p)
    }

    /// After a failed wait on work that touches host memory: return only once the
    /// stream has nothing in flight. `cuStreamQuery` answers NOT_READY while work
    /// is pending and anything else once the stream is idle or its work has been
    /// abandoned (a failed context runs nothing more), so borrowed host memory is
    /// no longer touched when this returns. Never fails; the caller reports the
    /// original error.
    #[cold]
    pub(crate) fn quiesce(&self) {
        let d = self.inner.ctx.driver();
        let raw = self.inner.raw;
        let _ = self.inner.ctx.bind_fast();
        let mut pause = std::time::Duration::from_micros(10);
        loop {
            // SAFETY: a live stream; only the status is read.
            match unsafe { cu!(d, cuStreamQuery(raw)) } {
                Err(CallError::Status { status, .. })
                    if status == CUresult::CUDA_ERROR_NOT_READY =>
                {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_millis(10));
                }
                _ => return,
            }
        }
    }

    /// Synchronise; when that fails, wait until the stream is idle before
    /// returning the error (see [`CudaStream::quiesce`]). For operations that lent
    /// host memory to the stream.
    pub(crate) fn synchronize_or_quiesce(&self) -> Result<()> {
        match self.synchronize() {
            Ok(()) => Ok(()),
            Err(e) => {
                self.quiesce();
                Err(e)
            }
        }
    }
}

impl AsContext for CudaStream {
    fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }
}

/// How an event is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EventOptions {
    /// Record timestamps, for [`CudaEvent::elapsed_ms`]. Default: off.
    pub timing: bool,
    /// Block the waiting thread in [`CudaEvent::synchronize`] instead of
    /// spinning (`CU_EVENT_BLOCKING_SYNC`). Default: off.
    pub blocking_sync: bool,
}

/// A CUDA event: a marker recorded on a stream, to wait for, query, or time.
///
/// Events are created **without timing** by default ([`CudaEvent::new`]): the
/// driver documents that such events give the best performance with
/// `cuStreamWaitEvent` and `cuEventQuery`, and ordering streams is what most
/// events are for. Use [`CudaEvent::timed`] for events you measure with.
pub struct CudaEvent {
    raw: CUevent,
    ctx: Arc<CudaContext>,
    timing: bool,
}

// SAFETY: the handle is written once at creation; the driver lets any thread record,
// query or wait on an event once its context is bound, which every use does.
unsafe impl Send for CudaEvent {}
// SAFETY: as for Send; no interior mutability.
unsafe impl Sync for CudaEvent {}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaEvent")
            .field("device", &self.ctx.ordinal())
            .field("raw", &self.raw)
            .field("timing", &self.timing)
            .finish()
    }
}

impl CudaEvent {
    /// An event without timing (see the type's docs for why that is the default).
    ///
    /// # Errors
    /// `cuEventCreate`'s status.
    pub fn new(ctx: &impl AsContext) -> Result<CudaEvent> {
        CudaEvent::with_options(ctx, EventOptions::default())
    }

    /// An event that records timestamps, for [`CudaEvent::elapsed_ms`].
    ///
    /// # Errors
    /// `cuEventCreate`'s status.
    pub fn timed(ctx: &impl AsContext) -> Result<CudaEvent> {
        CudaEvent::with_options(
            ctx,
            EventOptions {
                timing: true,
                ..EventOptions::default()
            },
        )
    }

    /// An event with the given options.
    ///
    /// # Errors
    /// `cuEventCreate`'s status.
    pub fn with_options(ctx: &impl AsContext, options: EventOptions) -> Result<CudaEvent> {
        use sys::CUevent_flags as F;
        let ctx = ctx.context();
        let mut flags = F::CU_EVENT_DEFAULT.0;
        if !options.timing {
            flags |= F::CU_EVENT_DISABLE_TIMING.0;
        }
        if options.blocking_sync {
            flags |= F::CU_EVENT_BLOCKING_SYNC.0;
        }
        let mut raw: CUevent = std::ptr::null_mut();
        ctx.call(
            || format!("device {}: creating an event", ctx.ordinal()),
            // SAFETY: writes one CUevent; the context is current.
            |d| unsafe { cu!(d, cuEventCreate(&mut raw, flags as c_uint)) },
        )?;
        Ok(CudaEvent {
            raw,
            ctx: Arc::clone(ctx),
            timing: options.timing,
        })
    }

    fn call(
        &self,
        what: &'static str,
        f: impl FnOnce(&'static sys::Driver) -> Result<(), CallError>,
    ) -> Result<()> {
        self.ctx.call(
            || format!("device {} event {:p} {what}", self.ctx.ordinal(), self.raw),
            f,
        )
    }

    /// Record the event at the current end of `stream`'s queue.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice) for a stream of another context;
    /// `cuEventRecord`'s status.
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        stream.context().check_same(
            &self.ctx,
            || "event".to_owned(),
            "the stream it is recorded on",
        )?;
        let (e, s) = (self.raw, stream.raw());
        // SAFETY: a live event and a live stream of the same, bound context.
        self.call("record", |d| unsafe { cu!(d, cuEventRecord(e, s)) })
    }

    /// Block until the work before the event's last record has finished.
    ///
    /// # Errors
    /// `cuEventSynchronize`'s status (the first failure of that work).
    pub fn synchronize(&self) -> Result<()> {
        let e = self.raw;
        // SAFETY: a live event.
        self.call("synchronize", |d| unsafe { cu!(d, cuEventSynchronize(e)) })
    }

    /// Whether the work before the event's last record has finished (an event
    /// never recorded counts as finished).
    ///
    /// # Errors
    /// A status other than success or `CUDA_ERROR_NOT_READY`.
    pub fn query(&self) -> Result<bool> {
        let e = self.raw;
        let mut done = true;
        self.call("query", |d| {
            // SAFETY: a live event.
            match unsafe { cu!(d, cuEventQuery(e)) } {
                Ok(()) => Ok(()),
                Err(CallError::Status { status, .. })
                    if status == CUresult::CUDA_ERROR_NOT_READY =>
                {
                    done = false;
                    Ok(())
                }
                Err(err) => Err(err),
            }
        })?;
        Ok(done)
    }

    /// Milliseconds from this event to `end` (both recorded and completed, both
    /// created with timing), with the driver's resolution of about half a
    /// microsecond.
    ///
    /// # Errors
    /// `InvalidArgument` when either event was created without timing (checked
    /// before the driver); `cuEventElapsedTime_v2`'s status (`NOT_READY` while one
    /// is still pending).
    pub fn elapsed_ms(&self, end: &CudaEvent) -> Result<f32> {
        if !self.timing || !end.timing {
            return Err(invalid_arg(format!(
                "elapsed time between events of device {}: the {} event was created without timing (use CudaEvent::timed)",
                self.ctx.ordinal(),
                if self.timing { "end" } else { "start" }
            )));
        }
        let (start, stop) = (self.raw, end.raw);
        let mut ms = 0f32;
        // SAFETY: two live events with timing; writes one float.
        self.call("elapsed time", |d| unsafe {
            cu!(d, cuEventElapsedTime_v2(&mut ms, start, stop))
        })?;
        Ok(ms)
    }

    /// Whether the event records timestamps.
    pub fn has_timing(&self) -> bool {
        self.timing
    }

    /// The raw `CUevent`, for driver calls of your own.
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// The context the event belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let raw = self.raw;
        self.ctx.release_with(
            format_args!("destroying event {raw:p} on device {}", self.ctx.ordinal()),
            |d, failures| {
                // SAFETY: the event was created here and is destroyed once.
                if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(raw)) } {
                    failures.push(e);
                }
            },
        );
    }
}
