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
