//! [`TensorMapLayout`]: a map's shape checked once, encoded over any memory it
//! fits with only the checks that depend on the memory.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdeviceptr};

use super::map::TensorMap;
use super::spec::{address_align, check_address, check_features, refuse, Im2col};
use super::types::{
    interleave_raw, l2_raw, oob_raw, swizzle_raw, wide_raw, Dims, Interleave, L2Promotion, OobFill,
    Swizzle, TensorDataType, TensorElement, TENSOR_MAP_MAX_RANK,
};
use crate::context::CudaContext;
use crate::error::{cu, MetraleError, Result};
use crate::memory::DeviceMemory;

/// The layout of a tensor map (sizes, strides, box, element strides, data type,
/// interleave, swizzle, L2 promotion, fill, im2col corners), checked against
/// every documented rule once by [`TensorMapBuilder::layout`](super::TensorMapBuilder::layout), then encoded over
/// any memory it fits by [`TensorMapLayout::encode`]: one map per buffer of the
/// same shape (per layer, per batch slot) pays only the checks that depend on the
/// memory (its device's context, the address alignment and the extent).
#[derive(Clone, Copy)]
pub struct TensorMapLayout<T: TensorElement> {
    pub(super) data_type: TensorDataType,
    pub(super) rank: u32,
    pub(super) dims: Dims<u64>,
    pub(super) strides: Dims<u64>,
    pub(super) box_dims: [u32; TENSOR_MAP_MAX_RANK],
    pub(super) element_strides: [u32; TENSOR_MAP_MAX_RANK],
    pub(super) interleave: Interleave,
    pub(super) swizzle: Swizzle,
    pub(super) l2_promotion: L2Promotion,
    pub(super) oob_fill: OobFill,
    pub(super) im2col: Option<Im2col>,
    /// Bytes from the first element to one past the last the map reaches.
    pub(super) extent: u64,
    /// Whether it needs compute capability 10.0 and CUDA 12.8 (a packed type,
    /// an atom swizzle, a wide im2col map): checked against each memory's device.
    pub(super) sm100: bool,
    pub(super) _t: PhantomData<fn() -> T>,
}

impl<T: TensorElement> fmt::Debug for TensorMapLayout<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorMapLayout")
            .field("data_type", &self.data_type)
            .field("dims", &self.dims)
            .field("strides", &self.strides)
            .field("box_dims", &&self.box_dims[..self.dims.len()])
            .field("interleave", &self.interleave)
            .field("swizzle", &self.swizzle)
            .field("im2col", &self.im2col.is_some())
            .field("extent", &self.extent)
            .finish_non_exhaustive()
    }
}

impl<T: TensorElement> TensorMapLayout<T> {
    /// Bytes from the first element to one past the last the layout reaches: the
    /// least memory it can be encoded over.
    pub fn extent(&self) -> u64 {
        self.extent
    }

