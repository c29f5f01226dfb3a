//! Kernels: [`CudaFunction`] (a kernel that keeps its code loaded), its attributes,
//! occupancy and parameter layout; [`RawCudaFunc`], the copyable handle of the
//! seed's memoized lookup; and the per-device table that looks kernels up once.
//!
//! Invariants:
//! - Each registry has one `KernelTable` per device: its context, the code it
//!   reads (a `ModuleSet`) and, per module, the kernels looked up so far. A
//!   kernel is looked up in the driver once per table; its `KernelInfo` (handle,
//!   name, parameter layout, shared-memory limit) is shared by every handle to it
//!   and never removed while the table lives.
//! - A `CudaFunction` holds its table, so its code stays loaded while it lives.
//! - A `RawCudaFunc` carries the id of the table it came from (ids are never
//!   reused). Its `KernelInfo` pointer is only followed after the id matched the
//!   table at hand, which is alive and keeps that info alive: a stale or foreign
//!   handle is detected, never dereferenced.
//! - The shared-memory limit recorded for a kernel is exactly what metrale last set
//!   in the driver: every change (launch opt-in or
//!   [`CudaFunction::set_max_dynamic_shared_bytes`]) sets the driver and the record
//!   under the kernel's lock, so they agree under any interleaving.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, Weak};

use metrale_cuda_sys::{self as sys, CUdeviceptr, CUfunction, CUfunction_attribute, CUresult};

use crate::context::CudaContext;
use crate::error::{cu, invalid_arg, CallError, ErrorKind, MetraleError, NameKind, Result};
use crate::module::{c_name, ModuleSet};

/// One kernel parameter, as the driver lays it out (`cuFuncGetParamInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamInfo {
    /// Byte offset in the kernel's parameter buffer.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
}

/// What metrale knows about one kernel of one table.
pub(crate) struct KernelInfo {
    pub(crate) raw: CUfunction,
    /// `module::kernel`.
    pub(crate) name: Arc<str>,
    /// The parameter layout once known: `Some(None)` when the driver cannot
    /// report it (before 12.4). Unset after a failed read, which the next typed
    /// launch repeats (a transient failure never disables the check).
    pub(crate) params: OnceLock<Option<Box<[ParamInfo]>>>,
    /// The dynamic shared memory limit set in the driver for this kernel.
    smem: AtomicU32,
    /// Serialises changes of `smem` with the driver call that makes them.
    smem_lock: Mutex<()>,
}

// SAFETY: `raw` is an opaque handle written once and passed to the thread-safe
// driver; the mutable parts are an atomic and a mutex.
unsafe impl Send for KernelInfo {}
// SAFETY: as for Send.
unsafe impl Sync for KernelInfo {}

impl KernelInfo {
    /// Whether a launch with `bytes` of dynamic shared memory needs no opt-in.
    #[inline]
    pub(crate) fn smem_ready(&self, bytes: u32) -> bool {
        bytes <= self.smem.load(Ordering::Acquire)
    }

    /// Raise the kernel's limit to at least `bytes` (the context is current).
    #[cold]
    pub(crate) fn opt_in(&self, d: &'static sys::Driver, bytes: u32) -> Result<(), CallError> {
        let _serial = self
            .smem_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.smem.load(Ordering::Acquire) >= bytes {
            return Ok(());
        }
        self.set_limit_locked(d, bytes)
    }

    /// Set the limit to exactly `bytes` (the context is current).
    fn set_limit(&self, d: &'static sys::Driver, bytes: u32) -> Result<(), CallError> {
        let _serial = self
            .smem_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.set_limit_locked(d, bytes)
    }

    fn set_limit_locked(&self, d: &'static sys::Driver, bytes: u32) -> Result<(), CallError> {
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        let value = c_int::try_from(bytes).unwrap_or(c_int::MAX);
        // SAFETY: sets a plain attribute of a live function handle.
        unsafe { cu!(d, cuFuncSetAttribute(self.raw, attr, value)) }?;
        self.smem.store(bytes, Ordering::Release);
        Ok(())
    }
}

