//! [`Communicator`]: init (by rank, for several devices of one
//! process, by split), what a communicator is, asynchronous errors, the bounded
//! wait, abort, and the bounded teardown in Drop.

use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use metrale_cuda_sys::nccl::{self as raw, ncclComm_t, ncclResult_t, Nccl};

use crate::context::{AsContext, CudaContext, Generation};
use crate::error::Result;
use crate::stream::CudaStream;

use super::config::{env_blocking, CommConfig};
use super::error::{
    self, call_error, into_error, missing, refused, CommInfo, NcclError, NcclStatus,
};
use super::state::{in_group, is_listed, DeferredAbort};
use super::teardown::{
    abort_bounded, abort_raw, backoff, bound_deadline, bound_deadline_at, on_helper, settle,
    DropJob, Handle, Helped, Settled, ABORT_GRACE,
};
use super::{lib, NcclId};

/// One rank's NCCL communicator, on one device.
///
/// Collectives are methods (`all_reduce`, `broadcast`, ...) taking typed device
/// memory and a [`CudaStream`] of the communicator's device; [`group`](super::group)
/// lets one thread queue work on several communicators at once.
///
/// `Send`, not `Sync`: NCCL communicators are not thread-safe, so one thread at a
/// time uses it (move it to the thread that drives its rank). A communicator
/// split with shared resources ([`CommConfig::split_share`]) and its parent
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
    raw: ncclComm_t,
    lib: &'static Nccl,
    ctx: Arc<CudaContext>,
    made: Generation,
    info: CommInfo,
    blocking: bool,
    /// Whether its children share its resources (`splitShare`, as NCCL decides).
    split_share: bool,
    timeout: Option<Duration>,
    drop_timeout: Duration,
    /// Aborted for metrale: set before NCCL's abort starts (which may go on on
    /// a helper thread, or wait for the end of a group that lists it), so no
    /// NCCL call is made on the handle from then on.
    aborted: Cell<bool>,
    /// Which NCCL communicator this is a rank of, as far as this process can
    /// tell (the id and size of `init_rank`, one `init_all`, a split's parent
    /// and color): ranks of one key queued in one group are checked to agree.
    clique: u64,
    /// How many collectives were queued (metrale's count, zero-length ones
    /// included: every rank counts the same calls), for the agreement check.
    seq: Cell<u64>,
    /// How many splits were made of this communicator (a child's key).
    splits: Cell<u64>,
    /// Sends to each peer, then receives from each peer, so far (made at init
    /// for at most `agree::P2P_CHECKED_RANKS` ranks, empty above: then sends
    /// and receives are not checked).
    p2p: Box<[Cell<u64>]>,
    /// Every stream this communicator queued work on (each once), so Drop can
    /// wait for that work before a blocking finalize.
    streams: RefCell<Vec<CudaStream>>,
    /// The last operation queued, for the text of a timed-out wait.
    last_op: Cell<&'static str>,
    /// A non-blocking init made inside a group, not yet polled to completion.
    unsettled: Cell<bool>,
    /// Made inside a group: usable only in that group (its thread) until the
    /// group ends, when NCCL runs the init.
    group_init: Option<Arc<super::state::GroupInit>>,
    /// Shared with the parent or children this communicator shares resources
    /// with (`splitShare`): NCCL forbids using them concurrently, so every NCCL
    /// call on any of them holds it. `None` (no lock taken) otherwise.
    serial: Option<Arc<Mutex<()>>>,
    /// The strings the config handed to NCCL (`commName`, `netName`): NCCL keeps
    /// the pointers for the communicator's life.
    _names: Vec<CString>,
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

/// How many streams a communicator keeps before it lets go of those nobody
/// else holds.
const KEPT_STREAMS: usize = 8;

