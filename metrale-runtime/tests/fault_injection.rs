//! Tier 2: the runtime against the stand-in driver (metrale-fakecuda), loaded
//! through `METRALE_LIBCUDA_PATH` exactly as users load libcuda. Runs everywhere,
//! with no GPU: every error text, teardown and drop path, missing symbols, the
//! borrow rules of copies, handle provenance, launches checked against parameter
//! layouts, graphs, two devices, and the allocation-free launch path.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/harness.rs"]
mod harness;

#[path = "fault/arena.rs"]
mod arena;
#[path = "fault/args.rs"]
mod args;
#[path = "fault/audit6.rs"]
mod audit6;
#[path = "fault/batch.rs"]
mod batch;
#[path = "fault/common.rs"]
mod common;
#[path = "fault/compose.rs"]
mod compose;
#[path = "fault/errors.rs"]
mod errors;
#[path = "fault/foreign.rs"]
mod foreign;
#[path = "fault/futures.rs"]
mod futures;
#[path = "fault/graph.rs"]
mod graph;
#[path = "fault/green.rs"]
mod green;
#[path = "fault/launch.rs"]
mod launch;
#[path = "fault/memory.rs"]
mod memory;
#[path = "fault/multi.rs"]
mod multi;
#[path = "fault/registry.rs"]
mod registry;
#[path = "fault/replay_code.rs"]
mod replay_code;
#[path = "fault/review2.rs"]
mod review2;
#[path = "fault/review3.rs"]
mod review3;
#[path = "fault/review4.rs"]
mod review4;
#[path = "fault/review5.rs"]
mod review5;
#[path = "fault/round4.rs"]
mod round4;
#[path = "fault/round5.rs"]
mod round5;
#[path = "fault/signals.rs"]
mod signals;
#[path = "fault/soundness.rs"]
mod soundness;
#[path = "fault/streams.rs"]
mod streams;
#[path = "fault/teardown.rs"]
mod teardown;
#[path = "fault/tensor_map.rs"]
mod tensor_map;
#[path = "fault/vmm.rs"]
mod vmm;

use std::process::ExitCode;

use metrale_runtime::sys;

#[global_allocator]
static GLOBAL: common::CountingAlloc = common::CountingAlloc;

fn main() -> ExitCode {
    // This suite always runs against the stand-in, also on a machine whose own
    // METRALE_LIBCUDA_PATH names the real driver. A child process keeps the path its
    // parent chose for it (the old-driver build, or this one).
    if std::env::var_os("METRALE_TEST_CHILD").is_none() {
        std::env::set_var("METRALE_LIBCUDA_PATH", metrale_fakecuda::library_path());
    }
    let tests: Vec<harness::Test> = [
        errors::tests(),
        registry::tests(),
        streams::tests(),
        futures::tests(),
        signals::tests(),
        memory::tests(),
        foreign::tests(),
        batch::tests(),
        arena::tests(),
        launch::tests(),
        args::tests(),
        audit6::tests(),
        compose::tests(),
        tensor_map::tests(),
        green::tests(),
        graph::tests(),
        multi::tests(),
        teardown::tests(),
        soundness::tests(),
        vmm::tests(),
        round4::tests(),
        review2::tests(),
        review3::tests(),
        review4::tests(),
        review5::tests(),
        replay_code::tests(),
        round5::tests(),
    ]
    .into_iter()
    .flatten()
    .collect();
    let gate = || match sys::driver() {
        Ok(d) if d.path().contains("metrale_fakecuda") => Ok(()),
        Ok(d) => Err(format!(
            "METRALE_LIBCUDA_PATH names {}, not the stand-in",
            d.path()
        )),
        Err(e) => Err(e.to_string()),
    };
    // The stand-in is built with this crate's dev-dependencies: it is always required.
    harness::main(
        &tests,
        &teardown::children()
            .into_iter()
            .chain(tensor_map::children())
            .chain(green::children())
            .chain(vmm::children())
            .chain(round4::children())
            .chain(review2::children())
            .chain(batch::children())
            .chain(review3::children())
            .chain(review5::children())
            .chain(round5::children())
            .chain(arena::children())
            .chain(replay_code::children())
            .collect::<Vec<_>>(),
        gate,
        Some("the stand-in driver (always required here)"),
    )
}
