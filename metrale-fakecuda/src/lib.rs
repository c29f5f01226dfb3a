//! A stand-in for the CUDA driver library, for tests on machines without a GPU.
//!
//! The C library (`src/fakecuda.c`, built by `build.rs`) exports the driver entry
//! points metrale's runtime uses, by their real names, and behaves like a tiny,
//! honest driver: handles are heap objects checked against a live table, copies
//! copy, launches are recorded. [`Fake`] drives its failure injection through
//! exported `fakecuda_*` functions. Tests load the library through the same
//! loader users use (`METRALE_LIBCUDA_PATH` or `Driver::load_from`); nothing in
//! the shipped crates knows about it. Not published.

use std::ffi::{c_char, c_int, c_long, c_longlong, c_uint, c_ulonglong, c_void, CString};
use std::path::Path;

/// Path of the full stand-in library.
pub fn library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakecuda.so"))
}

/// Path of the stand-in built as an old driver: it lacks `cuModuleGetGlobal_v2`,
/// `cuLaunchKernelEx`, `cuModuleGetFunctionCount`, `cuModuleEnumerateFunctions`,
/// `cuFuncGetName`, `cuFuncGetParamInfo`, `cuCtxGetId`, the library API
/// (`cuLibrary*`, `cuKernel*`), stream-ordered allocation and pools (and reports
/// `CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED` as 0), `cuMemPrefetchAsync_v2`
/// conditional graph nodes, tensor maps and green contexts.
pub fn old_library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakecuda_old.so"))
}

/// Path of the stand-in NCCL (`src/fakenccl.c`): ranks as threads of one
/// process, collectives computed on the stand-in driver's memory. It finds the
/// stand-in driver through `METRALE_LIBCUDA_PATH` (to hold streams while a
/// collective waits for its peers), so set both.
pub fn nccl_library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakenccl.so"))
}

/// Path of the stand-in NCCL built as NCCL 2.26.5: it lacks `ncclAlltoAll`,
/// `ncclGather`, `ncclScatter`, `ncclCommRevoke` and `ncclCommShrink` (the
/// window calls stay, so a version gate is what refuses them).
pub fn nccl_old_library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakenccl_old.so"))
}

/// Path of the stand-in NVTX tool (`src/fakenvtx.c`): name it in
/// `NVTX_INJECTION64_PATH`; it attaches and records every call ([`FakeNvtx`]).
pub fn nvtx_library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakenvtx.so"))
}

/// Path of the stand-in NVTX tool built to fail: it fills the tables, then its
/// `InitializeInjectionNvtx2` returns 0 (so none of its entries may be called).
pub fn nvtx_failing_library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakenvtx_fail.so"))
}

/// Path of the stand-in NVTX tool built hostile (`-DFAKENVTX_HOSTILE`): its init
/// asks for tables with null out-pointers and unknown ids, calls the hook set
/// with [`FakeNvtx::set_init_hook`], and clears the CORE mark entries; after
/// it, each push writes another pop into the CORE table.
pub fn nvtx_hostile_library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakenvtx_hostile.so"))
}

/// Path of the stand-in cuBLAS and cuBLASLt (`src/fakeblas.c`): one library
/// exporting both APIs (point `METRALE_LIBCUBLASLT_PATH` and
/// `METRALE_LIBCUBLAS_PATH` at it), GEMMs computed on the host over the stand-in
/// driver's memory, a scripted heuristic and a record of every GEMM call. It
/// finds the stand-in driver through `METRALE_LIBCUDA_PATH` (to read the current
/// device and context and whether a stream is being captured), so set that too.
pub fn blas_library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakeblas.so"))
}

/// Path of the stand-in cuBLAS built as release 12.4.0: it lacks
/// `cublasGemmGroupedBatchedEx` (added in 12.5).
pub fn old_blas_library_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/libmetrale_fakeblas_old.so"))
}

/// What [`Fake::live`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Live {
    /// Loaded modules.
    Modules = 1,
    /// Kernel handles of loaded modules.
    Functions = 2,
    /// Created streams.
    Streams = 3,
    /// Device allocations.
    DeviceMemory = 4,
    /// Pinned host allocations.
    HostMemory = 5,
    /// Created events.
    Events = 6,
    /// Loaded libraries.
    Libraries = 7,
    /// Kernel handles of loaded libraries.
    Kernels = 8,
    /// Created memory pools.
    Pools = 9,
    /// Graphs.
    Graphs = 10,
    /// Executable graphs.
    Execs = 11,
    /// Graph nodes.
    Nodes = 12,
    /// Green contexts.
    GreenContexts = 13,
    /// Physical memory (`cuMemCreate`, imports) not yet released and unmapped.
    PhysicalMemory = 15,
    /// Reserved address ranges (`cuMemAddressReserve`).
    ReservedRanges = 16,
    /// Mappings (`cuMemMap`).
    Mappings = 17,
}

