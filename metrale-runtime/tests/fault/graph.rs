//! Graphs against the stand-in: capture, fork/join, invalidation, replay, updates,
//! DOT, conditional nodes, and every drop order.

use std::sync::Arc;

use crate::common::*;
use crate::harness::Test;

fn cfg() -> LaunchConfig {
    LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap()
}

/// Capture `n` axpb steps on `s`.
fn capture_chain(
    s: &CudaStream,
    f: &CudaFunction,
    x: &DeviceBuffer<u32>,
    n: u32,
    b: u32,
) -> CudaGraph {
    s.capture(|s| -> metrale_runtime::Result<()> {
        for i in 0..n {
            // SAFETY: the stand-in only records the arguments.
            unsafe { s.launch(f, cfg(), (x, 1u32, b + i))? };
        }
        Ok(())
    })
    .unwrap()
}

fn capture_replay_and_inspect() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "axpb").unwrap();
    let x = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let launches = fake().launches();
    let graph = capture_chain(s, &f, &x, 5, 10);
    assert_eq!(fake().launches(), launches, "captured, not run");
    assert!(!s.is_capturing().unwrap());
    let nodes = graph.nodes().unwrap();
    assert_eq!(nodes.len(), 5);
    assert!(nodes.iter().all(|n| n.kind() == GraphNodeKind::Kernel));
    assert_eq!(graph.edges().unwrap(), [(0, 1), (1, 2), (2, 3), (3, 4)]);
    let kernels = graph.kernel_nodes().unwrap();
    assert!(kernels.iter().all(|k| k.name == "kernels::axpb"));
    assert_eq!(kernels[0].config, cfg());
    let exec = graph.instantiate().unwrap();
    exec.upload(s).unwrap();
    // SAFETY: x is alive.
    unsafe { exec.launch(s) }.unwrap();
    assert_eq!(fake().launches(), launches + 5);
    assert_eq!(fake().last_param(2), 14, "the last node's argument");
    // DOT.
    let path = std::env::temp_dir().join(format!("metrale-graph-{}.dot", std::process::id()));
    graph.write_dot(&path).unwrap();
    let dot = std::fs::read_to_string(&path).unwrap();
    assert!(
        dot.starts_with("digraph") && dot.matches("axpb").count() == 5,
        "{dot}"
    );
    std::fs::remove_file(&path).unwrap();
    let e = graph.write_dot("/nonexistent-folder/g.dot").unwrap_err();
    assert!(
        e.to_string().ends_with(
            "writing DOT to /nonexistent-folder/g.dot: cuGraphDebugDotPrint failed: \
             CUDA_ERROR_OPERATING_SYSTEM (304): OS call failed or operation not supported on this OS"
        ),
        "{e}"
    );
    drop((exec, graph, x, f));
    done(reg);
}

fn fork_join_across_two_streams() {
    let reg = setup();
    let (a, b) = (reg.stream(), CudaStream::new(reg.ctx()).unwrap());
    let f = reg.function("kernels", "axpb").unwrap();
    let x = DeviceBuffer::<u32>::zeroed(a, 2).unwrap();
    let (fork, join) = (
        CudaEvent::new(reg.ctx()).unwrap(),
        CudaEvent::new(reg.ctx()).unwrap(),
    );
    a.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: the stand-in only records the arguments (for every launch below).
    unsafe { a.launch(&f, cfg(), (&x, 1u32, 1u32)) }.unwrap();
    fork.record(a).unwrap();
    b.wait(&fork).unwrap();
    // SAFETY: as above.
    unsafe { a.launch(&f, cfg(), (&x, 1u32, 2u32)) }.unwrap();
    // SAFETY: as above.
    unsafe { b.launch(&f, cfg(), (&x, 1u32, 3u32)) }.unwrap();
    join.record(&b).unwrap();
    a.wait(&join).unwrap();
    // SAFETY: as above.
    unsafe { a.launch(&f, cfg(), (&x, 1u32, 4u32)) }.unwrap();
    let graph = a.end_capture().unwrap();
    assert_eq!(graph.nodes().unwrap().len(), 4);
    let mut edges = graph.edges().unwrap();
    edges.sort();
    assert_eq!(edges, [(0, 1), (0, 2), (1, 3), (2, 3)], "a diamond");
    assert!(!b.is_capturing().unwrap());
    drop((graph, fork, join, b, x, f));
    done(reg);
}

