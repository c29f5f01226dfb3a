//! GPU-side signals: stream memory operations on one device word
//! (`cuStreamWaitValue32/64`, `cuStreamWriteValue32/64`, `cuStreamBatchMemOp`).
//!
//! Invariants:
//! - A word is a [`SignalWord`]: an element of device memory (borrowed, and noted
//!   as used by the stream, so freeing it waits for the operation), or an element
//!   of [`MappedWords`], host memory mapped for the device (shared: each
//!   operation, or batch, queues one host function after itself that holds every
//!   mapped word it uses until it is done, so the host memory is never freed
//!   under it). That host function does not drop its hold (the last one would
//!   free pinned memory where the driver may not be called): it moves it to the
//!   process's drop-later list, emptied by the next `CudaStream::synchronize`,
//!   `CudaContext::synchronize` or `MappedWords::new`. When the holder cannot be
//!   queued, an event recorded after the operation stands in for it: the
//!   context keeps the words until that event (or, without one, the stream,
//!   idle) says the operation passed, and then does the holder's work, so the
//!   words are never freed under the operation, nor kept for ever.
//! - Mapped words are refused on a stream being captured through metrale,
//!   before anything is queued: a graph would replay the operation after the
//!   words may be gone.
//! - Every wait on mapped words queued outside a capture (the host passes it,
//!   and may never) is counted on its context until the host function that holds
//!   the words runs, or, when it could not be queued, until the event after the
//!   wait says it passed, whatever happened to the host function
//!   ([`CudaContext::pending_waits`]): meanwhile, frees and unmaps
//!   that would wait for the whole context refuse (or leak) instead of blocking
//!   for ever on a word nobody writes. Operations on device words only queue no
//!   host function (their submit is the driver's call alone): a wait on a device
//!   word is GPU work like a kernel, and one that never passes blocks what waits
//!   for the context, as an endless kernel does.
//! - The host reaches [`MappedWords`] only through atomics (no slice, not even
//!   internally: the length is kept beside the buffer), so its accesses never
//!   race with each other; the device's are outside the program.
//! - Flags are typed ([`WaitCondition`], [`WaitFlags`], [`WriteFlags`]); what the
//!   device cannot do (64-bit operations, the NOR condition) is refused before
//!   the driver with the device attribute named.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr, CUstream};

use super::{note_use, DeviceMemory, DeviceMemoryMut, PinnedBuffer};
use crate::context::{device_attribute, drain_dropped_later, drop_later, AsContext, CudaContext};
use crate::error::{cu, invalid_arg, report_line, CallError, ErrorKind, Result};
use crate::stream::CudaStream;

/// What a stream wait compares the word with (`CU_STREAM_WAIT_VALUE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WaitCondition {
    /// `(signed)(word - value) >= 0`: the word has reached `value` (a counter).
    Geq,
    /// `word == value`.
    Eq,
    /// `(word & value) != 0`.
    And,
    /// `~(word | value) != 0`; needs `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR`.
    Nor,
}

/// How a stream waits on a word: the condition, and whether remote writes are
/// flushed before the work after the wait (`CU_STREAM_WAIT_VALUE_FLUSH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct WaitFlags {
    /// The comparison.
    pub condition: WaitCondition,
    /// Flush remote writes (GPUDirect RDMA) before the work after the wait.
    pub flush: bool,
}

impl WaitFlags {
    /// Wait until the word has reached `value` (`>=`, wrapping).
    pub const GEQ: WaitFlags = WaitFlags::new(WaitCondition::Geq);
    /// Wait until the word equals `value`.
    pub const EQ: WaitFlags = WaitFlags::new(WaitCondition::Eq);
    /// Wait until the word has a bit of `value` set.
    pub const AND: WaitFlags = WaitFlags::new(WaitCondition::And);
    /// Wait until `~(word | value)` is non-zero.
    pub const NOR: WaitFlags = WaitFlags::new(WaitCondition::Nor);

    /// `condition`, without flush.
    pub const fn new(condition: WaitCondition) -> WaitFlags {
        WaitFlags {
            condition,
            flush: false,
        }
    }

    /// The same, flushing remote writes after the wait.
    pub const fn with_flush(self) -> WaitFlags {
        WaitFlags {
            flush: true,
            ..self
        }
    }

