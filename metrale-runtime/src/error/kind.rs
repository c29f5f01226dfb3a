//! The data of an error: [`ErrorKind`] and the pieces its variants carry
//! ([`NameKind`], [`LaunchShape`], [`LaunchFailure`]), with the words each
//! variant is shown in.

use std::fmt;

use metrale_cuda_sys::{self as sys, CUresult};

use super::library::LibraryError;
use super::text::{cuda_error_text, version_suffix};

/// What a name lookup was looking for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NameKind {
    /// A module of the registry.
    Module,
    /// A kernel (`__global__` function) of a module.
    Kernel,
    /// A `__device__` symbol of a module.
    Symbol,
}

impl NameKind {
    fn word(self) -> &'static str {
        match self {
            NameKind::Module => "module",
            NameKind::Kernel => "kernel",
            NameKind::Symbol => "symbol",
        }
    }
}

/// The shape of a launch, as an error reports it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct LaunchShape {
    /// Blocks in the grid (x, y, z).
    pub grid: [u32; 3],
    /// Threads in a block (x, y, z).
    pub block: [u32; 3],
    /// Dynamic shared memory per block, bytes.
    pub shared_mem_bytes: u32,
    /// Extended launch attributes (` cluster=[4,1,1] cooperative`), or empty.
    pub attributes: String,
}

impl fmt::Display for LaunchShape {
    /// `(grid=[x,y,z], block=[x,y,z], shared_mem=N cluster=[..])`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (g, b) = (self.grid, self.block);
        write!(
            f,
            "(grid=[{},{},{}], block=[{},{},{}], shared_mem={}{})",
            g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem_bytes, self.attributes
        )
    }
}

