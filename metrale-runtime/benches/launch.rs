//! Launch, event, stream and copy cost against the raw driver floor, on one GPU.
//!
//! `cargo bench -p metrale-runtime --bench launch` prints one table. Every launch
//! row uses the same kernel (`empty(float*, unsigned, float)`), the same stream and
//! the same process; rows are interleaved in rounds so clock and thermal drift hit
//! them all alike; within a round the launch paths take turns batch by batch. Each
//! cell is the median over the rounds, with the spread (min..max); "vs raw" is the
//! median of the per-round ratios (each round compares neighbours in time).
//!
//! The last rows (`launch/async_rows.rs`) compare a future's wake-up after an
//! empty kernel with `cuStreamSynchronize`, process CPU time with wall time while
//! 1,000 futures wait on 1 ms kernels, and the submit cost of `launch_host_fn`,
//! `write_value32` and `wait_value32` with the raw calls.
//!
//! Then (`launch/tensor_map_rows.rs`) the cost of encoding a tensor map and of
//! replacing its address, beside the raw calls.
//!
//! Options (after `--`): `--rounds N` (default 31), `--quick` (fewer, smaller).
//! Without a driver it exits with status 2 and the loader's message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "launch/async_rows.rs"]
mod async_rows;
mod common;
#[path = "launch/tensor_map_rows.rs"]
mod tensor_map_rows;

use std::ffi::c_void;
use std::hint::black_box;
use std::process::ExitCode;
use std::sync::OnceLock;

use common::{header, line, ratios, rounds, time, Row};
use metrale_runtime::sys::{self, CUresult};
use metrale_runtime::{
    CudaEvent, CudaStream, DeviceBuffer, KernelArgList, LaunchConfig, MetraleError,
    MetraleRegistry, PinnedBuffer, RawCudaFunc,
};

static PTX: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");
static CUBIN: &[u8] = include_bytes!("../tests/fixtures/kernels.sm_90.cubin");

fn ok(call: &str, s: CUresult) {
    assert!(s.is_success(), "{call} failed: {s}");
}