/// The last launch the stand-in accepted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Launch {
    /// Kernel name.
    pub kernel: String,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared: u32,
    /// Parameter count declared by the kernel.
    pub params: u32,
    /// Cluster dimensions (`cuLaunchKernelEx`), zero when none.
    pub cluster: [u32; 3],
    /// Whether the cooperative attribute was set.
    pub cooperative: bool,
}

/// Handle on the stand-in's control functions, for a library already loaded in
/// this process (dlopen of the same path gives the same instance and state).
pub struct Fake {
    lib: libloading::Library,
}

macro_rules! call {
    ($self:ident, $name:literal, $ty:ty $(, $arg:expr)*) => {{
        // SAFETY: the symbol is one of the fakecuda_* exports of fakecuda.c and
        // `$ty` is its C signature.
        unsafe {
            match $self.lib.get::<$ty>(concat!($name, "\0").as_bytes()) {
                Ok(f) => f($($arg),*),
                Err(e) => panic!("fakecuda control `{}` missing: {e}", $name),
            }
        }
    }};
}

#[allow(clippy::missing_panics_doc, clippy::panic, clippy::unnecessary_cast)]
impl Fake {
    /// Open the control interface of the library at `path`.
    ///
    /// # Panics
    /// When the library cannot be opened (a broken build of this test crate).
    pub fn open(path: &Path) -> Fake {
        // SAFETY: the stand-in's initialisers do nothing.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => Fake { lib },
            Err(e) => panic!("cannot open {}: {e}", path.display()),
        }
    }

    /// Forget injected failures, call counts, the last launch, and shut-down mode.
    pub fn reset(&self) {
        call!(self, "fakecuda_reset", unsafe extern "C" fn());
    }

    /// Make `call` return `status` from its `from_call`-th next call on (1: the next
    /// one), for `times` calls, or for ever when `times` is `None`.
    pub fn fail(&self, call: &str, status: u32, from_call: i64, times: Option<i64>) {
        let name = CString::new(call).unwrap_or_default();
        call!(
            self,
            "fakecuda_fail",
            unsafe extern "C" fn(*const c_char, c_int, c_long, c_long),
            name.as_ptr(),
            status as c_int,
            from_call as c_long,
            times.unwrap_or(-1) as c_long
        );
    }

    /// Make the next call of `call` wait inside the stand-in (its lock released,
    /// so other threads' calls go on) until [`Fake::resume`]: a test's pause
    /// point between two steps of the runtime.
    pub fn pause_next(&self, call: &str) {
        let name = CString::new(call).unwrap_or_default();
        call!(
            self,
            "fakecuda_pause_next",
            unsafe extern "C" fn(*const c_char),
            name.as_ptr()
        );
    }

    /// Wait up to `ms` milliseconds for a call of `call` to be paused there;
    /// whether one is.
    pub fn wait_paused(&self, call: &str, ms: i64) -> bool {
        let name = CString::new(call).unwrap_or_default();
        call!(
            self,
            "fakecuda_wait_paused",
            unsafe extern "C" fn(*const c_char, c_long) -> c_int,
            name.as_ptr(),
            ms as c_long
        ) != 0
    }

    /// Let the paused call of `call` go on (and disarm a pause not yet met).
    pub fn resume(&self, call: &str) {
        let name = CString::new(call).unwrap_or_default();
        call!(
            self,
            "fakecuda_resume",
            unsafe extern "C" fn(*const c_char),
            name.as_ptr()
        );
    }

    /// Switch "driver shut down" on or off: while on, every call returns
    /// `CUDA_ERROR_DEINITIALIZED`.
    pub fn shutdown(&self, on: bool) {
        call!(
            self,
            "fakecuda_shutdown",
            unsafe extern "C" fn(c_int),
            c_int::from(on)
        );
    }

    /// The version `cuDriverGetVersion` reports (default 13000).
    pub fn set_driver_version(&self, version: i32) {
        call!(
            self,
            "fakecuda_set_driver_version",
            unsafe extern "C" fn(c_int),
            version
        );
    }

    /// Whether `cuGetErrorName`/`cuGetErrorString` know any status.
    pub fn set_error_strings(&self, on: bool) {
        call!(
            self,
            "fakecuda_set_error_strings",
            unsafe extern "C" fn(c_int),
            c_int::from(on)
        );
    }

    /// How many times `call` was made since the last reset.
    pub fn calls(&self, call: &str) -> i64 {
        let name = CString::new(call).unwrap_or_default();
        let n: c_long = call!(
            self,
            "fakecuda_calls",
            unsafe extern "C" fn(*const c_char) -> c_long,
            name.as_ptr()
        );
        n as i64
    }

    /// How many legacy IPC memory handles are open (`cuIpcOpenMemHandle` not yet
    /// closed).
    pub fn ipc_open(&self) -> i32 {
        call!(
            self,
            "fakecuda_ipc_open_count",
            unsafe extern "C" fn() -> c_int
        )
    }

    /// How many objects of a kind are alive.
    pub fn live(&self, what: Live) -> i32 {
        call!(
            self,
            "fakecuda_live",
            unsafe extern "C" fn(c_int) -> c_int,
            what as c_int
        )
    }

    /// Retain count of the primary contexts of all devices together.
    pub fn primary_refs(&self) -> i32 {
        call!(
            self,
            "fakecuda_primary_refs",
            unsafe extern "C" fn() -> c_int
        )
    }

    /// Retain count of device `dev`'s primary context.
    pub fn device_refs(&self, dev: i32) -> i32 {
        call!(
            self,
            "fakecuda_device_refs",
            unsafe extern "C" fn(c_int) -> c_int,
            dev
        )
    }

    /// Make stream memory operations and host functions refuse unless the
    /// stream's context is current (`CUDA_ERROR_INVALID_CONTEXT` with none,
    /// `CUDA_ERROR_INVALID_HANDLE` with another), as an older driver might;
    /// until the next reset.
    pub fn set_stream_ctx_strict(&self, on: bool) {
        call!(
            self,
            "fakecuda_set_stream_ctx_strict",
            unsafe extern "C" fn(c_int),
            c_int::from(on)
        );
    }

    /// Make `cuCtxSynchronize` also wait while the stand-in NCCL holds a
    /// stream of the device (a collective not yet complete), as the driver
    /// waits for NCCL's kernels; until the next reset.
    pub fn set_ctx_sync_waits_holds(&self, on: bool) {
        call!(
            self,
            "fakecuda_set_ctx_sync_waits_holds",
            unsafe extern "C" fn(c_int),
            c_int::from(on)
        );
    }

    /// How many devices `cuDeviceGetCount` reports (0..=2; default 2).
    pub fn set_device_count(&self, n: i32) {
        call!(
            self,
            "fakecuda_set_device_count",
            unsafe extern "C" fn(c_int),
            n
        );
    }

    /// Make `cuDeviceGetAttribute(attr, dev)` report `value` (until the next reset).
    pub fn set_attribute(&self, dev: i32, attr: i32, value: i32) {
        call!(
            self,
            "fakecuda_set_attribute",
            unsafe extern "C" fn(c_int, c_int, c_int),
            dev,
            attr,
            value
        );
    }

    /// Device-to-host copies queued on `stream` that the copy engine has not
    /// written yet (-1 for an unknown stream).
    pub fn pending(&self, stream: *mut c_void) -> i32 {
        call!(
            self,
            "fakecuda_pending",
            unsafe extern "C" fn(*mut c_void) -> c_int,
            stream
        )
    }

    /// Host functions and memory operations queued on `stream` (null: the legacy
    /// stream) that its worker thread has not run yet.
    pub fn jobs_pending(&self, stream: *mut c_void) -> i64 {
        call!(
            self,
            "fakecuda_jobs_pending",
            unsafe extern "C" fn(*mut c_void) -> c_long,
            stream
        ) as i64
    }

    /// The stream of the last `cuMemFreeAsync`.
    pub fn last_free_stream(&self) -> *mut c_void {
        call!(
            self,
            "fakecuda_last_free_stream",
            unsafe extern "C" fn() -> *mut c_void
        )
    }

    /// The device of the last prefetch (-1: the host; -99: none).
    pub fn last_prefetch_device(&self) -> i32 {
        call!(
            self,
            "fakecuda_last_prefetch_device",
            unsafe extern "C" fn() -> c_int
        )
    }

    /// The calling thread's current context (null: none).
    pub fn current_context(&self) -> *mut c_void {
        call!(
            self,
            "fakecuda_current_context",
            unsafe extern "C" fn() -> *mut c_void
        )
    }

    /// How many calls were given a handle that a context reset destroyed (a real
    /// driver may crash on those).
    pub fn stale_uses(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakecuda_stale_uses",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// The stream of the last accepted launch.
    pub fn last_launch_stream(&self) -> *mut c_void {
        call!(
            self,
            "fakecuda_last_launch_stream",
            unsafe extern "C" fn() -> *mut c_void
        )
    }

    /// Launches accepted since the last reset.
    pub fn launches(&self) -> i64 {
        let n: c_long = call!(self, "fakecuda_launches", unsafe extern "C" fn() -> c_long);
        n as i64
    }

    /// The last accepted launch.
    pub fn last_launch(&self) -> Launch {
        let mut name = [0u8; 128];
        let mut dims = [0 as c_uint; 12];
        call!(
            self,
            "fakecuda_last_launch",
            unsafe extern "C" fn(*mut c_char, usize, *mut c_uint),
            name.as_mut_ptr().cast(),
            name.len(),
            dims.as_mut_ptr()
        );
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        Launch {
            kernel: String::from_utf8_lossy(&name[..end]).into_owned(),
            grid: [dims[0], dims[1], dims[2]],
            block: [dims[3], dims[4], dims[5]],
            shared: dims[6],
            params: dims[7],
            cluster: [dims[8], dims[9], dims[10]],
            cooperative: dims[11] != 0,
        }
    }

    /// Live user objects (`cuUserObjectCreate`, not yet released by every
    /// holder: their creator, graphs, executable graphs, replays in flight).
    pub fn user_objects(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakecuda_user_objects",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// Replayed kernels that ran (queued behind jobs of their stream) after
    /// their module or library had been unloaded.
    pub fn kernels_run_unloaded(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakecuda_kernels_run_unloaded",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// Green contexts destroyed while streams made on them were still alive.
    pub fn green_orphans(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakecuda_green_orphans",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// The green context a live stream was made on (null for other streams).
    pub fn stream_green(&self, stream: *mut c_void) -> *mut c_void {
        call!(
            self,
            "fakecuda_stream_green",
            unsafe extern "C" fn(*mut c_void) -> *mut c_void,
            stream
        )
    }

    /// The first 8 bytes (zero-padded, native order) of parameter `i` of the last launch.
    pub fn last_param(&self, i: i32) -> u64 {
        call!(
            self,
            "fakecuda_last_param",
            unsafe extern "C" fn(c_int) -> c_ulonglong,
            i
        )
    }

    /// The dynamic shared memory limit set on a kernel handle, or -1 when unknown.
    pub fn func_max_dynamic_shared(&self, func: *mut c_void) -> i32 {
        call!(
            self,
            "fakecuda_func_max_dynamic_shared",
            unsafe extern "C" fn(*mut c_void) -> c_int,
            func
        )
    }
}

/// Handle on the stand-in NCCL's control functions, for a library already loaded
/// in this process.
pub struct FakeNccl {
    lib: libloading::Library,
}

#[allow(clippy::missing_panics_doc, clippy::panic, clippy::unnecessary_cast)]
impl FakeNccl {
    /// Open the control interface of the stand-in NCCL at `path`.
    ///
    /// # Panics
    /// When the library cannot be opened (a broken build of this test crate).
    pub fn open(path: &Path) -> FakeNccl {
        // SAFETY: the stand-in's initialisers do nothing.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => FakeNccl { lib },
            Err(e) => panic!("cannot open {}: {e}", path.display()),
        }
    }

    /// Clear call counts, injected failures, hang, in-progress polls, timeout
    /// (10 s) and the version (2.28.9).
    pub fn reset(&self) {
        call!(self, "fakenccl_reset", unsafe extern "C" fn());
    }

    /// Make `call` return `status` from its `from_call`-th call on (1-based), for
    /// `times` calls, or for ever with `None`.
    pub fn fail(&self, call: &str, status: u32, from_call: i64, times: Option<i64>) {
        let name = CString::new(call).unwrap_or_default();
        call!(
            self,
            "fakenccl_fail",
            unsafe extern "C" fn(*const c_char, c_int, c_long, c_long),
            name.as_ptr(),
            status as c_int,
            from_call as c_long,
            times.unwrap_or(-1) as c_long
        );
    }

    /// How many times `call` was made since the last reset.
    pub fn calls(&self, call: &str) -> i64 {
        let name = CString::new(call).unwrap_or_default();
        let n: c_long = call!(
            self,
            "fakenccl_calls",
            unsafe extern "C" fn(*const c_char) -> c_long,
            name.as_ptr()
        );
        n as i64
    }

    /// Live communicators.
    pub fn live(&self) -> i32 {
        call!(self, "fakenccl_live", unsafe extern "C" fn() -> c_int)
    }

    /// Blocking finalizes or destroys made while operations were pending (a real
    /// library would have blocked there, maybe for ever).
    pub fn would_hang(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakenccl_would_hang",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// Operations never complete while on (a dead peer, a kernel that spins).
    pub fn set_hang(&self, on: bool) {
        call!(
            self,
            "fakenccl_set_hang",
            unsafe extern "C" fn(c_int),
            c_int::from(on)
        );
    }

    /// Non-blocking communicators answer `ncclInProgress` this many times after
    /// each operation before `ncclSuccess`.
    pub fn set_inprogress_polls(&self, n: i32) {
        call!(
            self,
            "fakenccl_set_inprogress_polls",
            unsafe extern "C" fn(c_int),
            n
        );
    }

    /// How long a blocking init waits for its peers.
    pub fn set_timeout_ms(&self, ms: i64) {
        call!(
            self,
            "fakenccl_set_timeout_ms",
            unsafe extern "C" fn(c_long),
            ms as c_long
        );
    }

    /// The code `ncclGetVersion` answers.
    pub fn set_version(&self, code: i32) {
        call!(
            self,
            "fakenccl_set_version",
            unsafe extern "C" fn(c_int),
            code
        );
    }

    /// `ncclCommGetAsyncError` on a communicator of a shared split sleeps this
    /// long outside the stand-in's lock (0: not at all).
    pub fn set_call_delay_us(&self, us: i64) {
        call!(
            self,
            "fakenccl_set_call_delay_us",
            unsafe extern "C" fn(c_long),
            us as c_long
        )
    }

    /// `ncclCommAbort` first sleeps this long, outside the stand-in's lock (as
    /// NCCL's abort waits for the device's queued work); 0: not at all.
    pub fn set_abort_delay_us(&self, us: i64) {
        call!(
            self,
            "fakenccl_set_abort_delay_us",
            unsafe extern "C" fn(c_long),
            us as c_long
        )
    }

    /// How many calls on a shared split overlapped another one (NCCL forbids it).
    pub fn shared_overlaps(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakenccl_shared_overlaps",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// The `commName` `comm` was made with, read through the pointer the
    /// stand-in kept (as NCCL keeps it); `None` without one.
    pub fn comm_name(&self, comm: *mut c_void) -> Option<String> {
        let p: *const std::ffi::c_char = call!(
            self,
            "fakenccl_comm_name",
            unsafe extern "C" fn(*mut c_void) -> *const std::ffi::c_char,
            comm
        );
        if p.is_null() {
            return None;
        }
        // SAFETY: the pointer the runtime handed NCCL as commName, which it keeps
        // alive as long as the communicator; read at once.
        Some(
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// Make `comm` report `status` from `ncclCommGetAsyncError` (and refuse new
    /// work with it).
    pub fn set_async_error(&self, comm: *mut c_void, status: i32) {
        call!(
            self,
            "fakenccl_set_async_error",
            unsafe extern "C" fn(*mut c_void, c_int),
            comm,
            status
        );
    }

    /// Live `ncclMemAlloc` allocations.
    pub fn mem_live(&self) -> i64 {
        let n: c_long = call!(self, "fakenccl_mem_live", unsafe extern "C" fn() -> c_long);
        n as i64
    }

    /// Live buffer registrations (`ncclCommRegister` not yet deregistered).
    pub fn registrations(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakenccl_registrations",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// Live windows (`ncclCommWindowRegister` not yet deregistered).
    pub fn windows(&self) -> i64 {
        let n: c_long = call!(self, "fakenccl_windows", unsafe extern "C" fn() -> c_long);
        n as i64
    }

    /// Registrations and windows still live when their communicator was
    /// destroyed or aborted, since the last reset (should stay 0).
    pub fn orphaned_registrations(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakenccl_orphaned_registrations",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// Live pre-multiplied-sum operations (`ncclRedOpCreatePreMulSum` not yet
    /// destroyed, nor freed with their communicator).
    pub fn premul_live(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakenccl_premul_live",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// `ncclCommWindowDeregister` first sleeps this long, outside the
    /// stand-in's lock (a peer late to the collective deregistration); 0: not
    /// at all.
    pub fn set_window_deregister_delay_us(&self, us: i64) {
        call!(
            self,
            "fakenccl_set_window_deregister_delay_us",
            unsafe extern "C" fn(c_long),
            us as c_long
        );
    }

    /// Kill `comm`'s rank mid-run: its calls fail from now on, and every other
    /// rank of its communicator reports `ncclRemoteError` (a peer died).
    pub fn kill(&self, comm: *mut c_void) {
        call!(
            self,
            "fakenccl_kill",
            unsafe extern "C" fn(*mut c_void),
            comm
        );
    }

    /// Operations of `comm` not yet complete (-1 for an unknown handle).
    pub fn pending(&self, comm: *mut c_void) -> i32 {
        call!(
            self,
            "fakenccl_pending",
            unsafe extern "C" fn(*mut c_void) -> c_int,
            comm
        )
    }
}
/// What the stand-in's `cuTensorMapEncodeTiled` received, read back from the 128
/// bytes it wrote (its "encoding" is its arguments).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EncodedTensorMap {
    /// Whether the bytes carry the stand-in's mark (an encoded map).
    pub valid: bool,
    /// `CUtensorMapDataType` value.
    pub data_type: u32,
    /// Rank.
    pub rank: u32,
    /// Global address.
    pub address: u64,
    /// Sizes (rank of them).
    pub dims: Vec<u64>,
    /// Byte strides (rank - 1).
    pub strides: Vec<u64>,
    /// Box sizes (rank).
    pub box_dims: Vec<u32>,
    /// Element strides (rank).
    pub element_strides: Vec<u32>,
    /// Interleave, swizzle, L2 promotion, OOB fill values.
    pub modes: [u32; 4],
    /// Whether `cuTensorMapEncodeIm2col` or `cuTensorMapEncodeIm2colWide` made
    /// it (then `box_dims` are ones).
    pub im2col: bool,
    /// Whether `cuTensorMapEncodeIm2colWide` made it (then `lower` and `upper`
    /// hold one width offset each).
    pub wide: bool,
    /// A wide map's `CUtensorMapIm2ColWideMode` value.
    pub wide_mode: u32,
    /// Im2col: the pixel box's lower corners (rank - 2).
    pub lower: Vec<i32>,
    /// Im2col: the pixel box's upper corners (rank - 2).
    pub upper: Vec<i32>,
    /// Im2col: channels per pixel.
    pub channels_per_pixel: u32,
    /// Im2col: pixels per column.
    pub pixels_per_column: u32,
}

/// Decode a map the stand-in encoded.
pub fn decode_tensor_map(q: &[u64; 16]) -> EncodedTensorMap {
    let rank = ((q[0] >> 40) & 0xff) as usize;
    if q[0] & 0xffff_ffff != 0x5041_4d54 || !(1..=5).contains(&rank) {
        return EncodedTensorMap::default();
    }
    let field = |shift: u32, mask: u64| ((q[0] >> shift) & mask) as u32;
    EncodedTensorMap {
        valid: true,
        data_type: field(32, 0xff),
        rank: rank as u32,
        address: q[1],
        dims: q[2..2 + rank].to_vec(),
        strides: q[7..7 + rank - 1].to_vec(),
        box_dims: (0..rank)
            .map(|i| {
                let (word, shift) = if i < 4 { (q[11], 16 * i) } else { (q[12], 0) };
                ((word >> shift) & 0xffff) as u32
            })
            .collect(),
        element_strides: (0..rank)
            .map(|i| ((q[12] >> (16 + 8 * i)) & 0xff) as u32)
            .collect(),
        modes: [
            field(48, 0xf),
            field(52, 0xf),
            field(56, 0xf),
            field(60, 0xf),
        ],
        im2col: matches!(q[15] & 0xf, 1 | 2),
        wide: q[15] & 0xf == 2,
        wide_mode: ((q[15] >> 4) & 0xf) as u32,
        lower: corners(q[13], if q[15] & 0xf == 2 { 3 } else { rank }),
        upper: corners(q[14], if q[15] & 0xf == 2 { 3 } else { rank }),
        channels_per_pixel: ((q[15] >> 8) & 0xff_ffff) as u32,
        pixels_per_column: (q[15] >> 32) as u32,
    }
}

/// Im2col corners: rank - 2 signed 16-bit fields.
fn corners(word: u64, rank: usize) -> Vec<i32> {
    (0..rank.saturating_sub(2))
        .map(|i| i32::from(((word >> (16 * i)) & 0xffff) as u16 as i16))
        .collect()
}

/// What kind of call a [`NvtxRecord`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum NvtxKind {
    /// A mark (core or domain).
    Mark = 1,
    /// A start/end range started.
    RangeStart = 2,
    /// A start/end range ended (`handle` is its id).
    RangeEnd = 3,
    /// A range pushed (`level` is what the push returned).
    Push = 4,
    /// A range popped (`level` is what the pop returned).
    Pop = 5,
    /// A category named.
    NameCategory = 6,
    /// An OS thread named (`handle` is the thread id).
    NameThread = 7,
    /// A domain created (`domain` is its handle).
    DomainCreate = 8,
    /// A domain destroyed.
    DomainDestroy = 9,
    /// A string registered (`handle` is its handle).
    RegisterString = 10,
    /// A device named (`handle` is the ordinal).
    NameDevice = 11,
    /// A context named (`handle` is the `CUcontext`).
    NameContext = 12,
    /// A stream named (`handle` is the `CUstream`).
    NameStream = 13,
    /// An event named (`handle` is the `CUevent`).
    NameEvent = 14,
}

/// One call the stand-in NVTX tool received (the layout of `record` in
/// `fakenvtx.c`).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct NvtxRecord {
    /// [`NvtxKind`] as a number.
    pub kind: i32,
    /// What a push or pop returned.
    pub level: i32,
    /// The domain handle, 0 for the core calls.
    pub domain: u64,
    /// Range id, thread id, device, context, stream or event.
    pub handle: u64,
    /// The category.
    pub category: u32,
    /// The attributes' color type (1: ARGB).
    pub color_type: i32,
    /// The color.
    pub color: u32,
    /// The payload type (NVTX's numbers).
    pub payload_type: i32,
    /// The payload union's 8 bytes.
    pub payload: u64,
    /// The message type (1: ASCII, 3: registered).
    pub message_type: i32,
    /// The attributes' `size` field (0 for a call without attributes).
    pub attributes_size: i32,
    message: [u8; 120],
}

impl NvtxRecord {
    /// The kind, if it is one the stand-in records.
    pub fn kind(&self) -> Option<NvtxKind> {
        use NvtxKind::*;
        [
            Mark,
            RangeStart,
            RangeEnd,
            Push,
            Pop,
            NameCategory,
            NameThread,
            DomainCreate,
            DomainDestroy,
            RegisterString,
            NameDevice,
            NameContext,
            NameStream,
            NameEvent,
        ]
        .into_iter()
        .find(|k| *k as i32 == self.kind)
    }

    /// The message (a registered string resolved), up to its first NUL.
    pub fn message(&self) -> String {
        let end = self
            .message
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.message.len());
        String::from_utf8_lossy(&self.message[..end]).into_owned()
    }
}

impl std::fmt::Debug for NvtxRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvtxRecord")
            .field("kind", &self.kind())
            .field("level", &self.level)
            .field("domain", &self.domain)
            .field("handle", &self.handle)
            .field("category", &self.category)
            .field("color_type", &self.color_type)
            .field("color", &self.color)
            .field("payload_type", &self.payload_type)
            .field("payload", &self.payload)
            .field("message_type", &self.message_type)
            .field("message", &self.message())
            .finish()
    }
}

/// Handle on the stand-in NVTX tool's records, for a tool already attached in
/// this process (dlopen of the same path gives the same instance).
pub struct FakeNvtx {
    lib: libloading::Library,
}

#[allow(clippy::missing_panics_doc, clippy::panic, clippy::unnecessary_cast)]
impl FakeNvtx {
    /// Open the record interface of the stand-in tool at `path`.
    ///
    /// # Panics
    /// When the library cannot be opened or its record layout differs from
    /// [`NvtxRecord`] (a broken build of this test crate).
    pub fn open(path: &Path) -> FakeNvtx {
        // SAFETY: the stand-in's initialisers do nothing.
        let fake = match unsafe { libloading::Library::new(path) } {
            Ok(lib) => FakeNvtx { lib },
            Err(e) => panic!("cannot open {}: {e}", path.display()),
        };
        let size = call!(
            fake,
            "fakenvtx_record_size",
            unsafe extern "C" fn() -> usize
        );
        assert_eq!(
            size,
            std::mem::size_of::<NvtxRecord>(),
            "fakenvtx record layout"
        );
        fake
    }

    /// The hostile build only: run `hook` inside the tool's init (a call
    /// back into the process while the tool attaches).
    pub fn set_init_hook(&self, hook: extern "C" fn()) {
        call!(
            self,
            "fakenvtx_set_init_hook",
            unsafe extern "C" fn(extern "C" fn()),
            hook
        );
    }

    /// The hostile build only: requests the caller should have refused but
    /// did not (an unknown module or export table answered).
    pub fn hostile_surprises(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakenvtx_hostile_surprises",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// The hostile build only: calls of the pop written into the table after
    /// the init (the caller must never make one).
    pub fn redirected_pops(&self) -> i64 {
        let n: c_long = call!(
            self,
            "fakenvtx_redirected_pops",
            unsafe extern "C" fn() -> c_long
        );
        n as i64
    }

    /// Every call received since the last [`reset`](FakeNvtx::reset).
    pub fn count(&self) -> i64 {
        call!(self, "fakenvtx_count", unsafe extern "C" fn() -> i64)
    }

    /// The calls recorded since the last reset (the first 4096), in order.
    pub fn records(&self) -> Vec<NvtxRecord> {
        let n = self.count();
        let mut out = Vec::new();
        for i in 0..n {
            let mut r = std::mem::MaybeUninit::<NvtxRecord>::uninit();
            let ok = call!(
                self,
                "fakenvtx_record",
                unsafe extern "C" fn(i64, *mut NvtxRecord) -> c_int,
                i,
                r.as_mut_ptr()
            );
            if ok == 0 {
                break;
            }
            // SAFETY: fakenvtx_record wrote the whole record (it returned 1).
            out.push(unsafe { r.assume_init() });
        }
        out
    }

    /// Forget the records (domains, depths and range ids stay).
    pub fn reset(&self) {
        call!(self, "fakenvtx_reset", unsafe extern "C" fn());
    }

    /// The calling thread's push depth in `domain` (null: the core); -1 for a
    /// domain the tool never created.
    pub fn depth(&self, domain: *const c_void) -> i32 {
        call!(
            self,
            "fakenvtx_depth",
            unsafe extern "C" fn(*const c_void) -> c_int,
            domain
        )
    }

    /// The name `domain` was created with, if the tool created it.
    pub fn domain_name(&self, domain: *const c_void) -> Option<String> {
        let mut buf = [0u8; 120];
        let ok = call!(
            self,
            "fakenvtx_domain_name",
            unsafe extern "C" fn(*const c_void, *mut c_char, usize) -> c_int,
            domain,
            buf.as_mut_ptr().cast(),
            buf.len()
        );
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        (ok != 0).then(|| String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    /// How many times `InitializeInjectionNvtx2` ran.
    pub fn inits(&self) -> i32 {
        call!(self, "fakenvtx_inits", unsafe extern "C" fn() -> c_int)
    }

    /// The NVTX version the application's version-info table gave.
    pub fn app_version(&self) -> u32 {
        call!(
            self,
            "fakenvtx_app_version",
            unsafe extern "C" fn() -> c_uint
        )
    }

    /// The size the application gave for module `module`'s table (0 if not asked).
    pub fn module_size(&self, module: i32) -> i32 {
        call!(
            self,
            "fakenvtx_module_size",
            unsafe extern "C" fn(c_int) -> c_int,
            module
        )
    }
}

/// One GEMM call the stand-in cuBLAS or cuBLASLt received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlasRecord {
    /// The entry point (`cublasLtMatmul`, `cublasGemmEx`, ...).
    pub call: String,
    /// The workspace pointer it was given (for cuBLAS: the handle's).
    pub workspace: u64,
    /// The workspace size it was given.
    pub workspace_size: usize,
    /// The stream (for cuBLAS: the handle's).
    pub stream: *mut c_void,
    /// The stand-in driver's current context during the call.
    pub context: *mut c_void,
    /// Whether the stream was being captured.
    pub capturing: bool,
    /// The algorithm's id (its first word: 1000 + heuristic index), -1 for none.
    pub algo: i64,
    /// The current device during the call.
    pub device: i32,
}

/// What [`FakeBlas::live`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum BlasLive {
    /// cuBLASLt handles.
    LtHandles = 1,
    /// cuBLAS handles.
    Handles = 2,
    /// Matmul descriptors.
    Descriptors = 3,
    /// Matrix layouts.
    Layouts = 4,
    /// Matmul preferences.
    Preferences = 5,
}

/// Handle on the stand-in cuBLAS/cuBLASLt's control functions, for a library
/// already loaded in this process.
pub struct FakeBlas {
    lib: libloading::Library,
}

#[allow(clippy::missing_panics_doc, clippy::panic, clippy::unnecessary_cast)]
impl FakeBlas {
    /// Open the control interface of the stand-in at `path`.
    ///
    /// # Panics
    /// When the library cannot be opened (a broken build of this test crate).
    pub fn open(path: &Path) -> FakeBlas {
        // SAFETY: the stand-in's initialisers do nothing.
        match unsafe { libloading::Library::new(path) } {
            Ok(lib) => FakeBlas { lib },
            Err(e) => panic!("cannot open {}: {e}", path.display()),
        }
    }

    /// Clear call counts, injected failures, records, the version (13.1.0, or
    /// 12.4.0 for the old build) and the heuristic (one algorithm, no workspace).
    pub fn reset(&self) {
        call!(self, "fakeblas_reset", unsafe extern "C" fn());
    }

    /// Make `call` return `status` from its `from_call`-th next call on (1: the
    /// next one), for `times` calls, or for ever with `None`.
    pub fn fail(&self, call: &str, status: u32, from_call: i64, times: Option<i64>) {
        let name = CString::new(call).unwrap_or_default();
        call!(
            self,
            "fakeblas_fail",
            unsafe extern "C" fn(*const c_char, c_int, c_long, c_long),
            name.as_ptr(),
            status as c_int,
            from_call as c_long,
            times.unwrap_or(-1) as c_long
        );
    }

    /// How many times `call` was made since the last reset.
    pub fn calls(&self, call: &str) -> i64 {
        let name = CString::new(call).unwrap_or_default();
        let n: c_long = call!(
            self,
            "fakeblas_calls",
            unsafe extern "C" fn(*const c_char) -> c_long,
            name.as_ptr()
        );
        n as i64
    }

    /// Set the version both APIs report (`130100` is 13.1.0).
    pub fn set_version(&self, code: i32) {
        call!(
            self,
            "fakeblas_set_version",
            unsafe extern "C" fn(c_int),
            code
        );
    }

    /// Script the heuristic: `count` algorithms needing `workspace` bytes each
    /// (none when that exceeds the preference's limit), or `status` when not 0.
    pub fn set_heuristic(&self, count: i32, workspace: usize, status: i32) {
        call!(
            self,
            "fakeblas_set_heuristic",
            unsafe extern "C" fn(c_int, usize, c_int),
            count,
            workspace,
            status
        );
    }

    /// The reduction-scheme mask (`CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK`)
    /// of the preference the last heuristic call was given: 7 (every scheme)
    /// when it set none, 0 before any call since the last reset.
    pub fn last_reduction_mask(&self) -> u32 {
        call!(
            self,
            "fakeblas_last_reduction_mask",
            unsafe extern "C" fn() -> u32
        )
    }

    /// Live objects of one kind.
    pub fn live(&self, what: BlasLive) -> i32 {
        call!(
            self,
            "fakeblas_live",
            unsafe extern "C" fn(c_int) -> c_int,
            what as c_int
        )
    }

    /// Every GEMM call recorded since the last reset (the last 256), oldest first.
    pub fn records(&self) -> Vec<BlasRecord> {
        let n: c_long = call!(self, "fakeblas_records", unsafe extern "C" fn() -> c_long);
        let mut out = Vec::new();
        for i in 0..n {
            let mut name = [0 as c_char; 40];
            let (mut ws, mut size, mut stream, mut context) = (
                std::ptr::null_mut(),
                0usize,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            let (mut capturing, mut algo, mut device) = (0 as c_int, 0 as c_longlong, 0 as c_int);
            let kept: c_int = call!(
                self,
                "fakeblas_record",
                unsafe extern "C" fn(
                    c_long,
                    *mut c_char,
                    usize,
                    *mut *mut c_void,
                    *mut usize,
                    *mut *mut c_void,
                    *mut *mut c_void,
                    *mut c_int,
                    *mut c_longlong,
                    *mut c_int,
                ) -> c_int,
                i,
                name.as_mut_ptr(),
                name.len(),
                &mut ws,
                &mut size,
                &mut stream,
                &mut context,
                &mut capturing,
                &mut algo,
                &mut device
            );
            if kept == 0 {
                continue;
            }
            // SAFETY: the stand-in wrote a NUL-terminated name into the buffer.
            let call = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            out.push(BlasRecord {
                call,
                workspace: ws as u64,
                workspace_size: size,
                stream,
                context,
                capturing: capturing != 0,
                algo: algo as i64,
                device,
            });
        }
        out
    }
}