/// Why a launch did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LaunchFailure {
    /// A driver call (the launch itself, or the shared-memory opt-in) failed.
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its status.
        status: CUresult,
    },
    /// Refused before the driver was called; the reason names the rule.
    Refused(String),
}
/// The data of a [`MetraleError`](super::MetraleError): which check or call failed, with its status and
/// subject. Grows with the crate (`#[non_exhaustive]`): match with a `_` arm.
#[derive(Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The driver library could not be loaded (the loader's list of what was tried).
    #[error(transparent)]
    DriverUnavailable(sys::LoadError),

    /// The loaded driver lacks a function the operation needs.
    #[error(
        "{subject}: {symbol} is not exported by the loaded CUDA driver{}",
        version_suffix(*driver_version)
    )]
    MissingSymbol {
        /// The symbol, as the header maps it.
        symbol: &'static str,
        /// `cuDriverGetVersion`'s answer, when it could be asked.
        driver_version: Option<i32>,
        /// What was being done (`module 'm'`, `kernel 'm::k'`, `device 0`).
        subject: String,
    },

    /// A driver call returned an error status.
    #[error("{subject}: {call} failed: {}", cuda_error_text(*status))]
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its status.
        status: CUresult,
        /// What was being done (`device 0 stream synchronize`).
        subject: String,
    },

    /// The driver refused to load a module (with the JIT log for PTX).
    #[error(
        "{module}: {call} failed: {} [{image}]{}{}",
        cuda_error_text(*status),
        hint.as_deref().map(|h| format!("; {h}")).unwrap_or_default(),
        jit_log.as_deref().map(|l| format!("\nJIT error log:\n{l}")).unwrap_or_default()
    )]
    ModuleLoad {
        /// The module's name.
        module: String,
        /// The loading call (`cuModuleLoadDataEx`, `cuLibraryLoadData`).
        call: &'static str,
        /// Its status.
        status: CUresult,
        /// What was handed to the driver (`PTX of 87 bytes`).
        image: String,
        /// What the blob was built for, when the device cannot run it.
        hint: Option<String>,
        /// The JIT compiler's error log, when it wrote one.
        jit_log: Option<String>,
    },

    /// A kernel blob was refused before the driver saw it (malformed, empty, ...).
    #[error("{module}: {reason}")]
    InvalidBlob {
        /// The module's name.
        module: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An unknown module, kernel or symbol.
    #[error("{}", not_found_text(*kind, module, name.as_deref(), *call, *status))]
    NotFound {
        /// What was not found.
        kind: NameKind,
        /// The module (asked for, or searched).
        module: String,
        /// The kernel or symbol asked for, if any.
        name: Option<String>,
        /// The driver call that reported it, when the driver did.
        call: Option<&'static str>,
        /// Its status (`CUDA_ERROR_NOT_FOUND`).
        status: Option<CUresult>,
    },

    /// A kernel or symbol name the driver cannot be given (an interior NUL).
    #[error(
        "{module}::{}: name has an interior NUL byte at offset {nul_at}",
        name.escape_debug()
    )]
    InvalidName {
        /// The module.
        module: String,
        /// The name as given.
        name: String,
        /// Where its first NUL is.
        nul_at: usize,
    },

    /// A launch failed, before or in the driver.
    #[error("{}", launch_text(kernel, shape, failure))]
    KernelLaunch {
        /// `module::kernel`.
        kernel: String,
        /// Grid, block, shared memory and attributes.
        shape: LaunchShape,
        /// The driver's refusal, or the rule that refused it first.
        failure: LaunchFailure,
    },

    /// Typed arguments that do not match the kernel's parameter list (checked
    /// before the driver, against `cuFuncGetParamInfo`).
    #[error("{}", mismatch_text(kernel, *index, *expected, *given))]
    ArgumentMismatch {
        /// `module::kernel`.
        kernel: String,
        /// The parameter index of a size mismatch; `None` for a count mismatch.
        index: Option<usize>,
        /// The kernel's parameter size in bytes (or its parameter count).
        expected: usize,
        /// The argument's size in bytes (or the argument count).
        given: usize,
    },

    /// A handle of one device (or context) used with another's.
    #[error("{}", wrong_device_text(what, *belongs_to, used_with, *used_device))]
    WrongDevice {
        /// The handle (`kernel 'm::k'`, `device buffer`).
        what: String,
        /// The device it belongs to.
        belongs_to: usize,
        /// What it was used with (`a stream`, `registry`).
        used_with: String,
        /// That one's device.
        used_device: usize,
    },

    /// A kernel handle from another registry, or one that was dropped.
    #[error(
        "kernel '{kernel}': the handle comes from another registry (or one that was dropped); \
         look the kernel up through this registry"
    )]
    ForeignHandle {
        /// The kernel the handle was looked up as.
        kernel: String,
    },

    /// A `__device__` symbol whose size does not match the type asked for.
    #[error(
        "{module}::{symbol}: the symbol is {symbol_bytes} bytes, {elements} x {type_name} is {type_bytes}"
    )]
    SymbolSize {
        /// The module.
        module: String,
        /// The symbol.
        symbol: String,
        /// Its size as the driver reports it.
        symbol_bytes: usize,
        /// The element type asked for.
        type_name: &'static str,
        /// How many elements were asked for.
        elements: usize,
        /// Their size in bytes.
        type_bytes: usize,
    },

    /// `cuGraphExecUpdate_v2` refused a new graph for an executable graph.
    #[error(
        "device {device} executable graph update: {call} failed: {}; refused because {} ({}){}",
        cuda_error_text(*status),
        update_reason(*result),
        result_name(*result),
        node.as_deref().map(|n| format!(", at {n}")).unwrap_or_default()
    )]
    GraphUpdate {
        /// The driver function (`cuGraphExecUpdate_v2`).
        call: &'static str,
        /// Its status (`CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE`, 910).
        status: CUresult,
        /// The device.
        device: usize,
        /// The driver's verdict (`CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED`).
        result: sys::CUgraphExecUpdateResult,
        /// The node the driver blamed, described.
        node: Option<String>,
    },

    /// Input the driver would reject (or crash on) was refused before any call.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A call of the operating system failed (passing a descriptor between
    /// processes over a Unix socket).
    #[error("{what}: {source}")]
    Os {
        /// What was being done (`sending a descriptor over a Unix socket`).
        what: String,
        /// The system's error.
        source: std::sync::Arc<std::io::Error>,
    },

    /// A metrale call made from inside a host function
    /// ([`CudaStream::launch_host_fn`](crate::CudaStream::launch_host_fn)), where
    /// the driver forbids CUDA calls (they may deadlock): refused before the
    /// driver.
    #[error(
        "{subject}: refused inside a host function: the driver forbids CUDA calls from \
         host functions (they may deadlock); do the work after the host function, on \
         another thread"
    )]
    InHostFunction {
        /// What was being done.
        subject: String,
    },

    /// A stream operation the device does not support (the attribute that says so
    /// is named).
    #[error("{subject}: not supported by device {device} ({attribute} is 0)")]
    Unsupported {
        /// What was asked for (`device 0 stream 0x..: wait_value64`).
        subject: String,
        /// The device.
        device: usize,
        /// The device attribute that answered no.
        attribute: &'static str,
    },

    /// A feature the device or the loaded driver is too old for (the packed
    /// sub-byte tensor-map types, the 128-byte atom swizzles and wide im2col maps
    /// need compute capability 10.0 and a CUDA 12.8 driver), refused before the
    /// driver is asked.
    #[error(
        "{subject}: {feature} needs compute capability {}.{} and a CUDA {}.{} driver: \
         device {device} has compute capability {}.{}, the driver is CUDA {}.{}",
        needs.0, needs.1, needs_driver / 1000, needs_driver % 1000 / 10,
        has.0, has.1, driver / 1000, driver % 1000 / 10
    )]
    FeatureUnavailable {
        /// What was being made (`tensor map at 0x...`).
        subject: String,
        /// The feature (`data type 16U4_ALIGN8B`).
        feature: String,
        /// The device.
        device: usize,
        /// The compute capability the feature needs.
        needs: (u32, u32),
        /// The device's.
        has: (u32, u32),
        /// The driver version it needs (`cuDriverGetVersion`'s form: 12080).
        needs_driver: i32,
        /// The loaded driver's.
        driver: i32,
    },

    /// A companion library (NCCL, NVRTC, nvJitLink) failed, or refused before it
    /// was called; the data is the library room's, in one shape
    /// ([`LibraryError`]).
    #[error(transparent)]
    Library(LibraryError),
}