/// Read a kernel's parameter layout: `Ok(None)` when the driver cannot report
/// one (no `cuFuncGetParamInfo`), the failing call otherwise.
pub(crate) fn read_params(
    d: &'static sys::Driver,
    func: CUfunction,
) -> Result<Option<Box<[ParamInfo]>>, CallError> {
    let Ok(f) = d.cuFuncGetParamInfo() else {
        return Ok(None);
    };
    let mut params = Vec::new();
    // A kernel has at most 32 KiB of parameters: the loop ends well before this.
    for index in 0..32 * 1024 {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: writes two sizes for a live function handle.
        let status = unsafe { f(func, index, &mut offset, &mut size) };
        if status.is_success() {
            params.push(ParamInfo { offset, size });
        } else if status == CUresult::CUDA_ERROR_INVALID_VALUE {
            // One past the last parameter.
            return Ok(Some(params.into_boxed_slice()));
        } else {
            return Err(CallError::Status {
                call: "cuFuncGetParamInfo",
                status,
            });
        }
    }
    Ok(None)
}

impl KernelInfo {
    /// The parameter layout (reading it again after an earlier failure); the
    /// context must be current. `Ok(None)`: the driver cannot report one.
    #[inline]
    pub(crate) fn layout(
        &self,
        d: &'static sys::Driver,
    ) -> Result<Option<&[ParamInfo]>, CallError> {
        if let Some(known) = self.params.get() {
            return Ok(known.as_deref());
        }
        self.read_layout(d)
    }

    #[cold]
    fn read_layout(&self, d: &'static sys::Driver) -> Result<Option<&[ParamInfo]>, CallError> {
        let read = read_params(d, self.raw)?;
        Ok(self.params.get_or_init(|| read).as_deref())
    }
}

/// Kernel code held while captures are in progress: every kernel queued while
/// any capture is under way keeps its table here until the captures end, so a
/// registry dropped inside a capture cannot unload code the graph will run.
static CAPTURED_CODE: Mutex<Vec<Arc<KernelTable>>> = Mutex::new(Vec::new());

/// A capture is beginning (counted before the driver begins it).
pub(crate) fn capture_started() {
    crate::stream::captures_begin();
}

/// A capture is over; the held code goes once no capture is left.
pub(crate) fn capture_finished() {
    if crate::stream::captures_end() {
        let mut held = CAPTURED_CODE.lock().unwrap_or_else(PoisonError::into_inner);
        if !crate::stream::captures_in_progress() {
            let released = std::mem::take(&mut *held);
            drop(held);
            drop(released);
            // Host functions are not released here: each capture's end releases
            // the ones it took (see `CudaStream::end_capture`).
        }
    }
}

/// Hold `table` while captures are in progress (the launch path's cold side).
#[cold]
pub(crate) fn keep_for_capture(table: &Arc<KernelTable>) {
    let mut held = CAPTURED_CODE.lock().unwrap_or_else(PoisonError::into_inner);
    if !held.iter().any(|t| Arc::ptr_eq(t, table)) {
        held.push(Arc::clone(table));
    }
}

/// Where each looked-up kernel handle comes from, for graphs (which must keep the
/// code of their kernels loaded). Entries leave when their table drops.
fn owners() -> &'static RwLock<HashMap<usize, Weak<KernelTable>>> {
    static OWNERS: OnceLock<RwLock<HashMap<usize, Weak<KernelTable>>>> = OnceLock::new();
    OWNERS.get_or_init(RwLock::default)
}

/// The table a kernel handle was looked up through, while it is alive.
pub(crate) fn owner_of(func: CUfunction) -> Option<Arc<KernelTable>> {
    owners()
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&(func as usize))
        .and_then(Weak::upgrade)
}

