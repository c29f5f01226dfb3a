//! Issue 29 (soundness, round 4): each test fails on the code before its fix.

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

/// Item 1: a capture ending on one thread releases only the repeatable host
/// functions of its own capture, not the one another thread has just queued
/// into a capture it began meanwhile. The end is paused (the stand-in's pause
/// point) in the module unload it makes once no capture is left.
fn ending_a_capture_keeps_the_host_function_of_another_capture() {
    fake().reset();
    let h = host(0).unwrap();
    let (s1, s2, plain) = (
        CudaStream::new(&h).unwrap(),
        CudaStream::new(&h).unwrap(),
        CudaStream::new(&h).unwrap(),
    );
    let x = DeviceBuffer::<f32>::alloc(&h, 1).unwrap();
    plain.synchronize().unwrap();
    let (begun_tx, begun) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    // Thread A begins a capture, then ends it when told.
    let ender = std::thread::spawn(move || {
        s1.begin_capture(CaptureMode::Relaxed).unwrap();
        begun_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        let g = s1.end_capture().unwrap();
        drop(g);
        s1
    });
    begun.recv().unwrap();
    {
        // A kernel queued on another stream while a capture is in progress is
        // held for the captures: its module goes when the last capture ends.
        let reg = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
        let f = reg.function("kernels", "empty").unwrap();
        let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
        // SAFETY: the stand-in only records the arguments.
        unsafe { plain.launch(&f, cfg, (&x, 1u32, 1.0f32)) }.unwrap();
    }
    fake().pause_next("cuModuleUnload");
    go.send(()).unwrap();
    assert!(
        fake().wait_paused("cuModuleUnload", 10_000),
        "the capture end unloads the held module"
    );
    // Meanwhile: a capture begins on another thread's stream and queues a
    // repeatable host function.
    let token = Arc::new(());
    let t = Arc::clone(&token);
    let runs = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&runs);
    let f: HostFn = Arc::new(move || {
        let _ = &t;
        r.fetch_add(1, Ordering::SeqCst);
    });
    s2.begin_capture(CaptureMode::Relaxed).unwrap();
    s2.launch_host_fn_repeat(f).unwrap();
    fake().resume("cuModuleUnload");
    let s1 = ender.join().unwrap();
    let graph = s2.end_capture().unwrap();
    assert_eq!(
        Arc::strong_count(&token),
        2,
        "the graph holds its host function (the other capture's end freed it)"
    );
    let exec = graph.instantiate().unwrap();
    drop(graph);
    // SAFETY: the graph runs a host function only.
    unsafe { exec.launch(&s2) }.unwrap();
    s2.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    drop(exec);
    assert_eq!(Arc::strong_count(&token), 1, "released with the graph");
    drop((x, s1, s2, plain, h));
    finish();
}

