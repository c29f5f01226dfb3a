//! Tier 2 for the `cublas` feature: the runtime's blas room against the
//! stand-in cuBLAS and cuBLASLt (metrale-fakecuda's `fakeblas.c`: host GEMMs
//! over the stand-in driver's memory) on the stand-in driver, all loaded
//! through their `METRALE_LIB*_PATH` variables. Runs everywhere, with no GPU:
//! results against a host reference, every refused shape, leading dimension,
//! type, alignment, device, overlap and scale rule, the error texts, the
//! heuristic's zero algorithms, the plan cache, workspace ownership across
//! streams and captures, context binding, and the missing library, missing
//! symbol and old-library paths.

#![cfg(feature = "cublas")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/harness.rs"]
mod harness;

#[path = "blas/audit6.rs"]
mod audit6;
#[path = "blas/round5.rs"]
mod round5;
#[path = "blas/stress.rs"]
mod stress;

use audit6::{
    defect_a_capture_ends_while_a_gemm_holds_its_graph_handle,
    defect_a_graph_holding_a_gemm_workspace_is_replayed_into_a_capture,
    held_without_user_objects_a_workspace_graph_is_not_replayed_into_a_capture,
};
use round5::{
    defect_a_bias_and_fp8_scales_get_use_records_as_a_does,
    defect_a_capture_cannot_begin_inside_a_grouped_gemm,
    defect_a_second_threads_gemm_waits_for_the_captures_workspace_holder,
    defect_fp8_leading_dimensions_off_16_bytes_are_refused_naming_the_rule,
    held_without_user_objects_a_second_threads_gemm_waits_for_the_host_node,
    plans_reduce_in_the_compute_type_unless_told_otherwise,
};
use stress::{
    held_deferred_frees_retried_as_captures_end_on_many_threads,
    held_mixed_stress_with_captures_on_shared_streams,
};

use std::process::ExitCode;
use std::sync::{Arc, OnceLock};

use half::{bf16, f16};
use metrale_fakecuda::{BlasLive, Fake, FakeBlas, Live};
use metrale_runtime::blas::{
    Blas, BlasError, BlasLt, BlasLtOptions, ComputeType, Epilogue, Fp8E4M3, GemmGroup, GemmShape,
    MathMode, MatmulDesc, MatmulExtras, MatrixLayout, ScaleMode, Transpose,
};
use metrale_runtime::{
    context, CudaContext, CudaStream, DeviceBuffer, DeviceSlice, DeviceSliceMut, GreenContext,
    MetraleError, SmResource,
};

fn fake() -> &'static Fake {
    static F: OnceLock<Fake> = OnceLock::new();
    F.get_or_init(|| Fake::open(metrale_fakecuda::library_path()))
}

fn blas() -> &'static FakeBlas {
    static F: OnceLock<FakeBlas> = OnceLock::new();
    F.get_or_init(|| FakeBlas::open(metrale_fakecuda::blas_library_path()))
}

fn reset() {
    fake().reset();
    blas().reset();
}

fn ctx(dev: usize) -> Arc<CudaContext> {
    context(dev).unwrap()
}

/// Column-major `rows x cols` matrix with element (r, c) = f(r, c).
fn col(rows: usize, cols: usize, f: impl Fn(usize, usize) -> f32) -> Vec<f32> {
    let mut v = vec![0.0; rows * cols];
    for c in 0..cols {
        for r in 0..rows {
            v[r + c * rows] = f(r, c);
        }
    }
    v
}

/// `op(A) op(B)` of column-major host matrices (A stored `ar x ac`).
#[allow(clippy::too_many_arguments)]
fn reference(
    a: &[f32],
    (ar, _ac): (usize, usize),
    ta: bool,
    b: &[f32],
    (br, _bc): (usize, usize),
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    let mut d = vec![0.0; m * n];
    for j in 0..n {
        for i in 0..m {
            let mut s = 0.0f64;
            for l in 0..k {
                let x = if ta { a[l + i * ar] } else { a[i + l * ar] };
                let y = if tb { b[j + l * br] } else { b[l + j * br] };
                s += f64::from(x) * f64::from(y);
            }
            d[i + j * m] = s as f32;
        }
    }
    d
}

fn refusal(e: &MetraleError) -> String {
    match e.as_cublas() {
        Some(BlasError::Refused { .. }) => e.to_string(),
        other => panic!("expected a refusal, got {other:?}: {e}"),
    }
}

fn setup() -> (BlasLt, CudaStream) {
    reset();
    let c = ctx(0);
    (BlasLt::new(&c).unwrap(), CudaStream::new(&c).unwrap())
}

// ---- results ------------------------------------------------------------------

fn f32_results_match_the_host_reference_with_transposes() {
    let (lt, s) = setup();
    let (m, n, k) = (5usize, 3usize, 4usize);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let (ar, ac) = if ta { (k, m) } else { (m, k) };
        let (br, bc) = if tb { (n, k) } else { (k, n) };
        let a = col(ar, ac, |r, c| (r * 3 + c) as f32 * 0.5 - 1.0);
        let b = col(br, bc, |r, c| (r + 2 * c) as f32 - 2.0);
        let cc = col(m, n, |r, c| (r + c) as f32);
        let t = |x: bool| if x { Transpose::Yes } else { Transpose::No };
        let plan = lt
            .plan(
                &MatmulDesc::new::<f32, f32, f32, f32>(m, n, k)
                    .transpose_a(t(ta))
                    .transpose_b(t(tb)),
            )
            .unwrap();
        let da = DeviceBuffer::from_host(&s, &a).unwrap();
        let db = DeviceBuffer::from_host(&s, &b).unwrap();
        let dc = DeviceBuffer::from_host(&s, &cc).unwrap();
        let mut dd = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
        plan.matmul(&s, 2.0, &da, &db, 0.5, &dc, &mut dd).unwrap();
        let got = s.to_vec(&dd).unwrap();
        let want: Vec<f32> = reference(&a, (ar, ac), ta, &b, (br, bc), tb, m, n, k)
            .iter()
            .zip(&cc)
            .map(|(p, c)| 2.0 * p + 0.5 * c)
            .collect();
        assert_eq!(got, want, "ta={ta} tb={tb}");
        // In place: D is C.
        let mut dcd = DeviceBuffer::from_host(&s, &cc).unwrap();
        plan.matmul_in_place(&s, 2.0, &da, &db, 0.5, &mut dcd, MatmulExtras::new())
            .unwrap();
        assert_eq!(s.to_vec(&dcd).unwrap(), want, "in place, ta={ta} tb={tb}");
    }
}

fn row_major_layouts_and_leading_dimensions() {
    let (lt, s) = setup();
    // A 2x3 row-major with ld 4 (one padding column), B 3x2 col-major ld 5.
    let a_host = [1.0f32, 2.0, 3.0, 99.0, 4.0, 5.0, 6.0, 99.0];
    let b_host = [1.0f32, 0.0, 1.0, 77.0, 77.0, 0.0, 1.0, 0.0, 77.0, 77.0];
    let desc = MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 3)
        .layout_a(MatrixLayout::row_major(2, 3).with_ld(4))
        .layout_b(MatrixLayout::col_major(3, 2).with_ld(5));
    let plan = lt.plan(&desc).unwrap();
    let a = DeviceBuffer::from_host(&s, &a_host[..7]).unwrap();
    let b = DeviceBuffer::from_host(&s, &b_host[..8]).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    plan.matmul(&s, 1.0, &a, &b, 0.0, &c, &mut d).unwrap();
    // Row 0 (1 2 3), row 1 (4 5 6); B columns (1 0 1), (0 1 0).
    assert_eq!(s.to_vec(&d).unwrap(), [4.0, 10.0, 2.0, 5.0]);
}

