//! Polling a non-blocking communicator to completion ([`settle`]), the poll's
//! back-off, abort of a raw handle, and the bounded teardown Drop runs.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use metrale_cuda_sys::nccl::{ncclComm_t, ncclResult_t, Nccl};

use crate::stream::CudaStream;

/// The turn on `serial`, the lock a communicator shares with its parent or
/// children (nothing when it shares none).
fn turn(serial: Option<&Mutex<()>>) -> Option<MutexGuard<'_, ()>> {
    serial.map(|m| m.lock().unwrap_or_else(PoisonError::into_inner))
}

/// Settle a non-blocking call on `comm`: poll `ncclCommGetAsyncError` until it
/// is not `ncclInProgress`, or until `deadline` (`None`: no deadline). Each
/// poll holds `serial` when given.
pub(crate) enum Settled {
    Done,
    Failed(ncclResult_t),
    TimedOut,
}

pub(crate) fn settle(
    lib: &Nccl,
    comm: ncclComm_t,
    deadline: Option<Instant>,
    serial: Option<&Mutex<()>>,
) -> std::result::Result<Settled, metrale_cuda_sys::LibraryMissingSymbol> {
    let f = lib.ncclCommGetAsyncError()?;
    let mut spins = 0u32;
    loop {
        let mut state = ncclResult_t::ncclSuccess;
        let status = {
            let _turn = turn(serial);
            // SAFETY: a live communicator; writes one status.
            unsafe { f(comm, &mut state) }
        };
        if !status.is_success() {
            return Ok(Settled::Failed(status));
        }
        if state.is_success() {
            return Ok(Settled::Done);
        }
        if state != ncclResult_t::ncclInProgress {
            return Ok(Settled::Failed(state));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Settled::TimedOut);
        }
        backoff(&mut spins);
    }
}

/// Yield for the first polls, then sleep up to 1 ms.
pub(super) fn backoff(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    if *spins < 64 {
        std::thread::yield_now();
    } else {
        let us = u64::from((*spins - 63).min(20)) * 50;
        std::thread::sleep(Duration::from_micros(us));
    }
}

/// Abort a raw communicator, ignoring the result (the handle is gone after).
pub(super) fn abort_raw(lib: &Nccl, comm: ncclComm_t) {
    if let Ok(f) = lib.ncclCommAbort() {
        // SAFETY: a live communicator, never used after this call.
        let _ = unsafe { f(comm) };
    }
}

pub(super) enum Teardown {
    Destroyed,
    DestroyFailed(ncclResult_t),
    Failed(&'static str, ncclResult_t),
    TimedOut,
    Missing(&'static str),
}

/// Finalize within `deadline` (a blocking communicator first waits for the
/// streams it used, so its finalize cannot block on unfinished work), then
/// destroy; each NCCL call holds `serial` when given. The context is current.
pub(super) fn teardown(
    lib: &Nccl,
    comm: ncclComm_t,
    blocking: bool,
    streams: &[CudaStream],
    deadline: Instant,
    serial: Option<&Mutex<()>>,
) -> Teardown {
    if blocking {
        let mut spins = 0u32;
        for s in streams {
            loop {
                match s.query() {
                    Ok(true) => break,
                    Ok(false) if Instant::now() < deadline => backoff(&mut spins),
                    // A stream that cannot be queried (faulted, being captured)
                    // or still busy at the deadline: finalize might block.
                    _ => return Teardown::TimedOut,
                }
            }
        }
    }
    let Ok(finalize) = lib.ncclCommFinalize() else {
        return Teardown::Missing("ncclCommFinalize");
    };
    let status = {
        let _turn = turn(serial);
        // SAFETY: a live communicator, finalized once.
        unsafe { finalize(comm) }
    };
    if status == ncclResult_t::ncclInProgress {
        match settle(lib, comm, Some(deadline), serial) {
            Ok(Settled::Done) => {}
            Ok(Settled::Failed(s)) => return Teardown::Failed("ncclCommFinalize", s),
            Ok(Settled::TimedOut) => return Teardown::TimedOut,
            Err(m) => return Teardown::Missing(m.name),
        }
    } else if !status.is_success() {
        return Teardown::Failed("ncclCommFinalize", status);
    }
    let Ok(destroy) = lib.ncclCommDestroy() else {
        return Teardown::Missing("ncclCommDestroy");
    };
    let status = {
        let _turn = turn(serial);
        // SAFETY: a finalized communicator, destroyed once and never used after.
        unsafe { destroy(comm) }
    };
    if status.is_success() {
        Teardown::Destroyed
    } else {
        // The handle is gone either way: report, without a second free.
        Teardown::DestroyFailed(status)
    }
}
