//! [`CudaFunction`]: a kernel that keeps its code loaded, its attributes and
//! occupancy.

use std::ffi::c_int;
use std::fmt;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUfunction, CUfunction_attribute};

use super::info::{KernelInfo, ParamInfo};
use super::raw::RawCudaFunc;
use super::table::KernelTable;
use crate::context::CudaContext;
use crate::error::{cu, invalid_arg, Result};

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

impl KernelTable {
    /// A [`CudaFunction`] for `module::name`.
    pub(crate) fn function(self: &Arc<Self>, module: &str, name: &str) -> Result<CudaFunction> {
        Ok(CudaFunction {
            info: self.info(module, name)?,
            table: Arc::clone(self),
        })
    }
}
