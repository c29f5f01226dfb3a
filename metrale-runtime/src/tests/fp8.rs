//! FP8 conversions: every one of the 256 codes of each format both ways, the
//! rounding against a reference that searches all codes, and the saturation,
//! NaN and zero rules.

use crate::{Fp8E4M3, Fp8E5M2};

/// The finite codes of a format with their values, from its `to_f32`.
fn finite(decode: impl Fn(u8) -> f32) -> Vec<(u8, f32)> {
    (0..=255u8)
        .map(|c| (c, decode(c)))
        .filter(|(_, v)| v.is_finite())
        .collect()
}

/// The code nearest to `x` among `codes`, ties to the even code (the one whose
/// lowest mantissa bit is 0), saturating at the largest finite value; `x`'s
/// sign for zeros. The reference the encoder is checked against.
fn nearest(codes: &[(u8, f32)], x: f32, max: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let x = f64::from(x.clamp(-max, max));
    let mut best: Option<(u8, f64)> = None;
    for &(c, v) in codes {
        if (c & 0x80) != sign {
            continue;
        }
        let d = (f64::from(v) - x).abs();
        best = match best {
            None => Some((c, d)),
            Some((b, bd)) if d < bd || (d == bd && c & 1 == 0 && b & 1 == 1) => Some((c, d)),
            keep => keep,
        };
    }
    best.map(|(c, _)| c).unwrap()
}

#[test]
fn e4m3_all_256_codes_both_ways() {
    let mut nans = 0;
    for c in 0..=255u8 {
        let v = Fp8E4M3(c).to_f32();
        if c & 0x7f == 0x7f {
            assert!(v.is_nan(), "{c:#x}");
            assert_eq!(v.is_sign_negative(), c & 0x80 != 0, "{c:#x}: sign kept");
            nans += 1;
        } else {
            assert!(v.is_finite() && v.abs() <= 448.0, "{c:#x}: {v}");
        }
        // Every code comes back as itself (NaN, -0 and subnormals included).
        assert_eq!(Fp8E4M3::from_f32(v).0, c, "{c:#x} = {v}");
    }
    assert_eq!(nans, 2);
    assert_eq!(Fp8E4M3(0x7e).to_f32(), 448.0);
    assert_eq!(Fp8E4M3(0x01).to_f32(), 2f32.powi(-9));
    assert_eq!(Fp8E4M3(0x08).to_f32(), 2f32.powi(-6));
    assert_eq!(Fp8E4M3(0x38).to_f32(), 1.0);
    assert_eq!(Fp8E4M3(0xb8).to_f32(), -1.0);
}

#[test]
fn e5m2_all_256_codes_both_ways() {
    for c in 0..=255u8 {
        let v = Fp8E5M2(c).to_f32();
        let m = c & 0x7f;
        let back = Fp8E5M2::from_f32(v).0;
        match m {
            0x7c => {
                assert!(v.is_infinite(), "{c:#x}");
                // Saturating: an infinity becomes the largest finite value.
                assert_eq!(back, (c & 0x80) | 0x7b, "{c:#x}");
            }
            0x7d..=0x7f => {
                assert!(v.is_nan(), "{c:#x}");
                assert_eq!(v.is_sign_negative(), c & 0x80 != 0, "{c:#x}: sign kept");
                assert_eq!(back, (c & 0x80) | 0x7f, "{c:#x}: the canonical NaN");
            }
            _ => {
                assert!(v.is_finite() && v.abs() <= 57344.0, "{c:#x}: {v}");
                assert_eq!(back, c, "{c:#x} = {v}");
            }
        }
    }
    assert_eq!(Fp8E5M2(0x7b).to_f32(), 57344.0);
    assert_eq!(Fp8E5M2(0x01).to_f32(), 2f32.powi(-16));
    assert_eq!(Fp8E5M2(0x3c).to_f32(), 1.0);
}

