//! The capture arena and graph buckets (issue 34, item 5): takes without a
//! driver call, stable addresses, graphs holding the arena, refused resets,
//! and buckets picked, replayed and updated. Issue 43, item 2: the hold is a
//! user object the graph retains, so a replay queues no host function; the
//! host-function keeper stays for drivers without user objects (the old-driver
//! stand-in, in child processes).

use crate::common::*;
use crate::harness::{run_child, Child, Test};

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
    assert!(
        e.to_string().contains("1 hold(s) of graphs, executables"),
        "{e}"
    );
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

/// An executable captured through an arena: one kernel, holding the arena.
fn arena_exec(reg: &MetraleRegistry, s: &CudaStream, arena: &CaptureArena) -> CudaGraphExec {
    let x = arena.take::<f32>(64).unwrap();
    let mut y = arena.take::<f32>(64).unwrap();
    let g = arena
        .capture(s, |s| queue_add(reg, s, &x, &mut y, 64))
        .unwrap();
    g.instantiate().unwrap()
}

/// A replay of an executable that holds an arena is one `cuGraphLaunch`: no
/// keeper host function (the graph holds the arena through one user object,
/// which its executables share), on the plain path and through buckets.
fn a_replay_that_holds_an_arena_queues_no_host_function() {
    let reg = setup();
    let s = reg.stream();
    let arena = CaptureArena::new(s, 1 << 16).unwrap();
    let objects = fake().user_objects();
    let exec = arena_exec(&reg, s, &arena);
    // One user object holds the arena, another the kernel's code.
    assert_eq!(
        fake().user_objects(),
        objects + 2,
        "one user object holds it"
    );
    let (host_fns, launches) = (
        fake().calls("cuLaunchHostFunc"),
        fake().calls("cuGraphLaunch"),
    );
    for _ in 0..10 {
        // SAFETY: the stand-in records the launch only.
        unsafe { exec.launch(s) }.unwrap();
    }
    assert_eq!(
        fake().calls("cuLaunchHostFunc"),
        host_fns,
        "no keeper queued"
    );
    assert_eq!(fake().calls("cuGraphLaunch"), launches + 10);
    let x = arena.take::<f32>(8).unwrap();
    let mut y = arena.take::<f32>(8).unwrap();
    let buckets = GraphBuckets::capture(s, &arena, &[1, 8], |s, size| {
        queue_add(&reg, s, &x, &mut y, size as u32)
    })
    .unwrap();
    let host_fns = fake().calls("cuLaunchHostFunc");
    // SAFETY: as above.
    unsafe { buckets.replay(s, 5) }.unwrap();
    assert_eq!(
        fake().calls("cuLaunchHostFunc"),
        host_fns,
        "no keeper queued"
    );
    s.synchronize().unwrap();
    drop((buckets, exec));
    assert_eq!(fake().user_objects(), objects, "every user object released");
    let _ = (x, y);
    drop(arena);
    done(reg);
}

/// The executable keeps the arena's memory after the graph and the arena's
/// own handle are dropped; the memory goes with the executable. A replay in
/// flight (held up behind a host function) keeps it after the executable
/// goes, and a reset is refused until it has run.
fn an_executable_keeps_the_arena_after_graph_and_handle_go() {
    let reg = setup();
    let s = reg.stream();
    let arena = CaptureArena::new(s, 1 << 16).unwrap();
    let exec = arena_exec(&reg, s, &arena);
    let live = fake().live(Live::DeviceMemory);
    drop(arena);
    s.synchronize().unwrap();
    assert_eq!(
        fake().live(Live::DeviceMemory),
        live,
        "held by the executable"
    );
    // The arena's and the kernel code's.
    assert_eq!(fake().user_objects(), 2);
    // SAFETY: the stand-in records the launch only.
    unsafe { exec.launch(s) }.unwrap();
    s.synchronize().unwrap();
    drop(exec);
    assert_eq!(
        fake().live(Live::DeviceMemory),
        live - 1,
        "freed with the executable"
    );
    assert_eq!(fake().user_objects(), 0);

    let mut arena = CaptureArena::new(s, 1 << 16).unwrap();
    let first = arena.take::<u32>(1).unwrap().device_ptr();
    let exec = arena_exec(&reg, s, &arena);
    let (go, wait) = std::sync::mpsc::channel::<()>();
    s.launch_host_fn(move || {
        let _ = wait.recv_timeout(std::time::Duration::from_secs(10));
    })
    .unwrap();
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    drop(exec);
    let e = arena.reset().unwrap_err();
    assert!(
        e.to_string().contains("1 hold(s)"),
        "the replay in flight: {e}"
    );
    go.send(()).unwrap();
    s.synchronize().unwrap();
    arena.reset().unwrap();
    assert_eq!(arena.take::<u32>(1).unwrap().device_ptr(), first);
    assert_eq!(fake().user_objects(), 0);
    drop(arena);
    done(reg);
}

