//! Issue 40 (soundness, round 5), the memory items, against the stand-in
//! driver: context-wide waits that a GPU-side wait queued after their check
//! could block for ever (item 4), a pending copy dropped behind a wait this
//! thread passes later (item 6), and deferred releases left at exit (item
//! 7). `defect_*`: failed on the code of the round; `held_*`: attacks that
//! held. Every scenario that can block is bounded (a thread and a timeout,
//! the word written afterwards so nothing stays blocked), and those that
//! change process state run in a child process.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::harness::{run_child, Child, Test};

const MIB: usize = 1 << 20;

/// Run a scenario in a child process: it passes when the child does.
fn in_child(name: &str) {
    let out = run_child(name, &[]);
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A range of 2 MiB with one mapping at offset 0.
fn mapped_range(reg: &MetraleRegistry) -> VirtualRange {
    let s = reg.stream();
    let mut range = VirtualRange::reserve(s, 2 * MIB).unwrap();
    let phys = Arc::new(PhysicalMemory::new(s, 2 * MIB, HandleTypes::NONE).unwrap());
    range
        .map(0, phys, 0, 2 * MIB, &[(reg.ctx(), Access::ReadWrite)])
        .unwrap();
    range
}

/// `wait_then` (an unmap, a Drop) runs on a thread and reaches its
/// `cuCtxSynchronize` (the stand-in pauses it at its entry: the check for
/// pending waits is behind it); another thread then counts and queues a
/// GPU-side wait on a mapped word. Whether `wait_then` returned within 2 s of
/// being let go: before the fix its synchronize waited for the word, which
/// only this test writes afterwards (were the unmapping thread the writer, it
/// would never return).
fn races_a_wait_queued_after_its_check(wait_then: impl FnOnce() + Send + 'static) -> bool {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    s.synchronize().unwrap();
    fake().pause_next("cuCtxSynchronize");
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        wait_then();
        let _ = tx.send(());
    });
    assert!(
        fake().wait_paused("cuCtxSynchronize", 10_000),
        "the wait found no pending wait and is synchronizing"
    );
    let returned = std::thread::scope(|sc| {
        let waiter = sc.spawn(|| {
            let word = SignalWord::mapped(&go, 0).unwrap();
            s.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
        });
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(reg.ctx().pending_waits(), 1, "counted");
        fake().resume("cuCtxSynchronize");
        let returned = rx.recv_timeout(Duration::from_secs(2)).is_ok();
        // Whatever happened, pass the wait so that everything can go.
        go.atomic(0).unwrap().store(1, Ordering::SeqCst);
        waiter.join().unwrap();
        returned
    });
    worker.join().unwrap();
    s.synchronize().unwrap();
    reg.ctx().synchronize().unwrap();
    drop((go, s));
    done(reg);
    returned
}

/// Item 4: `VirtualRange::unmap` checked for pending waits, then called
/// `cuCtxSynchronize` outside the in-flight count `wait_value32` waits out.
fn child_defect_unmap_races_a_wait_queued_after_its_check() {
    let reg = setup();
    let mut range = mapped_range(&reg);
    drop(reg);
    let returned = races_a_wait_queued_after_its_check(move || {
        range.unmap(0).unwrap();
        drop(range);
    });
    assert!(
        returned,
        "VirtualRange::unmap blocked behind a GPU-side wait queued after its check"
    );
}

fn defect_unmap_races_a_wait_queued_after_its_check() {
    in_child("round5_defect_unmap_races_a_wait_queued_after_its_check");
}

/// Item 4, the same in `VirtualRange`'s Drop.
fn child_defect_range_drop_races_a_wait_queued_after_its_check() {
    let reg = setup();
    let range = mapped_range(&reg);
    drop(reg);
    let returned = races_a_wait_queued_after_its_check(move || drop(range));
    assert!(
        returned,
        "dropping a VirtualRange blocked behind a GPU-side wait queued after its check"
    );
}

fn defect_range_drop_races_a_wait_queued_after_its_check() {
    in_child("round5_defect_range_drop_races_a_wait_queued_after_its_check");
}

