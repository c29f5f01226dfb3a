//! What a matmul is, before cuBLASLt sees it: [`MatmulDesc`] (types, shapes,
//! layouts, transposes, batches, epilogue, FP8 scales, workspace limit,
//! alignment, reduction precision), its rules ([`MatmulDesc::check`]), and the checked result
//! ([`Problem`]) that keys the plan cache and builds the library's
//! descriptors.
//!
//! Invariants:
//! - A [`Problem`] is only made by [`MatmulDesc::check`], so every one obeys
//!   the rules: shapes agree, `ld` reaches across each row or column, the
//!   batches of D never overlap, the element types are a combination the
//!   library has, FP8 scales are asked only of FP8 operands, and the
//!   alignment is one the operands' types allow.
//! - A problem is everything that changes the heuristic's choice, so equal
//!   problems share one plan.

use std::fmt;

use super::layout::{narrow, wide};
pub use super::layout::{Epilogue, MatrixLayout, Reduction, ScaleMode};
use super::{BlasElement, ComputeType, DataType, Transpose};

/// A matmul problem, `D = alpha * op(A) op(B) + beta * C` (then the
/// epilogue), described once and checked by [`MatmulDesc::check`]: `op(A)` is
/// `m x k`, `op(B)` is `k x n`, C and D are `m x n`.
///
/// By default every operand is packed column-major (cuBLAS's order), not
/// transposed and not batched, the compute type is f32, the workspace limit is
/// the handle's workspace, operands must be 16-byte aligned, and a split-K
/// algorithm adds its partial sums in the compute type ([`Reduction::Exact`]).
///
/// ```
/// use metrale_runtime::blas::{Epilogue, MatmulDesc, Transpose};
/// let desc = MatmulDesc::new::<half::bf16, half::bf16, half::bf16, half::bf16>(64, 32, 128)
///     .transpose_a(Transpose::Yes)
///     .epilogue(Epilogue::GeluBias);
/// let problem = desc.check().unwrap();
/// assert_eq!(problem.a().rows, 128, "A is stored k x m when transposed");
/// assert_eq!(problem.bias_len(), Some(64));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MatmulDesc {
    m: u64,
    n: u64,
    k: u64,
    types: [DataType; 4],
    compute: ComputeType,
    trans: [Transpose; 2],
    layouts: [Option<MatrixLayout>; 4],
    batch: Option<usize>,
    epilogue: Epilogue,
    bias_type: Option<DataType>,
    scales: [Option<ScaleMode>; 2],
    c_scale: bool,
    d_scale: bool,
    workspace_limit: Option<usize>,
    alignment: usize,
    reduction: Reduction,
}

/// A checked matmul problem: everything that changes the heuristic's choice,
/// so the plan cache's key. Made by [`MatmulDesc::check`] only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Problem {
    pub(crate) m: u64,
    pub(crate) n: u64,
    pub(crate) k: u64,
    pub(crate) types: [DataType; 4],
    pub(crate) compute: ComputeType,
    pub(crate) trans: [Transpose; 2],
    pub(crate) layouts: [MatrixLayout; 4],
    pub(crate) epilogue: Epilogue,
    pub(crate) bias_type: Option<DataType>,
    pub(crate) scales: [Option<ScaleMode>; 2],
    pub(crate) c_scale: bool,
    pub(crate) d_scale: bool,
    /// `None` until the handle fills in its own workspace size.
    pub(crate) workspace_limit: Option<usize>,
    pub(crate) alignment: usize,
    pub(crate) reduction: Reduction,
    /// The elements each operand's layout needs (`required_len`, checked to
    /// fit when the problem was made): computed once, read by every call.
    pub(crate) lens: [u64; 4],
    /// Whether a call needs extras (an epilogue bias or FP8 scales).
    pub(crate) extras: bool,
}

/// The operands' names, in the order of [`Problem::layouts`].
pub(crate) const OPERANDS: [&str; 4] = ["A", "B", "C", "D"];

