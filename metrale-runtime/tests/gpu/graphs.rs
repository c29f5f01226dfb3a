//! CUDA graphs on the GPU: a captured chain replayed exactly, updates whole and per
//! node, fork/join, an invalidated capture, every drop order, a device-side while
//! loop, DOT output.

use std::sync::Arc;

use crate::common::*;
use crate::harness::Test;

fn one_thread() -> LaunchConfig {
    LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap()
}

/// `n` dependent steps x = x * a + b_i, with b_i = b + i.
fn capture_chain(
    s: &CudaStream,
    f: &CudaFunction,
    x: &mut DeviceBuffer<u32>,
    n: u32,
    a: u32,
    b: u32,
) -> CudaGraph {
    s.capture(|s| -> metrale_runtime::Result<()> {
        for i in 0..n {
            // SAFETY: axpb(unsigned*, unsigned, unsigned) updates x[0].
            unsafe { s.launch(f, one_thread(), (&mut *x, a, b + i))? };
        }
        Ok(())
    })
    .unwrap()
}

/// The host's x after `replays` replays of the chain.
fn expected(mut x: u32, replays: u32, steps: &[(u32, u32)]) -> u32 {
    for _ in 0..replays {
        for &(a, b) in steps {
            x = x.wrapping_mul(a).wrapping_add(b);
        }
    }
    x
}

fn a_chain_of_100_replayed_1000_times_is_exact() {
    let reg = registry();
    let s = reg.stream();
    let f = reg.function("kernels", "axpb").unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let graph = capture_chain(s, &f, &mut x, 100, 3, 1);
    assert_eq!(graph.nodes().unwrap().len(), 100);
    assert_eq!(graph.edges().unwrap().len(), 99);
    let exec = graph.instantiate().unwrap();
    exec.upload(s).unwrap();
    for _ in 0..1000 {
        // SAFETY: x, the only memory the graph touches, is alive.
        unsafe { exec.launch(s) }.unwrap();
    }
    let steps: Vec<(u32, u32)> = (0..100).map(|i| (3, 1 + i)).collect();
    assert_eq!(s.to_vec(&x).unwrap()[0], expected(0, 1000, &steps));
}

fn updates_per_node_and_whole_graph() {
    let reg = registry();
    let s = reg.stream();
    let f = reg.function("kernels", "axpb").unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let graph = capture_chain(s, &f, &mut x, 10, 2, 0);
    let mut exec = graph.instantiate().unwrap();
    let mut steps: Vec<(u32, u32)> = (0..10).map(|i| (2, i)).collect();
    // SAFETY: x is alive (for every replay below).
    unsafe { exec.launch(s) }.unwrap();
    assert_eq!(s.to_vec(&x).unwrap()[0], expected(0, 1, &steps));
    // Per node, typed: node 4 becomes x = x * 5 + 1000, no new capture.
    let nodes = graph.kernel_nodes().unwrap();
    assert_eq!(nodes.len(), 10);
    assert!(nodes.iter().all(|n| n.name == "kernels::axpb"));
    s.zero(&mut x).unwrap();
    // SAFETY: as a launch of axpb on x.
    unsafe { exec.set_kernel_params(&nodes[4], &f, one_thread(), (&mut x, 5u32, 1000u32)) }
        .unwrap();
    steps[4] = (5, 1000);
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    assert_eq!(s.to_vec(&x).unwrap()[0], expected(0, 1, &steps));
    // A refused node update leaves the graph as it was.
    // SAFETY: refused before the driver.
    let e = unsafe { exec.set_kernel_params(&nodes[4], &f, one_thread(), (&mut x, 5u64, 1u32)) }
        .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::ArgumentMismatch { index: Some(1), .. }),
        "{e}"
    );
    // Whole graph: a new capture of the same topology with other arguments.
    let g2 = capture_chain(s, &f, &mut x, 10, 7, 3);
    exec.update(&g2).unwrap();
    s.zero(&mut x).unwrap();
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    let steps2: Vec<(u32, u32)> = (0..10).map(|i| (7, 3 + i)).collect();
    assert_eq!(s.to_vec(&x).unwrap()[0], expected(0, 1, &steps2));
    // Another topology is refused, with the driver's reason.
    let g3 = capture_chain(s, &f, &mut x, 11, 7, 3);
    let e = exec.update(&g3).unwrap_err();
    eprintln!("    refused update: {e}");
    assert!(matches!(e.kind(), ErrorKind::GraphUpdate { .. }), "{e}");
    assert!(e.to_string().contains("refused"), "{e}");
    // Still replays the accepted graph.
    s.zero(&mut x).unwrap();
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    assert_eq!(s.to_vec(&x).unwrap()[0], expected(0, 1, &steps2));
}

