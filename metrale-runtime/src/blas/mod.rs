//! cuBLASLt and cuBLAS (feature `cublas`): a handle per device, matmul plans
//! built once, one workspace per stream, and GEMMs checked against their
//! buffers before the library sees them.
//!
//! | file | owns |
//! | --- | --- |
//! | `mod.rs` | the element types ([`BlasElement`], [`Fp8E4M3`], [`Fp8E5M2`]), [`ComputeType`], [`Transpose`], [`Order`] |
//! | `fp8.rs` | FP8 conversions from and to `f32` (round to nearest even, saturating, NaN kept) |
//! | `error.rs` | [`BlasError`], how it fills the library-error shape, the status texts |
//! | `handle.rs` | [`BlasLt`]: the cuBLASLt handle of a device, its plan cache |
//! | `core.rs` | what a handle and its plans share; the one path into cuBLASLt |
//! | `workspace.rs` | one workspace per stream, and the one function that keeps a captured workspace alive (a user object in the graph) |
//! | `plan.rs` | [`MatmulDesc`] (the problem) and its rules, [`Problem`] (the checked problem, the cache's key) |
//! | `layout.rs` | [`MatrixLayout`], [`Epilogue`], [`ScaleMode`], [`Reduction`] |
//! | `matmul.rs` | [`MatmulPlan`]: its descriptors, the heuristic, its `matmul` |
//! | `check.rs` | the checks of every call's buffers, [`MatmulExtras`] (bias, FP8 scales) |
//! | `gemm.rs` | [`Blas`]: plain cuBLAS (`gemm_ex`, strided batches, device scalars) |
//! | `shape.rs` | [`GemmShape`], [`MathMode`] |
//! | `grouped.rs` | grouped batched GEMMs, [`GemmGroup`] |
//!
//! Invariants:
//! - Every cuBLAS and cuBLASLt call is made with the handle's context bound
//!   first (`CudaContext::with`). metrale's context of a device is the device's
//!   primary context (`cuDevicePrimaryCtxRetain`), the one the CUDA runtime
//!   under cuBLAS uses too, so a handle made on it and used with it bound is
//!   always on the right device, whatever another library left current.
//! - A plan runs the heuristic once, when built, and keeps the chosen
//!   algorithm; [`BlasLt::plan`] serves later plans of the same problem from a
//!   cache keyed on everything that changes the choice. A heuristic that
//!   returns no algorithm is an error ([`BlasError::NoAlgorithm`]), never a
//!   silent zero result.
//! - Before cuBLASLt or cuBLAS is called, every buffer's length is checked
//!   against its layout (batches included), each element type against the
//!   plan's, D against overlap with A and B, every buffer and the stream
//!   against the plan's device, each address against the alignment the plan's
//!   algorithm was chosen for: a mismatch is an error naming the call, the
//!   operand, what was expected and what was given. No safe call can make the
//!   library read or write past a buffer.
//! - A workspace belongs to one stream and is never shared across streams. It
//!   is made on the stream's first eager GEMM (or by
//!   [`BlasLt::prepare`]); a GEMM on a stream being captured without a
//!   workspace ready is refused, not allocated into the capture. A graph that
//!   captured a workspace holds it as long as the graph or an executable graph
//!   made from it lives (a user object in the graph, no node added); the
//!   holder exists before any GEMM of that capture is recorded, whichever
//!   thread queues it.
//! - Every buffer a call takes gets a use record before the library sees it:
//!   A, B, C, D, the bias, the FP8 scales, device scalars, the grouped GEMM's
//!   pointer arrays and the workspace.
//! - A plan reduces exactly unless told otherwise ([`Reduction`]): split-K
//!   partial sums are added in the compute type and D is rounded once.
//! - [`BlasLt`] is `Send` and `Sync` (cuBLASLt's calls are thread-safe for one
//!   handle; plans that set per-call pointers take a lock for it). [`Blas`]
//!   keeps the cuBLAS handle's stream, workspace and modes behind a lock, so
//!   calls from several threads never see each other's settings.

use metrale_cuda_sys::cublas::{cublasComputeType_t, cublasOperation_t, cudaDataType};

use crate::memory::{DevicePod, DeviceRepr};

mod check;
mod core;
mod error;
mod fp8;
mod gemm;
mod grouped;
mod handle;
mod layout;
mod matmul;
mod plan;
mod shape;
mod workspace;

