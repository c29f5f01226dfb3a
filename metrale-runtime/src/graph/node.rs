//! The parts of a graph: [`GraphNode`] (which carries its graph's identity),
//! [`GraphNodeKind`], [`KernelNode`], [`ConditionalHandle`], and the kernel-node
//! parameters that building, inspecting and updating share.

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use metrale_cuda_sys::{self as sys, CUfunction, CUgraphNode};

use crate::error::{cu, invalid_arg, Result};
use crate::launch::LaunchConfig;
use crate::memory::{DevicePod, DeviceRepr};

/// What a graph node does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GraphNodeKind {
    /// A kernel launch.
    Kernel,
    /// A memory copy.
    Memcpy,
    /// A memory fill.
    Memset,
    /// A host function.
    Host,
    /// A child graph.
    ChildGraph,
    /// An empty node (a join point).
    Empty,
    /// Waits for an event.
    WaitEvent,
    /// Records an event.
    EventRecord,
    /// A stream-ordered allocation.
    MemAlloc,
    /// A stream-ordered free.
    MemFree,
    /// A conditional node (`if` / `while`).
    Conditional,
    /// Another kind (the driver's number).
    Other(u32),
}

impl GraphNodeKind {
    pub(super) fn from_raw(t: sys::CUgraphNodeType) -> GraphNodeKind {
        use sys::CUgraphNodeType as T;
        match t {
            T::CU_GRAPH_NODE_TYPE_KERNEL => GraphNodeKind::Kernel,
            T::CU_GRAPH_NODE_TYPE_MEMCPY => GraphNodeKind::Memcpy,
            T::CU_GRAPH_NODE_TYPE_MEMSET => GraphNodeKind::Memset,
            T::CU_GRAPH_NODE_TYPE_HOST => GraphNodeKind::Host,
            T::CU_GRAPH_NODE_TYPE_GRAPH => GraphNodeKind::ChildGraph,
            T::CU_GRAPH_NODE_TYPE_EMPTY => GraphNodeKind::Empty,
            T::CU_GRAPH_NODE_TYPE_WAIT_EVENT => GraphNodeKind::WaitEvent,
            T::CU_GRAPH_NODE_TYPE_EVENT_RECORD => GraphNodeKind::EventRecord,
            T::CU_GRAPH_NODE_TYPE_MEM_ALLOC => GraphNodeKind::MemAlloc,
            T::CU_GRAPH_NODE_TYPE_MEM_FREE => GraphNodeKind::MemFree,
            T::CU_GRAPH_NODE_TYPE_CONDITIONAL => GraphNodeKind::Conditional,
            other => GraphNodeKind::Other(other.0),
        }
    }
}

/// One node of a graph. It carries the identity of its graph (ids are never
/// reused), so a node of another graph, or of one that was destroyed, is refused
/// where a node is taken, never handed to the driver.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphNode {
    pub(super) raw: CUgraphNode,
    pub(super) kind: GraphNodeKind,
    pub(super) graph: u64,
}

// SAFETY: an opaque handle, copied and passed to the thread-safe driver.
unsafe impl Send for GraphNode {}
// SAFETY: as for Send.
unsafe impl Sync for GraphNode {}

impl fmt::Debug for GraphNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} node {:p}", self.kind, self.raw)
    }
}

impl GraphNode {
    /// What the node does.
    pub fn kind(&self) -> GraphNodeKind {
        self.kind
    }

    /// The raw `CUgraphNode`.
    pub fn raw(&self) -> CUgraphNode {
        self.raw
    }
}

/// A fresh graph identity.
pub(super) fn next_graph_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The raw handles of `deps`, each checked to belong to graph `graph`.
pub(super) fn raw_deps(deps: &[GraphNode], graph: u64, device: usize) -> Result<Vec<CUgraphNode>> {
    deps.iter()
        .map(|n| {
            if n.graph == graph {
                Ok(n.raw)
            } else {
                Err(invalid_arg(format!(
                    "device {device}: {n:?} is a node of another graph (or of one that was \
                     dropped), not of the graph it is added to"
                )))
            }
        })
        .collect()
}

/// A kernel node of a graph, with the kernel and the shape it launches.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct KernelNode {
    /// The node.
    pub node: GraphNode,
    /// `module::kernel` when a metrale registry looked the kernel up, else the
    /// driver's name for it.
    pub name: String,
    /// The launch shape.
    pub config: LaunchConfig,
    pub(super) func: CUfunctionHandle,
}

/// A `CUfunction` as plain data.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct CUfunctionHandle(pub(super) CUfunction);
// SAFETY: an opaque handle, only compared.
unsafe impl Send for CUfunctionHandle {}
// SAFETY: as for Send.
unsafe impl Sync for CUfunctionHandle {}
impl fmt::Debug for CUfunctionHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:p}", self.0)
    }
}

/// A device-side condition of a conditional node: pass it to the kernel that sets
/// it (`cudaGraphSetConditional(handle, value)`); it is a `cudaGraphConditionalHandle`
/// (8 bytes) in kernel code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct ConditionalHandle(pub u64);

// SAFETY: a transparent u64: no padding, every bit pattern valid.
unsafe impl DeviceRepr for ConditionalHandle {}
// SAFETY: as above.
unsafe impl DevicePod for ConditionalHandle {}

/// Kernel nodes take no launch attributes (clusters, cooperative, PDL) yet.
pub(super) fn refuse_attributes(cfg: &LaunchConfig, kernel: &str) -> Result<()> {
    match cfg.attributes {
        a if a == crate::launch::LaunchAttributes::default() => Ok(()),
        a => Err(invalid_arg(format!(
            "kernel '{kernel}': a graph kernel node cannot carry launch attributes ({}); \
             capture a launch with them instead",
            a.to_string().trim()
        ))),
    }
}

pub(super) fn node_params(
    func: CUfunction,
    cfg: &LaunchConfig,
    params: *mut *mut c_void,
) -> sys::CUDA_KERNEL_NODE_PARAMS {
    let (g, b) = (cfg.grid_dim, cfg.block_dim);
    sys::CUDA_KERNEL_NODE_PARAMS {
        func,
        gridDimX: g.0,
        gridDimY: g.1,
        gridDimZ: g.2,
        blockDimX: b.0,
        blockDimY: b.1,
        blockDimZ: b.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        kernelParams: params,
        ..sys::CUDA_KERNEL_NODE_PARAMS::default()
    }
}

/// The driver's name for a kernel handle no registry knows (`cuFuncGetName`).
pub(super) fn driver_function_name(d: &'static sys::Driver, func: CUfunction) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: writes a pointer to the driver's own name for a live function.
    match unsafe { cu!(d, cuFuncGetName(&mut name, func)) } {
        Ok(()) if !name.is_null() => {
            // SAFETY: non-null and NUL-terminated, owned by the driver; copied at once.
            unsafe { std::ffi::CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        }
        _ => format!("{func:p}"),
    }
}
