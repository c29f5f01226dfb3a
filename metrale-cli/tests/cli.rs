//! The `metrale` binary against the stand-in driver and without a driver, with
//! golden outputs (`tests/golden/`; paths of the stand-ins are normalised to
//! `<FAKECUDA>` and `<FAKENCCL>`). `METRALE_BLESS=1 cargo test -p metrale-cli`
//! rewrites the golden files from the current output.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

const NO_DRIVER: &str = "/nonexistent/libcuda.so.1";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../metrale-runtime/tests/fixtures")
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Run `metrale args` with the driver at `driver` and the companion libraries
/// pinned (NVRTC and nvJitLink absent, NCCL the stand-in when the driver is),
/// so the output does not depend on what this machine has installed.
fn metrale(driver: &Path, args: &[&str]) -> Run {
    let fake = metrale_fakecuda::library_path();
    let nccl = if driver == fake {
        metrale_fakecuda::nccl_library_path().to_owned()
    } else {
        PathBuf::from("/nonexistent/libnccl.so.2")
    };
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(args)
        .env("METRALE_LIBCUDA_PATH", driver)
        .env("METRALE_LIBNVRTC_PATH", "/nonexistent/libnvrtc.so.13")
        .env(
            "METRALE_LIBNVJITLINK_PATH",
            "/nonexistent/libnvJitLink.so.13",
        )
        .env("METRALE_LIBNCCL_PATH", nccl)
        .output()
        .expect("the binary runs");
    let normalise = |b: &[u8]| {
        let mut s = String::from_utf8_lossy(b).into_owned();
        for (path, name) in [
            (metrale_fakecuda::library_path(), "<FAKECUDA>"),
            (metrale_fakecuda::nccl_library_path(), "<FAKENCCL>"),
        ] {
            if let Ok(real) = path.canonicalize() {
                s = s.replace(&*real.to_string_lossy(), name);
            }
            s = s.replace(&*path.to_string_lossy(), name);
        }
        s
    };
    let run = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: normalise(&out.stdout),
        stderr: normalise(&out.stderr),
    };
    assert!(
        !run.stderr.contains("panicked"),
        "metrale {args:?} panicked: {}",
        run.stderr
    );
    run
}

fn stand_in(args: &[&str]) -> Run {
    metrale(metrale_fakecuda::library_path(), args)
}

fn golden(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("METRALE_BLESS").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (METRALE_BLESS=1 writes it)", path.display()));
    assert!(
        expected == actual,
        "{name} differs from the golden file (METRALE_BLESS=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{actual}"
    );
}

fn fixture(name: &str) -> String {
    fixtures().join(name).to_string_lossy().into_owned()
}