impl Communicator {
    /// Join the communicator `id` names as `rank` of `nranks`, on `ctx`'s device
    /// (`ncclCommInitRankConfig`). Every rank calls this, each with its own
    /// device, in this process (one thread per rank, or inside one
    /// [`group`](super::group)) or in others.
    ///
    /// # Errors
    /// [`NcclError::Refused`] for a rank not below `nranks` or a bad config
    /// value (before NCCL); the library's load error; the call's status with
    /// `ncclGetLastError`'s text; for a non-blocking communicator, an
    /// asynchronous error or the timeout (the communicator is then aborted).
    pub fn init_rank(
        id: &NcclId,
        nranks: usize,
        rank: usize,
        ctx: &impl AsContext,
        config: &CommConfig,
    ) -> Result<Communicator> {
        const CALL: &str = "ncclCommInitRankConfig";
        let ctx = ctx.context();
        let info = CommInfo {
            rank,
            size: nranks,
            device: ctx.ordinal(),
        };
        let (n, r) = match (i32::try_from(nranks), i32::try_from(rank)) {
            (Ok(n), Ok(r)) if nranks >= 1 && rank < nranks => (n, r),
            _ => {
                return Err(refused(
                    CALL,
                    None,
                    format!("rank {rank} is not below the number of ranks {nranks} (at least 1)"),
                ))
            }
        };
        let (mut cfg, names) = config.to_raw(CALL)?;
        let lib = lib()?;
        let f = lib
            .ncclCommInitRankConfig()
            .map_err(|m| missing(m, Some(info)))?;
        ctx.bind()?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; the config outlives the call
        // and the strings it points to the communicator (kept in it); the device
        // is the current context's.
        let status = unsafe { f(&mut comm, n, id.to_raw(), r, &mut cfg) };
        let serial = config
            .effective_split_share()
            .then(|| Arc::new(Mutex::new(())));
        Communicator::made(
            lib,
            comm,
            status,
            CALL,
            ctx,
            info,
            config,
            Made {
                blocking: config.effective_blocking(),
                serial,
                names,
                clique: super::agree::clique_of_id(id, nranks),
            },
        )
    }

    /// One communicator per context, all of this process (`ncclCommInitAll`):
    /// rank `i` is on `contexts[i]`'s device. For one process driving several
    /// GPUs; queue their collectives inside one [`group`](super::group).
    ///
    /// # Errors
    /// [`NcclError::Refused`] for no context or a device given twice; the call's
    /// status.
    pub fn init_all(contexts: &[Arc<CudaContext>]) -> Result<Vec<Communicator>> {
        const CALL: &str = "ncclCommInitAll";
        if contexts.is_empty() {
            return Err(refused(CALL, None, "no context given"));
        }
        let mut devices = Vec::with_capacity(contexts.len());
        for (i, c) in contexts.iter().enumerate() {
            if contexts[..i].iter().any(|o| Arc::ptr_eq(o, c)) {
                return Err(refused(
                    CALL,
                    None,
                    format!(
                        "device {} is given twice (one rank per device)",
                        c.ordinal()
                    ),
                ));
            }
            let d = i32::try_from(c.ordinal())
                .map_err(|_| refused(CALL, None, "device ordinal too large"))?;
            devices.push(d);
        }
        let n =
            i32::try_from(contexts.len()).map_err(|_| refused(CALL, None, "too many devices"))?;
        let lib = lib()?;
        let f = lib.ncclCommInitAll().map_err(|m| missing(m, None))?;
        if let Some(first) = contexts.first() {
            first.bind()?;
        }
        let mut comms: Vec<ncclComm_t> = vec![std::ptr::null_mut(); contexts.len()];
        // SAFETY: writes one handle per device; the device list has `n` entries.
        let status = unsafe { f(comms.as_mut_ptr(), n, devices.as_ptr()) };
        if !status.is_success() {
            for &c in comms.iter().filter(|c| !c.is_null()) {
                abort_raw(lib, c);
            }
            return Err(call_error(lib, CALL, status, std::ptr::null_mut(), None));
        }
        let config = CommConfig::new();
        let clique = super::agree::fresh_clique();
        // ncclCommInitAll's communicators block unless NCCL_COMM_BLOCKING=0.
        let blocking = config.effective_blocking();
        Ok(comms
            .into_iter()
            .zip(contexts)
            .enumerate()
            .map(|(rank, (raw, ctx))| {
                Communicator::wrap(
                    lib,
                    raw,
                    ctx,
                    CommInfo {
                        rank,
                        size: contexts.len(),
                        device: ctx.ordinal(),
                    },
                    &config,
                    Made {
                        blocking,
                        serial: config
                            .effective_split_share()
                            .then(|| Arc::new(Mutex::new(()))),
                        names: Vec::new(),
                        clique,
                    },
                )
            })
            .collect())
    }