/// Item 9: a failed `cuStreamEndCapture` is retried by `capture`, which ends
/// its capture and leaves the stream and this thread's capture count as they
/// were; when the driver never ends it, the error says the stream is still
/// capturing, and a later `end_capture` ends it.
fn capture_retries_a_failed_end() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    let mut x = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    s.synchronize().unwrap();
    fake().fail("cuStreamEndCapture", 999, 1, Some(1));
    let graph = s
        .capture(|s| -> metrale_runtime::Result<()> { s.launch_host_fn_repeat(Arc::new(|| {})) })
        .unwrap();
    assert!(!s.is_capturing().unwrap(), "the capture ended");
    assert_eq!(graph.nodes().unwrap().len(), 1);
    drop(graph);
    // The stream and this thread work normally: a borrowed-host copy, a free.
    s.copy_h2d(&[1, 2, 3, 4], &mut x).unwrap();
    drop(x);
    assert_eq!(
        deferred_frees(),
        0,
        "this thread is not counted as capturing"
    );

    // A driver that never ends it: the error says so, the state stays true.
    fake().fail("cuStreamEndCapture", 999, 1, None);
    let e = s
        .capture(|_| -> metrale_runtime::Result<()> { Ok(()) })
        .unwrap_err();
    assert!(e.to_string().contains("cuStreamEndCapture"), "{e}");
    assert!(e.to_string().contains("still capturing"), "{e}");
    assert!(s.is_capturing().unwrap());
    fake().fail("cuStreamEndCapture", 999, 1, Some(0));
    drop(s.end_capture().unwrap());
    assert!(!s.is_capturing().unwrap());
    let y = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    s.synchronize().unwrap();
    drop(y);
    assert_eq!(deferred_frees(), 0);

    // The end's own status query fails: it still releases what its capture
    // took (the id noted when the capture began), no more, no less.
    let token = Arc::new(());
    let t = Arc::clone(&token);
    let graph = s
        .capture(|s| -> metrale_runtime::Result<()> {
            s.launch_host_fn_repeat(Arc::new(move || {
                let _ = &t;
            }))?;
            fake().fail("cuStreamGetCaptureInfo_v3", 999, 1, Some(1));
            Ok(())
        })
        .unwrap();
    assert_eq!(Arc::strong_count(&token), 2, "the graph holds it");
    drop(graph);
    assert_eq!(
        Arc::strong_count(&token),
        1,
        "released with the graph, not kept by the capture list"
    );
    drop((s, h));
    finish();
}

/// Item 3: each pending copy waits on its own completion event. With a wait on
/// a mapped word queued after the first copy and another pending copy after
/// that, the first is done and dropping it returns (it used to wait on the
/// stream's one event, recorded again after the wait: for ever, as the word is
/// written only after the drop).
fn a_pending_copy_waits_for_its_own_copy_only() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let src = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    s.synchronize().unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&go, 0).unwrap();
    let first = s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 4).unwrap())
        .unwrap();
    s.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
    let second = s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 4).unwrap())
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        let done = first.is_done().unwrap();
        drop(first);
        tx.send(done).unwrap();
    });
    let first_done = rx.recv_timeout(std::time::Duration::from_secs(5));
    // Release the wait in any case, so a failing run ends.
    go.atomic(0).unwrap().store(1, Ordering::SeqCst);
    dropper.join().unwrap();
    assert_eq!(
        first_done,
        Ok(true),
        "the first copy is done and dropping it returns before the word is written"
    );
    assert_eq!(second.wait().unwrap().len(), 4);

    // More copies in flight than the stream's pool has slots: each has its
    // own event all the same, and every event is given back or destroyed.
    let pending: Vec<_> = (0..40)
        .map(|_| {
            s.copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 4).unwrap())
                .unwrap()
        })
        .collect();
    for p in pending {
        assert!(p.wait().is_ok());
    }
    let events = fake().live(Live::Events);
    for _ in 0..100 {
        drop(s.to_vec(&src).unwrap());
    }
    assert_eq!(fake().live(Live::Events), events, "events are recycled");
    // No heap allocation per copy once the pool's events are made.
    let mut back = [0u32; 4];
    s.copy_d2h(&src, &mut back).unwrap();
    let before = allocations();
    for _ in 0..100 {
        s.copy_d2h(&src, &mut back).unwrap();
    }
    assert_eq!(allocations(), before, "a copy allocates nothing");
    s.synchronize().unwrap();
    drop(word);
    drop((go, src, s));
    done(reg);
}

