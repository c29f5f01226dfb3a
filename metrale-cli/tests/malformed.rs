//! Review regression tests: malformed input and hostile environments must give
//! exit status 1 or 2 (or 0), never 101 (a panic). Written by the round-4 review
//! (wt-review1); each one failed when written.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../metrale-runtime/tests/fixtures")
            .join(name),
    )
    .unwrap()
}

fn temp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("metrale-cli-malformed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn code(args: &[&std::ffi::OsStr]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .env("METRALE_LIBCUDA_PATH", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn inspect_offline(path: &Path) {
    for json in [false, true] {
        let mut args: Vec<&std::ffi::OsStr> = Vec::new();
        if json {
            args.push("--json".as_ref());
        }
        args.extend(["inspect".as_ref(), "--offline".as_ref(), path.as_os_str()]);
        let (code, stderr) = code(&args);
        assert!(
            matches!(code, 0 | 1),
            "{} (json {json}): exit {code}: {stderr}",
            path.display()
        );
    }
}

const HEAD: &str = ".version 8.5\n.target sm_90\n.address_size 64\n.visible .entry k(\n";
const TAIL: &str = "\n)\n{\n ret;\n}\n";

/// `type_size` splits at a count of characters used as a byte index.
#[test]
fn ptx_parameter_type_with_a_multibyte_letter() {
    inspect_offline(&temp(
        "mb.ptx",
        format!("{HEAD} .param .\u{30a2}8 k_0{TAIL}").as_bytes(),
    ));
}

/// Array length times element size, lanes times width, and the running offset
/// overflow u64 (a panic in debug builds, a wrong layout in release).
#[test]
fn ptx_parameter_sizes_that_overflow() {
    inspect_offline(&temp(
        "arr.ptx",
        format!("{HEAD} .param .u64 k_0[9999999999999999999]{TAIL}").as_bytes(),
    ));
    inspect_offline(&temp(
        "lanes.ptx",
        format!("{HEAD} .param .u64x3000000000000000000 k_0{TAIL}").as_bytes(),
    ));
    inspect_offline(&temp(
        "offset.ptx",
        format!("{HEAD} .param .b8 k_0[18446744073709551615],\n .param .u32 k_1{TAIL}").as_bytes(),
    ));
}

/// An EIATTR_REQNTID record of 3 x 0xffffffff: the product overflows u64.
#[test]
fn cubin_required_threads_that_overflow() {
    let mut b = fixture("kernels.sm_90.cubin");
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]) as usize;
    let u32_at =
        |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
    let u64_at =
        |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let (shoff, shnum, shstr) = (u64_at(&b, 0x28), u16_at(&b, 0x3c), u16_at(&b, 0x3e));
    let names = u64_at(&b, shoff + shstr * 64 + 0x18);
    let mut patched = false;
    'sections: for i in 0..shnum {
        let h = shoff + i * 64;
        let name_at = names + u32_at(&b, h);
        if !b[name_at..].starts_with(b".nv.info.") {
            continue;
        }
        let (off, size) = (u64_at(&b, h + 0x18), u64_at(&b, h + 0x20));
        let mut at = off;
        while at + 4 <= off + size {
            if b[at] == 4 {
                let n = u16_at(&b, at + 2);
                if b[at + 1] == 0x17 && n >= 12 {
                    b[at + 1] = 0x10; // EIATTR_REQNTID
                    b[at + 4..at + 16].fill(0xff);
                    patched = true;
                    break 'sections;
                }
                at += 4 + n;
            } else {
                at += 4;
            }
        }
    }
    assert!(patched);
    inspect_offline(&temp("reqntid.cubin", &b));
}

/// `std::env::args` panics on an argument that is not UTF-8 (a file name).
#[cfg(unix)]
#[test]
fn a_file_name_that_is_not_utf8() {
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::OsStr::from_bytes(b"/nonexistent/\xff.ptx");
    let (code, stderr) = code(&["inspect".as_ref(), "--offline".as_ref(), name]);
    assert!(matches!(code, 1 | 2), "exit {code}: {stderr}");
}

/// `print!` panics when stdout cannot be written (`--help` and `--version`).
#[cfg(target_os = "linux")]
#[test]
fn help_and_version_to_a_full_stdout() {
    for flag in ["--help", "--version"] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let status = Command::new(env!("CARGO_BIN_EXE_metrale"))
            .arg(flag)
            .stdout(Stdio::from(full))
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert_ne!(status.code(), Some(101), "{flag}: {status}");
    }
}