    /// Split this communicator (`ncclCommSplit`): every rank calls it; ranks of
    /// one `color` form a new communicator, ordered by `key` (then by their rank
    /// here). `None` as the color takes no part (`NCCL_SPLIT_NOCOLOR`) and gives
    /// `Ok(None)`.
    ///
    /// Splits are blocking: a non-blocking parent, a non-blocking config, or
    /// `NCCL_COMM_BLOCKING=0` is refused (NCCL would write the new handle after
    /// the call returned). With shared resources (the parent's
    /// [`CommConfig::split_share`], or `NCCL_COMM_SPLIT_SHARE_RESOURCES=1`) the
    /// child and the parent take turns on one lock for every NCCL call.
    ///
    /// # Errors
    /// A color above `i32::MAX`, an aborted communicator, a call inside
    /// [`group`](super::group) (NCCL would write the new handle at the group's
    /// end), a non-blocking split (all before NCCL); the call's status.
    pub fn split(
        &self,
        color: Option<u32>,
        key: i32,
        config: &CommConfig,
    ) -> Result<Option<Communicator>> {
        const CALL: &str = "ncclCommSplit";
        self.enter(CALL)?;
        if in_group() {
            return Err(refused(
                CALL,
                Some(self.info),
                "split inside `group` is not supported: NCCL writes the new communicator \
                 when the group ends, after this call has returned; split outside the group",
            ));
        }
        let c = match color {
            None => raw::NCCL_SPLIT_NOCOLOR,
            Some(c) => i32::try_from(c).map_err(|_| {
                refused(
                    CALL,
                    Some(self.info),
                    format!("color {c} is above i32::MAX"),
                )
            })?,
        };
        let (mut cfg, names) = config.to_raw(CALL)?;
        // NCCL writes the new handle of a non-blocking split when the split
        // completes, after this call has returned: the handle's storage would be
        // gone. Splits are blocking (inheriting a non-blocking parent's mode would
        // make them non-blocking); asking for a non-blocking one is refused.
        if !self.blocking {
            return Err(into_error(NcclError::Refused {
                call: "ncclCommSplit",
                reason: "splitting a non-blocking communicator is not supported: NCCL \
                         writes the new communicator after the call returns (seen with \
                         NCCL 2.28.3); split a blocking communicator"
                    .to_owned(),
                comm: Some(self.info),
            }));
        }
        if config.blocking == Some(false) || env_blocking() == Some(false) {
            return Err(into_error(NcclError::Refused {
                call: "ncclCommSplit",
                reason: "a non-blocking split is not supported: NCCL writes the new \
                         communicator after the call returns; split with a blocking \
                         config, and without NCCL_COMM_BLOCKING=0 (the new communicator \
                         can be made non-blocking only by its own init)"
                    .to_owned(),
                comm: Some(self.info),
            }));
        }
        cfg.blocking = 1;
        let f = self
            .lib
            .ncclCommSplit()
            .map_err(|m| missing(m, Some(self.info)))?;
        self.ctx.bind()?;
        // Every rank counts this split, with a color or without: the children
        // of one split share a key (see `agree`).
        let split_index = self.splits.get();
        self.splits.set(split_index.wrapping_add(1));
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let status = {
            let _turn = self.turn();
            // SAFETY: a live communicator; writes one handle, before the call
            // returns (a blocking split, outside any group: both checked); the
            // config outlives the call and its strings the child (kept in it).
            unsafe { f(self.raw, c, key, &mut comm, &mut cfg) }
        };
        if comm.is_null() && (status.is_success() || status == ncclResult_t::ncclInProgress) {
            return Ok(None);
        }
        // A child of a parent that shares its resources takes turns with it;
        // one that will share its own with its children gets a lock of its own.
        let serial = match &self.serial {
            Some(shared) if self.split_share => Some(Arc::clone(shared)),
            _ => config
                .effective_split_share()
                .then(|| Arc::new(Mutex::new(()))),
        };
        let child_config = config.clone().blocking(true);

        let mut made = Communicator::made(
            self.lib,
            comm,
            status,
            CALL,
            &self.ctx,
            self.info,
            &child_config,
            Made {
                blocking: child_config.effective_blocking(),
                serial,
                names,
                clique: super::agree::clique_of_split(self.clique, split_index, c),
            },
        )?;
        made.info.rank = made.query(CALL, |l| l.ncclCommUserRank())?;
        made.info.size = made.query(CALL, |l| l.ncclCommCount())?;
        made.p2p = p2p_counters(made.info.size);
        Ok(Some(made))
    }

