//! cuBLASLt and cuBLAS on the real libraries (feature `cublas`): f32, TF32,
//! f16, bf16 and FP8 products against a host reference within stated
//! tolerances, every epilogue, strided batches, odd sizes (1x1x1 and
//! 4095x4097x33), a plan captured into a graph and replayed 100 times
//! bit-identical to eager, two streams at once with their own workspaces,
//! plain cuBLAS GEMMs (strided, grouped, device scalars), the refusals, and
//! bf16 at odd shapes within 1 ulp of a host reference (exact reductions by
//! default, issue 40 item 8).
//!
//! The libraries are found like any user's: `METRALE_LIBCUBLASLT_PATH` /
//! `METRALE_LIBCUBLAS_PATH`, else `libcublasLt.so.13` / `libcublas.so.13`
//! (a Python wheel's `site-packages/nvidia/cu13/lib`, or
//! `/usr/local/cuda/lib64` on the loader's path). Without them these tests
//! fail with the loader's message.

use half::{bf16, f16};
use metrale_runtime::blas::{
    Blas, BlasError, BlasLt, ComputeType, Epilogue, Fp8E4M3, GemmGroup, GemmShape, MatmulDesc,
    MatmulExtras, Reduction, ScaleMode, Transpose,
};

use crate::common::*;
use crate::harness::Test;

fn setup() -> (BlasLt, CudaStream) {
    let ctx = context(0).unwrap();
    let lt = BlasLt::new(&ctx).unwrap();
    eprintln!("    cuBLASLt {:?}", lt.version());
    (lt, CudaStream::new(&ctx).unwrap())
}

/// Small exact values: multiples of 1/4 in [-2, 2] (exact in bf16, f16 and
/// FP8 e4m3, and their products sum exactly in f32 for these sizes).
fn exact(n: usize, seed: u32) -> Vec<f32> {
    data(n, seed)
        .iter()
        .map(|x| ((x.abs() as i64 % 17) as f32 - 8.0) / 4.0)
        .collect()
}

/// `op(A) op(B)` element (i, j), column-major host matrices (A stored with `lda`).
#[allow(clippy::too_many_arguments)]
fn entry(
    a: &[f32],
    lda: usize,
    ta: bool,
    b: &[f32],
    ldb: usize,
    tb: bool,
    k: usize,
    i: usize,
    j: usize,
) -> (f64, f64) {
    let (mut s, mut mag) = (0.0f64, 0.0f64);
    for l in 0..k {
        let x = if ta { a[l + i * lda] } else { a[i + l * lda] };
        let y = if tb { b[j + l * ldb] } else { b[l + j * ldb] };
        s += f64::from(x) * f64::from(y);
        mag += f64::from(x.abs()) * f64::from(y.abs());
    }
    (s, mag)
}

/// Compare `got` (column-major m x n) with the reference at up to 4096
/// sampled entries: |err| <= tol * sum |a||b| + abs.
#[allow(clippy::too_many_arguments)]
fn compare(
    what: &str,
    got: &[f32],
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    (m, n, k): (usize, usize, usize),
    tol: f64,
    abs: f64,
) {
    let lda = if ta { k } else { m };
    let ldb = if tb { n } else { k };
    let total = m * n;
    let step = (total / 4096).max(1);
    let mut worst = 0.0f64;
    for idx in (0..total).step_by(step) {
        let (i, j) = (idx % m, idx / m);
        let (want, mag) = entry(a, lda, ta, b, ldb, tb, k, i, j);
        let err = (f64::from(got[idx]) - want).abs();
        worst = worst.max(err / (mag + 1e-30));
        assert!(
            err <= tol * mag + abs,
            "{what}: D[{i},{j}] = {} vs {want} (|err| {err:.3e}, allowed {:.3e})",
            got[idx],
            tol * mag + abs
        );
    }
    eprintln!("    {what}: worst relative error {worst:.2e} (allowed {tol:.0e})");
}

