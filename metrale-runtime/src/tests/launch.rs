//! Unit tests of `launch`.

use super::*;

fn limits() -> DeviceLimits {
    DeviceLimits {
        max_threads_per_block: 1024,
        max_block_dim: [1024, 1024, 64],
        max_grid_dim: [i32::MAX as u32, 65535, 65535],
        max_shared_per_block: 48 * 1024,
        max_shared_per_block_optin: 227 * 1024,
        multiprocessor_count: 132,
        compute_capability: (9, 0),
        cluster_launch: true,
        cooperative_launch: true,
        memory_pools: true,
        managed_memory: true,
        concurrent_managed_access: true,
    }
}

#[test]
fn shape_rules() {
    assert!(LaunchConfig::new((1, 1, 1), (1024, 1, 1), 0).is_ok());
    let e = LaunchConfig::new((1, 0, 1), (32, 1, 1), 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: a launch dimension is zero: (grid=[1,0,1], block=[32,1,1], shared_mem=0)"
    );
    let e = LaunchConfig::new((1, 1, 1), (64, 32, 1), 0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: more than 1024 threads per block: (grid=[1,1,1], block=[64,32,1], shared_mem=0)"
    );
    assert!(LaunchConfig::new((1, 1, 1), (1, 1, 65), 0).is_err());
}

#[test]
fn device_limits() {
    let l = limits();
    let ok = LaunchConfig::new((1000, 1, 1), (256, 1, 1), 100 * 1024).unwrap();
    assert!(ok.validate_for(&l).is_ok());
    let too_much_smem = ok.with_shared_mem(228 * 1024);
    assert_eq!(
        too_much_smem.validate_for(&l).unwrap_err().to_string(),
        "invalid argument: dynamic shared memory above the device's opt-in limit of 232448 bytes: \
         (grid=[1000,1,1], block=[256,1,1], shared_mem=233472)"
    );
    let tall_grid = LaunchConfig::new((1, 70000, 1), (1, 1, 1), 0).unwrap();
    assert_eq!(
        tall_grid.validate_for(&l).unwrap_err().to_string(),
        "invalid argument: grid y dimension above the device's 65535: \
         (grid=[1,70000,1], block=[1,1,1], shared_mem=0)"
    );
}

#[test]
fn cluster_attributes_are_checked_before_the_driver() {
    let l = limits();
    let cfg = LaunchConfig::new((8, 2, 1), (128, 1, 1), 0).unwrap();
    assert!(LaunchAttributes::cluster(4, 2, 1).check(&cfg, &l).is_ok());
    assert_eq!(
        LaunchAttributes::cluster(3, 1, 1)
            .check(&cfg, &l)
            .unwrap_err(),
        "cluster x dimension 3 does not divide grid x dimension 8:"
    );
    let big = LaunchConfig::new((16, 1, 1), (128, 1, 1), 0).unwrap();
    assert_eq!(
        LaunchAttributes::cluster(16, 1, 1)
            .check(&big, &l)
            .unwrap_err(),
        "a cluster of 16 blocks exceeds the limit of 8 blocks per cluster:"
    );
    let old = DeviceLimits {
        cluster_launch: false,
        compute_capability: (8, 0),
        ..l
    };
    assert_eq!(
        LaunchAttributes::cluster(2, 1, 1)
            .check(&cfg, &old)
            .unwrap_err(),
        "the device (compute capability 8.0) cannot launch thread-block clusters (9.0+ can):"
    );
    let (attrs, n) = LaunchAttributes {
        cluster_dim: Some((2, 1, 1)),
        cooperative: true,
        programmatic_stream_serialization: false,
    }
    .to_driver();
    assert_eq!(n, 2);
    assert_eq!(
        attrs[0].id,
        CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    );
    // SAFETY: the cluster entry's union member is clusterDim.
    assert_eq!(unsafe { attrs[0].value.clusterDim.x }, 2);
    assert_eq!(
        attrs[1].id,
        CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    );
}

#[test]
fn for_num_elems_rounds_up() {
    let cfg = LaunchConfig::for_num_elems(1000, 256).unwrap();
    assert_eq!(cfg.grid_dim(), (4, 1, 1));
    assert_eq!(cfg.block_dim(), (256, 1, 1));
    assert!(LaunchConfig::for_num_elems(0, 256).is_err());
    assert!(LaunchConfig::for_num_elems(10, 2048).is_err());
}

#[test]
fn typed_args_pack_pointers_to_each_value() {
    let (a, b, c) = (7u64, 3u32, 1.5f32);
    let args = (a, b, c);
    args.with_params(|p| {
        assert_eq!(p.len(), 3);
        // SAFETY: the pointers point at the tuple's fields, alive in this closure.
        unsafe {
            assert_eq!(*p[0].cast::<u64>(), 7);
            assert_eq!(*p[1].cast::<u32>(), 3);
            assert_eq!(*p[2].cast::<f32>(), 1.5);
        }
    });
    assert_eq!(<(u8, u16) as KernelArgs<_>>::SIZES.len(), 2);
    ().with_params(|p| assert!(p.is_empty()));
}