fn every_epilogue_with_its_bias() {
    let (lt, s) = setup();
    let (m, n, k) = (3usize, 2usize, 2usize);
    let a = col(m, k, |r, c| r as f32 - c as f32 * 2.0);
    let b = col(k, n, |r, c| 1.0 + r as f32 + c as f32);
    let bias_host = [0.5f32, -10.0, 1.0];
    let plain = reference(&a, (m, k), false, &b, (k, n), false, m, n, k);
    let gelu = |x: f32| 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh());
    let da = DeviceBuffer::from_host(&s, &a).unwrap();
    let db = DeviceBuffer::from_host(&s, &b).unwrap();
    let dc = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    let bias = DeviceBuffer::from_host(&s, &bias_host).unwrap();
    for e in [
        Epilogue::None,
        Epilogue::Relu,
        Epilogue::Gelu,
        Epilogue::Bias,
        Epilogue::ReluBias,
        Epilogue::GeluBias,
    ] {
        let plan = lt
            .plan(&MatmulDesc::new::<f32, f32, f32, f32>(m, n, k).epilogue(e))
            .unwrap();
        let mut d = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
        let extras = if e.has_bias() {
            MatmulExtras::new().bias(&bias)
        } else {
            MatmulExtras::new()
        };
        plan.matmul_with(&s, 1.0, &da, &db, 0.0, &dc, &mut d, extras)
            .unwrap();
        let got = s.to_vec(&d).unwrap();
        for (i, &p) in plain.iter().enumerate() {
            let x = if e.has_bias() {
                p + bias_host[i % m]
            } else {
                p
            };
            let want = match e {
                Epilogue::Relu | Epilogue::ReluBias => x.max(0.0),
                Epilogue::Gelu | Epilogue::GeluBias => gelu(x),
                _ => x,
            };
            assert!(
                (got[i] - want).abs() < 1e-5,
                "{e:?} [{i}]: {} vs {want}",
                got[i]
            );
        }
    }
    // The bias is checked: length m, the plan's type, needed and only then.
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(3, 2, 2).epilogue(Epilogue::Bias))
        .unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 6).unwrap();
    let short = DeviceBuffer::<f32>::zeroed(&s, 2).unwrap();
    let calls = blas().calls("cublasLtMatmul");
    let e = plan
        .matmul_with(
            &s,
            1.0,
            &da,
            &db,
            0.0,
            &dc,
            &mut d,
            MatmulExtras::new().bias(&short),
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains(
            "the bias: cublasLtMatmul not called: needs at least 3 elements, the buffer has 2"
        ),
        "{e}"
    );
    let e = plan
        .matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut d)
        .unwrap_err();
    assert!(
        refusal(&e).contains("needs a bias vector of 3 elements"),
        "{e}"
    );
    let wrong = DeviceBuffer::<bf16>::zeroed(&s, 3).unwrap();
    let e = plan
        .matmul_with(
            &s,
            1.0,
            &da,
            &db,
            0.0,
            &dc,
            &mut d,
            MatmulExtras::new().bias(&wrong),
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains("expected f32 elements, the buffer holds bf16"),
        "{e}"
    );
    let none = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(3, 2, 2))
        .unwrap();
    let e = none
        .matmul_with(
            &s,
            1.0,
            &da,
            &db,
            0.0,
            &dc,
            &mut d,
            MatmulExtras::new().bias(&bias),
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains("a bias was given, but epilogue None has none"),
        "{e}"
    );
    assert_eq!(
        blas().calls("cublasLtMatmul"),
        calls,
        "refused before the library"
    );
}

fn strided_batches_compute_each_matrix() {
    let (lt, s) = setup();
    let (m, n, k, batches) = (2usize, 2usize, 3usize, 3usize);
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(m, n, k).batch(batches))
        .unwrap();
    assert_eq!(plan.problem().d().batch_stride, (m * n) as u64);
    let a: Vec<f32> = (0..m * k * 3).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..k * n * 3).map(|i| (i % 5) as f32).collect();
    let da = DeviceBuffer::from_host(&s, &a).unwrap();
    let db = DeviceBuffer::from_host(&s, &b).unwrap();
    let dc = DeviceBuffer::<f32>::zeroed(&s, m * n * 3).unwrap();
    let mut dd = DeviceBuffer::<f32>::zeroed(&s, m * n * 3).unwrap();
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd).unwrap();
    let got = s.to_vec(&dd).unwrap();
    for t in 0..3 {
        let want = reference(
            &a[t * m * k..(t + 1) * m * k],
            (m, k),
            false,
            &b[t * k * n..(t + 1) * k * n],
            (k, n),
            false,
            m,
            n,
            k,
        );
        assert_eq!(&got[t * m * n..(t + 1) * m * n], &want[..], "batch {t}");
    }
    // One matrix short of the batch is refused.
    let short = DeviceBuffer::<f32>::zeroed(&s, m * k * 3 - 1).unwrap();
    let e = plan
        .matmul(&s, 1.0, &short, &db, 0.0, &dc, &mut dd)
        .unwrap_err();
    assert!(
        refusal(&e).contains("operand A: cublasLtMatmul not called: needs at least 18 elements, the buffer has 17 (layout 2x3 col ld 2, batch 3 stride 6)"),
        "{e}"
    );
}