fn f32_and_tf32_match_the_host_within_tolerance() {
    let (lt, s) = setup();
    for (m, n, k) in [(1, 1, 1), (64, 48, 40), (4095, 4097, 33)] {
        let a = data(m * k, 1).iter().map(|x| x / 128.0).collect::<Vec<_>>();
        let b = data(k * n, 2).iter().map(|x| x / 128.0).collect::<Vec<_>>();
        let da = DeviceBuffer::from_host(&s, &a).unwrap();
        let db = DeviceBuffer::from_host(&s, &b).unwrap();
        let dc = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
        let mut dd = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
        // f32: 1e-5 of the magnitude sum (k roundings of 2^-24, any order);
        // TF32 (10-bit mantissa inputs): 2e-3.
        for (compute, tol) in [(ComputeType::F32, 1e-5), (ComputeType::Tf32, 2e-3)] {
            let plan = lt
                .plan(&MatmulDesc::new::<f32, f32, f32, f32>(m, n, k).compute(compute))
                .unwrap();
            plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd).unwrap();
            let got = s.to_vec(&dd).unwrap();
            compare(
                &format!("{compute:?} {m}x{n}x{k}"),
                &got,
                &a,
                false,
                &b,
                false,
                (m, n, k),
                tol,
                1e-6,
            );
        }
    }
}

fn f16_bf16_and_fp8_match_the_host_within_tolerance() {
    let (lt, s) = setup();
    let (m, n, k) = (256, 192, 128);
    let a = exact(m * k, 3);
    let b = exact(k * n, 4);
    let dc32 = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    let mut dd32 = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    // f16 in, f32 out: exact values, exact sums.
    let ha: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
    let hb: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
    let plan = lt
        .plan(&MatmulDesc::new::<f16, f16, f32, f32>(m, n, k))
        .unwrap();
    let (da, db) = (
        DeviceBuffer::from_host(&s, &ha).unwrap(),
        DeviceBuffer::from_host(&s, &hb).unwrap(),
    );
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc32, &mut dd32)
        .unwrap();
    compare(
        "f16 -> f32",
        &s.to_vec(&dd32).unwrap(),
        &a,
        false,
        &b,
        false,
        (m, n, k),
        0.0,
        0.0,
    );
    // bf16 in and out: the output rounded to 8 bits (2^-8 relative).
    let ba: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
    let bb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
    let plan = lt
        .plan(&MatmulDesc::new::<bf16, bf16, bf16, bf16>(m, n, k))
        .unwrap();
    let (da, db) = (
        DeviceBuffer::from_host(&s, &ba).unwrap(),
        DeviceBuffer::from_host(&s, &bb).unwrap(),
    );
    let dc = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
    let mut dd = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd).unwrap();
    let got: Vec<f32> = s.to_vec(&dd).unwrap().iter().map(|x| x.to_f32()).collect();
    compare(
        "bf16 -> bf16",
        &got,
        &a,
        false,
        &b,
        false,
        (m, n, k),
        1.0 / 256.0,
        0.0,
    );
    // FP8 e4m3, A transposed (TN, as Hopper's FP8 kernels want), scales
    // 0.5 and 2 (product 1), bf16 out.
    let to_fp8 = |x: f32| -> Fp8E4M3 {
        // Exact E4M3 bytes of the quarter steps in [-2, 2].
        let sign = if x < 0.0 { 0x80 } else { 0 };
        let v = x.abs();
        let byte = if v == 0.0 {
            0
        } else {
            let e = v.log2().floor() as i32;
            let mant = ((v / 2f32.powi(e) - 1.0) * 8.0).round() as u8;
            (((e + 7) as u8) << 3) | mant
        };
        Fp8E4M3(sign | byte)
    };
    let at: Vec<f32> = (0..k * m).map(|idx| a[(idx / k) + (idx % k) * m]).collect(); // k x m
    let fa: Vec<Fp8E4M3> = at.iter().map(|&x| to_fp8(x)).collect();
    let fb: Vec<Fp8E4M3> = b.iter().map(|&x| to_fp8(x)).collect();
    let plan = lt
        .plan(
            &MatmulDesc::new::<Fp8E4M3, Fp8E4M3, bf16, bf16>(m, n, k)
                .transpose_a(Transpose::Yes)
                .a_scale(ScaleMode::Tensor)
                .b_scale(ScaleMode::Tensor),
        )
        .unwrap();
    let (da, db) = (
        DeviceBuffer::from_host(&s, &fa).unwrap(),
        DeviceBuffer::from_host(&s, &fb).unwrap(),
    );
    let sa = DeviceBuffer::from_host(&s, &[0.5f32]).unwrap();
    let sb = DeviceBuffer::from_host(&s, &[2.0f32]).unwrap();
    plan.matmul_with(
        &s,
        1.0,
        &da,
        &db,
        0.0,
        &dc,
        &mut dd,
        MatmulExtras::new().a_scale(&sa).b_scale(&sb),
    )
    .unwrap();
    let got: Vec<f32> = s.to_vec(&dd).unwrap().iter().map(|x| x.to_f32()).collect();
    compare(
        "fp8 e4m3 -> bf16",
        &got,
        &at,
        true,
        &b,
        false,
        (m, n, k),
        1.0 / 256.0,
        0.0,
    );
}

