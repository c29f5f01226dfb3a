//! [`PinnedBuffer`] (page-locked host memory) and [`PendingCopy`] (an async copy
//! that owns its pinned buffer until the copy is done).

use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr};

use super::{byte_len, DevicePod};
use crate::context::{device_attribute, AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, report_line, ErrorKind, Result};
use crate::stream::{CudaStream, DoneEvent};

/// `len` elements of `T` in page-locked host memory (`cuMemAllocHost`), zeroed at
/// allocation, freed on drop (`cuMemFreeHost` waits for the context's work: while
/// a GPU-side wait on a mapped word is pending there, or inside a host function
/// or a capture, the free is deferred to the next synchronize instead, so the
/// drop returns at once). Dereferences to a slice. Copies from and to pinned
/// memory run at full bus speed and truly asynchronously
/// ([`CudaStream::copy_h2d_pinned`]).
///
/// ```no_run
/// use metrale_runtime::{host, DeviceBuffer, PinnedBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let mut staging = PinnedBuffer::<f32>::zeroed(&h, 1 << 20)?;
/// staging.fill(1.5);
/// let mut dev = DeviceBuffer::<f32>::alloc(&h, 1 << 20)?;
/// let pending = h.stream().copy_h2d_pinned(staging, &mut dev)?; // returns at once
/// // ... queue more work ...
/// let staging = pending.wait()?; // the buffer comes back once the copy is done
/// # Ok(()) }
/// ```
pub struct PinnedBuffer<T: DevicePod> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
    made: Generation,
    /// The device's address of the memory when it is mapped for the device
    /// ([`PinnedBuffer::mapped`]); 0 otherwise.
    device_ptr: CUdeviceptr,
}

// SAFETY: the buffer owns its allocation like a Box<[T]>; T is Send + Sync.
unsafe impl<T: DevicePod> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads through `&[T]`.
unsafe impl<T: DevicePod> Sync for PinnedBuffer<T> {}

impl<T: DevicePod> PinnedBuffer<T> {
    /// Allocate `len` zeroed elements. A zero-length buffer allocates nothing.
    ///
    /// # Errors
    /// The failing `cuMemAllocHost_v2`, naming the size; `InvalidArgument` when
    /// the driver's address is not aligned enough for `T` (an over-aligned type).
    pub fn zeroed(ctx: &impl AsContext, len: usize) -> Result<PinnedBuffer<T>> {
        PinnedBuffer::alloc(ctx.context(), len, false)
    }

    /// Allocate `len` zeroed elements of page-locked memory **mapped for the
    /// device** (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP`): kernels reach
    /// it at [`PinnedBuffer::device_ptr`] (zero-copy reads of host data). A kernel
    /// that writes it is, like every launch, the caller's contract: the host must
    /// not read the slice meanwhile. For words that host and device signal
    /// through while both run, use [`MappedWords`](crate::MappedWords) (atomic on
    /// the host, no slice).
    ///
    /// # Errors
    /// [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) when the device
    /// cannot map host memory (`CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY`); as
    /// [`PinnedBuffer::zeroed`], with `cuMemHostAlloc` and
    /// `cuMemHostGetDevicePointer_v2`; `InvalidArgument` for an empty buffer.
    pub fn mapped(ctx: &impl AsContext, len: usize) -> Result<PinnedBuffer<T>> {
        PinnedBuffer::alloc_mapped(ctx.context(), len)
    }

    /// [`PinnedBuffer::mapped`] for a context.
    pub(crate) fn alloc_mapped(ctx: &Arc<CudaContext>, len: usize) -> Result<PinnedBuffer<T>> {
        if len == 0 || std::mem::size_of::<T>() == 0 {
            return Err(invalid_arg(format!(
                "device {}: a mapped pinned buffer needs at least one byte",
                ctx.ordinal()
            )));
        }
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY;
        let can = ctx.call(
            || format!("device {}: can map host memory", ctx.ordinal()),
            |d| device_attribute(d, ctx.device(), attr),
        )?;
        if can == 0 {
            return Err(ErrorKind::Unsupported {
                subject: format!("mapping pinned memory for device {}", ctx.ordinal()),
                device: ctx.ordinal(),
                attribute: "CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY",
            }
            .into());
        }
        PinnedBuffer::alloc(ctx, len, true)
    }

