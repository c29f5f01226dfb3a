//! Errors: [`MetraleError`], [`Result`], the status text ([`cuda_error_text`]) and
//! the teardown rule ([`is_teardown_noop`]).
//!
//! This module is the one place where a `CUresult` becomes an error. Driver calls go
//! through the crate's `cu!` macro, which yields a small `Copy` [`CallError`] (the
//! call's name and its status, or the missing symbol); the caller attaches what it
//! was working on while turning it into a [`MetraleError`]. Variants carry data (the
//! call, the status, the module, kernel or symbol, the launch shape, the JIT log);
//! text is made only when an error is displayed, never on success.
//!
//! Invariants:
//! - Every [`MetraleError`] text names the driver call that failed (or the check
//!   that refused the input), the status name and number with the driver's
//!   description, and the device, module, kernel, symbol or copy involved.
//! - `{:?}` of an error is its message, so `fn main() -> Result<()>` prints words.

use std::ffi::{c_char, CStr};
use std::fmt;

use metrale_cuda_sys::{self as sys, CUresult};

/// The crate's result type.
pub type Result<T, E = MetraleError> = std::result::Result<T, E>;

/// `CUDA_ERROR_DEINITIALIZED` (4): the driver is shutting down.
pub const CUDA_ERROR_DEINITIALIZED: CUresult = CUresult::CUDA_ERROR_DEINITIALIZED;
/// `CUDA_ERROR_INVALID_CONTEXT` (201): no (or no valid) context is current.
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = CUresult::CUDA_ERROR_INVALID_CONTEXT;
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709): the context was destroyed.
pub const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED;

/// Whether `status` means the driver or context is already gone, so a free, unload,
/// destroy or release has nothing left to do: `CUDA_ERROR_DEINITIALIZED` (4),
/// `CUDA_ERROR_INVALID_CONTEXT` (201) or `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709).
#[inline]
pub fn is_teardown_noop(status: CUresult) -> bool {
    status == CUDA_ERROR_DEINITIALIZED
        || status == CUDA_ERROR_INVALID_CONTEXT
        || status == CUDA_ERROR_CONTEXT_IS_DESTROYED
}

/// `"<NAME> (<status>): <description>"` for a status.
///
/// The name and description come from the driver (`cuGetErrorName`,
/// `cuGetErrorString`). Where the driver cannot be loaded or has no name for the
/// status, the name comes from the header's constants, and `CUDA_UNKNOWN` for a
/// status the header does not know either; a missing description reads
/// `(no message)`.
pub fn cuda_error_text(status: CUresult) -> String {
    let (name, description) = match sys::driver() {
        Ok(d) => (
            driver_string(d.cuGetErrorName().ok(), status),
            driver_string(d.cuGetErrorString().ok(), status),
        ),
        Err(_) => (None, None),
    };
    let name = name
        .or_else(|| status.name().map(str::to_owned))
        .unwrap_or_else(|| "CUDA_UNKNOWN".to_owned());
    let description = description.unwrap_or_else(|| "(no message)".to_owned());
    format!("{name} ({}): {description}", status.0)
}