#[test]
fn typed_args_know_their_sizes() {
    assert_eq!(<(u64, u32, f32) as KernelArgs<_>>::SIZES, &[8, 4, 4]);
    assert_eq!(<([u8; 3], bool) as KernelArgs<_>>::SIZES, &[3, 1]);
    assert_eq!(<() as KernelArgs<_>>::SIZES, &[] as &[usize]);
}

#[test]
fn results_stay_one_pointer_wide() {
    // The hot path returns `Result<()>`: the error's data lives behind one box.
    assert_eq!(std::mem::size_of::<crate::Result<()>>(), 8);
    assert_eq!(std::mem::size_of::<crate::MetraleError>(), 8);
}

#[test]
fn setters_check_like_new() {
    let cfg = LaunchConfig::new((4, 1, 1), (256, 1, 1), 0).unwrap();
    let wider = cfg.with_block((1024, 1, 1)).unwrap();
    assert_eq!(
        (wider.grid_dim(), wider.block_dim()),
        ((4, 1, 1), (1024, 1, 1))
    );
    let e = cfg.with_block((1025, 1, 1)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: more than 1024 threads per block: (grid=[4,1,1], block=[1025,1,1], shared_mem=0)"
    );
    assert!(cfg.with_block((1, 1, 65)).is_err());
    assert!(cfg.with_grid((0, 1, 1)).is_err());
    let g = cfg.with_grid((8, 2, 1)).unwrap().with_shared_mem(1024);
    assert_eq!((g.grid_dim(), g.shared_mem_bytes()), ((8, 2, 1), 1024));
    assert_eq!(g.attributes(), LaunchAttributes::default());
    assert_eq!(
        g.with_cooperative(true).attributes(),
        LaunchAttributes::cooperative()
    );
}

#[test]
fn typed_args_know_their_alignments_up_to_24() {
    assert_eq!(<(u64, u32, [u8; 3]) as KernelArgs<_>>::ALIGNS, &[8, 4, 1]);
    assert_eq!(<(NullPtr, u16) as KernelArgs<_>>::ALIGNS, &[8, 2]);
    type T24 = (
        u8,
        u16,
        u32,
        u64,
        f32,
        f64,
        u8,
        u16,
        u32,
        u64,
        f32,
        f64,
        u8,
        u16,
        u32,
        u64,
        f32,
        f64,
        u8,
        u16,
        u32,
        u64,
        f32,
        NullPtr,
    );
    assert_eq!(<T24 as KernelArgs<_>>::SIZES.len(), 24);
    assert_eq!(<T24 as KernelArgs<_>>::SIZES[23], 8);
    let args: T24 = (
        0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0, NullPtr,
    );
    args.with_params(|p| {
        assert_eq!(p.len(), 24);
        // SAFETY: the last pointer is a NullPtr's 8 zero bytes, alive here.
        assert_eq!(unsafe { *p[23].cast::<u64>() }, 0);
    });
    let layout = args.layout();
    assert_eq!((layout.sizes().len(), layout.aligns()[3]), (24, 8));
}

#[test]
fn a_list_stores_each_argument_aligned_and_points_at_it() {
    let mut list = KernelArgList::new();
    list.push(1u8).push(2u64).push(NullPtr).push([3u16; 3]);
    list.push_bytes(&[9; 5], 64).unwrap();
    assert_eq!(list.sizes(), [1, 8, 8, 6, 5]);
    assert_eq!(list.aligns(), [1, 8, 8, 2, 64]);
    assert_eq!(list.arg_bytes(1).unwrap(), 2u64.to_ne_bytes());
    assert_eq!(list.arg_bytes(2).unwrap(), [0; 8]);
    assert_eq!(list.arg_bytes(5), None);
    (&list).with_params(|p| {
        assert_eq!(p.len(), 5);
        for (i, &ptr) in p.iter().enumerate() {
            let align = list.aligns()[i];
            assert_eq!(ptr as usize % align, 0, "argument {i} stored aligned");
        }
        // SAFETY: the pointers point at the list's bytes, alive in this closure.
        unsafe {
            assert_eq!(*p[0].cast::<u8>(), 1);
            assert_eq!(*p[1].cast::<u64>(), 2);
            assert_eq!(*p[3].cast::<[u16; 3]>(), [3; 3]);
            assert_eq!(*p[4].cast::<[u8; 5]>(), [9; 5]);
        }
    });
    let by_ref = &list;
    let layout = by_ref.layout();
    assert_eq!(layout, ArgLayout::new(&[1, 8, 8, 6, 5], &[1, 8, 8, 2, 64]));
    // Re-entrant use gets its own array.
    (&list).with_params(|outer| {
        let first = outer[0];
        (&list).with_params(|inner| assert_eq!(inner[0], first));
    });
}

