//! Tensor maps for the Tensor Memory Accelerator (compute capability 9.0+):
//! [`TensorMap`], a 128-byte descriptor that `cp.async.bulk.tensor` reads, encoded
//! by `cuTensorMapEncodeTiled` (or `cuTensorMapEncodeIm2col`,
//! `cuTensorMapEncodeIm2colWide`) from a
//! [`TensorMapBuilder`] over metrale device memory.
//!
//! Invariants:
//! - Every rule the CUDA 13.0 driver documents for the data types, interleaves
//!   and swizzles this module offers is checked before the driver is called, and
//!   a refusal names the rule and the value. These are all of them: rank 1..=5
//!   (3 or more when interleaved), global dimensions in 1..=2^32, byte strides
//!   multiples of 16 (32 with 32-byte interleave) and below 2^40, the global
//!   address aligned to 16 bytes (32 with 32-byte interleave), box sizes in
//!   1..=256, the inner box row a multiple of 16 bytes without interleave and
//!   within the swizzle span, element strides in 1..=8, 32-byte interleave only
//!   with the 32-byte swizzle, NaN fill only for floating-point types; for im2col
//!   maps also rank 3..=5, pixel-box corners within the range the rank allows,
//!   channels per pixel 1..=256 (a multiple of 16 bytes without interleave,
//!   within the swizzle span) and pixels per column 1..=1024; for the packed
//!   sub-byte types (sizes count values) a 32-byte aligned address and strides,
//!   size 0 a multiple of 128 and a box (or pixel) row of 128 values for the
//!   16-byte groups, size 0 even for `16U4_ALIGN8B`, the swizzles each allows, no
//!   interleave for `16U6_ALIGN16B`, no NaN fill; for wide im2col maps one width
//!   offset per corner in -32768..=32767, the 64-byte, 128-byte and 128-byte
//!   atom-32 swizzles only, pixels not read in mode `W128`. The packed types, the
//!   128-byte atom swizzles and wide im2col maps need compute capability 10.0
//!   and a CUDA 12.8 driver: refused with
//!   [`ErrorKind::FeatureUnavailable`](crate::ErrorKind::FeatureUnavailable)
//!   before the driver elsewhere (a layout against each memory's device). A
//!   [`TensorMapLayout`] is checked by the same code as a map built directly.
//! - A map never describes memory outside the buffer it was made from: the last
//!   byte the sizes and strides reach lies inside the memory's extent. The map
//!   borrows that memory (`'a`), so safe code cannot free it while the map lives;
//!   [`TensorMap::replace_address`] moves it to other memory with the same check.
//! - The kernel receives the driver's 128 bytes exactly: `&TensorMap` is a
//!   [`KernelArg`](crate::KernelArg) of size 128, so the launch check accepts it
//!   for a 128-byte (`CUtensorMap`, `__grid_constant__`) parameter.

mod builder;
mod layout;
mod quick;
mod rules;
mod types;

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr};

pub use builder::TensorMapBuilder;
pub use layout::TensorMapLayout;
pub use types::{
    Im2colWideMode, Interleave, L2Promotion, OobFill, Swizzle, TensorDataType, TensorElement,
    TENSOR_MAP_MAX_RANK,
};

use crate::context::CudaContext;
use crate::error::{cu, invalid_arg, ErrorKind, MetraleError, Result};
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
    /// Start a tiled map over `mem` (a buffer or slice; the map borrows it).
    /// Without [`dims`](TensorMapBuilder::dims) the map is one dimension of all
    /// of `mem`'s elements; without strides the dimensions are packed.
    pub fn tiled<M: DeviceMemory<T>>(mem: &'a M) -> TensorMapBuilder<'a, T> {
        let bytes = (mem.len() as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        TensorMapBuilder {
            ctx: mem.memory_context(),
            spec: builder::Spec {
                base: mem.device_ptr(),
                bytes,
                data_type: T::DATA_TYPE,
                dims: None,
                strides: None,
                box_dims: None,
                element_strides: None,
                interleave: Interleave::None,
                swizzle: Swizzle::None,
                l2_promotion: L2Promotion::None,
                oob_fill: OobFill::Zero,
                too_long: None,
                im2col: None,
            },
            _mem: PhantomData,
        }
    }

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

/// A refusal's error, built out of line (the checks' hot path only compares).
#[cold]
#[inline(never)]
pub(super) fn refuse(text: fmt::Arguments<'_>) -> MetraleError {
    invalid_arg(format!("tensor map: {text}"))
}

/// The global address aligned to `align` bytes (a power of two: 16, or 32 with
/// the reason from the interleave or the data type).
#[inline(always)]
pub(super) fn check_address(
    base: CUdeviceptr,
    align: u64,
    interleave: Interleave,
    ty: TensorDataType,
) -> Result<()> {
    // `align` is 16 or 32: a mask, not a division.
    if base & align.wrapping_sub(1) != 0 {
        return Err(misaligned(base, align, interleave, ty));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn misaligned(
    base: CUdeviceptr,
    align: u64,
    interleave: Interleave,
    ty: TensorDataType,
) -> MetraleError {
    refuse(format_args!(
        "the global address must be aligned to {align} bytes{}: {base:#x} is not",
        rules::align_reason(align, interleave, ty)
    ))
}

/// The device and driver have what a map of `spec` needs beyond compute
/// capability 9.0 (called only when it needs some: a packed type, an atom
/// swizzle, a wide im2col map): compute capability 10.0 and CUDA 12.8.
#[cold]
#[inline(never)]
fn check_sm100(ctx: &CudaContext, spec: &builder::Spec, base: CUdeviceptr) -> Result<()> {
    check_features(
        ctx,
        spec.data_type,
        spec.swizzle,
        spec.im2col.is_some_and(|i| i.wide.is_some()),
        base,
    )
}

/// As [`check_sm100`], from the parts a layout keeps.
#[cold]
#[inline(never)]
fn check_features(
    ctx: &CudaContext,
    data_type: TensorDataType,
    swizzle: Swizzle,
    wide: bool,
    base: CUdeviceptr,
) -> Result<()> {
    const NEEDS: (u32, u32) = (10, 0);
    const NEEDS_DRIVER: i32 = 12080;
    let has = ctx.limits().compute_capability;
    let driver = ctx.driver_version();
    if has >= NEEDS && driver >= NEEDS_DRIVER {
        return Ok(());
    }
    let feature = if data_type.is_packed() {
        format!("data type {}", data_type.driver_name())
    } else if swizzle.is_atom() {
        format!("swizzle {swizzle:?}")
    } else if wide {
        "a wide im2col map".to_string()
    } else {
        return Ok(());
    };
    Err(ErrorKind::FeatureUnavailable {
        subject: format!("tensor map at {base:#x}"),
        feature,
        device: ctx.ordinal(),
        needs: NEEDS,
        has,
        needs_driver: NEEDS_DRIVER,
        driver,
    }
    .into())
}