fn every_epilogue_matches_the_host() {
    let (lt, s) = setup();
    let (m, n, k) = (128, 64, 64);
    let a = data(m * k, 5).iter().map(|x| x / 512.0).collect::<Vec<_>>();
    let b = data(k * n, 6).iter().map(|x| x / 512.0).collect::<Vec<_>>();
    let bias: Vec<f32> = (0..m).map(|i| (i as f32 - 64.0) / 16.0).collect();
    let da = DeviceBuffer::from_host(&s, &a).unwrap();
    let db = DeviceBuffer::from_host(&s, &b).unwrap();
    let dbias = DeviceBuffer::from_host(&s, &bias).unwrap();
    let dc = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    let gelu = |x: f64| 0.5 * x * (1.0 + (0.797_884_560_8 * (x + 0.044_715 * x * x * x)).tanh());
    for e in [
        Epilogue::Relu,
        Epilogue::Gelu,
        Epilogue::Bias,
        Epilogue::ReluBias,
        Epilogue::GeluBias,
    ] {
        let plan = lt
            .plan(&MatmulDesc::new::<f32, f32, f32, f32>(m, n, k).epilogue(e))
            .unwrap();
        let mut dd = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
        let extras = if e.has_bias() {
            MatmulExtras::new().bias(&dbias)
        } else {
            MatmulExtras::new()
        };
        plan.matmul_with(&s, 1.0, &da, &db, 0.0, &dc, &mut dd, extras)
            .unwrap();
        let got = s.to_vec(&dd).unwrap();
        for j in 0..n {
            for i in 0..m {
                let (p, mag) = entry(&a, m, false, &b, k, false, k, i, j);
                let x = if e.has_bias() {
                    p + f64::from(bias[i])
                } else {
                    p
                };
                let want = match e {
                    Epilogue::Relu | Epilogue::ReluBias => x.max(0.0),
                    Epilogue::Gelu | Epilogue::GeluBias => gelu(x),
                    _ => x,
                };
                // f32 products; cuBLASLt's GELU is its own approximation: 1e-3.
                let err = (f64::from(got[i + j * m]) - want).abs();
                assert!(
                    err <= 1e-3 * (mag + x.abs()) + 1e-5,
                    "{e:?} D[{i},{j}] {} vs {want}",
                    got[i + j * m]
                );
            }
        }
    }
}

fn strided_batches_match_each_product() {
    let (lt, s) = setup();
    let (m, n, k, batch) = (96, 80, 48, 6usize);
    let a = exact(m * k * batch, 7);
    let b = exact(k * n * batch, 8);
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(m, n, k).batch(batch))
        .unwrap();
    let da = DeviceBuffer::from_host(&s, &a).unwrap();
    let db = DeviceBuffer::from_host(&s, &b).unwrap();
    let dc = DeviceBuffer::<f32>::zeroed(&s, m * n * batch).unwrap();
    let mut dd = DeviceBuffer::<f32>::zeroed(&s, m * n * batch).unwrap();
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd).unwrap();
    let got = s.to_vec(&dd).unwrap();
    for t in 0..batch {
        compare(
            &format!("batch {t}"),
            &got[t * m * n..(t + 1) * m * n],
            &a[t * m * k..(t + 1) * m * k],
            false,
            &b[t * k * n..(t + 1) * k * n],
            false,
            (m, n, k),
            0.0,
            0.0,
        );
    }
    // Plain cuBLAS, the same batch.
    let plain = Blas::new(&context(0).unwrap()).unwrap();
    let mut dc2 = DeviceBuffer::<f32>::zeroed(&s, m * n * batch).unwrap();
    plain
        .gemm_strided_batched(
            &s,
            &GemmShape::new(m, n, k).batched(batch),
            1.0,
            &da,
            &db,
            0.0,
            &mut dc2,
            ComputeType::F32,
        )
        .unwrap();
    assert_eq!(
        s.to_vec(&dc2).unwrap(),
        got,
        "gemm_strided_batched == the plan"
    );
}

