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
//! - `host_fn.rs`: host functions (`launch_host_fn`, `launch_host_fn_repeat`): a
//!   closure's state is owned by what the driver calls (a once-run is freed by
//!   its run, or never if a racing capture took it into a graph that is never
//!   replayed; a repeatable one captured into a graph is held by the graph), a
//!   panic never unwinds into the driver, and metrale calls from inside one are
//!   refused. `future.rs`: [`StreamDone`] and [`EventDone`], futures whose shared
//!   state what wakes them owns a share of; `waiter.rs`: the bounded set of
//!   threads that wake stream futures from a blocking-sync event wait (a
//!   stream callback beyond them).
//!
//! `mod.rs` owns [`CudaStream`] itself (making, binding, synchronising);
//! `section.rs` and `capture.rs` capture sections and the capture bookkeeping
//! (the process-wide counts are the lifetime room's gates); `pool.rs` and
//! `done.rs` the completion events of operations that lend host memory;
//! `event.rs` [`CudaEvent`] and the waits between streams; `host_fn.rs` and
//! `future.rs` as above.

use std::ffi::{c_int, c_uint};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use metrale_cuda_sys::{self as sys, CUevent, CUresult, CUstream};

use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, CallError, Result};
use crate::green::GreenContext;
use pool::DonePool;
use section::Begun;

mod capture;
mod done;
mod event;
mod future;
mod host_fn;
mod pool;
mod section;
mod waiter;

pub use event::{CudaEvent, EventOptions};
pub use future::{EventDone, StreamDone};
pub use host_fn::{host_function_panics, HostFn};
pub(crate) use host_fn::{
    release_captured_host_fns, release_captured_host_fns_of, take_captured_host_fn, HostKeep,
};
pub(crate) use pool::DoneEvent;
pub(crate) use section::Section;
#[doc(hidden)]
pub use waiter::live_waiters;
use waiter::Waiter;

/// How a stream is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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

impl StreamOptions {
    /// These options with `priority` (see [`CudaContext::stream_priority_range`]).
    #[must_use]
    pub fn with_priority(mut self, priority: i32) -> StreamOptions {
        self.priority = Some(priority);
        self
    }

    /// These options with the non-blocking flag set or cleared.
    #[must_use]
    pub fn with_non_blocking(mut self, on: bool) -> StreamOptions {
        self.non_blocking = on;
        self
    }
}

struct StreamInner {
    raw: CUstream,
    ctx: Arc<CudaContext>,
    /// Whether metrale created the stream (and so destroys it).
    owned: bool,
    /// The context generation the stream was made in (and everything allocated
    /// on it in stream order).
    made: Generation,
    /// Reasons to ask the driver whether the stream is being captured: a capture
    /// begun here by metrale (while it lasts), or a wait that may have joined one
    /// (for good). Zero: the stream cannot be capturing through metrale.
    capture_marks: AtomicU32,
    /// Operations that must not overlap the start of a capture or a join on this
    /// stream (host-borrowing copies, stream-ordered frees) while they run; see
    /// `CudaStream::section`.
    in_flight: AtomicU32,
    /// The completion events of operations that lend host memory (copies,
    /// reads of symbols, pending copies), one per operation in flight: a slot
    /// is claimed for one operation and given back after its wait (see
    /// `DonePool`).
    done: DonePool,
    /// The captures metrale began on this stream whose bookkeeping is not yet
    /// undone (one, or two when a capture began between a failed end's driver
    /// call and its status check): each undone exactly once, by the end that
    /// finds it over.
    begun: Mutex<Vec<Begun>>,
    /// Set while an `end_capture` of this stream runs: ends are exclusive (a
    /// second one fails at once rather than undo the first's capture under it).
    ending: AtomicBool,
    /// Held across a metrale capture's start (mark, drain, begin) or a
    /// capture-joining wait, by sections that find the stream marked, so the
    /// driver's answer "not capturing" stays true for the whole section, and by
    /// a capture's end from its status query through its bookkeeping (on its
    /// success path), so no capture begins in between.
    capture_lock: Mutex<()>,
    /// The green context the stream runs on, held so that it is destroyed only
    /// after the stream (fields drop after `Drop::drop` destroyed the stream).
    green: Option<Arc<GreenContext>>,
    /// The thread that wakes this stream's futures, started by the first
    /// `done`; `None` when none could be (see `waiter.rs`).
    waiter: OnceLock<Option<Waiter>>,
}

