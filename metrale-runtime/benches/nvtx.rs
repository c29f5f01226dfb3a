//! NVTX cost: a range (push + pop through the guard) with no tool attached,
//! beside an empty `#[inline(never)]` function (the budget: ≤ 2 ns); and with
//! the stand-in tool (`metrale-fakecuda`'s recorder) attached, beside the raw
//! calls through the table the tool filled. Runs on CPU: no GPU needed.
//!
//! `cargo bench -p metrale-runtime --bench nvtx --features nvtx`
//!
//! A tool is attached once per process, so each half runs in a child process
//! of this binary (the variable unset, then naming the stand-in). Options
//! (after `--`): `--rounds N` (default 21), `--quick`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::hint::black_box;
use std::process::{Command, ExitCode};

use common::{header, line, ratios, rounds, time, Row};
use metrale_runtime::nvtx;
use metrale_runtime::sys::nvtx::{nvtx as table, INJECTION_PATH_VAR};

const CHILD: &str = "METRALE_NVTX_BENCH_CHILD";
const ITERS: u32 = 1_000_000;

#[inline(never)]
fn empty() {
    black_box(());
}

/// Nanoseconds per iteration of `f` over `ITERS` iterations (the loop is
/// monomorphised: `f` is inlined into it, as in a caller's code).
#[inline(never)]
fn sample(mut f: impl FnMut()) -> f64 {
    time(|| {
        for _ in 0..ITERS {
            f();
        }
    }) * 1e9
        / f64::from(ITERS)
}

/// One sample per round of each row, the rows measured in turns.
macro_rules! measure {
    ($rounds:expr, $($f:expr),+ $(,)?) => {{
        let mut rows: Vec<Row> = Vec::new();
        for round in 0..$rounds {
            let samples = [$(sample($f)),+];
            for (i, s) in samples.into_iter().enumerate() {
                if round == 0 {
                    rows.push(Row::default());
                }
                rows[i].push(s);
            }
        }
        rows
    }};
}

fn no_tool(rounds: usize) {
    assert!(!nvtx::is_attached(), "{}", nvtx::injection());
    let rows = measure!(
        rounds,
        empty,
        || drop(nvtx::range(black_box("decode"))),
        || {
            nvtx::range_push(black_box("decode"));
            nvtx::range_pop();
        },
        || nvtx::mark(black_box("tick")),
    );
    header("NVTX with no tool attached (ns per iteration)");
    line("empty #[inline(never)] function", &rows[0], "ns", None);
    line(
        "nvtx::range(\"decode\") guard: push + pop",
        &rows[1],
        "ns",
        Some(&ratios(&rows[1], &rows[0])),
    );
    line(
        "nvtx::range_push + nvtx::range_pop",
        &rows[2],
        "ns",
        Some(&ratios(&rows[2], &rows[0])),
    );
    line(
        "nvtx::mark(\"tick\")",
        &rows[3],
        "ns",
        Some(&ratios(&rows[3], &rows[0])),
    );
    let range = rows[1].median();
    println!(
        "\nbudget: a range with no tool ≤ 2 ns: {range:.3} ns ({})",
        if range <= 2.0 { "within" } else { "OVER" }
    );
}

fn stand_in(rounds: usize) {
    assert!(nvtx::is_attached(), "{}", nvtx::injection());
    let message = c"decode";
    let rows = measure!(
        rounds,
        || {
            // The raw calls as NVTX's own inline functions make them: the
            // entry loaded and called, with a C string literal.
            if let Some(push) = table().nvtxRangePushA() {
                // SAFETY: a NUL-terminated message.
                unsafe { push(black_box(message).as_ptr()) };
            }
            if let Some(pop) = table().nvtxRangePop() {
                // SAFETY: no arguments.
                unsafe { pop() };
            }
        },
        || drop(nvtx::range(black_box("decode"))),
    );
    header("NVTX with the stand-in tool attached (ns per iteration; the tool records each call)");
    line(
        "raw nvtxRangePushA + nvtxRangePop through the table",
        &rows[0],
        "ns",
        None,
    );
    line(
        "nvtx::range(\"decode\") guard: push + pop",
        &rows[1],
        "ns",
        Some(&ratios(&rows[1], &rows[0])),
    );
}

fn main() -> ExitCode {
    let rounds = rounds(21, 3);
    match std::env::var(CHILD).as_deref() {
        Ok("none") => no_tool(rounds),
        Ok("stand-in") => stand_in(rounds),
        _ => {
            let args: Vec<String> = std::env::args().skip(1).collect();
            for (child, tool) in [
                ("none", None),
                ("stand-in", Some(metrale_fakecuda::nvtx_library_path())),
            ] {
                if let Some(path) = tool.filter(|p| !p.exists()) {
                    // A copy of the bench on another machine (the GPU host):
                    // the stand-in tool was built here, not there.
                    println!(
                        "\nthe stand-in tool half: skipped, {} is not on this machine",
                        path.display()
                    );
                    continue;
                }
                let mut cmd = Command::new(std::env::current_exe().unwrap());
                cmd.args(&args).env(CHILD, child);
                match tool {
                    Some(path) => cmd.env(INJECTION_PATH_VAR, path),
                    None => cmd.env_remove(INJECTION_PATH_VAR),
                };
                let status = cmd.status().unwrap();
                if !status.success() {
                    eprintln!("the {child} half failed: {status}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    ExitCode::SUCCESS
}
