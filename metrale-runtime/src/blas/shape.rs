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

    /// [`GemmShape::problem`], remembered: the last few shapes this thread
    /// checked are kept with their problems (a pure function of the shape,
    /// the types and the compute type), so a GEMM repeated with one shape,
    /// as every step of a decode loop does, builds and checks its problem
    /// once. A refusal is not remembered.
    pub(crate) fn problem_cached(
        &self,
        types: [DataType; 3],
        compute: ComputeType,
    ) -> std::result::Result<Problem, String> {
        type Entry = (GemmShape, [DataType; 3], ComputeType, Problem);
        /// Entries per thread: a decode step's distinct GEMM shapes.
        const ENTRIES: usize = 8;
        thread_local! {
            static CHECKED: std::cell::RefCell<([Option<Entry>; ENTRIES], usize)> =
                const { std::cell::RefCell::new(([None; ENTRIES], 0)) };
        }
        let key = (*self, types, compute);
        let hit = CHECKED.with(|c| {
            let c = c.try_borrow().ok()?;
            c.0.iter()
                .flatten()
                .find(|e| (e.0, e.1, e.2) == key)
                .map(|e| e.3)
        });
        if let Some(p) = hit {
            return Ok(p);
        }
        let p = self.problem(types, compute)?;
        CHECKED.with(|c| {
            if let Ok(mut c) = c.try_borrow_mut() {
                let at = c.1;
                c.0[at % ENTRIES] = Some((key.0, key.1, key.2, p));
                c.1 = (at + 1) % ENTRIES;
            }
        });
        Ok(p)
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

#[cfg(test)]
mod tests {
    use super::GemmShape;
    use crate::blas::{ComputeType, DataType};

    const F32: [DataType; 3] = [DataType::F32; 3];

    #[test]
    fn remembered_problems_are_the_checked_ones_and_refusals_are_not_kept() {
        // More shapes than the thread keeps, twice over: each answer is the
        // one a fresh check gives.
        for round in 0..2 {
            for m in 1..=12usize {
                let shape = GemmShape::new(m, 4, 8);
                let cached = shape.problem_cached(F32, ComputeType::F32);
                assert_eq!(
                    cached,
                    shape.problem(F32, ComputeType::F32),
                    "m {m}, round {round}"
                );
                let wider = shape.with_ld(m + 3, 8, m + 1);
                assert_eq!(
                    wider.problem_cached(F32, ComputeType::F32),
                    wider.problem(F32, ComputeType::F32)
                );
                assert_ne!(cached, wider.problem_cached(F32, ComputeType::F32));
            }
        }
        // A refused shape stays refused; the same shape with a valid ld is
        // not confused with it.
        let bad = GemmShape::new(8, 8, 8).with_ld(4, 8, 8);
        for _ in 0..2 {
            assert!(bad.problem_cached(F32, ComputeType::F32).is_err());
        }
        let good = GemmShape::new(8, 8, 8);
        assert!(good.problem_cached(F32, ComputeType::F32).is_ok());
        assert!(bad.problem_cached(F32, ComputeType::F32).is_err());
        // Other types or compute types are other problems.
        let f16 = [DataType::F16; 3];
        assert_eq!(
            good.problem_cached(f16, ComputeType::F32),
            good.problem(f16, ComputeType::F32)
        );
        assert_ne!(
            good.problem_cached(f16, ComputeType::F32),
            good.problem_cached(F32, ComputeType::F32)
        );
    }
}
