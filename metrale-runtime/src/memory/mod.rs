//! Memory: device buffers and their slices, pinned and managed host-visible
//! buffers, stream-ordered allocation and pools, typed `__device__` symbols, and
//! the copies and fills between them, queued on a [`CudaStream`].
//!
//! | file | owns |
//! | --- | --- |
//! | `device.rs` | [`DeviceBuffer`], [`DeviceSlice`], [`DeviceSliceMut`] |
//! | `pinned.rs` | [`PinnedBuffer`], [`PendingCopy`] |
//! | `managed.rs` | [`ManagedBuffer`], prefetch |
//! | `pool.rs` | [`MemPool`], stream-ordered allocation |
//! | `symbol.rs` | [`DeviceSymbol`] |
//! | `copy.rs` | copies and fills on a stream |
//!
//! Invariants (the borrow rules of this crate):
//! - Every allocation holds the [`CudaContext`] it lives in; its address and
//!   length never change. Memory of one context used with a stream of another is
//!   an error (peer copies say so explicitly).
//! - Safe code never ends a borrow of host memory while a copy may still touch it:
//!   copies from and to borrowed host slices wait for the stream before returning
//!   (and, when the wait fails, until the stream is idle); copies that return at
//!   once take a [`PinnedBuffer`] by value and hand it back from a
//!   [`PendingCopy`], which waits when dropped (forgetting it leaks the buffer,
//!   never frees it under the copy engine).
//! - Freeing device memory waits for the work that uses it: `cuMemFree` does so by
//!   itself; a stream-ordered buffer is freed on its own stream, after a
//!   context-wide synchronisation when a safe operation used it on another stream.
//! - Host-visible memory is read only as [`DevicePod`] types (every bit pattern
//!   valid); [`DeviceRepr`] alone (e.g. `bool`) can be written and passed to
//!   kernels but not read back.
//! - Drop frees quietly at teardown (`is_teardown_noop`), reports any other failure
//!   as one line on stderr, and never panics.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use metrale_cuda_sys::CUdeviceptr;

use crate::context::CudaContext;
use crate::error::{invalid_arg, Result};
use crate::stream::CudaStream;

mod copy;
mod device;
mod managed;
mod pinned;
mod pool;
mod symbol;

pub use device::{DeviceBuffer, DeviceSlice, DeviceSliceMut};
pub use managed::{ManagedBuffer, PrefetchTarget};
pub use pinned::{PendingCopy, PinnedBuffer};
pub use pool::MemPool;
pub use symbol::DeviceSymbol;

/// A type that can be copied to the device and passed to kernels by value: `Copy`,
/// with no padding bytes (so no uninitialised byte is ever read), laid out as the
/// kernel sees it.
///
/// # Safety
/// Implement only for `Copy` types without padding whose layout matches the
/// kernel-side type (`#[repr(C)]` or `#[repr(transparent)]` for structs).
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {}

/// A [`DeviceRepr`] type for which every bit pattern is a valid value, so it can be
/// read back from the device (or from memory the device wrote).
///
/// # Safety
/// As [`DeviceRepr`], and every bit pattern of `size_of::<Self>()` bytes must be a
/// valid value (no `bool`, `char`, enums, references or `NonZero*`).
pub unsafe trait DevicePod: DeviceRepr {}

macro_rules! pod {
    ($($t:ty),*) => { $(
        // SAFETY: a primitive number: no padding, every bit pattern valid.
        unsafe impl DeviceRepr for $t {}
        // SAFETY: as above.
        unsafe impl DevicePod for $t {}
    )* };
}
pod!(u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, usize, isize, f32, f64);

// SAFETY: one byte, no padding; only 0 and 1 are valid, so it is not DevicePod.
unsafe impl DeviceRepr for bool {}

#[cfg(feature = "half")]
pod!(half::f16, half::bf16);

// SAFETY: an array of DeviceRepr elements has no padding between its elements.
unsafe impl<T: DeviceRepr, const N: usize> DeviceRepr for [T; N] {}
// SAFETY: every bit pattern of each element is valid, so of the array.
unsafe impl<T: DevicePod, const N: usize> DevicePod for [T; N] {}

/// Bytes of `len` elements of `T`, or an error when that overflows.
pub(crate) fn byte_len<T>(len: usize, what: &str) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
        invalid_arg(format!(
            "{what} of {len} elements of {} bytes overflows usize",
            std::mem::size_of::<T>()
        ))
    })
}

mod sealed {
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::stream::CudaStream;

    /// Implemented by this crate's device memory types only.
    pub trait Sealed {}

    /// A stream-ordered allocation's own stream, and whether a safe operation used the
    /// memory on another stream (then its free must wait for the whole context).
    pub struct StreamOrdered {
        pub(crate) stream: CudaStream,
        pub(crate) elsewhere: AtomicBool,
    }

    impl StreamOrdered {
        pub(crate) fn new(stream: &CudaStream) -> StreamOrdered {
            StreamOrdered {
                stream: stream.clone(),
                elsewhere: AtomicBool::new(false),
            }
        }

        pub(crate) fn stream(&self) -> &CudaStream {
            &self.stream
        }

        pub(crate) fn used_elsewhere(&self) -> bool {
            self.elsewhere.load(Ordering::Acquire)
        }
    }
}
pub(crate) use sealed::StreamOrdered;

/// Device memory holding elements of `T`: buffers, slices, managed buffers and
/// typed symbols. Copies, fills and kernel arguments accept any of them.
pub trait DeviceMemory<T: DeviceRepr>: sealed::Sealed {
    /// The device address of the first element.
    fn device_ptr(&self) -> CUdeviceptr;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The context the memory lives in.
    fn memory_context(&self) -> &Arc<CudaContext>;
    #[doc(hidden)]
    /// The allocation's stream, when it is stream-ordered.
    fn stream_ordered(&self) -> Option<&StreamOrdered> {
        None
    }
    /// What the memory is, for error texts.
    #[doc(hidden)]
    fn describe(&self) -> String {
        format!(
            "device memory at {:#x} ({} elements)",
            self.device_ptr(),
            self.len()
        )
    }
}

/// Device memory that may be written through this handle.
pub trait DeviceMemoryMut<T: DeviceRepr>: DeviceMemory<T> {}

/// Note that `stream` uses `mem`: a stream-ordered allocation used on a stream
/// other than its own must have its free wait for the whole context.
#[inline]
pub(crate) fn note_use<T: DeviceRepr>(mem: &(impl DeviceMemory<T> + ?Sized), stream: &CudaStream) {
    if let Some(o) = mem.stream_ordered() {
        if !o.stream.same_stream(stream) {
            o.elsewhere.store(true, Ordering::Release);
        }
    }
}

/// `Ok` when `mem` lives in `stream`'s context.
pub(crate) fn check_stream<T: DeviceRepr>(
    mem: &(impl DeviceMemory<T> + ?Sized),
    stream: &CudaStream,
) -> Result<()> {
    stream
        .context()
        .check_same(mem.memory_context(), || mem.describe(), "the stream")
}

#[cfg(test)]
#[path = "../tests/memory.rs"]
mod tests;
