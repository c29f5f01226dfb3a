//! Conversions between `f32` and the two FP8 formats of the OCP 8-bit floating
//! point specification (v1.0), as NVIDIA's `__nv_cvt_float_to_fp8` with
//! `__NV_SATFINITE` converts them: round to nearest, ties to even; saturating.
//!
//! | | [`Fp8E4M3`] | [`Fp8E5M2`] |
//! | --- | --- | --- |
//! | exponent, mantissa bits, bias | 4, 3, 7 | 5, 2, 15 |
//! | largest finite | ±448 (`0x7e`) | ±57344 (`0x7b`) |
//! | smallest subnormal | 2⁻⁹ | 2⁻¹⁶ |
//! | infinities | none | `0x7c`, `0xfc` |
//! | NaN | `0x7f`, `0xff` | `0x7d`..=`0x7f`, `0xfd`..=`0xff` |
//!
//! Invariants: `from_f32` is saturating for both formats: a finite value beyond
//! the largest finite, and an infinity, become the largest finite of its sign
//! (E4M3 has no infinity to give; for E5M2 this is OCP's saturating mode, chosen
//! so that both formats behave alike and no infinity reaches a GEMM; an E5M2
//! infinity is still decoded as one). A NaN stays a NaN, with its sign
//! (`0x7f`/`0xff` for both). Every other value rounds to the nearest FP8 value,
//! ties to the even one (subnormals included; below half the smallest
//! subnormal it is a zero of its sign). `to_f32` is exact.

use super::{Fp8E4M3, Fp8E5M2};
use crate::error::{invalid_arg, Result};

/// One FP8 format's constants.
struct Format {
    man_bits: u32,
    bias: i32,
    /// The code of the largest finite magnitude.
    max_code: u8,
    /// The code of a NaN (without the sign).
    nan_code: u8,
    /// Whether exponent field all-ones with mantissa 0 is infinity (E5M2).
    ieee_special: bool,
}

const E4M3: Format = Format {
    man_bits: 3,
    bias: 7,
    max_code: 0x7e,
    nan_code: 0x7f,
    ieee_special: false,
};

const E5M2: Format = Format {
    man_bits: 2,
    bias: 15,
    max_code: 0x7b,
    nan_code: 0x7f,
    ieee_special: true,
};

/// `2^k` as an `f64` (exact for the exponents used here).
fn pow2(k: i32) -> f64 {
    f64::from_bits(((1023 + k) as u64) << 52)
}

impl Format {
    fn encode(&self, x: f32) -> u8 {
        let sign = ((x.to_bits() >> 24) & 0x80) as u8;
        if x.is_nan() {
            return sign | self.nan_code;
        }
        let a = f64::from(x.abs());
        if a == 0.0 {
            return sign;
        }
        let max = self.decode_magnitude(self.max_code);
        if a >= max {
            return sign | self.max_code;
        }
        // The binade of `a`, at least the smallest normal one (below it, the
        // subnormals share its quantum).
        let e = (((a.to_bits() >> 52) & 0x7ff) as i32 - 1023).max(1 - self.bias);
        let quantum = pow2(e - self.man_bits as i32);
        // Exact: `a` scaled by a power of two, then rounded to an integer of at
        // most `man_bits + 1` bits (2^(man_bits+1) when it carries to the next
        // binade, which the code's arithmetic below absorbs).
        let r = (a / quantum).round_ties_even() as i32;
        let code = ((e + self.bias) << self.man_bits) + r - (1 << self.man_bits);
        sign | (code.min(i32::from(self.max_code)) as u8)
    }

    /// The value of a code without its sign bit, which is not NaN.
    fn decode_magnitude(&self, code: u8) -> f64 {
        let exp = i32::from(code >> self.man_bits);
        let man = i32::from(code & ((1 << self.man_bits) - 1));
        if exp == 0 {
            f64::from(man) * pow2(1 - self.bias - self.man_bits as i32)
        } else {
            f64::from((1 << self.man_bits) + man) * pow2(exp - self.bias - self.man_bits as i32)
        }
    }

