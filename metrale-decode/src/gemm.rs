//! The step's GEMMs: how each runs (a cuBLASLt plan or the engine's batch-1
//! GEMV), the set of them for one batch, and the two calls the step makes.
//!
//! Invariant: a [`Plans`] is made before any step (checked plans, no
//! heuristic in a step), and its choice is fixed for the engine's life, so
//! every session and mode of an engine runs the same algorithms.

use metrale_runtime::blas::{BlasLt, MatmulDesc, MatmulExtras, MatmulPlan, Transpose};
use metrale_runtime::half::bf16;
use metrale_runtime::{CudaStream, DeviceBuffer, DeviceSliceMut, LaunchConfig};

use crate::config::Config;
use crate::error::Result;
use crate::kernels::{Kernels, GEMV_ROWS};

/// How one GEMM of a step runs.
#[derive(Debug, Clone)]
pub enum Gemm {
    /// A cuBLASLt plan: `y = x W^T` as cuBLASLt sees it, column-major D (out x
    /// B) = op(A) B with A = W stored (in x out), transposed.
    Lt(MatmulPlan),
    /// The engine's batch-1 GEMV kernel (`gemv_*` in `kernels.cu`); for the
    /// gate|up GEMM it also applies SiLU(gate) * up.
    Gemv,
}

impl Gemm {
    /// `lt` (cuBLASLt, with the heuristic's rank of its algorithm) or `gemv`.
    pub fn describe(&self) -> &'static str {
        match self {
            Gemm::Lt(_) => "cublasLt",
            Gemm::Gemv => "gemv",
        }
    }
}

/// The GEMMs of one batch size.
#[derive(Debug, Clone)]
pub struct Plans {
    /// h `[B, H]` to qkv.
    pub qkv: Gemm,
    /// o `[B, Hq D]` to x, accumulated (beta 1: the residual).
    pub o: Gemm,
    /// h to gate|up (or, with the GEMV, straight to act).
    pub gate_up: Gemm,
    /// act `[B, I]` to x, accumulated.
    pub down: Gemm,
    /// h to logits.
    pub lm_head: Gemm,
}

impl Plans {
    /// `qkv=gemv o=cublasLt ...`: which implementation each GEMM uses.
    pub fn describe(&self) -> String {
        format!(
            "qkv={} o={} gate_up={} down={} lm_head={}",
            self.qkv.describe(),
            self.o.describe(),
            self.gate_up.describe(),
            self.down.describe(),
            self.lm_head.describe()
        )
    }

    /// The plans of batch `b` (cached by the handle: equal problems share one).
    pub fn new(blas: &BlasLt, cfg: &Config, b: usize) -> Result<Plans> {
        let plan = |out: usize, inp: usize| -> Result<Gemm> {
            let desc =
                MatmulDesc::new::<bf16, bf16, bf16, bf16>(out, b, inp).transpose_a(Transpose::Yes);
            Ok(Gemm::Lt(blas.plan(&desc)?))
        };
        let h = cfg.hidden;
        Ok(Plans {
            qkv: plan(cfg.qkv_rows(), h)?,
            o: plan(h, cfg.heads * cfg.head_dim)?,
            gate_up: plan(2 * cfg.ffn, h)?,
            down: plan(h, cfg.ffn)?,
            lm_head: plan(cfg.vocab, h)?,
        })
    }
}

/// `y = x W^T` for the first rows of x (`y += ...` when `residual`), W
/// `[n, k]`, with the GEMM `g` chose.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn run_gemm(
    s: &CudaStream,
    kernels: &Kernels,
    g: &Gemm,
    w: &DeviceBuffer<bf16>,
    x: &DeviceSliceMut<'_, bf16>,
    y: &mut DeviceSliceMut<'_, bf16>,
    n: usize,
    k: usize,
    residual: bool,
    pdl: bool,
) -> metrale_runtime::Result<()> {
    match g {
        Gemm::Lt(p) => {
            let beta = if residual { 1.0 } else { 0.0 };
            p.matmul_in_place(s, 1.0, w, x, beta, y, MatmulExtras::new())
        }
        Gemm::Gemv => {
            let f = if residual {
                &kernels.gemv_residual
            } else {
                &kernels.gemv_store
            };
            let cfg = LaunchConfig::new(
                (n.div_ceil(GEMV_ROWS) as u32, 1, 1),
                (32 * GEMV_ROWS as u32, 1, 1),
                0,
            )?
            .with_programmatic_serialization(pdl);
            // SAFETY: gemv_*(const bf16* W, const bf16* x, bf16* y, int N, int K)
            // reads W [N, K] and x [K], writes y [N]: W is n x k, x holds at
            // least k elements and y at least n (row 0 of a batch of one).
            unsafe { s.launch(f, cfg, (w, x, y, n as i32, k as i32)) }
        }
    }
}

/// gate|up then SiLU(gate) * up into `act`: one GEMV, or a GEMM into `gu`
/// and the `silu_mul` kernel (`silu`: its shape for the batch).
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn run_gate_up(
    s: &CudaStream,
    kernels: &Kernels,
    g: &Gemm,
    w: &DeviceBuffer<bf16>,
    h: &DeviceSliceMut<'_, bf16>,
    gu: &mut DeviceSliceMut<'_, bf16>,
    act: &mut DeviceSliceMut<'_, bf16>,
    ffn: usize,
    hidden: usize,
    silu: LaunchConfig,
    pdl: bool,
) -> metrale_runtime::Result<()> {
    match g {
        Gemm::Gemv => {
            let cfg = LaunchConfig::new(
                (ffn.div_ceil(GEMV_ROWS) as u32, 1, 1),
                (32 * GEMV_ROWS as u32, 1, 1),
                0,
            )?
            .with_programmatic_serialization(pdl);
            // SAFETY: gemv_silu reads W [2N, K] and x [K], writes y [N]: the
            // gate|up weight is 2 ffn x hidden, h holds hidden, act ffn.
            unsafe {
                s.launch(
                    &kernels.gemv_silu,
                    cfg,
                    (w, h, act, ffn as i32, hidden as i32),
                )
            }
        }
        Gemm::Lt(p) => {
            p.matmul_in_place(s, 1.0, w, h, 0.0, gu, MatmulExtras::new())?;
            // SAFETY: silu_mul(const bf16* gu, bf16* act, int I) over the
            // batch's rows of gu [B, 2I] and act [B, I].
            unsafe { s.launch(&kernels.silu_mul, silu, (&*gu, act, ffn as i32)) }
        }
    }
}

/// The `silu_mul` shape of a batch.
pub(crate) fn silu_config(cfg: &Config, b: usize) -> metrale_runtime::Result<LaunchConfig> {
    let i8 = (cfg.ffn / 8) as u32;
    LaunchConfig::new((i8.div_ceil(256), b as u32, 1), (256, 1, 1), 0)
}