fn fork_join_capture_across_two_streams() {
    let reg = registry();
    let (a, b) = (reg.stream(), CudaStream::new(reg.ctx()).unwrap());
    let f = reg.function("kernels", "axpb").unwrap();
    let mut x0 = DeviceBuffer::<u32>::zeroed(a, 1).unwrap();
    let mut x1 = DeviceBuffer::<u32>::zeroed(a, 1).unwrap();
    let (fork, join) = (
        CudaEvent::new(reg.ctx()).unwrap(),
        CudaEvent::new(reg.ctx()).unwrap(),
    );
    a.begin_capture(CaptureMode::ThreadLocal).unwrap();
    fork.record(a).unwrap();
    b.wait(&fork).unwrap();
    // SAFETY: axpb on one element each (for both launches).
    unsafe { a.launch(&f, one_thread(), (&mut x0, 1u32, 5u32)) }.unwrap();
    // SAFETY: as above.
    unsafe { b.launch(&f, one_thread(), (&mut x1, 1u32, 7u32)) }.unwrap();
    join.record(&b).unwrap();
    a.wait(&join).unwrap();
    let graph = a.end_capture().unwrap();
    assert_eq!(graph.nodes().unwrap().len(), 2);
    assert!(!b.is_capturing().unwrap());
    let exec = graph.instantiate().unwrap();
    for _ in 0..10 {
        // SAFETY: x0 and x1 are alive.
        unsafe { exec.launch(a) }.unwrap();
    }
    assert_eq!(
        (a.to_vec(&x0).unwrap()[0], a.to_vec(&x1).unwrap()[0]),
        (50, 70)
    );
}

fn an_invalidated_capture_is_reported_and_the_stream_is_usable() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let f = reg.function("kernels", "axpb").unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    s.begin_capture(CaptureMode::default()).unwrap();
    // SAFETY: axpb on x.
    unsafe { s.launch(&f, one_thread(), (&mut x, 1u32, 1u32)) }.unwrap();
    let e = s.synchronize().unwrap_err();
    eprintln!("    synchronize inside a capture: {e}");
    let e = s.end_capture().unwrap_err();
    eprintln!("    end of the invalidated capture: {e}");
    assert!(
        e.to_string().contains("(capture status: invalidated)")
            && e.to_string()
                .contains("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901)"),
        "{e}"
    );
    // SAFETY: as above.
    unsafe { s.launch(&f, one_thread(), (&mut x, 1u32, 41u32)) }.unwrap();
    assert_eq!(s.to_vec(&x).unwrap()[0], 41, "the stream runs work again");
}

fn drop_in_every_order() {
    let orders: [[usize; 4]; 6] = [
        [0, 1, 2, 3],
        [3, 2, 1, 0],
        [2, 0, 3, 1],
        [1, 3, 0, 2],
        [3, 0, 1, 2],
        [2, 3, 0, 1],
    ];
    for order in orders {
        let reg = MetraleRegistry::load(0, &[("k", CUBIN)]).unwrap();
        let s = CudaStream::new(reg.ctx()).unwrap();
        let f = reg.function("k", "axpb").unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
        let graph = capture_chain(&s, &f, &mut x, 3, 1, 1);
        let exec = graph.instantiate().unwrap();
        drop(f);
        let ctx = Arc::clone(reg.ctx());
        let mut parts: [Option<Box<dyn std::any::Any>>; 4] = [
            Some(Box::new(graph)),
            None,
            Some(Box::new(s)),
            Some(Box::new(reg)),
        ];
        let mut exec = Some(exec);
        for i in order {
            if i == 1 {
                let e = exec.take().unwrap();
                let on = CudaStream::new(&ctx).unwrap();
                // SAFETY: x is alive.
                unsafe { e.launch(&on) }.unwrap();
                on.synchronize().unwrap();
                drop(e);
            } else {
                parts[i].take();
            }
        }
        let check = CudaStream::new(&ctx).unwrap();
        // One replay of x += 1, += 2, += 3.
        assert_eq!(check.to_vec(&x).unwrap()[0], 6, "order {order:?}");
    }
}

fn a_device_side_while_loop() {
    let reg = MetraleRegistry::load(0, &[("kernels", CUBIN), ("cond", COND_CUBIN)]);
    let reg = match reg {
        Ok(r) => r,
        Err(e) => {
            // The PTX variant, for a driver that wants to link it itself.
            eprintln!("    conditional cubin did not load ({e}); trying PTX");
            MetraleRegistry::load(0, &[("kernels", CUBIN), ("cond", COND_PTX)]).unwrap()
        }
    };
    let s = reg.stream();
    let body = reg.function("cond", "loop_body").unwrap();
    let mut counter = DeviceBuffer::from_host(s, &[5u32]).unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let mut g = CudaGraph::new(reg.ctx()).unwrap();
    g.add_while(&[], true, |b, handle| {
        // SAFETY: loop_body(handle, unsigned*, unsigned*) on one element each.
        unsafe { b.add_kernel_node(&[], &body, one_thread(), (handle, &mut counter, &mut x)) }?;
        Ok(())
    })
    .unwrap();
    let exec = g.instantiate().unwrap();
    // SAFETY: counter and x are alive.
    unsafe { exec.launch(s) }.unwrap();
    assert_eq!(s.to_vec(&x).unwrap()[0], 15, "five rounds of += 3");
    assert_eq!(s.to_vec(&counter).unwrap()[0], 0);
    // Again, from 2.
    s.copy_h2d(&[2u32], &mut counter).unwrap();
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    assert_eq!(s.to_vec(&x).unwrap()[0], 21);
}

