//! [`MatmulPlan`]: a checked problem, its cuBLASLt descriptors and the
//! algorithm the heuristic chose once; and its `matmul`, which checks every
//! buffer against the plan before `cublasLtMatmul` is called.
//!
//! Invariants:
//! - The descriptors and the algorithm never change after the build, except
//!   the per-call pointer attributes (bias, FP8 scales), which are set under
//!   the plan's lock and used under it, so two threads never see each
//!   other's pointers.
//! - A call reaches cuBLASLt only after every rule of [`check`] held, with the
//!   stream's own workspace, made outside capture.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use metrale_cuda_sys::cublas::{
    cublasLtMatmulAlgo_t, cublasLtMatmulDescAttributes_t as DescAttr, cublasLtMatmulDesc_t,
    cublasLtMatmulHeuristicResult_t, cublasLtMatmulPreferenceAttributes_t as PrefAttr,
    cublasLtMatmulPreference_t, cublasLtMatrixLayoutAttribute_t as LayoutAttr,
    cublasLtMatrixLayout_t, cudaStream_t, CUstream_st, CublasLt,
};

use crate::error::Result;
use crate::memory::{note_use, DeviceMemory, DeviceMemoryMut};

use super::check::{check, MatmulExtras, Operand};
use crate::stream::CudaStream;

use super::core::LtCore;
use super::error::{into_error, BlasError};
use super::plan::{Problem, ScaleMode};
use super::{scale_bytes, BlasElement, Order};

/// The cuBLASLt objects of a plan, destroyed when it goes.
struct Descs {
    lib: &'static CublasLt,
    desc: cublasLtMatmulDesc_t,
    layouts: [cublasLtMatrixLayout_t; 4],
}

impl Drop for Descs {
    fn drop(&mut self) {
        // Host-side objects: destroying them needs no context.
        if !self.desc.is_null() {
            if let Ok(f) = self.lib.cublasLtMatmulDescDestroy() {
                // SAFETY: made by cublasLtMatmulDescCreate, destroyed once.
                let _ = unsafe { f(self.desc) };
            }
        }
        for &l in &self.layouts {
            if !l.is_null() {
                if let Ok(f) = self.lib.cublasLtMatrixLayoutDestroy() {
                    // SAFETY: made by cublasLtMatrixLayoutCreate, destroyed once.
                    let _ = unsafe { f(l) };
                }
            }
        }
    }
}

/// What a plan shares among its clones.
pub(crate) struct PlanInner {
    core: Arc<LtCore>,
    problem: Problem,
    descs: Descs,
    algo: cublasLtMatmulAlgo_t,
    algo_workspace: usize,
    /// The pointer attributes last set on the descriptor (bias, A/B/C/D
    /// scales); held across the set and the matmul.
    pointers: Mutex<[u64; 5]>,
}

// SAFETY: the descriptors are host objects written at build and afterwards
// only under `pointers`' lock (the per-call attributes) or read by cuBLASLt
// during a call made under that lock when the plan has per-call pointers;
// cuBLASLt lets any thread use them.
unsafe impl Send for PlanInner {}
// SAFETY: as for Send.
unsafe impl Sync for PlanInner {}

/// Set one attribute of a cuBLASLt descriptor: `f(obj, attr, &value, size)`.
macro_rules! set_attr {
    ($core:expr, $subject:expr, $fn:ident, $obj:expr, $attr:expr, $value:expr) => {{
        let value = $value;
        $core.call(
            stringify!($fn),
            || $subject,
            |lib| {
                let f = lib.$fn()?;
                // SAFETY: the object is live; the value is the attribute's type
                // and size, read during the call only.
                Ok(unsafe {
                    f(
                        $obj,
                        $attr,
                        std::ptr::from_ref(&value).cast::<c_void>(),
                        size_of_val(&value),
                    )
                })
            },
        )
    }};
}

impl PlanInner {
    /// Create the descriptors of `problem` and run the heuristic once.
    pub(crate) fn build(core: &Arc<LtCore>, problem: Problem) -> Result<PlanInner> {
        Self::build_nth(core, problem, 0)
    }

