//! Review of issue 29's fixes (items 1, 3, 4, 9, 10, 16) as an adversary: each
//! `defect_*` test fails on the code it was written against; each `held_*`
//! test is an attack that the fixes withstood.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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

/// Item 1: `launch_host_fn_repeat` on a stream that is not marked for a capture
/// dropped its section before handing the closure to `launch_host_fn`, so a
/// capture could begin between its "not capturing" and the driver's call. The
/// repeatable host function then went into the graph through a once-only pool
/// slot: the graph's first replay ran it, later replays ran nothing. Now the
/// capture's start waits for the call: the function runs on the stream, once,
/// and the graph has no node of it (or, had the capture taken it, it would run
/// on every replay).
fn child_defect_repeat_host_fn_captured_after_its_check_runs_once() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&runs);
    let f: HostFn = Arc::new(move || {
        r.fetch_add(1, Ordering::SeqCst);
    });
    fake().pause_next("cuLaunchHostFunc");
    let s2 = s.clone();
    let queuer = std::thread::spawn(move || s2.launch_host_fn_repeat(f));
    assert!(
        fake().wait_paused("cuLaunchHostFunc", 10_000),
        "the host function is being queued"
    );
    // Between its check and the driver's call: a capture begins on another
    // thread (it may wait for the call to be made).
    let s3 = s.clone();
    let capturer = std::thread::spawn(move || s3.begin_capture(CaptureMode::Relaxed));
    std::thread::sleep(std::time::Duration::from_millis(50));
    fake().resume("cuLaunchHostFunc");
    queuer.join().unwrap().unwrap();
    capturer.join().unwrap().unwrap();
    let graph = s.end_capture().unwrap();
    let in_graph = graph.nodes().unwrap().len();
    let exec = graph.instantiate().unwrap();
    drop(graph);
    s.synchronize().unwrap();
    let before = runs.load(Ordering::SeqCst);
    for _ in 0..3 {
        // SAFETY: the graph runs a host function only.
        unsafe { exec.launch(&s) }.unwrap();
    }
    s.synchronize().unwrap();
    let ran = runs.load(Ordering::SeqCst);
    drop(exec);
    drop((s, h));
    finish();
    assert!(in_graph <= 1, "{in_graph} nodes");
    if in_graph == 1 {
        assert_eq!(
            (before, ran),
            (0, 3),
            "a repeatable host function taken by a capture runs on every replay"
        );
    } else {
        assert_eq!(
            (before, ran),
            (1, 1),
            "a repeatable host function queued before the capture runs once, on the stream"
        );
    }
}

/// Item 1: when the capture id is known at neither end (the query after the
/// begin and the query at the end both fail), the end releases nothing: the
/// repeatable host function queued into the capture (tagged with the id its
/// own query saw) stays in the capture list for the life of the process, with
/// no line on stderr (a silent leak).
fn child_defect_capture_id_unknown_at_both_ends_leaks_its_host_function() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    let token = Arc::new(());
    let t = Arc::clone(&token);
    fake().fail("cuStreamGetCaptureInfo_v3", 999, 1, Some(1));
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    s.launch_host_fn_repeat(Arc::new(move || {
        let _ = &t;
    }))
    .unwrap();
    fake().fail("cuStreamGetCaptureInfo_v3", 999, 1, Some(1));
    let graph = s.end_capture().unwrap();
    assert!(!s.is_capturing().unwrap());
    drop(graph);
    let left = Arc::strong_count(&token);
    drop((s, h));
    finish();
    assert_eq!(
        left, 1,
        "the graph is gone and its capture ended: nothing holds the host function"
    );
}

/// Item 9: a capture whose end failed four times leaves this thread's capture
/// count raised and says "call end_capture() to end it". A Relaxed capture may
/// be ended on any thread (the driver allows it); ended on another thread, the
/// count of the thread that began it stays raised for good: every `cuMemFree`
/// there is deferred for ever (the retries at each drain, on this thread,
/// defer it again).
fn child_defect_stuck_capture_ended_on_another_thread_leaves_this_thread_capturing() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    fake().fail("cuStreamEndCapture", 999, 1, None);
    let e = s
        .capture_with(CaptureMode::Relaxed, |_| Ok(()))
        .unwrap_err();
    assert!(e.to_string().contains("still capturing"), "{e}");
    fake().fail("cuStreamEndCapture", 999, 1, Some(0));
    let s2 = s.clone();
    std::thread::spawn(move || drop(s2.end_capture().unwrap()))
        .join()
        .unwrap();
    assert!(!s.is_capturing().unwrap(), "the capture ended");
    let before = deferred_frees();
    drop(DeviceBuffer::<u32>::alloc(&h, 4).unwrap());
    h.ctx().synchronize().unwrap();
    s.synchronize().unwrap();
    let left = deferred_frees() - before;
    // Let another thread's drain free it, so the suite goes on clean.
    let h2 = Arc::clone(&h);
    std::thread::spawn(move || h2.ctx().synchronize().unwrap())
        .join()
        .unwrap();
    assert_eq!(
        left, 0,
        "no capture is in progress: a free on this thread is not deferred"
    );
    drop((s, h));
    finish();
}

