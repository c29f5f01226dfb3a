//! The capture arena and graph buckets (issue 34, item 5): takes without a
//! driver call, stable addresses, graphs holding the arena, refused resets,
//! and buckets picked, replayed and updated.

use crate::common::*;
use crate::harness::Test;

/// `vec_add(a, b, c, n)` into the capture on `s`.
fn queue_add(
    reg: &MetraleRegistry,
    s: &CudaStream,
    a: &DeviceSliceMut<'_, f32>,
    c: &mut DeviceSliceMut<'_, f32>,
    n: u32,
) -> Result<()> {
    let cfg = LaunchConfig::for_num_elems(n as usize, 256)?;
    let src = a.slice(..)?;
    // SAFETY: the stand-in only records the arguments.
    unsafe { reg.launch(vec_add(reg), cfg, s, (&src, &src, &mut *c, n)) }
}

fn takes_are_aligned_disjoint_and_call_nothing() {
    let reg = setup();
    let s = reg.stream();
    let arena = CaptureArena::new(s, 4096).unwrap();
    let allocs = fake().calls("cuMemAlloc_v2");
    let a = arena.take::<f32>(10).unwrap();
    let b = arena.take::<u8>(1).unwrap();
    let c = arena.take::<u64>(100).unwrap();
    assert_eq!(fake().calls("cuMemAlloc_v2"), allocs, "no driver call");
    assert_eq!(a.device_ptr() % 256, 0);
    assert_eq!(b.device_ptr(), a.device_ptr() + 256);
    assert_eq!(c.device_ptr(), a.device_ptr() + 512);
    assert_eq!(arena.taken(), 512 + 800);
    let e = arena.take::<u8>(4096).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
    assert!(
        e.to_string().contains("4096 bytes (4096 x u8) do not fit"),
        "{e}"
    );
    assert!(arena.take::<u64>(usize::MAX).is_err(), "overflow refused");
    let _ = (a, b, c);
    drop(arena);
    done(reg);
}

fn graphs_hold_the_arena_and_resets_wait_for_them() {
    let reg = setup();
    let s = reg.stream();
    let mut arena = CaptureArena::new(s, 1 << 16).unwrap();
    let exec = {
        let x = arena.take::<f32>(1000).unwrap();
        let mut y = arena.take::<f32>(1000).unwrap();
        let graph = arena
            .capture(s, |s| queue_add(&reg, s, &x, &mut y, 1000))
            .unwrap();
        let nodes = graph.nodes().unwrap();
        assert_eq!(nodes.len(), 1, "one kernel node, no allocation node");
        assert_eq!(nodes[0].kind(), GraphNodeKind::Kernel);
        graph.instantiate().unwrap()
        // The views and the graph end here; the executable holds the memory.
    };
    let e = arena.reset().unwrap_err();
    assert!(e.to_string().contains("1 graph(s), executable(s)"), "{e}");
    let live = fake().live(Live::DeviceMemory);
    // Dropping the arena itself leaves the memory to the executable.
    drop(arena);
    assert_eq!(fake().live(Live::DeviceMemory), live, "still held");
    // SAFETY: the stand-in records the launch only.
    unsafe { exec.launch(s) }.unwrap();
    s.synchronize().unwrap();
    drop(exec);
    assert_eq!(
        fake().live(Live::DeviceMemory),
        live - 1,
        "freed with the last holder"
    );

    // The last holder a replay in flight: the memory goes after the replay,
    // outside the host function that held it (no leak, nothing freed early).
    let arena = CaptureArena::new(s, 1 << 16).unwrap();
    let exec = {
        let x = arena.take::<f32>(100).unwrap();
        let mut y = arena.take::<f32>(100).unwrap();
        let g = arena
            .capture(s, |s| queue_add(&reg, s, &x, &mut y, 100))
            .unwrap();
        g.instantiate().unwrap()
    };
    let live = fake().live(Live::DeviceMemory);
    drop(arena);
    // The stream is held up by a host function until the check below, so the
    // replay (and its keeper) is still queued when the executable goes.
    let (go, wait) = std::sync::mpsc::channel::<()>();
    s.launch_host_fn(move || {
        let _ = wait.recv_timeout(std::time::Duration::from_secs(10));
    })
    .unwrap();
    // SAFETY: the stand-in records the launch only.
    unsafe { exec.launch(s) }.unwrap();
    drop(exec);
    assert_eq!(fake().live(Live::DeviceMemory), live, "the replay holds it");
    go.send(()).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        fake().live(Live::DeviceMemory),
        live - 1,
        "freed after the replay"
    );

    // After the holders go, a reset gives the same addresses again.
    let mut arena = CaptureArena::new(s, 1 << 16).unwrap();
    let first = arena.take::<u32>(5).unwrap().device_ptr();
    {
        let x = arena.take::<f32>(8).unwrap();
        let mut y = arena.take::<f32>(8).unwrap();
        let g = arena
            .capture(s, |s| queue_add(&reg, s, &x, &mut y, 8))
            .unwrap();
        drop(g);
    }
    arena.reset().unwrap();
    assert_eq!(arena.taken(), 0);
    assert_eq!(arena.take::<u32>(5).unwrap().device_ptr(), first);
    drop(arena);
    done(reg);
}

