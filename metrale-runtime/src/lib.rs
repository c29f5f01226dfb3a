//! Safe, fast access to the CUDA driver for programs that ship their own kernels.
//!
//! New here? [The guide](guide) has a chapter per topic (streams, memory, graphs,
//! several GPUs, NCCL, NVRTC, virtual memory, async, errors, performance), every
//! example compiled.
//!
//! metrale-runtime stands on [`metrale_cuda_sys`] (re-exported as [`sys`]): the
//! driver is loaded at run time, so a program builds and starts on machines without
//! CUDA and reports a clear error there.
//!
//! ## The types
//!
//! - [`MetraleRegistry`]: one model's kernel modules (PTX, cubin, fatbin) on a
//!   device; [`MetraleRegistry::load_on_devices`] loads one model for several.
//! - [`CudaFunction`]: a kernel, with its attributes, occupancy and parameter
//!   layout; launched with typed, checked arguments by [`CudaStream::launch`].
//! - [`CudaStream`] and [`CudaEvent`]: where work is queued, and how streams are
//!   ordered and timed.
//! - [`DeviceBuffer`] (and its slices), [`PinnedBuffer`], [`ManagedBuffer`],
//!   [`MemPool`], [`DeviceSymbol`]: memory, with copies and fills on a stream.
//! - [`CudaGraph`] and [`CudaGraphExec`]: capture a step once, replay it, update it.
//! - [`CudaHost`] ([`host()`]), [`CudaContext`] ([`context()`]), [`Device`]: the
//!   device, its context and default stream, and what the driver says about it.
//! - [`MetraleError`]: every failure, naming the call, the status and what was
//!   being worked on.
//!
//! | module | owns |
//! | --- | --- |
//! | [`error`] | [`MetraleError`], [`Result`], [`cuda_error_text`], [`is_teardown_noop`] |
//! | [`context`](mod@context) | `cuInit`, [`CudaContext`], binding, the release rule, [`ContextGuard`] |
//! | [`green`] | green contexts: [`SmResource`], splits, [`GreenContext`] and its streams |
//! | [`device`] | [`Device`]: count, name, UUID, memory, attributes, peer access |
//! | [`stream`] | [`CudaStream`], [`CudaEvent`] |
//! | [`blob`] | what a kernel blob is, checked before the driver sees it |
//! | [`module`] | loading blobs as modules or libraries, JIT logs |
//! | [`host`](mod@host) | [`CudaHost`]: a device's context and default stream |
//! | [`function`] | [`CudaFunction`], [`RawCudaFunc`], attributes, parameter layout |
//! | [`memory`] | buffers, slices, pools, symbols, copies and fills |
//! | [`launch`] | [`LaunchConfig`], [`LaunchAttributes`], typed arguments, [`TensorMap`], the launch path |
//! | [`registry`] | [`MetraleRegistry`], the seed's facade |
//! | [`graph`] | [`CudaGraph`], [`CudaGraphExec`]: capture, replay, update, DOT |
//! | `nvrtc` (feature `nvrtc`) | run-time compilation: `Program`, `Linker`, `CompileCache` |
//! | `nccl` (feature `nccl`) | collective communication: `Communicator`, checked collectives |
//! | `blas` (feature `cublas`) | cuBLASLt plans and plain cuBLAS GEMMs: `BlasLt`, `MatmulPlan`, `Blas` |
//! | `nvtx` (feature `nvtx`) | profiler ranges, marks, domains and names (NVTX v3, nothing linked) |
//! | [`guide`] | no code: the user's guide, a chapter per topic |
//!
//! Rules that hold everywhere: every driver call makes the right context current on
//! the calling thread when it is not; every error names the call, the status and
//! what was being worked on; no safe function hands the driver an unchecked raw
//! handle, and a handle of one device used with another is an error; safe code
//! cannot end a borrow while an async operation may still touch that memory; Drop
//! never panics, and treats "driver or context already gone" as nothing left to
//! free.
//!
//! ```no_run
//! use metrale_runtime::{DeviceBuffer, LaunchConfig, MetraleRegistry};
//!
//! static PTX: &[u8] = b"..."; // e.g. include_bytes!("kernels.ptx")
//!
//! # fn main() -> metrale_runtime::Result<()> {
//! let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
//! let vec_add = reg.function("kernels", "vec_add")?;
//! let s = reg.stream();
//! let a = DeviceBuffer::from_host(s, &[1.0f32; 1024])?;
//! let b = DeviceBuffer::from_host(s, &[2.0f32; 1024])?;
//! let mut c = DeviceBuffer::<f32>::alloc(s, 1024)?;
//! let cfg = LaunchConfig::for_num_elems(1024, 256)?;
//! // SAFETY: vec_add(const float*, const float*, float*, unsigned) over 1024 elements.
//! unsafe { s.launch(&vec_add, cfg, (&a, &b, &mut c, 1024u32))? };
//! assert!(s.to_vec(&c)?.iter().all(|&x| x == 3.0));
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub use metrale_cuda_sys as sys;

/// The `half` crate our `f16` / `bf16` element types come from (feature `half`),
/// so a user names the same version metrale implements its traits for.
#[cfg(feature = "half")]
#[cfg_attr(docsrs, doc(cfg(feature = "half")))]
pub use half;

