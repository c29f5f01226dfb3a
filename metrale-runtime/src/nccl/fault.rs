//! Fault tolerance past abort: [`Communicator::revoke`] (`ncclCommRevoke`,
//! NCCL 2.28), [`Communicator::shrink`] (`ncclCommShrink`, NCCL 2.27), the
//! revoking bounded wait's failure ([`OnFailure::Revoke`](super::OnFailure)),
//! and [`Communicator::init_rank_scalable`] (`ncclCommInitRankScalable`,
//! NCCL 2.23), each version-gated against the loaded library.
//!
//! Invariants:
//! - A revoked communicator refuses collectives, registrations and new
//!   reductions ([`NcclError::Revoked`]); shrink, its status and Drop remain
//!   (Drop aborts it, bounded, instead of finalizing).
//! - The revoke runs on a helper thread, bounded by the drop timeout (a
//!   revoking wait: by 200 ms), like NCCL's abort: one still running then
//!   leaves the communicator aborted for metrale, and the helper aborts it
//!   when the revoke returns, so every timeout stays a bound.
//! - Shrink is checked before NCCL: every excluded rank is a rank, none given
//!   twice, and not this one (the excluded ranks do not call it); it is
//!   collective over the ranks that stay, blocking, and refused inside a
//!   group, like split. A revoked (or healthy) communicator shrinks with
//!   `NCCL_SHRINK_DEFAULT`; one whose asynchronous status reports an error
//!   (a peer failed) with `NCCL_SHRINK_ABORT`, which stops its in-flight work
//!   first.

use std::sync::Arc;
use std::time::{Duration, Instant};

use metrale_cuda_sys::nccl::{self as raw, ncclComm_t, ncclResult_t};

use crate::context::{AsContext, CudaContext};
use crate::error::{MetraleError, Result};

use super::comm::Communicator;
use super::config::{env_blocking, CommConfig};
use super::error::{
    description, into_error, last_error, missing, refused, require_version, CommInfo, NcclError,
};
use super::init::{p2p_counters, Made};
use super::state::in_group;
use super::teardown::{abort_raw, backoff, bound_deadline, on_helper, Handle, Helped};
use super::NcclId;

/// The first NCCL with `ncclCommRevoke`.
pub(super) const REVOKE_SINCE: (u32, u32, u32) = (2, 28, 0);
/// The first NCCL with `ncclCommShrink`.
pub(super) const SHRINK_SINCE: (u32, u32, u32) = (2, 27, 0);
/// The first NCCL with `ncclCommInitRankScalable`.
pub(super) const SCALABLE_SINCE: (u32, u32, u32) = (2, 23, 0);

impl Communicator {
    /// Whether the communicator was revoked ([`revoke`](Self::revoke), or a
    /// revoking wait).
    pub fn is_revoked(&self) -> bool {
        self.ledger.revoked.get()
    }

    /// Refuse `call` on a revoked communicator.
    #[inline]
    pub(crate) fn refuse_revoked(&self, call: &'static str) -> Result<()> {
        if self.ledger.revoked.get() {
            return Err(into_error(NcclError::Revoked {
                call,
                comm: self.info(),
            }));
        }
        Ok(())
    }

    /// Revoke the communicator (`ncclCommRevoke`, NCCL 2.28 or newer): NCCL
    /// stops its in-flight work, on the device too (work a graph replay queued
    /// included, which no host-side check reaches), and it refuses new work.
    /// The ranks that stay then [`shrink`](Self::shrink) it; Drop aborts it.
    /// Revoking twice does nothing; a revoke NCCL failed leaves the
    /// communicator not revoked ([`is_revoked`](Self::is_revoked) false), and
    /// the next revoke calls NCCL again.
    ///
    /// Bounded like [`abort`](Self::abort): NCCL's call runs on a helper
    /// thread, waited for at most the drop timeout plus 200 ms; past that the
    /// communicator counts as aborted and the helper aborts it when the revoke
    /// returns.
    ///
    /// # Errors
    /// [`NcclError::Unsupported`] on an NCCL older than 2.28; an aborted
    /// communicator, inside a group or a host function (before NCCL);
    /// NCCL's status; [`NcclError::Timeout`] past the bound.
    pub fn revoke(&self) -> Result<()> {
        self.revoke_within(self.drop_timeout)
    }

