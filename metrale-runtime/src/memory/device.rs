//! [`DeviceBuffer`] and its borrowed views [`DeviceSlice`] / [`DeviceSliceMut`].

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use metrale_cuda_sys::CUdeviceptr;

use super::free::{release, Kind};
use super::{byte_len, sealed, DeviceMemory, DeviceMemoryMut, DeviceRepr, Uses};
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, Result};
use crate::stream::{AsStream, CudaStream};

/// `len` elements of `T` in device memory, freed on drop.
///
/// Allocated synchronously ([`DeviceBuffer::alloc`], `cuMemAlloc`) or in stream
/// order ([`CudaStream::alloc`], `cuMemAllocAsync`; then freed on that stream).
/// Borrow a range with [`DeviceBuffer::slice`] / [`DeviceBuffer::slice_mut`];
/// pass `&buf`, `&mut buf` or a slice as a kernel argument.
///
/// ```no_run
/// use metrale_runtime::{host, DeviceBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let s = h.stream();
/// let mut buf = DeviceBuffer::from_host(&h, &[1.0f32, 2.0, 3.0, 4.0])?;
/// s.memset_u32(&mut buf.slice_mut(2..)?, 0)?;          // zero the last two
/// assert_eq!(s.to_vec(&buf)?, [1.0, 2.0, 0.0, 0.0]);
/// # Ok(()) }
/// ```
pub struct DeviceBuffer<T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
    /// The context generation the allocation was made in.
    made: Generation,
    /// The allocation's own stream (stream-ordered) and the streams that used it.
    uses: Uses,
    _elem: PhantomData<T>,
}

/// Check that the driver's address suits `T`'s alignment (it gives 256 bytes).
pub(crate) fn check_alignment<T>(ptr: u64, what: &str) -> Result<()> {
    let align = std::mem::align_of::<T>() as u64;
    if ptr.is_multiple_of(align) {
        Ok(())
    } else {
        Err(invalid_arg(format!(
            "{what}: the driver's address {ptr:#x} is not aligned to {align} bytes, the alignment of {}",
            std::any::type_name::<T>()
        )))
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// Allocate `len` elements (`cuMemAlloc`); their contents are whatever the
    /// device memory held. A zero-length buffer allocates nothing (address 0).
    ///
    /// # Errors
    /// The failing `cuMemAlloc_v2` (out of memory, ...), naming the size; an
    /// element count whose byte size overflows.
    pub fn alloc(ctx: &impl AsContext, len: usize) -> Result<DeviceBuffer<T>> {
        let ctx = ctx.context();
        let bytes = byte_len::<T>(len, "device buffer")?;
        let mut ptr: CUdeviceptr = 0;
        if bytes > 0 {
            ctx.call(
                || format!("device {}: allocating {bytes} bytes", ctx.ordinal()),
                // SAFETY: writes one address; the context is current.
                |d| unsafe { cu!(d, cuMemAlloc_v2(&mut ptr, bytes)) },
            )?;
        }
        let buf = DeviceBuffer::from_parts(ptr, len, ctx, ctx.generation(), None);
        check_alignment::<T>(ptr, "device buffer")?;
        Ok(buf)
    }

    /// A buffer over `ptr`, allocated in `ctx` (generation `made`), on stream
    /// `own` when it is stream-ordered.
    pub(crate) fn from_parts(
        ptr: CUdeviceptr,
        len: usize,
        ctx: &Arc<CudaContext>,
        made: Generation,
        own: Option<&CudaStream>,
    ) -> DeviceBuffer<T> {
        DeviceBuffer {
            ptr,
            len,
            ctx: Arc::clone(ctx),
            made,
            uses: Uses::new(own),
            _elem: PhantomData,
        }
    }

    #[inline]
    fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The allocation's use record (for views of it made elsewhere: a capture
    /// arena's).
    pub(crate) fn uses_ref(&self) -> &Uses {
        &self.uses
    }

    /// Allocate (`cuMemAlloc`) and fill from `data` with a copy queued on
    /// `stream` (a stream, or a host's or registry's stream) after its work so
    /// far; returns once the copy is done, so the buffer is ready for work on
    /// any stream of its device. With only a context at hand, pass
    /// `&host(ctx.ordinal())?` (the device's host shares the context) or a new
    /// `CudaStream` (see [`AsStream`]).
    ///
    /// # Errors
    /// As [`DeviceBuffer::alloc`] and [`CudaStream::copy_h2d`].
    pub fn from_host(stream: &impl AsStream, data: &[T]) -> Result<DeviceBuffer<T>> {
        let stream = stream.stream();
        let mut buf = DeviceBuffer::alloc(stream, data.len())?;
        stream.copy_h2d(data, &mut buf)?;
        Ok(buf)
    }

    /// Allocate `len` elements and fill them with zero bytes on `stream`; returns
    /// once they are zero (ready for work on any stream of the device). Unlike
    /// [`DeviceBuffer::alloc`] this queues work, so it takes a stream, host or
    /// registry, not a context: from a context, `&host(ctx.ordinal())?` (see
    /// [`AsStream`]).
    ///
    /// # Errors
    /// As [`DeviceBuffer::alloc`], and the failing fill or wait.
    pub fn zeroed(stream: &impl AsStream, len: usize) -> Result<DeviceBuffer<T>> {
        let stream = stream.stream();
        let mut buf = DeviceBuffer::alloc(stream, len)?;
        stream.zero(&mut buf)?;
        stream.finish_queued()?;
        Ok(buf)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address, for driver calls of your own.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The context the memory lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.ctx()
    }

    /// The stream a stream-ordered buffer is freed on (`None`: `cuMemAlloc`).
    pub fn stream(&self) -> Option<&CudaStream> {
        self.uses.own.as_ref()
    }

    /// A shared view of `range` (`buf.slice(2..10)`, `buf.slice(..)`).
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        DeviceSlice::of_range(self.ptr, self.len, &range, self.ctx(), Some(&self.uses))
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        DeviceSliceMut::of_range(self.ptr, self.len, &range, self.ctx(), Some(&self.uses))
    }

    /// Shared views of consecutive `size`-element chunks (the last may be
    /// shorter), as `<[T]>::chunks`; none for `size` 0.
    pub fn chunks(&self, size: usize) -> impl Iterator<Item = DeviceSlice<'_, T>> + '_ {
        chunk_views::<T>(self.ptr, self.len, size)
            .map(|(ptr, len)| DeviceSlice::from_parts(ptr, len, self.ctx(), Some(&self.uses)))
    }

    /// Disjoint mutable views of consecutive `size`-element chunks (the last
    /// may be shorter), as `<[T]>::chunks_mut`: for copying many blocks of one
    /// buffer at once ([`CudaStream::copy_batch`]); none for `size` 0.
    pub fn chunks_mut(&mut self, size: usize) -> impl Iterator<Item = DeviceSliceMut<'_, T>> + '_ {
        let (ctx, uses) = (&self.ctx, &self.uses);
        chunk_views::<T>(self.ptr, self.len, size)
            .map(move |(ptr, len)| DeviceSliceMut::from_parts(ptr, len, ctx, Some(uses)))
    }
}