fn half_bf16_and_fp8_with_scales() {
    let (lt, s) = setup();
    let (m, n, k) = (4usize, 4usize, 8usize);
    let a = col(m, k, |r, c| (r as f32 - c as f32) * 0.25);
    let b = col(k, n, |r, c| (r + c) as f32 * 0.5);
    let want = reference(&a, (m, k), false, &b, (k, n), false, m, n, k);
    // f16 in, f32 out.
    let plan = lt
        .plan(&MatmulDesc::new::<f16, f16, f32, f32>(m, n, k))
        .unwrap();
    let ha: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
    let hb: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
    let da = DeviceBuffer::from_host(&s, &ha).unwrap();
    let db = DeviceBuffer::from_host(&s, &hb).unwrap();
    let dc = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    let mut dd = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd).unwrap();
    assert_eq!(s.to_vec(&dd).unwrap(), want, "exact in f16");
    // bf16 in and out.
    let plan = lt
        .plan(&MatmulDesc::new::<bf16, bf16, bf16, bf16>(m, n, k))
        .unwrap();
    let ba: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
    let bb: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
    let da = DeviceBuffer::from_host(&s, &ba).unwrap();
    let db = DeviceBuffer::from_host(&s, &bb).unwrap();
    let dc = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
    let mut dd = DeviceBuffer::<bf16>::zeroed(&s, m * n).unwrap();
    plan.matmul(&s, 1.0, &da, &db, 0.0, &dc, &mut dd).unwrap();
    let got: Vec<f32> = s.to_vec(&dd).unwrap().iter().map(|x| x.to_f32()).collect();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= w.abs() / 128.0 + 1e-3, "{g} vs {w}");
    }
    // FP8 e4m3 (A transposed, as cuBLASLt wants on Hopper) with scales, bf16 out.
    // 0x38 is 1.0 and 0x40 is 2.0 in E4M3.
    let plan = lt
        .plan(
            &MatmulDesc::new::<Fp8E4M3, Fp8E4M3, bf16, bf16>(4, 4, 16)
                .transpose_a(Transpose::Yes)
                .a_scale(ScaleMode::Tensor)
                .b_scale(ScaleMode::OuterVector),
        )
        .unwrap();
    let fa = DeviceBuffer::from_host(&s, &[Fp8E4M3(0x38); 64]).unwrap();
    let fb = DeviceBuffer::from_host(&s, &[Fp8E4M3(0x40); 64]).unwrap();
    let dc = DeviceBuffer::<bf16>::zeroed(&s, 16).unwrap();
    let mut dd = DeviceBuffer::<bf16>::zeroed(&s, 16).unwrap();
    let sa = DeviceBuffer::from_host(&s, &[0.5f32]).unwrap();
    let sb = DeviceBuffer::from_host(&s, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    plan.matmul_with(
        &s,
        1.0,
        &fa,
        &fb,
        0.0,
        &dc,
        &mut dd,
        MatmulExtras::new().a_scale(&sa).b_scale(&sb),
    )
    .unwrap();
    let got: Vec<f32> = s.to_vec(&dd).unwrap().iter().map(|x| x.to_f32()).collect();
    // 16 * 1 * 2 * 0.5 * (column scale).
    assert_eq!(&got[..4], &[16.0; 4]);
    assert_eq!(&got[12..], &[64.0; 4]);
    // The scales are checked: B's outer vector needs n values, and is needed.
    let short = DeviceBuffer::from_host(&s, &[1.0f32; 3]).unwrap();
    let e = plan
        .matmul_with(
            &s,
            1.0,
            &fa,
            &fb,
            0.0,
            &dc,
            &mut dd,
            MatmulExtras::new().a_scale(&sa).b_scale(&short),
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains(
            "B's scale: cublasLtMatmul not called: needs at least 4 elements, the buffer has 3"
        ),
        "{e}"
    );
    let e = plan
        .matmul_with(
            &s,
            1.0,
            &fa,
            &fb,
            0.0,
            &dc,
            &mut dd,
            MatmulExtras::new().a_scale(&sa),
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains("the plan scales B and needs 4 f32 on the device"),
        "{e}"
    );
    // A D scale is only for an FP8 output.
    let e = plan
        .matmul_with(
            &s,
            1.0,
            &fa,
            &fb,
            0.0,
            &dc,
            &mut dd,
            MatmulExtras::new().a_scale(&sa).b_scale(&sb).d_scale(&sa),
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains("a D scale is only for an FP8 output, and D is bf16"),
        "{e}"
    );
    let e = lt
        .plan(&MatmulDesc::new::<Fp8E4M3, Fp8E4M3, bf16, bf16>(4, 4, 16).d_scale())
        .unwrap_err();
    assert!(
        refusal(&e).contains("a D scale is only for an FP8 output, and D is bf16"),
        "{e}"
    );
    // FP8 operands must be 16-byte aligned: a slice at byte 8 is refused.
    let wide = DeviceBuffer::from_host(&s, &[Fp8E4M3(0x38); 72]).unwrap();
    let off = wide.slice(8..).unwrap();
    let e = plan
        .matmul_with(
            &s,
            1.0,
            &off,
            &fb,
            0.0,
            &dc,
            &mut dd,
            MatmulExtras::new().a_scale(&sa).b_scale(&sb),
        )
        .unwrap_err();
    let text = refusal(&e);
    assert!(
        text.contains("operand A") && text.contains("is not 16-byte aligned"),
        "{text}"
    );
}

// ---- refusals of the problem --------------------------------------------------

fn problems_that_break_a_rule_are_refused_before_the_heuristic() {
    let (lt, _s) = setup();
    let cases: Vec<(MatmulDesc, &str)> = vec![
        (MatmulDesc::new::<f32, f32, f32, f32>(0, 2, 2), "m, n and k must be at least 1; got 0x2x2"),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 8).layout_a(MatrixLayout::col_major(8, 4)),
            "operand A: expected 4x8 as stored (m=4, n=4, k=8), got 8x4",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 8)
                .transpose_b(Transpose::Yes)
                .layout_b(MatrixLayout::col_major(8, 4)),
            "operand B: expected 4x8 as stored (m=4, n=4, k=8, B transposed), got 8x4",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 4).layout_a(MatrixLayout::col_major(4, 4).with_ld(3)),
            "operand A: ld 3 is less than its rows (4) in Col order",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 4).layout_c(MatrixLayout::row_major(4, 4).with_ld(2)),
            "operand C: ld 2 is less than its columns (4) in Row order",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2)
                .batch(2)
                .layout_d(MatrixLayout::col_major(2, 2).with_batch(2, 3)),
            "operand D: batch stride 3 is less than one matrix's extent (4): the batches would overlap",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2).layout_a(MatrixLayout::col_major(2, 2).with_batch(2, 4)),
            "operand A: batch count 2 differs from D's 1",
        ),
        (
            MatmulDesc::new::<f32, bf16, f32, f32>(2, 2, 2),
            "element types A f32, B bf16, C f32, D f32 are not a combination cuBLASLt offers",
        ),
        (
            MatmulDesc::new::<bf16, bf16, bf16, bf16>(2, 2, 2).compute(ComputeType::Tf32),
            "compute type Tf32 does not take bf16 matrices",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2).a_scale(ScaleMode::Tensor),
            "operand A: a scale is only for FP8 operands, and it is f32",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2).bias_type(metrale_runtime::blas::DataType::F32),
            "a bias type was given, but epilogue None has no bias",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2).alignment(2),
            "alignment 2 must be a power of two from 4 to 256",
        ),
        (
            MatmulDesc::new::<Fp8E4M3, Fp8E4M3, f32, f32>(2, 2, 16).alignment(8),
            "alignment 8 must be a power of two from 16 to 256",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(1 << 40, 1 << 40, 2).batch(4),
            "operand C: layout 1099511627776x1099511627776 col ld 1099511627776, batch 4 stride 18446744073709551615 is more than cuBLASLt holds (a leading dimension or batch stride above i64::MAX, a batch count above i32::MAX, or a required length above u64::MAX elements)",
        ),
        (
            // usize sizes: a batch count cuBLASLt cannot hold is refused, naming the limit.
            MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2).batch(1usize << 33),
            "the batch count 8589934592 is above cuBLASLt's limit (i32::MAX = 2147483647)",
        ),
        (
            MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2).workspace_limit(64 << 20),
            "the workspace limit 67108864 is more than the handle's workspace (33554432 bytes per stream",
        ),
    ];
    for (desc, want) in cases {
        let e = lt.plan(&desc).unwrap_err();
        let text = refusal(&e);
        assert!(
            text.contains("cublasLtMatmulAlgoGetHeuristic not called"),
            "{text}"
        );
        assert!(text.contains(want), "wanted {want:?} in {text}");
    }
    assert_eq!(blas().calls("cublasLtMatmulAlgoGetHeuristic"), 0);
}