    /// [`PlanInner::build`] with the heuristic's `nth` choice (0: its best),
    /// `NoAlgorithm` when it offers fewer.
    pub(crate) fn build_nth(core: &Arc<LtCore>, problem: Problem, nth: usize) -> Result<PlanInner> {
        let subject = || format!("device {} {problem}", core.ctx.ordinal());
        let mut descs = Descs {
            lib: core.lib,
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 4],
        };
        let compute = problem.compute;
        core.call("cublasLtMatmulDescCreate", subject, |lib| {
            let f = lib.cublasLtMatmulDescCreate()?;
            // SAFETY: writes one descriptor.
            Ok(unsafe { f(&mut descs.desc, compute.raw(), compute.scale_type().raw()) })
        })?;
        let desc = descs.desc;
        for (attr, t) in [
            (DescAttr::CUBLASLT_MATMUL_DESC_TRANSA, problem.trans[0]),
            (DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, problem.trans[1]),
        ] {
            set_attr!(
                core,
                subject(),
                cublasLtMatmulDescSetAttribute,
                desc,
                attr,
                t.raw().0 as i32
            )?;
        }
        if problem.epilogue.raw() != 1 {
            set_attr!(
                core,
                subject(),
                cublasLtMatmulDescSetAttribute,
                desc,
                DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE,
                problem.epilogue.raw()
            )?;
        }
        if let Some(t) = problem.bias_type {
            set_attr!(
                core,
                subject(),
                cublasLtMatmulDescSetAttribute,
                desc,
                DescAttr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                t.raw().0 as i32
            )?;
        }
        for (attr, mode) in [
            (
                DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                problem.scales[0],
            ),
            (
                DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                problem.scales[1],
            ),
        ] {
            if mode == Some(ScaleMode::OuterVector) {
                set_attr!(
                    core,
                    subject(),
                    cublasLtMatmulDescSetAttribute,
                    desc,
                    attr,
                    mode.map_or(0, ScaleMode::raw)
                )?;
            }
        }
        for i in 0..4 {
            let l = problem.layouts[i];
            let ty = problem.types[i].raw();
            let slot = &mut descs.layouts[i];
            core.call("cublasLtMatrixLayoutCreate", subject, |lib| {
                let f = lib.cublasLtMatrixLayoutCreate()?;
                // SAFETY: writes one layout; the sizes were checked to fit.
                Ok(unsafe { f(slot, ty, l.rows, l.cols, l.ld as i64) })
            })?;
            let layout = descs.layouts[i];
            if l.order == Order::Row {
                set_attr!(
                    core,
                    subject(),
                    cublasLtMatrixLayoutSetAttribute,
                    layout,
                    LayoutAttr::CUBLASLT_MATRIX_LAYOUT_ORDER,
                    1i32
                )?;
            }
            if l.batch_count > 1 {
                set_attr!(
                    core,
                    subject(),
                    cublasLtMatrixLayoutSetAttribute,
                    layout,
                    LayoutAttr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    l.batch_count as i32
                )?;
                set_attr!(
                    core,
                    subject(),
                    cublasLtMatrixLayoutSetAttribute,
                    layout,
                    LayoutAttr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    l.batch_stride as i64
                )?;
            }
        }
        let (algo, algo_workspace) = heuristic(core, &problem, &descs, subject, nth)?;
        Ok(PlanInner {
            core: Arc::clone(core),
            problem,
            descs,
            algo,
            algo_workspace,
            pointers: Mutex::new([0; 5]),
        })
    }
}

/// The most algorithms [`BlasLt::plan_candidates`](super::BlasLt::plan_candidates) asks for.
pub(crate) const MAX_CANDIDATES: usize = 16;

