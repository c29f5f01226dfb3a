//! Teardown, driver initialisation and old drivers, each in a child process (the
//! scenarios change process-wide driver state or leak on purpose).

use std::sync::{Arc, OnceLock};

use crate::common::*;
use crate::harness::{run_child, Child, Test};

/// One of everything metrale can own, for the drop scenarios.
struct Everything {
    reg: Arc<MetraleRegistry>,
    host: Arc<CudaHost>,
    stream: CudaStream,
    event: CudaEvent,
    dev: DeviceBuffer<f32>,
    ordered: DeviceBuffer<f32>,
    pinned: PinnedBuffer<f32>,
    managed: ManagedBuffer<f32>,
    pool: MemPool,
    symbol: DeviceSymbol<u32>,
    graph: CudaGraph,
    exec: CudaGraphExec,
    func: CudaFunction,
    grown: GrowableBuffer<u32>,
    asleep: SleepingBuffer<u32>,
    range: VirtualRange,
    phys: PhysicalMemory,
    ipc: IpcBuffer<f32>,
}

fn everything() -> Everything {
    let reg = setup();
    let host = Arc::clone(reg.host());
    let stream = CudaStream::new(&host).unwrap();
    let func = reg.function("kernels", "empty").unwrap();
    let dev = DeviceBuffer::<f32>::alloc(&host, 100).unwrap();
    let graph = stream
        .capture(|s| -> metrale_runtime::Result<()> {
            let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
            // SAFETY: the stand-in only records the arguments.
            unsafe { s.launch(&func, cfg, (&dev, 1u32, 1.0f32)) }
        })
        .unwrap();
    let mut grown = GrowableBuffer::<u32>::new(&host, 1 << 20).unwrap();
    grown.grow_to(1000).unwrap();
    let mut asleep = GrowableBuffer::<u32>::new(&host, 1 << 20).unwrap();
    asleep.grow_to(1000).unwrap();
    let asleep = asleep.sleep(&stream).unwrap();
    let mut range = VirtualRange::reserve(&host, 4 << 20).unwrap();
    let mapped = PhysicalMemory::new(&host, 2 << 20, HandleTypes::POSIX_FD).unwrap();
    range
        .map(
            0,
            Arc::new(mapped),
            0,
            2 << 20,
            &[(host.ctx(), Access::ReadWrite)],
        )
        .unwrap();
    // SAFETY: `dev` holds 100 f32 and outlives the opened buffer (dropped first).
    let ipc = unsafe { IpcBuffer::<f32>::open(&host, &dev.ipc_handle().unwrap(), 100) }.unwrap();
    Everything {
        grown,
        asleep,
        range,
        phys: PhysicalMemory::new(&host, 2 << 20, HandleTypes::NONE).unwrap(),
        ipc,
        event: CudaEvent::timed(&host).unwrap(),
        ordered: stream.alloc::<f32>(100).unwrap(),
        pinned: PinnedBuffer::<f32>::zeroed(&host, 100).unwrap(),
        managed: ManagedBuffer::<f32>::zeroed(&host, 100).unwrap(),
        pool: MemPool::new(&host).unwrap(),
        symbol: reg.symbol_array::<u32>("kernels", COUNTERS, 16).unwrap(),
        exec: graph.instantiate().unwrap(),
        graph,
        dev,
        stream,
        func,
        host,
        reg,
    }
}

fn drop_everything(e: Everything) {
    let Everything {
        reg,
        host,
        stream,
        event,
        dev,
        ordered,
        pinned,
        managed,
        pool,
        symbol,
        graph,
        exec,
        func,
        grown,
        asleep,
        range,
        phys,
        ipc,
    } = e;
    drop((ipc, grown, asleep, range, phys));
    drop((
        exec, graph, ordered, stream, event, dev, pinned, managed, pool,
    ));
    drop((symbol, func, reg, host));
}

