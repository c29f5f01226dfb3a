//! Launches: the shared-memory opt-in (and its race), context binding, the
//! allocation-free path, extended launches, attributes, and typed arguments checked
//! against the kernel's parameter layout.

use std::ffi::c_void;
use std::sync::{Arc, Barrier};

use crate::common::*;
use crate::harness::Test;

fn large_shared_memory_opts_in_once_per_kernel_and_size() {
    let reg = setup();
    let f = reg.function("kernels", "vec_add").unwrap();
    let s = reg.stream();
    let out = DeviceBuffer::<u32>::alloc(s, 2).unwrap();
    let small = LaunchConfig::new((1, 1, 1), (256, 1, 1), 48 * 1024).unwrap();
    let large = LaunchConfig::new((1, 1, 1), (256, 1, 1), 100 * 1024).unwrap();
    let args = (&out, &out, &out, 2u32);
    // SAFETY: the stand-in only records the arguments (for every launch below).
    unsafe { s.launch(&f, small, args) }.unwrap();
    assert_eq!(
        fake().calls("cuFuncSetAttribute"),
        0,
        "48 KiB needs no opt-in"
    );
    // SAFETY: as above.
    unsafe { s.launch(&f, large, args) }.unwrap();
    assert_eq!(fake().calls("cuFuncSetAttribute"), 1);
    assert_eq!(
        fake().func_max_dynamic_shared(f.as_raw().cast::<c_void>()),
        100 * 1024
    );
    // SAFETY: as above.
    unsafe {
        s.launch(&f, large, args).unwrap();
        s.launch(&f, small, args).unwrap();
    }
    assert_eq!(
        fake().calls("cuFuncSetAttribute"),
        1,
        "set once, not per launch"
    );
    assert_eq!(fake().last_launch().shared, 48 * 1024);
    let larger = large.with_shared_mem(200 * 1024);
    // SAFETY: as above.
    unsafe { s.launch(&f, larger, args) }.unwrap();
    assert_eq!(
        fake().calls("cuFuncSetAttribute"),
        2,
        "a larger size opts in again"
    );
    // Beyond the device's opt-in limit: refused before the driver, naming the limit.
    let too_large = large.with_shared_mem(240 * 1024);
    // SAFETY: refused before any driver call.
    let e = unsafe { s.launch(&f, too_large, args) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': launch not attempted, dynamic shared memory above the device's \
         opt-in limit of 232448 bytes: (grid=[1,1,1], block=[256,1,1], shared_mem=245760)"
    );
    assert_eq!(fake().calls("cuFuncSetAttribute"), 2);
    drop((out, f));
    done(reg);
}

/// Before, lowering the limit through `set_max_dynamic_shared_bytes` left the
/// opt-in record claiming more than the driver had: later large launches failed.
fn the_opt_in_record_follows_every_change_of_the_limit() {
    let reg = setup();
    let f = reg.function("kernels", "vec_add").unwrap();
    let s = reg.stream();
    let out = DeviceBuffer::<u32>::alloc(s, 2).unwrap();
    let big = LaunchConfig::new((1, 1, 1), (32, 1, 1), 220 * 1024).unwrap();
    let args = (&out, &out, &out, 2u32);
    // SAFETY: the stand-in only records the arguments (for every launch below).
    unsafe { s.launch(&f, big, args) }.unwrap();
    f.set_max_dynamic_shared_bytes(100 * 1024).unwrap();
    // SAFETY: as above.
    unsafe { s.launch(&f, big, args) }.expect("a launch after lowering opts in again");
    assert_eq!(
        fake().func_max_dynamic_shared(f.as_raw().cast::<c_void>()),
        220 * 1024
    );
    // Many threads racing for different sizes: the record never exceeds the driver.
    for round in 0..20u32 {
        f.set_max_dynamic_shared_bytes(48 * 1024).unwrap();
        let barrier = Arc::new(Barrier::new(12));
        let threads: Vec<_> = (0..12u32)
            .map(|t| {
                let (f, barrier) = (f.clone(), Arc::clone(&barrier));
                let s = s.clone();
                let ptr = out.device_ptr();
                std::thread::spawn(move || {
                    let bytes = (200 + (t + round) % 12 * 2) * 1024;
                    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), bytes).unwrap();
                    barrier.wait();
                    let mut p: [*mut c_void; 4] = [
                        (&ptr as *const u64).cast_mut().cast(),
                        (&ptr as *const u64).cast_mut().cast(),
                        (&ptr as *const u64).cast_mut().cast(),
                        (&bytes as *const u32).cast_mut().cast(),
                    ];
                    // SAFETY: the stand-in only records the arguments.
                    unsafe { s.launch_raw(&f, cfg, &mut p) }.unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // Every size still launches: the record and the driver agree.
        for kib in [200u32, 210, 222] {
            let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), kib * 1024).unwrap();
            // SAFETY: as above.
            unsafe { s.launch(&f, cfg, args) }
                .unwrap_or_else(|e| panic!("round {round}, {kib} KiB: {e}"));
        }
    }
    drop((out, f));
    done(reg);
}

