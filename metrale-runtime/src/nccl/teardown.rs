//! Polling a non-blocking communicator to completion ([`settle`]), the poll's
//! back-off, abort of a raw handle, the bounded teardown Drop runs
//! ([`DropJob`]), and the helper thread that makes NCCL's blocking calls
//! (abort, finalize, destroy) bounded for their caller ([`on_helper`]).

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use metrale_cuda_sys::nccl::{ncclComm_t, ncclResult_t, Nccl};

use crate::context::CudaContext;
use crate::error::MetraleError;
use crate::stream::CudaStream;

use super::error::{self, CommInfo};

/// How long a caller waits, past its own deadline, for an abort (or a Drop's
/// teardown) that runs on a helper thread, before it returns and leaves that
/// thread to finish alone. NCCL's abort, finalize and destroy can wait for the
/// device's queued work (any stream of the device), so they are never run on
/// the caller's thread past a deadline.
pub(crate) const ABORT_GRACE: Duration = Duration::from_millis(200);

/// A raw communicator handed to a helper thread.
pub(super) struct Handle(pub(super) ncclComm_t);

// SAFETY: NCCL lets a communicator be used from any thread, one thread at a
// time. A `Handle` is made only when its communicator is handed over whole: the
// `Communicator` it came from is marked aborted (or is being dropped) first, so
// no other thread calls NCCL on it after the hand-over; a lock it shares with a
// parent or child travels with it (`serial`) and is taken for each call.
unsafe impl Send for Handle {}

/// The outcome of a job run on a helper thread (see [`on_helper`]).
pub(super) enum Helped<R> {
    /// It finished before the deadline, with this result.
    Done(R),
    /// Still running at the deadline: the thread goes on alone, owning what
    /// the job owns, and hands its result to `late` when it ends. (Also a
    /// job that panicked, which nothing in these jobs should: no result comes.)
    Running,
    /// No thread could be started; nothing was run.
    NotStarted(std::io::Error),
}

