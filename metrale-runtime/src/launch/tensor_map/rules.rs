//! The rules a map is checked against before the driver sees it: every rule the
//! driver documents for the types, interleaves and swizzles offered, in the order
//! the driver lists them. A builder's `encode` and `layout` both run them, so a
//! [`TensorMapLayout`](super::TensorMapLayout) is checked by the same code as a map
//! built directly.

use std::fmt;
use std::marker::PhantomData;

use super::builder::{Im2col, TensorMapBuilder};
use super::types::{Dims, Interleave, OobFill, Swizzle, TensorElement, TENSOR_MAP_MAX_RANK};
use super::{check_address, refuse, TensorMapLayout};
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

impl<T: TensorElement> TensorMapBuilder<'_, T> {
    /// Every documented rule, in the order the driver lists them. Inlined into
    /// `encode`, with the refusals' texts built out of line.
    #[inline(always)]
    pub(super) fn check(&self) -> Result<TensorMapLayout<T>> {
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
