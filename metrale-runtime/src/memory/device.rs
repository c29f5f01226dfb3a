//! [`DeviceBuffer`] and its borrowed views [`DeviceSlice`] / [`DeviceSliceMut`].

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use metrale_cuda_sys::{CUdeviceptr, CUstream};

use super::{byte_len, sealed, DeviceMemory, DeviceMemoryMut, DeviceRepr, StreamOrdered};
use crate::context::{AsContext, CudaContext};
use crate::error::{cu, invalid_arg, Result};
use crate::stream::CudaStream;

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
    home: Home,
    _elem: PhantomData<T>,
}

/// What a buffer's allocation belongs to: a context (`cuMemAlloc`), or the stream
/// it was allocated on in stream order (which holds the context).
enum Home {
    Context(Arc<CudaContext>),
    Stream(StreamOrdered),
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
        let buf = DeviceBuffer::from_parts(ptr, len, ctx, None);
        check_alignment::<T>(ptr, "device buffer")?;
        Ok(buf)
    }

    pub(crate) fn from_parts(
        ptr: CUdeviceptr,
        len: usize,
        ctx: &Arc<CudaContext>,
        ordered: Option<StreamOrdered>,
    ) -> DeviceBuffer<T> {
        DeviceBuffer {
            ptr,
            len,
            home: match ordered {
                Some(o) => Home::Stream(o),
                None => Home::Context(Arc::clone(ctx)),
            },
            _elem: PhantomData,
        }
    }

    #[inline]
    fn ctx(&self) -> &Arc<CudaContext> {
        match &self.home {
            Home::Context(c) => c,
            Home::Stream(o) => o.stream().context(),
        }
    }

    #[inline]
    fn ordered(&self) -> Option<&StreamOrdered> {
        match &self.home {
            Home::Context(_) => None,
            Home::Stream(o) => Some(o),
        }
    }

    /// Allocate and fill from `data`; returns once the data is on the device, so
    /// the buffer is ready for work on any stream.
    ///
    /// # Errors
    /// As [`DeviceBuffer::alloc`], and the failing copy.
    pub fn from_host(ctx: &impl AsContext, data: &[T]) -> Result<DeviceBuffer<T>> {
        let mut buf = DeviceBuffer::alloc(ctx, data.len())?;
        buf.legacy_stream().copy_h2d(data, &mut buf)?;
        Ok(buf)
    }

    /// Allocate `len` zeroed elements; returns once they are zero.
    ///
    /// # Errors
    /// As [`DeviceBuffer::alloc`], and the failing fill.
    pub fn zeroed(ctx: &impl AsContext, len: usize) -> Result<DeviceBuffer<T>> {
        let mut buf = DeviceBuffer::alloc(ctx, len)?;
        let s = buf.legacy_stream();
        s.zero(&mut buf)?;
        s.synchronize()?;
        Ok(buf)
    }

    /// The legacy default stream of this buffer's context: for the one-off
    /// initialisation copies of a fresh buffer, which wait before returning.
    fn legacy_stream(&self) -> CudaStream {
        let null: CUstream = std::ptr::null_mut();
        // SAFETY: null is the legacy default stream, valid in every context and never
        // destroyed.
        unsafe { CudaStream::from_raw(self.ctx(), null) }
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

    /// The device address, by reference (what a kernel argument points at).
    pub(crate) fn device_ptr_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }

    /// The context the memory lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.ctx()
    }

    /// The stream a stream-ordered buffer is freed on (`None`: `cuMemAlloc`).
    pub fn stream(&self) -> Option<&CudaStream> {
        self.ordered().map(StreamOrdered::stream)
    }

    /// A shared view of `range` (`buf.slice(2..10)`, `buf.slice(..)`).
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        let (start, len) = bounds(&range, self.len)?;
        Ok(DeviceSlice {
            ptr: self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
            ctx: self.ctx(),
            ordered: self.ordered(),
            _elem: PhantomData,
        })
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let (start, len) = bounds(&range, self.len)?;
        Ok(DeviceSliceMut {
            ptr: self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
            ctx: self.ctx(),
            ordered: self.ordered(),
            _elem: PhantomData,
        })
    }
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
            .field("stream_ordered", &self.ordered().is_some())
            .finish()
    }
}

impl<T: DeviceRepr> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let ptr = self.ptr;
        match &self.home {
            Home::Context(ctx) => ctx.release_with(
                format_args!("freeing device buffer {ptr:#x} on device {}", ctx.ordinal()),
                |d, failures| {
                    // SAFETY: this buffer's own allocation, freed once; `cuMemFree`
                    // waits for work that uses it.
                    if let Err(e) = unsafe { cu!(d, cuMemFree_v2(ptr)) } {
                        failures.push(e);
                    }
                },
            ),
            Home::Stream(o) => {
                let (stream, ctx) = (o.stream().raw(), o.stream().context());
                let what = format_args!(
                    "freeing stream-ordered buffer {ptr:#x} on device {}",
                    ctx.ordinal()
                );
                if o.used_elsewhere() {
                    // Used on other streams too: let all of it finish first.
                    ctx.release_with(what, |d, failures| {
                        // SAFETY: no arguments; the context is current.
                        if let Err(e) = unsafe { cu!(d, cuCtxSynchronize()) } {
                            failures.push(e);
                        }
                        // SAFETY: freed once, in order on the stream it was
                        // allocated on (kept alive by this buffer).
                        if let Err(e) = unsafe { cu!(d, cuMemFreeAsync(ptr, stream)) } {
                            failures.push(e);
                        }
                    });
                } else {
                    // SAFETY: as above; the stream names the context.
                    ctx.release_on_stream(what, |d| unsafe { cu!(d, cuMemFreeAsync(ptr, stream)) });
                }
            }
        }
    }
}

impl<T: DeviceRepr> sealed::Sealed for DeviceBuffer<T> {}
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
    fn stream_ordered(&self) -> Option<&StreamOrdered> {
        self.ordered()
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
impl<T: DeviceRepr> DeviceMemoryMut<T> for DeviceBuffer<T> {}

macro_rules! slice_type {
    ($(#[$doc:meta])* $name:ident, $borrow:ty) => {
        $(#[$doc])*
        pub struct $name<'a, T: DeviceRepr> {
            ptr: CUdeviceptr,
            len: usize,
            ctx: &'a Arc<CudaContext>,
            ordered: Option<&'a StreamOrdered>,
            _elem: PhantomData<$borrow>,
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

            /// The device address, by reference (what a kernel argument points at).
            pub(crate) fn device_ptr_ref(&self) -> &CUdeviceptr {
                &self.ptr
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
                    ordered: self.ordered,
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


        impl<T: DeviceRepr> sealed::Sealed for $name<'_, T> {}
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
            fn stream_ordered(&self) -> Option<&StreamOrdered> {
                self.ordered
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

impl<T: DeviceRepr> DeviceMemoryMut<T> for DeviceSliceMut<'_, T> {}

impl<T: DeviceRepr> DeviceSliceMut<'_, T> {
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
            ordered: self.ordered,
            _elem: PhantomData,
        })
    }
}
