//! Hopper features on the real device: a 2-D TMA copy through a tensor map (the
//! hand-written PTX of `fixtures/tma.ptx`, sm_90a), and green contexts (the SM
//! split read back; a kernel's time on half the SMs; two halves side by side).

use std::sync::Arc;

use crate::common::*;
use crate::harness::{run_child, Child, Test};

pub static TMA_PTX: &[u8] = include_bytes!("../fixtures/tma.ptx");

/// Whether device 0 has the TMA (compute capability 9.0+); says so when not.
fn has_tma(reg: &MetraleRegistry) -> bool {
    let (major, _) = reg.host().limits().compute_capability;
    if major < 9 {
        eprintln!("skipped: the TMA needs compute capability 9.0 or newer");
    }
    major >= 9
}

/// Every element equal, or the first that is not (row, column), without
/// printing thousands of values.
fn check_copy(got: &[f32], want: &[f32], cols: usize, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element ({}, {}) is {}, expected {}",
            i / cols,
            i % cols,
            got[i],
            want[i]
        );
    }
}

/// A 64 x 96 f32 matrix copied tile by tile (32 x 32 boxes) through a tensor map,
/// then through the same map moved to another matrix by `replace_address`.
fn a_2d_tensor_map_copy_moves_every_tile() {
    let reg = registry();
    if !has_tma(&reg) {
        return;
    }
    let (rows, cols) = (64usize, 96usize);
    let tma = MetraleRegistry::load(0, &[("tma", TMA_PTX)]).unwrap();
    let f = tma.function("tma", "tma_copy_2d").unwrap();
    let s = reg.stream();
    let a = data(rows * cols, 7);
    let b = data(rows * cols, 8);
    let da = DeviceBuffer::from_host(s, &a).unwrap();
    let db = DeviceBuffer::from_host(s, &b).unwrap();
    let mut out = DeviceBuffer::<f32>::alloc(s, rows * cols).unwrap();
    let map = TensorMap::tiled(&da)
        .dims(&[cols as u64, rows as u64])
        .strides(&[(cols * 4) as u64])
        .box_dims(&[32, 32])
        .encode()
        .unwrap();
    let cfg =
        LaunchConfig::new(((cols / 32) as u32, (rows / 32) as u32, 1), (128, 1, 1), 0).unwrap();
    s.memset_u32(&mut out, f32::NAN.to_bits()).unwrap();
    // SAFETY: tma_copy_2d(map, float*, unsigned width) writes rows x cols floats of
    // `out`; the map covers `da`, which outlives the launch (the stream is waited).
    unsafe { s.launch(&f, cfg, (&map, &mut out, cols as u32)) }.unwrap();
    check_copy(
        &s.to_vec(&out).unwrap(),
        &a,
        cols,
        "the copy through the map",
    );
    if let Some(layout) = f.params() {
        assert_eq!(layout.first().map(|p| p.size), Some(128), "{layout:?}");
    }

    let moved = map.replace_address(&db).unwrap();
    s.memset_u32(&mut out, f32::NAN.to_bits()).unwrap();
    // SAFETY: as above, the map now covering `db`.
    unsafe { s.launch(&f, cfg, (&moved, &mut out, cols as u32)) }.unwrap();
    check_copy(
        &s.to_vec(&out).unwrap(),
        &b,
        cols,
        "the copy after replace_address",
    );

    let mut moved = moved;
    moved.set_address(&da).unwrap();
    s.memset_u32(&mut out, f32::NAN.to_bits()).unwrap();
    // SAFETY: as above, the map covering `da` again.
    unsafe { s.launch(&f, cfg, (&moved, &mut out, cols as u32)) }.unwrap();
    check_copy(
        &s.to_vec(&out).unwrap(),
        &a,
        cols,
        "the copy after set_address",
    );
}