/// Item 4: an unseen wait (its keeper refused) lists raw event and stream
/// handles; after a reset of the primary context outside metrale they are
/// dangling, yet the next `pending_waits()` (or drain) queries them: the
/// stand-in counts a use of a destroyed handle, which the real driver may
/// crash on (it did for a stream on CUDA 13.0). Every other release path
/// checks the generation first (`may_release`).
fn child_defect_unseen_wait_queried_after_a_reset() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&go, 0).unwrap();
    fake().fail("cuLaunchHostFunc", 999, 1, None);
    let e = s.wait_value32(&word, 1, WaitFlags::EQ).unwrap_err();
    assert!(e.to_string().contains("cuLaunchHostFunc"), "{e}");
    fake().fail("cuLaunchHostFunc", 999, 1, Some(0));
    go.atomic(0).unwrap().store(1, Ordering::SeqCst);
    let stale = fake().stale_uses();
    let d = sys::driver().unwrap();
    // SAFETY: destroys every resource of the context; the handles above are not
    // used again except by their Drop.
    let status = unsafe { (d.cuDevicePrimaryCtxReset_v2().unwrap())(reg.ctx().device()) };
    assert_eq!(status, CUresult::CUDA_SUCCESS);
    // Another library on this thread leaves no context current; metrale's
    // next call binds the primary context, which the driver creates anew.
    // SAFETY: null is a valid argument (no context).
    unsafe { (d.cuCtxSetCurrent().unwrap())(std::ptr::null_mut()) };
    let waits = reg.ctx().pending_waits();
    let used = fake().stale_uses() - stale;
    drop(word);
    drop((go, s));
    drop(reg);
    release(0);
    assert_eq!(waits, 0, "the reset ended the wait");
    assert_eq!(
        used, 0,
        "no handle the reset destroyed is given to the driver"
    );
}

/// Item 4: an unseen wait whose event could not be made is judged by its
/// stream's idleness (`cuStreamQuery`). Once the stream is captured, that query
/// is illegal: the driver refuses it and invalidates the capture (the stand-in
/// does as the driver). Any `pending_waits()` (a free does one), on any thread,
/// then breaks the user's capture.
fn child_defect_unseen_wait_triage_invalidates_a_capture() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&go, 0).unwrap();
    fake().fail("cuLaunchHostFunc", 999, 1, None);
    fake().fail("cuEventCreate", 999, 1, Some(1));
    let e = s.wait_value32(&word, 1, WaitFlags::EQ).unwrap_err();
    assert!(e.to_string().contains("cuLaunchHostFunc"), "{e}");
    fake().fail("cuLaunchHostFunc", 999, 1, Some(0));
    // The stream stays busy behind the wait (the word is written only after
    // the capture), so the listed wait is not triaged before the capture.
    let captured = s.capture(|s| {
        s.launch_host_fn_repeat(Arc::new(|| {}))?;
        // Reading the count (another thread's free would do the same).
        let _ = reg.ctx().pending_waits();
        Ok(())
    });
    let ok = captured.is_ok();
    let err = captured.err().map(|e| e.to_string());
    go.atomic(0).unwrap().store(1, Ordering::SeqCst);
    s.synchronize().unwrap();
    reg.ctx().synchronize().unwrap();
    drop(word);
    drop((go, s));
    done(reg);
    assert!(
        ok,
        "the capture is not invalidated by metrale's own triage: {err:?}"
    );
}

