//! Device buffers ([`DeviceBuffer`]) and pinned host buffers ([`PinnedBuffer`]) of
//! plain-old-data elements ([`DeviceRepr`]).
//!
//! Invariants:
//! - A buffer holds the [`CudaHost`] it was allocated in, so the context outlives
//!   the allocation; its address and length never change.
//! - Copies that the API presents as synchronous are queued on the host's stream and
//!   then wait for it, so they are ordered after kernels launched on that stream (the
//!   legacy default stream does not order with a non-blocking one).
//! - Drop frees quietly at teardown (`is_teardown_noop`), reports any other failure
//!   as one line on stderr, and never panics.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::CUdeviceptr;

use crate::error::{cu, MetraleError, Result};
use crate::host::CudaHost;

/// Plain-old-data: every bit pattern is a valid value, there are no pointers or
/// padding-sensitive invariants, and the layout is what a kernel sees.
///
/// # Safety
/// Implement only for `Copy` types with no padding bytes for which every bit
/// pattern is valid.
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {}

macro_rules! device_repr {
    ($($t:ty),*) => { $(
        // SAFETY: a primitive number: no padding, every bit pattern valid.
        unsafe impl DeviceRepr for $t {}
    )* };
}
device_repr!(u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, usize, isize, f32, f64);
// SAFETY: an array of plain-old-data has no padding between its elements.
unsafe impl<T: DeviceRepr, const N: usize> DeviceRepr for [T; N] {}

fn byte_len<T>(len: usize, what: &str) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
        MetraleError::InvalidArgument(format!("{what} of {len} elements overflows usize bytes"))
    })
}

/// `len` elements of `T` in device memory (`cuMemAlloc`), freed on drop.
pub struct DeviceBuffer<T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    host: Arc<CudaHost>,
    _elem: PhantomData<T>,
}

// SAFETY: the buffer owns a device allocation addressed by an integer; the driver
// allows any thread to use or free it once the context is bound, which every method
// does. Shared references only read `ptr` and `len`.
unsafe impl<T: DeviceRepr> Send for DeviceBuffer<T> {}
// SAFETY: as for Send; `&self` methods that write device memory go through the
// driver, which orders them on the host's stream.
unsafe impl<T: DeviceRepr> Sync for DeviceBuffer<T> {}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// Allocate `len` elements; their contents are whatever the device memory held.
    /// A zero-length buffer allocates nothing and has address 0.
    ///
    /// # Errors
    /// The failing driver call (`cuMemAlloc_v2`, out of memory, ...), naming the size.
    pub fn alloc(host: &Arc<CudaHost>, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = byte_len::<T>(len, "device buffer")?;
        let mut ptr: CUdeviceptr = 0;
        if bytes > 0 {
            let subject = || format!("device {}: allocating {bytes} bytes", host.ordinal());
            host.bind().map_err(|e| e.about(subject()))?;
            // SAFETY: writes one CUdeviceptr; the context is current.
            unsafe { cu!(host.driver(), cuMemAlloc_v2(&mut ptr, bytes)) }
                .map_err(|e| e.about(subject()))?;
        }
        Ok(DeviceBuffer {
            ptr,
            len,
            host: Arc::clone(host),
            _elem: PhantomData,
        })
    }

    /// Allocate and fill from `data`, waiting until the copy is done.
    ///
    /// # Errors
    /// As [`DeviceBuffer::alloc`] and [`DeviceBuffer::copy_from_host`].
    pub fn from_host(host: &Arc<CudaHost>, data: &[T]) -> Result<DeviceBuffer<T>> {
        let buf = DeviceBuffer::alloc(host, data.len())?;
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// Copy `data` (exactly `len()` elements) into the buffer, ordered after work
    /// already on the host's stream, and wait for it.
    ///
    /// # Errors
    /// `InvalidArgument` on a length mismatch; the failing driver call otherwise.
    pub fn copy_from_host(&self, data: &[T]) -> Result<()> {
        self.check_len(data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let h = &self.host;
        let subject = || format!("device {}: copy to device buffer", h.ordinal());
        h.bind().map_err(|e| e.about(subject()))?;
        let bytes = std::mem::size_of_val(data);
        // SAFETY: `data` is `bytes` long and borrowed until the stream sync below;
        // the destination is this buffer's allocation of the same size.
        unsafe {
            cu!(
                h.driver(),
                cuMemcpyHtoDAsync_v2(self.ptr, data.as_ptr().cast(), bytes, h.stream().raw())
            )
        }
        .map_err(|e| e.about(subject()))?;
        h.synchronize(h.stream().raw())
    }

    /// Copy the buffer into `out` (exactly `len()` elements), ordered after work
    /// already on the host's stream, and wait for it.
    ///
    /// # Errors
    /// `InvalidArgument` on a length mismatch; the failing driver call otherwise
    /// (including an earlier kernel's fault, reported by the synchronisation).
    pub fn copy_to_host(&self, out: &mut [T]) -> Result<()> {
        self.check_len(out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let h = &self.host;
        let subject = || format!("device {}: copy from device buffer", h.ordinal());
        h.bind().map_err(|e| e.about(subject()))?;
        let bytes = std::mem::size_of_val(out);
        // SAFETY: `out` is `bytes` long and exclusively borrowed until the sync
        // below; the source is this buffer's allocation of the same size.
        unsafe {
            cu!(
                h.driver(),
                cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), self.ptr, bytes, h.stream().raw())
            )
        }
        .map_err(|e| e.about(subject()))?;
        h.synchronize(h.stream().raw())
    }

    /// The buffer's contents as a new vector.
    ///
    /// # Errors
    /// As [`DeviceBuffer::copy_to_host`].
    pub fn to_host_vec(&self) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(self.len);
        let spare = &mut out.spare_capacity_mut()[..self.len];
        // SAFETY: `MaybeUninit<T>` and `T` have the same layout; the copy below
        // writes every element before `set_len` exposes them (and T is plain data).
        let slice = unsafe { &mut *(std::ptr::from_mut(spare) as *mut [T]) };
        self.copy_to_host(slice)?;
        // SAFETY: `copy_to_host` succeeded, so all `len` elements were written.
        unsafe { out.set_len(self.len) };
        Ok(out)
    }

    fn check_len(&self, other: usize) -> Result<()> {
        if other == self.len {
            Ok(())
        } else {
            Err(MetraleError::InvalidArgument(format!(
                "host slice of {other} elements for a device buffer of {}",
                self.len
            )))
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address, for kernel arguments and driver calls of your own.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The device address, by reference (what a kernel argument points at).
    pub(crate) fn device_ptr_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }

    /// The host whose context holds the allocation.
    pub fn host(&self) -> &Arc<CudaHost> {
        &self.host
    }
}

