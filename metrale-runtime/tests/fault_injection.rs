//! Tier 2: the runtime against the stand-in driver (metrale-fakecuda), loaded
//! through `METRALE_LIBCUDA_PATH` exactly as users load libcuda. Runs everywhere,
//! with no GPU: error texts, teardown, missing symbols, partial loads, the
//! shared-memory opt-in, context binding and the allocation-free launch path.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/harness.rs"]
mod harness;

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::c_void;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use harness::{run_child, Child, Test};
use metrale_fakecuda::{Fake, Live};
use metrale_runtime::sys::{self, CUresult};
use metrale_runtime::{
    cuda_error_text, host, is_teardown_noop, release, DeviceBuffer, LaunchAttributes, LaunchConfig,
    MetraleError, MetraleRegistry, PinnedBuffer, RawCudaFunc,
};

static PTX: &[u8] = include_bytes!("fixtures/kernels.ptx");
static CUBIN: &[u8] = include_bytes!("fixtures/kernels.sm_90.cubin");
const COUNTERS: &str = "_ZN12metrale_test8countersE";

/// Counts every allocation in this process (the harness runs tests one at a time).
struct CountingAlloc;
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn fake() -> &'static Fake {
    static FAKE: OnceLock<Fake> = OnceLock::new();
    FAKE.get_or_init(|| {
        let path = std::env::var_os("METRALE_LIBCUDA_PATH").expect("set by main");
        Fake::open(std::path::Path::new(&path))
    })
}

/// A clean stand-in and a registry with the PTX fixture as module "kernels".
fn setup() -> Arc<MetraleRegistry> {
    fake().reset();
    MetraleRegistry::load(0, &[("kernels", PTX)]).expect("fixture loads into the stand-in")
}

fn vec_add(reg: &MetraleRegistry) -> RawCudaFunc {
    let cache = OnceLock::new();
    reg.raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap()
}

/// Launch vec_add over 1000 elements through the typed path; checks the record.
fn launch_vec_add(reg: &MetraleRegistry) {
    let h = reg.host();
    let a = DeviceBuffer::<f32>::alloc(h, 1000).unwrap();
    let b = DeviceBuffer::<f32>::alloc(h, 1000).unwrap();
    let c = DeviceBuffer::<f32>::alloc(h, 1000).unwrap();
    let cfg = LaunchConfig::for_num_elems(1000, 256).unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { reg.launch(vec_add(reg), cfg, reg.raw_stream(), (&a, &b, &c, 1000u32)) }.unwrap();
    let l = fake().last_launch();
    assert_eq!(l.kernel, "vec_add");
    assert_eq!((l.grid, l.block, l.params), ([4, 1, 1], [256, 1, 1], 4));
    assert_eq!(fake().last_param(0), a.device_ptr());
    assert_eq!(fake().last_param(2), c.device_ptr());
    assert_eq!(fake().last_param(3), 1000);
}

fn done(reg: Arc<MetraleRegistry>) {
    drop(reg);
    release(0);
    assert_eq!(fake().live(Live::Modules), 0, "modules left loaded");
    assert_eq!(fake().primary_refs(), 0, "primary context still retained");
}

// ---- error texts -------------------------------------------------------------

