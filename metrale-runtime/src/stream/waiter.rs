//! What wakes a future (`Shared`, the state a future shares with its waker,
//! used by `future.rs` too) and the waiting thread that wakes
//! [`StreamDone`](super::StreamDone) futures: one
//! per stream that was awaited, blocked in the driver on blocking-sync events
//! recorded on that stream, so a wake-up costs what the host's best
//! non-spinning wait costs plus one unpark (a driver callback adds a hop of
//! the driver's own).
//!
//! Invariants:
//! - A stream's waiter waits for its events in the order they were recorded; a
//!   stream's work finishes in order, so no wake-up waits behind another of a
//!   later point.
//! - Nothing spins: the thread sleeps in `cuEventSynchronize` (the events are
//!   `CU_EVENT_BLOCKING_SYNC`) or on its condition variable.
//! - At most [`WAITER_THREADS`] such threads live in the process: a future on a
//!   stream beyond them is woken by a driver callback instead (see `future.rs`),
//!   so any number of pending futures costs a few threads at most.
//! - The thread owns its events and holds the context; the stream's last handle
//!   going closes its queue, and the thread leaves once the queue is empty. No
//!   Drop waits for it. A job's state is an `Arc` the future shares, so a
//!   future dropped early frees nothing the thread still uses.

use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use metrale_cuda_sys::{self as sys, CUevent, CUresult};

use crate::context::{CudaContext, Generation};
use crate::error::{cu, report_line, CallError, MetraleError};

/// The most waiting threads in the process.
pub(crate) const WAITER_THREADS: usize = 8;

/// Waiting threads alive now.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// How many threads that wake stream futures are alive (at most 8; for tests).
pub fn live_waiters() -> usize {
    LIVE.load(Ordering::Acquire)
}

/// A stream's waiter: the queue its thread takes jobs from.
pub(crate) struct Waiter {
    state: Arc<State>,
    /// Taken by `close` to wait for a thread that has nothing left to do.
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct State {
    ctx: Arc<CudaContext>,
    /// The generation its events are made in (the stream's).
    made: Generation,
    queue: Mutex<Queue>,
    wake: Condvar,
}

#[derive(Default)]
struct Queue {
    /// Events recorded on the stream, each with the future it wakes, in the
    /// order of their records (recorded and queued under this lock).
    jobs: VecDeque<(CUevent, Arc<Shared>)>,
    /// Events the thread is done with, for the next futures.
    free: Vec<CUevent>,
    /// Whether the thread sleeps on `wake` (only then is it notified).
    sleeping: bool,
    /// The stream's last handle went: leave once `jobs` is empty.
    closed: bool,
}

// SAFETY: the raw events are handles the driver lets any thread use; they are
// touched under the queue's lock or by the one thread that took them from it.
unsafe impl Send for Queue {}

thread_local! {
    /// The waiter whose thread this is (null elsewhere).
    static SERVING: Cell<*const State> = const { Cell::new(std::ptr::null()) };
}

impl Waiter {
    /// A waiter for a stream of `ctx` made in `made`, with its thread started;
    /// `None` when [`WAITER_THREADS`] are alive already or the thread could not
    /// be started (the caller falls back to a driver callback).
    pub(crate) fn start(ctx: &Arc<CudaContext>, made: Generation) -> Option<Waiter> {
        let mut n = LIVE.load(Ordering::Relaxed);
        loop {
            if n >= WAITER_THREADS {
                return None;
            }
            match LIVE.compare_exchange_weak(n, n + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => n = now,
            }
        }
        let state = Arc::new(State {
            ctx: Arc::clone(ctx),
            made,
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
        });
        let run = Arc::clone(&state);
        let spawned = std::thread::Builder::new()
            .name(format!("metrale-waiter-{}", ctx.ordinal()))
            .spawn(move || run.serve());
        match spawned {
            Ok(handle) => Some(Waiter {
                state,
                thread: Mutex::new(Some(handle)),
            }),
            Err(_) => {
                LIVE.fetch_sub(1, Ordering::AcqRel);
                None
            }
        }
    }

