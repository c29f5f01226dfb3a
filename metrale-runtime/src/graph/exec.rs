//! [`CudaGraphExec`]: an instantiated graph, replayed on streams and updated in
//! place (whole graph, or one kernel node's shape and typed arguments).

use std::fmt;
use std::sync::{Arc, PoisonError};

use metrale_cuda_sys::{self as sys, CUgraph, CUgraphExec, CUgraphNode};

use super::node::{driver_function_name, node_params, GraphNodeKind, KernelNode};
use super::CudaGraph;
use crate::context::{CudaContext, Generation};
use crate::error::{cu, invalid_arg, CallError, ErrorKind, Result};
use crate::function::{name_of, CudaFunction, KernelTable};
use crate::launch::{prepare, KernelArgs, LaunchConfig};
use crate::stream::{CudaStream, HostKeep};

/// How [`CudaGraph::instantiate`] prepares the executable graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct InstantiateOptions {
    /// Free stream-ordered allocations the graph made but did not free, before each
    /// launch (`CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`).
    pub auto_free_on_launch: bool,
    /// Make the graph launchable from the device
    /// (`CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH`).
    pub device_launch: bool,
    /// Run kernels with the priorities set on their nodes instead of the stream's
    /// (`CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY`).
    pub use_node_priority: bool,
}

impl CudaGraph {
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
        // Before the executable is made, so the driver clones the code's
        // holds into it.
        let code_keeper = self.hold_code();
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
            holds: self.holds_any() || code_keeper.is_some(),
            host_fns: Arc::new(self.host_fns.iter().cloned().chain(code_keeper).collect()),
        })
    }
}

impl InstantiateOptions {
    /// These options with auto-free on launch on or off.
    #[must_use]
    pub fn with_auto_free_on_launch(mut self, on: bool) -> InstantiateOptions {
        self.auto_free_on_launch = on;
        self
    }

    /// These options with device launch on or off.
    #[must_use]
    pub fn with_device_launch(mut self, on: bool) -> InstantiateOptions {
        self.device_launch = on;
        self
    }

    /// These options with node priorities used or not.
    #[must_use]
    pub fn with_node_priority(mut self, on: bool) -> InstantiateOptions {
        self.use_node_priority = on;
        self
    }
}

/// An executable graph: replayed with [`CudaGraphExec::launch`] for a fraction of
/// the cost of launching its kernels one by one, updated in place.
#[must_use = "dropping it destroys it"]
pub struct CudaGraphExec {
    pub(super) raw: CUgraphExec,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) made: Generation,
    /// The identity of the graph this was instantiated from: node updates take
    /// only its nodes.
    pub(super) source: u64,
    /// Whether that graph (which owns the nodes) still exists.
    pub(super) source_alive: std::sync::Weak<()>,
    /// The code of its kernels, held for the executable itself (the replays
    /// in flight hold it through the graph's user objects or `host_fns`).
    pub(super) keep: Vec<Arc<KernelTable>>,
    /// What its replays use that the driver does not hold for it (host
    /// functions and holds of graphs on a driver without user objects): a
    /// host function queued after each replay holds them too.
    pub(super) host_fns: Arc<Vec<HostKeep>>,
    /// Whether it holds anything for its replays, through user objects (the
    /// driver's references, cloned from its graphs) or `host_fns`: its
    /// replays are refused inside a capture. The code of its kernels held
    /// through user objects does not count (replays of kernel graphs inside a
    /// capture stay allowed, as before); held through `host_fns` it does.
    pub(super) holds: bool,
}

// SAFETY: the handle is written once and used by one thread at a time. The driver
// documents graph objects, executable ones included, as not thread-safe, so
// `CudaGraphExec` is `Send` but not `Sync`: replaying one executable graph from
// several threads needs the caller's lock (replays of one executable graph are
// serialised on the device anyway).
unsafe impl Send for CudaGraphExec {}

