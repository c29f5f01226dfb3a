//! The registry's contract on the GPU: blob kinds, lookups, symbols, shared memory,
//! copies, bad input, several registries and threads, clusters, attributes, the raw
//! path, faults and teardown.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::harness::{run_child, Child, Test};

fn ptx_cubin_and_fatbin_each_run_vec_add() {
    let reg =
        MetraleRegistry::load(0, &[("ptx", PTX), ("cubin", CUBIN), ("fatbin", FATBIN)]).unwrap();
    assert_eq!(reg.module_kind("ptx"), Some(BlobKind::Ptx));
    assert_eq!(reg.module_kind("cubin"), Some(BlobKind::Cubin));
    assert_eq!(reg.module_kind("fatbin"), Some(BlobKind::Fatbin));
    for (i, module) in ["ptx", "cubin", "fatbin"].into_iter().enumerate() {
        check_vec_add(&reg, module, 1 << 20, i as u32);
    }
}

fn function_lookup_memoized_and_not() {
    let reg = registry();
    let cache = OnceLock::new();
    let f1 = reg
        .raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    let f2 = reg
        .raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    assert_eq!(f1, f2);
    assert_eq!(reg.function("kernels", "vec_add").unwrap().raw(), f1);
    let typed = OnceLock::new();
    let t = reg.function_cached(&typed, "kernels", "empty").unwrap();
    assert_eq!(
        reg.function_cached(&typed, "kernels", "empty")
            .unwrap()
            .raw(),
        t.raw()
    );
    assert_ne!(t.raw(), f1);
    check_vec_add(&reg, "kernels", 1000, 7);
}

fn device_symbol_round_trip_by_mangled_name() {
    let reg = registry();
    let s = reg.stream();
    let (ptr, bytes) = reg.device_symbol("kernels", COUNTERS).unwrap();
    assert_eq!(bytes, 64);
    let start: Vec<u32> = (0..16).map(|i| 1000 + i * 17).collect();
    // SAFETY: the symbol holds 64 bytes; `start` outlives the synchronisation.
    unsafe { reg.copy_h2d_async(ptr, start.as_ptr().cast(), 64, s) }.unwrap();
    let f = reg.function("kernels", "bump_counters").unwrap().raw();
    let cfg = LaunchConfig::new((1, 1, 1), (16, 1, 1), 0).unwrap();
    // SAFETY: bump_counters(unsigned).
    unsafe { reg.launch(f, cfg, s, (5u32,)) }.unwrap();
    let mut back = vec![0u32; 16];
    // SAFETY: as above; `back` is not touched until the synchronisation.
    unsafe { reg.copy_d2h_async(back.as_mut_ptr().cast(), ptr, 64, s) }.unwrap();
    reg.stream_synchronize(s).unwrap();
    let want: Vec<u32> = (0..16).map(|i| 1000 + i * 17 + 5 * (i + 1)).collect();
    assert_eq!(back, want);
}

fn smem_expected(words: u32, block: u32) -> u32 {
    (0..words).fold(0u32, |s, w| {
        s.wrapping_add(w.wrapping_mul(2_654_435_761).wrapping_add(block))
    })
}

fn shared_memory_100_kib_launch() {
    let reg = registry();
    let s = reg.stream();
    let f = reg.function("kernels", "smem_check").unwrap();
    let bytes = 100 * 1024;
    let words = bytes / 4;
    let mut out = DeviceBuffer::<u32>::zeroed(s, 8).unwrap();
    let cfg = LaunchConfig::new((4, 1, 1), (256, 1, 1), bytes).unwrap();
    // SAFETY: smem_check(unsigned*, unsigned) with 4 blocks writing out[0..8].
    unsafe { s.launch(&f, cfg, (&mut out, words)) }.unwrap();
    let got = s.to_vec(&out).unwrap();
    for block in 0..4u32 {
        assert_eq!(got[2 * block as usize], 0, "mismatches in block {block}");
        assert_eq!(
            got[2 * block as usize + 1],
            smem_expected(words, block),
            "sum in block {block}"
        );
    }
    assert!(f.attributes().unwrap().max_dynamic_shared_bytes >= bytes as i32);
    // Lowering the limit behind the launch's back: the next launch opts in again.
    f.set_max_dynamic_shared_bytes(0).unwrap();
    s.zero(&mut out).unwrap();
    // SAFETY: as above.
    unsafe { s.launch(&f, cfg, (&mut out, words)) }.unwrap();
    assert_eq!(s.to_vec(&out).unwrap()[1], smem_expected(words, 0));
}

