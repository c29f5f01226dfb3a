//! Futures for GPU work: [`StreamDone`] ([`CudaStream::done`]) and [`EventDone`]
//! ([`CudaEvent::done`]), for any executor.
//!
//! Invariants:
//! - A [`StreamDone`] is woken by its stream's waiting thread (`waiter.rs`),
//!   blocked in the driver on an event recorded when the future was made; an
//!   [`EventDone`], and a `StreamDone` beyond the waiting threads' bound, by a
//!   stream callback the driver runs after the work it waits for
//!   (`cuStreamAddCallback`, which the driver also calls when that work failed).
//!   Never by a polling thread; each wakes at most once.
//! - The state the waker touches is an `Arc` it owns a share of, so dropping a
//!   future before it resolves frees nothing the driver or the thread still uses.
//! - Once woken, the future asks the driver for the stream's (or event's) status
//!   and resolves to its error when the work failed.

use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll};

use metrale_cuda_sys::{CUresult, CUstream};

use super::host_fn::run_guarded;
use super::waiter::Shared;
use super::{CudaEvent, CudaStream};
use crate::error::{cu, CallError, MetraleError, Result};

/// The driver's callback: record the status, wake the future once.
unsafe extern "C" fn wake(_stream: CUstream, status: CUresult, data: *mut c_void) {
    // SAFETY: `data` is the `Arc<Shared>` share `queue_wake` leaked for this one
    // callback (never queued into a capture), which the driver calls once.
    let shared = unsafe { Arc::from_raw(data.cast_const().cast::<Shared>()) };
    run_guarded(move || shared.fire(status, "cuStreamAddCallback"));
}

/// `wake` as a host function (drivers without `cuStreamAddCallback`).
unsafe extern "C" fn wake_host(data: *mut c_void) {
    // SAFETY: as for `wake`: the one share leaked for this call.
    unsafe { wake(std::ptr::null_mut(), CUresult::CUDA_SUCCESS, data) }
}

/// Queue the wake-up on `stream`, outside any capture: through the stream's
/// waiting thread when it has one (or can start one), else a driver callback.
fn queue_done(stream: &CudaStream) -> Result<Arc<Shared>> {
    let section = stream.section();
    stream.refuse_if_capturing(&section, "a future's wake-up (done)")?;
    // No thread is started for a call refused anyway (inside a host function),
    // and a waker running a task inline on the stream's own waiting thread
    // must not queue on it (it would wait for itself): a callback then.
    let waiter = if crate::lifetime::in_host_function() {
        None
    } else {
        stream.waiter().filter(|w| !w.is_current())
    };
    let Some(waiter) = waiter else {
        drop(section);
        return queue_wake(stream);
    };
    let shared = Shared::new();
    let queued = waiter.queue(Arc::clone(&shared), |event| {
        stream.call("recording a future's wake-up", |d, s| {
            // SAFETY: an event of the stream's context, owned by its waiter
            // (which waits on it only after this record).
            unsafe { cu!(d, cuEventRecord(event, s)) }
        })
    })?;
    drop(section);
    if !queued {
        return queue_wake(stream);
    }
    Ok(shared)
}

/// Queue the wake-up callback on `stream`, outside any capture.
fn queue_wake(stream: &CudaStream) -> Result<Arc<Shared>> {
    let shared = Shared::new();
    let section = stream.section();
    stream.refuse_if_capturing(&section, "a future's wake-up (done)")?;
    let data = Arc::into_raw(Arc::clone(&shared))
        .cast_mut()
        .cast::<c_void>();
    let queued = stream.call("queueing a future's wake-up", |d, s| {
        // SAFETY: `wake` takes back the share `data` is, once; flags must be 0.
        match unsafe { cu!(d, cuStreamAddCallback(s, Some(wake), data, 0)) } {
            // A driver without stream callbacks: a host function (not called
            // after an error of the context, so such a future may stay pending).
            // SAFETY: `wake_host` takes back the share, once.
            Err(CallError::Missing(_)) => unsafe {
                cu!(d, cuLaunchHostFunc(s, Some(wake_host), data))
            },
            other => other,
        }
    });
    drop(section);
    if let Err(e) = queued {
        // SAFETY: the driver refused the call, so it never received `data`.
        drop(unsafe { Arc::from_raw(data.cast_const().cast::<Shared>()) });
        return Err(e);
    }
    Ok(shared)
}