/// The same copy over memory metrale did not allocate (raw `cuMemAlloc`
/// through the sys table, as another library would): the tensor map and the
/// output are foreign views (issue 35, item 1).
fn a_tensor_map_over_foreign_memory_copies_every_tile() {
    let reg = registry();
    if !has_tma(&reg) {
        return;
    }
    let (rows, cols) = (64usize, 96usize);
    let tma = MetraleRegistry::load(0, &[("tma", TMA_PTX)]).unwrap();
    let f = tma.function("tma", "tma_copy_2d").unwrap();
    let s = reg.stream();
    let ctx = reg.ctx();
    let a = data(rows * cols, 11);
    let bytes = rows * cols * 4;
    let d = sys::driver().unwrap();
    ctx.bind().unwrap();
    let (mut pa, mut pout): (sys::CUdeviceptr, sys::CUdeviceptr) = (0, 0);
    // SAFETY: each writes one address; the context is current.
    unsafe {
        assert!(d.cuMemAlloc_v2().unwrap()(&mut pa, bytes).is_success());
        assert!(d.cuMemAlloc_v2().unwrap()(&mut pout, bytes).is_success());
    }
    {
        // SAFETY: both allocations stay alive, used only through these views,
        // until they are freed below after the stream's work.
        let mut fa = unsafe { DeviceSliceMut::<f32>::from_raw_mut(ctx, pa, rows * cols) }.unwrap();
        // SAFETY: as above.
        let mut fout =
            unsafe { DeviceSliceMut::<f32>::from_raw_mut(ctx, pout, rows * cols) }.unwrap();
        s.copy_h2d(&a, &mut fa).unwrap();
        let src = fa.slice(..).unwrap();
        let map = TensorMap::tiled(&src)
            .dims(&[cols as u64, rows as u64])
            .strides(&[(cols * 4) as u64])
            .box_dims(&[32, 32])
            .encode()
            .unwrap();
        assert_eq!(map.address(), pa);
        let cfg =
            LaunchConfig::new(((cols / 32) as u32, (rows / 32) as u32, 1), (128, 1, 1), 0).unwrap();
        s.memset_u32(&mut fout, f32::NAN.to_bits()).unwrap();
        // SAFETY: tma_copy_2d writes rows x cols floats of `fout` through a map
        // over `fa`; both outlive the launch (the stream is waited below).
        unsafe { s.launch(&f, cfg, (&map, &mut fout, cols as u32)) }.unwrap();
        check_copy(
            &s.to_vec(&fout).unwrap(),
            &a,
            cols,
            "the copy through a map over foreign memory",
        );
        // Past the allocation: refused by the driver's own range.
        // SAFETY: refused before any view exists.
        let e = unsafe { DeviceSlice::<f32>::from_raw(ctx, pa + 4, rows * cols) }.unwrap_err();
        assert!(e.to_string().contains("run past the allocation"), "{e}");
    }
    s.synchronize().unwrap();
    ctx.bind().unwrap();
    // SAFETY: the allocations made above, freed once, after the stream's work.
    unsafe {
        assert!(d.cuMemFree_v2().unwrap()(pa).is_success());
        assert!(d.cuMemFree_v2().unwrap()(pout).is_success());
    }
}

/// The same copy with the map passed by value in a run-time argument list.
fn a_tensor_map_in_a_run_time_list_copies_every_tile() {
    let reg = registry();
    if !has_tma(&reg) {
        return;
    }
    let (rows, cols) = (64usize, 96usize);
    let tma = MetraleRegistry::load(0, &[("tma", TMA_PTX)]).unwrap();
    let f = tma.function("tma", "tma_copy_2d").unwrap();
    let s = reg.stream();
    let a = data(rows * cols, 9);
    let da = DeviceBuffer::from_host(s, &a).unwrap();
    let mut out = DeviceBuffer::<f32>::alloc(s, rows * cols).unwrap();
    let map = TensorMap::tiled(&da)
        .dims(&[cols as u64, rows as u64])
        .strides(&[(cols * 4) as u64])
        .box_dims(&[32, 32])
        .encode()
        .unwrap();
    let cfg =
        LaunchConfig::new(((cols / 32) as u32, (rows / 32) as u32, 1), (128, 1, 1), 0).unwrap();
    s.memset_u32(&mut out, f32::NAN.to_bits()).unwrap();
    let mut args = KernelArgList::new();
    args.push_tensor_map(&map).push(&mut out).push(cols as u32);
    // SAFETY: as in the tuple test: tma_copy_2d writes rows x cols floats of `out`
    // through a map over `da`; both outlive the launch (the stream is waited).
    unsafe { s.launch(&f, cfg, &args) }.unwrap();
    drop(args);
    check_copy(
        &s.to_vec(&out).unwrap(),
        &a,
        cols,
        "the copy through a map in a list",
    );
}