/// Items 1 and 9: two threads end the same stream's capture (`end_capture`
/// takes `&self`, `CudaStream` is `Sync`). The first ends it in the driver and
/// is paused before its graph takes its holds (in `cuGraphGetNodes`); the
/// second finds the stream no longer capturing, falls back to the id noted at
/// the begin, fails to end it, sees "not capturing" and releases that
/// capture's host functions. The first graph then finds nothing to hold: its
/// host node's user data is freed memory, run by every replay.
fn child_defect_two_ends_of_one_capture_free_its_host_function() {
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
    fake().pause_next("cuGraphGetNodes");
    let s1 = s.clone();
    let first = std::thread::spawn(move || s1.end_capture());
    assert!(
        fake().wait_paused("cuGraphGetNodes", 10_000),
        "the first end has ended the capture and is taking its holds"
    );
    let second = s.end_capture();
    assert!(second.is_err(), "the capture was already ended");
    fake().resume("cuGraphGetNodes");
    let graph = first.join().unwrap().unwrap();
    let held = Arc::strong_count(&token);
    // Not replayed: the host node's user data would be freed memory.
    std::mem::forget(graph);
    assert_eq!(
        held, 2,
        "the graph holds its host function (the second end freed it under the first)"
    );
}

/// Item 9: a capture begun on the stream (by any thread) between an end's
/// driver call, which ended the capture with an error, and that end's status
/// check. The end then takes the new capture for its own, still in progress:
/// it undoes no bookkeeping, and the first capture's (its mark, the process's
/// capture count, the beginning thread's capture depth) is never undone. On
/// the thread that began both, every `cuMemFree` is deferred for ever.
fn child_defect_capture_begun_during_a_failed_end_keeps_the_old_one_counted() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    // An illegal query invalidates the capture: its end fails, and ends it.
    let d = sys::driver().unwrap();
    // SAFETY: a live stream of the bound context.
    let st = unsafe { (d.cuStreamQuery().unwrap())(s.raw()) };
    assert!(!st.is_success());
    fake().pause_next("cuStreamEndCapture");
    let s1 = s.clone();
    let ender = std::thread::spawn(move || s1.end_capture().map(drop));
    assert!(fake().wait_paused("cuStreamEndCapture", 10_000));
    fake().pause_next("cuStreamGetCaptureInfo_v3");
    fake().resume("cuStreamEndCapture");
    assert!(
        fake().wait_paused("cuStreamGetCaptureInfo_v3", 10_000),
        "the end asks whether the capture is over"
    );
    // Meanwhile the capture is over in the driver: a new one begins.
    s.begin_capture(CaptureMode::Relaxed).unwrap();
    fake().resume("cuStreamGetCaptureInfo_v3");
    assert!(ender.join().unwrap().is_err(), "the invalidated capture");
    drop(s.end_capture().unwrap());
    assert!(!s.is_capturing().unwrap(), "both captures ended");
    let before = deferred_frees();
    drop(DeviceBuffer::<u32>::alloc(&h, 4).unwrap());
    h.ctx().synchronize().unwrap();
    let left = deferred_frees() - before;
    assert_eq!(
        left, 0,
        "no capture is in progress: a free on this thread is not deferred"
    );
}

/// Item 9: when the closure fails and the end is stuck, `capture` returns the
/// closure's error and drops the end's: nothing says (no error, no line on
/// stderr) that the stream is still capturing and counted on this thread,
/// which the stuck-end error exists to say.
fn child_defect_closure_error_hides_a_stuck_capture() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    s.synchronize().unwrap();
    fake().fail("cuStreamEndCapture", 999, 1, None);
    let e = s
        .capture(|s| {
            // Any failure of the closure's own work: a copy refused in a capture.
            s.to_vec(&DeviceBuffer::<u32>::alloc(s.context(), 4)?)?;
            Ok(())
        })
        .unwrap_err();
    fake().fail("cuStreamEndCapture", 999, 1, Some(0));
    let still = s.is_capturing().unwrap();
    let text = e.to_string();
    if still {
        drop(s.end_capture());
    }
    assert!(
        !still || text.contains("still capturing"),
        "the stream is still capturing, and the error does not say so: {text}"
    );
}

