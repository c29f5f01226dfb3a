//! The main job: load bundled PTX, add two vectors of 1M floats on the GPU, check
//! every element, and print the device, the driver version and the time taken.
//!
//! `cargo run --release -p metrale-runtime --example quickstart`
//!
//! The kernel is hand-written PTX at ISA 7.0 for `sm_50` (`examples/kernels/
//! vec_add.ptx`): every driver metrale supports JIT-compiles it for whatever GPU it
//! finds, Maxwell to Blackwell. Without a driver it exits with status 2 and the
//! loader's message; it builds without a C compiler.

use std::process::ExitCode;
use std::time::Instant;

use metrale_runtime::{DeviceBuffer, LaunchConfig, MetraleError, MetraleRegistry};

static KERNELS: &[u8] = include_bytes!("kernels/vec_add.ptx");

const N: usize = 1 << 20;

fn run() -> Result<(), MetraleError> {
    let t0 = Instant::now();
    let reg = MetraleRegistry::load(0, &[("kernels", KERNELS)])?;
    let host = reg.host();
    let loaded = t0.elapsed();
    let v = host.driver_version();
    println!(
        "device 0: {} (compute capability {}.{}), driver {}.{} ({v})",
        host.device_name(),
        host.limits().compute_capability.0,
        host.limits().compute_capability.1,
        v / 1000,
        v % 1000 / 10
    );

    let a: Vec<f32> = (0..N).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..N).map(|i| 1.0 - i as f32 * 0.25).collect();
    let s = reg.stream();
    let da = DeviceBuffer::from_host(s, &a)?;
    let db = DeviceBuffer::from_host(s, &b)?;
    let mut dc = DeviceBuffer::<f32>::alloc(s, N)?;

    let vec_add = reg.function("kernels", "vec_add")?;
    let cfg = LaunchConfig::for_num_elems(N, 256)?;
    let t1 = Instant::now();
    // SAFETY: vec_add(const float*, const float*, float*, unsigned) over N elements
    // of buffers that outlive the kernel (the copy below waits for it). The
    // arguments' sizes are checked against the kernel's parameters.
    unsafe { s.launch(&vec_add, cfg, (&da, &db, &mut dc, N as u32))? };
    s.synchronize()?;
    let kernel = t1.elapsed();
    let c = s.to_vec(&dc)?;

    let wrong = (0..N).filter(|&i| c[i] != a[i] + b[i]).count();
    if wrong > 0 {
        return Err(metrale_runtime::ErrorKind::InvalidArgument(format!(
            "vec_add result wrong in {wrong} of {N} elements"
        ))
        .into());
    }
    println!(
        "vec_add of {N} floats: all {N} elements verified; module load {:.2} ms, launch + sync {:.3} ms",
        loaded.as_secs_f64() * 1e3,
        kernel.as_secs_f64() * 1e3
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("quickstart: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("quickstart: {e}");
            ExitCode::FAILURE
        }
    }
}
