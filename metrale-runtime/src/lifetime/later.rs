//! The lists of what waits: values a host function could not drop, waits whose
//! passing nobody saw yet, and releases deferred until a capture, an NCCL group
//! or a pending wait is over; and [`drain`], the one place they are worked off.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use super::gate::in_host_function;

/// A release that had to wait (a capture or an NCCL group was in the way, or a
/// pending wait): retried by [`retry_deferred`] until it is done.
pub(crate) trait Deferred: Send {
    /// Release now, or hand the job back when it must still wait.
    fn retry(self: Box<Self>) -> Option<Box<dyn Deferred>>;
    /// Whether what this job waits for may still be going (a capture in
    /// progress, an NCCL group open): another turn now would only hand it back.
    fn still_blocked(&self) -> bool;
    /// What it releases, for the report of those still deferred at exit.
    fn describe(&self) -> String {
        "a deferred release".to_owned()
    }
}

/// Something queued work may still touch, retired until that work is known to
/// have passed: polled by [`triage`], then finished (outside the list's lock).
pub(crate) trait Watched: Send {
    /// Whether the work it waits for has passed (or will never run). Called with
    /// the list's lock held, never inside a host function.
    fn passed(&mut self) -> bool;
    /// The release, once passed.
    fn finish(self: Box<Self>);
}

/// Values a host function had to keep rather than drop (their Drop calls the
/// driver, which a host function may not): see [`drop_later`].
static DROP_LATER: Mutex<Vec<Box<dyn Send>>> = Mutex::new(Vec::new());
/// Whether `DROP_LATER` may hold anything, or a deferred release waits for the
/// next drain (one load on the draining paths).
static DROP_LATER_ANY: AtomicBool = AtomicBool::new(false);

/// Retired things waiting for their work to pass (see [`watch`]).
static WATCHED: Mutex<Vec<Box<dyn Watched>>> = Mutex::new(Vec::new());
/// Whether `WATCHED` may hold anything (one load on the paths that triage).
static WATCHED_ANY: AtomicBool = AtomicBool::new(false);

/// Releases that waited for a capture, an NCCL group or pending waits.
static DEFERRED: Mutex<Vec<Box<dyn Deferred>>> = Mutex::new(Vec::new());
/// Whether `DEFERRED` may hold anything (one load at each [`drain`]): set
/// under its lock by every push, cleared under it by a take that empties it.
static DEFERRED_ANY: AtomicBool = AtomicBool::new(false);

/// Keep `value` until the next [`drain`]: what a host function does with the
/// last handle to memory that queued work used (freeing it there is refused by
/// the driver, and would leak it).
pub(crate) fn drop_later(value: Box<dyn Send>) {
    DROP_LATER
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(value);
    DROP_LATER_ANY.store(true, Ordering::Release);
}

/// A value held for queued work (a graph's hold, riding with its host
/// functions): when its last holder goes inside a host function, the value is
/// handed to [`drop_later`] (its Drop may call the driver).
pub(crate) struct HeldOutsideHostFns(Option<std::sync::Arc<dyn Send + Sync>>);

impl HeldOutsideHostFns {
    /// Hold `value`.
    pub(crate) fn new(value: std::sync::Arc<dyn Send + Sync>) -> HeldOutsideHostFns {
        HeldOutsideHostFns(Some(value))
    }
}

impl Drop for HeldOutsideHostFns {
    fn drop(&mut self) {
        if let Some(value) = self.0.take() {
            if in_host_function() {
                drop_later(Box::new(value));
            }
        }
    }
}

/// What kernels queued into a capture need (the code of their registries),
/// held while any capture is in progress: a registry dropped inside a capture
/// cannot unload code the graph will run. The graph takes its own holds when
/// its capture ends.
static CAPTURE_HOLDS: Mutex<Vec<std::sync::Arc<dyn Send + Sync>>> = Mutex::new(Vec::new());

/// A capture is beginning (counted before the driver begins it).
pub(crate) fn capture_began() {
    super::gate::captures_begin();
}

