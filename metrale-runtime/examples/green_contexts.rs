//! Green contexts: split the device's SMs into two halves, make a green context
//! of each, and run a kernel on each half side by side, timed with events. Each
//! half runs at about half the device's throughput; together they fill it.
//!
//! `cargo run --release -p metrale-runtime --example green_contexts`
//! (CUDA 12.4+ driver; an older one reports the missing entry point).

use std::process::ExitCode;

use metrale_runtime::{
    sys, CudaEvent, CudaStream, Device, DeviceBuffer, GreenContext, LaunchConfig, MetraleError,
    MetraleRegistry, SmResource,
};

static KERNELS: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");

fn run() -> Result<(), MetraleError> {
    let reg = MetraleRegistry::load(0, &[("kernels", KERNELS)])?;
    let spin = reg.function("kernels", "spin")?;
    let all = SmResource::of_device(reg.ctx())?;
    let align = all.coscheduled_alignment().max(1);
    let half = all.sm_count() / 2 / align * align;
    let split = all.split_by_count(2, half)?;
    println!(
        "{}: {} SMs split into {} groups of {} SMs ({} left over)",
        reg.host().device_name(),
        all.sm_count(),
        split.groups.len(),
        split.groups.first().map_or(0, |g| g.sm_count()),
        split.remaining.sm_count()
    );
    let (Some(ga), Some(gb)) = (split.groups.first(), split.groups.get(1)) else {
        println!("the device is too small for two groups");
        return Ok(());
    };
    let (a, b) = (GreenContext::new(&[ga])?, GreenContext::new(&[gb])?);
    println!(
        "green contexts of {} and {} SMs",
        a.sm_count()?,
        b.sm_count()?
    );
    // Ordinary streams of the device, running on each half.
    let (sa, sb) = (
        CudaStream::on_green_context(&a)?,
        CudaStream::on_green_context(&b)?,
    );
    let main = reg.stream();

    // One block per SM at a time (more than half an SM's shared memory each), one
    // wave on a half: each kernel spins 50 ms.
    let khz = Device::get(0)?.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?;
    let cycles = khz as u64 * 50;
    let smem = reg.host().limits().max_shared_per_block_optin / 2 + 1024;
    let cfg = LaunchConfig::new((half, 1, 1), (32, 1, 1), smem)?;
    let mut done = DeviceBuffer::<u32>::zeroed(main, 1)?;
    let (start, end) = (CudaEvent::timed(reg.ctx())?, CudaEvent::timed(reg.ctx())?);
    let fork = CudaEvent::new(reg.ctx())?;
    start.record(main)?;
    fork.record(main)?;
    for s in [&sa, &sb] {
        s.wait(&fork)?;
        // SAFETY: spin(unsigned long long cycles, unsigned* done) adds one to done[0].
        unsafe { s.launch(&spin, cfg, (cycles, &mut done))? };
        let joined = CudaEvent::new(reg.ctx())?;
        joined.record(s)?;
        main.wait(&joined)?;
    }
    end.record(main)?;
    end.synchronize()?;
    println!(
        "two {half}-block kernels of 50 ms, one on each half: {:.1} ms in all ({} done)",
        start.elapsed_ms(&end)?,
        main.to_vec(&done)?.first().copied().unwrap_or(0)
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("green_contexts: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("green_contexts: {e}");
            ExitCode::FAILURE
        }
    }
}
