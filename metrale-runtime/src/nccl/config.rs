//! [`CommConfig`]: how a communicator is made, checked before NCCL sees it and
//! turned into NCCL's versioned `ncclConfig_t`.

use std::ffi::CString;
use std::sync::OnceLock;
use std::time::Duration;

use metrale_cuda_sys::nccl::{self as raw, ncclConfig_t};

use crate::error::Result;

use super::error::refused;

/// How a communicator is made. `CommConfig::new()` leaves every NCCL setting
/// to NCCL (its environment variables and defaults).
///
/// ```
/// use std::time::Duration;
/// use metrale_runtime::nccl::CommConfig;
/// let config = CommConfig::new()
///     .blocking(false)
///     .max_ctas(16)
///     .timeout(Duration::from_secs(60));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommConfig {
    pub(super) blocking: Option<bool>,
    cga_cluster_size: Option<u32>,
    min_ctas: Option<u32>,
    max_ctas: Option<u32>,
    split_share: Option<bool>,
    net_name: Option<String>,
    comm_name: Option<String>,
    pub(super) timeout: Option<Duration>,
    pub(super) drop_timeout: Duration,
}

impl Default for CommConfig {
    fn default() -> CommConfig {
        CommConfig::new()
    }
}

impl CommConfig {
    /// The drop timeout when none is set: how long Drop waits for pending work
    /// and `ncclCommFinalize` before it aborts.
    pub const DEFAULT_DROP_TIMEOUT: Duration = Duration::from_secs(10);

    /// Everything NCCL's default; the drop timeout [`Self::DEFAULT_DROP_TIMEOUT`].
    pub const fn new() -> CommConfig {
        CommConfig {
            blocking: None,
            cga_cluster_size: None,
            min_ctas: None,
            max_ctas: None,
            split_share: None,
            net_name: None,
            comm_name: None,
            timeout: None,
            drop_timeout: CommConfig::DEFAULT_DROP_TIMEOUT,
        }
    }

    /// Whether NCCL calls block (NCCL's default) or return `ncclInProgress`. A
    /// non-blocking communicator's calls still return completed to the caller:
    /// metrale polls `ncclCommGetAsyncError` until the call is done (bounded by
    /// [`timeout`](Self::timeout)); what it buys is that every wait, and the
    /// teardown, can be bounded and aborted.
    #[must_use]
    pub fn blocking(mut self, blocking: bool) -> CommConfig {
        self.blocking = Some(blocking);
        self
    }

    /// The CGA cluster size of NCCL's kernels (0 to 8; `cgaClusterSize`).
    #[must_use]
    pub fn cga_cluster_size(mut self, size: u32) -> CommConfig {
        self.cga_cluster_size = Some(size);
        self
    }

    /// The least number of CTAs NCCL uses (`minCTAs`, at least 1).
    #[must_use]
    pub fn min_ctas(mut self, n: u32) -> CommConfig {
        self.min_ctas = Some(n);
        self
    }

    /// The most CTAs NCCL uses (`maxCTAs`, at least 1 and ≥ `min_ctas`).
    #[must_use]
    pub fn max_ctas(mut self, n: u32) -> CommConfig {
        self.max_ctas = Some(n);
        self
    }

    /// Whether a communicator split from this one shares its resources
    /// (`splitShare`).
    #[must_use]
    pub fn split_share(mut self, share: bool) -> CommConfig {
        self.split_share = Some(share);
        self
    }

    /// The network module NCCL uses (`netName`: `"Socket"`, `"IB"`, ...).
    #[must_use]
    pub fn net_name(mut self, name: impl Into<String>) -> CommConfig {
        self.net_name = Some(name.into());
        self
    }

    /// A name for the communicator in NCCL's logs (`commName`).
    #[must_use]
    pub fn comm_name(mut self, name: impl Into<String>) -> CommConfig {
        self.comm_name = Some(name.into());
        self
    }

    /// The bound on metrale's polling of a non-blocking communicator (init,
    /// split, a collective that returned `ncclInProgress`): past it the
    /// communicator is aborted and the call fails with [`NcclError::Timeout`](super::NcclError::Timeout),
    /// at most 200 ms after the timeout (NCCL's abort runs on a helper thread:
    /// it can wait for the device's queued work).
    /// Without it, polling goes on as long as NCCL says "in progress".
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> CommConfig {
        self.timeout = Some(timeout);
        self
    }

