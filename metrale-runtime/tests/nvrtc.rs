//! Run-time compilation against the real NVRTC and nvJitLink, on CPU (feature
//! `nvrtc`): PTX, cubin and LTO-IR compiled and linked for real, the outputs
//! checked as metrale checks blobs and read as ELF, the cache in memory and on
//! disk, and the loader's failures in child processes.
//!
//! Needs `METRALE_LIBNVRTC_PATH` and `METRALE_LIBNVJITLINK_PATH` (see
//! `scripts/fetch-nvrtc.sh`) or the libraries on the loader path. Without them
//! every test is reported ignored with the reason; `METRALE_REQUIRE_NVRTC=1`
//! makes that a failure.

#![cfg(feature = "nvrtc")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/harness.rs"]
mod harness;

#[path = "nvrtc/cache.rs"]
mod cache;
#[path = "nvrtc/compile.rs"]
mod compile;
#[path = "nvrtc/elf.rs"]
mod elf;
#[path = "nvrtc/loader.rs"]
mod loader;

use std::process::ExitCode;

use metrale_runtime::sys;

fn gate() -> Result<(), String> {
    let rtc = sys::nvrtc::nvrtc().map_err(|e| e.to_string())?;
    let link = sys::nvjitlink::nvjitlink().map_err(|e| e.to_string())?;
    println!(
        "NVRTC {:?} from {} (builtins {:?}); nvJitLink {:?} from {}",
        rtc.version(),
        rtc.path(),
        rtc.builtins_path(),
        link.version(),
        link.path()
    );
    Ok(())
}

fn main() -> ExitCode {
    let tests: Vec<harness::Test> = [compile::tests(), cache::tests(), loader::tests()]
        .into_iter()
        .flatten()
        .collect();
    let mut children = loader::children();
    children.push(harness::Child {
        name: "cache_compile_and_print",
        run: cache::cache_compile_and_print,
    });
    let require = std::env::var("METRALE_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    harness::main(
        &tests,
        &children,
        gate,
        require.then_some("METRALE_REQUIRE_NVRTC=1"),
    )
}
