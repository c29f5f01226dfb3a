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
    assert_eq!(<(u8, u16) as KernelArgs>::SIZES.len(), 2);
    ().with_params(|p| assert!(p.is_empty()));
}

#[test]
fn typed_args_know_their_sizes() {
    assert_eq!(<(u64, u32, f32) as KernelArgs>::SIZES, &[8, 4, 4]);
    assert_eq!(<([u8; 3], bool) as KernelArgs>::SIZES, &[3, 1]);
    assert_eq!(<() as KernelArgs>::SIZES, &[] as &[usize]);
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