fn zero_algorithms_is_a_typed_error_naming_the_problem() {
    let (lt, _s) = setup();
    blas().set_heuristic(0, 0, 0);
    let e = lt
        .plan(&MatmulDesc::new::<bf16, bf16, bf16, bf16>(8, 4, 2).epilogue(Epilogue::Relu))
        .unwrap_err();
    assert!(
        matches!(e.as_cublas(), Some(BlasError::NoAlgorithm { .. })),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.starts_with(
            "cublasLtMatmulAlgoGetHeuristic returned no algorithm for device 0 matmul 8x4x2 bf16 x \
             bf16 + bf16 -> bf16, compute F32, epilogue Relu, workspace limit 33554432 bytes"
        ),
        "{text}"
    );
    // An algorithm needing more workspace than the limit is not returned either.
    blas().set_heuristic(1, 1 << 20, 0);
    let e = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2).workspace_limit(4096))
        .unwrap_err();
    assert!(
        matches!(e.as_cublas(), Some(BlasError::NoAlgorithm { .. })),
        "{e}"
    );
    assert_eq!(lt.cached_plans(), 0, "failures are not cached");
    // A failing heuristic is a call error with cuBLASLt's status and text.
    blas().set_heuristic(1, 0, 15);
    let e = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap_err();
    let lib = e.as_library().unwrap();
    assert_eq!(lib.call(), Some("cublasLtMatmulAlgoGetHeuristic"));
    assert_eq!(lib.status_code(), Some(15));
    assert_eq!(
        lib.status_name().as_deref(),
        Some("CUBLAS_STATUS_NOT_SUPPORTED")
    );
    assert_eq!(
        lib.text().as_deref(),
        Some("fakeblas: the requested functionality is not supported")
    );
}

fn candidates_are_the_heuristics_algorithms_in_order_each_a_checked_plan() {
    let (lt, s) = setup();
    blas().set_heuristic(3, 0, 0);
    let desc = MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 4);
    let plans = lt.plan_candidates(&desc, 8).unwrap();
    assert_eq!(plans.len(), 3, "as many as the heuristic offers");
    // Best first: the first is the cached plan, the others differ from it.
    assert!(plans[0].same_plan(&lt.plan(&desc).unwrap()));
    assert_ne!(plans[1].algo().data[0], plans[0].algo().data[0]);
    assert_ne!(plans[2].algo().data[0], plans[1].algo().data[0]);
    assert_eq!(
        lt.plan_candidates(&desc, 2).unwrap().len(),
        2,
        "at most the number asked"
    );
    // Each computes the product and is checked like any plan.
    let a = DeviceBuffer::from_host(&s, &col(4, 4, |r, c| (r + c) as f32)).unwrap();
    let b = DeviceBuffer::from_host(&s, &col(4, 4, |r, c| (r * c) as f32)).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    let mut first = None;
    for p in &plans {
        let mut d = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
        p.matmul(&s, 1.0, &a, &b, 0.0, &c, &mut d).unwrap();
        let got = s.to_vec(&d).unwrap();
        assert_eq!(first.get_or_insert_with(|| got.clone()), &got);
        let mut short = DeviceBuffer::<f32>::zeroed(&s, 15).unwrap();
        assert!(p.matmul(&s, 1.0, &a, &b, 0.0, &c, &mut short).is_err());
    }
    blas().set_heuristic(0, 0, 0);
    let e = lt
        .plan_candidates(&MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 8), 4)
        .unwrap_err();
    assert!(
        matches!(e.as_cublas(), Some(BlasError::NoAlgorithm { .. })),
        "{e}"
    );
}

fn the_plan_cache_hits_on_equal_problems_and_misses_on_any_change() {
    let (lt, _s) = setup();
    let desc = MatmulDesc::new::<f32, f32, f32, f32>(16, 8, 4);
    let p1 = lt.plan(&desc).unwrap();
    let p2 = lt.plan(&desc).unwrap();
    assert!(p1.same_plan(&p2));
    assert_eq!(
        blas().calls("cublasLtMatmulAlgoGetHeuristic"),
        1,
        "the heuristic ran once"
    );
    // The explicit form of the defaults is the same problem.
    let p3 = lt
        .plan(
            &desc
                .clone()
                .workspace_limit(lt.workspace_bytes())
                .layout_a(MatrixLayout::col_major(16, 4)),
        )
        .unwrap();
    assert!(p1.same_plan(&p3));
    let changed = [
        desc.clone().transpose_a(Transpose::Yes),
        desc.clone().epilogue(Epilogue::Relu),
        desc.clone().workspace_limit(1024),
        desc.clone().compute(ComputeType::Tf32),
        desc.clone().alignment(256),
        desc.clone()
            .layout_c(MatrixLayout::col_major(16, 8).with_ld(32)),
    ];
    for (i, d) in changed.iter().enumerate() {
        let p = lt.plan(d).unwrap();
        assert!(!p.same_plan(&p1), "change {i} must miss");
    }
    assert_eq!(lt.cached_plans(), 7);
    assert_eq!(blas().calls("cublasLtMatmulAlgoGetHeuristic"), 7);
    // Another handle has its own cache.
    let other = BlasLt::new(&ctx(0)).unwrap();
    assert!(!other.plan(&desc).unwrap().same_plan(&p1));
    lt.clear_cache();
    assert_eq!(lt.cached_plans(), 0);
    assert!(!lt.plan(&desc).unwrap().same_plan(&p1), "rebuilt");
}

// ---- refusals of the buffers --------------------------------------------------

fn buffers_are_checked_against_the_plan_before_the_library() {
    let (lt, s) = setup();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 4))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    let b = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    let short = DeviceBuffer::<f32>::zeroed(&s, 15).unwrap();
    let calls = blas().calls("cublasLtMatmul");
    let e = plan
        .matmul(&s, 1.0, &a, &short, 0.0, &c, &mut d)
        .unwrap_err();
    assert_eq!(
        refusal(&e),
        "device 0 matmul 4x4x4 f32 x f32 + f32 -> f32, compute F32, workspace limit 33554432 \
         bytes, operand B: cublasLtMatmul not called: needs at least 16 elements, the buffer \
         has 15 (layout 4x4 col ld 4)"
    );
    let mut short_d = DeviceBuffer::<f32>::zeroed(&s, 15).unwrap();
    let e = plan
        .matmul(&s, 1.0, &a, &b, 0.0, &c, &mut short_d)
        .unwrap_err();
    assert!(
        refusal(&e).contains("operand D: cublasLtMatmul not called: needs at least 16"),
        "{e}"
    );
    // The wrong element type.
    let h = DeviceBuffer::<f16>::zeroed(&s, 16).unwrap();
    let e = plan.matmul(&s, 1.0, &h, &b, 0.0, &c, &mut d).unwrap_err();
    assert!(
        refusal(&e).contains(
            "operand A: cublasLtMatmul not called: expected f32 elements, the buffer holds f16"
        ),
        "{e}"
    );
    // Misaligned (the plan's 16 bytes): a slice one element in.
    let big = DeviceBuffer::<f32>::zeroed(&s, 17).unwrap();
    let off = big.slice(1..).unwrap();
    let e = plan.matmul(&s, 1.0, &off, &b, 0.0, &c, &mut d).unwrap_err();
    assert!(
        refusal(&e).contains("is not 16-byte aligned, as the plan's algorithm needs"),
        "{e}"
    );
    // In place on a buffer of its own is fine (D is C, one layout).
    let mut shared = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    plan.matmul_in_place(&s, 1.0, &a, &b, 0.0, &mut shared, MatmulExtras::new())
        .unwrap();
    // The stream of another device.
    let s1 = CudaStream::new(&ctx(1)).unwrap();
    let e = plan.matmul(&s1, 1.0, &a, &b, 0.0, &c, &mut d).unwrap_err();
    assert!(refusal(&e).contains("the stream: cublasLtMatmul not called: the stream is of device 1, the plan of device 0"), "{e}");
    // A buffer of another device.
    let a1 = DeviceBuffer::<f32>::zeroed(&s1, 16).unwrap();
    let e = plan.matmul(&s, 1.0, &a1, &b, 0.0, &c, &mut d).unwrap_err();
    assert!(
        refusal(&e).contains(
            "operand A: cublasLtMatmul not called: the buffer is on device 1, the plan on device 0"
        ),
        "{e}"
    );
    assert_eq!(
        blas().calls("cublasLtMatmul"),
        calls + 1,
        "only the in-place call reached cuBLASLt"
    );
}

