//! Legacy IPC (Linux): a `cuMemAlloc` buffer or an interprocess event named by
//! 64 bytes another process opens (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`,
//! `cuIpcGetEventHandle` / `cuIpcOpenEventHandle`). Send the bytes any way you
//! like (a socket, a pipe, a file).
//!
//! Who frees what, and when:
//! - The exporter owns the allocation: it must keep the [`DeviceBuffer`] alive
//!   until every importer closed its [`IpcBuffer`] (a process cannot enforce
//!   that on another, which is why [`IpcBuffer::open`] is `unsafe`).
//! - An importer's [`IpcBuffer`] closes (`cuIpcCloseMemHandle`) on drop, after
//!   waiting for the work of its context that may use it; it never frees.
//! - An opened event is destroyed by each process on its own
//!   (`cuEventDestroy`); the exporter's event stays usable.
//!
//! Stream-ordered buffers (`stream.alloc`) have no legacy handle: refused. They
//! are shared through an exportable [`MemPool`] instead: the pool goes as a
//! descriptor ([`MemPool::export_fd`], [`MemPool::import_fd`]), each buffer as 64
//! bytes ([`DeviceBuffer::export_pointer`], [`IpcBuffer::from_pool`]); the
//! importer's buffer releases its reference on drop (`cuMemFree`), and the
//! exporter must not free its buffer before every importer did.

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::Arc;

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use metrale_cuda_sys::{
    CUdeviceptr, CUevent, CUipcEventHandle, CUipcMemHandle, CUipcMem_flags,
    CUmemAllocationHandleType, CUmemPoolPtrExportData, CUmemoryPool,
};

use super::{
    byte_len, sealed, DeviceBuffer, DeviceMemory, DeviceMemoryMut, DeviceRepr, DeviceSlice,
    DeviceSliceMut, MemPool, Uses,
};
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, report_line, Result};
use crate::stream::CudaEvent;

/// The 64 bytes that name a `cuMemAlloc` buffer to another process.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle([u8; 64]);

/// The 64 bytes that name an interprocess event to another process.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle([u8; 64]);

macro_rules! handle_bytes {
    ($t:ident) => {
        impl $t {
            /// The handle from the bytes another process sent.
            pub fn from_bytes(bytes: [u8; 64]) -> $t {
                $t(bytes)
            }

            /// The bytes to send.
            pub fn to_bytes(self) -> [u8; 64] {
                self.0
            }
        }

        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(concat!(stringify!($t), "(64 bytes)"))
            }
        }
    };
}
/// The 64 bytes that name a buffer of an exportable [`MemPool`] to a process
/// that imported the pool.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolPointer([u8; 64]);

handle_bytes!(IpcMemHandle);
handle_bytes!(IpcEventHandle);
handle_bytes!(PoolPointer);

/// The driver's handle of `bytes` (a C struct of 64 chars).
fn mem_handle(bytes: [u8; 64]) -> CUipcMemHandle {
    CUipcMemHandle {
        reserved: bytes.map(|b| b as std::ffi::c_char),
    }
}

fn event_handle(bytes: [u8; 64]) -> CUipcEventHandle {
    CUipcEventHandle {
        reserved: bytes.map(|b| b as std::ffi::c_char),
    }
}

