//! [`MetraleRegistry`]: the seed's facade — one model's kernel modules on one
//! device, with function lookup (plain and memoized), `__device__` symbols, and
//! the seed's copy, synchronisation and launch entry points.
//!
//! Invariants:
//! - A registry owns its code (shared with the [`CudaFunction`]s and symbols taken
//!   from it) and holds its [`CudaHost`], so the context outlives the code.
//! - Lookups are memoized per registry; `function_cached` / `raw_function_cached`
//!   additionally keep the caller's `OnceLock`, and accept what it holds only when
//!   it came from this registry (one compare): a handle cached by another registry,
//!   or by one that was dropped, is never returned or launched.
//! - Everything here delegates to the rooms below (module loading, function
//!   table, launch path, stream methods); the registry adds the seed's names.

use std::borrow::Borrow;
use std::ffi::c_void;
use std::fmt;
use std::sync::{Arc, OnceLock};

use metrale_cuda_sys::{CUdeviceptr, CUstream};

use crate::blob::BlobKind;
use crate::context::{self, AsContext, CudaContext};
use crate::error::{cu, invalid_arg, Result};
use crate::function::{CudaFunction, KernelTable, RawCudaFunc, SideCache};
use crate::host::{host, CudaHost};
use crate::launch::{launch_kernel, KernelArgs, LaunchConfig};
use crate::memory::{DeviceRepr, DeviceSymbol};
use crate::module::{ModuleSet, NamedBlob};
use crate::stream::CudaStream;

/// The kernel modules of one loaded model on one device.
///
/// Get one with [`MetraleRegistry::load`] and pass the `Arc` along; there is no
/// global accessor. Dropping the last handle unloads the modules (once no
/// [`CudaFunction`] or symbol taken from it is left either).
///
/// ```no_run
/// use metrale_runtime::{DeviceBuffer, LaunchConfig, MetraleRegistry};
/// # fn main() -> metrale_runtime::Result<()> {
/// static KERNELS: &[u8] = b"..."; // include_bytes!("kernels.ptx"), a cubin or a fatbin
/// let reg = MetraleRegistry::load(0, &[("kernels", KERNELS)])?;
/// let vec_add = reg.function("kernels", "vec_add")?; // keep it: lookups are done once
/// let s = reg.stream();
/// let a = DeviceBuffer::from_host(s, &[1.0f32; 1024])?;
/// let mut c = DeviceBuffer::<f32>::alloc(s, 1024)?;
/// // SAFETY: vec_add(const float*, const float*, float*, unsigned) over 1024 elements.
/// unsafe { s.launch(&vec_add, LaunchConfig::for_num_elems(1024, 256)?, (&a, &a, &mut c, 1024u32))? };
/// assert!(s.to_vec(&c)?.iter().all(|&x| x == 2.0));
/// # Ok(()) }
/// ```
pub struct MetraleRegistry {
    table: Arc<KernelTable>,
    /// `table`'s id, kept here so a memoized lookup's hit compares against this
    /// registry's own field (no load through the table's `Arc`).
    table_id: u64,
    host: Arc<CudaHost>,
    /// Answers for caller caches that hold another registry's handle.
    side: SideCache,
    /// Slow-path lookups of `raw_function_cached`.
    slow: std::sync::atomic::AtomicU64,
}