impl MatmulDesc {
    /// `D (m x n) = op(A) (m x k) * op(B) (k x n) + C`, with element types
    /// `A`, `B`, `C` and `D`.
    ///
    /// Sizes are `usize`, as buffer lengths are (cuBLASLt takes them as
    /// `uint64_t`, so every size fits; what a buffer cannot hold is refused by
    /// [`MatmulDesc::check`]).
    pub fn new<A: BlasElement, B: BlasElement, C: BlasElement, D: BlasElement>(
        m: usize,
        n: usize,
        k: usize,
    ) -> MatmulDesc {
        MatmulDesc {
            m: wide(m),
            n: wide(n),
            k: wide(k),
            types: [A::DATA_TYPE, B::DATA_TYPE, C::DATA_TYPE, D::DATA_TYPE],
            compute: ComputeType::F32,
            trans: [Transpose::No; 2],
            layouts: [None; 4],
            batch: None,
            epilogue: Epilogue::None,
            bias_type: None,
            scales: [None; 2],
            c_scale: false,
            d_scale: false,
            workspace_limit: None,
            alignment: 16,
            reduction: Reduction::Exact,
        }
    }

    /// The same as [`MatmulDesc::new`] with the element types as values.
    pub(crate) fn typed(m: usize, n: usize, k: usize, types: [DataType; 4]) -> MatmulDesc {
        let mut d = MatmulDesc::new::<f32, f32, f32, f32>(m, n, k);
        d.types = types;
        d
    }

    /// Use A transposed (stored `k x m`).
    #[must_use]
    pub fn transpose_a(mut self, t: Transpose) -> MatmulDesc {
        self.trans[0] = t;
        self
    }

    /// Use B transposed (stored `n x k`).
    #[must_use]
    pub fn transpose_b(mut self, t: Transpose) -> MatmulDesc {
        self.trans[1] = t;
        self
    }

    /// A's layout as stored (default: packed column-major).
    #[must_use]
    pub fn layout_a(mut self, l: MatrixLayout) -> MatmulDesc {
        self.layouts[0] = Some(l);
        self
    }

    /// B's layout as stored.
    #[must_use]
    pub fn layout_b(mut self, l: MatrixLayout) -> MatmulDesc {
        self.layouts[1] = Some(l);
        self
    }

    /// C's layout.
    #[must_use]
    pub fn layout_c(mut self, l: MatrixLayout) -> MatmulDesc {
        self.layouts[2] = Some(l);
        self
    }

    /// D's layout (default: C's when C's is given).
    #[must_use]
    pub fn layout_d(mut self, l: MatrixLayout) -> MatmulDesc {
        self.layouts[3] = Some(l);
        self
    }

    /// A batch of `count` products, each operand packed one matrix after the
    /// other (for layouts not given explicitly). A count above cuBLASLt's
    /// `i32::MAX` is refused by the check.
    #[must_use]
    pub fn batch(mut self, count: usize) -> MatmulDesc {
        self.batch = Some(count);
        self
    }

    /// The compute type (default f32); it sets the scale type.
    #[must_use]
    pub fn compute(mut self, c: ComputeType) -> MatmulDesc {
        self.compute = c;
        self
    }

    /// The epilogue (default none).
    #[must_use]
    pub fn epilogue(mut self, e: Epilogue) -> MatmulDesc {
        self.epilogue = e;
        self
    }

    /// The bias vector's element type (default: D's, or bf16 for an FP8 D).
    #[must_use]
    pub fn bias_type(mut self, t: DataType) -> MatmulDesc {
        self.bias_type = Some(t);
        self
    }

    /// Scale A (FP8 only) by a device f32 (or one per row of op(A)) given at
    /// each call.
    #[must_use]
    pub fn a_scale(mut self, mode: ScaleMode) -> MatmulDesc {
        self.scales[0] = Some(mode);
        self
    }

    /// Scale B (FP8 only) by a device f32 (or one per column of op(B)).
    #[must_use]
    pub fn b_scale(mut self, mode: ScaleMode) -> MatmulDesc {
        self.scales[1] = Some(mode);
        self
    }

    /// Scale C by a device f32 given at each call (FP8 output only).
    #[must_use]
    pub fn c_scale(mut self) -> MatmulDesc {
        self.c_scale = true;
        self
    }