/// A capture is over; what [`hold_while_capturing`] holds goes once no capture
/// is left.
pub(crate) fn capture_ended() {
    if super::gate::captures_end() {
        let mut held = CAPTURE_HOLDS.lock().unwrap_or_else(PoisonError::into_inner);
        if !super::gate::captures_in_progress() {
            let released = std::mem::take(&mut *held);
            drop(held);
            // Dropped outside the lock: a registry's code unloads here.
            drop(released);
        }
    }
}

/// Hold `value` while captures are in progress (the launch path's cold side):
/// once however many kernels of it are queued.
#[cold]
pub(crate) fn hold_while_capturing<T: Send + Sync + 'static>(value: &std::sync::Arc<T>) {
    let mut held = CAPTURE_HOLDS.lock().unwrap_or_else(PoisonError::into_inner);
    let at = std::sync::Arc::as_ptr(value).cast::<()>();
    if !held
        .iter()
        .any(|h| std::sync::Arc::as_ptr(h).cast::<()>() == at)
    {
        held.push(std::sync::Arc::clone(value) as std::sync::Arc<dyn Send + Sync>);
    }
}

/// Captures in progress (the driver's ids) whose graphs hold a value through
/// a user object retained into them while capturing (a GEMM's workspace):
/// the graph that ends such a capture cannot see the hold (no node names
/// it), so it learns of it here ([`take_held_in_capture`]), and its
/// executables' replays are refused inside another capture, whose graph
/// would hold nothing.
static HELD_IN_CAPTURES: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// Capture `capture`'s graph now holds a value through a user object.
#[cfg(feature = "cublas")]
pub(crate) fn note_held_in_capture(capture: u64) {
    let mut held = HELD_IN_CAPTURES
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if !held.contains(&capture) {
        held.push(capture);
    }
}

/// Whether capture `capture`'s graph holds a value through a user object
/// retained while capturing ([`note_held_in_capture`]); forgets it (called
/// once, when the capture ends).
pub(crate) fn take_held_in_capture(capture: u64) -> bool {
    let mut held = HELD_IN_CAPTURES
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    match held.iter().position(|&c| c == capture) {
        Some(at) => {
            held.swap_remove(at);
            true
        }
        None => false,
    }
}

/// A value a capture in progress keeps for its graph (a repeatable host
/// function's closure), tagged with the driver's id of the capture it went
/// into.
pub(crate) struct CaptureKeep {
    /// The capture; `None`: kept for the life of the process (the capture may
    /// have ended before the value was queued, which then may run on the
    /// stream, not in a graph).
    pub(crate) capture: Option<u64>,
    /// The value (its address is what the driver was handed).
    pub(crate) keep: std::sync::Arc<dyn std::any::Any + Send + Sync>,
}

/// Values queued into captures in progress: a capture's end releases exactly
/// those it took (after its graph took its own holds), never those of a capture
/// another thread began meanwhile.
static CAPTURE_KEEPS: Mutex<Vec<CaptureKeep>> = Mutex::new(Vec::new());

