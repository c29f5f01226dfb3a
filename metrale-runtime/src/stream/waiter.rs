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

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll, Waker};

use metrale_cuda_sys::{self as sys, CUevent, CUresult};

use crate::context::{CudaContext, Generation};
use crate::error::{cu, report_line, CallError};

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
    /// Events recorded on the stream, each with the future it wakes, in order.
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
            Ok(_) => Some(Waiter { state }),
            Err(_) => {
                LIVE.fetch_sub(1, Ordering::AcqRel);
                None
            }
        }
    }

    /// An event to record for the next future: one the thread is done with, or
    /// a new blocking-sync event.
    pub(crate) fn event(&self) -> Result<CUevent, CallError> {
        if let Some(e) = self.lock().free.pop() {
            return Ok(e);
        }
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC.0
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        let mut e: CUevent = std::ptr::null_mut();
        self.state.ctx.with(|d| {
            // SAFETY: writes one event handle; the context is current.
            unsafe { cu!(d, cuEventCreate(&mut e, flags)) }
        })?;
        Ok(e)
    }

    /// Give back an event that was not recorded (its record failed).
    pub(crate) fn unused(&self, event: CUevent) {
        self.lock().free.push(event);
    }

    /// Wake `shared` once `event`, just recorded on the stream, has completed.
    pub(crate) fn push(&self, event: CUevent, shared: Arc<Shared>) {
        let mut q = self.lock();
        q.jobs.push_back((event, shared));
        let sleeping = q.sleeping;
        drop(q);
        if sleeping {
            self.state.wake.notify_one();
        }
    }

    /// The stream's last handle went: the thread leaves once its jobs are done.
    pub(crate) fn close(&self) {
        let mut q = self.lock();
        q.closed = true;
        let sleeping = q.sleeping;
        drop(q);
        if sleeping {
            self.state.wake.notify_one();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.state
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// The thread: wait for each event in turn and wake its future.
    fn serve(self: Arc<Self>) {
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
            // SAFETY: a live event this thread owns until it goes back to the
            // free list below; blocking-sync, so the thread sleeps.
            let status = match unsafe { cu!(d, cuEventSynchronize(event)) } {
                Ok(()) => CUresult::CUDA_SUCCESS,
                Err(CallError::Status { status, .. }) => status,
                // The table lacks the call (never for a driver that made the
                // event) or this thread is somehow a host function's.
                Err(_) => CUresult::CUDA_ERROR_UNKNOWN,
            };
            // The waker is the executor's code: a panic there must not end
            // this thread (the stream's later futures wait on it).
            let woke = catch_unwind(AssertUnwindSafe(|| {
                shared.fire(status, "cuEventSynchronize");
                drop(shared);
            }));
            if woke.is_err() {
                report_line(format_args!(
                    "a future's waker panicked on the waiting thread of device {}; the \
                     panic was caught and the thread goes on",
                    self.ctx.ordinal()
                ));
            }
            self.queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .free
                .push(event);
        }
        self.destroy_events();
        LIVE.fetch_sub(1, Ordering::AcqRel);
    }

    /// Destroy the events, under the release rule.
    fn destroy_events(&self) {
        let events = std::mem::take(
            &mut self
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .free,
        );
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
                    // SAFETY: an event this waiter made, destroyed once (the
                    // queue is closed and empty: nothing records it any more).
                    if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(e)) } {
                        failures.push(e);
                    }
                }
            },
        );
    }
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