fn context_is_bound_on_a_fresh_thread_only_when_needed() {
    let reg = setup();
    let r = Arc::clone(&reg);
    std::thread::spawn(move || {
        let set_before = fake().calls("cuCtxSetCurrent");
        r.stream().synchronize().unwrap();
        assert_eq!(
            fake().calls("cuCtxSetCurrent"),
            set_before + 1,
            "fresh thread: bound once"
        );
        let gets = fake().calls("cuCtxGetCurrent");
        r.stream().synchronize().unwrap();
        r.function("kernels", "vec_add").unwrap();
        assert_eq!(
            fake().calls("cuCtxSetCurrent"),
            set_before + 1,
            "already current: not set again"
        );
        assert_eq!(
            fake().calls("cuCtxGetCurrent"),
            gets + 2,
            "one cheap check per call"
        );
    })
    .join()
    .unwrap();
    done(reg);
}

/// metrale leaves its context current; a ContextGuard gives the thread its own back.
fn a_context_guard_restores_the_callers_context() {
    let reg = setup();
    let other = host(1).unwrap();
    std::thread::spawn(move || {
        let d1 = other.ctx().raw().cast::<c_void>();
        other.bind().unwrap();
        assert_eq!(fake().current_context(), d1);
        {
            let _keep = ContextGuard::save().unwrap();
            reg.stream().synchronize().unwrap();
            assert_eq!(
                fake().current_context(),
                reg.ctx().raw().cast::<c_void>(),
                "metrale binds its own context"
            );
        }
        assert_eq!(
            fake().current_context(),
            d1,
            "the guard restored device 1's"
        );
        // Without a guard the thread keeps metrale's context (documented).
        reg.stream().synchronize().unwrap();
        assert_eq!(fake().current_context(), reg.ctx().raw().cast::<c_void>());
        let _none = {
            let g = ContextGuard::save().unwrap();
            assert!(!g.saved().is_null());
            g
        };
        drop(reg);
    })
    .join()
    .unwrap();
    release(1);
    done(setup());
}

fn launch_path_allocates_nothing() {
    let reg = setup();
    let f = reg.function("kernels", "vec_add").unwrap();
    let raw_f = f.raw();
    let s = reg.stream();
    let buf = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (16, 1, 1), 64 * 1024).unwrap();
    let n = 16u32;
    let ptr = buf.device_ptr();
    let mut params: [*mut c_void; 4] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&ptr as *const u64).cast_mut().cast(),
        (&ptr as *const u64).cast_mut().cast(),
        (&n as *const u32).cast_mut().cast(),
    ];
    let cache = std::sync::OnceLock::new();
    reg.raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    // Warm: the first launch above 48 KiB opts in (a cold path).
    // SAFETY: the stand-in only records the arguments (for every launch below).
    unsafe { reg.launch_on_stream(raw_f, cfg, s, &mut params) }.unwrap();
    let before = allocations();
    for _ in 0..10_000 {
        let rf = reg
            .raw_function_cached(&cache, "kernels", "vec_add")
            .unwrap();
        // SAFETY: as above.
        unsafe {
            reg.launch_on_stream(rf, cfg, s, &mut params).unwrap();
            reg.launch(rf, cfg, s, (&buf, &buf, &buf, n)).unwrap();
            s.launch(&f, cfg, (&buf, &buf, &buf, n)).unwrap();
        }
    }
    assert_eq!(allocations() - before, 0, "allocations on the launch path");
    assert_eq!(fake().launches(), 30_001);
    drop((buf, f));
    done(reg);
}

