//! Virtual memory management: reserved address ranges ([`VirtualRange`]),
//! physical memory ([`PhysicalMemory`]), mappings of one into the other with
//! access for chosen devices, and the wait before unmapping; `growable/` builds
//! [`GrowableBuffer`](crate::GrowableBuffer) on them, a buffer whose address never
//! changes while it grows, which can sleep (release its physical memory) and wake
//! (get it back at the same addresses).
//!
//! Invariants:
//! - A range records every mapping it holds; a map over a mapped part is refused
//!   before the driver, and sizes and offsets are checked against the device's
//!   allocation granularity (the error says the granularity).
//! - Unmapping waits for the work that may use the memory: every stream of the
//!   range's context (`cuCtxSynchronize`) and the streams of other devices that a
//!   safe operation used it on. A wait that fails for another reason than
//!   abandoned work keeps the mapping (an error, or a reported leak in Drop).
//! - A range is freed (`cuMemAddressFree`) only after everything in it was
//!   unmapped; when an unmap fails the range stays reserved (a reported leak),
//!   never freed while mapped.
//! - A mapping holds its [`PhysicalMemory`] (an `Arc`), so the handle lives while
//!   it is mapped, and can still be exported.
//! - Memory of a sleeping buffer is unreachable from safe code: sleeping is a
//!   different type ([`SleepingBuffer`](crate::SleepingBuffer)) with no device
//!   address to pass.
//!
//! `mod.rs` owns handle types, granularity and access; `physical.rs`
//! [`PhysicalMemory`]; `range.rs` [`VirtualRange`] and mapping; `unmap.rs` the
//! wait before unmapping and the release.

use metrale_cuda_sys::{
    CUmemAccess_flags, CUmemAllocationGranularity_flags, CUmemAllocationHandleType,
    CUmemAllocationProp, CUmemAllocationType, CUmemLocation, CUmemLocationType,
};

mod physical;
mod range;
mod unmap;

pub use physical::PhysicalMemory;
pub use range::VirtualRange;
pub(in crate::memory) use unmap::wait_for_context;

use crate::context::AsContext;
use crate::error::{cu, invalid_arg, Result};

/// Which shareable handles physical memory can be exported as (a set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct HandleTypes(u32);

impl HandleTypes {
    /// Not exportable.
    pub const NONE: HandleTypes = HandleTypes(0);
    /// Exportable as a POSIX file descriptor (Linux).
    pub const POSIX_FD: HandleTypes =
        HandleTypes(CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0);

    /// Whether every type of `other` is in `self`.
    pub fn contains(self, other: HandleTypes) -> bool {
        self.0 & other.0 == other.0
    }

    /// The driver's bit set.
    pub fn bits(self) -> u32 {
        self.0
    }
}

/// The allocation properties of pinned device memory on `ordinal`.
pub(super) fn props(ordinal: usize, types: HandleTypes) -> Result<CUmemAllocationProp> {
    let id = i32::try_from(ordinal)
        .map_err(|_| invalid_arg(format!("device ordinal {ordinal} is out of range")))?;
    // SAFETY: a plain C struct of integers and one pointer; all zero is its
    // documented default.
    let mut p: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = CUmemAllocationHandleType(types.0);
    p.location = CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id,
    };
    Ok(p)
}

/// A device's allocation granularity for virtual memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granularity {
    /// Every size and offset must be a multiple of this.
    pub minimum: usize,
    /// What the driver recommends for performance (a multiple of `minimum`).
    pub recommended: usize,
}

/// The allocation granularity of `ctx`'s device for memory exportable as `types`
/// (`cuMemGetAllocationGranularity`).
///
/// # Errors
/// The failing call (a device without virtual memory management says
/// NOT_SUPPORTED).
pub fn granularity(ctx: &impl AsContext, types: HandleTypes) -> Result<Granularity> {
    let ctx = ctx.context();
    let prop = props(ctx.ordinal(), types)?;
    let get = |flag: CUmemAllocationGranularity_flags| -> Result<usize> {
        let mut g: usize = 0;
        ctx.call(
            || format!("device {}: allocation granularity", ctx.ordinal()),
            // SAFETY: writes one size; `prop` is a valid property struct.
            |d| unsafe { cu!(d, cuMemGetAllocationGranularity(&mut g, &prop, flag)) },
        )?;
        if g == 0 {
            return Err(invalid_arg(format!(
                "device {}: the driver reported an allocation granularity of 0",
                ctx.ordinal()
            )));
        }
        Ok(g)
    };
    Ok(Granularity {
        minimum: get(CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)?,
        recommended: get(CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?,
    })
}

/// `Ok` when `value` is a non-zero multiple of `g` (or zero where `zero_ok`);
/// the error reads "{subject}: {label} {value} bytes is not a multiple ...".
pub(super) fn check_multiple(
    value: usize,
    g: usize,
    zero_ok: bool,
    label: &str,
    subject: impl Fn() -> String,
) -> Result<()> {
    if (value == 0 && !zero_ok) || !value.is_multiple_of(g) {
        return Err(invalid_arg(format!(
            "{}: {label} {value} bytes is not a {}multiple of the allocation granularity ({g} bytes)",
            subject(),
            if zero_ok { "" } else { "non-zero " }
        )));
    }
    Ok(())
}

/// `value` rounded up to a multiple of `g`, or an error when that overflows.
pub(in crate::memory) fn round_up(value: usize, g: usize) -> Result<usize> {
    value
        .checked_next_multiple_of(g)
        .ok_or_else(|| invalid_arg(format!("{value} bytes rounded up to {g} overflows usize")))
}

/// How a device may access mapped memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

impl Access {
    pub(super) fn flags(self) -> CUmemAccess_flags {
        match self {
            Access::Read => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access::ReadWrite => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }
}