    fn to_driver(self) -> u32 {
        use sys::CUstreamWaitValue_flags as F;
        let c = match self.condition {
            WaitCondition::Geq => F::CU_STREAM_WAIT_VALUE_GEQ,
            WaitCondition::Eq => F::CU_STREAM_WAIT_VALUE_EQ,
            WaitCondition::And => F::CU_STREAM_WAIT_VALUE_AND,
            WaitCondition::Nor => F::CU_STREAM_WAIT_VALUE_NOR,
        };
        c.0 | if self.flush {
            F::CU_STREAM_WAIT_VALUE_FLUSH.0
        } else {
            0
        }
    }
}

/// How a stream writes a word (`CU_STREAM_WRITE_VALUE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct WriteFlags {
    /// Skip the memory barrier before the write
    /// (`CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`). **Always refused**: the
    /// `_v2` entry points metrale calls (`cuStreamWriteValue32_v2`,
    /// `cuStreamWriteValue64_v2`, `cuStreamBatchMemOp_v2`) do not support it
    /// (driver 580 answers `CUDA_ERROR_INVALID_VALUE`), so every write with it
    /// is refused with `InvalidArgument` before the driver. Default: off.
    pub no_memory_barrier: bool,
}

impl WriteFlags {
    /// A write after a memory barrier (the default).
    pub const DEFAULT: WriteFlags = WriteFlags {
        no_memory_barrier: false,
    };
    /// A write without the memory barrier before it: **always refused** (see
    /// [`WriteFlags::no_memory_barrier`]); kept so that code naming it gets a
    /// clear error rather than a bare driver status.
    pub const NO_MEMORY_BARRIER: WriteFlags = WriteFlags {
        no_memory_barrier: true,
    };

    /// The driver's flags, or the refusal of `NO_MEMORY_BARRIER` (which no
    /// `_v2` entry point supports) naming `what` on `stream`.
    fn to_driver(self, stream: &CudaStream, what: &str) -> Result<u32> {
        if self.no_memory_barrier {
            return Err(invalid_arg(format!(
                "{}: WriteFlags::NO_MEMORY_BARRIER is refused: the driver's \
                 cuStreamWriteValue32_v2 / cuStreamWriteValue64_v2 / \
                 cuStreamBatchMemOp_v2 do not support \
                 CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (CUDA_ERROR_INVALID_VALUE); \
                 use WriteFlags::DEFAULT",
                stream.subject(what)
            )));
        }
        Ok(sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT.0)
    }
}

/// The word types of stream memory operations: `u32` and `u64`.
pub trait SignalValue: super::DevicePod + sealed::Sealed {
    #[doc(hidden)]
    const WIDE: bool;
    #[doc(hidden)]
    fn widen(self) -> u64;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u32 {}
    impl Sealed for u64 {}
}

impl SignalValue for u32 {
    const WIDE: bool = false;
    fn widen(self) -> u64 {
        u64::from(self)
    }
}

impl SignalValue for u64 {
    const WIDE: bool = true;
    fn widen(self) -> u64 {
        self
    }
}

