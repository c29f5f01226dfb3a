//! Memory on the GPU: fills, device copies, slices as arguments, managed memory,
//! typed symbols, stream-ordered allocation, device information.

use crate::common::*;
use crate::harness::Test;

fn memset_patterns_at_unaligned_offsets_and_odd_lengths() {
    let reg = registry();
    let s = reg.stream();
    let n = 1001;
    let mut bytes = DeviceBuffer::<u8>::zeroed(s, n).unwrap();
    s.memset_u8(&mut bytes.slice_mut(3..998).unwrap(), 0x5a)
        .unwrap();
    let got = s.to_vec(&bytes).unwrap();
    for (i, &b) in got.iter().enumerate() {
        assert_eq!(b, if (3..998).contains(&i) { 0x5a } else { 0 }, "byte {i}");
    }
    let mut halves = DeviceBuffer::<u16>::zeroed(s, n).unwrap();
    s.memset_u16(&mut halves.slice_mut(1..700).unwrap(), 0xbeef)
        .unwrap();
    let got = s.to_vec(&halves).unwrap();
    for (i, &h) in got.iter().enumerate() {
        assert_eq!(
            h,
            if (1..700).contains(&i) { 0xbeef } else { 0 },
            "half {i}"
        );
    }
    let mut words = DeviceBuffer::<f32>::zeroed(s, n).unwrap();
    s.memset_u32(&mut words.slice_mut(5..).unwrap(), 2.5f32.to_bits())
        .unwrap();
    let got = s.to_vec(&words).unwrap();
    assert!(got[..5].iter().all(|&x| x == 0.0) && got[5..].iter().all(|&x| x == 2.5));
}

fn device_to_device_between_slices_and_slices_as_arguments() {
    let reg = registry();
    let s = reg.stream();
    let f = reg.function("kernels", "fill_index").unwrap();
    let n = 4096u32;
    let mut a = DeviceBuffer::<u32>::zeroed(s, n as usize).unwrap();
    // fill_index(out, count, base) on a slice starting at element 100.
    let mut view = a.slice_mut(100..1100).unwrap();
    let cfg = LaunchConfig::for_num_elems(1000, 256).unwrap();
    // SAFETY: fill_index(unsigned*, unsigned, unsigned) writes view[0..1000].
    unsafe { s.launch(&f, cfg, (&mut view, 1000u32, 7u32)) }.unwrap();
    let got = s.to_vec(&a).unwrap();
    for (i, &v) in got.iter().enumerate() {
        let want = if (100..1100).contains(&i) {
            i as u32 - 100 + 7
        } else {
            0
        };
        assert_eq!(v, want, "element {i}");
    }
    let mut b = DeviceBuffer::<u32>::zeroed(s, n as usize).unwrap();
    s.copy_d2d(
        &a.slice(100..600).unwrap(),
        &mut b.slice_mut(3000..3500).unwrap(),
    )
    .unwrap();
    let got = s.to_vec(&b).unwrap();
    for (i, &v) in got.iter().enumerate() {
        let want = if (3000..3500).contains(&i) {
            i as u32 - 3000 + 7
        } else {
            0
        };
        assert_eq!(v, want, "element {i}");
    }
}

fn managed_buffer_written_by_a_kernel_read_on_the_host() {
    let reg = registry();
    let s = reg.stream();
    let n = 1 << 16;
    let mut m = ManagedBuffer::<f32>::zeroed(s, n).unwrap();
    for (i, x) in m.host_slice().unwrap().iter_mut().enumerate() {
        *x = i as f32;
    }
    s.prefetch(&m, PrefetchTarget::Device).unwrap();
    let f = reg.function("kernels", "add_scalar").unwrap();
    let cfg = LaunchConfig::for_num_elems(n, 256).unwrap();
    // SAFETY: add_scalar(float*, unsigned, float) over n elements.
    unsafe { s.launch(&f, cfg, (&m, n as u32, 0.5f32)) }.unwrap();
    s.prefetch(&m, PrefetchTarget::Host).unwrap();
    let got = m.host_slice().unwrap();
    for (i, &x) in got.iter().enumerate() {
        assert_eq!(x, i as f32 + 0.5, "element {i}");
    }
}

