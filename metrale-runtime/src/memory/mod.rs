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
//! | `vmm/` | [`VirtualRange`], [`PhysicalMemory`], mappings and access, the wait before unmapping |
//! | `growable/` | [`GrowableBuffer`], [`SleepingBuffer`]: grow, sleep and wake |
//! | `ipc.rs` | sharing between processes: descriptors of physical memory, [`send_fd`] / [`recv_fd`] |
//! | `legacy_ipc.rs` | legacy IPC: [`IpcMemHandle`], [`IpcBuffer`], [`IpcEventHandle`] |
//! | `signal/` | [`SignalWord`], [`MappedWords`], stream memory operations (wait/write value, batches) |
//! | `free.rs` | the one free path of device, managed and pinned memory (`FreeJob`), deferred through the lifetime room |
//! | `batch.rs` | [`BatchCopy`]: many copies in one driver call |
//! | `foreign.rs` | views of another library's device memory |
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

mod batch;
mod copy;
mod device;
mod foreign;
mod free;
mod growable;
#[cfg(unix)]
mod ipc;
#[cfg(unix)]
mod legacy_ipc;
mod managed;
mod pinned;
mod pool;
mod signal;
mod symbol;
mod vmm;

pub use batch::BatchCopy;
pub use device::{DeviceBuffer, DeviceSlice, DeviceSliceMut};
pub use free::deferred_frees;
#[cfg(feature = "nccl")]
pub(crate) use free::release_nccl;
pub use growable::{GrowableBuffer, SleepError, SleepState, SleepingBuffer, WakeError};
#[cfg(unix)]
pub use ipc::{recv_fd, send_fd};
#[cfg(unix)]
pub use legacy_ipc::{IpcBuffer, IpcEventHandle, IpcMemHandle, PoolPointer};
pub use managed::{ManagedBuffer, PrefetchTarget};
pub use pinned::{PendingCopy, PinnedBuffer};
pub use pool::MemPool;
pub use signal::{
    MappedWords, MemOp, SignalValue, SignalWord, WaitCondition, WaitFlags, WriteFlags,
    MAX_BATCH_MEM_OPS,
};
pub use symbol::DeviceSymbol;
pub use vmm::{granularity, Access, Granularity, HandleTypes, PhysicalMemory, VirtualRange};

/// A type that can be copied to the device and passed to kernels by value: `Copy`,
/// with no padding bytes (so no uninitialised byte is ever read), laid out as the
/// kernel sees it.
///
/// # Safety
/// Implement only for `Copy` types without padding whose layout matches the
/// kernel-side type (`#[repr(C)]` or `#[repr(transparent)]` for structs);
/// never for a reference or a type that holds a host pointer or a handle (its
/// bytes would be a host address to the kernel: device memory is passed as
/// `&buf` or `&mut buf`, see [`KernelArg`](crate::KernelArg)).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be passed to the device",
    label = "not a `DeviceRepr` type",
    note = "a value passed to the device is plain data: a number, an array of them, or your own `#[repr(C)]` struct of plain data without padding, which holds no reference, pointer or handle (for that struct: `unsafe impl metrale_runtime::DeviceRepr for YourStruct {{}}`); device memory is passed as `&buf` or `&mut buf`, never as a value"
)]
pub unsafe trait DeviceRepr: Copy + Send + Sync + 'static {}

/// A [`DeviceRepr`] type for which every bit pattern is a valid value, so it can be
/// read back from the device (or from memory the device wrote).
///
/// # Safety
/// As [`DeviceRepr`], and every bit pattern of `size_of::<Self>()` bytes must be a
/// valid value (no `bool`, `char`, enums, references or `NonZero*`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be read back from the device",
    label = "not a `DevicePod` type (some bit patterns are invalid, or it is not `DeviceRepr`)",
    note = "read-back needs every bit pattern to be valid: plain numbers, arrays of them, or your own `#[repr(C)]` struct of plain numbers without padding, which holds no reference, pointer or handle (for that struct: `unsafe impl metrale_runtime::DevicePod for YourStruct {{}}`)"
)]
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
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;

    use metrale_cuda_sys::CUdeviceptr;

    use crate::stream::CudaStream;

    /// Implemented by this crate's device memory types only.
    pub trait Sealed {
        /// The device address of the first element, by reference: the field a
        /// kernel argument of this memory points the driver at (valid while the
        /// handle is borrowed; the address never changes).
        fn address_ref(&self) -> &CUdeviceptr;
    }

    /// The seal of [`super::DeviceMemoryMut`]: memory that may be written
    /// through this handle (a `&mut` of it passes as a `T*` argument).
    pub trait SealedMut: Sealed {}

    /// What an allocation needs to know to be freed only after every use: its own
    /// stream, when it is stream-ordered, and the streams of safe operations that
    /// used it elsewhere (another stream for stream-ordered memory, another
    /// device's stream for any memory).
    pub struct Uses {
        pub(crate) own: Option<CudaStream>,
        /// Whether `foreign` has anything (one load on the free path).
        pub(crate) any_foreign: AtomicBool,
        /// Each stream at most once; only touched off the hot path.
        pub(crate) foreign: Mutex<Vec<CudaStream>>,
    }

    impl Uses {
        pub(crate) fn new(own: Option<&CudaStream>) -> Uses {
            Uses {
                own: own.cloned(),
                any_foreign: AtomicBool::new(false),
                foreign: Mutex::new(Vec::new()),
            }
        }
    }
}
#[cfg(feature = "nccl")]
pub(crate) use device::bounds;
/// The seal of [`DeviceMemory`], for device memory types of other rooms (an
/// NCCL buffer).
pub(crate) use sealed::{Sealed, SealedMut, Uses};