/// The capture keeps, locked: a value is pushed, and the work that uses it
/// queued, under this lock, which a capture's end takes to release what it
/// took.
pub(crate) fn capture_keeps() -> std::sync::MutexGuard<'static, Vec<CaptureKeep>> {
    CAPTURE_KEEPS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Release the capture keeps `ours` picks (dropped outside the lock: a
/// closure's captures may do anything).
pub(crate) fn release_capture_keeps(ours: impl Fn(&CaptureKeep) -> bool) {
    let released: Vec<CaptureKeep> = {
        let mut held = capture_keeps();
        if !held.iter().any(&ours) {
            return;
        }
        let (gone, kept) = std::mem::take(&mut *held).into_iter().partition(&ours);
        *held = kept;
        gone
    };
    drop(released);
}

/// Watch `item` until its work passes; [`triage`] finishes it then.
pub(crate) fn watch(item: Box<dyn Watched>) {
    WATCHED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(item);
    WATCHED_ANY.store(true, Ordering::Release);
}

/// Finish what [`watch`] holds whose work has passed. One load while there is
/// none; nothing inside a host function (no driver call there).
pub(crate) fn triage() {
    if !WATCHED_ANY.load(Ordering::Acquire) || in_host_function() {
        return;
    }
    let passed: Vec<Box<dyn Watched>> = {
        let mut list = WATCHED.lock().unwrap_or_else(PoisonError::into_inner);
        let mut passed = Vec::new();
        let mut i = 0;
        while i < list.len() {
            let Some(w) = list.get_mut(i) else { break };
            if w.passed() {
                passed.push(list.swap_remove(i));
            } else {
                i += 1;
            }
        }
        WATCHED_ANY.store(!list.is_empty(), Ordering::Release);
        passed
    };
    // Outside the lock: finishing calls the driver and may watch again.
    for w in passed {
        w.finish();
    }
}

/// Work off the lists, outside any host function: triage what is watched, drop
/// what host functions left in [`drop_later`], then retry deferred releases.
/// Called by [`CudaContext::synchronize`](crate::CudaContext::synchronize),
/// [`CudaStream::synchronize`](crate::CudaStream::synchronize),
/// [`MappedWords::new`](crate::MappedWords::new),
/// [`CaptureArena::reset`](crate::CaptureArena::reset) and the drops of graphs
/// and executable graphs that held values through user objects (whose
/// destructors hand them here).
pub(crate) fn drain() {
    triage();
    if in_host_function() {
        return;
    }
    if DROP_LATER_ANY.load(Ordering::Acquire) {
        let taken = {
            let mut list = DROP_LATER.lock().unwrap_or_else(PoisonError::into_inner);
            DROP_LATER_ANY.store(false, Ordering::Release);
            std::mem::take(&mut *list)
        };
        // Dropped outside the lock: their Drop calls the driver (and may
        // defer a release).
        drop(taken);
    }
    // Every deferred release gets a turn at each drain, whatever deferred it:
    // one whose capture or group end found it out of the list (another
    // thread was retrying it) is not left for a capture that may never come.
    if DEFERRED_ANY.load(Ordering::Acquire) {
        retry_deferred();
    }
}

/// A release was deferred behind pending waits: the next [`drain`] retries it.
pub(crate) fn retry_at_next_drain() {
    DROP_LATER_ANY.store(true, Ordering::Release);
}

/// Defer `job`, and retry at once when nothing it waits for is going any more
/// (it may have ended, and retried the list, meanwhile).
pub(crate) fn defer(job: Box<dyn Deferred>) {
    report_at_exit();
    let blocked = {
        let mut list = DEFERRED.lock().unwrap_or_else(PoisonError::into_inner);
        list.push(job);
        DEFERRED_ANY.store(true, Ordering::Release);
        // Read after the push: what ended before it retried a list without it.
        list.last().is_some_and(|j| j.still_blocked())
    };
    if !blocked {
        retry_deferred();
    }
}

/// Defer `job` to the next [`drain`], without a turn now (what blocks it, a
/// pending wait or this thread's state, is not over yet).
pub(crate) fn defer_until_drain(job: Box<dyn Deferred>) {
    report_at_exit();
    let mut list = DEFERRED.lock().unwrap_or_else(PoisonError::into_inner);
    list.push(job);
    DEFERRED_ANY.store(true, Ordering::Release);
    drop(list);
    retry_at_next_drain();
}

/// Retry the deferred releases (called when a capture or group ends, and at each
/// [`drain`]).
pub(crate) fn retry_deferred() {
    if in_host_function() {
        return;
    }
    // A capture or group that ended while jobs were taken out found the list
    // empty: take another turn then (a few, so a job that keeps waiting for
    // pending waits cannot spin here).
    for _ in 0..3 {
        let jobs = {
            let mut list = DEFERRED.lock().unwrap_or_else(PoisonError::into_inner);
            DEFERRED_ANY.store(false, Ordering::Release);
            std::mem::take(&mut *list)
        };
        if jobs.is_empty() {
            return;
        }
        let still: Vec<Box<dyn Deferred>> = jobs.into_iter().filter_map(|j| j.retry()).collect();
        if still.is_empty() {
            return;
        }
        // Asked after the jobs are back in the list, as `defer` asks: a
        // capture or group that ends after this answer retries a list that
        // holds them. (Asked before, a capture that ended between the
        // answer and the push found the list without them, and they stayed
        // deferred with nothing left to retry them: issue 40, item 9.)
        let blocked = {
            let mut list = DEFERRED.lock().unwrap_or_else(PoisonError::into_inner);
            let from = list.len();
            list.extend(still);
            DEFERRED_ANY.store(true, Ordering::Release);
            list.get(from..)
                .is_some_and(|back| back.iter().any(|j| j.still_blocked()))
        };
        if blocked {
            return;
        }
    }
}

/// Have the releases still deferred when the process exits reported then
/// (once per process, on the first deferral): at exit they are neither freed
/// (the driver may be torn down already) nor silently dropped.
fn report_at_exit() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        extern "C" {
            fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
        }
        // SAFETY: `atexit` of the C library this process runs on, handed a
        // function of the C ABI that takes no argument and returns nothing;
        // it only touches statics, never blocks (`try_lock`), and cannot
        // unwind into C (a panic in an `extern "C"` fn aborts).
        let registered = unsafe { atexit(report_deferred_at_exit) };
        if registered != 0 {
            let _ = std::io::Write::write_fmt(
                &mut std::io::stderr(),
                format_args!(
                    "metrale: releases still deferred at exit cannot be reported (atexit \
                     refused: {registered})\n"
                ),
            );
        }
    });
}