fn run() -> Result<(), MetraleError> {
    let quick = common::is_quick();
    let rounds = rounds(31, 5);
    let launches = if quick { 2_000 } else { 20_000 };
    let copy_sizes: Vec<usize> = if quick {
        vec![64 << 20]
    } else {
        vec![64 << 20, 1 << 30]
    };

    let t = std::time::Instant::now();
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let first_driver_load_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = std::time::Instant::now();
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
    let first_registry_ms = t.elapsed().as_secs_f64() * 1e3;
    let host = reg.host();
    let stream = reg.stream();
    let raw_stream = stream.raw();
    static EMPTY: OnceLock<RawCudaFunc> = OnceLock::new();
    let f = reg.raw_function_cached(&EMPTY, "kernels", "empty")?;
    let func = reg.function("kernels", "empty")?;
    let buf = DeviceBuffer::<f32>::alloc(stream, 1024)?;
    let (ptr, n, x) = (buf.device_ptr(), 7u32, 1.5f32);
    let params: [*mut c_void; 3] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&n as *const u32).cast_mut().cast(),
        (&x as *const f32).cast_mut().cast(),
    ];
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    let raw_launch = d.cuLaunchKernel().unwrap();
    let raw_sync = d.cuStreamSynchronize().unwrap();

    let floor = || {
        // SAFETY: `empty` with three valid parameters on the host's stream.
        let s = unsafe {
            raw_launch(
                f.as_raw(),
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                raw_stream,
                params.as_ptr().cast_mut(),
                std::ptr::null_mut(),
            )
        };
        ok("cuLaunchKernel", s);
    };
    let on_stream = || {
        let mut p = params;
        // SAFETY: as above.
        unsafe { reg.launch_on_stream(f, cfg, stream, &mut p) }.unwrap();
    };
    let registry_typed = || {
        // SAFETY: `empty(float*, unsigned, float)`.
        unsafe { reg.launch(f, cfg, stream, (&buf, n, x)) }.unwrap();
    };
    let recommended = || {
        // SAFETY: as above.
        unsafe { stream.launch(&func, cfg, (&buf, n, x)) }.unwrap();
    };
    let mut list = KernelArgList::new();
    list.push(&buf).push(n).push(x);
    let run_time_list = || {
        // SAFETY: as above, the same three arguments from a run-time list.
        unsafe { stream.launch(&func, cfg, &list) }.unwrap();
    };
    let unchecked = || {
        let mut p = params;
        // SAFETY: as above.
        unsafe { stream.launch_raw(&func, cfg, &mut p) }.unwrap();
    };
    let sync_raw = || {
        // SAFETY: the host's stream.
        ok("cuStreamSynchronize", unsafe { raw_sync(raw_stream) });
    };
    let sync_ours = || stream.synchronize().unwrap();

    // Submit cost: batches of 250 launches, synchronised outside the timed region so
    // the queue never fills; the paths take turns batch by batch (rotating who goes
    // first). Returns µs per launch for each path.
    let submit_round = |paths: &[&dyn Fn()]| -> Vec<f64> {
        let batch = 250;
        let batches = launches / batch;
        let mut total = vec![0.0; paths.len()];
        for b in 0..batches {
            for k in 0..paths.len() {
                let i = (b + k) % paths.len();
                total[i] += time(|| {
                    for _ in 0..batch {
                        paths[i]();
                    }
                });
                sync_raw();
            }
        }
        total
            .iter()
            .map(|t| t * 1e6 / (batches * batch) as f64)
            .collect()
    };
    // Launch then wait, alternating the paths launch by launch; µs per pair.
    let latency_round = || -> (f64, f64) {
        let k = launches / 20;
        let (mut raw, mut mine) = (0.0, 0.0);
        for i in 0..k {
            if i % 2 == 0 {
                raw += time(|| {
                    floor();
                    sync_raw();
                });
            } else {
                mine += time(|| {
                    recommended();
                    sync_ours();
                });
            }
        }
        let half = (k / 2) as f64;
        (raw * 1e6 / half, mine * 1e6 / half)
    };
    // A memoized lookup's hit, and its floor: the same `OnceLock` read with no
    // check, the handle consumed the same way.
    let lookup = |floor_first: bool| -> (f64, f64) {
        let k = 10_000_000;
        let floor = || {
            time(|| {
                for _ in 0..k {
                    black_box(*black_box(&EMPTY).get().unwrap());
                }
            })
        };
        let hit = || {
            time(|| {
                for _ in 0..k {
                    black_box(
                        reg.raw_function_cached(black_box(&EMPTY), "kernels", "empty")
                            .unwrap(),
                    );
                }
            })
        };
        let (a, b) = if floor_first {
            let a = floor();
            (a, hit())
        } else {
            let b = hit();
            (floor(), b)
        };
        (a * 1e9 / k as f64, b * 1e9 / k as f64)
    };

    // Events: record + query, raw and ours, alternating; µs per pair.
    let raw_event = {
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event; the context is current.
        ok("cuEventCreate", unsafe {
            (d.cuEventCreate().unwrap())(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0)
        });
        e
    };
    let our_event = CudaEvent::new(reg.ctx())?;
    let raw_record = d.cuEventRecord().unwrap();
    let raw_query = d.cuEventQuery().unwrap();
    let event_round = || -> (f64, f64) {
        let k = 10_000;
        let raw = time(|| {
            for _ in 0..k {
                // SAFETY: a live event and stream.
                unsafe {
                    ok("cuEventRecord", raw_record(raw_event, raw_stream));
                    black_box(raw_query(raw_event));
                }
            }
        });
        sync_raw();
        let mine = time(|| {
            for _ in 0..k {
                our_event.record(stream).unwrap();
                black_box(our_event.query().unwrap());
            }
        });
        sync_raw();
        (raw * 1e6 / k as f64, mine * 1e6 / k as f64)
    };
    // Streams: create + destroy.
    let raw_create = d.cuStreamCreateWithPriority().unwrap();
    let raw_destroy = d.cuStreamDestroy_v2().unwrap();
    let stream_round = || -> (f64, f64) {
        let k = 1_000;
        let raw = time(|| {
            for _ in 0..k {
                let mut s: sys::CUstream = std::ptr::null_mut();
                // SAFETY: creates and destroys one stream in the current context.
                unsafe {
                    ok("cuStreamCreateWithPriority", raw_create(&mut s, 1, 0));
                    ok("cuStreamDestroy_v2", raw_destroy(s));
                }
            }
        });
        let mine = time(|| {
            for _ in 0..k {
                drop(black_box(CudaStream::new(reg.ctx()).unwrap()));
            }
        });
        (raw * 1e6 / k as f64, mine * 1e6 / k as f64)
    };

    let paths: [&dyn Fn(); 6] = [
        &floor,
        &on_stream,
        &registry_typed,
        &recommended,
        &unchecked,
        &run_time_list,
    ];
    for _ in 0..2 {
        submit_round(&paths);
    }

    let mut submit: Vec<Row> = vec![Row::default(); paths.len()];
    let (mut lat_raw, mut lat_ours) = (Row::default(), Row::default());
    let (mut lookups, mut lookup_floor) = (Row::default(), Row::default());
    let (mut ev_raw, mut ev_ours) = (Row::default(), Row::default());
    let (mut st_raw, mut st_ours) = (Row::default(), Row::default());
    for round in 0..rounds {
        for (row, us) in submit.iter_mut().zip(submit_round(&paths)) {
            row.push(us);
        }
        let (raw, mine) = latency_round();
        lat_raw.push(raw);
        lat_ours.push(mine);
        let (floor, hit) = lookup(round % 2 == 0);
        lookup_floor.push(floor);
        lookups.push(hit);
        let (raw, mine) = event_round();
        ev_raw.push(raw);
        ev_ours.push(mine);
        let (raw, mine) = stream_round();
        st_raw.push(raw);
        st_ours.push(mine);
    }

    // Copies through pinned memory: GB/s (10^9 bytes per second).
    let mut copy_rows = Vec::new();
    for &bytes in &copy_sizes {
        let mut pinned = PinnedBuffer::<u8>::zeroed(stream, bytes)?;
        for (i, b) in pinned.iter_mut().enumerate() {
            *b = i as u8;
        }
        let mut dev = DeviceBuffer::<u8>::alloc(stream, bytes)?;
        let dptr = dev.device_ptr();
        let hptr = pinned.as_mut_ptr();
        let gbps = |secs: f64| bytes as f64 / secs / 1e9;
        let raw_h2d = d.cuMemcpyHtoDAsync_v2().unwrap();
        let raw_d2h = d.cuMemcpyDtoHAsync_v2().unwrap();
        let (mut ru, mut ou, mut rd, mut od) = (
            Row::default(),
            Row::default(),
            Row::default(),
            Row::default(),
        );
        let mut pinned = Some(pinned);
        for round in 0..rounds.min(9) + 1 {
            let raw_up = time(|| {
                // SAFETY: pinned and device buffers of `bytes`, synchronised at once.
                ok("cuMemcpyHtoDAsync_v2", unsafe {
                    raw_h2d(dptr, hptr.cast(), bytes, raw_stream)
                });
                sync_raw();
            });
            let raw_down = time(|| {
                // SAFETY: as above.
                ok("cuMemcpyDtoHAsync_v2", unsafe {
                    raw_d2h(hptr.cast(), dptr, bytes, raw_stream)
                });
                sync_raw();
            });
            let mut ours_up = 0.0;
            let mut ours_down = 0.0;
            let p = pinned.take().unwrap();
            let p = {
                let mut back = None;
                ours_up += time(|| {
                    back = Some(stream.copy_h2d_pinned(p, &mut dev).unwrap().wait().unwrap());
                });
                back.unwrap()
            };
            let p = {
                let mut back = None;
                ours_down += time(|| {
                    back = Some(stream.copy_d2h_pinned(&dev, p).unwrap().wait().unwrap());
                });
                back.unwrap()
            };
            pinned = Some(p);
            if round > 0 {
                ru.push(gbps(raw_up));
                rd.push(gbps(raw_down));
                ou.push(gbps(ours_up));
                od.push(gbps(ours_down));
            }
        }
        copy_rows.push((bytes, ru, ou, rd, od));
    }

    // Module loads: fresh registries, PTX (JIT; the driver may cache it) vs cubin.
    let (mut r_ptx, mut r_cubin) = (Row::default(), Row::default());
    for _ in 0..rounds.min(9) {
        r_ptx.push(time(|| drop(MetraleRegistry::load(0, &[("k", PTX)]).unwrap())) * 1e3);
        r_cubin.push(time(|| drop(MetraleRegistry::load(0, &[("k", CUBIN)]).unwrap())) * 1e3);
    }

    let v = host.driver_version();
    header(&format!(
        "metrale launch benchmark: {} (sm_{}{}), driver {}.{} ({v}), {rounds} rounds, {launches} launches per submit sample",
        host.device_name(),
        host.limits().compute_capability.0,
        host.limits().compute_capability.1,
        v / 1000,
        v % 1000 / 10,
    ));
    let names = [
        "floor: raw cuLaunchKernel (sys table)",
        "registry.launch_on_stream (RawCudaFunc, void**)",
        "registry.launch (typed, checked)",
        "stream.launch(&CudaFunction) (typed, checked)",
        "stream.launch_raw (void**, unchecked)",
        "stream.launch(&KernelArgList) (run-time list, checked)",
    ];
    let floor_row = submit[0].clone();
    for (name, row) in names.iter().zip(&submit) {
        line(name, row, "us", Some(&ratios(row, &floor_row)));
    }
    line(
        "launch + sync: raw",
        &lat_raw,
        "us",
        Some(&ratios(&lat_raw, &lat_raw)),
    );
    line(
        "launch + sync: stream.launch",
        &lat_ours,
        "us",
        Some(&ratios(&lat_ours, &lat_raw)),
    );
    line(
        "memoized lookup floor: OnceLock::get, no check",
        &lookup_floor,
        "ns",
        Some(&ratios(&lookup_floor, &lookup_floor)),
    );
    line(
        "raw_function_cached hit",
        &lookups,
        "ns",
        Some(&ratios(&lookups, &lookup_floor)),
    );
    line(
        "event record + query: raw",
        &ev_raw,
        "us",
        Some(&ratios(&ev_raw, &ev_raw)),
    );
    line(
        "event record + query: CudaEvent",
        &ev_ours,
        "us",
        Some(&ratios(&ev_ours, &ev_raw)),
    );
    line(
        "stream create + destroy: raw",
        &st_raw,
        "us",
        Some(&ratios(&st_raw, &st_raw)),
    );
    line(
        "stream create + destroy: CudaStream",
        &st_ours,
        "us",
        Some(&ratios(&st_ours, &st_raw)),
    );
    for (bytes, ru, ou, rd, od) in &copy_rows {
        let size = if *bytes >= 1 << 30 {
            format!("{} GiB", bytes >> 30)
        } else {
            format!("{} MiB", bytes >> 20)
        };
        line(
            &format!("H2D pinned {size}: raw (GB/s)"),
            ru,
            "  ",
            Some(&ratios(ru, ru)),
        );
        line(
            &format!("H2D pinned {size}: copy_h2d_pinned (GB/s)"),
            ou,
            "  ",
            Some(&ratios(ou, ru)),
        );
        line(
            &format!("D2H pinned {size}: raw (GB/s)"),
            rd,
            "  ",
            Some(&ratios(rd, rd)),
        );
        line(
            &format!("D2H pinned {size}: copy_d2h_pinned (GB/s)"),
            od,
            "  ",
            Some(&ratios(od, rd)),
        );
    }
    line("MetraleRegistry::load, PTX module (ms)", &r_ptx, "  ", None);
    line(
        "MetraleRegistry::load, cubin module (ms)",
        &r_cubin,
        "  ",
        None,
    );
    println!(
        "{:<52} {:>7.3} ms (once per process)",
        "first driver() load", first_driver_load_ms
    );
    println!(
        "{:<52} {:>7.3} ms (cuInit, context, stream, PTX JIT)",
        "first MetraleRegistry::load", first_registry_ms
    );
    // SAFETY: the raw event is destroyed once, after its last use.
    unsafe { (d.cuEventDestroy_v2().unwrap())(raw_event) };
    drop(buf);
    // Issue 22: futures, host functions, stream memory operations.
    async_rows::run(&reg, rounds.min(11), quick)?;
    // Issue 23: tensor-map encode and address replacement.
    tensor_map_rows::run(&reg, rounds.min(11), quick)?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("launch bench: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("launch bench: {e}");
            ExitCode::FAILURE
        }
    }
}
