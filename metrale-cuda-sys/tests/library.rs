//! The one loader through the public names: every library's version is read
//! at load, and (feature `nccl`) a companion library is found through its own
//! variable, exactly like the driver.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use metrale_cuda_sys::Driver;

#[test]
fn the_driver_reads_its_version_at_load() {
    let d = Driver::load_from(metrale_fakecuda::library_path()).unwrap();
    assert_eq!(d.version(), Some((13, 0)));
    assert!(format!("{d:?}").contains("CUDA driver"), "{d:?}");
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_is_found_through_its_variable_and_reads_its_version() {
    use metrale_cuda_sys::nccl::{Nccl, LIBNCCL_PATH_VAR};

    // The only test in this binary that touches the variable.
    let stand_in = metrale_fakecuda::nccl_library_path();
    std::env::set_var(LIBNCCL_PATH_VAR, "/nonexistent/libnccl.so.2");
    let missing = Nccl::load_default();
    std::env::set_var(LIBNCCL_PATH_VAR, stand_in);
    let loaded = Nccl::load_default();
    std::env::remove_var(LIBNCCL_PATH_VAR);

    let e = missing.unwrap_err();
    let tried: Vec<&str> = e.attempts.iter().map(|a| a.candidate.as_str()).collect();
    assert_eq!(tried, ["/nonexistent/libnccl.so.2"]);
    let lib = loaded.unwrap();
    assert_eq!(lib.path(), stand_in.to_str().unwrap());
    let (major, minor, patch) = lib.version().unwrap();
    assert_eq!(
        lib.version_code(),
        Some(metrale_cuda_sys::nccl::version_code(major, minor, patch))
    );
    assert_eq!(lib.has_function("ncclGetVersion"), Some(true));
}
