//! Safe access to the CUDA driver for programs that ship their own kernels.
//!
//! metrale-runtime stands on [`metrale_cuda_sys`] (re-exported as [`sys`]): the
//! driver is loaded at run time, so a program builds and starts on machines without
//! CUDA and reports a clear error there.
//!
//! | module | owns |
//! | --- | --- |
//! | [`error`] | [`MetraleError`], [`Result`], [`cuda_error_text`], [`is_teardown_noop`] |
//! | [`host`](mod@host) | [`CudaHost`]: per device, `cuInit` once, the primary context, one stream |
//! | [`blob`] | what a kernel blob is and how it is handed to the driver |
//! | [`registry`] | [`MetraleRegistry`]: one model's modules, lookups, symbols, copies, launches |
//! | [`memory`] | [`DeviceBuffer`], [`PinnedBuffer`] |
//! | [`launch`] | [`LaunchConfig`], typed kernel arguments, the shared-memory opt-in |
//!
//! Rules that hold everywhere: every driver call makes the right context current on
//! the calling thread when it is not; every error names the call, the status and
//! what was being worked on; Drop never panics, and treats "driver or context already
//! gone" as nothing left to free.
//!
//! ```no_run
//! use std::sync::OnceLock;
//! use metrale_runtime::{DeviceBuffer, LaunchConfig, MetraleRegistry, RawCudaFunc};
//!
//! static PTX: &[u8] = b"..."; // e.g. include_bytes!("kernels.ptx")
//! static VEC_ADD: OnceLock<RawCudaFunc> = OnceLock::new();
//!
//! # fn main() -> metrale_runtime::Result<()> {
//! let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
//! let f = reg.raw_function_cached(&VEC_ADD, "kernels", "vec_add")?;
//! let a = DeviceBuffer::from_host(reg.host(), &[1.0f32; 1024])?;
//! let b = DeviceBuffer::from_host(reg.host(), &[2.0f32; 1024])?;
//! let c = DeviceBuffer::<f32>::alloc(reg.host(), 1024)?;
//! let cfg = LaunchConfig::for_num_elems(1024, 256)?;
//! // SAFETY: vec_add(const float*, const float*, float*, unsigned) over 1024 elements.
//! unsafe { reg.launch(f, cfg, reg.raw_stream(), (&a, &b, &c, 1024u32))? };
//! assert!(c.to_host_vec()?.iter().all(|&x| x == 3.0));
//! # Ok(()) }
//! ```

pub use metrale_cuda_sys as sys;

pub mod blob;
pub mod error;
pub mod host;
pub mod launch;
pub mod memory;
pub mod registry;

pub use blob::BlobKind;
pub use error::{
    cuda_error_text, is_teardown_noop, CallError, MetraleError, Result,
    CUDA_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_INVALID_CONTEXT,
};
pub use host::{host, release, CudaContext, CudaHost, CudaStream, DeviceLimits};
pub use launch::{KernelArg, KernelArgs, LaunchAttributes, LaunchConfig};
pub use memory::{DeviceBuffer, DeviceRepr, PinnedBuffer};
pub use registry::{CudaFunction, FunctionAttributes, MetraleRegistry, RawCudaFunc};