/// One device word that stream memory operations wait on or write: an element
/// of device memory ([`SignalWord::device`]) or of a pinned buffer mapped for the
/// device ([`SignalWord::mapped`]).
pub struct SignalWord<'a, T: SignalValue> {
    addr: CUdeviceptr,
    ctx: &'a Arc<CudaContext>,
    device: Option<&'a dyn DeviceMemory<T>>,
    mapped: Option<Arc<MappedWords<T>>>,
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
    fn prepare(&self, stream: &CudaStream, what: &str) -> Result<()> {
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
    fn held(&self, into: &mut Vec<Box<dyn Send>>) {
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
    /// As [`PinnedBuffer::mapped`]: [`ErrorKind::Unsupported`] when the device
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

/// Refuse `what` unless the device's `attr` is non-zero.
fn require(
    stream: &CudaStream,
    what: &str,
    attr: sys::CUdevice_attribute,
    name: &'static str,
) -> Result<()> {
    let ctx = stream.context();
    let v = ctx.call(
        || stream.subject(&format!("{what}: attribute {name}")),
        |d| device_attribute(d, ctx.device(), attr),
    )?;
    if v == 0 {
        return Err(ErrorKind::Unsupported {
            subject: stream.subject(what),
            device: ctx.ordinal(),
            attribute: name,
        }
        .into());
    }
    Ok(())
}

/// The most operations one [`CudaStream::batch_mem_ops`] batch takes: the
/// driver refuses 256 and more (measured on driver 580: 255 succeed, 256 fail).
pub const MAX_BATCH_MEM_OPS: usize = 255;

/// One operation of a [`CudaStream::batch_mem_ops`] batch.
#[derive(Debug)]
#[non_exhaustive]
pub enum MemOp<'w, 'a> {
    /// Wait on a 32-bit word.
    Wait32(&'w SignalWord<'a, u32>, u32, WaitFlags),
    /// Wait on a 64-bit word.
    Wait64(&'w SignalWord<'a, u64>, u64, WaitFlags),
    /// Write a 32-bit word.
    Write32(&'w SignalWord<'a, u32>, u32, WriteFlags),
    /// Write a 64-bit word.
    Write64(&'w SignalWord<'a, u64>, u64, WriteFlags),
}

impl CudaStream {
    /// Make work queued on this stream from now on wait until `word` meets
    /// `flags`' condition with `value` (`cuStreamWaitValue32_v2`): a wait on the
    /// GPU, released by another stream's [`CudaStream::write_value32`], a kernel,
    /// or the host writing mapped memory.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`] for a word of another context;
    /// [`ErrorKind::Unsupported`] for [`WaitCondition::Nor`] on a device without
    /// it; the driver's status.
    pub fn wait_value32(
        &self,
        word: &SignalWord<'_, u32>,
        value: u32,
        flags: WaitFlags,
    ) -> Result<()> {
        self.wait_checks(word, flags, "wait_value32")?;
        let (a, f) = (word.addr, flags.to_driver());
        // SAFETY: a live stream; `a` is a word of live memory the stream may use
        // (noted, or held by the host function `queue_mem_ops` queues after it),
        // aligned for u32.
        self.queue_word_op("wait_value32", word, 1, |d, s| unsafe {
            cu!(d, cuStreamWaitValue32_v2(s, a, value, f))
        })
    }

    /// As [`CudaStream::wait_value32`] on a 64-bit word
    /// (`cuStreamWaitValue64_v2`).
    ///
    /// # Errors
    /// As [`CudaStream::wait_value32`]; [`ErrorKind::Unsupported`] without
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`.
    pub fn wait_value64(
        &self,
        word: &SignalWord<'_, u64>,
        value: u64,
        flags: WaitFlags,
    ) -> Result<()> {
        self.wait_checks(word, flags, "wait_value64")?;
        let (a, f) = (word.addr, flags.to_driver());
        // SAFETY: as for wait_value32, aligned for u64.
        self.queue_word_op("wait_value64", word, 1, |d, s| unsafe {
            cu!(d, cuStreamWaitValue64_v2(s, a, value, f))
        })
    }

    /// Write `value` to `word` once the work queued before it on this stream has
    /// finished (`cuStreamWriteValue32_v2`).
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`] for a word of another context; the driver's
    /// status.
    pub fn write_value32(
        &self,
        word: &SignalWord<'_, u32>,
        value: u32,
        flags: WriteFlags,
    ) -> Result<()> {
        let f = flags.to_driver(self, "write_value32")?;
        word.prepare(self, "write_value32")?;
        let a = word.addr;
        // SAFETY: as for wait_value32.
        self.queue_word_op("write_value32", word, 0, |d, s| unsafe {
            cu!(d, cuStreamWriteValue32_v2(s, a, value, f))
        })
    }

    /// As [`CudaStream::write_value32`] on a 64-bit word
    /// (`cuStreamWriteValue64_v2`).
    ///
    /// # Errors
    /// As [`CudaStream::write_value32`]; [`ErrorKind::Unsupported`] without
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`.
    pub fn write_value64(
        &self,
        word: &SignalWord<'_, u64>,
        value: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        let f = flags.to_driver(self, "write_value64")?;
        word.prepare(self, "write_value64")?;
        let a = word.addr;
        // SAFETY: as for wait_value64.
        self.queue_word_op("write_value64", word, 0, |d, s| unsafe {
            cu!(d, cuStreamWriteValue64_v2(s, a, value, f))
        })
    }

    /// Queue several waits and writes as one batch (`cuStreamBatchMemOp_v2`), in
    /// order. Every word is checked before the driver sees any.
    ///
    /// # Errors
    /// As the single operations; `InvalidArgument` for more than
    /// [`MAX_BATCH_MEM_OPS`] (255) operations, before the driver.
    pub fn batch_mem_ops(&self, ops: &[MemOp<'_, '_>]) -> Result<()> {
        if ops.len() > MAX_BATCH_MEM_OPS {
            return Err(invalid_arg(format!(
                "{}: a batch of {} memory operations (at most {MAX_BATCH_MEM_OPS}: the \
                 driver refuses more)",
                self.subject("batch_mem_ops"),
                ops.len()
            )));
        }
        if ops.is_empty() {
            return Ok(());
        }
        use sys::CUstreamBatchMemOpType as Op;
        let mut params: Vec<sys::CUstreamBatchMemOpParams> = Vec::with_capacity(ops.len());
        let (mut held, mut waits) = (Vec::new(), 0);
        for op in ops {
            // SAFETY: a plain C union of integers, all-zero is a valid value.
            let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
            match *op {
                MemOp::Wait32(w, v, f) => {
                    self.wait_checks(w, f, "batch_mem_ops")?;
                    w.held(&mut held);
                    waits += 1;
                    p.waitValue.operation = Op::CU_STREAM_MEM_OP_WAIT_VALUE_32;
                    p.waitValue.address = w.addr;
                    p.waitValue.__bindgen_anon_1.value = v;
                    p.waitValue.flags = f.to_driver();
                }
                MemOp::Wait64(w, v, f) => {
                    self.wait_checks(w, f, "batch_mem_ops")?;
                    w.held(&mut held);
                    waits += 1;
                    p.waitValue.operation = Op::CU_STREAM_MEM_OP_WAIT_VALUE_64;
                    p.waitValue.address = w.addr;
                    p.waitValue.__bindgen_anon_1.value64 = v;
                    p.waitValue.flags = f.to_driver();
                }
                MemOp::Write32(w, v, f) => {
                    w.prepare(self, "batch_mem_ops")?;
                    w.held(&mut held);
                    p.writeValue.operation = Op::CU_STREAM_MEM_OP_WRITE_VALUE_32;
                    p.writeValue.address = w.addr;
                    p.writeValue.__bindgen_anon_1.value = v;
                    p.writeValue.flags = f.to_driver(self, "batch_mem_ops")?;
                }
                MemOp::Write64(w, v, f) => {
                    w.prepare(self, "batch_mem_ops")?;
                    w.held(&mut held);
                    p.writeValue.operation = Op::CU_STREAM_MEM_OP_WRITE_VALUE_64;
                    p.writeValue.address = w.addr;
                    p.writeValue.__bindgen_anon_1.value64 = v;
                    p.writeValue.flags = f.to_driver(self, "batch_mem_ops")?;
                }
            }
            params.push(p);
        }
        let (n, ptr) = (params.len() as u32, params.as_mut_ptr());
        // SAFETY: `n` initialised operations on checked words (device words noted,
        // mapped words held by the one host function queued after the batch),
        // read during the call.
        self.queue_mem_ops("batch_mem_ops", held, waits, |d, s| unsafe {
            cu!(d, cuStreamBatchMemOp_v2(s, n, ptr, 0))
        })
    }

    /// Queue one operation on `word`: a device word straight to the driver (no
    /// hold list to build and drop), a mapped one through `queue_mem_ops`.
    #[inline(always)]
    fn queue_word_op<T: SignalValue>(
        &self,
        what: &'static str,
        word: &SignalWord<'_, T>,
        waits: usize,
        queue: impl FnMut(&'static sys::Driver, CUstream) -> Result<(), CallError>,
    ) -> Result<()> {
        if word.mapped.is_none() {
            // A device word: nothing to hold, no host function (see
            // `queue_mem_ops`), so the submit is the driver's call.
            return self.call_unbound(what, queue);
        }
        let mut held = Vec::new();
        word.held(&mut held);
        self.queue_mem_ops(what, held, waits, queue)
    }

    /// Queue memory operations (`queue`, one driver call), then one host function
    /// that holds every mapped word of them (`held`) until they are done and
    /// counts their `waits` passed; all inside one section, so no metrale capture
    /// begins between the check and the queueing.
    ///
    /// Mapped words on a capturing stream are refused before anything is queued.
    /// Their waits are counted on the context before they are queued. When the
    /// host function cannot be queued, the operations are already: an event
    /// recorded after them stands in for it, and the context counts the waits
    /// down and hands the words on once it says they passed (see
    /// `CudaContext::note_unseen_wait`), never freeing them under the
    /// operations.
    fn queue_mem_ops(
        &self,
        what: &'static str,
        held: Vec<Box<dyn Send>>,
        waits: usize,
        queue: impl FnMut(&'static sys::Driver, CUstream) -> Result<(), CallError>,
    ) -> Result<()> {
        if held.is_empty() {
            // Device words only: nothing to hold, no capture to refuse (the
            // operation may become a graph node) and no host function, so the
            // submit is the driver's call. Their waits are GPU work like a
            // kernel's: one that never passes is the program's, as an endless
            // kernel is (see the module docs).
            return self.call_unbound(what, queue);
        }
        let section = self.section();
        let capturing = self
            .capturing_now(&section)
            .map_err(|e| e.about(self.subject(&format!("{what}: capture status"))))?;
        if capturing {
            return Err(invalid_arg(format!(
                "{}: {} mapped signal word(s) while the stream is being captured: every \
                 replay of the graph would use host memory that may be freed by then \
                 (use device words in a capture)",
                self.subject(what),
                held.len()
            )));
        }
        // Waits on mapped words are passed by the host, which may never write:
        // counted until the host function (queued anyway to hold the words).
        let counted = waits;
        let counter = Arc::clone(self.context().pending_waits_counter());
        counter.fetch_add(counted, Ordering::SeqCst);
        // A pinned free that checked the count before it rose waits for the
        // context's work: queued after it returns, this wait cannot block it.
        self.context().wait_out_context_wide_frees();
        if let Err(e) = self.call_unbound(what, queue) {
            counter.fetch_sub(counted, Ordering::AcqRel);
            return Err(e);
        }
        let keeper = move || {
            // The waits passed: counted first, so a drain that sees the flag
            // below also sees the count fall (and retries what waited for it).
            counter.fetch_sub(counted, Ordering::AcqRel);
            // Not dropped here: the last hold would free pinned memory inside a
            // host function, where the driver may not be called.
            drop_later(Box::new(held));
        };
        match self.launch_host_fn_in(&section, keeper) {
            Ok(()) => Ok(()),
            Err((e, None)) => {
                // A driver that reported an error ran the holder anyway: the
                // waits were counted down and the words handed on.
                drop(section);
                Err(e)
            }
            Err((e, Some(keeper))) => {
                // The operations are queued: their words stay held and their
                // waits counted until an event recorded after them (still in the
                // section: not captured) or, without one, the stream, idle,
                // says they passed; then the context does the keeper's work.
                let event = self.event_after_ops();
                drop(section);
                let stream = self.clone();
                self.context().note_unseen_wait(
                    event,
                    self.raw(),
                    Box::new(move || {
                        keeper();
                        drop(stream);
                    }),
                );
                report_line(format_args!(
                    "{}: the operation is queued, but the host function holding its \
                     mapped words could not be: the words stay held and its \
                     {counted} wait(s) counted until an event after it says it \
                     passed: {e}",
                    self.subject(what)
                ));
                Err(e)
            }
        }
    }

    /// An event recorded now at the end of the stream's queue (outside any
    /// capture: the caller's section), or null when none could be made or
    /// recorded (one made but not recorded is destroyed under the release rule).
    #[cold]
    fn event_after_ops(&self) -> sys::CUevent {
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        let made = self.call("creating an event after memory operations", |d, _| {
            // SAFETY: writes one event handle; the context is current.
            unsafe { cu!(d, cuEventCreate(&mut ev, flags as std::ffi::c_uint)) }
        });
        if made.is_err() {
            return std::ptr::null_mut();
        }
        // SAFETY: a live event and stream of the bound context.
        let recorded = self.call(
            "recording an event after memory operations",
            |d, s| unsafe { cu!(d, cuEventRecord(ev, s)) },
        );
        if recorded.is_ok() {
            return ev;
        }
        let ctx = self.context();
        ctx.release_with(
            ctx.generation(),
            format_args!("destroying an unrecorded event on device {}", ctx.ordinal()),
            |d, failures| {
                // SAFETY: the event made above, never recorded, destroyed once.
                if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(ev)) } {
                    failures.push(e);
                }
            },
        );
        std::ptr::null_mut()
    }

    fn wait_checks<T: SignalValue>(
        &self,
        word: &SignalWord<'_, T>,
        flags: WaitFlags,
        what: &str,
    ) -> Result<()> {
        word.prepare(self, what)?;
        if flags.condition == WaitCondition::Nor {
            require(
                self,
                what,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR,
                "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR",
            )?;
        }
        Ok(())
    }
}
