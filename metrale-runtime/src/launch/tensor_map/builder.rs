//! [`TensorMapBuilder`]: the options of a map over one buffer, set one by one,
//! then checked (`rules.rs`) and encoded.

use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::CUdeviceptr;

use super::rules::Scratch;
use super::types::{
    Dims, Interleave, L2Promotion, OobFill, Swizzle, TensorDataType, TensorElement,
};
use super::{TensorMap, TensorMapLayout};
use crate::context::CudaContext;
use crate::error::Result;

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

/// What a builder was given, apart from the memory's context: the input of the
/// rules (`rules.rs`), which need no driver.
#[derive(Debug, Clone)]
pub(super) struct Spec {
    pub(super) base: CUdeviceptr,
    pub(super) bytes: u64,
    pub(super) data_type: TensorDataType,
    pub(super) dims: Option<Dims<u64>>,
    pub(super) strides: Option<Dims<u64>>,
    pub(super) box_dims: Option<Dims<u32>>,
    pub(super) element_strides: Option<Dims<u32>>,
    pub(super) interleave: Interleave,
    pub(super) swizzle: Swizzle,
    pub(super) l2_promotion: L2Promotion,
    pub(super) oob_fill: OobFill,
    /// A list longer than five, remembered for `encode` to refuse.
    pub(super) too_long: Option<(&'static str, usize)>,
    /// Set by [`TensorMapBuilder::im2col`]: an im2col map instead of a tiled one.
    pub(super) im2col: Option<Im2col>,
}

/// The im2col part of a map: the pixel bounding box (corners of the spatial
/// dimensions, rank - 2 of each) and what one load gathers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Im2col {
    pub(super) lower: Dims<i32>,
    pub(super) upper: Dims<i32>,
    pub(super) channels_per_pixel: u32,
    pub(super) pixels_per_column: u32,
}

impl<'a, T: TensorElement> TensorMapBuilder<'a, T> {
    /// Elements of each dimension, innermost first (the rank is their count).
    #[inline]
    pub fn dims(mut self, dims: &[u64]) -> Self {
        self.spec.dims = Dims::new(dims);
        if self.spec.dims.is_none() {
            self.spec.too_long = Some(("sizes", dims.len()));
        }
        self
    }

    /// Byte strides of dimensions 1.. (one fewer than the rank). Default: packed.
    #[inline]
    pub fn strides(mut self, strides: &[u64]) -> Self {
        self.spec.strides = Dims::new(strides);
        if self.spec.strides.is_none() {
            self.spec.too_long = Some(("strides", strides.len()));
        }
        self
    }

    /// Elements of the box (the tile one copy moves) in each dimension. Default:
    /// each dimension's size, capped at 256.
    #[inline]
    pub fn box_dims(mut self, box_dims: &[u32]) -> Self {
        self.spec.box_dims = Dims::new(box_dims);
        if self.spec.box_dims.is_none() {
            self.spec.too_long = Some(("box sizes", box_dims.len()));
        }
        self
    }

    /// Step between elements read in each dimension. Default: 1.
    #[inline]
    pub fn element_strides(mut self, element_strides: &[u32]) -> Self {
        self.spec.element_strides = Dims::new(element_strides);
        if self.spec.element_strides.is_none() {
            self.spec.too_long = Some(("element strides", element_strides.len()));
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
        if l.is_none() {
            self.spec.too_long = Some(("lower corners", lower.len()));
        }
        if u.is_none() {
            self.spec.too_long = Some(("upper corners", upper.len()));
        }
        if let (Some(lower), Some(upper)) = (l, u) {
            self.spec.im2col = Some(Im2col {
                lower,
                upper,
                channels_per_pixel,
                pixels_per_column,
            });
        }
        self
    }

    /// Another data type of the same element size (`Tf32` over `f32` memory).
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
    /// `cuTensorMapEncodeIm2col` after [`TensorMapBuilder::im2col`]).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the
    /// rule and the value, before the driver; the driver's status (with the
    /// address) otherwise; a missing-symbol error on drivers before CUDA 12.0.
    pub fn encode(self) -> Result<TensorMap<'a, T>> {
        let mut scratch = Scratch::default();
        match self.spec.quick::<T>(&mut scratch) {
            Some(tiled) => tiled.encode(self.ctx, self.spec.base),
            None => self
                .spec
                .check_each::<T>()?
                .encode_at(self.ctx, self.spec.base),
        }
    }

    /// Check every rule, against this builder's memory too, and keep the layout
    /// for [`TensorMapLayout::encode`] over other memory of the same shape.
    ///
    /// # Errors
    /// As [`TensorMapBuilder::encode`], before the driver.
    pub fn layout(self) -> Result<TensorMapLayout<T>> {
        self.spec.check::<T>()
    }
}
