//! CPU tests of the NVTX injection loader (feature `nvtx`), against the stand-in
//! tool (`metrale-fakecuda/src/fakenvtx.c`). A tool is attached once per
//! process, so each case runs in a child process of this test binary with
//! `NVTX_INJECTION64_PATH` set as the case needs. The runtime's `nvtx` suite
//! covers the safe API.
#![cfg(feature = "nvtx")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

use metrale_cuda_sys::nvtx::{self, Injection};
use metrale_fakecuda::FakeNvtx;

const CHILD: &str = "METRALE_NVTX_LOADER_CHILD";

/// Run test `name` of this binary in a child with the injection variable set to
/// `tool` (unset for `None`); panic with its output unless it passed.
fn in_child(name: &str, tool: Option<&std::path::Path>) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name);
    match tool {
        Some(path) => cmd.env(nvtx::INJECTION_PATH_VAR, path),
        None => cmd.env_remove(nvtx::INJECTION_PATH_VAR),
    };
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {name} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child {name} did not run:\n{text}"
    );
}

/// Whether this process is the child running `name`.
fn is_child(name: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|c| c == name)
}

fn no_entries() -> bool {
    let n = nvtx::nvtx();
    n.nvtxMarkA().is_none()
        && n.nvtxMarkEx().is_none()
        && n.nvtxRangePushA().is_none()
        && n.nvtxRangePop().is_none()
        && n.nvtxRangeStartEx().is_none()
        && n.nvtxRangeEnd().is_none()
        && n.nvtxDomainCreateA().is_none()
        && n.nvtxDomainRangePushEx().is_none()
        && n.nvtxNameCuStreamA().is_none()
        && n.nvtxNameOsThreadA().is_none()
}

#[test]
fn without_a_tool_every_entry_is_empty() {
    if !is_child("child_no_tool") {
        in_child("child_no_tool", None);
    }
}

#[test]
fn child_no_tool() {
    if !is_child("child_no_tool") {
        return;
    }
    assert!(no_entries());
    assert_eq!(*nvtx::injection(), Injection::NoTool);
    assert!(!nvtx::injection().is_attached());
    assert_eq!(nvtx::tool_version(), 0);
}

#[test]
fn the_stand_in_tool_attaches_and_fills_the_tables() {
    if !is_child("child_attached") {
        in_child(
            "child_attached",
            Some(metrale_fakecuda::nvtx_library_path()),
        );
    }
}

#[test]
fn child_attached() {
    if !is_child("child_attached") {
        return;
    }
    let n = nvtx::nvtx();
    let push = n.nvtxRangePushA().expect("the tool filled RangePushA");
    let fake = FakeNvtx::open(metrale_fakecuda::nvtx_library_path());
    assert!(nvtx::injection().is_attached(), "{}", nvtx::injection());
    assert_eq!(fake.inits(), 1);
    assert_eq!(fake.app_version(), nvtx::NVTX_VERSION);
    assert_eq!(nvtx::tool_version(), 3);
    // CORE, CUDA, OPENCL, CUDART, CORE2, SYNC: every module served, sized as NVTX.
    let sizes: Vec<i32> = (1..=6).map(|m| fake.module_size(m)).collect();
    assert_eq!(sizes, [16, 9, 15, 7, 16, 7]);
    // SAFETY: a NUL-terminated message.
    assert_eq!(unsafe { push(c"outer".as_ptr()) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { push(c"inner".as_ptr()) }, 1);
    let pop = n.nvtxRangePop().unwrap();
    // SAFETY: no arguments.
    assert_eq!(unsafe { pop() }, 1);
    // SAFETY: as above.
    assert_eq!(unsafe { pop() }, 0);
    let records = fake.records();
    assert_eq!(records.len(), 4, "{records:?}");
    assert_eq!(records[0].message(), "outer");
    assert_eq!(records[1].message(), "inner");
    // The CORE2 and CUDA modules are filled too.
    assert!(n.nvtxNameCuEventA().is_some());
    assert!(n.nvtxDomainMarkEx().is_some());
}

#[test]
fn a_tool_whose_init_fails_leaves_every_entry_empty() {
    if !is_child("child_init_fails") {
        in_child(
            "child_init_fails",
            Some(metrale_fakecuda::nvtx_failing_library_path()),
        );
    }
}

#[test]
fn child_init_fails() {
    if !is_child("child_init_fails") {
        return;
    }
    assert!(no_entries(), "the failed tool's writes were used");
    let path = metrale_fakecuda::nvtx_failing_library_path();
    assert_eq!(
        *nvtx::injection(),
        Injection::InitFailed {
            path: path.to_path_buf()
        }
    );
    let fake = FakeNvtx::open(path);
    assert_eq!(fake.inits(), 1);
    assert_eq!(fake.count(), 0);
    assert!(nvtx::injection()
        .to_string()
        .contains("failed to initialise"));
}

#[test]
fn a_library_without_the_entry_point_is_no_tool() {
    if !is_child("child_no_entry_point") {
        in_child(
            "child_no_entry_point",
            Some(metrale_fakecuda::library_path()),
        );
    }
}

#[test]
fn child_no_entry_point() {
    if !is_child("child_no_entry_point") {
        return;
    }
    assert!(no_entries());
    assert_eq!(
        *nvtx::injection(),
        Injection::MissingEntryPoint {
            path: metrale_fakecuda::library_path().to_path_buf()
        }
    );
    assert!(nvtx::injection()
        .to_string()
        .contains("does not export InitializeInjectionNvtx2"));
}

#[test]
fn a_missing_library_is_no_tool_with_the_loader_message() {
    if !is_child("child_missing_library") {
        in_child(
            "child_missing_library",
            Some(std::path::Path::new("/nonexistent/libtool.so")),
        );
    }
}

#[test]
fn child_missing_library() {
    if !is_child("child_missing_library") {
        return;
    }
    assert!(no_entries());
    match nvtx::injection() {
        Injection::LoadFailed { path, message } => {
            assert_eq!(path, std::path::Path::new("/nonexistent/libtool.so"));
            assert!(!message.is_empty());
        }
        other => panic!("expected LoadFailed, got {other:?}"),
    }
}

#[test]
fn the_event_attribute_size_is_the_headers() {
    assert_eq!(nvtx::EVENT_ATTRIB_STRUCT_SIZE, 48);
    assert_eq!(nvtx::NVTX_VERSION, 3);
}
