//! Stream-ordered allocation (`cuMemAllocAsync` / `cuMemFreeAsync`) from a
//! device's default memory pool or from a [`MemPool`] of your own.

use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr, CUmemoryPool};

use super::device::check_alignment;
use super::{byte_len, DeviceBuffer, DeviceRepr, HandleTypes};
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, Result};
use crate::stream::CudaStream;

fn check_pools(ctx: &CudaContext) -> Result<()> {
    if ctx.limits().memory_pools {
        Ok(())
    } else {
        Err(invalid_arg(format!(
            "device {} does not support stream-ordered allocation \
             (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 0)",
            ctx.ordinal()
        )))
    }
}

/// A memory pool for stream-ordered allocation: the device's default pool
/// ([`MemPool::device_default`]) or one of your own ([`MemPool::new`]).
///
/// Freed memory returns to the pool and is reused by later allocations on the
/// stream without a driver round trip; the release threshold is how much unused
/// memory the pool keeps at a synchronisation instead of giving it back.
///
/// ```no_run
/// use metrale_runtime::{host, MemPool};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let pool = MemPool::device_default(&h)?;
/// pool.set_release_threshold(u64::MAX)?; // keep freed memory for reuse
/// let tmp = h.stream().alloc::<f32>(1 << 20)?; // from the default pool
/// drop(tmp); // freed in stream order
/// # Ok(()) }
/// ```
pub struct MemPool {
    raw: CUmemoryPool,
    ctx: Arc<CudaContext>,
    made: Generation,
    owned: bool,
}

// SAFETY: the handle is written once; the driver's pool calls are thread-safe.
unsafe impl Send for MemPool {}
// SAFETY: as for Send; no interior mutability.
unsafe impl Sync for MemPool {}

impl fmt::Debug for MemPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemPool")
            .field("device", &self.ctx.ordinal())
            .field("raw", &self.raw)
            .field("owned", &self.owned)
            .finish()
    }
}

impl MemPool {
    /// The device's default pool (what [`CudaStream::alloc`] draws from).
    ///
    /// # Errors
    /// `InvalidArgument` on a device without memory pools; the driver's status (a
    /// missing symbol on an old driver).
    pub fn device_default(ctx: &impl AsContext) -> Result<MemPool> {
        let ctx = ctx.context();
        check_pools(ctx)?;
        let mut raw: CUmemoryPool = std::ptr::null_mut();
        let device = ctx.device();
        ctx.call(
            || format!("device {} default memory pool", ctx.ordinal()),
            // SAFETY: writes one pool handle for a valid device.
            |d| unsafe { cu!(d, cuDeviceGetDefaultMemPool(&mut raw, device)) },
        )?;
        Ok(MemPool {
            raw,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            owned: false,
        })
    }

    /// A new pool of device memory on `ctx`'s device.
    ///
    /// # Errors
    /// As [`MemPool::device_default`], for `cuMemPoolCreate`.
    pub fn new(ctx: &impl AsContext) -> Result<MemPool> {
        MemPool::with_handle_types(ctx, HandleTypes::NONE)
    }