/// Reset after every holder is dropped and the stream synchronised: the
/// user objects' destructors handed the hold to the drop-later list, which
/// `reset` empties first (no other drain in between).
fn reset_works_once_graphs_and_executables_are_dropped() {
    let reg = setup();
    let s = reg.stream();
    let mut arena = CaptureArena::new(s, 1 << 16).unwrap();
    let x = arena.take::<f32>(8).unwrap().device_ptr();
    let (graph, exec) = {
        let a = arena.take::<f32>(8).unwrap();
        let mut b = arena.take::<f32>(8).unwrap();
        let g = arena
            .capture(s, |s| queue_add(&reg, s, &a, &mut b, 8))
            .unwrap();
        let e = g.instantiate().unwrap();
        (g, e)
    };
    // SAFETY: the stand-in records the launch only.
    unsafe { exec.launch(s) }.unwrap();
    assert!(arena.reset().is_err(), "graph and executable hold it");
    s.synchronize().unwrap();
    drop(exec);
    assert!(arena.reset().is_err(), "the graph holds it");
    drop(graph);
    arena.reset().unwrap();
    assert_eq!(arena.take::<f32>(8).unwrap().device_ptr(), x);
    drop(arena);
    done(reg);
}

/// On a driver without user objects (the old-driver stand-in) the hold rides
/// with the graph's host functions: one keeper per replay, the arena kept by
/// the executable and by a replay in flight, a reset once they are gone, and
/// a failed keeper leaks the memory rather than free it under the replay.
fn without_user_objects_replays_keep_the_arena_with_a_host_function() {
    let old = metrale_fakecuda::old_library_path().to_str().unwrap();
    let out = run_child("arena_on_old_driver", &[("METRALE_LIBCUDA_PATH", old)]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "keepers per replay 1, held by the executable 1, by the replay 1, reset ok, \
         failed keeper leaked 1"
    );
}

