//! Review of the capture end path, the repeatable host function's section
//! (f0814bd), deferred pinned frees (30a0aab) and the per-stream completion
//! events, as an adversary (issue 29's "Also": other threads, captures begun
//! between two steps, a panic, a failed call, drop order): each `defect_*`
//! test fails on the code it was written against; each `held_*` test is an
//! attack that held.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use crate::harness::{run_child, Child, Test};

fn finish() {
    release(0);
    release(1);
    assert_eq!(fake().live(Live::DeviceMemory), 0, "device memory left");
    assert_eq!(fake().live(Live::HostMemory), 0, "pinned memory left");
    assert_eq!(fake().live(Live::Streams), 0, "streams left");
    assert_eq!(fake().live(Live::Events), 0, "events left");
    assert_eq!(fake().live(Live::Graphs), 0, "graphs left");
    assert_eq!(fake().live(Live::Execs), 0, "executable graphs left");
}

/// Run a scenario in a child process (a failing one leaves the stand-in and
/// the process's lists as they are): it passes when the child does.
fn in_child(name: &str) {
    let out = run_child(name, &[]);
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A repeatable host function queued on a stream that joined another
/// stream's capture, while another thread ends that capture: the queuing
/// thread asked the capture id (the capture's), pushed its keep and is in
/// `cuLaunchHostFunc` when the end runs; the end's release waits for the
/// list's lock, the call then lands on the stream (no longer capturing) and
/// runs once there. The keep is then re-tagged "for the life of the
/// process": nothing ever releases it, and nothing says so (no line on
/// stderr), against the rule that a leak is never silent. Here the closure's
/// captures (a token) stay alive after the graph, the stream and every other
/// holder are gone.
fn child_defect_repeat_host_fn_whose_capture_ends_meanwhile_leaks_silently() {
    fake().reset();
    let h = host(0).unwrap();
    let a = CudaStream::new(&h).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    a.begin_capture(CaptureMode::Relaxed).unwrap();
    let ev = CudaEvent::new(&h).unwrap();
    ev.record(&a).unwrap();
    // `s` joins `a`'s capture.
    s.wait(&ev).unwrap();
    assert!(s.is_capturing().unwrap());
    let token = Arc::new(AtomicUsize::new(0));
    let t = Arc::clone(&token);
    let f: HostFn = Arc::new(move || {
        t.fetch_add(1, Ordering::SeqCst);
    });
    fake().pause_next("cuLaunchHostFunc");
    let s1 = s.clone();
    let queuer = std::thread::spawn(move || s1.launch_host_fn_repeat(f));
    assert!(
        fake().wait_paused("cuLaunchHostFunc", 10_000),
        "the host function is being queued into the capture"
    );
    let a1 = a.clone();
    let ender = std::thread::spawn(move || a1.end_capture());
    std::thread::sleep(Duration::from_millis(100));
    fake().resume("cuLaunchHostFunc");
    queuer.join().unwrap().unwrap();
    let graph = ender.join().unwrap().unwrap();
    assert!(!s.is_capturing().unwrap(), "the capture is over");
    s.synchronize().unwrap();
    let ran = token.load(Ordering::SeqCst);
    drop(graph);
    drop(ev);
    drop((a, s, h));
    finish();
    let left = Arc::strong_count(&token);
    println!("ran {ran}, holders left {left}");
    assert_eq!(
        left, 1,
        "the host function ran on the stream ({ran} run(s)), its graph, stream and \
         handles are gone: nothing should still hold it (or stderr should say so)"
    );
}

fn defect_repeat_host_fn_whose_capture_ends_meanwhile_leaks_silently() {
    let name = "review3_defect_repeat_host_fn_whose_capture_ends_meanwhile_leaks_silently";
    let out = run_child(name, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    // Either nothing is left, or the leak is said on stderr.
    assert!(
        out.status.success() || err.contains("life of the process"),
        "{name}: {err}"
    );
}

/// A pinned buffer dropped on one thread while another queues a GPU-side
/// wait on a mapped word: the drop's check (`host_free_must_wait`: no pending
/// wait) and its `cuMemFreeHost` are two steps, and the wait is counted and
/// queued in between (the stand-in pauses the free at its entry). The free
/// then waits for the context's work, which the unmet wait blocks: the Drop
/// blocks until the host writes the word, which the deferral exists to avoid
/// ("a Drop never blocks behind a wait only the host can end"). Were the
/// dropping thread the word's writer, this is a deadlock.
fn child_defect_pinned_free_races_a_wait_queued_after_its_check() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let pinned = PinnedBuffer::<u32>::zeroed(reg.ctx(), 64).unwrap();
    s.synchronize().unwrap();
    fake().pause_next("cuMemFreeHost");
    let (tx, rx) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        drop(pinned);
        let _ = tx.send(());
    });
    assert!(
        fake().wait_paused("cuMemFreeHost", 10_000),
        "the drop found no pending wait and is freeing"
    );
    let returned = std::thread::scope(|sc| {
        // The wait is counted and queued on another thread meanwhile (it may
        // wait for the free in flight).
        let waiter = sc.spawn(|| {
            let word = SignalWord::mapped(&go, 0).unwrap();
            s.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
        });
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(reg.ctx().pending_waits(), 1, "counted");
        fake().resume("cuMemFreeHost");
        let returned = rx.recv_timeout(Duration::from_secs(2)).is_ok();
        waiter.join().unwrap();
        returned
    });
    // Pass the wait so that everything can go.
    go.atomic(0).unwrap().store(1, Ordering::SeqCst);
    dropper.join().unwrap();
    s.synchronize().unwrap();
    reg.ctx().synchronize().unwrap();
    drop((go, s));
    done(reg);
    assert!(
        returned,
        "the pinned buffer's drop blocked behind a GPU-side wait queued while it freed"
    );
}

