//! Devices: count, name, UUID, memory, any attribute, compute capability, and
//! peer access between two devices. Usable without a registry.
//!
//! Invariants:
//! - A [`Device`] is an ordinal checked against the driver's device count; asking
//!   it about itself needs no context, except [`Device::memory_info`] (which binds
//!   the device's primary context, retaining it for the call).
//! - Peer access is enabled per pair of contexts and direction; enabling it again
//!   is not an error.

use std::ffi::c_int;
use std::fmt;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUdevice, CUdevice_attribute, CUresult};

use crate::context::{self, device_attribute, init_driver, AsContext, CudaContext};
use crate::error::{cu, invalid_arg, CallError, Result};

/// One CUDA device, by ordinal.
///
/// ```no_run
/// use metrale_runtime::Device;
/// # fn main() -> metrale_runtime::Result<()> {
/// for d in Device::all()? {
///     let (free, total) = d.memory_info()?;
///     println!("{}: {} (sm_{}{}), {free} of {total} bytes free", d.ordinal(), d.name(),
///              d.compute_capability()?.0, d.compute_capability()?.1);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Device {
    ordinal: usize,
    raw: CUdevice,
    driver: &'static sys::Driver,
    /// Read once when the device is looked up.
    name: Arc<str>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

/// What the driver reports about the link from one device to another
/// (`cuDeviceGetP2PAttribute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerLink {
    /// Whether the first device can access the second's memory.
    pub access_supported: bool,
    /// Whether atomics over the link are native.
    pub native_atomics: bool,
    /// Relative performance of the link (lower is better; 0 on a single link type).
    pub performance_rank: i32,
    /// Whether CUDA arrays can be accessed over the link.
    pub cuda_array_access: bool,
}

impl Device {
    /// Device `ordinal` (initialising the driver once).
    ///
    /// # Errors
    /// Without a driver, [`ErrorKind::DriverUnavailable`](crate::ErrorKind::DriverUnavailable); `InvalidArgument` for
    /// an ordinal the driver does not have.
    pub fn get(ordinal: usize) -> Result<Device> {
        let (d, _) = init_driver()?;
        let raw = context::device_handle(d, ordinal)?;
        let name =
            context::device_name(d, raw).map_err(|e| e.about(format_args!("device {ordinal}")))?;
        Ok(Device {
            ordinal,
            raw,
            driver: d,
            name: Arc::from(name),
        })
    }

    /// Every device the driver reports, in ordinal order.
    ///
    /// # Errors
    /// As [`device_count`](crate::device_count).
    pub fn all() -> Result<Vec<Device>> {
        (0..context::device_count()?).map(Device::get).collect()
    }

    fn subject(&self) -> String {
        format!("device {}", self.ordinal)
    }

    /// The ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The raw `CUdevice`.
    pub fn raw(&self) -> CUdevice {
        self.raw
    }

