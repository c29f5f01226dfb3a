//! Virtual memory on the GPU: a growable buffer grown to 16 GiB while kernels
//! write and read it, sleep and wake.

use crate::common::*;
use crate::harness::Test;

const MIB: usize = 1 << 20;

/// fill_index over `view` (at most `u32::MAX` elements): element j = base + j.
fn fill(reg: &MetraleRegistry, s: &CudaStream, view: &mut DeviceSliceMut<'_, u32>, base: u32) {
    let f = reg.function("kernels", "fill_index").unwrap();
    let n = u32::try_from(view.len()).unwrap();
    let cfg = LaunchConfig::for_num_elems(view.len(), 256).unwrap();
    // SAFETY: fill_index(unsigned*, unsigned, unsigned) writes view[0..n].
    unsafe { s.launch(&f, cfg, (view, n, base)) }.unwrap();
}

/// consume over `view`: how many elements differ from `value`.
fn count_not(
    reg: &MetraleRegistry,
    s: &CudaStream,
    view: &DeviceSlice<'_, u32>,
    value: u32,
) -> u32 {
    let f = reg.function("kernels", "consume").unwrap();
    let mut bad = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let n = u32::try_from(view.len()).unwrap();
    let cfg = LaunchConfig::new((4096, 1, 1), (256, 1, 1), 0).unwrap();
    // SAFETY: consume(const unsigned*, unsigned, unsigned, unsigned*) reads
    // view[0..n] (grid-stride) and adds to bad[0].
    unsafe { s.launch(&f, cfg, (view, n, value, &mut bad)) }.unwrap();
    s.to_vec(&bad).unwrap()[0]
}

fn growable_buffer_grows_to_16_gib_in_place() {
    let reg = registry();
    let s = reg.stream();
    let total = 16usize << 30;
    let cap = total / 4; // u32 elements: 2^32
    let mut buf = GrowableBuffer::<u32>::new(s, cap).unwrap();
    assert_eq!(buf.capacity(), cap);
    let p = buf.device_ptr();
    let mut len = 0usize;
    let mut bytes = 2 * MIB;
    while bytes <= total {
        let new_len = bytes / 4;
        buf.grow_to(new_len).unwrap();
        assert_eq!(buf.device_ptr(), p, "element 0 never moves");
        assert_eq!(buf.len(), new_len);
        // Write the new part: element k holds k (k < 2^32).
        let base = u32::try_from(len).unwrap();
        fill(&reg, s, &mut buf.slice_mut(len..new_len).unwrap(), base);
        // Read across the boundary of the old and the new piece.
        if len > 0 {
            let window = buf.slice(len - 1024..len + 1024).unwrap();
            let got = s.to_vec(&window).unwrap();
            for (j, &v) in got.iter().enumerate() {
                assert_eq!(
                    v as usize,
                    len - 1024 + j,
                    "element {} at {bytes} bytes",
                    len - 1024 + j
                );
            }
        }
        len = new_len;
        bytes *= 2;
    }
    assert_eq!(buf.mapped_bytes(), total);
    // The last element, and every element read by a kernel across all pieces.
    assert_eq!(
        s.to_vec(&buf.slice(cap - 1..).unwrap()).unwrap(),
        [u32::MAX]
    );
    s.memset_u32(&mut buf, 0x1234_5678).unwrap();
    let half = cap / 2;
    assert_eq!(
        count_not(&reg, s, &buf.slice(..half).unwrap(), 0x1234_5678),
        0
    );
    assert_eq!(
        count_not(&reg, s, &buf.slice(half..).unwrap(), 0x1234_5678),
        0
    );
    // A copy spanning every piece boundary of the first 64 MiB.
    let mut other = DeviceBuffer::<u32>::zeroed(s, 16 * MIB).unwrap();
    s.copy_d2d(&buf.slice(..16 * MIB).unwrap(), &mut other)
        .unwrap();
    assert_eq!(
        count_not(&reg, s, &other.slice(..).unwrap(), 0x1234_5678),
        0
    );
}

fn sleep_releases_memory_and_wake_restores_every_byte() {
    let reg = registry();
    let s = reg.stream();
    let dev = Device::get(0).unwrap();
    let n = 512 * MIB / 4;
    let mut buf = GrowableBuffer::<u32>::new(s, 4 * n).unwrap();
    buf.grow_to(n / 2).unwrap();
    buf.grow_to(n).unwrap();
    fill(&reg, s, &mut buf.slice_mut(..).unwrap(), 7);
    s.synchronize().unwrap();
    let p = buf.device_ptr();
    let (free_awake, _) = dev.memory_info().unwrap();
    let asleep = buf.sleep(Some(s)).unwrap();
    let (free_asleep, _) = dev.memory_info().unwrap();
    assert!(
        free_asleep >= free_awake + 512 * MIB - 64 * MIB,
        "free memory rose by {} MiB, expected about 512",
        (free_asleep.saturating_sub(free_awake)) / MIB
    );
    let buf = asleep.wake(s).unwrap();
    assert_eq!(buf.device_ptr(), p);
    let got = s.to_vec(&buf).unwrap();
    for (i, &v) in got.iter().enumerate() {
        assert_eq!(v, i as u32 + 7, "element {i}");
    }
    // Kernels use the woken memory.
    let mut buf = buf;
    s.memset_u32(&mut buf, 9).unwrap();
    assert_eq!(count_not(&reg, s, &buf.slice(..).unwrap(), 9), 0);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "vmm::growable_buffer_grows_to_16_gib_in_place",
            run: growable_buffer_grows_to_16_gib_in_place,
        },
        Test {
            name: "vmm::sleep_releases_memory_and_wake_restores_every_byte",
            run: sleep_releases_memory_and_wake_restores_every_byte,
        },
    ]
}
