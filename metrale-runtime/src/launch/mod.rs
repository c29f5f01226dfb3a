//! Launching kernels: [`LaunchConfig`] and its checks, [`LaunchAttributes`] for
//! `cuLaunchKernelEx`, typed arguments ([`KernelArgs`], in `args.rs`), argument
//! lists built at run time ([`KernelArgList`], in `arg_list.rs`), tensor maps
//! ([`TensorMap`], in `tensor_map/`), and the one
//! launch path every launch of the crate goes through (plain or extended, typed or
//! raw, from a stream, the registry or a graph update).
//!
//! Invariants:
//! - A launch is refused before the driver is called when the kernel belongs to
//!   another context than the stream, when the shape breaks the device's limits or
//!   the attributes' rules, or when typed arguments (a tuple or a run-time list)
//!   do not match the kernel's parameter layout (the count and each size; skipped
//!   when the driver cannot report the layout).
//! - The hot path (bind, those checks, the shared-memory check, the launch call)
//!   allocates nothing and takes no lock; text is made only on failure.
//! - Dynamic shared memory above what the kernel is set to is opted in once
//!   (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`), under the kernel's lock.

//!
//! `config.rs` owns [`LaunchConfig`] and [`LaunchAttributes`]; `path.rs` the
//! launch path; `args.rs`, `arg_list.rs` and `tensor_map/` the arguments.

mod arg_list;
mod args;
mod config;
mod path;
mod tensor_map;

pub use arg_list::{KernelArgList, MAX_ARG_ALIGN};
pub use args::{ArgLayout, ByAddress, ByValue, KernelArg, KernelArgs, NullPtr};
pub use config::{
    LaunchAttributes, LaunchConfig, DEFAULT_DYNAMIC_SHARED_LIMIT, MAX_PORTABLE_CLUSTER_SIZE,
};
pub(crate) use path::{launch_kernel, prepare};
pub use tensor_map::{
    Im2colWideMode, Interleave, L2Promotion, OobFill, Swizzle, TensorDataType, TensorElement,
    TensorMap, TensorMapBuilder, TensorMapLayout, TENSOR_MAP_MAX_RANK,
};

#[cfg(test)]
use crate::context::DeviceLimits;
#[cfg(test)]
use metrale_cuda_sys::CUlaunchAttributeID;

#[cfg(test)]
#[path = "../tests/launch.rs"]
mod tests;
