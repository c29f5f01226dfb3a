//! The quick proof of a common tiled map's rules: every rule at once, in one
//! pass over the rank, for a builder whose sizes are given (no im2col, no packed
//! type or atom swizzle, no list too long). Anything else, and any spec that
//! fails, goes to the rules one by one (`rules.rs`), which name the refusal. A
//! unit test below compares the two over many specs.

use std::marker::PhantomData;

use super::layout::{TensorMapLayout, Tiled};
use super::spec::Spec;
use super::types::{Dims, Interleave, OobFill, Swizzle, TensorElement, TENSOR_MAP_MAX_RANK};
use crate::error::Result;

/// Where [`Spec::quick`] writes the lists left to default.
#[derive(Default)]
pub(super) struct Scratch {
    strides: [u64; TENSOR_MAP_MAX_RANK],
    box_dims: [u32; TENSOR_MAP_MAX_RANK],
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
            sm100: false,
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
        let (Some(dims), true, None) = (&self.dims, self.too_long.is_none(), self.im2col) else {
            return None;
        };
        if self.data_type.is_packed() || self.swizzle.is_atom() {
            return None;
        }
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
            1 => r.pick(&[
                TensorDataType::U8,
                TensorDataType::U16,
                TensorDataType::U4x16Align8,
                TensorDataType::U4x16Align16,
                TensorDataType::U6x16Align16,
            ]),
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
            swizzle: r.pick(&[
                Swizzle::None,
                Swizzle::B32,
                Swizzle::B64,
                Swizzle::B128,
                Swizzle::B128Atom32,
            ]),
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
                (None, Ok(e)) if s.dims.is_some() && !s.needs_sm100() => {
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
                fast > 150,
                "too few specs pass to compare: {fast} of {each}"
            );
        }
    }
}
