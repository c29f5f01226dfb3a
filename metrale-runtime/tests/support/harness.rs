//! A small test runner for the suites that need a driver (`harness = false`).
//!
//! libtest decides "ignored" at compile time; these suites decide at run time
//! whether their driver is there, and say why when it is not. Output follows
//! libtest's lines (`test NAME ... ok`, `test result: ok. N passed; ...`) so cargo
//! and CI read it as usual. Tests run one at a time on the main thread, since they
//! share process-wide driver state.
//!
//! A test may re-run this binary as a child process on one scenario
//! ([`run_child`]); the child runs only that scenario and exits.

#![allow(dead_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::{Command, ExitCode, Output};
use std::time::Instant;

/// Environment variable naming the scenario a child process runs.
const CHILD_VAR: &str = "METRALE_TEST_CHILD";

/// One test.
pub struct Test {
    /// Its name, as printed and filtered.
    pub name: &'static str,
    /// The body; a panic is a failure.
    pub run: fn(),
}

/// One scenario run in a child process.
pub struct Child {
    /// Its name.
    pub name: &'static str,
    /// The body; its return is the child's exit, a panic exits 101.
    pub run: fn(),
}

/// Run this binary again as a child on `scenario`, with extra environment.
pub fn run_child(scenario: &str, env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().expect("own executable");
    let mut cmd = Command::new(exe);
    cmd.env(CHILD_VAR, scenario);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("child process runs")
}

/// Run the suite. `gate` says whether the suite can run here: `Err(reason)` marks
/// every test ignored with that reason, or fails them all when `require` names the
/// setting that demands the suite run (`METRALE_REQUIRE_GPU=1`).
pub fn main(
    tests: &[Test],
    children: &[Child],
    gate: impl FnOnce() -> Result<(), String>,
    require: Option<&str>,
) -> ExitCode {
    if let Ok(scenario) = std::env::var(CHILD_VAR) {
        return match children.iter().find(|c| c.name == scenario) {
            Some(c) => {
                (c.run)();
                ExitCode::SUCCESS
            }
            None => {
                eprintln!("no child scenario named {scenario}");
                ExitCode::from(2)
            }
        };
    }

    // libtest's own flags are accepted and ignored, except these: `--exact`,
    // `--skip NAME` (repeatable), `--list`; other words are name filters.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut filters: Vec<&str> = Vec::new();
    let mut skips: Vec<&str> = Vec::new();
    let mut words = args.iter();
    while let Some(a) = words.next() {
        if a == "--skip" {
            skips.extend(words.next().map(String::as_str));
        } else if !a.starts_with('-') {
            filters.push(a);
        }
    }
    let exact = args.iter().any(|a| a == "--exact");
    if std::env::args().any(|a| a == "--list") {
        for t in tests {
            println!("{}: test", t.name);
        }
        return ExitCode::SUCCESS;
    }
    let selected: Vec<&Test> = tests
        .iter()
        .filter(|t| {
            filters.is_empty()
                || filters.iter().any(|f| {
                    if exact {
                        t.name == *f
                    } else {
                        t.name.contains(f)
                    }
                })
        })
        .filter(|t| !skips.iter().any(|s| t.name.contains(s)))
        .collect();
    let filtered_out = tests.len() - selected.len();
    let start = Instant::now();
    println!("\nrunning {} tests", selected.len());

    if let Err(reason) = gate() {
        if let Some(setting) = require {
            for t in &selected {
                println!("test {} ... FAILED", t.name);
            }
            println!("\n{setting} is set but the suite cannot run: {reason}");
            println!(
                "\ntest result: FAILED. 0 passed; {} failed; 0 ignored; 0 measured; {filtered_out} filtered out; finished in {:.2}s\n",
                selected.len(),
                start.elapsed().as_secs_f64()
            );
            return ExitCode::from(101);
        }
        println!("every test below is ignored: {reason}");
        for t in &selected {
            println!("test {} ... ignored, see above", t.name);
        }
        println!(
            "\ntest result: ok. 0 passed; 0 failed; {} ignored; 0 measured; {filtered_out} filtered out; finished in {:.2}s\n",
            selected.len(),
            start.elapsed().as_secs_f64()
        );
        return ExitCode::SUCCESS;
    }

    let mut failed = Vec::new();
    for t in &selected {
        let t0 = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(t.run));
        let ms = t0.elapsed().as_millis();
        match outcome {
            Ok(()) => println!("test {} ... ok ({ms} ms)", t.name),
            Err(_) => {
                println!("test {} ... FAILED", t.name);
                failed.push(t.name);
            }
        }
    }
    let passed = selected.len() - failed.len();
    if !failed.is_empty() {
        println!("\nfailures:");
        for name in &failed {
            println!("    {name}");
        }
    }
    println!(
        "\ntest result: {}. {passed} passed; {} failed; 0 ignored; 0 measured; {filtered_out} filtered out; finished in {:.2}s\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        failed.len(),
        start.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(101)
    }
}
