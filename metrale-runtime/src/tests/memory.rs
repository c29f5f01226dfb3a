//! Unit tests of `memory`.

use super::device::bounds;

#[test]
fn slice_bounds_are_checked_without_panics() {
    assert_eq!(bounds(&(2..5), 10).unwrap(), (2, 3));
    assert_eq!(bounds(&(..), 10).unwrap(), (0, 10));
    assert_eq!(bounds(&(3..=9), 10).unwrap(), (3, 7));
    assert_eq!(bounds(&(10..), 10).unwrap(), (10, 0));
    assert_eq!(
        bounds(&(5..20), 10).unwrap_err().to_string(),
        "invalid argument: slice 5..20 of 10 elements is out of bounds"
    );
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 7..3;
    assert!(bounds(&reversed, 10).is_err());
    assert_eq!(
        bounds(&(0..=usize::MAX), 10).unwrap_err().to_string(),
        format!(
            "invalid argument: slice 0..={} of 10 elements is out of bounds",
            usize::MAX
        )
    );
}

#[test]
fn byte_sizes_that_overflow_are_errors() {
    assert_eq!(
        super::byte_len::<u64>(usize::MAX / 4, "device buffer")
            .unwrap_err()
            .to_string(),
        format!(
            "invalid argument: device buffer of {} elements of 8 bytes overflows usize",
            usize::MAX / 4
        )
    );
    assert_eq!(super::byte_len::<u32>(10, "x").unwrap(), 40);
}

#[test]
fn bool_is_sent_but_not_read_back() {
    fn sendable<T: super::DeviceRepr>() {}
    sendable::<bool>();
    assert_eq!(<(bool, [u8; 3]) as crate::KernelArgs<_>>::SIZES, &[1, 3]);
}

#[cfg(feature = "half")]
#[test]
fn half_floats_are_device_types() {
    fn pod<T: super::DevicePod>() {}
    pod::<half::f16>();
    pod::<half::bf16>();
    assert_eq!(
        <(half::f16, half::bf16, [half::f16; 4]) as crate::KernelArgs<_>>::SIZES,
        &[2, 2, 8]
    );
}
