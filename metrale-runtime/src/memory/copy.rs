//! Copies and fills, queued on a [`CudaStream`].
//!
//! Copies that borrow host memory wait before returning (and, when the wait
//! fails, until the stream is idle); device-side copies and fills return at once;
//! copies through a [`PinnedBuffer`] by value return a [`PendingCopy`].

use std::ffi::c_void;

use metrale_cuda_sys::CUdeviceptr;

use super::{
    check_stream, note_use, DeviceMemory, DeviceMemoryMut, DevicePod, DeviceRepr, PendingCopy,
    PinnedBuffer,
};
use crate::error::{cu, invalid_arg, Result};
use crate::stream::CudaStream;

fn check_len<T: DeviceRepr>(
    what: &str,
    mem: &(impl DeviceMemory<T> + ?Sized),
    other: usize,
) -> Result<()> {
    if mem.len() == other {
        Ok(())
    } else {
        Err(invalid_arg(format!(
            "{what} of {other} elements with {}: lengths differ",
            mem.describe()
        )))
    }
}

fn bytes_of<T>(len: usize) -> usize {
    // Cannot overflow: the memory exists, so its byte size fits.
    len * std::mem::size_of::<T>()
}

impl CudaStream {
    /// Copy `src` into `dst` (same length), ordered after the work already on this
    /// stream, and wait for it.
    ///
    /// # Errors
    /// `InvalidArgument` on a length mismatch, [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice) for
    /// memory of another context; the failing copy or wait.
    pub fn copy_h2d<T: DeviceRepr>(
        &self,
        src: &[T],
        dst: &mut (impl DeviceMemoryMut<T> + ?Sized),
    ) -> Result<()> {
        check_len("copy from a host slice", dst, src.len())?;
        check_stream(dst, self)?;
        if src.is_empty() {
            return Ok(());
        }
        note_use(dst, self)?;
        let (to, from, bytes) = (
            dst.device_ptr(),
            src.as_ptr().cast::<c_void>(),
            bytes_of::<T>(src.len()),
        );
        let section = self.section();
        self.refuse_if_capturing(&section, "a copy from borrowed host memory")?;
        // SAFETY: `src` is `bytes` long and borrowed until the wait below; the
        // destination holds `bytes` in this stream's context; the stream is not
        // being captured (checked in this section), so the copy runs now.
        self.call("copy to device", |d, s| unsafe {
            cu!(d, cuMemcpyHtoDAsync_v2(to, from, bytes, s))
        })?;
        let done = self.record_done_in(&section)?;
        drop(section);
        self.wait_done(done)
    }

    /// Copy `src` into `dst` (same length), ordered after the work already on this
    /// stream (a kernel that wrote `src`), and wait for it.
    ///
    /// # Errors
    /// As [`CudaStream::copy_h2d`]; the wait also reports an earlier kernel's fault.
    pub fn copy_d2h<T: DevicePod>(
        &self,
        src: &(impl DeviceMemory<T> + ?Sized),
        dst: &mut [T],
    ) -> Result<()> {
        check_len("copy into a host slice", src, dst.len())?;
        // SAFETY: `dst` is exclusively borrowed for `dst.len()` elements.
        unsafe { self.d2h_raw(src, dst.as_mut_ptr()) }
    }

    /// `src` copied into a new vector (ordered after the work on this stream).
    ///
    /// # Errors
    /// As [`CudaStream::copy_d2h`].
    pub fn to_vec<T: DevicePod>(&self, src: &(impl DeviceMemory<T> + ?Sized)) -> Result<Vec<T>> {
        let mut out: Vec<T> = Vec::with_capacity(src.len());
        // SAFETY: the vector has room for `src.len()` elements; raw pointers only, no
        // reference to the uninitialised part is made.
        unsafe { self.d2h_raw(src, out.as_mut_ptr())? };
        // SAFETY: the copy succeeded, so every element was written; T is DevicePod.
        unsafe { out.set_len(src.len()) };
        Ok(out)
    }

    /// Copy all of `src` to `dst` and wait.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `src.len()` elements and not accessed
    /// otherwise until this returns.
    unsafe fn d2h_raw<T: DevicePod>(
        &self,
        src: &(impl DeviceMemory<T> + ?Sized),
        dst: *mut T,
    ) -> Result<()> {
        check_stream(src, self)?;
        if src.is_empty() {
            return Ok(());
        }
        note_use(src, self)?;
        let (from, to, bytes) = (
            src.device_ptr(),
            dst.cast::<c_void>(),
            bytes_of::<T>(src.len()),
        );
        let section = self.section();
        self.refuse_if_capturing(&section, "a copy into borrowed host memory")?;
        // SAFETY: the caller lends `dst` for `bytes` until the wait below; the source
        // holds `bytes` in this stream's context; the stream is not being captured.
        self.call("copy from device", |d, s| unsafe {
            cu!(d, cuMemcpyDtoHAsync_v2(to, from, bytes, s))
        })?;
        // The wait is on an event recorded right after the copy, in the section: a
        // capture begun on this stream afterwards (by any thread) cannot make the
        // wait return early, and a failed wait polls until the copy is done.
        let done = self.record_done_in(&section)?;
        drop(section);
        self.wait_done(done)
    }