/// The kernel name a handle was looked up as, while its table is alive.
pub(crate) fn name_of(func: CUfunction) -> Option<Arc<str>> {
    owner_of(func).and_then(|t| t.name_of(func))
}

/// One device's view of a registry's code: lookups, memoized per module.
pub(crate) struct KernelTable {
    id: u64,
    ctx: Arc<CudaContext>,
    code: Arc<ModuleSet>,
    memo: Vec<RwLock<HashMap<Box<str>, Arc<KernelInfo>>>>,
}

impl KernelTable {
    pub(crate) fn new(ctx: &Arc<CudaContext>, code: Arc<ModuleSet>) -> Arc<KernelTable> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let memo = (0..code.list().len()).map(|_| RwLock::default()).collect();
        Arc::new(KernelTable {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            ctx: Arc::clone(ctx),
            code,
            memo,
        })
    }

    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn code(&self) -> &Arc<ModuleSet> {
        &self.code
    }

    /// The kernel `module::name`, looked up in the driver on first use.
    pub(crate) fn info(self: &Arc<Self>, module: &str, name: &str) -> Result<Arc<KernelInfo>> {
        let index = self.code.require(module, Some(name))?;
        let memo = &self.memo[index];
        if let Some(info) = memo
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
        {
            return Ok(Arc::clone(info));
        }
        self.look_up(index, module, name)
    }

    #[cold]
    fn look_up(
        self: &Arc<Self>,
        index: usize,
        module: &str,
        name: &str,
    ) -> Result<Arc<KernelInfo>> {
        let c = c_name(module, name)?;
        let code = &self.code;
        let (raw, params, smem) = self
            .ctx
            .with(|d| {
                let raw = code.function(d, index, &c)?;
                let mut smem: c_int = 48 * 1024;
                let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                // SAFETY: writes one int for a live function handle. Where this fails,
                // the driver's documented default (48 KiB) is assumed.
                let _ = unsafe { cu!(d, cuFuncGetAttribute(&mut smem, attr, raw)) };
                Ok((raw, read_params(d, raw).ok(), smem))
            })
            .map_err(|e| e.lookup(NameKind::Kernel, module, name))?;
        let info = Arc::new(KernelInfo {
            raw,
            name: Arc::from(format!("{module}::{name}")),
            params: params.map(OnceLock::from).unwrap_or_default(),
            smem: AtomicU32::new(u32::try_from(smem).unwrap_or(0)),
            smem_lock: Mutex::new(()),
        });
        // Another thread may have looked the kernel up meanwhile: keep the first.
        let info = Arc::clone(
            self.memo[index]
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(name.into())
                .or_insert(info),
        );
        owners()
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(raw as usize, Arc::downgrade(self));
        Ok(info)
    }

    /// A [`CudaFunction`] for `module::name`.
    pub(crate) fn function(self: &Arc<Self>, module: &str, name: &str) -> Result<CudaFunction> {
        Ok(CudaFunction {
            info: self.info(module, name)?,
            table: Arc::clone(self),
        })
    }

    /// A [`RawCudaFunc`] for `module::name`.
    pub(crate) fn raw_function(self: &Arc<Self>, module: &str, name: &str) -> Result<RawCudaFunc> {
        let info = self.info(module, name)?;
        Ok(RawCudaFunc {
            raw: info.raw,
            info: Arc::as_ptr(&info),
            table: self.id,
        })
    }

    /// Whether `f` was made by this table (one compare).
    #[inline(always)]
    pub(crate) fn owns(&self, f: RawCudaFunc) -> bool {
        f.table == self.id
    }

    /// The info behind `f`, when `f` comes from this table; else
    /// [`ErrorKind::ForeignHandle`] naming the kernel where it can.
    #[inline]
    pub(crate) fn resolve(&self, f: RawCudaFunc) -> Result<&KernelInfo> {
        if f.table == self.id {
            // SAFETY: the id matched: `f` was made by this table, whose memo holds the
            // `Arc<KernelInfo>` behind `f.info` for as long as the table lives.
            return Ok(unsafe { &*f.info });
        }
        Err(foreign(f))
    }

    /// The name of a kernel this table looked up.
    fn name_of(&self, func: CUfunction) -> Option<Arc<str>> {
        self.memo.iter().find_map(|m| {
            m.read()
                .unwrap_or_else(PoisonError::into_inner)
                .values()
                .find(|i| i.raw == func)
                .map(|i| Arc::clone(&i.name))
        })
    }

    /// The `__device__` symbol `module::symbol` in this table's context.
    pub(crate) fn symbol(&self, module: &str, symbol: &str) -> Result<(CUdeviceptr, usize)> {
        let index = self.code.require(module, Some(symbol))?;
        let c = c_name(module, symbol)?;
        self.ctx
            .with(|d| self.code.global(d, index, &c))
            .map_err(|e| e.lookup(NameKind::Symbol, module, symbol))
    }

    /// The kernels module `module` defines.
    pub(crate) fn kernel_names(&self, module: &str) -> Result<Vec<String>> {
        let index = self.code.require(module, None)?;
        self.ctx
            .with(|d| self.code.kernel_names(d, index))
            .map_err(|e| e.about(format_args!("module '{module}'")))
    }
}

