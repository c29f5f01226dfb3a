//! Memory: copies and their borrow rules, slices, fills, stream-ordered allocation
//! and pools, managed memory, typed symbols, device information.

use crate::common::*;
use crate::harness::Test;

/// Before, a failed wait after a queued device-to-host copy returned at once: the
/// borrow of the host memory ended while the copy engine could still write it.
/// Now the wait is on an event recorded right after the copy, and a failed wait
/// polls it: neither a failed query (item 7 of the soundness audit) nor a
/// transient error is taken for "done".
fn a_failed_wait_does_not_end_the_borrow_early() {
    let reg = setup();
    let s = reg.stream();
    let values: Vec<u32> = (0..256).map(|i| i * 7 + 1).collect();
    let dev = DeviceBuffer::from_host(s, &values).unwrap();
    let mut out = vec![0u32; 256];
    fake().fail("cuEventSynchronize", 999, 1, Some(1));
    // Three transient failures (not "idle", not "done"), then done.
    fake().fail("cuEventQuery", 999, 1, Some(3));
    let e = s.copy_d2h(&dev, &mut out).unwrap_err();
    assert_eq!(e.status(), Some(CUresult(999)));
    assert!(e.to_string().contains("cuEventSynchronize"), "{e}");
    assert_eq!(
        fake().pending(raw(s)),
        0,
        "the copy engine must be done with the host memory when the call returns"
    );
    assert_eq!(out, values, "the copy landed before the borrow ended");
    assert_eq!(fake().calls("cuEventQuery"), 4, "polled until done");
    // The same for to_vec, and the async copy's drop.
    fake().fail("cuEventSynchronize", 700, 1, Some(1));
    assert!(s.to_vec(&dev).is_err());
    assert_eq!(fake().pending(raw(s)), 0);
    assert_eq!(s.to_vec(&dev).unwrap(), values);
    drop(dev);
    done(reg);
}

fn copies_and_length_checks() {
    let reg = setup();
    let s = reg.stream();
    let h: Vec<u64> = (0..1024).map(|i| i * 3).collect();
    let mut dev = DeviceBuffer::<u64>::alloc(s, 1024).unwrap();
    s.copy_h2d(&h, &mut dev).unwrap();
    assert_eq!(s.to_vec(&dev).unwrap(), h);
    let e = s.copy_h2d(&[1, 2, 3], &mut dev).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "invalid argument: copy from a host slice of 3 elements with device buffer {:#x} (1024 x u64): lengths differ",
            dev.device_ptr()
        )
    );
    // Pinned, asynchronous: the pending copy owns the buffer until it is done.
    let mut pinned = PinnedBuffer::<u64>::zeroed(s, 1024).unwrap();
    pinned.copy_from_slice(&h);
    let mut back = DeviceBuffer::<u64>::zeroed(s, 1024).unwrap();
    let pending = s.copy_h2d_pinned(pinned, &mut back).unwrap();
    let pinned = pending.wait().unwrap();
    let staging = PinnedBuffer::<u64>::zeroed(s, 1024).unwrap();
    let pending = s.copy_d2h_pinned(&back, staging).unwrap();
    assert_eq!(fake().pending(raw(s)), 1, "the copy is in flight");
    let staging = pending.wait().unwrap();
    assert_eq!(&staging[..], &h[..]);
    // Dropping a pending copy waits for it.
    let pending = s.copy_d2h_pinned(&back, staging).unwrap();
    drop(pending);
    assert_eq!(fake().pending(raw(s)), 0);
    drop((pinned, dev, back));
    done(reg);
}

/// Before, an over-aligned type in pinned memory was undefined behaviour.
fn over_aligned_types_are_refused_not_misaligned() {
    #[derive(Clone, Copy)]
    #[repr(C, align(8192))]
    struct Page([u8; 8192]);
    // SAFETY: a byte array with no padding (size 8192, alignment 8192).
    unsafe impl DeviceRepr for Page {}
    // SAFETY: every bit pattern of a byte array is valid.
    unsafe impl DevicePod for Page {}
    let reg = setup();
    let e = PinnedBuffer::<Page>::zeroed(reg.stream(), 2).unwrap_err();
    assert!(
        e.to_string().contains("is not aligned to 8192 bytes"),
        "{e}"
    );
    assert_eq!(
        fake().live(Live::HostMemory),
        0,
        "the allocation was given back"
    );
    done(reg);
}

