//! `KernelTable`: one device's view of a registry's code, its lookups memoized
//! per module; which table a kernel handle came from; the code held while
//! captures are in progress.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock, Weak};

use metrale_cuda_sys::{CUdeviceptr, CUfunction, CUfunction_attribute};

use super::info::{read_params, KernelInfo};
use super::raw::RawCudaFunc;
use crate::context::CudaContext;
use crate::error::{cu, ErrorKind, MetraleError, NameKind, Result};
use crate::module::{c_name, ModuleSet};

/// A capture is beginning (counted before the driver begins it).
pub(crate) fn capture_started() {
    crate::lifetime::capture_began();
}

/// A capture is over; the code held for it goes once no capture is left (host
/// functions are not released here: each capture's end releases the ones it
/// took, see `CudaStream::end_capture`).
pub(crate) fn capture_finished() {
    crate::lifetime::capture_ended();
}

/// Hold `table` while captures are in progress (the launch path's cold side).
#[cold]
pub(crate) fn keep_for_capture(table: &Arc<KernelTable>) {
    crate::lifetime::hold_while_capturing(table);
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
    pub(super) id: u64,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) code: Arc<ModuleSet>,
    pub(super) memo: Vec<RwLock<HashMap<Box<str>, Arc<KernelInfo>>>>,
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

    /// The id every handle this table makes carries.
    #[inline(always)]
    pub(crate) fn id(&self) -> u64 {
        self.id
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
        let info = Arc::new(KernelInfo::new(
            raw,
            Arc::from(format!("{module}::{name}")),
            params,
            u32::try_from(smem).unwrap_or(0),
        ));
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
