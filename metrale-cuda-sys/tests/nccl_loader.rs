//! CPU tests of the NCCL loader (feature `nccl`): typed errors for missing files,
//! the header's config layout, status names. The runtime's `nccl` suite covers
//! the library itself (against the stand-in).
#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use metrale_cuda_sys::nccl::{self, ncclConfig_t, ncclResult_t, Nccl};

#[test]
fn a_missing_file_is_a_typed_error_naming_it() {
    let e = Nccl::load_from("/nonexistent/libnccl.so.2").unwrap_err();
    assert_eq!(e.attempts.len(), 1);
    let text = e.to_string();
    assert!(
        text.starts_with("could not load the NCCL library; tried `/nonexistent/libnccl.so.2`: "),
        "{text}"
    );
    assert!(
        text.ends_with("set METRALE_LIBNCCL_PATH to the library file"),
        "{text}"
    );
}

#[test]
fn the_config_initializer_matches_the_header() {
    let c = nccl::config_initializer();
    assert_eq!(c.size, std::mem::size_of::<ncclConfig_t>());
    assert_eq!(c.size, 80, "ncclConfig_v22800 on a 64-bit target");
    assert_eq!(c.magic, 0xcafe_beef);
    assert_eq!(c.version, nccl::NCCL_VERSION_CODE);
    assert_eq!(c.version, 22809);
    assert_eq!(c.blocking, i32::MIN);
    assert!(c.netName.is_null() && c.commName.is_null());
    assert_eq!(std::mem::size_of::<nccl::ncclUniqueId>(), 128);
}

#[test]
fn versions_decode_both_encodings() {
    assert_eq!(nccl::split_version(22809), (2, 28, 9));
    assert_eq!(nccl::split_version(2708), (2, 7, 8));
    assert_eq!(nccl::version_code(2, 7, 8), 2708);
    assert_eq!(nccl::version_code(2, 28, 3), 22803);
}

#[test]
fn status_names_come_from_the_header() {
    assert_eq!(
        ncclResult_t::ncclInvalidArgument.to_string(),
        "ncclInvalidArgument (4)"
    );
    assert_eq!(ncclResult_t(99).to_string(), "ncclUnknownResult (99)");
    assert!(nccl::FUNCTION_NAMES.contains(&"ncclAllReduce"));
    assert!(nccl::FUNCTION_NAMES.contains(&"ncclCommInitRankConfig"));
}

#[test]
fn the_real_library_loads_when_named() {
    let Some(path) = std::env::var_os(nccl::LIBNCCL_PATH_VAR) else {
        eprintln!("not checked: METRALE_LIBNCCL_PATH not set");
        return;
    };
    let lib = Nccl::load_from(&path).unwrap();
    let missing = lib.missing_functions();
    // The profiling names (pnccl*) and deprecated entry points may be absent.
    let core: Vec<&str> = missing
        .iter()
        .copied()
        .filter(|n| !n.starts_with("pnccl") && *n != "ncclResetDebugInit")
        .collect();
    assert_eq!(core, Vec::<&str>::new(), "{lib:?}");
    let (major, minor, _) = lib.version().unwrap();
    assert!((major, minor) >= (2, 19), "{lib:?}");
    let text = lib.ncclGetErrorString().unwrap();
    // SAFETY: ncclGetErrorString returns a static string for any status.
    let s = unsafe { std::ffi::CStr::from_ptr(text(ncclResult_t::ncclInvalidArgument)) };
    assert!(!s.to_bytes().is_empty());
    eprintln!(
        "{lib:?}: ncclInvalidArgument is {:?}; missing: {missing:?}",
        s.to_string_lossy()
    );
}
