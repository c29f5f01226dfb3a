//! GPU-side signals against the stand-in: stream memory operations on device
//! words and on mapped pinned memory, their typed flags and refusals.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use crate::harness::Test;

fn a_wait_is_released_by_a_write_from_another_stream() {
    let reg = setup();
    let (a, b) = (
        CudaStream::new(reg.ctx()).unwrap(),
        CudaStream::new(reg.ctx()).unwrap(),
    );
    let flags = DeviceBuffer::<u32>::zeroed(&a, 4).unwrap();
    a.synchronize().unwrap();
    let word = SignalWord::device(&flags, 2).unwrap();
    a.wait_value32(&word, 7, WaitFlags::GEQ).unwrap();
    let after = CudaEvent::new(&a).unwrap();
    after.record(&a).unwrap();
    std::thread::sleep(Duration::from_millis(10));
    assert!(!a.query().unwrap(), "the stream waits on the word");
    assert!(!after.query().unwrap());
    b.write_value32(&word, 7, WriteFlags::default()).unwrap();
    a.synchronize().unwrap();
    assert!(after.query().unwrap());
    assert_eq!(b.to_vec(&flags).unwrap(), [0, 0, 7, 0]);

    // 64-bit words and a batch: write then wait on the same stream.
    let wide = DeviceBuffer::<u64>::zeroed(&a, 1).unwrap();
    a.synchronize().unwrap();
    let w64 = SignalWord::device(&wide, 0).unwrap();
    let w32 = SignalWord::device(&flags, 0).unwrap();
    a.batch_mem_ops(&[
        MemOp::Write64(&w64, 1 << 40, WriteFlags::default()),
        MemOp::Wait64(&w64, 1 << 40, WaitFlags::EQ.with_flush()),
        MemOp::Write32(&w32, 5, WriteFlags::DEFAULT),
        MemOp::Wait32(&w32, 4, WaitFlags::AND),
    ])
    .unwrap();
    a.synchronize().unwrap();
    assert_eq!(a.to_vec(&wide).unwrap(), [1 << 40]);
    a.write_value64(&w64, 3, WriteFlags::default()).unwrap();
    a.wait_value64(&w64, 3, WaitFlags::GEQ).unwrap();
    a.wait_value32(&w32, 2, WaitFlags::NOR).unwrap();
    a.synchronize().unwrap();
    assert_eq!(a.to_vec(&wide).unwrap(), [3]);
}

fn the_host_releases_a_wait_through_mapped_memory() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let mapped = Arc::new(MappedWords::<u32>::new(reg.ctx(), 2).unwrap());
    assert_ne!(mapped.device_ptr(), 0);
    let word = SignalWord::mapped(&mapped, 1).unwrap();
    s.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
    s.write_value32(
        &SignalWord::mapped(&mapped, 0).unwrap(),
        9,
        WriteFlags::default(),
    )
    .unwrap();
    drop(word);
    std::thread::sleep(Duration::from_millis(10));
    assert!(!s.query().unwrap());
    assert_eq!(mapped.atomic(0).unwrap().load(Ordering::SeqCst), 0);
    // The operations hold the buffer until they are done.
    assert!(Arc::strong_count(&mapped) > 1);
    mapped.atomic(1).unwrap().store(1, Ordering::SeqCst);
    s.synchronize().unwrap();
    assert_eq!(mapped.atomic(0).unwrap().load(Ordering::SeqCst), 9);
    assert_eq!(Arc::strong_count(&mapped), 1);
    assert!(mapped.atomic(2).is_none());

    // A pinned buffer mapped for kernels (not a signal word: no atomics, a slice).
    let pinned = PinnedBuffer::<u32>::mapped(reg.ctx(), 4).unwrap();
    assert!(pinned.device_ptr().is_some());
    assert_eq!(&pinned[..], [0, 0, 0, 0]);
    let plain = PinnedBuffer::<u32>::zeroed(reg.ctx(), 1).unwrap();
    assert!(plain.device_ptr().is_none());
    assert!(PinnedBuffer::<u32>::mapped(reg.ctx(), 0).is_err());
    let e = SignalWord::mapped(&mapped, 5).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
}

/// No words: the refusal names the words asked for, not the pinned buffer
/// underneath, and comes before any driver call.
fn mapped_words_of_none_are_refused_by_name() {
    let reg = setup();
    let before = fake().calls("cuMemHostAlloc");
    let e = MappedWords::<u32>::new(reg.ctx(), 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: device 0: mapped words: at least one 4-byte word is needed, 0 were asked for"
    );
    let e = MappedWords::<u64>::new(reg.ctx(), 0).unwrap_err();
    assert!(e.to_string().contains("at least one 8-byte word"), "{e}");
    assert_eq!(fake().calls("cuMemHostAlloc"), before);
}

