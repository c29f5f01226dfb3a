//! Build script of metrale-cuda-sys.
//!
//! By default it does nothing: the committed `src/bindings.rs` (and, with the
//! `nvrtc` feature, `src/nvrtc_bindings.rs` and `src/nvjitlink_bindings.rs`; with
//! `nccl`, `src/nccl_bindings.rs`; with `cublas`, `src/cublas_bindings.rs` and
//! `src/cublaslt_bindings.rs`; with `nvtx`, `src/nvtx_bindings.rs`) are
//! used, so a build needs neither a CUDA toolkit nor libclang. With the `bindgen`
//! feature it runs bindgen (see `build/gen.rs`) on each wrapper header against the
//! first include folder that has the header, and writes the bindings to
//! `$OUT_DIR`; when `METRALE_BINDINGS_OUT_DIR` names a folder, the same files are
//! written there too (the regeneration script uses this). When
//! `METRALE_BINDINGS_ONLY` lists file names (comma-separated), only those are
//! generated and the others are the committed files, copied to `$OUT_DIR` (so
//! `scripts/regen-bindings.sh --only nvtx` needs no other header).

#[cfg(feature = "bindgen")]
#[path = "build/gen.rs"]
mod gen;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "bindgen")]
    if let Err(message) = generate_all() {
        eprintln!("metrale-cuda-sys: {message}");
        std::process::exit(1);
    }
}

#[cfg(feature = "bindgen")]
fn generate_all() -> Result<(), String> {
    println!("cargo:rerun-if-changed=build/gen.rs");
    for var in [
        "METRALE_CUDA_INCLUDE_DIR",
        "CUDA_PATH",
        "CUDA_HOME",
        "METRALE_BINDINGS_OUT_DIR",
        "METRALE_BINDINGS_ONLY",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let only = std::env::var("METRALE_BINDINGS_ONLY").ok();
    for spec in gen::SPECS
        .iter()
        .filter_map(|&(on, spec)| on.then_some(spec))
    {
        match &only {
            Some(list) if !list.split(',').any(|f| f.trim() == spec.file) => committed(spec)?,
            _ => generate(spec)?,
        }
    }
    Ok(())
}

/// Copy the committed `src/<file>` of `spec` to `$OUT_DIR` unchanged.
#[cfg(feature = "bindgen")]
fn committed(spec: &gen::Spec) -> Result<(), String> {
    use std::path::PathBuf;

    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR unset")?);
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR unset")?);
    let from = manifest.join("src").join(spec.file);
    println!("cargo:rerun-if-changed={}", from.display());
    std::fs::copy(&from, out_dir.join(spec.file))
        .map(drop)
        .map_err(|e| format!("cannot copy {}: {e}", from.display()))
}

/// Generate one header's bindings into `$OUT_DIR/<file>` (and the extra folder).
/// The include folder is the first of: the header's own variable,
/// `METRALE_CUDA_INCLUDE_DIR`, `$CUDA_PATH/include`, `$CUDA_HOME/include`,
/// `/usr/local/cuda/include` that has the header.
#[cfg(feature = "bindgen")]
fn generate(spec: &gen::Spec) -> Result<(), String> {
    use std::path::PathBuf;

    let (wrapper, own_var, file) = (spec.wrapper, spec.include_var, spec.file);
    println!("cargo:rerun-if-changed={wrapper}");
    if let Some(stub) = spec.stub_include {
        println!("cargo:rerun-if-changed={stub}");
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in own_var.into_iter().chain(["METRALE_CUDA_INCLUDE_DIR"]) {
        println!("cargo:rerun-if-env-changed={var}");
        if let Some(dir) = std::env::var_os(var) {
            candidates.push(dir.into());
        }
    }
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            candidates.push(PathBuf::from(root).join("include"));
        }
    }
    candidates.push("/usr/local/cuda/include".into());
    let header = spec.header;
    let include_dir = candidates
        .iter()
        .find(|dir| dir.join(header).is_file())
        .ok_or_else(|| {
            let tried: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
            let vars = own_var.map_or(String::new(), |v| format!("{v}, "));
            format!(
                "feature `bindgen` needs {header}; none found in: {} \
                 (set {vars}METRALE_CUDA_INCLUDE_DIR, CUDA_PATH or CUDA_HOME, or build without the feature)",
                tried.join(", ")
            )
        })?;
    println!(
        "cargo:rerun-if-changed={}",
        include_dir.join(header).display()
    );

    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR unset")?);
    let text = gen::generate(spec, &manifest.join(wrapper), include_dir)?;
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR unset")?);
    let write = |path: &std::path::Path| {
        std::fs::write(path, &text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    write(&out_dir.join(file))?;
    if let Some(extra) = std::env::var_os("METRALE_BINDINGS_OUT_DIR") {
        write(&std::path::Path::new(&extra).join(file))?;
    }
    Ok(())
}
