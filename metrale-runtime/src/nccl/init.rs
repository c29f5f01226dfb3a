//! The inits of a [`Communicator`]: by rank, for several devices of one process,
//! and by split.

use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::sync::{Arc, Mutex};

use metrale_cuda_sys::nccl::{self as raw, ncclComm_t, ncclResult_t, Nccl};

use crate::context::{AsContext, CudaContext};
use crate::error::Result;

use super::comm::Communicator;
use super::config::{env_blocking, CommConfig};
use super::error::{call_error, into_error, missing, refused, CommInfo, NcclError};
use super::state::in_group;
use super::teardown::abort_raw;
use super::{lib, NcclId};

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
        let clique = super::agree::clique_of_id(id, nranks);
        let id = id.to_raw();
        Communicator::init_by_rank(
            "ncclCommInitRankConfig",
            (nranks, rank),
            ctx.context(),
            config,
            clique,
            |lib, comm, n, r, cfg| {
                let f = lib.ncclCommInitRankConfig()?;
                // SAFETY: writes one communicator handle; the config outlives
                // the call and the strings it points to the communicator (kept
                // in it); the device is the current context's.
                Ok(unsafe { f(comm, n, id, r, cfg) })
            },
        )
    }

    /// The init of one rank by `call`, which `init` makes (handed the library,
    /// where to write the handle, the number of ranks, the rank and the
    /// config; the context current): the checks, the config, and the
    /// communicator made of the outcome.
    pub(super) fn init_by_rank(
        call: &'static str,
        (nranks, rank): (usize, usize),
        ctx: &Arc<CudaContext>,
        config: &CommConfig,
        clique: u64,
        init: impl FnOnce(
            &'static Nccl,
            &mut ncclComm_t,
            i32,
            i32,
            &mut raw::ncclConfig_t,
        )
            -> std::result::Result<ncclResult_t, metrale_cuda_sys::LibraryMissingSymbol>,
    ) -> Result<Communicator> {
        let info = CommInfo {
            rank,
            size: nranks,
            device: ctx.ordinal(),
        };
        let (n, r) = match (i32::try_from(nranks), i32::try_from(rank)) {
            (Ok(n), Ok(r)) if nranks >= 1 && rank < nranks => (n, r),
            _ => {
                return Err(refused(
                    call,
                    None,
                    format!("rank {rank} is not below the number of ranks {nranks} (at least 1)"),
                ))
            }
        };
        let (mut cfg, names) = config.to_raw(call)?;
        let lib = lib()?;
        ctx.bind()?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let status = init(lib, &mut comm, n, r, &mut cfg).map_err(|m| missing(m, Some(info)))?;
        let serial = config
            .effective_split_share()
            .then(|| Arc::new(Mutex::new(())));
        Communicator::made(
            lib,
            comm,
            status,
            call,
            ctx,
            info,
            config,
            Made {
                blocking: config.effective_blocking(),
                serial,
                names,
                clique,
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
    pub(super) fn made(
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
            ledger: super::ledger::Ledger::default(),
        }
    }
}

/// The per-peer send and receive counters of a communicator of `size` ranks
/// (none above `agree::P2P_CHECKED_RANKS`).
pub(super) fn p2p_counters(size: usize) -> Box<[Cell<u64>]> {
    if size > super::agree::P2P_CHECKED_RANKS {
        return Box::new([]);
    }
    (0..2 * size).map(|_| Cell::new(0)).collect()
}

/// What an init decided about the communicator it made.
pub(super) struct Made {
    /// Whether it blocks, as NCCL decided (the environment over the config).
    pub(super) blocking: bool,
    /// The lock shared with a parent or children (see `Communicator::serial`).
    pub(super) serial: Option<Arc<Mutex<()>>>,
    /// The config's strings, kept as long as the communicator.
    pub(super) names: Vec<CString>,
    /// The key of the NCCL communicator it is a rank of (see `Communicator::clique`).
    pub(super) clique: u64,
}