fn extended_launch_passes_cluster_and_cooperative() {
    let reg = setup();
    let f = reg.function("kernels", "vec_add").unwrap();
    let s = reg.stream();
    let buf = DeviceBuffer::<f32>::alloc(s, 64).unwrap();
    let cfg = LaunchConfig::new((8, 2, 1), (64, 1, 1), 0).unwrap();
    let mut attrs = LaunchAttributes::cluster(4, 2, 1);
    attrs.cooperative = true;
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg.with_attributes(attrs), (&buf, &buf, &buf, 64u32)) }.unwrap();
    let l = fake().last_launch();
    assert_eq!(
        (l.grid, l.cluster, l.cooperative),
        ([8, 2, 1], [4, 2, 1], true)
    );
    assert_eq!(fake().last_param(3), 64);
    let bad = LaunchAttributes::cluster(3, 1, 1);
    // SAFETY: refused before any driver call.
    let e = unsafe {
        reg.launch(
            f.raw(),
            cfg.with_attributes(bad),
            s,
            (&buf, &buf, &buf, 64u32),
        )
    }
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': launch not attempted, cluster x dimension 3 does not divide grid x \
         dimension 8: (grid=[8,2,1], block=[64,1,1], shared_mem=0 cluster=[3,1,1])"
    );
    drop((buf, f));
    done(reg);
}

fn kernel_attributes_occupancy_and_listing() {
    let reg = setup();
    let f = reg.function("kernels", "vec_add").unwrap();
    let a = f.attributes().unwrap();
    assert_eq!(
        (a.num_regs, a.ptx_version, a.max_dynamic_shared_bytes),
        (24, 90, 48 * 1024)
    );
    f.set_max_dynamic_shared_bytes(64 * 1024).unwrap();
    assert_eq!(f.attributes().unwrap().max_dynamic_shared_bytes, 64 * 1024);
    let e = f.set_max_dynamic_shared_bytes(1 << 20).unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': cuFuncSetAttribute failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
    );
    assert_eq!(f.max_active_blocks_per_sm(256, 0).unwrap(), 8);
    // The stand-in's model: 2048 threads per SM; with no shared memory the largest
    // block wins; when shared memory grows with the square of the block, 512.
    assert_eq!(f.potential_block_size(0).unwrap(), (1024, 264));
    extern "C" fn quadratic(block: std::ffi::c_int) -> usize {
        (block as usize * block as usize) / 8
    }
    assert_eq!(f.potential_block_size_with(quadratic).unwrap(), (512, 528));
    let names = reg.function_names("kernels").unwrap();
    assert_eq!(
        &names[..4],
        ["vec_add", "empty", "smem_check", "bump_counters"]
    );
    assert!(names.contains(&"layout_probe".to_owned()));
    drop(f);
    done(reg);
}

