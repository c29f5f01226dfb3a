//! The reducing collectives on a [`Communicator`]: all-reduce, reduce and
//! reduce-scatter, with a built-in [`ReduceOp`] or a pre-multiplied sum of the
//! communicator ([`PreMulSum`](super::PreMulSum), whose device scalar is checked
//! and noted like the buffers), each on the one checked path
//! (`Communicator::submit` in `collective.rs`).

use std::ffi::c_void;

use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut};
use crate::stream::CudaStream;

use super::collective::{Op, Red};
use super::comm::Communicator;
use super::error::refused;
use super::premul::Reduction;
use super::{NcclType, ReduceOp};

impl Communicator {
    /// A reducing collective `op` from `send` into `recv`: a built-in
    /// operation straight on [`pair`](Self::pair), a pre-multiplied sum
    /// through [`reducing`](Self::reducing).
    #[inline]
    fn reduce_pair<T: NcclType>(
        &self,
        op: impl Fn(Red) -> Op,
        red: Reduction<'_, T>,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        match red {
            Reduction::Op(o) => self.pair(op(o.into()), send, recv, stream),
            red => self.reducing(op, red, send, Some(&*recv), stream),
        }
    }

    /// [`reduce_pair`](Self::reduce_pair) in place, on `buf`.
    #[inline]
    fn reduce_in_place_with<T: NcclType>(
        &self,
        op: impl Fn(Red) -> Op,
        red: Reduction<'_, T>,
        buf: &mut impl DeviceMemoryMut<T>,
        stream: &CudaStream,
    ) -> Result<()> {
        match red {
            Reduction::Op(o) => self.single(op(o.into()), "in-place", buf, stream),
            red => self.reducing(op, red, &*buf, None, stream),
        }
    }

    /// [`pair`](Self::pair) or [`single`](Self::single) (`recv` `None`: in
    /// place) with a reduction that may read a scalar in device memory (noted
    /// as used, and checked for its device, like the buffers).
    #[inline]
    fn reducing<T: NcclType>(
        &self,
        op: impl Fn(Red) -> Op,
        red: Reduction<'_, T>,
        send: &dyn DeviceMemory<T>,
        recv: Option<&dyn DeviceMemory<T>>,
        stream: &CudaStream,
    ) -> Result<()> {
        let (red, scalar) = self.reduction(op(ReduceOp::Sum.into()).call(), red)?;
        let op = op(red);
        let sp = send.device_ptr() as usize as *mut c_void;
        let (rp, lens) = match &recv {
            Some(r) => (
                r.device_ptr() as usize as *mut c_void,
                (send.len(), r.len()),
            ),
            None => (sp, (send.len(), send.len())),
        };
        let first = ("send", send);
        let mut mems: [(&'static str, &dyn DeviceMemory<T>); 3] = [first, first, first];
        let mut n = 1;
        if let Some(r) = recv {
            mems[n] = ("receive", r);
            n += 1;
        } else {
            mems[0].0 = "in-place";
        }
        if let Some(sc) = scalar {
            mems[n] = ("scalar", sc);
            n += 1;
        }
        self.submit(op, stream, &mems[..n], (sp, rp), lens)
    }

    /// The reduction NCCL takes for `red`; a pre-multiplied sum must be this
    /// communicator's (and its device scalar comes along).
    #[inline]
    fn reduction<'r, T: NcclType>(
        &self,
        call: &'static str,
        red: Reduction<'r, T>,
    ) -> Result<(Red, Option<&'r dyn DeviceMemory<T>>)> {
        match red {
            Reduction::Op(op) => Ok((op.into(), None)),
            Reduction::PreMulSum(p) => {
                if !std::ptr::eq(p.comm(), self) {
                    return Err(refused(
                        call,
                        Some(self.info()),
                        format!(
                            "the pre-multiplied sum was made for another communicator ({}); \
                             NCCL's reduction operations belong to one communicator",
                            p.comm().info()
                        ),
                    ));
                }
                Ok((Red::custom(p.raw()), p.scalar()))
            }
        }
    }

    /// Sum (or another `op`: a [`ReduceOp`], or `&`[`PreMulSum`](super::PreMulSum)
    /// of this communicator, as for every reducing collective) `send` over all
    /// ranks into `recv` of every rank (`ncclAllReduce`); `recv` needs at least
    /// `send.len()` elements (the first `send.len()` are written).
    ///
    /// # Errors
    /// [`NcclError::Refused`](super::NcclError::Refused) for a short `recv` or
    /// memory or stream of another device (naming the call, the rank and both
    /// sizes), before NCCL; NCCL's status.
    pub fn all_reduce<'r, T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        op: impl Into<Reduction<'r, T>>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.reduce_pair(Op::AllReduce, op.into(), send, recv, stream)
    }

    /// [`all_reduce`](Self::all_reduce) with `buf` both sent and received.
    ///
    /// # Errors
    /// As `all_reduce`.
    pub fn all_reduce_in_place<'r, T: NcclType>(
        &self,
        buf: &mut impl DeviceMemoryMut<T>,
        op: impl Into<Reduction<'r, T>>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.reduce_in_place_with(Op::AllReduce, op.into(), buf, stream)
    }

    /// Reduce `send` over all ranks into `root`'s `recv` (`ncclReduce`); `recv`
    /// needs at least `send.len()` elements (on every rank: it is written on the
    /// root only).
    ///
    /// # Errors
    /// A root that is not a rank, a short `recv`, memory or stream of another
    /// device (before NCCL); NCCL's status.
    pub fn reduce<'r, T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        op: impl Into<Reduction<'r, T>>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.reduce_pair(|r| Op::Reduce(r, root), op.into(), send, recv, stream)
    }

    /// [`reduce`](Self::reduce) with `buf` both sent and (on the root) received.
    ///
    /// # Errors
    /// As `reduce`.
    pub fn reduce_in_place<'r, T: NcclType>(
        &self,
        buf: &mut impl DeviceMemoryMut<T>,
        op: impl Into<Reduction<'r, T>>,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.reduce_in_place_with(|r| Op::Reduce(r, root), op.into(), buf, stream)
    }

    /// Reduce `send` over all ranks and scatter it: rank `i` receives block `i`
    /// (`ncclReduceScatter`); `send.len()` must be exactly ranks × `recv.len()`.
    ///
    /// # Errors
    /// Sizes out of that rule, memory or stream of another device (before NCCL);
    /// NCCL's status.
    pub fn reduce_scatter<'r, T: NcclType>(
        &self,
        send: &impl DeviceMemory<T>,
        recv: &mut impl DeviceMemoryMut<T>,
        op: impl Into<Reduction<'r, T>>,
        stream: &CudaStream,
    ) -> Result<()> {
        self.reduce_pair(Op::ReduceScatter, op.into(), send, recv, stream)
    }
}
