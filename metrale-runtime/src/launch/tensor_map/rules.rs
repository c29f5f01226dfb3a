//! The rules a map is checked against before the driver sees it: every rule the
//! driver documents for the types, interleaves and swizzles offered, in the order
//! the driver lists them. A builder's `encode` and `layout` both run them, so a
//! [`TensorMapLayout`](super::TensorMapLayout) is checked by the same code as a map
//! built directly.

use std::fmt;
use std::marker::PhantomData;

use super::layout::TensorMapLayout;
use super::spec::{address_align, align_reason, check_address, refuse, Im2col, Spec};
use super::types::{
    Dims, Im2colWideMode, Interleave, OobFill, Swizzle, TensorDataType, TensorElement,
    TENSOR_MAP_MAX_RANK,
};

use crate::error::Result;

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

impl Spec {
    /// Every documented rule one by one, in the order the driver lists them; a
    /// refusal names the first rule broken and its value.
    #[inline(never)]
    pub(super) fn check_each<T: TensorElement>(&self) -> Result<TensorMapLayout<T>> {
        let fail = |text: fmt::Arguments<'_>| Err(refuse(text));
        if let Some(t) = &self.too_long {
            return fail(format_args!(
                "{t} given; a tensor map has at most {TENSOR_MAP_MAX_RANK} dimensions"
            ));
        }
        let ty = self.data_type;
        let esize = ty.size() as u64;
        if esize != std::mem::size_of::<T>() as u64 {
            return fail(format_args!(
                "data type {ty:?} has {esize}-byte elements, the memory's have {}",
                std::mem::size_of::<T>()
            ));
        }
        let bits = ty.bits();
        let dims = match self.dims {
            Some(d) => d,
            None => Dims::new(&[self.bytes.saturating_mul(8) / bits]).unwrap_or(Dims {
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
        check_address(
            self.base,
            address_align(self.interleave, ty),
            self.interleave,
            ty,
        )?;
        for (i, &d) in dims.get().iter().enumerate() {
            if d == 0 || d > 1 << 32 {
                return fail(format_args!("size {i} must be in 1..=2^32: {d}"));
            }
        }
        if ty.is_packed() {
            let group = if ty.is_packed_16() { 128 } else { 2 };
            if !dims.v[0].is_multiple_of(group) {
                return fail(format_args!(
                    "size 0 of a {} map (in values) must be a multiple of {group}: {}",
                    ty.driver_name(),
                    dims.v[0]
                ));
            }
        }
        // Bytes of one row of dimension 0 (the packed types: their values' bits).
        let row0 = dims.v[0].saturating_mul(bits).div_ceil(8);
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
                let mut s = row0;
                for (k, (slot, &d)) in v.iter_mut().zip(dims.get()).take(rank - 1).enumerate() {
                    if k > 0 {
                        s = s.saturating_mul(d);
                    }
                    *slot = s;
                }
                Dims {
                    len: (rank - 1) as u8,
                    v,
                }
            }
        };
        let stride_align = address_align(self.interleave, ty);
        for (i, &s) in strides.get().iter().enumerate() {
            if !s.is_multiple_of(stride_align) {
                return fail(format_args!(
                    "the byte stride of dimension {} must be a multiple of {stride_align}{}: {s}",
                    i + 1,
                    align_reason(stride_align, self.interleave, ty)
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
        let mut extent = u128::from(row0);
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
                ty,
                self.interleave,
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
        if self.im2col.is_none() {
            if ty.is_packed_16() && box_dims.v[0] != 128 {
                return fail(format_args!(
                    "box size 0 of a {} map must be 128 (values): {}",
                    ty.driver_name(),
                    box_dims.v[0]
                ));
            }
            if !interleaved {
                check_row(false, box_dims.v[0], ty, self.swizzle)?;
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
        if ty == TensorDataType::U6x16Align16 && interleaved {
            return fail(format_args!(
                "a 16U6_ALIGN16B map needs no interleave: interleave {:?}",
                self.interleave
            ));
        }
        if ty.is_packed_16() && self.im2col.is_none_or(|i| i.wide.is_none()) {
            check_packed_swizzle(ty, self.swizzle, &PACKED_SWIZZLES)?;
        }
        if self.oob_fill == OobFill::NanRequestZeroFma && !ty.is_float() {
            return fail(format_args!(
                "NaN out-of-bounds fill needs a floating-point type, not {ty:?}"
            ));
        }
        Ok(TensorMapLayout {
            data_type: ty,
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
            sm100: self.needs_sm100(),
            _t: PhantomData,
        })
    }

    /// Whether the map uses what only compute capability 10.0+ (and CUDA 12.8+)
    /// has: a packed type, an atom swizzle, a wide im2col map.
    #[inline(always)]
    pub(super) fn needs_sm100(&self) -> bool {
        self.data_type.is_packed()
            || self.swizzle.is_atom()
            || self.im2col.is_some_and(|i| i.wide.is_some())
    }
}

/// The swizzles a packed type of 16-byte groups allows in a tiled or im2col
/// map: none, 128 bytes, 128-byte atoms of 32 bytes, and for 16U6 (stores) of
/// 64 bytes.
const PACKED_SWIZZLES: [Swizzle; 3] = [Swizzle::None, Swizzle::B128, Swizzle::B128Atom32];

fn check_packed_swizzle(ty: TensorDataType, swizzle: Swizzle, allowed: &[Swizzle]) -> Result<()> {
    let also =
        ty == TensorDataType::U6x16Align16 && swizzle == Swizzle::B128Atom64 && allowed.len() == 3;
    if allowed.contains(&swizzle) || also {
        return Ok(());
    }
    let mut list: Vec<String> = allowed.iter().map(|s| format!("{s:?}")).collect();
    if ty == TensorDataType::U6x16Align16 && allowed.len() == 3 {
        list.push("B128Atom64 (stores)".into());
    }
    Err(refuse(format_args!(
        "a {} map allows the swizzles {}: swizzle {swizzle:?}",
        ty.driver_name(),
        list.join(", ")
    )))
}

/// A row of `n` values of `ty` without interleave: a multiple of 16 bytes, and
/// within the swizzle span; `pixel`: a pixel's channels, else the inner box row.
fn check_row(pixel: bool, n: u32, ty: TensorDataType, swizzle: Swizzle) -> Result<()> {
    let bits = u64::from(n) * ty.bits();
    let row = bits.div_ceil(8);
    if !bits.is_multiple_of(128) {
        let esize = if ty == TensorDataType::U4x16Align8 {
            "1/2".to_string()
        } else {
            ty.size().to_string()
        };
        let bytes = bits as f64 / 8.0;
        return Err(if pixel {
            refuse(format_args!(
                "without interleave a pixel's channels ({n} x {esize} = {bytes} bytes) must be \
                 a multiple of 16 bytes"
            ))
        } else {
            refuse(format_args!(
                "without interleave the inner box row (box size 0 x element size = {n} x \
                 {esize} = {bytes} bytes) must be a multiple of 16 bytes"
            ))
        });
    }
    if let Some(span) = swizzle.span() {
        if row > span {
            let what = if pixel {
                "a pixel's channels"
            } else {
                "the inner box row"
            };
            return Err(refuse(format_args!(
                "{what} ({row} bytes) must fit the swizzle span of {span} bytes ({swizzle:?})"
            )));
        }
    }
    Ok(())
}

/// The im2col rules: corners (rank - 2 of each; one of each for a wide map)
/// within the range the rank allows, channels 1..=256 (128 for a packed type of
/// 16-byte groups; their row a multiple of 16 bytes without interleave, within
/// the swizzle span), pixels 1..=1024 (not read by a wide map of mode W128), no
/// box sizes; a wide map takes only the 64-byte, 128-byte and 128-byte atom-32
/// swizzles (a packed type of 16-byte groups the last two).
fn check_im2col(
    i: &Im2col,
    rank: usize,
    ty: TensorDataType,
    interleave: Interleave,
    swizzle: Swizzle,
    has_box: bool,
) -> Result<()> {
    let fail = |text: fmt::Arguments<'_>| Err(refuse(text));
    if has_box {
        return fail(format_args!(
            "box sizes do not apply to an im2col map (it gathers pixels)"
        ));
    }
    let wide = i.wide;
    let (spatial, bits) = match wide {
        // One width offset of each corner, 16 bits wide.
        Some(_) => (1, 16),
        // The corner fields are 16, 8 or 5 bits wide as the rank grows.
        None => (
            rank - 2,
            match rank {
                3 => 16,
                4 => 8,
                _ => 5,
            },
        ),
    };
    for (what, c) in [("lower", &i.lower), ("upper", &i.upper)] {
        if c.len() != spatial {
            return match wide {
                Some(_) => fail(format_args!(
                    "{} {what} corners given for a wide im2col map: give 1 (the width offset)",
                    c.len()
                )),
                None => fail(format_args!(
                    "{} {what} corners given for rank {rank}: give rank - 2 = {spatial}",
                    c.len()
                )),
            };
        }
    }
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
    if ty.is_packed_16() && c != 128 {
        return fail(format_args!(
            "channels per pixel of a {} map must be 128: {c}",
            ty.driver_name()
        ));
    }
    let p = i.pixels_per_column;
    if wide != Some(Im2colWideMode::W128) && (p == 0 || p > 1024) {
        return fail(format_args!("pixels per column must be in 1..=1024: {p}"));
    }
    if interleave == Interleave::None {
        check_row(true, c, ty, swizzle)?;
    }
    if wide.is_some() {
        let allowed: &[Swizzle] = if ty.is_packed_16() {
            &[Swizzle::B128, Swizzle::B128Atom32]
        } else {
            &[Swizzle::B64, Swizzle::B128, Swizzle::B128Atom32]
        };
        if !allowed.contains(&swizzle) {
            let list: Vec<String> = allowed.iter().map(|s| format!("{s:?}")).collect();
            return fail(format_args!(
                "a wide im2col map{} allows the swizzles {}: swizzle {swizzle:?}",
                if ty.is_packed_16() {
                    format!(" of {}", ty.driver_name())
                } else {
                    String::new()
                },
                list.join(", ")
            ));
        }
    }
    Ok(())
}
