//! Device memory metrale did not allocate (a PyTorch or CuPy tensor, another
//! allocator's block, a raw `cuMemAlloc`): the `unsafe` constructors
//! [`DeviceSlice::from_raw`] and [`DeviceSliceMut::from_raw_mut`], which view it
//! as metrale's own borrowed slices, so it goes wherever those go (copies,
//! fills, launches, tensor maps, collectives).
//!
//! Invariants:
//! - What can still be checked is checked before the view exists: the address
//!   is device memory the driver knows (`cuPointerGetAttribute`, memory type
//!   and device ordinal), on the context's device, aligned for `T`, and the
//!   whole range lies inside one allocation (`cuMemGetAddressRange_v2`).
//! - A foreign view carries no use record: metrale never frees it, and orders
//!   nothing for its owner. Keeping the memory alive (and unaliased, for a
//!   mutable view) until the queued work that used it is done is the caller's
//!   contract, stated on each constructor.

use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr};

use super::{byte_len, DeviceRepr, DeviceSlice, DeviceSliceMut};
use crate::context::{AsContext, CudaContext};
use crate::error::{cu, invalid_arg, Result};

/// Check that `len` elements of `T` at `ptr` are device memory of `ctx`'s
/// device, inside one allocation, aligned for `T`.
fn check_foreign<T: DeviceRepr>(
    ctx: &Arc<CudaContext>,
    ptr: CUdeviceptr,
    len: usize,
) -> Result<()> {
    let what = || {
        format!(
            "foreign device memory {ptr:#x} ({len} x {}) on device {}",
            std::any::type_name::<T>(),
            ctx.ordinal()
        )
    };
    let bytes = byte_len::<T>(len, "foreign device memory")?;
    if bytes == 0 {
        return Ok(());
    }
    let align = std::mem::align_of::<T>() as u64;
    if ptr == 0 || !ptr.is_multiple_of(align) {
        return Err(invalid_arg(format!(
            "{}: the address is {}, not aligned to {align} bytes for {}",
            what(),
            if ptr == 0 { "null" } else { "misaligned" },
            std::any::type_name::<T>()
        )));
    }
    let mut kind: std::ffi::c_uint = 0;
    let mut ordinal: std::ffi::c_int = -1;
    ctx.call(
        || format!("{}: its memory type", what()),
        // SAFETY: writes one unsigned int (the attribute's type); reads nothing
        // at `ptr`.
        |d| unsafe {
            cu!(
                d,
                cuPointerGetAttribute(
                    (&mut kind as *mut std::ffi::c_uint).cast(),
                    sys::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    ptr
                )
            )
        },
    )?;
    let device = sys::CUmemorytype_enum::CU_MEMORYTYPE_DEVICE.0 as std::ffi::c_uint;
    let unified = sys::CUmemorytype_enum::CU_MEMORYTYPE_UNIFIED.0 as std::ffi::c_uint;
    if kind != device && kind != unified {
        return Err(invalid_arg(format!(
            "{}: the driver reports memory type {kind}, not device (2) or managed (4) memory",
            what()
        )));
    }
    ctx.call(
        || format!("{}: its device", what()),
        // SAFETY: writes one int (the attribute's type); reads nothing at `ptr`.
        |d| unsafe {
            cu!(
                d,
                cuPointerGetAttribute(
                    (&mut ordinal as *mut std::ffi::c_int).cast(),
                    sys::CUpointer_attribute_enum::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr
                )
            )
        },
    )?;
    if ordinal != ctx.ordinal() as std::ffi::c_int {
        return Err(invalid_arg(format!(
            "{}: the memory is on device {ordinal}, not on device {}",
            what(),
            ctx.ordinal()
        )));
    }
    let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
    ctx.call(
        || format!("{}: its allocation", what()),
        // SAFETY: writes one address and one size; reads nothing at `ptr`.
        |d| unsafe { cu!(d, cuMemGetAddressRange_v2(&mut base, &mut size, ptr)) },
    )?;
    let end = ptr.checked_add(bytes as u64);
    let alloc_end = base.saturating_add(size as u64);
    if ptr < base || end.is_none_or(|e| e > alloc_end) {
        return Err(invalid_arg(format!(
            "{}: {bytes} bytes from {ptr:#x} run past the allocation {base:#x}..{alloc_end:#x} \
             ({size} bytes) that holds it",
            what()
        )));
    }
    Ok(())
}

impl<'a, T: DeviceRepr> DeviceSlice<'a, T> {
    /// View `len` elements of `T` at `ptr`, device memory that metrale did not
    /// allocate, as a shared slice of `ctx`'s device (for copies from it,
    /// launches, tensor maps, collectives).
    ///
    /// Checked first: the address is device (or managed) memory the driver
    /// knows, on `ctx`'s device, aligned for `T`, and the `len` elements lie
    /// inside one allocation. An empty view (`len` 0) checks nothing.
    ///
    /// # Safety
    /// For all of `'a` and until every operation queued through this view (or
    /// views made from it) has finished on the GPU:
    /// - the memory stays allocated (its owner does not free, unmap or reuse
    ///   it): metrale keeps no record of foreign memory and orders no free after
    ///   that work;
    /// - nothing writes the `len` elements unless ordered before or after the
    ///   reads queued through the view (the rules of a shared borrow);
    /// - its elements hold valid values of `T`.
    ///
    /// # Errors
    /// `InvalidArgument` naming the address for a null or misaligned address, a
    /// memory type or device that is not `ctx`'s, or a range past its
    /// allocation; the failing `cuPointerGetAttribute` or
    /// `cuMemGetAddressRange_v2` (an address the driver does not know).
    pub unsafe fn from_raw(ctx: &'a impl AsContext, ptr: CUdeviceptr, len: usize) -> Result<Self> {
        let ctx = ctx.context();
        check_foreign::<T>(ctx, ptr, len)?;
        Ok(DeviceSlice::from_parts(ptr, len, ctx, None))
    }
}

impl<'a, T: DeviceRepr> DeviceSliceMut<'a, T> {
    /// View `len` elements of `T` at `ptr`, device memory that metrale did not
    /// allocate, as a mutable slice of `ctx`'s device (also a copy or fill
    /// target, and a kernel's output). Checked as [`DeviceSlice::from_raw`].
    ///
    /// # Safety
    /// As [`DeviceSlice::from_raw`], and the access is exclusive: for all of
    /// `'a` and until the work queued through the view has finished, nothing
    /// else reads or writes the `len` elements unless ordered with that work,
    /// and no other view of them is used meanwhile. Values a kernel writes must
    /// be valid values of `T` for the owner that reads them afterwards.
    ///
    /// # Errors
    /// As [`DeviceSlice::from_raw`].
    pub unsafe fn from_raw_mut(
        ctx: &'a impl AsContext,
        ptr: CUdeviceptr,
        len: usize,
    ) -> Result<Self> {
        let ctx = ctx.context();
        check_foreign::<T>(ctx, ptr, len)?;
        Ok(DeviceSliceMut::from_parts(ptr, len, ctx, None))
    }
}