    /// Whether the calling thread is this waiter's own (a waker running a task
    /// inline there must not queue on it: it would wait for itself).
    pub(crate) fn is_current(&self) -> bool {
        SERVING.with(|s| std::ptr::eq(s.get(), Arc::as_ptr(&self.state)))
    }

    /// Record an event on the stream (`record`, given the event) and queue the
    /// wake-up of `shared` after it, both under the queue's lock, so the thread
    /// waits for the events in the order they were recorded. `Ok(false)`, with
    /// nothing recorded, when the thread is gone (the caller uses a callback).
    pub(crate) fn queue(
        &self,
        shared: Arc<Shared>,
        record: impl FnOnce(CUevent) -> Result<(), MetraleError>,
    ) -> Result<bool, MetraleError> {
        let mut q = self.lock();
        if q.closed {
            return Ok(false);
        }
        let event = match q.free.pop() {
            Some(e) => e,
            None => self.new_event().map_err(|e| {
                e.about(format_args!(
                    "device {}: making a future's wake-up event",
                    self.state.ctx.ordinal()
                ))
            })?,
        };
        if let Err(e) = record(event) {
            q.free.push(event);
            return Err(e);
        }
        q.jobs.push_back((event, shared));
        let sleeping = q.sleeping;
        drop(q);
        if sleeping {
            self.state.wake.notify_one();
        }
        Ok(true)
    }

    /// A new blocking-sync event of the stream's context.
    fn new_event(&self) -> Result<CUevent, CallError> {
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC.0
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        let mut e: CUevent = std::ptr::null_mut();
        self.state.ctx.with(|d| {
            // SAFETY: writes one event handle; the context is current.
            unsafe { cu!(d, cuEventCreate(&mut e, flags)) }
        })?;
        Ok(e)
    }