/// The parameter layout the driver reports, and typed launches checked against it
/// before the driver is called.
fn typed_launches_are_checked_against_the_parameter_layout() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "layout_probe").unwrap();
    let sizes: Vec<usize> = f.params().unwrap().iter().map(|p| p.size).collect();
    assert_eq!(sizes, [8, 4, 4, 3, 1, 8, 8]);
    let offsets: Vec<usize> = f.params().unwrap().iter().map(|p| p.offset).collect();
    assert_eq!(offsets, [0, 8, 12, 16, 19, 24, 32]);
    let p = DeviceBuffer::<f32>::alloc(s, 4).unwrap();
    let mut out = DeviceBuffer::<u32>::alloc(s, 8).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    let launches = fake().launches();
    // Wrong count.
    // SAFETY: refused before the driver (for every refused launch below).
    let e = unsafe { s.launch(&f, cfg, (&p, 4u32, 1.5f32)) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::layout_probe': launch not attempted, 3 argument(s) given, the kernel takes 7 parameter(s)"
    );
    assert!(matches!(
        e.kind(),
        ErrorKind::ArgumentMismatch {
            index: None,
            expected: 7,
            given: 3,
            ..
        }
    ));
    // A wrong size at each position.
    let rgb = [1u8, 2, 3];
    macro_rules! refused {
        ($args:expr) => {{
            // SAFETY: refused before the driver is called.
            unsafe { s.launch(&f, cfg, $args) }.unwrap_err()
        }};
    }
    let cases: Vec<(usize, MetraleError)> = vec![
        (
            0,
            refused!((4u32, 4u32, 1.5f32, rgb, 1u8, 2.0f64, &mut out)),
        ),
        (1, refused!((&p, 4u64, 1.5f32, rgb, 1u8, 2.0f64, &mut out))),
        (2, refused!((&p, 4u32, 1.5f64, rgb, 1u8, 2.0f64, &mut out))),
        (
            3,
            refused!((&p, 4u32, 1.5f32, [0u8; 4], 1u8, 2.0f64, &mut out)),
        ),
        (4, refused!((&p, 4u32, 1.5f32, rgb, 1u16, 2.0f64, &mut out))),
        (5, refused!((&p, 4u32, 1.5f32, rgb, 1u8, 2.0f32, &mut out))),
        (6, refused!((&p, 4u32, 1.5f32, rgb, 1u8, 2.0f64, 7u32))),
    ];
    let given = [4, 8, 8, 4, 2, 4, 4];
    for (i, e) in cases {
        assert_eq!(
            e.to_string(),
            format!(
                "kernel 'kernels::layout_probe': launch not attempted, argument {i} is {} bytes, \
                 the kernel's parameter {i} is {} bytes",
                given[i], sizes[i]
            )
        );
    }
    // A too-large struct for the 3-byte parameter.
    #[derive(Clone, Copy)]
    #[repr(C)]
    struct Big([u8; 24]);
    // SAFETY: a byte array: no padding.
    unsafe impl DeviceRepr for Big {}
    // SAFETY: as above.
    let e = unsafe {
        s.launch(
            &f,
            cfg,
            (&p, 4u32, 1.5f32, Big([0; 24]), 1u8, 2.0f64, &mut out),
        )
    }
    .unwrap_err();
    assert!(e
        .to_string()
        .ends_with("argument 3 is 24 bytes, the kernel's parameter 3 is 3 bytes"));
    assert_eq!(fake().launches(), launches, "nothing reached the driver");
    // The correct launch goes ahead, and its bytes arrive.
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg, (&p, 4u32, 1.5f32, rgb, 9u8, 2.5f64, &mut out)) }.unwrap();
    assert_eq!(fake().last_param(3) & 0xff_ffff, 0x03_0201);
    assert_eq!(fake().last_param(4) & 0xff, 9);
    assert_eq!(fake().last_param(5), 2.5f64.to_bits());
    drop((p, out, f));
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "launch::large_shared_memory_opts_in_once_per_kernel_and_size",
            run: large_shared_memory_opts_in_once_per_kernel_and_size,
        },
        Test {
            name: "launch::the_opt_in_record_follows_every_change_of_the_limit",
            run: the_opt_in_record_follows_every_change_of_the_limit,
        },
        Test {
            name: "launch::context_is_bound_on_a_fresh_thread_only_when_needed",
            run: context_is_bound_on_a_fresh_thread_only_when_needed,
        },
        Test {
            name: "launch::a_context_guard_restores_the_callers_context",
            run: a_context_guard_restores_the_callers_context,
        },
        Test {
            name: "launch::path_allocates_nothing",
            run: launch_path_allocates_nothing,
        },
        Test {
            name: "launch::extended_launch_passes_cluster_and_cooperative",
            run: extended_launch_passes_cluster_and_cooperative,
        },
        Test {
            name: "launch::kernel_attributes_occupancy_and_listing",
            run: kernel_attributes_occupancy_and_listing,
        },
        Test {
            name: "launch::typed_launches_are_checked_against_the_parameter_layout",
            run: typed_launches_are_checked_against_the_parameter_layout,
        },
    ]
}