/// `(address, len)` of the consecutive `size`-element chunks of `len`
/// elements of `T` at `ptr`: disjoint, covering all of them.
fn chunk_views<T>(
    ptr: CUdeviceptr,
    len: usize,
    size: usize,
) -> impl Iterator<Item = (CUdeviceptr, usize)> {
    let step = size.max(1);
    let count = if size == 0 { 0 } else { len.div_ceil(step) };
    (0..count).map(move |i| {
        let start = i * step;
        (
            ptr + (start * std::mem::size_of::<T>()) as u64,
            step.min(len - start),
        )
    })
}

/// `(start, len)` of `range` within `0..len`.
pub(crate) fn bounds(range: &impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e - s)),
        _ => Err(invalid_arg(format!(
            "slice {} of {len} elements is out of bounds",
            RangeText(range)
        ))),
    }
}

struct RangeText<'a, R>(&'a R);

impl<R: RangeBounds<usize>> fmt::Display for RangeText<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.start_bound() {
            Bound::Included(s) => write!(f, "{s}")?,
            Bound::Excluded(s) => write!(f, "{s}<")?,
            Bound::Unbounded => {}
        }
        match self.0.end_bound() {
            Bound::Included(e) => write!(f, "..={e}"),
            Bound::Excluded(e) => write!(f, "..{e}"),
            Bound::Unbounded => write!(f, ".."),
        }
    }
}

impl<T: DeviceRepr> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.ctx().ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream_ordered", &self.uses.own.is_some())
            .finish()
    }
}

impl<T: DeviceRepr> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        release(self.ptr, Kind::Device, &self.ctx, self.made, &mut self.uses);
    }
}

impl<T: DeviceRepr> sealed::Sealed for DeviceBuffer<T> {
    fn address_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }
}
impl<T: DeviceRepr> DeviceMemory<T> for DeviceBuffer<T> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn memory_context(&self) -> &Arc<CudaContext> {
        self.ctx()
    }
    fn uses(&self) -> Option<&Uses> {
        Some(&self.uses)
    }
    fn describe(&self) -> String {
        format!(
            "device buffer {:#x} ({} x {})",
            self.ptr,
            self.len,
            std::any::type_name::<T>()
        )
    }
}
impl<T: DeviceRepr> sealed::SealedMut for DeviceBuffer<T> {}
impl<T: DeviceRepr> DeviceMemoryMut<T> for DeviceBuffer<T> {}

