//! Load every file of a folder (cubins, fatbins or PTX) as the modules of one
//! registry, then each as a registry of its own, and print both times: how a
//! large registry scales.
//!
//! `cargo run --release -p metrale-runtime --example load_dir -- DIR`

use std::process::ExitCode;
use std::time::Instant;

use metrale_runtime::{host, MetraleError, MetraleRegistry};

fn run() -> Result<(), MetraleError> {
    let dir = std::env::args()
        .nth(1)
        .ok_or_else(|| MetraleError::InvalidArgument("usage: load_dir DIR".into()))?;
    let read = |e: std::io::Error| MetraleError::InvalidArgument(format!("{dir}: {e}"));
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

    let t = Instant::now();
    let reg = MetraleRegistry::load_into(h.clone(), &blobs)?;
    let one = t.elapsed();
    let mut kernels = 0usize;
    for (name, _) in &blobs {
        kernels += reg.function_names(name).map(|k| k.len()).unwrap_or(0);
    }
    let t = Instant::now();
    for (name, _) in &blobs {
        let _ = reg.has_module(name);
    }
    let lookups = t.elapsed();
    drop(reg);

    let t = Instant::now();
    let separate: Vec<MetraleRegistry> = blobs
        .iter()
        .map(|b| MetraleRegistry::load_into(h.clone(), [b]))
        .collect::<Result<_, _>>()?;
    let many = t.elapsed();
    drop(separate);
    println!(
        "{} modules ({} kernels, {:.1} MiB) from {dir} on {}:",
        blobs.len(),
        kernels,
        bytes as f64 / (1 << 20) as f64,
        h.device_name()
    );
    println!(
        "  one registry of all modules:   {:8.1} ms",
        one.as_secs_f64() * 1e3
    );
    println!(
        "  one registry per module:       {:8.1} ms",
        many.as_secs_f64() * 1e3
    );
    println!(
        "  {} module-name lookups:       {:8.3} ms",
        blobs.len(),
        lookups.as_secs_f64() * 1e3
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ MetraleError::DriverUnavailable(_)) => {
            eprintln!("load_dir: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("load_dir: {e}");
            ExitCode::FAILURE
        }
    }
}