impl Drop for KernelTable {
    fn drop(&mut self) {
        let mut owners = owners().write().unwrap_or_else(PoisonError::into_inner);
        for memo in &self.memo {
            for info in memo.read().unwrap_or_else(PoisonError::into_inner).values() {
                let key = info.raw as usize;
                // Only this table's entry: a newer table may have reused the address.
                if owners.get(&key).is_some_and(|w| w.strong_count() == 0) {
                    owners.remove(&key);
                }
            }
        }
    }
}

#[cold]
fn foreign(f: RawCudaFunc) -> MetraleError {
    let kernel = match name_of(f.raw) {
        Some(name) => name.to_string(),
        None => format!("{:p} (its registry was dropped)", f.raw),
    };
    ErrorKind::ForeignHandle { kernel }.into()
}

/// A raw `CUfunction` from [`MetraleRegistry::raw_function_cached`], cheap to copy,
/// with the identity of the registry it came from.
///
/// A registry accepts only its own handles: one from another registry, or from one
/// that was dropped, is detected (looked up again by
/// [`raw_function_cached`](crate::MetraleRegistry::raw_function_cached), refused
/// by launches) rather than handed to the driver.
///
/// [`MetraleRegistry::raw_function_cached`]: crate::MetraleRegistry::raw_function_cached
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawCudaFunc {
    raw: CUfunction,
    info: *const KernelInfo,
    table: u64,
}

// SAFETY: the handle is copied and compared; `info` is only dereferenced by the
// table that made it (see `KernelTable::resolve`), which is Sync.
unsafe impl Send for RawCudaFunc {}
// SAFETY: as for Send; a shared reference only copies the fields.
unsafe impl Sync for RawCudaFunc {}

impl RawCudaFunc {
    /// The driver's `CUfunction`, for driver calls of your own. It is valid while
    /// the registry it came from (or a [`CudaFunction`] of it) is alive.
    pub fn as_raw(self) -> CUfunction {
        self.raw
    }
}

impl fmt::Debug for RawCudaFunc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawCudaFunc")
            .field("raw", &self.raw)
            .field("registry", &self.table)
            .finish()
    }
}

/// A registry's own answers for caller caches (`OnceLock<RawCudaFunc>`) that hold
/// another registry's handle: a static filled by a registry since dropped keeps
/// that handle for good, and the registry in use answers from here in a few loads
/// instead of a lock and a hash. Direct-mapped slots keyed by the cache's address,
/// each under a sequence counter: readers never block, writers take a lock.
pub(crate) struct SideCache {
    slots: [SideSlot; SIDE_SLOTS],
    write: Mutex<()>,
}

const SIDE_SLOTS: usize = 64;

