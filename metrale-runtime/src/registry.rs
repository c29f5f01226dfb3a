//! [`MetraleRegistry`]: one model's kernel modules, loaded into a device's primary
//! context, with function lookup (plain and memoized), `__device__` symbols, async
//! copies, stream synchronisation and raw or typed launches.
//!
//! Invariants:
//! - The registry owns its modules (shared with the [`CudaFunction`]s taken from
//!   it) and nothing else: the context and stream belong to the [`CudaHost`] the
//!   modules hold, which therefore outlives every module.
//! - Module handles are written only while loading and read afterwards; Drop unloads
//!   each one exactly once, when the registry and its `CudaFunction`s are gone. A
//!   load that fails at module k unloads modules 0..k.
//! - Function handles ([`RawCudaFunc`], [`CudaFunction`]) stay valid while the
//!   registry that produced them is alive.
//! - The launch path binds the context (one `cuCtxGetCurrent`), checks the shape
//!   against the device's limits, opts the kernel in to large dynamic shared memory
//!   only the first time a size needs it, and calls `cuLaunchKernel`: no allocation,
//!   no lock. Kernel names for error texts are looked up only on failure.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::fmt;
use std::sync::{Arc, OnceLock, RwLock};

use metrale_cuda_sys::{
    self as sys, CUdeviceptr, CUfunction, CUfunction_attribute, CUjit_option, CUmodule, CUresult,
    CUstream,
};

use crate::blob::{self, BlobKind};
use crate::error::{cu, CallError, MetraleError, Result};
use crate::host::{host, CudaContext, CudaHost, CudaStream};
use crate::launch::{
    KernelArgs, LaunchAttributes, LaunchConfig, SmemOptIns, DEFAULT_DYNAMIC_SHARED_LIMIT,
};

/// Bytes of each JIT log buffer (info and error) passed to `cuModuleLoadDataEx`.
const JIT_LOG_BYTES: usize = 16 * 1024;
/// At most this many bytes of a JIT log go into an error text.
const JIT_LOG_IN_ERROR: usize = 4 * 1024;

/// A raw `CUfunction` from [`MetraleRegistry::raw_function_cached`]: a plain handle,
/// cheap to copy, valid while the registry it came from is alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawCudaFunc(pub CUfunction);

// SAFETY: the handle is an opaque pointer that is only copied and passed to the
// driver, never dereferenced in Rust; the driver allows using a function handle from
// any thread that has its context current (which every metrale call ensures).
unsafe impl Send for RawCudaFunc {}
// SAFETY: as for Send; a shared reference only copies the pointer.
unsafe impl Sync for RawCudaFunc {}

/// A kernel of a loaded module, with its name: for attributes, occupancy and
/// launches. It keeps its module loaded: the modules of a registry are unloaded
/// when the registry and every `CudaFunction` taken from it are gone.
#[derive(Clone)]
pub struct CudaFunction {
    raw: RawCudaFunc,
    name: Arc<str>,
    modules: Arc<ModuleSet>,
}

impl fmt::Debug for CudaFunction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaFunction")
            .field("name", &self.name)
            .field("raw", &self.raw.0)
            .finish()
    }
}

/// A kernel's attributes, as `cuFuncGetAttribute` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionAttributes {
    /// Registers per thread.
    pub num_regs: i32,
    /// Statically allocated shared memory, bytes.
    pub static_shared_bytes: i32,
    /// Constant memory, bytes.
    pub const_bytes: i32,
    /// Local memory per thread, bytes.
    pub local_bytes: i32,
    /// The most threads per block this kernel can be launched with.
    pub max_threads_per_block: i32,
    /// PTX virtual architecture (90 for compute_90).
    pub ptx_version: i32,
    /// Binary architecture (90 for sm_90).
    pub binary_version: i32,
    /// Dynamic shared memory the kernel may currently use, bytes.
    pub max_dynamic_shared_bytes: i32,
    /// Preferred shared memory carveout, percent (-1: no preference).
    pub preferred_carveout: i32,
}

impl CudaFunction {
    /// `module::kernel`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The raw handle, for [`MetraleRegistry::launch_on_stream`].
    pub fn raw(&self) -> RawCudaFunc {
        self.raw
    }

    fn get(&self, attr: CUfunction_attribute) -> Result<i32> {
        let subject = || format!("kernel '{}'", self.name);
        self.modules.host.bind().map_err(|e| e.about(subject()))?;
        let mut v: c_int = 0;
        // SAFETY: writes one int for a live function handle.
        unsafe {
            cu!(
                self.modules.host.driver(),
                cuFuncGetAttribute(&mut v, attr, self.raw.0)
            )
        }
        .map_err(|e| e.about(subject()))?;
        Ok(v)
    }