/// The real driver agrees with the checks: what they accept it encodes, and the
/// bytes are a map (not all zeros).
fn the_driver_encodes_what_the_checks_accept() {
    let reg = registry();
    if !has_tma(&reg) {
        return;
    }
    let s = reg.stream();
    let buf = DeviceBuffer::<u16>::alloc(s, 8 * 16 * 128).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[128, 16, 8])
        .box_dims(&[64, 16, 2])
        .swizzle(Swizzle::B128)
        .l2_promotion(L2Promotion::B128)
        .encode()
        .unwrap();
    assert!(map.as_raw().opaque.iter().any(|&q| q != 0));
    let flat = TensorMap::tiled(&buf).box_dims(&[256]).encode().unwrap();
    assert!(flat.as_raw().opaque.iter().any(|&q| q != 0));
    // An im2col map of NHWC f32 (2 images, 8 x 8 pixels, 16 channels), the box of
    // a 3 x 3 convolution with padding 1.
    let nhwc = DeviceBuffer::<f32>::alloc(s, 2 * 8 * 8 * 16).unwrap();
    let im2col = TensorMap::tiled(&nhwc)
        .dims(&[16, 8, 8, 2])
        .im2col(&[-1, -1], &[-1, -1], 16, 64)
        .encode()
        .unwrap();
    assert!(im2col.as_raw().opaque.iter().any(|&q| q != 0));
}

/// The packed sub-byte types, the 128-byte atom swizzles and wide im2col maps
/// need compute capability 10.0: on a 9.x device (the H200) each is refused with
/// the typed error before the driver; on 10.0+ they encode. `as_bytes` is the
/// map's 128 bytes after an encode.
fn compute_capability_10_features_and_as_bytes() {
    let reg = registry();
    if !has_tma(&reg) {
        return;
    }
    let s = reg.stream();
    let bytes = DeviceBuffer::<u8>::alloc(s, 64 * 64).unwrap();
    let buf = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[64, 64])
        .box_dims(&[32, 32])
        .swizzle(Swizzle::B128)
        .encode()
        .unwrap();
    let want: Vec<u8> = map
        .as_raw()
        .opaque
        .iter()
        .flat_map(|q| q.to_ne_bytes())
        .collect();
    assert_eq!(&map.as_bytes()[..], &want[..]);
    assert!(map.as_bytes().iter().any(|&b| b != 0));

    let cc = reg.host().limits().compute_capability;
    let new_ok = cc >= (10, 0) && reg.host().driver_version() >= 12080;
    let packed = |t| {
        TensorMap::tiled(&bytes)
            .data_type(t)
            .dims(&[128, 32])
            .strides(&[128])
            .box_dims(&[128, 4])
    };
    let attempts = [
        (
            "16U4_ALIGN8B",
            TensorMap::tiled(&bytes)
                .data_type(TensorDataType::U4x16Align8)
                .dims(&[128, 64])
                .strides(&[64])
                .box_dims(&[32, 8])
                .encode(),
        ),
        (
            "16U4_ALIGN16B",
            packed(TensorDataType::U4x16Align16).encode(),
        ),
        (
            "16U6_ALIGN16B",
            packed(TensorDataType::U6x16Align16).encode(),
        ),
    ];
    let swizzles = [
        Swizzle::B128Atom32,
        Swizzle::B128Atom32Flip8,
        Swizzle::B128Atom64,
    ]
    .map(|sw| {
        TensorMap::tiled(&buf)
            .dims(&[64, 64])
            .box_dims(&[32, 32])
            .swizzle(sw)
            .encode()
    });
    let wide = TensorMap::tiled(&buf)
        .dims(&[64, 32, 2])
        .swizzle(Swizzle::B128)
        .encode_im2col_wide(-1, 1, 32, 64, Im2colWideMode::W);
    // Each attempt's answer: whether the encoded bytes are not all zero.
    let nonzero = |m: TensorMap<'_, u8>| m.as_bytes().iter().any(|&b| b != 0);
    let mut all: Vec<Result<bool>> = attempts.into_iter().map(|(_, r)| r.map(nonzero)).collect();
    all.extend(
        swizzles
            .into_iter()
            .map(|r| r.map(|m| m.as_bytes().iter().any(|&b| b != 0))),
    );
    all.push(wide.map(|m| m.as_bytes().iter().any(|&b| b != 0)));
    for (k, r) in all.into_iter().enumerate() {
        match r {
            Ok(nonzero) => {
                assert!(new_ok, "attempt {k} encoded on compute capability {cc:?}");
                assert!(nonzero, "attempt {k}");
            }
            Err(e) => {
                assert!(
                    !new_ok,
                    "attempt {k} refused on compute capability {cc:?}: {e}"
                );
                assert!(
                    matches!(
                        e.kind(),
                        ErrorKind::FeatureUnavailable { needs: (10, 0), .. }
                    ),
                    "attempt {k}: {e}"
                );
            }
        }
    }
}

