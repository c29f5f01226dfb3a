//! Unit tests of `registry`.

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
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<super::MetraleRegistry>();
    send_sync::<super::RawCudaFunc>();
    send_sync::<super::CudaFunction>();
    send_sync::<crate::CudaHost>();
    send_sync::<crate::DeviceBuffer<f32>>();
    send_sync::<crate::PinnedBuffer<u8>>();
}
