//! Issue 40's cuBLAS items against the stand-ins: a captured GEMM's workspace
//! held before a second thread's GEMM is recorded (item 1), use records for
//! every operand the room takes (item 2), the reduction-precision option
//! (item 8), the grouped GEMM's section held through its upload (item 11),
//! and FP8 leading dimensions refused before the library (item 12).
//!
//! The races are forced with the stand-in driver's pause points, and every
//! wait is bounded: a test that would hang fails instead.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use metrale_fakecuda::{Fake, Live};
use metrale_runtime::blas::{
    Blas, BlasLt, ComputeType, Epilogue, Fp8E4M3, GemmGroup, GemmShape, MatmulDesc, MatmulExtras,
    Reduction, ScaleMode, Transpose,
};
use metrale_runtime::{CaptureMode, CudaStream, DeviceBuffer};

use super::{blas, ctx, fake, refusal, reset};

/// How long a test waits for something that, with the defect, happens at
/// once (and, fixed, does not happen until the test lets it).
const BOUND: Duration = Duration::from_millis(1500);

/// Poll `f` until it is true or `BOUND` passes; its last answer.
fn within_bound(f: impl Fn() -> bool) -> bool {
    let end = Instant::now() + BOUND;
    while !f() {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Item 1, forced: thread 1's GEMM on a capturing stream stops inside the
/// making of the capture's workspace holder (`pause`: `cuUserObjectCreate`,
/// or `cuLaunchHostFunc` for the host-node fallback); thread 2's GEMM on the
/// same stream must not be recorded before that holder exists. When it is
/// (the defect), the capture is ended and instantiated at once, as the issue
/// describes, before thread 1 goes on. Returns "recorded early N, held by
/// the executable H, freed after F".
fn second_thread_scenario(f: &Fake, pause: &str, end_early: bool) -> String {
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let lt = BlasLt::new(&c0).unwrap();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d1 = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d2 = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    lt.prepare(&s).unwrap();
    let with_workspace = f.live(Live::DeviceMemory);
    let matmuls = blas().calls("cublasLtMatmul");
    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    f.pause_next(pause);
    let (early, early_exec) = std::thread::scope(|sc| {
        let t1 = sc.spawn(|| plan.matmul(&s, 1.0, &a, &a, 0.0, &c, &mut d1));
        assert!(
            f.wait_paused(pause, 10_000),
            "thread 1's GEMM reaches {pause}"
        );
        let t2 = sc.spawn(|| plan.matmul(&s, 1.0, &a, &a, 0.0, &c, &mut d2));
        // Bounded: with the defect thread 2 records at once; fixed, it waits
        // for thread 1's holder, which waits for the resume below.
        let early = within_bound(|| blas().calls("cublasLtMatmul") > matmuls);
        let early_exec = (early && end_early).then(|| {
            let graph = s.end_capture().unwrap();
            let exec = graph.instantiate().unwrap();
            (graph, exec)
        });
        f.resume(pause);
        t1.join().unwrap().unwrap();
        t2.join().unwrap().unwrap();
        (early, early_exec)
    });
    let (graph, exec) = match early_exec {
        Some(ge) => ge,
        None => {
            let graph = s.end_capture().unwrap();
            let exec = graph.instantiate().unwrap();
            (graph, exec)
        }
    };
    // Everything but the executable lets go of the workspace.
    lt.release_workspace(&s);
    drop(plan);
    drop(lt);
    drop(graph);
    s.synchronize().unwrap();
    let held = f.live(Live::DeviceMemory) - (with_workspace - 1);
    drop(exec);
    s.synchronize().unwrap();
    let freed = held - (f.live(Live::DeviceMemory) - (with_workspace - 1));
    format!(
        "recorded early {}, held by the executable {held}, freed after {freed}",
        u8::from(early)
    )
}

pub fn defect_a_second_threads_gemm_waits_for_the_captures_workspace_holder() {
    reset();
    let report = second_thread_scenario(fake(), "cuUserObjectCreate", true);
    assert_eq!(
        report, "recorded early 0, held by the executable 1, freed after 1",
        "a GEMM recorded into a capture before its workspace's holder existed: the executable \
         replays into freed memory"
    );
    assert_eq!(
        fake().user_objects(),
        0,
        "the holder went with the executable"
    );
}

/// The host-node fallback (the old stand-in driver has no user objects), in a
/// child process. Thread 1 holds the stream's section while its host node is
/// queued, so this race could not be forced before the fix either: it checks
/// that the fallback makes the mark after the holder too, and that the
/// executable holds the workspace.
pub fn held_without_user_objects_a_second_threads_gemm_waits_for_the_host_node() {
    let old = metrale_fakecuda::old_library_path().display().to_string();
    let (ok, stdout, stderr) =
        super::child_output("old_driver_two_threads", &[("METRALE_LIBCUDA_PATH", &old)]);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains("recorded early 0, held by the executable 1, freed after 1"),
        "{stdout}{stderr}"
    );
}

pub fn old_driver_two_threads_child() {
    let old = Fake::open(metrale_fakecuda::old_library_path());
    println!(
        "{}",
        second_thread_scenario(&old, "cuLaunchHostFunc", false)
    );
}

/// Item 2: a buffer allocated in stream order on S1 and used on S2 gets one
/// event on S1 and one wait on S2 at its first use there, and its free on S1
/// is ordered after S2's work (an event on S2, a wait on S1), whichever
/// operand of the GEMM it is: A, the bias, an FP8 scale.
pub fn defect_a_bias_and_fp8_scales_get_use_records_as_a_does() {
    reset();
    let c0 = ctx(0);
    let (s1, s2) = (CudaStream::new(&c0).unwrap(), CudaStream::new(&c0).unwrap());
    let lt = BlasLt::new(&c0).unwrap();
    let counts = || {
        (
            fake().calls("cuEventRecord"),
            fake().calls("cuStreamWaitEvent"),
        )
    };
    let delta = |before: (i64, i64)| {
        let now = counts();
        (now.0 - before.0, now.1 - before.1)
    };
    let (m, n, k) = (4usize, 2usize, 2usize);
    let b = DeviceBuffer::<f32>::zeroed(&s2, k * n).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s2, m * n).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s2, m * n).unwrap();
    // As A.
    let plain = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(m, n, k))
        .unwrap();
    let mut a = s1.alloc::<f32>(m * k).unwrap();
    s1.copy_h2d(&[1.0f32; 8], &mut a).unwrap();
    let before = counts();
    plain.matmul(&s2, 1.0, &a, &b, 0.0, &c, &mut d).unwrap();
    assert_eq!(delta(before), (1, 1), "A: one event on S1, one wait on S2");
    let before = counts();
    drop(a);
    assert_eq!(delta(before), (1, 1), "A's free waits for S2's GEMM");
    // As the bias.
    let biased = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(m, n, k).epilogue(Epilogue::Bias))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s2, m * k).unwrap();
    let mut bias = s1.alloc::<f32>(m).unwrap();
    s1.copy_h2d(&[1.0f32; 4], &mut bias).unwrap();
    let before = counts();
    biased
        .matmul_with(
            &s2,
            1.0,
            &a,
            &b,
            0.0,
            &c,
            &mut d,
            MatmulExtras::new().bias(&bias),
        )
        .unwrap();
    assert_eq!(delta(before), (1, 1), "the bias: as A");
    assert_eq!(s2.to_vec(&d).unwrap(), [1.0; 8], "0 + bias");
    let before = counts();
    drop(bias);
    assert_eq!(delta(before), (1, 1), "the bias's free waits for S2's GEMM");
    assert_eq!(fake().last_free_stream(), s1.raw().cast(), "freed on S1");
    // As FP8 scales (A transposed, as Hopper wants).
    let fp8 = lt
        .plan(
            &MatmulDesc::new::<Fp8E4M3, Fp8E4M3, f32, f32>(16, 16, 16)
                .transpose_a(Transpose::Yes)
                .a_scale(ScaleMode::Tensor)
                .b_scale(ScaleMode::Tensor),
        )
        .unwrap();
    let fa = DeviceBuffer::from_host(&s2, &[Fp8E4M3(0x38); 256]).unwrap();
    let fc = DeviceBuffer::<f32>::zeroed(&s2, 256).unwrap();
    let mut fd = DeviceBuffer::<f32>::zeroed(&s2, 256).unwrap();
    let mut sa = s1.alloc::<f32>(1).unwrap();
    let mut sb = s1.alloc::<f32>(1).unwrap();
    s1.copy_h2d(&[0.5f32], &mut sa).unwrap();
    s1.copy_h2d(&[2.0f32], &mut sb).unwrap();
    let before = counts();
    fp8.matmul_with(
        &s2,
        1.0,
        &fa,
        &fa,
        0.0,
        &fc,
        &mut fd,
        MatmulExtras::new().a_scale(&sa).b_scale(&sb),
    )
    .unwrap();
    assert_eq!(delta(before), (2, 2), "each scale: as A");
    let before = counts();
    drop(sa);
    drop(sb);
    assert_eq!(
        delta(before),
        (2, 2),
        "each scale's free waits for S2's GEMM"
    );
    // Device scalars of plain cuBLAS, for comparison (noted before this round).
    let plainblas = Blas::new(&c0).unwrap();
    let mut alpha = s1.alloc::<f32>(1).unwrap();
    s1.copy_h2d(&[1.0f32], &mut alpha).unwrap();
    let beta = DeviceBuffer::<f32>::zeroed(&s2, 1).unwrap();
    let before = counts();
    plainblas
        .gemm_device_scalars(
            &s2,
            &GemmShape::new(m, n, k),
            &alpha,
            &a,
            &b,
            &beta,
            &mut d,
            ComputeType::F32,
        )
        .unwrap();
    assert_eq!(delta(before), (1, 1), "a device alpha: as A");
    s2.synchronize().unwrap();
}

