//! Two GPUs against the raw driver, same process: peer copies of 1 GiB each way,
//! loading one model onto both devices (library API vs a module per device), and
//! the launch rate of one thread per device against one device alone.
//!
//! `cargo bench -p metrale-runtime --bench multi_gpu [-- --rounds N | --quick]`.
//! With fewer than two devices it says so and exits with status 2.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::ExitCode;
use std::sync::{Arc, Barrier};

use common::{header, line, ratios, rounds, time, Row};
use metrale_runtime::sys::{self, CUresult};
use metrale_runtime::{
    device_count, enable_peer_access, host, CudaStream, DeviceBuffer, LaunchConfig, MetraleError,
    MetraleRegistry,
};

static PTX: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");
static CUBIN: &[u8] = include_bytes!("../tests/fixtures/kernels.sm_90.cubin");

fn ok(call: &str, s: CUresult) {
    assert!(s.is_success(), "{call} failed: {s}");
}

/// Launches per second of `empty` from one thread on `reg`'s device, through
/// metrale or (`raw`) through the sys table.
fn launch_rate(reg: &MetraleRegistry, n: usize, start: &Barrier, raw: bool) -> f64 {
    let s = CudaStream::new(reg.ctx()).unwrap();
    let f = reg.function("kernels", "empty").unwrap();
    let buf = DeviceBuffer::<f32>::alloc(&s, 1).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    let (ptr, k, x) = (buf.device_ptr(), 1u32, 1.0f32);
    let params: [*mut std::ffi::c_void; 3] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&k as *const u32).cast_mut().cast(),
        (&x as *const f32).cast_mut().cast(),
    ];
    let d = reg.ctx().driver();
    let raw_launch = d.cuLaunchKernel().unwrap();
    reg.ctx().bind().unwrap();
    let one = || {
        if raw {
            // SAFETY: `empty` with three valid parameters on a stream of the
            // context bound above.
            ok("cuLaunchKernel", unsafe {
                raw_launch(
                    f.as_raw(),
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    s.raw(),
                    params.as_ptr().cast_mut(),
                    std::ptr::null_mut(),
                )
            });
        } else {
            // SAFETY: empty(float*, unsigned, float).
            unsafe { s.launch(&f, cfg, (&buf, k, x)) }.unwrap();
        }
    };
    for _ in 0..1000 {
        one();
    }
    s.synchronize().unwrap();
    start.wait();
    let t = time(|| {
        for i in 0..n {
            one();
            if i % 250 == 249 {
                s.synchronize().unwrap();
            }
        }
        s.synchronize().unwrap();
    });
    n as f64 / t
}