fn child_drop_after_shutdown() {
    let all = everything();
    release(0);
    fake().shutdown(true);
    drop_everything(all);
}

fn child_drop_after_context_reset() {
    // Before the reset: a generation is recorded per resource.
    let all = everything();
    let d = sys::driver().unwrap();
    // SAFETY: destroys every resource of the context; the handles above are not used
    // again except by their Drop.
    let status = unsafe { (d.cuDevicePrimaryCtxReset_v2().unwrap())(all.host.ctx().device()) };
    assert_eq!(status, CUresult::CUDA_SUCCESS);
    assert_eq!(fake().live(Live::Modules), 0);
    drop_everything(all);
    release(0);
    assert_eq!(
        fake().primary_refs(),
        0,
        "the retain is given back after a reset too"
    );
    assert_eq!(
        fake().stale_uses(),
        0,
        "no destroyed handle may reach the driver after a reset"
    );
}

fn child_unload_fails() {
    let reg = setup();
    let dev = DeviceBuffer::<f32>::alloc(reg.host(), 100).unwrap();
    fake().fail("cuModuleUnload", 999, 1, Some(1));
    drop(reg);
    drop(dev);
}

fn child_stream_destroy_fails() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let e = CudaEvent::new(reg.ctx()).unwrap();
    fake().fail("cuStreamDestroy_v2", 999, 1, Some(1));
    fake().fail("cuEventDestroy_v2", 999, 1, Some(1));
    drop(s);
    drop(e);
    drop(reg);
}

/// Before, the free ran on a thread without the context after a failed bind; its
/// INVALID_CONTEXT counted as teardown and the memory leaked silently.
fn child_leak_after_failed_bind() {
    let reg = setup();
    let buf = DeviceBuffer::<f32>::alloc(reg.host(), 100).unwrap();
    std::thread::spawn(move || {
        fake().fail("cuCtxSetCurrent", 999, 1, None);
        drop(buf);
    })
    .join()
    .unwrap();
    assert_eq!(
        fake().live(Live::DeviceMemory),
        1,
        "skipped the free: it would have failed"
    );
    std::process::exit(0);
}

/// Before, one transient cuInit failure was remembered for the life of the process.
fn child_init_is_retried_after_a_failure() {
    fake().reset();
    fake().fail("cuInit", 2, 1, Some(1));
    let e = host(0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "driver initialisation: cuInit failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
    );
    let h = host(0).expect("a second attempt initialises the driver");
    assert_eq!(fake().calls("cuInit"), 2);
    host(0).unwrap();
    assert_eq!(fake().calls("cuInit"), 2, "success is remembered");
    drop(h);
    release(0);
    println!("init retried: ok");
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
        e.kind(),
        ErrorKind::MissingSymbol {
            symbol: "cuModuleGetGlobal_v2",
            ..
        }
    ));
    let s = reg.stream();
    let f = reg.function("kernels", "vec_add").unwrap();
    let buf = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let cfg = LaunchConfig::new((2, 1, 1), (8, 1, 1), 0).unwrap();
    let attrs = LaunchAttributes::cluster(2, 1, 1);
    // SAFETY: the call fails before the launch.
    let e =
        unsafe { s.launch(&f, cfg.with_attributes(attrs), (&buf, &buf, &buf, 16u32)) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': cuLaunchKernelEx is not exported by the loaded CUDA driver \
         (driver version 13.0, 13000)"
    );
    let e = reg.function_names("kernels").unwrap_err();
    assert!(matches!(
        e.kind(),
        ErrorKind::MissingSymbol {
            symbol: "cuModuleGetFunctionCount",
            ..
        }
    ));
    // No parameter layout: typed launches go ahead unchecked, without error.
    assert!(f.params().is_none());
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg, (&buf, &buf, &buf, 16u64)) }.expect("unchecked on an old driver");
    // Stream-ordered allocation: the device says no pools, or the driver lacks them.
    let e = s.alloc::<u8>(16).unwrap_err();
    assert!(
        e.to_string()
            .contains("does not support stream-ordered allocation"),
        "{e}"
    );
    fake().set_attribute(1, 115, 1);
    let h1 = host(1).unwrap();
    let e = h1.stream().alloc::<u8>(16).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::MissingSymbol {
                symbol: "cuMemAllocAsync",
                ..
            }
        ),
        "{e}"
    );
    let e = MemPool::device_default(&h1).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::MissingSymbol {
                symbol: "cuDeviceGetDefaultMemPool",
                ..
            }
        ),
        "{e}"
    );
    drop(h1);
    // Prefetch and conditional nodes need newer drivers too.
    let m = ManagedBuffer::<f32>::zeroed(s, 4).unwrap();
    let e = s.prefetch(&m, PrefetchTarget::Device).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::MissingSymbol {
                symbol: "cuMemPrefetchAsync_v2",
                ..
            }
        ),
        "{e}"
    );
    let mut g = CudaGraph::new(s).unwrap();
    let e = g.add_while(&[], true, |_, _| Ok(())).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::MissingSymbol {
                symbol: "cuGraphConditionalHandleCreate",
                ..
            }
        ),
        "{e}"
    );
    // One model for two devices falls back to a module per device.
    let regs = MetraleRegistry::load_on_devices(&[0, 1], &[("kernels", PTX)]).unwrap();
    assert!(regs.iter().all(|r| !r.shares_code()));
    assert_eq!(fake().calls("cuLibraryLoadData"), 0);
    launch_vec_add(&regs[1]);
    // Everything else still works.
    launch_vec_add(&reg);
    drop((buf, f, m, g, regs));
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

