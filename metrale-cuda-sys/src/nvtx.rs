//! NVTX v3 (feature `nvtx`): its generated types and the injection loader, the
//! protocol through which a profiling tool (Nsight Systems, or any library that
//! implements it) receives NVTX's calls. Nothing is linked.
//!
//! This module owns the generated types of the pinned NVTX v3 headers (event
//! attributes, domain and string handles, callback ids, the export tables),
//! [`Nvtx`] with one accessor per entry the runtime calls, [`nvtx()`] (the
//! process-wide tables), and [`injection()`] (how attaching a tool went).
//!
//! # The protocol
//! At the first call of any accessor (or of [`injection()`]): when
//! [`INJECTION_PATH_VAR`] names a library, it is loaded and its
//! `InitializeInjectionNvtx2` is called with our `GetExportTable`. The tool asks
//! for export table [`NVTX_ETID_CALLBACKS`](NvtxExportTableID::NVTX_ETID_CALLBACKS)
//! and through its `GetModuleFunctionTable` for each module's table: an array of
//! pointers to our entries, into which it writes its functions (index 0 and the
//! last index are null, as NVTX has them). It may ask for
//! [`NVTX_ETID_VERSIONINFO`](NvtxExportTableID::NVTX_ETID_VERSIONINFO) (our NVTX
//! version, [`NVTX_VERSION`]; its own through `SetInjectionNvtxVersion`, kept in
//! [`tool_version`]). A nonzero return attaches the tool; zero (or no library, no
//! entry point) leaves every entry a no-op.
//!
//! # How it differs from the other loaders
//! The driver, NVRTC, nvJitLink and NCCL are [`Library<T>`](crate::Library)s:
//! their table is filled by `dlsym` from a library we search for, a missing
//! library is a load error and a missing function a missing-symbol error. Here
//! there is no library of NVTX to find: the variable is NVTX's own (not a
//! `METRALE_LIB*_PATH`), no default file is searched, the tool fills the tables
//! instead of `dlsym`, and an empty entry is not an error but a call that does
//! nothing (which is what NVTX promises with no tool attached). What went wrong
//! while attaching is kept as an [`Injection`] value, never returned by a call.
//!
//! # Invariants
//! - Each entry is one atomic pointer. Before the first call it holds a marker
//!   that sends the caller through the one-time attach; after it, the tool's
//!   function or null. So with no tool a call is one atomic load and one branch.
//! - The tool writes into staging tables of ours, copied into the entries once
//!   its `InitializeInjectionNvtx2` returned nonzero (and published before any
//!   caller sees an entry), so no entry is written while another thread reads it.
//!   Writes a tool makes to the tables after its init returned are not seen; the
//!   tables stay allocated for the life of the process, as a tool may keep them.
//! - Attaching runs once per process (other threads wait for it). A call made
//!   from inside the tool's own init (on the attaching thread) is a no-op
//!   instead of a deadlock. A tool that failed to initialise stays loaded (it may
//!   have left threads or handlers behind) and none of its functions is called.
//! - Only the modules' A (char) and Ex entries have accessors; the tables of every
//!   module NVTX v3 defines are served, so a tool that asks for all of them
//!   attaches. Nothing here panics.

use std::cell::Cell;
use std::ffi::{c_int, c_uint, c_void};
use std::fmt;
use std::path::PathBuf;
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
use std::sync::{Once, OnceLock};

generated_bindings!("nvtx_bindings.rs");

pub use bindings::*;

/// The environment variable naming the tool library NVTX loads (the 64-bit one;
/// `NVTX_INJECTION32_PATH` in a 32-bit process, as NVTX does).
#[cfg(target_pointer_width = "64")]
pub const INJECTION_PATH_VAR: &str = "NVTX_INJECTION64_PATH";
/// The environment variable naming the tool library NVTX loads (the 64-bit one;
/// `NVTX_INJECTION32_PATH` in a 32-bit process, as NVTX does).
#[cfg(not(target_pointer_width = "64"))]
pub const INJECTION_PATH_VAR: &str = "NVTX_INJECTION32_PATH";