    /// Scale D by a device f32 given at each call (FP8 output only).
    #[must_use]
    pub fn d_scale(mut self) -> MatmulDesc {
        self.d_scale = true;
        self
    }

    /// The most workspace the algorithm may use (default and at most: the
    /// handle's workspace size).
    #[must_use]
    pub fn workspace_limit(mut self, bytes: usize) -> MatmulDesc {
        self.workspace_limit = Some(bytes);
        self
    }

    /// The alignment in bytes every operand's address will have (a power of
    /// two from the largest element size to 256; at least 16 for FP8; default
    /// 16). The algorithm is chosen for it, and each call checks it.
    #[must_use]
    pub fn alignment(mut self, bytes: usize) -> MatmulDesc {
        self.alignment = bytes;
        self
    }

    /// How a split-K algorithm may add its partial sums (default
    /// [`Reduction::Exact`]: in the compute type, rounded to D's type once).
    #[must_use]
    pub fn reduction(mut self, r: Reduction) -> MatmulDesc {
        self.reduction = r;
        self
    }

    /// Check every rule; the checked problem, or what is wrong.
    ///
    /// # Errors
    /// The first broken rule, naming the operand, what was expected and what
    /// was given.
    pub fn check(&self) -> std::result::Result<Problem, String> {
        let (m, n, k) = (self.m, self.n, self.k);
        if m == 0 || n == 0 || k == 0 {
            return Err(format!("m, n and k must be at least 1; got {m}x{n}x{k}"));
        }
        let batch = self.batch.unwrap_or(1);
        if batch == 0 {
            return Err("the batch count must be at least 1".into());
        }
        if batch > i32::MAX as usize {
            return Err(format!(
                "the batch count {batch} is above cuBLASLt's limit (i32::MAX = {})",
                i32::MAX
            ));
        }
        let batch = narrow(batch);
        let [ta, tb] = self.trans;
        let stored = [
            if ta.is_transposed() { (k, m) } else { (m, k) },
            if tb.is_transposed() { (n, k) } else { (k, n) },
            (m, n),
            (m, n),
        ];
        let mut layouts = [MatrixLayout::col_major(1, 1); 4];
        for i in 0..4 {
            let given = self.layouts[i].or(if i == 3 { self.layouts[2] } else { None });
            layouts[i] = match given {
                Some(l) => l,
                None => {
                    let (r, c) = stored[i];
                    let stride = if batch > 1 { r.saturating_mul(c) } else { 0 };
                    MatrixLayout {
                        rows: r,
                        cols: c,
                        ld: r,
                        batch_count: batch,
                        batch_stride: stride,
                        ..MatrixLayout::col_major(1, 1)
                    }
                }
            };
        }
        for (i, l) in layouts.iter().enumerate() {
            let op = OPERANDS[i];
            let (r, c) = stored[i];
            if (l.rows, l.cols) != (r, c) {
                return Err(format!(
                    "operand {op}: expected {r}x{c} as stored (m={m}, n={n}, k={k}{}), got {}x{}",
                    match i {
                        0 if ta.is_transposed() => ", A transposed",
                        1 if tb.is_transposed() => ", B transposed",
                        _ => "",
                    },
                    l.rows,
                    l.cols
                ));
            }
            if let Some(p) = l.ld_problem() {
                return Err(format!("operand {op}: {p}"));
            }
            if l.batch_count != layouts[3].batch_count {
                return Err(format!(
                    "operand {op}: batch count {} differs from D's {}",
                    l.batch_count, layouts[3].batch_count
                ));
            }
            if l.batch_count == 0 {
                return Err(format!("operand {op}: the batch count must be at least 1"));
            }
            if l.required_len().is_none()
                || l.ld > i64::MAX as u64
                || l.batch_stride > i64::MAX as u64
                || l.batch_count > i32::MAX as u32
            {
                return Err(format!(
                    "operand {op}: layout {l} is more than cuBLASLt holds (a leading \
                     dimension or batch stride above i64::MAX, a batch count above \
                     i32::MAX, or a required length above u64::MAX elements)"
                ));
            }
        }
        let d = layouts[3];
        if d.batch_count > 1 {
            let extent = d.extent().unwrap_or(u64::MAX);
            if d.batch_stride < extent {
                return Err(format!(
                    "operand D: batch stride {} is less than one matrix's extent ({extent}): \
                     the batches would overlap",
                    d.batch_stride
                ));
            }
        }
        self.check_types()?;
        let bias_type = self.check_epilogue()?;
        self.check_scales()?;
        let largest = self.types.iter().map(|t| t.size()).max().unwrap_or(1);
        let a = self.alignment;
        let fp8 = self.types[0].is_fp8() || self.types[1].is_fp8();
        if !a.is_power_of_two() || a < largest || a > 256 || (fp8 && a < 16) {
            return Err(format!(
                "alignment {a} must be a power of two from {} to 256",
                if fp8 { 16 } else { largest }
            ));
        }
        if fp8 {
            check_fp8_leading_dimensions(&layouts, &self.types)?;
        }
        Ok(Problem {
            m,
            n,
            k,
            types: self.types,
            compute: self.compute,
            trans: self.trans,
            layouts,
            epilogue: self.epilogue,
            bias_type,
            scales: self.scales,
            c_scale: self.c_scale,
            d_scale: self.d_scale,
            workspace_limit: self.workspace_limit,
            alignment: a,
            reduction: self.reduction,
            lens: layouts.map(|l| l.required_len().unwrap_or(u64::MAX)),
            extras: self.epilogue.has_bias()
                || self.scales.iter().any(Option::is_some)
                || self.c_scale
                || self.d_scale,
        })
    }