    /// Queue a copy from device memory to device memory of the same context (same
    /// length); returns at once.
    ///
    /// # Errors
    /// `InvalidArgument` on a length mismatch, [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice) for
    /// memory of another context (use [`CudaStream::copy_peer`]); the driver's status.
    pub fn copy_d2d<T: DeviceRepr>(
        &self,
        src: &(impl DeviceMemory<T> + ?Sized),
        dst: &mut (impl DeviceMemoryMut<T> + ?Sized),
    ) -> Result<()> {
        check_len("device-to-device copy", dst, src.len())?;
        check_stream(src, self)?;
        check_stream(dst, self)?;
        note_use(src, self)?;
        note_use(dst, self)?;
        if src.is_empty() {
            return Ok(());
        }
        let (from, to, bytes) = (src.device_ptr(), dst.device_ptr(), bytes_of::<T>(src.len()));
        // SAFETY: both ranges hold `bytes` in this stream's context; device memory is
        // freed only after the work that uses it.
        self.call("device-to-device copy", |d, s| unsafe {
            cu!(d, cuMemcpyDtoDAsync_v2(to, from, bytes, s))
        })
    }

    /// Queue a copy between memory of two devices (`cuMemcpyPeerAsync`); this
    /// stream must belong to one of them. Returns at once. Without peer access
    /// ([`enable_peer_access`](crate::enable_peer_access)) the driver stages the
    /// copy through host memory: it still works, at a fraction of the link's speed.
    ///
    /// # Errors
    /// `InvalidArgument` on a length mismatch or a stream of neither device; the
    /// driver's status.
    pub fn copy_peer<T: DeviceRepr>(
        &self,
        src: &(impl DeviceMemory<T> + ?Sized),
        dst: &mut (impl DeviceMemoryMut<T> + ?Sized),
    ) -> Result<()> {
        check_len("peer copy", dst, src.len())?;
        let (sc, dc) = (src.memory_context(), dst.memory_context());
        if !self.context().same(sc) && !self.context().same(dc) {
            return Err(invalid_arg(format!(
                "peer copy from device {} to device {} on a stream of device {}: the stream must belong to one of them",
                sc.ordinal(),
                dc.ordinal(),
                self.ordinal()
            )));
        }
        if src.is_empty() {
            return Ok(());
        }
        note_use(src, self)?;
        note_use(dst, self)?;
        let (from, to, bytes) = (src.device_ptr(), dst.device_ptr(), bytes_of::<T>(src.len()));
        let (from_ctx, to_ctx) = (sc.raw(), dc.raw());
        // SAFETY: both ranges hold `bytes` in their (retained) contexts.
        self.call("peer copy", |d, s| unsafe {
            cu!(d, cuMemcpyPeerAsync(to, to_ctx, from, from_ctx, bytes, s))
        })
    }

    /// Queue a copy from a pinned buffer, which the returned [`PendingCopy`] owns
    /// until the copy is done; returns at once.
    ///
    /// # Errors
    /// As [`CudaStream::copy_h2d`] (the buffer is freed on error).
    pub fn copy_h2d_pinned<T: DevicePod>(
        &self,
        src: PinnedBuffer<T>,
        dst: &mut (impl DeviceMemoryMut<T> + ?Sized),
    ) -> Result<PendingCopy<T>> {
        check_len("async copy from a pinned buffer", dst, src.len())?;
        check_stream(dst, self)?;
        if !src.is_empty() {
            note_use(dst, self)?;
        }
        let (to, from, bytes) = (
            dst.device_ptr(),
            src.as_ptr().cast::<c_void>(),
            src.byte_len(),
        );
        let section = self.section();
        self.refuse_if_capturing(&section, "a copy from a pinned buffer that is handed back")?;
        if bytes > 0 {
            // SAFETY: the pinned source is owned by the PendingCopy until its event
            // has completed; the destination holds `bytes`; not captured.
            self.call("async copy to device", |d, s| unsafe {
                cu!(d, cuMemcpyHtoDAsync_v2(to, from, bytes, s))
            })?;
        }
        let done = self.record_done_in(&section)?;
        drop(section);
        Ok(PendingCopy::new(src, self, done))
    }

