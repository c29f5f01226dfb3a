//! CPU tests of the cuBLAS and cuBLASLt loaders (feature `cublas`): typed errors
//! for missing files, status names, the tables' contents, and (when the
//! variables name them) the real libraries' versions, which load without a GPU.
//! The runtime's `blas` suite covers the libraries' use (against the stand-in).
#![cfg(feature = "cublas")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use metrale_cuda_sys::cublas::{self, cublasStatus_t, Cublas, CublasLt};

#[test]
fn a_missing_file_is_a_typed_error_naming_it() {
    let e = CublasLt::load_from("/nonexistent/libcublasLt.so.13").unwrap_err();
    assert_eq!(e.attempts.len(), 1);
    let text = e.to_string();
    assert!(
        text.starts_with(
            "could not load the cuBLASLt library; tried `/nonexistent/libcublasLt.so.13`: "
        ),
        "{text}"
    );
    assert!(
        text.ends_with("set METRALE_LIBCUBLASLT_PATH to the library file"),
        "{text}"
    );
    let e = Cublas::load_from("/nonexistent/libcublas.so.13").unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("could not load the cuBLAS library; tried `/nonexistent/libcublas.so.13`"),
        "{text}"
    );
    assert!(
        text.ends_with("set METRALE_LIBCUBLAS_PATH to the library file"),
        "{text}"
    );
}

#[test]
fn the_search_order_is_the_variable_then_13_then_12() {
    assert_eq!(
        cublas::CUBLASLT_LIBRARY_NAMES,
        ["libcublasLt.so.13", "libcublasLt.so.12"]
    );
    assert_eq!(
        cublas::CUBLAS_LIBRARY_NAMES,
        ["libcublas.so.13", "libcublas.so.12"]
    );
    assert_eq!(cublas::LIBCUBLASLT_PATH_VAR, "METRALE_LIBCUBLASLT_PATH");
    assert_eq!(cublas::LIBCUBLAS_PATH_VAR, "METRALE_LIBCUBLAS_PATH");
}

#[test]
fn versions_split_and_join() {
    assert_eq!(cublas::split_version(130100), (13, 1, 0));
    assert_eq!(cublas::split_version(120903), (12, 9, 3));
    assert_eq!(cublas::version_code(13, 1, 0), 130100);
    assert_eq!(cublas::CUBLAS_VERSION, 130100, "the pinned header");
}

#[test]
fn status_names_come_from_the_header() {
    assert_eq!(
        cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED.to_string(),
        "CUBLAS_STATUS_NOT_SUPPORTED (15)"
    );
    assert_eq!(cublasStatus_t(99).to_string(), "CUBLAS_STATUS_UNKNOWN (99)");
    assert!(cublasStatus_t::CUBLAS_STATUS_SUCCESS.is_success());
}

#[test]
fn the_tables_hold_the_gemm_surface() {
    for name in [
        "cublasCreate_v2",
        "cublasSetWorkspace_v2",
        "cublasSetStream_v2",
        "cublasSetMathMode",
        "cublasSetPointerMode_v2",
        "cublasGetStatusString",
        "cublasGemmEx",
        "cublasGemmStridedBatchedEx",
        "cublasGemmGroupedBatchedEx",
        "cublasSgemm_v2",
        "cublasSgemmStridedBatched",
    ] {
        assert!(cublas::CUBLAS_FUNCTION_NAMES.contains(&name), "{name}");
    }
    assert_eq!(
        cublas::CUBLAS_FUNCTION_NAMES.len(),
        cublas::CUBLAS_FUNCTION_COUNT
    );
    assert!(!cublas::CUBLAS_FUNCTION_NAMES.contains(&"cublasSaxpy_v2"));
    // The header declares the half-precision GEMMs for C++ only.
    assert!(!cublas::CUBLAS_FUNCTION_NAMES.contains(&"cublasHgemm"));
    for name in [
        "cublasLtCreate",
        "cublasLtGetVersion",
        "cublasLtGetStatusString",
        "cublasLtMatmul",
        "cublasLtMatmulAlgoGetHeuristic",
        "cublasLtMatmulDescCreate",
        "cublasLtMatmulDescSetAttribute",
        "cublasLtMatrixLayoutCreate",
        "cublasLtMatmulPreferenceSetAttribute",
    ] {
        assert!(cublas::CUBLASLT_FUNCTION_NAMES.contains(&name), "{name}");
    }
    assert!(!cublas::CUBLASLT_FUNCTION_NAMES.contains(&"cublasLtLoggerSetFile"));
    assert_eq!(
        std::mem::size_of::<cublas::cublasLtMatmulAlgo_t>(),
        64,
        "eight 64-bit words"
    );
}

#[test]
fn the_real_libraries_load_when_named() {
    let (Some(lt), Some(plain)) = (
        std::env::var_os(cublas::LIBCUBLASLT_PATH_VAR),
        std::env::var_os(cublas::LIBCUBLAS_PATH_VAR),
    ) else {
        eprintln!("not checked: METRALE_LIBCUBLASLT_PATH / METRALE_LIBCUBLAS_PATH not set");
        return;
    };
    let lt = CublasLt::load_from(&lt).unwrap();
    let plain = Cublas::load_from(&plain).unwrap();
    // 13.1.0.3 declares cublasLtDisableCpuInstructionsSetMask but does not export it.
    let lt_missing: Vec<&str> = lt
        .missing_functions()
        .into_iter()
        .filter(|&n| n != "cublasLtDisableCpuInstructionsSetMask")
        .collect();
    assert_eq!(lt_missing, Vec::<&str>::new(), "{lt:?}");
    assert_eq!(plain.missing_functions(), Vec::<&str>::new(), "{plain:?}");
    let (major, _, _) = lt.version().unwrap();
    assert!(major >= 12, "{lt:?}");
    assert_eq!(lt.version(), plain.version(), "one release");
    let text = lt.cublasLtGetStatusString().unwrap();
    // SAFETY: cublasLtGetStatusString returns a static string for any status.
    let s = unsafe { std::ffi::CStr::from_ptr(text(cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) };
    assert!(!s.to_bytes().is_empty());
    eprintln!("{lt:?} {plain:?}: {:?}", s.to_string_lossy());
}
