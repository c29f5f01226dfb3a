//! [`Communicator`]: what a communicator is, the checks every call on it makes,
//! abort, and the bounded teardown in Drop. Its inits are in `init.rs`, its
//! asynchronous status and bounded wait in `wait.rs`.

use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use metrale_cuda_sys::nccl::{ncclComm_t, ncclResult_t, Nccl};

use crate::context::{CudaContext, Generation};
use crate::error::Result;
use crate::stream::CudaStream;

use super::error::{self, call_error, into_error, missing, refused, CommInfo, NcclError};
use super::ledger::{finished_and_unheld, KEPT_STREAMS};
use super::state::{in_group, is_listed, DeferredAbort};
use super::teardown::{
    abort_bounded, bound_deadline, bound_deadline_at, on_helper, settle, DropJob, Handle, Helped,
    Settled, ABORT_GRACE,
};

/// One rank's NCCL communicator, on one device.
///
/// Collectives are methods (`all_reduce`, `broadcast`, ...) taking typed device
/// memory and a [`CudaStream`] of the communicator's device; [`group`](super::group)
/// lets one thread queue work on several communicators at once.
///
/// `Send`, not `Sync`: NCCL communicators are not thread-safe, so one thread at a
/// time uses it (move it to the thread that drives its rank). A communicator
/// split with shared resources ([`CommConfig::split_share`](super::CommConfig::split_share)) and its parent
/// take turns: each NCCL call on either holds a lock they share. Drop finalizes
/// and destroys it within the config's drop timeout, and aborts it past that,
/// on a helper thread (NCCL's teardown can wait for the device's queued work):
/// the dropping thread waits at most the drop timeout plus 200 ms, then leaks
/// it to that thread with a line on stderr. Drop never blocks forever.
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<metrale_runtime::nccl::Communicator>(); // not Sync
/// ```
/// ```
/// fn sent<T: Send>() {}
/// sent::<metrale_runtime::nccl::Communicator>();
/// ```
pub struct Communicator {
    pub(super) raw: ncclComm_t,
    pub(super) lib: &'static Nccl,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) made: Generation,
    pub(super) info: CommInfo,
    pub(super) blocking: bool,
    /// Whether its children share its resources (`splitShare`, as NCCL decides).
    pub(super) split_share: bool,
    pub(super) timeout: Option<Duration>,
    pub(super) drop_timeout: Duration,
    /// Aborted for metrale: set before NCCL's abort starts (which may go on on
    /// a helper thread, or wait for the end of a group that lists it), so no
    /// NCCL call is made on the handle from then on.
    pub(super) aborted: Cell<bool>,
    /// Which NCCL communicator this is a rank of, as far as this process can
    /// tell (the id and size of `init_rank`, one `init_all`, a split's parent
    /// and color): ranks of one key queued in one group are checked to agree.
    pub(super) clique: u64,
    /// How many collectives were queued (metrale's count, zero-length ones
    /// included: every rank counts the same calls), for the agreement check.
    pub(super) seq: Cell<u64>,
    /// How many splits were made of this communicator (a child's key).
    pub(super) splits: Cell<u64>,
    /// Sends to each peer, then receives from each peer, so far (made at init
    /// for at most `agree::P2P_CHECKED_RANKS` ranks, empty above: then sends
    /// and receives are not checked).
    pub(super) p2p: Box<[Cell<u64>]>,
    /// Every stream this communicator queued work on (each once), so Drop can
    /// wait for that work before a blocking finalize.
    pub(super) streams: RefCell<Vec<CudaStream>>,
    /// The last operation queued, for the text of a timed-out wait.
    pub(super) last_op: Cell<&'static str>,
    /// A non-blocking init made inside a group, not yet polled to completion.
    pub(super) unsettled: Cell<bool>,
    /// Made inside a group: usable only in that group (its thread) until the
    /// group ends, when NCCL runs the init.
    pub(super) group_init: Option<Arc<super::state::GroupInit>>,
    /// Shared with the parent or children this communicator shares resources
    /// with (`splitShare`): NCCL forbids using them concurrently, so every NCCL
    /// call on any of them holds it. `None` (no lock taken) otherwise.
    pub(super) serial: Option<Arc<Mutex<()>>>,
    /// The strings the config handed to NCCL (`commName`, `netName`): NCCL keeps
    /// the pointers for the communicator's life.
    pub(super) _names: Vec<CString>,
    /// Registrations, their bound, and revocation (`ledger.rs`).
    pub(super) ledger: super::ledger::Ledger,
}

