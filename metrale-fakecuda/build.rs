//! Builds the stand-in driver as two shared libraries in `$OUT_DIR`: the full
//! one, and an "old driver" one without the entry points CUDA 12 added.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/fakecuda.c");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    for (file, define) in [
        ("libmetrale_fakecuda.so", None),
        ("libmetrale_fakecuda_old.so", Some("-DFAKECUDA_OLD")),
    ] {
        let mut cmd: Command = compiler.to_command();
        cmd.args([
            "-shared",
            "-fPIC",
            "-O1",
            "-fvisibility=hidden",
            "-std=c11",
            "-Wall",
        ])
        .args([
            "-Werror=implicit-function-declaration",
            "-Werror=int-conversion",
        ])
        .args(define)
        .arg("-o")
        .arg(out.join(file))
        .arg("src/fakecuda.c")
        .arg("-lpthread");
        let status = cmd.status();
        match status {
            Ok(s) if s.success() => {}
            other => {
                eprintln!("metrale-fakecuda: building {file} failed: {other:?}");
                std::process::exit(1);
            }
        }
    }
}