/// The entry point a tool library exports.
pub const INIT_ENTRY_POINT: &str = "InitializeInjectionNvtx2";

/// What a push or pop returns when no tool tracks nesting
/// (`NVTX_NO_PUSH_POP_TRACKING`).
pub const NO_PUSH_POP_TRACKING: c_int = -2;

/// `NVTX_EVENT_ATTRIB_STRUCT_SIZE`: the `size` field of an event attribute
/// structure of this header.
pub const EVENT_ATTRIB_STRUCT_SIZE: u16 = {
    let size = std::mem::size_of::<nvtxEventAttributes_t>();
    assert!(size <= u16::MAX as usize);
    size as u16
};

/// The marker an entry holds before attaching ran: not null, never a function.
const UNSET: *mut () = ptr::without_provenance_mut(1);

const CORE_SIZE: usize = NvtxCallbackIdCore::NVTX_CBID_CORE_SIZE.0 as usize;
const CORE2_SIZE: usize = NvtxCallbackIdCore2::NVTX_CBID_CORE2_SIZE.0 as usize;
const CUDA_SIZE: usize = NvtxCallbackIdCuda::NVTX_CBID_CUDA_SIZE.0 as usize;
const MODULES: usize = NvtxCallbackModule::NVTX_CB_MODULE_SIZE.0 as usize;

/// The number of entries of each module (index = module id; 0 is invalid).
const MODULE_SIZES: [usize; MODULES] = [
    0,
    CORE_SIZE,
    CUDA_SIZE,
    NvtxCallbackIdOpenCL::NVTX_CBID_OPENCL_SIZE.0 as usize,
    NvtxCallbackIdCudaRt::NVTX_CBID_CUDART_SIZE.0 as usize,
    CORE2_SIZE,
    NvtxCallbackIdSync::NVTX_CBID_SYNC_SIZE.0 as usize,
];

static CORE: [AtomicPtr<()>; CORE_SIZE] = [const { AtomicPtr::new(UNSET) }; CORE_SIZE];
static CORE2: [AtomicPtr<()>; CORE2_SIZE] = [const { AtomicPtr::new(UNSET) }; CORE2_SIZE];
static CUDA: [AtomicPtr<()>; CUDA_SIZE] = [const { AtomicPtr::new(UNSET) }; CUDA_SIZE];

/// The entries of the modules that have accessors, by module id.
fn live(module: usize) -> &'static [AtomicPtr<()>] {
    if module == NvtxCallbackModule::NVTX_CB_MODULE_CORE.0 as usize {
        &CORE
    } else if module == NvtxCallbackModule::NVTX_CB_MODULE_CORE2.0 as usize {
        &CORE2
    } else if module == NvtxCallbackModule::NVTX_CB_MODULE_CUDA.0 as usize {
        &CUDA
    } else {
        &[]
    }
}

static ATTACH: Once = Once::new();
static INJECTION: OnceLock<Injection> = OnceLock::new();
static TOOL_VERSION: AtomicU32 = AtomicU32::new(0);

thread_local! {
    /// Whether this thread is running the tool's init right now.
    static ATTACHING: Cell<bool> = const { Cell::new(false) };
}

/// One module's staging table as handed to the tool.
#[derive(Clone, Copy)]
struct Staged {
    /// `size + 1` pointers to the cells (first and last null).
    table: NvtxFunctionTable,
    /// The cells the tool writes (`size` of them; index 0 unused).
    cells: *mut NvtxFunctionPointer,
    size: usize,
}

/// The staging tables of every module, by module id.
struct Tables([Staged; MODULES]);

// SAFETY: the tables are allocated once, never freed, and read by us only on the
// attaching thread (right after the tool's init returned); the pointers are
// handed to the tool, which is the only other party writing through them.
unsafe impl Send for Tables {}
// SAFETY: as above; sharing the pointers shares no Rust-visible state.
unsafe impl Sync for Tables {}

static TABLES: OnceLock<Tables> = OnceLock::new();