    /// How long Drop waits for pending work and `ncclCommFinalize` before it
    /// aborts the communicator; also the bound of [`Communicator::abort`](super::Communicator::abort).
    /// NCCL's finalize, destroy and abort run on a helper thread (they can
    /// wait for the device's queued work): Drop returns at most 200 ms after
    /// this timeout, leaking the communicator to that thread (with a line on
    /// stderr) when it has not finished by then.
    #[must_use]
    pub fn drop_timeout(mut self, timeout: Duration) -> CommConfig {
        self.drop_timeout = timeout;
        self
    }

    /// Whether a communicator made with this config blocks, as NCCL decides it:
    /// `NCCL_COMM_BLOCKING` set to 0 or 1 wins over the config, which wins over
    /// NCCL's default (blocking).
    pub(super) fn effective_blocking(&self) -> bool {
        env_blocking().or(self.blocking).unwrap_or(true)
    }

    /// Whether communicators split from one made with this config share its
    /// resources, as NCCL decides it: `NCCL_COMM_SPLIT_SHARE_RESOURCES` set (1:
    /// share, any other number: do not) wins over the config; the default is
    /// not to share.
    pub(super) fn effective_split_share(&self) -> bool {
        env_split_share().or(self.split_share).unwrap_or(false)
    }

    /// The NCCL config and the strings it points to, checked. The caller keeps
    /// the strings alive as long as the communicator lives: NCCL keeps the
    /// pointers (`commName` is read later, by the profiler plugin among
    /// others).
    pub(super) fn to_raw(&self, call: &'static str) -> Result<(ncclConfig_t, Vec<CString>)> {
        let mut c = raw::config_initializer();
        let mut strings = Vec::new();
        let int = |v: u32, what: &str| -> Result<i32> {
            i32::try_from(v).map_err(|_| refused(call, None, format!("{what} {v} is too large")))
        };
        if let Some(b) = self.blocking {
            c.blocking = i32::from(b);
        }
        if let Some(n) = self.cga_cluster_size {
            if n > 8 {
                return Err(refused(
                    call,
                    None,
                    format!("cga_cluster_size is 0 to 8, not {n}"),
                ));
            }
            c.cgaClusterSize = int(n, "cga_cluster_size")?;
        }
        for (v, slot, what) in [
            (self.min_ctas, &mut c.minCTAs, "min_ctas"),
            (self.max_ctas, &mut c.maxCTAs, "max_ctas"),
        ] {
            if let Some(n) = v {
                if n == 0 {
                    return Err(refused(call, None, format!("{what} must be at least 1")));
                }
                *slot = int(n, what)?;
            }
        }
        if let (Some(min), Some(max)) = (self.min_ctas, self.max_ctas) {
            if min > max {
                return Err(refused(
                    call,
                    None,
                    format!("min_ctas {min} is more than max_ctas {max}"),
                ));
            }
        }
        if let Some(s) = self.split_share {
            c.splitShare = i32::from(s);
        }
        for (text, what) in [(&self.net_name, "net_name"), (&self.comm_name, "comm_name")] {
            if let Some(t) = text {
                let s = CString::new(t.as_str()).map_err(|_| {
                    refused(call, None, format!("{what} `{t}` contains a NUL byte"))
                })?;
                strings.push(s);
            }
        }
        let mut it = strings.iter();
        if self.net_name.is_some() {
            c.netName = it.next().map_or(std::ptr::null(), |s| s.as_ptr());
        }
        if self.comm_name.is_some() {
            c.commName = it.next().map_or(std::ptr::null(), |s| s.as_ptr());
        }
        Ok((c, strings))
    }
}

/// An integer NCCL setting from the environment, read once per process as NCCL
/// reads its parameters (after NCCL's first call, so the values NCCL copied in
/// from `nccl.conf` are seen too). Not a number: unset, as NCCL treats it.
fn env_int(name: &str) -> Option<i64> {
    std::env::var(name).ok()?.parse().ok()
}

/// `NCCL_COMM_BLOCKING`: 0 or 1 override the config's blocking flag; other
/// values are ignored (NCCL warns).
pub(super) fn env_blocking() -> Option<bool> {
    static V: OnceLock<Option<i64>> = OnceLock::new();
    match *V.get_or_init(|| env_int("NCCL_COMM_BLOCKING")) {
        Some(0) => Some(false),
        Some(1) => Some(true),
        _ => None,
    }
}

/// `NCCL_COMM_SPLIT_SHARE_RESOURCES`: when set, overrides `splitShare` (1
/// shares; NCCL turns any other value into 0).
pub(super) fn env_split_share() -> Option<bool> {
    static V: OnceLock<Option<i64>> = OnceLock::new();
    V.get_or_init(|| env_int("NCCL_COMM_SPLIT_SHARE_RESOURCES"))
        .map(|v| v == 1)
}