fn typed_symbols_round_trip_with_a_namespace_array() {
    let reg = registry();
    let s = reg.stream();
    let scale = reg.symbol_array::<f32>("kernels", SCALE, 64).unwrap();
    let factors: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 / 64.0).collect();
    scale.write(s, &factors).unwrap();
    assert_eq!(scale.read(s).unwrap(), factors);
    let seed = reg.symbol::<u64>("kernels", SEED).unwrap();
    seed.set(s, 41).unwrap();
    let counters = reg.symbol_array::<u32>("kernels", COUNTERS, 16).unwrap();
    counters.write(s, &[0; 16]).unwrap();
    // apply_scale(x, n): x[i] *= scale[i % 64]; counters[0] += seed.
    let f = reg.function("kernels", "apply_scale").unwrap();
    let n = 1000usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dx = DeviceBuffer::from_host(s, &x).unwrap();
    let cfg = LaunchConfig::for_num_elems(n, 128).unwrap();
    // SAFETY: apply_scale(float*, unsigned) over n elements.
    unsafe { s.launch(&f, cfg, (&mut dx, n as u32)) }.unwrap();
    let got = s.to_vec(&dx).unwrap();
    for i in 0..n {
        assert_eq!(got[i], x[i] * factors[i % 64], "element {i}");
    }
    assert_eq!(counters.read(s).unwrap()[0], 41);
    // Async write through a pinned buffer.
    let mut pinned = PinnedBuffer::<f32>::zeroed(s, 64).unwrap();
    pinned.fill(3.0);
    let pending = s
        .copy_h2d_pinned(
            pinned,
            &mut reg.symbol_array::<f32>("kernels", SCALE, 64).unwrap(),
        )
        .unwrap();
    drop(pending.wait().unwrap());
    assert_eq!(scale.read(s).unwrap(), vec![3.0; 64]);
    let e = reg.symbol::<u32>("kernels", SCALE).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("kernels::{SCALE}: the symbol is 256 bytes, 1 x u32 is 4")
    );
}

fn stream_ordered_pairs_leave_free_memory_where_it_was() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let pool = MemPool::device_default(&s).unwrap();
    pool.trim_to(0).unwrap();
    s.synchronize().unwrap();
    let (before, total) = memory_info(&s).unwrap();
    for i in 0..10_000usize {
        let buf = s.alloc::<u8>(1 << 20 | (i % 7) << 12).unwrap();
        drop(buf);
    }
    let mut z = s.alloc_zeroed::<u32>(1000).unwrap();
    s.memset_u32(&mut z.slice_mut(500..).unwrap(), 9).unwrap();
    let got = s.to_vec(&z).unwrap();
    assert!(got[..500].iter().all(|&x| x == 0) && got[500..].iter().all(|&x| x == 9));
    drop(z);
    s.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let (after, _) = memory_info(&s).unwrap();
    eprintln!("    free memory before {before}, after 10,000 pairs {after} (of {total})");
    assert!(
        after.abs_diff(before) <= 64 << 20,
        "free memory moved from {before} to {after}"
    );
    // Our own pool.
    let own = MemPool::new(&s).unwrap();
    own.set_release_threshold(64 << 20).unwrap();
    let b = s.alloc_from::<f32>(&own, 1 << 20).unwrap();
    assert!(own.used_bytes().unwrap() >= 4 << 20);
    drop(b);
    s.synchronize().unwrap();
}

fn an_allocation_larger_than_the_device_is_a_clear_error() {
    let reg = registry();
    let total = Device::get(0).unwrap().total_memory().unwrap();
    let e = DeviceBuffer::<u8>::alloc(reg.stream(), total * 2).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "device 0: allocating {} bytes: cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory",
            total * 2
        )
    );
    let e = reg.stream().alloc::<u8>(total * 2).unwrap_err();
    assert!(
        e.to_string()
            .contains("cuMemAllocAsync failed: CUDA_ERROR_OUT_OF_MEMORY (2)"),
        "{e}"
    );
    // Still usable.
    check_vec_add(&reg, "kernels", 1000, 3);
}

fn device_information() {
    assert!(device_count().unwrap() >= 1);
    let d = Device::get(0).unwrap();
    let (free, total) = d.memory_info().unwrap();
    eprintln!(
        "    {} (sm_{}{}), uuid {:02x?}, {free} of {total} bytes free",
        d.name(),
        d.compute_capability().unwrap().0,
        d.compute_capability().unwrap().1,
        d.uuid().unwrap()
    );
    assert!(d.name().contains("H200") || !d.name().is_empty());
    assert_eq!(d.total_memory().unwrap(), total);
    assert!(free <= total && free > 0);
    assert_eq!(d.compute_capability().unwrap(), (9, 0));
    assert_ne!(d.uuid().unwrap(), [0; 16]);
}

