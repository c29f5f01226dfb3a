//! Issue 33's rows, the per-step paths an engine calls thousands of times, each
//! beside its raw call in the same process; and (`--parts`) where their time
//! goes: the driver calls and host work metrale adds, timed alone, and the raw
//! paths rebuilt one added part at a time (`floor/parts.rs`).
//!
//! `cargo bench -p metrale-runtime --bench floor [-- --parts] [--rounds N | --quick]`.
//! Without a driver it exits with status 2 and the loader's message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "floor/parts.rs"]
mod parts;

use std::future::Future;
use std::pin::pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use metrale_runtime::{MetraleError, MetraleRegistry};

static PTX: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");

struct Unpark(std::thread::Thread);
impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// The smallest executor: poll, park until woken.
pub(crate) fn block_on<F: Future>(f: F) -> F::Output {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

fn run() -> Result<(), MetraleError> {
    let rounds = common::rounds(21, 5);
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
    if std::env::args().any(|a| a == "--parts") {
        return parts::run(&reg, rounds);
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("floor bench: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("floor bench: {e}");
            ExitCode::FAILURE
        }
    }
}