impl fmt::Debug for CudaGraphExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaGraphExec")
            .field("device", &self.ctx.ordinal())
            .field("raw", &self.raw)
            .finish()
    }
}

impl CudaGraphExec {
    fn call(
        &self,
        what: &str,
        f: impl FnOnce(&'static sys::Driver) -> Result<(), CallError>,
    ) -> Result<()> {
        self.ctx.call(|| self.subject(what), f)
    }

    /// `device N executable graph 0x..: what`, for error texts.
    #[cold]
    fn subject(&self, what: &str) -> String {
        format!(
            "device {} executable graph {:p}: {what}",
            self.ctx.ordinal(),
            self.raw
        )
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        stream
            .context()
            .check_same(&self.ctx, || "executable graph".to_owned(), "the stream")
    }

    /// Queue one replay of the graph on `stream` (`cuGraphLaunch`).
    ///
    /// # Safety
    /// Everything the graph's work touches (the buffers its kernels, copies and
    /// fills were captured or updated with, host memory of captured copies) must be
    /// alive and valid until the replay finishes. What metrale holds for the
    /// replay (the code of its kernels, host functions, a capture arena) it
    /// keeps alive itself, also after this executable is dropped: through
    /// user objects the driver holds for the replay in flight (one
    /// `cuGraphLaunch`), or on drivers without them a host function queued
    /// after the replay.
    /// What it cannot hold includes the NCCL registrations and windows its collectives were captured through: a
    /// `Registration` or `Window` borrows its buffer and communicator, so the
    /// graph cannot hold it, and one dropped after the capture deregisters
    /// what the captured collective may still use: keep each such guard alive
    /// until the replays that use it have finished.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`]; `InvalidArgument` on a stream being
    /// captured when the graph holds anything for its replays; `cuGraphLaunch`'s
    /// status.
    #[inline]
    pub unsafe fn launch(&self, stream: &CudaStream) -> Result<()> {
        self.check_stream(stream)?;
        let (g, s) = (self.raw, stream.raw());
        if !self.holds {
            // SAFETY: a live executable graph and a stream of its context; the
            // rest is the caller's contract.
            return self.call("launch", |d| unsafe { cu!(d, cuGraphLaunch(g, s)) });
        }
        // What the replay uses may be needed after this executable is dropped.
        // Held through user objects, the driver keeps it for the replay in
        // flight, and the launch is all. Otherwise a host function queued right
        // after the replay, on this stream, holds it until it has run. One
        // section covers the refusal in a capture (a graph captured around the
        // replay would hold neither), the launch and that keeper, so no capture
        // can begin between them and take the keeper away from the stream.
        let section = stream.section();
        stream.refuse_if_capturing(
            &section,
            "replaying a graph that holds host functions or memory",
        )?;
        // SAFETY: as above.
        self.call("launch", |d| unsafe { cu!(d, cuGraphLaunch(g, s)) })?;
        if self.host_fns.is_empty() {
            return Ok(());
        }
        let held = Arc::clone(&self.host_fns);
        let keeper = Arc::clone(&held);
        let kept = stream.launch_host_fn_in(&section, move || drop(keeper));
        drop(section);
        match kept {
            Ok(()) => {}
            // A driver that reported an error ran the keeper anyway (after the
            // replay): nothing to keep.
            Err((e, None)) => return Err(e),
            Err((e, Some(keeper))) => {
                // The replay is queued: leak its host functions rather than let
                // them go while it may run them.
                std::mem::forget(keeper);
                std::mem::forget(held);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Upload the graph's work descriptors to the device ahead of the first launch
    /// (`cuGraphUpload`), ordered on `stream`.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`]; `cuGraphUpload`'s status.
    pub fn upload(&self, stream: &CudaStream) -> Result<()> {
        self.check_stream(stream)?;
        let (g, s) = (self.raw, stream.raw());
        // SAFETY: a live executable graph and a stream of its context.
        self.call("upload", |d| unsafe { cu!(d, cuGraphUpload(g, s)) })
    }

    /// Update the executable graph in place from `graph`, a graph of the same
    /// topology (typically a new capture of the same step with other arguments):
    /// `cuGraphExecUpdate_v2`.
    ///
    /// What `graph` holds for its replays is held by the executable from then
    /// on: the driver replaces the user-object references it held for the
    /// executable with `graph`'s (replays in flight keep the old ones until
    /// they have run); what rides with host functions (drivers without user
    /// objects) is added to what the executable already holds.
    ///
    /// # Errors
    /// [`ErrorKind::GraphUpdate`] with the driver's reason in words (topology
    /// changed, a kernel's function changed, ...) and the node it blamed;
    /// [`ErrorKind::WrongDevice`].
    pub fn update(&mut self, graph: &CudaGraph) -> Result<()> {
        graph
            .ctx
            .check_same(&self.ctx, || "executable graph".to_owned(), "the graph")?;
        // Before the update, which replaces the executable's user objects
        // with the graph's: the new code is held by those.
        let code_keeper = graph.hold_code();
        let mut info = sys::CUgraphExecUpdateResultInfo::default();
        let (e, g) = (self.raw, graph.raw);
        let result = self.ctx.with(|d| {
            // SAFETY: a live executable graph and graph of one context; writes `info`.
            unsafe { cu!(d, cuGraphExecUpdate_v2(e, g, &mut info)) }
        });
        match result {
            Ok(()) => {
                for table in graph
                    .keep
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .iter()
                {
                    if !self.keep.iter().any(|t| Arc::ptr_eq(t, table)) {
                        self.keep.push(Arc::clone(table));
                    }
                }
                // The driver replaced the references it held for this
                // executable with the graph's (those of replays in flight stay
                // until they ran); what the graph holds through host
                // functions is added to ours.
                self.holds |= graph.holds_any();
                self.holds |= code_keeper.is_some();
                let new: Vec<&HostKeep> = graph
                    .host_fns
                    .iter()
                    .chain(code_keeper.as_ref())
                    .filter(|k| !self.host_fns.iter().any(|h| Arc::ptr_eq(h, k)))
                    .collect();
                if !new.is_empty() {
                    // What the executable already holds stays (replays in
                    // flight may still run it); one keeper is held once.
                    let mut all: Vec<HostKeep> = self.host_fns.to_vec();
                    all.extend(new.into_iter().cloned());
                    self.host_fns = Arc::new(all);
                }
                Ok(())
            }
            Err(CallError::Status { call, status })
                if info.result != sys::CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS =>
            {
                Err(ErrorKind::GraphUpdate {
                    call,
                    status,
                    device: self.ctx.ordinal(),
                    result: info.result,
                    node: describe_node(self.ctx.driver(), info.errorNode),
                }
                .into())
            }
            Err(e) => Err(e.about(format_args!(
                "device {} executable graph {:p}: update",
                self.ctx.ordinal(),
                self.raw
            ))),
        }
    }

    /// Set a kernel node's shape and typed arguments in this executable graph,
    /// without a new capture (`cuGraphExecKernelNodeSetParams_v2`). `node` comes
    /// from [`CudaGraph::kernel_nodes`] of the graph this was instantiated from, and
    /// `f` must be the kernel it runs; both are checked, and the update is checked
    /// like a launch.
    ///
    /// # Safety
    /// As [`CudaStream::launch`], for every later replay: the arguments must mean
    /// what the kernel expects and the memory they name must be valid whenever the
    /// executable graph runs.
    ///
    /// # Errors
    /// `InvalidArgument` when `node` is not a node of the graph this was
    /// instantiated from, that graph was dropped, or `f` is not the node's kernel
    /// (the graph must not be changed by another thread meanwhile: it is `Send`,
    /// not `Sync`, so only its owner can); as
    /// [`CudaStream::launch`]; the driver's status.
    pub unsafe fn set_kernel_params<A: KernelArgs<K>, K>(
        &self,
        node: &KernelNode,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: A,
    ) -> Result<()> {
        self.ctx.check_same(
            f.context(),
            || format!("kernel '{}'", f.name()),
            "the executable graph",
        )?;
        if node.node.graph != self.source || self.source_alive.strong_count() == 0 {
            return Err(invalid_arg(format!(
                "device {}: graph node {:p} is not a node of the graph this executable graph \
                 was instantiated from (or that graph was dropped)",
                self.ctx.ordinal(),
                node.node.raw
            )));
        }
        if node.func.0 != f.as_raw() {
            return Err(invalid_arg(format!(
                "graph node {:p} runs kernel '{}', not '{}'",
                node.node.raw,
                node.name,
                f.name()
            )));
        }
        super::node::refuse_attributes(&cfg, f.name())?;
        // Bound once, here (the update itself must not go unbound: with no
        // context current, driver 580 crashed in `cuGraphExecKernelNodeSetParams_v2`,
        // seen on an H100 by `floor --parts`); the checks below and the call
        // need no second bind.
        self.ctx.bind()?;
        prepare(&self.ctx, f.info(), &cfg, Some(args.layout()))?;
        let (e, n) = (self.raw, node.node.raw);
        let d = self.ctx.driver();
        args.with_params(|p| {
            let params = node_params(f.as_raw(), &cfg, p.as_mut_ptr());
            // SAFETY: the driver copies the argument values `p` points to during
            // the call; the node belongs to the graph this was instantiated
            // from; the context is current (bound above, on this thread).
            unsafe { cu!(d, cuGraphExecKernelNodeSetParams_v2(e, n, &params)) }
                .map_err(|e| e.about(self.subject("kernel node update")))
        })
    }

    /// The raw `CUgraphExec`, for driver calls of your own.
    pub fn raw(&self) -> CUgraphExec {
        self.raw
    }
}

/// `kernel node 0x.. ('m::k')` for the node the driver blamed.
fn describe_node(d: &'static sys::Driver, node: CUgraphNode) -> Option<String> {
    if node.is_null() {
        return None;
    }
    let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
    // SAFETY: a node the driver just named; writes its type.
    if unsafe { cu!(d, cuGraphNodeGetType(node, &mut t)) }.is_err() {
        return Some(format!("node {node:p}"));
    }
    let kind = GraphNodeKind::from_raw(t);
    if kind != GraphNodeKind::Kernel {
        return Some(format!("{kind:?} node {node:p}"));
    }
    let mut p = sys::CUDA_KERNEL_NODE_PARAMS::default();
    // SAFETY: a kernel node; writes its parameters.
    if unsafe { cu!(d, cuGraphKernelNodeGetParams_v2(node, &mut p)) }.is_err() {
        return Some(format!("kernel node {node:p}"));
    }
    let name = name_of(p.func).map_or_else(|| driver_function_name(d, p.func), |n| n.to_string());
    Some(format!("kernel node {node:p} ('{name}')"))
}

impl Drop for CudaGraphExec {
    fn drop(&mut self) {
        let raw = self.raw;
        self.ctx.release_with(
            self.made,
            format_args!(
                "destroying executable graph {raw:p} on device {}",
                self.ctx.ordinal()
            ),
            |d, failures| {
                // SAFETY: the executable graph is this value's own, destroyed once.
                if let Err(e) = unsafe { cu!(d, cuGraphExecDestroy(raw)) } {
                    failures.push(e);
                }
            },
        );
        if self.holds || !self.keep.is_empty() {
            // A user object's destructor the destroy ran (kernel code
            // included) handed its value to
            // the drop-later list: drop it now rather than at the next
            // synchronisation.
            crate::lifetime::drain();
        }
    }
}
