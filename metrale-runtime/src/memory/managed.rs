//! [`ManagedBuffer`]: unified memory (`cuMemAllocManaged`) that kernels and the host
//! both address, with prefetch on a stream.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr};

use super::device::check_alignment;
use super::free::{release, Kind};
use super::{byte_len, check_stream, sealed, DeviceMemory, DeviceMemoryMut, DevicePod, Uses};
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, Result};
use crate::stream::CudaStream;

/// Where [`CudaStream::prefetch`] moves managed memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PrefetchTarget {
    /// The device of the stream.
    Device,
    /// Host memory.
    Host,
}

/// `len` elements of `T` in managed memory, zeroed at allocation: the same address
/// works in kernels (pass `&buf`) and on the host ([`ManagedBuffer::host_slice`]).
///
/// Host access waits for all work of the context first, so the host never reads
/// or writes while a kernel may be using the memory.
///
/// ```no_run
/// use metrale_runtime::{host, ManagedBuffer, PrefetchTarget};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let mut m = ManagedBuffer::<u32>::zeroed(&h, 1024)?;
/// m.host_slice()?.fill(7);
/// h.stream().prefetch(&m, PrefetchTarget::Device)?;
/// // ... kernels read and write `&m` on the stream ...
/// let values = m.host_slice()?; // waits for them first
/// # Ok(()) }
/// ```
pub struct ManagedBuffer<T: DevicePod> {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
    made: Generation,
    /// Streams of other devices that used the buffer (peer copies).
    uses: Uses,
    _elem: PhantomData<T>,
}

impl<T: DevicePod> ManagedBuffer<T> {
    /// Allocate `len` zeroed elements of managed memory, accessible from any
    /// stream (`CU_MEM_ATTACH_GLOBAL`).
    ///
    /// # Errors
    /// `InvalidArgument` on a device without managed memory; the failing
    /// `cuMemAllocManaged`, naming the size.
    pub fn zeroed(ctx: &impl AsContext, len: usize) -> Result<ManagedBuffer<T>> {
        let ctx = ctx.context();
        if !ctx.limits().managed_memory {
            return Err(invalid_arg(format!(
                "device {} does not support managed memory (CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 0)",
                ctx.ordinal()
            )));
        }
        let bytes = byte_len::<T>(len, "managed buffer")?;
        let mut ptr: CUdeviceptr = 0;
        if bytes > 0 {
            let flags = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL.0;
            ctx.call(
                || format!("device {}: allocating {bytes} managed bytes", ctx.ordinal()),
                // SAFETY: writes one address; the context is current.
                |d| unsafe { cu!(d, cuMemAllocManaged(&mut ptr, bytes, flags)) },
            )?;
        }
        let buf = ManagedBuffer {
            ptr,
            len,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            uses: Uses::new(None),
            _elem: PhantomData,
        };
        check_alignment::<T>(ptr, "managed buffer")?;
        if bytes > 0 && ctx.limits().concurrent_managed_access {
            // SAFETY: `bytes` of fresh managed memory, addressable from the host; no
            // work can use it yet, and the device lets the host touch managed memory
            // while kernels run (CONCURRENT_MANAGED_ACCESS).
            unsafe { std::ptr::write_bytes(ptr as usize as *mut u8, 0, bytes) };
        } else if bytes > 0 {
            // Without concurrent access the host may not touch managed memory while
            // any kernel of the device runs: the driver zeroes it instead.
            ctx.call(
                || format!("device {}: zeroing {bytes} managed bytes", ctx.ordinal()),
                // SAFETY: the fresh allocation's `bytes`; the context is current.
                |d| unsafe { cu!(d, cuMemsetD8_v2(ptr, 0, bytes)) },
            )?;
            ctx.synchronize()?;
        }
        Ok(buf)
    }