    fn set(&self, attr: CUfunction_attribute, value: i32) -> Result<()> {
        let subject = || format!("kernel '{}'", self.name);
        self.modules.host.bind().map_err(|e| e.about(subject()))?;
        // SAFETY: sets a plain attribute of a live function handle.
        unsafe {
            cu!(
                self.modules.host.driver(),
                cuFuncSetAttribute(self.raw.0, attr, value)
            )
        }
        .map_err(|e| e.about(subject()))
    }

    /// All of the kernel's attributes.
    ///
    /// # Errors
    /// The failing `cuFuncGetAttribute`, naming the kernel.
    pub fn attributes(&self) -> Result<FunctionAttributes> {
        use sys::CUfunction_attribute as A;
        Ok(FunctionAttributes {
            num_regs: self.get(A::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            static_shared_bytes: self.get(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
            const_bytes: self.get(A::CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES)?,
            local_bytes: self.get(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
            max_threads_per_block: self.get(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            ptx_version: self.get(A::CU_FUNC_ATTRIBUTE_PTX_VERSION)?,
            binary_version: self.get(A::CU_FUNC_ATTRIBUTE_BINARY_VERSION)?,
            max_dynamic_shared_bytes: self
                .get(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)?,
            preferred_carveout: self.get(A::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)?,
        })
    }

    /// Let the kernel use up to `bytes` of dynamic shared memory (the opt-in above
    /// 48 KiB). Launches through the registry do this themselves when needed.
    ///
    /// # Errors
    /// The failing `cuFuncSetAttribute` (a size above the device's opt-in limit).
    pub fn set_max_dynamic_shared_bytes(&self, bytes: u32) -> Result<()> {
        let value = i32::try_from(bytes).map_err(|_| {
            MetraleError::InvalidArgument(format!(
                "kernel '{}': {bytes} bytes of shared memory",
                self.name
            ))
        })?;
        self.set(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            value,
        )
    }

    /// Preferred share of L1/shared memory given to shared memory, in percent
    /// (0..=100), or -1 for no preference.
    ///
    /// # Errors
    /// The failing `cuFuncSetAttribute`.
    pub fn set_preferred_carveout(&self, percent: i32) -> Result<()> {
        self.set(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            percent,
        )
    }

    /// How many blocks of `block_size` threads, each with `dynamic_shared_bytes`,
    /// fit on one multiprocessor at once.
    ///
    /// # Errors
    /// The failing occupancy call, naming the kernel.
    pub fn max_active_blocks_per_sm(
        &self,
        block_size: u32,
        dynamic_shared_bytes: usize,
    ) -> Result<u32> {
        let subject = || format!("kernel '{}'", self.name);
        let block = c_int::try_from(block_size).map_err(|_| {
            MetraleError::InvalidArgument(format!(
                "kernel '{}': block size {block_size}",
                self.name
            ))
        })?;
        self.modules.host.bind().map_err(|e| e.about(subject()))?;
        let mut n: c_int = 0;
        // SAFETY: writes one int for a live function handle.
        unsafe {
            cu!(
                self.modules.host.driver(),
                cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut n,
                    self.raw.0,
                    block,
                    dynamic_shared_bytes
                )
            )
        }
        .map_err(|e| e.about(subject()))?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// The block size that maximises occupancy, and the smallest grid that reaches
    /// it, for a kernel using `dynamic_shared_bytes` whatever the block size.
    ///
    /// # Errors
    /// The failing occupancy call, naming the kernel.
    pub fn potential_block_size(&self, dynamic_shared_bytes: usize) -> Result<(u32, u32)> {
        self.potential(None, dynamic_shared_bytes)
    }

    /// As [`CudaFunction::potential_block_size`], for a kernel whose dynamic shared
    /// memory depends on its block size: the driver calls `shared_bytes_for_block`
    /// with each block size it considers. The function must not panic (a panic
    /// cannot unwind through the driver and aborts the process).
    ///
    /// # Errors
    /// The failing occupancy call, naming the kernel.
    pub fn potential_block_size_with(
        &self,
        shared_bytes_for_block: extern "C" fn(block_size: c_int) -> usize,
    ) -> Result<(u32, u32)> {
        self.potential(Some(shared_bytes_for_block), 0)
    }

    fn potential(&self, per_block: sys::CUoccupancyB2DSize, fixed: usize) -> Result<(u32, u32)> {
        let subject = || format!("kernel '{}'", self.name);
        self.modules.host.bind().map_err(|e| e.about(subject()))?;
        let (mut grid, mut block): (c_int, c_int) = (0, 0);
        // SAFETY: writes two ints for a live function handle; the callback, when
        // given, is a plain function the driver calls synchronously.
        unsafe {
            cu!(
                self.modules.host.driver(),
                cuOccupancyMaxPotentialBlockSize(
                    &mut grid, &mut block, self.raw.0, per_block, fixed, 0
                )
            )
        }
        .map_err(|e| e.about(subject()))?;
        Ok((
            u32::try_from(block).unwrap_or(0),
            u32::try_from(grid).unwrap_or(0),
        ))
    }
}

struct Module {
    name: &'static str,
    raw: CUmodule,
    kind: BlobKind,
}

/// The modules of one registry, shared with the [`CudaFunction`]s taken from it;
/// unloaded once, when the last holder goes.
struct ModuleSet {
    host: Arc<CudaHost>,
    list: Vec<Module>,
}

// SAFETY: the module handles are written only while the set is built, before it is
// shared, and unloaded only in Drop; shared access reads them and passes them to the
// thread-safe driver.
unsafe impl Send for ModuleSet {}
// SAFETY: as for Send.
unsafe impl Sync for ModuleSet {}

impl ModuleSet {
    fn find(&self, name: &str) -> Option<&Module> {
        self.list.iter().find(|m| m.name == name)
    }
}

impl Drop for ModuleSet {
    /// Unloads every module once; see [`CudaHost`] for the teardown rule.
    fn drop(&mut self) {
        if self.list.is_empty() {
            return;
        }
        let modules = std::mem::take(&mut self.list);
        let d = self.host.driver();
        self.host.release_with(
            format_args!("unloading kernel modules on device {}", self.host.ordinal()),
            |failures| {
                for m in modules {
                    // SAFETY: each module was loaded into this set and is unloaded once.
                    if let Err(e) = unsafe { cu!(d, cuModuleUnload(m.raw)) } {
                        failures.push(e);
                    }
                }
            },
        );
    }
}

/// The kernel modules of one loaded model.
///
/// Get one with [`MetraleRegistry::load`] and pass the `Arc` along; there is no
/// global accessor. Dropping the last handle unloads the modules (once no
/// [`CudaFunction`] taken from it is left either).
pub struct MetraleRegistry {
    host: Arc<CudaHost>,
    modules: Arc<ModuleSet>,
    /// `CUfunction` address → `module::kernel`, for error texts (read only on failure).
    kernel_names: RwLock<HashMap<usize, Arc<str>>>,
    smem: SmemOptIns,
}

impl fmt::Debug for MetraleRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetraleRegistry")
            .field("device", &self.host.ordinal())
            .field(
                "modules",
                &self.modules.list.iter().map(|m| m.name).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl MetraleRegistry {
    /// Load this model's kernel modules (PTX, cubin, fatbin or clang offload bundle,
    /// each named) into device `ordinal`'s primary context.
    ///
    /// Each call loads a fresh, independent set of modules; only the [`CudaHost`]
    /// (context and stream) is shared with other registries of the device.
    ///
    /// # Errors
    /// Without a driver, [`MetraleError::DriverUnavailable`]. A module that fails to
    /// load gives [`MetraleError::ModuleLoad`] naming it (with the JIT log for PTX,
    /// and the architectures for a cubin built for another GPU); the modules loaded
    /// before it are unloaded again.
    pub fn load(
        ordinal: usize,
        kernel_blobs: &[(&'static str, &'static [u8])],
    ) -> Result<Arc<Self>> {
        Ok(Arc::new(Self::load_into(host(ordinal)?, kernel_blobs)?))
    }

    /// As [`MetraleRegistry::load`], into a host the caller already holds, with
    /// blobs of any lifetime (they are not kept).
    ///
    /// # Errors
    /// As [`MetraleRegistry::load`].
    pub fn load_into(host: Arc<CudaHost>, kernel_blobs: &[(&'static str, &[u8])]) -> Result<Self> {
        let mut set = ModuleSet {
            host: Arc::clone(&host),
            list: Vec::with_capacity(kernel_blobs.len()),
        };
        for &(name, blob) in kernel_blobs {
            if set.find(name).is_some() {
                return Err(MetraleError::InvalidArgument(format!(
                    "module '{name}' is listed twice"
                )));
            }
            // On error `set` drops here and unloads the modules loaded so far.
            let (raw, kind) = load_module(&host, name, blob)?;
            set.list.push(Module { name, raw, kind });
        }
        Ok(MetraleRegistry {
            host,
            modules: Arc::new(set),
            kernel_names: RwLock::new(HashMap::new()),
            smem: SmemOptIns::new(),
        })
    }

    /// The [`CudaHost`] this registry's modules live in.
    pub fn host(&self) -> &Arc<CudaHost> {
        &self.host
    }

    /// The device's primary context.
    pub fn ctx(&self) -> &CudaContext {
        self.host.ctx()
    }

    /// The host's non-blocking stream.
    pub fn stream(&self) -> &CudaStream {
        self.host.stream()
    }

    /// The raw `CUstream` of the host's stream.
    pub fn raw_stream(&self) -> CUstream {
        self.host.stream().raw()
    }

    /// Names of the loaded modules, in load order.
    pub fn module_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.modules.list.iter().map(|m| m.name)
    }

    /// Whether a module of this name was loaded.
    pub fn has_module(&self, module_name: &str) -> bool {
        self.modules.list.iter().any(|m| m.name == module_name)
    }

    /// What kind of blob a loaded module came from.
    pub fn module_kind(&self, module_name: &str) -> Option<BlobKind> {
        self.modules
            .list
            .iter()
            .find(|m| m.name == module_name)
            .map(|m| m.kind)
    }

    fn module(&self, module_name: &str) -> Result<CUmodule> {
        self.modules
            .list
            .iter()
            .find(|m| m.name == module_name)
            .map(|m| m.raw)
            .ok_or_else(|| MetraleError::ModuleLoad {
                module: module_name.to_owned(),
                message: format!("Module '{module_name}' not loaded"),
                status: None,
            })
    }

    fn c_name(module_name: &str, name: &str) -> Result<CString> {
        CString::new(name).map_err(|e| MetraleError::ModuleLoad {
            module: module_name.to_owned(),
            message: format!(
                "{module_name}::{}: name has an interior NUL byte at offset {}",
                name.escape_debug(),
                e.nul_position()
            ),
            status: None,
        })
    }

    /// `cuModuleGetFunction`, recording the name for error texts.
    fn lookup(&self, module_name: &str, func_name: &str) -> Result<(CUfunction, Arc<str>)> {
        let module = self.module(module_name)?;
        let c_name = Self::c_name(module_name, func_name)?;
        let prefix = || format!("{module_name}::{func_name}");
        self.host
            .bind()
            .map_err(|e| e.module_error(module_name, &prefix(), ""))?;
        let mut func: CUfunction = std::ptr::null_mut();
        // SAFETY: writes one CUfunction; the module is loaded and `c_name` is a
        // NUL-terminated string alive for the call.
        unsafe {
            cu!(
                self.host.driver(),
                cuModuleGetFunction(&mut func, module, c_name.as_ptr())
            )
        }
        .map_err(|e| e.module_error(module_name, &prefix(), ""))?;
        let name: Arc<str> = Arc::from(prefix());
        let mut names = self
            .kernel_names
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let name = Arc::clone(names.entry(func as usize).or_insert(name));
        Ok((func, name))
    }

    /// Look up kernel `func_name` in `module_name`. Not memoized: see
    /// [`MetraleRegistry::function_cached`] and [`MetraleRegistry::raw_function_cached`].
    ///
    /// # Errors
    /// [`MetraleError::ModuleLoad`] naming the module and kernel: module not loaded,
    /// interior NUL in the name, or `cuModuleGetFunction`'s status.
    pub fn function(&self, module_name: &str, func_name: &str) -> Result<CudaFunction> {
        let (func, name) = self.lookup(module_name, func_name)?;
        Ok(CudaFunction {
            raw: RawCudaFunc(func),
            name,
            modules: Arc::clone(&self.modules),
        })
    }

    /// [`MetraleRegistry::function`], memoized in the caller's `OnceLock`.
    ///
    /// # Errors
    /// As [`MetraleRegistry::function`]; nothing is cached on error.
    pub fn function_cached(
        &self,
        cache: &OnceLock<CudaFunction>,
        module_name: &str,
        func_name: &str,
    ) -> Result<CudaFunction> {
        if let Some(f) = cache.get() {
            return Ok(f.clone());
        }
        let f = self.function(module_name, func_name)?;
        Ok(cache.get_or_init(|| f).clone())
    }

    /// The raw handle of kernel `func_name`, memoized in the caller's `OnceLock`: a
    /// hit is one atomic load.
    ///
    /// # Errors
    /// As [`MetraleRegistry::function`]; nothing is cached on error.
    #[inline]
    pub fn raw_function_cached(
        &self,
        cache: &OnceLock<RawCudaFunc>,
        module_name: &str,
        func_name: &str,
    ) -> Result<RawCudaFunc> {
        if let Some(f) = cache.get() {
            return Ok(*f);
        }
        self.raw_function_miss(cache, module_name, func_name)
    }

    #[cold]
    fn raw_function_miss(
        &self,
        cache: &OnceLock<RawCudaFunc>,
        module_name: &str,
        func_name: &str,
    ) -> Result<RawCudaFunc> {
        let (func, _) = self.lookup(module_name, func_name)?;
        Ok(*cache.get_or_init(|| RawCudaFunc(func)))
    }

    /// The kernels a module defines, by name (`cuModuleEnumerateFunctions`, CUDA
    /// 12.4+; an older driver gives [`MetraleError::MissingSymbol`]).
    ///
    /// # Errors
    /// Unknown module, a missing symbol, or the failing call.
    pub fn function_names(&self, module_name: &str) -> Result<Vec<String>> {
        let module = self.module(module_name)?;
        let d = self.host.driver();
        let subject = || format!("module '{module_name}'");
        self.host.bind().map_err(|e| e.about(subject()))?;
        let mut count: c_uint = 0;
        // SAFETY: writes one unsigned int for a loaded module.
        unsafe { cu!(d, cuModuleGetFunctionCount(&mut count, module)) }
            .map_err(|e| e.about(subject()))?;
        let mut funcs: Vec<CUfunction> = vec![std::ptr::null_mut(); count as usize];
        // SAFETY: the array has exactly `count` slots.
        unsafe {
            cu!(
                d,
                cuModuleEnumerateFunctions(funcs.as_mut_ptr(), count, module)
            )
        }
        .map_err(|e| e.about(subject()))?;
        let mut names = Vec::with_capacity(funcs.len());
        for f in funcs {
            let mut name: *const c_char = std::ptr::null();
            // SAFETY: writes a pointer to the driver's own NUL-terminated name.
            unsafe { cu!(d, cuFuncGetName(&mut name, f)) }.map_err(|e| e.about(subject()))?;
            if !name.is_null() {
                // SAFETY: non-null, NUL-terminated, owned by the driver while the
                // module is loaded; copied out at once.
                names.push(
                    unsafe { CStr::from_ptr(name) }
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
        Ok(names)
    }

    /// A `__device__` symbol of a loaded module: its device address and size in
    /// bytes. `symbol` is the linker name, so a symbol in a C++ namespace is given
    /// mangled (`_ZN12metrale_test8countersE`).
    ///
    /// # Errors
    /// [`MetraleError::ModuleLoad`] naming module and symbol: module not loaded,
    /// interior NUL, or `cuModuleGetGlobal_v2`'s status (missing symbol: NOT_FOUND).
    pub fn device_symbol(&self, module_name: &str, symbol: &str) -> Result<(CUdeviceptr, usize)> {
        let module = self.module(module_name)?;
        let c_sym = Self::c_name(module_name, symbol)?;
        let prefix = || format!("{module_name}::{symbol}");
        self.host
            .bind()
            .map_err(|e| e.module_error(module_name, &prefix(), ""))?;
        let (mut dptr, mut bytes): (CUdeviceptr, usize) = (0, 0);
        // SAFETY: writes an address and a size; the module is loaded and `c_sym` is
        // NUL-terminated and alive for the call.
        unsafe {
            cu!(
                self.host.driver(),
                cuModuleGetGlobal_v2(&mut dptr, &mut bytes, module, c_sym.as_ptr())
            )
        }
        .map_err(|e| e.module_error(module_name, &prefix(), ""))?;
        Ok((dptr, bytes))
    }

    /// Queue a copy of `bytes` bytes from host `src` to device `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` must be device memory of this context with room for `bytes`; `src` must
    /// be valid for `bytes` reads until `stream` has been synchronised (for pageable
    /// memory the driver stages it before returning; pinned memory is read later).
    ///
    /// # Errors
    /// `cuMemcpyHtoDAsync_v2`'s status, naming the copy.
    pub unsafe fn copy_h2d_async(
        &self,
        dst: CUdeviceptr,
        src: *const c_void,
        bytes: usize,
        stream: CUstream,
    ) -> Result<()> {
        let subject = || {
            format!(
                "device {}: copy of {bytes} bytes to {dst:#x}",
                self.host.ordinal()
            )
        };
        self.host.bind().map_err(|e| e.about(subject()))?;
        // SAFETY: the caller's contract covers both pointers and the stream.
        unsafe {
            cu!(
                self.host.driver(),
                cuMemcpyHtoDAsync_v2(dst, src, bytes, stream)
            )
        }
        .map_err(|e| e.about(subject()))
    }

    /// Queue a copy of `bytes` bytes from device `src` to host `dst` on `stream`.
    ///
    /// # Safety
    /// `src` must be device memory of this context holding `bytes`; `dst` must be
    /// valid for `bytes` writes, and not otherwise accessed, until `stream` has
    /// been synchronised.
    ///
    /// # Errors
    /// `cuMemcpyDtoHAsync_v2`'s status, naming the copy.
    pub unsafe fn copy_d2h_async(
        &self,
        dst: *mut c_void,
        src: CUdeviceptr,
        bytes: usize,
        stream: CUstream,
    ) -> Result<()> {
        let subject = || {
            format!(
                "device {}: copy of {bytes} bytes from {src:#x}",
                self.host.ordinal()
            )
        };
        self.host.bind().map_err(|e| e.about(subject()))?;
        // SAFETY: the caller's contract covers both pointers and the stream.
        unsafe {
            cu!(
                self.host.driver(),
                cuMemcpyDtoHAsync_v2(dst, src, bytes, stream)
            )
        }
        .map_err(|e| e.about(subject()))
    }

    /// Block until all work queued on `stream` has finished (the first error of that
    /// work, such as a kernel's illegal address, is reported here).
    ///
    /// # Errors
    /// `cuStreamSynchronize`'s status.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn stream_synchronize(&self, stream: CUstream) -> Result<()> {
        self.host.synchronize(stream)
    }

    /// Launch `raw_func` on `stream` with the driver's `void*` parameter array.
    ///
    /// The shape is checked against the device's limits before the driver is called;
    /// above 48 KiB of dynamic shared memory the kernel is opted in first (once per
    /// kernel and size). The caller's stream is used as given.
    ///
    /// # Safety
    /// - `kernel_params` holds one pointer per kernel parameter, each to a value of
    ///   the parameter's type, valid for the duration of this call.
    /// - `stream` is a stream of this registry's context, or null for the legacy
    ///   default stream.
    /// - `raw_func` comes from this registry (which is still alive).
    /// - What the kernel reads and writes is valid device memory until it finishes.
    ///
    /// # Errors
    /// [`MetraleError::KernelLaunch`] naming the kernel, with grid, block and shared
    /// memory: an impossible shape (before the driver), a failed opt-in, or
    /// `cuLaunchKernel`'s status.
    #[inline]
    pub unsafe fn launch_on_stream(
        &self,
        raw_func: RawCudaFunc,
        cfg: LaunchConfig,
        stream: CUstream,
        kernel_params: &mut [*mut c_void],
    ) -> Result<()> {
        self.prepare_launch(raw_func, &cfg, None)?;
        let d = self.host.driver();
        let (g, b) = (cfg.grid_dim, cfg.block_dim);
        // SAFETY: the caller's contract covers the handle, the stream and the
        // parameters; the shape was checked above and the context is current.
        let launched = unsafe {
            cu!(
                d,
                cuLaunchKernel(
                    raw_func.0,
                    g.0,
                    g.1,
                    g.2,
                    b.0,
                    b.1,
                    b.2,
                    cfg.shared_mem_bytes,
                    stream,
                    kernel_params.as_mut_ptr(),
                    std::ptr::null_mut()
                )
            )
        };
        launched.map_err(|e| self.launch_error(raw_func, &cfg, None, e))
    }

    /// Launch with typed arguments: a tuple of values and device buffers, packed on
    /// the stack. `registry.launch(f, cfg, stream, (&a, &b, &mut c, n))`.
    ///
    /// # Safety
    /// The tuple's element types must match the kernel's parameters in order and
    /// layout (a device buffer is passed as its `CUdeviceptr`), and the other
    /// conditions of [`MetraleRegistry::launch_on_stream`] hold.
    ///
    /// # Errors
    /// As [`MetraleRegistry::launch_on_stream`].
    #[inline]
    pub unsafe fn launch<A: KernelArgs>(
        &self,
        func: RawCudaFunc,
        cfg: LaunchConfig,
        stream: CUstream,
        args: A,
    ) -> Result<()> {
        // SAFETY: forwarded; the packed pointers point into `args`, alive here.
        args.with_params(|params| unsafe { self.launch_on_stream(func, cfg, stream, params) })
    }

    /// Launch through `cuLaunchKernelEx` (CUDA 12.0+) with [`LaunchAttributes`]:
    /// thread-block clusters, cooperative launch, programmatic dependent launch.
    ///
    /// Cluster shape (divides the grid, at most 8 blocks, device support) and the
    /// launch shape are checked before the driver is called.
    ///
    /// # Safety
    /// As [`MetraleRegistry::launch_on_stream`].
    ///
    /// # Errors
    /// As [`MetraleRegistry::launch_on_stream`]; a driver without
    /// `cuLaunchKernelEx` gives a missing-symbol error naming it.
    pub unsafe fn launch_ex_on_stream(
        &self,
        raw_func: RawCudaFunc,
        cfg: LaunchConfig,
        attrs: &LaunchAttributes,
        stream: CUstream,
        kernel_params: &mut [*mut c_void],
    ) -> Result<()> {
        self.prepare_launch(raw_func, &cfg, Some(attrs))?;
        let (mut driver_attrs, n) = attrs.to_driver();
        let (g, b) = (cfg.grid_dim, cfg.block_dim);
        let config = sys::CUlaunchConfig {
            gridDimX: g.0,
            gridDimY: g.1,
            gridDimZ: g.2,
            blockDimX: b.0,
            blockDimY: b.1,
            blockDimZ: b.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream,
            attrs: driver_attrs.as_mut_ptr(),
            numAttrs: n as c_uint,
        };
        // SAFETY: `config` and its attribute array live on this frame for the call;
        // the caller's contract covers the handle, the stream and the parameters.
        let launched = unsafe {
            cu!(
                self.host.driver(),
                cuLaunchKernelEx(
                    &config,
                    raw_func.0,
                    kernel_params.as_mut_ptr(),
                    std::ptr::null_mut()
                )
            )
        };
        launched.map_err(|e| self.launch_error(raw_func, &cfg, Some(attrs), e))
    }

    /// [`MetraleRegistry::launch_ex_on_stream`] with typed arguments, as
    /// [`MetraleRegistry::launch`].
    ///
    /// # Safety
    /// As [`MetraleRegistry::launch`].
    ///
    /// # Errors
    /// As [`MetraleRegistry::launch_ex_on_stream`].
    pub unsafe fn launch_ex<A: KernelArgs>(
        &self,
        func: RawCudaFunc,
        cfg: LaunchConfig,
        attrs: &LaunchAttributes,
        stream: CUstream,
        args: A,
    ) -> Result<()> {
        // SAFETY: forwarded; the packed pointers point into `args`, alive here.
        args.with_params(|params| unsafe {
            self.launch_ex_on_stream(func, cfg, attrs, stream, params)
        })
    }

    /// Everything a launch does before the driver's launch call: bind the context,
    /// check the shape (and attributes) against the device, and opt the kernel in
    /// to large dynamic shared memory the first time a size needs it.
    #[inline]
    fn prepare_launch(
        &self,
        raw_func: RawCudaFunc,
        cfg: &LaunchConfig,
        attrs: Option<&LaunchAttributes>,
    ) -> Result<()> {
        if let Err(e) = self.host.bind() {
            return Err(self.launch_error(raw_func, cfg, attrs, e));
        }
        let limits = self.host.limits();
        let checked = cfg
            .check_limits(limits)
            .and_then(|()| attrs.map_or(Ok(()), |a| a.check(cfg, limits)));
        if let Err(why) = checked {
            return Err(self.refused(raw_func, cfg, attrs, &why));
        }
        if cfg.shared_mem_bytes > DEFAULT_DYNAMIC_SHARED_LIMIT
            && self.smem.limit(raw_func.0) < cfg.shared_mem_bytes
        {
            self.opt_in(raw_func, cfg, attrs)?;
        }
        Ok(())
    }

    #[cold]
    fn opt_in(
        &self,
        raw_func: RawCudaFunc,
        cfg: &LaunchConfig,
        attrs: Option<&LaunchAttributes>,
    ) -> Result<()> {
        let bytes = c_int::try_from(cfg.shared_mem_bytes).unwrap_or(c_int::MAX);
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: sets a plain attribute of a live function handle.
        unsafe {
            cu!(
                self.host.driver(),
                cuFuncSetAttribute(raw_func.0, attr, bytes)
            )
        }
        .map_err(|e| self.launch_error(raw_func, cfg, attrs, e))?;
        self.smem.record(raw_func.0, cfg.shared_mem_bytes);
        Ok(())
    }

    /// The name a kernel handle was looked up under, or its address.
    fn kernel_name(&self, raw_func: RawCudaFunc) -> Arc<str> {
        let names = self
            .kernel_names
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match names.get(&(raw_func.0 as usize)) {
            Some(n) => Arc::clone(n),
            None => Arc::from(format!(
                "{:p} (not looked up through this registry)",
                raw_func.0
            )),
        }
    }

    #[cold]
    fn launch_error(
        &self,
        raw_func: RawCudaFunc,
        cfg: &LaunchConfig,
        attrs: Option<&LaunchAttributes>,
        e: CallError,
    ) -> MetraleError {
        e.launch_error(&self.kernel_name(raw_func), &LaunchShape(cfg, attrs))
    }

    #[cold]
    fn refused(
        &self,
        raw_func: RawCudaFunc,
        cfg: &LaunchConfig,
        attrs: Option<&LaunchAttributes>,
        why: &str,
    ) -> MetraleError {
        let kernel = self.kernel_name(raw_func);
        MetraleError::KernelLaunch {
            message: format!(
                "kernel '{kernel}': launch not attempted, {why} {}",
                LaunchShape(cfg, attrs)
            ),
            kernel: kernel.to_string(),
            status: None,
        }
    }
}

/// Check `blob` and load it with `cuModuleLoadDataEx`, capturing the JIT logs.
fn load_module(h: &CudaHost, name: &str, blob: &[u8]) -> Result<(CUmodule, BlobKind)> {
    let image = blob::prepare(name, blob)?;
    h.bind().map_err(|e| e.module_error(name, name, ""))?;

    let mut info_log = vec![0u8; JIT_LOG_BYTES];
    let mut error_log = vec![0u8; JIT_LOG_BYTES];
    let mut options: [CUjit_option; 4] = [
        CUjit_option::CU_JIT_INFO_LOG_BUFFER,
        CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // Sizes travel in the pointer-sized slots, as the driver API specifies.
    let mut values: [*mut c_void; 4] = [
        info_log.as_mut_ptr().cast(),
        JIT_LOG_BYTES as *mut c_void,
        error_log.as_mut_ptr().cast(),
        JIT_LOG_BYTES as *mut c_void,
    ];
    let mut raw: CUmodule = std::ptr::null_mut();
    // SAFETY: `image` was checked by `blob::prepare` (PTX NUL-terminated, binary
    // headers within bounds) and outlives the call; both log buffers are
    // JIT_LOG_BYTES long as declared in `values`; the context is current.
    let loaded = unsafe {
        cu!(
            h.driver(),
            cuModuleLoadDataEx(
                &mut raw,
                image.bytes.as_ptr().cast(),
                options.len() as c_uint,
                options.as_mut_ptr(),
                values.as_mut_ptr()
            )
        )
    };
    match loaded {
        Ok(()) => Ok((raw, image.kind)),
        Err(e) => {
            let mut extra = format!(" [{} of {} bytes]", image.kind.label(), blob.len());
            if let Some(hint) = arch_hint(h, &image, e.status()) {
                extra.push_str("; ");
                extra.push_str(&hint);
            }
            let log = log_text(&error_log);
            if !log.is_empty() {
                extra.push_str("\nJIT error log:\n");
                extra.push_str(&log);
            }
            Err(e.module_error(name, name, &extra))
        }
    }
}

/// For a binary that has no code for this device: what it was built for.
fn arch_hint(h: &CudaHost, image: &blob::Image<'_>, status: Option<CUresult>) -> Option<String> {
    let (major, minor) = h.limits().compute_capability;
    let device = format!("the device is sm_{major}{minor}");
    match (image.kind, status) {
        (BlobKind::Cubin, _) => {
            let sm = blob::elf_info(&image.bytes)?.sm();
            (sm != major * 10 + minor).then(|| format!("the cubin was built for sm_{sm}, {device}"))
        }
        (BlobKind::Fatbin, Some(CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU)) => {
            Some(format!("the fatbin has no code {device} can run"))
        }
        _ => None,
    }
}

/// A launch shape, with its extended attributes when there are any, for error
/// texts: `(grid=[..], block=[..], shared_mem=N cluster=[..])`.
struct LaunchShape<'a>(&'a LaunchConfig, Option<&'a LaunchAttributes>);

impl fmt::Display for LaunchShape<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.1 {
            None => self.0.fmt(f),
            Some(attrs) => {
                let text = self.0.to_string();
                write!(f, "{}{attrs})", text.trim_end_matches(')'))
            }
        }
    }
}

/// The text of a JIT log buffer: up to its NUL, trimmed, at most
/// [`JIT_LOG_IN_ERROR`] bytes (cut at a character boundary, marked when cut).
fn log_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let text = String::from_utf8_lossy(&buf[..end]);
    let text = text.trim();
    if text.len() <= JIT_LOG_IN_ERROR {
        return text.to_owned();
    }
    let mut cut = JIT_LOG_IN_ERROR;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}\n[... log cut at {JIT_LOG_IN_ERROR} bytes]",
        &text[..cut]
    )
}

#[cfg(test)]
#[path = "tests/registry.rs"]
mod tests;