/// Issue 34: a paged-KV move of 512 blocks of 16 KiB, pinned host to device
/// blocks in reverse order and back in one `copy_batch` each, bit-exact; a
/// device-to-device batch beside it; a bad pair refused by the real driver's
/// path too.
fn copy_batch_moves_512_kv_blocks_exactly() {
    let reg = registry();
    let s = reg.stream();
    let (blocks, elems) = (512usize, 4096usize);
    let mut host = PinnedBuffer::<u32>::zeroed(s, blocks * elems).unwrap();
    for (i, v) in host.iter_mut().enumerate() {
        *v = (i as u32).wrapping_mul(2_654_435_761);
    }
    let mut cache = DeviceBuffer::<u32>::zeroed(s, blocks * elems).unwrap();
    {
        let mut views: Vec<DeviceSliceMut<'_, u32>> = cache.chunks_mut(elems).collect();
        let copies: Vec<BatchCopy<'_>> = host
            .chunks(elems)
            .zip(views.iter_mut().rev())
            .map(|(f, t)| BatchCopy::h2d(f, t))
            .collect();
        s.copy_batch(&copies).unwrap();
    }
    let mut back = PinnedBuffer::<u32>::zeroed(s, blocks * elems).unwrap();
    {
        let views: Vec<DeviceSlice<'_, u32>> = cache.chunks(elems).collect();
        let copies: Vec<BatchCopy<'_>> = views
            .iter()
            .rev()
            .zip(back.chunks_mut(elems))
            .map(|(f, t)| BatchCopy::d2h(f, t))
            .collect();
        s.copy_batch(&copies).unwrap();
    }
    assert!(back[..] == host[..], "every block back where it started");
    let direct = s.to_vec(&cache).unwrap();
    assert_eq!(
        &direct[..elems],
        &host[(blocks - 1) * elems..],
        "block order"
    );
    // Device to device, returned at once, then waited.
    let mut twin = DeviceBuffer::<u32>::zeroed(s, blocks * elems).unwrap();
    {
        let src: Vec<DeviceSlice<'_, u32>> = cache.chunks(elems).collect();
        let mut dst: Vec<DeviceSliceMut<'_, u32>> = twin.chunks_mut(elems).collect();
        let copies: Vec<BatchCopy<'_>> = src
            .iter()
            .zip(dst.iter_mut())
            .map(|(f, t)| BatchCopy::d2d(f, t))
            .collect();
        s.copy_batch(&copies).unwrap();
    }
    assert_eq!(s.to_vec(&twin).unwrap(), direct);
    let short = vec![0u32; elems - 1];
    let e = s
        .copy_batch(&[BatchCopy::h2d(&short, &mut cache)])
        .unwrap_err();
    assert!(e.to_string().contains("lengths differ"), "{e}");
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "memory::copy_batch_moves_512_kv_blocks_exactly",
            run: copy_batch_moves_512_kv_blocks_exactly,
        },
        Test {
            name: "memory::memset_patterns_at_unaligned_offsets_and_odd_lengths",
            run: memset_patterns_at_unaligned_offsets_and_odd_lengths,
        },
        Test {
            name: "memory::device_to_device_between_slices_and_slices_as_arguments",
            run: device_to_device_between_slices_and_slices_as_arguments,
        },
        Test {
            name: "memory::managed_buffer_written_by_a_kernel_read_on_the_host",
            run: managed_buffer_written_by_a_kernel_read_on_the_host,
        },
        Test {
            name: "memory::typed_symbols_round_trip_with_a_namespace_array",
            run: typed_symbols_round_trip_with_a_namespace_array,
        },
        Test {
            name: "memory::stream_ordered_pairs_leave_free_memory_where_it_was",
            run: stream_ordered_pairs_leave_free_memory_where_it_was,
        },
        Test {
            name: "memory::an_allocation_larger_than_the_device_is_a_clear_error",
            run: an_allocation_larger_than_the_device_is_a_clear_error,
        },
        Test {
            name: "memory::device_information",
            run: device_information,
        },
    ]
}