// SAFETY: NCCL lets a communicator be used from any thread, one thread at a time.
// One at a time: `Communicator` is not `Sync` (its `Cell`s), so only the thread
// that holds it calls NCCL on it; a communicator sharing resources with a parent
// or child (which NCCL forbids using concurrently) holds their shared lock for
// every NCCL call. NCCL's group state is per thread: a collective queued inside
// `group` needs its communicator listed, and the group borrows the listed ones
// until it has ended, so none moves to another thread (or is dropped) while its
// work waits in this thread's group; an abort asked for meanwhile (directly, by
// a failed check or a timed-out wait) only marks it aborted and is run when the
// outermost group has ended. The one other thread that calls NCCL on the handle
// is the helper an abort or a Drop hands it to (`teardown::Handle`): the
// communicator is marked aborted (or is being dropped) before, so the thread
// holding it makes no NCCL call on it after the hand-over. NCCL sets the
// communicator's device itself; the calls metrale makes for it bind the
// context first (the helper binds it on its own thread).
unsafe impl Send for Communicator {}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.info.rank)
            .field("size", &self.info.size)
            .field("device", &self.info.device)
            .field("blocking", &self.blocking)
            .field("aborted", &self.aborted.get())
            .finish_non_exhaustive()
    }
}

impl Communicator {
    /// This communicator's turn on the lock it shares with a parent or child
    /// (`None`, nothing taken, when it shares none).
    #[inline]
    pub(crate) fn turn(&self) -> Option<MutexGuard<'_, ()>> {
        self.serial
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The lock shared with a parent or child, if any.
    pub(crate) fn serial(&self) -> Option<&Arc<Mutex<()>>> {
        self.serial.as_ref()
    }

    /// The error of `call` returning `status` (NCCL's last error read in this
    /// communicator's turn).
    #[cold]
    pub(super) fn failed(
        &self,
        call: &'static str,
        status: ncclResult_t,
    ) -> crate::error::MetraleError {
        let _turn = self.turn();
        call_error(self.lib, call, status, self.raw, Some(self.info))
    }

    /// An int NCCL tells about the communicator (rank, count).
    pub(super) fn query(
        &self,
        call: &'static str,
        get: impl FnOnce(
            &Nccl,
        ) -> std::result::Result<
            unsafe extern "C" fn(ncclComm_t, *mut i32) -> ncclResult_t,
            metrale_cuda_sys::LibraryMissingSymbol,
        >,
    ) -> Result<usize> {
        let f = get(self.lib).map_err(|m| missing(m, Some(self.info)))?;
        let mut v = 0;
        let status = {
            let _turn = self.turn();
            // SAFETY: a live communicator; writes one int.
            unsafe { f(self.raw, &mut v) }
        };
        if !status.is_success() {
            return Err(self.failed(call, status));
        }
        usize::try_from(v).map_err(|_| refused(call, Some(self.info), format!("NCCL answered {v}")))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.info.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.info.size
    }