    /// The elements, for the host to read and write: waits first for all work of
    /// the buffer's context (`cuCtxSynchronize`) and for every stream of another
    /// device a safe operation used the buffer on (peer copies).
    ///
    /// Only on devices that let the host access managed memory while kernels run
    /// (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`: Linux with a Pascal or
    /// newer GPU); elsewhere a kernel started by any thread while the slice is
    /// held would fault the host, so it is refused: copy with
    /// [`CudaStream::to_vec`] and [`CudaStream::copy_h2d`] instead.
    ///
    /// Refused while an NCCL group is open in the process (feature `nccl`): a
    /// collective queued inside a group reaches its stream only when the group
    /// ends, so no synchronisation can wait for it yet (and the buffer may have
    /// been handed to another thread since it was queued).
    ///
    /// # Errors
    /// `InvalidArgument` on a device without concurrent managed access, or
    /// while an NCCL group is open; the synchronisation's failure (an earlier
    /// kernel's fault), or a stream that used the buffer being captured.
    pub fn host_slice(&mut self) -> Result<&mut [T]> {
        if crate::lifetime::nccl_groups_open() {
            return Err(self.refused_in_group());
        }
        if !self.ctx.limits().concurrent_managed_access {
            return Err(invalid_arg(format!(
                "managed buffer {:#x}: device {} does not let the host access managed memory while \
                 kernels run (CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 0); copy it instead",
                self.ptr,
                self.ctx.ordinal()
            )));
        }
        self.ctx.synchronize()?;
        let foreign = self
            .uses
            .foreign
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for s in &foreign {
            s.synchronize()?;
        }
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: `len` initialised (zeroed, then written as T) elements, aligned
        // (checked), addressable from the host. Every stream a safe operation used
        // the buffer on has finished (just waited for), none can be queued through
        // `&mut self` meanwhile, and the device allows concurrent host access
        // while unrelated kernels run. Kernels given the buffer by `unsafe`
        // launches are the launch's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr as usize as *mut T, self.len) })
    }

    #[cold]
    fn refused_in_group(&self) -> crate::error::MetraleError {
        #[cfg(feature = "nccl")]
        let whose = if crate::lifetime::nccl_group_on_this_thread() {
            "this thread is inside `nccl::group`"
        } else {
            "another thread is inside `nccl::group`"
        };
        #[cfg(not(feature = "nccl"))]
        let whose = "an NCCL group is open";
        invalid_arg(format!(
            "managed buffer {:#x} on device {}: host_slice refused while an NCCL group is open \
             ({whose}): collectives queued in a group reach their stream only when it ends, \
             so the host cannot wait for them yet; take the slice after the group",
            self.ptr,
            self.ctx.ordinal()
        ))
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address (the same on the device and the host).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
}

impl CudaStream {
    /// Queue a migration of `buf` to this stream's device or to the host
    /// (`cuMemPrefetchAsync_v2`, CUDA 12.2+), so the next access does not fault.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice); the driver's status.
    pub fn prefetch<T: DevicePod>(&self, buf: &ManagedBuffer<T>, to: PrefetchTarget) -> Result<()> {
        check_stream(buf, self)?;
        if buf.len == 0 {
            return Ok(());
        }
        let location = match to {
            PrefetchTarget::Device => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: i32::try_from(self.ordinal()).unwrap_or(i32::MAX),
            },
            PrefetchTarget::Host => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
        };
        let (ptr, bytes) = (buf.ptr, buf.len * std::mem::size_of::<T>());
        // SAFETY: the managed range belongs to `buf`, in this stream's context.
        self.call("prefetch", |d, s| unsafe {
            cu!(d, cuMemPrefetchAsync_v2(ptr, bytes, location, 0, s))
        })
    }
}

impl<T: DevicePod> fmt::Debug for ManagedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DevicePod> Drop for ManagedBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        release(
            self.ptr,
            Kind::Managed,
            &self.ctx,
            self.made,
            &mut self.uses,
        );
    }
}

impl<T: DevicePod> sealed::Sealed for ManagedBuffer<T> {
    fn address_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }
}
impl<T: DevicePod> DeviceMemory<T> for ManagedBuffer<T> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn memory_context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    fn uses(&self) -> Option<&Uses> {
        Some(&self.uses)
    }
    fn describe(&self) -> String {
        format!("managed buffer {:#x} ({} elements)", self.ptr, self.len)
    }
}
impl<T: DevicePod> sealed::SealedMut for ManagedBuffer<T> {}
impl<T: DevicePod> DeviceMemoryMut<T> for ManagedBuffer<T> {}
