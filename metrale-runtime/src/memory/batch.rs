//! Batched copies: [`BatchCopy`] (one checked pair of ends) and
//! [`CudaStream::copy_batch`], many copies in any mix of directions in one
//! `cuMemcpyBatchAsync` call (KV-cache offload and gather).
//!
//! Invariants:
//! - Every pair is checked before anything is queued: the same element count
//!   at both ends, device ends in the stream's context. A refused batch queues
//!   nothing.
//! - A batch with a host end borrows that host memory: it is refused on a
//!   stream being captured, and the call returns only once the stream has
//!   finished the batch (an event recorded right after it, waited for also
//!   when the batch call failed, so no copy can still touch the memory).
//!   A device-only batch returns at once, as `copy_d2d` does.
//! - Uses are noted for every device end, so a buffer's free waits for the
//!   batch like for any copy.
//! - A driver without `cuMemcpyBatchAsync_v2` (before CUDA 12.8) gets the
//!   same pairs as single async copies on the stream, in order: the same
//!   result and the same borrow rule, one call per pair.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr};

use super::{note_use_parts, DeviceMemory, DeviceMemoryMut, DevicePod, DeviceRepr, Uses};
use crate::context::CudaContext;
use crate::error::{cu, invalid_arg, Result};
use crate::stream::CudaStream;

/// One end of a batched copy.
#[derive(Clone, Copy)]
enum End<'a> {
    /// Device memory of a context, with its use record.
    Device {
        ptr: CUdeviceptr,
        ctx: &'a Arc<CudaContext>,
        uses: Option<&'a Uses>,
    },
    /// Host memory, borrowed for the copy.
    Host(*const c_void),
}

impl End<'_> {
    fn address(&self) -> CUdeviceptr {
        match *self {
            End::Device { ptr, .. } => ptr,
            End::Host(p) => p as usize as CUdeviceptr,
        }
    }
}

/// One copy of a batch for [`CudaStream::copy_batch`]: host to device, device
/// to host, or device to device, with the element type and the borrows of
/// both ends (the source shared, the destination exclusive) for as long as the
/// pair lives.
///
/// ```no_run
/// use metrale_runtime::{host, BatchCopy, DeviceBuffer, PinnedBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let s = h.stream();
/// let mut kv = DeviceBuffer::<u16>::alloc(s, 8 * 4096)?;
/// let staged = PinnedBuffer::<u16>::zeroed(s, 8 * 4096)?;
/// // Eight 8 KiB blocks, each to its own block of the cache, in one call.
/// let mut blocks: Vec<_> = kv.chunks_mut(4096).collect();
/// let copies: Vec<BatchCopy<'_>> = staged
///     .chunks(4096)
///     .zip(blocks.iter_mut())
///     .map(|(from, to)| BatchCopy::h2d(from, to))
///     .collect();
/// s.copy_batch(&copies)?;
/// # Ok(()) }
/// ```
///
/// Not `Clone`: a pair holds its destination's exclusive borrow, so one
/// destination cannot be written twice by one batch through copies of a pair.
pub struct BatchCopy<'a> {
    src: End<'a>,
    dst: End<'a>,
    src_len: usize,
    dst_len: usize,
    elem_size: usize,
    elem: &'static str,
    _borrows: PhantomData<&'a mut ()>,
}

// SAFETY: the ends are addresses of memory borrowed for 'a (a host slice
// shared as `&[T]` with `T: Sync`, or exclusively as `&mut [T]` with `T: Send`;
// device handles that are Send and Sync); a pair only carries them to the
// driver call of the thread that queues the batch.
unsafe impl Send for BatchCopy<'_> {}
// SAFETY: as above; shared access only reads the addresses.
unsafe impl Sync for BatchCopy<'_> {}

impl std::fmt::Debug for BatchCopy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchCopy")
            .field("src", &format_args!("{:#x}", self.src.address()))
            .field("dst", &format_args!("{:#x}", self.dst.address()))
            .field("len", &self.src_len)
            .field("elem", &self.elem)
            .finish()
    }
}

fn device_end<'a, T: DeviceRepr>(mem: &'a (impl DeviceMemory<T> + ?Sized)) -> End<'a> {
    End::Device {
        ptr: mem.device_ptr(),
        ctx: mem.memory_context(),
        uses: mem.uses(),
    }
}

