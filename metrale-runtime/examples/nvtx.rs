//! NVTX annotations for Nsight Systems: a domain with a category and a registered
//! string, colored ranges with payloads, marks, and names for the thread, the
//! device, its context and a stream, around a few fills and copies on the GPU.
//!
//! `nsys profile -t cuda,nvtx cargo run -p metrale-runtime --features nvtx --example nvtx`
//! (plain `cargo run` works too: with no tool every NVTX call is a no-op).
//!
//! It prints how attaching the tool went. Without a driver it exits with status 2
//! and the error.

use std::process::ExitCode;
use std::sync::LazyLock;

use metrale_runtime::nvtx::{self, Color, Domain, EventAttributes};
use metrale_runtime::{context, CudaStream, Device, DeviceBuffer, Result};

static DOMAIN: LazyLock<Domain> = LazyLock::new(|| Domain::new("metrale-example"));

fn run() -> Result<()> {
    nvtx::name_current_thread("example main");
    DOMAIN.name_category(1, "fills");
    let step = DOMAIN.register_string("step");
    let ctx = context(0)?;
    let stream = CudaStream::new(&ctx)?;
    nvtx::name_device(&Device::get(0)?, "gpu0");
    nvtx::name_context(&ctx, "gpu0 primary context");
    nvtx::name_stream(&stream, "example stream");
    let mut buf = DeviceBuffer::<u32>::zeroed(&stream, 1 << 20)?;
    for i in 0..8u32 {
        let _r = DOMAIN.range(
            &EventAttributes::new()
                .registered(&step)
                .category(1)
                .color(Color::rgb(0x76, 0xb9, 0x00))
                .payload(i),
        );
        stream.memset_u32(&mut buf, i)?;
        let host = {
            let _copy = nvtx::range_with(
                &EventAttributes::new()
                    .message("copy back")
                    .color(Color::rgb(0, 0x80, 0xff)),
            );
            stream.to_vec(&buf)?
        };
        if host.iter().any(|&x| x != i) {
            nvtx::mark("mismatch");
        }
    }
    nvtx::mark("done");
    Ok(())
}

fn main() -> ExitCode {
    println!("{}", nvtx::injection());
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvtx example: {e}");
            ExitCode::from(2)
        }
    }
}