/// Item 4: a wait on a mapped word whose holding host function is refused is
/// counted down once an event after it says it passed: frees are not deferred
/// for ever and the words are freed, not leaked.
fn a_refused_keeper_leaves_no_wait_counted_for_ever() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let go = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&go, 0).unwrap();
    fake().fail("cuLaunchHostFunc", 999, 1, None);
    let e = s.wait_value32(&word, 1, WaitFlags::EQ).unwrap_err();
    assert!(e.to_string().contains("cuLaunchHostFunc"), "{e}");
    fake().fail("cuLaunchHostFunc", 999, 1, Some(0));
    assert_eq!(reg.ctx().pending_waits(), 1, "counted until it passes");
    assert!(Arc::strong_count(&go) > 1, "the words are held meanwhile");
    go.atomic(0).unwrap().store(1, Ordering::SeqCst);
    s.synchronize().unwrap();
    reg.ctx().synchronize().unwrap();
    assert_eq!(reg.ctx().pending_waits(), 0, "counted down once passed");
    // Frees are not deferred behind it.
    let frees = fake().calls("cuMemFree_v2");
    drop(DeviceBuffer::<u32>::alloc(reg.ctx(), 4).unwrap());
    assert_eq!(fake().calls("cuMemFree_v2"), frees + 1, "freed at once");
    drop(word);
    reg.ctx().synchronize().unwrap();
    assert_eq!(Arc::strong_count(&go), 1, "the words are handed back");
    drop((go, s));
    done(reg);
}

/// `n` raw 32-bit write operations on consecutive words of `words`, as
/// `cuStreamBatchMemOp_v2` takes them (word `i` gets `i + 1`).
fn raw_writes(words: &DeviceBuffer<u32>, n: usize) -> Vec<sys::CUstreamBatchMemOpParams> {
    (0..n)
        .map(|i| {
            // SAFETY: a plain C union of integers, all-zero is a valid value.
            let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
            p.writeValue.operation = sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_32;
            p.writeValue.address = words.device_ptr() + 4 * i as u64;
            p.writeValue.__bindgen_anon_1.value = i as u32 + 1;
            p.writeValue.flags = 0;
            p
        })
        .collect()
}

/// The driver's own answer to a batch of `n` writes (the context bound).
fn raw_batch(s: &CudaStream, words: &DeviceBuffer<u32>, n: usize) -> CUresult {
    let mut ops = raw_writes(words, n);
    s.context().bind().unwrap();
    let f = sys::driver().unwrap().cuStreamBatchMemOp_v2().unwrap();
    // SAFETY: `n` initialised write operations on words of a live buffer of
    // this stream's context, read during the call.
    unsafe { f(s.raw(), n as u32, ops.as_mut_ptr(), 0) }
}