fn a_captured_plan_replays_100_times_bit_identical_to_eager() {
    let (lt, s) = setup();
    let (m, n, k) = (512, 384, 256);
    let a: Vec<bf16> = data(m * k, 9)
        .iter()
        .map(|x| bf16::from_f32(x / 64.0))
        .collect();
    let b: Vec<bf16> = data(k * n, 10)
        .iter()
        .map(|x| bf16::from_f32(x / 64.0))
        .collect();
    let plan = lt
        .plan(&MatmulDesc::new::<bf16, bf16, bf16, bf16>(m, n, k))
        .unwrap();
    let da = DeviceBuffer::from_host(&s, &a).unwrap();
    let db = DeviceBuffer::from_host(&s, &b).unwrap();
    let dc = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
    let mut eager = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut eager)
        .unwrap();
    let want = s.to_vec(&eager).unwrap();
    let mut dd = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
    let graph = s
        .capture(|s| plan.matmul(s, 1.0, &da, &db, 0.0, &dc, &mut dd))
        .unwrap();
    let exec = graph.instantiate().unwrap();
    for i in 0..100 {
        s.memset_u8(&mut dd, 0).unwrap();
        // SAFETY: the graph reads da, db, dc and writes dd, all alive; the
        // workspace is held by the graph.
        unsafe { exec.launch(&s) }.unwrap();
        if i % 10 == 9 {
            let got = s.to_vec(&dd).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(g, w)| g.to_bits() == w.to_bits()),
                "replay {i} differs from eager"
            );
        }
    }
    // New pointers: the same plan captured over another D updates the
    // executable in place.
    let mut d2 = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
    let graph2 = s
        .capture(|s| plan.matmul(s, 1.0, &da, &db, 0.0, &dc, &mut d2))
        .unwrap();
    let mut exec = exec;
    exec.update(&graph2).unwrap();
    // SAFETY: as above, with d2.
    unsafe { exec.launch(&s) }.unwrap();
    let got = s.to_vec(&d2).unwrap();
    assert!(
        got.iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits()),
        "the updated graph differs from eager"
    );
    drop(graph2);
    drop(graph);
    drop(plan);
    drop(lt);
    // The executable still holds the workspace.
    // SAFETY: as above.
    unsafe { exec.launch(&s) }.unwrap();
    s.synchronize().unwrap();
}

fn two_streams_at_once_each_with_its_own_workspace() {
    let (lt, s1) = setup();
    let s2 = CudaStream::new(&context(0).unwrap()).unwrap();
    let (m, n, k) = (1024, 1024, 1024);
    let plan = lt
        .plan(&MatmulDesc::new::<bf16, bf16, f32, f32>(m, n, k))
        .unwrap();
    let a = exact(m * k, 11);
    let b = exact(k * n, 12);
    let ba: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
    let bb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
    let da = DeviceBuffer::from_host(&s1, &ba).unwrap();
    let db = DeviceBuffer::from_host(&s1, &bb).unwrap();
    let dc = DeviceBuffer::<f32>::zeroed(&s1, m * n).unwrap();
    let mut d1 = DeviceBuffer::<f32>::zeroed(&s1, m * n).unwrap();
    let mut d2 = DeviceBuffer::<f32>::zeroed(&s1, m * n).unwrap();
    // The fills above are queued on s1; s2 must not race them.
    s1.synchronize().unwrap();
    for _ in 0..20 {
        plan.matmul(&s1, 1.0, &da, &db, 0.0, &dc, &mut d1).unwrap();
        plan.matmul(&s2, 1.0, &da, &db, 0.0, &dc, &mut d2).unwrap();
    }
    assert_eq!(lt.workspaces(), 2);
    let (g1, g2) = (s1.to_vec(&d1).unwrap(), s2.to_vec(&d2).unwrap());
    assert_eq!(g1, g2, "both streams computed the same exact product");
    compare(
        "two streams",
        &g1,
        &a,
        false,
        &b,
        false,
        (m, n, k),
        0.0,
        0.0,
    );
}