fn an_invalidated_capture_is_reported_and_the_stream_recovers() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "axpb").unwrap();
    let x = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    s.begin_capture(CaptureMode::default()).unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg(), (&x, 1u32, 1u32)) }.unwrap();
    let e = s.synchronize().unwrap_err();
    assert_eq!(e.status(), Some(CUresult(900)));
    let e = s.end_capture().unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "device 0 stream {:p} end capture (capture status: invalidated): cuStreamEndCapture failed: \
             CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901): operation failed due to a previous error during capture",
            s.raw()
        )
    );
    // The stream runs work again.
    let launches = fake().launches();
    // SAFETY: as above.
    unsafe { s.launch(&f, cfg(), (&x, 1u32, 1u32)) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(fake().launches(), launches + 1);
    // A closure that fails still ends the capture.
    let e = s
        .capture(|s| -> metrale_runtime::Result<()> {
            // SAFETY: refused before the driver.
            unsafe { s.launch(&f, cfg(), (&x, 1u32)) }
        })
        .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::ArgumentMismatch { .. }),
        "{e}"
    );
    assert!(!s.is_capturing().unwrap());
    assert_eq!(fake().live(Live::Graphs), 0);
    drop((x, f));
    done(reg);
}

fn graphs_update_whole_and_per_node() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "axpb").unwrap();
    let x = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let g1 = capture_chain(s, &f, &x, 3, 0);
    let mut exec = g1.instantiate().unwrap();
    // Same topology: accepted, and replays use the new arguments.
    let g2 = capture_chain(s, &f, &x, 3, 100);
    exec.update(&g2).unwrap();
    // SAFETY: x is alive.
    unsafe { exec.launch(s) }.unwrap();
    assert_eq!(fake().last_param(2), 102);
    // Another topology: refused with the driver's reason.
    let g3 = capture_chain(s, &f, &x, 4, 0);
    let e = exec.update(&g3).unwrap_err();
    assert!(
        e.to_string().starts_with(
            "device 0 executable graph update: cuGraphExecUpdate_v2 failed: CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE (910): \
             the graph update was not performed because it included changes which violated constraints specific to \
             instantiated graph update; refused because the graph's topology changed (nodes or edges added or removed) \
             (CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED), at kernel node 0x"
        ) && e.to_string().ends_with("('kernels::axpb')"),
        "{e}"
    );
    assert!(matches!(
        e.kind(),
        ErrorKind::GraphUpdate {
            call: "cuGraphExecUpdate_v2",
            ..
        }
    ));
    assert_eq!(
        e.status(),
        Some(CUresult(910)),
        "the update refusal carries its status"
    );
    // Per node, typed and checked like a launch.
    let nodes = g1.kernel_nodes().unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { exec.set_kernel_params(&nodes[2], &f, cfg(), (&x, 3u32, 77u32)) }.unwrap();
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    assert_eq!((fake().last_param(1), fake().last_param(2)), (3, 77));
    // SAFETY: refused before the driver.
    let e = unsafe { exec.set_kernel_params(&nodes[2], &f, cfg(), (&x, 3u64, 77u32)) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::axpb': launch not attempted, argument 1 is 8 bytes, the kernel's parameter 1 is 4 bytes"
    );
    let other = reg.function("kernels", "empty").unwrap();
    // SAFETY: refused before the driver.
    let e = unsafe { exec.set_kernel_params(&nodes[0], &other, cfg(), (&x, 1u32, 1.0f32)) }
        .unwrap_err();
    assert!(
        e.to_string()
            .ends_with("runs kernel 'kernels::axpb', not 'kernels::empty'"),
        "{e}"
    );
    drop((exec, g1, g2, g3, x, f, other));
    done(reg);
}

fn graphs_built_node_by_node_with_a_while_loop() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "axpb").unwrap();
    let x = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let mut g = CudaGraph::new(reg.ctx()).unwrap();
    // SAFETY: the stand-in only records the arguments.
    let first = unsafe { g.add_kernel_node(&[], &f, cfg(), (&x, 2u32, 1u32)) }.unwrap();
    let w = g
        .add_while(&[first], true, |body, handle| {
            assert_ne!(handle.0, 0);
            // SAFETY: as above.
            unsafe { body.add_kernel_node(&[], &f, cfg(), (&x, 1u32, 3u32)) }?;
            Ok(())
        })
        .unwrap();
    assert_eq!(w.kind(), GraphNodeKind::Conditional);
    assert_eq!(g.nodes().unwrap().len(), 2);
    assert_eq!(g.edges().unwrap(), [(0, 1)]);
    drop((g, x, f));
    done(reg);
}