fn slices_fills_and_device_copies() {
    let reg = setup();
    let s = reg.stream();
    let mut buf = DeviceBuffer::<u8>::zeroed(s, 37).unwrap();
    // 8-bit fill at an odd offset and length.
    s.memset_u8(&mut buf.slice_mut(3..20).unwrap(), 0xab)
        .unwrap();
    let got = s.to_vec(&buf).unwrap();
    assert!(got[..3].iter().all(|&b| b == 0) && got[3..20].iter().all(|&b| b == 0xab));
    assert!(got[20..].iter().all(|&b| b == 0));
    // A 16-bit fill needs whole aligned words: refused before the driver.
    let calls = fake().calls("cuMemsetD16Async");
    let e = s
        .memset_u16(&mut buf.slice_mut(3..9).unwrap(), 7)
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("invalid argument: memset of 16-bit values: device slice")
            && e.to_string()
                .contains("is not made of whole, aligned 2-byte words (6 bytes at "),
        "{e}"
    );
    assert_eq!(fake().calls("cuMemsetD16Async"), calls);
    s.memset_u16(&mut buf.slice_mut(4..10).unwrap(), 0x1234)
        .unwrap();
    let mut words = DeviceBuffer::<u32>::zeroed(s, 10).unwrap();
    s.memset_u32(&mut words.slice_mut(1..4).unwrap(), 0xdead_beef)
        .unwrap();
    assert_eq!(
        s.to_vec(&words).unwrap(),
        [0, 0xdead_beef, 0xdead_beef, 0xdead_beef, 0, 0, 0, 0, 0, 0]
    );
    // Device to device between slices of two buffers.
    let src = DeviceBuffer::from_host(s, &(0..10u32).collect::<Vec<_>>()).unwrap();
    s.copy_d2d(
        &src.slice(2..5).unwrap(),
        &mut words.slice_mut(7..).unwrap(),
    )
    .unwrap();
    assert_eq!(s.to_vec(&words.slice(7..).unwrap()).unwrap(), [2, 3, 4]);
    // Out of bounds and overflow are errors, not panics.
    let e = buf.slice(30..40).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: slice 30..40 of 37 elements is out of bounds"
    );
    let e = DeviceBuffer::<u64>::alloc(s, usize::MAX / 2).unwrap_err();
    assert!(e.to_string().contains("overflows usize"), "{e}");
    // Slices as kernel arguments: the address of the first element.
    let f = reg.function("kernels", "fill_index").unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    let mut view = words.slice_mut(4..).unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg, (&mut view, 6u32, 0u32)) }.unwrap();
    assert_eq!(fake().last_param(0), words.device_ptr() + 16);
    // An allocation larger than the device is the driver's clear error.
    let e = DeviceBuffer::<u8>::alloc(s, 1 << 40).unwrap_err();
    assert_eq!(
        e.to_string(),
        "device 0: allocating 1099511627776 bytes: cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
    );
    drop((buf, words, src, f));
    done(reg);
}

