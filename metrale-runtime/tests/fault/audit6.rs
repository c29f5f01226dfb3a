//! Audit of issue 43's round (kernel arguments by address for every memory
//! type, graphs holding through user objects), against the stand-in driver.
//! `defect_*`: failed on the code of the round; `held_*`: attacks that held.
//! Every scenario that can block is bounded (a host function that gives up
//! after a timeout, a channel read with one).

use std::sync::mpsc;
use std::time::Duration;

use crate::common::*;
use crate::harness::Test;

fn cfg() -> LaunchConfig {
    LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap()
}

/// The first 8 bytes of each of the last launch's `n` parameters.
fn recorded(n: i32) -> Vec<u64> {
    (0..n).map(|i| fake().last_param(i)).collect()
}

/// `&m` of every memory kind, through a generic `&impl DeviceMemory`, a
/// `&dyn DeviceMemory` and a `&mut dyn DeviceMemoryMut`, a view of an arena
/// and a view of a view: the kernel receives each one's own device address
/// (never the address of the handle, a host address), in a tuple and in a
/// run-time list alike.
fn held_every_memory_kind_passes_its_own_address() {
    let reg = setup();
    let s = reg.stream();
    let vec_add = reg.function("kernels", "vec_add").unwrap();
    let a = DeviceBuffer::<f32>::alloc(s, 64).unwrap();
    let mut m = ManagedBuffer::<f32>::zeroed(s, 64).unwrap();
    let mut g = GrowableBuffer::<f32>::new(s, 1 << 20).unwrap();
    g.grow_to(64).unwrap();
    let arena = CaptureArena::new(s, 1 << 16).unwrap();
    let _skip = arena.take::<u8>(1).unwrap();
    let mut view = arena.take::<f32>(64).unwrap();
    let (pa, pm, pg, pv) = (
        a.device_ptr(),
        m.device_ptr(),
        g.device_ptr(),
        view.device_ptr(),
    );
    assert_ne!(pv, arena.take::<u8>(1).unwrap().device_ptr());

    fn generic<M: DeviceMemory<f32>>(s: &CudaStream, f: &CudaFunction, mem: &M) {
        // SAFETY: the stand-in only records the arguments.
        unsafe { s.launch(f, cfg(), (mem, mem, mem, 1u32)) }.unwrap();
    }
    generic(s, &vec_add, &m);
    assert_eq!(recorded(4), [pm, pm, pm, 1]);

    let dynamic: &dyn DeviceMemory<f32> = &g;
    // SAFETY: as above.
    unsafe { s.launch(&vec_add, cfg(), (dynamic, &a, &mut view, 2u32)) }.unwrap();
    assert_eq!(recorded(4), [pg, pa, pv, 2]);
    {
        let out: &mut dyn DeviceMemoryMut<f32> = &mut m;
        // SAFETY: as above.
        unsafe { s.launch(&vec_add, cfg(), (&a, &view, out, 3u32)) }.unwrap();
        assert_eq!(recorded(4), [pa, pv, pm, 3]);
    }
    // A view of a view, by reference and by value, offset into its parent.
    let inner = view.slice(8..16).unwrap();
    let pi = inner.device_ptr();
    assert_eq!(pi, pv + 32);
    let mut b = DeviceBuffer::<f32>::alloc(s, 64).unwrap();
    let pb = b.device_ptr();
    let mut tail = b.slice_mut(1..).unwrap();
    let mut list = KernelArgList::new();
    list.push(&inner).push(dynamic).push(&mut tail).push(4u32);
    // SAFETY: as above.
    unsafe { s.launch(&vec_add, cfg(), &list) }.unwrap();
    assert_eq!(recorded(4), [pi, pg, pb + 4, 4]);
    drop(list);
    drop((a, b, m, g, arena, vec_add));
    done(reg);
}

/// A run-time list built in a loop from temporaries (a view made and
/// dropped each round, pushed by value): each argument's address is copied
/// at the push, so the launch delivers every view's address, not one left
/// dangling by the temporary. (Pushing `&v` of a view `v` local to the loop
/// body, or `&mut` of a temporary view, does not compile: the list borrows
/// what it was given for as long as it lives; tried while writing this.)
fn held_list_pushed_in_a_loop_of_temporary_views_keeps_each_address() {
    let reg = setup();
    let s = reg.stream();
    let vec_add = reg.function("kernels", "vec_add").unwrap();
    let a = DeviceBuffer::<f32>::alloc(s, 64).unwrap();
    let base = a.device_ptr();
    let mut list = KernelArgList::new();
    for i in 0..3usize {
        if i % 2 == 0 {
            list.push(a.slice(i * 4..).unwrap());
        } else {
            // A view made and dropped in this round (a view of a view
            // borrows the outer one, so it cannot be pushed past it).
            let v = a.slice(i * 4..).unwrap();
            list.push(v);
        }
    }
    list.push(9u32);
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&vec_add, cfg(), &list) }.unwrap();
    assert_eq!(recorded(4), [base, base + 16, base + 32, 9]);
    // The same through `set`, replacing an argument with another temporary.
    list.set(1, a.slice(60..).unwrap()).unwrap();
    // SAFETY: as above.
    unsafe { s.launch(&vec_add, cfg(), &list) }.unwrap();
    assert_eq!(recorded(2)[1], base + 240);
    drop(list);
    drop((a, vec_add));
    done(reg);
}