/// Allocate the staging tables (leaked: a tool may keep the pointers).
fn staging() -> Tables {
    let mut staged = [Staged {
        table: ptr::null_mut(),
        cells: ptr::null_mut(),
        size: 0,
    }; MODULES];
    for (module, &size) in MODULE_SIZES.iter().enumerate().skip(1) {
        let cells: &'static mut [NvtxFunctionPointer] =
            Box::leak(vec![None; size].into_boxed_slice());
        let base = cells.as_mut_ptr();
        let mut table: Vec<*mut NvtxFunctionPointer> = vec![ptr::null_mut(); size + 1];
        for (i, slot) in table.iter_mut().enumerate().take(size).skip(1) {
            // SAFETY: `i < size`, inside the cells allocation.
            *slot = unsafe { base.add(i) };
        }
        let table: &'static mut [*mut NvtxFunctionPointer] = Box::leak(table.into_boxed_slice());
        staged[module] = Staged {
            table: table.as_mut_ptr(),
            cells: base,
            size,
        };
    }
    Tables(staged)
}

/// `GetModuleFunctionTable` of our `NVTX_ETID_CALLBACKS` table.
unsafe extern "C" fn get_module_function_table(
    module: NvtxCallbackModule,
    out_table: *mut NvtxFunctionTable,
    out_size: *mut c_uint,
) -> c_int {
    let Some(tables) = TABLES.get() else {
        return 0;
    };
    let index = module.0 as usize;
    let Some(staged) = tables.0.get(index).filter(|s| s.size > 0) else {
        return 0;
    };
    if !out_size.is_null() {
        // SAFETY: the tool passes a writable `unsigned int` or null (checked).
        unsafe { *out_size = staged.size as c_uint };
    }
    if !out_table.is_null() {
        // SAFETY: the tool passes a writable table pointer or null (checked).
        unsafe { *out_table = staged.table };
    }
    1
}

/// `SetInjectionNvtxVersion` of our `NVTX_ETID_VERSIONINFO` table.
unsafe extern "C" fn set_injection_version(version: u32) {
    TOOL_VERSION.store(version, Ordering::Relaxed);
}

static CALLBACKS: NvtxExportTableCallbacks = NvtxExportTableCallbacks {
    struct_size: std::mem::size_of::<NvtxExportTableCallbacks>(),
    GetModuleFunctionTable: Some(get_module_function_table),
};

static VERSION_INFO: NvtxExportTableVersionInfo = NvtxExportTableVersionInfo {
    struct_size: std::mem::size_of::<NvtxExportTableVersionInfo>(),
    version: NVTX_VERSION,
    reserved0: 0,
    SetInjectionNvtxVersion: Some(set_injection_version),
};

/// The `GetExportTable` handed to the tool.
unsafe extern "C" fn get_export_table(id: u32) -> *const c_void {
    if id == NvtxExportTableID::NVTX_ETID_CALLBACKS.0 {
        ptr::from_ref(&CALLBACKS).cast()
    } else if id == NvtxExportTableID::NVTX_ETID_VERSIONINFO.0 {
        ptr::from_ref(&VERSION_INFO).cast()
    } else {
        ptr::null()
    }
}

/// How attaching a tool went; [`injection()`] gives the process's.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Injection {
    /// [`INJECTION_PATH_VAR`] is unset or empty: every call is a no-op.
    NoTool,
    /// The tool's init returned nonzero; its entries are in use.
    Attached {
        /// The library loaded.
        path: PathBuf,
    },
    /// The library could not be loaded (every call is a no-op).
    LoadFailed {
        /// The library named.
        path: PathBuf,
        /// The system loader's message.
        message: String,
    },
    /// The library has no `InitializeInjectionNvtx2` (every call is a no-op).
    MissingEntryPoint {
        /// The library loaded.
        path: PathBuf,
    },
    /// The tool's init returned 0 (every call is a no-op).
    InitFailed {
        /// The library loaded.
        path: PathBuf,
    },
}

impl Injection {
    /// Whether a tool is attached (its entries are called).
    pub fn is_attached(&self) -> bool {
        matches!(self, Injection::Attached { .. })
    }
}