fn defect_pinned_free_races_a_wait_queued_after_its_check() {
    in_child("review3_defect_pinned_free_races_a_wait_queued_after_its_check");
}

/// Pinned memory still allocated in the stand-in.
fn pinned_live() -> i32 {
    fake().live(Live::HostMemory)
}

/// A pinned buffer dropped on a thread that is capturing (its free deferred:
/// `cuMemFreeHost` is refused there), the capture then ended by another
/// thread: that end's retry, on a thread with no capture, frees it.
fn held_pinned_dropped_on_a_capturing_thread_freed_by_an_end_on_another() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    let (before, deferred) = (pinned_live(), deferred_frees());
    let pinned = PinnedBuffer::<u32>::zeroed(&h, 64).unwrap();
    let s1 = s.clone();
    std::thread::spawn(move || {
        s1.begin_capture(CaptureMode::Relaxed).unwrap();
        drop(pinned);
    })
    .join()
    .unwrap();
    assert_eq!(
        deferred_frees(),
        deferred + 1,
        "deferred on the capturing thread"
    );
    assert_eq!(pinned_live(), before + 1);
    drop(s.end_capture().unwrap());
    assert_eq!(deferred_frees(), deferred, "retried by the end");
    assert_eq!(pinned_live(), before, "freed by the end's retry");
    drop((s, h));
    finish();
}

/// A pinned buffer dropped inside a host function (no driver call there):
/// deferred, and freed by the next synchronize.
fn held_pinned_dropped_in_a_host_function_freed_at_the_next_synchronize() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    let before = pinned_live();
    let pinned = PinnedBuffer::<u32>::zeroed(&h, 64).unwrap();
    s.launch_host_fn(move || drop(pinned)).unwrap();
    s.synchronize().unwrap();
    assert_eq!(pinned_live(), before, "freed by the synchronize after it");
    assert_eq!(deferred_frees(), 0);
    drop((s, h));
    finish();
}

/// A pinned buffer dropped while a GPU-side wait on a mapped word is pending:
/// the drop returns at once (deferred); once the host passes the wait, the
/// next synchronize frees it.
fn held_pinned_dropped_behind_a_pending_wait_freed_once_it_passes() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&go, 0).unwrap();
    s.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
    let before = pinned_live();
    let pinned = PinnedBuffer::<u32>::zeroed(reg.ctx(), 64).unwrap();
    let t = std::time::Instant::now();
    drop(pinned);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "the drop did not wait"
    );
    assert_eq!(pinned_live(), before + 1, "deferred");
    // A drain while the wait is still pending (making mapped words drains
    // without waiting) keeps it deferred.
    let extra = MappedWords::<u32>::new(reg.ctx(), 1).unwrap();
    assert_eq!(pinned_live(), before + 2, "still deferred");
    assert_eq!(deferred_frees(), 1);
    go.atomic(0).unwrap().store(1, Ordering::SeqCst);
    drop(extra);
    s.synchronize().unwrap();
    assert_eq!(reg.ctx().pending_waits(), 0);
    // The keeper's host function counted the wait down after the stream's
    // synchronize may have drained: one more drain frees it at the latest.
    if pinned_live() != before {
        s.synchronize().unwrap();
    }
    assert_eq!(pinned_live(), before, "freed once the wait passed");
    drop(word);
    drop((go, s));
    done(reg);
}

