//! The collectives on a [`Communicator`], checked before NCCL sees them: each
//! checks its own sizes and ranks, then takes the one checked path
//! (`Communicator::submit`) to NCCL.

use std::ffi::c_void;
use std::sync::Arc;

use metrale_cuda_sys::nccl::{
    self as raw, cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, Nccl,
};
use metrale_cuda_sys::LibraryMissingSymbol;

use crate::error::Result;
use crate::memory::{note_use, DeviceMemory, DeviceMemoryMut};
use crate::stream::CudaStream;

use super::agree::Shape;
use super::comm::Communicator;
use super::error::{into_error, missing, refused, NcclError};
use super::state::{in_group, is_listed};
use super::{NcclType, ReduceOp};

/// A reduction as NCCL takes it: a built-in operation or one made for this
/// communicator (a pre-multiplied sum), with the operation the ranks are
/// checked to agree on (a pre-multiplied sum agrees as a sum).
#[derive(Clone, Copy)]
pub(super) struct Red {
    raw: ncclRedOp_t,
    agree: ReduceOp,
}

impl Red {
    /// A reduction made for a communicator (`raw`), agreeing as a sum.
    #[inline]
    pub(super) fn custom(raw: ncclRedOp_t) -> Red {
        Red {
            raw,
            agree: ReduceOp::Sum,
        }
    }
}

impl From<ReduceOp> for Red {
    #[inline]
    fn from(op: ReduceOp) -> Red {
        Red {
            raw: op.to_raw(),
            agree: op,
        }
    }
}

/// The device pointer of `mem` as NCCL takes it.
#[inline]
fn ptr<T: NcclType>(mem: &impl DeviceMemory<T>) -> *mut c_void {
    mem.device_ptr() as usize as *mut c_void
}

#[inline]
fn nccl_stream(stream: &CudaStream) -> cudaStream_t {
    stream.raw().cast::<raw::CUstream_st>()
}

/// One NCCL call of this file, with what it takes besides the buffers: every
/// collective, send and receive goes through [`Communicator::submit`] with one,
/// which checks it by the rules here.
#[derive(Clone, Copy)]
pub(super) enum Op {
    AllReduce(Red),
    /// From this root.
    Broadcast(usize),
    /// To this root.
    Reduce(Red, usize),
    AllGather,
    ReduceScatter(Red),
    /// Block `j` of every rank's send to rank `j`.
    AllToAll,
    /// To this root.
    Gather(usize),
    /// From this root.
    Scatter(usize),
    /// To this peer.
    Send(usize),
    /// From this peer.
    Recv(usize),
}

/// What an [`Op`] asks of its buffers' lengths. NCCL's count is the length
/// the rule measures against (the second buffer named); with one buffer, its
/// length.
enum Sizes {
    /// The receive buffer has at least the send buffer's elements.
    RecvAtLeastSend,
    /// The send buffer has at least the receive buffer's elements.
    SendAtLeastRecv,
    /// The receive buffer has exactly ranks × the send buffer's elements.
    RecvRanksTimesSend,
    /// The send buffer has exactly ranks × the receive buffer's elements.
    SendRanksTimesRecv,
    /// Both buffers have the same number of elements, a multiple of ranks
    /// (the count is that over ranks).
    BothRanksTimes,
    /// One buffer: nothing to compare.
    One,
}

