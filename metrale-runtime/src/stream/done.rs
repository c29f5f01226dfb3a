//! Completion events: recording one after an operation that lends host
//! memory, waiting on it (and only on it), handing it back; waiting for what a
//! stream has queued so far.

use std::ffi::c_uint;
use std::sync::atomic::Ordering as AtomicOrdering;

use metrale_cuda_sys::{self as sys, CUevent, CUresult};

use super::pool::{DoneEvent, DONE_SLOTS};
use super::section::Section;
use super::waiter::relaxed;
use super::CudaStream;
use crate::error::{cu, CallError, MetraleError, Result};
use crate::lifetime::work_abandoned;

impl CudaStream {
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
                // Inside a host function every call is refused and nothing
                // was queued by this thread: polling would never end.
                Err(CallError::InHostFunction) => return,
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
        if waited.is_ok() || crate::lifetime::in_host_function() {
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

    /// Wait for everything queued on the stream so far, through a completion
    /// event (see `record_done`); refused while the stream is being captured.
    pub(crate) fn finish_queued(&self) -> Result<()> {
        let section = self.section();
        self.refuse_if_capturing(&section, "waiting for it")?;
        let done = self.record_done_in(&section)?;
        drop(section);
        self.wait_done(done)
    }
}
