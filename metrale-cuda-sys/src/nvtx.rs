//! NVTX v3's types (feature `nvtx`), generated from the pinned headers.
generated_bindings!("nvtx_bindings.rs");
pub use bindings::*;