/// Safe code cannot alias A or B with D (a shared and a mutable borrow of one
/// buffer); views of foreign memory (`from_raw`, unsafe) can, and are refused.
fn d_overlapping_a_or_part_of_c_is_refused() {
    let (lt, s) = setup();
    let c0 = ctx(0);
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 4))
        .unwrap();
    let buf = DeviceBuffer::<f32>::zeroed(&s, 64).unwrap();
    let b = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    let base = buf.device_ptr();
    // SAFETY: views of a live buffer of this test; the overlapping call below
    // is refused before any work is queued, so nothing reads or writes them.
    let (a, mut d) = unsafe {
        (
            DeviceSlice::<f32>::from_raw(&c0, base, 16).unwrap(),
            DeviceSliceMut::<f32>::from_raw_mut(&c0, base + 32, 16).unwrap(),
        )
    };
    let calls = blas().calls("cublasLtMatmul");
    let e = plan.matmul(&s, 1.0, &a, &b, 0.0, &c, &mut d).unwrap_err();
    let text = refusal(&e);
    assert!(
        text.contains("operand D: cublasLtMatmul not called: D (")
            && text.contains(") overlaps A (")
            && text.contains("D may share memory with C only"),
        "{text}"
    );
    // C overlapping D without being D.
    // SAFETY: as above.
    let c_part = unsafe { DeviceSlice::<f32>::from_raw(&c0, base + 32 + 16, 16).unwrap() };
    let e = plan
        .matmul(&s, 1.0, &b, &b, 0.0, &c_part, &mut d)
        .unwrap_err();
    assert!(refusal(&e).contains("D overlaps C without being C"), "{e}");
    assert_eq!(
        blas().calls("cublasLtMatmul"),
        calls,
        "refused before the library"
    );
}

/// What safe code can do is pass D as C in place, which needs C and D alike.
fn in_place_needs_c_and_d_alike() {
    let (lt, s) = setup();
    let plan = lt
        .plan(
            &MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2)
                .layout_c(MatrixLayout::col_major(2, 2))
                .layout_d(MatrixLayout::col_major(2, 2).with_ld(4)),
        )
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 8).unwrap();
    let e = plan
        .matmul_in_place(&s, 1.0, &a, &a, 0.0, &mut d, MatmulExtras::new())
        .unwrap_err();
    assert!(
        refusal(&e).contains(
            "in place, C and D must have one layout and type; the plan has C 2x2 col ld 2 f32 \
             and D 2x2 col ld 4 f32"
        ),
        "{e}"
    );
    let plan = lt
        .plan(
            &MatmulDesc::new::<bf16, bf16, f32, f32>(2, 2, 2)
                .layout_d(MatrixLayout::col_major(2, 2)),
        )
        .unwrap();
    let h = DeviceBuffer::<bf16>::zeroed(&s, 4).unwrap();
    plan.matmul_in_place(&s, 1.0, &h, &h, 0.0, &mut d, MatmulExtras::new())
        .unwrap();
    assert_eq!(blas().calls("cublasLtMatmul"), 1);
}

// ---- workspaces ---------------------------------------------------------------

fn each_stream_has_its_own_workspace() {
    let (lt, s) = setup();
    blas().set_heuristic(1, 4096, 0);
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    assert_eq!(plan.algo_workspace(), 4096);
    let s2 = CudaStream::new(&ctx(0)).unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d2 = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    for _ in 0..2 {
        plan.matmul(&s, 1.0, &a, &a, 0.0, &c, &mut d).unwrap();
        plan.matmul(&s2, 1.0, &a, &a, 0.0, &c, &mut d2).unwrap();
    }
    let r = blas().records();
    assert_eq!(r.len(), 4);
    assert_eq!(r[0].stream, s.raw().cast());
    assert_eq!(r[1].stream, s2.raw().cast());
    assert_ne!(
        r[0].workspace, r[1].workspace,
        "never shared across streams"
    );
    assert_eq!(r[0].workspace, r[2].workspace, "one per stream, reused");
    assert_eq!(r[1].workspace, r[3].workspace);
    assert!(r
        .iter()
        .all(|x| x.workspace_size == 32 << 20 && x.workspace != 0));
    assert!(r.iter().all(|x| x.algo == 1000), "the planned algorithm");
    assert_eq!(lt.workspaces(), 2);
    assert!(lt.release_workspace(&s2));
    assert!(!lt.release_workspace(&s2));
    assert_eq!(lt.workspaces(), 1);
    // An algorithm given less workspace than it needs fails in the library:
    // a handle whose workspace is smaller than the plan's need cannot exist.
    let small =
        BlasLt::with_options(&ctx(0), BlasLtOptions::default().with_workspace_bytes(1024)).unwrap();
    let e = small
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap_err();
    assert!(
        matches!(e.as_cublas(), Some(BlasError::NoAlgorithm { .. })),
        "{e}"
    );
}

fn captures_need_a_prepared_workspace_which_the_graph_keeps() {
    let (lt, s) = setup();
    blas().set_heuristic(1, 256, 0);
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d2 = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let devmem = fake().live(Live::DeviceMemory);
    // Not prepared: refused, nothing allocated into the capture.
    let e = s
        .capture(|s| plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("is being captured and has no workspace of this handle yet"),
        "{e}"
    );
    assert_eq!(fake().live(Live::DeviceMemory), devmem);
    assert_eq!(blas().calls("cublasLtMatmul"), 0);
    // Prepared: captured with the stream's workspace, once held by the graph.
    lt.prepare(&s).unwrap();
    assert_eq!(fake().live(Live::DeviceMemory), devmem + 1);
    let graph = s
        .capture(|s| {
            plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d)?;
            plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d)
        })
        .unwrap();
    let r = blas().records();
    assert_eq!(r.len(), 2);
    assert!(r.iter().all(|x| x.capturing && x.stream == s.raw().cast()));
    assert_eq!(r[0].workspace, r[1].workspace);
    let host_nodes = graph
        .nodes()
        .unwrap()
        .iter()
        .filter(|n| n.kind() == metrale_runtime::GraphNodeKind::Host)
        .count();
    assert_eq!(host_nodes, 0, "held by a user object, not a node");
    assert_eq!(
        fake().user_objects(),
        1,
        "one holder per capture, not one per GEMM"
    );
    let mut exec = graph.instantiate().unwrap();
    // The same plan captured with other buffers updates the executable.
    let graph2 = s
        .capture(|s| {
            plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d2)?;
            plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d2)
        })
        .unwrap();
    assert_eq!(fake().user_objects(), 2, "each capture holds it");
    exec.update(&graph2).unwrap();
    drop(graph2);
    // The update replaced the executable's references with the second
    // graph's (as CUDA documents): the first graph holds one, the
    // executable the other.
    assert_eq!(fake().user_objects(), 2);
    // The handle, the plan and the stream's entry go: the graph still holds it.
    assert!(lt.release_workspace(&s));
    drop(plan);
    drop(lt);
    assert_eq!(
        fake().live(Live::DeviceMemory),
        devmem + 1,
        "the captured workspace lives while the graph does"
    );
    drop(graph);
    assert_eq!(
        fake().live(Live::DeviceMemory),
        devmem + 1,
        "and its executable"
    );
    drop(exec);
    s.synchronize().unwrap();
    assert_eq!(
        fake().live(Live::DeviceMemory),
        devmem,
        "freed with the last holder"
    );
    // Preparing a stream being captured is refused.
    let (lt, s) = setup();
    let e = s.capture(|s| lt.prepare(s)).unwrap_err();
    assert!(
        e.to_string()
            .contains("its workspace must be made before the capture begins"),
        "{e}"
    );
    assert_eq!(lt.workspaces(), 0);
}