// SAFETY: the handle is written once at creation and only read; the driver lets any
// thread queue work on a stream (it binds the context first, or, for the calls
// whose only handle is the stream, the driver takes the context from it).
unsafe impl Send for StreamInner {}
// SAFETY: shared access reads the handle and uses only atomics (the completion-event
// pool: a slot's event is touched only by its claimant, see `DonePool`) and a
// `Mutex` for its mutable state; the driver is thread-safe for the stream.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if let Some(Some(w)) = self.waiter.get() {
            // Its thread finishes the futures queued (their events complete
            // with the work; the driver destroys the stream only after it).
            w.close();
        }
        let begun = std::mem::take(self.begun.get_mut().unwrap_or_else(PoisonError::into_inner));
        if !begun.is_empty() {
            self.end_abandoned_capture(begun);
        }
        let raw = self.raw;
        let made: Vec<CUevent> = self
            .done
            .events
            .iter()
            .map(|e| e.load(AtomicOrdering::Acquire))
            .filter(|e| !e.is_null())
            .collect();
        if !self.owned && made.is_empty() {
            return;
        }
        let owned = self.owned;
        self.ctx.release_with(
            self.made,
            format_args!("destroying stream {raw:p} on device {}", self.ctx.ordinal()),
            |d, failures| {
                for &e in &made {
                    // SAFETY: one of the stream's completion events, made once
                    // and destroyed once (nothing can claim it any more).
                    if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(e)) } {
                        failures.push(e);
                    }
                }
                if owned {
                    // SAFETY: the stream was created by metrale and is destroyed once.
                    if let Err(e) = unsafe { cu!(d, cuStreamDestroy_v2(raw)) } {
                        failures.push(e);
                    }
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
        Ok(CudaStream::wrap(ctx, raw, true))
    }

    /// Wrap a stream created elsewhere (another library, your own driver calls).
    /// metrale queues work on it and never destroys it.
    ///
    /// # Safety
    /// `raw` must be a stream of `ctx`'s context (or null, the legacy default
    /// stream), and stay valid for as long as any clone of the returned handle, and
    /// anything queued through it, is alive.
    pub unsafe fn from_raw(ctx: &impl AsContext, raw: CUstream) -> CudaStream {
        CudaStream::wrap(ctx.context(), raw, false)
    }

    /// A new non-blocking stream on a green context (`cuGreenCtxStreamCreate`,
    /// default priority): work queued on it runs on the green context's SMs. It
    /// is an ordinary stream of the device's context for everything else:
    /// kernels loaded for the device, memory, copies, events and graphs. The
    /// stream keeps the green context alive.
    ///
    /// # Errors
    /// The driver's status naming the device; a missing-symbol error before CUDA
    /// 12.4.
    pub fn on_green_context(green: &Arc<GreenContext>) -> Result<CudaStream> {
        let ctx = green.context();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
        let g = green.raw();
        let mut raw: CUstream = std::ptr::null_mut();
        let one_call = green.lock_calls();
        ctx.call(
            || {
                format!(
                    "device {}: creating a stream on green context {g:p}",
                    ctx.ordinal()
                )
            },
            // SAFETY: a live green context (held by `green`), no other call on it
            // meanwhile (`one_call`); writes one CUstream; CU_STREAM_NON_BLOCKING
            // is the flag the driver requires.
            |d| unsafe { cu!(d, cuGreenCtxStreamCreate(&mut raw, g, flags as c_uint, 0)) },
        )?;
        drop(one_call);
        Ok(CudaStream::wrap_made(
            ctx,
            raw,
            true,
            green.made(),
            Some(Arc::clone(green)),
        ))
    }

    /// The green context the stream runs on, for a stream made by
    /// [`CudaStream::on_green_context`].
    pub fn green_context(&self) -> Option<&Arc<GreenContext>> {
        self.inner.green.as_ref()
    }

    fn wrap(ctx: &Arc<CudaContext>, raw: CUstream, owned: bool) -> CudaStream {
        CudaStream::wrap_made(ctx, raw, owned, ctx.generation(), None)
    }

    fn wrap_made(
        ctx: &Arc<CudaContext>,
        raw: CUstream,
        owned: bool,
        made: Generation,
        green: Option<Arc<GreenContext>>,
    ) -> CudaStream {
        CudaStream {
            inner: Arc::new(StreamInner {
                raw,
                made,
                ctx: Arc::clone(ctx),
                owned,
                capture_marks: AtomicU32::new(0),
                in_flight: AtomicU32::new(0),
                done: DonePool::new(),
                begun: Mutex::new(Vec::new()),
                ending: AtomicBool::new(false),
                capture_lock: Mutex::new(()),
                green,
                waiter: OnceLock::new(),
            }),
        }
    }

    /// The thread that wakes this stream's futures, started on first use;
    /// `None` for the null and special streams, or when no more waiting
    /// threads may start.
    fn waiter(&self) -> Option<&Waiter> {
        if (self.inner.raw as usize) <= 2 {
            return None;
        }
        self.inner
            .waiter
            .get_or_init(|| Waiter::start(&self.inner.ctx, self.inner.made))
            .as_ref()
    }

    /// The context generation the stream was made in.
    pub(crate) fn made(&self) -> Generation {
        self.inner.made
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

    /// Whether this is the last handle to the stream (nothing else holds it).
    #[cfg(feature = "nccl")]
    pub(crate) fn is_last_handle(&self) -> bool {
        Arc::strong_count(&self.inner) == 1
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

    /// Call `f` with the driver on this stream without binding the context first;
    /// name the stream on failure. For the calls whose only handle is the stream
    /// (stream memory operations, host functions): the driver takes the context
    /// from the stream, which the H200 probe of driver 580 confirmed with no
    /// context and with another context current. A driver that wants the
    /// stream's context current anyway refuses before queueing anything:
    /// `CUDA_ERROR_INVALID_CONTEXT` (none current), `CUDA_ERROR_INVALID_HANDLE`
    /// (another current: the stream is not of it) or
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED` (the current one was destroyed); the
    /// call is then bound and made again, so the unbound attempt can cost a
    /// retry but never a wrong result. `f` may run twice. The null
    /// stream and the special handles (legacy, per-thread) mean the current
    /// context's: those calls are always bound.
    #[inline(always)]
    pub(crate) fn call_unbound<R>(
        &self,
        what: &'static str,
        f: impl FnMut(&'static sys::Driver, CUstream) -> Result<R, CallError>,
    ) -> Result<R> {
        self.call_by_stream(f)
            .map_err(|e| e.about(self.subject(what)))
    }

    /// [`CudaStream::call_unbound`] leaving the [`CallError`] to the caller to
    /// describe: unbound for a stream of its own, bound for the null and special
    /// streams (they mean the current context's).
    #[inline(always)]
    pub(crate) fn call_by_stream<R>(
        &self,
        mut f: impl FnMut(&'static sys::Driver, CUstream) -> Result<R, CallError>,
    ) -> Result<R, CallError> {
        let raw = self.inner.raw;
        let ctx = &self.inner.ctx;
        if (raw as usize) <= 2 {
            return ctx.with(|d| f(d, raw));
        }
        ctx.call_by_handle(|d| f(d, raw))
    }

    /// `device N stream 0x..: what` for error texts.
    pub(crate) fn subject(&self, what: &str) -> String {
        let (ordinal, raw) = (self.inner.ctx.ordinal(), self.inner.raw);
        if what.is_empty() {
            // Alone, before a colon or a verb: no trailing space.
            format!("device {ordinal} stream {raw:p}")
        } else {
            format!("device {ordinal} stream {raw:p} {what}")
        }
    }

    /// Block until all work queued on the stream has finished; the error carries
    /// the first failure of that work (a kernel's illegal address, ...).
    /// Afterwards, what host functions had to keep rather than drop (mapped
    /// signal words whose last holder they were) is dropped here.
    ///
    /// # Errors
    /// `cuStreamSynchronize`'s status.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream of the bound context.
        let done = self.call("synchronize", |d, s| unsafe {
            cu!(d, cuStreamSynchronize(s))
        });
        // What this stream's host functions could not drop (mapped signal words
        // whose last holder they were) is dropped here, and waits whose host
        // function could not be queued are counted down once passed.
        crate::lifetime::drain();
        done
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
}

impl AsContext for CudaStream {
    fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }
}

/// Something that names a stream to queue work on: a [`CudaStream`], or a
/// [`CudaHost`](crate::CudaHost) or [`MetraleRegistry`](crate::MetraleRegistry)
/// (their default stream).
///
/// A [`CudaContext`] is not one: it owns no stream, and metrale does not queue
/// on the legacy null stream behind your back (it synchronises with every
/// blocking stream of the context). From a context, take the device's host,
/// which shares it, or make a stream:
///
/// ```no_run
/// # use metrale_runtime::{context, host, CudaStream, DeviceBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let ctx = context(0)?;
/// let a = DeviceBuffer::<f32>::alloc(&ctx, 256)?; // queues nothing: a context
/// let h = host(ctx.ordinal())?;                  // the same context, with a stream
/// let b = DeviceBuffer::<f32>::zeroed(&h, 256)?;
/// let s = CudaStream::new(&ctx)?;
/// let c = DeviceBuffer::from_host(&s, &[1.0f32; 256])?;
/// # drop((a, b, c));
/// # Ok(()) }
/// ```
///
/// ```compile_fail,E0277
/// # use metrale_runtime::{context, DeviceBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let ctx = context(0)?;
/// // error: `CudaContext` is not a stream: this call queues work on one
/// // note: a `CudaContext` owns no stream: pass `&metrale_runtime::host(ctx.ordinal())?` ...
/// let b = DeviceBuffer::<f32>::zeroed(&ctx, 256)?;
/// # Ok(()) }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a stream: this call queues work on one",
    label = "not a `CudaStream`, `CudaHost` or `MetraleRegistry`",
    note = "a `CudaContext` owns no stream: pass `&metrale_runtime::host(ctx.ordinal())?` (the device's host: the same context and its stream), or `&CudaStream::new(&ctx)?`; `DeviceBuffer::alloc` takes a context because it queues nothing"
)]
pub trait AsStream {
    /// The stream.
    fn stream(&self) -> &CudaStream;
}

impl AsStream for CudaStream {
    fn stream(&self) -> &CudaStream {
        self
    }
}

impl<T: AsStream + ?Sized> AsStream for &T {
    fn stream(&self) -> &CudaStream {
        (**self).stream()
    }
}

impl<T: AsStream + ?Sized> AsStream for Arc<T> {
    fn stream(&self) -> &CudaStream {
        (**self).stream()
    }
}