/// Item 4, the same in a growable buffer's sleep (its wait for every use,
/// found by this review: the same check-then-synchronize).
fn child_defect_sleep_races_a_wait_queued_after_its_check() {
    let reg = setup();
    let mut buf = GrowableBuffer::<u32>::new(reg.stream(), MIB).unwrap();
    buf.grow_to(1024).unwrap();
    drop(reg);
    let returned = races_a_wait_queued_after_its_check(move || {
        let asleep = buf.sleep_discarding().map_err(|e| e.error).unwrap();
        drop(asleep);
    });
    assert!(
        returned,
        "sleeping a growable buffer blocked behind a GPU-side wait queued after its check"
    );
}

fn defect_sleep_races_a_wait_queued_after_its_check() {
    in_child("round5_defect_sleep_races_a_wait_queued_after_its_check");
}

/// Item 4, found by this review: a host function that queues a wait on a
/// mapped word while an unmap's `cuCtxSynchronize` (in flight) waits for that
/// very host function. `wait_value32` counted the wait, then waited out the
/// frees in flight before reaching the driver (which refuses it there): the
/// host function spun for ever, and the unmap with it. It is refused at once
/// now.
fn child_defect_a_host_function_waits_out_an_unmap_that_waits_for_it() {
    host_function_waits_out_a_context_wide_wait(false);
}

/// The same with a pinned buffer's free (`cuMemFreeHost`, in flight from its
/// check), on the code of the round.
fn child_defect_a_host_function_waits_out_a_pinned_free_that_waits_for_it() {
    host_function_waits_out_a_context_wide_wait(true);
}

fn defect_a_host_function_waits_out_a_pinned_free_that_waits_for_it() {
    in_child("round5_defect_a_host_function_waits_out_a_pinned_free_that_waits_for_it");
}

/// A host function queues a wait on a mapped word 200 ms in, while another
/// thread unmaps a range (`pinned`: frees a pinned buffer), which waits for
/// the context's work, that host function included.
fn host_function_waits_out_a_context_wide_wait(pinned: bool) {
    let reg = setup();
    let mut range = mapped_range(&reg);
    let buffer = PinnedBuffer::<u32>::zeroed(reg.ctx(), 64).unwrap();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    s.synchronize().unwrap();
    let (said, heard) = mpsc::channel();
    let (s2, go2) = (s.clone(), Arc::clone(&go));
    s.launch_host_fn(move || {
        // Long enough for the unmap below to be in its synchronize.
        std::thread::sleep(Duration::from_millis(200));
        let word = SignalWord::mapped(&go2, 0).unwrap();
        let r = s2.wait_value32(&word, 1, WaitFlags::EQ);
        let _ = said.send(r.map_err(|e| e.to_string()));
    })
    .unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let (r, left) = if pinned {
            drop(buffer);
            (Ok(()), None)
        } else {
            let r = range.unmap(0).map(drop).map_err(|e| e.to_string());
            (r, Some(buffer))
        };
        let _ = tx.send((r, range, left));
    });
    let (unmapped, range, left) = rx
        .recv_timeout(Duration::from_secs(3))
        .expect("the context-wide wait and the host function wait for each other");
    unmapped.unwrap();
    let e = heard.recv().unwrap().unwrap_err();
    assert!(e.contains("host function"), "{e}");
    assert_eq!(reg.ctx().pending_waits(), 0, "nothing counted");
    drop((range, left));
    s.synchronize().unwrap();
    drop((go, s));
    done(reg);
}

fn defect_a_host_function_waits_out_an_unmap_that_waits_for_it() {
    in_child("round5_defect_a_host_function_waits_out_an_unmap_that_waits_for_it");
}