/// Graph, executable graph, stream and registry dropped in every order: nothing
/// leaks and nothing is used after it was freed (the stand-in checks handles).
fn drop_order_never_matters() {
    let orders: [[usize; 4]; 6] = [
        [0, 1, 2, 3],
        [3, 2, 1, 0],
        [2, 0, 3, 1],
        [1, 3, 0, 2],
        [3, 0, 1, 2],
        [2, 3, 0, 1],
    ];
    for order in orders {
        let reg = setup();
        let s = CudaStream::new(reg.ctx()).unwrap();
        let f = reg.function("kernels", "empty").unwrap();
        let buf = DeviceBuffer::<f32>::alloc(&s, 1).unwrap();
        let graph = s
            .capture(|s| -> metrale_runtime::Result<()> {
                // SAFETY: the stand-in only records the arguments.
                unsafe { s.launch(&f, cfg(), (&buf, 1u32, 1.0f32)) }
            })
            .unwrap();
        let exec = graph.instantiate().unwrap();
        drop(f);
        let ctx = Arc::clone(reg.ctx());
        let mut parts: [Option<Box<dyn std::any::Any>>; 4] = [
            Some(Box::new(graph)),
            None,
            Some(Box::new(s)),
            Some(Box::new(Arc::clone(&reg))),
        ];
        drop(reg);
        let mut exec = Some(exec);
        for i in order {
            if i == 1 {
                // Still launchable whatever else is gone already.
                let e = exec.take().unwrap();
                let on = CudaStream::new(&ctx).unwrap();
                // SAFETY: buf is alive.
                unsafe { e.launch(&on) }.unwrap();
                drop(e);
            } else {
                parts[i].take();
            }
        }
        drop((ctx, buf));
        release(0);
        assert_eq!(fake().live(Live::Graphs), 0, "order {order:?}");
        assert_eq!(fake().live(Live::Execs), 0, "order {order:?}");
        assert_eq!(fake().live(Live::Modules), 0, "order {order:?}");
        assert_eq!(fake().live(Live::Streams), 0, "order {order:?}");
        assert_eq!(fake().primary_refs(), 0, "order {order:?}");
    }
}

/// An executable graph keeps its kernels' code loaded after the registry goes.
fn a_graph_keeps_its_kernels_loaded() {
    let reg = setup();
    let s = reg.stream().clone();
    let f = reg.function("kernels", "axpb").unwrap();
    let x = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    let graph = capture_chain(&s, &f, &x, 2, 0);
    drop(f);
    drop(reg);
    release(0);
    assert_eq!(fake().live(Live::Modules), 1, "held by the graph");
    let exec = graph.instantiate().unwrap();
    drop(graph);
    assert_eq!(
        fake().live(Live::Modules),
        1,
        "held by the executable graph"
    );
    // SAFETY: x is alive.
    unsafe { exec.launch(&s) }.unwrap();
    drop((exec, x, s));
    assert_eq!(fake().live(Live::Modules), 0);
    assert_eq!(fake().primary_refs(), 0);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "graph::capture_replay_and_inspect",
            run: capture_replay_and_inspect,
        },
        Test {
            name: "graph::fork_join_across_two_streams",
            run: fork_join_across_two_streams,
        },
        Test {
            name: "graph::an_invalidated_capture_is_reported_and_the_stream_recovers",
            run: an_invalidated_capture_is_reported_and_the_stream_recovers,
        },
        Test {
            name: "graph::update_whole_and_per_node",
            run: graphs_update_whole_and_per_node,
        },
        Test {
            name: "graph::built_node_by_node_with_a_while_loop",
            run: graphs_built_node_by_node_with_a_while_loop,
        },
        Test {
            name: "graph::drop_order_never_matters",
            run: drop_order_never_matters,
        },
        Test {
            name: "graph::a_graph_keeps_its_kernels_loaded",
            run: a_graph_keeps_its_kernels_loaded,
        },
    ]
}
