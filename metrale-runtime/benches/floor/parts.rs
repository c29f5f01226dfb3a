//! Where the time of the per-step paths goes (issue 33): the driver calls and
//! host work that metrale's paths add to the raw call, each timed alone in this
//! process, and the raw paths rebuilt with one added part at a time. Also three
//! questions about the driver the paths' designs rest on, answered by trying:
//! whether a graph's per-node update needs a current context, whether a copy
//! to pageable host memory has finished when the call returns, and how long a
//! wake-up takes through a waiting thread.

use std::ffi::c_void;
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::common::{header, line, ratios, time, Row};
use metrale_runtime::sys::{self, CUresult};
use metrale_runtime::{CudaGraph, DeviceBuffer, LaunchConfig, MetraleError, MetraleRegistry};

fn ok(call: &str, s: CUresult) {
    assert!(s.is_success(), "{call} failed: {s}");
}

/// ns per call of `f`, `k` calls, median over `rounds`.
fn per_call(rounds: usize, k: usize, mut f: impl FnMut()) -> Row {
    let mut row = Row::default();
    for _ in 0..rounds {
        row.push(
            time(|| {
                for _ in 0..k {
                    f();
                }
            }) * 1e9
                / k as f64,
        );
    }
    row
}

pub fn run(reg: &MetraleRegistry, rounds: usize) -> Result<(), MetraleError> {
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let s = reg.stream();
    let raw_s = s.raw();
    let ctx_raw = reg.ctx().raw();
    let sync = || {
        // SAFETY: a live stream.
        ok("cuStreamSynchronize", unsafe {
            (d.cuStreamSynchronize().unwrap())(raw_s)
        });
    };

    // 1. The driver calls, alone.
    let get_current = d.cuCtxGetCurrent().unwrap();
    let get_id = d.cuCtxGetId().unwrap();
    let capture_info = d.cuStreamGetCaptureInfo_v3().unwrap();
    let ev_create = d.cuEventCreate().unwrap();
    let ev_record = d.cuEventRecord().unwrap();
    let ev_query = d.cuEventQuery().unwrap();
    let ev_sync = d.cuEventSynchronize().unwrap();
    let stream_query = d.cuStreamQuery().unwrap();
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: writes one event (timing disabled).
    ok("cuEventCreate", unsafe { ev_create(&mut ev, 0x2) });
    let k = 20_000;
    let calls: Vec<(&str, Row)> = vec![
        (
            "cuCtxGetCurrent",
            per_call(rounds, k, || {
                let mut c: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: writes one handle.
                black_box(unsafe { get_current(&mut c) });
                black_box(c);
            }),
        ),
        (
            "cuCtxGetId",
            per_call(rounds, k, || {
                let mut id = 0u64;
                // SAFETY: a live context; writes one integer.
                black_box(unsafe { get_id(ctx_raw, &mut id) });
                black_box(id);
            }),
        ),
        (
            "cuStreamGetCaptureInfo_v3 (status only)",
            per_call(rounds, k, || {
                let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
                // SAFETY: a live stream; optional outputs null.
                black_box(unsafe {
                    capture_info(
                        raw_s,
                        &mut st,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    )
                });
                black_box(st);
            }),
        ),
        (
            "cuEventRecord (idle stream)",
            per_call(rounds, k, || {
                // SAFETY: a live event and stream of one context.
                black_box(unsafe { ev_record(ev, raw_s) });
            }),
        ),
        (
            "cuEventQuery (complete)",
            per_call(rounds, k, || {
                // SAFETY: a live event.
                black_box(unsafe { ev_query(ev) });
            }),
        ),
        (
            "cuEventSynchronize (complete)",
            per_call(rounds, k, || {
                // SAFETY: a live event.
                black_box(unsafe { ev_sync(ev) });
            }),
        ),
        (
            "cuStreamQuery (idle)",
            per_call(rounds, k, || {
                // SAFETY: a live stream.
                black_box(unsafe { stream_query(raw_s) });
            }),
        ),
        (
            "cuStreamSynchronize (idle)",
            per_call(rounds, k, || {
                // SAFETY: a live stream.
                black_box(unsafe { (d.cuStreamSynchronize().unwrap())(raw_s) });
            }),
        ),
        ("cuPointerGetAttribute (memory type) of a Vec", {
            let get = d.cuPointerGetAttribute().unwrap();
            let host = vec![0u32; 64];
            let mut status = CUresult::CUDA_SUCCESS;
            let row = per_call(rounds, k, || {
                let mut t = 0u32;
                // SAFETY: writes one u32; the pointer is only looked up.
                status = unsafe {
                    get(
                        (&mut t as *mut u32).cast(),
                        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                        host.as_ptr() as sys::CUdeviceptr,
                    )
                };
                black_box(t);
            });
            println!("cuPointerGetAttribute of a Vec's pointer: {status}");
            row
        }),
        ("SeqCst fetch_add + fetch_sub", {
            let a = AtomicUsize::new(0);
            per_call(rounds, k * 10, || {
                black_box(&a).fetch_add(1, Ordering::SeqCst);
                black_box(&a).fetch_sub(1, Ordering::SeqCst);
            })
        }),
        ("Arc clone + drop", {
            let a = Arc::new(0u64);
            per_call(rounds, k * 10, || {
                drop(black_box(Arc::clone(black_box(&a))));
            })
        }),
    ];
    header("parts: driver calls and host work, alone (ns per call)");
    for (name, row) in &calls {
        line(name, row, "ns", None);
    }

    // 2. Stream-ordered alloc + free of 1 MiB, built up part by part.
    let raw_alloc = d.cuMemAllocAsync().unwrap();
    let raw_free = d.cuMemFreeAsync().unwrap();
    let pairs = 5_000;
    let variants: [&str; 4] = [
        "alloc+free raw",
        "  + cuCtxGetId",
        "  + cuCtxGetId + 2 sections + 2 Arc pairs",
        "alloc+free ours (stream.alloc, drop)",
    ];
    let counter = AtomicUsize::new(0);
    let arc = Arc::new(0u64);
    let pair = |v: usize| {
        if v == 3 {
            drop(black_box(s.alloc::<u8>(1 << 20).unwrap()));
            return;
        }
        let mut p: sys::CUdeviceptr = 0;
        if v == 2 {
            counter.fetch_add(1, Ordering::SeqCst);
            drop(black_box(Arc::clone(&arc)));
        }
        // SAFETY: a stream-ordered allocation freed at once on the same stream.
        ok("cuMemAllocAsync", unsafe {
            raw_alloc(&mut p, 1 << 20, raw_s)
        });
        if v == 2 {
            counter.fetch_sub(1, Ordering::SeqCst);
            counter.fetch_add(1, Ordering::SeqCst);
        }
        if v >= 1 {
            let mut id = 0u64;
            // SAFETY: a live context; writes one integer.
            ok("cuCtxGetId", unsafe { get_id(ctx_raw, &mut id) });
        }
        // SAFETY: as above.
        ok("cuMemFreeAsync", unsafe { raw_free(black_box(p), raw_s) });
        if v == 2 {
            counter.fetch_sub(1, Ordering::SeqCst);
            drop(black_box(Arc::clone(&arc)));
        }
    };
    interleaved(rounds, &variants, |v| {
        time(|| {
            for _ in 0..pairs {
                pair(v);
            }
            sync();
        }) * 1e9
            / pairs as f64
    });

    // 3. The per-node update: does it need a current context?
    let f = reg.function("kernels", "empty")?;
    let buf = DeviceBuffer::<f32>::alloc(s, 1024)?;
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    let graph: CudaGraph = s.capture(|cs| -> metrale_runtime::Result<()> {
        // SAFETY: empty(float*, unsigned, float).
        unsafe { cs.launch(&f, cfg, (&buf, 7u32, 1.5f32)) }
    })?;
    let nodes = graph.kernel_nodes()?;
    let exec = graph.instantiate()?;
    let set_params = d.cuGraphExecKernelNodeSetParams_v2().unwrap();
    let set_current = d.cuCtxSetCurrent().unwrap();
    let (ptr, n, x) = (buf.device_ptr(), 7u32, 1.5f32);
    let mut params: [*mut c_void; 3] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&n as *const u32).cast_mut().cast(),
        (&x as *const f32).cast_mut().cast(),
    ];
    let np = sys::CUDA_KERNEL_NODE_PARAMS {
        func: f.as_raw(),
        gridDimX: 1,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: 32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        kernelParams: params.as_mut_ptr(),
        ..sys::CUDA_KERNEL_NODE_PARAMS::default()
    };
    let node = nodes[0].node.raw();
    // (With no context current, driver 580 crashed in this call on an H100:
    // the update is never made unbound, so that case is not probed here.)

    // With another context of the device current: the update must reach the
    // node (a fill kernel's value, read back after a replay).
    if let (Ok(create), Ok(destroy)) = (d.cuCtxCreate_v4(), d.cuCtxDestroy_v2()) {
        let fill = reg.function("kernels", "fill_index")?;
        let mut out = DeviceBuffer::<u32>::zeroed(s, 32)?;
        let g: CudaGraph = s.capture(|cs| -> metrale_runtime::Result<()> {
            // SAFETY: fill_index(unsigned*, unsigned, unsigned) over 32 words.
            unsafe { cs.launch(&fill, cfg, (&mut out, 32u32, 1u32)) }
        })?;
        let fill_nodes = g.kernel_nodes()?;
        let fill_exec = g.instantiate()?;
        let (optr, on, base) = (out.device_ptr(), 32u32, 1000u32);
        let mut fp: [*mut c_void; 3] = [
            (&optr as *const u64).cast_mut().cast(),
            (&on as *const u32).cast_mut().cast(),
            (&base as *const u32).cast_mut().cast(),
        ];
        let fnp = sys::CUDA_KERNEL_NODE_PARAMS {
            func: fill.as_raw(),
            kernelParams: fp.as_mut_ptr(),
            ..np
        };
        let mut other: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: makes a second context of device 0 (current on this thread),
        // calls, destroys it and binds ours again.
        let st = unsafe {
            let dev = reg.ctx().device();
            ok(
                "cuCtxCreate",
                create(&mut other, std::ptr::null_mut(), 0, dev),
            );
            let st = set_params(fill_exec.raw(), fill_nodes[0].node.raw(), &fnp);
            ok("cuCtxSetCurrent", set_current(ctx_raw));
            ok("cuCtxDestroy", destroy(other));
            ok("cuCtxSetCurrent", set_current(ctx_raw));
            st
        };
        // SAFETY: `out`, the only memory the graph touches, is alive.
        unsafe { fill_exec.launch(s) }?;
        let back = s.to_vec(&out)?;
        println!(
            "  with another context current: {st}; the replay wrote {}..{} (1000.. expected)",
            back[0], back[31]
        );
    }
    let variants: [&str; 4] = [
        "node update raw",
        "  + cuCtxGetCurrent",
        "  + 2 x cuCtxGetCurrent",
        "node update ours (set_kernel_params)",
    ];
    interleaved(rounds, &variants, |v| {
        let k = 2_000;
        time(|| {
            for _ in 0..k {
                if v == 3 {
                    // SAFETY: empty(float*, unsigned, float) on buf.
                    unsafe { exec.set_kernel_params(&nodes[0], &f, cfg, (&buf, n, x)) }.unwrap();
                    continue;
                }
                for _ in 0..v {
                    let mut c: sys::CUcontext = std::ptr::null_mut();
                    // SAFETY: writes one handle.
                    black_box(unsafe { get_current(&mut c) });
                }
                // SAFETY: a kernel node of the graph exec was instantiated from.
                ok("cuGraphExecKernelNodeSetParams_v2", unsafe {
                    set_params(exec.raw(), node, &np)
                });
            }
        }) * 1e9
            / k as f64
    });

    // 4. Copies to pageable memory: finished when the call returns?
    let spin = reg.function("kernels", "spin")?;
    let mut done = DeviceBuffer::<u32>::zeroed(s, 1)?;
    let word = DeviceBuffer::<u32>::zeroed(s, 64)?;
    let raw_memset = d.cuMemsetD32Async().unwrap();
    let raw_d2h = d.cuMemcpyDtoHAsync_v2().unwrap();
    sync();
    let mut seen_late = 0;
    for trial in 1..=20u32 {
        // A kernel of about 2 ms, then a fill, then the copy into a Vec.
        // SAFETY: spin(unsigned long long, unsigned*) on a live counter.
        unsafe { s.launch(&spin, cfg, (4_000_000u64, &mut done)) }.unwrap();
        let mut back = vec![0u32; 64];
        // SAFETY: 64 words of `word`; `back` is 256 writable bytes, waited for below.
        unsafe {
            ok(
                "cuMemsetD32Async",
                raw_memset(word.device_ptr(), trial, 64, raw_s),
            );
            ok(
                "cuMemcpyDtoHAsync_v2",
                raw_d2h(back.as_mut_ptr().cast(), word.device_ptr(), 256, raw_s),
            );
        }
        if back.iter().any(|&w| w != trial) {
            seen_late += 1;
        }
        sync();
    }
    println!(
        "D2H into pageable memory behind a 2 ms kernel: {seen_late} of 20 copies unfinished when the call returned"
    );

    // 5. Wake-ups after an empty kernel: on the blocking-sync event itself, a
    // raw host function unparking, and a waiting thread that blocks on the
    // event and then unparks.
    let mut blocking: sys::CUevent = std::ptr::null_mut();
    // SAFETY: writes one event; BLOCKING_SYNC | DISABLE_TIMING.
    ok("cuEventCreate", unsafe {
        ev_create(&mut blocking, 0x1 | 0x2)
    });
    let launch_empty = || {
        // SAFETY: empty(float*, unsigned, float).
        unsafe { s.launch(&f, cfg, (&buf, 7u32, 1.5f32)) }.unwrap();
    };
    struct Handoff {
        slot: Mutex<Option<usize>>,
        ready: Condvar,
        done: AtomicBool,
        main: std::thread::Thread,
    }
    let hand = Arc::new(Handoff {
        slot: Mutex::new(None),
        ready: Condvar::new(),
        done: AtomicBool::new(false),
        main: std::thread::current(),
    });
    let stop = usize::MAX;
    let waiter = {
        let hand = Arc::clone(&hand);
        let ctx = ctx_raw as usize;
        std::thread::spawn(move || loop {
            // SAFETY: binds the (retained) context on this thread.
            ok("cuCtxSetCurrent", unsafe {
                set_current(ctx as sys::CUcontext)
            });
            let e = {
                let mut g = hand.slot.lock().unwrap();
                loop {
                    if let Some(e) = g.take() {
                        break e;
                    }
                    g = hand.ready.wait(g).unwrap();
                }
            };
            if e == stop {
                return;
            }
            // SAFETY: a live blocking-sync event (the main thread keeps it).
            ok("cuEventSynchronize", unsafe { ev_sync(e as sys::CUevent) });
            hand.done.store(true, Ordering::Release);
            hand.main.unpark();
        })
    };
    struct Flag {
        done: AtomicBool,
        thread: std::thread::Thread,
    }
    unsafe extern "C" fn unpark_flag(data: *mut c_void) {
        // SAFETY: the Flag the waiting thread keeps alive until `done`.
        let f = unsafe { &*data.cast_const().cast::<Flag>() };
        f.done.store(true, Ordering::Release);
        f.thread.unpark();
    }
    let flag = Flag {
        done: AtomicBool::new(false),
        thread: std::thread::current(),
    };
    let raw_host_fn = d.cuLaunchHostFunc().unwrap();
    let variants: [&str; 4] = [
        "wake: blocking-sync event, this thread",
        "wake: raw host function unparks",
        "wake: waiting thread on the event, unparks",
        "wake: stream.done() (ours today)",
    ];
    interleaved(rounds, &variants, |v| {
        let k = 100;
        let mut t = 0.0;
        for _ in 0..k {
            t += time(|| {
                launch_empty();
                match v {
                    // SAFETY: live event and stream of one context.
                    0 => unsafe {
                        ok("cuEventRecord", ev_record(blocking, raw_s));
                        ok("cuEventSynchronize", ev_sync(blocking));
                    },
                    1 => {
                        flag.done.store(false, Ordering::Relaxed);
                        // SAFETY: `flag` outlives the wait below.
                        ok("cuLaunchHostFunc", unsafe {
                            raw_host_fn(
                                raw_s,
                                Some(unpark_flag),
                                (&flag as *const Flag).cast_mut().cast(),
                            )
                        });
                        while !flag.done.load(Ordering::Acquire) {
                            std::thread::park_timeout(Duration::from_secs(1));
                        }
                    }
                    2 => {
                        hand.done.store(false, Ordering::Relaxed);
                        // SAFETY: live event and stream.
                        ok("cuEventRecord", unsafe { ev_record(blocking, raw_s) });
                        *hand.slot.lock().unwrap() = Some(blocking as usize);
                        hand.ready.notify_one();
                        while !hand.done.load(Ordering::Acquire) {
                            std::thread::park_timeout(Duration::from_secs(1));
                        }
                    }
                    _ => super::block_on(s.done()).unwrap(),
                }
            });
        }
        t * 1e9 / k as f64
    });
    *hand.slot.lock().unwrap() = Some(stop);
    hand.ready.notify_one();
    waiter.join().unwrap();
    sync();

    // 6. A tensor map's address replaced: which of its 16 words the driver
    // changes, and what a copy of the map right after the call costs.
    let (Ok(encode), Ok(replace)) = (d.cuTensorMapEncodeTiled(), d.cuTensorMapReplaceAddress())
    else {
        println!("tensor maps: the driver lacks them; rows skipped");
        return Ok(());
    };
    let a = DeviceBuffer::<f32>::alloc(s, 256 * 512)?;
    let b = DeviceBuffer::<f32>::alloc(s, 256 * 512)?;
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let (dims, strides, boxes, estrides) = ([512u64, 256], [512u64 * 4], [32u32, 32], [1u32, 1]);
    // SAFETY: a writable map; arrays of the rank's length; `a` covers the tensor.
    ok("cuTensorMapEncodeTiled", unsafe {
        encode(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            2,
            a.device_ptr() as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            estrides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    });
    let before = map.opaque;
    // SAFETY: an encoded map; `b` covers the tensor.
    ok("cuTensorMapReplaceAddress", unsafe {
        replace(&mut map, b.device_ptr() as *mut c_void)
    });
    let changed: Vec<usize> = (0..16).filter(|&i| before[i] != map.opaque[i]).collect();
    println!("\ncuTensorMapReplaceAddress changed words {changed:?} of 16");
    let mut copy = sys::CUtensorMap { opaque: [0; 16] };
    let variants: [&str; 3] = [
        "replace address raw, in place",
        "  + a copy of the map right after",
        "  + a copy of the map before the call",
    ];
    interleaved(rounds, &variants, |v| {
        let k = 2_000;
        time(|| {
            for i in 0..k {
                let p = if i % 2 == 0 { &b } else { &a };
                if v == 2 {
                    copy = *black_box(&map);
                }
                // SAFETY: an encoded map; both buffers cover the tensor.
                black_box(unsafe { replace(&mut map, p.device_ptr() as *mut c_void) });
                if v == 1 {
                    copy = *black_box(&map);
                }
                black_box(&copy);
            }
        }) * 1e9
            / k as f64
    });
    Ok(())
}

/// Time `variants` round by round, their order rotating, and print each beside
/// the first (ns).
fn interleaved(rounds: usize, variants: &[&str], mut one: impl FnMut(usize) -> f64) {
    let mut rows = vec![Row::default(); variants.len()];
    let n = variants.len();
    for _ in 0..2 {
        for v in 0..n {
            one(v);
        }
    }
    for r in 0..rounds {
        for j in 0..n {
            let v = (r + j) % n;
            let x = one(v);
            rows[v].push(x);
        }
    }
    println!();
    for (name, row) in variants.iter().zip(&rows) {
        line(name, row, "ns", Some(&ratios(row, &rows[0])));
    }
}