    /// The communicator an init call made (or the error, the handle aborted).
    #[allow(clippy::too_many_arguments)]
    fn made(
        lib: &'static Nccl,
        comm: ncclComm_t,
        status: ncclResult_t,
        call: &'static str,
        ctx: &Arc<CudaContext>,
        info: CommInfo,
        config: &CommConfig,
        parts: Made,
    ) -> Result<Communicator> {
        let in_progress = status == ncclResult_t::ncclInProgress;
        if !status.is_success() && !in_progress {
            let e = call_error(lib, call, status, comm, Some(info));
            if !comm.is_null() {
                abort_raw(lib, comm);
            }
            return Err(e);
        }
        if comm.is_null() {
            return Err(call_error(
                lib,
                call,
                ncclResult_t::ncclInternalError,
                comm,
                Some(info),
            ));
        }
        let made = Communicator::wrap(lib, comm, ctx, info, config, parts);
        if in_progress {
            if in_group() {
                made.unsettled.set(true);
            } else {
                made.settle_call(call)?;
            }
        }
        Ok(made)
    }

    fn wrap(
        lib: &'static Nccl,
        raw: ncclComm_t,
        ctx: &Arc<CudaContext>,
        info: CommInfo,
        config: &CommConfig,
        parts: Made,
    ) -> Communicator {
        Communicator {
            raw,
            lib,
            ctx: Arc::clone(ctx),
            made: ctx.generation(),
            info,
            blocking: parts.blocking,
            split_share: config.effective_split_share(),
            timeout: config.timeout,
            drop_timeout: config.drop_timeout,
            aborted: Cell::new(false),
            clique: parts.clique,
            seq: Cell::new(0),
            splits: Cell::new(0),
            p2p: p2p_counters(info.size),
            streams: RefCell::new(Vec::new()),
            last_op: Cell::new("no operation"),
            unsettled: Cell::new(false),
            group_init: in_group().then(super::state::GroupInit::pending),
            serial: parts.serial,
            _names: parts.names,
        }
    }

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
    fn failed(&self, call: &'static str, status: ncclResult_t) -> crate::error::MetraleError {
        let _turn = self.turn();
        call_error(self.lib, call, status, self.raw, Some(self.info))
    }