/// Item 16: a batch takes at most 255 operations (the driver's limit: 255
/// succeed, 256 fail); 256 are refused before the driver, which refuses them
/// too. `NO_MEMORY_BARRIER` is refused before the driver (which refuses it in
/// every `_v2` write) for single writes and batches alike.
fn batches_take_255_operations_and_no_memory_barrier_is_refused() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let words = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
    s.synchronize().unwrap();
    let sw: Vec<SignalWord<'_, u32>> = (0..256)
        .map(|i| SignalWord::device(&words, i).unwrap())
        .collect();
    let ops: Vec<MemOp<'_, '_>> = sw
        .iter()
        .enumerate()
        .map(|(i, w)| MemOp::Write32(w, i as u32 + 1, WriteFlags::DEFAULT))
        .collect();
    assert_eq!(MAX_BATCH_MEM_OPS, 255);
    s.batch_mem_ops(&ops[..255]).unwrap();
    s.synchronize().unwrap();
    let got = s.to_vec(&words).unwrap();
    let want: Vec<u32> = (1..=255).chain([0]).collect();
    assert_eq!(got, want, "255 operations ran, in order");
    let e = s.batch_mem_ops(&ops).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
    assert!(
        e.to_string()
            .contains("a batch of 256 memory operations (at most 255"),
        "{e}"
    );
    // The driver's own limit, which the check stands for.
    assert!(raw_batch(&s, &words, 255).is_success());
    assert!(
        !raw_batch(&s, &words, 256).is_success(),
        "the driver takes at most 255"
    );
    s.synchronize().unwrap();

    // NO_MEMORY_BARRIER: refused before the driver, naming why.
    let w = SignalWord::device(&words, 0).unwrap();
    let wide = DeviceBuffer::<u64>::zeroed(&s, 1).unwrap();
    s.synchronize().unwrap();
    let w64 = SignalWord::device(&wide, 0).unwrap();
    for e in [
        s.write_value32(&w, 9, WriteFlags::NO_MEMORY_BARRIER)
            .unwrap_err(),
        s.batch_mem_ops(&[MemOp::Write32(&w, 9, WriteFlags::NO_MEMORY_BARRIER)])
            .unwrap_err(),
        s.batch_mem_ops(&[
            MemOp::Write32(&w, 9, WriteFlags::DEFAULT),
            MemOp::Write64(&w64, 9, WriteFlags::NO_MEMORY_BARRIER),
        ])
        .unwrap_err(),
    ] {
        assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
        assert!(
            e.to_string().contains("NO_MEMORY_BARRIER is refused"),
            "{e}"
        );
    }
    // The driver's own answer, which the refusal stands for.
    s.context().bind().unwrap();
    let f = sys::driver().unwrap().cuStreamWriteValue32_v2().unwrap();
    let barrier = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER.0;
    // SAFETY: a live stream and an aligned word of a live buffer of its context.
    let st = unsafe { f(s.raw(), w.device_ptr(), 9, barrier) };
    assert!(
        !st.is_success(),
        "the driver refuses NO_MEMORY_BARRIER in the v2 write"
    );
    s.synchronize().unwrap();
    assert_eq!(
        s.to_vec(&words).unwrap()[0],
        1,
        "nothing refused was written"
    );
    drop(ops);
    drop(sw);
    drop((w, w64));
    drop((words, wide, s));
    done(reg);
}

/// Item 10 (child): a saving sleep whose event destroy fails.
fn child_sleep_event_destroy_fails() {
    let reg = setup();
    let s = reg.stream();
    let mut buf = GrowableBuffer::<u32>::new(s, 4 << 20).unwrap();
    buf.grow_to(1024).unwrap();
    s.synchronize().unwrap();
    fake().fail("cuEventDestroy_v2", 999, 1, Some(1));
    let asleep = buf.sleep(s).unwrap();
    assert!(asleep.is_saved());
    drop(asleep);
}

/// Item 10: the events of a saving sleep go through the release rule: a failed
/// destroy is one line on stderr naming the call (it was discarded).
fn a_saving_sleeps_failed_event_destroy_is_reported() {
    let out = run_child("sleep_event_destroy_fails", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {stderr}");
    assert!(
        stderr.contains("event(s) of a saving sleep on device 0: cuEventDestroy_v2 failed: CUDA_ERROR_UNKNOWN (999)"),
        "{stderr}"
    );
}

pub fn children() -> Vec<Child> {
    vec![Child {
        name: "sleep_event_destroy_fails",
        run: child_sleep_event_destroy_fails,
    }]
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "round4::ending_a_capture_keeps_the_host_function_of_another_capture",
            run: ending_a_capture_keeps_the_host_function_of_another_capture,
        },
        Test {
            name: "round4::capture_retries_a_failed_end",
            run: capture_retries_a_failed_end,
        },
        Test {
            name: "round4::a_pending_copy_waits_for_its_own_copy_only",
            run: a_pending_copy_waits_for_its_own_copy_only,
        },
        Test {
            name: "round4::a_refused_keeper_leaves_no_wait_counted_for_ever",
            run: a_refused_keeper_leaves_no_wait_counted_for_ever,
        },
        Test {
            name: "round4::a_saving_sleeps_failed_event_destroy_is_reported",
            run: a_saving_sleeps_failed_event_destroy_is_reported,
        },
        Test {
            name: "round4::batches_take_255_operations_and_no_memory_barrier_is_refused",
            run: batches_take_255_operations_and_no_memory_barrier_is_refused,
        },
    ]
}