fn error_text_for_each_variant() {
    let reg = setup();
    // DriverUnavailable: the loader's text, unchanged.
    let load = sys::LoadError {
        attempts: vec![sys::LoadAttempt {
            candidate: "libcuda.so.1".into(),
            message: "not found".into(),
        }],
    };
    assert_eq!(
        MetraleError::from(load.clone()).to_string(),
        load.to_string()
    );

    // Driver: a failed call names the call, status, description and subject.
    fake().fail("cuStreamSynchronize", 700, 1, Some(1));
    let e = reg.stream_synchronize(reg.raw_stream()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "device 0 stream synchronize: cuStreamSynchronize failed: \
         CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory access was encountered"
    );
    assert_eq!(e.status(), Some(CUresult(700)));

    // ModuleLoad: JIT log included.
    let bad = b".version 9.0\n.target sm_90\nsyntax error here\n";
    let e = MetraleRegistry::load(0, &[("broken", bad)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "broken: cuModuleLoadDataEx failed: CUDA_ERROR_INVALID_PTX (218): a PTX JIT compilation failed \
         [PTX of 45 bytes]\nJIT error log:\nptxas application ptx input, line 3; error   : syntax error\n\
         ptxas fatal   : Ptx assembly aborted due to errors"
    );
    assert!(matches!(&e, MetraleError::ModuleLoad { module, .. } if module == "broken"));

    // ModuleLoad: lookups.
    let e = reg.function("nope", "vec_add").unwrap_err();
    assert_eq!(e.to_string(), "Module 'nope' not loaded");
    let e = reg.function("kernels", "missing_kernel").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::missing_kernel: cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND (500): named symbol not found"
    );
    let e = reg.device_symbol("kernels", "no_such_symbol").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::no_such_symbol: cuModuleGetGlobal_v2 failed: CUDA_ERROR_NOT_FOUND (500): named symbol not found"
    );
    let e = reg.device_symbol("kernels", "bad\0name").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::bad\\0name: name has an interior NUL byte at offset 3"
    );

    // KernelLaunch: the driver's refusal, with the kernel and the shape.
    let f = vec_add(&reg);
    fake().fail("cuLaunchKernel", 701, 1, Some(1));
    let cfg = LaunchConfig::new((4, 1, 1), (256, 1, 1), 0).unwrap();
    // SAFETY: the stand-in refuses before reading parameters.
    let e = unsafe { reg.launch_on_stream(f, cfg, reg.raw_stream(), &mut []) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701): \
         too many resources requested for launch (grid=[4,1,1], block=[256,1,1], shared_mem=0)"
    );

    // KernelLaunch: refused before the driver.
    let before = fake().calls("cuLaunchKernel");
    let too_big = LaunchConfig {
        block_dim: (2048, 1, 1),
        ..cfg
    };
    // SAFETY: refused before any driver call.
    let e = unsafe { reg.launch_on_stream(f, too_big, reg.raw_stream(), &mut []) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': launch not attempted, more than 1024 threads per block: \
         (grid=[4,1,1], block=[2048,1,1], shared_mem=0)"
    );
    assert_eq!(fake().calls("cuLaunchKernel"), before);

    // InvalidArgument: an ordinal the driver does not have.
    let e = host(5).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: device ordinal 5 is out of range: the driver reports 1 CUDA device(s)"
    );

    // After all of that, the registry still works.
    launch_vec_add(&reg);
    done(reg);
}

fn status_text_known_unknown_and_unnamed() {
    fake().reset();
    assert_eq!(
        cuda_error_text(CUresult(1)),
        "CUDA_ERROR_INVALID_VALUE (1): invalid argument"
    );
    assert_eq!(
        cuda_error_text(CUresult(9999)),
        "CUDA_UNKNOWN (9999): (no message)"
    );
    fake().set_error_strings(false);
    // The driver has no name: the header's constant names it; no description.
    assert_eq!(
        cuda_error_text(CUresult(218)),
        "CUDA_ERROR_INVALID_PTX (218): (no message)"
    );
    fake().set_error_strings(true);
    assert!(is_teardown_noop(CUresult(4)));
    assert!(is_teardown_noop(CUresult(201)));
    assert!(is_teardown_noop(CUresult(709)));
    assert!(!is_teardown_noop(CUresult(1)));
    assert!(!is_teardown_noop(CUresult(0)));
}

fn unknown_status_from_a_call_is_a_value() {
    let reg = setup();
    fake().fail("cuStreamSynchronize", 9999, 1, Some(1));
    let e = reg.stream_synchronize(reg.raw_stream()).unwrap_err();
    assert_eq!(e.status(), Some(CUresult(9999)));
    assert_eq!(
        e.to_string(),
        "device 0 stream synchronize: cuStreamSynchronize failed: CUDA_UNKNOWN (9999): (no message)"
    );
    reg.stream_synchronize(reg.raw_stream()).unwrap();
    done(reg);
}

