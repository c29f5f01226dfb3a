//! Launch configuration, its validation, typed kernel arguments, and the
//! dynamic shared memory opt-in bookkeeping.
//!
//! Owns:
//! - [`LaunchConfig`] (grid, block, dynamic shared memory) and its checks, against
//!   the fixed CUDA rules ([`LaunchConfig::new`]) and against a device's limits
//!   ([`LaunchConfig::validate_for`]);
//! - [`KernelArgs`]: tuples of [`KernelArg`] values packed into the driver's
//!   `void**` array on the stack, with no heap allocation;
//! - `SmemOptIns`, the per-registry record of the dynamic shared memory limit set on
//!   each kernel, so `cuFuncSetAttribute` runs once per kernel and size, not per launch.
//!
//! Invariant: nothing here allocates or locks on the launch path.

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

use metrale_cuda_sys::{
    CUdeviceptr, CUfunction, CUlaunchAttribute, CUlaunchAttributeID,
    CUlaunchAttributeValue_union__bindgen_ty_1,
};

use crate::error::{MetraleError, Result};
use crate::host::DeviceLimits;
use crate::memory::{DeviceBuffer, DeviceRepr};

/// Dynamic shared memory a kernel may use without opting in (48 KiB).
pub const DEFAULT_DYNAMIC_SHARED_LIMIT: u32 = 48 * 1024;

/// The shape of a launch: grid and block dimensions and dynamic shared memory bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Blocks in the grid (x, y, z).
    pub grid_dim: (u32, u32, u32),
    /// Threads in a block (x, y, z).
    pub block_dim: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes. Above 48 KiB the launch opts the
    /// kernel in first (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A checked configuration: no dimension may be zero, a block has at most 1024
    /// threads and a z extent of at most 64 (the rules of every CUDA device).
    ///
    /// # Errors
    /// [`MetraleError::InvalidArgument`] saying which rule failed.
    pub fn new(
        grid_dim: (u32, u32, u32),
        block_dim: (u32, u32, u32),
        shared_mem_bytes: u32,
    ) -> Result<LaunchConfig> {
        let cfg = LaunchConfig {
            grid_dim,
            block_dim,
            shared_mem_bytes,
        };
        cfg.check_shape()
            .map_err(|why| MetraleError::InvalidArgument(format!("{why} {cfg}")))?;
        Ok(cfg)
    }

    /// One dimension: `ceil(n / block)` blocks of `block` threads (`block` must be
    /// 1..=1024). For element-wise kernels.
    ///
    /// # Errors
    /// [`MetraleError::InvalidArgument`] for `n == 0` or a bad block size.
    pub fn for_num_elems(n: u32, block: u32) -> Result<LaunchConfig> {
        if n == 0 {
            return Err(MetraleError::InvalidArgument(
                "launch for 0 elements".to_owned(),
            ));
        }
        let block_count = n.div_ceil(block.max(1));
        LaunchConfig::new((block_count, 1, 1), (block, 1, 1), 0)
    }

    /// Threads in one block.
    pub fn threads_per_block(&self) -> u64 {
        u64::from(self.block_dim.0) * u64::from(self.block_dim.1) * u64::from(self.block_dim.2)
    }

    /// The device-independent rules; `Err` holds the reason.
    #[inline]
    pub(crate) fn check_shape(&self) -> Result<(), &'static str> {
        let (g, b) = (self.grid_dim, self.block_dim);
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 {
            return Err("a launch dimension is zero:");
        }
        if self.threads_per_block() > 1024 {
            return Err("more than 1024 threads per block:");
        }
        if b.2 > 64 {
            return Err("block z dimension above 64:");
        }
        Ok(())
    }

    /// Check against a device's limits: block and grid extents, threads per block,
    /// and dynamic shared memory against the opt-in maximum.
    ///
    /// # Errors
    /// [`MetraleError::InvalidArgument`] naming the limit that was exceeded.
    pub fn validate_for(&self, limits: &DeviceLimits) -> Result<()> {
        self.check_limits(limits)
            .map_err(|why| MetraleError::InvalidArgument(format!("{why} {self}")))
    }

    #[inline]
    pub(crate) fn check_limits(&self, limits: &DeviceLimits) -> Result<(), String> {
        self.check_shape().map_err(str::to_owned)?;
        let (g, b) = (self.grid_dim, self.block_dim);
        if self.threads_per_block() > u64::from(limits.max_threads_per_block) {
            return Err(format!(
                "more threads per block than the device's {}:",
                limits.max_threads_per_block
            ));
        }
        let block = [b.0, b.1, b.2];
        let grid = [g.0, g.1, g.2];
        for (axis, name) in ["x", "y", "z"].iter().enumerate() {
            if block[axis] > limits.max_block_dim[axis] {
                return Err(format!(
                    "block {name} dimension above the device's {}:",
                    limits.max_block_dim[axis]
                ));
            }
            if grid[axis] > limits.max_grid_dim[axis] {
                return Err(format!(
                    "grid {name} dimension above the device's {}:",
                    limits.max_grid_dim[axis]
                ));
            }
        }
        if self.shared_mem_bytes > limits.max_shared_per_block_optin {
            return Err(format!(
                "dynamic shared memory above the device's opt-in limit of {} bytes:",
                limits.max_shared_per_block_optin
            ));
        }
        Ok(())
    }
}