    /// The element-type combinations metrale offers (a subset of cuBLASLt's).
    fn check_types(&self) -> std::result::Result<(), String> {
        use DataType::{Bf16, Fp8E4M3, Fp8E5M2, F16, F32};
        let [a, b, c, d] = self.types;
        let compute = self.compute;
        let ok = match (a, b) {
            (F32, F32) => c == F32 && d == F32,
            (F16, F16) if compute == ComputeType::F16 => c == F16 && d == F16,
            (F16, F16) => (c == F16 || c == F32) && c == d,
            (Bf16, Bf16) => (c == Bf16 || c == F32) && c == d,
            (Fp8E4M3 | Fp8E5M2, Fp8E4M3 | Fp8E5M2) if !(a == Fp8E5M2 && b == Fp8E5M2) => match d {
                F16 | Bf16 | F32 => c == d,
                Fp8E4M3 | Fp8E5M2 => c == F16 || c == Bf16,
            },
            _ => false,
        };
        if !ok {
            return Err(format!(
                "element types A {}, B {}, C {}, D {} are not a combination cuBLASLt offers \
                 (f32; f16 or bf16 with C = D of the same type or f32; FP8 A and B, not both \
                 e5m2, with C = D f16, bf16 or f32, or an FP8 D with an f16 or bf16 C)",
                a.name(),
                b.name(),
                c.name(),
                d.name()
            ));
        }
        let compute_ok = match compute {
            ComputeType::F32 => true,
            ComputeType::Tf32 | ComputeType::F32FastF16 | ComputeType::F32FastBf16 => a == F32,
            ComputeType::F16 => a == F16,
        };
        if !compute_ok {
            return Err(format!(
                "compute type {compute:?} does not take {} matrices",
                a.name()
            ));
        }
        Ok(())
    }

    /// The bias type, when the epilogue has a bias.
    fn check_epilogue(&self) -> std::result::Result<Option<DataType>, String> {
        let d = self.types[3];
        if !self.epilogue.has_bias() {
            return match self.bias_type {
                Some(_) => Err(format!(
                    "a bias type was given, but epilogue {:?} has no bias",
                    self.epilogue
                )),
                None => Ok(None),
            };
        }
        let default = if d.is_fp8() { DataType::Bf16 } else { d };
        let t = self.bias_type.unwrap_or(default);
        let ok = if d.is_fp8() {
            matches!(t, DataType::Bf16 | DataType::F16)
        } else {
            t == d || (t == DataType::F32 && d != DataType::F32 && self.types[0].is_fp8())
        };
        if !ok {
            return Err(format!(
                "the bias type {} does not go with D {} (the bias is of D's type, or f16/bf16 \
                 for an FP8 D)",
                t.name(),
                d.name()
            ));
        }
        Ok(Some(t))
    }

