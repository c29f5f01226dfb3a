//! The vocabulary of a tensor map: element types ([`TensorDataType`],
//! [`TensorElement`]), interleaves, swizzles, L2 promotion and fill modes, their
//! driver values, and the inline lists (`Dims`) the other files keep sizes in.

use std::fmt;

use metrale_cuda_sys::{
    CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapIm2ColWideMode, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

use crate::memory::DeviceRepr;

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
    /// `16U4_ALIGN8B`: groups of sixteen 4-bit values packed in 8 bytes, no gaps
    /// (compute capability 10.0+, CUDA 12.8+). Over `u8` memory; sizes count
    /// values.
    U4x16Align8,
    /// `16U4_ALIGN16B`: groups of sixteen 4-bit values, 8 bytes of values then an
    /// 8-byte gap (compute capability 10.0+, CUDA 12.8+; loads only). Over `u8`
    /// memory; sizes count values.
    U4x16Align16,
    /// `16U6_ALIGN16B`: groups of sixteen 6-bit values, 12 bytes of values then
    /// a 4-byte gap (compute capability 10.0+, CUDA 12.8+). Over `u8` memory;
    /// sizes count values.
    U6x16Align16,
}

impl TensorDataType {
    /// Bytes of one element; for the packed types, of the memory's element they
    /// are read over (`u8`: 1).
    pub const fn size(self) -> usize {
        match self {
            TensorDataType::U8
            | TensorDataType::U4x16Align8
            | TensorDataType::U4x16Align16
            | TensorDataType::U6x16Align16 => 1,
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

    /// Bits of memory one value takes, gaps included: 4 for `U4x16Align8`, 8 for
    /// `U4x16Align16` and `U6x16Align16` (sixteen values in 16 bytes), else eight
    /// times [`size`](TensorDataType::size).
    pub const fn bits(self) -> u64 {
        match self {
            TensorDataType::U4x16Align8 => 4,
            _ => 8 * self.size() as u64,
        }
    }

    /// Whether it is one of the packed sub-byte types (compute capability 10.0+).
    pub const fn is_packed(self) -> bool {
        matches!(
            self,
            TensorDataType::U4x16Align8
                | TensorDataType::U4x16Align16
                | TensorDataType::U6x16Align16
        )
    }

    /// Whether it is a packed type of 16-byte groups (`U4x16Align16`,
    /// `U6x16Align16`), with rules of their own: a 32-byte aligned address and
    /// strides, sizes 0 a multiple of 128, a box (or pixel) row of 128 values.
    pub const fn is_packed_16(self) -> bool {
        matches!(
            self,
            TensorDataType::U4x16Align16 | TensorDataType::U6x16Align16
        )
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
                | TensorDataType::U4x16Align8
                | TensorDataType::U4x16Align16
                | TensorDataType::U6x16Align16
        )
    }

    /// The driver's name for it, as refusals say it.
    pub(super) const fn driver_name(self) -> &'static str {
        match self {
            TensorDataType::U4x16Align8 => "16U4_ALIGN8B",
            TensorDataType::U4x16Align16 => "16U4_ALIGN16B",
            TensorDataType::U6x16Align16 => "16U6_ALIGN16B",
            _ => "",
        }
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
            TensorDataType::U4x16Align8 => 13,
            TensorDataType::U4x16Align16 => 14,
            TensorDataType::U6x16Align16 => 15,
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
    /// `128B_ATOM_32B`: 32-byte chunks within a 128-byte span (compute
    /// capability 10.0+, CUDA 12.8+).
    B128Atom32,
    /// `128B_ATOM_32B_FLIP_8B`: as `B128Atom32`, the two 8-byte halves of each
    /// 16 bytes exchanged on alternate rows (compute capability 10.0+, CUDA 12.8+).
    B128Atom32Flip8,
    /// `128B_ATOM_64B`: 64-byte chunks within a 128-byte span (compute
    /// capability 10.0+, CUDA 12.8+).
    B128Atom64,
}

impl Swizzle {
    /// The span in bytes (`None`: no limit).
    pub const fn span(self) -> Option<u64> {
        match self {
            Swizzle::None => None,
            Swizzle::B32 => Some(32),
            Swizzle::B64 => Some(64),
            Swizzle::B128
            | Swizzle::B128Atom32
            | Swizzle::B128Atom32Flip8
            | Swizzle::B128Atom64 => Some(128),
        }
    }

    /// Whether it is one of the 128-byte atom swizzles (compute capability 10.0+).
    pub const fn is_atom(self) -> bool {
        matches!(
            self,
            Swizzle::B128Atom32 | Swizzle::B128Atom32Flip8 | Swizzle::B128Atom64
        )
    }
}

/// How a wide im2col map ([`TensorMapBuilder::im2col_wide`](super::TensorMapBuilder::im2col_wide))
/// loads along W.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Im2colWideMode {
    /// `W`: pixels per column says how many elements a load reads along W.
    #[default]
    W,
    /// `W128`: 128 elements along W (pixels per column is ignored).
    W128,
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
pub(super) struct Dims<V: Copy> {
    pub(super) v: [V; TENSOR_MAP_MAX_RANK],
    pub(super) len: u8,
}

impl<V: Copy + Default> Dims<V> {
    /// Up to five values; `None` for more. Each length is its own fixed copy
    /// (no call to copy a few words).
    #[inline(always)]
    pub(super) fn new(values: &[V]) -> Option<Dims<V>> {
        let z = V::default();
        let v = match *values {
            [] => [z; TENSOR_MAP_MAX_RANK],
            [a] => [a, z, z, z, z],
            [a, b] => [a, b, z, z, z],
            [a, b, c] => [a, b, c, z, z],
            [a, b, c, d] => [a, b, c, d, z],
            [a, b, c, d, e] => [a, b, c, d, e],
            _ => return None,
        };
        Some(Dims {
            len: values.len() as u8,
            v,
        })
    }

    #[inline]
    pub(super) fn len(&self) -> usize {
        usize::from(self.len)
    }
    #[inline]
    pub(super) fn get(&self) -> &[V] {
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

pub(super) fn interleave_raw(i: Interleave) -> CUtensorMapInterleave {
    CUtensorMapInterleave(match i {
        Interleave::None => 0,
        Interleave::B16 => 1,
        Interleave::B32 => 2,
    })
}

pub(super) fn swizzle_raw(s: Swizzle) -> CUtensorMapSwizzle {
    CUtensorMapSwizzle(match s {
        Swizzle::None => 0,
        Swizzle::B32 => 1,
        Swizzle::B64 => 2,
        Swizzle::B128 => 3,
        Swizzle::B128Atom32 => 4,
        Swizzle::B128Atom32Flip8 => 5,
        Swizzle::B128Atom64 => 6,
    })
}

pub(super) fn l2_raw(l: L2Promotion) -> CUtensorMapL2promotion {
    CUtensorMapL2promotion(match l {
        L2Promotion::None => 0,
        L2Promotion::B64 => 1,
        L2Promotion::B128 => 2,
        L2Promotion::B256 => 3,
    })
}

pub(super) fn wide_raw(m: Im2colWideMode) -> CUtensorMapIm2ColWideMode {
    CUtensorMapIm2ColWideMode(match m {
        Im2colWideMode::W => 0,
        Im2colWideMode::W128 => 1,
    })
}

pub(super) fn oob_raw(o: OobFill) -> CUtensorMapFloatOOBfill {
    CUtensorMapFloatOOBfill(match o {
        OobFill::Zero => 0,
        OobFill::NanRequestZeroFma => 1,
    })
}