/// Item 4, found by this review in the free path the item names as the model:
/// a buffer of device 0 used by a stream of device 1 is freed after that
/// stream's `cuStreamSynchronize`; only device 0 counted the free in flight,
/// so a wait on a mapped word queued on the device-1 stream between the
/// check and the synchronize blocked the Drop until the word was written.
fn child_defect_free_races_a_wait_queued_on_a_foreign_stream() {
    fake().reset();
    let (h0, h1) = (host(0).unwrap(), host(1).unwrap());
    let s1 = CudaStream::new(&h1).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(&h1, 1).unwrap());
    let mut m = ManagedBuffer::<u32>::zeroed(&h0, 64).unwrap();
    let src = DeviceBuffer::<u32>::from_host(&h1, &[9; 64]).unwrap();
    s1.copy_peer(&src, &mut m).unwrap();
    s1.synchronize().unwrap();
    fake().pause_next("cuStreamSynchronize");
    let (tx, rx) = mpsc::channel();
    let dropper = std::thread::spawn(move || {
        drop(m);
        let _ = tx.send(());
    });
    assert!(
        fake().wait_paused("cuStreamSynchronize", 10_000),
        "the free found no pending wait and waits for the foreign stream"
    );
    let returned = std::thread::scope(|sc| {
        let waiter = sc.spawn(|| {
            let word = SignalWord::mapped(&go, 0).unwrap();
            s1.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
        });
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(h1.context().pending_waits(), 1, "counted");
        fake().resume("cuStreamSynchronize");
        let returned = rx.recv_timeout(Duration::from_secs(2)).is_ok();
        go.atomic(0).unwrap().store(1, Ordering::SeqCst);
        waiter.join().unwrap();
        returned
    });
    dropper.join().unwrap();
    s1.synchronize().unwrap();
    drop((go, src, s1, h0, h1));
    release(0);
    release(1);
    assert!(
        returned,
        "the managed buffer's drop blocked behind a wait queued on a foreign stream after its check"
    );
}

fn defect_free_races_a_wait_queued_on_a_foreign_stream() {
    in_child("round5_defect_free_races_a_wait_queued_on_a_foreign_stream");
}

/// Item 6: a `PendingCopy` dropped while its copy sits behind a GPU-side wait
/// on a mapped word that the dropping thread writes only afterwards. Its Drop
/// waited for the copy: a single-threaded program deadlocks. Now the drop
/// returns at once (the buffer and the wait go to the lifetime room), and the
/// synchronize after the write frees the buffer.
fn child_defect_pending_copy_dropped_behind_a_wait_this_thread_passes() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    s.synchronize().unwrap();
    let pinned_before = fake().live(Live::HostMemory);
    let (tx, rx) = mpsc::channel();
    let go1 = Arc::clone(&go);
    let s1 = s.clone();
    let ctx = Arc::clone(reg.ctx());
    let worker = std::thread::spawn(move || {
        let word = SignalWord::mapped(&go1, 0).unwrap();
        s1.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
        let staging = PinnedBuffer::<u32>::zeroed(&ctx, 256).unwrap();
        let mut dev = DeviceBuffer::<u32>::alloc(&s1, 256).unwrap();
        let pending = s1.copy_h2d_pinned(staging, &mut dev).unwrap();
        let t = Instant::now();
        drop(pending);
        let _ = tx.send(t.elapsed());
        // This thread is the word's writer.
        go1.atomic(0).unwrap().store(1, Ordering::SeqCst);
        s1.synchronize().unwrap();
        drop(dev);
        s1.synchronize().unwrap();
    });
    let took = rx.recv_timeout(Duration::from_secs(2));
    if took.is_err() {
        // Let the blocked drop go, so the child can end and report.
        go.atomic(0).unwrap().store(1, Ordering::SeqCst);
    }
    worker.join().unwrap();
    let took = took.expect("the pending copy's drop blocked behind a wait its own thread passes");
    assert!(took < Duration::from_secs(1), "the drop took {took:?}");
    assert_eq!(
        deferred_frees(),
        0,
        "released by the synchronize after the write"
    );
    assert_eq!(
        fake().live(Live::HostMemory),
        pinned_before,
        "the staging buffer was freed"
    );
    drop((go, s));
    done(reg);
}

fn defect_pending_copy_dropped_behind_a_wait_this_thread_passes() {
    in_child("round5_defect_pending_copy_dropped_behind_a_wait_this_thread_passes");
}

/// Item 6, the other side: a pending copy dropped with no wait in the way
/// still waits for its copy (the buffer is freed at once, nothing deferred).
fn held_pending_copy_dropped_without_a_wait_frees_at_once() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    s.synchronize().unwrap();
    let before = fake().live(Live::HostMemory);
    let staging = PinnedBuffer::<u32>::zeroed(reg.ctx(), 256).unwrap();
    let mut dev = DeviceBuffer::<u32>::alloc(&s, 256).unwrap();
    let deferred = deferred_frees();
    drop(s.copy_h2d_pinned(staging, &mut dev).unwrap());
    assert_eq!(deferred_frees(), deferred, "nothing deferred");
    assert_eq!(fake().live(Live::HostMemory), before, "freed at once");
    drop((dev, s, reg));
}