fn teardown_after_context_reset_is_reported_once() {
    let out = run_child("drop_after_context_reset", &[]);
    assert!(out.status.success(), "child failed: {out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.lines().count(),
        1,
        "one line for everything skipped: {err}"
    );
    assert!(
        err.starts_with(
            "metrale: device 0: the context was reset outside metrale; resources made before \
             the reset are not freed again, the reset freed them (first: "
        ),
        "{err}"
    );
}

/// Before, everything made after an outside reset was judged "gone" by the id
/// recorded when the context was created, and leaked without a word.
fn teardown_resources_made_after_a_reset_are_freed() {
    let out = run_child("made_after_reset", &[]);
    assert!(out.status.success(), "child failed: {out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.lines().count(),
        1,
        "only the skip of the old buffer: {err}"
    );
}

fn child_made_after_reset() {
    let reg = setup();
    let host = Arc::clone(reg.host());
    let old = DeviceBuffer::<f32>::alloc(&host, 10).unwrap();
    let d = sys::driver().unwrap();
    // SAFETY: destroys every resource of the context; `old`, the registry and the
    // host's stream are not used again except by their Drop.
    let status = unsafe { (d.cuDevicePrimaryCtxReset_v2().unwrap())(host.ctx().device()) };
    assert_eq!(status, CUresult::CUDA_SUCCESS);
    // Another library on this thread leaves no context current; the next metrale
    // call binds the primary context, which the driver creates anew.
    // SAFETY: null is a valid argument (no context).
    unsafe { (d.cuCtxSetCurrent().unwrap())(std::ptr::null_mut()) };
    let fresh = DeviceBuffer::<f32>::alloc(&host, 10).unwrap();
    let s = CudaStream::new(&host).unwrap();
    let e = CudaEvent::new(&host).unwrap();
    let ordered = s.alloc::<u32>(10).unwrap();
    assert_eq!(fake().live(Live::DeviceMemory), 2);
    drop(old);
    drop((ordered, e, fresh, s));
    assert_eq!(
        fake().live(Live::DeviceMemory),
        0,
        "made after the reset: freed"
    );
    assert_eq!(fake().live(Live::Streams), 0);
    assert_eq!(fake().live(Live::Events), 0);
    drop((reg, host));
    release(0);
}

