//! What a [`Communicator`](super::Communicator) keeps beyond its handle for
//! registrations and fault tolerance: whether it was revoked, the bytes it has
//! registered now and the bound on them, how many window registrations it
//! has made (the collective sequence every rank must keep in step), and which
//! of the streams it queued work on it may forget (a deregistration waits for
//! the others).

use std::cell::Cell;

use crate::stream::CudaStream;

/// A communicator's registration and revocation state (its thread's only:
/// communicators are not `Sync`).
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// Revoked (`ncclCommRevoke`): collectives and registrations are refused;
    /// shrink and Drop remain.
    pub(crate) revoked: Cell<bool>,
    /// Bytes registered through live guards (buffers and windows).
    pub(crate) registered: Cell<usize>,
    /// The most bytes that may be registered at once (`None`: no bound).
    pub(crate) limit: Cell<Option<usize>>,
    /// Live guards (buffers and windows).
    pub(crate) guards: Cell<usize>,
    /// Window registrations made so far (each rank counts the same calls).
    pub(crate) windows_made: Cell<u64>,
}

/// How many streams a communicator keeps before it lets go of those nobody
/// else holds whose work has finished.
pub(super) const KEPT_STREAMS: usize = 8;

/// Whether the communicator may forget `s`: it holds the last handle (so no
/// other thread can queue or capture there) and the stream's work has
/// finished (asked only when it is not being captured: a query would
/// invalidate the capture). Any error reads as "still busy".
pub(super) fn finished_and_unheld(s: &CudaStream) -> bool {
    use metrale_cuda_sys::CUstreamCaptureStatus as Status;
    s.is_last_handle()
        && matches!(
            s.capture_status_raw(),
            Ok(Status::CU_STREAM_CAPTURE_STATUS_NONE)
        )
        && matches!(s.query(), Ok(true))
}