fn shared_memory_beyond_the_device_limit_fails_clearly() {
    let reg = registry();
    let limit = reg.host().limits().max_shared_per_block_optin;
    let f = reg.function("kernels", "smem_check").unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(reg.stream(), 2).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (256, 1, 1), limit + 1024).unwrap();
    // SAFETY: refused before the driver.
    let e = unsafe { reg.stream().launch(&f, cfg, (&mut out, 16u32)) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "kernel 'kernels::smem_check': launch not attempted, dynamic shared memory above the \
             device's opt-in limit of {limit} bytes: (grid=[1,1,1], block=[256,1,1], shared_mem={})",
            limit + 1024
        )
    );
    // The driver's own refusal of the opt-in names the kernel and the status.
    let e = f.set_max_dynamic_shared_bytes(limit + 1024).unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::smem_check': cuFuncSetAttribute failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument"
    );
}

fn pinned_copies_sync_async_and_raw() {
    let reg = registry();
    let s = reg.stream();
    let n = 16 << 20;
    let mut src = PinnedBuffer::<u32>::zeroed(s, n).unwrap();
    for (i, x) in src.iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(2_654_435_761);
    }
    let mut dev = DeviceBuffer::<u32>::alloc(s, n).unwrap();
    // The seed's raw path.
    let mut dst = PinnedBuffer::<u32>::zeroed(s, n).unwrap();
    let bytes = src.byte_len();
    // SAFETY: both pinned buffers and the device buffer hold `bytes`; nothing touches
    // them until the synchronisation.
    unsafe {
        reg.copy_h2d_async(dev.device_ptr(), src.as_ptr().cast(), bytes, s)
            .unwrap();
        reg.copy_d2h_async(dst.as_mut_ptr().cast(), dev.device_ptr(), bytes, s)
            .unwrap();
    }
    reg.stream_synchronize(s).unwrap();
    assert!(src.iter().zip(dst.iter()).all(|(a, b)| a == b));
    // Async, owned by the pending copies.
    s.zero(&mut dev).unwrap();
    let up = s.copy_h2d_pinned(src, &mut dev).unwrap();
    let down = s.copy_d2h_pinned(&dev, dst).unwrap();
    let dst = down.wait().unwrap();
    let src = up.wait().unwrap();
    assert!(src.iter().zip(dst.iter()).all(|(a, b)| a == b));
    // Sync copies of pageable memory.
    let v: Vec<u32> = (0..1000).collect();
    let mut small = DeviceBuffer::<u32>::alloc(s, 1000).unwrap();
    s.copy_h2d(&v, &mut small).unwrap();
    assert_eq!(s.to_vec(&small).unwrap(), v);
}

fn bad_inputs_give_named_errors_and_the_registry_still_works() {
    let reg = registry();
    let check = |what: &str| check_vec_add(&reg, "kernels", 4096, what.len() as u32);

    let garbage: &[u8] = &[0x13, 0x37, 0xff, 0x00, 0x42, 0x99, 0x10, 0x20];
    let e = MetraleRegistry::load(0, &[("garbage", garbage)]).unwrap_err();
    assert!(
        e.to_string().starts_with("garbage: PTX is not valid UTF-8"),
        "{e}"
    );
    check("garbage");

    let e = MetraleRegistry::load(0, &[("half", &CUBIN[..CUBIN.len() / 2])]).unwrap_err();
    assert!(e.to_string().starts_with("half: malformed cubin:"), "{e}");
    check("truncated");

    let broken = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k() { bogus_instruction; }\n";
    let e = MetraleRegistry::load(0, &[("broken", broken)]).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("broken: cuModuleLoadDataEx failed: CUDA_ERROR_INVALID_PTX (218): "),
        "{text}"
    );
    assert!(
        text.contains("\nJIT error log:\n") && text.contains("ptxas"),
        "{text}"
    );
    eprintln!("    JIT error text: {}", text.replace('\n', "\n    | "));
    check("syntax");

    let e = MetraleRegistry::load(0, &[("latin1", b".version 8.0 // caf\xe9\n")]).unwrap_err();
    assert!(
        e.to_string().starts_with("latin1: PTX is not valid UTF-8"),
        "{e}"
    );

    // A cubin whose header claims another architecture.
    let mut sm80 = CUBIN.to_vec();
    let flags = u32::from_le_bytes(sm80[0x30..0x34].try_into().unwrap());
    let patched = (flags & !0xff00) | (80 << 8);
    sm80[0x30..0x34].copy_from_slice(&patched.to_le_bytes());
    match MetraleRegistry::load_into(Arc::clone(reg.host()), &[("sm80", &sm80)]) {
        Err(e) => {
            eprintln!("    wrong-architecture cubin: {e}");
            assert!(
                e.to_string()
                    .contains("the cubin was built for sm_80, the device is sm_90"),
                "{e}"
            );
        }
        Ok(_) => panic!("the driver accepted a cubin marked sm_80 on an sm_90 device"),
    }

    assert_eq!(
        reg.function("nope", "vec_add").unwrap_err().to_string(),
        "Module 'nope' not loaded (looking up 'nope::vec_add')"
    );
    let e = reg.function("kernels", "no_such_kernel").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::no_such_kernel: cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND (500): named symbol not found"
    );
    let e = reg
        .device_symbol("kernels", "_ZN12metrale_test\0x")
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::_ZN12metrale_test\\0x: name has an interior NUL byte at offset 17"
    );
    let f = reg.function("kernels", "vec_add").unwrap();
    let out = DeviceBuffer::<f32>::alloc(reg.stream(), 4).unwrap();
    // Above the H200's opt-in shared memory: refused at launch.
    let impossible = LaunchConfig::new((1, 1, 1), (1, 1, 1), 0)
        .unwrap()
        .with_shared_mem(1 << 20);
    // SAFETY: refused before the driver.
    let e = unsafe {
        reg.stream()
            .launch(&f, impossible, (&out, &out, &out, 4u32))
    }
    .unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::KernelLaunch {
                failure: LaunchFailure::Refused(_),
                ..
            }
        ),
        "{e}"
    );
    check("launch");
}

