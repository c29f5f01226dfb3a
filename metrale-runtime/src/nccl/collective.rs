//! The collectives on a [`Communicator`], checked before NCCL sees them.

use std::ffi::c_void;
use std::sync::Arc;

use metrale_cuda_sys::nccl::{self as raw, cudaStream_t, ncclResult_t};

use crate::error::Result;
use crate::memory::{note_use, DeviceMemory, DeviceMemoryMut};
use crate::stream::CudaStream;

use super::agree::Shape;
use super::comm::Communicator;
use super::error::{missing, refused};
use super::state::{in_group, is_listed};
use super::{NcclType, ReduceOp};

/// The device pointer of `mem` as NCCL takes it.
#[inline]
fn ptr<T: NcclType>(mem: &impl DeviceMemory<T>) -> *mut c_void {
    mem.device_ptr() as usize as *mut c_void
}

#[inline]
fn nccl_stream(stream: &CudaStream) -> cudaStream_t {
    stream.raw().cast::<raw::CUstream_st>()
}

impl Communicator {
    /// Checks shared by every operation: not aborted, the stream and memory on
    /// this device; inside a group, listed and (for a collective, `shape`)
    /// agreeing with the other ranks of its communicator that this thread's
    /// group queued; then the memory's use is noted and the stream remembered.
    #[inline]
    fn prepare<T: NcclType>(
        &self,
        call: &'static str,
        stream: &CudaStream,
        mems: &[(&'static str, &dyn DeviceMemory<T>)],
        shape: Option<Shape>,
    ) -> Result<()> {
        self.enter(call)?;
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

    /// Run one NCCL call.
    #[inline]
    fn run(
        &self,
        call: &'static str,
        f: impl FnOnce() -> std::result::Result<ncclResult_t, metrale_cuda_sys::LibraryMissingSymbol>,
    ) -> Result<()> {
        // No context is bound: NCCL selects the communicator's device itself for
        // its calls (and restores the caller's), and the stream names the
        // context. That keeps a small collective's submit at NCCL's own cost.
        // A communicator sharing resources with a parent or child takes its
        // turn (no lock otherwise).
        let status = {
            let _turn = self.turn();
            f().map_err(|m| missing(m, Some(self.info())))?
        };
        self.finish(call, status)
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

    /// Sum (or another `op`) `send` over all ranks into `recv` of every rank
    /// (`ncclAllReduce`); `recv` needs at least `send.len()` elements (the first
    /// `send.len()` are written).
    ///
    /// # Errors
    /// [`NcclError::Refused`](super::NcclError::Refused) for a short `recv` or
    /// memory or stream of another device (naming the call, the rank and both
    /// sizes), before NCCL; NCCL's status.
    pub fn all_reduce<T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        const CALL: &str = "ncclAllReduce";
        if recv.len() < send.len() {
            return Err(self.count_refused(
                CALL,
                format!(
                    "the receive buffer has {} elements, fewer than the send buffer's {}",
                    recv.len(),
                    send.len()
                ),
            ));
        }
        let shape = Shape::of::<T>(CALL, send.len(), Some(op), None);
        self.prepare::<T>(CALL, stream, &[("send", send), ("receive", recv)], shape)?;
        if send.is_empty() {
            return Ok(());
        }
        let (s, r, n) = (ptr(send), ptr(recv), send.len());
        let lib = self.lib();
        self.run(CALL, || {
            let f = lib.ncclAllReduce()?;
            // SAFETY: `n` elements of `T` at both pointers, on this communicator's
            // device (checked); the stream is of that device; memory is freed
            // only after the work its safe uses queued.
            Ok(unsafe {
                f(
                    s,
                    r,
                    n,
                    T::DATA_TYPE,
                    op.to_raw(),
                    self.raw_handle(),
                    nccl_stream(stream),
                )
            })
        })
    }

    /// [`all_reduce`](Self::all_reduce) with `buf` both sent and received.
    ///
    /// # Errors
    /// As `all_reduce`.
    pub fn all_reduce_in_place<T: NcclType>(
        &self,
        buf: &mut impl DeviceMemoryMut<T>,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        const CALL: &str = "ncclAllReduce";
        let shape = Shape::of::<T>(CALL, buf.len(), Some(op), None);
        self.prepare::<T>(CALL, stream, &[("in-place", buf)], shape)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (p, n) = (ptr(buf), buf.len());
        let lib = self.lib();
        self.run(CALL, || {
            let f = lib.ncclAllReduce()?;
            // SAFETY: as in all_reduce; NCCL allows send == recv.
            Ok(unsafe {
                f(
                    p,
                    p,
                    n,
                    T::DATA_TYPE,
                    op.to_raw(),
                    self.raw_handle(),
                    nccl_stream(stream),
                )
            })
        })
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
        const CALL: &str = "ncclBroadcast";
        let root = self.check_root(CALL, "root", root)?;
        if send.len() < recv.len() {
            return Err(self.count_refused(
                CALL,
                format!(
                    "the send buffer has {} elements, fewer than the receive buffer's {}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        let shape = Shape::of::<T>(CALL, recv.len(), None, Some(root));
        self.prepare::<T>(CALL, stream, &[("send", send), ("receive", recv)], shape)?;
        self.broadcast_raw(
            CALL,
            ptr(send),
            ptr(recv),
            recv.len(),
            root,
            stream,
            T::DATA_TYPE,
        )
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
        const CALL: &str = "ncclBroadcast";
        let root = self.check_root(CALL, "root", root)?;
        let shape = Shape::of::<T>(CALL, buf.len(), None, Some(root));
        self.prepare::<T>(CALL, stream, &[("in-place", buf)], shape)?;
        self.broadcast_raw(
            CALL,
            ptr(buf),
            ptr(buf),
            buf.len(),
            root,
            stream,
            T::DATA_TYPE,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn broadcast_raw(
        &self,
        call: &'static str,
        s: *mut c_void,
        r: *mut c_void,
        n: usize,
        root: i32,
        stream: &CudaStream,
        ty: raw::ncclDataType_t,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let lib = self.lib();
        self.run(call, || {
            let f = lib.ncclBroadcast()?;
            // SAFETY: `n` elements at both pointers on this device (checked by the
            // callers); the root is a rank.
            Ok(unsafe { f(s, r, n, ty, root, self.raw_handle(), nccl_stream(stream)) })
        })
    }

    /// Reduce `send` over all ranks into `root`'s `recv` (`ncclReduce`); `recv`
    /// needs at least `send.len()` elements (on every rank: it is written on the
    /// root only).
    ///
    /// # Errors
    /// A root that is not a rank, a short `recv`, memory or stream of another
    /// device (before NCCL); NCCL's status.
    pub fn reduce<T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        op: ReduceOp,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        const CALL: &str = "ncclReduce";
        let root = self.check_root(CALL, "root", root)?;
        if recv.len() < send.len() {
            return Err(self.count_refused(
                CALL,
                format!(
                    "the receive buffer has {} elements, fewer than the send buffer's {}",
                    recv.len(),
                    send.len()
                ),
            ));
        }
        let shape = Shape::of::<T>(CALL, send.len(), Some(op), Some(root));
        self.prepare::<T>(CALL, stream, &[("send", send), ("receive", recv)], shape)?;
        self.reduce_raw(
            ptr(send),
            ptr(recv),
            send.len(),
            op,
            root,
            stream,
            T::DATA_TYPE,
        )
    }

    /// [`reduce`](Self::reduce) with `buf` both sent and (on the root) received.
    ///
    /// # Errors
    /// As `reduce`.
    pub fn reduce_in_place<T: NcclType>(
        &self,
        buf: &mut impl DeviceMemoryMut<T>,
        op: ReduceOp,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        const CALL: &str = "ncclReduce";
        let root = self.check_root(CALL, "root", root)?;
        let shape = Shape::of::<T>(CALL, buf.len(), Some(op), Some(root));
        self.prepare::<T>(CALL, stream, &[("in-place", buf)], shape)?;
        self.reduce_raw(
            ptr(buf),
            ptr(buf),
            buf.len(),
            op,
            root,
            stream,
            T::DATA_TYPE,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce_raw(
        &self,
        s: *mut c_void,
        r: *mut c_void,
        n: usize,
        op: ReduceOp,
        root: i32,
        stream: &CudaStream,
        ty: raw::ncclDataType_t,
    ) -> Result<()> {
        const CALL: &str = "ncclReduce";
        if n == 0 {
            return Ok(());
        }
        let lib = self.lib();
        self.run(CALL, || {
            let f = lib.ncclReduce()?;
            // SAFETY: `n` elements at both pointers on this device (checked by the
            // callers); the root is a rank.
            Ok(unsafe {
                f(
                    s,
                    r,
                    n,
                    ty,
                    op.to_raw(),
                    root,
                    self.raw_handle(),
                    nccl_stream(stream),
                )
            })
        })
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
        const CALL: &str = "ncclAllGather";
        let needed = send.len().checked_mul(self.size());
        if needed != Some(recv.len()) {
            return Err(self.count_refused(
                CALL,
                format!(
                    "the receive buffer has {} elements; it needs ranks × send = {} × {} = {}",
                    recv.len(),
                    self.size(),
                    send.len(),
                    needed.map_or_else(|| "more than usize".to_owned(), |n| n.to_string())
                ),
            ));
        }
        let shape = Shape::of::<T>(CALL, send.len(), None, None);
        self.prepare::<T>(CALL, stream, &[("send", send), ("receive", recv)], shape)?;
        if send.is_empty() {
            return Ok(());
        }
        let (s, r, n) = (ptr(send), ptr(recv), send.len());
        let lib = self.lib();
        self.run(CALL, || {
            let f = lib.ncclAllGather()?;
            // SAFETY: `n` elements at `s`, ranks × `n` at `r` (checked), on this
            // device.
            Ok(unsafe {
                f(
                    s,
                    r,
                    n,
                    T::DATA_TYPE,
                    self.raw_handle(),
                    nccl_stream(stream),
                )
            })
        })
    }

    /// Reduce `send` over all ranks and scatter it: rank `i` receives block `i`
    /// (`ncclReduceScatter`); `send.len()` must be exactly ranks × `recv.len()`.
    ///
    /// # Errors
    /// Sizes out of that rule, memory or stream of another device (before NCCL);
    /// NCCL's status.
    pub fn reduce_scatter<T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<()> {
        const CALL: &str = "ncclReduceScatter";
        let needed = recv.len().checked_mul(self.size());
        if needed != Some(send.len()) {
            return Err(self.count_refused(
                CALL,
                format!(
                    "the send buffer has {} elements; it needs ranks × receive = {} × {} = {}",
                    send.len(),
                    self.size(),
                    recv.len(),
                    needed.map_or_else(|| "more than usize".to_owned(), |n| n.to_string())
                ),
            ));
        }
        let shape = Shape::of::<T>(CALL, recv.len(), Some(op), None);
        self.prepare::<T>(CALL, stream, &[("send", send), ("receive", recv)], shape)?;
        if recv.is_empty() {
            return Ok(());
        }
        let (s, r, n) = (ptr(send), ptr(recv), recv.len());
        let lib = self.lib();
        self.run(CALL, || {
            let f = lib.ncclReduceScatter()?;
            // SAFETY: ranks × `n` elements at `s`, `n` at `r` (checked), on this
            // device.
            Ok(unsafe {
                f(
                    s,
                    r,
                    n,
                    T::DATA_TYPE,
                    op.to_raw(),
                    self.raw_handle(),
                    nccl_stream(stream),
                )
            })
        })
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
        const CALL: &str = "ncclSend";
        let (peer_rank, peer) = (peer, self.check_root(CALL, "peer", peer)?);
        self.prepare::<T>(CALL, stream, &[("send", buf)], None)?;
        self.p2p_agree::<T>(CALL, peer_rank, true, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        let (p, n) = (ptr(buf), buf.len());
        let lib = self.lib();
        self.run(CALL, || {
            let f = lib.ncclSend()?;
            // SAFETY: `n` elements at `p` on this device (checked); the peer is a
            // rank.
            Ok(unsafe {
                f(
                    p,
                    n,
                    T::DATA_TYPE,
                    peer,
                    self.raw_handle(),
                    nccl_stream(stream),
                )
            })
        })
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
        const CALL: &str = "ncclRecv";
        let (peer_rank, peer) = (peer, self.check_root(CALL, "peer", peer)?);
        self.prepare::<T>(CALL, stream, &[("receive", buf)], None)?;
        self.p2p_agree::<T>(CALL, peer_rank, false, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        let (p, n) = (ptr(buf), buf.len());
        let lib = self.lib();
        self.run(CALL, || {
            let f = lib.ncclRecv()?;
            // SAFETY: `n` elements at `p` on this device (checked); the peer is a
            // rank.
            Ok(unsafe {
                f(
                    p,
                    n,
                    T::DATA_TYPE,
                    peer,
                    self.raw_handle(),
                    nccl_stream(stream),
                )
            })
        })
    }
}