/// `vec_add` over two views of `arena`, captured through it.
fn fill_graph(
    reg: &MetraleRegistry,
    s: &CudaStream,
    arena: &CaptureArena,
    len: usize,
) -> CudaGraph {
    let x = arena.take::<f32>(len).unwrap();
    let mut y = arena.take::<f32>(len).unwrap();
    let f = reg.function("kernels", "vec_add").unwrap();
    arena
        .capture(s, |s| {
            // SAFETY: the stand-in only records the arguments.
            unsafe { s.launch(&f, cfg(), (&x, &x, &mut y, len as u32)) }
        })
        .unwrap()
}

/// A blocker on `s`: a host function that waits (at most 10 s) for the
/// sender to be used or dropped.
fn block(s: &CudaStream) -> mpsc::Sender<()> {
    let (go, wait) = mpsc::channel::<()>();
    s.launch_host_fn(move || {
        let _ = wait.recv_timeout(Duration::from_secs(10));
    })
    .unwrap();
    go
}

/// Item 2: an executable made from arena A's graph, replayed behind slow
/// work, then updated from arena B's graph; graph, executable and arena A's
/// other holders dropped. The queued replay still uses A (the driver keeps
/// the references it took at launch), so A's reset is refused until the
/// replay ran; B is held by the updated executable, and only by it.
fn held_a_replay_queued_before_an_update_keeps_the_old_arena() {
    let reg = setup();
    let s = reg.stream();
    let mut a = CaptureArena::new(s, 1 << 16).unwrap();
    let mut b = CaptureArena::new(s, 1 << 16).unwrap();
    let ga = fill_graph(&reg, s, &a, 64);
    let gb = fill_graph(&reg, s, &b, 64);
    let mut exec = ga.instantiate().unwrap();
    drop(ga);
    let go = block(s);
    // SAFETY: the graph fills arena memory only, which the arena keeps.
    unsafe { exec.launch(s) }.unwrap();
    exec.update(&gb).unwrap();
    drop(gb);
    let e = a.reset().unwrap_err();
    assert!(
        e.to_string().contains("1 hold(s)"),
        "the replay queued before the update holds A: {e}"
    );
    assert!(b.reset().is_err(), "the updated executable holds B");
    go.send(()).unwrap();
    s.synchronize().unwrap();
    a.reset().unwrap();
    assert!(b.reset().is_err(), "still held by the executable");
    drop(exec);
    b.reset().unwrap();
    assert_eq!(fake().user_objects(), 0);
    drop((a, b));
    done(reg);
}

/// Item 2: the last hold of an arena goes in a user object's destructor,
/// which the stand-in runs on its own thread under its lock, when a replay
/// queued behind slow work finishes after graph, executable and arena were
/// dropped. Were the memory freed there, `cuMemFree` would wait for the
/// driver's lock for ever (a driver thread may not call the driver): it is
/// handed over, and freed by the next synchronisation.
fn held_the_last_hold_dropped_on_a_driver_thread_is_freed_by_the_next_sync() {
    let reg = setup();
    let s = reg.stream();
    let before = fake().live(Live::DeviceMemory);
    let arena = CaptureArena::new(s, 1 << 16).unwrap();
    let graph = fill_graph(&reg, s, &arena, 64);
    let exec = graph.instantiate().unwrap();
    let go = block(s);
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    drop((exec, graph, arena));
    assert_eq!(
        fake().live(Live::DeviceMemory),
        before + 1,
        "held by the queued replay"
    );
    go.send(()).unwrap();
    // The replay finishes on the stand-in's thread; wait for it without a
    // metrale call that drains.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        while fake().user_objects() != 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(5))
        .expect("the destructor ran (the driver's thread did not deadlock)");
    s.synchronize().unwrap();
    assert_eq!(
        fake().live(Live::DeviceMemory),
        before,
        "freed by the synchronisation after the replay"
    );
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "audit6::held_every_memory_kind_passes_its_own_address",
            run: held_every_memory_kind_passes_its_own_address,
        },
        Test {
            name: "audit6::held_list_pushed_in_a_loop_of_temporary_views_keeps_each_address",
            run: held_list_pushed_in_a_loop_of_temporary_views_keeps_each_address,
        },
        Test {
            name: "audit6::held_a_replay_queued_before_an_update_keeps_the_old_arena",
            run: held_a_replay_queued_before_an_update_keeps_the_old_arena,
        },
        Test {
            name: "audit6::held_the_last_hold_dropped_on_a_driver_thread_is_freed_by_the_next_sync",
            run: held_the_last_hold_dropped_on_a_driver_thread_is_freed_by_the_next_sync,
        },
    ]
}