fn run() -> Result<(), MetraleError> {
    if device_count()? < 2 {
        return Err(metrale_runtime::ErrorKind::InvalidArgument(
            "the multi-GPU benchmark needs two CUDA devices".into(),
        )
        .into());
    }
    let rounds = rounds(9, 2);
    let big: usize = if common::is_quick() {
        64 << 20
    } else {
        1 << 30
    };
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let (h0, h1) = (host(0)?, host(1)?);
    enable_peer_access(&h0, &h1)?;
    enable_peer_access(&h1, &h0)?;
    let mut a = DeviceBuffer::<u8>::zeroed(&h0, big)?;
    let mut b = DeviceBuffer::<u8>::zeroed(&h1, big)?;
    let raw_peer = d.cuMemcpyPeerAsync().unwrap();
    let raw_sync = d.cuStreamSynchronize().unwrap();
    let gbps = |secs: f64| big as f64 / secs / 1e9;
    let raw_copy = |dst: u64, dctx, src: u64, sctx, s: &CudaStream| {
        time(|| {
            // SAFETY: `big` bytes in each (retained) context; waited for at once.
            unsafe {
                ok(
                    "cuMemcpyPeerAsync",
                    raw_peer(dst, dctx, src, sctx, big, s.raw()),
                );
                ok("cuStreamSynchronize", raw_sync(s.raw()));
            }
        })
    };
    let (s0, s1) = (h0.stream(), h1.stream());
    let mut rows: Vec<Row> = vec![Row::default(); 8];
    for round in 0..=rounds {
        let there_raw = raw_copy(
            b.device_ptr(),
            h1.ctx().raw(),
            a.device_ptr(),
            h0.ctx().raw(),
            s0,
        );
        let there_ours = time(|| {
            s0.copy_peer(&a, &mut b).unwrap();
            s0.synchronize().unwrap();
        });
        let back_raw = raw_copy(
            a.device_ptr(),
            h0.ctx().raw(),
            b.device_ptr(),
            h1.ctx().raw(),
            s1,
        );
        let back_ours = time(|| {
            s1.copy_peer(&b, &mut a).unwrap();
            s1.synchronize().unwrap();
        });
        if round > 0 {
            rows[0].push(gbps(there_raw));
            rows[1].push(gbps(there_ours));
            rows[2].push(gbps(back_raw));
            rows[3].push(gbps(back_ours));
        }
    }
    drop((a, b));
    // Loading one model on both devices.
    for (i, blob) in [(4usize, PTX), (6, CUBIN)] {
        for _ in 0..rounds {
            rows[i].push(
                time(|| {
                    let regs =
                        MetraleRegistry::load_on_devices(&[0, 1], &[("kernels", blob)]).unwrap();
                    for r in &regs {
                        r.function("kernels", "vec_add").unwrap();
                    }
                }) * 1e3,
            );
            rows[i + 1].push(
                time(|| {
                    for o in [0, 1] {
                        let r = MetraleRegistry::load(o, &[("kernels", blob)]).unwrap();
                        r.function("kernels", "vec_add").unwrap();
                    }
                }) * 1e3,
            );
        }
    }
    // Launch rate: one device alone, then both at once from two threads, through
    // metrale and through the sys table.
    let regs = MetraleRegistry::load_on_devices(&[0, 1], &[("kernels", CUBIN)])?;
    let n = if common::is_quick() { 20_000 } else { 200_000 };
    let mut rates: Vec<Row> = vec![Row::default(); 4];
    for round in 0..rounds.min(5) {
        for raw in [round % 2 == 0, round % 2 != 0] {
            let k = usize::from(raw) * 2;
            rates[k].push(launch_rate(&regs[0], n, &Barrier::new(1), raw) / 1e6);
            let start = Arc::new(Barrier::new(2));
            let threads: Vec<_> = regs
                .iter()
                .map(|r| {
                    let (r, start) = (Arc::clone(r), Arc::clone(&start));
                    std::thread::spawn(move || launch_rate(&r, n, &start, raw))
                })
                .collect();
            let both: Vec<f64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            rates[k + 1].push(both.iter().copied().fold(f64::INFINITY, f64::min) / 1e6);
        }
    }
    header(&format!(
        "metrale multi-GPU benchmark: 2 x {}, driver {}, {rounds} rounds",
        h0.device_name(),
        h0.driver_version()
    ));
    let size = if big >= 1 << 30 {
        "1 GiB".to_owned()
    } else {
        format!("{} MiB", big >> 20)
    };
    line(
        &format!("peer copy {size} 0 -> 1, raw (GB/s)"),
        &rows[0],
        "  ",
        Some(&ratios(&rows[0], &rows[0])),
    );
    line(
        &format!("peer copy {size} 0 -> 1, copy_peer (GB/s)"),
        &rows[1],
        "  ",
        Some(&ratios(&rows[1], &rows[0])),
    );
    line(
        &format!("peer copy {size} 1 -> 0, raw (GB/s)"),
        &rows[2],
        "  ",
        Some(&ratios(&rows[2], &rows[2])),
    );
    line(
        &format!("peer copy {size} 1 -> 0, copy_peer (GB/s)"),
        &rows[3],
        "  ",
        Some(&ratios(&rows[3], &rows[2])),
    );
    line(
        "load PTX model on 2 devices: library API (ms)",
        &rows[4],
        "  ",
        None,
    );
    line(
        "load PTX model on 2 devices: 2 module loads (ms)",
        &rows[5],
        "  ",
        None,
    );
    line(
        "load cubin model on 2 devices: library API (ms)",
        &rows[6],
        "  ",
        None,
    );
    line(
        "load cubin model on 2 devices: 2 module loads (ms)",
        &rows[7],
        "  ",
        None,
    );
    line(
        "launch rate, device 0 alone, raw (M/s)",
        &rates[2],
        "  ",
        None,
    );
    line(
        "launch rate per device, both at once, raw (M/s)",
        &rates[3],
        "  ",
        Some(&ratios(&rates[3], &rates[2])),
    );
    line(
        "launch rate, device 0 alone, stream.launch (M/s)",
        &rates[0],
        "  ",
        None,
    );
    line(
        "launch rate per device, both at once, stream.launch (M/s)",
        &rates[1],
        "  ",
        Some(&ratios(&rates[1], &rates[0])),
    );
    println!("(a launch-rate ratio compares both at once with one device alone, same path)");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("multi_gpu bench: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("multi_gpu bench: {e}");
            ExitCode::from(2)
        }
    }
}