/// A pinned buffer dropped behind a pending wait, retried by a drain on a
/// thread that is capturing (re-deferred there, with no drain flag left
/// set): the capture's end on that thread retries it and frees it.
fn held_pinned_deferred_retried_on_a_capturing_thread_then_its_end() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let other = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&go, 0).unwrap();
    s.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
    let before = pinned_live();
    drop(PinnedBuffer::<u32>::zeroed(reg.ctx(), 64).unwrap());
    go.atomic(0).unwrap().store(1, Ordering::SeqCst);
    // Let the keeper run (the wait passes on the stream's worker).
    while reg.ctx().pending_waits() != 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::scope(|sc| {
        sc.spawn(|| {
            other.begin_capture(CaptureMode::Relaxed).unwrap();
            // A drain on this capturing thread: the free stays deferred.
            s.synchronize().unwrap();
            assert_eq!(pinned_live(), before + 1, "not freed on a capturing thread");
            drop(other.end_capture().unwrap());
            assert_eq!(pinned_live(), before, "freed by the end's retry");
        });
    });
    assert_eq!(deferred_frees(), 0);
    drop(word);
    drop((go, s, other));
    done(reg);
}

/// A panic in a capture's closure right after it dropped a pinned buffer (its
/// free deferred): the capture ends on the unwind, and that end frees it.
fn held_panic_in_a_capture_after_a_pinned_drop() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    let before = pinned_live();
    let pinned = PinnedBuffer::<u32>::zeroed(&h, 64).unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        s.capture(|_| {
            drop(pinned);
            assert_eq!(deferred_frees(), 1);
            panic!("in the capture");
        })
    }));
    assert!(r.is_err());
    assert!(!s.is_capturing().unwrap());
    assert_eq!(deferred_frees(), 0);
    assert_eq!(pinned_live(), before);
    drop((s, h));
    finish();
}

/// The completion-event pool under failed calls and a full pool: a slot's
/// event that could not be made gives the slot back; sixteen forgotten
/// pending copies fill the pool, and later operations make (and destroy)
/// events of their own; pending copies dropped after every other handle of
/// their stream still wait and free everything.
fn child_held_done_pool_failures_and_a_full_pool() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let src = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    s.synchronize().unwrap();
    // Slot 0 held (its event made now or before).
    let p0 = s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 64).unwrap())
        .unwrap();
    let events = fake().live(Live::Events);
    // Slot 1's first event cannot be made: the copy fails (waited for), the
    // slot is free again.
    fake().fail("cuEventCreate", 999, 1, Some(1));
    assert!(s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 64).unwrap())
        .is_err());
    assert_eq!(fake().live(Live::Events), events);
    let p = s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 64).unwrap())
        .unwrap();
    assert_eq!(p.wait().unwrap().len(), 64);
    assert_eq!(p0.wait().unwrap().len(), 64);
    let events = events - 1;
    assert_eq!(fake().live(Live::Events), events + 2, "two slots' events");
    // Fill the pool with forgotten copies.
    for _ in 0..16 {
        let p = s
            .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 64).unwrap())
            .unwrap();
        std::mem::forget(p);
    }
    let full = fake().live(Live::Events);
    assert_eq!(full, events + 16);
    let held: Vec<_> = (0..5)
        .map(|_| {
            s.copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 64).unwrap())
                .unwrap()
        })
        .collect();
    assert_eq!(fake().live(Live::Events), full + 5, "events of their own");
    // A failed record of an own event: destroyed, the copy waited for.
    fake().fail("cuEventRecord", 999, 1, Some(1));
    assert!(s.to_vec(&src).is_err());
    assert_eq!(fake().live(Live::Events), full + 5);
    // Drop order: every other handle of the stream goes first.
    let s2 = s.clone();
    drop(s);
    drop(src);
    for p in held {
        assert!(p.is_done().unwrap() || !p.is_done().unwrap());
        drop(p);
    }
    assert_eq!(fake().live(Live::Events), full, "own events destroyed");
    assert!(s2.query().unwrap());
    drop(s2);
    drop(reg);
    release(0);
}

fn held_done_pool_failures_and_a_full_pool() {
    // In a child: the forgotten pending copies leak their buffers and stream.
    in_child("review3_held_done_pool_failures_and_a_full_pool");
}