fn plain_gemm_ex_grouped_and_device_scalars() {
    let ctx = context(0).unwrap();
    let s = CudaStream::new(&ctx).unwrap();
    let plain = Blas::new(&ctx).unwrap();
    eprintln!("    cuBLAS {:?}", plain.version());
    let (m, n, k) = (300, 200, 100);
    let a = exact(k * m, 13);
    let b = exact(k * n, 14);
    let da = DeviceBuffer::from_host(&s, &a).unwrap();
    let db = DeviceBuffer::from_host(&s, &b).unwrap();
    let mut dc = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    let shape = GemmShape::new(m, n, k).transpose_a();
    plain
        .gemm_ex(&s, &shape, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32)
        .unwrap();
    let got = s.to_vec(&dc).unwrap();
    compare("gemm_ex", &got, &a, true, &b, false, (m, n, k), 0.0, 0.0);
    let alpha = DeviceBuffer::from_host(&s, &[2.0f32]).unwrap();
    let beta = DeviceBuffer::from_host(&s, &[0.0f32]).unwrap();
    plain
        .gemm_device_scalars(
            &s,
            &shape,
            &alpha,
            &da,
            &db,
            &beta,
            &mut dc,
            ComputeType::F32,
        )
        .unwrap();
    assert!(s
        .to_vec(&dc)
        .unwrap()
        .iter()
        .zip(&got)
        .all(|(x, y)| *x == 2.0 * y));
    // Grouped: two groups of different shapes.
    let a1 = DeviceBuffer::from_host(&s, &exact(64 * 32, 15)).unwrap();
    let b1 = DeviceBuffer::from_host(&s, &exact(32 * 16, 16)).unwrap();
    let mut c1 = DeviceBuffer::<f32>::zeroed(&s, 64 * 16).unwrap();
    let mut c2 = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    let mut groups = vec![
        GemmGroup {
            shape: GemmShape::new(64, 16, 32),
            alpha: 1.0,
            beta: 0.0,
            a: vec![&a1],
            b: vec![&b1],
            c: vec![&mut c1],
        },
        GemmGroup {
            shape,
            alpha: 1.0,
            beta: 0.0,
            a: vec![&da],
            b: vec![&db],
            c: vec![&mut c2],
        },
    ];
    plain
        .gemm_grouped_batched(&s, &mut groups, ComputeType::F32)
        .unwrap();
    drop(groups);
    assert_eq!(s.to_vec(&c2).unwrap(), got, "grouped == gemm_ex");
    let (h1, hb1) = (s.to_vec(&a1).unwrap(), s.to_vec(&b1).unwrap());
    compare(
        "grouped 64x16x32",
        &s.to_vec(&c1).unwrap(),
        &h1,
        false,
        &hb1,
        false,
        (64, 16, 32),
        0.0,
        0.0,
    );
}

