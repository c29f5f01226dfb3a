//! [`GrowableBuffer`]: a device buffer over a reserved range that grows in place,
//! and sleeps ([`SleepingBuffer`]) with its physical memory released.
//!
//! Invariants: element 0 never moves; `len()` elements are always mapped with
//! read-write access for the buffer's device; a sleeping buffer has no address
//! to pass and no slices; a failed sleep or wake hands back the buffer as it
//! really is (awake, or asleep and possibly partly mapped).
//!
//! `mod.rs` owns the buffer, its states and growing; `sleep.rs` putting it to
//! sleep; `wake.rs` waking it.

use std::fmt;
use std::ops::RangeBounds;
use std::sync::Arc;

use metrale_cuda_sys::CUdeviceptr;

mod sleep;
mod wake;

use crate::context::{AsContext, CudaContext};
use crate::error::{invalid_arg, MetraleError, Result};
use crate::memory::vmm::{
    granularity, round_up, Access, HandleTypes, PhysicalMemory, VirtualRange,
};
use crate::memory::{byte_len, sealed, DeviceMemory, DeviceMemoryMut, DeviceRepr, Uses};
use crate::memory::{DeviceSlice, DeviceSliceMut, PinnedBuffer};

/// A device buffer that grows without moving: a large range is reserved once and
/// physical memory is mapped on demand ([`GrowableBuffer::grow_to`]), so the
/// address of element 0 never changes. Usable wherever a [`DeviceBuffer`]
/// is (copies, fills, kernel arguments, slices).
///
/// [`GrowableBuffer::sleep`] releases its physical memory (optionally saving the
/// contents in pinned host memory) and [`SleepingBuffer::wake`] restores it at
/// the same addresses.
///
/// Dropping it, or sleeping it, waits for every use of the context
/// (`cuCtxSynchronize`); while the context has waits on mapped words pending
/// ([`CudaContext::pending_waits`]) that could block for ever, or an NCCL group
/// is open, a drop leaks the memory (one line on stderr; a group open on
/// another thread is waited out first, up to five seconds) and `sleep` returns
/// an error instead.
///
/// [`DeviceBuffer`]: super::DeviceBuffer
///
/// ```no_run
/// use metrale_runtime::{host, GrowableBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let s = h.stream();
/// let mut kv = GrowableBuffer::<f32>::new(&h, 1 << 30)?; // up to 4 GiB of address space
/// kv.grow_to(1 << 20)?;                                   // 4 MiB mapped
/// let p = kv.device_ptr();
/// kv.grow_to(1 << 24)?;
/// assert_eq!(kv.device_ptr(), p);
/// s.zero(&mut kv)?;
/// # Ok(()) }
/// ```
pub struct GrowableBuffer<T: DeviceRepr> {
    /// `range.device_ptr()`, held by reference for kernel arguments.
    ptr: CUdeviceptr,
    len: usize,
    range: VirtualRange,
    /// Bytes mapped from the start of the range (a multiple of the granularity).
    mapped: usize,
    /// What the physical memory it maps can be exported as.
    types: HandleTypes,
    /// The size every piece is rounded to: the larger of the range's and the
    /// physical memory's granularity (powers of two).
    grain: usize,
    /// Made by [`GrowableBuffer::from_physical`]: the memory is shared (imported,
    /// say), so it cannot sleep (waking would map fresh private memory).
    shared: bool,
    uses: Uses,
    _elem: std::marker::PhantomData<T>,
}

impl<T: DeviceRepr> GrowableBuffer<T> {
    /// Reserve room for `capacity` elements (rounded up to the granularity) on
    /// `ctx`'s device; nothing is mapped yet (`len() == 0`).
    ///
    /// # Errors
    /// `InvalidArgument` for a zero or overflowing capacity, or a type whose
    /// alignment exceeds the granularity; the failing reservation.
    pub fn new(ctx: &impl AsContext, capacity: usize) -> Result<GrowableBuffer<T>> {
        GrowableBuffer::with_handle_types(ctx, capacity, HandleTypes::NONE)
    }