    /// Encode a map of this layout over `mem` (a buffer or slice; the map borrows
    /// it), after the checks that depend on the memory: the address aligned as
    /// the layout needs, and the extent within the memory.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the
    /// rule before the driver; the driver's status (with the address) otherwise.
    #[inline(always)]
    pub fn encode<'a, M: DeviceMemory<T>>(&self, mem: &'a M) -> Result<TensorMap<'a, T>> {
        let base = mem.device_ptr();
        let bytes = (mem.len() as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        check_address(
            base,
            address_align(self.interleave, self.data_type),
            self.interleave,
            self.data_type,
        )?;
        if self.extent > bytes {
            return Err(self.too_small(bytes));
        }
        if self.sm100 {
            check_features(
                mem.memory_context(),
                self.data_type,
                self.swizzle,
                self.im2col.is_some_and(|i| i.wide.is_some()),
                base,
            )?;
        }
        self.encode_at(mem.memory_context(), base)
    }

    #[cold]
    #[inline(never)]
    fn too_small(&self, bytes: u64) -> MetraleError {
        refuse(format_args!(
            "sizes {:?} with byte strides {:?} reach {} bytes, beyond the {bytes} bytes of \
             the memory",
            self.dims, self.strides, self.extent
        ))
    }

    /// The driver's encoding at `base` (checked by the caller).
    #[inline(always)]
    pub(super) fn encode_at<'a>(
        &self,
        ctx: &'a Arc<CudaContext>,
        base: CUdeviceptr,
    ) -> Result<TensorMap<'a, T>> {
        let Some(i) = &self.im2col else {
            return Tiled {
                data_type: self.data_type,
                rank: self.rank,
                dims: &self.dims.v,
                strides: &self.strides.v,
                box_dims: &self.box_dims,
                element_strides: &self.element_strides,
                interleave: self.interleave,
                swizzle: self.swizzle,
                l2_promotion: self.l2_promotion,
                oob_fill: self.oob_fill,
                extent: self.extent,
            }
            .encode(ctx, base);
        };
        let mut raw_map = sys::CUtensorMap { opaque: [0; 16] };
        let raw = &mut raw_map;
        ctx.call_unbound(
            // Encoding is host work on the caller's arrays: no context is bound.
            || format!("tensor map at {base:#x}"),
            |d| {
                if let (Some(mode), [lower], [upper]) = (i.wide, i.lower.get(), i.upper.get()) {
                    // SAFETY: as for the im2col call below; a wide map takes one
                    // width offset per corner, passed by value (checked).
                    return unsafe {
                        cu!(
                            d,
                            cuTensorMapEncodeIm2colWide(
                                raw,
                                self.data_type.to_driver(),
                                self.rank,
                                base as *mut c_void,
                                self.dims.v.as_ptr(),
                                self.strides.v.as_ptr(),
                                *lower,
                                *upper,
                                i.channels_per_pixel,
                                i.pixels_per_column,
                                self.element_strides.as_ptr(),
                                interleave_raw(self.interleave),
                                wide_raw(mode),
                                swizzle_raw(self.swizzle),
                                l2_raw(self.l2_promotion),
                                oob_raw(self.oob_fill),
                            )
                        )
                    };
                }
                // SAFETY: `raw` is a writable, 128-aligned CUtensorMap; each array
                // holds at least `rank` values and the corner arrays rank - 2
                // (checked when the layout was made); the caller checked the
                // address and the extent against the memory, which the map's
                // lifetime keeps alive.
                unsafe {
                    cu!(
                        d,
                        cuTensorMapEncodeIm2col(
                            raw,
                            self.data_type.to_driver(),
                            self.rank,
                            base as *mut c_void,
                            self.dims.v.as_ptr(),
                            self.strides.v.as_ptr(),
                            i.lower.v.as_ptr(),
                            i.upper.v.as_ptr(),
                            i.channels_per_pixel,
                            i.pixels_per_column,
                            self.element_strides.as_ptr(),
                            interleave_raw(self.interleave),
                            swizzle_raw(self.swizzle),
                            l2_raw(self.l2_promotion),
                            oob_raw(self.oob_fill),
                        )
                    )
                }
            },
        )?;
        Ok(TensorMap {
            raw: raw_map,
            base,
            extent: self.extent,
            ctx,
            data_type: self.data_type,
            interleave: self.interleave,
            align: address_align(self.interleave, self.data_type) as u8,
            _mem: PhantomData,
        })
    }
}

/// The arguments of one tiled encoding, the arrays by reference (a builder's
/// own lists are passed to the driver where they are, without a copy). Made
/// only from checked values: by a [`TensorMapLayout`], or by the builder's quick
/// proof (`rules.rs`).
pub(super) struct Tiled<'s> {
    pub(super) data_type: TensorDataType,
    pub(super) rank: u32,
    pub(super) dims: &'s [u64; TENSOR_MAP_MAX_RANK],
    pub(super) strides: &'s [u64; TENSOR_MAP_MAX_RANK],
    pub(super) box_dims: &'s [u32; TENSOR_MAP_MAX_RANK],
    pub(super) element_strides: &'s [u32; TENSOR_MAP_MAX_RANK],
    pub(super) interleave: Interleave,
    pub(super) swizzle: Swizzle,
    pub(super) l2_promotion: L2Promotion,
    pub(super) oob_fill: OobFill,
    pub(super) extent: u64,
}

impl Tiled<'_> {
    /// `cuTensorMapEncodeTiled` at `base` (checked by the caller).
    #[inline(always)]
    pub(super) fn encode<'a, T: TensorElement>(
        &self,
        ctx: &'a Arc<CudaContext>,
        base: CUdeviceptr,
    ) -> Result<TensorMap<'a, T>> {
        // Encoded into a local and moved into the map (measured: fewer instructions
        // than encoding inside the returned value, whose address then escapes).
        let mut raw_map = sys::CUtensorMap { opaque: [0; 16] };
        let raw = &mut raw_map;
        ctx.call_unbound(
            // Encoding is host work on the caller's arrays: no context is bound.
            || format!("tensor map at {base:#x}"),
            |d| {
                // SAFETY: `raw` is a writable, 128-aligned CUtensorMap; each array
                // holds five values, the first `rank` of them checked; the caller
                // checked the address and the extent against the memory, which
                // the map's lifetime keeps alive.
                unsafe {
                    cu!(
                        d,
                        cuTensorMapEncodeTiled(
                            raw,
                            self.data_type.to_driver(),
                            self.rank,
                            base as *mut c_void,
                            self.dims.as_ptr(),
                            self.strides.as_ptr(),
                            self.box_dims.as_ptr(),
                            self.element_strides.as_ptr(),
                            interleave_raw(self.interleave),
                            swizzle_raw(self.swizzle),
                            l2_raw(self.l2_promotion),
                            oob_raw(self.oob_fill),
                        )
                    )
                }
            },
        )?;
        Ok(TensorMap {
            raw: raw_map,
            base,
            extent: self.extent,
            ctx,
            data_type: self.data_type,
            interleave: self.interleave,
            align: address_align(self.interleave, self.data_type) as u8,
            _mem: PhantomData,
        })
    }
}
