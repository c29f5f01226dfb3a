//! [`Version`]: one version number, ordered, for every library metrale loads
//! (the driver's CUDA version, NVRTC, cuBLAS and cuBLASLt, NCCL).

use std::fmt;

/// A library's version, `major.minor.patch`, ordered as numbers are (`2.9.0 <
/// 2.27.0`): what the driver ([`CudaContext::cuda_version`](crate::CudaContext::cuda_version)),
/// NVRTC, cuBLAS, cuBLASLt and NCCL report.
///
/// ```
/// use metrale_runtime::Version;
/// let nccl = Version::new(2, 28, 9);
/// assert!(nccl >= Version::new(2, 27, 0));
/// assert!(Version::new(2, 9, 0) < Version::new(2, 27, 0));
/// assert_eq!(Version::from_cuda(13000), Version::new(13, 0, 0));
/// assert_eq!(Version::from_cuda(12080).to_string(), "12.8.0");
/// assert_eq!(Version::from((2, 27, 3)), Version::new(2, 27, 3));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Version {
    /// The major version.
    pub major: u32,
    /// The minor version.
    pub minor: u32,
    /// The patch level (0 where the library reports none, as NVRTC).
    pub patch: u32,
}

impl Version {
    /// `major.minor.patch`.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Version {
        Version {
            major,
            minor,
            patch,
        }
    }

    /// A CUDA version code as `cuDriverGetVersion` gives it (`1000 * major + 10
    /// * minor`: 13000 is 13.0, 12080 is 12.8); a negative code is 0.0.0.
    pub const fn from_cuda(code: i32) -> Version {
        let code = if code < 0 { 0 } else { code as u32 };
        Version::new(code / 1000, (code % 1000) / 10, 0)
    }
}

impl From<(u32, u32, u32)> for Version {
    fn from((major, minor, patch): (u32, u32, u32)) -> Version {
        Version::new(major, minor, patch)
    }
}

impl From<(u32, u32)> for Version {
    fn from((major, minor): (u32, u32)) -> Version {
        Version::new(major, minor, 0)
    }
}

impl From<Version> for (u32, u32, u32) {
    fn from(v: Version) -> (u32, u32, u32) {
        (v.major, v.minor, v.patch)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}
