//! Launch and copy cost against the raw driver floor, on one GPU.
//!
//! `cargo bench -p metrale-runtime --bench launch` prints one table. Every row uses
//! the same kernel (`empty(float*, unsigned, float)`), the same stream and the same
//! process; rows are interleaved in rounds so clock and thermal drift hit them all
//! alike; within a round the launch paths take turns batch by batch. Each cell is
//! the median over the rounds, with the spread (min..max); "vs floor" is the median
//! of the per-round ratios (each round compares neighbours in time).
//!
//! Options (after `--`): `--rounds N` (default 15), `--quick` (fewer, smaller).
//! Without a driver it exits with status 2 and the loader's message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::c_void;
use std::hint::black_box;
use std::process::ExitCode;
use std::sync::OnceLock;
use std::time::Instant;

use metrale_runtime::sys::{self, CUresult};
use metrale_runtime::{
    DeviceBuffer, LaunchConfig, MetraleError, MetraleRegistry, PinnedBuffer, RawCudaFunc,
};

static PTX: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");
static CUBIN: &[u8] = include_bytes!("../tests/fixtures/kernels.sm_90.cubin");

struct Opts {
    rounds: usize,
    launches: usize,
    copy_sizes: Vec<usize>,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 5 } else { 31 });
    Opts {
        rounds,
        launches: if quick { 2_000 } else { 20_000 },
        copy_sizes: if quick {
            vec![64 << 20]
        } else {
            vec![64 << 20, 1 << 30]
        },
    }
}

/// Samples of one row, one per round.
#[derive(Default)]
struct Row {
    samples: Vec<f64>,
}

impl Row {
    fn median(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        }
    }
    fn min(&self) -> f64 {
        self.samples.iter().copied().fold(f64::INFINITY, f64::min)
    }
    fn max(&self) -> f64 {
        self.samples
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max)
    }
}

fn ok(call: &str, s: CUresult) {
    assert!(s.is_success(), "{call} failed: {s}");
}

