//! cuBLASLt plans against raw `cublasLtMatmul` through the sys table, same
//! process, same algorithm (the plan's), interleaved GEMM by GEMM (the GPU
//! clocks down under its power cap after 20-30 ms of 8192^3 load, so blocks of
//! one path would be measured at another clock than the other's):
//! - submit cost of a planned 64^3 bf16 matmul;
//! - TFLOP/s at 4096^3 and 8192^3 in bf16, f16 and FP8 (e4m3, bf16 out);
//! - the plan-cache hit;
//! - a transformer layer's GEMMs (QKV, out, up, down; hidden 4096) at batch 1,
//!   16 and 256, replayed as one graph against the same four queued eagerly;
//! - `Blas::gemm_ex` against raw `cublasGemmEx` (64^3 bf16 submit).
//!
//! `cargo bench -p metrale-runtime --features cublas --bench cublas [-- --rounds N | --quick]`.
//! Without a GPU or the libraries it says so and exits with status 2.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::ffi::c_void;
use std::process::ExitCode;
use std::time::Instant;

use common::{header, line, ratios, rounds, time, Row};
use half::{bf16, f16};
use metrale_runtime::blas::{
    Blas, BlasElement, BlasLt, ComputeType, DataType, Fp8E4M3, GemmShape, MatmulDesc, MatmulExtras,
    MatmulPlan, ScaleMode, Transpose,
};
use metrale_runtime::sys::cublas::{
    self as raw, cublasComputeType_t, cublasGemmAlgo_t, cublasLtMatmulDescAttributes_t as Attr,
    cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasOperation_t, CUstream_st,
};
use metrale_runtime::{context, CudaEvent, CudaStream, DeviceBuffer, MetraleError};

/// The raw path's own descriptors of a plan's problem (column-major, A
/// transposed or not), its own workspace, and the plan's algorithm.
struct RawPlan {
    desc: cublasLtMatmulDesc_t,
    layouts: [cublasLtMatrixLayout_t; 4],
    algo: raw::cublasLtMatmulAlgo_t,
    ws: DeviceBuffer<u8>,
}

fn ok(st: raw::cublasStatus_t) {
    assert!(st.is_success(), "{st}");
}

impl RawPlan {
    #[allow(clippy::too_many_arguments)]
    fn new(
        s: &CudaStream,
        plan: &MatmulPlan,
        types: [DataType; 4],
        trans_a: bool,
        (m, n, k): (u64, u64, u64),
        scales: Option<(u64, u64)>,
    ) -> RawPlan {
        let lt = raw::cublas_lt().unwrap();
        let mut desc = std::ptr::null_mut();
        // SAFETY: plain descriptor and layout creation and attribute writes of
        // the documented types and sizes.
        unsafe {
            ok((lt.cublasLtMatmulDescCreate().unwrap())(
                &mut desc,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                raw::cudaDataType::CUDA_R_32F,
            ));
            let set = lt.cublasLtMatmulDescSetAttribute().unwrap();
            let t = if trans_a {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            };
            let t = t.0 as i32;
            ok(set(
                desc,
                Attr::CUBLASLT_MATMUL_DESC_TRANSA,
                std::ptr::from_ref(&t).cast(),
                4,
            ));
            if let Some((sa, sb)) = scales {
                let (pa, pb) = (sa as usize as *const c_void, sb as usize as *const c_void);
                ok(set(
                    desc,
                    Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                    std::ptr::from_ref(&pa).cast(),
                    8,
                ));
                ok(set(
                    desc,
                    Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    std::ptr::from_ref(&pb).cast(),
                    8,
                ));
            }
            let mut layouts = [std::ptr::null_mut(); 4];
            let stored = [
                if trans_a { (k, m) } else { (m, k) },
                (k, n),
                (m, n),
                (m, n),
            ];
            for i in 0..4 {
                let (r, c) = stored[i];
                ok((lt.cublasLtMatrixLayoutCreate().unwrap())(
                    &mut layouts[i],
                    types[i].raw(),
                    r,
                    c,
                    r as i64,
                ));
            }
            RawPlan {
                desc,
                layouts,
                algo: *plan.algo(),
                ws: DeviceBuffer::<u8>::alloc(s, 32 << 20).unwrap(),
            }
        }
    }