    /// The device ordinal.
    pub fn device(&self) -> usize {
        self.info.device
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Rank, size and device, as errors name them.
    pub fn info(&self) -> CommInfo {
        self.info
    }

    /// Whether NCCL calls on this communicator block (see
    /// [`CommConfig::blocking`](super::CommConfig::blocking)).
    pub fn is_blocking(&self) -> bool {
        self.blocking
    }

    /// Whether the communicator was aborted (by a failed or timed-out wait, or
    /// [`abort`](Self::abort)); it cannot be used again.
    pub fn is_aborted(&self) -> bool {
        self.aborted.get()
    }

    /// The raw handle, for calls metrale does not wrap. It stays owned by this
    /// value (do not destroy it); after an abort (which may still be running
    /// on a helper thread, or be deferred to a group's end) it is dangling.
    pub fn raw(&self) -> ncclComm_t {
        self.raw
    }

    /// Abort the communicator (`ncclCommAbort`): NCCL stops its pending work and
    /// frees it. Later calls are refused with [`NcclError::Aborted`]; Drop does
    /// nothing more. Aborting twice does nothing.
    ///
    /// Bounded: NCCL's abort can wait for the device's queued work (on any
    /// stream of the device), so it runs on a helper thread, and this returns
    /// when it has finished or at the latest the config's
    /// [`drop_timeout`](super::CommConfig::drop_timeout) plus 200 ms after the call;
    /// an abort still running then finishes alone (one line on stderr says so).
    /// The communicator counts as aborted from the call on.
    ///
    /// Inside a [`group`](super::group) that lists it (on this thread), the
    /// abort is deferred to the outermost group's end: the group's queued work
    /// still names the communicator, and NCCL would launch it for a freed one.
    /// Until then it is refused like an aborted one.
    ///
    /// A communicator made inside a group that has not ended is not aborted (NCCL
    /// would reclaim it while its init is still queued): refused calls say so,
    /// and its Drop leaks it. Inside a host function nothing is done (NCCL may
    /// not be called there), with a line on stderr.
    pub fn abort(&self) {
        self.abort_within(self.drop_timeout);
    }

    /// Abort, waiting at most `bound` plus [`ABORT_GRACE`] for NCCL's abort (on a
    /// helper thread); deferred to the group's end while a group of this thread
    /// lists the communicator.
    pub(crate) fn abort_within(&self, bound: Duration) {
        if self.init_not_ended() {
            crate::error::report_line(format_args!(
                "NCCL communicator ({}): abort skipped, the group it was made in has not \
                 ended (NCCL has not initialized it yet)",
                self.info
            ));
            return;
        }
        if crate::lifetime::in_host_function() {
            crate::error::report_line(format_args!(
                "NCCL communicator ({}): abort skipped inside a host function (where NCCL \
                 may not be called); abort it after the host function",
                self.info
            ));
            return;
        }
        if self.aborted.replace(true) {
            return;
        }
        if is_listed(self.raw) {
            // This thread's open group still lists it, with work queued that
            // NCCL launches at the group's end: aborting now would free the
            // communicator under it. The outermost group's end runs it.
            super::state::defer_abort(DeferredAbort {
                lib: self.lib,
                raw: self.raw,
                ctx: Arc::clone(&self.ctx),
                serial: self.serial.clone(),
                info: self.info,
                bound,
            });
            return;
        }
        abort_bounded(
            self.lib,
            self.raw,
            &self.ctx,
            self.serial.as_ref(),
            self.info,
            bound_deadline(bound),
        );
    }

    /// Abort, and the error of `state` seen during `during`.
    #[cold]
    pub(super) fn async_failure(
        &self,
        during: &str,
        state: ncclResult_t,
    ) -> crate::error::MetraleError {
        let last_error = {
            let _turn = self.turn();
            error::last_error(self.lib, self.raw)
        };
        let e = NcclError::Async {
            during: during.to_owned(),
            status: state,
            description: error::description(self.lib, state),
            last_error,
            comm: self.info,
        };
        self.abort_within(Duration::ZERO);
        into_error(e)
    }

    /// Refuse a call inside a host function (the driver forbids CUDA calls
    /// there, and NCCL makes them) or on an aborted communicator; settle an init
    /// a group left in progress.
    #[inline]
    pub(crate) fn enter(&self, call: &'static str) -> Result<()> {
        if crate::lifetime::in_host_function() {
            return Err(self.in_host_function(call));
        }
        if self.aborted.get() {
            return Err(into_error(NcclError::Aborted {
                call,
                comm: self.info,
            }));
        }
        if let Some(init) = &self.group_init {
            if !init.usable_here() {
                return Err(self.init_pending(call));
            }
        }
        if self.unsettled.get() && !in_group() {
            self.unsettled.set(false);
            self.settle_call("init")?;
        }
        Ok(())
    }

    /// Whether it was made inside a group that has not ended (NCCL has not
    /// initialized it yet), on any thread.
    pub(crate) fn init_not_ended(&self) -> bool {
        self.group_init.as_ref().is_some_and(|i| !i.ended())
    }

    /// Whether NCCL may be called on it here (see `GroupInit::usable_here`).
    pub(crate) fn usable_here(&self) -> bool {
        self.group_init.as_ref().is_none_or(|i| i.usable_here())
    }

    #[cold]
    fn init_pending(&self, call: &'static str) -> crate::error::MetraleError {
        refused(
            call,
            Some(self.info),
            "the communicator was made inside a `group` that has not ended: NCCL \
             initializes it at that group's end, so until then it may be used only \
             inside the group, on the thread that opened it",
        )
    }

    #[cold]
    fn in_host_function(&self, call: &'static str) -> crate::error::MetraleError {
        crate::error::CallError::InHostFunction.about(format_args!(
            "{call} on the NCCL communicator ({})",
            self.info
        ))
    }

    /// Refuse a stream of another device.
    #[inline]
    pub(crate) fn check_stream(&self, call: &'static str, stream: &CudaStream) -> Result<()> {
        if Arc::ptr_eq(stream.context(), &self.ctx) {
            return Ok(());
        }
        Err(self.wrong_device(call, stream))
    }

    #[cold]
    fn wrong_device(&self, call: &'static str, stream: &CudaStream) -> crate::error::MetraleError {
        refused(
            call,
            Some(self.info),
            format!(
                "the stream is on device {}, the communicator on device {}",
                stream.ordinal(),
                self.info.device
            ),
        )
    }

    pub(crate) fn lib(&self) -> &'static Nccl {
        self.lib
    }

