//! GPU-side waits on mapped words a context counts until they pass, and the
//! unseen ones (whose host function could not be queued) it hands to the
//! lifetime room to watch.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use metrale_cuda_sys as sys;

use super::release::{Generation, ReleaseState};
use super::CudaContext;
use crate::error::{cu, CallError, Result};
use crate::lifetime::{work_abandoned, Watched};

impl CudaContext {
    /// GPU-side waits on mapped (host) words metrale queued on this context's
    /// streams ([`CudaStream::wait_value32`](crate::CudaStream::wait_value32)
    /// and the others, outside captures) that the stream has not yet passed: the
    /// host passes them, and may not. A wait is counted until the host function
    /// queued after it has run, or, when that host function could not be
    /// queued, until an event recorded after the wait (or its stream, idle)
    /// says it passed: whatever happened to the host function, a wait is
    /// counted down once its completion is known. While this is non-zero, a wait for the
    /// whole context (`cuCtxSynchronize`) could block for ever, so freeing
    /// virtual memory or closing an IPC buffer leaks it (one line on stderr), a
    /// `cuMemFree` is deferred until they have passed (retried at the next
    /// synchronize), and `sleep` / `unmap` return an error instead. Waits on device words are not counted: they are
    /// GPU work like a kernel's, and one that never passes blocks what waits for
    /// the context as an endless kernel does. A wait whose stream faulted (its
    /// host functions never run) stays counted for good.
    pub fn pending_waits(&self) -> usize {
        crate::lifetime::triage();
        self.pending_waits.load(Ordering::Acquire)
    }

    /// Note a counted wait whose host function could not be queued: `event`
    /// (recorded right after it, or null) or, without one, `stream`'s
    /// idleness says when it passed; then `finish` (the host function's work)
    /// runs, outside any host function. `finish` keeps the stream alive.
    pub(crate) fn note_unseen_wait(
        self: &Arc<Self>,
        event: sys::CUevent,
        stream: sys::CUstream,
        finish: Box<dyn FnOnce() + Send>,
    ) {
        crate::lifetime::watch(Box::new(UnseenWait {
            ctx: Arc::clone(self),
            event,
            stream,
            made: self.generation(),
            finish,
        }));
    }

    /// Enter a free that waits for the whole context (`cuMemFreeHost`): held
    /// from its pending-wait check through the driver's call. Either the check
    /// sees a wait counted meanwhile (and the free is deferred), or that
    /// wait's queueing sees this free in flight and waits for it
    /// ([`CudaContext::wait_out_context_wide_frees`]): a free never waits
    /// behind a GPU-side wait queued after its check.
    pub(crate) fn enter_context_wide_free(&self) -> ContextWideFree<'_> {
        self.context_wide_frees.fetch_add(1, Ordering::SeqCst);
        ContextWideFree(&self.context_wide_frees)
    }

    /// [`enter_context_wide_free`](Self::enter_context_wide_free) for a wait
    /// that outlives a borrow of the context (an unmap, a sleep, an IPC close:
    /// held from the pending-wait check through the driver's last call that
    /// waits for the context's work).
    pub(crate) fn enter_context_wide_wait(self: &Arc<Self>) -> ContextWideWait {
        self.context_wide_frees.fetch_add(1, Ordering::SeqCst);
        ContextWideWait(Arc::clone(self))
    }

    /// Before queueing a wait on a mapped word (already counted in
    /// `pending_waits`): wait until no context-wide free that may have missed
    /// the count is in flight (they wait only for work queued before them).
    pub(crate) fn wait_out_context_wide_frees(&self) {
        // A free in flight can last as long as the context's queued work
        // (`cuMemFree` waits for it): yield a few times, then sleep with a
        // growing pause rather than keep a core spinning.
        let mut rounds = 0u32;
        let mut pause = std::time::Duration::from_micros(20);
        while self.context_wide_frees.load(Ordering::SeqCst) != 0 {
            if rounds < 64 {
                rounds += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(1));
            }
        }
    }

    /// The shared counter behind [`CudaContext::pending_waits`], for the host
    /// function queued after a wait to count it passed.
    pub(crate) fn pending_waits_counter(&self) -> &Arc<AtomicUsize> {
        &self.pending_waits
    }

    /// Refuse `what`, a wait for the whole context, while GPU-side waits are
    /// pending (it could block for ever).
    pub(crate) fn refuse_with_pending_waits(&self, what: &dyn fmt::Display) -> Result<()> {
        match self.pending_waits() {
            0 => Ok(()),
            n => Err(crate::error::invalid_arg(format!(
                "{what}: device {} has {n} pending GPU-side wait(s) (wait_value32/64 or a \
                 batch wait) queued through metrale; cuCtxSynchronize could block for ever \
                 on a word nobody writes, so it is not called (write the word, then \
                 synchronize, and retry)",
                self.ordinal
            ))),
        }
    }
}

