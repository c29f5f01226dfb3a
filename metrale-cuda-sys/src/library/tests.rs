//! The generic loader on a table of its own: two functions of the stand-in
//! driver, searched for under a variable and file names no other test uses.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::{Mutex, PoisonError};

use super::*;
use crate::{PFN_cuDriverGetVersion, PFN_cuLaunchKernelEx};

const VAR: &str = "METRALE_LIBLOADERTEST_PATH";
const FILES: &[&str] = &[
    "/nonexistent/first/libloadertest.so",
    "libloadertest-none.so.7",
];

/// Held by every test that reads or writes [`VAR`].
static ENV: Mutex<()> = Mutex::new(());

#[allow(non_snake_case)]
struct TestFns {
    cuDriverGetVersion: Option<PFN_cuDriverGetVersion>,
    cuLaunchKernelEx: Option<PFN_cuLaunchKernelEx>,
}

impl sealed::Sealed for TestFns {}

impl Table for TestFns {
    const FUNCTION_NAMES: &'static [&'static str] = &["cuDriverGetVersion", "cuLaunchKernelEx"];

    unsafe fn resolve(lib: &libloading::Library) -> Self {
        // SAFETY: the caller's promise: the library is a (stand-in) driver.
        unsafe {
            TestFns {
                cuDriverGetVersion: lib.get(b"cuDriverGetVersion\0").ok().map(|s| *s),
                cuLaunchKernelEx: lib.get(b"cuLaunchKernelEx\0").ok().map(|s| *s),
            }
        }
    }

    fn presence(&self) -> Vec<bool> {
        vec![
            self.cuDriverGetVersion.is_some(),
            self.cuLaunchKernelEx.is_some(),
        ]
    }
}

impl Api for TestFns {
    const NAMES: Names = Names::new("loader-test", VAR, FILES);
    type Version = (u32, u32);
    type LoadError = LibraryLoadError;

    fn query_version(lib: &Library<TestFns>) -> Option<(u32, u32)> {
        // SAFETY: cuDriverGetVersion writes one int.
        let code = unsafe { read_one(lib.fns.cuDriverGetVersion?) }?;
        Some((u32::try_from(code).ok()? / 1000, 0))
    }
}

#[allow(non_snake_case)]
impl Library<TestFns> {
    /// The accessor shape the generator writes for a companion library.
    fn cuLaunchKernelEx(&self) -> Result<PFN_cuLaunchKernelEx, LibraryMissingSymbol> {
        match self.fns.cuLaunchKernelEx {
            Some(f) => Ok(f),
            None => Err(self.missing("cuLaunchKernelEx")),
        }
    }
}

fn tried(e: &LibraryLoadError) -> Vec<&str> {
    e.attempts.iter().map(|a| a.candidate.as_str()).collect()
}

#[test]
fn without_the_variable_every_file_name_is_tried_in_order_and_listed() {
    let _env = ENV.lock().unwrap_or_else(PoisonError::into_inner);
    for value in [None, Some("")] {
        match value {
            None => std::env::remove_var(VAR),
            Some(v) => std::env::set_var(VAR, v),
        }
        let e = Library::<TestFns>::load_default().unwrap_err();
        assert_eq!(tried(&e), FILES, "{value:?}");
        assert!(e.attempts.iter().all(|a| !a.message.is_empty()), "{e:?}");
        assert_eq!(
            (e.library, e.env_var, &e.companion_of),
            ("loader-test", VAR, &None)
        );
        let text = e.to_string();
        let first = format!("`{}`: {}", FILES[0], e.attempts[0].message);
        let second = format!("`{}`: {}", FILES[1], e.attempts[1].message);
        assert_eq!(
            text,
            format!(
                "could not load the loader-test library; tried {first}; {second}. \
                 Install it, or set {VAR} to the library file"
            )
        );
    }
    std::env::remove_var(VAR);
}

#[test]
fn the_variable_is_the_only_candidate_when_set() {
    let _env = ENV.lock().unwrap_or_else(PoisonError::into_inner);
    std::env::set_var(VAR, "/nonexistent/override/libloadertest.so");
    let missing = Library::<TestFns>::load_default();
    let stand_in = metrale_fakecuda::library_path();
    std::env::set_var(VAR, stand_in);
    let loaded = Library::<TestFns>::load_default();
    std::env::remove_var(VAR);

    let e = missing.unwrap_err();
    assert_eq!(tried(&e), ["/nonexistent/override/libloadertest.so"]);
    assert!(
        e.to_string()
            .contains("/nonexistent/override/libloadertest.so"),
        "{e}"
    );
    let lib = loaded.unwrap();
    assert_eq!(lib.path(), stand_in.to_str().unwrap());
    assert_eq!(lib.version(), Some((13, 0)));
    assert_eq!(lib.missing_functions(), Vec::<&str>::new());
    let debug = format!("{lib:?}");
    assert!(
        debug.contains("loader-test") && debug.contains("libmetrale_fakecuda"),
        "{debug}"
    );
}

#[test]
fn a_missing_symbol_is_typed_and_names_the_symbol_and_version() {
    let old = Library::<TestFns>::load_from(metrale_fakecuda::old_library_path()).unwrap();
    let e = old.cuLaunchKernelEx().map(|_| ()).unwrap_err();
    assert_eq!(
        e,
        LibraryMissingSymbol {
            library: "loader-test",
            name: "cuLaunchKernelEx",
            version: Some((13, 0)),
        }
    );
    assert_eq!(
        e.to_string(),
        "the loaded loader-test library does not export `cuLaunchKernelEx` (it is version 13.0)"
    );
    assert_eq!(old.has_function("cuLaunchKernelEx"), Some(false));
    assert_eq!(old.has_function("cuDriverGetVersion"), Some(true));
    assert_eq!(old.has_function("cuInit"), None, "not in this table");
    assert_eq!(old.missing_functions(), ["cuLaunchKernelEx"]);

    let full = Library::<TestFns>::load_from(metrale_fakecuda::library_path()).unwrap();
    assert!(full.cuLaunchKernelEx().is_ok());
}

#[test]
fn a_file_that_does_not_load_is_one_attempt_with_the_loaders_message() {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let e = Library::<TestFns>::load_from(manifest).unwrap_err();
    assert_eq!(tried(&e), [manifest]);
    assert!(!e.attempts[0].message.is_empty());
    assert!(e.companion_of.is_none());
}