/// Ask `cuGetErrorName`/`cuGetErrorString` (same signature) about `status`.
fn driver_string(
    f: Option<unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult>,
    status: CUresult,
) -> Option<String> {
    let f = f?;
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: the driver writes a pointer to a static NUL-terminated string, or
    // leaves NULL and returns an error for a status it does not know.
    let ok = unsafe { f(status, &mut text) }.is_success();
    if !ok || text.is_null() {
        return None;
    }
    // SAFETY: checked non-null; the driver's strings are static and NUL-terminated.
    Some(
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// The version the loaded driver reports, when it can be asked.
pub(crate) fn loaded_driver_version() -> Option<i32> {
    let d = sys::driver().ok()?;
    let f = d.cuDriverGetVersion().ok()?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { f(&mut version) }.is_success().then_some(version)
}

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

/// Everything that can go wrong in metrale: one pointer wide, so a `Result<()>` is
/// 8 bytes on the hot path, with the failure's data in [`ErrorKind`] behind it.
///
/// `Display` (and `Debug`, which prints the same message) puts the failure into
/// words: the call, the status name and number with the library's description,
/// and what was being worked on. [`MetraleError::kind`] gives the data to match on.
///
/// # Matching on errors
///
/// Match on [`e.kind()`](MetraleError::kind), an [`ErrorKind`]: `MetraleError`
/// itself is one pointer with no variants, so `MetraleError::ArgumentMismatch {
/// .. }` does not name anything (rustc says E0223, "ambiguous associated type").
/// `ErrorKind` grows with the crate: end with a `_` arm. [`MetraleError::status`]
/// gives the driver's status whatever the kind, [`MetraleError::is_unavailable`]
/// says "no GPU stack here". Each common kind:
///
/// ```
/// use metrale_runtime::sys::CUresult;
/// use metrale_runtime::{ErrorKind, LaunchFailure, MetraleError, NameKind};
///
/// fn advice(e: &MetraleError) -> &'static str {
///     match e.kind() {
///         ErrorKind::DriverUnavailable(_) => "no driver here: fall back to the CPU",
///         ErrorKind::MissingSymbol { .. } => "the installed driver is too old for this call",
///         ErrorKind::Driver { status, .. } if *status == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
///             "out of device memory: free some and retry"
///         }
///         ErrorKind::Driver { .. } => "a driver call failed (the message names it)",
///         ErrorKind::ModuleLoad { .. } => "the driver refused a blob (the message has the JIT log)",
///         ErrorKind::InvalidBlob { .. } => "not a PTX, cubin or fatbin",
///         ErrorKind::NotFound { kind: NameKind::Kernel, .. } => "no kernel of that name",
///         ErrorKind::NotFound { .. } => "no module or symbol of that name",
///         ErrorKind::KernelLaunch { failure: LaunchFailure::Refused(_), .. } => {
///             "the launch shape was refused before the driver"
///         }
///         ErrorKind::KernelLaunch { .. } => "the driver refused the launch",
///         ErrorKind::ArgumentMismatch { .. } => "the arguments do not match the kernel's parameters",
///         ErrorKind::WrongDevice { .. } => "a handle of one device used with another",
///         ErrorKind::InvalidArgument(_) => "refused before any driver call",
///         _ => "something else: show the message",
///     }
/// }
///
/// let oom = MetraleError::from(ErrorKind::Driver {
///     call: "cuMemAlloc_v2",
///     status: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
///     subject: "device 0: allocating 1 GiB".into(),
/// });
/// assert_eq!(advice(&oom), "out of device memory: free some and retry");
/// assert_eq!(oom.status(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
///
/// let args = MetraleError::from(ErrorKind::ArgumentMismatch {
///     kernel: "kernels::vec_add".into(),
///     index: Some(2),
///     expected: 8,
///     given: 4,
/// });
/// assert_eq!(advice(&args), "the arguments do not match the kernel's parameters");
/// // The fields, when the handling needs them:
/// if let ErrorKind::ArgumentMismatch { index: Some(i), expected, given, .. } = args.kind() {
///     assert_eq!((*i, *expected, *given), (2, 8, 4));
/// }
///
/// let bad = MetraleError::from(ErrorKind::InvalidArgument("a launch dimension is zero".into()));
/// assert_eq!(advice(&bad), "refused before any driver call");
/// assert!(!bad.is_unavailable());
/// ```
///
/// The variants live on `ErrorKind`, not on `MetraleError`:
///
/// ```compile_fail,E0223
/// # use metrale_runtime::MetraleError;
/// fn is_mismatch(e: &MetraleError) -> bool {
///     matches!(e, MetraleError::ArgumentMismatch { .. })
/// }
/// ```
///
/// Loading, with the kinds a load can fail with:
///
/// ```no_run
/// use metrale_runtime::{ErrorKind, MetraleRegistry, NameKind};
/// # fn main() {
/// match MetraleRegistry::load(0, &[("kernels", b".version 8.0\nnot ptx")]) {
///     Ok(_) => {}
///     Err(e) => match e.kind() {
///         ErrorKind::DriverUnavailable(why) => eprintln!("no GPU here: {why}"),
///         ErrorKind::ModuleLoad { .. } => {
///             // "kernels: cuModuleLoadDataEx failed: CUDA_ERROR_INVALID_PTX (218): ...
///             //  JIT error log: ..."
///             eprintln!("{e}");
///             assert!(e.status().is_some());
///         }
///         ErrorKind::NotFound { kind: NameKind::Kernel, name, .. } => {
///             eprintln!("no kernel {name:?}")
///         }
///         _ => eprintln!("{e}"),
///     },
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct MetraleError(Box<ErrorKind>);

impl MetraleError {
    /// What failed, with its data.
    #[inline]
    pub fn kind(&self) -> &ErrorKind {
        &self.0
    }

    /// The failure's data, by value.
    pub fn into_kind(self) -> ErrorKind {
        *self.0
    }

    /// Whether the driver (or another library metrale loads) could not be loaded:
    /// the machine has no GPU stack, as opposed to a failure on a working one.
    pub fn is_unavailable(&self) -> bool {
        matches!(*self.0, ErrorKind::DriverUnavailable(_))
    }
}

impl From<ErrorKind> for MetraleError {
    #[cold]
    fn from(kind: ErrorKind) -> Self {
        MetraleError(Box::new(kind))
    }
}

impl From<sys::LoadError> for MetraleError {
    #[cold]
    fn from(e: sys::LoadError) -> Self {
        ErrorKind::DriverUnavailable(e).into()
    }
}

impl fmt::Display for MetraleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for MetraleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)
    }
}