/// Drop order: the last handle of a stream dropped while a metrale capture
/// is in progress on it (safe code: `begin_capture`, then `drop`). The
/// stream is destroyed, but its capture's bookkeeping (kept in the stream)
/// is never undone: the beginning thread's capture count stays raised, so
/// every pinned (and `cuMemFree`) free on that thread is deferred for ever
/// (each drain defers it again); the process's capture count stays raised
/// (kernel code held for captures is never released, the launch path's
/// capture work never stops); and repeatable host functions queued into the
/// capture stay in the capture list for the life of the process, with no
/// line on stderr.
fn child_defect_capturing_stream_dropped_leaves_its_capture_counted() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    let token = Arc::new(());
    let t = Arc::clone(&token);
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    s.launch_host_fn_repeat(Arc::new(move || {
        let _ = &t;
    }))
    .unwrap();
    drop(s);
    let before = pinned_live();
    drop(PinnedBuffer::<u32>::zeroed(&h, 64).unwrap());
    h.ctx().synchronize().unwrap();
    let (left, deferred) = (pinned_live() - before, deferred_frees());
    let holders = Arc::strong_count(&token);
    assert_eq!(
        (left, deferred),
        (0, 0),
        "no capture is in progress any more: a pinned free on this thread is not deferred"
    );
    assert_eq!(
        holders, 1,
        "the capture is gone: nothing holds its host function"
    );
    // Its graph went with it.
    drop(h);
    finish();
}

fn defect_capturing_stream_dropped_leaves_its_capture_counted() {
    in_child("review3_defect_capturing_stream_dropped_leaves_its_capture_counted");
}

/// f0814bd with a join instead of a begin: a repeatable host function queued
/// on a stream no capture marks (its section's fast path) is paused in the
/// driver's call while another thread makes the stream wait on an event
/// recorded in another stream's capture (which would join it). The join
/// waits for the call: the function runs once on the stream, and the graph
/// of the capture has no node of it.
fn held_repeat_host_fn_outside_a_capture_waits_out_a_join() {
    fake().reset();
    let h = host(0).unwrap();
    let a = CudaStream::new(&h).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&runs);
    let f: HostFn = Arc::new(move || {
        r.fetch_add(1, Ordering::SeqCst);
    });
    a.begin_capture(CaptureMode::Relaxed).unwrap();
    let ev = CudaEvent::new(&h).unwrap();
    ev.record(&a).unwrap();
    fake().pause_next("cuLaunchHostFunc");
    let graph = std::thread::scope(|sc| {
        let queuer = sc.spawn(|| s.launch_host_fn_repeat(f));
        assert!(fake().wait_paused("cuLaunchHostFunc", 10_000));
        let joiner = sc.spawn(|| s.wait(&ev));
        std::thread::sleep(Duration::from_millis(50));
        fake().resume("cuLaunchHostFunc");
        queuer.join().unwrap().unwrap();
        joiner.join().unwrap().unwrap();
        assert!(s.is_capturing().unwrap(), "joined after the call");
        a.end_capture().unwrap()
    });
    s.synchronize().unwrap();
    let nodes = graph.nodes().unwrap().len();
    let exec = graph.instantiate().unwrap();
    // SAFETY: the graph records an event and waits; no kernel.
    unsafe { exec.launch(&a) }.unwrap();
    a.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "ran once, on the stream");
    assert!(nodes <= 2, "no host node in the graph: {nodes} nodes");
    drop((exec, graph, ev));
    drop((a, s, h));
    finish();
}

/// A pending copy dropped inside another stream's capture, on the capturing
/// thread: it waits for its own copy (an event recorded outside the
/// capture), and its pinned buffer's free is deferred (refused on a capturing
/// thread) and done by the capture's end.
fn held_pending_copy_dropped_inside_a_capture() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    let c = CudaStream::new(&h).unwrap();
    let src = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    s.synchronize().unwrap();
    let before = pinned_live();
    let p = s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 64).unwrap())
        .unwrap();
    let g = c
        .capture(|_| {
            drop(p);
            assert_eq!(pinned_live(), before + 1, "deferred");
            Ok(())
        })
        .unwrap();
    assert_eq!(pinned_live(), before, "freed by the end");
    assert_eq!(deferred_frees(), 0);
    drop(g);
    drop((src, s, c, h));
    finish();
}

/// The last handle of a stream dropped while its capture is invalidated (an
/// illegal call inside it): the drop ends it quietly and undoes its
/// bookkeeping; a pinned free on the thread is not deferred afterwards.
fn child_held_invalidated_capturing_stream_dropped() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    let d = sys::driver().unwrap();
    // SAFETY: a live stream of the bound context (the query invalidates the
    // capture).
    let st = unsafe { (d.cuStreamQuery().unwrap())(s.raw()) };
    assert!(!st.is_success());
    drop(s);
    let before = pinned_live();
    drop(PinnedBuffer::<u32>::zeroed(&h, 64).unwrap());
    assert_eq!(pinned_live(), before, "not deferred");
    assert_eq!(deferred_frees(), 0);
    drop(h);
    finish();
}

