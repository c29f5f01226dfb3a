//! Build script of metrale-cuda-sys.
//!
//! By default it does nothing: the committed `src/bindings.rs` is used, so a build
//! needs neither a CUDA toolkit nor libclang. With the `bindgen` feature it runs
//! bindgen on `wrapper.h` (see `build/gen.rs`) against the first include folder
//! that has `cuda.h`, and writes the bindings to `$OUT_DIR/bindings.rs`; when
//! `METRALE_BINDINGS_OUT` names a file, the same text is written there too (the
//! regeneration script uses this).

#[cfg(feature = "bindgen")]
#[path = "build/gen.rs"]
mod gen;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "bindgen")]
    if let Err(message) = generate() {
        eprintln!("metrale-cuda-sys: {message}");
        std::process::exit(1);
    }
}

#[cfg(feature = "bindgen")]
fn generate() -> Result<(), String> {
    use std::path::PathBuf;

    println!("cargo:rerun-if-changed=build/gen.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    for var in [
        "METRALE_CUDA_INCLUDE_DIR",
        "CUDA_PATH",
        "CUDA_HOME",
        "METRALE_BINDINGS_OUT",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dir) = std::env::var_os("METRALE_CUDA_INCLUDE_DIR") {
        candidates.push(dir.into());
    }
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            candidates.push(PathBuf::from(root).join("include"));
        }
    }
    candidates.push("/usr/local/cuda/include".into());
    let include_dir = candidates
        .iter()
        .find(|dir| dir.join("cuda.h").is_file())
        .ok_or_else(|| {
            let tried: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
            format!(
                "feature `bindgen` needs cuda.h; none found in: {} \
                 (set METRALE_CUDA_INCLUDE_DIR, CUDA_PATH or CUDA_HOME, or build without the feature)",
                tried.join(", ")
            )
        })?;
    println!(
        "cargo:rerun-if-changed={}",
        include_dir.join("cuda.h").display()
    );

    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR unset")?);
    let text = gen::generate(&manifest.join("wrapper.h"), include_dir)?;
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR unset")?);
    let write = |path: &std::path::Path| {
        std::fs::write(path, &text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    write(&out_dir.join("bindings.rs"))?;
    if let Some(extra) = std::env::var_os("METRALE_BINDINGS_OUT") {
        write(std::path::Path::new(&extra))?;
    }
    Ok(())
}
