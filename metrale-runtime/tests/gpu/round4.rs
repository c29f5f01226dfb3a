//! Issue 29 (soundness, round 4) on the GPU: the driver's limits that metrale's
//! checks stand for (stream memory operations).

use crate::common::*;
use crate::harness::Test;

fn registry_for_batches() -> std::sync::Arc<MetraleRegistry> {
    registry()
}

fn finish_batches(reg: std::sync::Arc<MetraleRegistry>) {
    drop(reg);
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
    let reg = registry_for_batches();
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
    finish_batches(reg);
}

/// Item 3: each pending copy waits on its own completion event. A pending
/// copy, then a wait on a mapped word the host writes only after the first
/// copy's drop, then another pending copy: dropping the first returns (it used
/// to wait on the stream's one event, recorded again after the wait).
fn a_pending_copy_waits_for_its_own_copy_only() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let src = DeviceBuffer::from_host(&s, &[1u32, 2, 3, 4]).unwrap();
    s.synchronize().unwrap();
    let go = std::sync::Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&go, 0).unwrap();
    let first = s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 4).unwrap())
        .unwrap();
    s.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
    let second = s
        .copy_d2h_pinned(&src, PinnedBuffer::<u32>::zeroed(&s, 4).unwrap())
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let back = first.wait().map(|b| b.to_vec());
        tx.send(back).unwrap();
    });
    let first_back = rx.recv_timeout(std::time::Duration::from_secs(10));
    assert!(
        !second.is_done().unwrap(),
        "the second copy waits on the word"
    );
    // Release the wait in any case, so a failing run ends.
    go.atomic(0)
        .unwrap()
        .store(1, std::sync::atomic::Ordering::SeqCst);
    waiter.join().unwrap();
    assert_eq!(
        first_back.map(|r| r.unwrap()),
        Ok(vec![1, 2, 3, 4]),
        "the first copy's wait returns before the word is written"
    );
    assert_eq!(second.wait().unwrap().to_vec(), [1, 2, 3, 4]);
    s.synchronize().unwrap();
    drop(word);
    drop((go, src, s, reg));
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "round4::batches_take_255_operations_and_no_memory_barrier_is_refused",
            run: batches_take_255_operations_and_no_memory_barrier_is_refused,
        },
        Test {
            name: "round4::a_pending_copy_waits_for_its_own_copy_only",
            run: a_pending_copy_waits_for_its_own_copy_only,
        },
    ]
}