fn two_registries_share_one_host() {
    let a = registry();
    let b = MetraleRegistry::load(0, &[("other", CUBIN)]).unwrap();
    assert!(Arc::ptr_eq(a.host(), b.host()));
    assert!(Arc::ptr_eq(a.host(), &host(0).unwrap()));
    check_vec_add(&a, "kernels", 10_000, 1);
    check_vec_add(&b, "other", 10_000, 2);
    drop(a);
    check_vec_add(&b, "other", 10_000, 3);
}

fn eight_threads_at_once() {
    let reg = registry();
    let cache: Arc<OnceLock<RawCudaFunc>> = Arc::new(OnceLock::new());
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let reg = Arc::clone(&reg);
            let cache = Arc::clone(&cache);
            std::thread::spawn(move || {
                let s = reg.stream();
                for round in 0..20u32 {
                    let n = 10_000 + (t * 1000 + round) as usize;
                    let f = reg
                        .raw_function_cached(&cache, "kernels", "vec_add")
                        .unwrap();
                    let (a, b) = (data(n, t * 100 + round), data(n, t * 100 + round + 50));
                    let da = DeviceBuffer::from_host(s, &a).unwrap();
                    let db = DeviceBuffer::from_host(s, &b).unwrap();
                    let mut dc = DeviceBuffer::<f32>::alloc(s, n).unwrap();
                    let cfg = LaunchConfig::for_num_elems(n, 128).unwrap();
                    // SAFETY: vec_add over n elements of live buffers.
                    unsafe { reg.launch(f, cfg, s, (&da, &db, &mut dc, n as u32)) }.unwrap();
                    let c = s.to_vec(&dc).unwrap();
                    assert!(
                        (0..n).all(|i| c[i] == a[i] + b[i]),
                        "thread {t} round {round}"
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

fn cluster_launch_with_distributed_shared_memory() {
    let reg = registry();
    let s = reg.stream();
    assert!(reg.host().limits().cluster_launch);
    let f = reg.function("kernels", "cluster_ranks").unwrap();
    let blocks = 16u32;
    let mut out = DeviceBuffer::from_host(s, &vec![u32::MAX; blocks as usize]).unwrap();
    let cfg = LaunchConfig::new((blocks, 1, 1), (32, 1, 1), 0).unwrap();
    let attrs = LaunchAttributes::cluster(4, 1, 1);
    // SAFETY: cluster_ranks(unsigned*) writes out[0..blocks].
    unsafe { s.launch(&f, cfg.with_attributes(attrs), (&mut out,)) }.unwrap();
    let got = s.to_vec(&out).unwrap();
    for (b, v) in got.iter().enumerate() {
        let rank = b as u32 % 4;
        assert_eq!(*v, rank | ((rank + 1) % 4) << 8 | 4 << 16, "block {b}");
    }
    // SAFETY: refused before any driver call.
    let e = unsafe { s.launch(&f, cfg.with_cluster(3, 1, 1), (&mut out,)) }.unwrap_err();
    assert!(
        e.to_string()
            .contains("cluster x dimension 3 does not divide grid x dimension 16"),
        "{e}"
    );
    // Cooperative and programmatic launches of an ordinary kernel.
    let coop = LaunchAttributes::cooperative();
    let vec_add = reg.function("kernels", "vec_add").unwrap().raw();
    let n = 4096u32;
    let (a, b) = (data(n as usize, 1), data(n as usize, 2));
    let (da, db) = (
        DeviceBuffer::from_host(s, &a).unwrap(),
        DeviceBuffer::from_host(s, &b).unwrap(),
    );
    let mut dc = DeviceBuffer::<f32>::alloc(s, n as usize).unwrap();
    let cfg = LaunchConfig::for_num_elems(n as usize, 256).unwrap();
    // SAFETY: vec_add over n elements.
    unsafe {
        reg.launch(
            vec_add,
            cfg.with_attributes(coop)
                .with_programmatic_serialization(true),
            s,
            (&da, &db, &mut dc, n),
        )
    }
    .unwrap();
    let c = s.to_vec(&dc).unwrap();
    assert!((0..n as usize).all(|i| c[i] == a[i] + b[i]));
}

fn kernel_attributes_occupancy_and_listing() {
    let reg = registry();
    let f = reg.function("kernels", "vec_add").unwrap();
    let a = f.attributes().unwrap();
    eprintln!("    vec_add attributes: {a:?}");
    assert!(a.num_regs > 0 && a.max_threads_per_block >= 256);
    assert_eq!(a.ptx_version, 90);
    assert_eq!(a.binary_version, 90);
    assert_eq!(a.max_dynamic_shared_bytes, 48 * 1024);
    let blocks = f.max_active_blocks_per_sm(256, 0).unwrap();
    assert!((1..=32).contains(&blocks), "{blocks}");
    let (block, grid) = f.potential_block_size(0).unwrap();
    assert!((32..=1024).contains(&block) && grid >= 1, "{block} {grid}");
    extern "C" fn four_bytes_per_thread(block: std::ffi::c_int) -> usize {
        block as usize * 4
    }
    let smem = reg.function("kernels", "smem_check").unwrap();
    let (b2, g2) = smem
        .potential_block_size_with(four_bytes_per_thread)
        .unwrap();
    eprintln!(
        "    potential block size: vec_add {block} x {grid}; smem_check (4 B/thread) {b2} x {g2}"
    );
    assert!((32..=1024).contains(&b2) && g2 >= 1, "{b2} {g2}");
    f.set_preferred_carveout(50).unwrap();
    assert_eq!(f.attributes().unwrap().preferred_carveout, 50);
    let mut names = reg.function_names("kernels").unwrap();
    names.sort();
    for k in [
        "bump_counters",
        "cluster_ranks",
        "empty",
        "smem_check",
        "vec_add",
        "axpb",
        "layout_probe",
    ] {
        assert!(names.iter().any(|n| n == k), "{k} in {names:?}");
    }
}

fn vec_add_cubin_via_raw_params() {
    // The seed's raw path: a hand-built void* array.
    let reg = MetraleRegistry::load(0, &[("cubin", CUBIN)]).unwrap();
    let s = reg.stream();
    let n = 1000usize;
    let (a, b) = (data(n, 9), data(n, 10));
    let (da, db) = (
        DeviceBuffer::from_host(s, &a).unwrap(),
        DeviceBuffer::from_host(s, &b).unwrap(),
    );
    let dc = DeviceBuffer::<f32>::alloc(s, n).unwrap();
    let (pa, pb, pc, nn) = (da.device_ptr(), db.device_ptr(), dc.device_ptr(), n as u32);
    let mut params: [*mut c_void; 4] = [
        (&pa as *const u64).cast_mut().cast(),
        (&pb as *const u64).cast_mut().cast(),
        (&pc as *const u64).cast_mut().cast(),
        (&nn as *const u32).cast_mut().cast(),
    ];
    let cache = OnceLock::new();
    let f = reg.raw_function_cached(&cache, "cubin", "vec_add").unwrap();
    let cfg = LaunchConfig::for_num_elems(nn as usize, 128).unwrap();
    // SAFETY: params match vec_add's signature and outlive the call.
    unsafe { reg.launch_on_stream(f, cfg, s, &mut params) }.unwrap();
    reg.stream_synchronize(s).unwrap();
    let c = s.to_vec(&dc).unwrap();
    assert!((0..n).all(|i| c[i] == a[i] + b[i]));
}

fn illegal_address_is_reported_in_a_child_without_hanging() {
    let t0 = Instant::now();
    let out = run_child("illegal_address", &[]);
    assert!(t0.elapsed() < Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {out:?}");
    assert!(
        stdout
            .contains("synchronize: cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)"),
        "{stdout}"
    );
    eprintln!("    child said: {}", stdout.trim());
}

fn child_illegal_address() {
    let reg = registry();
    let s = reg.stream();
    let f = reg.function("kernels", "write_illegal").unwrap();
    let mut out = DeviceBuffer::<u32>::alloc(s, 1).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (1, 1, 1), 0).unwrap();
    // SAFETY: the kernel faults on purpose; the fault is reported by the sync.
    unsafe { s.launch(&f, cfg, (&mut out,)) }.unwrap();
    match reg.stream_synchronize(s) {
        Err(e) => println!("{e}"),
        Ok(()) => println!("no error reported"),
    }
    // The context is unusable now; leave without tearing it down.
    std::process::exit(0);
}

/// The quickstart's shipped kernel (hand-written PTX 7.0 for sm_50) loads on this
/// GPU and driver through the JIT, and computes exactly.
fn the_quickstart_blob_loads_and_runs() {
    static QUICKSTART: &[u8] = include_bytes!("../../examples/kernels/vec_add.ptx");
    let reg = MetraleRegistry::load(0, &[("quickstart", QUICKSTART)]).unwrap();
    assert_eq!(reg.module_kind("quickstart"), Some(BlobKind::Ptx));
    let f = reg.function("quickstart", "vec_add").unwrap();
    let attrs = f.attributes().unwrap();
    eprintln!(
        "    quickstart vec_add: PTX version {}, binary version {}",
        attrs.ptx_version, attrs.binary_version
    );
    assert_eq!(attrs.ptx_version, 50, "the PTX targets sm_50");
    for n in [1, 1000, 1 << 20] {
        check_vec_add(&reg, "quickstart", n, n as u32);
    }
}

/// After the driver's exit everything is silent; after an outside reset the
/// skipped resources are reported once (the reset freed them), never one line
/// each and never a crash.
fn dropping_after_the_context_is_gone_is_silent() {
    for scenario in ["drop_after_ctx_reset", "drop_after_driver_exit"] {
        let out = run_child(scenario, &[]);
        assert!(out.status.success(), "{scenario}: {out:?}");
        eprintln!(
            "    {scenario}: {}",
            String::from_utf8_lossy(&out.stdout).trim()
        );
        let err = String::from_utf8_lossy(&out.stderr);
        if scenario == "drop_after_ctx_reset" {
            assert_eq!(err.lines().count(), 1, "{scenario}: one line: {err}");
            assert!(
                err.starts_with("metrale: device 0: the context was reset outside metrale"),
                "{scenario}: {err}"
            );
        } else {
            assert_eq!(err, "", "{scenario}: stderr must stay empty");
        }
    }
}

/// The primary context is reset under everything metrale owns.
fn child_drop_after_ctx_reset() {
    let reg = registry();
    check_vec_add(&reg, "kernels", 1000, 1);
    let h = Arc::clone(reg.host());
    let s = CudaStream::new(&h).unwrap();
    let dev = DeviceBuffer::<f32>::alloc(&h, 1000).unwrap();
    let ordered = s.alloc::<f32>(1000).unwrap();
    let pinned = PinnedBuffer::<f32>::zeroed(&h, 1000).unwrap();
    let event = CudaEvent::timed(&h).unwrap();
    let f = reg.function("kernels", "empty").unwrap();
    let graph = s
        .capture(|s| -> metrale_runtime::Result<()> {
            let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
            // SAFETY: empty(float*, unsigned, float) never writes for n != ~0.
            unsafe { s.launch(&f, cfg, (&dev, 1u32, 1.0f32)) }
        })
        .unwrap();
    let exec = graph.instantiate().unwrap();
    let mut grown = GrowableBuffer::<u32>::new(&h, 1 << 24).unwrap();
    grown.grow_to(1 << 20).unwrap();
    let mut asleep = GrowableBuffer::<u32>::new(&h, 1 << 24).unwrap();
    asleep.grow_to(1 << 20).unwrap();
    let asleep = asleep.sleep(&s).unwrap();
    s.synchronize().unwrap();
    let d = sys::driver().unwrap();
    // SAFETY: resets the device's primary context; every handle above dies with it.
    let status = unsafe { (d.cuDevicePrimaryCtxReset_v2().unwrap())(h.ctx().device()) };
    assert_eq!(status, CUresult::CUDA_SUCCESS);
    let (mut flags, mut active, mut id) = (0u32, 0i32, 0u64);
    // SAFETY: each call writes integers only.
    let (s1, s2) = unsafe {
        (
            (d.cuDevicePrimaryCtxGetState().unwrap())(h.ctx().device(), &mut flags, &mut active),
            (d.cuCtxGetId().unwrap())(h.ctx().raw(), &mut id),
        )
    };
    println!(
        "after reset: cuDevicePrimaryCtxGetState {s1} active={active}; cuCtxGetId {s2} id={id}"
    );
    drop((grown, asleep));
    drop((exec, graph, f, ordered, s, event, dev, pinned, reg));
    release(0);
    drop(h);
}

type Late = (
    Arc<MetraleRegistry>,
    DeviceBuffer<f32>,
    CudaStream,
    CudaEvent,
);
static LATE: Mutex<Option<Late>> = Mutex::new(None);

extern "C" fn drop_late() {
    let taken = LATE.lock().map(|mut g| g.take()).unwrap_or(None);
    drop(taken);
}

unsafe extern "C" {
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

/// Everything is dropped by an exit handler that runs after the driver's own.
fn child_drop_after_driver_exit() {
    // Registered before the driver initialises, so it runs after the driver's
    // handlers (exit handlers run in reverse order).
    // SAFETY: registers a plain function.
    assert_eq!(unsafe { atexit(drop_late) }, 0);
    let reg = registry();
    check_vec_add(&reg, "kernels", 1000, 2);
    let s = CudaStream::new(reg.ctx()).unwrap();
    let buf = s.alloc::<f32>(10).unwrap();
    let e = CudaEvent::new(reg.ctx()).unwrap();
    *LATE.lock().unwrap() = Some((reg, buf, s, e));
    release(0);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "basic::ptx_cubin_and_fatbin_each_run_vec_add",
            run: ptx_cubin_and_fatbin_each_run_vec_add,
        },
        Test {
            name: "basic::function_lookup_memoized_and_not",
            run: function_lookup_memoized_and_not,
        },
        Test {
            name: "basic::device_symbol_round_trip_by_mangled_name",
            run: device_symbol_round_trip_by_mangled_name,
        },
        Test {
            name: "basic::shared_memory_100_kib_launch",
            run: shared_memory_100_kib_launch,
        },
        Test {
            name: "basic::shared_memory_beyond_the_device_limit_fails_clearly",
            run: shared_memory_beyond_the_device_limit_fails_clearly,
        },
        Test {
            name: "basic::pinned_copies_sync_async_and_raw",
            run: pinned_copies_sync_async_and_raw,
        },
        Test {
            name: "basic::bad_inputs_give_named_errors_and_the_registry_still_works",
            run: bad_inputs_give_named_errors_and_the_registry_still_works,
        },
        Test {
            name: "basic::two_registries_share_one_host",
            run: two_registries_share_one_host,
        },
        Test {
            name: "basic::eight_threads_at_once",
            run: eight_threads_at_once,
        },
        Test {
            name: "basic::cluster_launch_with_distributed_shared_memory",
            run: cluster_launch_with_distributed_shared_memory,
        },
        Test {
            name: "basic::kernel_attributes_occupancy_and_listing",
            run: kernel_attributes_occupancy_and_listing,
        },
        Test {
            name: "basic::vec_add_cubin_via_raw_params",
            run: vec_add_cubin_via_raw_params,
        },
        Test {
            name: "basic::illegal_address_is_reported_in_a_child_without_hanging",
            run: illegal_address_is_reported_in_a_child_without_hanging,
        },
        Test {
            name: "basic::the_quickstart_blob_loads_and_runs",
            run: the_quickstart_blob_loads_and_runs,
        },
        Test {
            name: "basic::dropping_after_the_context_is_gone_is_silent",
            run: dropping_after_the_context_is_gone_is_silent,
        },
    ]
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "illegal_address",
            run: child_illegal_address,
        },
        Child {
            name: "drop_after_ctx_reset",
            run: child_drop_after_ctx_reset,
        },
        Child {
            name: "drop_after_driver_exit",
            run: child_drop_after_driver_exit,
        },
    ]
}