#[test]
fn list_pushes_and_replacements_are_checked() {
    let mut list = KernelArgList::new();
    list.push(1u32);
    let e = list.push_bytes(&[], 4).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: kernel argument list: argument 1 has no bytes (a kernel parameter has at least one)"
    );
    let e = list.push_bytes(&[0; 12], 12).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: kernel argument list: argument 1: alignment 12 is not a power of two from 1 to 4096"
    );
    assert!(list.push_bytes(&[0; 4], 0).is_err());
    assert!(list.push_bytes(&[0; 4], MAX_ARG_ALIGN * 2).is_err());
    assert_eq!(list.len(), 1, "refused pushes leave the list as it was");
    list.set(0, 7u32).unwrap();
    list.set(0, 7i32).unwrap();
    assert_eq!(list.arg_bytes(0).unwrap(), 7u32.to_ne_bytes());
    let e = list.set(0, 7u64).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: kernel argument list: argument 0 is 4 bytes aligned to 4, its replacement 8 bytes aligned to 8"
    );
    let e = list.set(3, 7u32).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: kernel argument list: no argument 3 to replace (the list has 1)"
    );
    assert!(list.set_bytes(0, &[1, 0, 0, 0], 2).is_err());
    list.set_bytes(0, &[1, 0, 0, 0], 4).unwrap();
    assert_eq!(list.arg_bytes(0).unwrap(), [1, 0, 0, 0]);
    list.clear();
    assert!(list.is_empty());
    (&list).with_params(|p| assert!(p.is_empty()));
    let recycled: KernelArgList<'static> = list.recycle();
    assert!(recycled.is_empty());
    assert!(format!("{recycled:?}").starts_with("KernelArgList"));
}

/// The sizes and alignments a tuple of argument types passes (kinds inferred).
fn layout_of<A: KernelArgs<K>, K>() -> (&'static [usize], &'static [usize]) {
    (A::SIZES, A::ALIGNS)
}

/// Issue 41: every memory type, generic ones included, is a pointer argument:
/// `&m` a `const T*`, `&mut m` a `T*`, `&` of a mutable view too.
#[test]
fn generic_and_mutable_memory_are_pointer_arguments() {
    use crate::memory::{DeviceBuffer, DeviceMemory, DeviceMemoryMut, DeviceSliceMut};
    use crate::{ByAddress, ByValue, KernelArg};
    fn generic<X: DeviceMemory<f32>, Y: DeviceMemoryMut<f32>>() -> &'static [usize] {
        layout_of::<(&X, &mut Y, u32), _>().0
    }
    assert_eq!(
        generic::<DeviceBuffer<f32>, DeviceSliceMut<'_, f32>>(),
        [8, 8, 4]
    );
    assert_eq!(
        layout_of::<
            (
                &DeviceSliceMut<'_, f32>,
                &mut DeviceSliceMut<'_, f32>,
                &dyn DeviceMemory<f32>
            ),
            _,
        >(),
        (&[8, 8, 8][..], &[8, 8, 8][..])
    );
    assert_eq!(<&DeviceBuffer<u8> as KernelArg<ByAddress>>::SIZE, 8);
    assert_eq!(<u16 as KernelArg<ByValue>>::ALIGN, 2);
    assert_eq!(<u16 as KernelArg>::SIZE, 2, "ByValue is the default kind");
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_memory_is_a_pointer_argument() {
    use crate::nccl::{NcclBuffer, Registration, Window};
    assert_eq!(
        layout_of::<(&NcclBuffer<f32>, &mut NcclBuffer<f32>, u32), _>().0,
        [8, 8, 4]
    );
    assert_eq!(
        layout_of::<(&Registration<'_, '_, f32>, &mut Window<'_, '_, f32>), _>().0,
        [8, 8]
    );
}

/// No compiler note may suggest `unsafe impl DeviceRepr` (or `DevicePod`) for
/// the type at hand: that type may be a reference or hold a pointer, whose bytes
/// would reach the kernel as a host address.
#[test]
fn no_diagnostic_suggests_device_repr_for_the_type_at_hand() {
    let sources = [
        ("memory/mod.rs", include_str!("../memory/mod.rs")),
        ("launch/args.rs", include_str!("../launch/args.rs")),
        ("stream/mod.rs", include_str!("../stream/mod.rs")),
    ];
    let mut seen = 0;
    for (file, text) in sources {
        for part in text.split("#[diagnostic::on_unimplemented(").skip(1) {
            let attr = &part[..part.find(")]").unwrap()];
            seen += 1;
            assert!(
                !attr.contains("for {Self}"),
                "{file}: a note suggests an impl for the type at hand: {attr}"
            );
        }
    }
    assert!(seen >= 4, "{seen} diagnostics read");
}
