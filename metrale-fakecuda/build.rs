//! Builds the stand-in driver as two shared libraries in `$OUT_DIR`: the full
//! one, and an "old driver" one without the entry points CUDA 12 added; and the
//! stand-in NCCL (`fakenccl.c`) as a third (also as an older NCCL, 2.26.5), the
//! stand-in NVTX tool (`fakenvtx.c`) three times: one that attaches, one whose
//! init returns 0, one hostile, and the stand-in cuBLAS and cuBLASLt (`fakeblas.c`) twice: as
//! 13.1.0, and as an older release (12.4.0, without the grouped GEMM).
//!
//! Without a working C compiler the build still succeeds (with a warning) and no
//! library is made: examples and anything else that only links this crate as a
//! dev-dependency build on such a machine, and the suites that need a stand-in
//! fail at run time saying it is missing.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/fakecuda.c");
    println!("cargo:rerun-if-changed=src/fakenccl.c");
    println!("cargo:rerun-if-changed=src/fakenvtx.c");
    println!("cargo:rerun-if-changed=src/fakeblas.c");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    for (file, source, define) in [
        ("libmetrale_fakecuda.so", "src/fakecuda.c", None),
        (
            "libmetrale_fakecuda_old.so",
            "src/fakecuda.c",
            Some("-DFAKECUDA_OLD"),
        ),
        ("libmetrale_fakenccl.so", "src/fakenccl.c", None),
        (
            "libmetrale_fakenccl_old.so",
            "src/fakenccl.c",
            Some("-DFAKENCCL_OLD"),
        ),
        ("libmetrale_fakenvtx.so", "src/fakenvtx.c", None),
        (
            "libmetrale_fakenvtx_fail.so",
            "src/fakenvtx.c",
            Some("-DFAKENVTX_FAIL"),
        ),
        (
            "libmetrale_fakenvtx_hostile.so",
            "src/fakenvtx.c",
            Some("-DFAKENVTX_HOSTILE"),
        ),
        ("libmetrale_fakeblas.so", "src/fakeblas.c", None),
        (
            "libmetrale_fakeblas_old.so",
            "src/fakeblas.c",
            Some("-DFAKEBLAS_OLD"),
        ),
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
        .arg(source)
        .args(["-lpthread", "-ldl", "-lm"]);
        let status = cmd.status();
        match status {
            Ok(s) if s.success() => {}
            other => {
                println!(
                    "cargo:warning=metrale-fakecuda: the stand-in driver {file} was not built \
                     (C compiler: {other:?}); the fault-injection suite will report it missing"
                );
                let _ = std::fs::remove_file(out.join(file));
            }
        }
    }
}
