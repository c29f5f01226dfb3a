//! Tier 3: the runtime against the real driver and GPU, with the kernels of
//! `fixtures/kernels.cu` (PTX, sm_90 cubin, fatbin), embedded in this binary.
//!
//! Without a usable driver and device every test is reported ignored, with the
//! reason (once); `METRALE_REQUIRE_GPU=1` turns that into failures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/harness.rs"]
mod harness;

#[path = "gpu/basic.rs"]
mod basic;
#[cfg(feature = "cublas")]
#[path = "gpu/blas.rs"]
mod blas;
#[path = "gpu/common.rs"]
mod common;
#[path = "gpu/futures.rs"]
mod futures;
#[path = "gpu/graphs.rs"]
mod graphs;
#[path = "gpu/hopper.rs"]
mod hopper;
#[path = "gpu/layout.rs"]
mod layout;
#[path = "gpu/memory.rs"]
mod memory;
#[cfg(feature = "nccl")]
#[path = "gpu/nccl.rs"]
mod nccl;
#[cfg(feature = "nvrtc")]
#[path = "gpu/nvrtc.rs"]
mod nvrtc;
#[path = "gpu/round4.rs"]
mod round4;
#[path = "gpu/soundness.rs"]
mod soundness;
#[path = "gpu/streams.rs"]
mod streams;
#[path = "gpu/vmm.rs"]
mod vmm;

use std::process::ExitCode;

fn gate() -> Result<(), String> {
    let h = metrale_runtime::host(0).map_err(|e| format!("no CUDA GPU: {e}"))?;
    // On stderr: stdout is the test list under `--list`, JSON under `--format json`.
    eprintln!(
        "device 0: {} (sm_{}{}), driver {}",
        h.device_name(),
        h.limits().compute_capability.0,
        h.limits().compute_capability.1,
        h.driver_version()
    );
    Ok(())
}

fn main() -> ExitCode {
    let tests: Vec<harness::Test> = [
        basic::tests(),
        streams::tests(),
        futures::tests(),
        memory::tests(),
        graphs::tests(),
        hopper::tests(),
        layout::tests(),
        soundness::tests(),
        vmm::tests(),
        round4::tests(),
        #[cfg(feature = "nvrtc")]
        nvrtc::tests(),
        #[cfg(feature = "nccl")]
        nccl::tests(),
        #[cfg(feature = "cublas")]
        blas::tests(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let require = std::env::var("METRALE_REQUIRE_GPU").is_ok_and(|v| v == "1");
    #[allow(unused_mut)]
    let mut children = basic::children();
    children.extend(futures::children());
    children.extend(hopper::children());
    children.extend(vmm::children());
    #[cfg(feature = "nccl")]
    children.extend(nccl::children());
    harness::main(
        &tests,
        &children,
        gate,
        require.then_some("METRALE_REQUIRE_GPU=1"),
    )
}