pub use check::MatmulExtras;
pub use error::BlasError;
pub use gemm::Blas;
pub use grouped::GemmGroup;
pub use handle::{BlasLt, BlasLtOptions};
pub use matmul::MatmulPlan;
pub use plan::{Epilogue, MatmulDesc, MatrixLayout, Problem, Reduction, ScaleMode};
pub use shape::{GemmShape, MathMode};

/// An FP8 number in the E4M3 format (4 exponent bits, 3 mantissa bits), as
/// its byte: a buffer's element type. [`Fp8E4M3::from_f32`] and
/// [`Fp8E4M3::to_f32`] convert (round to nearest even, saturating to ±448, NaN
/// kept), one value or a slice at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct Fp8E4M3(pub u8);

/// An FP8 number in the E5M2 format (5 exponent bits, 2 mantissa bits), as
/// its byte. [`Fp8E5M2::from_f32`] and [`Fp8E5M2::to_f32`] convert (round to
/// nearest even, saturating to ±57344 (OCP's saturating mode: an infinity too),
/// NaN kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct Fp8E5M2(pub u8);

// SAFETY: one byte, no padding.
unsafe impl DeviceRepr for Fp8E4M3 {}
// SAFETY: every byte is some E4M3 value (or NaN).
unsafe impl DevicePod for Fp8E4M3 {}
// SAFETY: one byte, no padding.
unsafe impl DeviceRepr for Fp8E5M2 {}
// SAFETY: every byte is some E5M2 value (or NaN, infinity).
unsafe impl DevicePod for Fp8E5M2 {}

mod sealed {
    pub trait Sealed {}
}

/// An element type cuBLAS and cuBLASLt take: `f32`, `half::f16`, `half::bf16`,
/// [`Fp8E4M3`], [`Fp8E5M2`]. A buffer of one type given where the plan says
/// another is refused.
pub trait BlasElement: DeviceRepr + sealed::Sealed {
    /// The library's data type of the same layout.
    const DATA_TYPE: DataType;
}

macro_rules! blas_element {
    ($($t:ty => $d:ident),* $(,)?) => { $(
        impl sealed::Sealed for $t {}
        impl BlasElement for $t {
            const DATA_TYPE: DataType = DataType::$d;
        }
    )* };
}
blas_element!(
    f32 => F32,
    half::f16 => F16,
    half::bf16 => Bf16,
    Fp8E4M3 => Fp8E4M3,
    Fp8E5M2 => Fp8E5M2,
);

/// An element type of a matrix or vector, as the plan knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// `f32` (`CUDA_R_32F`).
    F32,
    /// `half::f16` (`CUDA_R_16F`).
    F16,
    /// `half::bf16` (`CUDA_R_16BF`).
    Bf16,
    /// [`Fp8E4M3`] (`CUDA_R_8F_E4M3`).
    Fp8E4M3,
    /// [`Fp8E5M2`] (`CUDA_R_8F_E5M2`).
    Fp8E5M2,
}

impl DataType {
    /// The library's code.
    pub const fn raw(self) -> cudaDataType {
        match self {
            DataType::F32 => cudaDataType::CUDA_R_32F,
            DataType::F16 => cudaDataType::CUDA_R_16F,
            DataType::Bf16 => cudaDataType::CUDA_R_16BF,
            DataType::Fp8E4M3 => cudaDataType::CUDA_R_8F_E4M3,
            DataType::Fp8E5M2 => cudaDataType::CUDA_R_8F_E5M2,
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DataType::F32 => 4,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::Fp8E4M3 | DataType::Fp8E5M2 => 1,
        }
    }

    /// Whether this is one of the FP8 types.
    pub const fn is_fp8(self) -> bool {
        matches!(self, DataType::Fp8E4M3 | DataType::Fp8E5M2)
    }

    /// The Rust type's name, for error texts.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::Fp8E4M3 => "fp8 e4m3",
            DataType::Fp8E5M2 => "fp8 e5m2",
        }
    }
}

