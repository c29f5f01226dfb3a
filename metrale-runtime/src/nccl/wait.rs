//! A [`Communicator`]'s asynchronous status and the bounded wait.

use std::time::{Duration, Instant};

use metrale_cuda_sys::nccl::ncclResult_t;

use crate::error::Result;
use crate::stream::CudaStream;

use super::comm::Communicator;
use super::error::{into_error, missing, refused, NcclError, NcclStatus};
use super::state::in_group;
use super::teardown::backoff;

/// What a failed bounded wait ([`Communicator::wait_with`]) does to the
/// communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum OnFailure {
    /// Abort it (`ncclCommAbort`): it cannot be used again.
    #[default]
    Abort,
    /// Revoke it (`ncclCommRevoke`): its in-flight work stops; it can then
    /// only be shrunk ([`Communicator::shrink`]) or dropped.
    Revoke,
}

impl Communicator {
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
        self.wait_with(stream, timeout, OnFailure::Abort)
    }

    /// [`wait`](Self::wait), choosing what a failure does: with
    /// [`OnFailure::Revoke`] a timeout or an asynchronous error revokes the
    /// communicator (`ncclCommRevoke`, NCCL 2.28: its in-flight work stops,
    /// also work a graph replay queued, which no host-side check reaches)
    /// instead of aborting it, so the live ranks can
    /// [`shrink`](Self::shrink) it and go on. The revoke is bounded like the
    /// abort (a helper thread, the drop timeout).
    ///
    /// # Errors
    /// As `wait`; with `Revoke`, [`NcclError::WaitRevoked`] for the failure
    /// (and the revoke's own failure or version gate, then the communicator
    /// is aborted after all).
    pub fn wait_with(
        &self,
        stream: &CudaStream,
        timeout: Duration,
        on_failure: OnFailure,
    ) -> Result<()> {
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
                if on_failure == OnFailure::Revoke {
                    return Err(self.revoked_wait(Some(state), start.elapsed()));
                }
                return Err(self.async_failure("wait", state));
            }
            if stream.query()? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                if on_failure == OnFailure::Revoke {
                    return Err(self.revoked_wait(None, waited));
                }
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
}