impl MemPool {
    /// Export the pool as a POSIX descriptor (`cuMemPoolExportToShareableHandle`),
    /// for another process's [`MemPool::import_fd`]; the pool must be made with
    /// `MemPool::with_handle_types(ctx, HandleTypes::POSIX_FD)`. The descriptor is
    /// close-on-exec: a program started by `exec` does not inherit it.
    ///
    /// # Errors
    /// The failing call (a pool made without the handle type).
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let (pool, mut fd): (CUmemoryPool, c_int) = (self.raw(), -1);
        self.context().call(
            || {
                format!(
                    "device {}: exporting memory pool {pool:p}",
                    self.context().ordinal()
                )
            },
            // SAFETY: for POSIX_FD the driver writes one int; the pool is live.
            |d| unsafe {
                cu!(
                    d,
                    cuMemPoolExportToShareableHandle(
                        (&mut fd as *mut c_int).cast::<c_void>(),
                        pool,
                        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0
                    )
                )
            },
        )?;
        super::ipc::own_exported(fd, || {
            format!(
                "device {}: exporting memory pool {pool:p}",
                self.context().ordinal()
            )
        })
    }

    /// Import another process's exported pool on `ctx`'s device
    /// (`cuMemPoolImportFromShareableHandle`): it cannot allocate, only import
    /// pointers ([`IpcBuffer::from_pool`]). Destroyed on drop. The descriptor
    /// stays the caller's.
    ///
    /// # Errors
    /// The failing call (a descriptor that is not an exported pool).
    pub fn import_fd(ctx: &impl AsContext, fd: BorrowedFd<'_>) -> Result<MemPool> {
        let ctx = ctx.context();
        let raw_fd = fd.as_raw_fd();
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        ctx.call(
            || {
                format!(
                    "device {}: importing a memory pool from descriptor {raw_fd}",
                    ctx.ordinal()
                )
            },
            // SAFETY: writes one pool; for POSIX_FD the handle is the descriptor's
            // value as a pointer-sized integer, open for the call (borrowed).
            |d| unsafe {
                cu!(
                    d,
                    cuMemPoolImportFromShareableHandle(
                        &mut pool,
                        raw_fd as isize as *mut c_void,
                        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0
                    )
                )
            },
        )
        .map_err(|e| {
            super::ipc::explain_import(e, "MemPool::export_fd (cuMemPoolExportToShareableHandle)")
        })?;
        Ok(MemPool::from_imported(pool, ctx))
    }
}

impl<T: DeviceRepr> DeviceBuffer<T> {
    /// The bytes that name this buffer of an exportable pool to a process that
    /// imported the pool (`cuMemPoolExportPointer`).
    ///
    /// # Errors
    /// `InvalidArgument` for a buffer that is not stream-ordered, or empty; the
    /// failing call (a buffer of a pool that is not exportable).
    pub fn export_pointer(&self) -> Result<PoolPointer> {
        if self.stream().is_none() || self.is_empty() {
            return Err(invalid_arg(format!(
                "{}: only a non-empty stream-ordered buffer of an exportable pool has a pool pointer",
                self.describe()
            )));
        }
        // SAFETY: a C struct of bytes; zero is a valid value to be overwritten.
        let mut data: CUmemPoolPtrExportData = unsafe { std::mem::zeroed() };
        let ptr = self.device_ptr();
        self.context().call(
            || format!("{}: exporting its pool pointer", self.describe()),
            // SAFETY: writes 64 bytes; `ptr` is this live allocation.
            |d| unsafe { cu!(d, cuMemPoolExportPointer(&mut data, ptr)) },
        )?;
        Ok(PoolPointer(data.reserved))
    }

    /// The handle another process opens with [`IpcBuffer::open`]
    /// (`cuIpcGetMemHandle`). Only `cuMemAlloc` buffers have one.
    ///
    /// # Errors
    /// `InvalidArgument` for a stream-ordered or empty buffer; the failing call.
    pub fn ipc_handle(&self) -> Result<IpcMemHandle> {
        if self.stream().is_some() || self.is_empty() {
            return Err(invalid_arg(format!(
                "{}: only a non-empty buffer from cuMemAlloc has a legacy IPC handle (export a VirtualRange's PhysicalMemory instead)",
                self.describe()
            )));
        }
        // SAFETY: a C struct of chars; zero is a valid value to be overwritten.
        let mut h: CUipcMemHandle = unsafe { std::mem::zeroed() };
        let ptr = self.device_ptr();
        self.context().call(
            || format!("{}: IPC handle", self.describe()),
            // SAFETY: writes one handle; `ptr` is this live allocation's base.
            |d| unsafe { cu!(d, cuIpcGetMemHandle(&mut h, ptr)) },
        )?;
        Ok(IpcMemHandle(h.reserved.map(|c| c as u8)))
    }
}