    fn alloc(ctx: &Arc<CudaContext>, len: usize, mapped: bool) -> Result<PinnedBuffer<T>> {
        let bytes = byte_len::<T>(len, "pinned buffer")?;
        let mut raw: *mut c_void = std::ptr::NonNull::<T>::dangling().as_ptr().cast();
        if bytes > 0 && mapped {
            let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP;
            ctx.call(
                || {
                    format!(
                        "device {}: pinning {bytes} mapped host bytes",
                        ctx.ordinal()
                    )
                },
                // SAFETY: writes one pointer; the context is current.
                |d| unsafe { cu!(d, cuMemHostAlloc(&mut raw, bytes, flags)) },
            )?;
        } else if bytes > 0 {
            ctx.call(
                || format!("device {}: pinning {bytes} host bytes", ctx.ordinal()),
                // SAFETY: writes one pointer; the context is current.
                |d| unsafe { cu!(d, cuMemAllocHost_v2(&mut raw, bytes)) },
            )?;
        }
        let mut buf = PinnedBuffer {
            ptr: raw.cast::<T>(),
            len,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            device_ptr: 0,
        };
        if mapped {
            let mut dptr: CUdeviceptr = 0;
            ctx.call(
                || {
                    format!(
                        "device {}: device address of mapped memory {raw:p}",
                        ctx.ordinal()
                    )
                },
                // SAFETY: writes one address for memory allocated just above; flags 0.
                |d| unsafe { cu!(d, cuMemHostGetDevicePointer_v2(&mut dptr, raw, 0)) },
            )?;
            buf.device_ptr = dptr;
        }
        if bytes > 0 && !(raw as usize).is_multiple_of(std::mem::align_of::<T>()) {
            // Dropping `buf` frees the allocation.
            return Err(invalid_arg(format!(
                "pinned buffer of {}: the driver's address {raw:p} is not aligned to {} bytes",
                std::any::type_name::<T>(),
                std::mem::align_of::<T>()
            )));
        }
        if bytes > 0 {
            // SAFETY: the driver returned `bytes` writable bytes at `raw`.
            unsafe { std::ptr::write_bytes(raw.cast::<u8>(), 0, bytes) };
        }
        Ok(buf)
    }

    /// A pinned copy of `data`.
    ///
    /// # Errors
    /// As [`PinnedBuffer::zeroed`].
    pub fn from_slice(ctx: &impl AsContext, data: &[T]) -> Result<PinnedBuffer<T>> {
        let mut buf = PinnedBuffer::zeroed(ctx, data.len())?;
        buf.copy_from_slice(data);
        Ok(buf)
    }

    /// Raw pointer to the first element.
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }

    /// Raw mutable pointer to the first element.
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// Number of elements (without making a slice).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The context the memory was pinned in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's address of the memory, for a buffer made with
    /// [`PinnedBuffer::mapped`]; `None` otherwise.
    pub fn device_ptr(&self) -> Option<CUdeviceptr> {
        (self.device_ptr != 0).then_some(self.device_ptr)
    }
}

impl<T: DevicePod> std::ops::Deref for PinnedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised (zeroed, then written as T) elements,
        // aligned for T (checked at allocation), or is dangling and aligned with len 0.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: DevicePod> std::ops::DerefMut for PinnedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for Deref, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: DevicePod> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DevicePod> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.len == 0 || std::mem::size_of::<T>() == 0 {
            return;
        }
        let ptr = self.ptr.cast::<c_void>();
        // From the check through the free: a wait counted meanwhile is
        // queued only after it (see `enter_context_wide_free`).
        let in_flight = self.ctx.enter_context_wide_free();
        if super::free::host_free_must_wait(&self.ctx) {
            drop(in_flight);
            // `cuMemFreeHost` would wait for a GPU-side wait nobody may ever
            // pass (or is refused here): freed by a later drain instead.
            super::free::defer_host_free(ptr, &self.ctx, self.made);
            return;
        }
        self.ctx.release_with(
            self.made,
            format_args!(
                "freeing pinned buffer {ptr:p} on device {}",
                self.ctx.ordinal()
            ),
            |d, failures| {
                // SAFETY: the allocation is this buffer's own, freed once, here.
                if let Err(e) = unsafe { cu!(d, cuMemFreeHost(ptr)) } {
                    failures.push(e);
                }
            },
        );
        drop(in_flight);
    }
}

/// An async copy in flight between device memory and a [`PinnedBuffer`], which it
/// owns until the copy is done: [`PendingCopy::wait`] hands the buffer back.
///
/// Dropping it waits for the copy and the work queued before it on the stream,
/// never for work queued after it (each copy has its own completion event),
/// then frees the buffer; forgetting it (`mem::forget`) leaks the buffer, so the
/// copy engine never writes freed memory.
#[must_use = "dropping a pending copy waits for it; call wait() to get the buffer back"]
pub struct PendingCopy<T: DevicePod> {
    buffer: Option<PinnedBuffer<T>>,
    stream: CudaStream,
    /// This copy's own completion event, recorded right after it, outside any
    /// capture: done means the copy is (`None` once handed back).
    done: Option<DoneEvent>,
}