/// The exit report: one line naming what is still deferred (leaked), or
/// nothing when the list is empty.
extern "C" fn report_deferred_at_exit() {
    use std::io::Write as _;
    // Never block at exit: a thread still running may hold the lock.
    let names: Vec<String> = match DEFERRED.try_lock() {
        Ok(list) => list.iter().map(|j| j.describe()).collect(),
        Err(std::sync::TryLockError::Poisoned(p)) => {
            p.into_inner().iter().map(|j| j.describe()).collect()
        }
        Err(std::sync::TryLockError::WouldBlock) => {
            let _ = writeln!(
                std::io::stderr(),
                "metrale: at exit, the deferred releases could not be counted (their list \
                 was in use); any still deferred are leaked"
            );
            return;
        }
    };
    if names.is_empty() {
        return;
    }
    const SHOWN: usize = 8;
    let mut shown = names
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("; ");
    if names.len() > SHOWN {
        shown.push_str(&format!("; and {} more", names.len() - SHOWN));
    }
    let _ = writeln!(
        std::io::stderr(),
        "metrale: {} release(s) still deferred at exit, leaked (the work or wait they \
         waited for never passed before the process ended): {shown}",
        names.len()
    );
}

/// How many releases are deferred (for tests and diagnostics).
pub(crate) fn deferred_count() -> usize {
    DEFERRED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .len()
}

/// An outermost NCCL group of this thread, open until dropped: frees made
/// meanwhile (on any thread) are deferred; the drop (also on unwind) retries
/// them once no group is open. Made before the group's first call, dropped
/// after its `ncclGroupEnd` (and the settling of what it launched).
#[cfg(feature = "nccl")]
pub(crate) struct NcclGroupOpen(());

#[cfg(feature = "nccl")]
impl NcclGroupOpen {
    pub(crate) fn new() -> NcclGroupOpen {
        super::gate::nccl_group_opened();
        NcclGroupOpen(())
    }
}

#[cfg(feature = "nccl")]
impl Drop for NcclGroupOpen {
    fn drop(&mut self) {
        if super::gate::nccl_group_closed() {
            retry_deferred();
        }
    }
}
