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
//!   refused. `future.rs`: [`StreamDone`] and [`EventDone`], futures woken by a
//!   stream callback, whose shared state the callback owns a share of.

use std::ffi::{c_int, c_uint};
use std::fmt;
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicUsize, Ordering as AtomicOrdering,
};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use metrale_cuda_sys::{self as sys, CUevent, CUresult, CUstream};

use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, CallError, MetraleError, Result};
use crate::green::GreenContext;

mod future;
mod host_fn;

pub use future::{EventDone, StreamDone};
pub use host_fn::{host_function_panics, HostFn};
pub(crate) use host_fn::{
    release_captured_host_fns, release_captured_host_fns_of, take_captured_host_fn, HostKeep,
};

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
}

/// Completion-event slots per stream: more operations in flight at once than
/// this (pending copies kept) each make and destroy an event of their own.
const DONE_SLOTS: usize = 16;

/// A stream's completion events: each operation that lends host memory claims
/// a free slot (one compare-exchange on `taken`), records the slot's event
/// right after itself and waits on that event alone, then gives the slot back,
/// so it waits for its own work and what was queued before it, never for work
/// queued after it. A slot's event is made on its first claim and destroyed
/// with the stream; only the slot's claimant touches it meanwhile.
struct DonePool {
    /// Bit `i` set: slot `i` is claimed.
    taken: AtomicU32,
    /// Slot `i`'s event (null until first made).
    events: [AtomicPtr<sys::CUevent_st>; DONE_SLOTS],
}

impl DonePool {
    fn new() -> DonePool {
        DonePool {
            taken: AtomicU32::new(0),
            events: std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())),
        }
    }

    /// Claim a free slot; `None` when all are claimed.
    #[inline]
    fn claim(&self) -> Option<usize> {
        let mut now = self.taken.load(AtomicOrdering::Relaxed);
        loop {
            let free = (!now).trailing_zeros() as usize;
            if free >= DONE_SLOTS {
                return None;
            }
            match self.taken.compare_exchange_weak(
                now,
                now | (1 << free),
                AtomicOrdering::Acquire,
                AtomicOrdering::Relaxed,
            ) {
                Ok(_) => return Some(free),
                Err(seen) => now = seen,
            }
        }
    }

    /// Give slot `slot` back (its event may be recorded again by the next
    /// claimant).
    #[inline]
    fn give_back(&self, slot: usize) {
        self.taken
            .fetch_and(!(1u32 << slot), AtomicOrdering::Release);
    }
}

/// The completion event of one operation on a stream (see `DonePool`): a slot
/// of the stream's pool, or an event of its own when every slot was claimed.
/// Handed back through `CudaStream::wait_done` or `CudaStream::give_back_done`
/// (forgotten, it keeps its slot claimed: a later operation then makes an
/// event of its own).
#[derive(Debug)]
pub(crate) struct DoneEvent {
    raw: CUevent,
    /// The pool slot; `DONE_SLOTS`: an event of its own, destroyed when given
    /// back.
    slot: usize,
}

impl DoneEvent {
    /// The raw event, to query or wait on.
    pub(crate) fn raw(&self) -> CUevent {
        self.raw
    }
}

/// Whether an unbound stream call's `status` may be the driver wanting the
/// stream's context current (see `CudaStream::call_unbound`).
fn refused_for_context(status: sys::CUresult) -> bool {
    status == sys::CUresult::CUDA_ERROR_INVALID_CONTEXT
        || status == sys::CUresult::CUDA_ERROR_INVALID_HANDLE
        || status == sys::CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
}

/// Metrale captures in progress in this process. While there is none, no stream
/// can be capturing through metrale, and the launch path does no capture work.
static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// Count a capture that is beginning.
pub(crate) fn captures_begin() {
    CAPTURES.fetch_add(1, AtomicOrdering::SeqCst);
    // A wait that saw no capture in progress must finish before this capture can
    // begin (it may be about to join it, unmarked): see `CudaStream::wait`.
    while UNMARKED_WAITS.load(AtomicOrdering::SeqCst) != 0 {
        std::thread::yield_now();
    }
}

/// Waits in progress that found no capture in progress (and so mark nothing).
static UNMARKED_WAITS: AtomicUsize = AtomicUsize::new(0);

