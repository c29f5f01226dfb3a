//! CUDA graphs: capture work from streams into a [`CudaGraph`] (or build one node by
//! node), instantiate it as a [`CudaGraphExec`], replay it for a fraction of the
//! launch cost, update it in place (whole graph, or one kernel node's shape and
//! typed arguments), and look at it (nodes, edges, Graphviz DOT).
//!
//! `mod.rs` owns [`CudaGraph`] itself (making, holding what it runs, destroying),
//! `node.rs` its parts, `build.rs` building node by node, `inspect.rs` looking at
//! it, `capture.rs` stream capture, `exec.rs` instantiating and [`CudaGraphExec`]
//! (replay and updates). Files only name the ones listed before them (capture and
//! exec name mod.rs and node.rs; mod.rs names only node.rs).
//!
//! Invariants:
//! - A graph and an executable graph hold their context and the code of every
//!   kernel they run (found when capture ends, or added with a node), so the
//!   order in which graphs, executable graphs, streams and registries are dropped
//!   never matters. Replays in flight hold that code too: the graph holds each
//!   kernel table through a user object before it is instantiated or updated
//!   into an executable (the driver keeps it for each launch in flight), or, on
//!   a driver without user objects, the executable's host function after each
//!   replay does.
//! - The body of a conditional node belongs to its node: it is reached only inside
//!   [`CudaGraph::add_while`]'s closure, never as an owned graph.
//! - Kernel node updates are checked like launches (device, shape, typed argument
//!   sizes against the kernel's layout) before the driver is called.
//! - Capture mode defaults to [`CaptureMode::ThreadLocal`]: it keeps the capturing
//!   thread from calling APIs that are unsafe during capture, without making other
//!   threads' allocations and frees fail the way the global mode does.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use metrale_cuda_sys::{self as sys, CUgraph};

mod arena;
mod build;
mod capture;
mod exec;
mod inspect;
mod node;

pub use arena::{CaptureArena, GraphBuckets};
pub use build::GraphBody;
pub use capture::CaptureMode;
pub use exec::{CudaGraphExec, InstantiateOptions};
pub use node::{ConditionalHandle, GraphNode, GraphNodeKind, KernelNode};

use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, CallError, Result};
use crate::function::{owner_of, KernelTable};
use crate::stream::{take_captured_host_fn, HostKeep};
use node::next_graph_id;

/// The code the kernels of a graph need, shared by graphs built from one another.
type KeepAlive = Arc<Mutex<Vec<Arc<KernelTable>>>>;

fn keep(list: &KeepAlive, table: &Arc<KernelTable>) {
    let mut list = list.lock().unwrap_or_else(PoisonError::into_inner);
    if !list.iter().any(|t| Arc::ptr_eq(t, table)) {
        list.push(Arc::clone(table));
    }
}

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
    /// What its replays must keep alive (the repeatable host functions its
    /// host nodes run, captured through `launch_host_fn_repeat`, and holds
    /// such as a capture arena's memory, see [`CudaGraph::hold`]) that the
    /// driver does not hold for it (no user objects): executables take them,
    /// and a host function queued after each replay holds them until the
    /// replay has run.
    pub(super) host_fns: Vec<HostKeep>,
    /// The addresses of what it holds through user objects instead (for
    /// identity only): the driver keeps those for the graph, its executables
    /// and their launches in flight, so a replay queues nothing more.
    pub(super) held_by_driver: Vec<usize>,
    /// Whether its capture retained a value into it through a user object
    /// (a GEMM's workspace, `lifetime::note_held_in_capture`): held by the
    /// driver as `held_by_driver`'s are, known by the capture's id only.
    pub(super) held_in_capture: bool,
    /// The kernel tables (by address) the driver holds for the graph through
    /// user objects ([`CudaGraph::hold_code`]): for its executables and their
    /// launches in flight, so a replay keeps its code loaded.
    code_held: Mutex<CodeHeld>,
}