macro_rules! slice_type {
    ($(#[$doc:meta])* $name:ident, $borrow:ty) => {
        $(#[$doc])*
        pub struct $name<'a, T: DeviceRepr> {
            ptr: CUdeviceptr,
            len: usize,
            ctx: &'a Arc<CudaContext>,
            uses: Option<&'a Uses>,
            _elem: PhantomData<$borrow>,
        }

        impl<'a, T: DeviceRepr> $name<'a, T> {
            /// A view of `len` elements at `ptr`, memory of `ctx` whose streams
            /// `uses` records (another room's buffer, e.g. a growable buffer).
            pub(crate) fn from_parts(
                ptr: CUdeviceptr,
                len: usize,
                ctx: &'a Arc<CudaContext>,
                uses: Option<&'a Uses>,
            ) -> Self {
                $name { ptr, len, ctx, uses, _elem: PhantomData }
            }

            /// The view of `range` of `whole` elements at `ptr` (see
            /// [`from_parts`](Self::from_parts)): every slice method's body.
            pub(crate) fn of_range(
                ptr: CUdeviceptr,
                whole: usize,
                range: &impl RangeBounds<usize>,
                ctx: &'a Arc<CudaContext>,
                uses: Option<&'a Uses>,
            ) -> Result<Self> {
                let (start, len) = bounds(range, whole)?;
                let ptr = ptr + (start * std::mem::size_of::<T>()) as u64;
                Ok($name::from_parts(ptr, len, ctx, uses))
            }
        }

        impl<T: DeviceRepr> $name<'_, T> {
            /// Number of elements.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether the view has no elements.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// The device address of the first element.
            pub fn device_ptr(&self) -> CUdeviceptr {
                self.ptr
            }


            /// A shared sub-view of `range`, relative to this view.
            ///
            /// # Errors
            /// `InvalidArgument` for a range out of bounds or reversed.
            pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
                let (start, len) = bounds(&range, self.len)?;
                Ok(DeviceSlice {
                    ptr: self.ptr + (start * std::mem::size_of::<T>()) as u64,
                    len,
                    ctx: self.ctx,
                    uses: self.uses,
                    _elem: PhantomData,
                })
            }
        }

        impl<T: DeviceRepr> fmt::Debug for $name<'_, T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("ptr", &format_args!("{:#x}", self.ptr))
                    .field("len", &self.len)
                    .finish()
            }
        }


        impl<T: DeviceRepr> sealed::Sealed for $name<'_, T> {
            fn address_ref(&self) -> &CUdeviceptr {
                &self.ptr
            }
        }
        impl<T: DeviceRepr> DeviceMemory<T> for $name<'_, T> {
            fn device_ptr(&self) -> CUdeviceptr {
                self.ptr
            }
            fn len(&self) -> usize {
                self.len
            }
            fn memory_context(&self) -> &Arc<CudaContext> {
                self.ctx
            }
            fn uses(&self) -> Option<&Uses> {
                self.uses
            }
            fn describe(&self) -> String {
                format!(
                    "device slice {:#x} ({} x {})",
                    self.ptr,
                    self.len,
                    std::any::type_name::<T>()
                )
            }
        }
    };
}

slice_type!(
    /// A shared view of a range of a [`DeviceBuffer`]: a copy source or a kernel
    /// argument.
    DeviceSlice,
    &'a T
);
slice_type!(
    /// A mutable view of a range of a [`DeviceBuffer`]: also a copy or fill target.
    DeviceSliceMut,
    &'a mut T
);

impl<T: DeviceRepr> sealed::SealedMut for DeviceSliceMut<'_, T> {}
impl<T: DeviceRepr> DeviceMemoryMut<T> for DeviceSliceMut<'_, T> {}

impl<'a, T: DeviceRepr> DeviceSliceMut<'a, T> {
    /// Disjoint mutable views of consecutive `size`-element chunks of this
    /// view (the last may be shorter), as `<[T]>::chunks_mut`; none for `size` 0.
    pub fn chunks_mut(&mut self, size: usize) -> impl Iterator<Item = DeviceSliceMut<'_, T>> + '_ {
        let (ctx, uses) = (self.ctx, self.uses);
        chunk_views::<T>(self.ptr, self.len, size)
            .map(move |(ptr, len)| DeviceSliceMut::from_parts(ptr, len, ctx, uses))
    }

    /// A mutable sub-view of `range`, relative to this view.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let (start, len) = bounds(&range, self.len)?;
        Ok(DeviceSliceMut {
            ptr: self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
            ctx: self.ctx,
            uses: self.uses,
            _elem: PhantomData,
        })
    }
}