    /// As [`GrowableBuffer::new`], with every piece of physical memory it maps
    /// exportable as `types` (find a piece with [`VirtualRange::physical`]).
    ///
    /// # Errors
    /// As [`GrowableBuffer::new`].
    pub fn with_handle_types(
        ctx: &impl AsContext,
        capacity: usize,
        types: HandleTypes,
    ) -> Result<GrowableBuffer<T>> {
        let ctx = ctx.context();
        let bytes = byte_len::<T>(capacity, "growable buffer")?;
        if bytes == 0 {
            return Err(invalid_arg("growable buffer: a capacity of 0 bytes"));
        }
        let g = granularity(ctx, HandleTypes::NONE)?.minimum;
        let g_types = if types == HandleTypes::NONE {
            g
        } else {
            granularity(ctx, types)?.minimum
        };
        let grain = g.max(g_types);
        if !grain.is_multiple_of(g) || !grain.is_multiple_of(g_types) {
            return Err(invalid_arg(format!(
                "device {}: growable buffer: the granularities of address space ({g} bytes) and of exportable memory ({g_types} bytes) do not divide each other",
                ctx.ordinal()
            )));
        }
        // Pieces are mapped at multiples of `grain`: the range must start at one.
        let range = VirtualRange::reserve_aligned(ctx, round_up(bytes, grain)?, Some(grain))?;
        super::device::check_alignment::<T>(range.base, "growable buffer")?;
        Ok(GrowableBuffer {
            ptr: range.base,
            len: 0,
            range,
            mapped: 0,
            types,
            grain,
            shared: false,
            uses: Uses::new(None),
            _elem: std::marker::PhantomData,
        })
    }

    /// A buffer over all of `phys` (imported from another process, say): a range
    /// of its size is reserved, `phys` is mapped there with read-write access for
    /// its device, and every element is usable (`len() == capacity()`, which
    /// does not grow further). Both processes see the same memory: order their
    /// accesses yourself (an IPC event, a message on the socket). Such a buffer
    /// cannot [`sleep`](GrowableBuffer::sleep): waking would map fresh private
    /// memory and silently end the sharing.
    ///
    /// # Errors
    /// `InvalidArgument` when the size is not a multiple of `T`'s size; the
    /// failing reservation or mapping.
    pub fn from_physical(phys: Arc<PhysicalMemory>) -> Result<GrowableBuffer<T>> {
        let elem = std::mem::size_of::<T>();
        if elem == 0 || !phys.size.is_multiple_of(elem) {
            return Err(invalid_arg(format!(
                "a buffer of {} over {} bytes of physical memory: not a whole number of elements",
                std::any::type_name::<T>(),
                phys.size
            )));
        }
        let ctx = Arc::clone(&phys.ctx);
        let (size, types) = (phys.size, phys.types);
        let mut range = VirtualRange::reserve(&ctx, size)?;
        super::device::check_alignment::<T>(range.base, "growable buffer")?;
        range.map(0, phys, 0, size, &[(&ctx, Access::ReadWrite)])?;
        Ok(GrowableBuffer {
            ptr: range.base,
            len: size / elem,
            grain: range.granularity,
            range,
            mapped: size,
            types,
            shared: true,
            uses: Uses::new(None),
            _elem: std::marker::PhantomData,
        })
    }

    /// Number of elements usable now.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no element is usable yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most elements it can grow to (the reserved range).
    pub fn capacity(&self) -> usize {
        self.range.size / std::mem::size_of::<T>().max(1)
    }

    /// Bytes of physical memory mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped
    }

    /// The address of element 0: the same for the buffer's whole life.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The context the memory lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.range.ctx
    }

    /// The reserved range (its mappings, granularity).
    pub fn range(&self) -> &VirtualRange {
        &self.range
    }

    /// Grow to `len` elements: physical memory is mapped (one piece, rounded up
    /// to the granularity) with read-write access for the buffer's device. New
    /// elements hold whatever the memory held. A `len` not above the current one
    /// changes nothing.
    ///
    /// # Errors
    /// `InvalidArgument` past [`GrowableBuffer::capacity`]; the failing
    /// `cuMemCreate`, `cuMemMap` or `cuMemSetAccess` (then the buffer is as
    /// before).
    pub fn grow_to(&mut self, len: usize) -> Result<()> {
        if len <= self.len {
            return Ok(());
        }
        if len > self.capacity() {
            return Err(invalid_arg(format!(
                "growing a buffer to {len} elements: its capacity is {} elements",
                self.capacity()
            )));
        }
        let bytes = byte_len::<T>(len, "growable buffer")?;
        if bytes > self.mapped {
            let piece = round_up(bytes - self.mapped, self.grain)?;
            let ctx = Arc::clone(&self.range.ctx);
            // `piece` is a multiple of the grain, so of the memory's granularity.
            let phys = Arc::new(PhysicalMemory::create(&ctx, piece, self.types)?);
            self.range
                .map(self.mapped, phys, 0, piece, &[(&ctx, Access::ReadWrite)])?;
            self.mapped += piece;
        }
        self.len = len;
        Ok(())
    }

    /// A shared view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        DeviceSlice::of_range(
            self.ptr,
            self.len,
            &range,
            &self.range.ctx,
            Some(&self.uses),
        )
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        DeviceSliceMut::of_range(
            self.ptr,
            self.len,
            &range,
            &self.range.ctx,
            Some(&self.uses),
        )
    }
}