impl fmt::Debug for ErrorKind {
    /// The message itself, as for [`MetraleError`](super::MetraleError).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

fn not_found_text(
    kind: NameKind,
    module: &str,
    name: Option<&str>,
    call: Option<&'static str>,
    status: Option<CUresult>,
) -> String {
    match (kind, call, status) {
        (NameKind::Module, _, _) => match name {
            Some(n) => format!("Module '{module}' not loaded (looking up '{module}::{n}')"),
            None => format!("Module '{module}' not loaded"),
        },
        (_, Some(call), Some(status)) => format!(
            "{module}::{}: {call} failed: {}",
            name.unwrap_or_default(),
            cuda_error_text(status)
        ),
        _ => format!(
            "{module}::{}: no such {} in the module",
            name.unwrap_or_default(),
            kind.word()
        ),
    }
}

fn launch_text(kernel: &str, shape: &LaunchShape, failure: &LaunchFailure) -> String {
    match failure {
        LaunchFailure::Driver { call, status } => format!(
            "kernel '{kernel}': {call} failed: {} {shape}",
            cuda_error_text(*status)
        ),
        LaunchFailure::Refused(why) => {
            format!("kernel '{kernel}': launch not attempted, {why} {shape}")
        }
    }
}

fn mismatch_text(kernel: &str, index: Option<usize>, expected: usize, given: usize) -> String {
    match index {
        None => format!(
            "kernel '{kernel}': launch not attempted, {given} argument(s) given, the kernel takes {expected} parameter(s)"
        ),
        Some(i) => format!(
            "kernel '{kernel}': launch not attempted, argument {i} is {given} bytes, the kernel's parameter {i} is {expected} bytes"
        ),
    }
}

fn wrong_device_text(what: &str, belongs_to: usize, used_with: &str, used_device: usize) -> String {
    if belongs_to == used_device {
        format!(
            "{what} belongs to an earlier context of device {belongs_to} (released and created \
             anew since), not to the one of {used_with}"
        )
    } else {
        format!("{what} belongs to device {belongs_to}, but {used_with} is on device {used_device}")
    }
}

fn result_name(r: sys::CUgraphExecUpdateResult) -> String {
    use sys::CUgraphExecUpdateResult as R;
    let name = match r {
        R::CU_GRAPH_EXEC_UPDATE_SUCCESS => "CU_GRAPH_EXEC_UPDATE_SUCCESS",
        R::CU_GRAPH_EXEC_UPDATE_ERROR => "CU_GRAPH_EXEC_UPDATE_ERROR",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED => {
            "CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED => {
            "CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED => {
            "CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED => {
            "CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED => "CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE => {
            "CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED => {
            "CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED"
        }
        _ => return format!("CU_GRAPH_EXEC_UPDATE result {}", r.0),
    };
    name.to_owned()
}

/// `cuGraphExecUpdate`'s verdict in words.
fn update_reason(r: sys::CUgraphExecUpdateResult) -> &'static str {
    use sys::CUgraphExecUpdateResult as R;
    match r {
        R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED => {
            "the graph's topology changed (nodes or edges added or removed)"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED => "a node's type changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED => {
            "a kernel node's function changed in a way the driver cannot update"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED => {
            "a node's parameters changed in a way the driver cannot update"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED => {
            "something in the graph cannot be updated in place"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE => {
            "a kernel node's function changed to one of another module or context"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED => "a node's attributes changed",
        _ => "the driver could not update the executable graph",
    }
}