/// Item 3: more pending copies than pool slots, from several threads at
/// once, some waited, some dropped, some polled with `is_done`; each sees its
/// own copy complete, every event is given back or destroyed.
fn child_held_many_pending_copies_from_threads() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let src = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    s.synchronize().unwrap();
    let events = fake().live(Live::Events);
    std::thread::scope(|sc| {
        for t in 0..4 {
            let (s, src) = (&s, &src);
            sc.spawn(move || {
                for round in 0..20 {
                    let pend: Vec<_> = (0..9)
                        .map(|_| {
                            s.copy_d2h_pinned(src, PinnedBuffer::<u32>::zeroed(s, 64).unwrap())
                                .unwrap()
                        })
                        .collect();
                    for (i, p) in pend.into_iter().enumerate() {
                        match (i + t + round) % 3 {
                            0 => assert_eq!(p.wait().unwrap().len(), 64),
                            1 => drop(p),
                            _ => {
                                while !p.is_done().unwrap() {}
                                drop(p);
                            }
                        }
                    }
                    drop(s.to_vec(src).unwrap());
                }
            });
        }
    });
    assert!(
        fake().live(Live::Events) <= events + 16,
        "at most the pool's events"
    );
    // Forgotten pending copy: its slot stays claimed and its buffer leaked; the
    // stream (held by it) is never destroyed under it.
    let p = s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 64).unwrap())
        .unwrap();
    std::mem::forget(p);
    // A failed record: the slot goes back, the copy is waited for.
    fake().fail("cuEventRecord", 999, 1, Some(1));
    assert!(s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 64).unwrap())
        .is_err());
    for _ in 0..40 {
        drop(s.to_vec(&src).unwrap());
    }
    // Copies on a capturing stream are refused before anything is queued.
    let g = s.capture(|s| {
        assert!(s
            .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(s, 64).unwrap())
            .is_err());
        assert!(s.to_vec(&src).is_err());
        Ok(())
    });
    drop(g);
    s.synchronize().unwrap();
    drop((src, s));
    drop(reg);
    release(0);
}

/// Item 1: captures on three threads at once, each queuing repeatable host
/// functions on its own stream (and one joined to another's capture), ended in
/// any order; each graph runs its own functions on every replay, and every
/// function is released once its graph and executable graph are gone.
fn held_three_captures_release_their_own() {
    fake().reset();
    let h = host(0).unwrap();
    let streams: Vec<CudaStream> = (0..3).map(|_| CudaStream::new(&h).unwrap()).collect();
    let tokens: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::new(AtomicUsize::new(0))).collect();
    for round in 0..30 {
        let graphs: Vec<CudaGraph> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..3)
                .map(|i| {
                    let (s, t) = (&streams[i], Arc::clone(&tokens[i]));
                    sc.spawn(move || {
                        s.capture_with(CaptureMode::Relaxed, |s| {
                            for _ in 0..(1 + (i + round) % 3) {
                                let t = Arc::clone(&t);
                                s.launch_host_fn_repeat(Arc::new(move || {
                                    t.fetch_add(1, Ordering::SeqCst);
                                }))?;
                                std::thread::yield_now();
                            }
                            Ok(())
                        })
                        .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, g) in graphs.into_iter().enumerate() {
            let before = tokens[i].load(Ordering::SeqCst);
            let exec = g.instantiate().unwrap();
            if round % 2 == 0 {
                drop(g);
            } else {
                drop(exec);
                continue;
            }
            for _ in 0..2 {
                // SAFETY: host functions only.
                unsafe { exec.launch(&streams[i]) }.unwrap();
            }
            streams[i].synchronize().unwrap();
            let want = 2 * (1 + (i + round) % 3);
            assert_eq!(tokens[i].load(Ordering::SeqCst) - before, want);
        }
    }
    for t in &tokens {
        assert_eq!(Arc::strong_count(t), 1, "every host function released");
    }
    // A panic inside the capture's closure: the capture ends, its host
    // function released.
    let tok = Arc::new(());
    let t = Arc::clone(&tok);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        streams[0].capture(|s| {
            s.launch_host_fn_repeat(Arc::new(move || {
                let _ = &t;
            }))?;
            panic!("in the capture");
        })
    }));
    assert!(r.is_err());
    assert!(!streams[0].is_capturing().unwrap());
    assert_eq!(Arc::strong_count(&tok), 1);
    drop(streams);
    drop(h);
    finish();
}

