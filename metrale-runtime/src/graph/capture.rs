//! Stream capture: work queued on a stream (and on streams that join it through
//! events) recorded into a [`CudaGraph`].

use metrale_cuda_sys::{self as sys, CUgraph};

use super::CudaGraph;
use crate::error::{cu, MetraleError, Result};
use crate::function::{capture_finished, capture_started};
use crate::stream::CudaStream;

/// How a capture treats calls that are unsafe while a stream is captured
/// (`cuStreamBeginCapture_v2`'s mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CaptureMode {
    /// Unsafe calls fail on every thread while any global capture is under way.
    Global,
    /// Unsafe calls fail on the capturing thread only (the default; see the module
    /// docs for why).
    #[default]
    ThreadLocal,
    /// No call is refused; the caller keeps capture sound.
    Relaxed,
}

impl CaptureMode {
    fn raw(self) -> sys::CUstreamCaptureMode {
        use sys::CUstreamCaptureMode as M;
        match self {
            CaptureMode::Global => M::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => M::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => M::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

/// A capture whose stream went before its end (see `CudaStream::set_capturing`):
/// the process's count goes down, and the frees it held back are retried.
fn abandoned_capture_over() {
    capture_finished();
    crate::lifetime::retry_deferred();
}

fn capture_status_word(s: sys::CUstreamCaptureStatus) -> &'static str {
    use sys::CUstreamCaptureStatus as S;
    match s {
        S::CU_STREAM_CAPTURE_STATUS_NONE => "not capturing",
        S::CU_STREAM_CAPTURE_STATUS_ACTIVE => "active",
        S::CU_STREAM_CAPTURE_STATUS_INVALIDATED => "invalidated",
        _ => "unknown",
    }
}

impl CudaStream {
    /// Start capturing: work queued on this stream (and on streams that join it by
    /// waiting on an event recorded here) is recorded into a graph instead of run,
    /// until [`CudaStream::end_capture`]. Prefer [`CudaStream::capture`], which
    /// ends the capture on every path.
    ///
    /// Operations of this crate that cannot be captured (copies that borrow host
    /// memory, waits, stream-ordered frees) are refused or deferred on a stream
    /// being captured, by any thread, and kernels queued into the capture keep
    /// their code loaded until the graph holds it.
    ///
    /// # Errors
    /// `cuStreamBeginCapture_v2`'s status (already capturing, the legacy stream).
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        let m = mode.raw();
        let locked = self.mark_capture();
        capture_started();
        // SAFETY: a live stream of the bound context.
        let begun = self.call("begin capture", |d, s| unsafe {
            cu!(d, cuStreamBeginCapture_v2(s, m))
        });
        match &begun {
            Ok(()) => {
                // Its id, for its end to release exactly what it took (0 when
                // the query fails: the end asks again).
                let id = self.capture_id_raw().ok().flatten().unwrap_or(0);
                self.set_capturing(id, abandoned_capture_over);
            }
            Err(_) => {
                // Undo this attempt's bookkeeping only.
                self.unmark_capture();
                capture_finished();
            }
        }
        drop(locked);
        begun
    }

    /// The capture status of the stream.
    fn capture_status(&self) -> Result<sys::CUstreamCaptureStatus> {
        self.capture_status_raw()
            .map_err(|e| e.about(self.subject("capture status")))
    }

    /// Whether the stream is being captured.
    ///
    /// # Errors
    /// `cuStreamGetCaptureInfo_v3`'s status.
    pub fn is_capturing(&self) -> Result<bool> {
        Ok(self.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The bookkeeping of a metrale capture that is over (the one with the
    /// driver's id `id` when known): done once per capture (an `end_capture`
    /// of a stream metrale is not capturing changes nothing). The caller runs
    /// `lifetime::retry_deferred` afterwards, outside any lock.
    /// Returns whether there was one, and the id noted when it began (0: not
    /// known).
    fn capture_over(&self, id: Option<u64>) -> Option<u64> {
        let (noted, depth) = self.take_capturing(id)?;
        self.unmark_capture();
        // The count of the thread that began it, whichever thread ends it.
        depth.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        capture_finished();
        Some(noted)
    }

    /// End the capture begun on this stream and return the graph. The stream runs
    /// work normally again afterwards, also when the capture failed. A failure
    /// that leaves the capture in progress (the context could not be bound, a
    /// transient refusal) leaves the stream capturing, as the driver has it:
    /// call `end_capture` again ([`CudaStream::capture`] retries by itself).
    /// Ends of one stream are exclusive: one made while another runs fails.
    ///
    /// # Errors
    /// A capture the driver invalidated (a synchronisation inside it, ...) names the
    /// capture status: `... (capture status: invalidated): cuStreamEndCapture
    /// failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901) ...`.
    pub fn end_capture(&self) -> Result<CudaGraph> {
        let Some(ending) = self.start_ending() else {
            return Err(crate::error::invalid_arg(format!(
                "{}: another thread is ending this stream's capture",
                self.subject("end capture")
            )));
        };
        // No capture begins, and no other end runs, from this query to the
        // bookkeeping (on the success path).
        let locked = self.lock_capture();
        let (status, id) = match self.capture_info_raw() {
            Ok((status, id)) => (
                status,
                // Active or invalidated: a capture of this stream, which the
                // end below ends.
                (status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE).then_some(id),
            ),
            Err(_) => (
                sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED,
                None,
            ),
        };
        let mut raw: CUgraph = std::ptr::null_mut();
        let ended = self.context().with(|d| {
            // SAFETY: writes one graph handle (null when the capture failed).
            unsafe { cu!(d, cuStreamEndCapture(self.raw(), &mut raw)) }
        });
        if let Err(e) = ended {
            // A capture may begin from here on (none of ours is in progress
            // in the driver, or it stays as it was).
            drop(locked);
            if !raw.is_null() {
                drop(CudaGraph::adopt(raw, self.context()));
            }
            // A capture the driver ended (invalidated, ...) is over: what it
            // took goes. One it kept (ended from the wrong thread, a failed
            // bind) still counts. A capture of another id (begun meanwhile)
            // means ours is over.
            // An invalidated capture's end ends it (the driver's documented
            // behaviour), whatever a query after it sees: a capture begun
            // meanwhile may even carry the same id.
            let invalidated =
                e.status() == Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            let after = self.capture_id_raw();
            let over = invalidated
                || match after {
                    Ok(None) => true,
                    Ok(Some(now)) => id.is_some_and(|id| id != now),
                    Err(_) => false,
                };
            if over {
                if let Some(id) = id {
                    crate::stream::release_captured_host_fns(id);
                    crate::lifetime::take_held_in_capture(id);
                }
                if self.capture_over(id).is_some() {
                    crate::lifetime::retry_deferred();
                }
            }
            drop(ending);
            return Err(e.about(self.subject(&format!(
                "end capture (capture status: {})",
                capture_status_word(status)
            ))));
        }
        let mut graph = CudaGraph::adopt(raw, self.context());
        // The kernels' code and the host functions are still held for the
        // capture: take them into the graph before letting go of this capture's.
        let kept = graph.keep_kernel_code();
        let over = self.capture_over(id);
        // The id is this call's own query's (the capture just ended) or, when
        // that query failed, the one noted when metrale began it (this end
        // succeeded, under the lock: that capture is the one it ended). The
        // entries the graph holds go whatever their tag.
        let id = id.or(over.filter(|&noted| noted != 0));
        // What the capture retained into the graph through user objects (a
        // GEMM's workspace) is the graph's hold too: its replays are then
        // refused inside a capture.
        graph.held_in_capture = id.is_some_and(crate::lifetime::take_held_in_capture);
        crate::stream::release_captured_host_fns_of(id, &graph.held_addresses());
        drop(locked);
        drop(ending);
        if id.is_none() && over.is_some() {
            crate::error::report_line(format_args!(
                "{}: the capture's id could not be asked at its begin nor at its end: \
                 repeatable host functions queued into it that its graph does not run \
                 stay held for the life of the process",
                self.subject("end capture")
            ));
        }
        if over.is_some() {
            crate::lifetime::retry_deferred();
        }
        kept?;
        Ok(graph)
    }

    /// End this stream's metrale capture, retrying while the driver leaves it in
    /// progress (a failed bind or end that did not end it), a few times.
    fn end_capture_retrying(&self) -> Result<CudaGraph> {
        let mut tries = 0;
        loop {
            match self.end_capture() {
                Ok(graph) => return Ok(graph),
                Err(_) if tries < 3 && self.metrale_capturing() => tries += 1,
                Err(e) => {
                    if !self.metrale_capturing() {
                        return Err(e);
                    }
                    // The capture is still in progress: say so in the error.
                    return Err(match e.into_kind() {
                        crate::ErrorKind::Driver {
                            call,
                            status,
                            subject,
                        } => crate::ErrorKind::Driver {
                            call,
                            status,
                            subject: format!(
                                "{subject}; the driver did not end the capture after 4 \
                                 tries: the stream is still capturing (and counted on the \
                                 thread that began it), call end_capture() to end it"
                            ),
                        }
                        .into(),
                        other => other.into(),
                    });
                }
            }
        }
    }

    /// Capture the work `f` queues on this stream into a graph, in the default
    /// mode ([`CaptureMode::ThreadLocal`]): begin, run `f`, end. The capture ends
    /// on every path (an error or a panic in `f` too), so the stream is usable
    /// afterwards.
    ///
    /// `f` returns metrale's [`Result`], so the closure needs no annotation;
    /// for another error type (`anyhow::Error`, your own) use
    /// [`CudaStream::try_capture`].
    ///
    /// ```no_run
    /// # use metrale_runtime::{CudaGraph, CudaStream, DeviceBuffer, Result};
    /// fn record(s: &CudaStream, buf: &mut DeviceBuffer<f32>) -> Result<CudaGraph> {
    ///     s.capture(|s| {
    ///         s.zero(buf)?; // `?` on metrale's Result: no annotation needed
    ///         Ok(())
    ///     })
    /// }
    /// ```
    ///
    /// # Errors
    /// `f`'s error, or as [`CudaStream::begin_capture`] / [`CudaStream::end_capture`].
    pub fn capture(&self, f: impl FnOnce(&CudaStream) -> Result<()>) -> Result<CudaGraph> {
        self.capture_with(CaptureMode::default(), f)
    }

    /// As [`CudaStream::capture`], in `mode`.
    ///
    /// # Errors
    /// As [`CudaStream::capture`].
    pub fn capture_with(
        &self,
        mode: CaptureMode,
        f: impl FnOnce(&CudaStream) -> Result<()>,
    ) -> Result<CudaGraph> {
        match self.capture_parts(mode, f)? {
            // The closure failed and the end is stuck: the error says both.
            (Err(queued), Err(ended)) if self.metrale_capturing() => {
                Err(with_stuck_end(queued, &ended))
            }
            (Err(queued), _) => Err(queued),
            (Ok(()), ended) => ended,
        }
    }

    /// As [`CudaStream::capture`], with `f` returning any error type that a
    /// [`MetraleError`] converts into (`anyhow::Error`, your own); name it in the
    /// closure (`|s| -> anyhow::Result<()> { .. }`) or with a turbofish
    /// (`try_capture::<MyError>`).
    ///
    /// ```no_run
    /// # use metrale_runtime::{CudaStream, CudaGraph, MetraleError};
    /// #[derive(Debug)]
    /// enum AppError { Gpu(MetraleError), Config(&'static str) }
    /// impl From<MetraleError> for AppError {
    ///     fn from(e: MetraleError) -> Self { AppError::Gpu(e) }
    /// }
    /// fn record(s: &CudaStream, steps: usize) -> Result<CudaGraph, AppError> {
    ///     s.try_capture(|_s| -> Result<(), AppError> {
    ///         if steps == 0 {
    ///             return Err(AppError::Config("no steps"));
    ///         }
    ///         Ok(())
    ///     })
    /// }
    /// ```
    ///
    /// # Errors
    /// As [`CudaStream::capture`].
    pub fn try_capture<E: From<MetraleError>>(
        &self,
        f: impl FnOnce(&CudaStream) -> std::result::Result<(), E>,
    ) -> std::result::Result<CudaGraph, E> {
        self.try_capture_with(CaptureMode::default(), f)
    }

    /// As [`CudaStream::try_capture`], in `mode`.
    ///
    /// # Errors
    /// As [`CudaStream::capture`].
    pub fn try_capture_with<E: From<MetraleError>>(
        &self,
        mode: CaptureMode,
        f: impl FnOnce(&CudaStream) -> std::result::Result<(), E>,
    ) -> std::result::Result<CudaGraph, E> {
        match self.capture_parts(mode, f)? {
            (Err(queued), ended) => {
                // `E` cannot carry it: the stuck end is said on stderr.
                if let Err(e) = ended {
                    if self.metrale_capturing() {
                        crate::error::report_line(format_args!(
                            "the capture's closure failed, and so did its end: {e}"
                        ));
                    }
                }
                Err(queued)
            }
            (Ok(()), ended) => Ok(ended?),
        }
    }

    /// Begin, run `f`, end (also when `f` unwinds): `f`'s result and the end's.
    #[allow(clippy::type_complexity)]
    fn capture_parts<E: From<MetraleError>>(
        &self,
        mode: CaptureMode,
        f: impl FnOnce(&CudaStream) -> std::result::Result<(), E>,
    ) -> std::result::Result<(std::result::Result<(), E>, Result<CudaGraph>), E> {
        /// Ends the capture when `f` unwinds.
        struct EndOnUnwind<'a>(&'a CudaStream);
        impl Drop for EndOnUnwind<'_> {
            fn drop(&mut self) {
                if let Err(e) = self.0.end_capture_retrying() {
                    crate::error::report_line(format_args!("ending a capture after a panic: {e}"));
                }
            }
        }
        self.begin_capture(mode)?;
        let guard = EndOnUnwind(self);
        let queued = f(self);
        std::mem::forget(guard);
        let ended = self.end_capture_retrying();
        Ok((queued, ended))
    }
}

/// `queued` (the closure's error) with the stuck end's error `ended` added to
/// its text (or, for a kind with no text to add to, said on stderr).
fn with_stuck_end(queued: MetraleError, ended: &MetraleError) -> MetraleError {
    use crate::ErrorKind;
    match queued.into_kind() {
        ErrorKind::InvalidArgument(text) => {
            ErrorKind::InvalidArgument(format!("{text}; and ending the capture failed: {ended}"))
                .into()
        }
        ErrorKind::Driver {
            call,
            status,
            subject,
        } => ErrorKind::Driver {
            call,
            status,
            subject: format!("{subject} (and ending the capture failed: {ended})"),
        }
        .into(),
        other => {
            crate::error::report_line(format_args!(
                "the capture's closure failed, and so did its end: {ended}"
            ));
            other.into()
        }
    }
}