impl fmt::Display for Injection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Injection::NoTool => write!(f, "no NVTX tool ({INJECTION_PATH_VAR} is not set)"),
            Injection::Attached { path } => write!(f, "NVTX tool attached: {}", path.display()),
            Injection::LoadFailed { path, message } => write!(
                f,
                "the NVTX tool {} could not be loaded: {message}",
                path.display()
            ),
            Injection::MissingEntryPoint { path } => write!(
                f,
                "the NVTX tool {} does not export {INIT_ENTRY_POINT}",
                path.display()
            ),
            Injection::InitFailed { path } => {
                write!(f, "the NVTX tool {} failed to initialise", path.display())
            }
        }
    }
}

/// Load the tool and run its init; fill the entries from its staging tables.
fn attach() -> Injection {
    let path = match std::env::var_os(INJECTION_PATH_VAR) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => return Injection::NoTool,
    };
    // SAFETY: loading runs the tool's initialisers; naming a library in
    // NVTX_INJECTION64_PATH is the user asking for exactly that (as NVTX does).
    let lib = match unsafe { libloading::Library::new(&path) } {
        Ok(lib) => lib,
        Err(e) => {
            return Injection::LoadFailed {
                path,
                message: e.to_string(),
            }
        }
    };
    // SAFETY: the entry point's type is NVTX's `NvtxInitializeInjectionNvtxFunc_t`;
    // reading it as `Option` makes a null address `None`.
    let init =
        unsafe { lib.get::<NvtxInitializeInjectionNvtxFunc_t>(b"InitializeInjectionNvtx2\0") }
            .ok()
            .and_then(|s| *s);
    let Some(init) = init else {
        return Injection::MissingEntryPoint { path };
    };
    let tables = TABLES.get_or_init(staging);
    // SAFETY: the tool's entry point, called once with our export-table function,
    // as the protocol has it; its writes go to the staging tables, which live for
    // the process.
    let ok = unsafe { init(Some(get_export_table)) };
    // The library stays loaded for the process, whatever its init said.
    std::mem::forget(lib);
    if ok == 0 {
        return Injection::InitFailed { path };
    }
    for (module, staged) in tables.0.iter().enumerate() {
        for (i, entry) in live(module).iter().enumerate().skip(1) {
            // SAFETY: `i < size` of this module's cells, written by the tool
            // during its init on this thread (which has returned).
            let f = unsafe { staged.cells.add(i).read() };
            entry.store(
                f.map_or(ptr::null_mut(), |f| f as *mut ()),
                Ordering::Release,
            );
        }
    }
    Injection::Attached { path }
}