fn handles_work_with_another_context_current_on_green_streams_and_after_release() {
    let (lt, s) = setup();
    let ctx = context(0).unwrap();
    let (m, n, k) = (128, 64, 96);
    let a = exact(m * k, 17);
    let b = exact(k * n, 18);
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(m, n, k))
        .unwrap();
    let plain = Blas::new(&ctx).unwrap();
    let da = DeviceBuffer::from_host(&s, &a).unwrap();
    let db = DeviceBuffer::from_host(&s, &b).unwrap();
    let dc = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    let mut dd = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    // Another context of the same device current on the thread.
    let d = sys::driver().unwrap();
    let mut other: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context; no creation parameters.
    let made =
        unsafe { (d.cuCtxCreate_v4().unwrap())(&mut other, std::ptr::null_mut(), 0, ctx.device()) };
    assert!(made.is_success(), "cuCtxCreate_v4: {made}");
    // SAFETY: the live context made above.
    assert!(unsafe { (d.cuCtxSetCurrent().unwrap())(other) }.is_success());
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd).unwrap();
    compare(
        "another context current",
        &s.to_vec(&dd).unwrap(),
        &a,
        false,
        &b,
        false,
        (m, n, k),
        0.0,
        0.0,
    );
    // SAFETY: the live context made above.
    assert!(unsafe { (d.cuCtxSetCurrent().unwrap())(other) }.is_success());
    let mut dc2 = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    plain
        .gemm_ex(
            &s,
            &GemmShape::new(m, n, k),
            1.0,
            &da,
            &db,
            0.0,
            &mut dc2,
            ComputeType::F32,
        )
        .unwrap();
    assert_eq!(
        s.to_vec(&dc2).unwrap(),
        s.to_vec(&dd).unwrap(),
        "gemm_ex with another context current"
    );
    // SAFETY: made above, destroyed once; metrale's context is current now.
    assert!(unsafe { (d.cuCtxDestroy_v2().unwrap())(other) }.is_success());
    // A green-context stream (the device's primary context under it).
    let split = SmResource::of_device(&ctx)
        .unwrap()
        .split_by_count(1, 16)
        .unwrap();
    let green = GreenContext::new(&[&split.groups[0]]).unwrap();
    let gs = CudaStream::on_green_context(&green).unwrap();
    let mut dg = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    s.synchronize().unwrap();
    plan.matmul(&gs, 1.0, &da, &db, 0.0, &dc, &mut dg).unwrap();
    compare(
        "green stream",
        &gs.to_vec(&dg).unwrap(),
        &a,
        false,
        &b,
        false,
        (m, n, k),
        0.0,
        0.0,
    );
    // After release(): the handle holds its context.
    release(0);
    let mut dr = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dr).unwrap();
    compare(
        "after release",
        &s.to_vec(&dr).unwrap(),
        &a,
        false,
        &b,
        false,
        (m, n, k),
        0.0,
        0.0,
    );
}

fn refusals_hold_on_the_gpu_too() {
    let (lt, s) = setup();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(64, 64, 64))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 64 * 64).unwrap();
    let short = DeviceBuffer::<f32>::zeroed(&s, 64 * 64 - 1).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 64 * 64).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 64 * 64).unwrap();
    let refused = |e: metrale_runtime::MetraleError, want: &str| {
        assert!(
            matches!(e.as_cublas(), Some(BlasError::Refused { .. })),
            "{e}"
        );
        assert!(e.to_string().contains(want), "wanted {want:?} in {e}");
    };
    refused(
        plan.matmul(&s, 1.0, &a, &short, 0.0, &c, &mut d)
            .unwrap_err(),
        "needs at least 4096 elements, the buffer has 4095",
    );
    let big = DeviceBuffer::<f32>::zeroed(&s, 64 * 64 + 1).unwrap();
    let off = big.slice(1..).unwrap();
    refused(
        plan.matmul(&s, 1.0, &off, &a, 0.0, &c, &mut d).unwrap_err(),
        "is not 16-byte aligned",
    );
    let h = DeviceBuffer::<bf16>::zeroed(&s, 64 * 64).unwrap();
    refused(
        plan.matmul(&s, 1.0, &h, &a, 0.0, &c, &mut d).unwrap_err(),
        "expected f32 elements, the buffer holds bf16",
    );
    let fresh = CudaStream::new(&context(0).unwrap()).unwrap();
    let e = fresh
        .capture(|s| plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("has no workspace of this handle yet"),
        "{e}"
    );
    refused(
        lt.plan(&MatmulDesc::new::<f32, f32, f32, f32>(64, 64, 64).a_scale(ScaleMode::Tensor))
            .unwrap_err(),
        "a scale is only for FP8 operands",
    );
    refused(
        lt.plan(&MatmulDesc::new::<f32, f32, f32, f32>(64, 64, 64).epilogue(Epilogue::Bias))
            .unwrap()
            .matmul(&s, 1.0, &a, &a, 0.0, &c, &mut d)
            .unwrap_err(),
        "needs a bias vector of 64 elements",
    );
}

