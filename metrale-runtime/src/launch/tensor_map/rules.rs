//! The rules a map is checked against before the driver sees it: every rule the
//! driver documents for the types, interleaves and swizzles offered, in the order
//! the driver lists them. A builder's `encode` and `layout` both run them, so a
//! [`TensorMapLayout`](super::TensorMapLayout) is checked by the same code as a map
//! built directly.

use std::fmt;
use std::marker::PhantomData;

use super::builder::{Im2col, Spec};
use super::layout::Tiled;
use super::types::{Dims, Interleave, OobFill, Swizzle, TensorElement, TENSOR_MAP_MAX_RANK};
use super::{check_address, refuse, TensorMapLayout};

/// Where [`Spec::quick`] writes the lists left to default.
#[derive(Default)]
pub(super) struct Scratch {
    strides: [u64; TENSOR_MAP_MAX_RANK],
    box_dims: [u32; TENSOR_MAP_MAX_RANK],
}
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
    /// Every documented rule: the quick proof for a common tiled map when it
    /// passes, else every rule one by one (which gives the refusal its text).
    #[inline(always)]
    pub(super) fn check<T: TensorElement>(&self) -> Result<TensorMapLayout<T>> {
        match self.check_fast::<T>() {
            Some(layout) => Ok(layout),
            None => self.check_each::<T>(),
        }
    }

    /// [`Spec::quick`] as a layout (what [`TensorMapBuilder::layout`] keeps).
    #[inline(always)]
    pub(super) fn check_fast<T: TensorElement>(&self) -> Option<TensorMapLayout<T>> {
        let mut scratch = Scratch::default();
        let q = self.quick::<T>(&mut scratch)?;
        let strides = Dims {
            v: *q.strides,
            len: q.rank.saturating_sub(1) as u8,
        };
        Some(TensorMapLayout {
            data_type: q.data_type,
            rank: q.rank,
            dims: Dims {
                v: *q.dims,
                len: q.rank as u8,
            },
            strides,
            box_dims: *q.box_dims,
            element_strides: *q.element_strides,
            interleave: q.interleave,
            swizzle: q.swizzle,
            l2_promotion: q.l2_promotion,
            oob_fill: q.oob_fill,
            im2col: None,
            extent: q.extent,
            _t: PhantomData,
        })
    }

    /// The rules of a tiled map with its sizes given, all at once and without a
    /// branch per value: every value of every list is compared (the slots past
    /// the rank hold values that pass, or are masked), the failures are or-ed
    /// together, and any failure, or any case this does not cover (im2col, sizes
    /// left to default, a list too long), answers `None` for
    /// [`Spec::check_each`] to decide and name. What it passes is exactly what
    /// `check_each` passes, with the same values (a unit test compares the two
    /// over many specs). The lists given are used where they are; defaults are
    /// written into `scratch`.
    #[inline(always)]
    pub(super) fn quick<'s, T: TensorElement>(
        &'s self,
        scratch: &'s mut Scratch,
    ) -> Option<Tiled<'s>> {
        let (Some(dims), None, None) = (&self.dims, self.too_long, self.im2col) else {
            return None;
        };
        let esize = self.data_type.size() as u64;
        let rank = dims.len();
        let interleaved = self.interleave != Interleave::None;
        let b32 = self.interleave == Interleave::B32;
        let align: u64 = if b32 { 32 } else { 16 };
        let mut bad = esize != std::mem::size_of::<T>() as u64
            || rank == 0
            || (interleaved && rank < 3)
            || self.base & (align - 1) != 0;
        let strides: &[u64; TENSOR_MAP_MAX_RANK] = match &self.strides {
            Some(s) => {
                bad |= s.len() + 1 != rank;
                &s.v
            }
            None => {
                let mut s = esize;
                for (slot, &d) in scratch
                    .strides
                    .iter_mut()
                    .zip(dims.get())
                    .take(rank.saturating_sub(1))
                {
                    s = s.saturating_mul(d);
                    *slot = s;
                }
                &scratch.strides
            }
        };
        let box_dims: &[u32; TENSOR_MAP_MAX_RANK] = match &self.box_dims {
            Some(b) => {
                bad |= b.len() != rank;
                &b.v
            }
            None => {
                for (slot, &d) in scratch.box_dims.iter_mut().zip(dims.get()) {
                    // At most 256: fits.
                    *slot = d.min(256) as u32;
                }
                &scratch.box_dims
            }
        };
        let element_strides: &[u32; TENSOR_MAP_MAX_RANK] = match &self.element_strides {
            Some(e) => {
                bad |= e.len() != rank;
                &e.v
            }
            None => &[1; TENSOR_MAP_MAX_RANK],
        };
        // The values of the rank only (a list of another length already failed).
        // The extent saturates: it is the exact extent capped at u64::MAX, as
        // `check_each` computes it.
        for ((&d, &b), &e) in dims.v.iter().zip(box_dims).zip(element_strides).take(rank) {
            bad |= (d.wrapping_sub(1) >= 1 << 32)
                | (b.wrapping_sub(1) >= 256)
                | (e.wrapping_sub(1) >= 8);
        }
        let mut extent = dims.v[0].saturating_mul(esize);
        for (&s, &d) in strides
            .iter()
            .zip(dims.v.iter().skip(1))
            .take(rank.saturating_sub(1))
        {
            bad |= (s & (align - 1) != 0) | (s >= 1 << 40);
            extent = extent.saturating_add(d.saturating_sub(1).saturating_mul(s));
        }
        bad |= extent > self.bytes;
        let inner = u64::from(box_dims[0]) * esize;
        if !interleaved {
            bad |= inner & 15 != 0;
            bad |= self.swizzle.span().is_some_and(|span| inner > span);
        }
        bad |= b32 && self.swizzle != Swizzle::B32;
        bad |= self.oob_fill == OobFill::NanRequestZeroFma && !self.data_type.is_float();
        if bad {
            return None;
        }
        Some(Tiled {
            data_type: self.data_type,
            rank: rank as u32,
            dims: &dims.v,
            strides,
            box_dims,
            element_strides,
            interleave: self.interleave,
            swizzle: self.swizzle,
            l2_promotion: self.l2_promotion,
            oob_fill: self.oob_fill,
            extent,
        })
    }

    /// Every documented rule one by one, in the order the driver lists them; a
    /// refusal names the first rule broken and its value.
    #[inline(never)]
    pub(super) fn check_each<T: TensorElement>(&self) -> Result<TensorMapLayout<T>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::tensor_map::types::{L2Promotion, TensorDataType};

    /// A small deterministic generator (xorshift64*).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn pick<V: Copy>(&mut self, v: &[V]) -> V {
            v[(self.next() % v.len() as u64) as usize]
        }
    }

    fn same<T: TensorElement>(a: &TensorMapLayout<T>, b: &TensorMapLayout<T>) -> bool {
        a.data_type == b.data_type
            && a.rank == b.rank
            && a.dims == b.dims
            && a.strides == b.strides
            && a.box_dims == b.box_dims
            && a.element_strides == b.element_strides
            && a.interleave == b.interleave
            && a.swizzle == b.swizzle
            && a.l2_promotion == b.l2_promotion
            && a.oob_fill == b.oob_fill
            && a.im2col.is_none() == b.im2col.is_none()
            && a.extent == b.extent
    }

    fn spec(r: &mut Rng, esize: u64) -> Spec {
        let rank = r.pick(&[0usize, 1, 2, 2, 3, 3, 4, 5]);
        let len = |r: &mut Rng, n: usize| {
            match r.next() % 8 {
                0 => n.saturating_sub(1),
                1 => n + 1,
                _ => n,
            }
            .min(TENSOR_MAP_MAX_RANK)
        };
        let dims: Vec<u64> = (0..len(r, rank))
            .map(|_| {
                r.pick(&[
                    0,
                    1,
                    2,
                    3,
                    4,
                    8,
                    16,
                    17,
                    64,
                    255,
                    256,
                    257,
                    1 << 32,
                    (1 << 32) + 1,
                ])
            })
            .collect();
        let strides: Vec<u64> = (0..len(r, rank.saturating_sub(1)))
            .map(|_| {
                r.pick(&[
                    0,
                    8,
                    16,
                    32,
                    48,
                    64,
                    256,
                    4096,
                    1 << 20,
                    (1 << 40) - 32,
                    1 << 40,
                ])
            })
            .collect();
        let boxes: Vec<u32> = (0..len(r, rank))
            .map(|_| r.pick(&[0, 1, 2, 4, 8, 16, 16, 32, 32, 64, 128, 256, 257]))
            .collect();
        let estrides: Vec<u32> = (0..len(r, rank))
            .map(|_| r.pick(&[0, 1, 1, 1, 2, 8, 9]))
            .collect();
        let data_type = match esize {
            1 => r.pick(&[TensorDataType::U8, TensorDataType::U16]),
            2 => r.pick(&[
                TensorDataType::U16,
                TensorDataType::F16,
                TensorDataType::Bf16,
            ]),
            _ => r.pick(&[
                TensorDataType::F32,
                TensorDataType::U32,
                TensorDataType::Tf32,
                TensorDataType::U8,
            ]),
        };
        let opt = |r: &mut Rng| !r.next().is_multiple_of(4);
        Spec {
            base: r.pick(&[
                0x1000_0000,
                0x1000_0000,
                0x1000_0010,
                0x1000_0020,
                0x1000_0008,
            ]),
            bytes: r.pick(&[16, 256, 4096, 1 << 20, 1 << 30, 1 << 45, u64::MAX, u64::MAX]),
            data_type,
            dims: if r.next().is_multiple_of(16) {
                None
            } else {
                Dims::new(&dims)
            },
            strides: if opt(r) { Dims::new(&strides) } else { None },
            box_dims: if opt(r) { Dims::new(&boxes) } else { None },
            element_strides: if opt(r) { Dims::new(&estrides) } else { None },
            interleave: r.pick(&[
                Interleave::None,
                Interleave::None,
                Interleave::B16,
                Interleave::B32,
            ]),
            swizzle: r.pick(&[Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128]),
            l2_promotion: r.pick(&[L2Promotion::None, L2Promotion::B128]),
            oob_fill: r.pick(&[OobFill::Zero, OobFill::NanRequestZeroFma]),
            too_long: None,
            im2col: None,
        }
    }

    fn agree<T: TensorElement>(seed: u64) -> (usize, usize) {
        let mut r = Rng(seed);
        let (mut fast, mut each) = (0, 0);
        for _ in 0..200_000 {
            let s = spec(&mut r, std::mem::size_of::<T>() as u64);
            let f = s.check_fast::<T>();
            let e = s.check_each::<T>();
            match (&f, &e) {
                (Some(f), Ok(e)) => assert!(same(f, e), "{s:?}: {f:?} vs {e:?}"),
                (Some(f), Err(e)) => {
                    panic!("{s:?}: the quick proof passed {f:?}, the rules say {e}")
                }
                (None, Ok(e)) if s.dims.is_some() => {
                    panic!("{s:?}: the rules pass {e:?}, the quick proof does not")
                }
                _ => {}
            }
            fast += usize::from(f.is_some());
            each += usize::from(e.is_ok());
        }
        (fast, each)
    }

    #[test]
    fn the_quick_proof_passes_exactly_what_every_rule_passes() {
        for (fast, each) in [
            agree::<f32>(1),
            agree::<u8>(2),
            agree::<u16>(3),
            agree::<f32>(4),
        ] {
            assert!(
                fast > 500,
                "too few specs pass to compare: {fast} of {each}"
            );
        }
    }
}
