//! NVTX loader tests (filled in below).