    /// A new pool whose memory can be shared with other processes as `types`
    /// (`MemPool::export_fd`, `DeviceBuffer::export_pointer` on Linux).
    ///
    /// # Errors
    /// As [`MemPool::new`].
    pub fn with_handle_types(ctx: &impl AsContext, types: HandleTypes) -> Result<MemPool> {
        let ctx = ctx.context();
        check_pools(ctx)?;
        let props = sys::CUmemPoolProps {
            allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: sys::CUmemAllocationHandleType(types.bits()),
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: i32::try_from(ctx.ordinal()).unwrap_or(i32::MAX),
            },
            ..sys::CUmemPoolProps::default()
        };
        let mut raw: CUmemoryPool = std::ptr::null_mut();
        ctx.call(
            || format!("device {}: creating a memory pool", ctx.ordinal()),
            // SAFETY: writes one pool handle; `props` is a complete, zero-filled struct.
            |d| unsafe { cu!(d, cuMemPoolCreate(&mut raw, &props)) },
        )?;
        Ok(MemPool {
            raw,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            owned: true,
        })
    }

    fn set_u64(&self, attr: sys::CUmemPool_attribute, what: &str, mut value: u64) -> Result<()> {
        let raw = self.raw;
        self.ctx.call(
            || format!("device {} memory pool: {what}", self.ctx.ordinal()),
            // SAFETY: the attribute takes a cuuint64_t, passed by pointer.
            |d| unsafe {
                cu!(
                    d,
                    cuMemPoolSetAttribute(raw, attr, (&mut value as *mut u64).cast::<c_void>())
                )
            },
        )
    }

    fn get_u64(&self, attr: sys::CUmemPool_attribute, what: &str) -> Result<u64> {
        let (raw, mut value) = (self.raw, 0u64);
        self.ctx.call(
            || format!("device {} memory pool: {what}", self.ctx.ordinal()),
            // SAFETY: the attribute is a cuuint64_t, written through the pointer.
            |d| unsafe {
                cu!(
                    d,
                    cuMemPoolGetAttribute(raw, attr, (&mut value as *mut u64).cast::<c_void>())
                )
            },
        )?;
        Ok(value)
    }

    /// How many unused bytes the pool keeps at a synchronisation (default 0: give
    /// everything back). `u64::MAX` keeps all freed memory for reuse.
    ///
    /// # Errors
    /// `cuMemPoolSetAttribute`'s status.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<()> {
        self.set_u64(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            "release threshold",
            bytes,
        )
    }

    /// Memory the pool currently holds from the device, bytes.
    ///
    /// # Errors
    /// `cuMemPoolGetAttribute`'s status.
    pub fn reserved_bytes(&self) -> Result<u64> {
        self.get_u64(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            "reserved memory",
        )
    }

    /// Memory currently allocated from the pool, bytes.
    ///
    /// # Errors
    /// `cuMemPoolGetAttribute`'s status.
    pub fn used_bytes(&self) -> Result<u64> {
        self.get_u64(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            "used memory",
        )
    }

    /// Give unused memory back to the device, keeping at least `keep` bytes.
    ///
    /// # Errors
    /// `cuMemPoolTrimTo`'s status.
    pub fn trim_to(&self, keep: usize) -> Result<()> {
        let raw = self.raw;
        self.ctx.call(
            || format!("device {} memory pool: trim", self.ctx.ordinal()),
            // SAFETY: a live pool.
            |d| unsafe { cu!(d, cuMemPoolTrimTo(raw, keep)) },
        )
    }

    /// The raw `CUmemoryPool`, for driver calls of your own.
    pub fn raw(&self) -> CUmemoryPool {
        self.raw
    }

    /// The context (device) of the pool.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Own a pool the driver made for `ctx` just now (imported from another
    /// process): destroyed with `cuMemPoolDestroy`.
    #[cfg(unix)]
    pub(crate) fn from_imported(raw: CUmemoryPool, ctx: &Arc<CudaContext>) -> MemPool {
        MemPool {
            raw,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            owned: true,
        }
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let raw = self.raw;
        // The driver defers the destruction until outstanding allocations are freed.
        self.ctx.release_with(
            self.made,
            format_args!(
                "destroying memory pool {raw:p} on device {}",
                self.ctx.ordinal()
            ),
            |d, failures| {
                // SAFETY: the pool was created here and is destroyed once.
                if let Err(e) = unsafe { cu!(d, cuMemPoolDestroy(raw)) } {
                    failures.push(e);
                }
            },
        );
    }
}

impl CudaStream {
    /// Allocate `len` elements in stream order from the device's default pool
    /// (`cuMemAllocAsync`): usable by work queued on this stream from now on,
    /// freed on this stream when the buffer drops. Contents are undefined.
    ///
    /// # Errors
    /// `InvalidArgument` on a device without memory pools or for a byte size that
    /// overflows; the driver's status (out of memory; a missing symbol on an old
    /// driver), naming the size.
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        self.alloc_ordered(None, len)
    }

    /// As [`CudaStream::alloc`], then a queued fill with zero bytes.
    ///
    /// # Errors
    /// As [`CudaStream::alloc`] and [`CudaStream::zero`].
    pub fn alloc_zeroed<T: DeviceRepr>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        let mut buf = self.alloc_ordered(None, len)?;
        self.zero(&mut buf)?;
        Ok(buf)
    }

    /// As [`CudaStream::alloc`], from `pool` (`cuMemAllocFromPoolAsync`).
    ///
    /// # Errors
    /// As [`CudaStream::alloc`]; [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice) for a pool of
    /// another device.
    pub fn alloc_from<T: DeviceRepr>(&self, pool: &MemPool, len: usize) -> Result<DeviceBuffer<T>> {
        self.context()
            .check_same(&pool.ctx, || "memory pool".to_owned(), "the stream")?;
        self.alloc_ordered(Some(pool.raw), len)
    }

    fn alloc_ordered<T: DeviceRepr>(
        &self,
        pool: Option<CUmemoryPool>,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        check_pools(self.context())?;
        let bytes = byte_len::<T>(len, "stream-ordered buffer")?;
        let mut ptr: CUdeviceptr = 0;
        // Not on a stream being captured: there the driver would return a graph
        // allocation, with no memory behind it outside the graph's replays (and
        // freed with the graph), which a safe buffer cannot be.
        let section = self.section();
        self.refuse_if_capturing(&section, "a stream-ordered allocation")?;
        if bytes > 0 {
            let ptr_out = std::cell::Cell::new(0);
            self.call_by_stream(|d, s| {
                let mut p: CUdeviceptr = 0;
                // SAFETY: writes one address; the stream and pool are live.
                let r = unsafe {
                    match pool {
                        None => cu!(d, cuMemAllocAsync(&mut p, bytes, s)),
                        Some(pl) => cu!(d, cuMemAllocFromPoolAsync(&mut p, bytes, pl, s)),
                    }
                };
                ptr_out.set(p);
                r
            })
            .map_err(|e| {
                e.about(format_args!(
                    "device {}: allocating {bytes} bytes in stream order",
                    self.ordinal()
                ))
            })?;
            ptr = ptr_out.get();
        }
        drop(section);
        let own = (bytes > 0).then_some(self);
        let buf = DeviceBuffer::from_parts(ptr, len, self.context(), self.made(), own);
        check_alignment::<T>(ptr, "stream-ordered buffer")?;
        Ok(buf)
    }
}