// ---- bad input leaves the registry usable ------------------------------------

fn bad_inputs_are_named_and_harmless() {
    let reg = setup();
    let garbage: &[u8] = &[0x13, 0x37, 0xff, 0x00, 0x42, 0x99];
    let e = MetraleRegistry::load(0, &[("garbage", garbage)]).unwrap_err();
    assert!(
        e.to_string().starts_with("garbage: PTX is not valid UTF-8"),
        "{e}"
    );
    let truncated = &CUBIN[..CUBIN.len() / 2];
    let e = MetraleRegistry::load(0, &[("half", truncated)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "half: malformed cubin: section headers lie past the end of the blob (truncated?)"
    );
    let e = MetraleRegistry::load(0, &[("empty", b"")]).unwrap_err();
    assert_eq!(e.to_string(), "empty: empty kernel blob");
    let e = MetraleRegistry::load(0, &[("a", PTX), ("a", PTX)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: module 'a' is listed twice"
    );
    let e = reg.function("kernels", "vec\0add").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::vec\\0add: name has an interior NUL byte at offset 3"
    );
    assert_eq!(
        fake().live(Live::Modules),
        1,
        "only the registry's own module is loaded"
    );
    launch_vec_add(&reg);
    done(reg);
}

fn failure_mid_list_unloads_the_loaded_modules() {
    let reg = setup();
    let before = fake().live(Live::Modules);
    let bad = b".version 9.0\nsyntax error\n";
    let e = MetraleRegistry::load(
        0,
        &[("one", PTX), ("two", PTX), ("three", bad), ("four", PTX)],
    )
    .unwrap_err();
    assert!(
        matches!(&e, MetraleError::ModuleLoad { module, .. } if module == "three"),
        "{e}"
    );
    assert_eq!(fake().live(Live::Modules), before);
    // The same through an injected driver failure on the second module.
    fake().fail("cuModuleLoadDataEx", 2, 2, Some(1));
    let e = MetraleRegistry::load(0, &[("one", PTX), ("two", PTX)]).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("two: cuModuleLoadDataEx failed: CUDA_ERROR_OUT_OF_MEMORY (2)"),
        "{e}"
    );
    assert_eq!(fake().live(Live::Modules), before);
    done(reg);
}

// ---- registry behaviour --------------------------------------------------------

fn registries_share_one_host_and_lookups_memoize() {
    let reg = setup();
    let other = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    assert!(Arc::ptr_eq(reg.host(), other.host()));
    assert_eq!(fake().primary_refs(), 1, "one retain for the shared host");
    assert_eq!(reg.module_names().collect::<Vec<_>>(), ["kernels"]);
    assert!(reg.has_module("kernels") && !reg.has_module("other"));

    let cache = OnceLock::new();
    let calls = fake().calls("cuModuleGetFunction");
    let f1 = reg
        .raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    let f2 = reg
        .raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    assert_eq!(f1, f2);
    assert_eq!(
        fake().calls("cuModuleGetFunction"),
        calls + 1,
        "second lookup is a cache hit"
    );
    let plain1 = reg.function("kernels", "vec_add").unwrap();
    let plain2 = reg.function("kernels", "vec_add").unwrap();
    assert_eq!(plain1.raw(), plain2.raw());
    assert_eq!(
        fake().calls("cuModuleGetFunction"),
        calls + 3,
        "function() is not memoized"
    );
    let typed = OnceLock::new();
    let t1 = reg.function_cached(&typed, "kernels", "empty").unwrap();
    let t2 = reg.function_cached(&typed, "kernels", "empty").unwrap();
    assert_eq!(t1.raw(), t2.raw());
    assert_eq!(t1.name(), "kernels::empty");
    assert_eq!(fake().calls("cuModuleGetFunction"), calls + 4);
    drop((plain1, plain2, t1, t2, typed));
    // An error is not cached.
    let failing = OnceLock::new();
    assert!(reg
        .raw_function_cached(&failing, "kernels", "nope")
        .is_err());
    assert!(failing.get().is_none());

    // Each registry has its own modules.
    assert_eq!(fake().live(Live::Modules), 2);
    drop(other);
    assert_eq!(fake().live(Live::Modules), 1);
    done(reg);
}