/// Item 8 on the stand-in: a plan asks the heuristic for exact reductions
/// (partial sums in the compute type) unless told otherwise, and the choice
/// is part of the plan cache's key.
pub fn plans_reduce_in_the_compute_type_unless_told_otherwise() {
    reset();
    let lt = BlasLt::new(&ctx(0)).unwrap();
    let desc = MatmulDesc::new::<half::bf16, half::bf16, half::bf16, half::bf16>(1000, 1001, 999);
    let exact = lt.plan(&desc).unwrap();
    assert_eq!(exact.problem().reduction(), Reduction::Exact);
    assert_eq!(
        blas().last_reduction_mask(),
        2,
        "CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE only"
    );
    let reduced = lt
        .plan(&desc.clone().reduction(Reduction::ReducedPrecision))
        .unwrap();
    assert_eq!(blas().last_reduction_mask(), 7, "every scheme");
    assert!(!reduced.same_plan(&exact), "a separate cache entry");
    assert!(
        reduced
            .problem()
            .to_string()
            .contains("reduction ReducedPrecision"),
        "{}",
        reduced.problem()
    );
    assert!(lt
        .plan(&desc.reduction(Reduction::Exact))
        .unwrap()
        .same_plan(&exact));
}

/// Item 11, forced: a grouped GEMM stops in the allocation of its pointer
/// arrays (`cuMemAlloc_v2`), after its capture check; another thread begins a
/// capture on the stream then. The capture must wait for the grouped GEMM
/// (its section covers the check, the upload, the call and the wait), so the
/// GEMM runs eagerly and the capture stays valid and empty.
pub fn defect_a_capture_cannot_begin_inside_a_grouped_gemm() {
    reset();
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let plain = Blas::new(&c0).unwrap();
    plain.prepare(&s).unwrap();
    let a = DeviceBuffer::from_host(&s, &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let b = DeviceBuffer::from_host(&s, &[1.0f32, 0.0, 0.0, 1.0]).unwrap();
    let mut c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let grouped_calls = blas().calls("cublasGemmGroupedBatchedEx");
    fake().pause_next("cuMemAlloc_v2");
    let (began, go) = (mpsc::channel::<()>(), mpsc::channel::<()>());
    let (began_tx, began_rx) = began;
    let (go_tx, go_rx) = go;
    let s = &s;
    let (ran, began_inside, captured) = std::thread::scope(|sc| {
        let t1 = sc.spawn(|| {
            let mut groups = vec![GemmGroup {
                shape: GemmShape::new(2, 2, 2),
                alpha: 1.0,
                beta: 0.0,
                a: vec![&a],
                b: vec![&b],
                c: vec![&mut c],
            }];
            plain.gemm_grouped_batched(s, &mut groups, ComputeType::F32)
        });
        assert!(
            fake().wait_paused("cuMemAlloc_v2", 10_000),
            "the grouped GEMM reaches its upload"
        );
        let t3 = sc.spawn(move || {
            s.begin_capture(CaptureMode::ThreadLocal).unwrap();
            began_tx.send(()).unwrap();
            go_rx.recv_timeout(Duration::from_secs(30)).unwrap();
            s.end_capture()
        });
        let began_inside = began_rx.recv_timeout(BOUND).is_ok();
        fake().resume("cuMemAlloc_v2");
        let ran = t1.join().unwrap();
        if !began_inside {
            began_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        }
        go_tx.send(()).unwrap();
        (ran, began_inside, t3.join().unwrap())
    });
    let graph_nodes = captured.as_ref().map(|g| g.nodes().unwrap().len());
    let recorded_in_capture = blas()
        .records()
        .iter()
        .filter(|r| r.call == "cublasGemmGroupedBatchedEx" && r.capturing)
        .count();
    assert_eq!(
        (
            began_inside,
            ran.is_ok(),
            recorded_in_capture,
            graph_nodes.ok()
        ),
        (false, true, 0, Some(0)),
        "a capture began inside the grouped GEMM: {ran:?}, {:?}",
        captured.err()
    );
    assert_eq!(
        blas().calls("cublasGemmGroupedBatchedEx"),
        grouped_calls + 1
    );
    assert_eq!(s.to_vec(&c).unwrap(), [1.0, 2.0, 3.0, 4.0], "ran eagerly");
}

/// Item 12: an FP8 plan whose FP8 matrices' leading dimensions are not a
/// multiple of 16 bytes is refused before the heuristic, naming the rule.
pub fn defect_fp8_leading_dimensions_off_16_bytes_are_refused_naming_the_rule() {
    reset();
    let lt = BlasLt::new(&ctx(0)).unwrap();
    let heuristics = blas().calls("cublasLtMatmulAlgoGetHeuristic");
    // The shape: A transposed, stored 999 x 1000 (ld 999 bytes).
    let e = lt
        .plan(
            &MatmulDesc::new::<Fp8E4M3, Fp8E4M3, half::bf16, half::bf16>(1000, 1001, 999)
                .transpose_a(Transpose::Yes),
        )
        .unwrap_err();
    let text = refusal(&e);
    assert!(
        text.contains(
            "operand A: an FP8 matrix's leading dimension must be a multiple of 16 bytes \
             (cuBLASLt's FP8 kernels on Hopper and Ada take no other); layout 999x1000 col ld \
             999: its ld is 999 bytes (pad ld to a multiple of 16)"
        ),
        "{text}"
    );
    assert_eq!(
        blas().calls("cublasLtMatmulAlgoGetHeuristic"),
        heuristics,
        "refused before the library"
    );
    // Padded to 1008, it is planned.
    let padded = metrale_runtime::blas::MatrixLayout::col_major(999, 1000).with_ld(1008);
    let e = lt
        .plan(
            &MatmulDesc::new::<Fp8E4M3, Fp8E4M3, half::bf16, half::bf16>(1000, 1001, 999)
                .transpose_a(Transpose::Yes)
                .layout_a(padded),
        )
        .unwrap_err();
    assert!(
        refusal(&e).contains("operand B: an FP8 matrix's leading dimension"),
        "B next: {e}"
    );
    let b = metrale_runtime::blas::MatrixLayout::col_major(999, 1001).with_ld(1008);
    lt.plan(
        &MatmulDesc::new::<Fp8E4M3, Fp8E4M3, half::bf16, half::bf16>(1000, 1001, 999)
            .transpose_a(Transpose::Yes)
            .layout_a(padded)
            .layout_b(b),
    )
    .unwrap();
    assert_eq!(
        blas().calls("cublasLtMatmulAlgoGetHeuristic"),
        heuristics + 1
    );
}