fn every_call_binds_the_handles_context() {
    let (lt, s) = setup();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let other = ctx(1);
    other.bind().unwrap();
    assert_eq!(fake().current_context(), other.raw().cast());
    plan.matmul(&s, 1.0, &a, &a, 0.0, &c, &mut d).unwrap();
    let r = blas().records();
    assert_eq!(
        r[0].context,
        ctx(0).raw().cast(),
        "bound to the plan's device"
    );
    assert_eq!(r[0].device, 0);
    // Plain cuBLAS: the handle was made on device 0; a call with device 1
    // current would fail in the stand-in (EXECUTION_FAILED), so binding holds.
    let plain = Blas::new(&ctx(0)).unwrap();
    other.bind().unwrap();
    plain
        .gemm_ex(
            &s,
            &GemmShape::new(2, 2, 2),
            1.0,
            &a,
            &a,
            0.0,
            &mut d,
            ComputeType::F32,
        )
        .unwrap();
    assert_eq!(blas().records().last().unwrap().device, 0);
}

fn green_context_streams_and_a_released_host_work() {
    let (lt, _s) = setup();
    let c0 = ctx(0);
    let split = SmResource::of_device(&c0)
        .unwrap()
        .split_by_count(2, 64)
        .unwrap();
    let green = GreenContext::new(&[&split.groups[0]]).unwrap();
    let gs = CudaStream::on_green_context(&green).unwrap();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::from_host(&gs, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&gs, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&gs, 4).unwrap();
    plan.matmul(&gs, 1.0, &a, &a, 0.0, &c, &mut d).unwrap();
    assert_eq!(gs.to_vec(&d).unwrap(), [7.0, 10.0, 15.0, 22.0]);
    let r = blas().records().pop().unwrap();
    assert_eq!(r.stream, gs.raw().cast(), "the green stream itself");
    assert_eq!(
        r.context,
        c0.raw().cast(),
        "with the device's primary context bound"
    );
    // release() drops the process's host; the handle holds its context, so
    // its plans go on working on the device.
    let h = metrale_runtime::host(0).unwrap();
    drop(h);
    metrale_runtime::release(0);
    plan.matmul(&gs, 2.0, &a, &a, 0.0, &c, &mut d).unwrap();
    assert_eq!(gs.to_vec(&d).unwrap(), [14.0, 20.0, 30.0, 44.0]);
    assert_eq!(blas().records().pop().unwrap().context, c0.raw().cast());
}

fn library_errors_name_call_status_text_and_subject() {
    let (lt, s) = setup();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    blas().fail("cublasLtMatmul", 13, 1, Some(1));
    let e = plan.matmul(&s, 1.0, &a, &a, 0.0, &c, &mut d).unwrap_err();
    assert_eq!(
        e.to_string(),
        "device 0 matmul 2x2x2 f32 x f32 + f32 -> f32, compute F32, workspace limit 33554432 \
         bytes: cublasLtMatmul failed: CUBLAS_STATUS_EXECUTION_FAILED (13): fakeblas: the GPU \
         program failed to execute"
    );
    let lib = e.as_library().unwrap();
    assert_eq!(
        (lib.library(), lib.call(), lib.status_code()),
        ("cuBLASLt", Some("cublasLtMatmul"), Some(13))
    );
    assert!(e.as_cublas().unwrap().is_call());
    plan.matmul(&s, 1.0, &a, &a, 0.0, &c, &mut d).unwrap();
    blas().fail("cublasLtCreate", 3, 1, Some(1));
    let e = BlasLt::new(&ctx(0)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "device 0: creating a cuBLASLt handle: cublasLtCreate failed: \
         CUBLAS_STATUS_ALLOC_FAILED (3): fakeblas: resource allocation failed"
    );
    blas().fail("cublasLtMatmulDescSetAttribute", 7, 1, Some(1));
    let e = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(3, 3, 3))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("cublasLtMatmulDescSetAttribute failed: CUBLAS_STATUS_INVALID_VALUE (7)"),
        "{e}"
    );
    // Nothing leaked on the failed build.
    drop(plan);
    lt.clear_cache();
    drop(lt);
    assert_eq!(blas().live(BlasLive::Descriptors), 0);
    assert_eq!(blas().live(BlasLive::Layouts), 0);
    assert_eq!(blas().live(BlasLive::Preferences), 0);
    assert_eq!(blas().live(BlasLive::LtHandles), 0);
}

// ---- plain cuBLAS -------------------------------------------------------------

