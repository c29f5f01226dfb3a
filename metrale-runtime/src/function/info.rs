//! What the driver says about one kernel, looked up once: [`ParamInfo`] and the
//! shared `KernelInfo` (handle, name, parameter layout, shared-memory limit).

use std::ffi::c_int;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use metrale_cuda_sys::{self as sys, CUfunction, CUfunction_attribute, CUresult};

use crate::error::{cu, CallError, Result};

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
    /// The info of kernel `raw`, named `name`, with its parameter layout when
    /// read (`None`: read it at the first typed launch) and the dynamic shared
    /// memory limit the driver has for it.
    pub(super) fn new(
        raw: CUfunction,
        name: Arc<str>,
        params: Option<Option<Box<[ParamInfo]>>>,
        smem: u32,
    ) -> KernelInfo {
        KernelInfo {
            raw,
            name,
            params: params.map(OnceLock::from).unwrap_or_default(),
            smem: AtomicU32::new(smem),
            smem_lock: Mutex::new(()),
        }
    }

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
    pub(super) fn set_limit(&self, d: &'static sys::Driver, bytes: u32) -> Result<(), CallError> {
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