/// The code a graph holds for its replays ([`CudaGraph::hold_code`]).
#[derive(Default)]
struct CodeHeld {
    /// Kernel tables (by address) the driver holds through user objects.
    by_driver: Vec<usize>,
    /// The keeper of the rest, and the tables (by address) it holds: made
    /// once per set, so executables instantiated or updated again and again
    /// share one instead of adding a keeper each time.
    fallback: Option<(Vec<usize>, HostKeep)>,
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
            held_by_driver: Vec::new(),
            held_in_capture: false,
            code_held: Mutex::default(),
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
                    self.hold(&f);
                }
            }
        }
        Ok(())
    }

    /// Keep `keep` (and what it owns) alive as long as this graph, every
    /// executable made from it and every replay in flight.
    ///
    /// With user objects (CUDA 11.3+) the graph holds it through one
    /// ([`CudaContext::hold_in_graph`]): the driver clones the reference into
    /// every executable instantiated or updated from the graph and holds it
    /// for their launches in flight, so a replay is one `cuGraphLaunch`.
    /// Without them (or when the driver refuses one) it rides with the graph's
    /// host functions, held by a host function queued after each replay. The
    /// last hold may go on a driver thread or inside a host function: the
    /// value is then dropped later, outside both (its Drop may call the
    /// driver).
    ///
    /// `keep` comes from [`CudaGraph::holder`] (or is a captured host
    /// function); one keeper held twice by a graph counts once.
    pub(crate) fn hold(&mut self, keep: &HostKeep) {
        let at = Arc::as_ptr(keep) as usize;
        if self.held_by_driver.contains(&at) || self.host_fns.iter().any(|k| Arc::ptr_eq(k, keep)) {
            return;
        }
        // A refusal is not an error of the caller's: the host-function
        // keeper holds it as soundly, at the cost of a host node per replay.
        match self
            .ctx
            .hold_in_graph(self.raw, Arc::clone(keep), "what its replays use")
        {
            Ok(true) => self.held_by_driver.push(at),
            Ok(false) | Err(_) => self.host_fns.push(Arc::clone(keep)),
        }
    }

    /// Make the code of every kernel the graph runs held for its replays
    /// (called before it is instantiated or updated into an executable): each
    /// kernel table not yet held goes into the graph through a user object
    /// ([`CudaContext::hold_in_graph`]), which the driver clones into the
    /// executable and holds for each launch in flight, so the modules are not
    /// unloaded under a replay queued behind other work after the executable
    /// and the registry are gone. `Some`: a keeper of the code the driver
    /// does not hold (no user objects, or a refusal), for the executable's
    /// host functions (a host function after each replay holds it).
    pub(super) fn hold_code(&self) -> Option<HostKeep> {
        let tables = self
            .keep
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut held = self
            .code_held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut rest: Vec<Arc<KernelTable>> = Vec::new();
        for table in tables {
            let at = Arc::as_ptr(&table) as usize;
            if held.by_driver.contains(&at) {
                continue;
            }
            match self
                .ctx
                .hold_in_graph(self.raw, Arc::clone(&table), "the code of its kernels")
            {
                Ok(true) => held.by_driver.push(at),
                Ok(false) | Err(_) => rest.push(table),
            }
        }
        if rest.is_empty() {
            return None;
        }
        let at: Vec<usize> = rest.iter().map(|t| Arc::as_ptr(t) as usize).collect();
        if let Some((covered, keeper)) = &held.fallback {
            if *covered == at {
                return Some(Arc::clone(keeper));
            }
        }
        let keeper = CudaGraph::holder(Arc::new(rest));
        held.fallback = Some((at, Arc::clone(&keeper)));
        Some(keeper)
    }

    /// Whether the graph holds anything for its replays (its executables'
    /// replays are then refused inside a capture).
    pub(super) fn holds_any(&self) -> bool {
        !self.host_fns.is_empty() || !self.held_by_driver.is_empty() || self.held_in_capture
    }

    /// The addresses of every keeper the graph holds, however held.
    pub(super) fn held_addresses(&self) -> Vec<usize> {
        self.host_fns
            .iter()
            .map(|k| Arc::as_ptr(k) as usize)
            .chain(self.held_by_driver.iter().copied())
            .collect()
    }

    /// The keeper of `value` that graphs hold ([`CudaGraph::hold`]): made once
    /// per value, so its holds can be counted and are never duplicated.
    pub(crate) fn holder(value: Arc<dyn Send + Sync>) -> HostKeep {
        let held = crate::lifetime::HeldOutsideHostFns::new(value);
        let keep: crate::stream::HostFn = Arc::new(move || {
            let _ = &held;
        });
        Arc::new(keep)
    }

    /// The raw `CUgraph`, for driver calls of your own.
    pub fn raw(&self) -> CUgraph {
        self.raw
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
        let code_held = !self
            .code_held
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .by_driver
            .is_empty();
        if !self.held_by_driver.is_empty() || self.held_in_capture || code_held {
            // A destructor the destroy ran handed its value to the drop-later
            // list: drop it now rather than at the next synchronisation.
            crate::lifetime::drain();
        }
    }
}