fn unsupported_operations_are_refused_with_the_attribute() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let wide = DeviceBuffer::<u64>::zeroed(&s, 1).unwrap();
    let narrow = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    s.synchronize().unwrap();
    let w64 = SignalWord::device(&wide, 0).unwrap();
    let w32 = SignalWord::device(&narrow, 0).unwrap();
    fake().set_attribute(0, 122, 0);
    fake().set_attribute(0, 123, 0);
    let e = s.write_value64(&w64, 1, WriteFlags::default()).unwrap_err();
    assert!(
        e.to_string().ends_with(
            "write_value64: not supported by device 0 (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0)"
        ),
        "{e}"
    );
    assert!(matches!(e.kind(), ErrorKind::Unsupported { device: 0, .. }));
    let e = s.wait_value32(&w32, 1, WaitFlags::NOR).unwrap_err();
    assert!(
        e.to_string()
            .contains("(CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR is 0)"),
        "{e}"
    );
    let e = s
        .batch_mem_ops(&[
            MemOp::Write32(&w32, 1, WriteFlags::default()),
            MemOp::Wait64(&w64, 1, WaitFlags::GEQ),
        ])
        .unwrap_err();
    assert!(e.to_string().contains("64_BIT"), "{e}");
    assert_eq!(fake().calls("cuStreamBatchMemOp_v2"), 0, "nothing queued");
    // 32-bit operations need no attribute.
    s.write_value32(&w32, 1, WriteFlags::default()).unwrap();
    s.wait_value32(&w32, 1, WaitFlags::EQ).unwrap();
    s.synchronize().unwrap();
    fake().set_attribute(0, 19, 0);
    let e = PinnedBuffer::<u32>::mapped(reg.ctx(), 1).unwrap_err();
    assert!(
        e.to_string()
            .contains("CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY"),
        "{e}"
    );
    let e = SignalWord::device(&narrow, 1).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    fake().reset();
}

fn a_driver_refusal_names_the_call_and_stream() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let narrow = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    s.synchronize().unwrap();
    let w = SignalWord::device(&narrow, 0).unwrap();
    fake().fail("cuStreamWriteValue32_v2", 1, 1, Some(1));
    let e = s.write_value32(&w, 1, WriteFlags::default()).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("device 0 stream 0x")
            && text.contains(
                "write_value32: cuStreamWriteValue32_v2 failed: CUDA_ERROR_INVALID_VALUE (1)"
            ),
        "{text}"
    );
    fake().reset();
}

/// The host function after an operation often holds the last `Arc` of the
/// mapped words: it hands it to the drop-later list, and the next synchronize
/// frees the pinned memory (a drop inside the host function would leak it).
fn mapped_words_held_last_by_a_host_function_are_freed_after_synchronize() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let before = fake().live(Live::HostMemory);
    s.write_value32(
        &SignalWord::mapped(&Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap()), 0).unwrap(),
        9,
        WriteFlags::default(),
    )
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        fake().live(Live::HostMemory),
        before,
        "the pinned words were freed"
    );
    // A batch: every mapped word is held by one host function.
    let a = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let b = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let host_fns = fake().calls("cuLaunchHostFunc");
    let (wa, wb) = (
        SignalWord::mapped(&a, 0).unwrap(),
        SignalWord::mapped(&b, 0).unwrap(),
    );
    s.batch_mem_ops(&[
        MemOp::Write32(&wa, 1, WriteFlags::default()),
        MemOp::Write32(&wb, 2, WriteFlags::default()),
    ])
    .unwrap();
    assert_eq!(fake().calls("cuLaunchHostFunc"), host_fns + 1, "one holder");
    drop(wa);
    drop(wb);
    drop(a);
    drop(b);
    s.synchronize().unwrap();
    assert_eq!(fake().live(Live::HostMemory), before);
    drop(s);
    done(reg);
}

