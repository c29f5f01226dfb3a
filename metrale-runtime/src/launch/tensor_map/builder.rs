//! [`TensorMapBuilder`]: the options of a map over one buffer, set one by one,
//! then checked (`rules.rs`) and encoded.

use std::marker::PhantomData;
use std::sync::Arc;

use super::layout::TensorMapLayout;
use super::map::TensorMap;
use super::quick::Scratch;
use super::spec::{check_sm100, Im2col, Spec, TooLong};
use super::types::{
    Dims, Im2colWideMode, Interleave, L2Promotion, OobFill, Swizzle, TensorDataType, TensorElement,
};
use crate::context::CudaContext;
use crate::error::Result;
use crate::memory::DeviceMemory;

/// The options of a tiled tensor map over `mem`, checked and encoded by
/// [`TensorMapBuilder::encode`]. Dimension 0 is the innermost (contiguous) one.
///
/// ```no_run
/// use metrale_runtime::{host, DeviceBuffer, Swizzle, TensorMap};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let s = h.stream();
/// // A 64 x 128 row-major f32 matrix, read as 32 x 32 tiles.
/// let m = DeviceBuffer::<f32>::alloc(s, 64 * 128)?;
/// let map = TensorMap::tiled(&m)
///     .dims(&[128, 64])
///     .strides(&[128 * 4])
///     .box_dims(&[32, 32])
///     .swizzle(Swizzle::B128)
///     .encode()?;
/// # let _ = map; Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `encode` is called"]
pub struct TensorMapBuilder<'a, T: TensorElement> {
    pub(super) ctx: &'a Arc<CudaContext>,
    pub(super) spec: Spec,
    pub(super) _mem: PhantomData<&'a T>,
}