fn stream_ordered_allocation_and_pools() {
    let reg = setup();
    let s = reg.stream();
    let buf = s.alloc::<f32>(1000).unwrap();
    assert!(buf.stream().unwrap().same_stream(s));
    drop(buf);
    assert_eq!(fake().calls("cuMemFreeAsync"), 1);
    assert_eq!(fake().last_free_stream(), raw(s), "freed on its own stream");
    // Allocation and free in stream order bind nothing: the stream names the
    // context, whatever context the thread has current (or none).
    let owned = s.clone();
    let sets = fake().calls("cuCtxSetCurrent");
    std::thread::spawn(move || {
        let b = owned.alloc::<u64>(10).unwrap();
        drop(b);
    })
    .join()
    .unwrap();
    assert_eq!(
        fake().calls("cuCtxSetCurrent"),
        sets,
        "no context was bound"
    );
    assert_eq!(fake().last_free_stream(), raw(s));
    let z = s.alloc_zeroed::<u32>(64).unwrap();
    assert_eq!(s.to_vec(&z).unwrap(), vec![0; 64]);
    // Used by a safe operation on another stream: that use is ordered after the
    // allocation (an event of the own stream, waited for by the other), and the
    // free after that use (an event of the other stream, waited for by the own
    // stream), without blocking the host.
    let other = CudaStream::new(reg.ctx()).unwrap();
    let mut z = z;
    let (records, waits) = (
        fake().calls("cuEventRecord"),
        fake().calls("cuStreamWaitEvent"),
    );
    other.memset_u32(&mut z, 5).unwrap();
    assert_eq!(
        fake().calls("cuEventRecord"),
        records + 1,
        "use ordered after the allocation"
    );
    assert_eq!(fake().calls("cuStreamWaitEvent"), waits + 1);
    other.memset_u32(&mut z, 6).unwrap();
    assert_eq!(
        fake().calls("cuEventRecord"),
        records + 1,
        "once per stream"
    );
    let syncs = fake().calls("cuCtxSynchronize");
    drop(z);
    assert_eq!(
        fake().calls("cuCtxSynchronize"),
        syncs,
        "the free does not block"
    );
    assert_eq!(
        fake().calls("cuEventRecord"),
        records + 2,
        "free ordered after the use"
    );
    assert_eq!(fake().calls("cuStreamWaitEvent"), waits + 2);
    assert_eq!(fake().last_free_stream(), raw(s), "freed on its own stream");
    // Pools: the default one and one of our own.
    let default = MemPool::device_default(s).unwrap();
    default.set_release_threshold(u64::MAX).unwrap();
    let pool = MemPool::new(s).unwrap();
    pool.set_release_threshold(1 << 20).unwrap();
    let p = s.alloc_from::<u64>(&pool, 512).unwrap();
    assert_eq!(fake().calls("cuMemAllocFromPoolAsync"), 1);
    pool.trim_to(0).unwrap();
    assert_eq!(pool.used_bytes().unwrap(), 0);
    drop((p, pool, default, other));
    assert_eq!(fake().live(Live::Pools), 0);
    // A device without memory pools: a clear error before the driver.
    fake().set_attribute(1, 115, 0);
    let h1 = host(1).unwrap();
    let e = h1.stream().alloc::<u8>(16).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: device 1 does not support stream-ordered allocation \
         (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 0)"
    );
    drop(h1);
    done(reg);
}

fn managed_memory_and_prefetch() {
    let reg = setup();
    let s = reg.stream();
    let mut m = ManagedBuffer::<f32>::zeroed(s, 100).unwrap();
    assert!(m.host_slice().unwrap().iter().all(|&x| x == 0.0));
    m.host_slice().unwrap().fill(1.5);
    s.prefetch(&m, PrefetchTarget::Device).unwrap();
    assert_eq!(fake().last_prefetch_device(), 0);
    let f = reg.function("kernels", "add_scalar").unwrap();
    let cfg = LaunchConfig::for_num_elems(100, 128).unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg, (&m, 100u32, 1.0f32)) }.unwrap();
    assert_eq!(fake().last_param(0), m.device_ptr());
    s.prefetch(&m, PrefetchTarget::Host).unwrap();
    assert_eq!(fake().last_prefetch_device(), -1);
    let syncs = fake().calls("cuCtxSynchronize");
    assert_eq!(m.host_slice().unwrap()[99], 1.5);
    assert_eq!(
        fake().calls("cuCtxSynchronize"),
        syncs + 1,
        "host access waits first"
    );
    drop((m, f));
    fake().set_attribute(0, 83, 0);
    release(0);
    drop(reg);
    let h = host(0).unwrap();
    let e = ManagedBuffer::<u8>::zeroed(&h, 4).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: device 0 does not support managed memory (CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 0)"
    );
    drop(h);
    fake().reset();
    done(setup());
}