/// Two green contexts of half the device's SMs each (rounded down to the
/// driver's alignment), or `None` with the reason said when the driver lacks them.
fn halves(reg: &MetraleRegistry) -> Option<(SmSplit, Arc<GreenContext>, Arc<GreenContext>)> {
    let all = match SmResource::of_device(reg.host().context()) {
        Ok(all) => all,
        Err(e) if matches!(e.kind(), ErrorKind::MissingSymbol { .. }) => {
            eprintln!("skipped: {e}");
            return None;
        }
        Err(e) => panic!("{e}"),
    };
    let align = all.coscheduled_alignment().max(1);
    let half = all.sm_count() / 2 / align * align;
    let split = all.split_by_count(2, half).unwrap();
    assert_eq!(split.groups.len(), 2, "{split:?}");
    let a = GreenContext::new(&[&split.groups[0]]).unwrap();
    let b = GreenContext::new(&[&split.groups[1]]).unwrap();
    Some((split, a, b))
}

fn green_contexts_split_the_device_and_read_their_sms_back() {
    let reg = registry();
    let Some((split, a, b)) = halves(&reg) else {
        return;
    };
    let all = SmResource::of_device(reg.host().context()).unwrap();
    eprintln!(
        "    {} SMs: groups of {} and {}, {} left (min partition {}, alignment {})",
        all.sm_count(),
        split.groups[0].sm_count(),
        split.groups[1].sm_count(),
        split.remaining.sm_count(),
        all.min_partition_size(),
        all.coscheduled_alignment()
    );
    for g in &split.groups {
        assert!(g.sm_count() >= split.min_count);
    }
    assert_eq!(
        split.groups[0].sm_count() + split.groups[1].sm_count() + split.remaining.sm_count(),
        all.sm_count()
    );
    assert_eq!(a.sm_count().unwrap(), split.groups[0].sm_count());
    assert_eq!(b.sm_count().unwrap(), split.groups[1].sm_count());
}

/// `blocks` blocks of `spin(cycles)`, one block per SM at a time (the dynamic
/// shared memory of a block is more than half an SM's), on each stream, timed
/// from `main` with events the others join; milliseconds.
fn waves(
    reg: &MetraleRegistry,
    main: &CudaStream,
    streams: &[&CudaStream],
    blocks: u32,
    cycles: u64,
) -> f32 {
    let f = reg.function("kernels", "spin").unwrap();
    let mut done = DeviceBuffer::<u32>::zeroed(main, 1).unwrap();
    let (start, end) = (
        CudaEvent::timed(reg.ctx()).unwrap(),
        CudaEvent::timed(reg.ctx()).unwrap(),
    );
    let fork = CudaEvent::new(reg.ctx()).unwrap();
    let smem = reg.host().limits().max_shared_per_block_optin / 2 + 1024;
    let cfg = LaunchConfig::new((blocks, 1, 1), (32, 1, 1), smem).unwrap();
    start.record(main).unwrap();
    fork.record(main).unwrap();
    for s in streams {
        s.wait(&fork).unwrap();
        // SAFETY: spin(unsigned long long, unsigned*) adds one to done[0] per launch.
        unsafe { s.launch(&f, cfg, (cycles, &mut done)) }.unwrap();
        let joined = CudaEvent::new(reg.ctx()).unwrap();
        joined.record(s).unwrap();
        main.wait(&joined).unwrap();
    }
    end.record(main).unwrap();
    end.synchronize().unwrap();
    assert_eq!(main.to_vec(&done).unwrap()[0], streams.len() as u32);
    start.elapsed_ms(&end).unwrap()
}

