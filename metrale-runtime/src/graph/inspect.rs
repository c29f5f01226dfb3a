//! Looking at a [`CudaGraph`]: its nodes, edges and kernel nodes, and Graphviz DOT.

use std::ffi::CString;
use std::path::Path;

use metrale_cuda_sys::{self as sys, CUfunction, CUgraphNode};

use super::node::{driver_function_name, CUfunctionHandle, GraphNode, GraphNodeKind, KernelNode};
use super::CudaGraph;
use crate::error::{cu, invalid_arg, Result};
use crate::function::name_of;
use crate::launch::LaunchConfig;

impl CudaGraph {
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

    pub(super) fn kernel_params(&self, node: CUgraphNode) -> Result<(CUfunction, LaunchConfig)> {
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
}
