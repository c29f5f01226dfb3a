//! CUDA graphs: capture work from streams into a [`CudaGraph`] (or build one node by
//! node), instantiate it as a [`CudaGraphExec`], replay it for a fraction of the
//! launch cost, update it in place (whole graph, or one kernel node's shape and
//! typed arguments), and look at it (nodes, edges, Graphviz DOT).
//!
//! `capture.rs` owns stream capture, `mod.rs` [`CudaGraph`] (building, inspecting,
//! instantiating), `exec.rs` [`CudaGraphExec`] (replay and updates).
//!
//! Invariants:
//! - A graph and an executable graph hold their context and the code of every
//!   kernel they run (found when capture ends, or added with a node), so the
//!   order in which graphs, executable graphs, streams and registries are dropped
//!   never matters.
//! - The body of a conditional node belongs to its node: it is reached only inside
//!   [`CudaGraph::add_while`]'s closure, never as an owned graph.
//! - Kernel node updates are checked like launches (device, shape, typed argument
//!   sizes against the kernel's layout) before the driver is called.
//! - Capture mode defaults to [`CaptureMode::ThreadLocal`]: it keeps the capturing
//!   thread from calling APIs that are unsafe during capture, without making other
//!   threads' allocations and frees fail the way the global mode does.

use std::ffi::{c_void, CString};
use std::fmt;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use metrale_cuda_sys::{self as sys, CUfunction, CUgraph, CUgraphExec, CUgraphNode};

mod arena;
mod capture;
mod exec;

pub use arena::{CaptureArena, GraphBuckets};
pub use capture::CaptureMode;
pub use exec::{CudaGraphExec, InstantiateOptions};

use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, CallError, Result};
use crate::function::{name_of, owner_of, CudaFunction, KernelTable};
use crate::launch::{prepare, KernelArgs, LaunchConfig};
use crate::memory::{DevicePod, DeviceRepr};
use crate::stream::{take_captured_host_fn, HostKeep};

/// The code the kernels of a graph need, shared by graphs built from one another.
type KeepAlive = Arc<Mutex<Vec<Arc<KernelTable>>>>;

fn keep(list: &KeepAlive, table: &Arc<KernelTable>) {
    let mut list = list.lock().unwrap_or_else(PoisonError::into_inner);
    if !list.iter().any(|t| Arc::ptr_eq(t, table)) {
        list.push(Arc::clone(table));
    }
}

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
    fn from_raw(t: sys::CUgraphNodeType) -> GraphNodeKind {
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
    raw: CUgraphNode,
    kind: GraphNodeKind,
    graph: u64,
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
fn next_graph_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The raw handles of `deps`, each checked to belong to graph `graph`.
fn raw_deps(deps: &[GraphNode], graph: u64, device: usize) -> Result<Vec<CUgraphNode>> {
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

/// A CUDA graph: work recorded by stream capture, or built node by node.
///
/// ```no_run
/// # use metrale_runtime::*;
/// # fn main() -> Result<()> {
/// # let reg = MetraleRegistry::load(0, &[("kernels", b"...")])?;
/// # let step = reg.function("kernels", "step")?;
/// # let x = DeviceBuffer::<f32>::alloc(reg.stream(), 1)?;
/// let s = reg.stream();
/// let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
/// let graph = s.capture(|s| -> metrale_runtime::Result<()> {
///     for _ in 0..100 {
///         // SAFETY: step(float*, float, float) updates x[0].
///         unsafe { s.launch(&step, cfg, (&x, 2.0f32, 1.0f32))? };
///     }
///     Ok(())
/// })?;
/// graph.write_dot("step.dot")?;
/// let exec = graph.instantiate()?;
/// // SAFETY: x, the only memory the graph touches, is alive.
/// unsafe { exec.launch(s)? };
/// # Ok(()) }
/// ```
#[must_use = "dropping it destroys it"]
pub struct CudaGraph {
    raw: CUgraph,
    pub(super) ctx: Arc<CudaContext>,
    made: Generation,
    /// This graph's identity, carried by its nodes.
    pub(super) id: u64,
    /// Alive while the graph is: executable graphs made from it check it before
    /// taking one of its nodes.
    pub(super) alive: Arc<()>,
    pub(super) keep: KeepAlive,
    /// What its replays must keep alive: the repeatable host functions its
    /// host nodes run (captured through `launch_host_fn_repeat`), and holds
    /// such as a capture arena's memory (see [`CudaGraph::hold`]). Executables
    /// take them, and a host function queued after each replay holds them
    /// until the replay has run.
    pub(super) host_fns: Vec<HostKeep>,
}

/// A value a graph holds (see [`CudaGraph::hold`]), whose drop inside a host
/// function is handed to the drop-later list.
struct HeldOutsideHostFns(Option<Arc<dyn Send + Sync>>);

impl Drop for HeldOutsideHostFns {
    fn drop(&mut self) {
        if let Some(value) = self.0.take() {
            if crate::context::in_host_function() {
                crate::context::drop_later(Box::new(value));
            }
        }
    }
}

// SAFETY: the handle is written once and the graph is used by one thread at a time:
// the driver documents graph objects as not thread-safe (even calls that read), so
// `CudaGraph` is `Send` but not `Sync`: a shared graph needs the caller's lock.
unsafe impl Send for CudaGraph {}

impl fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaGraph")
            .field("device", &self.ctx.ordinal())
            .field("raw", &self.raw)
            .finish()
    }
}