fn held_invalidated_capturing_stream_dropped() {
    let name = "review3_held_invalidated_capturing_stream_dropped";
    let out = run_child(name, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}: {err}");
    assert!(!err.contains("metrale:"), "nothing to say: {err}");
}

/// The last handle of a capturing stream dropped while the driver refuses
/// to end its capture: one line on stderr says so, and the bookkeeping is
/// undone all the same (the stream is destroyed: nothing can end or replay
/// that capture any more).
fn child_held_capturing_stream_dropped_with_a_failed_end() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    fake().fail("cuStreamEndCapture", 999, 1, Some(1));
    drop(s);
    let before = pinned_live();
    drop(PinnedBuffer::<u32>::zeroed(&h, 64).unwrap());
    assert_eq!(pinned_live(), before, "not deferred");
    assert_eq!(deferred_frees(), 0);
    drop(h);
    release(0);
}

fn held_capturing_stream_dropped_with_a_failed_end() {
    let name = "review3_held_capturing_stream_dropped_with_a_failed_end";
    let out = run_child(name, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}: {err}");
    assert_eq!(
        err.matches("cuStreamEndCapture").count(),
        1,
        "one line: {err}"
    );
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "review3_held_capturing_stream_dropped_with_a_failed_end",
            run: child_held_capturing_stream_dropped_with_a_failed_end,
        },
        Child {
            name: "review3_held_invalidated_capturing_stream_dropped",
            run: child_held_invalidated_capturing_stream_dropped,
        },
        Child {
            name: "review3_defect_capturing_stream_dropped_leaves_its_capture_counted",
            run: child_defect_capturing_stream_dropped_leaves_its_capture_counted,
        },
        Child {
            name: "review3_held_done_pool_failures_and_a_full_pool",
            run: child_held_done_pool_failures_and_a_full_pool,
        },
        Child {
            name: "review3_defect_repeat_host_fn_whose_capture_ends_meanwhile_leaks_silently",
            run: child_defect_repeat_host_fn_whose_capture_ends_meanwhile_leaks_silently,
        },
        Child {
            name: "review3_defect_pinned_free_races_a_wait_queued_after_its_check",
            run: child_defect_pinned_free_races_a_wait_queued_after_its_check,
        },
    ]
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "review3::held_capturing_stream_dropped_with_a_failed_end",
            run: held_capturing_stream_dropped_with_a_failed_end,
        },
        Test {
            name: "review3::held_invalidated_capturing_stream_dropped",
            run: held_invalidated_capturing_stream_dropped,
        },
        Test {
            name: "review3::held_repeat_host_fn_outside_a_capture_waits_out_a_join",
            run: held_repeat_host_fn_outside_a_capture_waits_out_a_join,
        },
        Test {
            name: "review3::held_pending_copy_dropped_inside_a_capture",
            run: held_pending_copy_dropped_inside_a_capture,
        },
        Test {
            name: "review3::held_pinned_dropped_on_a_capturing_thread_freed_by_an_end_on_another",
            run: held_pinned_dropped_on_a_capturing_thread_freed_by_an_end_on_another,
        },
        Test {
            name: "review3::held_pinned_dropped_in_a_host_function_freed_at_the_next_synchronize",
            run: held_pinned_dropped_in_a_host_function_freed_at_the_next_synchronize,
        },
        Test {
            name: "review3::held_pinned_dropped_behind_a_pending_wait_freed_once_it_passes",
            run: held_pinned_dropped_behind_a_pending_wait_freed_once_it_passes,
        },
        Test {
            name: "review3::held_pinned_deferred_retried_on_a_capturing_thread_then_its_end",
            run: held_pinned_deferred_retried_on_a_capturing_thread_then_its_end,
        },
        Test {
            name: "review3::held_panic_in_a_capture_after_a_pinned_drop",
            run: held_panic_in_a_capture_after_a_pinned_drop,
        },
        Test {
            name: "review3::held_done_pool_failures_and_a_full_pool",
            run: held_done_pool_failures_and_a_full_pool,
        },
        Test {
            name: "review3::defect_pinned_free_races_a_wait_queued_after_its_check",
            run: defect_pinned_free_races_a_wait_queued_after_its_check,
        },
        Test {
            name: "review3::defect_repeat_host_fn_whose_capture_ends_meanwhile_leaks_silently",
            run: defect_repeat_host_fn_whose_capture_ends_meanwhile_leaks_silently,
        },
        Test {
            name: "review3::defect_capturing_stream_dropped_leaves_its_capture_counted",
            run: defect_capturing_stream_dropped_leaves_its_capture_counted,
        },
    ]
}