fn buckets_pick_replay_and_update() {
    let reg = setup();
    let s = reg.stream();
    let arena = CaptureArena::new(s, 1 << 20).unwrap();
    let x = arena.take::<f32>(64).unwrap();
    let mut y = arena.take::<f32>(64).unwrap();
    let mut seen = Vec::new();
    let buckets = GraphBuckets::capture(s, &arena, &[4, 1, 2, 2, 64], |s, size| {
        seen.push(size);
        queue_add(&reg, s, &x, &mut y, size as u32)
    });
    let mut buckets = buckets.unwrap();
    assert_eq!(seen, [1, 2, 4, 64], "ascending, without duplicates");
    assert_eq!(buckets.sizes().collect::<Vec<_>>(), [1, 2, 4, 64]);
    assert_eq!(buckets.bucket_for(3), Some(4));
    assert_eq!(buckets.bucket_for(65), None);
    let launches = fake().launches();
    // SAFETY: the stand-in records the launch only.
    assert_eq!(unsafe { buckets.replay(s, 3) }.unwrap(), 4);
    assert_eq!(fake().launches(), launches + 1, "one replayed kernel");
    assert_eq!(fake().last_launch().grid, [1, 1, 1]);
    // SAFETY: as above.
    let e = unsafe { buckets.replay(s, 65) }.unwrap_err();
    assert!(
        e.to_string().contains("above the largest bucket (64)"),
        "{e}"
    );
    // Update the bucket of 4 in place (the same topology).
    buckets
        .update(s, &arena, 4, |s, size| {
            queue_add(&reg, s, &x, &mut y, size as u32)
        })
        .unwrap();
    let e = buckets
        .update(s, &arena, 3, |s, size| {
            queue_add(&reg, s, &x, &mut y, size as u32)
        })
        .unwrap_err();
    assert!(e.to_string().contains("no bucket of 3"), "{e}");
    assert!(GraphBuckets::capture(s, &arena, &[], |_, _| Ok(())).is_err());
    assert!(GraphBuckets::capture(s, &arena, &[0, 1], |_, _| Ok(())).is_err());
    s.synchronize().unwrap();
    drop(buckets);
    let _ = (x, y);
    drop(arena);
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "arena::takes_are_aligned_disjoint_and_call_nothing",
            run: takes_are_aligned_disjoint_and_call_nothing,
        },
        Test {
            name: "arena::graphs_hold_the_arena_and_resets_wait_for_them",
            run: graphs_hold_the_arena_and_resets_wait_for_them,
        },
        Test {
            name: "arena::buckets_pick_replay_and_update",
            run: buckets_pick_replay_and_update,
        },
    ]
}
