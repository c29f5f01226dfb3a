//! Load every file of a folder (cubins, fatbins or PTX) as the modules of one
//! registry, then each as a registry of its own, and print both times: how a
//! large registry scales.
//!
//! `cargo run --release -p metrale-runtime --example load_dir -- DIR`

use std::process::ExitCode;
use std::time::Instant;

use metrale_runtime::{host, ErrorKind, MetraleError, MetraleRegistry};

fn run() -> Result<(), MetraleError> {
    let dir = std::env::args().nth(1).ok_or_else(|| {
        MetraleError::from(ErrorKind::InvalidArgument("usage: load_dir DIR".into()))
    })?;
    let read =
        |e: std::io::Error| MetraleError::from(ErrorKind::InvalidArgument(format!("{dir}: {e}")));
    let mut blobs: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(read)? {
        let path = entry.map_err(read)?.path();
        if path.is_file() {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            blobs.push((name, std::fs::read(&path).map_err(read)?));
        }
    }
    blobs.sort();
    let bytes: usize = blobs.iter().map(|(_, b)| b.len()).sum();
    let h = host(0)?;
    // Warm the driver's caches once.
    drop(MetraleRegistry::load_into(h.clone(), &blobs)?);
    println!(
        "{} modules ({:.1} MiB) from {dir} on {}:",
        blobs.len(),
        bytes as f64 / (1 << 20) as f64,
        h.device_name()
    );
    // Alternate the two ways, so neither always follows the other's unload.
    for round in 0..4 {
        let one = |report: bool| -> Result<(), MetraleError> {
            let t = Instant::now();
            let reg = MetraleRegistry::load_into(h.clone(), &blobs)?;
            let took = t.elapsed();
            let t = Instant::now();
            for (name, _) in &blobs {
                reg.function_names(name)?;
            }
            let listed = t.elapsed();
            drop(reg);
            if report {
                println!(
                    "  round {round}: one registry of all modules: {:8.1} ms (listing their kernels: {:.1} ms)",
                    took.as_secs_f64() * 1e3,
                    listed.as_secs_f64() * 1e3
                );
            }
            Ok(())
        };
        let many = || -> Result<(), MetraleError> {
            let t = Instant::now();
            let separate: Vec<MetraleRegistry> = blobs
                .iter()
                .map(|b| MetraleRegistry::load_into(h.clone(), &[b]))
                .collect::<Result<_, _>>()?;
            let took = t.elapsed();
            drop(separate);
            println!(
                "  round {round}: one registry per module:       {:8.1} ms",
                took.as_secs_f64() * 1e3
            );
            Ok(())
        };
        if round % 2 == 0 {
            one(true)?;
            many()?;
        } else {
            many()?;
            one(true)?;
        }
    }
    let reg = MetraleRegistry::load_into(h.clone(), &blobs)?;
    let kernels: usize = blobs
        .iter()
        .map(|(name, _)| reg.function_names(name).map(|k| k.len()).unwrap_or(0))
        .sum();
    let t = Instant::now();
    for (name, _) in &blobs {
        let _ = reg.has_module(name);
    }
    println!(
        "  {kernels} kernels; {} module-name lookups in {:.3} ms",
        blobs.len(),
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("load_dir: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("load_dir: {e}");
            ExitCode::FAILURE
        }
    }
}