/// Run the heuristic for `problem` once: its `nth` best algorithm (0: the
/// best) and the workspace it needs.
fn heuristic(
    core: &Arc<LtCore>,
    problem: &Problem,
    descs: &Descs,
    subject: impl Fn() -> String,
    nth: usize,
) -> Result<(cublasLtMatmulAlgo_t, usize)> {
    struct Pref(&'static CublasLt, cublasLtMatmulPreference_t);
    impl Drop for Pref {
        fn drop(&mut self) {
            if !self.1.is_null() {
                if let Ok(f) = self.0.cublasLtMatmulPreferenceDestroy() {
                    // SAFETY: made by cublasLtMatmulPreferenceCreate, destroyed once.
                    let _ = unsafe { f(self.1) };
                }
            }
        }
    }
    let mut pref = Pref(core.lib, std::ptr::null_mut());
    core.call("cublasLtMatmulPreferenceCreate", &subject, |lib| {
        let f = lib.cublasLtMatmulPreferenceCreate()?;
        // SAFETY: writes one preference.
        Ok(unsafe { f(&mut pref.1) })
    })?;
    let limit = problem.workspace_limit.unwrap_or(0) as u64;
    set_attr!(
        core,
        subject(),
        cublasLtMatmulPreferenceSetAttribute,
        pref.1,
        PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        limit
    )?;
    for attr in [
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
    ] {
        set_attr!(
            core,
            subject(),
            cublasLtMatmulPreferenceSetAttribute,
            pref.1,
            attr,
            problem.alignment as u32
        )?;
    }
    // Which split-K reductions the heuristic may choose (exact by default:
    // partial sums in the compute type only).
    set_attr!(
        core,
        subject(),
        cublasLtMatmulPreferenceSetAttribute,
        pref.1,
        PrefAttr::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
        problem.reduction.scheme_mask()
    )?;
    let mut results: [cublasLtMatmulHeuristicResult_t; MAX_CANDIDATES] =
        std::array::from_fn(|_| cublasLtMatmulHeuristicResult_t::default());
    let want = (nth + 1).min(MAX_CANDIDATES);
    let mut returned = 0i32;
    let [a, b, c, d] = descs.layouts;
    core.call("cublasLtMatmulAlgoGetHeuristic", &subject, |lib| {
        let f = lib.cublasLtMatmulAlgoGetHeuristic()?;
        // SAFETY: live handle, descriptors and preference; `want` result
        // slots (at most the array's length) for `want` algorithms asked.
        Ok(unsafe {
            f(
                core.raw,
                descs.desc,
                a,
                b,
                c,
                d,
                pref.1,
                want as i32,
                results.as_mut_ptr(),
                &mut returned,
            )
        })
    })?;
    let result = &results[nth.min(MAX_CANDIDATES - 1)];
    if returned <= nth as i32 || nth >= MAX_CANDIDATES || !result.state.is_success() {
        return Err(into_error(BlasError::NoAlgorithm { problem: subject() }));
    }
    Ok((result.algo, result.workspaceSize))
}

/// A matmul planned once: its checked problem, its cuBLASLt descriptors and
/// the algorithm the heuristic chose (feature `cublas`). Cloning is cheap.
///
/// Made by [`BlasLt::plan`](super::BlasLt::plan); see its example.
#[derive(Clone)]
pub struct MatmulPlan {
    inner: Arc<PlanInner>,
}

impl std::fmt::Debug for MatmulPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MatmulPlan")
            .field("problem", &self.inner.problem.to_string())
            .field("algo_workspace", &self.inner.algo_workspace)
            .finish_non_exhaustive()
    }
}

impl MatmulPlan {
    pub(crate) fn from_inner(inner: Arc<PlanInner>) -> MatmulPlan {
        MatmulPlan { inner }
    }

    /// The checked problem.
    pub fn problem(&self) -> &Problem {
        &self.inner.problem
    }

    /// The workspace the chosen algorithm needs, in bytes.
    pub fn algo_workspace(&self) -> usize {
        self.inner.algo_workspace
    }

    /// The chosen algorithm, as cuBLASLt describes it.
    pub fn algo(&self) -> &cublasLtMatmulAlgo_t {
        &self.inner.algo
    }