/// The spacing of bf16 numbers at `r` (one ulp): 2^(e - 7) for |r| in
/// [2^e, 2^(e+1)); the smallest subnormal's below the normal range.
fn bf16_ulp(r: f64) -> f64 {
    let a = r.abs();
    if a < f64::from(f32::MIN_POSITIVE) {
        return 2f64.powi(-133);
    }
    2f64.powi(a.log2().floor() as i32 - 7)
}

/// `op(A) op(B)` for column-major host matrices, every element: (the exact
/// sum in f64, the sum of |products|), column-major m x n; on every core.
fn reference_all(
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    (m, n, k): (usize, usize, usize),
) -> Vec<(f64, f64)> {
    // Rows of op(A) and columns of op(B), each contiguous along k.
    let lda = if ta { k } else { m };
    let ldb = if tb { n } else { k };
    let mut rows = vec![0.0f64; m * k];
    for i in 0..m {
        for l in 0..k {
            rows[i * k + l] = f64::from(if ta { a[l + i * lda] } else { a[i + l * lda] });
        }
    }
    let mut cols = vec![0.0f64; n * k];
    for j in 0..n {
        for l in 0..k {
            cols[j * k + l] = f64::from(if tb { b[j + l * ldb] } else { b[l + j * ldb] });
        }
    }
    let mut out = vec![(0.0f64, 0.0f64); m * n];
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let per = n.div_ceil(threads);
    std::thread::scope(|sc| {
        for (t, chunk) in out.chunks_mut(per * m).enumerate() {
            let (rows, cols) = (&rows, &cols);
            sc.spawn(move || {
                for (idx, slot) in chunk.iter_mut().enumerate() {
                    let (i, j) = (idx % m, t * per + idx / m);
                    let (r, c) = (&rows[i * k..(i + 1) * k], &cols[j * k..(j + 1) * k]);
                    let (mut s, mut mag) = (0.0f64, 0.0f64);
                    for (x, y) in r.iter().zip(c) {
                        s += x * y;
                        mag += (x * y).abs();
                    }
                    *slot = (s, mag);
                }
            });
        }
    });
    out
}

/// Elements of `got` farther from the reference than 1 bf16 ulp plus
/// `slack(mag)`, and elements that are not the correctly rounded reference.
fn count_off(
    got: &[bf16],
    want: &[(f64, f64)],
    slack: impl Fn(f64) -> f64,
) -> (usize, usize, String) {
    let (mut over, mut not_rounded, mut first) = (0, 0, String::new());
    for (idx, (g, &(r, mag))) in got.iter().zip(want).enumerate() {
        let g = f64::from(g.to_f32());
        let err = (g - r).abs();
        if err > bf16_ulp(r) + slack(mag) {
            if over == 0 {
                first = format!("element {idx}: {g} where {r} was expected");
            }
            over += 1;
        }
        if g != f64::from(bf16::from_f64(r).to_f32()) {
            not_rounded += 1;
        }
    }
    (over, not_rounded, first)
}

