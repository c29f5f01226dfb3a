//! The plain pieces of a stream's capture bookkeeping: a [`Section`] (work that
//! no capture may begin in), a capture [`Begun`] here, an [`Ending`] in progress.
//! The methods that make them are in `capture.rs`.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering as AtomicOrdering};
use std::sync::{Arc, MutexGuard};

/// A section of work on a stream during which no metrale capture begins on it and
/// no metrale wait joins it to one (see [`CudaStream::section`]).
pub(crate) struct Section<'a> {
    /// The stream's count of fast sections (see `StreamInner::in_flight`).
    pub(super) in_flight: &'a AtomicU32,
    /// Whether the stream may be capturing: the driver must be asked.
    pub(crate) may_capture: bool,
    /// Held on the slow path (the stream was marked).
    pub(super) _locked: Option<MutexGuard<'a, ()>>,
}

impl Drop for Section<'_> {
    #[inline]
    fn drop(&mut self) {
        if !self.may_capture {
            self.in_flight.fetch_sub(1, AtomicOrdering::SeqCst);
        }
    }
}

/// A metrale capture begun on a stream: the driver's id (0: not known) and
/// the capture count of the thread that began it.
pub(crate) struct Begun {
    pub(super) id: u64,
    pub(super) depth: Arc<AtomicI32>,
    /// What the room that began it undoes once it is over (the process's
    /// capture count, the code held for captures, deferred frees): run by
    /// the stream's Drop for a capture still in progress when the stream goes.
    pub(super) finished: fn(),
}

/// An end of a stream's capture in progress (see `CudaStream::start_ending`).
pub(crate) struct Ending<'a>(pub(super) &'a AtomicBool);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.0.store(false, AtomicOrdering::SeqCst);
    }
}