    fn revoke_within(&self, bound: Duration) -> Result<()> {
        const CALL: &str = "ncclCommRevoke";
        if self.ledger.revoked.get() {
            return Ok(());
        }
        self.enter(CALL)?;
        if in_group() {
            return Err(refused(
                CALL,
                Some(self.info()),
                "revoke inside `group` is refused: the group's work is launched at its end; \
                 revoke after the group",
            ));
        }
        require_version(self.lib(), CALL, REVOKE_SINCE, Some(self.info()))?;
        let f = self
            .lib()
            .ncclCommRevoke()
            .map_err(|m| missing(m, Some(self.info())))?;
        // Marked revoked only once NCCL took the revoke (below): a failed
        // call leaves it as it was, and a second revoke calls NCCL again. No
        // collective can be queued on it meanwhile: this thread is in here,
        // and the communicator is not `Sync`.
        let (lib, info) = (self.lib(), self.info());
        let handle = Handle(self.raw_handle());
        let ctx: Arc<CudaContext> = Arc::clone(self.context());
        let serial = self.serial().cloned();
        let start = Instant::now();
        // `bound` plus the grace, as an abort's.
        let wait_until = bound_deadline(bound);
        let job = move || {
            let handle = handle;
            if let Err(e) = ctx.bind() {
                return (Err(e), handle);
            }
            let _turn = serial
                .as_ref()
                .map(|m| m.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
            // SAFETY: a live communicator (checked before the hand-over); its
            // owner makes no NCCL call on it until this returns, or (past the
            // bound) never again: it is then marked aborted, and `late` aborts
            // it here. Flags 0 (`NCCL_REVOKE_DEFAULT`).
            let status = unsafe { f(handle.0, 0) };
            (Ok(status), handle)
        };
        let late = move |(_, handle): (Result<ncclResult_t>, Handle)| {
            abort_raw(lib, handle.0);
            crate::error::report_line(format_args!(
                "NCCL communicator ({info}): its late ncclCommRevoke returned; the \
                 communicator was aborted"
            ));
        };
        match on_helper(wait_until, job, late) {
            Helped::Done((Ok(status), _)) if status == ncclResult_t::ncclInProgress => {
                // NCCL took it and is stopping the work: revoked from here
                // on, whatever the polling says.
                self.ledger.revoked.set(true);
                self.settle_revoke(wait_until)
            }
            Helped::Done((Ok(status), _)) if status.is_success() => {
                self.ledger.revoked.set(true);
                Ok(())
            }
            Helped::Done((Ok(status), _)) => Err(self.failed(CALL, status)),
            Helped::Done((Err(e), _)) => Err(e),
            Helped::Running => {
                self.aborted.set(true);
                Err(into_error(NcclError::Timeout {
                    pending: CALL.to_owned(),
                    waited: start.elapsed(),
                    comm: info,
                }))
            }
            Helped::NotStarted(e) => {
                self.aborted.set(true);
                crate::error::report_line(format_args!(
                    "NCCL communicator ({info}): leaked, not revoked: no helper thread could \
                     be started ({e})"
                ));
                Err(refused(
                    CALL,
                    Some(info),
                    format!("no helper thread could be started ({e}); the communicator was leaked"),
                ))
            }
        }
    }

    /// Poll a non-blocking revoke until NCCL no longer says in progress (an
    /// error it reports is the failure the revoke answers, not the revoke's),
    /// until `deadline`: past it the communicator is aborted.
    fn settle_revoke(&self, deadline: Instant) -> Result<()> {
        let mut spins = 0u32;
        loop {
            if self.async_status()? != super::NcclStatus::IN_PROGRESS {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.abort_within(Duration::ZERO);
                return Err(into_error(NcclError::Timeout {
                    pending: "ncclCommRevoke".to_owned(),
                    waited: self.drop_timeout,
                    comm: self.info(),
                }));
            }
            backoff(&mut spins);
        }
    }

    /// The error of a failed revoking wait: revoke (bounded by the grace), and
    /// say what failed; when the revoke cannot be made, abort after all and
    /// say why.
    #[cold]
    pub(super) fn revoked_wait(
        &self,
        status: Option<ncclResult_t>,
        waited: Duration,
    ) -> MetraleError {
        let pending = self.last_op.get().to_owned();
        let (description, last_error) = match status {
            Some(st) => {
                let _turn = self.turn();
                (
                    description(self.lib(), st),
                    last_error(self.lib(), self.raw_handle()),
                )
            }
            None => (String::new(), String::new()),
        };
        if let Err(e) = self.revoke_within(Duration::ZERO) {
            self.abort_within(Duration::ZERO);
            return e;
        }
        into_error(NcclError::WaitRevoked {
            pending,
            waited,
            status,
            description,
            last_error,
            comm: self.info(),
        })
    }

    /// A new communicator of the ranks that stay (`ncclCommShrink`, NCCL 2.27
    /// or newer): every rank not in `excluded` calls it with the same list
    /// (the excluded ones, failed or leaving, do not); ranks are renumbered in
    /// order. Typically after a revoke (a revoking [`wait_with`](Self::wait_with),
    /// or [`revoke`](Self::revoke)) when a peer died.
    ///
    /// Blocking (and collective over the ranks that stay), like
    /// [`split`](Self::split): a non-blocking communicator or config is
    /// refused. The flags are chosen from the state: `NCCL_SHRINK_DEFAULT`
    /// when revoked or healthy, `NCCL_SHRINK_ABORT` when NCCL reports an
    /// asynchronous error (a peer failed, not yet revoked).
    ///
    /// # Errors
    /// [`NcclError::Unsupported`] on an NCCL older than 2.27; refused before
    /// NCCL: a rank that is not one, given twice, or this rank; inside a
    /// group; a non-blocking shrink; an aborted communicator; NCCL's status.
    pub fn shrink(&self, excluded: &[usize], config: &CommConfig) -> Result<Communicator> {
        const CALL: &str = "ncclCommShrink";
        self.enter(CALL)?;
        let info = self.info();
        if in_group() {
            return Err(refused(
                CALL,
                Some(info),
                "shrink inside `group` is refused: NCCL writes the new communicator when the \
                 group ends, after this call has returned; shrink outside the group",
            ));
        }
        require_version(self.lib(), CALL, SHRINK_SINCE, Some(info))?;
        if excluded.is_empty() {
            // NCCL 2.28.3 answers ncclInvalidArgument (seen on the H200).
            return Err(refused(
                CALL,
                Some(info),
                "no rank to exclude: a shrink drops at least one rank (split the \
                 communicator for a copy of it)",
            ));
        }
        let mut list = Vec::with_capacity(excluded.len());
        for (i, &r) in excluded.iter().enumerate() {
            let reason = if r >= info.size {
                Some(format!(
                    "excluded rank {r} is not a rank (the communicator has {} ranks)",
                    info.size
                ))
            } else if excluded[..i].contains(&r) {
                Some(format!("rank {r} is excluded twice"))
            } else if r == info.rank {
                Some(format!(
                    "this rank ({r}) is excluded: only the ranks that stay call shrink"
                ))
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(refused(CALL, Some(info), reason));
            }
            list.push(i32::try_from(r).map_err(|_| refused(CALL, Some(info), "rank too large"))?);
        }
        if !self.blocking || config.blocking == Some(false) || env_blocking() == Some(false) {
            return Err(refused(
                CALL,
                Some(info),
                "a non-blocking shrink is not supported: NCCL writes the new communicator \
                 after the call returns; shrink a blocking communicator with a blocking \
                 config, and without NCCL_COMM_BLOCKING=0",
            ));
        }
        let (mut cfg, names) = config.to_raw(CALL)?;
        cfg.blocking = 1;
        let flags = if !self.is_revoked() && self.async_status()?.is_error() {
            raw::NCCL_SHRINK_ABORT as i32
        } else {
            raw::NCCL_SHRINK_DEFAULT as i32
        };
        let f = self
            .lib()
            .ncclCommShrink()
            .map_err(|m| missing(m, Some(info)))?;
        let n =
            i32::try_from(list.len()).map_err(|_| refused(CALL, Some(info), "too many ranks"))?;
        self.context().bind()?;
        // Every rank that stays counts this, as a split (the children's key).
        let index = self.splits.get();
        self.splits.set(index.wrapping_add(1));
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let status = {
            let _turn = self.turn();
            // SAFETY: a live (or revoked) communicator; the list holds `n`
            // ranks of it (checked); writes one handle before returning (a
            // blocking shrink outside any group: both checked); the config
            // outlives the call and its strings the child (kept in it).
            unsafe {
                f(
                    self.raw_handle(),
                    list.as_mut_ptr(),
                    n,
                    &mut comm,
                    &mut cfg,
                    flags,
                )
            }
        };
        let below = excluded.iter().filter(|&&r| r < info.rank).count();
        let child_info = CommInfo {
            rank: info.rank - below,
            size: info.size - excluded.len(),
            device: info.device,
        };
        let child_config = config.clone().blocking(true);
        let mut made = Communicator::made(
            self.lib(),
            comm,
            status,
            CALL,
            self.context(),
            child_info,
            &child_config,
            Made {
                blocking: true,
                serial: child_config
                    .effective_split_share()
                    .then(|| Arc::new(std::sync::Mutex::new(()))),
                names,
                clique: super::agree::clique_of_split(self.clique(), index, -2),
            },
        )?;
        made.info.rank = made.query(CALL, |l| l.ncclCommUserRank())?;
        made.info.size = made.query(CALL, |l| l.ncclCommCount())?;
        made.p2p = p2p_counters(made.info.size);
        Ok(made)
    }

    /// Join the communicator that several ids name together
    /// (`ncclCommInitRankScalable`, NCCL 2.23 or newer), as `rank` of
    /// `nranks`, on `ctx`'s device: for large jobs, whose bootstrap NCCL
    /// spreads over the ids' roots. Every rank gives the same ids, in the same
    /// order.
    ///
    /// # Errors
    /// [`NcclError::Unsupported`] on an older NCCL; refused before NCCL: no
    /// id, or more than `i32::MAX`, a rank not below `nranks`; as
    /// [`init_rank`](Self::init_rank) otherwise.
    pub fn init_rank_scalable(
        ids: &[NcclId],
        nranks: usize,
        rank: usize,
        ctx: &impl AsContext,
        config: &CommConfig,
    ) -> Result<Communicator> {
        const CALL: &str = "ncclCommInitRankScalable";
        let Some(first) = ids.first() else {
            return Err(refused(CALL, None, "no id given (at least one)"));
        };
        if ids.len() > nranks {
            // NCCL refuses it too (ncclInvalidArgument): each id is hosted by
            // one rank's bootstrap root.
            return Err(refused(
                CALL,
                None,
                format!(
                    "{} ids for {nranks} rank(s): at most one id per rank",
                    ids.len()
                ),
            ));
        }
        let n_ids =
            i32::try_from(ids.len()).map_err(|_| refused(CALL, None, "more than i32::MAX ids"))?;
        require_version(super::lib()?, CALL, SCALABLE_SINCE, None)?;
        let mut raw_ids: Vec<raw::ncclUniqueId> = ids.iter().map(|id| id.to_raw()).collect();
        let clique = ids
            .iter()
            .skip(1)
            .fold(super::agree::clique_of_id(first, nranks), |h, id| {
                h.rotate_left(7) ^ super::agree::clique_of_id(id, nranks)
            });
        Communicator::init_by_rank(
            CALL,
            (nranks, rank),
            ctx.context(),
            config,
            clique,
            |lib, comm, n, r, cfg| {
                let f = lib.ncclCommInitRankScalable()?;
                // SAFETY: writes one communicator handle; `raw_ids` holds
                // `n_ids` ids and outlives the call; the config outlives the
                // call and its strings the communicator (kept in it); the
                // device is the current context's.
                Ok(unsafe { f(comm, n, r, n_ids, raw_ids.as_mut_ptr(), cfg) })
            },
        )
    }
}