/// A [`GrowableBuffer::sleep`] that did not complete.
pub struct SleepError<T: DeviceRepr> {
    /// What failed.
    pub error: MetraleError,
    /// The buffer, awake or asleep.
    pub buffer: SleepState<T>,
}

/// Where a failed sleep left a buffer.
pub enum SleepState<T: DeviceRepr> {
    /// Nothing was released.
    Awake(GrowableBuffer<T>),
    /// Asleep, part of the memory possibly still mapped.
    Asleep(SleepingBuffer<T>),
}

/// A [`SleepingBuffer::wake`] that did not complete: the buffer is still asleep
/// (what was mapped again stays mapped; waking again maps the rest).
pub struct WakeError<T: DeviceRepr> {
    /// What failed.
    pub error: MetraleError,
    /// The buffer, still asleep.
    pub buffer: SleepingBuffer<T>,
}

impl<T: DeviceRepr> fmt::Debug for SleepError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SleepError")
            .field("error", &self.error)
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl<T: DeviceRepr> fmt::Debug for SleepState<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SleepState::Awake(b) => f.debug_tuple("Awake").field(b).finish(),
            SleepState::Asleep(b) => f.debug_tuple("Asleep").field(b).finish(),
        }
    }
}

impl<T: DeviceRepr> fmt::Display for SleepError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<T: DeviceRepr> std::error::Error for SleepError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// `?` on a sleep in a function returning metrale's `Result`: the error is
/// kept, the buffer is dropped (match the [`SleepError`] to keep it).
impl<T: DeviceRepr> From<SleepError<T>> for MetraleError {
    fn from(e: SleepError<T>) -> MetraleError {
        e.error
    }
}

/// As `From<SleepError<T>>`: what [`GrowableBuffer::sleep`] returns.
impl<T: DeviceRepr> From<Box<SleepError<T>>> for MetraleError {
    fn from(e: Box<SleepError<T>>) -> MetraleError {
        e.error
    }
}

impl<T: DeviceRepr> fmt::Debug for WakeError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WakeError")
            .field("error", &self.error)
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl<T: DeviceRepr> fmt::Display for WakeError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<T: DeviceRepr> std::error::Error for WakeError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// `?` on a wake in a function returning metrale's `Result`: the error is
/// kept, the sleeping buffer is dropped (match the [`WakeError`] to keep it).
impl<T: DeviceRepr> From<WakeError<T>> for MetraleError {
    fn from(e: WakeError<T>) -> MetraleError {
        e.error
    }
}

/// As `From<WakeError<T>>`: what [`SleepingBuffer::wake`] returns.
impl<T: DeviceRepr> From<Box<WakeError<T>>> for MetraleError {
    fn from(e: Box<WakeError<T>>) -> MetraleError {
        e.error
    }
}

/// A [`GrowableBuffer`] whose physical memory was released: its addresses stay
/// reserved, and nothing can reach them until [`SleepingBuffer::wake`].
pub struct SleepingBuffer<T: DeviceRepr> {
    len: usize,
    mapped: usize,
    /// `(offset, size)` of each mapping it had.
    pieces: Vec<(usize, usize)>,
    /// Per piece: released with its bytes saved, so waking restores it (a piece
    /// still mapped kept its contents; a restored one is done).
    to_restore: Vec<bool>,
    saved: Option<PinnedBuffer<u8>>,
    /// The buffer (its `len` is not usable while asleep: no slice can be made).
    buffer: GrowableBuffer<T>,
}

impl<T: DeviceRepr> fmt::Debug for SleepingBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SleepingBuffer")
            .field("device", &self.buffer.range.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.buffer.ptr))
            .field("len", &self.len)
            .field("saved", &self.saved.is_some())
            .finish()
    }
}

impl<T: DeviceRepr> fmt::Debug for GrowableBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrowableBuffer")
            .field("device", &self.range.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("mapped_bytes", &self.mapped)
            .finish()
    }
}

impl<T: DeviceRepr> Drop for GrowableBuffer<T> {
    fn drop(&mut self) {
        // The range's own Drop would not know the foreign streams.
        self.range.release(Some(&self.uses));
    }
}

impl<T: DeviceRepr> sealed::Sealed for GrowableBuffer<T> {
    fn address_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }
}
impl<T: DeviceRepr> DeviceMemory<T> for GrowableBuffer<T> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn memory_context(&self) -> &Arc<CudaContext> {
        &self.range.ctx
    }
    fn uses(&self) -> Option<&Uses> {
        Some(&self.uses)
    }
    fn describe(&self) -> String {
        format!(
            "growable buffer {:#x} ({} x {})",
            self.ptr,
            self.len,
            std::any::type_name::<T>()
        )
    }
}
impl<T: DeviceRepr> sealed::SealedMut for GrowableBuffer<T> {}
impl<T: DeviceRepr> DeviceMemoryMut<T> for GrowableBuffer<T> {}
