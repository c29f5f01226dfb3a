//! The driver initialised once, and the facts of a device a context reads at
//! creation: count, handle, name, attributes, [`DeviceLimits`].

use std::ffi::{c_char, c_int, CStr};
use std::sync::OnceLock;

use metrale_cuda_sys::{self as sys, CUdevice, CUdevice_attribute};

use crate::error::{cu, invalid_arg, CallError, MetraleError, Result};

/// The limits and capabilities of a device that launches and allocations check,
/// read once per context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceLimits {
    /// Threads in one block.
    pub max_threads_per_block: u32,
    /// Block dimensions x, y, z.
    pub max_block_dim: [u32; 3],
    /// Grid dimensions x, y, z.
    pub max_grid_dim: [u32; 3],
    /// Dynamic plus static shared memory per block without opting in (48 KiB).
    pub max_shared_per_block: u32,
    /// Shared memory per block a kernel may opt in to.
    pub max_shared_per_block_optin: u32,
    /// Streaming multiprocessors.
    pub multiprocessor_count: u32,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// Whether thread-block clusters can be launched.
    pub cluster_launch: bool,
    /// Whether cooperative launches are supported.
    pub cooperative_launch: bool,
    /// Whether stream-ordered allocation (memory pools) is supported.
    pub memory_pools: bool,
    /// Whether managed (unified) memory can be allocated.
    pub managed_memory: bool,
    /// Whether the host may access managed memory while kernels run
    /// (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`).
    pub concurrent_managed_access: bool,
}

/// Initialise the driver (`cuInit(0)`) once and return the table and its version.
/// Success is remembered; a failure is returned and tried again next time.
pub(crate) fn init_driver() -> Result<(&'static sys::Driver, i32)> {
    static VERSION: OnceLock<i32> = OnceLock::new();
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    if let Some(&v) = VERSION.get() {
        return Ok((d, v));
    }
    // SAFETY: cuInit takes flags (must be 0) and nothing else; calling it again after
    // a success is harmless.
    unsafe { cu!(d, cuInit(0)) }.map_err(|e| e.about("driver initialisation"))?;
    let mut version: c_int = 0;
    // SAFETY: writes one int.
    unsafe { cu!(d, cuDriverGetVersion(&mut version)) }
        .map_err(|e| e.about("driver initialisation"))?;
    Ok((d, *VERSION.get_or_init(|| version)))
}

/// How many CUDA devices the driver reports (initialising it first).
///
/// # Errors
/// [`ErrorKind::DriverUnavailable`](crate::ErrorKind::DriverUnavailable) without a driver, or the failing call.
pub fn device_count() -> Result<usize> {
    let (d, _) = init_driver()?;
    let mut count: c_int = 0;
    // SAFETY: writes one int.
    unsafe { cu!(d, cuDeviceGetCount(&mut count)) }.map_err(|e| e.about("device count"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The `CUdevice` of `ordinal`, checked against the device count.
pub(crate) fn device_handle(d: &sys::Driver, ordinal: usize) -> Result<CUdevice> {
    let subject = || format!("device {ordinal}");
    let mut count: c_int = 0;
    // SAFETY: writes one int.
    unsafe { cu!(d, cuDeviceGetCount(&mut count)) }.map_err(|e| e.about(subject()))?;
    let Some(index) = c_int::try_from(ordinal).ok().filter(|&i| i < count) else {
        return Err(invalid_arg(format!(
            "device ordinal {ordinal} is out of range: the driver reports {count} CUDA device(s)"
        )));
    };
    let mut device: CUdevice = 0;
    // SAFETY: writes one CUdevice; the ordinal was checked against the count.
    unsafe { cu!(d, cuDeviceGet(&mut device, index)) }.map_err(|e| e.about(subject()))?;
    Ok(device)
}

/// A device's name (`NVIDIA H200`).
pub(crate) fn device_name(d: &sys::Driver, device: CUdevice) -> Result<String, CallError> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: the buffer's length is passed with it.
    unsafe { cu!(d, cuDeviceGetName(buf.as_mut_ptr(), 256, device)) }?;
    buf[255] = 0;
    // SAFETY: NUL-terminated: the driver writes at most 256 bytes with the NUL, and
    // the last byte is zero either way.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// One device attribute.
pub(crate) fn device_attribute(
    d: &sys::Driver,
    device: CUdevice,
    attr: CUdevice_attribute,
) -> Result<i32, CallError> {
    let mut v: c_int = 0;
    // SAFETY: writes one int for a valid device.
    unsafe { cu!(d, cuDeviceGetAttribute(&mut v, attr, device)) }?;
    Ok(v)
}

pub(super) fn read_limits(d: &sys::Driver, device: CUdevice) -> Result<DeviceLimits, CallError> {
    use sys::CUdevice_attribute as A;
    let get = |attr| -> Result<u32, CallError> {
        Ok(u32::try_from(device_attribute(d, device, attr)?).unwrap_or(0))
    };
    Ok(DeviceLimits {
        max_threads_per_block: get(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
        max_block_dim: [
            get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?,
            get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?,
            get(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?,
        ],
        max_grid_dim: [
            get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
            get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
            get(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
        ],
        max_shared_per_block: get(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?,
        max_shared_per_block_optin: get(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
        multiprocessor_count: get(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        compute_capability: (
            get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        cluster_launch: get(A::CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH)? != 0,
        cooperative_launch: get(A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? != 0,
        memory_pools: get(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0,
        managed_memory: get(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? != 0,
        concurrent_managed_access: get(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)? != 0,
    })
}
