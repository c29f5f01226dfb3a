//! A template kernel specialised at run time for `f32` and `f64`, compiled by NVRTC
//! for the GPU found, loaded, launched with checked arguments and verified.
//!
//! `cargo run -p metrale-runtime --features nvrtc --example nvrtc`
//!
//! NVRTC comes from `METRALE_LIBNVRTC_PATH` (a wheel's `libnvrtc.so.13`, see
//! scripts/fetch-nvrtc.sh) or the loader path. Without a driver (or NVRTC) it
//! exits with status 2 and the error.

use std::process::ExitCode;
use std::time::Instant;

use metrale_runtime::nvrtc::{CompileCache, Program};
use metrale_runtime::{
    host, DeviceBuffer, DevicePod, DeviceRepr, LaunchConfig, MetraleError, MetraleRegistry,
};

const SOURCE: &str = r#"
// y = a * x + y, for any arithmetic T.
template <typename T>
__global__ void axpy(T a, const T* x, T* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

const N: usize = 1 << 16;

/// Launch `axpy<T>` on `N` elements and check every one against the host.
fn run_axpy<T>(
    reg: &MetraleRegistry,
    kernel: &str,
    a: T,
    to_t: fn(usize) -> T,
) -> Result<(), MetraleError>
where
    T: DeviceRepr
        + DevicePod
        + Copy
        + PartialEq
        + std::ops::Mul<Output = T>
        + std::ops::Add<Output = T>
        + std::fmt::Debug,
{
    let s = reg.stream();
    let f = reg.function("axpy.cu", kernel)?;
    let x: Vec<T> = (0..N).map(to_t).collect();
    let y: Vec<T> = (0..N).map(|i| to_t(N - i)).collect();
    let dx = DeviceBuffer::from_host(s, &x)?;
    let mut dy = DeviceBuffer::from_host(s, &y)?;
    let cfg = LaunchConfig::for_num_elems(N, 256)?;
    // SAFETY: axpy<T>(T, const T*, T*, unsigned) over N elements of buffers that
    // outlive the kernel (to_vec waits for it); sizes are checked against the
    // kernel's parameters before the driver is called.
    unsafe { s.launch(&f, cfg, (a, &dx, &mut dy, N as u32))? };
    let got = s.to_vec(&dy)?;
    let wrong = (0..N).filter(|&i| got[i] != a * x[i] + y[i]).count();
    if wrong > 0 {
        return Err(MetraleError::from(
            metrale_runtime::ErrorKind::InvalidArgument(format!(
                "{kernel}: {wrong} of {N} elements wrong"
            )),
        ));
    }
    println!("  {kernel}: all {N} elements verified");
    Ok(())
}

fn run() -> Result<(), MetraleError> {
    let host = host(0)?;
    let (major, minor) = host.limits().compute_capability;
    println!("device 0: {} (sm_{major}{minor})", host.device_name());

    let program = Program::new("axpy.cu", SOURCE)
        .std("c++17")
        .name_expression("axpy<float>")
        .name_expression("axpy<double>");
    let cache = CompileCache::new();
    let t0 = Instant::now();
    let compiled = cache.compile_for(&program, host.ctx())?;
    let compile = t0.elapsed();
    let t1 = Instant::now();
    cache.compile_for(&program, host.ctx())?;
    let hit = t1.elapsed();
    println!(
        "compiled for {} in {:.1} ms ({} bytes of cubin); cache hit {:.3} ms",
        compiled.target(),
        compile.as_secs_f64() * 1e3,
        compiled.blob().len(),
        hit.as_secs_f64() * 1e3
    );
    if !compiled.log().is_empty() {
        println!("NVRTC said:\n{}", compiled.log());
    }
    for (expression, lowered) in compiled.lowered_names() {
        println!("  {expression} -> {lowered}");
    }

    let reg = MetraleRegistry::load_into(host, &[&*compiled])?;
    let lowered = |e: &str| {
        compiled.lowered_name(e).map(str::to_owned).ok_or_else(|| {
            MetraleError::from(metrale_runtime::ErrorKind::InvalidArgument(format!(
                "no lowered name for {e}"
            )))
        })
    };
    run_axpy(&reg, &lowered("axpy<float>")?, 1.5f32, |i| i as f32)?;
    run_axpy(&reg, &lowered("axpy<double>")?, -0.25f64, |i| i as f64)?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvrtc example: {e}");
            ExitCode::from(2)
        }
    }
}