    /// Remember that `op` was queued on `stream` (each stream once).
    #[inline]
    pub(crate) fn queued(&self, op: &'static str, stream: &CudaStream) {
        self.last_op.set(op);
        let Ok(mut streams) = self.streams.try_borrow_mut() else {
            return;
        };
        if streams.last().is_some_and(|s| s.same_stream(stream)) {
            return;
        }
        if !streams.iter().any(|s| s.same_stream(stream)) {
            if streams.len() >= KEPT_STREAMS && !in_group() {
                // (Not inside a group: its queued work reaches these streams
                // only at the group's end, so none may be destroyed before.)
                // Streams only this list still holds and whose work has
                // finished: nothing queued there can use a registration any
                // more, so keep them from piling up (a new stream per step).
                // One still busy (or whose state cannot be read) stays: a
                // deregistration waits for it.
                streams.retain(|s| !finished_and_unheld(s));
            }
            streams.push(stream.clone());
        }
    }

    /// The outcome of a queued call: success; for `ncclInProgress` outside a
    /// group, the polled result; an error with the communicator named.
    #[inline]
    pub(crate) fn finish(&self, call: &'static str, status: ncclResult_t) -> Result<()> {
        if status.is_success() {
            return Ok(());
        }
        if status == ncclResult_t::ncclInProgress {
            if in_group() {
                // Listed in the group (checked before the call): polled when it
                // ends.
                return Ok(());
            }
            return self.settle_call(call);
        }
        Err(self.failed(call, status))
    }

    /// Poll a non-blocking call to completion, bounded by the config's timeout
    /// (one too long to add to the clock is no bound).
    #[cold]
    pub(crate) fn settle_call(&self, call: &'static str) -> Result<()> {
        let deadline = self.timeout.and_then(|t| Instant::now().checked_add(t));
        match settle(self.lib, self.raw, deadline, self.serial.as_deref())
            .map_err(|m| missing(m, Some(self.info)))?
        {
            Settled::Done => Ok(()),
            Settled::Failed(state) => Err(self.async_failure(call, state)),
            Settled::TimedOut => {
                self.abort_within(Duration::ZERO);
                Err(into_error(NcclError::Timeout {
                    pending: call.to_owned(),
                    waited: self.timeout.unwrap_or_default(),
                    comm: self.info,
                }))
            }
        }
    }

    pub(crate) fn raw_handle(&self) -> ncclComm_t {
        self.raw
    }

    /// The key of the NCCL communicator it is a rank of (see `agree`).
    pub(crate) fn clique(&self) -> u64 {
        self.clique
    }