impl Op {
    /// The NCCL function.
    pub(super) const fn call(self) -> &'static str {
        match self {
            Op::AllReduce(_) => "ncclAllReduce",
            Op::Broadcast(_) => "ncclBroadcast",
            Op::Reduce(..) => "ncclReduce",
            Op::AllGather => "ncclAllGather",
            Op::ReduceScatter(_) => "ncclReduceScatter",
            Op::AllToAll => "ncclAlltoAll",
            Op::Gather(_) => "ncclGather",
            Op::Scatter(_) => "ncclScatter",
            Op::Send(_) => "ncclSend",
            Op::Recv(_) => "ncclRecv",
        }
    }

    /// The root or peer, and what the call names it.
    #[inline]
    fn rank(self) -> Option<(&'static str, usize)> {
        match self {
            Op::Broadcast(root) | Op::Reduce(_, root) | Op::Gather(root) | Op::Scatter(root) => {
                Some(("root", root))
            }
            Op::Send(peer) | Op::Recv(peer) => Some(("peer", peer)),
            _ => None,
        }
    }

    /// The rule for the buffers' lengths.
    #[inline]
    fn sizes(self) -> Sizes {
        match self {
            Op::AllReduce(_) | Op::Reduce(..) => Sizes::RecvAtLeastSend,
            Op::Broadcast(_) => Sizes::SendAtLeastRecv,
            Op::AllGather | Op::Gather(_) => Sizes::RecvRanksTimesSend,
            Op::ReduceScatter(_) | Op::Scatter(_) => Sizes::SendRanksTimesRecv,
            Op::AllToAll => Sizes::BothRanksTimes,
            Op::Send(_) | Op::Recv(_) => Sizes::One,
        }
    }

    /// What the ranks of a collective must agree on (`rank`: its root); `None`
    /// for a send or receive (paired instead, see [`p2p`](Self::p2p)).
    #[inline]
    fn shape<T: NcclType>(self, count: usize, rank: i32) -> Option<Shape> {
        let (op, root) = match self {
            Op::AllReduce(op) | Op::ReduceScatter(op) => (Some(op.agree), None),
            Op::Broadcast(_) | Op::Gather(_) | Op::Scatter(_) => (None, Some(rank)),
            Op::Reduce(op, _) => (Some(op.agree), Some(rank)),
            Op::AllGather | Op::AllToAll => (None, None),
            Op::Send(_) | Op::Recv(_) => return None,
        };
        Shape::of::<T>(self.call(), count, op, root)
    }

    /// The peer of a send (`true`) or receive (`false`).
    #[inline]
    fn p2p(self) -> Option<(usize, bool)> {
        match self {
            Op::Send(peer) => Some((peer, true)),
            Op::Recv(peer) => Some((peer, false)),
            _ => None,
        }
    }

    /// Call NCCL: `count` elements of `ty` from `send` into `recv`, `rank` the
    /// root or peer (a send reads only `send`, a receive writes only `recv`:
    /// one buffer's op passes its pointer as both).
    ///
    /// # Safety
    /// `comm` is a live communicator of `lib`, and `stream` a stream of its
    /// device; `rank` is one of its ranks; `send` and `recv` point to device
    /// memory of that device holding what the call reads and writes (`count`
    /// elements, ranks × `count` for an all-gather's or gather's `recv`, a
    /// reduce-scatter's or scatter's `send`, and both of an all-to-all), which
    /// stays allocated until the work is done; a reduction made for a
    /// communicator (a pre-multiplied sum) is `comm`'s and still alive.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    unsafe fn issue(
        self,
        lib: &Nccl,
        (s, r): (*mut c_void, *mut c_void),
        n: usize,
        ty: ncclDataType_t,
        rank: i32,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> std::result::Result<ncclResult_t, LibraryMissingSymbol> {
        // SAFETY: the caller's contract above is each function's contract;
        // NCCL allows `send == recv` (in place) for every collective.
        Ok(unsafe {
            match self {
                Op::AllReduce(op) => lib.ncclAllReduce()?(s, r, n, ty, op.raw, comm, stream),
                Op::Broadcast(_) => lib.ncclBroadcast()?(s, r, n, ty, rank, comm, stream),
                Op::Reduce(op, _) => lib.ncclReduce()?(s, r, n, ty, op.raw, rank, comm, stream),
                Op::AllGather => lib.ncclAllGather()?(s, r, n, ty, comm, stream),
                Op::ReduceScatter(op) => {
                    lib.ncclReduceScatter()?(s, r, n, ty, op.raw, comm, stream)
                }
                Op::AllToAll => lib.ncclAlltoAll()?(s, r, n, ty, comm, stream),
                Op::Gather(_) => lib.ncclGather()?(s, r, n, ty, rank, comm, stream),
                Op::Scatter(_) => lib.ncclScatter()?(s, r, n, ty, rank, comm, stream),
                Op::Send(_) => lib.ncclSend()?(s, n, ty, rank, comm, stream),
                Op::Recv(_) => lib.ncclRecv()?(r, n, ty, rank, comm, stream),
            }
        })
    }
}