enum State {
    Waiting(Arc<Shared>),
    Failed(Option<MetraleError>),
    Done,
}

/// A future resolving once the work queued on a stream before
/// [`CudaStream::done`] has finished: `Ok(())`, or the error that work met.
///
/// Works with any executor (plain [`Waker`](std::task::Waker)s); woken by the stream's waiting
/// thread, asleep in the driver until the work is done (or, beyond the eight
/// such threads a process keeps, by a driver callback), with no polling. It
/// may stay pending for a few microseconds after a `synchronize` that saw the
/// work finish. Dropping it before it resolves is safe and leaves the queued
/// work alone. Polling it again after it resolved gives `Ok(())`.
///
/// A failed work wakes it too (the future then resolves to that error). A
/// callback is not run after the context was destroyed or reset, nor once the
/// process is tearing the driver down: such a future stays pending. Put a
/// timeout around it where that can happen.
#[must_use = "a future does nothing unless awaited or polled"]
pub struct StreamDone {
    state: State,
    stream: CudaStream,
}

impl std::fmt::Debug for StreamDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDone")
            .field("stream", &self.stream)
            .field("pending", &matches!(self.state, State::Waiting(_)))
            .finish()
    }
}

impl Future for StreamDone {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        let status = match &mut this.state {
            State::Done => return Poll::Ready(Ok(())),
            State::Failed(e) => {
                let e = e.take();
                this.state = State::Done;
                return Poll::Ready(e.map_or(Ok(()), Err));
            }
            State::Waiting(shared) => match shared.poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(status) => (status, shared.call()),
            },
        };
        this.state = State::Done;
        let (status, call) = status;
        if !status.is_success() {
            return Poll::Ready(Err(CallError::Status { call, status }
                .about(this.stream.subject("done (the work it waited for failed)"))));
        }
        if crate::lifetime::in_host_function() {
            // Polled from a waker that runs the task inline, on the driver's
            // thread: no CUDA call there; the callback's status is the answer.
            return Poll::Ready(Ok(()));
        }
        // Work queued after `done` may still run (NOT_READY): what this future
        // waited for has finished; a failure shows as an error status.
        Poll::Ready(this.stream.query().map(|_| ()))
    }
}

/// A future resolving once a recorded event has completed: see
/// [`CudaEvent::done`]. `EventDone<'static>` (from [`CudaEvent::into_done`] or
/// [`CudaEvent::done_owned`]) owns its event and is `Send`, so it can go into
/// `tokio::spawn`.
#[must_use = "a future does nothing unless awaited or polled"]
pub struct EventDone<'a> {
    state: State,
    event: EventHold<'a>,
}

/// How an [`EventDone`] holds its event.
enum EventHold<'a> {
    Borrowed(&'a CudaEvent),
    Owned(CudaEvent),
    Shared(Arc<CudaEvent>),
}

impl std::ops::Deref for EventHold<'_> {
    type Target = CudaEvent;
    fn deref(&self) -> &CudaEvent {
        match self {
            EventHold::Borrowed(e) => e,
            EventHold::Owned(e) => e,
            EventHold::Shared(e) => e,
        }
    }
}

impl std::fmt::Debug for EventDone<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventDone")
            .field("event", &*self.event)
            .field("pending", &matches!(self.state, State::Waiting(_)))
            .finish()
    }
}

