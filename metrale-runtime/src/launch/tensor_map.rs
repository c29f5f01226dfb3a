//! Tensor maps for the Tensor Memory Accelerator (compute capability 9.0+):
//! [`TensorMap`], a 128-byte descriptor that `cp.async.bulk.tensor` reads, encoded
//! by `cuTensorMapEncodeTiled` (or `cuTensorMapEncodeIm2col`) from a
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
//!   within the swizzle span) and pixels per column 1..=1024. (The packed
//!   sub-byte types and the 128-byte atom swizzles, with rules of their own, are
//!   not offered.) A [`TensorMapLayout`] is checked by the same code as a map
//!   built directly.
//! - A map never describes memory outside the buffer it was made from: the last
//!   byte the sizes and strides reach lies inside the memory's extent. The map
//!   borrows that memory (`'a`), so safe code cannot free it while the map lives;
//!   [`TensorMap::replace_address`] moves it to other memory with the same check.
//! - The kernel receives the driver's 128 bytes exactly: `&TensorMap` is a
//!   [`KernelArg`](crate::KernelArg) of size 128, so the launch check accepts it
//!   for a 128-byte (`CUtensorMap`, `__grid_constant__`) parameter.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::{
    self as sys, CUdeviceptr, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

use crate::context::CudaContext;
use crate::error::{cu, invalid_arg, MetraleError, Result};
use crate::memory::{DeviceMemory, DeviceRepr};

/// Most dimensions a tensor map has.
pub const TENSOR_MAP_MAX_RANK: usize = 5;

/// The element type of a tensor map, as the driver names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TensorDataType {
    /// `u8`.
    U8,
    /// `u16`.
    U16,
    /// `u32`.
    U32,
    /// `i32`.
    I32,
    /// `u64`.
    U64,
    /// `i64`.
    I64,
    /// IEEE half precision.
    F16,
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// bfloat16.
    Bf16,
    /// `f32`, denormals flushed to zero.
    F32Ftz,
    /// TensorFloat-32 (stored as 4 bytes).
    Tf32,
    /// TensorFloat-32, denormals flushed to zero.
    Tf32Ftz,
}

impl TensorDataType {
    /// Bytes of one element.
    pub const fn size(self) -> usize {
        match self {
            TensorDataType::U8 => 1,
            TensorDataType::U16 | TensorDataType::F16 | TensorDataType::Bf16 => 2,
            TensorDataType::U32
            | TensorDataType::I32
            | TensorDataType::F32
            | TensorDataType::F32Ftz
            | TensorDataType::Tf32
            | TensorDataType::Tf32Ftz => 4,
            TensorDataType::U64 | TensorDataType::I64 | TensorDataType::F64 => 8,
        }
    }

    /// Whether it is a floating-point type (NaN fill is allowed).
    pub const fn is_float(self) -> bool {
        !matches!(
            self,
            TensorDataType::U8
                | TensorDataType::U16
                | TensorDataType::U32
                | TensorDataType::I32
                | TensorDataType::U64
                | TensorDataType::I64
        )
    }

    /// The driver's value.
    pub const fn to_driver(self) -> CUtensorMapDataType {
        CUtensorMapDataType(match self {
            TensorDataType::U8 => 0,
            TensorDataType::U16 => 1,
            TensorDataType::U32 => 2,
            TensorDataType::I32 => 3,
            TensorDataType::U64 => 4,
            TensorDataType::I64 => 5,
            TensorDataType::F16 => 6,
            TensorDataType::F32 => 7,
            TensorDataType::F64 => 8,
            TensorDataType::Bf16 => 9,
            TensorDataType::F32Ftz => 10,
            TensorDataType::Tf32 => 11,
            TensorDataType::Tf32Ftz => 12,
        })
    }
}

/// A Rust element type with a tensor-map data type of the same size.
///
/// # Safety
/// `size_of::<Self>()` must equal `DATA_TYPE.size()` and the type's bytes must be
/// laid out as the driver's type (the TMA copies them unchanged).
pub unsafe trait TensorElement: DeviceRepr {
    /// The data type a map of this element gets by default.
    const DATA_TYPE: TensorDataType;
}

macro_rules! tensor_element {
    ($($t:ty => $d:ident),* $(,)?) => { $(
        // SAFETY: a primitive of exactly the driver type's size and layout.
        unsafe impl TensorElement for $t {
            const DATA_TYPE: TensorDataType = TensorDataType::$d;
        }
    )* };
}
tensor_element!(u8 => U8, u16 => U16, u32 => U32, i32 => I32, u64 => U64, i64 => I64,
    f32 => F32, f64 => F64);
