//! [`NcclBuffer`]: device memory from `ncclMemAlloc`, the allocation NCCL
//! registers best (and needs for symmetric windows), usable like any device
//! buffer: [`DeviceMemory`] for copies, fills and collectives, and slices for
//! kernel launches.
//!
//! Invariants:
//! - It holds its context; its address and length never change.
//! - Freed by `ncclMemFree` through the crate's one free path
//!   (`memory/free.rs`): after the work of every stream that may use it (the
//!   device's work is waited for, and the streams of other devices a safe
//!   operation used it on), never while a capture is in progress or an NCCL
//!   group is open (then deferred, and retried when they end). The wait for
//!   the device's work runs on a helper thread that the Drop waits for at
//!   most its drop timeout ([`NcclBuffer::set_drop_timeout`]): a collective
//!   whose peer died never ends, and Drop never blocks for ever.
//! - A registration or window of it borrows it ([`Registration`](super::Registration),
//!   [`Window`](super::Window)), so it cannot be dropped while registered.

use std::fmt;
use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::time::Duration;

use metrale_cuda_sys::CUdeviceptr;

use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{invalid_arg, Result};
use crate::memory::{
    release_nccl, DeviceMemory, DeviceMemoryMut, DeviceRepr, DeviceSlice, DeviceSliceMut, Sealed,
    SealedMut, Uses,
};

use super::error::missing;
use super::lib;

/// `len` elements of `T` in device memory from `ncclMemAlloc`, freed by
/// `ncclMemFree` on drop (after the work that may use it).
///
/// Pass it to collectives, copies, fills and kernels like a
/// [`DeviceBuffer`](crate::DeviceBuffer) (`&buf` is a `const T*` argument,
/// `&mut buf` a `T*`; a range of it through [`slice`](Self::slice)). Register it with a communicator
/// ([`Communicator::register`](super::Communicator::register)) or make it a
/// symmetric window ([`Communicator::register_window`](super::Communicator::register_window)).
///
/// ```no_run
/// use metrale_runtime::nccl::NcclBuffer;
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = metrale_runtime::host(0)?;
/// let s = h.stream();
/// let mut buf = NcclBuffer::<f32>::alloc(&h, 1024)?;
/// s.copy_h2d(&vec![1.0; 1024], &mut buf)?;
/// assert_eq!(s.to_vec(&buf)?[0], 1.0);
/// # Ok(()) }
/// ```
pub struct NcclBuffer<T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    bytes: usize,
    ctx: Arc<CudaContext>,
    made: Generation,
    uses: Uses,
    /// How long its Drop waits for the device's work before `ncclMemFree`.
    drop_timeout: Duration,
    _elem: PhantomData<T>,
}