impl CudaEvent {
    /// The handle another process opens with [`CudaEvent::open_ipc`]
    /// (`cuIpcGetEventHandle`); the event must be made with
    /// `EventOptions::default().with_interprocess(true)`.
    ///
    /// # Errors
    /// The failing call (an event made without the interprocess flag).
    pub fn ipc_handle(&self) -> Result<IpcEventHandle> {
        // SAFETY: a C struct of chars; zero is a valid value to be overwritten.
        let mut h: CUipcEventHandle = unsafe { std::mem::zeroed() };
        let e: CUevent = self.raw();
        self.context().call(
            || {
                format!(
                    "device {}: IPC handle of event {e:p}",
                    self.context().ordinal()
                )
            },
            // SAFETY: writes one handle; the event is live (held by `self`).
            |d| unsafe { cu!(d, cuIpcGetEventHandle(&mut h, e)) },
        )?;
        Ok(IpcEventHandle(h.reserved.map(|c| c as u8)))
    }

    /// Open another process's interprocess event on `ctx`'s device: record it,
    /// wait for it, query it as any event (no timing).
    ///
    /// # Errors
    /// The failing `cuIpcOpenEventHandle` (bytes that name no event).
    pub fn open_ipc(ctx: &impl AsContext, handle: &IpcEventHandle) -> Result<CudaEvent> {
        let ctx = ctx.context();
        let h = event_handle(handle.0);
        let mut e: CUevent = std::ptr::null_mut();
        ctx.call(
            || format!("device {}: opening an IPC event", ctx.ordinal()),
            // SAFETY: writes one event; the handle is passed by value.
            |d| unsafe { cu!(d, cuIpcOpenEventHandle(&mut e, h)) },
        )?;
        Ok(CudaEvent::from_opened(e, ctx))
    }
}

/// Another process's `cuMemAlloc` buffer, opened here (`cuIpcOpenMemHandle`):
/// device memory like a [`DeviceBuffer`] (copies, fills, slices, kernel
/// arguments), closed on drop after the work of its context. While the context
/// has GPU-side waits pending ([`CudaContext::pending_waits`]) that wait could
/// block for ever, so the drop leaves the buffer open instead (one line on
/// stderr).
pub struct IpcBuffer<T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    /// The imported pool of a pool pointer (`None`: a legacy IPC handle).
    pool: Option<Arc<MemPool>>,
    ctx: Arc<CudaContext>,
    made: Generation,
    uses: Uses,
    _elem: PhantomData<T>,
}

impl<T: DeviceRepr> IpcBuffer<T> {
    /// Open `handle` on `ctx`'s device as `len` elements of `T`, with peer
    /// access enabled lazily when the buffer lives on another device.
    ///
    /// # Safety
    /// The exporter's buffer must hold at least `len` elements of `T` (the
    /// driver does not say the size), and the exporter must keep it allocated
    /// until this buffer is dropped.
    ///
    /// # Errors
    /// `InvalidArgument` for a byte size that overflows; the failing call
    /// (bytes that name no buffer, opening in the exporting process).
    pub unsafe fn open(
        ctx: &impl AsContext,
        handle: &IpcMemHandle,
        len: usize,
    ) -> Result<IpcBuffer<T>> {
        let ctx = ctx.context();
        byte_len::<T>(len, "IPC buffer")?;
        let h = mem_handle(handle.0);
        let mut ptr: CUdeviceptr = 0;
        ctx.call(
            || format!("device {}: opening an IPC memory handle", ctx.ordinal()),
            // SAFETY: writes one address; the handle is passed by value.
            |d| unsafe {
                cu!(
                    d,
                    cuIpcOpenMemHandle_v2(
                        &mut ptr,
                        h,
                        CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.0
                    )
                )
            },
        )?;
        let buf = IpcBuffer {
            ptr,
            len,
            pool: None,
            ctx: Arc::clone(ctx),
            made: ctx.generation(),
            uses: Uses::new(None),
            _elem: PhantomData,
        };
        super::device::check_alignment::<T>(ptr, "IPC buffer")?;
        Ok(buf)
    }