fn dot_output_names_the_kernels() {
    let reg = registry();
    let s = reg.stream();
    let f = reg.function("kernels", "axpb").unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let graph = capture_chain(s, &f, &mut x, 3, 1, 1);
    let path = std::env::temp_dir().join(format!("metrale-gpu-{}.dot", std::process::id()));
    graph.write_dot(&path).unwrap();
    let dot = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(dot.contains("digraph") && dot.contains("axpb"), "{dot}");
}

/// Issue 34: an arena-backed bucketed step (`vec_add(x, y, y, n)`, so y += x
/// over the bucket's elements) captured for buckets 1..64 of 256 elements,
/// replayed 1,000 times for a batch of 5 (the bucket of 8): exact, and the rest
/// of the arena untouched.
fn an_arena_bucketed_step_replayed_1000_times_is_exact() {
    let reg = registry();
    let f = reg.function("kernels", "vec_add").unwrap();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let per = 256usize;
    let arena = CaptureArena::new(&s, 1 << 20).unwrap();
    let mut x = arena.take::<f32>(64 * per).unwrap();
    let mut y = arena.take::<f32>(64 * per).unwrap();
    s.copy_h2d(&vec![1.0f32; 64 * per], &mut x).unwrap();
    s.memset_u32(&mut y, 0).unwrap();
    // SAFETY: a second, shared view of y's memory for the kernel's `b`
    // parameter (vec_add reads b[i] before it writes c[i], elementwise); the
    // arena keeps the memory alive for the views and the graphs.
    let y_in = unsafe { DeviceSlice::<f32>::from_raw(&s, y.device_ptr(), 64 * per) }.unwrap();
    let buckets = GraphBuckets::capture(&s, &arena, &[1, 2, 4, 8, 16, 32, 64], |s, size| {
        let n = size * per;
        let cfg = LaunchConfig::for_num_elems(n, 256)?;
        let (xs, ys_in) = (x.slice(..n)?, y_in.slice(..n)?);
        let mut ys = y.slice_mut(..n)?;
        // SAFETY: vec_add(a, b, c, n): c = a + b over n floats of the arena.
        unsafe { s.launch(&f, cfg, (&xs, &ys_in, &mut ys, n as u32)) }
    })
    .unwrap();
    assert_eq!(buckets.sizes().count(), 7);
    for _ in 0..1000 {
        // SAFETY: the step only reads x and writes y, both held by the arena.
        assert_eq!(unsafe { buckets.replay(&s, 5) }.unwrap(), 8);
    }
    s.synchronize().unwrap();
    let got = s.to_vec(&y).unwrap();
    assert!(
        got[..8 * per].iter().all(|&v| v == 1000.0),
        "{:?}",
        &got[..4]
    );
    assert!(
        got[8 * per..].iter().all(|&v| v == 0.0),
        "the rest untouched"
    );
    drop(buckets);
    let _ = (x, y);
    drop(arena);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "graphs::an_arena_bucketed_step_replayed_1000_times_is_exact",
            run: an_arena_bucketed_step_replayed_1000_times_is_exact,
        },
        Test {
            name: "graphs::a_chain_of_100_replayed_1000_times_is_exact",
            run: a_chain_of_100_replayed_1000_times_is_exact,
        },
        Test {
            name: "graphs::updates_per_node_and_whole_graph",
            run: updates_per_node_and_whole_graph,
        },
        Test {
            name: "graphs::fork_join_capture_across_two_streams",
            run: fork_join_capture_across_two_streams,
        },
        Test {
            name: "graphs::an_invalidated_capture_is_reported_and_the_stream_is_usable",
            run: an_invalidated_capture_is_reported_and_the_stream_is_usable,
        },
        Test {
            name: "graphs::drop_in_every_order",
            run: drop_in_every_order,
        },
        Test {
            name: "graphs::a_device_side_while_loop",
            run: a_device_side_while_loop,
        },
        Test {
            name: "graphs::dot_output_names_the_kernels",
            run: dot_output_names_the_kernels,
        },
    ]
}