/// Mapped words on a capturing stream are refused before anything is queued
/// (the op would be recorded into the graph, then the words could not be held).
fn mapped_words_are_refused_in_a_capture_before_anything_is_queued() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let words = Arc::new(MappedWords::<u32>::new(reg.ctx(), 2).unwrap());
    let dev = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    s.synchronize().unwrap();
    let (w0, w1) = (
        SignalWord::mapped(&words, 0).unwrap(),
        SignalWord::mapped(&words, 1).unwrap(),
    );
    let d0 = SignalWord::device(&dev, 0).unwrap();
    let (writes, batches) = (
        fake().calls("cuStreamWriteValue32_v2"),
        fake().calls("cuStreamBatchMemOp_v2"),
    );
    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let e = s.write_value32(&w0, 9, WriteFlags::default()).unwrap_err();
    assert!(
        e.to_string()
            .contains("write_value32: 1 mapped signal word(s) while the stream is being captured"),
        "{e}"
    );
    let e = s
        .batch_mem_ops(&[
            MemOp::Write32(&d0, 1, WriteFlags::default()),
            MemOp::Write32(&w0, 1, WriteFlags::default()),
            MemOp::Wait32(&w1, 1, WaitFlags::EQ),
        ])
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("batch_mem_ops: 2 mapped signal word(s)"),
        "{e}"
    );
    // Device words may be captured.
    s.write_value32(&d0, 3, WriteFlags::default()).unwrap();
    let graph = s.end_capture().unwrap();
    assert_eq!(
        fake().calls("cuStreamWriteValue32_v2"),
        writes + 1,
        "only the device word's write"
    );
    assert_eq!(
        fake().calls("cuStreamBatchMemOp_v2"),
        batches,
        "nothing of the batch"
    );
    assert_eq!(Arc::strong_count(&words), 3, "nothing holds the words");
    drop(graph);
    drop(w0);
    drop(w1);
    drop(d0);
    drop(words);
    drop(dev);
    drop(s);
    done(reg);
}

/// A queued wait on mapped words is counted on its context until the stream
/// passes it; waits on device words queue nothing more than the operation.
fn pending_waits_are_counted_until_passed() {
    let reg = setup();
    let (a, b) = (
        CudaStream::new(reg.ctx()).unwrap(),
        CudaStream::new(reg.ctx()).unwrap(),
    );
    let device_flags = DeviceBuffer::<u32>::zeroed(&a, 1).unwrap();
    a.synchronize().unwrap();
    let host_fns = fake().calls("cuLaunchHostFunc");
    let dw = SignalWord::device(&device_flags, 0).unwrap();
    b.write_value32(&dw, 1, WriteFlags::default()).unwrap();
    a.wait_value32(&dw, 1, WaitFlags::EQ).unwrap();
    assert_eq!(reg.ctx().pending_waits(), 0, "device words are not counted");
    assert_eq!(
        fake().calls("cuLaunchHostFunc"),
        host_fns,
        "no host function follows device-word operations"
    );
    let flags = Arc::new(MappedWords::<u32>::new(reg.ctx(), 2).unwrap());
    let (w0, w1) = (
        SignalWord::mapped(&flags, 0).unwrap(),
        SignalWord::mapped(&flags, 1).unwrap(),
    );
    assert_eq!(reg.ctx().pending_waits(), 0);
    a.wait_value32(&w0, 1, WaitFlags::EQ).unwrap();
    a.batch_mem_ops(&[
        MemOp::Wait32(&w1, 1, WaitFlags::EQ),
        MemOp::Write32(&w1, 5, WriteFlags::default()),
    ])
    .unwrap();
    assert_eq!(reg.ctx().pending_waits(), 2);
    // A refused wait is not counted.
    fake().fail("cuStreamWaitValue32_v2", 999, 1, Some(1));
    assert!(a.wait_value32(&w0, 1, WaitFlags::EQ).is_err());
    assert_eq!(reg.ctx().pending_waits(), 2);
    b.write_value32(&w0, 1, WriteFlags::default()).unwrap();
    b.write_value32(&w1, 1, WriteFlags::default()).unwrap();
    a.synchronize().unwrap();
    assert_eq!(reg.ctx().pending_waits(), 0);
    // `b`'s holders may run after `a`'s drain: its own synchronize drains them
    // (what the last holds of mapped words leave is freed at a drain).
    b.synchronize().unwrap();
    drop(w0);
    drop(w1);
    drop(dw);
    drop((flags, device_flags));
    drop(a);
    drop(b);
    done(reg);
}