    /// Import `data`, a buffer of the pool `pool` was imported from
    /// (`cuMemPoolImportPointer`), as `len` elements of `T`. The buffer holds the
    /// pool; dropping it releases this process's reference (`cuMemFree`).
    ///
    /// # Safety
    /// The exporter's buffer must hold at least `len` elements of `T`, and the
    /// exporter must not free it until this buffer is dropped. The memory must
    /// not be accessed here (by a copy, a fill or a kernel) before the
    /// exporter's stream-ordered allocation of it has completed: the exporter
    /// synchronizes its allocating stream before sending `data`, or sends an IPC
    /// event ([`CudaEvent::ipc_handle`]) recorded after the allocation, which
    /// this process makes its stream wait on first.
    ///
    /// # Errors
    /// `InvalidArgument` for a byte size that overflows; the failing call (a
    /// pool that was not imported, bytes of another pool).
    pub unsafe fn from_pool(
        pool: &Arc<MemPool>,
        data: &PoolPointer,
        len: usize,
    ) -> Result<IpcBuffer<T>> {
        let ctx = pool.context();
        byte_len::<T>(len, "IPC buffer")?;
        let mut share = CUmemPoolPtrExportData { reserved: data.0 };
        let (raw, mut ptr): (CUmemoryPool, CUdeviceptr) = (pool.raw(), 0);
        ctx.call(
            || {
                format!(
                    "device {}: importing a pointer into memory pool {raw:p}",
                    ctx.ordinal()
                )
            },
            // SAFETY: writes one address; the pool is live (`pool`); `share` is 64
            // readable bytes.
            |d| unsafe { cu!(d, cuMemPoolImportPointer(&mut ptr, raw, &mut share)) },
        )?;
        let buf = IpcBuffer {
            ptr,
            len,
            pool: Some(Arc::clone(pool)),
            ctx: Arc::clone(ctx),
            made: ctx.generation(),
            uses: Uses::new(None),
            _elem: PhantomData,
        };
        super::device::check_alignment::<T>(ptr, "IPC buffer")?;
        Ok(buf)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address in this process.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// A shared view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        DeviceSlice::of_range(self.ptr, self.len, &range, &self.ctx, Some(&self.uses))
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        DeviceSliceMut::of_range(self.ptr, self.len, &range, &self.ctx, Some(&self.uses))
    }
}

impl<T: DeviceRepr> fmt::Debug for IpcBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcBuffer")
            .field("device", &self.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DeviceRepr> Drop for IpcBuffer<T> {
    fn drop(&mut self) {
        let what = format!(
            "closing IPC buffer {:#x} on device {}",
            self.ptr,
            self.ctx.ordinal()
        );
        if !self.ctx.may_release(self.made, format_args!("{what}")) {
            return;
        }
        // Closing does not wait for queued work: wait for every use first (an
        // NCCL group open on another thread is waited out; what still blocks the
        // wait leaks the buffer).
        crate::lifetime::wait_out_nccl_groups();
        // In flight through the close (a pool pointer's free waits for the
        // legacy stream): a wait counted meanwhile is queued after it.
        let _in_flight = match super::vmm::wait_for_context(&self.ctx, Some(&self.uses)) {
            Ok(in_flight) => in_flight,
            Err(e) => {
                report_line(format_args!(
                    "{what}: leaked (left open), its uses could not be waited for: {e}"
                ));
                return;
            }
        };
        let (ptr, from_pool) = (self.ptr, self.pool.is_some());
        self.ctx
            .release_with(self.made, format_args!("{what}"), |d, failures| {
                // SAFETY: this process's own open (or pointer import), closed or
                // released once, after the work that may use it; the imported pool
                // is still held (`self.pool` drops after this).
                let closed = unsafe {
                    if from_pool {
                        // A pool pointer is freed as pool memory: stream-ordered
                        // (on the legacy stream, after every use, waited above)
                        // and waited for, so the importer's free completes before
                        // it tells the exporter it is done.
                        cu!(d, cuMemFreeAsync(ptr, std::ptr::null_mut()))
                            .and_then(|()| cu!(d, cuStreamSynchronize(std::ptr::null_mut())))
                    } else {
                        cu!(d, cuIpcCloseMemHandle(ptr))
                    }
                };
                if let Err(e) = closed {
                    failures.push(e);
                }
            });
    }
}

impl<T: DeviceRepr> sealed::Sealed for IpcBuffer<T> {
    fn address_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }
}
impl<T: DeviceRepr> DeviceMemory<T> for IpcBuffer<T> {
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
        format!(
            "IPC buffer {:#x} ({} x {})",
            self.ptr,
            self.len,
            std::any::type_name::<T>()
        )
    }
}
impl<T: DeviceRepr> sealed::SealedMut for IpcBuffer<T> {}
impl<T: DeviceRepr> DeviceMemoryMut<T> for IpcBuffer<T> {}