/// Issue 40 item 8: bf16 in and out at odd shapes (the 1000x1001x999,
/// and a transposed one) against a host reference, with the default plan
/// (exact reductions: split-K partial sums in f32, D rounded once).
///
/// Two kinds of input. Multiples of 1/4 in [-2, 2]: every product and every
/// partial sum is exact in f32 in any order, so D's one rounding is the only
/// error and no element may be more than 1 ulp off (each should be the
/// correctly rounded sum; the count that is not is printed). Random bf16 in
/// [-1, 1): f32 accumulation adds at most k * 2^-23 * sum |a b| (any order,
/// truncating or rounding), so no element may be farther than 1 ulp plus
/// that. The same problems with `Reduction::ReducedPrecision` are run and
/// their counts printed, not checked (PyTorch's default allows the same and
/// saw 8 of 1,001,000 past 1 ulp on an H100).
fn bf16_odd_shapes_are_within_one_ulp_with_exact_reductions() {
    let (lt, s) = setup();
    for (m, n, k, ta) in [(1000, 1001, 999, false), (999, 1000, 1001, true)] {
        let (ar, ac) = if ta { (k, m) } else { (m, k) };
        let trans = if ta { Transpose::Yes } else { Transpose::No };
        let desc = MatmulDesc::new::<bf16, bf16, bf16, bf16>(m, n, k).transpose_a(trans);
        let exact_plan = lt.plan(&desc).unwrap();
        assert_eq!(
            exact_plan.problem().reduction(),
            Reduction::Exact,
            "the default"
        );
        let reduced_plan = lt
            .plan(&desc.clone().reduction(Reduction::ReducedPrecision))
            .unwrap();
        let kinds: [(&str, Vec<f32>, Vec<f32>); 2] = [
            ("quarters", exact(ar * ac, 41), exact(k * n, 42)),
            (
                "random",
                data(ar * ac, 43)
                    .iter()
                    .map(|x| bf16::from_f32(x / 128.0).to_f32())
                    .collect(),
                data(k * n, 44)
                    .iter()
                    .map(|x| bf16::from_f32(x / 128.0).to_f32())
                    .collect(),
            ),
        ];
        for (kind, a, b) in kinds {
            let want = reference_all(&a, ta, &b, false, (m, n, k));
            let ha: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
            let hb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
            let da = DeviceBuffer::from_host(&s, &ha).unwrap();
            let db = DeviceBuffer::from_host(&s, &hb).unwrap();
            let dc = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
            let mut dd = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
            let accumulation = |mag: f64| {
                if kind == "quarters" {
                    0.0
                } else {
                    k as f64 * 2f64.powi(-23) * mag
                }
            };
            let what = format!(
                "bf16 {m}x{n}x{k}{} {kind}",
                if ta { " A transposed" } else { "" }
            );
            reduced_plan
                .matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd)
                .unwrap();
            let (over, not_rounded, first) =
                count_off(&s.to_vec(&dd).unwrap(), &want, accumulation);
            eprintln!(
                "    {what}, reduced-precision reduction: {over} of {} past the bound, {not_rounded} \
                 not correctly rounded {first}",
                m * n
            );
            exact_plan
                .matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd)
                .unwrap();
            let (over, not_rounded, first) =
                count_off(&s.to_vec(&dd).unwrap(), &want, accumulation);
            eprintln!(
                "    {what}, exact reduction: {over} of {} past the bound, {not_rounded} not \
                 correctly rounded",
                m * n
            );
            assert_eq!(
                over, 0,
                "{what}: {over} elements more than 1 ulp (plus f32 accumulation) from the host \
                 reference with the default, exact reduction; first {first}"
            );
        }
    }
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "blas::f32_and_tf32_match_the_host_within_tolerance",
            run: f32_and_tf32_match_the_host_within_tolerance,
        },
        Test {
            name: "blas::f16_bf16_and_fp8_match_the_host_within_tolerance",
            run: f16_bf16_and_fp8_match_the_host_within_tolerance,
        },
        Test {
            name: "blas::every_epilogue_matches_the_host",
            run: every_epilogue_matches_the_host,
        },
        Test {
            name: "blas::strided_batches_match_each_product",
            run: strided_batches_match_each_product,
        },
        Test {
            name: "blas::a_captured_plan_replays_100_times_bit_identical_to_eager",
            run: a_captured_plan_replays_100_times_bit_identical_to_eager,
        },
        Test {
            name: "blas::two_streams_at_once_each_with_its_own_workspace",
            run: two_streams_at_once_each_with_its_own_workspace,
        },
        Test {
            name: "blas::plain_gemm_ex_grouped_and_device_scalars",
            run: plain_gemm_ex_grouped_and_device_scalars,
        },
        Test {
            name:
                "blas::handles_work_with_another_context_current_on_green_streams_and_after_release",
            run: handles_work_with_another_context_current_on_green_streams_and_after_release,
        },
        Test {
            name: "blas::refusals_hold_on_the_gpu_too",
            run: refusals_hold_on_the_gpu_too,
        },
        Test {
            name: "blas::bf16_odd_shapes_are_within_one_ulp_with_exact_reductions",
            run: bf16_odd_shapes_are_within_one_ulp_with_exact_reductions,
        },
    ]
}
