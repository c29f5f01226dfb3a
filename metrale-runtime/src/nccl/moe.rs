//! The collectives of mixture-of-experts layers on a [`Communicator`]:
//! all-to-all, gather and scatter (NCCL 2.28), each checked against ranks ×
//! the per-rank count (and its root against the ranks) on the one collective
//! path (`collective.rs`).

use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use crate::stream::CudaStream;

use super::collective::Op;
use super::comm::Communicator;
use super::NcclType;

impl Communicator {
    /// Exchange blocks between every pair of ranks (`ncclAlltoAll`): `send` and
    /// `recv` each hold ranks × k elements, and block `j` (k elements) of
    /// rank `i`'s `send` lands in block `i` of rank `j`'s `recv`. The
    /// dispatch and combine steps of an expert-parallel layer.
    ///
    /// # Errors
    /// [`NcclError::Refused`](super::NcclError::Refused) before NCCL when the
    /// two lengths differ or are not a multiple of the number of ranks, or for
    /// memory or a stream of another device; the missing symbol on an NCCL
    /// older than 2.28; NCCL's status.
    pub fn all_to_all<T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.pair(Op::AllToAll, send, recv, stream)
    }

    /// Gather every rank's `send` into `root`'s `recv`, in rank order
    /// (`ncclGather`). `recv` needs exactly ranks × `send.len()` elements on
    /// every rank (NCCL writes it on the root only; the rule is the same
    /// everywhere so no rank needs to know whether it is the root).
    ///
    /// # Errors
    /// A root that is not a rank, sizes out of that rule, memory or a stream
    /// of another device (before NCCL); the missing symbol on an NCCL older
    /// than 2.28; NCCL's status.
    pub fn gather<T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.pair(Op::Gather(root), send, recv, stream)
    }

    /// Scatter `root`'s `send` over the ranks: rank `i` receives block `i`
    /// (`recv.len()` elements) into `recv` (`ncclScatter`). `send` needs
    /// exactly ranks × `recv.len()` elements on every rank (it is read on the
    /// root only).
    ///
    /// # Errors
    /// As [`gather`](Self::gather).
    pub fn scatter<T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.pair(Op::Scatter(root), send, recv, stream)
    }
}