fn a_real_failure_in_drop_is_one_line() {
    let out = run_child("unload_fails", &[]);
    assert!(out.status.success(), "child failed: {out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "metrale: unloading kernel modules on device 0: cuModuleUnload failed: \
         CUDA_ERROR_UNKNOWN (999): unknown error\n"
    );
    let out = run_child("stream_destroy_fails", &[]);
    assert!(out.status.success(), "child failed: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(
        lines[0].starts_with("metrale: destroying stream 0x")
            && lines[0].ends_with(
                "on device 0: cuStreamDestroy_v2 failed: CUDA_ERROR_UNKNOWN (999): unknown error"
            ),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with("metrale: destroying event 0x"),
        "{stderr}"
    );
}

fn a_leak_after_a_failed_bind_is_reported() {
    let out = run_child("leak_after_failed_bind", &[]);
    assert!(out.status.success(), "child failed: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("metrale: freeing device buffer 0x")
            && stderr.ends_with(
                " on device 0: leaked, the context of device 0 could not be made current: \
                 cuCtxSetCurrent failed: CUDA_ERROR_UNKNOWN (999): unknown error\n"
            ),
        "{stderr}"
    );
}

fn driver_initialisation_is_retried() {
    let out = run_child("init_retry", &[]);
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "init retried: ok\n");
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

/// A static cache shared by two registries used from many threads: every thread
/// gets its own registry's handle.
fn cached_handles_under_threads() {
    static CACHE: OnceLock<RawCudaFunc> = OnceLock::new();
    let a = setup();
    let b = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let r = if t % 2 == 0 {
                Arc::clone(&a)
            } else {
                Arc::clone(&b)
            };
            std::thread::spawn(move || {
                let f = r.raw_function_cached(&CACHE, "kernels", "vec_add").unwrap();
                assert_eq!(f, r.function("kernels", "vec_add").unwrap().raw());
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    drop(b);
    done(a);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "teardown::after_shutdown_is_silent",
            run: teardown_after_shutdown_is_silent,
        },
        Test {
            name: "teardown::after_context_reset_is_reported_once",
            run: teardown_after_context_reset_is_reported_once,
        },
        Test {
            name: "teardown::resources_made_after_a_reset_are_freed",
            run: teardown_resources_made_after_a_reset_are_freed,
        },
        Test {
            name: "teardown::a_real_failure_in_drop_is_one_line",
            run: a_real_failure_in_drop_is_one_line,
        },
        Test {
            name: "teardown::a_leak_after_a_failed_bind_is_reported",
            run: a_leak_after_a_failed_bind_is_reported,
        },
        Test {
            name: "teardown::driver_initialisation_is_retried",
            run: driver_initialisation_is_retried,
        },
        Test {
            name: "teardown::an_old_driver_reports_missing_symbols_and_keeps_working",
            run: an_old_driver_reports_missing_symbols_and_keeps_working,
        },
        Test {
            name: "teardown::cached_handles_under_threads",
            run: cached_handles_under_threads,
        },
    ]
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "drop_after_shutdown",
            run: child_drop_after_shutdown,
        },
        Child {
            name: "drop_after_context_reset",
            run: child_drop_after_context_reset,
        },
        Child {
            name: "made_after_reset",
            run: child_made_after_reset,
        },
        Child {
            name: "unload_fails",
            run: child_unload_fails,
        },
        Child {
            name: "stream_destroy_fails",
            run: child_stream_destroy_fails,
        },
        Child {
            name: "leak_after_failed_bind",
            run: child_leak_after_failed_bind,
        },
        Child {
            name: "init_retry",
            run: child_init_is_retried_after_a_failure,
        },
        Child {
            name: "old_driver",
            run: child_old_driver,
        },
    ]
}