impl Future for EventDone<'_> {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = &mut *self;
        let status = match &mut this.state {
            State::Done => return Poll::Ready(Ok(())),
            State::Failed(e) => {
                let e = e.take();
                this.state = State::Done;
                return Poll::Ready(e.map_or(Ok(()), Err));
            }
            State::Waiting(shared) => match shared.poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(status) => status,
            },
        };
        this.state = State::Done;
        if !status.is_success() {
            return Poll::Ready(Err(CallError::Status {
                call: "cuStreamAddCallback",
                status,
            }
            .about(format_args!(
                "device {} event {:p} done (the work it waited for failed)",
                this.event.ctx.ordinal(),
                this.event.raw
            ))));
        }
        if crate::lifetime::in_host_function() {
            // As for `StreamDone`: no CUDA call on the driver's thread.
            return Poll::Ready(Ok(()));
        }
        Poll::Ready(this.event.query().map(|_| ()))
    }
}

impl CudaStream {
    /// A future that resolves once all work queued on the stream so far has
    /// finished, to `Ok(())` or to the error that work met (the stream's status,
    /// asked once woken). Errors in queueing it (a stream being captured, a
    /// driver refusal) come out of the future.
    ///
    /// ```no_run
    /// # async fn f(s: &metrale_runtime::CudaStream) -> metrale_runtime::Result<()> {
    /// // ... queue kernels and copies on s ...
    /// s.done().await?; // the executor thread is free meanwhile
    /// # Ok(()) }
    /// ```
    pub fn done(&self) -> StreamDone {
        let state = match queue_done(self) {
            Ok(shared) => State::Waiting(shared),
            Err(e) => State::Failed(Some(e)),
        };
        StreamDone {
            state,
            stream: self.clone(),
        }
    }
}

impl CudaEvent {
    /// A future that resolves once the event's last record has completed (at
    /// once for an event never recorded), to `Ok(())` or to the error the work
    /// before it met (the event's status, asked once woken).
    ///
    /// The wake-up is queued on the stream the event was last recorded on, so
    /// the future resolves after the work queued on that stream when `done` is
    /// called: call it right after [`CudaEvent::record`] to wake as the event
    /// completes.
    ///
    /// The future borrows the event; [`CudaEvent::into_done`] and
    /// [`CudaEvent::done_owned`] give one that owns it (`'static`, `Send`).
    pub fn done(&self) -> EventDone<'_> {
        EventDone {
            state: self.wake_state(),
            event: EventHold::Borrowed(self),
        }
    }

    /// As [`CudaEvent::done`], owning the event: an `EventDone<'static>` that is
    /// `Send`, for `tokio::spawn` and other executors that need `'static`
    /// tasks. The event is destroyed with the future.
    ///
    /// ```no_run
    /// # use metrale_runtime::{CudaEvent, CudaStream};
    /// # async fn f(s: &CudaStream) -> metrale_runtime::Result<()> {
    /// let ev = CudaEvent::new(s.context())?;
    /// // ... queue work on s ...
    /// ev.record(s)?;
    /// let waiter = tokio::spawn(ev.into_done());
    /// # drop(waiter); Ok(()) }
    /// ```
    pub fn into_done(self) -> EventDone<'static> {
        EventDone {
            state: self.wake_state(),
            event: EventHold::Owned(self),
        }
    }

    /// As [`CudaEvent::done`], holding a share of an event kept elsewhere too
    /// (recorded again later, say): an `EventDone<'static>` that is `Send`.
    pub fn done_owned(self: &Arc<Self>) -> EventDone<'static> {
        EventDone {
            state: self.wake_state(),
            event: EventHold::Shared(Arc::clone(self)),
        }
    }

    /// Queue the wake-up on the stream of the last record.
    fn wake_state(&self) -> State {
        let stream = self
            .recorded_on
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match stream {
            None => State::Failed(None),
            Some(s) => match queue_wake(&s) {
                Ok(shared) => State::Waiting(shared),
                Err(e) => State::Failed(Some(e)),
            },
        }
    }
}