    /// One raw `cublasLtMatmul` (alpha 1, beta 0).
    fn matmul(
        &self,
        lt_handle: raw::cublasLtHandle_t,
        s: &CudaStream,
        a: u64,
        b: u64,
        c: u64,
        d: u64,
    ) {
        let f = raw::cublas_lt().unwrap().cublasLtMatmul().unwrap();
        let (alpha, beta) = (1.0f32, 0.0f32);
        let p = |x: u64| x as usize as *mut c_void;
        let [la, lb, lc, ld] = self.layouts;
        // SAFETY: buffers of the plan's sizes, this handle's descriptors and the
        // plan's algorithm, its own 32 MiB workspace, a live stream.
        ok(unsafe {
            f(
                lt_handle,
                self.desc,
                std::ptr::from_ref(&alpha).cast(),
                p(a),
                la,
                p(b),
                lb,
                std::ptr::from_ref(&beta).cast(),
                p(c),
                lc,
                p(d),
                ld,
                &self.algo,
                p(self.ws.device_ptr()),
                32 << 20,
                s.raw().cast::<CUstream_st>(),
            )
        });
    }
}

/// A, B, C, D of one problem, and the plan and raw plan for it.
struct Case<A: BlasElement, D: BlasElement> {
    a: DeviceBuffer<A>,
    b: DeviceBuffer<A>,
    c: DeviceBuffer<D>,
    d: DeviceBuffer<D>,
    plan: MatmulPlan,
    raw: RawPlan,
    scales: Option<(DeviceBuffer<f32>, DeviceBuffer<f32>)>,
}

fn case<A: BlasElement + Default, D: BlasElement + Default>(
    lt: &BlasLt,
    s: &CudaStream,
    (m, n, k): (u64, u64, u64),
    fp8: bool,
) -> Result<Case<A, D>, MetraleError> {
    let mut desc = MatmulDesc::new::<A, A, D, D>(m as usize, n as usize, k as usize);
    if fp8 {
        desc = desc
            .transpose_a(Transpose::Yes)
            .a_scale(ScaleMode::Tensor)
            .b_scale(ScaleMode::Tensor);
    }
    let plan = lt.plan(&desc)?;
    let scales = if fp8 {
        Some((
            DeviceBuffer::from_host(s, &[1.0f32])?,
            DeviceBuffer::from_host(s, &[1.0f32])?,
        ))
    } else {
        None
    };
    let types = [A::DATA_TYPE, A::DATA_TYPE, D::DATA_TYPE, D::DATA_TYPE];
    let raw_scales = scales
        .as_ref()
        .map(|(a, b)| (a.device_ptr(), b.device_ptr()));
    let raw = RawPlan::new(s, &plan, types, fp8, (m, n, k), raw_scales);
    let (mk, kn, mn) = ((m * k) as usize, (k * n) as usize, (m * n) as usize);
    let mut a = DeviceBuffer::<A>::alloc(s, mk)?;
    let mut b = DeviceBuffer::<A>::alloc(s, kn)?;
    s.memset_u8(&mut a, 0x3c)?;
    s.memset_u8(&mut b, 0x3c)?;
    Ok(Case {
        a,
        b,
        c: DeviceBuffer::<D>::zeroed(s, mn)?,
        d: DeviceBuffer::<D>::zeroed(s, mn)?,
        plan,
        raw,
        scales,
    })
}

impl<A: BlasElement, D: BlasElement> Case<A, D> {
    fn ours(&mut self, s: &CudaStream) {
        let extras = match &self.scales {
            Some((sa, sb)) => MatmulExtras::new().a_scale(sa).b_scale(sb),
            None => MatmulExtras::new(),
        };
        self.plan
            .matmul_with(s, 1.0, &self.a, &self.b, 0.0, &self.c, &mut self.d, extras)
            .unwrap();
    }

    fn raw(&self, lt: &BlasLt, s: &CudaStream) {
        self.raw.matmul(
            lt.raw(),
            s,
            self.a.device_ptr(),
            self.b.device_ptr(),
            self.c.device_ptr(),
            self.d.device_ptr(),
        );
    }
}

/// TFLOP/s of each path, GEMM by GEMM (events around each), alternating.
fn throughput<A: BlasElement, D: BlasElement>(
    lt: &BlasLt,
    s: &CudaStream,
    c: &mut Case<A, D>,
    flops: f64,
    n: usize,
) -> Result<(Row, Row), MetraleError> {
    let ctx = s.context();
    let events: Vec<CudaEvent> = (0..4)
        .map(|_| CudaEvent::timed(ctx))
        .collect::<Result<_, _>>()?;
    let (mut ours, mut base) = (Row::default(), Row::default());
    for i in 0..n {
        let raw_first = i % 2 == 0;
        for j in 0..2 {
            let raw_turn = (j == 0) == raw_first;
            events[2 * j].record(s)?;
            if raw_turn {
                c.raw(lt, s);
            } else {
                c.ours(s);
            }
            events[2 * j + 1].record(s)?;
        }
        s.synchronize()?;
        for j in 0..2 {
            let ms = f64::from(events[2 * j].elapsed_ms(&events[2 * j + 1])?);
            let tflops = flops / (ms * 1e-3) / 1e12;
            if (j == 0) == raw_first {
                base.push(tflops);
            } else {
                ours.push(tflops);
            }
        }
    }
    Ok((ours, base))
}