impl<T: DeviceRepr> fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DeviceRepr> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let h = &self.host;
        h.release_with(
            format_args!(
                "freeing device buffer {:#x} on device {}",
                self.ptr,
                h.ordinal()
            ),
            |failures| {
                // SAFETY: the allocation is this buffer's own, freed once, here.
                if let Err(e) = unsafe { cu!(h.driver(), cuMemFree_v2(self.ptr)) } {
                    failures.push(e);
                }
            },
        );
    }
}

/// `len` elements of `T` in page-locked host memory (`cuMemAllocHost`), zeroed at
/// allocation, freed on drop. Dereferences to a slice. Copies from and to pinned
/// memory run at full bus speed and truly asynchronously.
pub struct PinnedBuffer<T: DeviceRepr> {
    ptr: *mut T,
    len: usize,
    host: Arc<CudaHost>,
}

// SAFETY: the buffer owns its allocation like a Box<[T]>; T is Send + Sync.
unsafe impl<T: DeviceRepr> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads through `&[T]`.
unsafe impl<T: DeviceRepr> Sync for PinnedBuffer<T> {}

impl<T: DeviceRepr> PinnedBuffer<T> {
    /// Allocate `len` zeroed elements. A zero-length buffer allocates nothing.
    ///
    /// # Errors
    /// The failing driver call (`cuMemAllocHost_v2`), naming the size.
    pub fn zeroed(host: &Arc<CudaHost>, len: usize) -> Result<PinnedBuffer<T>> {
        let bytes = byte_len::<T>(len, "pinned buffer")?;
        let mut ptr: *mut c_void = std::ptr::NonNull::<T>::dangling().as_ptr().cast();
        if bytes > 0 {
            let subject = || format!("device {}: pinning {bytes} host bytes", host.ordinal());
            host.bind().map_err(|e| e.about(subject()))?;
            // SAFETY: writes one pointer; the context is current.
            unsafe { cu!(host.driver(), cuMemAllocHost_v2(&mut ptr, bytes)) }
                .map_err(|e| e.about(subject()))?;
            // SAFETY: the driver returned `bytes` writable bytes at `ptr`, page-aligned
            // (so aligned for T).
            unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        }
        Ok(PinnedBuffer {
            ptr: ptr.cast(),
            len,
            host: Arc::clone(host),
        })
    }

    /// Raw pointer to the first element.
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }

    /// Raw mutable pointer to the first element.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        std::mem::size_of_val(&**self)
    }
}

impl<T: DeviceRepr> std::ops::Deref for PinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised (zeroed, then written as T) elements,
        // or is dangling and aligned with len 0.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: DeviceRepr> std::ops::DerefMut for PinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for Deref, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: DeviceRepr> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DeviceRepr> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.len == 0 || std::mem::size_of::<T>() == 0 {
            return;
        }
        let h = &self.host;
        h.release_with(
            format_args!(
                "freeing pinned buffer {:p} on device {}",
                self.ptr,
                h.ordinal()
            ),
            |failures| {
                // SAFETY: the allocation is this buffer's own, freed once, here.
                if let Err(e) = unsafe { cu!(h.driver(), cuMemFreeHost(self.ptr.cast())) } {
                    failures.push(e);
                }
            },
        );
    }
}