/// How products are accumulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ComputeType {
    /// f32 (`CUBLAS_COMPUTE_32F`): the default for every element type.
    F32,
    /// f32 with f32 inputs rounded to TF32 on tensor cores
    /// (`CUBLAS_COMPUTE_32F_FAST_TF32`); f32 matrices only.
    Tf32,
    /// f32 with f32 inputs rounded to f16 (`CUBLAS_COMPUTE_32F_FAST_16F`).
    F32FastF16,
    /// f32 with f32 inputs rounded to bf16 (`CUBLAS_COMPUTE_32F_FAST_16BF`).
    F32FastBf16,
    /// f16 (`CUBLAS_COMPUTE_16F`): f16 matrices with f16 C and D only; the
    /// scale type is f16: alpha and beta, given as `f32`, are converted by
    /// `half::f16::from_f32` (round to nearest, ties to even; beyond ±65504
    /// ±infinity; NaN kept).
    F16,
}

impl ComputeType {
    /// The library's code.
    pub const fn raw(self) -> cublasComputeType_t {
        match self {
            ComputeType::F32 => cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ComputeType::Tf32 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ComputeType::F32FastF16 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16F,
            ComputeType::F32FastBf16 => cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
            ComputeType::F16 => cublasComputeType_t::CUBLAS_COMPUTE_16F,
        }
    }

    /// The scale type (alpha, beta) it takes: f16 for [`ComputeType::F16`],
    /// else f32.
    pub const fn scale_type(self) -> DataType {
        match self {
            ComputeType::F16 => DataType::F16,
            _ => DataType::F32,
        }
    }
}

/// Whether an operand is used as stored or transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Transpose {
    /// As stored (`CUBLAS_OP_N`).
    #[default]
    No,
    /// Transposed (`CUBLAS_OP_T`).
    Yes,
}

impl Transpose {
    /// The library's code.
    pub const fn raw(self) -> cublasOperation_t {
        match self {
            Transpose::No => cublasOperation_t::CUBLAS_OP_N,
            Transpose::Yes => cublasOperation_t::CUBLAS_OP_T,
        }
    }

    /// Whether it transposes.
    pub const fn is_transposed(self) -> bool {
        matches!(self, Transpose::Yes)
    }
}

/// How a matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Order {
    /// Column after column (cuBLAS's own order): element `(r, c)` at `r + c * ld`.
    #[default]
    Col,
    /// Row after row: element `(r, c)` at `r * ld + c`.
    Row,
}

/// A scalar (alpha, beta) in the scale type, aligned for any of them: the
/// library reads it through a pointer to the scale type.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub(crate) struct Scalar([u8; 8]);

impl Scalar {
    /// The address the library reads.
    pub(crate) fn as_ptr(&self) -> *const std::ffi::c_void {
        std::ptr::from_ref(self).cast()
    }
}

/// An f32 as the scale type's bytes (f16 for an f16 scale type), in the low
/// bytes (the scale type's value at the start, on a little-endian host).
pub(crate) fn scale_bytes(value: f32, scale: DataType) -> Scalar {
    let mut out = [0u8; 8];
    match scale {
        DataType::F16 => out[..2].copy_from_slice(&half::f16::from_f32(value).to_ne_bytes()),
        _ => out[..4].copy_from_slice(&value.to_ne_bytes()),
    }
    Scalar(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_types_have_the_library_codes_and_sizes() {
        assert_eq!(
            <f32 as BlasElement>::DATA_TYPE.raw(),
            cudaDataType::CUDA_R_32F
        );
        assert_eq!(<half::bf16 as BlasElement>::DATA_TYPE.raw().0, 14);
        assert_eq!(<Fp8E4M3 as BlasElement>::DATA_TYPE.raw().0, 28);
        assert_eq!(<Fp8E5M2 as BlasElement>::DATA_TYPE.raw().0, 29);
        assert_eq!(DataType::F16.size(), 2);
        assert!(DataType::Fp8E5M2.is_fp8() && !DataType::Bf16.is_fp8());
        assert_eq!(ComputeType::F16.scale_type(), DataType::F16);
        assert_eq!(ComputeType::Tf32.raw().0, 77);
    }

    #[test]
    fn scales_are_written_in_the_scale_type() {
        let f = scale_bytes(1.5, DataType::F32);
        assert_eq!(&f.0[..4], &1.5f32.to_ne_bytes());
        assert_eq!(f.as_ptr() as usize % 8, 0);
        assert_eq!(
            &scale_bytes(1.5, DataType::F16).0[..2],
            &half::f16::from_f32(1.5).to_ne_bytes()
        );
        assert_eq!(half::f16::from_f32(1.5).to_bits(), 0x3e00);
    }
}
