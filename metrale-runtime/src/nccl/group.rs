//! [`group`]: several NCCL calls, of one or several communicators, queued as one
//! NCCL group from one thread (the thread's group state is `state.rs`).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use metrale_cuda_sys::nccl::ncclResult_t;

use crate::error::Result;
use crate::lifetime::NcclGroupOpen;

use super::comm::Communicator;
use super::error::{call_error, missing};
use super::lib;
use super::state::{self, in_group, is_listed};

/// Queue NCCL calls of one or several communicators as one group
/// (`ncclGroupStart` / `ncclGroupEnd`): what `f` queues is launched when it
/// returns. One thread drives several ranks this way (communicators of
/// [`Communicator::init_all`], or `init_rank` for several ranks), and sends and
/// receives between ranks do not deadlock.
///
/// `comms` lists the communicators `f` uses: a collective, send or receive on
/// a communicator not listed is refused (the group borrows those it lists, so
/// none can be moved to another thread or dropped before its work is
/// launched), and so is [`Communicator::split`]. The completion of the
/// non-blocking ones is polled when the group ends, within each one's
/// timeout. Groups nest; the outermost end launches.
///
/// When one thread queues several ranks of one communicator in the group
/// (communicators of one `init_all`, or `init_rank`s of one id), their
/// collectives are checked to agree: the k-th collective of each rank must
/// have the same count, type, operation and root, and the k-th send from one
/// rank to another the count and type of the other's k-th receive from it
/// (communicators of at most 1024 ranks). One that disagrees is
/// refused before NCCL sees it, and every listed rank of that communicator is
/// aborted when the group ends (what was queued could never complete).
/// Agreement with ranks of other processes or threads stays the caller's duty.
///
/// Inside the group, [`Communicator::wait`] is refused (the work reaches the
/// streams only at the end), and an abort of a listed communicator, direct
/// ([`Communicator::abort`]) or by a failed
/// [`check_async`](Communicator::check_async), marks it aborted at once but
/// runs NCCL's abort after the outermost group's end: the queued work still
/// names the communicator, and NCCL would launch it for a freed one.
///
/// While any group is open in the process, device memory dropped (on any
/// thread) is not freed but deferred until the last open group has ended: the
/// collectives queued so far reach their streams only then. So keep groups
/// short. [`ManagedBuffer::host_slice`](crate::ManagedBuffer::host_slice) is
/// refused meanwhile.
///
/// ```no_run
/// use metrale_runtime::nccl::{group, Communicator, ReduceOp};
/// use metrale_runtime::{context, CudaStream, DeviceBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let ctxs = [context(0)?, context(1)?];
/// let comms = Communicator::init_all(&ctxs)?;
/// let streams = [CudaStream::new(&ctxs[0])?, CudaStream::new(&ctxs[1])?];
/// let mut bufs = [DeviceBuffer::<f32>::alloc(&ctxs[0], 1024)?, DeviceBuffer::alloc(&ctxs[1], 1024)?];
/// let listed: Vec<&Communicator> = comms.iter().collect();
/// group(&listed, || {
///     for ((c, b), s) in comms.iter().zip(bufs.iter_mut()).zip(&streams) {
///         c.all_reduce_in_place(b, ReduceOp::Sum, s)?;
///     }
///     Ok(())
/// })?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// Inside a host function, refused before NCCL
/// ([`ErrorKind::InHostFunction`](crate::ErrorKind::InHostFunction)); `f`'s
/// error (the group is still ended), else `ncclGroupEnd`'s status, or the
/// first asynchronous error or timeout among the listed communicators (every
/// one is polled; each that failed is aborted).
pub fn group<R>(comms: &[&Communicator], f: impl FnOnce() -> Result<R>) -> Result<R> {
    if crate::lifetime::in_host_function() {
        return Err(crate::error::CallError::InHostFunction.about("ncclGroupStart (nccl::group)"));
    }
    if let Some(c) = comms.iter().find(|c| !c.usable_here()) {
        // Made inside another thread's group that has not ended.
        return Err(super::error::refused(
            "ncclGroupStart (nccl::group)",
            Some(c.info()),
            "the communicator was made inside a `group` that has not ended: NCCL \
             initializes it at that group's end",
        ));
    }
    if in_group() {
        // NCCL launches a nested group's work at the outermost end: what it
        // lists must be borrowed (and locked) until then, so by the outer group.
        if let Some(c) = comms.iter().find(|c| !is_listed(c.raw_handle())) {
            return Err(super::error::refused(
                "ncclGroupStart (nccl::group)",
                Some(c.info()),
                "a nested group may list only communicators an enclosing group lists: \
                 its work is launched when the outermost group ends",
            ));
        }
    }
    let nccl = lib()?;
    let start = nccl.ncclGroupStart().map_err(|m| missing(m, None))?;
    let end = nccl.ncclGroupEnd().map_err(|m| missing(m, None))?;
    // SAFETY: no arguments; starts a group on this thread.
    let status = unsafe { start() };
    if !status.is_success() {
        return Err(call_error(
            nccl,
            "ncclGroupStart",
            status,
            std::ptr::null_mut(),
            None,
        ));
    }
    // The outermost group holds frees back until it has ended (also on
    // unwind, after the NCCL group: `Open` is dropped first).
    let frees_wait = (!in_group()).then(NcclGroupOpen::new);
    let mark = state::list(comms.iter().map(|c| c.raw_handle()));
    /// Ends the depth and the listing, and when `f` unwinds the NCCL group too
    /// (its status ignored), so the thread is not left inside a group.
    struct Open {
        mark: usize,
        end: Option<unsafe extern "C" fn() -> ncclResult_t>,
    }
    impl Drop for Open {
        fn drop(&mut self) {
            state::leave(self.mark);
            if let Some(end) = self.end.take() {
                // SAFETY: ends the group `group` started, once.
                let _ = unsafe { end() };
            }
        }
    }
    /// At the outermost group's end (after `ncclGroupEnd`, also on unwind),
    /// the inits made inside it have run.
    struct InitsEnd {
        outermost: bool,
    }
    impl Drop for InitsEnd {
        fn drop(&mut self) {
            if self.outermost {
                state::inits_ended();
            }
        }
    }
    /// At the outermost group's end (after `ncclGroupEnd`, also on unwind):
    /// the aborts deferred while it was open run, and its agreement records
    /// are forgotten.
    struct AbortsEnd {
        outermost: bool,
    }
    impl AbortsEnd {
        fn run(&mut self) {
            if std::mem::take(&mut self.outermost) {
                super::agree::clear();
                state::run_deferred_aborts();
            }
        }
    }
    impl Drop for AbortsEnd {
        fn drop(&mut self) {
            self.run();
        }
    }
    let inits_end = InitsEnd {
        outermost: !in_group(),
    };
    // Declared before `open`: on unwind it drops after the NCCL group's end.
    let mut aborts_end = AbortsEnd {
        outermost: !in_group(),
    };
    state::deepen();
    let mut open = Open {
        mark,
        end: Some(end),
    };
    let result = f();
    if aborts_end.outermost {
        // Ranks whose collectives disagreed: what was queued can never
        // complete. Abort every listed rank of those communicators (deferred to
        // the group's end: they are still listed here).
        for c in comms.iter().filter(|c| super::agree::disagreed(c.clique())) {
            c.abort_within(Duration::ZERO);
        }
    }
    open.end = None;
    drop(open);
    let status = {
        // The outermost end launches the work of every listed communicator:
        // hold the locks of those sharing resources with a parent or child
        // (each once, in address order, so two groups cannot deadlock).
        let mut locks: Vec<&Arc<Mutex<()>>> = comms.iter().filter_map(|c| c.serial()).collect();
        locks.sort_by_key(|m| Arc::as_ptr(m) as usize);
        locks.dedup_by(|a, b| Arc::ptr_eq(a, b));
        let _held: Vec<_> = locks
            .iter()
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner))
            .collect();
        // SAFETY: ends the group this call started.
        unsafe { end() }
    };
    // The work is launched: the aborts deferred meanwhile may run now.
    aborts_end.run();
    let ended = if status.is_success() {
        Ok(())
    } else if status == ncclResult_t::ncclInProgress {
        // Settle every listed non-blocking communicator, the first error wins.
        let mut first = Ok(());
        for c in comms.iter().filter(|c| !c.is_blocking() && !c.is_aborted()) {
            let settled = c.settle_call("ncclGroupEnd");
            if first.is_ok() {
                first = settled;
            }
        }
        first
    } else {
        Err(call_error(
            nccl,
            "ncclGroupEnd",
            status,
            std::ptr::null_mut(),
            None,
        ))
    };
    drop(inits_end);
    drop(frees_wait);
    let value = result?;
    ended.map(|()| value)
}
