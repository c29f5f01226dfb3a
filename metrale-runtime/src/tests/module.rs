//! Unit tests of `module`.

use super::log_text;

#[test]
fn jit_log_is_trimmed_and_bounded() {
    assert_eq!(log_text(b"  error: x \n\0garbage"), "error: x");
    let long = vec![b'a'; 10_000];
    let text = log_text(&long);
    assert!(text.starts_with(&"a".repeat(4096)));
    assert!(text.ends_with("[... log cut at 4096 bytes]"));
}

#[test]
fn interior_nul_names_the_module_and_offset() {
    let e = super::c_name("kernels", "vec\0add").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::vec\\0add: name has an interior NUL byte at offset 3"
    );
}