impl fmt::Display for LaunchConfig {
    /// `(grid=[x,y,z], block=[x,y,z], shared_mem=N)`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (g, b) = (self.grid_dim, self.block_dim);
        write!(
            f,
            "(grid=[{},{},{}], block=[{},{},{}], shared_mem={})",
            g.0, g.1, g.2, b.0, b.1, b.2, self.shared_mem_bytes
        )
    }
}

/// Portable maximum of blocks in one thread-block cluster.
pub const MAX_PORTABLE_CLUSTER_SIZE: u64 = 8;

/// Launch attributes for `cuLaunchKernelEx` (CUDA 12.0+):
/// [`MetraleRegistry::launch_ex`](crate::MetraleRegistry::launch_ex).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaunchAttributes {
    /// Thread-block cluster dimensions (compute capability 9.0+). Each must divide
    /// the grid's, and the cluster may hold at most 8 blocks.
    pub cluster_dim: Option<(u32, u32, u32)>,
    /// Cooperative launch: all blocks are co-resident and may synchronise grid-wide.
    pub cooperative: bool,
    /// Programmatic dependent launch: this kernel may start before the previous
    /// kernel on the stream finishes (it waits with `cudaGridDependencySynchronize`).
    pub programmatic_stream_serialization: bool,
}

impl LaunchAttributes {
    /// Attributes with only a cluster shape.
    pub fn cluster(x: u32, y: u32, z: u32) -> LaunchAttributes {
        LaunchAttributes {
            cluster_dim: Some((x, y, z)),
            ..LaunchAttributes::default()
        }
    }

    /// Check the attributes against the launch shape and the device; `Err` holds
    /// the reason.
    pub(crate) fn check(&self, cfg: &LaunchConfig, limits: &DeviceLimits) -> Result<(), String> {
        if let Some((x, y, z)) = self.cluster_dim {
            if !limits.cluster_launch {
                let (major, minor) = limits.compute_capability;
                return Err(format!(
                    "the device (compute capability {major}.{minor}) cannot launch thread-block clusters (9.0+ can):"
                ));
            }
            let cluster = [x, y, z];
            let grid = [cfg.grid_dim.0, cfg.grid_dim.1, cfg.grid_dim.2];
            for (axis, name) in ["x", "y", "z"].iter().enumerate() {
                if cluster[axis] == 0 || !grid[axis].is_multiple_of(cluster[axis]) {
                    return Err(format!(
                        "cluster {name} dimension {} does not divide grid {name} dimension {}:",
                        cluster[axis], grid[axis]
                    ));
                }
            }
            let size = u64::from(x) * u64::from(y) * u64::from(z);
            if size > MAX_PORTABLE_CLUSTER_SIZE {
                return Err(format!(
                    "a cluster of {size} blocks exceeds the limit of {MAX_PORTABLE_CLUSTER_SIZE} blocks per cluster:"
                ));
            }
        }
        if self.cooperative && !limits.cooperative_launch {
            return Err("the device does not support cooperative launches:".to_owned());
        }
        Ok(())
    }

    /// The driver's attribute array (on the stack) and how many entries are used.
    pub(crate) fn to_driver(self) -> ([CUlaunchAttribute; 3], usize) {
        let mut attrs = [CUlaunchAttribute::default(); 3];
        let mut n = 0;
        if let Some((x, y, z)) = self.cluster_dim {
            attrs[n].id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim = CUlaunchAttributeValue_union__bindgen_ty_1 { x, y, z };
            n += 1;
        }
        if self.cooperative {
            attrs[n].id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
            attrs[n].value.cooperative = 1;
            n += 1;
        }
        if self.programmatic_stream_serialization {
            attrs[n].id =
                CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        (attrs, n)
    }
}

impl fmt::Display for LaunchAttributes {
    /// ` cluster=[x,y,z] cooperative programmatic` (only what is set).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((x, y, z)) = self.cluster_dim {
            write!(f, " cluster=[{x},{y},{z}]")?;
        }
        if self.cooperative {
            f.write_str(" cooperative")?;
        }
        if self.programmatic_stream_serialization {
            f.write_str(" programmatic")?;
        }
        Ok(())
    }
}

/// One kernel argument: something whose bytes are passed by pointer to the driver.
///
/// # Safety
/// `param_ptr` must return a pointer to this value's bytes, valid while `self` is
/// borrowed, laid out as the kernel's matching parameter expects.
pub unsafe trait KernelArg {
    /// Pointer to the argument's bytes.
    fn param_ptr(&self) -> *mut c_void;
}