/// Count a capture that is over; whether none is left.
pub(crate) fn captures_end() -> bool {
    let before = CAPTURES
        .fetch_update(AtomicOrdering::SeqCst, AtomicOrdering::SeqCst, |n| {
            Some(n.saturating_sub(1))
        })
        .unwrap_or(0);
    before <= 1
}

/// Whether any capture begun through metrale is in progress (one atomic load).
#[inline]
pub(crate) fn captures_in_progress() -> bool {
    CAPTURES.load(AtomicOrdering::SeqCst) != 0
}

/// A section of work on a stream during which no metrale capture begins on it and
/// no metrale wait joins it to one (see [`CudaStream::section`]).
pub(crate) struct Section<'a> {
    inner: &'a StreamInner,
    /// Whether the stream may be capturing: the driver must be asked.
    pub(crate) may_capture: bool,
    /// Held on the slow path (the stream was marked).
    _locked: Option<MutexGuard<'a, ()>>,
}

impl Drop for Section<'_> {
    #[inline]
    fn drop(&mut self) {
        if !self.may_capture {
            self.inner.in_flight.fetch_sub(1, AtomicOrdering::SeqCst);
        }
    }
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

impl StreamInner {
    /// The last handle went while a metrale capture was in progress here
    /// (begun, never ended): end it in the driver (its graph destroyed
    /// unreplayed), then undo its bookkeeping as its end would have (the
    /// beginning thread's count, the host functions queued into it, the
    /// process's count), so nothing stays counted or held for good.
    #[cold]
    fn end_abandoned_capture(&mut self, begun: Vec<Begun>) {
        let raw = self.raw;
        self.ctx.release_with(
            self.made,
            format_args!(
                "ending the capture of stream {raw:p} on device {}, dropped while capturing",
                self.ctx.ordinal()
            ),
            |d, failures| {
                let mut graph: sys::CUgraph = std::ptr::null_mut();
                // SAFETY: a live stream of the bound context; writes one graph
                // handle (null when the capture failed).
                match unsafe { cu!(d, cuStreamEndCapture(raw, &mut graph)) } {
                    // An invalidated capture's end ends it: nothing to say.
                    Err(CallError::Status { status, .. })
                        if status == CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => {}
                    Err(e) => failures.push(e),
                    Ok(()) => {}
                }
                if !graph.is_null() {
                    // SAFETY: the graph the end just made, never handed out,
                    // destroyed once.
                    if let Err(e) = unsafe { cu!(d, cuGraphDestroy(graph)) } {
                        failures.push(e);
                    }
                }
            },
        );
        for b in begun {
            b.depth.fetch_sub(1, AtomicOrdering::SeqCst);
            if b.id != 0 {
                release_captured_host_fns(b.id);
            }
            (b.finished)();
        }
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
            }),
        }
    }

    /// The context generation the stream was made in.
    pub(crate) fn made(&self) -> Generation {
        self.inner.made
    }

    /// Enter a section that no metrale capture may begin in, nor a metrale wait
    /// join to one: while the returned guard lives, `begin_capture` and
    /// capture-joining waits on this stream wait for it to end. The guard says
    /// whether the stream may be capturing anyway (captured through metrale
    /// before the section began): then ask [`CudaStream::is_capturing`].
    ///
    /// This is how a copy that borrows host memory, or a stream-ordered free, knows
    /// that what it queues is not recorded into another thread's graph (two atomic
    /// read-modify-writes and a load when no capture is in progress).
    #[inline]
    pub(crate) fn section(&self) -> Section<'_> {
        let inner = &*self.inner;
        inner.in_flight.fetch_add(1, AtomicOrdering::SeqCst);
        if inner.capture_marks.load(AtomicOrdering::SeqCst) == 0 {
            return Section {
                inner,
                may_capture: false,
                _locked: None,
            };
        }
        self.marked_section()
    }

    /// The slow path of `section`: the stream is (or is about to be) captured
    /// through metrale. Leave the fast count (a capture start waits for it) and
    /// take the capture lock instead, so no capture starts or joins until the
    /// section ends and the driver's answer holds throughout.
    #[cold]
    fn marked_section(&self) -> Section<'_> {
        let inner = &*self.inner;
        inner.in_flight.fetch_sub(1, AtomicOrdering::SeqCst);
        let locked = inner
            .capture_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Section {
            inner,
            may_capture: true,
            _locked: Some(locked),
        }
    }

    /// Whether a metrale capture (or capture join) may be in progress on this
    /// stream: one load, no section. Only for work that stays sound if a capture
    /// begins right after the answer (see `launch_host_fn`'s pool slots).
    #[inline]
    pub(crate) fn marked_for_capture(&self) -> bool {
        self.inner.capture_marks.load(AtomicOrdering::SeqCst) != 0
    }

    /// Take the capture lock, mark the stream as possibly capturing and wait until
    /// no fast section is open on it: afterwards every new section takes the lock
    /// and asks the driver. The lock is held until the returned guard drops, so
    /// the capture (or join) happens before any such section.
    pub(crate) fn mark_capture(&self) -> MutexGuard<'_, ()> {
        let inner = &*self.inner;
        let locked = inner
            .capture_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        inner.capture_marks.fetch_add(1, AtomicOrdering::SeqCst);
        while inner.in_flight.load(AtomicOrdering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        locked
    }

    /// Note that a metrale capture began on this stream, with the driver's
    /// capture id when known (0 otherwise), and the capture count of the
    /// thread that began it (undone there whichever thread ends it).
    /// `finished` is what the end runs besides this room's bookkeeping; the
    /// stream's Drop runs it for a capture that is never ended.
    pub(crate) fn set_capturing(&self, id: u64, finished: fn()) {
        let depth = capture_depth_counter();
        depth.fetch_add(1, AtomicOrdering::SeqCst);
        self.inner
            .begun
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Begun {
                id,
                depth,
                finished,
            });
    }

    /// Take the bookkeeping of one metrale capture of this stream that is over:
    /// the one with the driver's id `id` when noted, else the oldest; `None`
    /// when no metrale capture is in progress here.
    pub(crate) fn take_capturing(&self, id: Option<u64>) -> Option<(u64, Arc<AtomicI32>)> {
        let mut begun = self
            .inner
            .begun
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let at = id
            .and_then(|id| begun.iter().position(|b| b.id == id))
            .or_else(|| (!begun.is_empty()).then_some(0))?;
        let Begun { id, depth, .. } = begun.remove(at);
        Some((id, depth))
    }

    /// Whether a capture metrale began on this stream is still in progress (its
    /// bookkeeping not yet undone).
    pub(crate) fn metrale_capturing(&self) -> bool {
        !self
            .inner
            .begun
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }

    /// Start an end of this stream's capture: `None` while another one runs
    /// (ends are exclusive); the guard lets the next one start when dropped.
    pub(crate) fn start_ending(&self) -> Option<Ending<'_>> {
        (!self.inner.ending.swap(true, AtomicOrdering::SeqCst))
            .then_some(Ending(&self.inner.ending))
    }

    /// Take the capture lock, without marking: an end holds it so that no
    /// capture begins (nor section runs) between its driver call and its
    /// bookkeeping.
    pub(crate) fn lock_capture(&self) -> MutexGuard<'_, ()> {
        self.inner
            .capture_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Take back one mark of `mark_capture`.
    pub(crate) fn unmark_capture(&self) {
        self.inner
            .capture_marks
            .fetch_sub(1, AtomicOrdering::SeqCst);
    }

    /// Whether the stream is being captured (asked of the driver), inside a section
    /// that said it may be.
    #[inline(always)]
    pub(crate) fn capturing_now(&self, section: &Section<'_>) -> Result<bool, CallError> {
        if !section.may_capture {
            return Ok(false);
        }
        self.capturing_driver()
    }

    /// The driver's answer to "is the stream being captured" (out of line: the
    /// submit paths only ask it for a stream marked for capture).
    #[cold]
    #[inline(never)]
    fn capturing_driver(&self) -> Result<bool, CallError> {
        Ok(self.capture_status_raw()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// `cuStreamGetCaptureInfo_v3`'s status of the stream.
    pub(crate) fn capture_status_raw(&self) -> Result<sys::CUstreamCaptureStatus, CallError> {
        self.capture_info_raw().map(|(status, _)| status)
    }

    /// The driver's id of the capture the stream is in (its own, or one it
    /// joined); `None` when it is not capturing.
    pub(crate) fn capture_id_raw(&self) -> Result<Option<u64>, CallError> {
        let (status, id) = self.capture_info_raw()?;
        Ok((status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE).then_some(id))
    }

    /// `cuStreamGetCaptureInfo_v3`'s status of the stream and its capture id.
    pub(crate) fn capture_info_raw(&self) -> Result<(sys::CUstreamCaptureStatus, u64), CallError> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: std::ffi::c_ulonglong = 0;
        let raw = self.inner.raw;
        self.inner.ctx.with(|d| {
            // SAFETY: writes the status and the id only; the other outputs are
            // optional (null).
            unsafe {
                cu!(
                    d,
                    cuStreamGetCaptureInfo_v3(
                        raw,
                        &mut status,
                        &mut id,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut()
                    )
                )
            }
        })?;
        Ok((status, id))
    }

    /// Refuse, inside `section`, an operation that cannot be captured (a copy that
    /// borrows host memory would be replayed after the borrow ends).
    pub(crate) fn refuse_if_capturing(&self, section: &Section<'_>, what: &str) -> Result<()> {
        match self.capturing_now(section) {
            Ok(false) => Ok(()),
            Ok(true) => Err(invalid_arg(format!(
                "{}: the stream is being captured, and {what} cannot be: a graph would \
                 replay it after this call returned (queue it outside the capture)",
                self.subject("")
            ))),
            Err(e) => Err(e.about(self.subject("capture status"))),
        }
    }

    /// Record a completion event of this stream's pool at the end of its queue,
    /// inside a section (so it is not recorded into a capture): waiting on it
    /// waits for everything queued so far, and for nothing queued later (each
    /// operation has its own, see `DonePool`). Hand it back with
    /// [`CudaStream::wait_done`] or [`CudaStream::give_back_done`].
    pub(crate) fn record_done(&self) -> Result<DoneEvent> {
        let done = self.claim_done()?;
        let (ev, s) = (done.raw, self.inner.raw);
        // SAFETY: a live event and stream of the bound context.
        let recorded = self.call("recording its completion event", |d, _| unsafe {
            cu!(d, cuEventRecord(ev, s))
        });
        match recorded {
            Ok(()) => Ok(done),
            Err(e) => {
                self.give_back_done(done);
                Err(e)
            }
        }
    }

    /// A completion event: a free slot of the pool (its event made on the
    /// slot's first claim), or an event of its own when every slot is claimed.
    fn claim_done(&self) -> Result<DoneEvent> {
        let pool = &self.inner.done;
        let slot = pool.claim();
        if let Some(slot) = slot {
            let ev = pool.events[slot].load(AtomicOrdering::Acquire);
            if !ev.is_null() {
                return Ok(DoneEvent { raw: ev, slot });
            }
        }
        let mut raw: CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        let made = self.call("creating a completion event", |d, _| {
            // SAFETY: writes one event handle; the context is current.
            unsafe { cu!(d, cuEventCreate(&mut raw, flags as c_uint)) }
        });
        match (made, slot) {
            (Ok(()), Some(slot)) => {
                // Only this slot's claimant writes it; the stream's Drop reads it.
                pool.events[slot].store(raw, AtomicOrdering::Release);
                Ok(DoneEvent { raw, slot })
            }
            (Ok(()), None) => Ok(DoneEvent {
                raw,
                slot: DONE_SLOTS,
            }),
            (Err(e), slot) => {
                if let Some(slot) = slot {
                    pool.give_back(slot);
                }
                Err(e)
            }
        }
    }

    /// Hand back a completion event that is no longer waited on: its slot is
    /// freed, or an event of its own destroyed (under the release rule).
    pub(crate) fn give_back_done(&self, done: DoneEvent) {
        if done.slot < DONE_SLOTS {
            self.inner.done.give_back(done.slot);
            return;
        }
        let raw = done.raw;
        let ctx = &self.inner.ctx;
        ctx.release_with(
            self.inner.made,
            format_args!(
                "destroying a completion event {raw:p} of stream {:p} on device {}",
                self.inner.raw,
                ctx.ordinal()
            ),
            |d, failures| {
                // SAFETY: an event made by `claim_done` for this one operation,
                // destroyed once (the driver frees a pending one once complete).
                if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(raw)) } {
                    failures.push(e);
                }
            },
        );
    }

    /// Record a completion event inside `section`, right after an operation that
    /// lent host memory; when that fails, wait for the stream inside the section
    /// (no capture can begin there) so the memory is no longer touched when the
    /// error is returned.
    pub(crate) fn record_done_in(&self, section: &Section<'_>) -> Result<DoneEvent> {
        let _ = section;
        match self.record_done() {
            Ok(e) => Ok(e),
            Err(e) => {
                self.finish_raw();
                Err(e)
            }
        }
    }

    /// Wait until the stream has nothing in flight, by `cuStreamSynchronize` and,
    /// when that fails, by polling `cuStreamQuery` until the stream is idle or its
    /// work is abandoned. For error paths inside a section (not captured).
    #[cold]
    fn finish_raw(&self) {
        let d = self.inner.ctx.driver();
        let raw = self.inner.raw;
        let _ = self.inner.ctx.bind_fast();
        // SAFETY: a live stream of the bound context, not being captured.
        if unsafe { cu!(d, cuStreamSynchronize(raw)) }.is_ok() {
            return;
        }
        let mut pause = std::time::Duration::from_micros(10);
        loop {
            // SAFETY: as above; only the status is read.
            match unsafe { cu!(d, cuStreamQuery(raw)) } {
                Ok(()) => return,
                Err(CallError::Status { status, .. }) if work_abandoned(status) => return,
                Err(_) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_millis(10));
                }
            }
        }
    }

    /// Whether `event` (recorded on this stream) has completed.
    pub(crate) fn event_done(&self, event: CUevent) -> Result<bool> {
        self.call("query", |d, _| {
            // SAFETY: a live event of this context.
            match unsafe { cu!(d, cuEventQuery(event)) } {
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

    /// Wait until `done` (recorded on this stream outside any capture) has
    /// completed, then give it back, for an operation that lent host memory to
    /// the stream: when the
    /// wait fails, poll until the event is done or the context can run nothing
    /// more, so the memory is no longer touched when this returns. A failed query
    /// is never taken for "done".
    pub(crate) fn wait_done(&self, done: DoneEvent) -> Result<()> {
        let waited = self.wait_event(done.raw);
        self.give_back_done(done);
        waited
    }

    /// As [`CudaStream::wait_done`], for an event that is not the pool's (it
    /// stays the caller's).
    pub(crate) fn wait_event(&self, event: CUevent) -> Result<()> {
        let sync = || {
            self.call("waiting for queued work", |d, _| {
                // SAFETY: a live event of this context.
                unsafe { cu!(d, cuEventSynchronize(event)) }
            })
        };
        let mut waited = sync();
        if waited
            .as_ref()
            .err()
            .and_then(MetraleError::status)
            .is_some_and(|s| (900..=908).contains(&s.0))
        {
            // Refused because of a capture (this thread's, or a global one): an
            // event recorded outside any capture may still be waited for, in the
            // relaxed mode, for this call.
            waited = relaxed(self.inner.ctx.driver(), sync);
        }
        if waited.is_ok() || crate::context::in_host_function() {
            // Inside a host function nothing was queued (every call is refused).
            return waited;
        }
        let d = self.inner.ctx.driver();
        let mut pause = std::time::Duration::from_micros(10);
        loop {
            let _ = self.inner.ctx.bind_fast();
            // SAFETY: a live event; only the status is read.
            match unsafe { cu!(d, cuEventQuery(event)) } {
                Ok(()) => return waited,
                Err(CallError::Status { status, .. }) if work_abandoned(status) => return waited,
                Err(_) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_millis(10));
                }
            }
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
        mut f: impl FnMut(&'static sys::Driver, CUstream) -> Result<R, CallError>,
    ) -> Result<R> {
        let raw = self.inner.raw;
        let ctx = &self.inner.ctx;
        if (raw as usize) <= 2 {
            return ctx.call(|| self.subject(what), |d| f(d, raw));
        }
        match f(ctx.driver(), raw) {
            Ok(r) => Ok(r),
            Err(e) if e.status().is_some_and(refused_for_context) => {
                ctx.call(|| self.subject(what), |d| f(d, raw))
            }
            Err(e) => Err(e.about(self.subject(what))),
        }
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
        crate::context::drain_dropped_later();
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

    /// Make work queued on this stream from now on wait until `event` (as last
    /// recorded) has completed. The event may belong to another device.
    ///
    /// # Errors
    /// `cuStreamWaitEvent`'s status.
    pub fn wait(&self, event: &CudaEvent) -> Result<()> {
        let e = event.raw;
        let wait = || {
            // SAFETY: a live stream and a live event; flags must be 0.
            self.call("waiting for an event", |d, s| unsafe {
                cu!(d, cuStreamWaitEvent(s, e, 0))
            })
        };
        UNMARKED_WAITS.fetch_add(1, AtomicOrdering::SeqCst);
        if !captures_in_progress() {
            // No capture can begin (it waits for this count) until the wait is
            // queued, so the event cannot be one recorded in a capture.
            let waited = wait();
            UNMARKED_WAITS.fetch_sub(1, AtomicOrdering::SeqCst);
            return waited;
        }
        UNMARKED_WAITS.fetch_sub(1, AtomicOrdering::SeqCst);
        // The event may have been recorded in a capture: waiting would join this
        // stream to it. Mark the stream first, so sections that must not be
        // captured ask the driver from now on; keep the mark if it did join.
        let locked = self.mark_capture();
        let waited = wait();
        let joined = self.capturing_driver().unwrap_or(true);
        if !joined {
            self.unmark_capture();
        }
        drop(locked);
        waited
    }

    /// `cuStreamWaitEvent` without the capture-join marking of
    /// [`CudaStream::wait`]: for events metrale recorded outside any capture.
    pub(crate) fn wait_unmarked(&self, event: &CudaEvent) -> Result<()> {
        let e = event.raw;
        // SAFETY: a live stream and a live event; flags must be 0.
        self.call("waiting for an event", |d, s| unsafe {
            cu!(d, cuStreamWaitEvent(s, e, 0))
        })
    }

    /// Wait for everything queued on the stream so far, through a completion
    /// event (see `record_done`); refused while the stream is being captured.
    pub(crate) fn finish_queued(&self) -> Result<()> {
        let section = self.section();
        self.refuse_if_capturing(&section, "waiting for it")?;
        let done = self.record_done_in(&section)?;
        drop(section);
        self.wait_done(done)
    }

    /// Make work queued on this stream from now on wait for the work queued on
    /// `other` so far: an event recorded on `other` and waited on here, in one
    /// call. `other` may belong to another device.
    ///
    /// # Errors
    /// `cuEventCreate`, `cuEventRecord` or `cuStreamWaitEvent`'s status.
    pub fn join(&self, other: &CudaStream) -> Result<()> {
        let event = CudaEvent::new(other)?;
        event.record(other)?;
        self.wait(&event)
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

/// How an event is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EventOptions {
    /// Record timestamps, for [`CudaEvent::elapsed_ms`]. Default: off.
    pub timing: bool,
    /// Block the waiting thread in [`CudaEvent::synchronize`] instead of
    /// spinning (`CU_EVENT_BLOCKING_SYNC`). Default: off.
    pub blocking_sync: bool,
    /// Shareable with other processes (`CU_EVENT_INTERPROCESS`, see
    /// `CudaEvent::ipc_handle`); needs timing off. Default: off.
    pub interprocess: bool,
}

impl EventOptions {
    /// These options with interprocess sharing on or off.
    #[must_use]
    pub fn with_interprocess(mut self, on: bool) -> EventOptions {
        self.interprocess = on;
        self
    }

    /// These options with timing on or off.
    #[must_use]
    pub fn with_timing(mut self, on: bool) -> EventOptions {
        self.timing = on;
        self
    }

    /// These options with blocking synchronisation on or off.
    #[must_use]
    pub fn with_blocking_sync(mut self, on: bool) -> EventOptions {
        self.blocking_sync = on;
        self
    }
}

/// A CUDA event: a marker recorded on a stream, to wait for, query, or time.
///
/// Events are created **without timing** by default ([`CudaEvent::new`]): the
/// driver documents that such events give the best performance with
/// `cuStreamWaitEvent` and `cuEventQuery`, and ordering streams is what most
/// events are for. Use [`CudaEvent::timed`] for events you measure with.
#[must_use = "dropping it destroys it"]
pub struct CudaEvent {
    raw: CUevent,
    ctx: Arc<CudaContext>,
    made: Generation,
    timing: bool,
    /// The stream of the last record, for [`CudaEvent::done`]'s wake-up.
    recorded_on: Mutex<Option<CudaStream>>,
}

// SAFETY: the handle is written once at creation; the driver lets any thread record,
// query or wait on an event once its context is bound, which every use does.
unsafe impl Send for CudaEvent {}
// SAFETY: as for Send; the only interior mutability is behind a Mutex.
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
        if options.interprocess {
            if options.timing {
                return Err(crate::error::invalid_arg(format!(
                    "device {}: an interprocess event cannot record timing (the driver refuses it)",
                    ctx.ordinal()
                )));
            }
            flags |= F::CU_EVENT_INTERPROCESS.0;
        }
        let mut raw: CUevent = std::ptr::null_mut();
        ctx.call(
            || format!("device {}: creating an event", ctx.ordinal()),
            // SAFETY: writes one CUevent; the context is current.
            |d| unsafe { cu!(d, cuEventCreate(&mut raw, flags as c_uint)) },
        )?;
        Ok(CudaEvent {
            raw,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            timing: options.timing,
            recorded_on: Mutex::new(None),
        })
    }

    /// Own an event the driver made for `ctx` just now (opened from another
    /// process's handle): destroyed with `cuEventDestroy` like any other.
    pub(crate) fn from_opened(raw: CUevent, ctx: &Arc<CudaContext>) -> CudaEvent {
        CudaEvent {
            raw,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            timing: false,
            recorded_on: Mutex::new(None),
        }
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
        self.call("record", |d| unsafe { cu!(d, cuEventRecord(e, s)) })?;
        let mut on = self
            .recorded_on
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !on.as_ref().is_some_and(|o| o.same_stream(stream)) {
            *on = Some(stream.clone());
        }
        Ok(())
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
            self.made,
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

/// Run `f` with this thread's capture mode relaxed (`cuThreadExchangeStreamCaptureMode`),
/// restoring it afterwards: for a wait on an event recorded outside any capture,
/// which the default modes refuse on a capturing thread.
fn relaxed<R>(d: &'static sys::Driver, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: exchanges this thread's mode through a valid pointer.
    let swapped = unsafe { cu!(d, cuThreadExchangeStreamCaptureMode(&mut mode)) }.is_ok();
    let r = f();
    if swapped {
        // SAFETY: puts the previous mode back.
        let _ = unsafe { cu!(d, cuThreadExchangeStreamCaptureMode(&mut mode)) };
    }
    r
}

/// Whether a status means the context will run nothing more (a sticky fault, the
/// context destroyed, the driver shutting down): queued work that borrowed host
/// memory will never touch it again.
pub(crate) fn work_abandoned(status: CUresult) -> bool {
    matches!(
        status.0,
        3 | 4 // NOT_INITIALIZED, DEINITIALIZED
            | 214 // ECC_UNCORRECTABLE
            | 400 // INVALID_HANDLE: the event went with a reset
            | 700..=702 // ILLEGAL_ADDRESS, LAUNCH_OUT_OF_RESOURCES, LAUNCH_TIMEOUT
            | 709 // CONTEXT_IS_DESTROYED
            | 710 // ASSERT
            | 714..=720 // HARDWARE_STACK_ERROR .. COOPERATIVE_LAUNCH_TOO_LARGE
    )
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

thread_local! {
    /// Captures this thread has begun through metrale and not ended (shared
    /// with the streams it began them on: the end, on any thread, counts
    /// down this one).
    static CAPTURE_DEPTH: Arc<AtomicI32> = Arc::new(AtomicI32::new(0));
}

/// A metrale capture begun on a stream: the driver's id (0: not known) and
/// the capture count of the thread that began it.
pub(crate) struct Begun {
    id: u64,
    depth: Arc<AtomicI32>,
    /// What the room that began it undoes once it is over (the process's
    /// capture count, the code held for captures, deferred frees): run by
    /// the stream's Drop for a capture still in progress when the stream goes.
    finished: fn(),
}

/// An end of a stream's capture in progress (see `CudaStream::start_ending`).
pub(crate) struct Ending<'a>(&'a AtomicBool);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.0.store(false, AtomicOrdering::SeqCst);
    }
}

/// This thread's capture count.
fn capture_depth_counter() -> Arc<AtomicI32> {
    CAPTURE_DEPTH.with(Arc::clone)
}

/// Whether this thread has a metrale capture open: calls the driver refuses on a
/// capturing thread (`cuMemFree`, synchronisations) must wait.
pub(crate) fn capturing_on_this_thread() -> bool {
    CAPTURE_DEPTH
        .try_with(|d| d.load(AtomicOrdering::SeqCst) > 0)
        .unwrap_or(false)
}