impl<T: DeviceRepr> NcclBuffer<T> {
    /// Allocate `len` elements with `ncclMemAlloc` on `ctx`'s device; their
    /// contents are whatever the memory held. A zero-length buffer allocates
    /// nothing (address 0).
    ///
    /// # Errors
    /// A byte size that overflows; inside a host function or while this thread
    /// captures a graph (refused before NCCL); the NCCL library's
    /// load error or missing symbol; `ncclMemAlloc`'s status (out of memory),
    /// naming the size and device.
    pub fn alloc(ctx: &impl AsContext, len: usize) -> Result<NcclBuffer<T>> {
        const CALL: &str = "ncclMemAlloc";
        let ctx = ctx.context();
        let bytes = crate::memory::byte_len::<T>(len, "NCCL buffer")?;
        let mut ptr: CUdeviceptr = 0;
        if bytes > 0 {
            if crate::lifetime::in_host_function() {
                return Err(crate::error::CallError::InHostFunction
                    .about("ncclMemAlloc (NcclBuffer::alloc)"));
            }
            if crate::lifetime::capturing_on_this_thread() {
                // NCCL maps the memory (cuMem* calls, or cudaMalloc), which a
                // capture on this thread is invalidated by.
                return Err(super::error::refused(
                    CALL,
                    None,
                    "allocating while this thread captures a graph is refused (NCCL's \
                     allocation would invalidate the capture); allocate before it",
                ));
            }
            let lib = lib()?;
            let f = lib.ncclMemAlloc().map_err(|m| missing(m, None))?;
            ctx.bind()?;
            let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: writes one address; NCCL allocates on the current
            // device (the context was just made current).
            let status = unsafe { f(&mut p, bytes) };
            if !status.is_success() {
                let last = super::error::last_error(lib, std::ptr::null_mut());
                return Err(super::error::into_error(super::NcclError::Call {
                    call: CALL,
                    status,
                    description: super::error::description(lib, status),
                    last_error: format!(
                        "allocating {bytes} bytes on device {}{}{last}",
                        ctx.ordinal(),
                        if last.is_empty() { "" } else { ": " }
                    ),
                    comm: None,
                }));
            }
            ptr = p as usize as CUdeviceptr;
        }
        let buf = NcclBuffer {
            ptr,
            len,
            bytes,
            ctx: Arc::clone(ctx),
            made: ctx.generation(),
            uses: Uses::new(None),
            drop_timeout: super::CommConfig::DEFAULT_DROP_TIMEOUT,
            _elem: PhantomData,
        };
        if !ptr.is_multiple_of(std::mem::align_of::<T>() as u64) {
            return Err(invalid_arg(format!(
                "NCCL buffer: ncclMemAlloc's address {ptr:#x} is not aligned for {}",
                std::any::type_name::<T>()
            )));
        }
        Ok(buf)
    }

    /// Bound the wait of its Drop (default
    /// [`CommConfig::DEFAULT_DROP_TIMEOUT`](super::CommConfig::DEFAULT_DROP_TIMEOUT),
    /// 10 s). `ncclMemFree` comes after the device's work (`cuCtxSynchronize`),
    /// which a collective whose peer died never ends: the Drop waits for it on
    /// a helper thread at most this long, then leaves the free to that thread
    /// (one line on stderr), so it never blocks for ever.
    pub fn set_drop_timeout(&mut self, timeout: Duration) {
        self.drop_timeout = timeout;
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its size in bytes.
    pub fn byte_len(&self) -> usize {
        self.bytes
    }

    /// The device address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The context the memory lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// All of it as a shared slice (a kernel argument, a copy's source).
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        DeviceSlice::from_parts(self.ptr, self.len, &self.ctx, Some(&self.uses))
    }

    /// All of it as a mutable slice.
    pub fn as_slice_mut(&mut self) -> DeviceSliceMut<'_, T> {
        DeviceSliceMut::from_parts(self.ptr, self.len, &self.ctx, Some(&self.uses))
    }

    /// A shared view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        let (start, len) = crate::memory::bounds(&range, self.len)?;
        Ok(DeviceSlice::from_parts(
            self.offset(start),
            len,
            &self.ctx,
            Some(&self.uses),
        ))
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let (start, len) = crate::memory::bounds(&range, self.len)?;
        Ok(DeviceSliceMut::from_parts(
            self.offset(start),
            len,
            &self.ctx,
            Some(&self.uses),
        ))
    }

    fn offset(&self, start: usize) -> CUdeviceptr {
        self.ptr + (start * std::mem::size_of::<T>()) as u64
    }
}

impl<T: DeviceRepr> fmt::Debug for NcclBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclBuffer")
            .field("device", &self.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DeviceRepr> Drop for NcclBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        release_nccl(
            self.ptr,
            &self.ctx,
            self.made,
            &mut self.uses,
            self.drop_timeout,
        );
    }
}

impl<T: DeviceRepr> Sealed for NcclBuffer<T> {
    fn address_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }
}
impl<T: DeviceRepr> DeviceMemory<T> for NcclBuffer<T> {
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
            "NCCL buffer {:#x} ({} x {})",
            self.ptr,
            self.len,
            std::any::type_name::<T>()
        )
    }
}
impl<T: DeviceRepr> SealedMut for NcclBuffer<T> {}
impl<T: DeviceRepr> DeviceMemoryMut<T> for NcclBuffer<T> {}