    /// The device's name (`NVIDIA H200`).
    /// (read once by [`Device::get`], as [`CudaContext::device_name`] is).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's UUID (16 bytes, as `nvidia-smi -L` prints them after `GPU-`).
    ///
    /// # Errors
    /// `cuDeviceGetUuid_v2`'s status.
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let mut uuid = sys::CUuuid::default();
        // SAFETY: writes one CUuuid for a valid device.
        unsafe { cu!(self.driver, cuDeviceGetUuid_v2(&mut uuid, self.raw)) }
            .map_err(|e| e.about(self.subject()))?;
        Ok(uuid.bytes.map(|b| b as u8))
    }

    /// Total device memory in bytes (`cuDeviceTotalMem_v2`).
    ///
    /// # Errors
    /// The driver call's status.
    pub fn total_memory(&self) -> Result<usize> {
        let mut bytes = 0usize;
        // SAFETY: writes one size for a valid device.
        unsafe { cu!(self.driver, cuDeviceTotalMem_v2(&mut bytes, self.raw)) }
            .map_err(|e| e.about(self.subject()))?;
        Ok(bytes)
    }

    /// Free and total device memory in bytes, as `cuMemGetInfo_v2` reports them in
    /// the device's primary context.
    ///
    /// # Errors
    /// Creating the context, or `cuMemGetInfo_v2`'s status.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        memory_info(&context::context(self.ordinal)?)
    }

    /// Any attribute, by its enum (`CU_DEVICE_ATTRIBUTE_*`).
    ///
    /// # Errors
    /// `cuDeviceGetAttribute`'s status (an attribute the driver does not know:
    /// `CUDA_ERROR_INVALID_VALUE`).
    pub fn attribute(&self, attr: CUdevice_attribute) -> Result<i32> {
        device_attribute(self.driver, self.raw, attr)
            .map_err(|e| e.about(format_args!("{} attribute {}", self.subject(), attr.0)))
    }

    /// Compute capability `(major, minor)`: `(9, 0)` on an H200.
    ///
    /// # Errors
    /// `cuDeviceGetAttribute`'s status.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        use sys::CUdevice_attribute as A;
        Ok((
            self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Whether this device can access `peer`'s memory directly
    /// (`cuDeviceCanAccessPeer`); false for the device itself.
    ///
    /// # Errors
    /// The driver call's status.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if peer.raw == self.raw {
            return Ok(false);
        }
        let mut can: c_int = 0;
        // SAFETY: writes one int for two valid devices.
        unsafe {
            cu!(
                self.driver,
                cuDeviceCanAccessPeer(&mut can, self.raw, peer.raw)
            )
        }
        .map_err(|e| {
            e.about(format_args!(
                "{} -> device {}",
                self.subject(),
                peer.ordinal
            ))
        })?;
        Ok(can != 0)
    }

    /// The link from this device to `peer` (`cuDeviceGetP2PAttribute`).
    ///
    /// # Errors
    /// The driver call's status.
    pub fn peer_link(&self, peer: &Device) -> Result<PeerLink> {
        use sys::CUdevice_P2PAttribute as P;
        let get = |attr: P| -> Result<i32> {
            let mut v: c_int = 0;
            // SAFETY: writes one int for two valid devices.
            unsafe {
                cu!(
                    self.driver,
                    cuDeviceGetP2PAttribute(&mut v, attr, self.raw, peer.raw)
                )
            }
            .map_err(|e| {
                e.about(format_args!(
                    "{} -> device {} link",
                    self.subject(),
                    peer.ordinal
                ))
            })?;
            Ok(v)
        };
        Ok(PeerLink {
            access_supported: get(P::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)? != 0,
            native_atomics: get(P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0,
            performance_rank: get(P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
            cuda_array_access: get(P::CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED)? != 0,
        })
    }
}

/// Free and total memory of `ctx`'s device (`cuMemGetInfo_v2`).
///
/// # Errors
/// The driver call's status.
pub fn memory_info(ctx: &impl AsContext) -> Result<(usize, usize)> {
    let ctx = ctx.context();
    let (mut free, mut total) = (0usize, 0usize);
    ctx.call(
        || format!("device {} memory info", ctx.ordinal()),
        // SAFETY: writes two sizes; the context is current.
        |d| unsafe { cu!(d, cuMemGetInfo_v2(&mut free, &mut total)) },
    )?;
    Ok((free, total))
}

/// Let kernels and copies in `from`'s context access memory of `to`'s device
/// directly (`cuCtxEnablePeerAccess`). One direction; call it both ways for both.
/// Enabling twice is not an error.
///
/// Without peer access, [`CudaStream::copy_peer`](crate::CudaStream::copy_peer)
/// still works: the driver stages the copy through host memory, at a fraction of
/// the link's bandwidth and with the host in the path. Kernels can only read
/// another device's memory with access enabled.
///
/// # Errors
/// `InvalidArgument` for one context with itself; `cuCtxEnablePeerAccess`'s status
/// (`CUDA_ERROR_PEER_ACCESS_UNSUPPORTED` when the devices cannot).
pub fn enable_peer_access(from: &impl AsContext, to: &impl AsContext) -> Result<()> {
    let (from, to): (&Arc<CudaContext>, &Arc<CudaContext>) = (from.context(), to.context());
    if Arc::ptr_eq(from, to) {
        return Err(invalid_arg(format!(
            "peer access from device {} to itself",
            from.ordinal()
        )));
    }
    let peer = to.raw();
    let result = from.with(|d| {
        // SAFETY: `peer` is a retained context; flags must be 0.
        match unsafe { cu!(d, cuCtxEnablePeerAccess(peer, 0)) } {
            Err(CallError::Status { status, .. })
                if status == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED =>
            {
                Ok(())
            }
            other => other,
        }
    });
    result.map_err(|e| {
        e.about(format_args!(
            "peer access from device {} to device {}",
            from.ordinal(),
            to.ordinal()
        ))
    })
}