#[derive(Default)]
struct SideSlot {
    /// Odd while a writer changes the slot.
    seq: AtomicU32,
    key: AtomicUsize,
    /// The foreign handle the cache held when the answer was stored: a cache at a
    /// reused address (holding another handle) does not match.
    held_raw: AtomicPtr<c_void>,
    held_table: AtomicU64,
    raw: AtomicPtr<c_void>,
    info: AtomicPtr<KernelInfo>,
    table: AtomicU64,
}

impl Default for SideCache {
    fn default() -> Self {
        SideCache {
            slots: std::array::from_fn(|_| SideSlot::default()),
            write: Mutex::new(()),
        }
    }
}

impl SideCache {
    fn slot(&self, key: usize) -> &SideSlot {
        &self.slots[(key >> 3) % SIDE_SLOTS]
    }

    /// The handle remembered for `cache`, if any.
    #[inline]
    pub(crate) fn get<C>(&self, cache: &C, held: RawCudaFunc) -> Option<RawCudaFunc> {
        let key = cache as *const C as usize;
        let slot = self.slot(key);
        let before = slot.seq.load(Ordering::Acquire);
        if before & 1 == 1
            || slot.key.load(Ordering::Acquire) != key
            || slot.held_table.load(Ordering::Acquire) != held.table
            || slot.held_raw.load(Ordering::Acquire) != held.raw.cast()
        {
            return None;
        }
        let f = RawCudaFunc {
            raw: slot.raw.load(Ordering::Acquire).cast(),
            info: slot.info.load(Ordering::Acquire),
            table: slot.table.load(Ordering::Acquire),
        };
        std::sync::atomic::fence(Ordering::Acquire);
        (slot.seq.load(Ordering::Relaxed) == before).then_some(f)
    }

    /// Remember `f` (a handle of this registry's table) for `cache`.
    pub(crate) fn put<C>(&self, cache: &C, held: RawCudaFunc, f: RawCudaFunc) {
        let key = cache as *const C as usize;
        let _serial = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = self.slot(key);
        slot.seq.fetch_add(1, Ordering::AcqRel);
        std::sync::atomic::fence(Ordering::Release);
        slot.key.store(key, Ordering::Release);
        slot.held_raw.store(held.raw.cast(), Ordering::Release);
        slot.held_table.store(held.table, Ordering::Release);
        slot.raw.store(f.raw.cast(), Ordering::Release);
        slot.info.store(f.info.cast_mut(), Ordering::Release);
        slot.table.store(f.table, Ordering::Release);
        slot.seq.fetch_add(1, Ordering::Release);
    }
}

/// A kernel's attributes, as `cuFuncGetAttribute` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
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

/// A kernel of a loaded model: for launches ([`CudaStream::launch`]), attributes,
/// occupancy and its parameter layout. It keeps its code loaded: a registry's
/// modules are unloaded when the registry and every `CudaFunction` taken from it
/// are gone. Cloning is cheap.
///
/// ```no_run
/// # use metrale_runtime::MetraleRegistry;
/// # fn main() -> metrale_runtime::Result<()> {
/// # let reg = MetraleRegistry::load(0, &[("kernels", b"...")])?;
/// let f = reg.function("kernels", "vec_add")?;
/// println!("{}: {} registers, parameters {:?}", f.name(), f.attributes()?.num_regs, f.params());
/// let (block, grid) = f.potential_block_size(0)?;
/// # Ok(()) }
/// ```
///
/// [`CudaStream::launch`]: crate::CudaStream::launch
#[derive(Clone)]
pub struct CudaFunction {
    info: Arc<KernelInfo>,
    table: Arc<KernelTable>,
}

impl fmt::Debug for CudaFunction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaFunction")
            .field("name", &self.info.name)
            .field("device", &self.table.ctx.ordinal())
            .field("raw", &self.info.raw)
            .finish()
    }
}

