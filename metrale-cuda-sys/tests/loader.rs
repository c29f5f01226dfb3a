//! CPU tests of the loader and the generated types: no GPU, no real driver.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use metrale_cuda_sys::{CUresult, Driver, LoadError, MissingSymbol, FUNCTION_COUNT};

fn load_error(path: &str) -> LoadError {
    match Driver::load_from(path) {
        Ok(d) => panic!("loading {path} should fail, got {d:?}"),
        Err(e) => e,
    }
}

#[test]
fn missing_file_is_a_typed_error_naming_the_candidate() {
    let e = load_error("/nonexistent/libcuda.so.1");
    assert_eq!(e.attempts.len(), 1);
    assert_eq!(e.attempts[0].candidate, "/nonexistent/libcuda.so.1");
    assert!(!e.attempts[0].message.is_empty());
    let text = e.to_string();
    assert!(
        text.starts_with(
            "could not load the CUDA driver library; tried `/nonexistent/libcuda.so.1`: "
        ),
        "{text}"
    );
    assert!(
        text.ends_with("set METRALE_LIBCUDA_PATH to the driver library file"),
        "{text}"
    );
}

#[test]
fn a_file_that_is_not_a_library_is_a_typed_error() {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let e = load_error(manifest);
    assert_eq!(e.attempts[0].candidate, manifest);
    assert!(e.to_string().contains(manifest));
}

#[test]
fn env_override_is_the_only_candidate_and_failures_list_it() {
    // The only test in this binary that touches the variable.
    std::env::set_var("METRALE_LIBCUDA_PATH", "/nonexistent/override.so");
    let result = Driver::load_default();
    std::env::set_var("METRALE_LIBCUDA_PATH", metrale_fakecuda::library_path());
    let ok = Driver::load_default();
    std::env::remove_var("METRALE_LIBCUDA_PATH");
    let e = result.expect_err("a missing override must fail");
    let tried: Vec<&str> = e.attempts.iter().map(|a| a.candidate.as_str()).collect();
    assert_eq!(tried, ["/nonexistent/override.so"]);
    let d = ok.expect("the stand-in loads through the override");
    assert_eq!(d.path(), metrale_fakecuda::library_path().to_str().unwrap());
}

#[test]
fn unknown_status_is_a_plain_value() {
    let s = CUresult(9999);
    assert_ne!(s, CUresult::CUDA_SUCCESS);
    assert!(!s.is_success());
    assert_eq!(s.name(), None);
    assert_eq!(s.to_string(), "CUDA_UNKNOWN (9999)");
    assert_eq!(
        CUresult::CUDA_ERROR_INVALID_VALUE.to_string(),
        "CUDA_ERROR_INVALID_VALUE (1)"
    );
    assert_eq!(CUresult::CUDA_ERROR_DEINITIALIZED.0, 4);
    assert_eq!(
        CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED.name(),
        Some("CUDA_ERROR_CONTEXT_IS_DESTROYED")
    );
    assert!(CUresult::CUDA_SUCCESS.is_success());
}

#[test]
fn the_table_covers_the_header_and_keeps_versioned_names() {
    const { assert!(FUNCTION_COUNT > 400) };
    let names = metrale_cuda_sys::FUNCTION_NAMES;
    for versioned in [
        "cuMemAlloc_v2",
        "cuCtxCreate_v4",
        "cuStreamDestroy_v2",
        "cuModuleGetGlobal_v2",
    ] {
        assert!(names.contains(&versioned), "{versioned}");
    }
    // The header maps the plain names away; the table holds only what it maps to.
    assert!(!names.contains(&"cuMemAlloc"));
}

#[test]
fn a_symbol_the_library_lacks_is_a_typed_error_and_the_rest_works() {
    let d = Driver::load_from(metrale_fakecuda::old_library_path()).expect("stand-in loads");
    let err: MissingSymbol = d.cuLaunchKernelEx().map(|_| ()).unwrap_err();
    assert_eq!(err.name, "cuLaunchKernelEx");
    assert_eq!(
        err.to_string(),
        "the loaded CUDA driver does not export `cuLaunchKernelEx` (it predates that function)"
    );
    assert_eq!(d.has_function("cuModuleGetGlobal_v2"), Some(false));
    assert_eq!(d.has_function("cuInit"), Some(true));
    assert_eq!(d.has_function("not_a_cuda_function"), None);
    let missing = d.missing_functions();
    assert!(missing.contains(&"cuModuleGetGlobal_v2"));
    assert!(!missing.contains(&"cuInit"));

    let init = d.cuInit().expect("the stand-in exports cuInit");
    let get_version = d.cuDriverGetVersion().expect("and cuDriverGetVersion");
    let mut version = 0;
    // SAFETY: plain calls into the stand-in with valid arguments.
    let (s1, s2) = unsafe { (init(0), get_version(&mut version)) };
    assert_eq!((s1, s2), (CUresult::CUDA_SUCCESS, CUresult::CUDA_SUCCESS));
    assert_eq!(version, 13000);
    // A versioned name resolves under its versioned symbol.
    assert!(d.cuMemAlloc_v2().is_ok());
}
