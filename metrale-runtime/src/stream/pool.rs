//! A stream's pool of completion events (one per operation in flight that
//! lends host memory), as plain data; `done.rs` records and waits on them.

use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering as AtomicOrdering};

use metrale_cuda_sys::{self as sys, CUevent};

/// Completion-event slots per stream: more operations in flight at once than
/// this (pending copies kept) each make and destroy an event of their own.
pub(super) const DONE_SLOTS: usize = 16;

/// A stream's completion events: each operation that lends host memory claims
/// a free slot (one compare-exchange on `taken`), records the slot's event
/// right after itself and waits on that event alone, then gives the slot back,
/// so it waits for its own work and what was queued before it, never for work
/// queued after it. A slot's event is made on its first claim and destroyed
/// with the stream; only the slot's claimant touches it meanwhile.
pub(super) struct DonePool {
    /// Bit `i` set: slot `i` is claimed.
    taken: AtomicU32,
    /// Slot `i`'s event (null until first made).
    pub(super) events: [AtomicPtr<sys::CUevent_st>; DONE_SLOTS],
}

impl DonePool {
    pub(super) fn new() -> DonePool {
        DonePool {
            taken: AtomicU32::new(0),
            events: std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())),
        }
    }

    /// Claim a free slot; `None` when all are claimed.
    #[inline]
    pub(super) fn claim(&self) -> Option<usize> {
        let mut now = self.taken.load(AtomicOrdering::Relaxed);
        loop {
            let free = (!now).trailing_zeros() as usize;
            if free >= DONE_SLOTS {
                return None;
            }
            match self.taken.compare_exchange_weak(
                now,
                now | (1 << free),
                AtomicOrdering::Acquire,
                AtomicOrdering::Relaxed,
            ) {
                Ok(_) => return Some(free),
                Err(seen) => now = seen,
            }
        }
    }

    /// Give slot `slot` back (its event may be recorded again by the next
    /// claimant).
    #[inline]
    pub(super) fn give_back(&self, slot: usize) {
        self.taken
            .fetch_and(!(1u32 << slot), AtomicOrdering::Release);
    }
}

/// The completion event of one operation on a stream (see `DonePool`): a slot
/// of the stream's pool, or an event of its own when every slot was claimed.
/// Handed back through `CudaStream::wait_done` or `CudaStream::give_back_done`
/// (forgotten, it keeps its slot claimed: a later operation then makes an
/// event of its own).
#[derive(Debug)]
pub(crate) struct DoneEvent {
    pub(super) raw: CUevent,
    /// The pool slot; `DONE_SLOTS`: an event of its own, destroyed when given
    /// back.
    pub(super) slot: usize,
}

impl DoneEvent {
    /// The raw event, to query or wait on.
    pub(crate) fn raw(&self) -> CUevent {
        self.raw
    }
}
