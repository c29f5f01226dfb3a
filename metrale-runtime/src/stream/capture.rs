//! Capture sections and a stream's capture bookkeeping: which operations no
//! capture may begin in, marking a stream that is (or may be) captured, the
//! captures begun here and their ends, and the driver's capture status.

use std::sync::atomic::{AtomicI32, Ordering as AtomicOrdering};
use std::sync::{Arc, MutexGuard, PoisonError};

use metrale_cuda_sys::{self as sys, CUresult};

use super::host_fn::release_captured_host_fns;
use super::section::{Begun, Ending, Section};
use super::CudaStream;
use crate::error::{cu, invalid_arg, CallError, Result};
use crate::lifetime::capture_depth_counter;

impl CudaStream {
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
                in_flight: &inner.in_flight,
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
            in_flight: &inner.in_flight,
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
    pub(super) fn capturing_driver(&self) -> Result<bool, CallError> {
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
    #[inline]
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
}

impl super::StreamInner {
    /// The last handle went while a metrale capture was in progress here
    /// (begun, never ended): end it in the driver (its graph destroyed
    /// unreplayed), then undo its bookkeeping as its end would have (the
    /// beginning thread's count, the host functions queued into it, the
    /// process's count), so nothing stays counted or held for good.
    #[cold]
    pub(super) fn end_abandoned_capture(&mut self, begun: Vec<Begun>) {
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
