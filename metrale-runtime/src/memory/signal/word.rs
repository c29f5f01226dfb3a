//! The words a signal operation reads or writes: [`SignalWord`] (device memory
//! or mapped host memory) and [`MappedWords`] (host memory mapped for the device,
//! reached from the host only through atomics).

use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr};

use super::{require, SignalValue};
use crate::context::{AsContext, CudaContext};
use crate::error::{invalid_arg, Result};
use crate::lifetime::drain as drain_dropped_later;
use crate::memory::{note_use, DeviceMemory, DeviceMemoryMut, PinnedBuffer};
use crate::stream::CudaStream;

/// One device word that stream memory operations wait on or write: an element
/// of device memory ([`SignalWord::device`]) or of a pinned buffer mapped for the
/// device ([`SignalWord::mapped`]).
pub struct SignalWord<'a, T: SignalValue> {
    pub(super) addr: CUdeviceptr,
    pub(super) ctx: &'a Arc<CudaContext>,
    pub(super) device: Option<&'a dyn DeviceMemory<T>>,
    pub(super) mapped: Option<Arc<MappedWords<T>>>,
}

impl<T: SignalValue> std::fmt::Debug for SignalWord<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignalWord")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("mapped", &self.mapped.is_some())
            .finish()
    }
}

impl<'a, T: SignalValue> SignalWord<'a, T> {
    /// Element `index` of device memory, borrowed for as long as the word is.
    ///
    /// # Errors
    /// `InvalidArgument` past the end.
    pub fn device(mem: &'a (impl DeviceMemoryMut<T> + 'a), index: usize) -> Result<Self> {
        if index >= mem.len() {
            return Err(invalid_arg(format!(
                "signal word {index} of {}: past the end",
                mem.describe()
            )));
        }
        Ok(SignalWord {
            addr: mem.device_ptr() + (index * std::mem::size_of::<T>()) as CUdeviceptr,
            ctx: mem.memory_context(),
            device: Some(mem),
            mapped: None,
        })
    }

    /// Element `index` of host words mapped for the device ([`MappedWords`]);
    /// every operation on it holds the words until the operation is done.
    ///
    /// # Errors
    /// `InvalidArgument` past the end.
    pub fn mapped(words: &'a Arc<MappedWords<T>>, index: usize) -> Result<Self> {
        if index >= words.len() {
            return Err(invalid_arg(format!(
                "signal word {index} of {} mapped words: past the end",
                words.len()
            )));
        }
        Ok(SignalWord {
            addr: words.device_ptr() + (index * std::mem::size_of::<T>()) as CUdeviceptr,
            ctx: words.buffer.context(),
            device: None,
            mapped: Some(Arc::clone(words)),
        })
    }

    /// The word's device address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.addr
    }

    /// Check the word against `stream` and note the use, before queueing.
    #[inline(always)]
    pub(super) fn prepare(&self, stream: &CudaStream, what: &str) -> Result<()> {
        stream.context().check_same(
            self.ctx,
            || format!("signal word {:#x}", self.addr),
            "the stream",
        )?;
        if T::WIDE {
            require(
                stream,
                what,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
            )?;
        }
        if let Some(mem) = self.device {
            note_use(mem, stream)?;
        }
        Ok(())
    }

    /// A hold on the mapped words, for the host function after the operation.
    #[inline(always)]
    pub(super) fn held(&self, into: &mut Vec<Box<dyn Send>>) {
        if let Some(words) = &self.mapped {
            into.push(Box::new(Arc::clone(words)));
        }
    }
}

/// Words of page-locked host memory mapped for the device
/// (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP`), zeroed: signals between
/// the host and the device. Stream operations reach them through
/// [`SignalWord::mapped`] (share them in an `Arc`); the host reads and writes them
/// only as atomics ([`MappedWords::atomic`]), never as a slice, so host accesses
/// never race.
///
/// ```no_run
/// use std::sync::{atomic::Ordering, Arc};
/// use metrale_runtime::{context, CudaStream, MappedWords, SignalWord, WaitFlags};
/// # fn main() -> metrale_runtime::Result<()> {
/// let ctx = context(0)?;
/// let s = CudaStream::new(&ctx)?;
/// let go = Arc::new(MappedWords::<u32>::new(&ctx, 1)?);
/// s.wait_value32(&SignalWord::mapped(&go, 0)?, 1, WaitFlags::EQ)?;
/// // ... queue work on s: it waits ...
/// if let Some(word) = go.atomic(0) {
///     word.store(1, Ordering::Release); // released by the host
/// }
/// # Ok(()) }
/// ```
pub struct MappedWords<T: SignalValue> {
    /// Never dereferenced (a `&[T]` over words the device and other threads
    /// store to would be a data race): only `as_ptr` and `context`.
    buffer: PinnedBuffer<T>,
    len: usize,
    device_ptr: CUdeviceptr,
}

impl<T: SignalValue> std::fmt::Debug for MappedWords<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedWords")
            .field("len", &self.len)
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr))
            .finish()
    }
}

impl<T: SignalValue> MappedWords<T> {
    /// `len` zeroed words on `ctx`'s device.
    ///
    /// # Errors
    /// As [`PinnedBuffer::mapped`]: [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) when the device
    /// cannot map host memory, `InvalidArgument` for no words, the driver's status.
    ///
    /// Before allocating, it drops the mapped words that host functions of
    /// earlier operations held last (see the module's invariants).
    pub fn new(ctx: &impl AsContext, len: usize) -> Result<MappedWords<T>> {
        if len == 0 {
            return Err(invalid_arg(format!(
                "device {}: mapped words: at least one {}-byte word is needed, 0 were asked for",
                ctx.context().ordinal(),
                std::mem::size_of::<T>()
            )));
        }
        drain_dropped_later();
        let buffer = PinnedBuffer::alloc_mapped(ctx.context(), len)?;
        let Some(device_ptr) = buffer.device_ptr() else {
            return Err(invalid_arg("mapped words without a device address"));
        };
        Ok(MappedWords {
            buffer,
            len,
            device_ptr,
        })
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no words (never: `new` refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device's address of the first word.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device_ptr
    }
}

impl MappedWords<u32> {
    /// Word `index` as an atomic; `None` past the end.
    pub fn atomic(&self, index: usize) -> Option<&AtomicU32> {
        if index >= self.len {
            return None;
        }
        // SAFETY: in bounds (`index < len`, the buffer's own length, read without
        // making a slice) of a live, zeroed allocation aligned for u32; the host
        // reaches these words only through atomics (the buffer is never
        // dereferenced to a slice, inside metrale or out), and `AtomicU32` has
        // the size and alignment of `u32`.
        Some(unsafe { AtomicU32::from_ptr(self.buffer.as_ptr().add(index).cast_mut()) })
    }
}

impl MappedWords<u64> {
    /// Word `index` as an atomic; `None` past the end.
    pub fn atomic(&self, index: usize) -> Option<&AtomicU64> {
        if index >= self.len {
            return None;
        }
        // SAFETY: as for `MappedWords<u32>`; the allocation is page-aligned, so
        // every word is 8-aligned, as `AtomicU64` needs.
        Some(unsafe { AtomicU64::from_ptr(self.buffer.as_ptr().add(index).cast_mut()) })
    }
}