    /// The stream's last handle went. A thread asleep with nothing queued
    /// leaves now: its events are destroyed here and it is waited for (it only
    /// wakes and returns), so nothing of the stream outlives its last handle.
    /// A thread with futures queued finishes them first (their events complete
    /// with the stream's work) and then cleans up by itself; nothing waits for
    /// it.
    pub(crate) fn close(&self) {
        let mut q = self.lock();
        q.closed = true;
        let idle = q.sleeping && q.jobs.is_empty();
        let events = if idle {
            std::mem::take(&mut q.free)
        } else {
            Vec::new()
        };
        let sleeping = q.sleeping;
        drop(q);
        if sleeping {
            self.state.wake.notify_one();
        }
        self.state.destroy(events);
        if idle && !self.is_current() {
            let handle = self
                .thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if let Some(h) = handle {
                let _ = h.join();
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.state
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// On the thread's way out, however it leaves: its events destroyed, its
/// place among the waiting threads given back.
struct Leave<'a>(&'a State);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let events = {
            let mut q = self.0.queue.lock().unwrap_or_else(PoisonError::into_inner);
            // Closed for good: were the thread to leave early (a panic of its
            // own), later futures go to a callback rather than a dead queue.
            q.closed = true;
            std::mem::take(&mut q.free)
        };
        self.0.destroy(events);
        LIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

impl State {
    /// The thread: wait for each event in turn and wake its future.
    fn serve(self: Arc<Self>) {
        SERVING.with(|s| s.set(Arc::as_ptr(&self)));
        let _leave = Leave(&self);
        // Bound once; `cuEventSynchronize` takes the event's context from the
        // event, but a driver that wants it current gets it.
        let _ = self.ctx.bind_fast();
        let d = self.ctx.driver();
        loop {
            let job = {
                let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                loop {
                    if let Some(job) = q.jobs.pop_front() {
                        break Some(job);
                    }
                    if q.closed {
                        break None;
                    }
                    q.sleeping = true;
                    q = self.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
                    q.sleeping = false;
                }
            };
            let Some((event, shared)) = job else {
                break;
            };
            let mut status = wait(d, event);
            if (900..=908).contains(&status.0) {
                // Refused because a global capture is in progress somewhere: an
                // event recorded outside any capture may be waited for in the
                // relaxed mode.
                status = relaxed(d, || wait(d, event));
            }
            // The waker is the executor's code: a panic there must not end
            // this thread (the stream's later futures wait on it), nor may
            // dropping the panic's payload.
            let woke = catch_unwind(AssertUnwindSafe(|| {
                shared.fire(status, "cuEventSynchronize");
                drop(shared);
            }));
            if let Err(payload) = woke {
                report_line(format_args!(
                    "a future's waker panicked on the waiting thread of device {}; the \
                     panic was caught and the thread goes on",
                    self.ctx.ordinal()
                ));
                let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
            }
            self.queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .free
                .push(event);
        }
    }

    /// Destroy `events` (this waiter's), under the release rule.
    fn destroy(&self, events: Vec<CUevent>) {
        if events.is_empty() {
            return;
        }
        self.ctx.release_with(
            self.made,
            format_args!(
                "destroying {} wake-up event(s) on device {}",
                events.len(),
                self.ctx.ordinal()
            ),
            |d, failures| {
                for &e in &events {
                    // SAFETY: an event this waiter made, destroyed once: taken
                    // off the free list, so nothing records or waits on it.
                    if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(e)) } {
                        failures.push(e);
                    }
                }
            },
        );
    }
}

/// `cuEventSynchronize` of `event`, as a status.
fn wait(d: &'static sys::Driver, event: CUevent) -> CUresult {
    // SAFETY: a live event the calling waiter owns until it goes back to the
    // free list; blocking-sync, so the thread sleeps.
    match unsafe { cu!(d, cuEventSynchronize(event)) } {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(CallError::Status { status, .. }) => status,
        // The table lacks the call (never for a driver that made the event)
        // or this thread is somehow a host function's.
        Err(_) => CUresult::CUDA_ERROR_UNKNOWN,
    }
}

/// Run `f` with this thread's capture mode relaxed (`cuThreadExchangeStreamCaptureMode`),
/// restoring it afterwards: for a wait on an event recorded outside any capture,
/// which the default modes refuse on a capturing thread or during a global capture.
pub(super) fn relaxed<R>(d: &'static sys::Driver, f: impl FnOnce() -> R) -> R {
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

/// What a future and what wakes it share.
pub(crate) struct Shared {
    fired: AtomicBool,
    /// The status the driver gave the waker (the callback's, or the event
    /// wait's).
    status: AtomicI32,
    /// The driver call that status came from, for the error text.
    call: OnceLock<&'static str>,
    waker: Mutex<Option<Waker>>,
}

impl Shared {
    pub(crate) fn new() -> Arc<Shared> {
        Arc::new(Shared {
            fired: AtomicBool::new(false),
            status: AtomicI32::new(0),
            call: OnceLock::new(),
            waker: Mutex::new(None),
        })
    }

    /// Record `status` (from `call`) and wake the future; once.
    pub(crate) fn fire(&self, status: CUresult, call: &'static str) {
        let _ = self.call.set(call);
        self.status.store(status.0 as i32, Ordering::Release);
        self.fired.store(true, Ordering::Release);
        let waker = self
            .waker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The call whose status was recorded.
    pub(crate) fn call(&self) -> &'static str {
        self.call.get().copied().unwrap_or("cuStreamAddCallback")
    }

    pub(crate) fn poll(&self, cx: &Context<'_>) -> Poll<CUresult> {
        if self.fired.load(Ordering::Acquire) {
            return Poll::Ready(CUresult(self.status.load(Ordering::Acquire) as _));
        }
        {
            let mut slot = self.waker.lock().unwrap_or_else(PoisonError::into_inner);
            match slot.as_mut() {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => *slot = Some(cx.waker().clone()),
            }
        }
        // The callback stores `fired` before it takes the waker: a callback that
        // ran meanwhile is seen here.
        if self.fired.load(Ordering::Acquire) {
            return Poll::Ready(CUresult(self.status.load(Ordering::Acquire) as _));
        }
        Poll::Pending
    }
}
