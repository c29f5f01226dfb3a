//! Building a [`CudaGraph`] node by node: kernel nodes (checked like launches)
//! and conditional `while` nodes, whose body is a [`GraphBody`].

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUgraph, CUgraphNode};

use super::node::{
    next_graph_id, node_params, raw_deps, refuse_attributes, ConditionalHandle, GraphNode,
    GraphNodeKind,
};
use super::{keep, CudaGraph, KeepAlive};
use crate::context::CudaContext;
use crate::error::{cu, invalid_arg, Result};
use crate::function::CudaFunction;
use crate::launch::{prepare, KernelArgs, LaunchConfig};

impl CudaGraph {
    /// Add a kernel node that runs after `deps`: `f` with typed arguments (a tuple
    /// or a `&`[`KernelArgList`](crate::KernelArgList)), checked like a launch. The argument values are copied into the node.
    ///
    /// # Safety
    /// As [`CudaStream::launch`](crate::CudaStream::launch), for every replay of the graph.
    ///
    /// # Errors
    /// As [`CudaStream::launch`](crate::CudaStream::launch); `cuGraphAddKernelNode_v2`'s status.
    pub unsafe fn add_kernel_node<A: KernelArgs<K>, K>(
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
}

/// Add a kernel node to `graph` (checked like a launch).
///
/// # Safety
/// As [`CudaStream::launch`](crate::CudaStream::launch), for every replay.
unsafe fn add_kernel<A: KernelArgs<K>, K>(
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
    pub unsafe fn add_kernel_node<A: KernelArgs<K>, K>(
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