/// Device memory holding elements of `T`: buffers, slices, managed buffers,
/// typed symbols and NCCL buffers, registrations and windows. Copies, fills and
/// kernel arguments accept any of them: `&m` of any `m: impl DeviceMemory<T>`
/// passes as a `const T*` kernel argument, `&mut m` of any
/// `m: impl DeviceMemoryMut<T>` as a `T*` (see [`KernelArg`](crate::KernelArg)).
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
    /// The allocation's record of its streams, for memory that is freed (buffers).
    fn uses(&self) -> Option<&Uses> {
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
pub trait DeviceMemoryMut<T: DeviceRepr>: DeviceMemory<T> + sealed::SealedMut {}

/// Note that `stream` is about to use `mem`, before the operation is queued, so
/// that freeing `mem` waits for it:
/// - stream-ordered memory on another stream than its own: the first such use on
///   each stream is ordered after the allocation (an event on the own stream that
///   `stream` waits for), and the stream is remembered, so the free is ordered
///   after its work (see `DeviceBuffer`'s Drop);
/// - any memory on a stream of another device (peer copies): the stream is
///   remembered, and the free waits for it.
///
/// A stream being captured records nothing (its work runs at replays, which are
/// `unsafe` and the caller's to order).
#[inline]
pub(crate) fn note_use<T: DeviceRepr>(
    mem: &(impl DeviceMemory<T> + ?Sized),
    stream: &CudaStream,
) -> Result<()> {
    note_use_parts(mem.uses(), mem.memory_context(), stream)
}

/// [`note_use`] for memory given by its use record and context (the ends of
/// a batched copy).
#[inline]
pub(crate) fn note_use_parts(
    uses: Option<&Uses>,
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
) -> Result<()> {
    let Some(uses) = uses else {
        return Ok(());
    };
    match &uses.own {
        Some(own) if own.same_stream(stream) => Ok(()),
        Some(own) => note_foreign(uses, Some(own), stream),
        None if stream.context().same(ctx) => Ok(()),
        None => note_foreign(uses, None, stream),
    }
}

#[cold]
fn note_foreign(uses: &Uses, own: Option<&CudaStream>, stream: &CudaStream) -> Result<()> {
    let mut list = uses
        .foreign
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if list.iter().any(|s| s.same_stream(stream)) {
        return Ok(());
    }
    // Sections of two streams are never held at once (a capture start holds its
    // stream's lock while it waits for that stream's sections).
    let ready = match own {
        Some(own) => {
            // The memory is valid for work ordered after its allocation on `own`.
            let own_section = own.section();
            own.refuse_if_capturing(
                &own_section,
                "ordering a stream-ordered allocation before its use on another stream",
            )?;
            let ready = crate::stream::CudaEvent::new(own)?;
            ready.record(own)?;
            Some(ready)
        }
        None => None,
    };
    let section = stream.section();
    let captured = stream
        .capturing_now(&section)
        .map_err(|e| e.about(stream.subject("capture status")))?;
    // A captured use runs at replays (the caller's to order); the stream is
    // remembered all the same, since the capture may end before the operation is
    // queued, and then the operation runs now.
    if !captured {
        if let Some(ready) = ready {
            stream.wait_unmarked(&ready)?;
        }
    }
    list.push(stream.clone());
    uses.any_foreign.store(true, Ordering::Release);
    Ok(())
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
