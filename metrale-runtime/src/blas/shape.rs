//! The shapes of plain cuBLAS GEMMs ([`GemmShape`]) and the math mode
//! ([`MathMode`]); a shape is checked by turning it into the matmul
//! [`Problem`] of the same GEMM.

use metrale_cuda_sys::cublas::cublasMath_t;

use super::plan::{MatmulDesc, MatrixLayout, Problem};
use super::{ComputeType, DataType, Transpose};

/// cuBLAS's math mode (`cublasSetMathMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum MathMode {
    /// `CUBLAS_DEFAULT_MATH`.
    #[default]
    Default,
    /// `CUBLAS_PEDANTIC_MATH`: no reduced-precision shortcuts.
    Pedantic,
    /// `CUBLAS_TF32_TENSOR_OP_MATH`: f32 GEMMs on TF32 tensor cores.
    Tf32TensorOp,
}

impl MathMode {
    pub(crate) const fn raw(self) -> cublasMath_t {
        match self {
            MathMode::Default => cublasMath_t::CUBLAS_DEFAULT_MATH,
            MathMode::Pedantic => cublasMath_t::CUBLAS_PEDANTIC_MATH,
            MathMode::Tf32TensorOp => cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
        }
    }
}

/// The shape of one column-major GEMM, `C (m x n) = op(A) op(B)`, with
/// leading dimensions, and for strided batches the strides and count (in
/// elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Whether A is used transposed (then stored `k x m`).
    pub trans_a: Transpose,
    /// Whether B is used transposed (then stored `n x k`).
    pub trans_b: Transpose,
    /// Rows of op(A) and C.
    pub m: usize,
    /// Columns of op(B) and C.
    pub n: usize,
    /// Columns of op(A), rows of op(B).
    pub k: usize,
    /// A's leading dimension.
    pub lda: usize,
    /// B's leading dimension.
    pub ldb: usize,
    /// C's leading dimension.
    pub ldc: usize,
    /// Batch count (1 for `gemm_ex`).
    pub batch: usize,
    /// Elements between A's batches.
    pub stride_a: usize,
    /// Elements between B's batches.
    pub stride_b: usize,
    /// Elements between C's batches.
    pub stride_c: usize,
}

impl GemmShape {
    /// A packed `m x n x k` GEMM, no transposes, not batched.
    pub const fn new(m: usize, n: usize, k: usize) -> GemmShape {
        GemmShape {
            trans_a: Transpose::No,
            trans_b: Transpose::No,
            m,
            n,
            k,
            lda: m,
            ldb: k,
            ldc: m,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
        }
    }

    /// With A transposed (`lda` becomes `k`, A packed `k x m`).
    #[must_use]
    pub const fn transpose_a(mut self) -> GemmShape {
        self.trans_a = Transpose::Yes;
        self.lda = self.k;
        self
    }

    /// With B transposed (`ldb` becomes `n`, B packed `n x k`).
    #[must_use]
    pub const fn transpose_b(mut self) -> GemmShape {
        self.trans_b = Transpose::Yes;
        self.ldb = self.n;
        self
    }

    /// With leading dimensions.
    #[must_use]
    pub const fn with_ld(mut self, lda: usize, ldb: usize, ldc: usize) -> GemmShape {
        self.lda = lda;
        self.ldb = ldb;
        self.ldc = ldc;
        self
    }

    /// A strided batch of `count`, each operand packed one after the other.
    #[must_use]
    pub const fn batched(mut self, count: usize) -> GemmShape {
        self.batch = count;
        let (ac, bc) = (
            if matches!(self.trans_a, Transpose::Yes) {
                self.m
            } else {
                self.k
            },
            if matches!(self.trans_b, Transpose::Yes) {
                self.k
            } else {
                self.n
            },
        );
        self.stride_a = self.lda.saturating_mul(ac);
        self.stride_b = self.ldb.saturating_mul(bc);
        self.stride_c = self.ldc.saturating_mul(self.n);
        self
    }

    /// With batch strides.
    #[must_use]
    pub const fn with_strides(mut self, a: usize, b: usize, c: usize) -> GemmShape {
        self.stride_a = a;
        self.stride_b = b;
        self.stride_c = c;
        self
    }

    /// The first size cuBLAS cannot hold, named with its value and the limit
    /// (`int` sizes, leading dimensions and counts; `long long` strides).
    pub(crate) fn too_large(&self) -> Option<String> {
        let ints = [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("lda", self.lda),
            ("ldb", self.ldb),
            ("ldc", self.ldc),
            ("the batch count", self.batch),
        ];
        let longs = [
            ("A's stride", self.stride_a),
            ("B's stride", self.stride_b),
            ("C's stride", self.stride_c),
        ];
        let int = ints
            .iter()
            .find(|(_, x)| *x > i32::MAX as usize)
            .map(|(what, x)| {
                format!(
                    "{what} {x} is above cuBLAS's int limit (i32::MAX = {})",
                    i32::MAX
                )
            });
        int.or_else(|| {
            longs
                .iter()
                .find(|(_, x)| u64::try_from(*x).map_or(true, |x| x > i64::MAX as u64))
                .map(|(what, x)| {
                    format!(
                        "{what} {x} is above cuBLAS's long long limit (i64::MAX = {})",
                        i64::MAX
                    )
                })
        })
    }

    /// The matmul problem of the same GEMM (C is also D), checked by the
    /// plans' rules.
    pub(crate) fn problem(
        &self,
        types: [DataType; 3],
        compute: ComputeType,
    ) -> std::result::Result<Problem, String> {
        if types.iter().any(|t| t.is_fp8()) {
            return Err("plain cuBLAS takes no FP8 matrices: use a cuBLASLt plan".into());
        }
        let (m, n, k) = (self.m, self.n, self.k);
        let stored_a = if self.trans_a.is_transposed() {
            (k, m)
        } else {
            (m, k)
        };
        let stored_b = if self.trans_b.is_transposed() {
            (n, k)
        } else {
            (k, n)
        };
        let batch = self.batch;
        let la = MatrixLayout::col_major(stored_a.0, stored_a.1)
            .with_ld(self.lda)
            .with_batch(batch, self.stride_a);
        let lb = MatrixLayout::col_major(stored_b.0, stored_b.1)
            .with_ld(self.ldb)
            .with_batch(batch, self.stride_b);
        let lc = MatrixLayout::col_major(m, n)
            .with_ld(self.ldc)
            .with_batch(batch, self.stride_c);
        let mut desc = MatmulDesc::typed(m, n, k, [types[0], types[1], types[2], types[2]])
            .transpose_a(self.trans_a)
            .transpose_b(self.trans_b)
            .layout_a(la)
            .layout_b(lb)
            .layout_c(lc)
            .layout_d(lc)
            .compute(compute);
        let largest = types.iter().map(|t| t.size()).max().unwrap_or(1);
        desc = desc.alignment(largest);
        desc.check()
    }
}