#[cfg(feature = "cublas")]
#[cfg_attr(docsrs, doc(cfg(feature = "cublas")))]
pub mod blas;
pub mod blob;
pub mod context;
pub mod device;
pub mod error;
pub mod function;
pub mod graph;
pub mod green;
pub mod guide;
pub mod host;
pub mod launch;
mod lifetime;
pub mod memory;
pub mod module;
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub mod nccl;
#[cfg(feature = "nvrtc")]
#[cfg_attr(docsrs, doc(cfg(feature = "nvrtc")))]
pub mod nvrtc;
#[cfg(feature = "nvtx")]
#[cfg_attr(docsrs, doc(cfg(feature = "nvtx")))]
pub mod nvtx;
pub mod registry;
pub mod stream;

/// The names most programs use: `use metrale_runtime::prelude::*;`.
pub mod prelude {
    #[cfg(feature = "nccl")]
    pub use crate::{nccl_version, Communicator, NcclId, NcclStatus, ReduceOp};
    pub use crate::{
        AsContext, AsStream, CudaEvent, CudaFunction, CudaGraph, CudaGraphExec, CudaStream,
        DeviceBuffer, DeviceMemory, DeviceMemoryMut, DevicePod, DeviceRepr, ErrorKind,
        KernelArgList, LaunchConfig, ManagedBuffer, MetraleError, MetraleRegistry, NullPtr,
        PinnedBuffer, Result, Version,
    };
    #[cfg(feature = "cublas")]
    pub use crate::{Blas, BlasLt, MatmulDesc, MatmulPlan};
}

#[cfg(feature = "cublas")]
#[cfg_attr(docsrs, doc(cfg(feature = "cublas")))]
pub use blas::{
    Blas, BlasElement, BlasError, BlasLt, BlasLtOptions, ComputeType, Epilogue, Fp8E4M3, Fp8E5M2,
    GemmShape, MatmulDesc, MatmulExtras, MatmulPlan, MatrixLayout, ScaleMode, Transpose,
};
pub use blob::BlobKind;
pub use context::{
    context, device_count, AsContext, ContextGuard, CudaContext, DeviceLimits, Version,
};
pub use device::{enable_peer_access, memory_info, Device, PeerLink};
pub use error::{
    cuda_error_text, is_teardown_noop, CallError, ErrorKind, LaunchFailure, LaunchShape,
    LibraryError, LibraryFailure, MetraleError, NameKind, Result, CUDA_ERROR_CONTEXT_IS_DESTROYED,
    CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_INVALID_CONTEXT,
};
pub use function::{CudaFunction, FunctionAttributes, ParamInfo, RawCudaFunc};
pub use graph::{
    CaptureArena, CaptureMode, ConditionalHandle, CudaGraph, CudaGraphExec, GraphBuckets,
    GraphNode, GraphNodeKind, InstantiateOptions, KernelNode,
};
pub use green::{GreenContext, SmResource, SmSplit};
pub use host::{host, release, CudaHost};
pub use launch::{
    ArgLayout, ByAddress, ByValue, Im2colWideMode, Interleave, KernelArg, KernelArgList,
    KernelArgs, L2Promotion, LaunchAttributes, LaunchConfig, NullPtr, OobFill, Swizzle,
    TensorDataType, TensorElement, TensorMap, TensorMapBuilder, TensorMapLayout, MAX_ARG_ALIGN,
    TENSOR_MAP_MAX_RANK,
};
pub use memory::{
    deferred_frees, granularity, Access, BatchCopy, DeviceBuffer, DeviceMemory, DeviceMemoryMut,
    DevicePod, DeviceRepr, DeviceSlice, DeviceSliceMut, DeviceSymbol, Granularity, GrowableBuffer,
    HandleTypes, ManagedBuffer, MappedWords, MemOp, MemPool, PendingCopy, PhysicalMemory,
    PinnedBuffer, PrefetchTarget, SignalValue, SignalWord, SleepError, SleepState, SleepingBuffer,
    VirtualRange, WaitCondition, WaitFlags, WakeError, WriteFlags, MAX_BATCH_MEM_OPS,
};
#[cfg(unix)]
pub use memory::{recv_fd, send_fd, IpcBuffer, IpcEventHandle, IpcMemHandle, PoolPointer};
pub use module::NamedBlob;
#[cfg(feature = "nccl")]
pub use nccl::{
    group, nccl_version, CommConfig, Communicator, NcclError, NcclId, NcclStatus, NcclType,
    ReduceOp,
};
#[cfg(feature = "nvrtc")]
#[cfg_attr(docsrs, doc(cfg(feature = "nvrtc")))]
pub use nvrtc::{
    CompileCache, CompileOption, Compiled, Linked, Linker, NvrtcError, Program, Target,
};
pub use registry::MetraleRegistry;
#[doc(hidden)]
pub use stream::live_waiters;
pub use stream::{
    host_function_panics, AsStream, CudaEvent, CudaStream, EventDone, EventOptions, HostFn,
    StreamDone, StreamOptions,
};

#[cfg(test)]
#[path = "tests/texts.rs"]
mod texts;