impl fmt::Debug for MetraleRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetraleRegistry")
            .field("device", &self.host.ordinal())
            .field("modules", &self.module_names().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl MetraleRegistry {
    /// Load this model's kernel modules (PTX, cubin, fatbin or clang offload bundle,
    /// each named) into device `ordinal`'s primary context.
    ///
    /// Names and blobs may be borrowed or owned ([`NamedBlob`]): the registry API's
    /// `&[("kernels", PTX)]` with statics, `&blobs` of `(String, Vec<u8>)` read
    /// from disk, or NVRTC's outputs; nothing is kept after loading. The set is
    /// a slice (`&[..]`, `&vec`): the registry API's form, and one that clippy's
    /// `needless_borrows_for_generic_args` accepts in your code.
    ///
    /// ```no_run
    /// # use metrale_runtime::MetraleRegistry;
    /// # const PTX: &[u8] = b"";
    /// # fn main() -> metrale_runtime::Result<()> {
    /// let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
    /// let from_disk: Vec<(String, Vec<u8>)> = vec![("other".into(), std::fs::read("other.ptx").unwrap_or_default())];
    /// let again = MetraleRegistry::load(0, &from_disk)?;
    /// # drop((reg, again));
    /// # Ok(()) }
    /// ```
    ///
    /// Each call loads a fresh, independent set of modules; only the [`CudaHost`]
    /// (context and stream) is shared with other registries of the device.
    ///
    /// # Errors
    /// Without a driver, [`ErrorKind::DriverUnavailable`](crate::ErrorKind::DriverUnavailable). A blob refused before
    /// the driver gives [`ErrorKind::InvalidBlob`](crate::ErrorKind::InvalidBlob), one the driver refuses
    /// [`ErrorKind::ModuleLoad`](crate::ErrorKind::ModuleLoad) (with the JIT log for PTX, and the
    /// architectures for a cubin built for another GPU), both naming the module;
    /// the modules loaded before it are unloaded again.
    pub fn load(ordinal: usize, kernel_blobs: &[impl NamedBlob]) -> Result<Arc<Self>> {
        Ok(Arc::new(Self::load_into(host(ordinal)?, kernel_blobs)?))
    }

    /// As [`MetraleRegistry::load`], into a host the caller holds (`&host`, or
    /// the `Arc` itself), with names and blobs of any lifetime, owned or
    /// borrowed ([`NamedBlob`]: `(String, Vec<u8>)` read from disk, `(&str,
    /// &[u8])`, references to either); nothing is kept after loading.
    ///
    /// # Errors
    /// As [`MetraleRegistry::load`].
    pub fn load_into(
        host: impl Borrow<Arc<CudaHost>>,
        kernel_blobs: &[impl NamedBlob],
    ) -> Result<Self> {
        let host = Arc::clone(host.borrow());
        let blobs: Vec<(&str, &[u8])> =
            kernel_blobs.iter().map(|b| (b.name(), b.bytes())).collect();
        let code = ModuleSet::load_modules(host.ctx(), &blobs)?;
        Ok(Self::over(host, Arc::new(code)))
    }

    /// A registry of `host`'s device over `code`.
    fn over(host: Arc<CudaHost>, code: Arc<ModuleSet>) -> MetraleRegistry {
        let table = KernelTable::new(host.ctx(), code);
        MetraleRegistry {
            table_id: table.id(),
            table,
            host,
            side: SideCache::default(),
            slow: Default::default(),
        }
    }

    /// Load a model once for several devices: one registry per ordinal, in order.
    ///
    /// With the context-independent library API (`cuLibraryLoadData`, CUDA 12.0+)
    /// each blob is loaded once and every device gets its kernels from it
    /// (`cuLibraryGetKernel` + `cuKernelGetFunction`, `cuLibraryGetGlobal` for
    /// symbols). On a driver without that API each device loads its own modules.
    /// [`MetraleRegistry::shares_code`] tells which happened.
    ///
    /// # Errors
    /// As [`MetraleRegistry::load`]; `InvalidArgument` for an ordinal listed twice.
    pub fn load_on_devices(
        ordinals: &[usize],
        kernel_blobs: &[impl NamedBlob],
    ) -> Result<Vec<Arc<Self>>> {
        for (i, o) in ordinals.iter().enumerate() {
            if ordinals[..i].contains(o) {
                return Err(invalid_arg(format!("device {o} is listed twice")));
            }
        }
        let blobs: Vec<(&str, &[u8])> =
            kernel_blobs.iter().map(|b| (b.name(), b.bytes())).collect();
        let hosts = ordinals
            .iter()
            .map(|&o| host(o))
            .collect::<Result<Vec<_>>>()?;
        let driver = context::init_driver()?.0;
        let library_api = driver.cuLibraryLoadData().is_ok()
            && driver.cuLibraryGetKernel().is_ok()
            && driver.cuKernelGetFunction().is_ok();
        if library_api {
            let code = Arc::new(ModuleSet::load_libraries(driver, &blobs)?);
            Ok(hosts
                .into_iter()
                .map(|h| Arc::new(Self::over(h, Arc::clone(&code))))
                .collect())
        } else {
            hosts
                .into_iter()
                .map(|h| Ok(Arc::new(Self::load_into(h, &blobs)?)))
                .collect()
        }
    }

    /// Whether this registry's code is a context-independent library shared with
    /// registries of other devices ([`MetraleRegistry::load_on_devices`]).
    pub fn shares_code(&self) -> bool {
        self.table.code().is_library()
    }

    /// The [`CudaHost`] this registry's modules live in.
    pub fn host(&self) -> &Arc<CudaHost> {
        &self.host
    }

    /// The device's primary context.
    pub fn ctx(&self) -> &Arc<CudaContext> {
        self.host.ctx()
    }

    /// The host's non-blocking stream.
    pub fn stream(&self) -> &CudaStream {
        self.host.stream()
    }

    /// The raw `CUstream` of the host's stream, for driver calls of your own.
    pub fn raw_stream(&self) -> CUstream {
        self.host.stream().raw()
    }

    /// Names of the loaded modules, in load order.
    pub fn module_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.table.code().list().iter().map(|m| &*m.name)
    }

    /// Whether a module of this name was loaded.
    pub fn has_module(&self, module_name: &str) -> bool {
        self.table.code().position(module_name).is_some()
    }

    /// What kind of blob a loaded module came from.
    pub fn module_kind(&self, module_name: &str) -> Option<BlobKind> {
        let code = self.table.code();
        code.position(module_name).map(|i| code.list()[i].kind)
    }

    /// Kernel `func_name` of `module_name`. The driver is asked once per registry;
    /// later calls return the memoized kernel (a read lock and a hash lookup). For
    /// a lock-free hit, keep the `CudaFunction` or use
    /// [`MetraleRegistry::function_cached`].
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) for an unknown module or kernel (naming both),
    /// [`ErrorKind::InvalidName`](crate::ErrorKind::InvalidName) for an interior NUL, or the failing call.
    pub fn function(&self, module_name: &str, func_name: &str) -> Result<CudaFunction> {
        self.table.function(module_name, func_name)
    }

    /// [`MetraleRegistry::function`], memoized in the caller's `OnceLock`. A cached
    /// function of another registry (a `static` shared by two registries, or one
    /// filled by a registry since dropped) is not returned: this registry's own is.
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
            if Arc::ptr_eq(f.table(), &self.table) {
                return Ok(f.clone());
            }
            return self.function(module_name, func_name);
        }
        let f = self.function(module_name, func_name)?;
        // Another thread (of another registry, maybe) may have filled the cache
        // meanwhile: return what it holds only when it is this registry's.
        let cached = cache.get_or_init(|| f.clone());
        if Arc::ptr_eq(cached.table(), &self.table) {
            Ok(cached.clone())
        } else {
            Ok(f)
        }
    }

    /// The raw handle of kernel `func_name`, memoized in the caller's `OnceLock`: a
    /// hit is one atomic load and one compare. A handle the cache got from another
    /// registry (or one since dropped) is detected and looked up again here.
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
            if f.table_id() == self.table_id {
                // Copied whole from the cache (not field by field): the caller's
                // own copy of the result then reads what one wide store wrote.
                return Ok(*f);
            }
            // The cache holds another registry's handle (one since dropped, say):
            // this registry remembers its own answer for this cache.
            if let Some(mine) = self.side.get(cache, *f) {
                return Ok(mine);
            }
        }
        self.raw_function_miss(cache, module_name, func_name)
    }

    /// How many `raw_function_cached` calls took the slow path (a lookup by
    /// name): for tests of the fast path.
    #[doc(hidden)]
    pub fn slow_lookups(&self) -> u64 {
        self.slow.load(std::sync::atomic::Ordering::Relaxed)
    }

    #[cold]
    fn raw_function_miss(
        &self,
        cache: &OnceLock<RawCudaFunc>,
        module_name: &str,
        func_name: &str,
    ) -> Result<RawCudaFunc> {
        self.slow.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let f = self.table.raw_function(module_name, func_name)?;
        // Fills an empty cache; one holding another registry's handle stays as it
        // is, and this registry's handle goes to its side cache for the next call.
        let cached = *cache.get_or_init(|| f);
        if !self.table.owns(cached) {
            self.side.put(cache, cached, f);
        }
        Ok(f)
    }

    /// The kernels a module defines, by name (`cuModuleEnumerateFunctions`, CUDA
    /// 12.4+; an older driver gives [`ErrorKind::MissingSymbol`](crate::ErrorKind::MissingSymbol)).
    ///
    /// # Errors
    /// Unknown module, a missing symbol, or the failing call.
    pub fn function_names(&self, module_name: &str) -> Result<Vec<String>> {
        self.table.kernel_names(module_name)
    }

    /// A `__device__` symbol of a loaded module: its device address and size in
    /// bytes. `symbol` is the linker name, so a symbol in a C++ namespace is given
    /// mangled (`_ZN12metrale_test8countersE`). See [`MetraleRegistry::symbol`] for
    /// a typed view.
    ///
    /// # Errors
    /// [`ErrorKind::NotFound`](crate::ErrorKind::NotFound) for an unknown module or symbol,
    /// [`ErrorKind::InvalidName`](crate::ErrorKind::InvalidName), or the failing `cuModuleGetGlobal_v2`.
    pub fn device_symbol(&self, module_name: &str, symbol: &str) -> Result<(CUdeviceptr, usize)> {
        self.table.symbol(module_name, symbol)
    }

    /// A scalar `__device__` symbol as a typed view, its size checked against `T`.
    ///
    /// # Errors
    /// As [`MetraleRegistry::device_symbol`]; [`ErrorKind::SymbolSize`](crate::ErrorKind::SymbolSize) naming
    /// the symbol and both sizes.
    pub fn symbol<T: DeviceRepr>(
        &self,
        module_name: &str,
        symbol: &str,
    ) -> Result<DeviceSymbol<T>> {
        self.symbol_array(module_name, symbol, 1)
    }

    /// An array `__device__` symbol as a typed view of `len` elements.
    ///
    /// # Errors
    /// As [`MetraleRegistry::symbol`].
    pub fn symbol_array<T: DeviceRepr>(
        &self,
        module_name: &str,
        symbol: &str,
        len: usize,
    ) -> Result<DeviceSymbol<T>> {
        let (ptr, bytes) = self.table.symbol(module_name, symbol)?;
        DeviceSymbol::new(
            ptr,
            bytes,
            len,
            self.host.ctx(),
            (module_name, symbol),
            Arc::clone(self.table.code()) as _,
        )
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        stream
            .context()
            .check_same(self.host.ctx(), || "registry".to_owned(), "the stream")
    }

    /// Queue a copy of `bytes` bytes from host `src` to device `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` must be device memory of this context with room for `bytes`; `src` must
    /// be valid for `bytes` reads until `stream` has been synchronised. Prefer
    /// [`CudaStream::copy_h2d`], which is safe.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice); `cuMemcpyHtoDAsync_v2`'s status, naming the copy.
    pub unsafe fn copy_h2d_async(
        &self,
        dst: CUdeviceptr,
        src: *const c_void,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let s = stream.raw();
        self.host.ctx().call(
            || {
                format!(
                    "device {}: copy of {bytes} bytes to {dst:#x}",
                    self.host.ordinal()
                )
            },
            // SAFETY: the caller's contract covers both pointers.
            |d| unsafe { cu!(d, cuMemcpyHtoDAsync_v2(dst, src, bytes, s)) },
        )
    }

    /// Queue a copy of `bytes` bytes from device `src` to host `dst` on `stream`.
    ///
    /// # Safety
    /// `src` must be device memory of this context holding `bytes`; `dst` must be
    /// valid for `bytes` writes, and not otherwise accessed, until `stream` has
    /// been synchronised. Prefer [`CudaStream::copy_d2h`], which is safe.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice); `cuMemcpyDtoHAsync_v2`'s status, naming the copy.
    pub unsafe fn copy_d2h_async(
        &self,
        dst: *mut c_void,
        src: CUdeviceptr,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let s = stream.raw();
        self.host.ctx().call(
            || {
                format!(
                    "device {}: copy of {bytes} bytes from {src:#x}",
                    self.host.ordinal()
                )
            },
            // SAFETY: the caller's contract covers both pointers.
            |d| unsafe { cu!(d, cuMemcpyDtoHAsync_v2(dst, src, bytes, s)) },
        )
    }

    /// Block until all work queued on `stream` has finished (the first error of that
    /// work, such as a kernel's illegal address, is reported here).
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice); `cuStreamSynchronize`'s status.
    pub fn stream_synchronize(&self, stream: &CudaStream) -> Result<()> {
        self.check_stream(stream)?;
        stream.synchronize()
    }

    /// Launch `raw_func` on `stream` with the driver's `void*` parameter array.
    ///
    /// The handle must come from this registry (checked: another registry's, or a
    /// dropped one's, is refused), the stream must be of its device (checked), and
    /// the shape is checked against the device's limits; above the kernel's
    /// dynamic shared memory limit it is opted in first (once per kernel and size).
    /// The arguments' sizes cannot be checked here: prefer
    /// [`MetraleRegistry::launch`] or [`CudaStream::launch`].
    ///
    /// # Safety
    /// - `kernel_params` holds one pointer per kernel parameter, each to a value of
    ///   the parameter's type, valid for the duration of this call.
    /// - What the kernel reads and writes is valid device memory until it finishes.
    ///
    /// # Errors
    /// [`ErrorKind::ForeignHandle`](crate::ErrorKind::ForeignHandle), [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice),
    /// [`ErrorKind::KernelLaunch`](crate::ErrorKind::KernelLaunch) naming the kernel, with grid, block and
    /// shared memory: an impossible shape (before the driver), a failed opt-in, or
    /// `cuLaunchKernel`'s status.
    #[inline]
    pub unsafe fn launch_on_stream(
        &self,
        raw_func: RawCudaFunc,
        cfg: LaunchConfig,
        stream: &CudaStream,
        kernel_params: &mut [*mut c_void],
    ) -> Result<()> {
        let info = self.table.resolve(raw_func)?;
        // SAFETY: the caller's contract; the handle is this registry's (resolved).
        unsafe {
            launch_kernel(
                stream,
                &self.table,
                info,
                &cfg,
                None,
                kernel_params.as_mut_ptr(),
            )
        }
    }

    /// Launch with typed arguments: a tuple of values and device memory, packed on
    /// the stack, or a [`KernelArgList`](crate::KernelArgList) built at run time
    /// (`&list`), checked against the kernel's parameter layout
    /// (`registry.launch(f, cfg, stream, (&a, &b, &mut c, n))`).
    ///
    /// # Safety
    /// As [`CudaStream::launch`].
    ///
    /// # Errors
    /// As [`MetraleRegistry::launch_on_stream`], and
    /// [`ErrorKind::ArgumentMismatch`](crate::ErrorKind::ArgumentMismatch).
    #[inline]
    pub unsafe fn launch<A: KernelArgs<K>, K>(
        &self,
        func: RawCudaFunc,
        cfg: LaunchConfig,
        stream: &CudaStream,
        args: A,
    ) -> Result<()> {
        let info = self.table.resolve(func)?;
        args.with_params(|p| {
            // SAFETY: the packed pointers point into `args`, alive here; the handle
            // is this registry's.
            unsafe {
                launch_kernel(
                    stream,
                    &self.table,
                    info,
                    &cfg,
                    Some(args.layout()),
                    p.as_mut_ptr(),
                )
            }
        })
    }
}

impl crate::stream::AsStream for MetraleRegistry {
    fn stream(&self) -> &CudaStream {
        self.host.stream()
    }
}

impl AsContext for MetraleRegistry {
    fn context(&self) -> &Arc<CudaContext> {
        self.host.ctx()
    }
}
