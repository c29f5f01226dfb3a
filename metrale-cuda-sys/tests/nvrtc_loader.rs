//! CPU tests of the NVRTC and nvJitLink loaders (feature `nvrtc`): typed errors
//! for missing files always; with `METRALE_LIBNVRTC_PATH` and
//! `METRALE_LIBNVJITLINK_PATH` set (scripts/fetch-nvrtc.sh), the real libraries'
//! tables and versions. The runtime's `nvrtc` suite covers compiling.
#![cfg(feature = "nvrtc")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use metrale_cuda_sys::nvjitlink::{self, NvJitLink};
use metrale_cuda_sys::nvrtc::{self, nvrtcResult, Nvrtc};

#[test]
fn a_missing_file_is_a_typed_error_naming_it() {
    let e = Nvrtc::load_from("/nonexistent/libnvrtc.so.13").unwrap_err();
    assert_eq!(e.attempts.len(), 1);
    let text = e.to_string();
    assert!(
        text.starts_with("could not load the NVRTC library; tried `/nonexistent/libnvrtc.so.13`: "),
        "{text}"
    );
    assert!(
        text.ends_with("set METRALE_LIBNVRTC_PATH to the library file"),
        "{text}"
    );
    let e = NvJitLink::load_from("/nonexistent/libnvJitLink.so.13").unwrap_err();
    assert!(e.to_string().contains("nvJitLink"), "{e}");
}

#[test]
fn a_missing_symbol_names_the_library_and_its_version() {
    let m = metrale_cuda_sys::LibraryMissingSymbol {
        library: "NVRTC",
        name: "nvrtcGetLTOIR",
        version: Some((11, 8)),
    };
    assert_eq!(
        m.to_string(),
        "the loaded NVRTC library does not export `nvrtcGetLTOIR` (it is version 11.8)"
    );
}

#[test]
fn status_names_come_from_the_header() {
    assert_eq!(
        nvrtcResult::NVRTC_ERROR_COMPILATION.to_string(),
        "NVRTC_ERROR_COMPILATION (6)"
    );
    assert_eq!(nvrtcResult(999).to_string(), "NVRTC_UNKNOWN (999)");
    assert_eq!(
        nvjitlink::nvJitLinkResult::NVJITLINK_ERROR_MISSING_ARCH.to_string(),
        "NVJITLINK_ERROR_MISSING_ARCH (2)"
    );
    assert!(nvrtc::FUNCTION_NAMES.contains(&"nvrtcGetLoweredName"));
    assert!(nvjitlink::FUNCTION_NAMES.contains(&"__nvJitLinkCreate_13_0"));
}

#[test]
fn the_real_libraries_load_when_named() {
    let (Some(rtc), Some(link)) = (
        std::env::var_os(nvrtc::LIBNVRTC_PATH_VAR),
        std::env::var_os(nvjitlink::LIBNVJITLINK_PATH_VAR),
    ) else {
        assert!(
            std::env::var("METRALE_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
            "METRALE_REQUIRE_NVRTC=1 but METRALE_LIBNVRTC_PATH / METRALE_LIBNVJITLINK_PATH are not set"
        );
        eprintln!("not checked: METRALE_LIBNVRTC_PATH / METRALE_LIBNVJITLINK_PATH not set");
        return;
    };
    let n = Nvrtc::load_from(&rtc).unwrap();
    assert_eq!(n.missing_functions(), Vec::<&str>::new());
    assert!(n.version().is_some_and(|(major, _)| major >= 12), "{n:?}");
    assert!(
        n.builtins_path().unwrap().contains("libnvrtc-builtins.so"),
        "{n:?}"
    );
    let l = NvJitLink::load_from(&link).unwrap();
    assert_eq!(l.missing_functions(), Vec::<&str>::new());
    assert!(l.version().is_some(), "{l:?}");
    // Each as the other: every symbol is missing, the error names the library.
    let wrong = NvJitLink::load_from(&rtc).unwrap();
    let missing = wrong.__nvJitLinkCreate_13_0().unwrap_err();
    assert_eq!(
        missing.to_string(),
        "the loaded nvJitLink library does not export `__nvJitLinkCreate_13_0` \
         (its version is unknown: it does not say)"
    );
}
