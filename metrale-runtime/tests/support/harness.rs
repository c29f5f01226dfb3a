//! The runner of the suites that need a driver (`harness = false`), on
//! [libtest-mimic](https://docs.rs/libtest-mimic).
//!
//! libtest decides "ignored" at compile time; these suites decide at run time
//! whether their driver is there (the suite's *gate*), and say why when it is
//! not. libtest-mimic parses libtest's flags (`--test-threads N`, `--format
//! pretty|terse|json`, `--ignored`, `--include-ignored`, `--list`, `--exact`,
//! `--skip NAME`, a name filter) and prints libtest's lines and summary, so cargo
//! and CI read the output as usual. A flag it does not know is an error, never a
//! name filter. It takes one name filter, not several.
//!
//! # One thread
//!
//! The tests share process-wide driver state (the loaded driver, its contexts,
//! the stand-in's injected faults, the fault suite's counting allocator), so they
//! run one at a time on the main thread whatever `--test-threads` says: the
//! runner sets the thread count to 1, and says so on stderr when it was asked for
//! more.
//!
//! # When the gate fails
//!
//! The gate's reason is printed once, before the run (on stderr under `--list`
//! and `--format json`, whose stdout tools parse; on stdout otherwise). Then:
//!
//! - Nothing requires the suite: every test is marked ignored, so a plain run
//!   reports each `ignored` and the summary counts them, and `--list --ignored`
//!   lists them. Asked to run them anyway (`--ignored`, `--include-ignored`), each
//!   fails with the reason: the run was asked to carry out tests this machine
//!   cannot carry out, and reporting them ignored again would answer "ok" to a
//!   request that was not met, which is what this runner exists to avoid.
//! - `require` names the setting that demands the suite (`METRALE_REQUIRE_GPU=1`):
//!   no test is ignored, and every selected test fails with a message naming the
//!   setting and the reason.
//!
//! When the gate passes, no test is ignored: a test passes when it returns and
//! fails with its panic's message when it panics.
//!
//! # Child processes
//!
//! A test may re-run this binary as a child process on one scenario
//! ([`run_child`], environment variable `METRALE_TEST_CHILD`). The child runs only
//! that scenario and exits, before any argument is parsed and before the gate;
//! libtest-mimic has no such notion, so this part stays by hand.

#![allow(dead_code)]

use std::process::{Command, ExitCode, Output};

use libtest_mimic::{Arguments, FormatSetting, Trial};

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
/// setting that demands the suite run (`METRALE_REQUIRE_GPU=1`). See the module
/// documentation for the flags and for `--ignored` when the gate fails.
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

    let mut args = Arguments::from_args();
    if let Some(n) = args.test_threads.filter(|&n| n != 1) {
        eprintln!(
            "--test-threads {n}: these tests share process-wide driver state; \
             they run one at a time, on the main thread"
        );
    }
    args.test_threads = Some(1);

    // Tools parse stdout under `--list` and `--format json`: notes go to stderr.
    let stdout_is_parsed = args.list || args.format == Some(FormatSetting::Json);
    let note = |text: &str| {
        if stdout_is_parsed {
            eprintln!("{text}");
        } else {
            println!("{text}");
        }
    };

    let trials: Vec<Trial> = match (gate(), require) {
        (Ok(()), _) => tests
            .iter()
            .map(|t| {
                let run = t.run;
                Trial::test(t.name, move || {
                    run();
                    Ok(())
                })
            })
            .collect(),
        (Err(reason), Some(setting)) => {
            let message = format!("this suite cannot run here: {reason} (required: {setting})");
            note(&message);
            tests
                .iter()
                .map(|t| {
                    let message = message.clone();
                    Trial::test(t.name, move || Err(message.into()))
                })
                .collect()
        }
        (Err(reason), None) => {
            note(&format!(
                "every test of this suite is ignored here: {reason}"
            ));
            let message =
                format!("asked to run an ignored test, but this suite cannot run here: {reason}");
            tests
                .iter()
                .map(|t| {
                    let message = message.clone();
                    Trial::test(t.name, move || Err(message.into())).with_ignored_flag(true)
                })
                .collect()
        }
    };
    libtest_mimic::run(&args, trials).exit_code()
}
