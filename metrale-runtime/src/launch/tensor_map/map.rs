//! [`TensorMap`]: the driver's encoded map over borrowed device memory, its
//! address replacement, and its place in a kernel's parameters.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr};

use super::spec::{check_address, refuse};
use super::types::{Interleave, TensorDataType, TensorElement};
use crate::context::CudaContext;
use crate::error::{cu, MetraleError, Result};
use crate::memory::DeviceMemory;

/// A tensor map: the driver's 128-byte `CUtensorMap` describing tiles of device
/// memory it borrows, passed to kernels as `&map` (a 128-byte parameter,
/// `const __grid_constant__ CUtensorMap`).
///
/// The driver's bytes are the first field, aligned as the header's `CUtensorMap`
/// (128 bytes, as the 13.0 header declares it; the driver requires 64); what
/// another address is checked against
/// ([`TensorMap::set_address`]) follows them.
#[repr(C)]
pub struct TensorMap<'a, T: TensorElement> {
    pub(super) raw: sys::CUtensorMap,
    pub(super) base: CUdeviceptr,
    /// Bytes from the first element to one past the last the map reaches.
    pub(super) extent: u64,
    /// The memory's context, borrowed with the memory (no reference count to
    /// touch per map).
    pub(super) ctx: &'a Arc<CudaContext>,
    pub(super) data_type: TensorDataType,
    pub(super) interleave: Interleave,
    /// The address alignment the map needs (16 or 32 bytes), kept so a new
    /// address is checked without deriving it again.
    pub(super) align: u8,
    pub(super) _mem: PhantomData<&'a T>,
}

impl<T: TensorElement> fmt::Debug for TensorMap<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorMap")
            .field("address", &format_args!("{:#x}", self.base))
            .field("data_type", &self.data_type)
            .field("extent", &self.extent)
            .field("device", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl<'a, T: TensorElement> TensorMap<'a, T> {
    /// The driver's 128 bytes.
    pub fn as_raw(&self) -> &sys::CUtensorMap {
        &self.raw
    }

    /// The driver's 128 bytes, as bytes (what a kernel parameter or a buffer of
    /// maps holds).
    pub fn as_bytes(&self) -> &[u8; 128] {
        const _: () = assert!(std::mem::size_of::<sys::CUtensorMap>() == 128);
        // SAFETY: `CUtensorMap` is 16 `u64`s, exactly 128 initialised bytes with
        // no padding (asserted above); `[u8; 128]` has alignment 1, and the
        // borrow is tied to `self`.
        unsafe { &*std::ptr::from_ref(&self.raw).cast::<[u8; 128]>() }
    }

    /// The global address the map points at.
    pub fn address(&self) -> CUdeviceptr {
        self.base
    }

    /// The context of the memory the map describes.
    pub fn context(&self) -> &'a Arc<CudaContext> {
        self.ctx
    }

    /// Point the map at `mem` instead (`cuTensorMapReplaceAddress`), keeping every
    /// other field: `mem` must be memory of the same device, aligned as the map
    /// needs and at least as large as the map reaches. The map now borrows `mem`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the
    /// rule before the driver; the driver's status otherwise.
    #[inline(always)]
    pub fn replace_address<'b, M: DeviceMemory<T>>(
        mut self,
        mem: &'b M,
    ) -> Result<TensorMap<'b, T>> {
        let base = self.admit(mem)?;
        // The driver rewrites this map's own bytes (no copy before the call); the
        // bytes then move, unchanged, into the map borrowing `mem`.
        self.replace_raw(base)?;
        Ok(TensorMap {
            raw: self.raw,
            base,
            extent: self.extent,
            ctx: mem.memory_context(),
            data_type: self.data_type,
            interleave: self.interleave,
            align: self.align,
            _mem: PhantomData,
        })
    }

    /// [`replace_address`](TensorMap::replace_address) in place, for memory that
    /// lives as long as the memory the map borrows now (no copy of the map).
    /// On an error the map is unchanged.
    ///
    /// # Errors
    /// As [`replace_address`](TensorMap::replace_address).
    #[inline]
    pub fn set_address<M: DeviceMemory<T>>(&mut self, mem: &'a M) -> Result<()> {
        let base = self.admit(mem)?;
        if let Err(e) = self.replace_raw(base) {
            return Err(self.restore(e));
        }
        self.base = base;
        Ok(())
    }

    /// The checks that depend on the new memory, and only those (every other
    /// field was checked when the map was made and is unchanged): the same
    /// context, the address aligned as the map needs, and the extent within the
    /// memory. Returns its address.
    #[inline(always)]
    fn admit<M: DeviceMemory<T>>(&self, mem: &M) -> Result<CUdeviceptr> {
        let ctx = mem.memory_context();
        if !Arc::ptr_eq(ctx, self.ctx) {
            return Err(self.other_device(ctx));
        }
        let base = mem.device_ptr();
        let bytes = (mem.len() as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        check_address(base, u64::from(self.align), self.interleave, self.data_type)?;
        if self.extent > bytes {
            return Err(self.too_small(bytes));
        }
        Ok(base)
    }

    /// `cuTensorMapReplaceAddress` on the map's own bytes.
    #[inline(always)]
    fn replace_raw(&mut self, base: CUdeviceptr) -> Result<()> {
        let raw = &mut self.raw;
        self.ctx.call_unbound(
            // Encoding is host work on the caller's arrays: no context is bound.
            || format!("tensor map at {base:#x}"),
            |d| {
                // SAFETY: `raw` is a map the driver encoded, in the 128-byte aligned
                // CUtensorMap field; the new address was checked (`admit`) against
                // the map's alignment and extent, and the caller ties that memory's
                // borrow to the map.
                unsafe { cu!(d, cuTensorMapReplaceAddress(raw, base as *mut c_void)) }
            },
        )
    }

    /// After a failed replace in place: point the bytes back at the address the
    /// map had (which passed the same checks when it was set), so the map is
    /// unchanged whatever the driver left in them; `e` is the error returned.
    #[cold]
    #[inline(never)]
    fn restore(&mut self, e: MetraleError) -> MetraleError {
        let _ = self.replace_raw(self.base);
        e
    }

    #[cold]
    #[inline(never)]
    fn other_device(&self, ctx: &Arc<CudaContext>) -> MetraleError {
        refuse(format_args!(
            "a map of device {}: replace_address with memory of device {}",
            self.ctx.ordinal(),
            ctx.ordinal()
        ))
    }

    #[cold]
    #[inline(never)]
    fn too_small(&self, bytes: u64) -> MetraleError {
        refuse(format_args!(
            "the map reaches {} bytes, beyond the {bytes} bytes of the memory",
            self.extent
        ))
    }
}

/// The alignment a tensor-map kernel parameter has (`.param .align 64 .b8 [128]`).
pub(crate) const TENSOR_MAP_PARAM_ALIGN: usize = 64;

// SAFETY: the pointer is to the `raw` field, the driver's 128 bytes, borrowed with
// the map; a `CUtensorMap` kernel parameter is exactly those bytes; 64 is a power
// of two.
unsafe impl<T: TensorElement> crate::launch::KernelArg for &TensorMap<'_, T> {
    const SIZE: usize = std::mem::size_of::<sys::CUtensorMap>();
    const ALIGN: usize = TENSOR_MAP_PARAM_ALIGN;
    #[inline]
    fn param_ptr(&self) -> *mut c_void {
        (&self.raw as *const sys::CUtensorMap).cast_mut().cast()
    }
}