/// A context-wide free in flight (see `CudaContext::enter_context_wide_free`).
pub(crate) struct ContextWideFree<'a>(&'a AtomicUsize);

impl Drop for ContextWideFree<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A context-wide wait in flight, owning its context (see
/// `CudaContext::enter_context_wide_wait`).
pub(crate) struct ContextWideWait(Arc<CudaContext>);

impl Drop for ContextWideWait {
    fn drop(&mut self) {
        self.0.context_wide_frees.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A wait on mapped words whose host function was refused (watched by the
/// lifetime room until it passed): what tells that it passed, and what that
/// host function would have done.
struct UnseenWait {
    /// The context of the event and stream.
    ctx: Arc<CudaContext>,
    /// An event recorded right after the wait (destroyed here), or null when
    /// none could be: then the stream's idleness says.
    event: sys::CUevent,
    /// The stream the wait was queued on, held alive by `finish`.
    stream: sys::CUstream,
    /// The context generation the event was made in.
    made: Generation,
    /// The host function's work: counts the waits passed and hands on the
    /// words it held (run here, outside any host function).
    finish: Box<dyn FnOnce() + Send>,
}

// SAFETY: the event and stream are opaque handles the driver lets any thread
// query once their context is bound (the stream is kept alive by `finish`);
// the context and `finish` are Send.
unsafe impl Send for UnseenWait {}

impl Watched for UnseenWait {
    fn passed(&mut self) -> bool {
        let (ev, st) = (self.event, self.stream);
        // The generation first, without binding: after a reset the handles are
        // dangling (never given to the driver), and the reset ended the wait.
        match self.ctx.state(self.made) {
            Ok(ReleaseState::Reset | ReleaseState::Gone) => true,
            Err(_) => false,
            Ok(ReleaseState::Live) => {
                let status = self.ctx.with(|d| {
                    if ev.is_null() {
                        // Never `cuStreamQuery` a capturing stream (it
                        // invalidates the capture): the wait stays listed
                        // while the stream is captured.
                        let mut cs = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
                        // SAFETY: a live stream (kept alive by the entry's
                        // `finish`) of this, bound, context; writes the
                        // status only (the other outputs are null).
                        unsafe {
                            cu!(
                                d,
                                cuStreamGetCaptureInfo_v3(
                                    st,
                                    &mut cs,
                                    std::ptr::null_mut(),
                                    std::ptr::null_mut(),
                                    std::ptr::null_mut(),
                                    std::ptr::null_mut(),
                                    std::ptr::null_mut()
                                )
                            )
                        }?;
                        if cs != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                            return Ok(false);
                        }
                        // SAFETY: as above, and not being captured; only the
                        // status is read.
                        unsafe { cu!(d, cuStreamQuery(st)) }.map(|()| true)
                    } else {
                        // SAFETY: a live event made for this entry; only the
                        // status is read.
                        unsafe { cu!(d, cuEventQuery(ev)) }.map(|()| true)
                    }
                });
                match status {
                    Ok(done) => done,
                    Err(CallError::Status { status, .. }) => work_abandoned(status),
                    Err(_) => false,
                }
            }
        }
    }

    fn finish(self: Box<Self>) {
        // Outside the list's lock: destroying the event and the host function's
        // work (which drops a stream handle) call the driver.
        let w = *self;
        if !w.event.is_null() {
            let ev = w.event;
            w.ctx.release_with(
                w.made,
                format_args!(
                    "destroying the event after a wait on device {}",
                    w.ctx.ordinal()
                ),
                |d, failures| {
                    // SAFETY: the event made for this entry, destroyed once.
                    if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(ev)) } {
                        failures.push(e);
                    }
                },
            );
        }
        // Counts the waits down; what it held goes to the drop-later list.
        (w.finish)();
    }
}
