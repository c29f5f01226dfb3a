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