    /// Whether two plans are the same plan (one came from the cache).
    pub fn same_plan(&self, other: &MatmulPlan) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// `D = alpha * op(A) op(B) + beta * C` (then the epilogue) on `stream`,
    /// every buffer checked against the plan first.
    ///
    /// # Errors
    /// [`BlasError::Refused`] naming the operand, what was expected and what
    /// was given (a type, length, alignment, device, overlap or capture rule,
    /// or a bias or scale the plan needs); `cublasLtMatmul`'s failure.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul<A: BlasElement, B: BlasElement, C: BlasElement, D: BlasElement>(
        &self,
        stream: &CudaStream,
        alpha: f32,
        a: &impl DeviceMemory<A>,
        b: &impl DeviceMemory<B>,
        beta: f32,
        c: &impl DeviceMemory<C>,
        d: &mut impl DeviceMemoryMut<D>,
    ) -> Result<()> {
        self.matmul_with(stream, alpha, a, b, beta, c, d, MatmulExtras::new())
    }

    /// [`MatmulPlan::matmul`] with the epilogue's bias and the FP8 scales.
    ///
    /// # Errors
    /// As [`MatmulPlan::matmul`].
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_with<A: BlasElement, B: BlasElement, C: BlasElement, D: BlasElement>(
        &self,
        stream: &CudaStream,
        alpha: f32,
        a: &impl DeviceMemory<A>,
        b: &impl DeviceMemory<B>,
        beta: f32,
        c: &impl DeviceMemory<C>,
        d: &mut impl DeviceMemoryMut<D>,
        extras: MatmulExtras<'_>,
    ) -> Result<()> {
        let ops = [
            Operand::of(a),
            Operand::of(b),
            Operand::of(c),
            Operand::of(&*d),
        ];
        let inner = &*self.inner;
        check(
            &inner.problem,
            &inner.core.ctx,
            stream,
            &ops,
            &extras,
            false,
            "cublasLtMatmul",
        )?;
        note_use(a, stream)?;
        note_use(b, stream)?;
        note_use(c, stream)?;
        note_use(&*d, stream)?;
        extras.note_uses(stream)?;
        self.submit(stream, alpha, beta, &ops, &extras)
    }

    /// `D = alpha * op(A) op(B) + beta * D` in place: D is also C (the plan's
    /// C and D layouts and types must be equal).
    ///
    /// # Errors
    /// As [`MatmulPlan::matmul`].
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_in_place<A: BlasElement, B: BlasElement, D: BlasElement>(
        &self,
        stream: &CudaStream,
        alpha: f32,
        a: &impl DeviceMemory<A>,
        b: &impl DeviceMemory<B>,
        beta: f32,
        d: &mut impl DeviceMemoryMut<D>,
        extras: MatmulExtras<'_>,
    ) -> Result<()> {
        let dd = Operand::of(&*d);
        let ops = [Operand::of(a), Operand::of(b), dd, dd];
        let inner = &*self.inner;
        check(
            &inner.problem,
            &inner.core.ctx,
            stream,
            &ops,
            &extras,
            true,
            "cublasLtMatmul",
        )?;
        note_use(a, stream)?;
        note_use(b, stream)?;
        note_use(&*d, stream)?;
        extras.note_uses(stream)?;
        self.submit(stream, alpha, beta, &ops, &extras)
    }

    /// The checked call: the stream's workspace (held by a capture that
    /// records it), the per-call pointers, `cublasLtMatmul`.
    fn submit(
        &self,
        stream: &CudaStream,
        alpha: f32,
        beta: f32,
        ops: &[Operand<'_>; 4],
        extras: &MatmulExtras<'_>,
    ) -> Result<()> {
        let inner = &*self.inner;
        let core = &inner.core;
        let subject = || format!("device {} {}", core.ctx.ordinal(), inner.problem);
        let (_section, workspace) =
            core.workspaces
                .for_call(&core.ctx, stream, "cublasLtMatmul", subject)?;
        let (ws, ws_size) = if inner.algo_workspace == 0 {
            (std::ptr::null_mut(), 0)
        } else {
            (workspace.ptr(), workspace.size())
        };
        let scale = inner.problem.compute.scale_type();
        let (alpha, beta) = (scale_bytes(alpha, scale), scale_bytes(beta, scale));
        let [a, b, c, d] = ops.map(|o| o.ptr as usize as *mut c_void);
        let [la, lb, lc, ld] = inner.descs.layouts;
        let raw_stream: cudaStream_t = stream.raw().cast::<CUstream_st>();
        let wanted = [
            extras.bias.map_or(0, |o| o.ptr),
            extras.scales[0].map_or(0, |o| o.ptr),
            extras.scales[1].map_or(0, |o| o.ptr),
            extras.scales[2].map_or(0, |o| o.ptr),
            extras.scales[3].map_or(0, |o| o.ptr),
        ];
        let needs_pointers = extras.any && wanted.iter().any(|&p| p != 0);
        let _guard = if needs_pointers {
            let mut set = inner
                .pointers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            const ATTRS: [DescAttr; 5] = [
                DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                DescAttr::CUBLASLT_MATMUL_DESC_C_SCALE_POINTER,
                DescAttr::CUBLASLT_MATMUL_DESC_D_SCALE_POINTER,
            ];
            for i in 0..5 {
                if set[i] != wanted[i] {
                    let p = wanted[i] as usize as *const c_void;
                    set_attr!(
                        core,
                        subject(),
                        cublasLtMatmulDescSetAttribute,
                        inner.descs.desc,
                        ATTRS[i],
                        p
                    )?;
                    set[i] = wanted[i];
                }
            }
            Some(set)
        } else {
            None
        };
        core.call("cublasLtMatmul", subject, |lib| {
            let f = lib.cublasLtMatmul()?;
            // SAFETY: every buffer was checked against the plan's layouts
            // (length, type, alignment, device, overlap), the per-call pointers
            // too; the workspace is this stream's, at least the algorithm's
            // size, and lives until its work is done (freed by cuMemFree, which
            // waits, or held by the graph capturing it); alpha and beta are in
            // the scale type and read during the call (host pointer mode).
            Ok(unsafe {
                f(
                    core.raw,
                    inner.descs.desc,
                    alpha.as_ptr(),
                    a,
                    la,
                    b,
                    lb,
                    beta.as_ptr(),
                    c,
                    lc,
                    d,
                    ld,
                    &inner.algo,
                    ws,
                    ws_size,
                    raw_stream,
                )
            })
        })
    }
}