fn run() -> Result<(), MetraleError> {
    let ctx = context(0)?;
    let s = CudaStream::new(&ctx)?;
    let lt = BlasLt::new(&ctx)?;
    let lib = raw::cublas_lt().unwrap();
    println!(
        "cuBLASLt {:?} from {}, device 0 ({})",
        lib.version(),
        lib.path(),
        ctx.device_name()
    );
    let n_rounds = rounds(15, 3);
    let quick = common::is_quick();

    // Submit cost: 64^3 bf16, 1000 calls per sample, paths taking turns.
    let calls = if quick { 200 } else { 1000 };
    let mut small = case::<bf16, bf16>(&lt, &s, (64, 64, 64), false)?;
    small.ours(&s);
    small.raw(&lt, &s);
    s.synchronize()?;
    let (mut ours, mut base) = (Row::default(), Row::default());
    for round in 0..n_rounds {
        for k in 0..2 {
            if (round + k) % 2 == 0 {
                base.push(
                    time(|| (0..calls).for_each(|_| small.raw(&lt, &s))) * 1e6 / calls as f64,
                );
            } else {
                ours.push(time(|| (0..calls).for_each(|_| small.ours(&s))) * 1e6 / calls as f64);
            }
            s.synchronize()?;
        }
    }
    header("64^3 bf16 matmul, submit cost per call");
    line(
        "raw cublasLtMatmul (sys table, plan's algorithm)",
        &base,
        "us",
        None,
    );
    line(
        "MatmulPlan::matmul",
        &ours,
        "us",
        Some(&ratios(&ours, &base)),
    );

    // Plain cuBLAS submit: gemm_ex vs raw cublasGemmEx.
    let plain = Blas::new(&ctx)?;
    let raw_gemm = raw::cublas().unwrap().cublasGemmEx().unwrap();
    let raw_handle = {
        let mut h = std::ptr::null_mut();
        // SAFETY: writes one handle; device 0's context is current (bound above).
        ok(unsafe { (raw::cublas().unwrap().cublasCreate_v2().unwrap())(&mut h) });
        // SAFETY: a live handle and stream.
        ok(unsafe { (raw::cublas().unwrap().cublasSetStream_v2().unwrap())(h, s.raw().cast()) });
        h
    };
    let mut cd = DeviceBuffer::<bf16>::zeroed(&s, 64 * 64)?;
    let shape = GemmShape::new(64, 64, 64);
    let (pa, pb, pc) = (small.a.device_ptr(), small.b.device_ptr(), cd.device_ptr());
    let raw_call = || {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: 64x64 bf16 buffers, a live handle on this stream.
        ok(unsafe {
            raw_gemm(
                raw_handle,
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_N,
                64,
                64,
                64,
                std::ptr::from_ref(&alpha).cast(),
                pa as usize as *const c_void,
                raw::cudaDataType::CUDA_R_16BF,
                64,
                pb as usize as *const c_void,
                raw::cudaDataType::CUDA_R_16BF,
                64,
                std::ptr::from_ref(&beta).cast(),
                pc as usize as *mut c_void,
                raw::cudaDataType::CUDA_R_16BF,
                64,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        });
    };
    let (mut ours, mut base) = (Row::default(), Row::default());
    for round in 0..n_rounds {
        for k in 0..2 {
            if (round + k) % 2 == 0 {
                base.push(time(|| (0..calls).for_each(|_| raw_call())) * 1e6 / calls as f64);
            } else {
                ours.push(
                    time(|| {
                        for _ in 0..calls {
                            plain
                                .gemm_ex(
                                    &s,
                                    &shape,
                                    1.0,
                                    &small.a,
                                    &small.b,
                                    0.0,
                                    &mut cd,
                                    ComputeType::F32,
                                )
                                .unwrap();
                        }
                    }) * 1e6
                        / calls as f64,
                );
            }
            s.synchronize()?;
        }
    }
    header("64^3 bf16 gemm_ex, submit cost per call");
    line("raw cublasGemmEx (sys table)", &base, "us", None);
    line("Blas::gemm_ex", &ours, "us", Some(&ratios(&ours, &base)));

    // Plan-cache hit.
    let desc = MatmulDesc::new::<bf16, bf16, bf16, bf16>(64, 64, 64);
    let hits = if quick { 10_000 } else { 100_000 };
    let mut hit = Row::default();
    for _ in 0..n_rounds {
        let t = Instant::now();
        for _ in 0..hits {
            std::hint::black_box(lt.plan(std::hint::black_box(&desc)).unwrap());
        }
        hit.push(t.elapsed().as_secs_f64() * 1e9 / f64::from(hits));
    }
    header("plan-cache hit (BlasLt::plan of a planned problem)");
    line("BlasLt::plan, hit", &hit, "ns", None);

    // Throughput, GEMM by GEMM.
    let sizes: &[u64] = if quick { &[4096] } else { &[4096, 8192] };
    let per = if quick { 6 } else { 20 };
    for &n in sizes {
        let flops = 2.0 * (n as f64).powi(3);
        header(&format!(
            "{n}^3 matmul, TFLOP/s (higher is better), GEMM by GEMM"
        ));
        let mut bf = case::<bf16, bf16>(&lt, &s, (n, n, n), false)?;
        let (o, b) = throughput(&lt, &s, &mut bf, flops, per)?;
        line("raw cublasLtMatmul bf16", &b, "TF", None);
        line("MatmulPlan bf16", &o, "TF", Some(&ratios(&o, &b)));
        drop(bf);
        let mut hf = case::<f16, f16>(&lt, &s, (n, n, n), false)?;
        let (o, b) = throughput(&lt, &s, &mut hf, flops, per)?;
        line("raw cublasLtMatmul f16", &b, "TF", None);
        line("MatmulPlan f16", &o, "TF", Some(&ratios(&o, &b)));
        drop(hf);
        let mut f8 = case::<Fp8E4M3, bf16>(&lt, &s, (n, n, n), true)?;
        let (o, b) = throughput(&lt, &s, &mut f8, flops, per)?;
        line("raw cublasLtMatmul fp8 e4m3 -> bf16", &b, "TF", None);
        line(
            "MatmulPlan fp8 e4m3 -> bf16",
            &o,
            "TF",
            Some(&ratios(&o, &b)),
        );
    }

    // A transformer layer's GEMMs: weights (out x in) transposed, activations
    // (in x batch); hidden 4096, MLP 16384.
    header("transformer layer GEMMs (QKV, out, up, down; hidden 4096), us per step");
    let h = 4096usize;
    for batch in [1usize, 16, 256] {
        let shapes = [
            (3 * h, batch, h),
            (h, batch, h),
            (4 * h, batch, h),
            (h, batch, 4 * h),
        ];
        let mut cases = Vec::new();
        for &(m, n, k) in &shapes {
            let plan = lt.plan(
                &MatmulDesc::new::<bf16, bf16, bf16, bf16>(m, n, k).transpose_a(Transpose::Yes),
            )?;
            let w = DeviceBuffer::<bf16>::zeroed(&s, m * k)?;
            let x = DeviceBuffer::<bf16>::zeroed(&s, k * n)?;
            let c = DeviceBuffer::<bf16>::zeroed(&s, m * n)?;
            let d = DeviceBuffer::<bf16>::zeroed(&s, m * n)?;
            cases.push((plan, w, x, c, d));
        }
        let mut step = |st: &CudaStream| -> metrale_runtime::Result<()> {
            for (plan, w, x, c, d) in &mut cases {
                plan.matmul(st, 1.0, w, x, 0.0, c, d)?;
            }
            Ok(())
        };
        step(&s)?;
        s.synchronize()?;
        let graph = s.capture(&mut step)?;
        let exec = graph.instantiate()?;
        let (mut eager, mut replay) = (Row::default(), Row::default());
        for _ in 0..n_rounds {
            eager.push(
                time(|| {
                    step(&s).unwrap();
                    s.synchronize().unwrap();
                }) * 1e6,
            );
            replay.push(
                time(|| {
                    // SAFETY: the buffers the graph uses are alive and not borrowed.
                    unsafe { exec.launch(&s) }.unwrap();
                    s.synchronize().unwrap();
                }) * 1e6,
            );
        }
        line(
            &format!("batch {batch}: eager (4 matmuls + sync)"),
            &eager,
            "us",
            None,
        );
        line(
            &format!("batch {batch}: graph replay (+ sync)"),
            &replay,
            "us",
            Some(&ratios(&replay, &eager)),
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cublas bench: {e}");
            ExitCode::from(2)
        }
    }
}