#[cfg(feature = "half")]
tensor_element!(half::f16 => F16, half::bf16 => Bf16);

/// How the TMA interleaves elements of the inner dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Interleave {
    /// No interleave (the usual layout).
    #[default]
    None,
    /// 16-byte interleave (NC/8HWC8 style).
    B16,
    /// 32-byte interleave (NC/16HWC16 style).
    B32,
}

/// How shared memory rows are swizzled to avoid bank conflicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Swizzle {
    /// No swizzle.
    #[default]
    None,
    /// 32-byte span.
    B32,
    /// 64-byte span.
    B64,
    /// 128-byte span.
    B128,
}

impl Swizzle {
    /// The span in bytes (`None`: no limit).
    pub const fn span(self) -> Option<u64> {
        match self {
            Swizzle::None => None,
            Swizzle::B32 => Some(32),
            Swizzle::B64 => Some(64),
            Swizzle::B128 => Some(128),
        }
    }
}

/// How much of L2 a TMA load may promote into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum L2Promotion {
    /// No promotion.
    #[default]
    None,
    /// 64 bytes.
    B64,
    /// 128 bytes.
    B128,
    /// 256 bytes.
    B256,
}

/// What a load reads outside the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum OobFill {
    /// Zeros.
    #[default]
    Zero,
    /// NaN, with "request zero FMA" (floating-point types only).
    NanRequestZeroFma,
}

/// Up to five values, kept inline (no allocation).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Dims<V: Copy> {
    v: [V; TENSOR_MAP_MAX_RANK],
    len: u8,
}

impl<V: Copy + Default> Dims<V> {
    #[inline]
    fn new(values: &[V]) -> Option<Dims<V>> {
        let mut v = [V::default(); TENSOR_MAP_MAX_RANK];
        v.get_mut(..values.len())?.copy_from_slice(values);
        Some(Dims {
            len: values.len() as u8,
            v,
        })
    }
    #[inline]
    fn len(&self) -> usize {
        usize::from(self.len)
    }
    #[inline]
    fn get(&self) -> &[V] {
        self.v.get(..self.len()).unwrap_or(&[])
    }
}

impl<V: Copy + fmt::Debug> fmt::Debug for Dims<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.v.iter().take(usize::from(self.len)))
            .finish()
    }
}

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
    ctx: &'a Arc<CudaContext>,
    base: CUdeviceptr,
    bytes: u64,
    data_type: TensorDataType,
    dims: Option<Dims<u64>>,
    strides: Option<Dims<u64>>,
    box_dims: Option<Dims<u32>>,
    element_strides: Option<Dims<u32>>,
    interleave: Interleave,
    swizzle: Swizzle,
    l2_promotion: L2Promotion,
    oob_fill: OobFill,
    /// A list longer than five, remembered for `encode` to refuse.
    too_long: Option<(&'static str, usize)>,
    /// Set by [`TensorMapBuilder::im2col`]: an im2col map instead of a tiled one.
    im2col: Option<Im2col>,
    _mem: PhantomData<&'a T>,
}

/// The im2col part of a map: the pixel bounding box (corners of the spatial
/// dimensions, rank - 2 of each) and what one load gathers.
#[derive(Debug, Clone, Copy)]
struct Im2col {
    lower: Dims<i32>,
    upper: Dims<i32>,
    channels_per_pixel: u32,
    pixels_per_column: u32,
}

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
    raw: sys::CUtensorMap,
    base: CUdeviceptr,
    /// Bytes from the first element to one past the last the map reaches.
    extent: u64,
    /// The memory's context, borrowed with the memory (no reference count to
    /// touch per map).
    ctx: &'a Arc<CudaContext>,
    data_type: TensorDataType,
    interleave: Interleave,
    _mem: PhantomData<&'a T>,
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

