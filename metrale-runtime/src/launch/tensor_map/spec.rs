//! What a map is asked for ([`Spec`], [`Im2col`]) and the refusals every part of
//! the tensor-map code shares: the address alignment, the features beyond compute
//! capability 9.0, and the error a refusal builds out of line.

use std::fmt;

use metrale_cuda_sys::CUdeviceptr;

use super::types::{
    Dims, Im2colWideMode, Interleave, L2Promotion, OobFill, Swizzle, TensorDataType,
    TENSOR_MAP_MAX_RANK,
};
use crate::context::CudaContext;
use crate::error::{invalid_arg, ErrorKind, MetraleError, Result};

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
    /// The lists longer than five, remembered for `encode` to refuse.
    pub(super) too_long: Option<TooLong>,
    /// Set by [`TensorMapBuilder::im2col`]: an im2col map instead of a tiled one.
    pub(super) im2col: Option<Im2col>,
}

/// The lists given with more than five values: each list's length, 0 for a
/// list of five or fewer (or not given).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct TooLong([usize; 6]);

/// The lists, as refusals name them, in the order [`TooLong`] keeps them.
const LISTS: [&str; 6] = [
    "sizes",
    "strides",
    "box sizes",
    "element strides",
    "lower corners",
    "upper corners",
];

impl TooLong {
    /// `slot` with list `which` given `n` values (`n` > 5 is too long, else
    /// fine); by value, so the builder's own storage never escapes the hot path.
    #[cold]
    #[inline(never)]
    pub(super) fn noted(slot: Option<TooLong>, which: usize, n: usize) -> Option<TooLong> {
        let mut t = slot.unwrap_or_default();
        if let Some(len) = t.0.get_mut(which) {
            *len = if n > TENSOR_MAP_MAX_RANK { n } else { 0 };
        }
        if t.0.iter().all(|&n| n == 0) {
            None
        } else {
            Some(t)
        }
    }
}

impl fmt::Display for TooLong {
    /// Every list too long: `6 sizes and 6 box sizes`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let named: Vec<String> = self
            .0
            .iter()
            .zip(LISTS)
            .filter(|(&n, _)| n > 0)
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
        match named.split_last() {
            Some((last, [])) => f.write_str(last),
            Some((last, rest)) => write!(f, "{} and {last}", rest.join(", ")),
            None => f.write_str("no list"),
        }
    }
}

/// The im2col part of a map: the pixel bounding box (corners of the spatial
/// dimensions, rank - 2 of each) and what one load gathers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Im2col {
    pub(super) lower: Dims<i32>,
    pub(super) upper: Dims<i32>,
    pub(super) channels_per_pixel: u32,
    pub(super) pixels_per_column: u32,
    /// A wide map (`cuTensorMapEncodeIm2colWide`, one width offset per corner).
    pub(super) wide: Option<Im2colWideMode>,
}

/// The address (and stride) alignment a map needs: 32 bytes with 32-byte
/// interleave or a packed type of 16-byte groups, else 16.
#[inline(always)]
pub(super) fn address_align(interleave: Interleave, ty: TensorDataType) -> u64 {
    if interleave == Interleave::B32 || ty.is_packed_16() {
        32
    } else {
        16
    }
}

/// Why the alignment is 32, for a refusal's text.
pub(super) fn align_reason(align: u64, interleave: Interleave, ty: TensorDataType) -> String {
    if align != 32 {
        String::new()
    } else if interleave == Interleave::B32 {
        " (32-byte interleave)".into()
    } else {
        format!(" ({})", ty.driver_name())
    }
}

/// A refusal's error, built out of line (the checks' hot path only compares).
#[cold]
#[inline(never)]
pub(super) fn refuse(text: fmt::Arguments<'_>) -> MetraleError {
    invalid_arg(format!("tensor map: {text}"))
}

/// The global address aligned to `align` bytes (a power of two: 16, or 32 with
/// the reason from the interleave or the data type).
#[inline(always)]
pub(super) fn check_address(
    base: CUdeviceptr,
    align: u64,
    interleave: Interleave,
    ty: TensorDataType,
) -> Result<()> {
    // `align` is 16 or 32: a mask, not a division.
    if base & align.wrapping_sub(1) != 0 {
        return Err(misaligned(base, align, interleave, ty));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn misaligned(
    base: CUdeviceptr,
    align: u64,
    interleave: Interleave,
    ty: TensorDataType,
) -> MetraleError {
    refuse(format_args!(
        "the global address must be aligned to {align} bytes{}: {base:#x} is not",
        align_reason(align, interleave, ty)
    ))
}

/// The device and driver have what a map of `spec` needs beyond compute
/// capability 9.0 (called only when it needs some: a packed type, an atom
/// swizzle, a wide im2col map): compute capability 10.0 and CUDA 12.8.
#[cold]
#[inline(never)]
pub(super) fn check_sm100(ctx: &CudaContext, spec: &Spec, base: CUdeviceptr) -> Result<()> {
    check_features(
        ctx,
        spec.data_type,
        spec.swizzle,
        spec.im2col.is_some_and(|i| i.wide.is_some()),
        base,
    )
}

/// As [`check_sm100`], from the parts a layout keeps.
#[cold]
#[inline(never)]
pub(super) fn check_features(
    ctx: &CudaContext,
    data_type: TensorDataType,
    swizzle: Swizzle,
    wide: bool,
    base: CUdeviceptr,
) -> Result<()> {
    const NEEDS: (u32, u32) = (10, 0);
    const NEEDS_DRIVER: i32 = 12080;
    let has = ctx.limits().compute_capability;
    let driver = ctx.driver_version();
    if has >= NEEDS && driver >= NEEDS_DRIVER {
        return Ok(());
    }
    let feature = if data_type.is_packed() {
        format!("data type {}", data_type.driver_name())
    } else if swizzle.is_atom() {
        format!("swizzle {swizzle:?}")
    } else if wide {
        "a wide im2col map".to_string()
    } else {
        return Ok(());
    };
    Err(ErrorKind::FeatureUnavailable {
        subject: format!("tensor map at {base:#x}"),
        feature,
        device: ctx.ordinal(),
        needs: NEEDS,
        has,
        needs_driver: NEEDS_DRIVER,
        driver,
    }
    .into())
}