fn a_function_keeps_its_module_loaded_after_the_registry_goes() {
    let reg = setup();
    let f = reg.function("kernels", "vec_add").unwrap();
    drop(reg);
    assert_eq!(
        fake().live(Live::Modules),
        1,
        "the function still holds its module"
    );
    assert_eq!(f.attributes().unwrap().ptx_version, 90);
    drop(f);
    release(0);
    assert_eq!(fake().live(Live::Modules), 0);
    assert_eq!(fake().primary_refs(), 0);
}

fn device_symbols_and_copies_round_trip() {
    let reg = setup();
    let (ptr, bytes) = reg.device_symbol("kernels", COUNTERS).unwrap();
    assert_eq!(bytes, 64);
    let values: Vec<u32> = (0..16).map(|i| i * 3 + 1).collect();
    let mut back = vec![0u32; 16];
    // SAFETY: the symbol has 64 bytes; both host slices are 64 bytes and outlive the sync.
    unsafe {
        reg.copy_h2d_async(ptr, values.as_ptr().cast(), 64, reg.raw_stream())
            .unwrap();
        reg.copy_d2h_async(back.as_mut_ptr().cast(), ptr, 64, reg.raw_stream())
            .unwrap();
    }
    reg.stream_synchronize(reg.raw_stream()).unwrap();
    assert_eq!(back, values);

    let h = reg.host();
    let mut pinned = PinnedBuffer::<u64>::zeroed(h, 1024).unwrap();
    assert!(pinned.iter().all(|&x| x == 0));
    for (i, x) in pinned.iter_mut().enumerate() {
        *x = i as u64 * 7;
    }
    let dev = DeviceBuffer::from_host(h, &pinned).unwrap();
    assert_eq!(dev.to_host_vec().unwrap(), pinned.to_vec());
    let e = dev.copy_from_host(&[1, 2, 3]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: host slice of 3 elements for a device buffer of 1024"
    );
    assert_eq!(fake().live(Live::DeviceMemory), 1);
    assert_eq!(fake().live(Live::HostMemory), 1);
    drop((dev, pinned));
    assert_eq!(fake().live(Live::DeviceMemory), 0);
    assert_eq!(fake().live(Live::HostMemory), 0);
    done(reg);
}

fn large_shared_memory_opts_in_once_per_kernel_and_size() {
    let reg = setup();
    let f = vec_add(&reg);
    let out = DeviceBuffer::<u32>::alloc(reg.host(), 2).unwrap();
    let small = LaunchConfig::new((1, 1, 1), (256, 1, 1), 48 * 1024).unwrap();
    let large = LaunchConfig::new((1, 1, 1), (256, 1, 1), 100 * 1024).unwrap();
    let s = reg.raw_stream();
    let args = (&out, &out, &out, 2u32);
    // SAFETY: the stand-in only records the arguments.
    unsafe { reg.launch(f, small, s, args) }.unwrap();
    assert_eq!(
        fake().calls("cuFuncSetAttribute"),
        0,
        "48 KiB needs no opt-in"
    );
    // SAFETY: as above.
    unsafe { reg.launch(f, large, s, args) }.unwrap();
    assert_eq!(fake().calls("cuFuncSetAttribute"), 1);
    assert_eq!(
        fake().func_max_dynamic_shared(f.0.cast::<c_void>()),
        100 * 1024
    );
    // SAFETY: as above.
    unsafe {
        reg.launch(f, large, s, args).unwrap();
        reg.launch(f, small, s, args).unwrap();
    }
    assert_eq!(
        fake().calls("cuFuncSetAttribute"),
        1,
        "set once, not per launch"
    );
    assert_eq!(fake().last_launch().shared, 48 * 1024);
    let larger = LaunchConfig {
        shared_mem_bytes: 200 * 1024,
        ..large
    };
    // SAFETY: as above.
    unsafe { reg.launch(f, larger, s, args) }.unwrap();
    assert_eq!(
        fake().calls("cuFuncSetAttribute"),
        2,
        "a larger size opts in again"
    );
    // Beyond the device's opt-in limit: refused before the driver, naming the limit.
    let too_large = LaunchConfig {
        shared_mem_bytes: 240 * 1024,
        ..large
    };
    // SAFETY: refused before any driver call.
    let e = unsafe { reg.launch(f, too_large, s, args) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': launch not attempted, dynamic shared memory above the device's \
         opt-in limit of 232448 bytes: (grid=[1,1,1], block=[256,1,1], shared_mem=245760)"
    );
    assert_eq!(fake().calls("cuFuncSetAttribute"), 2);
    drop(out);
    done(reg);
}

