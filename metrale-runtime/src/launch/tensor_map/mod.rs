//! Tensor maps for the Tensor Memory Accelerator (compute capability 9.0+):
//! [`TensorMap`], a 128-byte descriptor that `cp.async.bulk.tensor` reads, encoded
//! by `cuTensorMapEncodeTiled` (or `cuTensorMapEncodeIm2col`,
//! `cuTensorMapEncodeIm2colWide`) from a
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
//!   within the swizzle span) and pixels per column 1..=1024; for the packed
//!   sub-byte types (sizes count values) a 32-byte aligned address and strides,
//!   size 0 a multiple of 128 and a box (or pixel) row of 128 values for the
//!   16-byte groups, size 0 even for `16U4_ALIGN8B`, the swizzles each allows, no
//!   interleave for `16U6_ALIGN16B`, no NaN fill; for wide im2col maps one width
//!   offset per corner in -32768..=32767, the 64-byte, 128-byte and 128-byte
//!   atom-32 swizzles only, pixels not read in mode `W128`. The packed types, the
//!   128-byte atom swizzles and wide im2col maps need compute capability 10.0
//!   and a CUDA 12.8 driver: refused with
//!   [`ErrorKind::FeatureUnavailable`](crate::ErrorKind::FeatureUnavailable)
//!   before the driver elsewhere (a layout against each memory's device). A
//!   [`TensorMapLayout`] is checked by the same code as a map built directly.
//! - A map never describes memory outside the buffer it was made from: the last
//!   byte the sizes and strides reach lies inside the memory's extent. The map
//!   borrows that memory (`'a`), so safe code cannot free it while the map lives;
//!   [`TensorMap::replace_address`] moves it to other memory with the same check.
//! - The kernel receives the driver's 128 bytes exactly: `&TensorMap` is a
//!   [`KernelArg`](crate::KernelArg) of size 128, so the launch check accepts it
//!   for a 128-byte (`CUtensorMap`, `__grid_constant__`) parameter.

mod builder;
mod layout;
mod map;
mod quick;
mod rules;
mod spec;
mod types;

pub use builder::TensorMapBuilder;
pub use layout::TensorMapLayout;
pub use map::TensorMap;
pub use types::{
    Im2colWideMode, Interleave, L2Promotion, OobFill, Swizzle, TensorDataType, TensorElement,
    TENSOR_MAP_MAX_RANK,
};