    fn decode(&self, code: u8) -> f32 {
        let magnitude = code & 0x7f;
        let negative = code & 0x80 != 0;
        let all_ones = 0x7f >> self.man_bits;
        let value = if self.ieee_special && magnitude >> self.man_bits == all_ones {
            if magnitude & ((1 << self.man_bits) - 1) == 0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        } else if !self.ieee_special && magnitude == self.nan_code {
            f32::NAN
        } else {
            // Exact: at most 4 significant bits, well inside f32's range.
            self.decode_magnitude(magnitude) as f32
        };
        if negative {
            -value
        } else {
            value
        }
    }
}

/// Refuses slices of different lengths, naming both.
fn same_len(call: &str, src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(invalid_arg(format!(
            "{call}: the source has {src} elements, the destination {dst}"
        )))
    }
}

macro_rules! fp8_conversions {
    ($ty:ident, $format:ident, $name:literal, $max:literal) => {
        impl $ty {
            #[doc = concat!("The largest finite ", $name, " value, ±", $max, ".")]
            pub const MAX: $ty = $ty($format.max_code);
            /// The canonical NaN (`0x7f`).
            pub const NAN: $ty = $ty($format.nan_code);

            #[doc = concat!("`x` as ", $name, ": round to nearest, ties to even; a value beyond ±", $max)]
            /// and an infinity saturate to the largest finite value of their sign; a NaN
            /// stays a NaN of its sign. See the module's table.
            ///
            /// ```
            #[doc = concat!("use metrale_runtime::", stringify!($ty), ";")]
            #[doc = concat!("assert_eq!(", stringify!($ty), "::from_f32(1.0).to_f32(), 1.0);")]
            #[doc = concat!("assert_eq!(", stringify!($ty), "::from_f32(1e9).to_f32(), ", $max, ".0);")]
            #[doc = concat!("assert!(", stringify!($ty), "::from_f32(f32::NAN).to_f32().is_nan());")]
            /// ```
            pub fn from_f32(x: f32) -> $ty {
                $ty($format.encode(x))
            }

            /// The exact `f32` value (a NaN code gives a NaN of its sign).
            pub fn to_f32(self) -> f32 {
                $format.decode(self.0)
            }

            /// Whether this is a NaN code.
            pub fn is_nan(self) -> bool {
                self.to_f32().is_nan()
            }

            #[doc = concat!("Each of `src` as ", $name, " (as [`", stringify!($ty), "::from_f32`]).")]
            pub fn from_f32_slice(src: &[f32]) -> Vec<$ty> {
                src.iter().map(|&x| $ty::from_f32(x)).collect()
            }

            /// Each of `src` as `f32` (as [`Self::to_f32`]).
            pub fn to_f32_vec(src: &[$ty]) -> Vec<f32> {
                src.iter().map(|x| x.to_f32()).collect()
            }

            /// Convert `src` into `dst` in place (no allocation).
            ///
            /// # Errors
            /// `InvalidArgument` when the lengths differ, naming both.
            pub fn encode_into(src: &[f32], dst: &mut [$ty]) -> Result<()> {
                same_len(concat!(stringify!($ty), "::encode_into"), src.len(), dst.len())?;
                for (d, &s) in dst.iter_mut().zip(src) {
                    *d = $ty::from_f32(s);
                }
                Ok(())
            }

            /// Convert `src` into `dst` in place (no allocation).
            ///
            /// # Errors
            /// `InvalidArgument` when the lengths differ, naming both.
            pub fn decode_into(src: &[$ty], dst: &mut [f32]) -> Result<()> {
                same_len(concat!(stringify!($ty), "::decode_into"), src.len(), dst.len())?;
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = s.to_f32();
                }
                Ok(())
            }
        }

        impl From<$ty> for f32 {
            fn from(x: $ty) -> f32 {
                x.to_f32()
            }
        }
    };
}

fp8_conversions!(Fp8E4M3, E4M3, "E4M3", "448");
fp8_conversions!(Fp8E5M2, E5M2, "E5M2", "57344");

#[cfg(test)]
#[path = "../tests/fp8.rs"]
mod tests;
