//! Review regression test (wt-review1): a symbol the library exports with the
//! address 0 (an absolute symbol, or an IFUNC resolving to null) is found by
//! `dlsym` with no error, and libloading's `get` (on Linux `get_singlethreaded`)
//! returns it as a `Symbol` holding a null pointer. `resolve` then reads it as a
//! non-nullable `unsafe extern "C" fn` (`*s`): an invalid value, undefined
//! behaviour. Today this passes only because `Some(null fn)` has the bits of
//! `None` (the niche), so the UB happens to read as "missing"; the test keeps
//! the observable rule (a null symbol is missing) for when `resolve` reads
//! `Option<PFN_x>` and flattens it, as it should.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use metrale_cuda_sys::Driver;

#[cfg(target_os = "linux")]
#[test]
fn a_symbol_at_address_zero_is_missing() {
    let dir = std::env::temp_dir().join(format!("metrale-null-symbol-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("null.c");
    let lib = dir.join("libnullsym.so");
    std::fs::write(
        &src,
        "int cuDriverGetVersion(int *v) { *v = 13000; return 0; }\n",
    )
    .unwrap();
    let built = std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-Wl,--defsym,cuInit=0", "-o"])
        .arg(&lib)
        .arg(&src)
        .status();
    if !built.is_ok_and(|s| s.success()) {
        eprintln!("skipped: no C compiler to build the probe library");
        return;
    }
    let d = Driver::load_from(&lib).unwrap();
    assert_eq!(d.has_function("cuDriverGetVersion"), Some(true));
    assert_eq!(
        d.has_function("cuInit"),
        Some(false),
        "a null cuInit counts as present"
    );
    assert!(d.cuInit().is_err());
}