/// Attach (once per process); every entry is the tool's function or null after.
#[cold]
fn initialize() {
    if ATTACHING.with(Cell::get) {
        return;
    }
    ATTACH.call_once(|| {
        ATTACHING.with(|a| a.set(true));
        let injection = attach();
        for module in 0..MODULES {
            for entry in live(module) {
                // Entries the tool did not fill, or all of them without a tool.
                let _ = entry.compare_exchange(
                    UNSET,
                    ptr::null_mut(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        }
        let _ = INJECTION.set(injection);
        ATTACHING.with(|a| a.set(false));
    });
}

/// How attaching the tool went (attaching first if no call has yet).
pub fn injection() -> &'static Injection {
    initialize();
    // During the tool's own init (on the attaching thread) the answer is not in yet.
    static NOT_YET: Injection = Injection::NoTool;
    INJECTION.get().unwrap_or(&NOT_YET)
}

/// The NVTX version the tool said it implements (`SetInjectionNvtxVersion`), or 0.
pub fn tool_version() -> u32 {
    TOOL_VERSION.load(Ordering::Relaxed)
}

/// The entry's function pointer, or null; attaches on the first call.
#[inline(always)]
fn entry(slot: &AtomicPtr<()>) -> *mut () {
    let f = slot.load(Ordering::Acquire);
    if f != UNSET {
        return f;
    }
    initialize();
    let f = slot.load(Ordering::Acquire);
    if f == UNSET {
        ptr::null_mut()
    } else {
        f
    }
}

/// The process's NVTX entries, one accessor per entry the runtime calls (the C
/// names of NVTX's API). Each returns the tool's function, or `None` when no
/// tool is attached or the tool left that entry empty (the call is then a no-op).
///
/// ```
/// use metrale_cuda_sys::nvtx;
/// if let Some(push) = nvtx::nvtx().nvtxRangePushA() {
///     // SAFETY: a NUL-terminated message.
///     unsafe { push(c"step".as_ptr()) };
/// }
/// ```
#[derive(Debug)]
pub struct Nvtx {
    _private: (),
}

static NVTX: Nvtx = Nvtx { _private: () };

/// The process-wide NVTX entries (free: the tables are statics; the tool is
/// attached at the first accessor call).
#[inline]
pub fn nvtx() -> &'static Nvtx {
    &NVTX
}

macro_rules! accessors {
    ($($table:ident [$id:expr] $name:ident : $ty:ident;)*) => {
        #[allow(non_snake_case)]
        impl Nvtx {
            $(
                #[doc = concat!("`", stringify!($name), "`, or `None` (a no-op).")]
                #[inline(always)]
                pub fn $name(&self) -> $ty {
                    let f = entry(&$table[$id.0 as usize]);
                    // SAFETY: `f` is null or a function the tool wrote into this
                    // entry, which by the protocol has this entry's signature; a
                    // null pointer is `None` (the niche of `Option<fn>`).
                    unsafe { std::mem::transmute::<*mut (), $ty>(f) }
                }
            )*
        }
    };
}

accessors! {
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_MarkEx] nvtxMarkEx: nvtxMarkEx_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_MarkA] nvtxMarkA: nvtxMarkA_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_RangeStartEx] nvtxRangeStartEx: nvtxRangeStartEx_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_RangeStartA] nvtxRangeStartA: nvtxRangeStartA_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_RangeEnd] nvtxRangeEnd: nvtxRangeEnd_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_RangePushEx] nvtxRangePushEx: nvtxRangePushEx_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_RangePushA] nvtxRangePushA: nvtxRangePushA_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_RangePop] nvtxRangePop: nvtxRangePop_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_NameCategoryA] nvtxNameCategoryA: nvtxNameCategoryA_impl_fntype;
    CORE[NvtxCallbackIdCore::NVTX_CBID_CORE_NameOsThreadA] nvtxNameOsThreadA: nvtxNameOsThreadA_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainMarkEx] nvtxDomainMarkEx: nvtxDomainMarkEx_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainRangeStartEx] nvtxDomainRangeStartEx: nvtxDomainRangeStartEx_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainRangeEnd] nvtxDomainRangeEnd: nvtxDomainRangeEnd_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainRangePushEx] nvtxDomainRangePushEx: nvtxDomainRangePushEx_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainRangePop] nvtxDomainRangePop: nvtxDomainRangePop_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainNameCategoryA] nvtxDomainNameCategoryA: nvtxDomainNameCategoryA_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainRegisterStringA] nvtxDomainRegisterStringA: nvtxDomainRegisterStringA_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainCreateA] nvtxDomainCreateA: nvtxDomainCreateA_impl_fntype;
    CORE2[NvtxCallbackIdCore2::NVTX_CBID_CORE2_DomainDestroy] nvtxDomainDestroy: nvtxDomainDestroy_impl_fntype;
    CUDA[NvtxCallbackIdCuda::NVTX_CBID_CUDA_NameCuDeviceA] nvtxNameCuDeviceA: nvtxNameCuDeviceA_fakeimpl_fntype;
    CUDA[NvtxCallbackIdCuda::NVTX_CBID_CUDA_NameCuContextA] nvtxNameCuContextA: nvtxNameCuContextA_fakeimpl_fntype;
    CUDA[NvtxCallbackIdCuda::NVTX_CBID_CUDA_NameCuStreamA] nvtxNameCuStreamA: nvtxNameCuStreamA_fakeimpl_fntype;
    CUDA[NvtxCallbackIdCuda::NVTX_CBID_CUDA_NameCuEventA] nvtxNameCuEventA: nvtxNameCuEventA_fakeimpl_fntype;
}