fn a_kernel_on_half_the_sms_takes_two_waves_and_two_halves_run_side_by_side() {
    let reg = registry();
    let Some((split, a, b)) = halves(&reg) else {
        return;
    };
    let g = split.groups[0].sm_count().min(split.groups[1].sm_count());
    let main = CudaStream::new(reg.ctx()).unwrap();
    let (sa, sb) = (
        CudaStream::on_green_context(&a).unwrap(),
        CudaStream::on_green_context(&b).unwrap(),
    );
    let cycles = cycles_per_ms(&reg) * 20;
    waves(&reg, &main, &[&main], 2 * g, cycles / 10); // warm up
                                                      // 2g blocks: one wave on the whole device, two on a half.
    let whole = waves(&reg, &main, &[&main], 2 * g, cycles);
    let half = waves(&reg, &main, &[&sa], 2 * g, cycles);
    // g blocks on each half at once: one wave each, side by side.
    let one = waves(&reg, &main, &[&sa], g, cycles);
    let both = waves(&reg, &main, &[&sa, &sb], g, cycles);
    eprintln!(
        "    {}-block spin: whole device {whole:.2} ms, half {half:.2} ms; {g} blocks on one \
         half {one:.2} ms, on both halves {both:.2} ms",
        2 * g
    );
    assert!(whole > 15.0, "the spin ran {whole} ms");
    assert!(
        half > 1.6 * whole && half < 2.6 * whole,
        "{half} ms on half the SMs is not about two waves of {whole} ms"
    );
    assert!(
        both < 1.5 * one,
        "{both} ms for two halves is not under 1.5 x {one} ms"
    );
}

/// Green contexts and their streams dropped after an outside reset of the primary
/// context: no crash, at most the one "reset outside metrale" line.
fn green_contexts_dropped_after_a_reset_are_quiet() {
    let out = run_child("green_drop_after_ctx_reset", &[]);
    assert!(out.status.success(), "{out:?}");
    eprintln!("    {}", String::from_utf8_lossy(&out.stdout).trim());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.lines().count() <= 1, "at most one line: {err}");
    assert!(
        err.is_empty()
            || err.starts_with("metrale: device 0: the context was reset outside metrale"),
        "{err}"
    );
}

fn child_green_drop_after_ctx_reset() {
    let reg = registry();
    let Some((_split, a, b)) = halves(&reg) else {
        println!("green contexts: not supported by this driver");
        return;
    };
    let s = CudaStream::on_green_context(&a).unwrap();
    let buf = DeviceBuffer::<f32>::zeroed(&s, 1000).unwrap();
    s.synchronize().unwrap();
    let h = Arc::clone(reg.host());
    let d = sys::driver().unwrap();
    // SAFETY: resets the device's primary context; the handles above die with it.
    let status = unsafe { (d.cuDevicePrimaryCtxReset_v2().unwrap())(h.ctx().device()) };
    println!("green contexts: cuDevicePrimaryCtxReset {status}");
    drop((buf, s, a, b, reg));
    release(0);
    drop(h);
}

pub fn children() -> Vec<Child> {
    vec![Child {
        name: "green_drop_after_ctx_reset",
        run: child_green_drop_after_ctx_reset,
    }]
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "hopper::a_2d_tensor_map_copy_moves_every_tile",
            run: a_2d_tensor_map_copy_moves_every_tile,
        },
        Test {
            name: "hopper::a_tensor_map_over_foreign_memory_copies_every_tile",
            run: a_tensor_map_over_foreign_memory_copies_every_tile,
        },
        Test {
            name: "hopper::a_tensor_map_in_a_run_time_list_copies_every_tile",
            run: a_tensor_map_in_a_run_time_list_copies_every_tile,
        },
        Test {
            name: "hopper::the_driver_encodes_what_the_checks_accept",
            run: the_driver_encodes_what_the_checks_accept,
        },
        Test {
            name: "hopper::compute_capability_10_features_and_as_bytes",
            run: compute_capability_10_features_and_as_bytes,
        },
        Test {
            name: "hopper::green_contexts_dropped_after_a_reset_are_quiet",
            run: green_contexts_dropped_after_a_reset_are_quiet,
        },
        Test {
            name: "hopper::green_contexts_split_the_device_and_read_their_sms_back",
            run: green_contexts_split_the_device_and_read_their_sms_back,
        },
        Test {
            name:
                "hopper::a_kernel_on_half_the_sms_takes_two_waves_and_two_halves_run_side_by_side",
            run: a_kernel_on_half_the_sms_takes_two_waves_and_two_halves_run_side_by_side,
        },
    ]
}