fn child_arena_on_old_driver() {
    let reg = setup();
    let s = reg.stream();
    assert_eq!(fake().user_objects(), 0);
    let mut arena = CaptureArena::new(s, 1 << 16).unwrap();
    let exec = arena_exec(&reg, s, &arena);
    let host_fns = fake().calls("cuLaunchHostFunc");
    // SAFETY: the stand-in records the launch only.
    unsafe { exec.launch(s) }.unwrap();
    let per_replay = fake().calls("cuLaunchHostFunc") - host_fns;
    s.synchronize().unwrap();
    let live = fake().live(Live::DeviceMemory);
    let held = {
        let e = arena.reset().unwrap_err();
        assert!(e.to_string().contains("1 hold(s)"), "{e}");
        i32::from(fake().live(Live::DeviceMemory) == live)
    };
    let (go, wait) = std::sync::mpsc::channel::<()>();
    s.launch_host_fn(move || {
        let _ = wait.recv_timeout(std::time::Duration::from_secs(10));
    })
    .unwrap();
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    drop(exec);
    let by_replay = i32::from(arena.reset().is_err());
    go.send(()).unwrap();
    s.synchronize().unwrap();
    arena.reset().unwrap();
    drop(arena);

    // The keeper after a replay cannot be queued: the arena memory is leaked
    // (held), never freed under the queued replay; a reset stays refused.
    let mut arena = CaptureArena::new(s, 1 << 16).unwrap();
    let exec = arena_exec(&reg, s, &arena);
    fake().fail("cuLaunchHostFunc", 1, 1, Some(1));
    // SAFETY: as above.
    let r = unsafe { exec.launch(s) };
    s.synchronize().unwrap();
    drop(exec);
    assert!(r.is_err(), "the keeper's failure is reported");
    assert!(
        arena.reset().is_err(),
        "a replay that may run holds the arena"
    );
    let live = fake().live(Live::DeviceMemory);
    drop(arena);
    let leaked = i32::from(fake().live(Live::DeviceMemory) == live);
    println!(
        "keepers per replay {per_replay}, held by the executable {held}, by the replay \
         {by_replay}, reset ok, failed keeper leaked {leaked}"
    );
    drop(reg);
}

/// A repeatable host function captured into a graph is held the same way:
/// its replays queue no keeper, run it, and its closure lives while a replay
/// in flight may run it, after the graph and the executable are dropped.
fn a_captured_host_function_is_held_by_the_driver_not_a_keeper() {
    let reg = setup();
    let s = reg.stream();
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let token = std::sync::Arc::new(());
    let graph = {
        let (runs, token) = (runs.clone(), token.clone());
        s.capture(move |s| {
            s.launch_host_fn_repeat(std::sync::Arc::new(move || {
                let _ = &token;
                runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }))
        })
        .unwrap()
    };
    let exec = graph.instantiate().unwrap();
    drop(graph);
    assert_eq!(fake().user_objects(), 1);
    let host_fns = fake().calls("cuLaunchHostFunc");
    for _ in 0..3 {
        // SAFETY: the graph runs the host function only.
        unsafe { exec.launch(s) }.unwrap();
    }
    assert_eq!(
        fake().calls("cuLaunchHostFunc"),
        host_fns,
        "no keeper queued"
    );
    s.synchronize().unwrap();
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 3);
    // A replay held up behind a host function keeps the closure after the
    // executable goes.
    let (go, wait) = std::sync::mpsc::channel::<()>();
    s.launch_host_fn(move || {
        let _ = wait.recv_timeout(std::time::Duration::from_secs(10));
    })
    .unwrap();
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    drop(exec);
    assert_eq!(
        std::sync::Arc::strong_count(&token),
        2,
        "held for the replay"
    );
    go.send(()).unwrap();
    s.synchronize().unwrap();
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 4);
    assert_eq!(std::sync::Arc::strong_count(&token), 1, "released after it");
    assert_eq!(fake().user_objects(), 0);
    done(reg);
}

pub fn children() -> Vec<Child> {
    vec![Child {
        name: "arena_on_old_driver",
        run: child_arena_on_old_driver,
    }]
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
        Test {
            name: "arena::a_replay_that_holds_an_arena_queues_no_host_function",
            run: a_replay_that_holds_an_arena_queues_no_host_function,
        },
        Test {
            name: "arena::an_executable_keeps_the_arena_after_graph_and_handle_go",
            run: an_executable_keeps_the_arena_after_graph_and_handle_go,
        },
        Test {
            name: "arena::reset_works_once_graphs_and_executables_are_dropped",
            run: reset_works_once_graphs_and_executables_are_dropped,
        },
        Test {
            name: "arena::a_captured_host_function_is_held_by_the_driver_not_a_keeper",
            run: a_captured_host_function_is_held_by_the_driver_not_a_keeper,
        },
        Test {
            name: "arena::without_user_objects_replays_keep_the_arena_with_a_host_function",
            run: without_user_objects_replays_keep_the_arena_with_a_host_function,
        },
    ]
}