    /// Queue a copy into a pinned buffer, which the returned [`PendingCopy`] owns
    /// until the copy is done; returns at once.
    ///
    /// # Errors
    /// As [`CudaStream::copy_d2h`] (the buffer is freed on error).
    pub fn copy_d2h_pinned<T: DevicePod>(
        &self,
        src: &(impl DeviceMemory<T> + ?Sized),
        mut dst: PinnedBuffer<T>,
    ) -> Result<PendingCopy<T>> {
        check_len("async copy into a pinned buffer", src, dst.len())?;
        check_stream(src, self)?;
        if !dst.is_empty() {
            note_use(src, self)?;
        }
        let (from, to, bytes) = (
            src.device_ptr(),
            dst.as_mut_ptr().cast::<c_void>(),
            dst.byte_len(),
        );
        let section = self.section();
        self.refuse_if_capturing(&section, "a copy into a pinned buffer that is handed back")?;
        if bytes > 0 {
            // SAFETY: as for copy_h2d_pinned, in the other direction.
            self.call("async copy from device", |d, s| unsafe {
                cu!(d, cuMemcpyDtoHAsync_v2(to, from, bytes, s))
            })?;
        }
        let done = self.record_done_in(&section)?;
        drop(section);
        Ok(PendingCopy::new(dst, self, done))
    }

    fn fill<T: DeviceRepr>(
        &self,
        dst: &mut (impl DeviceMemoryMut<T> + ?Sized),
        width: usize,
        what: &'static str,
        f: impl FnOnce(
            &'static metrale_cuda_sys::Driver,
            CUdeviceptr,
            usize,
            metrale_cuda_sys::CUstream,
        ) -> Result<(), crate::error::CallError>,
    ) -> Result<()> {
        check_stream(dst, self)?;
        note_use(dst, self)?;
        let (ptr, bytes) = (dst.device_ptr(), bytes_of::<T>(dst.len()));
        if bytes % width != 0 || ptr % width as u64 != 0 {
            return Err(invalid_arg(format!(
                "{what}: {} is not made of whole, aligned {width}-byte words ({bytes} bytes at {ptr:#x})",
                dst.describe()
            )));
        }
        if bytes == 0 {
            return Ok(());
        }
        self.call(what, |d, s| f(d, ptr, bytes / width, s))
    }

    /// Queue a fill of every byte of `dst` with `value`; returns at once.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice); the driver's status.
    pub fn memset_u8<T: DeviceRepr>(
        &self,
        dst: &mut (impl DeviceMemoryMut<T> + ?Sized),
        value: u8,
    ) -> Result<()> {
        // SAFETY: `n` bytes at `ptr` belong to `dst`, in this stream's context.
        self.fill(dst, 1, "memset of 8-bit values", |d, ptr, n, s| unsafe {
            cu!(d, cuMemsetD8Async(ptr, value, n, s))
        })
    }

    /// Queue a fill of `dst` with a 16-bit pattern; `dst` must be whole, aligned
    /// 16-bit words.
    ///
    /// # Errors
    /// `InvalidArgument` for memory that is not whole aligned words (checked
    /// before the driver); [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice); the driver's status.
    pub fn memset_u16<T: DeviceRepr>(
        &self,
        dst: &mut (impl DeviceMemoryMut<T> + ?Sized),
        value: u16,
    ) -> Result<()> {
        // SAFETY: `n` 16-bit words at `ptr` belong to `dst`.
        self.fill(dst, 2, "memset of 16-bit values", |d, ptr, n, s| unsafe {
            cu!(d, cuMemsetD16Async(ptr, value, n, s))
        })
    }

    /// Queue a fill of `dst` with a 32-bit pattern (`f32::to_bits` for floats);
    /// `dst` must be whole, aligned 32-bit words.
    ///
    /// # Errors
    /// As [`CudaStream::memset_u16`].
    pub fn memset_u32<T: DeviceRepr>(
        &self,
        dst: &mut (impl DeviceMemoryMut<T> + ?Sized),
        value: u32,
    ) -> Result<()> {
        // SAFETY: `n` 32-bit words at `ptr` belong to `dst`.
        self.fill(dst, 4, "memset of 32-bit values", |d, ptr, n, s| unsafe {
            cu!(d, cuMemsetD32Async(ptr, value, n, s))
        })
    }

    /// Queue a fill of `dst` with zero bytes; returns at once.
    ///
    /// # Errors
    /// As [`CudaStream::memset_u8`].
    pub fn zero<T: DeviceRepr>(&self, dst: &mut (impl DeviceMemoryMut<T> + ?Sized)) -> Result<()> {
        self.memset_u8(dst, 0)
    }
}