// SAFETY: the buffer is Send; the event is an opaque handle of the stream (which
// keeps it alive), waited on from any thread.
unsafe impl<T: DevicePod> Send for PendingCopy<T> {}
// SAFETY: shared access only queries the event and reads the stream.
unsafe impl<T: DevicePod> Sync for PendingCopy<T> {}

impl<T: DevicePod> PendingCopy<T> {
    pub(crate) fn new(
        buffer: PinnedBuffer<T>,
        stream: &CudaStream,
        done: DoneEvent,
    ) -> PendingCopy<T> {
        PendingCopy {
            buffer: Some(buffer),
            stream: stream.clone(),
            done: Some(done),
        }
    }

    /// Wait for the copy (once; afterwards `Ok`) and hand its event back.
    fn wait_copy(&mut self) -> Result<()> {
        match self.done.take() {
            Some(done) => self.stream.wait_done(done),
            None => Ok(()),
        }
    }

    /// Wait for the copy (and everything queued before it on the stream, nothing
    /// queued after it) and take the buffer back.
    ///
    /// # Errors
    /// The stream's failure; the buffer is freed (once the copy can no longer
    /// touch it).
    pub fn wait(mut self) -> Result<PinnedBuffer<T>> {
        let waited = self.wait_copy();
        let buffer = self.buffer.take();
        waited?;
        buffer.ok_or_else(|| invalid_arg("pending copy already taken"))
    }

    /// Whether the copy (and the work queued before it on the stream) has
    /// finished; its own completion event says.
    ///
    /// # Errors
    /// `cuEventQuery`'s failure.
    pub fn is_done(&self) -> Result<bool> {
        match &self.done {
            Some(done) => self.stream.event_done(done.raw()),
            None => Ok(true),
        }
    }

    /// The stream the copy was queued on.
    pub fn stream(&self) -> &CudaStream {
        &self.stream
    }
}

impl<T: DevicePod> Drop for PendingCopy<T> {
    fn drop(&mut self) {
        let Some(done) = self.done.take() else {
            return;
        };
        if super::free::host_free_must_wait(self.stream.context())
            && !matches!(self.stream.event_done(done.raw()), Ok(true))
        {
            // The copy may sit behind a GPU-side wait on a mapped word that
            // only the host passes (this thread, maybe, later), or this thread
            // may not wait here (a host function, a capture): waiting could
            // block for ever. The lifetime room keeps the buffer and the wait
            // until a drain finds the copy done.
            crate::lifetime::defer_until_drain(Box::new(CopyRelease {
                _buffer: self.buffer.take(),
                stream: self.stream.clone(),
                done: Some(done),
            }));
            return;
        }
        if let Err(e) = self.stream.wait_done(done) {
            report_line(format_args!("dropping a pending copy: {e}"));
        }
    }
}

/// A dropped [`PendingCopy`] whose copy could not be waited for then: its
/// pinned buffer, kept until the copy is done (then freed, itself deferred
/// when it must be).
struct CopyRelease<T: DevicePod> {
    /// Held for its Drop (the free), which runs once the copy is done.
    _buffer: Option<PinnedBuffer<T>>,
    stream: CudaStream,
    done: Option<DoneEvent>,
}

// SAFETY: as for `PendingCopy`: the buffer is Send; the event is an opaque
// handle of the stream (which keeps it alive), waited on from any thread.
unsafe impl<T: DevicePod> Send for CopyRelease<T> {}

impl<T: DevicePod> crate::lifetime::Deferred for CopyRelease<T> {
    fn retry(mut self: Box<Self>) -> Option<Box<dyn crate::lifetime::Deferred>> {
        let done = self.done.take()?;
        if super::free::host_free_must_wait(self.stream.context())
            && !matches!(self.stream.event_done(done.raw()), Ok(true))
        {
            self.done = Some(done);
            crate::lifetime::retry_at_next_drain();
            return Some(self);
        }
        if let Err(e) = self.stream.wait_done(done) {
            report_line(format_args!("a dropped pending copy: {e}"));
        }
        // The buffer goes here, after its copy.
        None
    }

    fn still_blocked(&self) -> bool {
        self.stream.context().pending_waits() > 0
    }

    fn describe(&self) -> String {
        format!(
            "a dropped pending copy's pinned buffer on device {}",
            self.stream.ordinal()
        )
    }
}

impl<T: DevicePod> fmt::Debug for PendingCopy<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingCopy")
            .field("buffer", &self.buffer)
            .field("stream", &self.stream)
            .finish()
    }
}
