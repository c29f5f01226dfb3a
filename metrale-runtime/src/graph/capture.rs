//! Stream capture: work queued on a stream (and on streams that join it through
//! events) recorded into a [`CudaGraph`].

use metrale_cuda_sys::{self as sys, CUgraph};

use super::CudaGraph;
use crate::error::{cu, Result};
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
    /// until [`CudaStream::end_capture`].
    ///
    /// # Errors
    /// `cuStreamBeginCapture_v2`'s status (already capturing, the legacy stream).
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        let m = mode.raw();
        // SAFETY: a live stream of the bound context.
        self.call("begin capture", |d, s| unsafe {
            cu!(d, cuStreamBeginCapture_v2(s, m))
        })
    }

    /// The capture status of the stream: `(capturing, status word)`.
    fn capture_status(&self) -> Result<sys::CUstreamCaptureStatus> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: writes the status only; every other output is optional (null).
        self.call("capture status", |d, s| unsafe {
            cu!(
                d,
                cuStreamGetCaptureInfo_v3(
                    s,
                    &mut status,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut()
                )
            )
        })?;
        Ok(status)
    }

    /// Whether the stream is being captured.
    ///
    /// # Errors
    /// `cuStreamGetCaptureInfo_v3`'s status.
    pub fn is_capturing(&self) -> Result<bool> {
        Ok(self.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// End the capture begun on this stream and return the graph. The stream runs
    /// work normally again afterwards, also when the capture failed.
    ///
    /// # Errors
    /// A capture the driver invalidated (a synchronisation inside it, ...) names the
    /// capture status: `... (capture status: invalidated): cuStreamEndCapture
    /// failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901) ...`.
    pub fn end_capture(&self) -> Result<CudaGraph> {
        let status = self
            .capture_status()
            .unwrap_or(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED);
        let mut raw: CUgraph = std::ptr::null_mut();
        let ended = self.context().with(|d| {
            // SAFETY: writes one graph handle (null when the capture failed).
            unsafe { cu!(d, cuStreamEndCapture(self.raw(), &mut raw)) }
        });
        if let Err(e) = ended {
            if !raw.is_null() {
                drop(CudaGraph::adopt(raw, self.context()));
            }
            return Err(e.about(self.subject(&format!(
                "end capture (capture status: {})",
                capture_status_word(status)
            ))));
        }
        let graph = CudaGraph::adopt(raw, self.context());
        graph.keep_kernel_code()?;
        Ok(graph)
    }

    /// Capture the work `f` queues on this stream into a graph: begin, run `f`,
    /// end (also when `f` fails, so the stream is usable afterwards).
    ///
    /// # Errors
    /// `f`'s error, or as [`CudaStream::begin_capture`] / [`CudaStream::end_capture`].
    pub fn capture(
        &self,
        mode: CaptureMode,
        f: impl FnOnce(&CudaStream) -> Result<()>,
    ) -> Result<CudaGraph> {
        self.begin_capture(mode)?;
        let queued = f(self);
        let ended = self.end_capture();
        queued?;
        ended
    }
}