/// The data of a [`MetraleError`]: which check or call failed, with its status and
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

    // nvrtc feature
    /// Run-time compilation or linking failed (NVRTC, nvJitLink, the compile
    /// cache); the data is the `nvrtc` room's.
    #[cfg(feature = "nvrtc")]
    #[error(transparent)]
    Nvrtc(Box<crate::nvrtc::NvrtcError>),

    // nccl feature
    /// A communicator, a collective or NCCL itself failed, or a collective was
    /// refused before NCCL; the data is the `nccl` room's.
    #[cfg(feature = "nccl")]
    #[error(transparent)]
    Nccl(Box<crate::nccl::NcclError>),
}

impl fmt::Debug for MetraleError {
    /// The message itself, so `main` returning an error prints words, not a struct.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Debug for ErrorKind {
    /// The message itself, as for [`MetraleError`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

fn version_suffix(version: Option<i32>) -> String {
    match version {
        Some(v) => format!(" (driver version {}.{}, {v})", v / 1000, v % 1000 / 10),
        None => String::new(),
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

impl MetraleError {
    /// The driver status behind this error, when a driver call returned one.
    pub fn status(&self) -> Option<CUresult> {
        match &*self.0 {
            ErrorKind::Driver { status, .. } | ErrorKind::ModuleLoad { status, .. } => {
                Some(*status)
            }
            ErrorKind::NotFound { status, .. } => *status,
            ErrorKind::GraphUpdate { status, .. } => Some(*status),
            ErrorKind::KernelLaunch {
                failure: LaunchFailure::Driver { status, .. },
                ..
            } => Some(*status),
            _ => None,
        }
    }
}

/// A failed driver call before context is attached: cheap to make and to pass up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CallError {
    /// The call returned a status other than success.
    Status {
        /// The driver function.
        call: &'static str,
        /// What it returned.
        status: CUresult,
    },
    /// The driver does not export the function.
    Missing(sys::MissingSymbol),
    /// Refused without calling the driver: the thread is running a host function.
    InHostFunction,
}

impl fmt::Display for CallError {
    /// `call failed: NAME (n): description`, or the missing-symbol sentence.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CallError::Status { call, status } => {
                write!(f, "{call} failed: {}", cuda_error_text(status))
            }
            CallError::Missing(m) => write!(
                f,
                "{} is not exported by the loaded CUDA driver{}",
                m.name,
                version_suffix(loaded_driver_version())
            ),
            CallError::InHostFunction => {
                f.write_str("CUDA call refused inside a host function (the driver forbids it)")
            }
        }
    }
}

impl std::error::Error for CallError {}

impl CallError {
    /// The status, for a call that returned one.
    pub fn status(self) -> Option<CUresult> {
        match self {
            CallError::Status { status, .. } => Some(status),
            CallError::Missing(_) | CallError::InHostFunction => None,
        }
    }