/// Every midpoint between neighbouring codes, a point just either side of it,
/// and a sweep of f32 bit patterns: each encodes as the reference's nearest code.
fn rounding_matches_the_reference(
    decode: impl Fn(u8) -> f32,
    encode: impl Fn(f32) -> u8,
    max: f32,
) {
    let codes = finite(&decode);
    let mut values: Vec<f32> = codes.iter().map(|&(_, v)| v).collect();
    values.sort_by(f32::total_cmp);
    values.dedup();
    let mut probes = Vec::new();
    for w in values.windows(2) {
        let mid = ((f64::from(w[0]) + f64::from(w[1])) / 2.0) as f32;
        probes.extend([mid, mid.next_up(), mid.next_down(), w[0], w[1]]);
    }
    probes.extend((0..u32::MAX).step_by(65_521).map(f32::from_bits));
    probes.extend([max * 1.01, -max * 1.01, 1e30, -1e30, f32::MAX, f32::MIN]);
    for x in probes {
        if x.is_nan() {
            continue;
        }
        let want = nearest(&codes, x, max);
        let got = encode(x);
        assert_eq!(
            got,
            want,
            "{x:e} ({:#010x}): got {got:#x}, want {want:#x}",
            x.to_bits()
        );
    }
}

#[test]
fn e4m3_rounds_to_nearest_even_and_saturates() {
    rounding_matches_the_reference(|c| Fp8E4M3(c).to_f32(), |x| Fp8E4M3::from_f32(x).0, 448.0);
    // Ties: 1.0625 is half-way between 1.0 (0x38) and 1.125 (0x39): even is 1.0.
    assert_eq!(Fp8E4M3::from_f32(1.0625).0, 0x38);
    assert_eq!(Fp8E4M3::from_f32(1.1875).0, 0x3a);
    // Saturation: no infinity in E4M3.
    assert_eq!(Fp8E4M3::from_f32(f32::INFINITY), Fp8E4M3::MAX);
    assert_eq!(Fp8E4M3::from_f32(f32::NEG_INFINITY).0, 0xfe);
    assert_eq!(Fp8E4M3::from_f32(464.0).to_f32(), 448.0);
    // NaN kept, with its sign; below half the smallest subnormal, a signed zero.
    assert_eq!(Fp8E4M3::from_f32(f32::NAN), Fp8E4M3::NAN);
    assert_eq!(Fp8E4M3::from_f32(-f32::NAN).0, 0xff);
    assert_eq!(Fp8E4M3::from_f32(2f32.powi(-11)).0, 0x00);
    assert_eq!(Fp8E4M3::from_f32(-2f32.powi(-11)).0, 0x80);
}

#[test]
fn e5m2_rounds_to_nearest_even_and_saturates() {
    rounding_matches_the_reference(|c| Fp8E5M2(c).to_f32(), |x| Fp8E5M2::from_f32(x).0, 57344.0);
    assert_eq!(Fp8E5M2::from_f32(f32::INFINITY), Fp8E5M2::MAX);
    assert_eq!(Fp8E5M2::from_f32(f32::NEG_INFINITY).0, 0xfb);
    assert_eq!(Fp8E5M2::from_f32(1e6).to_f32(), 57344.0);
    assert_eq!(Fp8E5M2::from_f32(f32::NAN), Fp8E5M2::NAN);
    assert!(Fp8E5M2::from_f32(-f32::NAN).is_nan());
    // 1.125 is half-way between 1.0 (0x3c) and 1.25 (0x3d): even is 1.0.
    assert_eq!(Fp8E5M2::from_f32(1.125).0, 0x3c);
    assert_eq!(Fp8E5M2::from_f32(1.375).0, 0x3e);
}

#[test]
fn slices_convert_and_refuse_other_lengths() {
    let xs = [0.0f32, 1.0, -2.5, 448.0, 1e9];
    let e4 = Fp8E4M3::from_f32_slice(&xs);
    assert_eq!(Fp8E4M3::to_f32_vec(&e4), [0.0, 1.0, -2.5, 448.0, 448.0]);
    let mut back = [0.0f32; 5];
    Fp8E4M3::decode_into(&e4, &mut back).unwrap();
    assert_eq!(back, [0.0, 1.0, -2.5, 448.0, 448.0]);
    let mut e5 = [Fp8E5M2::default(); 5];
    Fp8E5M2::encode_into(&xs, &mut e5).unwrap();
    assert_eq!(f32::from(e5[4]), 57344.0);
    let e = Fp8E5M2::encode_into(&xs, &mut e5[..4]).unwrap_err();
    assert!(
        e.to_string()
            .contains("Fp8E5M2::encode_into: the source has 5 elements, the destination 4"),
        "{e}"
    );
}