    /// An int NCCL tells about the communicator (rank, count).
    fn query(
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
    /// [`CommConfig::blocking`]).
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

    /// `ncclCommGetAsyncError`: [`NcclStatus::SUCCESS`],
    /// [`NcclStatus::IN_PROGRESS`] (a non-blocking operation still running), or
    /// the error a peer or the network caused ([`NcclStatus::is_error`]).
    ///
    /// # Errors
    /// An aborted communicator; the query's own failure.
    pub fn async_status(&self) -> Result<NcclStatus> {
        self.async_raw().map(NcclStatus::from)
    }

    fn async_raw(&self) -> Result<ncclResult_t> {
        const CALL: &str = "ncclCommGetAsyncError";
        self.enter(CALL)?;
        let f = self
            .lib
            .ncclCommGetAsyncError()
            .map_err(|m| missing(m, Some(self.info)))?;
        let mut state = ncclResult_t::ncclSuccess;
        let status = {
            let _turn = self.turn();
            // SAFETY: a live communicator; writes one status.
            unsafe { f(self.raw, &mut state) }
        };
        if !status.is_success() {
            return Err(self.failed(CALL, status));
        }
        Ok(state)
    }

    /// `Ok` unless [`async_status`](Self::async_status) reports an error; then
    /// the communicator is aborted and the error says so.
    ///
    /// # Errors
    /// [`NcclError::Async`]; the query's own failure.
    pub fn check_async(&self) -> Result<()> {
        let state = self.async_raw()?;
        if state.is_success() || state == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        Err(self.async_failure("ncclCommGetAsyncError", state))
    }

    /// Wait until the work queued on `stream` (this communicator's collectives
    /// among it) has finished, or `timeout` passed, polling the stream and
    /// `ncclCommGetAsyncError`. Past the timeout, or on an asynchronous error,
    /// the communicator is aborted (`ncclCommAbort`) and the error names the
    /// operation last queued; the communicator cannot be used again.
    ///
    /// The timeout is a bound: NCCL's abort can wait for the device's queued
    /// work, so it runs on a helper thread and this returns at most 200 ms
    /// after the timeout (one line on stderr when the abort goes on alone).
    ///
    /// # Errors
    /// [`NcclError::Timeout`], [`NcclError::Async`]; a stream of another device,
    /// being captured through metrale, or a call inside [`group`](super::group)
    /// (its work reaches the stream only when the group ends, so the stream
    /// would read idle before it ran), all refused before anything is polled;
    /// a failed stream query (a fault of the work).
    pub fn wait(&self, stream: &CudaStream, timeout: Duration) -> Result<()> {
        const CALL: &str = "wait";
        self.enter(CALL)?;
        if in_group() {
            return Err(refused(
                CALL,
                Some(self.info),
                "a wait inside `group` is refused: the group's work reaches the stream \
                 only when the group ends, so the stream would read idle before that work \
                 ran; wait after the group",
            ));
        }
        self.check_stream(CALL, stream)?;
        {
            let section = stream.section();
            stream.refuse_if_capturing(&section, "a bounded wait on a communicator")?;
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let state = self.async_raw()?;
            if !state.is_success() && state != ncclResult_t::ncclInProgress {
                return Err(self.async_failure("wait", state));
            }
            if stream.query()? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                let pending = self.last_op.get();
                // (The time waited for the work, not for the abort after it.)
                self.abort_within(Duration::ZERO);
                return Err(into_error(NcclError::Timeout {
                    pending: pending.to_owned(),
                    waited,
                    comm: self.info,
                }));
            }
            backoff(&mut spins);
        }
    }

    /// Abort the communicator (`ncclCommAbort`): NCCL stops its pending work and
    /// frees it. Later calls are refused with [`NcclError::Aborted`]; Drop does
    /// nothing more. Aborting twice does nothing.
    ///
    /// Bounded: NCCL's abort can wait for the device's queued work (on any
    /// stream of the device), so it runs on a helper thread, and this returns
    /// when it has finished or at the latest the config's
    /// [`drop_timeout`](CommConfig::drop_timeout) plus 200 ms after the call;
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
        if crate::context::in_host_function() {
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
    fn async_failure(&self, during: &str, state: ncclResult_t) -> crate::error::MetraleError {
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
        if crate::context::in_host_function() {
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
                // Streams only this list still holds: their owners are done
                // with them, so keep them from piling up (a new stream per step).
                streams.retain(|s| !s.is_last_handle());
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

/// The per-peer send and receive counters of a communicator of `size` ranks
/// (none above `agree::P2P_CHECKED_RANKS`).
fn p2p_counters(size: usize) -> Box<[Cell<u64>]> {
    if size > super::agree::P2P_CHECKED_RANKS {
        return Box::new([]);
    }
    (0..2 * size).map(|_| Cell::new(0)).collect()
}

/// What an init decided about the communicator it made.
struct Made {
    /// Whether it blocks, as NCCL decided (the environment over the config).
    blocking: bool,
    /// The lock shared with a parent or children (see `Communicator::serial`).
    serial: Option<Arc<Mutex<()>>>,
    /// The config's strings, kept as long as the communicator.
    names: Vec<CString>,
    /// The key of the NCCL communicator it is a rank of (see `Communicator::clique`).
    clique: u64,
}