/// Run a defect's scenario in a child process (a failing one leaves the
/// stand-in and the process's lists as they are): it passes when the child does.
fn in_child(name: &str) {
    let out = run_child(name, &[]);
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn defect_repeat_host_fn_captured_after_its_check_runs_once() {
    in_child("review2_defect_repeat_host_fn_captured_after_its_check_runs_once");
}

fn defect_capture_id_unknown_at_both_ends_leaks_its_host_function() {
    in_child("review2_defect_capture_id_unknown_at_both_ends_leaks_its_host_function");
}

fn defect_stuck_capture_ended_on_another_thread_leaves_this_thread_capturing() {
    in_child("review2_defect_stuck_capture_ended_on_another_thread_leaves_this_thread_capturing");
}

fn defect_unseen_wait_queried_after_a_reset() {
    in_child("review2_defect_unseen_wait_queried_after_a_reset");
}

fn defect_unseen_wait_triage_invalidates_a_capture() {
    in_child("review2_defect_unseen_wait_triage_invalidates_a_capture");
}

fn defect_two_ends_of_one_capture_free_its_host_function() {
    in_child("review2_defect_two_ends_of_one_capture_free_its_host_function");
}

fn defect_capture_begun_during_a_failed_end_keeps_the_old_one_counted() {
    in_child("review2_defect_capture_begun_during_a_failed_end_keeps_the_old_one_counted");
}

fn defect_closure_error_hides_a_stuck_capture() {
    in_child("review2_defect_closure_error_hides_a_stuck_capture");
}

fn held_many_pending_copies_from_threads() {
    // In a child: the forgotten pending copy leaks its buffer and stream.
    in_child("review2_held_many_pending_copies_from_threads");
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "review2_defect_closure_error_hides_a_stuck_capture",
            run: child_defect_closure_error_hides_a_stuck_capture,
        },
        Child {
            name: "review2_defect_capture_begun_during_a_failed_end_keeps_the_old_one_counted",
            run: child_defect_capture_begun_during_a_failed_end_keeps_the_old_one_counted,
        },
        Child {
            name: "review2_defect_two_ends_of_one_capture_free_its_host_function",
            run: child_defect_two_ends_of_one_capture_free_its_host_function,
        },
        Child {
            name: "review2_held_many_pending_copies_from_threads",
            run: child_held_many_pending_copies_from_threads,
        },
        Child {
            name: "review2_defect_repeat_host_fn_captured_after_its_check_runs_once",
            run: child_defect_repeat_host_fn_captured_after_its_check_runs_once,
        },
        Child {
            name: "review2_defect_capture_id_unknown_at_both_ends_leaks_its_host_function",
            run: child_defect_capture_id_unknown_at_both_ends_leaks_its_host_function,
        },
        Child {
            name:
                "review2_defect_stuck_capture_ended_on_another_thread_leaves_this_thread_capturing",
            run: child_defect_stuck_capture_ended_on_another_thread_leaves_this_thread_capturing,
        },
        Child {
            name: "review2_defect_unseen_wait_queried_after_a_reset",
            run: child_defect_unseen_wait_queried_after_a_reset,
        },
        Child {
            name: "review2_defect_unseen_wait_triage_invalidates_a_capture",
            run: child_defect_unseen_wait_triage_invalidates_a_capture,
        },
    ]
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "review2::defect_closure_error_hides_a_stuck_capture",
            run: defect_closure_error_hides_a_stuck_capture,
        },
        Test {
            name: "review2::defect_capture_begun_during_a_failed_end_keeps_the_old_one_counted",
            run: defect_capture_begun_during_a_failed_end_keeps_the_old_one_counted,
        },
        Test {
            name: "review2::defect_two_ends_of_one_capture_free_its_host_function",
            run: defect_two_ends_of_one_capture_free_its_host_function,
        },
        Test {
            name: "review2::defect_repeat_host_fn_captured_after_its_check_runs_once",
            run: defect_repeat_host_fn_captured_after_its_check_runs_once,
        },
        Test {
            name: "review2::defect_capture_id_unknown_at_both_ends_leaks_its_host_function",
            run: defect_capture_id_unknown_at_both_ends_leaks_its_host_function,
        },
        Test {
            name:
                "review2::defect_stuck_capture_ended_on_another_thread_leaves_this_thread_capturing",
            run: defect_stuck_capture_ended_on_another_thread_leaves_this_thread_capturing,
        },
        Test {
            name: "review2::defect_unseen_wait_queried_after_a_reset",
            run: defect_unseen_wait_queried_after_a_reset,
        },
        Test {
            name: "review2::defect_unseen_wait_triage_invalidates_a_capture",
            run: defect_unseen_wait_triage_invalidates_a_capture,
        },
        Test {
            name: "review2::held_many_pending_copies_from_threads",
            run: held_many_pending_copies_from_threads,
        },
        Test {
            name: "review2::held_three_captures_release_their_own",
            run: held_three_captures_release_their_own,
        },
    ]
}