    /// The error for a call made while working on `subject` (`device 0`, ...).
    #[cold]
    pub fn about(self, subject: impl fmt::Display) -> MetraleError {
        match self {
            CallError::Status { call, status } => ErrorKind::Driver {
                call,
                status,
                subject: subject.to_string(),
            }
            .into(),
            CallError::Missing(m) => ErrorKind::MissingSymbol {
                symbol: m.name,
                driver_version: loaded_driver_version(),
                subject: subject.to_string(),
            }
            .into(),
            CallError::InHostFunction => ErrorKind::InHostFunction {
                subject: subject.to_string(),
            }
            .into(),
        }
    }

    /// A lookup of `name` (a kernel or symbol) in `module` failed: NOT_FOUND is a
    /// [`ErrorKind::NotFound`], other statuses a [`ErrorKind::Driver`] about
    /// `module::name`.
    #[cold]
    pub(crate) fn lookup(self, kind: NameKind, module: &str, name: &str) -> MetraleError {
        match self {
            CallError::Status { call, status } if status == CUresult::CUDA_ERROR_NOT_FOUND => {
                ErrorKind::NotFound {
                    kind,
                    module: module.to_owned(),
                    name: Some(name.to_owned()),
                    call: Some(call),
                    status: Some(status),
                }
                .into()
            }
            _ => self.about(format_args!("{module}::{name}")),
        }
    }

    /// A launch failed in the driver: a [`ErrorKind::KernelLaunch`] with the
    /// shape, or a missing-symbol error about the kernel.
    #[cold]
    pub(crate) fn launch(self, kernel: &str, shape: LaunchShape) -> MetraleError {
        match self {
            CallError::Missing(_) | CallError::InHostFunction => {
                self.about(format_args!("kernel '{kernel}'"))
            }
            CallError::Status { call, status } => ErrorKind::KernelLaunch {
                kernel: kernel.to_owned(),
                shape,
                failure: LaunchFailure::Driver { call, status },
            }
            .into(),
        }
    }
}

impl From<sys::MissingSymbol> for CallError {
    fn from(m: sys::MissingSymbol) -> Self {
        CallError::Missing(m)
    }
}

/// Call a driver function through a table and check its status:
/// `cu!(driver, cuCtxSetCurrent(ctx))` is a `Result<(), CallError>`.
///
/// The macro expands to an `unsafe` call; each use site carries the `// SAFETY:`
/// reasoning for its arguments. On a thread running a host function it returns
/// [`CallError::InHostFunction`] without calling (one thread-local load).
macro_rules! cu {
    ($driver:expr, $func:ident ( $($arg:expr),* $(,)? )) => {
        if $crate::context::in_host_function() {
            // The driver forbids CUDA calls in host functions: refuse, never call.
            Err($crate::error::CallError::InHostFunction)
        } else {
            match $driver.$func() {
                Ok(f) => {
                    let status = f($($arg),*);
                    if status.is_success() {
                        Ok(())
                    } else {
                        Err($crate::error::CallError::Status { call: stringify!($func), status })
                    }
                }
                Err(missing) => Err($crate::error::CallError::Missing(missing)),
            }
        }
    };
}
pub(crate) use cu;

/// Report a failure met while dropping a resource: teardown no-ops are success,
/// anything else is one line on stderr. Never panics.
pub(crate) fn report_drop_failures(what: fmt::Arguments<'_>, failures: &[CallError]) {
    let real: Vec<String> = failures
        .iter()
        .filter(|f| !f.status().is_some_and(is_teardown_noop))
        .map(ToString::to_string)
        .collect();
    if !real.is_empty() {
        report_line(format_args!("{what}: {}", real.join("; ")));
    }
}

/// One line on stderr, `metrale: ...`; a failed write cannot be reported anywhere.
pub(crate) fn report_line(text: fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "metrale: {text}");
}

/// An [`ErrorKind::InvalidArgument`]: input refused before any call, `text` saying
/// which rule it broke.
#[cold]
pub(crate) fn invalid_arg(text: impl Into<String>) -> MetraleError {
    ErrorKind::InvalidArgument(text.into()).into()
}