/// Run `job` on a new thread and wait for it until `deadline`. A job still
/// running then is left to finish alone: its result goes to `late` (on that
/// thread). The caller never waits past `deadline`, and each result goes to
/// exactly one of the two (they decide under one lock).
pub(super) fn on_helper<R: Send + 'static>(
    deadline: Instant,
    job: impl FnOnce() -> R + Send + 'static,
    late: impl FnOnce(R) + Send + 'static,
) -> Helped<R> {
    enum State<R> {
        Running,
        Done(R),
        /// The job panicked (nothing in it should): no result will come.
        Lost,
        /// The caller stopped waiting.
        Gone,
    }
    let shared = Arc::new((Mutex::new(State::Running), Condvar::new()));
    let theirs = Arc::clone(&shared);
    let spawned = std::thread::Builder::new()
        .name("metrale-nccl-teardown".to_owned())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            let (state, cv) = &*theirs;
            let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
            match r {
                Ok(r) if matches!(*state, State::Gone) => {
                    drop(state);
                    late(r);
                }
                Ok(r) => *state = State::Done(r),
                Err(_) => *state = State::Lost,
            }
            cv.notify_all();
        });
    if let Err(e) = spawned {
        return Helped::NotStarted(e);
    }
    let (state, cv) = &*shared;
    let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
    loop {
        if matches!(*state, State::Lost) {
            return Helped::Running;
        }
        if matches!(*state, State::Done(_)) {
            if let State::Done(r) = std::mem::replace(&mut *state, State::Gone) {
                return Helped::Done(r);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            *state = State::Gone;
            return Helped::Running;
        }
        state = cv
            .wait_timeout(state, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

/// Abort `comm` on a helper thread (its context made current there, `serial`
/// held for the call), waiting for it until `deadline`. Returns whether the
/// abort finished by then; one line on stderr when it did not, or when no
/// thread could be started (the communicator is then leaked, not aborted:
/// aborting on this thread could block past any bound).
pub(super) fn abort_bounded(
    lib: &'static Nccl,
    comm: ncclComm_t,
    ctx: &Arc<CudaContext>,
    serial: Option<&Arc<Mutex<()>>>,
    info: CommInfo,
    deadline: Instant,
) -> bool {
    let handle = Handle(comm);
    let ctx = Arc::clone(ctx);
    let serial = serial.cloned();
    let start = Instant::now();
    let job = move || {
        let handle = handle;
        if let Err(e) = ctx.bind() {
            return Some(format!(
                "abort skipped (leaked), the device could not be made current: {e}"
            ));
        }
        let _turn = turn(serial.as_deref());
        abort_raw(lib, handle.0);
        None
    };
    let late = move |skipped: Option<String>| {
        if let Some(text) = skipped {
            crate::error::report_line(format_args!("NCCL communicator ({info}): {text}"));
        }
    };
    match on_helper(deadline, job, late) {
        Helped::Done(skipped) => {
            if let Some(text) = skipped {
                crate::error::report_line(format_args!("NCCL communicator ({info}): {text}"));
            }
            true
        }
        Helped::Running => {
            crate::error::report_line(format_args!(
                "NCCL communicator ({info}): ncclCommAbort had not returned after {:?} (it \
                 waits for the device's queued work); it finishes on a helper thread",
                start.elapsed()
            ));
            false
        }
        Helped::NotStarted(e) => {
            crate::error::report_line(format_args!(
                "NCCL communicator ({info}): leaked, not aborted: no helper thread for \
                 ncclCommAbort could be started ({e}), and on this thread it could block \
                 without bound"
            ));
            false
        }
    }
}

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
    /// A stream it used could not be queried (not a transient failure, or
    /// still failing at the deadline): its error, naming the call and status.
    QueryFailed(MetraleError),
    TimedOut,
    Missing(&'static str),
}

/// Whether a failed `cuStreamQuery` may pass if asked again: out of memory,
/// or the stream (or another in relaxed mode) being captured right now. A
/// fault of the work (a sticky error) or anything else is not.
fn transient(e: &MetraleError) -> bool {
    e.status().is_some_and(|s| {
        s == metrale_cuda_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY || (900..=909).contains(&s.0)
    })
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
                    // Still busy at the deadline: finalize might block.
                    Ok(false) => return Teardown::TimedOut,
                    Err(e) if transient(&e) && Instant::now() < deadline => backoff(&mut spins),
                    // A stream that cannot be queried (a fault of the work, or
                    // a transient failure that lasted to the deadline):
                    // finalize might block; the error is reported.
                    Err(e) => return Teardown::QueryFailed(e),
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

/// How long Drop waits at most when the drop timeout cannot be added to the
/// clock (`Duration::MAX`): a very long but finite bound, so Drop never blocks
/// forever.
const LONGEST_DROP_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// The deadline `bound` plus `extra` from now; a sum the clock cannot
/// represent is [`LONGEST_DROP_WAIT`] from now (a very long, finite bound).
pub(super) fn bound_deadline_at(now: Instant, bound: Duration, extra: Duration) -> Instant {
    now.checked_add(bound)
        .and_then(|d| d.checked_add(extra))
        .or_else(|| now.checked_add(LONGEST_DROP_WAIT))
        .unwrap_or(now)
}

/// The deadline of an abort bounded by `bound`: `bound` plus [`ABORT_GRACE`].
pub(crate) fn bound_deadline(bound: Duration) -> Instant {
    bound_deadline_at(Instant::now(), bound, ABORT_GRACE)
}

/// What a dropped communicator's teardown needs, owned by the helper thread
/// that runs it.
pub(super) struct DropJob {
    pub(super) lib: &'static Nccl,
    pub(super) comm: Handle,
    pub(super) info: CommInfo,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) serial: Option<Arc<Mutex<()>>>,
    pub(super) streams: Vec<CudaStream>,
    pub(super) blocking: bool,
    pub(super) last_op: &'static str,
    pub(super) timeout: Duration,
    pub(super) start: Instant,
    pub(super) deadline: Instant,
}

impl DropJob {
    /// Finalize and destroy within the deadline, abort past it; the line to
    /// report, if any.
    pub(super) fn run(self) -> Option<String> {
        let DropJob {
            lib,
            comm,
            info,
            ctx,
            serial,
            streams,
            blocking,
            last_op,
            timeout,
            start,
            deadline,
        } = self;
        let comm = comm.0;
        if let Err(e) = ctx.bind() {
            return Some(format!(
                "NCCL communicator ({info}): leaked, the device could not be made current \
                 for its teardown: {e}"
            ));
        }
        let serial = serial.as_deref();
        let lock = || serial.map(|m| m.lock().unwrap_or_else(PoisonError::into_inner));
        let abort = || {
            let _turn = lock();
            abort_raw(lib, comm);
        };
        match teardown(lib, comm, blocking, &streams, deadline, serial) {
            Teardown::Destroyed => None,
            Teardown::DestroyFailed(status) => Some(format!(
                "NCCL communicator ({info}): ncclCommDestroy failed: {status}: {}",
                error::description(lib, status)
            )),
            Teardown::Failed(call, status) => {
                let text = error::description(lib, status);
                let last = {
                    let _turn = lock();
                    error::last_error(lib, comm)
                };
                abort();
                Some(format!(
                    "NCCL communicator ({info}): {call} failed: {status}: {text}{}{}; aborted",
                    if last.is_empty() {
                        ""
                    } else {
                        "; last error: "
                    },
                    last
                ))
            }
            Teardown::QueryFailed(e) => {
                abort();
                Some(format!(
                    "NCCL communicator ({info}): a stream it used could not be queried \
                     before ncclCommFinalize: {e}; aborted"
                ))
            }
            Teardown::TimedOut => {
                let waited = start.elapsed();
                abort();
                Some(format!(
                    "NCCL communicator ({info}): work ({last_op}) or finalize had not \
                     completed after {waited:?} (drop timeout {timeout:?}); aborted"
                ))
            }
            Teardown::Missing(name) => {
                abort();
                Some(format!(
                    "NCCL communicator ({info}): the library lacks {name}; aborted"
                ))
            }
        }
    }
}