impl CudaFunction {
    /// `module::kernel`.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// The copyable handle of this kernel, for the registry's raw launch path.
    pub fn raw(&self) -> RawCudaFunc {
        RawCudaFunc {
            raw: self.info.raw,
            info: Arc::as_ptr(&self.info),
            table: self.table.id,
        }
    }

    /// The driver's `CUfunction`, valid while this value lives.
    pub fn as_raw(&self) -> CUfunction {
        self.info.raw
    }

    /// The context of the device this kernel handle belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.table.ctx
    }

    /// The kernel's parameters (offset and size of each), read once from the driver
    /// (`cuFuncGetParamInfo`, CUDA 12.4+). `None` on an older driver: typed
    /// launches then go ahead unchecked.
    pub fn params(&self) -> Option<&[ParamInfo]> {
        self.info.params.get().and_then(|p| p.as_deref())
    }

    pub(crate) fn info(&self) -> &KernelInfo {
        &self.info
    }

    pub(crate) fn table(&self) -> &Arc<KernelTable> {
        &self.table
    }

    fn subject(&self) -> String {
        format!("kernel '{}'", self.info.name)
    }

    fn get(&self, attr: CUfunction_attribute) -> Result<i32> {
        let mut v: c_int = 0;
        let raw = self.info.raw;
        self.table.ctx.call(
            || self.subject(),
            // SAFETY: writes one int for a live function handle.
            |d| unsafe { cu!(d, cuFuncGetAttribute(&mut v, attr, raw)) },
        )?;
        Ok(v)
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

    /// Set the dynamic shared memory the kernel may use to exactly `bytes` (above
    /// 48 KiB this is the opt-in). Launches opt in by themselves when they need
    /// more; they see this value, so lowering it here makes the next larger launch
    /// opt in again.
    ///
    /// # Errors
    /// The failing `cuFuncSetAttribute` (a size above the device's opt-in limit).
    pub fn set_max_dynamic_shared_bytes(&self, bytes: u32) -> Result<()> {
        if i32::try_from(bytes).is_err() {
            return Err(invalid_arg(format!(
                "kernel '{}': {bytes} bytes of shared memory",
                self.info.name
            )));
        }
        let info = &self.info;
        self.table
            .ctx
            .call(|| self.subject(), |d| info.set_limit(d, bytes))
    }

    /// Preferred share of L1/shared memory given to shared memory, in percent
    /// (0..=100), or -1 for no preference.
    ///
    /// # Errors
    /// The failing `cuFuncSetAttribute`.
    pub fn set_preferred_carveout(&self, percent: i32) -> Result<()> {
        let raw = self.info.raw;
        let attr = CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
        self.table.ctx.call(
            || self.subject(),
            // SAFETY: sets a plain attribute of a live function handle.
            |d| unsafe { cu!(d, cuFuncSetAttribute(raw, attr, percent)) },
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
        let block = c_int::try_from(block_size).map_err(|_| {
            invalid_arg(format!(
                "kernel '{}': block size {block_size}",
                self.info.name
            ))
        })?;
        let (raw, mut n): (CUfunction, c_int) = (self.info.raw, 0);
        self.table.ctx.call(
            || self.subject(),
            // SAFETY: writes one int for a live function handle.
            |d| unsafe {
                cu!(
                    d,
                    cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        &mut n,
                        raw,
                        block,
                        dynamic_shared_bytes
                    )
                )
            },
        )?;
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
        let (raw, mut grid, mut block): (CUfunction, c_int, c_int) = (self.info.raw, 0, 0);
        self.table.ctx.call(
            || self.subject(),
            // SAFETY: writes two ints for a live function handle; the callback, when
            // given, is a plain function the driver calls synchronously.
            |d| unsafe {
                cu!(
                    d,
                    cuOccupancyMaxPotentialBlockSize(
                        &mut grid, &mut block, raw, per_block, fixed, 0
                    )
                )
            },
        )?;
        Ok((
            u32::try_from(block).unwrap_or(0),
            u32::try_from(grid).unwrap_or(0),
        ))
    }
}
