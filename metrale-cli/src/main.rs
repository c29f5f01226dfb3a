//! `metrale`: answers to "which libcuda did it load, why is NCCL not found, what is
//! in this blob and where will it load, how fast can this machine launch".
//!
//! ```text
//! metrale [--json] doctor            the driver and companion libraries: found, where, version
//! metrale [--json] devices           each GPU, and the peer matrix
//! metrale [--json] inspect FILE      a PTX, cubin or fatbin: kernels, parameters, where it loads
//! metrale [--json] bench             the launch floor beside metrale's launch path
//! ```
//!
//! Exit status: 0 done; 1 the command failed (an unreadable or malformed file, a
//! failing driver call); 2 usage; 3 no CUDA driver could be loaded (the loader's
//! message says why; `doctor` and `inspect` still print what they could).
//!
//! Arguments are parsed by hand: four subcommands and a handful of flags do not
//! need a parser dependency, and the binary stays small and quick to build.

mod bench;
mod devices;
mod doctor;
mod inspect;
mod json;
mod locate;

use std::ffi::{OsStr, OsString};
use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;

use json::Json;

/// What a command produced: the text report, the same as JSON, and the status.
pub struct Outcome {
    /// The human-readable report (stdout).
    pub text: String,
    /// The `--json` report (stdout).
    pub json: Json,
    /// A message for stderr, when something failed.
    pub error: Option<String>,
    /// The exit status.
    pub code: u8,
}

/// Exit status: the command failed.
pub const FAILED: u8 = 1;
/// Exit status: bad arguments.
pub const USAGE: u8 = 2;
/// Exit status: no CUDA driver could be loaded.
pub const NO_DRIVER: u8 = 3;

const HELP: &str = "\
metrale: what the CUDA driver, the GPUs and a kernel blob look like from here

Usage: metrale [--json] <command> [options]

Commands:
  doctor          the driver library (path, version), every GPU, and NVRTC,
                  nvJitLink and NCCL: found or not, where, version, names tried,
                  and the METRALE_LIB*_PATH variable that picks the file
  devices         each GPU: name, compute capability, memory, SMs; the peer matrix
  inspect FILE    a PTX, cubin or fatbin: kind, PTX ISA, targets, SASS
                  architectures, each kernel's parameters and resources, and
                  where it will and will not load
      --offline   read the file only; do not load the driver
  bench           the launch floor (raw cuLaunchKernel of an empty kernel) beside
                  the registry's launch_on_stream and
                  typed CudaStream::launch, median and spread
      --rounds N      rounds (default 15)
      --launches N    launches per path per round (default 5000)

Options:
  --json          print the report as JSON
  -h, --help      this text
  -V, --version   the version

Exit status: 0 done, 1 the command failed, 2 usage, 3 no CUDA driver loaded.
";

fn main() -> ExitCode {
    // `args_os`: a file name need not be UTF-8 (`std::env::args` panics on one).
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let rest: Vec<&OsStr> = args
        .iter()
        .map(OsString::as_os_str)
        .filter(|a| *a != "--json")
        .collect();
    let outcome = match rest.split_first() {
        None => usage("no command given"),
        Some((cmd, opts)) => match cmd.to_str() {
            Some("-h" | "--help" | "help") => {
                // A closed or full stdout (`metrale --help > /dev/full`) is not
                // worth a panic: write, and ignore the failure.
                write_out(HELP);
                return ExitCode::SUCCESS;
            }
            Some("-V" | "--version") => {
                write_out(&format!("metrale {}\n", env!("CARGO_PKG_VERSION")));
                return ExitCode::SUCCESS;
            }
            Some("doctor") if opts.is_empty() => doctor::run(),
            Some("devices") if opts.is_empty() => devices::run(),
            Some("inspect") => match inspect_args(opts) {
                Ok((file, offline)) => inspect::run(file, offline),
                Err(why) => usage(&why),
            },
            Some("bench") => match bench_args(opts) {
                Ok(options) => bench::run(options),
                Err(why) => usage(&why),
            },
            Some(cmd @ ("doctor" | "devices")) => usage(&format!(
                "`{cmd}` takes no arguments (got `{}`)",
                opts.first()
                    .map_or_else(String::new, |a| a.to_string_lossy().into_owned())
            )),
            _ => usage(&format!("unknown command `{}`", cmd.to_string_lossy())),
        },
    };
    let body = if json {
        outcome.json.render()
    } else {
        outcome.text
    };
    // A closed stdout (`metrale doctor | head -1`) is not worth a panic.
    write_out(&body);
    if let Some(error) = &outcome.error {
        let _ = writeln!(std::io::stderr().lock(), "metrale: {error}");
    }
    ExitCode::from(outcome.code)
}

/// Write `text` to stdout, ignoring a failure (a closed pipe, a full disk):
/// `print!` would panic there.
fn write_out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(text.as_bytes());
    let _ = stdout.flush();
}

fn usage(why: &str) -> Outcome {
    Outcome {
        text: String::new(),
        json: Json::obj().with("error", why),
        error: Some(format!("{why}\n\n{HELP}")),
        code: USAGE,
    }
}

fn inspect_args<'a>(opts: &[&'a OsStr]) -> Result<(&'a Path, bool), String> {
    let mut file = None;
    let mut offline = false;
    for &opt in opts {
        let text = opt.to_string_lossy();
        match text.as_ref() {
            "--offline" => offline = true,
            flag if flag.starts_with("--") => {
                return Err(format!("`inspect` has no option `{flag}`"))
            }
            _ if file.is_none() => file = Some(Path::new(opt)),
            extra => return Err(format!("`inspect` takes one file (got also `{extra}`)")),
        }
    }
    file.map(|f| (f, offline))
        .ok_or_else(|| "`inspect` needs a file: metrale inspect FILE".to_owned())
}

fn bench_args(opts: &[&OsStr]) -> Result<bench::Options, String> {
    let mut options = bench::Options::default();
    let mut it = opts.iter().map(|o| o.to_string_lossy());
    while let Some(opt) = it.next() {
        let slot = match opt.as_ref() {
            "--rounds" => &mut options.rounds,
            "--launches" => &mut options.launches,
            other => return Err(format!("`bench` has no option `{other}`")),
        };
        let value = it.next().ok_or_else(|| format!("`{opt}` needs a number"))?;
        *slot = value
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("`{opt}` needs a positive number, not `{value}`"))?;
    }
    Ok(options)
}

/// Bytes as `80.0 GiB` (binary units, one decimal).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A driver or toolkit version code (13000) as `13.0`.
pub fn cuda_version(code: i32) -> String {
    format!("{}.{}", code / 1000, code % 1000 / 10)
}
