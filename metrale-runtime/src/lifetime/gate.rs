//! The gates: process- and thread-wide facts that say whether a release may run
//! now, each one load on the fast path.
//!
//! - The host-function flag: the calling thread is running a host function
//!   metrale queued (the driver's thread), where the driver may not be called.
//!   [`cu!`](crate::error) reads it before every call and refuses.
//! - The NCCL group gate (feature `nccl`): an NCCL group is open somewhere, so a
//!   collective queued in it may use memory and reach its stream only at the
//!   outermost `ncclGroupEnd`.
//! - [`work_abandoned`]: a status that says the context will run nothing more,
//!   so queued work will never touch what it borrowed again.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

use metrale_cuda_sys::CUresult;

thread_local! {
    /// Whether this thread is running a host function metrale queued (the
    /// driver's thread, inside [`crate::CudaStream::launch_host_fn`]'s closure).
    static IN_HOST_FUNCTION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is inside a host function (one thread-local load).
#[inline]
pub(crate) fn in_host_function() -> bool {
    IN_HOST_FUNCTION.with(std::cell::Cell::get)
}

/// Marks the thread as running a host function until dropped (also on unwind).
pub(crate) struct HostFunctionScope {
    was: bool,
}

impl HostFunctionScope {
    /// Enter a host function on this thread.
    pub(crate) fn enter() -> HostFunctionScope {
        HostFunctionScope {
            was: IN_HOST_FUNCTION.with(|c| c.replace(true)),
        }
    }
}

impl Drop for HostFunctionScope {
    fn drop(&mut self) {
        let was = self.was;
        IN_HOST_FUNCTION.with(|c| c.set(was));
    }
}

/// Whether a status means the context will run nothing more (a sticky fault, the
/// context destroyed, the driver shutting down): queued work that borrowed host
/// memory will never touch it again.
pub(crate) fn work_abandoned(status: CUresult) -> bool {
    matches!(
        status.0,
        3 | 4 // NOT_INITIALIZED, DEINITIALIZED
            | 214 // ECC_UNCORRECTABLE
            | 400 // INVALID_HANDLE: the event went with a reset
            | 700..=702 // ILLEGAL_ADDRESS, LAUNCH_OUT_OF_RESOURCES, LAUNCH_TIMEOUT
            | 709 // CONTEXT_IS_DESTROYED
            | 710 // ASSERT
            | 714..=720 // HARDWARE_STACK_ERROR .. COOPERATIVE_LAUNCH_TOO_LARGE
    )
}

/// Before a release that waits for the whole context (a virtual range's
/// unmaps, an IPC close): wait out NCCL groups open on other threads, up to
/// [`GROUP_WAIT`] (groups are short). What is still blocking afterwards (a group
/// of this thread, which cannot end while it waits, or pending waits on mapped
/// words) makes the release refuse, and the caller leaks with the reason on
/// stderr.
pub(crate) fn wait_out_nccl_groups() {
    #[cfg(feature = "nccl")]
    if nccl_groups_open() && !nccl_group_on_this_thread() {
        let until = std::time::Instant::now() + GROUP_WAIT;
        while nccl_groups_open() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}

/// How long a release waits for NCCL groups open on other threads.
#[cfg(feature = "nccl")]
pub(crate) const GROUP_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The outermost NCCL groups open in the process (`nccl::group`).
#[cfg(feature = "nccl")]
static NCCL_GROUPS_OPEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[cfg(feature = "nccl")]
thread_local! {
    /// Whether this thread has an NCCL group open.
    static NCCL_GROUP_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether an NCCL group is open anywhere in the process: frees wait (one
/// atomic load; always `false` without the `nccl` feature).
#[inline]
pub(crate) fn nccl_groups_open() -> bool {
    #[cfg(feature = "nccl")]
    {
        NCCL_GROUPS_OPEN.load(std::sync::atomic::Ordering::Acquire) != 0
    }
    #[cfg(not(feature = "nccl"))]
    {
        false
    }
}

/// Whether the calling thread has an NCCL group open.
#[cfg(feature = "nccl")]
pub(crate) fn nccl_group_on_this_thread() -> bool {
    NCCL_GROUP_HERE.with(std::cell::Cell::get)
}

/// Count an outermost NCCL group of this thread opening.
#[cfg(feature = "nccl")]
pub(super) fn nccl_group_opened() {
    NCCL_GROUPS_OPEN.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    NCCL_GROUP_HERE.with(|h| h.set(true));
}

/// Count an outermost NCCL group of this thread closing; whether it was the
/// last one open in the process.
#[cfg(feature = "nccl")]
pub(super) fn nccl_group_closed() -> bool {
    NCCL_GROUP_HERE.with(|h| h.set(false));
    NCCL_GROUPS_OPEN.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1
}

/// Metrale captures in progress in this process. While there is none, no stream
/// can be capturing through metrale, and the launch path does no capture work.
static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// Waits in progress that found no capture in progress (and so mark nothing).
static UNMARKED_WAITS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Captures this thread has begun through metrale and not ended (shared
    /// with the streams it began them on: the end, on any thread, counts
    /// down this one).
    static CAPTURE_DEPTH: Arc<AtomicI32> = Arc::new(AtomicI32::new(0));
}

/// Count a capture that is beginning.
pub(crate) fn captures_begin() {
    CAPTURES.fetch_add(1, Ordering::SeqCst);
    // A wait that saw no capture in progress must finish before this capture can
    // begin (it may be about to join it, unmarked): see `CudaStream::wait`.
    while UNMARKED_WAITS.load(Ordering::SeqCst) != 0 {
        std::thread::yield_now();
    }
}

/// Count a capture that is over; whether none is left.
pub(crate) fn captures_end() -> bool {
    let before = CAPTURES
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            Some(n.saturating_sub(1))
        })
        .unwrap_or(0);
    before <= 1
}

/// Whether any capture begun through metrale is in progress (one atomic load).
#[inline]
pub(crate) fn captures_in_progress() -> bool {
    CAPTURES.load(Ordering::SeqCst) != 0
}

/// A wait on a stream that may join a capture: `Some` while no capture is in
/// progress (the wait marks nothing, and a capture's begin waits for it to be
/// dropped), `None` when a capture is in progress (the wait must mark its
/// stream instead).
pub(crate) fn unmarked_wait() -> Option<UnmarkedWait> {
    UNMARKED_WAITS.fetch_add(1, Ordering::SeqCst);
    if captures_in_progress() {
        UNMARKED_WAITS.fetch_sub(1, Ordering::SeqCst);
        None
    } else {
        Some(UnmarkedWait(()))
    }
}

/// See [`unmarked_wait`]: counted until dropped.
pub(crate) struct UnmarkedWait(());

impl Drop for UnmarkedWait {
    fn drop(&mut self) {
        UNMARKED_WAITS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// This thread's capture count (shared with the streams it began captures on).
pub(crate) fn capture_depth_counter() -> Arc<AtomicI32> {
    CAPTURE_DEPTH.with(Arc::clone)
}

/// Whether this thread has a metrale capture open: calls the driver refuses on a
/// capturing thread (`cuMemFree`, synchronisations) must wait.
pub(crate) fn capturing_on_this_thread() -> bool {
    CAPTURE_DEPTH
        .try_with(|d| d.load(Ordering::SeqCst) > 0)
        .unwrap_or(false)
}