/// Stream memory operations and host functions are queued without binding: the
/// driver takes the context from the stream (as driver 580 does), so they work,
/// on the right device, with another context current or none, and leave the
/// thread's current context as it was.
fn stream_operations_take_the_context_from_the_stream() {
    let reg = setup();
    let other = host(1).unwrap();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let flags = DeviceBuffer::<u32>::zeroed(&s, 2).unwrap();
    s.synchronize().unwrap();
    let word = SignalWord::device(&flags, 1).unwrap();
    let d1 = other.ctx().raw().cast::<std::ffi::c_void>();
    let ran = Arc::new(std::sync::atomic::AtomicU32::new(0));
    for current in [d1, std::ptr::null_mut()] {
        // SAFETY: device 1's live context, or none.
        let st = unsafe { (sys::driver().unwrap().cuCtxSetCurrent().unwrap())(current.cast()) };
        assert!(st.is_success());
        let sets = fake().calls("cuCtxSetCurrent");
        s.write_value32(&word, 9, WriteFlags::default()).unwrap();
        s.wait_value32(&word, 9, WaitFlags::EQ).unwrap();
        let r = Arc::clone(&ran);
        s.launch_host_fn(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        if current.is_null() {
            // Nothing was bound by those calls.
            assert_eq!(fake().current_context(), current);
        } else {
            assert_eq!(
                fake().current_context(),
                d1,
                "device 1's context stays current"
            );
        }
        assert_eq!(
            fake().calls("cuCtxSetCurrent"),
            sets,
            "no bind for stream operations"
        );
        s.synchronize().unwrap();
        assert_eq!(s.to_vec(&flags).unwrap(), [0, 9]);
        s.write_value32(&word, 0, WriteFlags::default()).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    // A driver that wants a current context answers INVALID_CONTEXT without
    // queueing: the call is bound and made again.
    let before = fake().calls("cuStreamWriteValue32_v2");
    fake().fail("cuStreamWriteValue32_v2", 201, 1, Some(1));
    s.write_value32(&word, 4, WriteFlags::default()).unwrap();
    assert_eq!(
        fake().calls("cuStreamWriteValue32_v2"),
        before + 2,
        "made again"
    );
    assert_eq!(
        fake().current_context(),
        reg.ctx().raw().cast(),
        "bound for the retry"
    );
    assert_eq!(s.to_vec(&flags).unwrap(), [0, 4]);

    // A driver that wants the stream's context current (refusing 201 with none,
    // 400 with another): each call is refused once, bound and made again, and
    // each host function runs exactly once.
    fake().set_stream_ctx_strict(true);
    let before = ran.load(Ordering::SeqCst);
    for current in [d1, std::ptr::null_mut()] {
        // SAFETY: device 1's live context, or none.
        let st = unsafe { (sys::driver().unwrap().cuCtxSetCurrent().unwrap())(current.cast()) };
        assert!(st.is_success());
        let writes = fake().calls("cuStreamWriteValue32_v2");
        s.write_value32(&word, 6, WriteFlags::default()).unwrap();
        assert_eq!(
            fake().calls("cuStreamWriteValue32_v2"),
            writes + 2,
            "refused, then bound"
        );
        assert_eq!(
            fake().current_context(),
            reg.ctx().raw().cast(),
            "bound for the retry"
        );
        // SAFETY: as above.
        let st = unsafe { (sys::driver().unwrap().cuCtxSetCurrent().unwrap())(current.cast()) };
        assert!(st.is_success());
        let hosts = fake().calls("cuLaunchHostFunc");
        let r = Arc::clone(&ran);
        s.launch_host_fn(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        assert_eq!(
            fake().calls("cuLaunchHostFunc"),
            hosts + 2,
            "refused, then bound"
        );
        // A closure too large for a slot travels boxed: the same retry.
        let big = [7u64; 16];
        let r = Arc::clone(&ran);
        // SAFETY: as above.
        let st = unsafe { (sys::driver().unwrap().cuCtxSetCurrent().unwrap())(current.cast()) };
        assert!(st.is_success());
        s.launch_host_fn(move || {
            r.fetch_add(big.len() as u32, Ordering::SeqCst);
        })
        .unwrap();
        s.synchronize().unwrap();
        assert_eq!(s.to_vec(&flags).unwrap(), [0, 6]);
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        before + 2 * (1 + 16),
        "each ran once"
    );
    fake().set_stream_ctx_strict(false);
    drop((flags, s, other));
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "signals::mapped_words_of_none_are_refused_by_name",
            run: mapped_words_of_none_are_refused_by_name,
        },
        Test {
            name: "signals::stream_operations_take_the_context_from_the_stream",
            run: stream_operations_take_the_context_from_the_stream,
        },
        Test {
            name: "signals::a_wait_is_released_by_a_write_from_another_stream",
            run: a_wait_is_released_by_a_write_from_another_stream,
        },
        Test {
            name: "signals::the_host_releases_a_wait_through_mapped_memory",
            run: the_host_releases_a_wait_through_mapped_memory,
        },
        Test {
            name: "signals::unsupported_operations_are_refused_with_the_attribute",
            run: unsupported_operations_are_refused_with_the_attribute,
        },
        Test {
            name: "signals::a_driver_refusal_names_the_call_and_stream",
            run: a_driver_refusal_names_the_call_and_stream,
        },
        Test {
            name: "signals::mapped_words_held_last_by_a_host_function_are_freed_after_synchronize",
            run: mapped_words_held_last_by_a_host_function_are_freed_after_synchronize,
        },
        Test {
            name: "signals::mapped_words_are_refused_in_a_capture_before_anything_is_queued",
            run: mapped_words_are_refused_in_a_capture_before_anything_is_queued,
        },
        Test {
            name: "signals::pending_waits_are_counted_until_passed",
            run: pending_waits_are_counted_until_passed,
        },
    ]
}