#[test]
fn doctor_against_the_stand_in() {
    let r = stand_in(&["doctor"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    golden("doctor.txt", &r.stdout);
    let r = stand_in(&["doctor", "--json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    golden("doctor.json", &r.stdout);
}

#[test]
fn doctor_names_a_driver_that_lacks_newer_functions() {
    let r = metrale(metrale_fakecuda::old_library_path(), &["doctor"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for f in [
        "cuLaunchKernelEx",
        "cuFuncGetParamInfo",
        "cuModuleEnumerateFunctions",
    ] {
        assert!(
            r.stdout.contains(&format!("lacks:     {f}")),
            "{}",
            r.stdout
        );
    }
}

#[test]
fn devices_against_the_stand_in() {
    let r = stand_in(&["devices"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    golden("devices.txt", &r.stdout);
    let r = stand_in(&["--json", "devices"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    golden("devices.json", &r.stdout);
}

#[test]
fn inspect_every_fixture_offline() {
    for name in [
        "kernels.ptx",
        "kernels.sm_90.cubin",
        "kernels.fatbin",
        "conditional.ptx",
        "conditional.sm_90.cubin",
        "tma.ptx",
    ] {
        let r = metrale(
            Path::new(NO_DRIVER),
            &["inspect", "--offline", &fixture(name)],
        );
        assert_eq!(r.code, 0, "{name}: {}", r.stderr);
        assert_eq!(r.stderr, "", "{name}");
        golden(&format!("inspect-{name}.txt"), &r.stdout);
    }
    for name in ["kernels.sm_90.cubin", "kernels.fatbin"] {
        let r = metrale(
            Path::new(NO_DRIVER),
            &["inspect", "--offline", "--json", &fixture(name)],
        );
        assert_eq!(r.code, 0, "{name}: {}", r.stderr);
        golden(&format!("inspect-{name}.json"), &r.stdout);
    }
}

#[test]
fn inspect_cubin_parameters_match_the_ptx_layout() {
    // The cubin's EIATTR_KPARAM_INFO records and the PTX's declarations describe
    // the same kernels: the layouts must agree kernel by kernel.
    let layouts = |name: &str| -> Vec<(String, String)> {
        let r = metrale(
            Path::new(NO_DRIVER),
            &["inspect", "--offline", &fixture(name)],
        );
        let mut out = Vec::new();
        let mut kernel = String::new();
        for line in r.stdout.lines() {
            if let Some(p) = line.strip_prefix("    parameters (offset:size): ") {
                out.push((kernel.clone(), p.to_owned()));
            } else if let Some(k) = line.strip_prefix("  ") {
                if !k.starts_with(' ') && !k.starts_with("kernels:") {
                    kernel = k.to_owned();
                }
            }
        }
        out.sort();
        out
    };
    let ptx = layouts("kernels.ptx");
    assert_eq!(ptx.len(), 16);
    assert_eq!(ptx, layouts("kernels.sm_90.cubin"));
}

#[test]
fn inspect_with_the_stand_in_asks_the_driver() {
    let r = stand_in(&["inspect", &fixture("kernels.ptx")]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    golden("inspect-kernels.ptx-driver.txt", &r.stdout);
}

#[test]
fn inspect_refuses_what_is_not_a_blob() {
    let dir = std::env::temp_dir().join(format!("metrale-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cubin = std::fs::read(fixtures().join("kernels.sm_90.cubin")).unwrap();
    let cut = dir.join("cut.cubin");
    std::fs::write(&cut, &cubin[..200]).unwrap();
    let text = dir.join("notes.txt");
    std::fs::write(&text, "hello\n").unwrap();
    let r = metrale(Path::new(NO_DRIVER), &["inspect", &cut.to_string_lossy()]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .contains("cut.cubin: malformed cubin: section headers lie past the end"),
        "{}",
        r.stderr
    );
    let r = metrale(Path::new(NO_DRIVER), &["inspect", &text.to_string_lossy()]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("not a kernel blob"), "{}", r.stderr);
    let r = metrale(Path::new(NO_DRIVER), &["inspect", "/nonexistent/k.ptx"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("cannot read /nonexistent/k.ptx"),
        "{}",
        r.stderr
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_against_the_stand_in() {
    let r = stand_in(&["bench", "--rounds", "2", "--launches", "250"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("raw cuLaunchKernel (floor)"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("registry launch_on_stream"),
        "{}",
        r.stdout
    );
    let r = stand_in(&["bench", "--json", "--rounds", "2", "--launches", "250"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout.matches("\"median_us\"").count(), 3, "{}", r.stdout);
}

#[test]
fn without_a_driver_every_command_exits_3_with_the_loaders_message() {
    let message = format!("could not load the CUDA driver library; tried `{NO_DRIVER}`: ");
    let kernels = fixture("kernels.ptx");
    let commands: [&[&str]; 4] = [
        &["doctor"],
        &["devices"],
        &["inspect", &kernels],
        &["bench", "--rounds", "1", "--launches", "1"],
    ];
    for args in commands {
        for json in [false, true] {
            let mut args = args.to_vec();
            if json {
                args.push("--json");
            }
            let r = metrale(Path::new(NO_DRIVER), &args);
            assert_eq!(r.code, 3, "{args:?}: {}", r.stderr);
            assert!(r.stderr.contains(&message), "{args:?}: {}", r.stderr);
            if json {
                assert!(
                    r.stdout.contains("could not load the CUDA driver library"),
                    "{args:?}"
                );
            }
        }
    }
    // doctor still reports what it could.
    let r = metrale(Path::new(NO_DRIVER), &["doctor"]);
    golden("doctor-no-driver.txt", &r.stdout);
    // inspect still reads the file.
    let r = metrale(Path::new(NO_DRIVER), &["inspect", &kernels]);
    assert!(
        r.stdout.contains("PTX: ISA 9.0, target sm_90"),
        "{}",
        r.stdout
    );
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &[][..],
        &["frobnicate"],
        &["inspect"],
        &["inspect", "a", "b"],
        &["doctor", "extra"],
        &["bench", "--rounds"],
        &["bench", "--rounds", "0"],
    ] {
        let r = metrale(Path::new(NO_DRIVER), args);
        assert_eq!(r.code, 2, "{args:?}");
        assert!(
            r.stderr.contains("Usage: metrale"),
            "{args:?}: {}",
            r.stderr
        );
    }
    let r = metrale(Path::new(NO_DRIVER), &["--help"]);
    assert_eq!(r.code, 0);
    assert!(r.stdout.contains("metrale doctor") || r.stdout.contains("doctor"));
}