impl CudaGraph {
    /// An empty graph on `ctx`'s device, to build node by node.
    ///
    /// # Errors
    /// `cuGraphCreate`'s status.
    pub fn new(ctx: &impl AsContext) -> Result<CudaGraph> {
        let ctx = ctx.context();
        let mut raw: CUgraph = std::ptr::null_mut();
        ctx.call(
            || format!("device {}: creating a graph", ctx.ordinal()),
            // SAFETY: writes one graph handle; flags must be 0.
            |d| unsafe { cu!(d, cuGraphCreate(&mut raw, 0)) },
        )?;
        Ok(CudaGraph::adopt(raw, ctx))
    }

    pub(super) fn adopt(raw: CUgraph, ctx: &Arc<CudaContext>) -> CudaGraph {
        CudaGraph {
            raw,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            id: next_graph_id(),
            alive: Arc::new(()),
            keep: Arc::default(),
            host_fns: Vec::new(),
        }
    }

    fn call<R>(
        &self,
        what: &str,
        f: impl FnOnce(&'static sys::Driver) -> Result<R, CallError>,
    ) -> Result<R> {
        self.ctx.call(
            || format!("device {} graph {:p}: {what}", self.ctx.ordinal(), self.raw),
            f,
        )
    }

    /// Hold the code of every kernel the graph launches (found through the
    /// registries that looked the kernels up).
    /// Also hold the host functions its host nodes run.
    pub(super) fn keep_kernel_code(&mut self) -> Result<()> {
        for node in self.nodes()? {
            if node.kind == GraphNodeKind::Kernel {
                let (func, _) = self.kernel_params(node.raw)?;
                if let Some(table) = owner_of(func) {
                    keep(&self.keep, &table);
                }
            } else if node.kind == GraphNodeKind::Host {
                let mut p = sys::CUDA_HOST_NODE_PARAMS {
                    fn_: None,
                    userData: std::ptr::null_mut(),
                };
                let n = node.raw;
                self.call("host node", |d| {
                    // SAFETY: a host node of this graph; writes its parameters.
                    unsafe { cu!(d, cuGraphHostNodeGetParams(n, &mut p)) }
                })?;
                if let Some(f) = take_captured_host_fn(p.userData) {
                    if !self.host_fns.iter().any(|k| Arc::ptr_eq(k, &f)) {
                        self.host_fns.push(f);
                    }
                }
            }
        }
        Ok(())
    }

    /// Keep `value` alive as long as this graph, every executable made from it
    /// and every replay in flight (it rides with the graph's host functions).
    /// The last hold may go inside the host function after a replay: `value`
    /// is then dropped later, outside any host function (its Drop may call the
    /// driver).
    pub(crate) fn hold(&mut self, value: Arc<dyn Send + Sync>) {
        let held = HeldOutsideHostFns(Some(value));
        let keep: crate::stream::HostFn = Arc::new(move || {
            let _ = &held;
        });
        self.host_fns.push(Arc::new(keep));
    }

    /// The raw `CUgraph`, for driver calls of your own.
    pub fn raw(&self) -> CUgraph {
        self.raw
    }

    /// The graph's nodes, in the driver's order.
    ///
    /// # Errors
    /// `cuGraphGetNodes` / `cuGraphNodeGetType`'s status.
    pub fn nodes(&self) -> Result<Vec<GraphNode>> {
        let g = self.raw;
        self.call("nodes", |d| {
            let mut n = 0usize;
            // SAFETY: with a null array the driver writes only the count.
            unsafe { cu!(d, cuGraphGetNodes(g, std::ptr::null_mut(), &mut n)) }?;
            if n == 0 {
                // An empty graph: the driver refuses a second call with an array.
                return Ok(Vec::new());
            }
            let mut raw: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
            // SAFETY: the array has room for `n` nodes.
            unsafe { cu!(d, cuGraphGetNodes(g, raw.as_mut_ptr(), &mut n)) }?;
            raw.truncate(n);
            raw.into_iter()
                .map(|node| {
                    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                    // SAFETY: a node of this graph; writes its type.
                    unsafe { cu!(d, cuGraphNodeGetType(node, &mut t)) }?;
                    Ok(GraphNode {
                        raw: node,
                        kind: GraphNodeKind::from_raw(t),
                        graph: self.id,
                    })
                })
                .collect()
        })
    }

    /// The graph's edges, as `(from, to)` indices into [`CudaGraph::nodes`].
    ///
    /// # Errors
    /// `cuGraphGetEdges_v2`'s status.
    pub fn edges(&self) -> Result<Vec<(usize, usize)>> {
        let nodes = self.nodes()?;
        let g = self.raw;
        let (from, to) = self.call("edges", |d| {
            let mut n = 0usize;
            let null: CUgraphNode = std::ptr::null_mut();
            let no_data: *mut sys::CUgraphEdgeData = std::ptr::null_mut();
            // SAFETY: with null arrays the driver writes only the count.
            unsafe {
                cu!(
                    d,
                    cuGraphGetEdges_v2(
                        g,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        no_data,
                        &mut n
                    )
                )
            }?;
            if n == 0 {
                return Ok((Vec::new(), Vec::new()));
            }
            let mut from: Vec<CUgraphNode> = vec![null; n];
            let mut to: Vec<CUgraphNode> = vec![null; n];
            // SAFETY: both arrays have room for `n` edges; no edge data is asked for.
            unsafe {
                cu!(
                    d,
                    cuGraphGetEdges_v2(g, from.as_mut_ptr(), to.as_mut_ptr(), no_data, &mut n)
                )
            }?;
            from.truncate(n);
            to.truncate(n);
            Ok((from, to))
        })?;
        let index = |raw: CUgraphNode| nodes.iter().position(|n| n.raw == raw);
        Ok(from
            .into_iter()
            .zip(to)
            .filter_map(|(a, b)| Some((index(a)?, index(b)?)))
            .collect())
    }

    fn kernel_params(&self, node: CUgraphNode) -> Result<(CUfunction, LaunchConfig)> {
        let mut p = sys::CUDA_KERNEL_NODE_PARAMS::default();
        self.call("kernel node", |d| {
            // SAFETY: a kernel node of this graph; writes its parameters.
            unsafe { cu!(d, cuGraphKernelNodeGetParams_v2(node, &mut p)) }
        })?;
        let config = LaunchConfig {
            grid_dim: (p.gridDimX, p.gridDimY, p.gridDimZ),
            block_dim: (p.blockDimX, p.blockDimY, p.blockDimZ),
            shared_mem_bytes: p.sharedMemBytes,
            attributes: crate::launch::LaunchAttributes::default(),
        };
        Ok((p.func, config))
    }

    /// The kernel nodes, with the kernel each runs and its shape.
    ///
    /// # Errors
    /// The failing node query.
    pub fn kernel_nodes(&self) -> Result<Vec<KernelNode>> {
        let mut out = Vec::new();
        for node in self.nodes()? {
            if node.kind != GraphNodeKind::Kernel {
                continue;
            }
            let (func, config) = self.kernel_params(node.raw)?;
            let name = match name_of(func) {
                Some(n) => n.to_string(),
                None => driver_function_name(self.ctx.driver(), func),
            };
            out.push(KernelNode {
                node,
                name,
                config,
                func: CUfunctionHandle(func),
            });
        }
        Ok(out)
    }

    /// Write the graph as Graphviz DOT (`cuGraphDebugDotPrint`), with kernel
    /// names and launch shapes; `dot -Tpng graph.dot -o graph.png` draws it.
    ///
    /// # Errors
    /// `InvalidArgument` for a path with a NUL byte or that is not UTF-8; the
    /// driver's status (a folder that does not exist: `CUDA_ERROR_OPERATING_SYSTEM`).
    pub fn write_dot(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = path
            .to_str()
            .ok_or_else(|| invalid_arg(format!("DOT path {} is not UTF-8", path.display())))?;
        let c = CString::new(text)
            .map_err(|_| invalid_arg(format!("DOT path {text:?} has a NUL byte")))?;
        let flags = sys::CUgraphDebugDot_flags::CU_GRAPH_DEBUG_DOT_FLAGS_KERNEL_NODE_PARAMS.0;
        let g = self.raw;
        self.call(&format!("writing DOT to {text}"), |d| {
            // SAFETY: a live graph and a NUL-terminated path alive for the call.
            unsafe { cu!(d, cuGraphDebugDotPrint(g, c.as_ptr(), flags)) }
        })
    }

    /// Add a kernel node that runs after `deps`: `f` with typed arguments (a tuple
    /// or a `&`[`KernelArgList`](crate::KernelArgList)), checked like a launch. The argument values are copied into the node.
    ///
    /// # Safety
    /// As [`CudaStream::launch`](crate::CudaStream::launch), for every replay of the graph.
    ///
    /// # Errors
    /// As [`CudaStream::launch`](crate::CudaStream::launch); `cuGraphAddKernelNode_v2`'s status.
    pub unsafe fn add_kernel_node<A: KernelArgs>(
        &mut self,
        deps: &[GraphNode],
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: A,
    ) -> Result<GraphNode> {
        // SAFETY: the caller's contract.
        let node = unsafe { add_kernel((self.raw, self.id), &self.ctx, deps, f, &cfg, &args) }?;
        keep(&self.keep, f.table());
        Ok(node)
    }

    /// Add a conditional `while` node after `deps` (CUDA 12.4+): its body runs
    /// while the condition is non-zero, starting from `initial`. `body` builds the
    /// body graph; a kernel in it sets the condition with
    /// `cudaGraphSetConditional(handle, value)`, given the [`ConditionalHandle`]
    /// as an argument.
    ///
    /// # Errors
    /// A missing symbol on a driver before 12.4; the driver's status; `body`'s
    /// error.
    pub fn add_while(
        &mut self,
        deps: &[GraphNode],
        initial: bool,
        body: impl FnOnce(&mut GraphBody<'_>, ConditionalHandle) -> Result<()>,
    ) -> Result<GraphNode> {
        let (g, ctx) = (self.raw, self.ctx.raw());
        raw_deps(deps, self.id, self.ctx.ordinal())?;
        let mut handle: sys::CUgraphConditionalHandle = 0;
        let flags = sys::CU_GRAPH_COND_ASSIGN_DEFAULT;
        self.call("conditional handle", |d| {
            // SAFETY: writes one handle for a live graph and the retained context.
            unsafe {
                cu!(
                    d,
                    cuGraphConditionalHandleCreate(&mut handle, g, ctx, u32::from(initial), flags)
                )
            }
        })?;
        let mut params = sys::CUgraphNodeParams {
            type_: sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_CONDITIONAL,
            ..sys::CUgraphNodeParams::default()
        };
        params.__bindgen_anon_1.conditional = sys::CUDA_CONDITIONAL_NODE_PARAMS {
            handle,
            type_: sys::CUgraphConditionalNodeType::CU_GRAPH_COND_TYPE_WHILE,
            size: 1,
            phGraph_out: std::ptr::null_mut(),
            ctx,
        };
        let raw_deps = raw_deps(deps, self.id, self.ctx.ordinal())?;
        let mut node: CUgraphNode = std::ptr::null_mut();
        self.call("adding a while node", |d| {
            // SAFETY: `params` is a complete conditional node description; the
            // dependency array has `raw_deps.len()` nodes of this graph.
            unsafe {
                cu!(
                    d,
                    cuGraphAddNode_v2(
                        &mut node,
                        g,
                        raw_deps.as_ptr(),
                        std::ptr::null(),
                        raw_deps.len(),
                        &mut params
                    )
                )
            }
        })?;
        // SAFETY: the union member written by the driver for a conditional node; the
        // driver filled `phGraph_out` with its own array of `size` (1) body graphs.
        let body_graph = unsafe {
            let out = params.__bindgen_anon_1.conditional.phGraph_out;
            if out.is_null() {
                std::ptr::null_mut()
            } else {
                *out
            }
        };
        if body_graph.is_null() {
            return Err(invalid_arg(format!(
                "device {}: the driver returned no body graph for a while node",
                self.ctx.ordinal()
            )));
        }
        let mut b = GraphBody {
            raw: body_graph,
            id: next_graph_id(),
            ctx: &self.ctx,
            keep: &self.keep,
            _parent: PhantomData,
        };
        body(&mut b, ConditionalHandle(handle))?;
        Ok(GraphNode {
            raw: node,
            kind: GraphNodeKind::Conditional,
            graph: self.id,
        })
    }

    /// Instantiate the graph as an executable graph with the default options.
    ///
    /// # Errors
    /// As [`CudaGraph::instantiate_with`].
    pub fn instantiate(&self) -> Result<CudaGraphExec> {
        self.instantiate_with(InstantiateOptions::default())
    }

    /// Instantiate the graph as an executable graph (`cuGraphInstantiateWithFlags`).
    ///
    /// # Errors
    /// The driver's status (`CUDA_ERROR_INVALID_VALUE` for flags the device or
    /// driver does not support).
    pub fn instantiate_with(&self, options: InstantiateOptions) -> Result<CudaGraphExec> {
        use sys::CUgraphInstantiate_flags as F;
        let mut flags = 0u64;
        if options.auto_free_on_launch {
            flags |= u64::from(F::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0);
        }
        if options.device_launch {
            flags |= u64::from(F::CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH.0);
        }
        if options.use_node_priority {
            flags |= u64::from(F::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.0);
        }
        let (g, mut raw): (CUgraph, CUgraphExec) = (self.raw, std::ptr::null_mut());
        self.call("instantiate", |d| {
            // SAFETY: writes one executable graph handle for a live graph.
            unsafe { cu!(d, cuGraphInstantiateWithFlags(&mut raw, g, flags)) }
        })?;
        let keep = self
            .keep
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Ok(CudaGraphExec {
            raw,
            made: self.ctx.generation(),
            ctx: Arc::clone(&self.ctx),
            source: self.id,
            source_alive: Arc::downgrade(&self.alive),
            keep,
            host_fns: Arc::new(self.host_fns.clone()),
        })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        let raw = self.raw;
        self.ctx.release_with(
            self.made,
            format_args!("destroying graph {raw:p} on device {}", self.ctx.ordinal()),
            |d, failures| {
                // SAFETY: the graph is this value's own, destroyed once.
                if let Err(e) = unsafe { cu!(d, cuGraphDestroy(raw)) } {
                    failures.push(e);
                }
            },
        );
    }
}

/// Add a kernel node to `graph` (checked like a launch).
///
/// # Safety
/// As [`CudaStream::launch`](crate::CudaStream::launch), for every replay.
unsafe fn add_kernel<A: KernelArgs>(
    (graph, graph_id): (CUgraph, u64),
    ctx: &Arc<CudaContext>,
    deps: &[GraphNode],
    f: &CudaFunction,
    cfg: &LaunchConfig,
    args: &A,
) -> Result<GraphNode> {
    ctx.check_same(
        f.context(),
        || format!("kernel '{}'", f.name()),
        "the graph",
    )?;
    ctx.bind()?;
    refuse_attributes(cfg, f.name())?;
    prepare(ctx, f.info(), cfg, Some(args.layout()))?;
    let raw_deps = raw_deps(deps, graph_id, ctx.ordinal())?;
    let mut node: CUgraphNode = std::ptr::null_mut();
    args.with_params(|p| {
        let params = node_params(f.as_raw(), cfg, p.as_mut_ptr());
        ctx.call(
            || format!("kernel '{}': adding a graph node", f.name()),
            // SAFETY: the driver copies the argument values, which `p` points to for
            // this call; dependencies are nodes of this graph.
            |d| unsafe {
                cu!(
                    d,
                    cuGraphAddKernelNode_v2(
                        &mut node,
                        graph,
                        raw_deps.as_ptr(),
                        raw_deps.len(),
                        &params
                    )
                )
            },
        )
    })?;
    Ok(GraphNode {
        raw: node,
        kind: GraphNodeKind::Kernel,
        graph: graph_id,
    })
}

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

/// The body of a conditional node, reached only while it is being built.
pub struct GraphBody<'a> {
    raw: CUgraph,
    id: u64,
    ctx: &'a Arc<CudaContext>,
    keep: &'a KeepAlive,
    _parent: PhantomData<&'a mut CudaGraph>,
}

impl GraphBody<'_> {
    /// As [`CudaGraph::add_kernel_node`], in the body.
    ///
    /// # Safety
    /// As [`CudaGraph::add_kernel_node`].
    ///
    /// # Errors
    /// As [`CudaGraph::add_kernel_node`].
    pub unsafe fn add_kernel_node<A: KernelArgs>(
        &mut self,
        deps: &[GraphNode],
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: A,
    ) -> Result<GraphNode> {
        // SAFETY: the caller's contract.
        let node = unsafe { add_kernel((self.raw, self.id), self.ctx, deps, f, &cfg, &args) }?;
        keep(self.keep, f.table());
        Ok(node)
    }
}

impl fmt::Debug for GraphBody<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphBody").field("raw", &self.raw).finish()
    }
}
