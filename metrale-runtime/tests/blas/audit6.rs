//! Audit of issue 43's round, the cuBLAS items, against the stand-ins.
//! `defect_*`: failed on the code of the round; `held_*`: attacks that held.

use metrale_fakecuda::Live;
use metrale_runtime::blas::{BlasLt, MatmulDesc};
use metrale_runtime::{CudaStream, DeviceBuffer};

use super::{ctx, fake, reset};

/// A graph that captured a GEMM holds the stream's workspace through a user
/// object retained into the capture's graph (`keep_for_capture`), which the
/// `CudaGraph` did not know of: its executables said they held nothing, so
/// their replays were allowed inside another capture, whose graph holds
/// nothing (the stand-in, like CUDA, copies the replayed work into it). With
/// the executable, the plan and the handle dropped, the workspace was freed
/// while that outer graph, which replays the GEMM into it, lived. A replay
/// of an executable whose capture holds anything is refused in a capture
/// now, as one holding an arena or host functions was.
pub fn defect_a_graph_holding_a_gemm_workspace_is_replayed_into_a_capture() {
    reset();
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let s2 = CudaStream::new(&c0).unwrap();
    let lt = BlasLt::new(&c0).unwrap();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    lt.prepare(&s).unwrap();
    s.synchronize().unwrap();
    let graph = s
        .capture(|s| plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d))
        .unwrap();
    let exec = graph.instantiate().unwrap();
    drop(graph);
    assert_eq!(fake().user_objects(), 1, "the workspace's holder");
    let with_workspace = fake().live(Live::DeviceMemory);
    // SAFETY: the GEMM's buffers outlive every replay here.
    let outer = s2.capture(|s2| unsafe { exec.launch(s2) });
    let Ok(outer) = outer else {
        let e = outer.unwrap_err();
        assert!(e.to_string().contains("being captured"), "{e}");
        drop(exec);
        lt.release_workspace(&s);
        drop((plan, lt));
        s.synchronize().unwrap();
        assert_eq!(fake().user_objects(), 0);
        drop((a, c, d));
        return;
    };
    let outer_exec = outer.instantiate().unwrap();
    drop(exec);
    lt.release_workspace(&s);
    drop((plan, lt));
    s.synchronize().unwrap();
    let freed = fake().live(Live::DeviceMemory) < with_workspace;
    drop((outer_exec, outer));
    s.synchronize().unwrap();
    drop((a, c, d));
    panic!(
        "an executable holding a GEMM workspace was replayed inside a capture; the outer \
         graph holds nothing (workspace freed while it lives: {freed})"
    );
}

/// A GEMM on a capturing stream reads the capture's graph
/// (`cuStreamGetCaptureInfo`) and then retains its workspace's user object
/// into it, outside any section of the stream: the thread that began the
/// capture could end it in between and drop the graph, and the GEMM then
/// handed the driver a destroyed graph (`cuGraphRetainUserObject` on a
/// dangling handle: undefined behaviour on CUDA; the stand-in refuses it).
/// Forced with the stand-in's pause at `cuUserObjectCreate` (between the two):
/// the end returned at once. The holder is made inside a section of the
/// stream now, so the end waits for it and the graph it returns holds the
/// workspace. Bounded: the end is given `BOUND` before the GEMM goes on.
pub fn defect_a_capture_ends_while_a_gemm_holds_its_graph_handle() {
    use std::sync::mpsc;
    use std::time::Duration;

    use metrale_runtime::CaptureMode;

    const BOUND: Duration = Duration::from_millis(500);
    reset();
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let lt = BlasLt::new(&c0).unwrap();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    lt.prepare(&s).unwrap();
    s.synchronize().unwrap();
    let (ended_early, gemm, held) = std::thread::scope(|sc| {
        let (began_tx, began_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (ended_tx, ended_rx) = mpsc::channel();
        let s = &s;
        // The capturing thread: begins, then ends when told and drops the
        // graph at once (what it returns says whether it holds anything).
        let ender = sc.spawn(move || {
            s.begin_capture(CaptureMode::ThreadLocal).unwrap();
            began_tx.send(()).unwrap();
            let _ = go_rx.recv_timeout(Duration::from_secs(10));
            let graph = s.end_capture();
            let _ = ended_tx.send(());
            graph.map(|g| g.instantiate().map(|e| drop((g, e))))
        });
        began_rx.recv().unwrap();
        fake().pause_next("cuUserObjectCreate");
        let gemm = sc.spawn(|| plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d));
        assert!(
            fake().wait_paused("cuUserObjectCreate", 10_000),
            "the GEMM makes its workspace's holder"
        );
        go_tx.send(()).unwrap();
        let ended_early = ended_rx.recv_timeout(BOUND).is_ok();
        fake().resume("cuUserObjectCreate");
        let gemm = gemm.join().unwrap();
        let ended = ender.join().unwrap();
        (ended_early, gemm, ended.is_ok())
    });
    lt.release_workspace(&s);
    drop((plan, lt));
    s.synchronize().unwrap();
    assert!(
        !ended_early,
        "the capture ended (and its graph was dropped) while a GEMM held its graph handle; \
         the GEMM then gave: {gemm:?}"
    );
    gemm.unwrap();
    assert!(held, "the capture ended");
    assert_eq!(fake().user_objects(), 0, "the holder went with the graph");
    drop((a, c, d));
}

/// The same attack on a driver without user objects (the old stand-in, in a
/// child process): the workspace rides with a host node, which the graph
/// holds, so its executables' replays were already refused in a capture.
pub fn held_without_user_objects_a_workspace_graph_is_not_replayed_into_a_capture() {
    let old = metrale_fakecuda::old_library_path().display().to_string();
    let (ok, stdout, stderr) = super::child_output(
        "old_driver_replay_in_capture",
        &[("METRALE_LIBCUDA_PATH", &old)],
    );
    assert!(ok, "{stdout}{stderr}");
    assert!(stdout.contains("refused: true"), "{stdout}{stderr}");
}

pub fn old_driver_replay_in_capture_child() {
    let c0 = ctx(0);
    let s = CudaStream::new(&c0).unwrap();
    let s2 = CudaStream::new(&c0).unwrap();
    let lt = BlasLt::new(&c0).unwrap();
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(2, 2, 2))
        .unwrap();
    let a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let c = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    lt.prepare(&s).unwrap();
    let graph = s
        .capture(|s| plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d))
        .unwrap();
    let exec = graph.instantiate().unwrap();
    // SAFETY: the GEMM's buffers outlive every replay here.
    let outer = s2.capture(|s2| unsafe { exec.launch(s2) });
    println!("refused: {}", outer.is_err());
    drop(outer);
    drop((exec, graph));
    s.synchronize().unwrap();
}
