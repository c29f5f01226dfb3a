//! Batched copies (issue 34, item 4): `copy_batch` over device and host ends in
//! any mix of directions, checked before the driver, waited for when host
//! memory is lent, and single copies on a driver without the batch call.

use crate::common::*;
use crate::harness::{run_child, Child, Test};

/// Blocks of a paged cache: host blocks to device blocks and back, and a
/// device-to-device pair, in one call, exact.
fn a_mixed_batch_moves_every_block_in_one_call() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream();
    let (blocks, block) = (64usize, 256usize);
    let host_in: Vec<u32> = (0..(blocks * block) as u32).map(|i| i * 3 + 1).collect();
    let mut cache = DeviceBuffer::<u32>::zeroed(s, blocks * block).unwrap();
    let before = fake().calls("cuMemcpyBatchAsync_v2");
    {
        let mut blocks_of: Vec<DeviceSliceMut<'_, u32>> = cache.chunks_mut(block).collect();
        let copies: Vec<BatchCopy<'_>> = host_in
            .chunks(block)
            .zip(blocks_of.iter_mut())
            .map(|(from, to)| BatchCopy::h2d(from, to))
            .collect();
        assert_eq!(copies.len(), blocks);
        assert_eq!(copies[0].byte_len(), block * 4);
        s.copy_batch(&copies).unwrap();
    }
    assert_eq!(
        fake().calls("cuMemcpyBatchAsync_v2") - before,
        1,
        "one call"
    );
    assert_eq!(
        fake().pending(raw(s)),
        0,
        "waited for: host memory was lent"
    );
    // Back out in reverse block order, plus one device-to-device pair.
    let mut host_out = vec![0u32; blocks * block];
    let mut spare = DeviceBuffer::<u32>::zeroed(s, block).unwrap();
    {
        let first = cache.slice(..block).unwrap();
        let views: Vec<DeviceSlice<'_, u32>> = cache.chunks(block).collect();
        let mut copies: Vec<BatchCopy<'_>> = views
            .iter()
            .rev()
            .zip(host_out.chunks_mut(block))
            .map(|(from, to)| BatchCopy::d2h(from, to))
            .collect();
        copies.push(BatchCopy::d2d(&first, &mut spare));
        s.copy_batch(&copies).unwrap();
    }
    assert_eq!(
        fake().pending(raw(s)),
        0,
        "the device-to-host writes landed"
    );
    for (i, chunk) in host_out.chunks(block).enumerate() {
        let src = blocks - 1 - i;
        assert_eq!(chunk, &host_in[src * block..(src + 1) * block], "block {i}");
    }
    assert_eq!(s.to_vec(&spare).unwrap(), &host_in[..block]);
    // An empty batch, and pairs of zero bytes, call nothing.
    let calls = fake().calls("cuMemcpyBatchAsync_v2");
    s.copy_batch(&[]).unwrap();
    let empty: [u32; 0] = [];
    let mut none = DeviceBuffer::<u32>::zeroed(s, 0).unwrap();
    s.copy_batch(&[BatchCopy::h2d(&empty, &mut none)]).unwrap();
    assert_eq!(fake().calls("cuMemcpyBatchAsync_v2"), calls);
    drop((cache, spare, none));
}

fn a_bad_pair_is_refused_before_the_driver() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream();
    let src = vec![1u32; 8];
    let mut a = DeviceBuffer::<u32>::zeroed(s, 8).unwrap();
    let mut b = DeviceBuffer::<u32>::zeroed(s, 7).unwrap();
    let before = fake().calls("cuMemcpyBatchAsync_v2");
    let e = s
        .copy_batch(&[BatchCopy::h2d(&src, &mut a), BatchCopy::h2d(&src, &mut b)])
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("pair 1 copies 8 elements of u32 into 7"),
        "{e}"
    );
    assert_eq!(
        fake().calls("cuMemcpyBatchAsync_v2"),
        before,
        "nothing queued"
    );
    assert_eq!(s.to_vec(&a).unwrap(), [0; 8], "not even the good pair");

    // A device end of another device.
    let h1 = host(1).unwrap();
    let mut other = DeviceBuffer::<u32>::zeroed(h1.stream(), 8).unwrap();
    let e = s.copy_batch(&[BatchCopy::d2d(&a, &mut other)]).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::WrongDevice { .. }), "{e}");
    assert!(e.to_string().contains("the destination of pair 0"), "{e}");
    assert_eq!(fake().calls("cuMemcpyBatchAsync_v2"), before);

    // A host end while the stream is captured.
    let c = CudaStream::new(&h).unwrap();
    c.begin_capture(CaptureMode::Relaxed).unwrap();
    let e = c.copy_batch(&[BatchCopy::h2d(&src, &mut a)]).unwrap_err();
    assert!(
        e.to_string().contains("a batch of copies with a host end"),
        "{e}"
    );
    let graph = c.end_capture().unwrap();
    assert_eq!(graph.nodes().unwrap().len(), 0);
    assert_eq!(fake().calls("cuMemcpyBatchAsync_v2"), before);
    drop((a, b, other, h1));
}