fn run(o: &Opts) -> Result<(), MetraleError> {
    let t = Instant::now();
    let d = sys::driver().map_err(|e| MetraleError::DriverUnavailable(e.clone()))?;
    let first_driver_load_ms = t.elapsed().as_secs_f64() * 1e3;

    let t = Instant::now();
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
    let first_registry_ms = t.elapsed().as_secs_f64() * 1e3;
    let host = reg.host();
    let stream = reg.raw_stream();
    static EMPTY: OnceLock<RawCudaFunc> = OnceLock::new();
    let f = reg.raw_function_cached(&EMPTY, "kernels", "empty")?;
    let buf = DeviceBuffer::<f32>::alloc(host, 1024)?;
    let (ptr, n, x) = (buf.device_ptr(), 7u32, 1.5f32);
    let params: [*mut c_void; 3] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&n as *const u32).cast_mut().cast(),
        (&x as *const f32).cast_mut().cast(),
    ];
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    let raw_launch = d.cuLaunchKernel().unwrap();
    let raw_sync = d.cuStreamSynchronize().unwrap();
    let raw_h2d = d.cuMemcpyHtoDAsync_v2().unwrap();
    let raw_d2h = d.cuMemcpyDtoHAsync_v2().unwrap();

    let floor = || {
        // SAFETY: `empty` with three valid parameters on the host's stream.
        let s = unsafe {
            raw_launch(
                f.0,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                stream,
                params.as_ptr().cast_mut(),
                std::ptr::null_mut(),
            )
        };
        ok("cuLaunchKernel", s);
    };
    let ours = || {
        let mut p = params;
        // SAFETY: as above.
        unsafe { reg.launch_on_stream(f, cfg, stream, &mut p) }.unwrap();
    };
    let typed = || {
        // SAFETY: `empty(float*, unsigned, float)`.
        unsafe { reg.launch(f, cfg, stream, (&buf, n, x)) }.unwrap();
    };
    let sync_raw = || {
        // SAFETY: the host's stream.
        ok("cuStreamSynchronize", unsafe { raw_sync(stream) });
    };
    let sync_ours = || reg.stream_synchronize(stream).unwrap();

    // Submit cost: batches of 250 launches, synchronised outside the timed region
    // so the queue never fills. Within a round the paths take turns batch by batch
    // (rotating who goes first), so each round's ratios compare neighbours in time.
    // Returns µs per launch for each path.
    let submit_round = |paths: &[&dyn Fn()]| -> Vec<f64> {
        let batch = 250;
        let batches = o.launches / batch;
        let mut total = vec![0.0; paths.len()];
        for b in 0..batches {
            for k in 0..paths.len() {
                let i = (b + k) % paths.len();
                let t = Instant::now();
                for _ in 0..batch {
                    paths[i]();
                }
                total[i] += t.elapsed().as_secs_f64();
                sync_raw();
            }
        }
        total
            .iter()
            .map(|t| t * 1e6 / (batches * batch) as f64)
            .collect()
    };
    // Launch then wait, alternating the two paths launch by launch; µs per pair.
    let latency_round = || -> (f64, f64) {
        let k = o.launches / 20;
        let (mut raw, mut mine) = (0.0, 0.0);
        for i in 0..k {
            let t = Instant::now();
            if i % 2 == 0 {
                floor();
                sync_raw();
                raw += t.elapsed().as_secs_f64();
            } else {
                ours();
                sync_ours();
                mine += t.elapsed().as_secs_f64();
            }
        }
        let half = (k / 2) as f64;
        (raw * 1e6 / half, mine * 1e6 / half)
    };
    let lookup = || -> f64 {
        let k = 10_000_000;
        let t = Instant::now();
        for _ in 0..k {
            black_box(
                reg.raw_function_cached(black_box(&EMPTY), "kernels", "empty")
                    .unwrap(),
            );
        }
        t.elapsed().as_secs_f64() * 1e9 / k as f64
    };

    let paths: [&dyn Fn(); 3] = [&floor, &ours, &typed];
    // Warm up every path.
    for _ in 0..2 {
        submit_round(&paths);
    }

    let mut r_floor = Row::default();
    let mut r_ours = Row::default();
    let mut r_typed = Row::default();
    let mut q_ours = Row::default();
    let mut q_typed = Row::default();
    let mut r_lat_floor = Row::default();
    let mut r_lat_ours = Row::default();
    let mut q_lat = Row::default();
    let mut r_lookup = Row::default();
    for _ in 0..o.rounds {
        let us = submit_round(&paths);
        r_floor.samples.push(us[0]);
        r_ours.samples.push(us[1]);
        r_typed.samples.push(us[2]);
        q_ours.samples.push(us[1] / us[0]);
        q_typed.samples.push(us[2] / us[0]);
        let (raw, mine) = latency_round();
        r_lat_floor.samples.push(raw);
        r_lat_ours.samples.push(mine);
        q_lat.samples.push(mine / raw);
        r_lookup.samples.push(lookup());
    }

    // Copies through pinned memory: GB/s (10^9 bytes per second).
    let mut copy_rows = Vec::new();
    for &bytes in &o.copy_sizes {
        let mut pinned = PinnedBuffer::<u8>::zeroed(host, bytes)?;
        for (i, b) in pinned.iter_mut().enumerate() {
            *b = i as u8;
        }
        let dev = DeviceBuffer::<u8>::alloc(host, bytes)?;
        let dptr = dev.device_ptr();
        let hptr = pinned.as_mut_ptr();
        let gbps = |secs: f64| bytes as f64 / secs / 1e9;
        let time = |copy: &dyn Fn()| {
            let t = Instant::now();
            copy();
            t.elapsed().as_secs_f64()
        };
        let raw_up = || {
            // SAFETY: pinned and device buffers of `bytes`, synchronised at once.
            ok("cuMemcpyHtoDAsync_v2", unsafe {
                raw_h2d(dptr, hptr.cast(), bytes, stream)
            });
            sync_raw();
        };
        let raw_down = || {
            // SAFETY: as above.
            ok("cuMemcpyDtoHAsync_v2", unsafe {
                raw_d2h(hptr.cast(), dptr, bytes, stream)
            });
            sync_raw();
        };
        let ours_up = || {
            // SAFETY: as above.
            unsafe { reg.copy_h2d_async(dptr, hptr.cast(), bytes, stream) }.unwrap();
            sync_ours();
        };
        let ours_down = || {
            // SAFETY: as above.
            unsafe { reg.copy_d2h_async(hptr.cast(), dptr, bytes, stream) }.unwrap();
            sync_ours();
        };
        raw_up();
        raw_down();
        let (mut ru, mut ou, mut rd, mut od) = (
            Row::default(),
            Row::default(),
            Row::default(),
            Row::default(),
        );
        for round in 0..o.rounds.min(9) {
            if round % 2 == 0 {
                ru.samples.push(gbps(time(&raw_up)));
                ou.samples.push(gbps(time(&ours_up)));
                rd.samples.push(gbps(time(&raw_down)));
                od.samples.push(gbps(time(&ours_down)));
            } else {
                od.samples.push(gbps(time(&ours_down)));
                rd.samples.push(gbps(time(&raw_down)));
                ou.samples.push(gbps(time(&ours_up)));
                ru.samples.push(gbps(time(&raw_up)));
            }
        }
        copy_rows.push((bytes, ru, ou, rd, od));
    }

    // Module loads: fresh registries, PTX (JIT; the driver may cache it) vs cubin.
    let mut r_ptx = Row::default();
    let mut r_cubin = Row::default();
    for _ in 0..o.rounds.min(9) {
        let t = Instant::now();
        drop(MetraleRegistry::load(0, &[("k", PTX)])?);
        r_ptx.samples.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        drop(MetraleRegistry::load(0, &[("k", CUBIN)])?);
        r_cubin.samples.push(t.elapsed().as_secs_f64() * 1e3);
    }

    let v = host.driver_version();
    println!(
        "\nmetrale launch benchmark: {} (sm_{}{}), driver {}.{} ({v}), {} rounds, {} launches per submit sample\n",
        host.device_name(),
        host.limits().compute_capability.0,
        host.limits().compute_capability.1,
        v / 1000,
        v % 1000 / 10,
        o.rounds,
        o.launches
    );
    println!(
        "{:<44} {:>10} {:>21} {:>9}",
        "row", "median", "spread (min..max)", "vs floor"
    );
    let line = |name: &str, row: &Row, unit: &str, ratio: Option<f64>| {
        let ratio = ratio.map_or(String::from("-"), |q| format!("{q:.3}"));
        println!(
            "{:<44} {:>7.3} {unit:<2} {:>10.3}..{:<8.3} {:>9}",
            name,
            row.median(),
            row.min(),
            row.max(),
            ratio
        );
    };
    let (q1, q2, q3) = (q_ours.median(), q_typed.median(), q_lat.median());
    line(
        "floor: raw cuLaunchKernel (sys table)",
        &r_floor,
        "us",
        Some(1.0),
    );
    line(
        "launch_on_stream (memoized RawCudaFunc)",
        &r_ours,
        "us",
        Some(q1),
    );
    line("typed launch (KernelArgs tuple)", &r_typed, "us", Some(q2));
    line("launch + sync: raw", &r_lat_floor, "us", Some(1.0));
    line(
        "launch + sync: launch_on_stream",
        &r_lat_ours,
        "us",
        Some(q3),
    );
    line("raw_function_cached hit", &r_lookup, "ns", None);
    for (bytes, ru, ou, rd, od) in &copy_rows {
        let size = if *bytes >= 1 << 30 {
            format!("{} GiB", bytes >> 30)
        } else {
            format!("{} MiB", bytes >> 20)
        };
        let up = ou.median() / ru.median();
        let down = od.median() / rd.median();
        line(
            &format!("H2D pinned {size}: raw (GB/s)"),
            ru,
            "  ",
            Some(1.0),
        );
        line(
            &format!("H2D pinned {size}: copy_h2d_async (GB/s)"),
            ou,
            "  ",
            Some(up),
        );
        line(
            &format!("D2H pinned {size}: raw (GB/s)"),
            rd,
            "  ",
            Some(1.0),
        );
        line(
            &format!("D2H pinned {size}: copy_d2h_async (GB/s)"),
            od,
            "  ",
            Some(down),
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
        "{:<44} {:>7.3} ms (once per process)",
        "first driver() load", first_driver_load_ms
    );
    println!(
        "{:<44} {:>7.3} ms (cuInit, context, stream, PTX JIT)",
        "first MetraleRegistry::load", first_registry_ms
    );
    println!(
        "\nper-round ratios to the floor over {} rounds (median, min..max):",
        o.rounds
    );
    for (name, q) in [
        ("launch_on_stream / floor", &q_ours),
        ("typed launch / floor", &q_typed),
        ("launch + sync, ours / raw", &q_lat),
    ] {
        println!(
            "{:<44} {:>7.3}    {:>10.3}..{:<8.3}",
            name,
            q.median(),
            q.min(),
            q.max()
        );
    }
    drop(buf);
    Ok(())
}

fn main() -> ExitCode {
    let o = opts();
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ MetraleError::DriverUnavailable(_)) => {
            eprintln!("launch bench: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("launch bench: {e}");
            ExitCode::FAILURE
        }
    }
}