impl<'a, T: TensorElement> TensorMap<'a, T> {
    /// Start a tiled map over `mem` (a buffer or slice; the map borrows it).
    /// Without [`dims`](TensorMapBuilder::dims) the map is one dimension of all
    /// of `mem`'s elements; without strides the dimensions are packed.
    pub fn tiled<M: DeviceMemory<T>>(mem: &'a M) -> TensorMapBuilder<'a, T> {
        let bytes = (mem.len() as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        TensorMapBuilder {
            ctx: mem.memory_context(),
            spec: Spec {
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
}

impl<'a, T: TensorElement> TensorMapBuilder<'a, T> {
    /// Elements of each dimension, innermost first (the rank is their count).
    #[inline]
    pub fn dims(mut self, dims: &[u64]) -> Self {
        self.spec.dims = Dims::new(dims);
        if self.spec.dims.is_none() || self.spec.too_long.is_some() {
            self.spec.too_long = TooLong::noted(self.spec.too_long, 0, dims.len());
        }
        self
    }

    /// Byte strides of dimensions 1.. (one fewer than the rank). Default: packed.
    #[inline]
    pub fn strides(mut self, strides: &[u64]) -> Self {
        self.spec.strides = Dims::new(strides);
        if self.spec.strides.is_none() || self.spec.too_long.is_some() {
            self.spec.too_long = TooLong::noted(self.spec.too_long, 1, strides.len());
        }
        self
    }

    /// Elements of the box (the tile one copy moves) in each dimension. Default:
    /// each dimension's size, capped at 256.
    #[inline]
    pub fn box_dims(mut self, box_dims: &[u32]) -> Self {
        self.spec.box_dims = Dims::new(box_dims);
        if self.spec.box_dims.is_none() || self.spec.too_long.is_some() {
            self.spec.too_long = TooLong::noted(self.spec.too_long, 2, box_dims.len());
        }
        self
    }

    /// Step between elements read in each dimension. Default: 1.
    #[inline]
    pub fn element_strides(mut self, element_strides: &[u32]) -> Self {
        self.spec.element_strides = Dims::new(element_strides);
        if self.spec.element_strides.is_none() || self.spec.too_long.is_some() {
            self.spec.too_long = TooLong::noted(self.spec.too_long, 3, element_strides.len());
        }
        self
    }

    /// Make an im2col map (`cuTensorMapEncodeIm2col`, rank 3 to 5, dimension 0
    /// the channels) instead of a tiled one: `lower` and `upper` are the corners
    /// of the pixel bounding box in the spatial dimensions (rank - 2 values each,
    /// innermost first); a load gathers `pixels_per_column` pixels of
    /// `channels_per_pixel` channels. Box sizes do not apply.
    #[inline]
    pub fn im2col(
        mut self,
        lower: &[i32],
        upper: &[i32],
        channels_per_pixel: u32,
        pixels_per_column: u32,
    ) -> Self {
        let (l, u) = (Dims::new(lower), Dims::new(upper));
        if l.is_none() || u.is_none() || self.spec.too_long.is_some() {
            self.spec.too_long = TooLong::noted(self.spec.too_long, 4, lower.len());
            self.spec.too_long = TooLong::noted(self.spec.too_long, 5, upper.len());
        }
        if let (Some(lower), Some(upper)) = (l, u) {
            self.spec.im2col = Some(Im2col {
                lower,
                upper,
                channels_per_pixel,
                pixels_per_column,
                wide: None,
            });
        }
        self
    }

    /// Make a wide im2col map (`cuTensorMapEncodeIm2colWide`, compute capability
    /// 10.0+, CUDA 12.8+; rank 3 to 5, NWC, NHWC or NDHWC) instead of a tiled
    /// one: loads run along W only, from `lower_w` to `upper_w` (the width
    /// offsets of the pixel box's corners); a load gathers `pixels_per_column`
    /// pixels (mode [`Im2colWideMode::W`]; [`Im2colWideMode::W128`] reads 128)
    /// of `channels_per_pixel` channels. Box sizes do not apply; the swizzle must
    /// be `B64`, `B128` or `B128Atom32`.
    #[inline]
    pub fn im2col_wide(
        mut self,
        lower_w: i32,
        upper_w: i32,
        channels_per_pixel: u32,
        pixels_per_column: u32,
        mode: Im2colWideMode,
    ) -> Self {
        if let (Some(lower), Some(upper)) = (Dims::new(&[lower_w]), Dims::new(&[upper_w])) {
            self.spec.im2col = Some(Im2col {
                lower,
                upper,
                channels_per_pixel,
                pixels_per_column,
                wide: Some(mode),
            });
        }
        self
    }

    /// [`im2col_wide`](TensorMapBuilder::im2col_wide), then
    /// [`encode`](TensorMapBuilder::encode).
    ///
    /// # Errors
    /// As [`encode`](TensorMapBuilder::encode).
    pub fn encode_im2col_wide(
        self,
        lower_w: i32,
        upper_w: i32,
        channels_per_pixel: u32,
        pixels_per_column: u32,
        mode: Im2colWideMode,
    ) -> Result<TensorMap<'a, T>> {
        self.im2col_wide(
            lower_w,
            upper_w,
            channels_per_pixel,
            pixels_per_column,
            mode,
        )
        .encode()
    }

    /// Another data type of the same element size (`Tf32` over `f32` memory), or a
    /// packed sub-byte type over `u8` memory (sizes then count values).
    #[inline]
    pub fn data_type(mut self, data_type: TensorDataType) -> Self {
        self.spec.data_type = data_type;
        self
    }

    /// The interleave layout.
    #[inline]
    pub fn interleave(mut self, interleave: Interleave) -> Self {
        self.spec.interleave = interleave;
        self
    }

    /// The shared-memory swizzle.
    #[inline]
    pub fn swizzle(mut self, swizzle: Swizzle) -> Self {
        self.spec.swizzle = swizzle;
        self
    }

    /// The L2 promotion.
    #[inline]
    pub fn l2_promotion(mut self, l2_promotion: L2Promotion) -> Self {
        self.spec.l2_promotion = l2_promotion;
        self
    }

    /// What loads outside the tensor read.
    #[inline]
    pub fn oob_fill(mut self, oob_fill: OobFill) -> Self {
        self.spec.oob_fill = oob_fill;
        self
    }

    /// Check every rule and encode the map (`cuTensorMapEncodeTiled`, or
    /// `cuTensorMapEncodeIm2col` after [`TensorMapBuilder::im2col`],
    /// `cuTensorMapEncodeIm2colWide` after [`TensorMapBuilder::im2col_wide`]).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the
    /// rule and the value, before the driver;
    /// [`ErrorKind::FeatureUnavailable`](crate::ErrorKind::FeatureUnavailable) for a
    /// packed type, an atom swizzle or a wide im2col map on a device below compute
    /// capability 10.0 or a driver before CUDA 12.8; the driver's status (with the
    /// address) otherwise; a missing-symbol error on drivers before CUDA 12.0
    /// (12.8 for a wide im2col map).
    pub fn encode(self) -> Result<TensorMap<'a, T>> {
        let mut scratch = Scratch::default();
        match self.spec.quick::<T>(&mut scratch) {
            Some(tiled) => tiled.encode(self.ctx, self.spec.base),
            None => {
                let layout = self.spec.check_each::<T>()?;
                if layout.sm100 {
                    check_sm100(self.ctx, &self.spec, self.spec.base)?;
                }
                layout.encode_at(self.ctx, self.spec.base)
            }
        }
    }

    /// Check every rule, against this builder's memory too, and keep the layout
    /// for [`TensorMapLayout::encode`] over other memory of the same shape.
    ///
    /// # Errors
    /// As [`TensorMapBuilder::encode`], before the driver.
    pub fn layout(self) -> Result<TensorMapLayout<T>> {
        let layout = self.spec.check::<T>()?;
        if layout.sm100 {
            check_sm100(self.ctx, &self.spec, self.spec.base)?;
        }
        Ok(layout)
    }
}
