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
        MemOp::Write32(&w32, 5, WriteFlags::NO_MEMORY_BARRIER),
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

pub fn tests() -> Vec<Test> {
    vec![
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
    ]
}