impl<'a> BatchCopy<'a> {
    fn new<T>(src: End<'a>, src_len: usize, dst: End<'a>, dst_len: usize) -> BatchCopy<'a> {
        BatchCopy {
            src,
            dst,
            src_len,
            dst_len,
            elem_size: std::mem::size_of::<T>(),
            elem: std::any::type_name::<T>(),
            _borrows: PhantomData,
        }
    }

    /// Copy host `src` into device `dst` (the same length, checked when queued).
    pub fn h2d<T: DeviceRepr>(
        src: &'a [T],
        dst: &'a mut (impl DeviceMemoryMut<T> + ?Sized),
    ) -> Self {
        BatchCopy::new::<T>(
            End::Host(src.as_ptr().cast()),
            src.len(),
            device_end(&*dst),
            dst.len(),
        )
    }

    /// Copy device `src` into host `dst` (the same length, checked when queued).
    pub fn d2h<T: DevicePod>(src: &'a (impl DeviceMemory<T> + ?Sized), dst: &'a mut [T]) -> Self {
        BatchCopy::new::<T>(
            device_end(src),
            src.len(),
            End::Host(dst.as_mut_ptr().cast_const().cast()),
            dst.len(),
        )
    }

    /// Copy device `src` into device `dst` of the same context (the same
    /// length, checked when queued).
    pub fn d2d<T: DeviceRepr>(
        src: &'a (impl DeviceMemory<T> + ?Sized),
        dst: &'a mut (impl DeviceMemoryMut<T> + ?Sized),
    ) -> Self {
        BatchCopy::new::<T>(device_end(src), src.len(), device_end(&*dst), dst.len())
    }

    /// The bytes this pair copies.
    pub fn byte_len(&self) -> usize {
        // Cannot overflow: both ends exist with this many elements.
        self.src_len * self.elem_size
    }

    fn touches_host(&self) -> bool {
        matches!(self.src, End::Host(_)) || matches!(self.dst, End::Host(_))
    }
}

/// The arrays `cuMemcpyBatchAsync_v2` reads.
struct Arrays {
    dsts: Vec<CUdeviceptr>,
    srcs: Vec<CUdeviceptr>,
    sizes: Vec<usize>,
}

