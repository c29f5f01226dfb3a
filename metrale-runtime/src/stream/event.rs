//! [`CudaEvent`]: markers that order and time work across streams, and the
//! waits of one stream on an event or on another stream.

use std::ffi::c_uint;
use std::fmt;

use std::sync::{Arc, Mutex, PoisonError};

use metrale_cuda_sys::{self as sys, CUevent, CUresult};

use super::CudaStream;
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, CallError, Result};

impl CudaStream {
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
        if let Some(_unmarked) = crate::lifetime::unmarked_wait() {
            // No capture can begin (it waits for this count) until the wait is
            // queued, so the event cannot be one recorded in a capture.
            return wait();
        }
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
    pub(super) raw: CUevent,
    pub(super) ctx: Arc<CudaContext>,
    made: Generation,
    timing: bool,
    /// The stream of the last record, for [`CudaEvent::done`]'s wake-up.
    pub(super) recorded_on: Mutex<Option<CudaStream>>,
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