fn context_is_bound_on_a_fresh_thread_only_when_needed() {
    let reg = setup();
    let r = Arc::clone(&reg);
    std::thread::spawn(move || {
        let set_before = fake().calls("cuCtxSetCurrent");
        r.stream_synchronize(r.raw_stream()).unwrap();
        assert_eq!(
            fake().calls("cuCtxSetCurrent"),
            set_before + 1,
            "fresh thread: bound once"
        );
        let gets = fake().calls("cuCtxGetCurrent");
        r.stream_synchronize(r.raw_stream()).unwrap();
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

fn launch_path_allocates_nothing() {
    let reg = setup();
    let f = vec_add(&reg);
    let buf = DeviceBuffer::<f32>::alloc(reg.host(), 16).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (16, 1, 1), 64 * 1024).unwrap();
    let n = 16u32;
    let ptr = buf.device_ptr();
    let mut params: [*mut c_void; 4] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&ptr as *const u64).cast_mut().cast(),
        (&ptr as *const u64).cast_mut().cast(),
        (&n as *const u32).cast_mut().cast(),
    ];
    let s = reg.raw_stream();
    let cache = OnceLock::new();
    reg.raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    // Warm: the first launch above 48 KiB opts in (a cold path).
    // SAFETY: the stand-in only records the arguments.
    unsafe { reg.launch_on_stream(f, cfg, s, &mut params) }.unwrap();
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    for _ in 0..10_000 {
        let f = reg
            .raw_function_cached(&cache, "kernels", "vec_add")
            .unwrap();
        // SAFETY: as above.
        unsafe { reg.launch_on_stream(f, cfg, s, &mut params) }.unwrap();
        // SAFETY: as above.
        unsafe { reg.launch(f, cfg, s, (&buf, &buf, &buf, n)) }.unwrap();
    }
    let after = ALLOCATIONS.load(Ordering::SeqCst);
    assert_eq!(after - before, 0, "allocations on the launch path");
    assert_eq!(fake().launches(), 20_001);
    drop(buf);
    done(reg);
}

fn extended_launch_passes_cluster_and_cooperative() {
    let reg = setup();
    let f = vec_add(&reg);
    let buf = DeviceBuffer::<f32>::alloc(reg.host(), 64).unwrap();
    let cfg = LaunchConfig::new((8, 2, 1), (64, 1, 1), 0).unwrap();
    let attrs = LaunchAttributes {
        cluster_dim: Some((4, 2, 1)),
        cooperative: true,
        programmatic_stream_serialization: false,
    };
    // SAFETY: the stand-in only records the arguments.
    unsafe { reg.launch_ex(f, cfg, &attrs, reg.raw_stream(), (&buf, &buf, &buf, 64u32)) }.unwrap();
    let l = fake().last_launch();
    assert_eq!(
        (l.grid, l.cluster, l.cooperative),
        ([8, 2, 1], [4, 2, 1], true)
    );
    assert_eq!(fake().last_param(3), 64);
    let bad = LaunchAttributes::cluster(3, 1, 1);
    // SAFETY: refused before any driver call.
    let e = unsafe { reg.launch_ex(f, cfg, &bad, reg.raw_stream(), (&buf, &buf, &buf, 64u32)) }
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': launch not attempted, cluster x dimension 3 does not divide grid x \
         dimension 8: (grid=[8,2,1], block=[64,1,1], shared_mem=0 cluster=[3,1,1])"
    );
    drop(buf);
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
        names,
        [
            "vec_add",
            "empty",
            "smem_check",
            "bump_counters",
            "write_illegal",
            "cluster_ranks"
        ]
    );
    drop(f);
    done(reg);
}

