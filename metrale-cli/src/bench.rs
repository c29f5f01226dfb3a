//! `metrale bench`: the launch floor on this machine (raw `cuLaunchKernel` through
//! the sys table) beside the registry's `launch_on_stream` and the typed, checked
//! `CudaStream::launch` (the README's recommended launch), all launching the
//! repository's `empty(float*, unsigned, float)` kernel (from the PTX fixture,
//! built in) on the same stream. Paths take turns batch by batch within a round;
//! each row is the median over rounds with the spread (min..max); "vs floor" is
//! the median of the per-round ratios.

use std::ffi::c_void;
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::time::Instant;

use metrale_runtime::sys;
use metrale_runtime::{
    CallError, DeviceBuffer, LaunchConfig, MetraleError, MetraleRegistry, RawCudaFunc,
};

use crate::json::Json;
use crate::{cuda_version, Outcome, FAILED, NO_DRIVER};

static PTX: &[u8] = include_bytes!("../../metrale-runtime/tests/fixtures/kernels.ptx");

/// The rows: the floor first.
const PATHS: [&str; 3] = [
    "raw cuLaunchKernel (floor)",
    "registry launch_on_stream",
    "typed CudaStream::launch",
];

/// Launches per timed batch (synchronised outside the timing).
const BATCH: usize = 250;

/// `metrale bench` options.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Rounds (each one sample per path).
    pub rounds: usize,
    /// Launches per path per round.
    pub launches: usize,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            rounds: 15,
            launches: 5_000,
        }
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn spread(xs: &[f64]) -> (f64, f64) {
    xs.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x), hi.max(x))
        })
}

struct Measured {
    driver_version: i32,
    device: String,
    /// µs per launch, per round, per path (in [`PATHS`] order).
    samples: [Vec<f64>; 3],
}

fn measure(options: Options) -> Result<Measured, MetraleError> {
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
    let stream = reg.stream();
    let raw_stream = stream.raw();
    static EMPTY: OnceLock<RawCudaFunc> = OnceLock::new();
    let f = reg.raw_function_cached(&EMPTY, "kernels", "empty")?;
    let func = reg.function("kernels", "empty")?;
    let buf = DeviceBuffer::<f32>::alloc(stream, 1)?;
    let (ptr, n, x) = (buf.device_ptr(), 7u32, 1.5f32);
    let params: [*mut c_void; 3] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&n as *const u32).cast_mut().cast(),
        (&x as *const f32).cast_mut().cast(),
    ];
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    let raw_launch = d
        .cuLaunchKernel()
        .map_err(|e| CallError::Missing(e).about("the launch floor"))?;
    let status = |call: &'static str, status: sys::CUresult| -> Result<(), MetraleError> {
        if status.is_success() {
            Ok(())
        } else {
            Err(CallError::Status { call, status }.about("kernel 'kernels::empty'"))
        }
    };
    let floor = || -> Result<(), MetraleError> {
        // SAFETY: `empty(float*, unsigned, float)` with three parameters that live
        // across the call, on the registry's stream, one block of 32 threads.
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
        status("cuLaunchKernel", s)
    };
    let ours = || -> Result<(), MetraleError> {
        let mut p = params;
        // SAFETY: as for the floor: `empty` with its three parameters; the kernel
        // only writes `buf` (one float), which lives until the end of `measure`.
        unsafe { reg.launch_on_stream(f, cfg, stream, &mut p) }
    };
    let typed = || -> Result<(), MetraleError> {
        // SAFETY: `empty(float*, unsigned, float)`: the arguments are checked
        // against the kernel's parameter layout; it only writes `buf`.
        unsafe { stream.launch(&func, cfg, (&buf, n, x)) }
    };
    let paths: [&dyn Fn() -> Result<(), MetraleError>; 3] = [&floor, &ours, &typed];
    let batches = options.launches.div_ceil(BATCH).max(1);
    let round = || -> Result<[f64; 3], MetraleError> {
        let mut total = [0.0f64; 3];
        for b in 0..batches {
            for k in 0..paths.len() {
                let i = (b + k) % paths.len();
                let t = Instant::now();
                for _ in 0..BATCH {
                    paths[i]()?;
                }
                total[i] += t.elapsed().as_secs_f64();
                stream.synchronize()?;
            }
        }
        let per = 1e6 / (batches * BATCH) as f64;
        Ok(total.map(|t| t * per))
    };
    // Warm-up: caches, the driver's first launches.
    round()?;
    let mut samples = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..options.rounds {
        for (row, us) in samples.iter_mut().zip(round()?) {
            row.push(us);
        }
    }
    Ok(Measured {
        driver_version: reg.ctx().driver_version(),
        device: reg.ctx().device_name().to_owned(),
        samples,
    })
}

/// `metrale bench`.
pub fn run(options: Options) -> Outcome {
    let m = match measure(options) {
        Ok(m) => m,
        Err(e) => {
            return Outcome {
                text: String::new(),
                json: Json::obj().with("error", e.to_string()),
                error: Some(e.to_string()),
                code: if e.is_unavailable() {
                    NO_DRIVER
                } else {
                    FAILED
                },
            }
        }
    };
    let ratios = |i: usize| -> Vec<f64> {
        m.samples[i]
            .iter()
            .zip(&m.samples[0])
            .map(|(ours, floor)| ours / floor)
            .collect()
    };
    let mut text = String::new();
    let _ = writeln!(
        text,
        "launch submit cost, device 0 ({}), driver CUDA {}; {} rounds of {} launches per path",
        m.device,
        cuda_version(m.driver_version),
        options.rounds,
        options.launches.div_ceil(BATCH).max(1) * BATCH
    );
    let _ = writeln!(
        text,
        "{:<28} {:>12} {:>20} {:>9}",
        "path", "median µs", "spread µs", "vs floor"
    );
    let mut rows = Vec::new();
    for (i, name) in PATHS.iter().enumerate() {
        let med = median(&m.samples[i]);
        let (lo, hi) = spread(&m.samples[i]);
        let ratio = if i == 0 { 1.0 } else { median(&ratios(i)) };
        let _ = writeln!(
            text,
            "{name:<28} {med:>12.3} {:>20} {:>8.3}×",
            format!("{lo:.3}..{hi:.3}"),
            ratio
        );
        rows.push(
            Json::obj()
                .with("path", *name)
                .with("median_us", med)
                .with("min_us", lo)
                .with("max_us", hi)
                .with("vs_floor", ratio),
        );
    }
    let json = Json::obj()
        .with("device", m.device.as_str())
        .with("driver_version", m.driver_version)
        .with("rounds", options.rounds)
        .with(
            "launches_per_round",
            options.launches.div_ceil(BATCH).max(1) * BATCH,
        )
        .with("rows", Json::Arr(rows));
    Outcome {
        text,
        json,
        error: None,
        code: 0,
    }
}