/// The layout of a tensor map (sizes, strides, box, element strides, data type,
/// interleave, swizzle, L2 promotion, fill, im2col corners), checked against
/// every documented rule once by [`TensorMapBuilder::layout`], then encoded over
/// any memory it fits by [`TensorMapLayout::encode`]: one map per buffer of the
/// same shape (per layer, per batch slot) pays only the checks that depend on the
/// memory (its device's context, the address alignment and the extent).
#[derive(Clone, Copy)]
pub struct TensorMapLayout<T: TensorElement> {
    data_type: TensorDataType,
    rank: u32,
    dims: Dims<u64>,
    strides: Dims<u64>,
    box_dims: [u32; TENSOR_MAP_MAX_RANK],
    element_strides: [u32; TENSOR_MAP_MAX_RANK],
    interleave: Interleave,
    swizzle: Swizzle,
    l2_promotion: L2Promotion,
    oob_fill: OobFill,
    im2col: Option<Im2col>,
    /// Bytes from the first element to one past the last the map reaches.
    extent: u64,
    _t: PhantomData<fn() -> T>,
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
        check_address(base, self.interleave)?;
        if self.extent > bytes {
            return Err(self.too_small(bytes));
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
    fn encode_at<'a>(
        &self,
        ctx: &'a Arc<CudaContext>,
        base: CUdeviceptr,
    ) -> Result<TensorMap<'a, T>> {
        // Encoded into a local and moved into the map (measured: fewer instructions
        // than encoding inside the returned value, whose address then escapes).
        let mut raw_map = sys::CUtensorMap { opaque: [0; 16] };
        let raw = &mut raw_map;
        let encoded = ctx.call_unbound(
            // Encoding is host work on the caller's arrays: no context is bound.
            || format!("tensor map at {base:#x}"),
            |d| {
                if let Some(i) = &self.im2col {
                    // SAFETY: as below; the corner arrays hold rank - 2 values
                    // (checked).
                    return unsafe {
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
                    };
                }
                // SAFETY: `raw` is a writable, 128-aligned CUtensorMap; each array
                // holds at least `rank` values (checked when the layout was made);
                // the caller checked the address and the extent against the
                // memory, which the map's lifetime keeps alive.
                unsafe {
                    cu!(
                        d,
                        cuTensorMapEncodeTiled(
                            raw,
                            self.data_type.to_driver(),
                            self.rank,
                            base as *mut c_void,
                            self.dims.v.as_ptr(),
                            self.strides.v.as_ptr(),
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
        );
        encoded?;
        Ok(TensorMap {
            raw: raw_map,
            base,
            extent: self.extent,
            ctx,
            data_type: self.data_type,
            interleave: self.interleave,
            _mem: PhantomData,
        })
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
            _mem: PhantomData,
        }
    }

    /// The driver's 128 bytes.
    pub fn as_raw(&self) -> &sys::CUtensorMap {
        &self.raw
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
    #[inline]
    pub fn replace_address<'b, M: DeviceMemory<T>>(self, mem: &'b M) -> Result<TensorMap<'b, T>> {
        let (raw, base) = self.moved_to(mem)?;
        Ok(TensorMap {
            raw,
            base,
            extent: self.extent,
            ctx: mem.memory_context(),
            data_type: self.data_type,
            interleave: self.interleave,
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
        let (raw, base) = self.moved_to(mem)?;
        self.raw = raw;
        self.base = base;
        Ok(())
    }

    /// The map's bytes pointed at `mem`, after the checks; `self` is unchanged.
    #[inline]
    fn moved_to<M: DeviceMemory<T>>(&self, mem: &M) -> Result<(sys::CUtensorMap, CUdeviceptr)> {
        let ctx = mem.memory_context();
        if !Arc::ptr_eq(ctx, self.ctx) {
            return Err(refuse(format_args!(
                "a map of device {}: replace_address with memory of device {}",
                self.ctx.ordinal(),
                ctx.ordinal()
            )));
        }
        let base = mem.device_ptr();
        let bytes = (mem.len() as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        check_address(base, self.interleave)?;
        if self.extent > bytes {
            return Err(refuse(format_args!(
                "the map reaches {} bytes, beyond the {bytes} bytes of the memory",
                self.extent
            )));
        }
        let mut raw = self.raw;
        ctx.call_unbound(
            // Encoding is host work on the caller's arrays: no context is bound.
            || format!("tensor map at {base:#x}"),
            |d| {
                // SAFETY: `raw` is a copy of a map the driver encoded, in a local
                // of the 128-byte aligned CUtensorMap type; the new address was
                // checked above against the map's alignment and extent, and the
                // caller ties that memory's borrow to the map it builds.
                unsafe { cu!(d, cuTensorMapReplaceAddress(&mut raw, base as *mut c_void)) }
            },
        )?;
        Ok((raw, base))
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
fn refuse(text: fmt::Arguments<'_>) -> MetraleError {
    invalid_arg(format!("tensor map: {text}"))
}

#[inline]
fn check_address(base: CUdeviceptr, interleave: Interleave) -> Result<()> {
    let align = if interleave == Interleave::B32 {
        32
    } else {
        16
    };
    if !base.is_multiple_of(align) {
        return Err(refuse(format_args!(
            "the global address must be aligned to {align} bytes{}: {base:#x} is not",
            if align == 32 {
                " (32-byte interleave)"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

#[inline]
fn check_extent(extent: u64, bytes: u64, dims: &Dims<u64>, strides: &Dims<u64>) -> Result<()> {
    if extent > bytes {
        return Err(refuse(format_args!(
            "sizes {dims:?} with byte strides {strides:?} reach {extent} bytes, \
             beyond the {bytes} bytes of the memory"
        )));
    }
    Ok(())
}

impl<'a, T: TensorElement> TensorMapBuilder<'a, T> {
    #[inline]
    fn list<V: Copy + Default>(&mut self, what: &'static str, v: &[V]) -> Option<Dims<V>> {
        let d = Dims::new(v);
        if d.is_none() {
            self.too_long = Some((what, v.len()));
        }
        d
    }

    /// Elements of each dimension, innermost first (the rank is their count).
    #[inline]
    pub fn dims(mut self, dims: &[u64]) -> Self {
        self.dims = self.list("sizes", dims);
        self
    }

    /// Byte strides of dimensions 1.. (one fewer than the rank). Default: packed.
    #[inline]
    pub fn strides(mut self, strides: &[u64]) -> Self {
        self.strides = self.list("strides", strides);
        self
    }

    /// Elements of the box (the tile one copy moves) in each dimension. Default:
    /// each dimension's size, capped at 256.
    #[inline]
    pub fn box_dims(mut self, box_dims: &[u32]) -> Self {
        self.box_dims = self.list("box sizes", box_dims);
        self
    }

    /// Step between elements read in each dimension. Default: 1.
    #[inline]
    pub fn element_strides(mut self, element_strides: &[u32]) -> Self {
        self.element_strides = self.list("element strides", element_strides);
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
        let (l, u) = (
            self.list("lower corners", lower),
            self.list("upper corners", upper),
        );
        if let (Some(lower), Some(upper)) = (l, u) {
            self.im2col = Some(Im2col {
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
        self.data_type = data_type;
        self
    }

    /// The interleave layout.
    #[inline]
    pub fn interleave(mut self, interleave: Interleave) -> Self {
        self.interleave = interleave;
        self
    }

    /// The shared-memory swizzle.
    #[inline]
    pub fn swizzle(mut self, swizzle: Swizzle) -> Self {
        self.swizzle = swizzle;
        self
    }

    /// The L2 promotion.
    #[inline]
    pub fn l2_promotion(mut self, l2_promotion: L2Promotion) -> Self {
        self.l2_promotion = l2_promotion;
        self
    }

    /// What loads outside the tensor read.
    #[inline]
    pub fn oob_fill(mut self, oob_fill: OobFill) -> Self {
        self.oob_fill = oob_fill;
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
        let layout = self.check()?;
        layout.encode_at(self.ctx, self.base)
    }

    /// Check every rule, against this builder's memory too, and keep the layout
    /// for [`TensorMapLayout::encode`] over other memory of the same shape.
    ///
    /// # Errors
    /// As [`TensorMapBuilder::encode`], before the driver.
    pub fn layout(self) -> Result<TensorMapLayout<T>> {
        self.check()
    }

    /// Every documented rule, in the order the driver lists them. Inlined into
    /// `encode`, with the refusals' texts built out of line.
    #[inline(always)]
    fn check(&self) -> Result<TensorMapLayout<T>> {
        let fail = |text: fmt::Arguments<'_>| Err(refuse(text));
        if let Some((what, n)) = self.too_long {
            return fail(format_args!(
                "{n} {what} given; a tensor map has at most {TENSOR_MAP_MAX_RANK} dimensions"
            ));
        }
        let esize = self.data_type.size() as u64;
        if esize != std::mem::size_of::<T>() as u64 {
            return fail(format_args!(
                "data type {:?} has {esize}-byte elements, the memory's have {}",
                self.data_type,
                std::mem::size_of::<T>()
            ));
        }
        let dims = match self.dims {
            Some(d) => d,
            None => Dims::new(&[self.bytes / esize]).unwrap_or(Dims {
                len: 1,
                v: [0; TENSOR_MAP_MAX_RANK],
            }),
        };
        let rank = dims.len();
        if rank == 0 {
            return fail(format_args!("the rank must be 1..=5: no sizes given"));
        }
        if self.im2col.is_some() && rank < 3 {
            return fail(format_args!(
                "an im2col map needs rank 3, 4 or 5: rank {rank}"
            ));
        }
        let interleaved = self.interleave != Interleave::None;
        if interleaved && rank < 3 {
            return fail(format_args!(
                "an interleaved map needs rank 3 or more: rank {rank} with interleave {:?}",
                self.interleave
            ));
        }
        check_address(self.base, self.interleave)?;
        for (i, &d) in dims.get().iter().enumerate() {
            if d == 0 || d > 1 << 32 {
                return fail(format_args!("size {i} must be in 1..=2^32: {d}"));
            }
        }
        let strides = match self.strides {
            Some(s) => {
                if s.len() + 1 != rank {
                    return fail(format_args!(
                        "{} strides given for rank {rank}: give rank - 1 = {} byte strides \
                         (of dimensions 1..)",
                        s.len(),
                        rank - 1
                    ));
                }
                s
            }
            None => {
                let mut v = [0u64; TENSOR_MAP_MAX_RANK];
                let mut s = esize;
                for (slot, &d) in v.iter_mut().zip(dims.get()).take(rank - 1) {
                    s = s.saturating_mul(d);
                    *slot = s;
                }
                Dims {
                    len: (rank - 1) as u8,
                    v,
                }
            }
        };
        let stride_align = if self.interleave == Interleave::B32 {
            32
        } else {
            16
        };
        for (i, &s) in strides.get().iter().enumerate() {
            if !s.is_multiple_of(stride_align) {
                return fail(format_args!(
                    "the byte stride of dimension {} must be a multiple of {stride_align}{}: {s}",
                    i + 1,
                    if stride_align == 32 {
                        " (32-byte interleave)"
                    } else {
                        ""
                    }
                ));
            }
            if s >= 1 << 40 {
                return fail(format_args!(
                    "the byte stride of dimension {} must be below 2^40: {s}",
                    i + 1
                ));
            }
        }
        // The last byte reached: every index at its largest.
        let mut extent = u128::from(dims.v[0]) * u128::from(esize);
        for (&d, &s) in dims.get().iter().skip(1).zip(strides.get()) {
            // Sizes are at least 1 (checked above).
            extent += u128::from(d.saturating_sub(1)) * u128::from(s);
        }
        let extent = u64::try_from(extent).unwrap_or(u64::MAX);
        check_extent(extent, self.bytes, &dims, &strides)?;

        if let Some(i) = &self.im2col {
            check_im2col(
                i,
                rank,
                esize,
                interleaved,
                self.swizzle,
                self.box_dims.is_some(),
            )?;
        }
        let box_dims = match self.box_dims {
            _ if self.im2col.is_some() => Dims {
                len: rank as u8,
                v: [1; TENSOR_MAP_MAX_RANK],
            },
            Some(b) if b.len() != rank => {
                return fail(format_args!("{} box sizes given for rank {rank}", b.len()));
            }
            Some(b) => b,
            None => {
                let mut v = [0u32; TENSOR_MAP_MAX_RANK];
                for (slot, &d) in v.iter_mut().zip(dims.get()) {
                    // At most 256: fits.
                    *slot = d.min(256) as u32;
                }
                Dims { len: rank as u8, v }
            }
        };
        for (i, &b) in box_dims.get().iter().enumerate() {
            if b == 0 || b > 256 {
                return fail(format_args!("box size {i} must be in 1..=256: {b}"));
            }
        }
        let inner = u64::from(box_dims.v[0]) * esize;
        if !interleaved && self.im2col.is_none() {
            if !inner.is_multiple_of(16) {
                return fail(format_args!(
                    "without interleave the inner box row (box size 0 x element size = {} x \
                     {esize} = {inner} bytes) must be a multiple of 16 bytes",
                    box_dims.v[0]
                ));
            }
            if let Some(span) = self.swizzle.span() {
                if inner > span {
                    return fail(format_args!(
                        "the inner box row ({inner} bytes) must fit the swizzle span of \
                         {span} bytes ({:?})",
                        self.swizzle
                    ));
                }
            }
        }
        let element_strides = match self.element_strides {
            Some(e) if e.len() != rank => {
                return fail(format_args!(
                    "{} element strides given for rank {rank}",
                    e.len()
                ));
            }
            Some(e) => e,
            None => Dims {
                len: rank as u8,
                v: [1; TENSOR_MAP_MAX_RANK],
            },
        };
        for (i, &e) in element_strides.get().iter().enumerate() {
            if e == 0 || e > 8 {
                return fail(format_args!("element stride {i} must be in 1..=8: {e}"));
            }
        }
        if self.interleave == Interleave::B32 && self.swizzle != Swizzle::B32 {
            return fail(format_args!(
                "32-byte interleave needs the 32-byte swizzle (Swizzle::B32): swizzle {:?}",
                self.swizzle
            ));
        }
        if self.oob_fill == OobFill::NanRequestZeroFma && !self.data_type.is_float() {
            return fail(format_args!(
                "NaN out-of-bounds fill needs a floating-point type, not {:?}",
                self.data_type
            ));
        }
        Ok(TensorMapLayout {
            data_type: self.data_type,
            rank: rank as u32,
            dims,
            strides,
            box_dims: box_dims.v,
            element_strides: element_strides.v,
            interleave: self.interleave,
            swizzle: self.swizzle,
            l2_promotion: self.l2_promotion,
            oob_fill: self.oob_fill,
            im2col: self.im2col,
            extent,
            _t: PhantomData,
        })
    }
}

/// The im2col rules: corners (rank - 2 of each) within the range the rank
/// allows, channels 1..=256 (their row a multiple of 16 bytes without interleave,
/// within the swizzle span), pixels 1..=1024, no box sizes.
fn check_im2col(
    i: &Im2col,
    rank: usize,
    esize: u64,
    interleaved: bool,
    swizzle: Swizzle,
    has_box: bool,
) -> Result<()> {
    let fail = |text: fmt::Arguments<'_>| Err(refuse(text));
    if has_box {
        return fail(format_args!(
            "box sizes do not apply to an im2col map (it gathers pixels)"
        ));
    }
    let spatial = rank - 2;
    for (what, c) in [("lower", &i.lower), ("upper", &i.upper)] {
        if c.len() != spatial {
            return fail(format_args!(
                "{} {what} corners given for rank {rank}: give rank - 2 = {spatial}",
                c.len()
            ));
        }
    }
    // The corner fields are 16, 8 or 5 bits wide as the rank grows.
    let bits = match rank {
        3 => 16,
        4 => 8,
        _ => 5,
    };
    let (min, max) = (-(1i32 << (bits - 1)), (1i32 << (bits - 1)) - 1);
    for (what, c) in [("lower", &i.lower), ("upper", &i.upper)] {
        for (k, &v) in c.get().iter().enumerate() {
            if v < min || v > max {
                return fail(format_args!(
                    "{what} corner {k} must be in {min}..={max} for rank {rank}: {v}"
                ));
            }
        }
    }
    let c = i.channels_per_pixel;
    if c == 0 || c > 256 {
        return fail(format_args!("channels per pixel must be in 1..=256: {c}"));
    }
    let p = i.pixels_per_column;
    if p == 0 || p > 1024 {
        return fail(format_args!("pixels per column must be in 1..=1024: {p}"));
    }
    let row = u64::from(c) * esize;
    if !interleaved {
        if !row.is_multiple_of(16) {
            return fail(format_args!(
                "without interleave a pixel's channels ({c} x {esize} = {row} bytes) must be \
                 a multiple of 16 bytes"
            ));
        }
        if let Some(span) = swizzle.span() {
            if row > span {
                return fail(format_args!(
                    "a pixel's channels ({row} bytes) must fit the swizzle span of {span} \
                     bytes ({swizzle:?})"
                ));
            }
        }
    }
    Ok(())
}

fn interleave_raw(i: Interleave) -> CUtensorMapInterleave {
    CUtensorMapInterleave(match i {
        Interleave::None => 0,
        Interleave::B16 => 1,
        Interleave::B32 => 2,
    })
}

fn swizzle_raw(s: Swizzle) -> CUtensorMapSwizzle {
    CUtensorMapSwizzle(match s {
        Swizzle::None => 0,
        Swizzle::B32 => 1,
        Swizzle::B64 => 2,
        Swizzle::B128 => 3,
    })
}

fn l2_raw(l: L2Promotion) -> CUtensorMapL2promotion {
    CUtensorMapL2promotion(match l {
        L2Promotion::None => 0,
        L2Promotion::B64 => 1,
        L2Promotion::B128 => 2,
        L2Promotion::B256 => 3,
    })
}

fn oob_raw(o: OobFill) -> CUtensorMapFloatOOBfill {
    CUtensorMapFloatOOBfill(match o {
        OobFill::Zero => 0,
        OobFill::NanRequestZeroFma => 1,
    })
}
