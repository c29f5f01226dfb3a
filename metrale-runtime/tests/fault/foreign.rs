//! Foreign device memory (issue 35, item 1): raw device pointers viewed as
//! metrale's slices, accepted where metrale's own go, and refused for a wrong
//! device, a range past the allocation, a bad address or alignment.

use crate::common::*;
use crate::harness::Test;

/// An allocation made behind metrale's back, through the sys table, as another
/// library would; freed by the caller.
fn raw_alloc(h: &CudaHost, bytes: usize) -> sys::CUdeviceptr {
    h.context().bind().unwrap();
    let d = sys::driver().unwrap();
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: writes one address; the context is current.
    assert!(unsafe { d.cuMemAlloc_v2().unwrap()(&mut p, bytes) }.is_success());
    p
}

fn raw_free(h: &CudaHost, p: sys::CUdeviceptr) {
    h.context().bind().unwrap();
    // SAFETY: the allocation made by `raw_alloc`, freed once, after its work.
    let r = unsafe { sys::driver().unwrap().cuMemFree_v2().unwrap()(p) };
    assert!(r.is_success());
}

fn a_raw_allocation_is_copied_filled_and_mapped_like_a_buffer() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream();
    let p = raw_alloc(&h, 64 * 4);
    {
        // SAFETY: the allocation is alive and only used through these views
        // until it is freed below, after the stream's work.
        let mut out = unsafe { DeviceSliceMut::<u32>::from_raw_mut(&h, p, 64) }.unwrap();
        let values: Vec<u32> = (0..64).collect();
        s.copy_h2d(&values, &mut out).unwrap();
        s.memset_u32(&mut out.slice_mut(60..).unwrap(), 7).unwrap();
        assert_eq!(out.device_ptr(), p);
        assert_eq!(out.len(), 64);
        // SAFETY: as above, a shared view of the same memory, used after the
        // mutable one is done.
        let view = unsafe { DeviceSlice::<u32>::from_raw(&h, p + 16, 8) }.unwrap();
        let back = s.to_vec(&view).unwrap();
        assert_eq!(back, (4..12).collect::<Vec<u32>>());
        let all = s.to_vec(&out).unwrap();
        assert_eq!(&all[56..], &[56, 57, 58, 59, 7, 7, 7, 7]);
        // A tensor map over it, at its address.
        let map = TensorMap::tiled(&view).encode().unwrap();
        assert_eq!(map.address(), p + 16);
        // An empty view checks nothing, not even the address.
        // SAFETY: no element is viewed.
        assert!(unsafe { DeviceSlice::<u32>::from_raw(&h, 0, 0) }
            .unwrap()
            .is_empty());
    }
    s.synchronize().unwrap();
    raw_free(&h, p);
}

fn a_range_past_its_allocation_is_refused() {
    fake().reset();
    let h = host(0).unwrap();
    let p = raw_alloc(&h, 256);
    // SAFETY: refused before any view exists.
    let e = unsafe { DeviceSlice::<u32>::from_raw(&h, p + 16, 61) }.unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
    let text = e.to_string();
    assert!(text.contains("run past the allocation"), "{e}");
    assert!(text.contains("244 bytes from"), "{e}");
    // Exactly to the end is fine.
    // SAFETY: the allocation is alive until freed below; the view is unused.
    assert!(unsafe { DeviceSlice::<u32>::from_raw(&h, p + 16, 60) }.is_ok());
    // An element count whose byte size overflows.
    // SAFETY: refused before any view exists.
    assert!(unsafe { DeviceSlice::<u64>::from_raw(&h, p, usize::MAX / 4) }.is_err());
    raw_free(&h, p);
}

fn another_devices_memory_is_refused() {
    fake().reset();
    let (h0, h1) = (host(0).unwrap(), host(1).unwrap());
    let p = raw_alloc(&h1, 256);
    // SAFETY: refused before any view exists.
    let e = unsafe { DeviceSliceMut::<u8>::from_raw_mut(&h0, p, 256) }.unwrap_err();
    assert!(
        e.to_string()
            .contains("the memory is on device 1, not on device 0"),
        "{e}"
    );
    // SAFETY: the allocation is alive until freed below; the view is unused.
    assert!(unsafe { DeviceSliceMut::<u8>::from_raw_mut(&h1, p, 256) }.is_ok());
    raw_free(&h1, p);
    drop(h0);
}

fn an_unknown_null_or_misaligned_address_is_refused() {
    fake().reset();
    let h = host(0).unwrap();
    // SAFETY: refused before any view exists.
    let e = unsafe { DeviceSlice::<u32>::from_raw(&h, 0, 4) }.unwrap_err();
    assert!(e.to_string().contains("the address is null"), "{e}");
    let p = raw_alloc(&h, 256);
    // SAFETY: refused before any view exists.
    let e = unsafe { DeviceSlice::<u32>::from_raw(&h, p + 2, 4) }.unwrap_err();
    assert!(e.to_string().contains("misaligned"), "{e}");
    raw_free(&h, p);
    // Freed now: the driver does not know the address.
    // SAFETY: refused before any view exists.
    let e = unsafe { DeviceSlice::<u32>::from_raw(&h, p, 4) }.unwrap_err();
    assert_eq!(e.status(), Some(CUresult(1)), "{e}");
    let text = e.to_string();
    assert!(text.contains("cuPointerGetAttribute"), "{e}");
    assert!(text.contains("foreign device memory"), "{e}");
    // Host memory is not device memory.
    let host_words = [0u32; 4];
    // SAFETY: refused before any view exists.
    let e = unsafe { DeviceSlice::<u32>::from_raw(&h, host_words.as_ptr() as sys::CUdeviceptr, 4) }
        .unwrap_err();
    assert!(e.to_string().contains("cuPointerGetAttribute"), "{e}");
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "foreign::a_raw_allocation_is_copied_filled_and_mapped_like_a_buffer",
            run: a_raw_allocation_is_copied_filled_and_mapped_like_a_buffer,
        },
        Test {
            name: "foreign::a_range_past_its_allocation_is_refused",
            run: a_range_past_its_allocation_is_refused,
        },
        Test {
            name: "foreign::another_devices_memory_is_refused",
            run: another_devices_memory_is_refused,
        },
        Test {
            name: "foreign::an_unknown_null_or_misaligned_address_is_refused",
            run: an_unknown_null_or_misaligned_address_is_refused,
        },
    ]
}
