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
//!
//! `mod.rs` owns the flags and value types; `word.rs` the words; `ops.rs` the
//! operations queued on a stream.

mod ops;
mod word;

pub use ops::{MemOp, MAX_BATCH_MEM_OPS};
pub use word::{MappedWords, SignalWord};

use metrale_cuda_sys as sys;

use crate::context::device_attribute;
use crate::error::{invalid_arg, ErrorKind, Result};
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
