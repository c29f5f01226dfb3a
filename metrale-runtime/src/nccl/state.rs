//! The thread's group state, which communicators and `group` both use: the depth
//! of its open groups, the communicators they list, the inits made inside them
//! and the aborts deferred to the outermost group's end.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use metrale_cuda_sys::nccl::{ncclComm_t, Nccl};

use crate::context::CudaContext;

use super::error::CommInfo;
use super::teardown::{abort_bounded, bound_deadline};

thread_local! {
    /// Depth of this thread's `group` calls.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    /// The communicators the open groups list (borrowed for the group's length).
    static LISTED: RefCell<Vec<ncclComm_t>> = const { RefCell::new(Vec::new()) };
    /// Inits made inside this thread's open groups: NCCL runs them at the
    /// outermost `ncclGroupEnd`.
    static PENDING_INITS: RefCell<Vec<Arc<GroupInit>>> = const { RefCell::new(Vec::new()) };
    /// Aborts asked for while an open group of this thread listed the
    /// communicator: run after the outermost `ncclGroupEnd`.
    static DEFERRED_ABORTS: RefCell<Vec<DeferredAbort>> = const { RefCell::new(Vec::new()) };
}

/// An abort of a communicator that this thread's open group lists (its queued
/// work still names it): NCCL's abort runs after the outermost group's end.
/// The communicator is marked aborted meanwhile (no NCCL call on it) and, being
/// borrowed by the group, outlives the group's end; this owns what the abort
/// needs.
pub(crate) struct DeferredAbort {
    pub(crate) lib: &'static Nccl,
    pub(crate) raw: ncclComm_t,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) serial: Option<Arc<Mutex<()>>>,
    pub(crate) info: CommInfo,
    /// How long the abort may take (plus the grace) before it is left to a
    /// helper thread.
    pub(crate) bound: Duration,
}

/// Defer `abort` to the outermost group's end.
pub(crate) fn defer_abort(abort: DeferredAbort) {
    DEFERRED_ABORTS.with(|d| d.borrow_mut().push(abort));
}

/// Run the aborts deferred to the end of this thread's outermost group (after
/// its `ncclGroupEnd`), each bounded.
pub(super) fn run_deferred_aborts() {
    let aborts = DEFERRED_ABORTS.with(|d| std::mem::take(&mut *d.borrow_mut()));
    for a in aborts {
        abort_bounded(
            a.lib,
            a.raw,
            &a.ctx,
            a.serial.as_ref(),
            a.info,
            bound_deadline(a.bound),
        );
    }
}

/// A communicator made inside a group: NCCL initializes it only when the
/// outermost group of the thread that made it ends. Until then it may be used
/// only inside that group, on that thread.
#[derive(Debug)]
pub(crate) struct GroupInit {
    thread: ThreadId,
    ended: AtomicBool,
}

impl GroupInit {
    /// Record an init made now, inside this thread's open group.
    pub(crate) fn pending() -> Arc<GroupInit> {
        let init = Arc::new(GroupInit {
            thread: std::thread::current().id(),
            ended: AtomicBool::new(false),
        });
        PENDING_INITS.with(|p| p.borrow_mut().push(Arc::clone(&init)));
        init
    }

    /// Whether NCCL may be called on the communicator here: its group ended, or
    /// this is the thread whose open group holds its init.
    pub(crate) fn usable_here(&self) -> bool {
        self.ended() || (self.thread == std::thread::current().id() && in_group())
    }

    /// Whether the group it was made in has ended (NCCL ran the init).
    pub(crate) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }
}

/// The outermost group ended (its `ncclGroupEnd` was called): the inits made in
/// it have run (or failed, which their communicators report).
pub(super) fn inits_ended() {
    let done = PENDING_INITS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    for init in done {
        init.ended.store(true, Ordering::Release);
    }
}

/// Whether this thread is inside [`group`].
#[inline]
pub(crate) fn in_group() -> bool {
    DEPTH.with(Cell::get) > 0
}

/// List `comms` as used by the group this thread is opening: the mark to give
/// [`leave`].
pub(super) fn list(comms: impl Iterator<Item = ncclComm_t>) -> usize {
    LISTED.with(|l| {
        let mut l = l.borrow_mut();
        let mark = l.len();
        l.extend(comms);
        mark
    })
}

/// The group this thread is opening is open: one level deeper.
pub(super) fn deepen() {
    DEPTH.with(|d| d.set(d.get() + 1));
}

/// Leave the group [`list`] gave `mark` for: one level less deep, its
/// communicators no longer listed.
pub(super) fn leave(mark: usize) {
    DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    LISTED.with(|l| l.borrow_mut().truncate(mark));
}

/// Whether an open group of this thread lists the communicator `raw`.
pub(crate) fn is_listed(raw: ncclComm_t) -> bool {
    LISTED.with(|l| l.borrow().contains(&raw))
}