// SAFETY: a plain-old-data value is passed by its own bytes.
unsafe impl<T: DeviceRepr> KernelArg for T {
    #[inline]
    fn param_ptr(&self) -> *mut c_void {
        (self as *const T).cast_mut().cast()
    }
}

// SAFETY: a device buffer is passed as its device address, a `CUdeviceptr` field the
// buffer holds for as long as it is borrowed.
unsafe impl<T: DeviceRepr> KernelArg for &DeviceBuffer<T> {
    #[inline]
    fn param_ptr(&self) -> *mut c_void {
        self.device_ptr_ref() as *const CUdeviceptr as *mut c_void
    }
}

// SAFETY: as for `&DeviceBuffer<T>`.
unsafe impl<T: DeviceRepr> KernelArg for &mut DeviceBuffer<T> {
    #[inline]
    fn param_ptr(&self) -> *mut c_void {
        self.device_ptr_ref() as *const CUdeviceptr as *mut c_void
    }
}

/// A kernel's whole argument list: a tuple of up to 16 [`KernelArg`]s, or `()`.
///
/// # Safety
/// `with_params` must pass `f` an array holding one valid [`KernelArg::param_ptr`]
/// per element, in order.
pub unsafe trait KernelArgs {
    /// Number of arguments.
    const COUNT: usize;
    /// Call `f` with the packed `void*` array (on the stack).
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R;
}

macro_rules! impl_kernel_args {
    ($n:literal; $($t:ident . $i:tt),*) => {
        // SAFETY: one pointer per tuple element, in order, borrowed from `self`.
        unsafe impl<$($t: KernelArg),*> KernelArgs for ($($t,)*) {
            const COUNT: usize = $n;
            #[inline]
            fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
                let mut params: [*mut c_void; $n] = [$(self.$i.param_ptr()),*];
                f(&mut params)
            }
        }
    };
}

// SAFETY: no arguments, an empty array.
unsafe impl KernelArgs for () {
    const COUNT: usize = 0;
    #[inline]
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
        f(&mut [])
    }
}
impl_kernel_args!(1; A.0);
impl_kernel_args!(2; A.0, B.1);
impl_kernel_args!(3; A.0, B.1, C.2);
impl_kernel_args!(4; A.0, B.1, C.2, D.3);
impl_kernel_args!(5; A.0, B.1, C.2, D.3, E.4);
impl_kernel_args!(6; A.0, B.1, C.2, D.3, E.4, F.5);
impl_kernel_args!(7; A.0, B.1, C.2, D.3, E.4, F.5, G.6);
impl_kernel_args!(8; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7);
impl_kernel_args!(9; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8);
impl_kernel_args!(10; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9);
impl_kernel_args!(11; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10);
impl_kernel_args!(12; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11);
impl_kernel_args!(13; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11, M.12);
impl_kernel_args!(14; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11, M.12, N.13);
impl_kernel_args!(15; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11, M.12, N.13, O.14);
impl_kernel_args!(16; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11, M.12, N.13, O.14, P.15);

/// Kernels whose dynamic shared memory limit this registry raised, with the limit:
/// a fixed-size, lock-free open-addressing table (no allocation on the launch path).
/// A kernel that finds the table full is opted in on every launch above 48 KiB,
/// which is correct, only slower.
pub(crate) struct SmemOptIns {
    slots: [(AtomicPtr<c_void>, AtomicU32); Self::SLOTS],
}

impl SmemOptIns {
    const SLOTS: usize = 64;

    pub(crate) fn new() -> SmemOptIns {
        SmemOptIns {
            slots: std::array::from_fn(|_| (AtomicPtr::default(), AtomicU32::new(0))),
        }
    }

    fn start(func: CUfunction) -> usize {
        // Kernel handles are heap addresses: drop the alignment bits, then mix.
        let x = (func as usize >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15_u64 as usize);
        x % Self::SLOTS
    }

    /// The limit recorded for `func` (0 when none).
    #[inline]
    pub(crate) fn limit(&self, func: CUfunction) -> u32 {
        let key = func.cast::<c_void>();
        let start = Self::start(func);
        for i in 0..Self::SLOTS {
            let (k, v) = &self.slots[(start + i) % Self::SLOTS];
            let found = k.load(Ordering::Acquire);
            if found == key {
                return v.load(Ordering::Acquire);
            }
            if found.is_null() {
                return 0;
            }
        }
        0
    }

    /// Record that `func`'s limit is now at least `bytes`.
    pub(crate) fn record(&self, func: CUfunction, bytes: u32) {
        let key = func.cast::<c_void>();
        let start = Self::start(func);
        for i in 0..Self::SLOTS {
            let (k, v) = &self.slots[(start + i) % Self::SLOTS];
            let claimed = match k.compare_exchange(
                std::ptr::null_mut(),
                key,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => true,
                Err(existing) => existing == key,
            };
            if claimed {
                v.fetch_max(bytes, Ordering::AcqRel);
                return;
            }
        }
    }
}

#[cfg(test)]
#[path = "tests/launch.rs"]
mod tests;
