//! [`LaunchConfig`] (grid, block, dynamic shared memory) and the
//! [`LaunchAttributes`] of an extended launch, with the checks that need no
//! device and the ones against a device's limits.

use std::fmt;

use metrale_cuda_sys::{
    CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue_union__bindgen_ty_1,
};

use crate::context::DeviceLimits;
use crate::error::{invalid_arg, Result};

/// Dynamic shared memory a kernel may use without opting in (48 KiB).
pub const DEFAULT_DYNAMIC_SHARED_LIMIT: u32 = 48 * 1024;

/// The shape of a launch: grid and block dimensions and dynamic shared memory bytes.
///
/// Closed: the fields are private, read through [`grid_dim`](LaunchConfig::grid_dim),
/// [`block_dim`](LaunchConfig::block_dim), [`shared_mem_bytes`](LaunchConfig::shared_mem_bytes)
/// and [`attributes`](LaunchConfig::attributes), and every way to make or change
/// one checks the device-independent rules ([`LaunchConfig::new`],
/// [`with_grid`](LaunchConfig::with_grid), [`with_block`](LaunchConfig::with_block)),
/// so a `LaunchConfig` always has a shape some device can run. What depends on
/// the device (its grid and block limits, the shared-memory opt-in limit, the
/// attributes) is checked at launch; the limits also before, with
/// [`LaunchConfig::validate_for`].
///
/// ```
/// use metrale_runtime::LaunchConfig;
/// // 1,000,000 elements, 256 threads a block: 3907 blocks.
/// let cfg = LaunchConfig::for_num_elems(1_000_000, 256)?;
/// assert_eq!(cfg.grid_dim(), (3907, 1, 1));
/// // 2D tiles with 64 KiB of dynamic shared memory (opted in at launch).
/// let tiles = LaunchConfig::new((32, 32, 1), (16, 16, 1), 64 << 10)?;
/// assert_eq!(tiles.threads_per_block(), 256);
/// // Changing a dimension is checked like making one.
/// let wide = tiles.with_block((32, 32, 1))?;
/// assert_eq!(wide.block_dim(), (32, 32, 1));
/// // Impossible shapes are refused before any driver call.
/// assert!(LaunchConfig::new((1, 1, 1), (2048, 1, 1), 0).is_err());
/// assert!(tiles.with_block((64, 32, 1)).is_err());
/// # Ok::<(), metrale_runtime::MetraleError>(())
/// ```
///
/// A field cannot be set to a shape `new` would refuse:
///
/// ```compile_fail,E0616
/// # use metrale_runtime::LaunchConfig;
/// let mut cfg = LaunchConfig::new((1, 1, 1), (256, 1, 1), 0)?;
/// cfg.block_dim = (1025, 1, 1);
/// # Ok::<(), metrale_runtime::MetraleError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Blocks in the grid (x, y, z).
    pub(crate) grid_dim: (u32, u32, u32),
    /// Threads in a block (x, y, z).
    pub(crate) block_dim: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes. Above 48 KiB the launch opts the
    /// kernel in first (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
    pub(crate) shared_mem_bytes: u32,
    /// Thread-block clusters, cooperative launch, programmatic dependent launch:
    /// when any is set the launch goes through `cuLaunchKernelEx` (CUDA 12.0+),
    /// else through `cuLaunchKernel`. One configuration, one launch path.
    pub(crate) attributes: LaunchAttributes,
}

impl LaunchConfig {
    /// A checked configuration: no dimension may be zero, a block has at most 1024
    /// threads and a z extent of at most 64 (the rules of every CUDA device).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) saying which rule failed.
    pub fn new(
        grid_dim: (u32, u32, u32),
        block_dim: (u32, u32, u32),
        shared_mem_bytes: u32,
    ) -> Result<LaunchConfig> {
        LaunchConfig {
            grid_dim,
            block_dim,
            shared_mem_bytes,
            attributes: LaunchAttributes::default(),
        }
        .checked()
    }

    /// `self` when it passes the device-independent rules.
    fn checked(self) -> Result<LaunchConfig> {
        self.check_shape()
            .map_err(|why| invalid_arg(format!("{why} {self}")))?;
        Ok(self)
    }

    /// Blocks in the grid (x, y, z).
    #[inline]
    pub fn grid_dim(&self) -> (u32, u32, u32) {
        self.grid_dim
    }