impl Communicator {
    /// The one checked path of every collective, send and receive, in this
    /// order: the root or peer is a rank, the buffers' lengths keep the op's
    /// rule, the checks every operation shares ([`prepare`](Self::prepare)), a
    /// send's or receive's pairing; then NCCL (not called for zero elements).
    ///
    /// No context is bound: NCCL selects the communicator's device itself for
    /// its calls (and restores the caller's), and the stream names the context.
    /// That keeps a small collective's submit at NCCL's own cost. A
    /// communicator sharing resources with a parent or child takes its turn (no
    /// lock otherwise).
    #[inline(always)]
    pub(super) fn submit<T: NcclType>(
        &self,
        op: Op,
        stream: &CudaStream,
        mems: &[(&'static str, &dyn DeviceMemory<T>)],
        ptrs: (*mut c_void, *mut c_void),
        (send_len, recv_len): (usize, usize),
    ) -> Result<()> {
        let call = op.call();
        let rank = match op.rank() {
            Some((what, rank)) => self.check_root(call, what, rank)?,
            None => 0,
        };
        let (s, r) = (send_len, recv_len);
        let count = match op.sizes() {
            Sizes::RecvAtLeastSend => self.at_least(call, ("receive", r), ("send", s))?,
            Sizes::SendAtLeastRecv => self.at_least(call, ("send", s), ("receive", r))?,
            Sizes::RecvRanksTimesSend => self.ranks_times(call, ("receive", r), ("send", s))?,
            Sizes::SendRanksTimesRecv => self.ranks_times(call, ("send", s), ("receive", r))?,
            Sizes::BothRanksTimes => self.per_rank(call, s, r)?,
            Sizes::One => s,
        };
        self.prepare::<T>(call, stream, mems, op.shape::<T>(count, rank))?;
        if let Some((peer, sent)) = op.p2p() {
            self.p2p_agree::<T>(call, peer, sent, count)?;
        }
        if count == 0 {
            return Ok(());
        }
        let status = {
            let _turn = self.turn();
            let (lib, ty, comm, s) = (
                self.lib(),
                T::DATA_TYPE,
                self.raw_handle(),
                nccl_stream(stream),
            );
            // SAFETY: a live communicator (`prepare` refused an aborted one) and
            // a stream of its device (checked); the memory is on that device
            // (checked) and as large as the op needs (the lengths were checked
            // by its rule; the root or peer is a rank); memory is freed only
            // after the work its safe uses queued (`prepare` noted the use).
            unsafe { op.issue(lib, ptrs, count, ty, rank, comm, s) }
                .map_err(|m| missing(m, Some(self.info())))?
        };
        self.finish(call, status)
    }

    /// [`submit`](Self::submit) with a send and a receive buffer.
    #[inline(always)]
    pub(super) fn pair<T: NcclType>(
        &self,
        op: Op,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        let lens = (send.len(), recv.len());
        let mems: [(_, &dyn DeviceMemory<T>); 2] = [("send", send), ("receive", recv)];
        self.submit(op, stream, &mems, (ptr(send), ptr(recv)), lens)
    }

    /// [`submit`](Self::submit) with one buffer (`role`): sent and received in
    /// place, or a send's or a receive's.
    #[inline(always)]
    pub(super) fn single<T: NcclType>(
        &self,
        op: Op,
        role: &'static str,
        buf: &impl DeviceMemory<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        let (p, n) = (ptr(buf), buf.len());
        self.submit(op, stream, &[(role, buf)], (p, p), (n, n))
    }

    /// Checks shared by every operation: not aborted, the stream and memory on
    /// this device; inside a group, listed and (for a collective, `shape`)
    /// agreeing with the other ranks of its communicator that this thread's
    /// group queued; then the memory's use is noted and the stream remembered.
    #[inline(always)]
    fn prepare<T: NcclType>(
        &self,
        call: &'static str,
        stream: &CudaStream,
        mems: &[(&'static str, &dyn DeviceMemory<T>)],
        shape: Option<Shape>,
    ) -> Result<()> {
        self.enter(call)?;
        if self.ledger.revoked.get() {
            return Err(into_error(NcclError::Revoked {
                call,
                comm: self.info(),
            }));
        }
        self.check_stream(call, stream)?;
        for &(role, mem) in mems {
            if !Arc::ptr_eq(mem.memory_context(), self.context()) {
                return Err(refused(
                    call,
                    Some(self.info()),
                    format!(
                        "the {role} buffer is on device {}, the communicator on device {}",
                        mem.memory_context().ordinal(),
                        self.device()
                    ),
                ));
            }
        }
        if in_group() {
            if !self.listed() {
                return Err(refused(
                    call,
                    Some(self.info()),
                    "a communicator used inside `group` must be listed in its `comms`: the \
                     group borrows those until its work is launched at the group's end (and \
                     polls the non-blocking ones then)",
                ));
            }
            if let Some(shape) = shape {
                self.agree(call, shape)?;
            }
        }
        if shape.is_some() {
            self.count_collective();
        }
        for &(_, mem) in mems {
            note_use(mem, stream)?;
        }
        self.queued(call, stream);
        Ok(())
    }

    fn listed(&self) -> bool {
        is_listed(self.raw_handle())
    }

    /// Count a send to (`sent`) or receive from `peer` and, inside a group,
    /// refuse one that disagrees with its partner queued in this thread's group.
    #[inline]
    fn p2p_agree<T: NcclType>(
        &self,
        call: &'static str,
        peer: usize,
        sent: bool,
        count: usize,
    ) -> Result<()> {
        let Some(seq) = self.count_p2p(peer, sent) else {
            return Ok(());
        };
        if !in_group() {
            return Ok(());
        }
        super::agree::record_p2p(
            self.clique(),
            self.rank(),
            peer,
            sent,
            seq,
            count,
            T::DATA_TYPE,
        )
        .map_err(|reason| {
            // Not queued: this one does not count.
            self.uncount_p2p(peer, sent);
            refused(call, Some(self.info()), reason)
        })
    }

    /// Refuse a collective that disagrees with another rank's of the same
    /// sequence number queued in this thread's group.
    #[cold]
    fn agree(&self, call: &'static str, shape: Shape) -> Result<()> {
        if self.size() < 2 {
            return Ok(());
        }
        super::agree::record(self.clique(), self.rank(), self.collectives(), shape)
            .map_err(|reason| refused(call, Some(self.info()), reason))
    }

    fn count_refused(&self, call: &'static str, reason: String) -> crate::error::MetraleError {
        refused(call, Some(self.info()), reason)
    }

    fn check_root(&self, call: &'static str, what: &str, root: usize) -> Result<i32> {
        match i32::try_from(root) {
            Ok(r) if root < self.size() => Ok(r),
            _ => Err(self.count_refused(
                call,
                format!(
                    "{what} {root} is not a rank (the communicator has {} ranks)",
                    self.size()
                ),
            )),
        }
    }

    /// Refuse a `role` buffer of `has` elements, fewer than the `other`
    /// buffer's `needs`; else `needs`.
    #[inline]
    fn at_least(
        &self,
        call: &'static str,
        (role, has): (&str, usize),
        (other, needs): (&str, usize),
    ) -> Result<usize> {
        if has < needs {
            return Err(self.count_refused(
                call,
                format!(
                    "the {role} buffer has {has} elements, fewer than the {other} buffer's {needs}"
                ),
            ));
        }
        Ok(needs)
    }

    /// Refuse buffers of different lengths, or a length that is not a multiple
    /// of ranks; else the length over ranks (each rank's block).
    #[inline]
    fn per_rank(&self, call: &'static str, send: usize, recv: usize) -> Result<usize> {
        let n = self.size();
        if send != recv || !send.is_multiple_of(n) {
            return Err(self.count_refused(
                call,
                format!(
                    "the send buffer has {send} elements and the receive buffer {recv}; both \
                     need ranks × per-rank count ({n} × k) elements, the same on both"
                ),
            ));
        }
        Ok(send / n)
    }

    /// Refuse a `role` buffer of `has` elements unless it is exactly ranks ×
    /// the `other` buffer's `per_rank`; else `per_rank`.
    #[inline]
    fn ranks_times(
        &self,
        call: &'static str,
        (role, has): (&str, usize),
        (other, per_rank): (&str, usize),
    ) -> Result<usize> {
        let needed = per_rank.checked_mul(self.size());
        if needed != Some(has) {
            return Err(self.count_refused(
                call,
                format!(
                    "the {role} buffer has {has} elements; it needs ranks × {other} = {} × {per_rank} = {}",
                    self.size(),
                    needed.map_or_else(|| "more than usize".to_owned(), |n| n.to_string())
                ),
            ));
        }
        Ok(per_rank)
    }

    /// Copy `root`'s `send` into `recv` of every rank (`ncclBroadcast`);
    /// `recv.len()` elements move, and `send` needs at least as many (it is read
    /// on the root only).
    ///
    /// # Errors
    /// A root that is not a rank, a short `send`, memory or stream of another
    /// device (before NCCL); NCCL's status.
    pub fn broadcast<T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.pair(Op::Broadcast(root), send, recv, stream)
    }

    /// [`broadcast`](Self::broadcast) from `root`'s `buf` into every rank's `buf`.
    ///
    /// # Errors
    /// As `broadcast`.
    pub fn broadcast_in_place<T: NcclType>(
        &self,
        buf: &mut impl DeviceMemoryMut<T>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.single(Op::Broadcast(root), "in-place", buf, stream)
    }

    /// Gather every rank's `send` into `recv` of every rank, in rank order
    /// (`ncclAllGather`); `recv.len()` must be exactly ranks × `send.len()`.
    ///
    /// # Errors
    /// Sizes out of that rule, memory or stream of another device (before NCCL);
    /// NCCL's status.
    pub fn all_gather<T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.pair(Op::AllGather, send, recv, stream)
    }

    /// Send `buf` to rank `peer` (`ncclSend`), which receives it with
    /// [`recv`](Self::recv) of the same length. Between ranks driven by one
    /// thread, put both in one [`group`](super::group).
    ///
    /// # Errors
    /// A peer that is not a rank, memory or stream of another device (before
    /// NCCL); NCCL's status.
    pub fn send<T: NcclType>(
        &self,
        buf: &impl DeviceMemory<T>,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.single(Op::Send(peer), "send", buf, stream)
    }

    /// Receive `buf.len()` elements from rank `peer` into `buf` (`ncclRecv`).
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub fn recv<T: NcclType>(
        &self,
        buf: &mut impl DeviceMemoryMut<T>,
        peer: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.single(Op::Recv(peer), "receive", buf, stream)
    }
}