/// The batch call fails: the error names it, and the stream was waited for
/// before the host memory's borrow ended.
fn a_failed_batch_is_named_and_waited_for() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream();
    let dev = DeviceBuffer::from_host(s, &[5u32; 16]).unwrap();
    let mut out = vec![0u32; 16];
    fake().fail("cuMemcpyBatchAsync_v2", 1, 1, Some(1));
    let e = s.copy_batch(&[BatchCopy::d2h(&dev, &mut out)]).unwrap_err();
    assert_eq!(e.status(), Some(CUresult(1)), "{e}");
    let text = e.to_string();
    assert!(text.contains("cuMemcpyBatchAsync"), "{e}");
    assert!(text.contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
    assert_eq!(fake().pending(raw(s)), 0);
    // The stream is usable afterwards.
    s.copy_batch(&[BatchCopy::d2h(&dev, &mut out)]).unwrap();
    assert_eq!(out, [5; 16]);
}

/// A driver without `cuMemcpyBatchAsync_v2` (the old stand-in): the same
/// pairs as single copies, the same result.
fn without_the_batch_call_single_copies_do_the_same() {
    let old = metrale_fakecuda::old_library_path().to_str().unwrap();
    let out = run_child("batch_on_old_driver", &[("METRALE_LIBCUDA_PATH", old)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "single copies: h2d 4, d2h 4, d2d 1"
    );
}

fn child_batch_on_old_driver() {
    let h = host(0).unwrap();
    let s = h.stream();
    let input: Vec<u16> = (0..64).collect();
    let mut dev = DeviceBuffer::<u16>::zeroed(s, 64).unwrap();
    {
        let mut views: Vec<DeviceSliceMut<'_, u16>> = dev.chunks_mut(16).collect();
        let copies: Vec<BatchCopy<'_>> = input
            .chunks(16)
            .zip(views.iter_mut())
            .map(|(f, t)| BatchCopy::h2d(f, t))
            .collect();
        s.copy_batch(&copies).unwrap();
    }
    let mut back = vec![0u16; 64];
    let mut copy = DeviceBuffer::<u16>::zeroed(s, 64).unwrap();
    {
        let views: Vec<DeviceSlice<'_, u16>> = dev.chunks(16).collect();
        let mut copies: Vec<BatchCopy<'_>> = views
            .iter()
            .zip(back.chunks_mut(16))
            .map(|(f, t)| BatchCopy::d2h(f, t))
            .collect();
        copies.push(BatchCopy::d2d(&dev, &mut copy));
        s.copy_batch(&copies).unwrap();
    }
    assert_eq!(back, input);
    assert_eq!(s.to_vec(&copy).unwrap(), input);
    let f = fake();
    println!(
        "single copies: h2d {}, d2h {}, d2d {}",
        f.calls("cuMemcpyHtoDAsync_v2"),
        f.calls("cuMemcpyDtoHAsync_v2") - 1, // the to_vec above
        f.calls("cuMemcpyDtoDAsync_v2")
    );
}

pub fn children() -> Vec<Child> {
    vec![Child {
        name: "batch_on_old_driver",
        run: child_batch_on_old_driver,
    }]
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "batch::a_mixed_batch_moves_every_block_in_one_call",
            run: a_mixed_batch_moves_every_block_in_one_call,
        },
        Test {
            name: "batch::a_bad_pair_is_refused_before_the_driver",
            run: a_bad_pair_is_refused_before_the_driver,
        },
        Test {
            name: "batch::a_failed_batch_is_named_and_waited_for",
            run: a_failed_batch_is_named_and_waited_for,
        },
        Test {
            name: "batch::without_the_batch_call_single_copies_do_the_same",
            run: without_the_batch_call_single_copies_do_the_same,
        },
    ]
}