// ---- teardown and missing symbols, in child processes --------------------------

fn child_drop_after_shutdown() {
    let reg = setup();
    let h = Arc::clone(reg.host());
    let dev = DeviceBuffer::<f32>::alloc(&h, 100).unwrap();
    let pinned = PinnedBuffer::<f32>::zeroed(&h, 100).unwrap();
    release(0);
    fake().shutdown(true);
    drop(dev);
    drop(pinned);
    drop(reg);
    drop(h);
}

fn child_drop_after_context_reset() {
    let reg = setup();
    let h = Arc::clone(reg.host());
    let dev = DeviceBuffer::<f32>::alloc(&h, 100).unwrap();
    let pinned = PinnedBuffer::<f32>::zeroed(&h, 100).unwrap();
    let d = sys::driver().unwrap();
    // SAFETY: destroys every resource of the context; the handles above are not used again.
    let status = unsafe { (d.cuDevicePrimaryCtxReset_v2().unwrap())(h.ctx().device()) };
    assert_eq!(status, CUresult::CUDA_SUCCESS);
    assert_eq!(fake().live(Live::Modules), 0);
    drop((dev, pinned, reg));
    release(0);
    drop(h);
    assert_eq!(
        fake().primary_refs(),
        0,
        "the retain is given back after a reset too"
    );
}

fn child_unload_fails() {
    let reg = setup();
    let dev = DeviceBuffer::<f32>::alloc(reg.host(), 100).unwrap();
    fake().fail("cuModuleUnload", 999, 1, Some(1));
    drop(reg);
    drop(dev);
}

fn child_old_driver() {
    let reg = setup();
    launch_vec_add(&reg);
    let e = reg.device_symbol("kernels", COUNTERS).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "kernels::{COUNTERS}: cuModuleGetGlobal_v2 is not exported by the loaded CUDA driver \
             (driver version 13.0, 13000)"
        )
    );
    assert!(matches!(
        e,
        MetraleError::MissingSymbol {
            symbol: "cuModuleGetGlobal_v2",
            ..
        }
    ));
    let buf = DeviceBuffer::<f32>::alloc(reg.host(), 16).unwrap();
    let cfg = LaunchConfig::new((2, 1, 1), (8, 1, 1), 0).unwrap();
    let attrs = LaunchAttributes::cluster(2, 1, 1);
    // SAFETY: the call fails before the launch.
    let e = unsafe {
        reg.launch_ex(
            vec_add(&reg),
            cfg,
            &attrs,
            reg.raw_stream(),
            (&buf, &buf, &buf, 16u32),
        )
    }
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': cuLaunchKernelEx is not exported by the loaded CUDA driver \
         (driver version 13.0, 13000)"
    );
    let e = reg.function_names("kernels").unwrap_err();
    assert!(matches!(
        e,
        MetraleError::MissingSymbol {
            symbol: "cuModuleGetFunctionCount",
            ..
        }
    ));
    // Everything else still works.
    launch_vec_add(&reg);
    drop(buf);
    done(reg);
    println!("old driver: ok");
}

fn teardown_after_shutdown_is_silent() {
    let out = run_child("drop_after_shutdown", &[]);
    assert!(out.status.success(), "child failed: {out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "",
        "stderr must stay empty"
    );
}

fn teardown_after_context_reset_is_silent() {
    let out = run_child("drop_after_context_reset", &[]);
    assert!(out.status.success(), "child failed: {out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "",
        "stderr must stay empty"
    );
}