fn plain_gemms_compute_and_check() {
    reset();
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let plain = Blas::new(&c0).unwrap();
    assert_eq!(
        plain.version(),
        Some(metrale_runtime::Version::new(13, 1, 0))
    );
    let (m, n, k) = (3usize, 2usize, 4usize);
    let a = col(k, m, |r, c| (r + c) as f32);
    let b = col(k, n, |r, c| r as f32 - c as f32);
    let da = DeviceBuffer::from_host(&s, &a).unwrap();
    let db = DeviceBuffer::from_host(&s, &b).unwrap();
    let mut dc = DeviceBuffer::<f32>::zeroed(&s, m * n).unwrap();
    let shape = GemmShape::new(3, 2, 4).transpose_a();
    plain
        .gemm_ex(&s, &shape, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32)
        .unwrap();
    assert_eq!(
        s.to_vec(&dc).unwrap(),
        reference(&a, (k, m), true, &b, (k, n), false, m, n, k)
    );
    // Strided: two batches.
    let a2: Vec<f32> = (0..2 * m * k).map(|i| i as f32).collect();
    let b2: Vec<f32> = (0..2 * k * n).map(|i| (i % 3) as f32).collect();
    let da2 = DeviceBuffer::from_host(&s, &a2).unwrap();
    let db2 = DeviceBuffer::from_host(&s, &b2).unwrap();
    let mut dc2 = DeviceBuffer::<f32>::zeroed(&s, 2 * m * n).unwrap();
    let shape2 = GemmShape::new(3, 2, 4).batched(2);
    plain
        .gemm_strided_batched(
            &s,
            &shape2,
            1.0,
            &da2,
            &db2,
            0.0,
            &mut dc2,
            ComputeType::F32,
        )
        .unwrap();
    let got = s.to_vec(&dc2).unwrap();
    for t in 0..2 {
        let want = reference(
            &a2[t * 12..(t + 1) * 12],
            (m, k),
            false,
            &b2[t * 8..(t + 1) * 8],
            (k, n),
            false,
            m,
            n,
            k,
        );
        assert_eq!(&got[t * 6..(t + 1) * 6], &want[..], "batch {t}");
    }
    // Device scalars.
    let alpha = DeviceBuffer::from_host(&s, &[2.0f32]).unwrap();
    let beta = DeviceBuffer::from_host(&s, &[0.0f32]).unwrap();
    plain
        .gemm_device_scalars(
            &s,
            &shape2,
            &alpha,
            &da2,
            &db2,
            &beta,
            &mut dc2,
            ComputeType::F32,
        )
        .unwrap();
    let doubled = s.to_vec(&dc2).unwrap();
    assert!(doubled.iter().zip(&got).all(|(d, g)| *d == 2.0 * g));
    plain.set_math_mode(MathMode::Tf32TensorOp).unwrap();
    // The workspace is the stream's own, set on the handle.
    let r = blas().records();
    assert!(
        r.iter()
            .all(|x| x.workspace_size == 32 << 20 && x.stream == s.raw().cast()),
        "{r:?}"
    );
    let s2 = CudaStream::new(&c0).unwrap();
    plain
        .gemm_ex(&s2, &shape, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32)
        .unwrap();
    let last = blas().records().pop().unwrap();
    assert_eq!(last.stream, s2.raw().cast());
    assert_ne!(
        last.workspace, r[0].workspace,
        "never shared across streams"
    );
    // Refusals.
    let calls = blas().calls("cublasGemmEx");
    let bad = GemmShape::new(3, 2, 4).with_ld(2, 4, 3);
    let e = plain
        .gemm_ex(&s, &bad, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32)
        .unwrap_err();
    assert!(
        refusal(&e).contains("cublasGemmEx not called: operand A: ld 2 is less than its rows (3)"),
        "{e}"
    );
    let e = plain
        .gemm_ex(
            &s,
            &GemmShape::new(3, 3, 4),
            1.0,
            &da,
            &db,
            0.0,
            &mut dc,
            ComputeType::F32,
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains(
            "operand B: cublasGemmEx not called: needs at least 12 elements, the buffer has 8"
        ),
        "{e}"
    );
    let huge = GemmShape::new(1 << 31, 1, 1);
    let e = plain
        .gemm_ex(&s, &huge, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32)
        .unwrap_err();
    assert!(
        refusal(&e).contains("m 2147483648 is above cuBLAS's int limit (i32::MAX = 2147483647)"),
        "{e}"
    );
    // usize sizes: a leading dimension past `u32` is named, not wrapped.
    let wide = GemmShape::new(2, 2, 2).with_ld(2, 1 << 33, 2);
    let e = plain
        .gemm_ex(&s, &wide, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32)
        .unwrap_err();
    assert!(
        refusal(&e).contains("ldb 8589934592 is above cuBLAS's int limit"),
        "{e}"
    );
    let fp8 = DeviceBuffer::from_host(&s, &[Fp8E4M3(0); 16]).unwrap();
    let e = plain
        .gemm_ex(
            &s,
            &GemmShape::new(2, 2, 2),
            1.0,
            &fp8,
            &fp8,
            0.0,
            &mut dc,
            ComputeType::F32,
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains("plain cuBLAS takes no FP8 matrices"),
        "{e}"
    );
    let s1 = CudaStream::new(&ctx(1)).unwrap();
    let e = plain
        .gemm_ex(&s1, &shape, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32)
        .unwrap_err();
    assert!(
        refusal(&e).contains("the stream is of device 1, the plan of device 0"),
        "{e}"
    );
    assert_eq!(blas().calls("cublasGemmEx"), calls);
    // Errors name the call, the status and cuBLAS's text.
    blas().fail("cublasGemmEx", 13, 1, Some(1));
    let e = plain
        .gemm_ex(&s, &shape, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32)
        .unwrap_err();
    assert!(e.to_string().ends_with("cublasGemmEx failed: CUBLAS_STATUS_EXECUTION_FAILED (13): fakeblas: the GPU program failed to execute"), "{e}");
    assert_eq!(e.as_library().unwrap().library(), "cuBLAS");
    // Capture: refused without a workspace, fine with one.
    let s3 = CudaStream::new(&c0).unwrap();
    let e = s3
        .capture(|s| plain.gemm_ex(s, &shape, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("has no workspace of this handle yet"),
        "{e}"
    );
    plain.prepare(&s3).unwrap();
    let _graph = s3
        .capture(|s| plain.gemm_ex(s, &shape, 1.0, &da, &db, 0.0, &mut dc, ComputeType::F32))
        .unwrap();
    assert!(blas().records().last().unwrap().capturing);
}

fn grouped_gemms_compute_each_group() {
    reset();
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let plain = Blas::new(&c0).unwrap();
    let a1 = DeviceBuffer::from_host(&s, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let b1 = DeviceBuffer::from_host(&s, &[1.0f32, 0.0, 0.0, 1.0]).unwrap();
    let a2 = DeviceBuffer::from_host(&s, &[2.0f32; 9]).unwrap();
    let b2 = DeviceBuffer::from_host(&s, &[1.0f32; 9]).unwrap();
    let mut c1 = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut c1b = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut c2 = DeviceBuffer::<f32>::zeroed(&s, 9).unwrap();
    let mut groups = vec![
        GemmGroup {
            shape: GemmShape::new(2, 2, 2),
            alpha: 1.0,
            beta: 0.0,
            a: vec![&a1, &a1],
            b: vec![&b1, &b1],
            c: vec![&mut c1, &mut c1b],
        },
        GemmGroup {
            shape: GemmShape::new(3, 3, 3),
            alpha: 0.5,
            beta: 0.0,
            a: vec![&a2],
            b: vec![&b2],
            c: vec![&mut c2],
        },
    ];
    plain
        .gemm_grouped_batched(&s, &mut groups, ComputeType::F32)
        .unwrap();
    drop(groups);
    assert_eq!(s.to_vec(&c1).unwrap(), [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(s.to_vec(&c1b).unwrap(), [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(s.to_vec(&c2).unwrap(), [3.0; 9]);
    // A short C in a group is refused.
    let mut short = DeviceBuffer::<f32>::zeroed(&s, 3).unwrap();
    let mut groups = vec![GemmGroup {
        shape: GemmShape::new(2, 2, 2),
        alpha: 1.0,
        beta: 0.0,
        a: vec![&a1],
        b: vec![&b1],
        c: vec![&mut short],
    }];
    let e = plain
        .gemm_grouped_batched(&s, &mut groups, ComputeType::F32)
        .unwrap_err();
    assert!(
        refusal(&e).contains(
            "cublasGemmGroupedBatchedEx not called: needs at least 4 elements, the buffer has 3"
        ),
        "{e}"
    );
}

// ---- missing library, missing symbol, old library ------------------------------

fn child_output(name: &str, env: &[(&str, &str)]) -> (bool, String, String) {
    let out = harness::run_child(name, env);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn missing_library_missing_symbol_and_old_library() {
    let (ok, stdout, stderr) = child_output(
        "lt_handle",
        &[("METRALE_LIBCUBLASLT_PATH", "/nonexistent/libcublasLt.so.13")],
    );
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains(
            "could not load the cuBLASLt library; tried `/nonexistent/libcublasLt.so.13`: "
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("set METRALE_LIBCUBLASLT_PATH to the library file"),
        "{stdout}"
    );
    // A library that is not cuBLASLt: the first function it needs is named.
    let not_blas = metrale_fakecuda::library_path().display().to_string();
    let (ok, stdout, stderr) =
        child_output("lt_handle", &[("METRALE_LIBCUBLASLT_PATH", &not_blas)]);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains(
            "device 0: creating a cuBLASLt handle: the loaded cuBLASLt library does not export \
             `cublasLtCreate` (its version is unknown: it does not say)"
        ),
        "{stdout}"
    );
    // cuBLAS 12.4: no grouped GEMM, a typed error naming both versions.
    let old = metrale_fakecuda::old_blas_library_path()
        .display()
        .to_string();
    let (ok, stdout, stderr) = child_output("grouped", &[("METRALE_LIBCUBLAS_PATH", &old)]);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains(
            "cublasGemmGroupedBatchedEx needs cuBLAS 12.5 or newer; the loaded library is 12.4.0"
        ),
        "{stdout}"
    );
    // A 12.5+ version that still lacks the symbol: the missing-symbol error.
    let (ok, stdout, stderr) =
        child_output("grouped_claims_new", &[("METRALE_LIBCUBLAS_PATH", &old)]);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains("does not export `cublasGemmGroupedBatchedEx` (it is version 13.1)"),
        "{stdout}"
    );
}

/// On a driver without user objects (the old stand-in), a capture holds its
/// workspace through a host node instead.
fn without_user_objects_a_host_node_holds_the_workspace() {
    let old = metrale_fakecuda::old_library_path().display().to_string();
    let (ok, stdout, stderr) =
        child_output("old_driver_capture", &[("METRALE_LIBCUDA_PATH", &old)]);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains("host nodes 1, memory held 1, freed 1"),
        "{stdout}{stderr}"
    );
}

fn old_driver_capture_child() {
    // The old stand-in is the loaded driver here: read its counters.
    let old = Fake::open(metrale_fakecuda::old_library_path());
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let lt = BlasLt::new(&c0).unwrap();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let before = old.live(Live::DeviceMemory);
    lt.prepare(&s).unwrap();
    let graph = s
        .capture(|s| plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d))
        .unwrap();
    let hosts = graph
        .nodes()
        .unwrap()
        .iter()
        .filter(|n| n.kind() == metrale_runtime::GraphNodeKind::Host)
        .count();
    lt.release_workspace(&s);
    drop(plan);
    drop(lt);
    let held = old.live(Live::DeviceMemory) - before;
    drop(graph);
    s.synchronize().unwrap();
    let freed = held - (old.live(Live::DeviceMemory) - before);
    println!("host nodes {hosts}, memory held {held}, freed {freed}");
}

fn grouped_child() {
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let plain = Blas::new(&c0).unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut groups = vec![GemmGroup {
        shape: GemmShape::new(2, 2, 2),
        alpha: 1.0,
        beta: 0.0,
        a: vec![&a],
        b: vec![&a],
        c: vec![&mut c],
    }];
    match plain.gemm_grouped_batched(&s, &mut groups, ComputeType::F32) {
        Ok(()) => println!("ran?"),
        Err(e) => println!("{e}"),
    }
}

fn main() -> ExitCode {
    if std::env::var_os("METRALE_TEST_CHILD").is_none() {
        std::env::set_var("METRALE_LIBCUDA_PATH", metrale_fakecuda::library_path());
        let blas = metrale_fakecuda::blas_library_path();
        std::env::set_var("METRALE_LIBCUBLASLT_PATH", blas);
        std::env::set_var("METRALE_LIBCUBLAS_PATH", blas);
        #[cfg(feature = "nccl")]
        std::env::set_var(
            "METRALE_LIBNCCL_PATH",
            metrale_fakecuda::nccl_library_path(),
        );
    }
    macro_rules! tests {
        ($($f:ident),* $(,)?) => { vec![$(harness::Test { name: stringify!($f), run: $f }),*] };
    }
    let tests = tests![
        f32_results_match_the_host_reference_with_transposes,
        row_major_layouts_and_leading_dimensions,
        every_epilogue_with_its_bias,
        strided_batches_compute_each_matrix,
        half_bf16_and_fp8_with_scales,
        problems_that_break_a_rule_are_refused_before_the_heuristic,
        zero_algorithms_is_a_typed_error_naming_the_problem,
        candidates_are_the_heuristics_algorithms_in_order_each_a_checked_plan,
        the_plan_cache_hits_on_equal_problems_and_misses_on_any_change,
        buffers_are_checked_against_the_plan_before_the_library,
        d_overlapping_a_or_part_of_c_is_refused,
        in_place_needs_c_and_d_alike,
        each_stream_has_its_own_workspace,
        captures_need_a_prepared_workspace_which_the_graph_keeps,
        every_call_binds_the_handles_context,
        green_context_streams_and_a_released_host_work,
        library_errors_name_call_status_text_and_subject,
        plain_gemms_compute_and_check,
        grouped_gemms_compute_each_group,
        missing_library_missing_symbol_and_old_library,
        without_user_objects_a_host_node_holds_the_workspace,
        defect_a_second_threads_gemm_waits_for_the_captures_workspace_holder,
        held_without_user_objects_a_second_threads_gemm_waits_for_the_host_node,
        defect_a_bias_and_fp8_scales_get_use_records_as_a_does,
        plans_reduce_in_the_compute_type_unless_told_otherwise,
        defect_a_capture_cannot_begin_inside_a_grouped_gemm,
        defect_fp8_leading_dimensions_off_16_bytes_are_refused_naming_the_rule,
        defect_a_graph_holding_a_gemm_workspace_is_replayed_into_a_capture,
        defect_a_capture_ends_while_a_gemm_holds_its_graph_handle,
        held_without_user_objects_a_workspace_graph_is_not_replayed_into_a_capture,
        held_mixed_stress_with_captures_on_shared_streams,
        held_deferred_frees_retried_as_captures_end_on_many_threads,
    ];
    let children = [
        harness::Child {
            name: "lt_handle",
            run: || match BlasLt::new(&ctx(0)) {
                Ok(_) => println!("loaded?"),
                Err(e) => println!("{e}"),
            },
        },
        harness::Child {
            name: "grouped",
            run: grouped_child,
        },
        harness::Child {
            name: "old_driver_capture",
            run: old_driver_capture_child,
        },
        harness::Child {
            name: "old_driver_replay_in_capture",
            run: audit6::old_driver_replay_in_capture_child,
        },
        harness::Child {
            name: "old_driver_two_threads",
            run: round5::old_driver_two_threads_child,
        },
        harness::Child {
            name: "grouped_claims_new",
            run: || {
                // Kept open, so the library (and the version set) stays loaded.
                let old = FakeBlas::open(metrale_fakecuda::old_blas_library_path());
                old.set_version(130100);
                grouped_child();
                drop(old);
            },
        },
    ];
    let gate = || match metrale_runtime::sys::cublas::cublas_lt() {
        Ok(l) if l.path().contains("metrale_fakeblas") => Ok(()),
        Ok(l) => Err(format!(
            "METRALE_LIBCUBLASLT_PATH names {}, not the stand-in",
            l.path()
        )),
        Err(e) => Err(e.to_string()),
    };
    harness::main(
        &tests,
        &children,
        gate,
        Some("the stand-in cuBLAS (always required here)"),
    )
}