    /// How many collectives were queued on it so far.
    #[inline]
    pub(crate) fn collectives(&self) -> u64 {
        self.seq.get()
    }

    /// One more collective queued.
    #[inline]
    pub(crate) fn count_collective(&self) {
        self.seq.set(self.seq.get().wrapping_add(1));
    }

    /// Take back the count of a send or receive that was not queued.
    #[cold]
    pub(crate) fn uncount_p2p(&self, peer: usize, sent: bool) {
        let i = if sent {
            Some(peer)
        } else {
            self.info.size.checked_add(peer)
        };
        if let Some(c) = i.and_then(|i| self.p2p.get(i)) {
            c.set(c.get().wrapping_sub(1));
        }
    }

    /// Count one send to (`sent`) or receive from `peer`: which one it is
    /// (`None` when this communicator does not count them).
    #[inline]
    pub(crate) fn count_p2p(&self, peer: usize, sent: bool) -> Option<u64> {
        let i = if sent {
            peer
        } else {
            self.info.size.checked_add(peer)?
        };
        let c = self.p2p.get(i)?;
        let seq = c.get();
        c.set(seq.wrapping_add(1));
        Some(seq)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.aborted.get() {
            return;
        }
        if self.ledger.revoked.get() {
            // Revoked: NCCL's work on it was stopped and only a bounded abort
            // is left to make (no finalize of a revoked communicator).
            self.abort();
            return;
        }
        if self.init_not_ended() {
            // Its init is queued in a group that is still open (here or on
            // another thread): neither a finalize nor an abort may race it
            // (NCCL runs an abort's reclaim beside the init). Leak it.
            crate::error::report_line(format_args!(
                "NCCL communicator ({}): dropped before the group it was made in \
                 ended; leaked (not finalized)",
                self.info
            ));
            return;
        }
        if in_group() {
            // A finalize queued into the open group would complete only at its
            // end, after the destroy below: abort instead (bounded, and
            // deferred to the group's end should a group still list it).
            crate::error::report_line(format_args!(
                "NCCL communicator ({}): dropped inside `group`; aborted",
                self.info
            ));
            self.abort();
            return;
        }
        let start = Instant::now();
        let deadline = bound_deadline_at(start, self.drop_timeout, Duration::ZERO);
        let job = DropJob {
            lib: self.lib,
            comm: Handle(self.raw),
            info: self.info,
            ctx: Arc::clone(&self.ctx),
            serial: self.serial.clone(),
            streams: std::mem::take(self.streams.get_mut()),
            blocking: self.blocking,
            last_op: self.last_op.get(),
            timeout: self.drop_timeout,
            start,
            deadline,
        };
        let (info, last_op, timeout) = (self.info, self.last_op.get(), self.drop_timeout);
        self.ctx.release_with(
            self.made,
            format_args!("NCCL communicator ({info})"),
            |_, _| {
                // NCCL's finalize, destroy and abort can wait for the device's
                // queued work (any stream of the device): run them on a helper
                // thread and wait for it at most the drop timeout (plus the
                // grace an abort past it gets).
                let report = |line: Option<String>| {
                    if let Some(line) = line {
                        crate::error::report_line(format_args!("{line}"));
                    }
                };
                let wait_until = deadline.checked_add(ABORT_GRACE).unwrap_or(deadline);
                match on_helper(wait_until, move || job.run(), report) {
                    Helped::Done(line) => report(line),
                    Helped::Running => crate::error::report_line(format_args!(
                        "NCCL communicator ({info}): its teardown (its work ({last_op}), \
                         ncclCommFinalize and ncclCommDestroy, or ncclCommAbort past the \
                         drop timeout {timeout:?}) had not returned after {:?}; leaked to \
                         a helper thread that finishes it (NCCL waits for the device's \
                         queued work)",
                        start.elapsed()
                    )),
                    Helped::NotStarted(e) => crate::error::report_line(format_args!(
                        "NCCL communicator ({info}): leaked (not finalized): no helper \
                         thread for its teardown could be started ({e}), and on this \
                         thread it could block without bound"
                    )),
                }
            },
        );
    }
}