    fn check_scales(&self) -> std::result::Result<(), String> {
        for (i, s) in self.scales.iter().enumerate() {
            if s.is_some() && !self.types[i].is_fp8() {
                return Err(format!(
                    "operand {}: a scale is only for FP8 operands, and it is {}",
                    OPERANDS[i],
                    self.types[i].name()
                ));
            }
        }
        let d = self.types[3];
        if (self.c_scale || self.d_scale) && !d.is_fp8() {
            return Err(format!(
                "{} scale is only for an FP8 output, and D is {}",
                if self.d_scale { "a D" } else { "a C" },
                d.name()
            ));
        }
        Ok(())
    }
}

/// cuBLASLt's FP8 kernels (Hopper's, and Ada's) take an FP8 matrix only when
/// its leading dimension is a multiple of 16 bytes: refused here, naming the
/// rule, rather than left to the heuristic (which answers
/// `CUBLAS_STATUS_NOT_SUPPORTED`).
fn check_fp8_leading_dimensions(
    layouts: &[MatrixLayout; 4],
    types: &[DataType; 4],
) -> std::result::Result<(), String> {
    for (i, (l, t)) in layouts.iter().zip(types).enumerate() {
        if !t.is_fp8() {
            continue;
        }
        let bytes = l.ld.saturating_mul(t.size() as u64);
        if !bytes.is_multiple_of(16) {
            return Err(format!(
                "operand {}: an FP8 matrix's leading dimension must be a multiple of 16 bytes \
                 (cuBLASLt's FP8 kernels on Hopper and Ada take no other); layout {l}: its ld is \
                 {bytes} bytes (pad ld to a multiple of 16)",
                OPERANDS[i]
            ));
        }
    }
    Ok(())
}

impl Problem {
    /// A's layout as stored.
    pub fn a(&self) -> MatrixLayout {
        self.layouts[0]
    }

    /// D's layout.
    pub fn d(&self) -> MatrixLayout {
        self.layouts[3]
    }

    /// `(m, n, k)`.
    pub fn shape(&self) -> (u64, u64, u64) {
        (self.m, self.n, self.k)
    }

    /// The bias vector's length when the epilogue has one: `m`, one element per
    /// row of D.
    /// One vector serves every matrix of a batch (its batch stride is 0).
    pub fn bias_len(&self) -> Option<u64> {
        self.epilogue.has_bias().then_some(self.m)
    }

    /// The element types of A, B, C and D.
    pub fn types(&self) -> [DataType; 4] {
        self.types
    }

    /// How a split-K algorithm may add its partial sums.
    pub fn reduction(&self) -> Reduction {
        self.reduction
    }
}

impl fmt::Display for Problem {
    /// `64x32x128 bf16 x bf16 -> bf16 (A transposed, epilogue GeluBias) on ...`:
    /// what an error names as the plan.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d] = self.types;
        write!(
            f,
            "matmul {}x{}x{} {} x {} + {} -> {}",
            self.m,
            self.n,
            self.k,
            a.name(),
            b.name(),
            c.name(),
            d.name()
        )?;
        write!(f, ", compute {:?}", self.compute)?;
        if self.trans[0].is_transposed() {
            f.write_str(", A transposed")?;
        }
        if self.trans[1].is_transposed() {
            f.write_str(", B transposed")?;
        }
        if self.layouts[3].batch_count > 1 {
            write!(f, ", batch {}", self.layouts[3].batch_count)?;
        }
        if self.epilogue != Epilogue::None {
            write!(f, ", epilogue {:?}", self.epilogue)?;
        }
        for (i, s) in self.scales.iter().enumerate() {
            if let Some(s) = s {
                write!(f, ", {} scale {s:?}", OPERANDS[i])?;
            }
        }
        if let Some(w) = self.workspace_limit {
            write!(f, ", workspace limit {w} bytes")?;
        }
        if self.reduction != Reduction::Exact {
            write!(f, ", reduction {:?}", self.reduction)?;
        }
        Ok(())
    }
}
