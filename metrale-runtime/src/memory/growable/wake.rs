//! Waking a [`SleepingBuffer`]: its pieces mapped again at the same addresses
//! and the saved contents restored.

use std::sync::Arc;

use metrale_cuda_sys::CUdeviceptr;

use super::{GrowableBuffer, SleepingBuffer, WakeError};
use crate::error::{cu, invalid_arg, Result};
use crate::memory::vmm::{Access, PhysicalMemory};
use crate::memory::{DeviceRepr, PinnedBuffer};
use crate::stream::{AsStream, CudaStream};

impl<T: DeviceRepr> SleepingBuffer<T> {
    /// The length it wakes with.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it wakes empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address it wakes at.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.buffer.ptr
    }

    /// Whether the contents were saved (and will be restored).
    pub fn is_saved(&self) -> bool {
        self.saved.is_some()
    }

    /// Map new physical memory at the same addresses (the same pieces as before)
    /// and, when the contents were saved, copy them back on `stream` (waiting for
    /// the copy). Unsaved contents are whatever the new memory holds.
    ///
    /// # Cost
    /// One `cuMemCreate` + map per piece, overlapped with the copy back of the
    /// piece before it; no pinning (the saved bytes are already pinned). After a
    /// [`sleep_into`](GrowableBuffer::sleep_into) the round trip measured
    /// 50.8–51.6 GB/s on the H200; after [`sleep`](GrowableBuffer::sleep) the
    /// wake costs the same, but the sleep paid 0.5–0.7 s per GiB to pin. The
    /// pinned memory is freed here; [`wake_keeping_host`](SleepingBuffer::wake_keeping_host)
    /// hands it back for the next sleep.
    ///
    /// # Errors
    /// A [`WakeError`] holding the buffer, still asleep, for the failing
    /// allocation, mapping or copy.
    pub fn wake(
        self,
        stream: &impl AsStream,
    ) -> std::result::Result<GrowableBuffer<T>, Box<WakeError<T>>> {
        self.wake_keeping_host(stream).map(|(buffer, _)| buffer)
    }

    /// [`wake`](SleepingBuffer::wake), handing back the pinned memory the
    /// contents were saved in (for the next [`GrowableBuffer::sleep_into`]);
    /// `None` when they were not saved.
    ///
    /// # Errors
    /// As `wake`.
    #[allow(clippy::type_complexity)]
    pub fn wake_keeping_host(
        mut self,
        stream: &impl AsStream,
    ) -> std::result::Result<(GrowableBuffer<T>, Option<PinnedBuffer<u8>>), Box<WakeError<T>>> {
        let stream = stream.stream();
        if let Err(error) = self.map_and_restore(stream) {
            return Err(Box::new(WakeError {
                error,
                buffer: self,
            }));
        }
        let SleepingBuffer {
            len,
            mapped,
            mut buffer,
            saved,
            ..
        } = self;
        buffer.len = len;
        buffer.mapped = mapped;
        Ok((buffer, saved))
    }

    /// Map what is missing, piece by piece, and queue the copy of each released
    /// piece's saved bytes right after its mapping, so that creating and mapping
    /// the next piece overlaps the copy of the last; then wait for the copies (on
    /// every path once one was queued: the saved bytes must outlive them). A
    /// piece that was never released, or that an earlier wake restored, is not
    /// copied again.
    fn map_and_restore(&mut self, stream: &CudaStream) -> Result<()> {
        let ctx = Arc::clone(&self.buffer.range.ctx);
        let restore = self.saved.is_some() && self.mapped > 0;
        if restore && !stream.context().same(&ctx) {
            return Err(invalid_arg(format!(
                "waking a buffer of device {}: the stream is of device {}",
                ctx.ordinal(),
                stream.ordinal()
            )));
        }
        if let Some(saved) = &self.saved {
            if saved.len() < self.mapped {
                return Err(invalid_arg("waking a buffer: the saved contents are short"));
            }
        }
        let section = stream.section();
        if restore {
            stream.refuse_if_capturing(&section, "restoring a sleeping buffer")?;
        }
        let mut queued = Vec::new();
        let mut failed = None;
        for (i, &(offset, size)) in self.pieces.iter().enumerate() {
            if !self.buffer.range.is_mapped(offset, size) {
                // The pieces were made with this granularity before.
                let mapped =
                    PhysicalMemory::create(&ctx, size, self.buffer.types).and_then(|phys| {
                        self.buffer.range.map(
                            offset,
                            Arc::new(phys),
                            0,
                            size,
                            &[(&ctx, Access::ReadWrite)],
                        )
                    });
                if let Err(e) = mapped {
                    failed = Some(e);
                    break;
                }
            }
            // A piece that was never released kept its contents; one restored
            // by an earlier wake is done.
            let (Some(saved), true) = (&self.saved, self.to_restore.get(i) == Some(&true)) else {
                continue;
            };
            let n = size.min(self.mapped.saturating_sub(offset));
            if n == 0 {
                continue;
            }
            let (to, from) = (
                self.buffer.ptr + offset as u64,
                saved
                    .as_ptr()
                    .wrapping_add(offset)
                    .cast::<std::ffi::c_void>(),
            );
            // SAFETY: `[offset, offset + n)` lies inside the saved bytes (checked
            // above: they cover every mapped byte) and inside this piece, mapped
            // with read-write access just now or before; the saved buffer lives in
            // `self` until the wait below, and nothing else uses either side (the
            // buffer is asleep); the stream is not being captured (this section).
            let copied = stream.call("restoring a sleeping buffer", |d, s| unsafe {
                cu!(d, cuMemcpyHtoDAsync_v2(to, from, n, s))
            });
            match copied {
                Ok(()) => queued.push(i),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if !queued.is_empty() {
            let waited = stream.record_done_in(&section).and_then(|done| {
                drop(section);
                stream.wait_done(done)
            });
            match waited {
                Ok(()) => {
                    for i in queued {
                        if let Some(r) = self.to_restore.get_mut(i) {
                            *r = false;
                        }
                    }
                }
                Err(e) => {
                    if failed.is_none() {
                        failed = Some(e);
                    }
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }
}
