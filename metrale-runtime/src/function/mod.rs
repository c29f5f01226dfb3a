//! Kernels: [`CudaFunction`] (a kernel that keeps its code loaded), its attributes,
//! occupancy and parameter layout; [`RawCudaFunc`], the copyable handle of the
//! seed's memoized lookup; and the per-device table that looks kernels up once.
//!
//! Invariants:
//! - Each registry has one `KernelTable` per device: its context, the code it
//!   reads (a `ModuleSet`) and, per module, the kernels looked up so far. A
//!   kernel is looked up in the driver once per table; its `KernelInfo` (handle,
//!   name, parameter layout, shared-memory limit) is shared by every handle to it
//!   and never removed while the table lives.
//! - A `CudaFunction` holds its table, so its code stays loaded while it lives.
//! - A `RawCudaFunc` carries the id of the table it came from (ids are never
//!   reused). Its `KernelInfo` pointer is only followed after the id matched the
//!   table at hand, which is alive and keeps that info alive: a stale or foreign
//!   handle is detected, never dereferenced.
//! - The shared-memory limit recorded for a kernel is exactly what metrale last set
//!   in the driver: every change (launch opt-in or
//!   [`CudaFunction::set_max_dynamic_shared_bytes`]) sets the driver and the record
//!   under the kernel's lock, so they agree under any interleaving.

//!
//! `info.rs` owns what the driver says about a kernel; `raw.rs` [`RawCudaFunc`];
//! `table.rs` the per-device table; `kernel.rs` [`CudaFunction`].

mod info;
mod kernel;
mod raw;
mod table;

pub(crate) use info::KernelInfo;
pub use info::ParamInfo;
pub use kernel::{CudaFunction, FunctionAttributes};
pub use raw::RawCudaFunc;
pub(crate) use raw::SideCache;
pub(crate) use table::{
    capture_finished, capture_started, keep_for_capture, name_of, owner_of, KernelTable,
};