fn typed_symbols_read_and_write() {
    let reg = setup();
    let s = reg.stream();
    let counters = reg.symbol_array::<u32>("kernels", COUNTERS, 16).unwrap();
    assert_eq!(counters.name(), format!("kernels::{COUNTERS}"));
    let values: Vec<u32> = (0..16).map(|i| i * 3 + 1).collect();
    counters.write(s, &values).unwrap();
    assert_eq!(counters.read(s).unwrap(), values);
    // The seed's calibration table, an array in a C++ namespace.
    let scale = reg.symbol_array::<f32>("kernels", SCALE, 64).unwrap();
    scale.write(s, &[0.25; 64]).unwrap();
    assert_eq!(scale.read(s).unwrap(), vec![0.25; 64]);
    // A scalar.
    let seed = reg.symbol::<u64>("kernels", SEED).unwrap();
    seed.set(s, 0xfeed).unwrap();
    assert_eq!(seed.get(s).unwrap(), 0xfeed);
    // Async, through a pinned buffer the pending copy owns.
    let mut pinned = PinnedBuffer::<u32>::zeroed(s, 16).unwrap();
    pinned.fill(9);
    let pending = s
        .copy_h2d_pinned(
            pinned,
            &mut reg.symbol_array::<u32>("kernels", COUNTERS, 16).unwrap(),
        )
        .unwrap();
    drop(pending.wait().unwrap());
    assert_eq!(counters.read(s).unwrap(), vec![9; 16]);
    // Size mismatches name the symbol and both sizes.
    let e = reg.symbol_array::<f32>("kernels", SCALE, 32).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("kernels::{SCALE}: the symbol is 256 bytes, 32 x f32 is 128")
    );
    let e = counters.get(s).unwrap_err();
    assert!(
        e.to_string().contains("get() of a symbol of 16 elements"),
        "{e}"
    );
    // A symbol keeps its module loaded.
    drop(reg);
    assert_eq!(fake().live(Live::Modules), 1);
    assert_eq!(
        seed.get(&host(0).unwrap().stream().clone()).unwrap(),
        0xfeed
    );
    drop((counters, scale, seed));
    release(0);
    assert_eq!(fake().live(Live::Modules), 0);
}

fn device_information_without_a_registry() {
    fake().reset();
    assert_eq!(device_count().unwrap(), 2);
    let d = Device::get(1).unwrap();
    assert_eq!(d.name(), "fakecuda stand-in device 1");
    assert_eq!(d.uuid().unwrap()[0], 0x100u32 as u8);
    assert_eq!(d.total_memory().unwrap(), 80 << 30);
    assert_eq!(d.compute_capability().unwrap(), (9, 0));
    assert_eq!(
        d.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap(),
        132
    );
    let e = d.attribute(sys::CUdevice_attribute(9999)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "device 1 attribute 9999: cuDeviceGetAttribute failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
    );
    let (free0, total) = d.memory_info().unwrap();
    assert_eq!(total, 80 << 30);
    let buf = DeviceBuffer::<u8>::alloc(&context(1).unwrap(), 1 << 20).unwrap();
    assert_eq!(d.memory_info().unwrap().0, free0 - (1 << 20));
    drop(buf);
    assert_eq!(Device::all().unwrap().len(), 2);
    assert!(Device::get(2).is_err());
    assert_eq!(fake().primary_refs(), 0, "nothing kept retained");
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "memory::a_failed_wait_does_not_end_the_borrow_early",
            run: a_failed_wait_does_not_end_the_borrow_early,
        },
        Test {
            name: "memory::copies_and_length_checks",
            run: copies_and_length_checks,
        },
        Test {
            name: "memory::over_aligned_types_are_refused_not_misaligned",
            run: over_aligned_types_are_refused_not_misaligned,
        },
        Test {
            name: "memory::slices_fills_and_device_copies",
            run: slices_fills_and_device_copies,
        },
        Test {
            name: "memory::stream_ordered_allocation_and_pools",
            run: stream_ordered_allocation_and_pools,
        },
        Test {
            name: "memory::managed_memory_and_prefetch",
            run: managed_memory_and_prefetch,
        },
        Test {
            name: "memory::typed_symbols_read_and_write",
            run: typed_symbols_read_and_write,
        },
        Test {
            name: "memory::device_information_without_a_registry",
            run: device_information_without_a_registry,
        },
    ]
}
