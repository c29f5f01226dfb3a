//! `&str` to a C string for one call, without allocating for short names.

use std::ffi::c_char;
use std::mem::MaybeUninit;

/// Texts shorter than this are made NUL-terminated in a stack buffer.
const STACK: usize = 128;

/// Call `f` with `text` as a NUL-terminated C string, on the stack when it is
/// shorter than 128 bytes (else in a heap copy). The C side reads up to the
/// first NUL, so a text with an interior NUL is cut there.
#[inline]
pub(crate) fn with_cstr<R>(text: &str, f: impl FnOnce(*const c_char) -> R) -> R {
    let bytes = text.as_bytes();
    let len = bytes.len();
    if len >= STACK {
        return f(owned(bytes).as_ptr().cast());
    }
    // Not zeroed: only the text and its NUL are written, and only they are read
    // (by the C side, up to the first NUL).
    let mut buf = [MaybeUninit::<u8>::uninit(); STACK];
    let dst = buf.as_mut_ptr().cast::<u8>();
    // SAFETY: `len < STACK`, so the text and the NUL after it fit in `buf`;
    // the source is the text itself, which does not overlap the stack buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, len);
        dst.add(len).write(0);
    }
    f(dst.cast_const().cast())
}

/// `bytes` up to their first NUL, with a NUL after (for texts kept or long).
pub(crate) fn owned(bytes: &[u8]) -> Box<[u8]> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let mut v = Vec::with_capacity(end + 1);
    v.extend_from_slice(&bytes[..end]);
    v.push(0);
    v.into_boxed_slice()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn read(text: &str) -> String {
        with_cstr(text, |p| {
            // SAFETY: with_cstr hands a NUL-terminated string, valid during the call.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        })
    }

    #[test]
    fn short_long_and_cut_texts() {
        assert_eq!(read(""), "");
        assert_eq!(read("decode"), "decode");
        let long = "x".repeat(127);
        assert_eq!(read(&long), long);
        let longer = "y".repeat(500);
        assert_eq!(read(&longer), longer);
        assert_eq!(read("a\0b"), "a");
        assert_eq!(read(&format!("{}\0tail", "z".repeat(300))), "z".repeat(300));
        assert_eq!(&*owned(b"ab\0cd"), b"ab\0");
        assert_eq!(&*owned(b"ab"), b"ab\0");
    }
}