    /// Threads in a block (x, y, z).
    #[inline]
    pub fn block_dim(&self) -> (u32, u32, u32) {
        self.block_dim
    }

    /// Dynamic shared memory per block, in bytes.
    #[inline]
    pub fn shared_mem_bytes(&self) -> u32 {
        self.shared_mem_bytes
    }

    /// The launch attributes (clusters, cooperative, programmatic dependent
    /// launch); when any is set the launch goes through `cuLaunchKernelEx`.
    #[inline]
    pub fn attributes(&self) -> LaunchAttributes {
        self.attributes
    }

    /// This configuration with `grid` blocks, checked as in [`LaunchConfig::new`].
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) saying which rule failed.
    pub fn with_grid(self, grid: (u32, u32, u32)) -> Result<LaunchConfig> {
        LaunchConfig {
            grid_dim: grid,
            ..self
        }
        .checked()
    }

    /// This configuration with blocks of `block` threads, checked as in
    /// [`LaunchConfig::new`].
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) saying which rule failed.
    pub fn with_block(self, block: (u32, u32, u32)) -> Result<LaunchConfig> {
        LaunchConfig {
            block_dim: block,
            ..self
        }
        .checked()
    }

    /// One dimension: `ceil(n / block)` blocks of `block` threads (`block` must be
    /// 1..=1024), for element-wise kernels over `n` elements.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for
    /// `n == 0`, a bad block size, or more blocks than a grid's x dimension holds.
    pub fn for_num_elems(n: usize, block: u32) -> Result<LaunchConfig> {
        if n == 0 {
            return Err(invalid_arg("launch for 0 elements"));
        }
        let blocks = n.div_ceil(block.max(1) as usize);
        let Ok(block_count) = u32::try_from(blocks) else {
            return Err(invalid_arg(format!(
                "launch for {n} elements in blocks of {block}: {blocks} blocks do not fit a grid"
            )));
        };
        LaunchConfig::new((block_count, 1, 1), (block, 1, 1), 0)
    }

    /// This configuration with `bytes` of dynamic shared memory per block (checked
    /// against the device at launch; above 48 KiB the kernel is opted in).
    #[must_use]
    pub fn with_shared_mem(mut self, bytes: u32) -> LaunchConfig {
        self.shared_mem_bytes = bytes;
        self
    }

    /// This configuration launched in thread-block clusters of `x * y * z` blocks
    /// (compute capability 9.0+; each must divide the grid's dimension).
    #[must_use]
    pub fn with_cluster(mut self, x: u32, y: u32, z: u32) -> LaunchConfig {
        self.attributes.cluster_dim = Some((x, y, z));
        self
    }

    /// This configuration as a cooperative launch (all blocks co-resident).
    #[must_use]
    pub fn with_cooperative(mut self, on: bool) -> LaunchConfig {
        self.attributes.cooperative = on;
        self
    }

    /// This configuration with programmatic dependent launch allowed.
    #[must_use]
    pub fn with_programmatic_serialization(mut self, on: bool) -> LaunchConfig {
        self.attributes.programmatic_stream_serialization = on;
        self
    }

    /// This configuration with `attributes`.
    #[must_use]
    pub fn with_attributes(mut self, attributes: LaunchAttributes) -> LaunchConfig {
        self.attributes = attributes;
        self
    }

    /// The attributes, when any is set (the launch then needs `cuLaunchKernelEx`).
    #[inline]
    pub(crate) fn extended(&self) -> Option<&LaunchAttributes> {
        (self.attributes != LaunchAttributes::default()).then_some(&self.attributes)
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
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the limit that was exceeded.
    pub fn validate_for(&self, limits: &DeviceLimits) -> Result<()> {
        self.check_limits(limits)
            .map_err(|why| invalid_arg(format!("{why} {self}")))
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

/// Launch attributes for `cuLaunchKernelEx` (CUDA 12.0+), part of a
/// [`LaunchConfig`] ([`LaunchConfig::with_cluster`], ...).
///
/// The fields are public: every rule of theirs depends on the device or on the
/// launch shape (cluster support, divisibility of the grid, cooperative
/// support), so they are checked at launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[non_exhaustive]
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

    /// Attributes with only the cooperative flag.
    pub fn cooperative() -> LaunchAttributes {
        LaunchAttributes {
            cooperative: true,
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