fn a_real_failure_in_drop_is_one_line() {
    let out = run_child("unload_fails", &[]);
    assert!(out.status.success(), "child failed: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr,
        "metrale: unloading kernel modules on device 0: cuModuleUnload failed: \
         CUDA_ERROR_UNKNOWN (999): unknown error\n"
    );
}

fn an_old_driver_reports_missing_symbols_and_keeps_working() {
    let old = metrale_fakecuda::old_library_path().to_str().unwrap();
    let out = run_child("old_driver", &[("METRALE_LIBCUDA_PATH", old)]);
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "old driver: ok\n");
}

fn main() -> ExitCode {
    // This suite always runs against the stand-in, also on a machine whose own
    // METRALE_LIBCUDA_PATH names the real driver. A child process keeps the path its
    // parent chose for it (the old-driver build, or this one).
    if std::env::var_os("METRALE_TEST_CHILD").is_none() {
        std::env::set_var("METRALE_LIBCUDA_PATH", metrale_fakecuda::library_path());
    }
    let tests = [
        Test {
            name: "error_text_for_each_variant",
            run: error_text_for_each_variant,
        },
        Test {
            name: "status_text_known_unknown_and_unnamed",
            run: status_text_known_unknown_and_unnamed,
        },
        Test {
            name: "unknown_status_from_a_call_is_a_value",
            run: unknown_status_from_a_call_is_a_value,
        },
        Test {
            name: "bad_inputs_are_named_and_harmless",
            run: bad_inputs_are_named_and_harmless,
        },
        Test {
            name: "failure_mid_list_unloads_the_loaded_modules",
            run: failure_mid_list_unloads_the_loaded_modules,
        },
        Test {
            name: "registries_share_one_host_and_lookups_memoize",
            run: registries_share_one_host_and_lookups_memoize,
        },
        Test {
            name: "a_function_keeps_its_module_loaded_after_the_registry_goes",
            run: a_function_keeps_its_module_loaded_after_the_registry_goes,
        },
        Test {
            name: "device_symbols_and_copies_round_trip",
            run: device_symbols_and_copies_round_trip,
        },
        Test {
            name: "large_shared_memory_opts_in_once_per_kernel_and_size",
            run: large_shared_memory_opts_in_once_per_kernel_and_size,
        },
        Test {
            name: "context_is_bound_on_a_fresh_thread_only_when_needed",
            run: context_is_bound_on_a_fresh_thread_only_when_needed,
        },
        Test {
            name: "launch_path_allocates_nothing",
            run: launch_path_allocates_nothing,
        },
        Test {
            name: "extended_launch_passes_cluster_and_cooperative",
            run: extended_launch_passes_cluster_and_cooperative,
        },
        Test {
            name: "kernel_attributes_occupancy_and_listing",
            run: kernel_attributes_occupancy_and_listing,
        },
        Test {
            name: "teardown_after_shutdown_is_silent",
            run: teardown_after_shutdown_is_silent,
        },
        Test {
            name: "teardown_after_context_reset_is_silent",
            run: teardown_after_context_reset_is_silent,
        },
        Test {
            name: "a_real_failure_in_drop_is_one_line",
            run: a_real_failure_in_drop_is_one_line,
        },
        Test {
            name: "an_old_driver_reports_missing_symbols_and_keeps_working",
            run: an_old_driver_reports_missing_symbols_and_keeps_working,
        },
    ];
    let children = [
        Child {
            name: "drop_after_shutdown",
            run: child_drop_after_shutdown,
        },
        Child {
            name: "drop_after_context_reset",
            run: child_drop_after_context_reset,
        },
        Child {
            name: "unload_fails",
            run: child_unload_fails,
        },
        Child {
            name: "old_driver",
            run: child_old_driver,
        },
    ];
    let gate = || match sys::driver() {
        Ok(d) if d.path().contains("metrale_fakecuda") => Ok(()),
        Ok(d) => Err(format!(
            "METRALE_LIBCUDA_PATH names {}, not the stand-in",
            d.path()
        )),
        Err(e) => Err(e.to_string()),
    };
    // The stand-in is built with this crate's dev-dependencies: it is always required.
    harness::main(&tests, &children, gate, true)
}