/// Item 7: a release still deferred when the process exits (a pinned buffer
/// dropped behind a wait nobody passes) was neither freed nor reported. The
/// child exits with it deferred; its stderr names it, once.
fn child_deferred_at_exit() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&go, 0).unwrap();
    s.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
    let pinned = PinnedBuffer::<u32>::zeroed(reg.ctx(), 64).unwrap();
    drop(pinned);
    assert_eq!(deferred_frees(), 1, "deferred behind the wait");
    // Exit with the wait pending and the free deferred (nothing here may
    // block: the handles are forgotten, as a process that exits leaves them).
    std::mem::forget((go, s, reg));
}

fn defect_deferred_releases_at_exit_are_reported_once() {
    let out = run_child("round5_deferred_at_exit", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let line = "release(s) still deferred at exit, leaked";
    assert_eq!(err.matches(line).count(), 1, "{err}");
    assert!(
        err.contains("1 release(s) still deferred at exit")
            && err.contains("freeing pinned buffer"),
        "{err}"
    );
}

/// A child that defers nothing says nothing at exit.
fn child_nothing_deferred_at_exit() {
    let reg = setup();
    let pinned = PinnedBuffer::<u32>::zeroed(reg.ctx(), 64).unwrap();
    drop(pinned);
    assert_eq!(deferred_frees(), 0);
    done(reg);
}

fn held_nothing_deferred_says_nothing_at_exit() {
    let out = run_child("round5_nothing_deferred_at_exit", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("deferred at exit"), "{err}");
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "round5_defect_unmap_races_a_wait_queued_after_its_check",
            run: child_defect_unmap_races_a_wait_queued_after_its_check,
        },
        Child {
            name: "round5_defect_range_drop_races_a_wait_queued_after_its_check",
            run: child_defect_range_drop_races_a_wait_queued_after_its_check,
        },
        Child {
            name: "round5_defect_sleep_races_a_wait_queued_after_its_check",
            run: child_defect_sleep_races_a_wait_queued_after_its_check,
        },
        Child {
            name: "round5_defect_a_host_function_waits_out_an_unmap_that_waits_for_it",
            run: child_defect_a_host_function_waits_out_an_unmap_that_waits_for_it,
        },
        Child {
            name: "round5_defect_a_host_function_waits_out_a_pinned_free_that_waits_for_it",
            run: child_defect_a_host_function_waits_out_a_pinned_free_that_waits_for_it,
        },
        Child {
            name: "round5_defect_free_races_a_wait_queued_on_a_foreign_stream",
            run: child_defect_free_races_a_wait_queued_on_a_foreign_stream,
        },
        Child {
            name: "round5_defect_pending_copy_dropped_behind_a_wait_this_thread_passes",
            run: child_defect_pending_copy_dropped_behind_a_wait_this_thread_passes,
        },
        Child {
            name: "round5_deferred_at_exit",
            run: child_deferred_at_exit,
        },
        Child {
            name: "round5_nothing_deferred_at_exit",
            run: child_nothing_deferred_at_exit,
        },
    ]
}

pub fn tests() -> Vec<Test> {
    macro_rules! tests {
        ($($f:ident),* $(,)?) => {
            vec![$(Test { name: concat!("round5::", stringify!($f)), run: $f }),*]
        };
    }
    tests![
        defect_unmap_races_a_wait_queued_after_its_check,
        defect_range_drop_races_a_wait_queued_after_its_check,
        defect_sleep_races_a_wait_queued_after_its_check,
        defect_free_races_a_wait_queued_on_a_foreign_stream,
        defect_a_host_function_waits_out_an_unmap_that_waits_for_it,
        defect_a_host_function_waits_out_a_pinned_free_that_waits_for_it,
        defect_pending_copy_dropped_behind_a_wait_this_thread_passes,
        held_pending_copy_dropped_without_a_wait_frees_at_once,
        defect_deferred_releases_at_exit_are_reported_once,
        held_nothing_deferred_says_nothing_at_exit,
    ]
}