impl CudaStream {
    /// Queue every pair of `copies` in one `cuMemcpyBatchAsync` call, ordered
    /// after the work already on this stream; pairs of zero bytes are skipped.
    ///
    /// The pairs are taken by value (a `Vec` or an array, whose borrows end
    /// with the call, so the destinations can be read right after) or by
    /// reference (`&copies`, to keep them).
    ///
    /// A batch with a host end waits until the stream has finished it (the
    /// host memory is borrowed only for this call) and is refused while the
    /// stream is being captured; a device-only batch returns at once. On a
    /// driver without the call (before CUDA 12.8) the pairs are queued as
    /// single async copies, in order, with the same rules.
    ///
    /// # Errors
    /// `InvalidArgument` naming the pair for ends of different lengths, or a
    /// host end on a capturing stream; [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice)
    /// for a device end of another context; the failing batch call, copy or
    /// wait (a batch with a host end is waited for even then).
    pub fn copy_batch<'a>(&self, copies: impl AsRef<[BatchCopy<'a>]>) -> Result<()> {
        let copies = copies.as_ref();
        if crate::lifetime::in_host_function() {
            // Every driver call is refused here: nothing is queued, nothing
            // to wait for.
            return Err(crate::error::CallError::InHostFunction.about(self.subject("copy_batch")));
        }
        let mut host = false;
        for (i, c) in copies.iter().enumerate() {
            if c.src_len != c.dst_len {
                return Err(invalid_arg(format!(
                    "{}: copy_batch: pair {i} copies {} elements of {} into {}: lengths differ",
                    self.subject(""),
                    c.src_len,
                    c.elem,
                    c.dst_len
                )));
            }
            for (end, which) in [(c.src, "source"), (c.dst, "destination")] {
                if let End::Device { ptr, ctx, .. } = end {
                    self.context().check_same(
                        ctx,
                        || format!("copy_batch: the {which} of pair {i} ({ptr:#x})"),
                        "the stream",
                    )?;
                }
            }
            host |= c.touches_host() && c.byte_len() > 0;
        }
        let live = || copies.iter().filter(|c| c.byte_len() > 0);
        if live().next().is_none() {
            return Ok(());
        }
        for c in live() {
            for end in [c.src, c.dst] {
                if let End::Device { ctx, uses, .. } = end {
                    note_use_parts(uses, ctx, self)?;
                }
            }
        }
        let mut arrays = Arrays {
            dsts: Vec::with_capacity(copies.len()),
            srcs: Vec::with_capacity(copies.len()),
            sizes: Vec::with_capacity(copies.len()),
        };
        for c in live() {
            arrays.dsts.push(c.dst.address());
            arrays.srcs.push(c.src.address());
            arrays.sizes.push(c.byte_len());
        }
        let section = self.section();
        if host {
            self.refuse_if_capturing(&section, "a batch of copies with a host end")?;
        }
        let queued = if self.context().driver().cuMemcpyBatchAsync_v2().is_ok() {
            self.queue_batch(&mut arrays)
        } else {
            self.queue_singly(live())
        };
        if !host {
            drop(section);
            return queued;
        }
        // Whatever was queued (all of it, or the pairs before a failed one)
        // finishes before the host memory's borrow ends.
        let done = self.record_done_in(&section);
        drop(section);
        let waited = done.and_then(|done| self.wait_done(done));
        queued.and(waited)
    }

    /// One `cuMemcpyBatchAsync_v2` over `arrays`, sources read in stream order.
    fn queue_batch(&self, arrays: &mut Arrays) -> Result<()> {
        // SAFETY: a plain C struct of integers; all-zero is a valid value (no
        // location hint, no flags).
        let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder_enum::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut first: usize = 0;
        let count = arrays.sizes.len();
        let (dsts, srcs, sizes) = (
            arrays.dsts.as_mut_ptr(),
            arrays.srcs.as_mut_ptr(),
            arrays.sizes.as_mut_ptr(),
        );
        // SAFETY: `count` entries in each array, every pair checked above (its
        // ends of this context, or host memory borrowed by the caller's pairs
        // for the call and, with a host end, until the wait after it); one
        // attribute set for all pairs from index 0; read during the call.
        self.call("a batch of copies (cuMemcpyBatchAsync)", |d, s| unsafe {
            cu!(
                d,
                cuMemcpyBatchAsync_v2(dsts, srcs, sizes, count, &mut attrs, &mut first, 1, s)
            )
        })
    }

    /// The pairs as single async copies, in order (a driver without the batch
    /// call); stops at the first failure.
    fn queue_singly<'b>(&self, pairs: impl Iterator<Item = &'b BatchCopy<'b>>) -> Result<()> {
        for c in pairs {
            let (bytes, to, from) = (c.byte_len(), c.dst.address(), c.src.address());
            match (c.src, c.dst) {
                (End::Host(p), End::Device { .. }) => {
                    self.call("a batched copy to device", |d, s| {
                        // SAFETY: host bytes borrowed by the pair until the wait
                        // after the batch; device bytes of this context (checked).
                        unsafe { cu!(d, cuMemcpyHtoDAsync_v2(to, p, bytes, s)) }
                    })?;
                }
                (End::Device { .. }, End::Host(p)) => {
                    self.call("a batched copy from device", |d, s| {
                        // SAFETY: as above, the host end written: it was
                        // borrowed exclusively (`&mut [T]`) by the pair.
                        unsafe { cu!(d, cuMemcpyDtoHAsync_v2(p.cast_mut(), from, bytes, s)) }
                    })?;
                }
                (End::Device { .. }, End::Device { .. }) => {
                    self.call("a batched device copy", |d, s| {
                        // SAFETY: both ends device bytes of this context (checked).
                        unsafe { cu!(d, cuMemcpyDtoDAsync_v2(to, from, bytes, s)) }
                    })?;
                }
                (End::Host(_), End::Host(_)) => {
                    return Err(invalid_arg("copy_batch: a host-to-host pair"));
                }
            }
        }
        Ok(())
    }
}
