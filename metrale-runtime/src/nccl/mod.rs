//! Collective communication through NCCL (feature `nccl`): ids, communicators,
//! checked collectives, groups and the bounded wait.
//!
//! This room owns:
//! - [`NcclId`]: the unique id that names a communicator's rendezvous
//!   (`ncclGetUniqueId`), as bytes and as hex text to pass between processes;
//! - [`Communicator`] (`comm.rs`): init by rank or for several devices of one
//!   process, split, the config builder [`CommConfig`], rank, size and device,
//!   asynchronous errors, [`Communicator::wait`], abort and the bounded teardown;
//! - the collectives (`collective.rs`): all-reduce, broadcast, reduce,
//!   all-gather, reduce-scatter, send and receive on a [`CudaStream`] with typed
//!   device memory, element types mapped by [`NcclType`], operations
//!   [`ReduceOp`], and [`group`];
//! - [`NcclError`] (`error.rs`), the one constructor of `MetraleError::Nccl`.
//!
//! Invariants:
//! - Each rank checks its own lengths, root, peer and devices before NCCL sees
//!   them: all-reduce receive ≥ send, all-gather receive = ranks × send,
//!   reduce-scatter send = ranks × receive, root and peer < ranks, memory and
//!   stream on the communicator's device. A refusal names the call, the rank
//!   and both sizes. Whether the ranks agree with each other (the same count,
//!   type, operation and root on every rank, a receive as long as its peer's
//!   send) is not checked here: no rank sees another's arguments. That is
//!   NCCL's business (`NCCL_CHECK_MODE`, its cross-rank argument check); ranks
//!   that disagree may hang, fail, or move the wrong bytes.
//! - Inside [`group`] every communicator used is listed (and so borrowed until
//!   the group's end), split is refused, device memory dropped anywhere in the
//!   process waits to be freed until no group is open, and managed memory's
//!   host access is refused.
//! - No NCCL call is made from inside a host function (refused, as every CUDA
//!   call there).
//! - The collective path never synchronises with the host (no stream query, no
//!   event wait), so collectives can be captured into CUDA graphs; a
//!   non-blocking communicator's `ncclInProgress` is polled through
//!   `ncclCommGetAsyncError` only, which does not touch streams.
//! - A communicator is `Send` but not `Sync` (NCCL communicators are not
//!   thread-safe); a split sharing resources and its parent take turns on one
//!   lock for every NCCL call; it holds its device's context and every stream it queued
//!   work on, so its Drop can wait for that work, boundedly.
//! - Drop never blocks forever: it finalizes within the config's drop timeout
//!   (waiting first for the streams it used when the communicator is
//!   blocking), destroys only when finalize completed, aborts otherwise; one
//!   line on stderr when it had to abort or a call failed, silence when the
//!   context is already gone.
//! - Memory is tracked like any other safe operation's (`note_use`), so freeing
//!   a buffer waits for the collectives that used it.

use std::fmt;
use std::str::FromStr;

use metrale_cuda_sys::nccl::{self as raw, ncclDataType_t, ncclRedOp_t, Nccl};

use crate::error::{invalid_arg, MetraleError, Result};
use crate::memory::DeviceRepr;
#[allow(unused_imports)]
use crate::stream::CudaStream;

mod collective;
mod comm;
mod config;
mod error;
mod group;
mod teardown;

pub use comm::Communicator;
pub use config::CommConfig;
pub use error::{CommInfo, NcclError};
pub use group::group;

/// The process-wide NCCL library, or the load error as a [`MetraleError`].
pub(crate) fn lib() -> Result<&'static Nccl> {
    raw::nccl().map_err(|e| error::into_error(NcclError::Unavailable(e.clone())))
}

/// The version of the loaded NCCL library, `(major, minor, patch)`.
///
/// # Errors
/// The library could not be loaded; `None` inside when it does not say.
pub fn nccl_version() -> Result<Option<(u32, u32, u32)>> {
    Ok(lib()?.version())
}

/// The id that names one communicator's rendezvous: made once (by rank 0, say)
/// with [`NcclId::new`], then given to every rank, in this process or others
/// (as [`bytes`](NcclId::as_bytes) or as hex text: `Display` and `FromStr`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct NcclId([u8; NcclId::BYTES]);

impl NcclId {
    /// The size of an id (`NCCL_UNIQUE_ID_BYTES`).
    pub const BYTES: usize = raw::NCCL_UNIQUE_ID_BYTES as usize;

    /// A new unique id (`ncclGetUniqueId`). NCCL may open a socket for the
    /// bootstrap (see `NCCL_SOCKET_IFNAME`).
    ///
    /// # Errors
    /// The library could not be loaded, or the call failed.
    pub fn new() -> Result<NcclId> {
        let lib = lib()?;
        let f = lib.ncclGetUniqueId().map_err(|m| error::missing(m, None))?;
        let mut id = raw::ncclUniqueId::default();
        // SAFETY: writes one ncclUniqueId.
        let status = unsafe { f(&mut id) };
        if !status.is_success() {
            return Err(error::call_error(
                lib,
                "ncclGetUniqueId",
                status,
                std::ptr::null_mut(),
                None,
            ));
        }
        let mut bytes = [0u8; NcclId::BYTES];
        for (b, c) in bytes.iter_mut().zip(id.internal.iter()) {
            *b = c.to_ne_bytes()[0];
        }
        Ok(NcclId(bytes))
    }

    /// The id made of `bytes` (as [`as_bytes`](NcclId::as_bytes) gave them).
    pub const fn from_bytes(bytes: [u8; NcclId::BYTES]) -> NcclId {
        NcclId(bytes)
    }

    /// The id's bytes.
    pub const fn as_bytes(&self) -> &[u8; NcclId::BYTES] {
        &self.0
    }

    pub(crate) fn to_raw(self) -> raw::ncclUniqueId {
        let mut id = raw::ncclUniqueId::default();
        for (c, b) in id.internal.iter_mut().zip(self.0.iter()) {
            *c = std::ffi::c_char::from_ne_bytes([*b]);
        }
        id
    }
}

impl fmt::Display for NcclId {
    /// 256 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclId({self})")
    }
}

impl FromStr for NcclId {
    type Err = MetraleError;

    /// Exactly 256 hex digits (either case), surrounding whitespace ignored.
    fn from_str(s: &str) -> Result<NcclId> {
        let s = s.trim();
        if s.len() != 2 * NcclId::BYTES || !s.is_ascii() {
            return Err(invalid_arg(format!(
                "an NCCL id is {} hex digits; got {} characters",
                2 * NcclId::BYTES,
                s.chars().count()
            )));
        }
        let mut bytes = [0u8; NcclId::BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            let pair = &s[2 * i..2 * i + 2];
            *b = u8::from_str_radix(pair, 16).map_err(|_| {
                invalid_arg(format!(
                    "an NCCL id is hex digits; `{pair}` at offset {} is not",
                    2 * i
                ))
            })?;
        }
        Ok(NcclId(bytes))
    }
}

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL reduces and moves: `f32`, `f64`, `i8`, `u8`, `i32`,
/// `u32`, `i64`, `u64` (and `half::f16`, `half::bf16` with the `half` feature).
pub trait NcclType: DeviceRepr + sealed::Sealed {
    /// The NCCL data type of the same layout.
    const DATA_TYPE: ncclDataType_t;
}

macro_rules! nccl_type {
    ($($t:ty => $d:ident),* $(,)?) => { $(
        impl sealed::Sealed for $t {}
        impl NcclType for $t {
            const DATA_TYPE: ncclDataType_t = ncclDataType_t::$d;
        }
    )* };
}
nccl_type!(
    i8 => ncclInt8,
    u8 => ncclUint8,
    i32 => ncclInt32,
    u32 => ncclUint32,
    i64 => ncclInt64,
    u64 => ncclUint64,
    f32 => ncclFloat32,
    f64 => ncclFloat64,
);
#[cfg(feature = "half")]
nccl_type!(half::f16 => ncclFloat16, half::bf16 => ncclBfloat16);

/// A reduction operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum (`ncclSum`).
    Sum,
    /// Product (`ncclProd`).
    Prod,
    /// Minimum (`ncclMin`).
    Min,
    /// Maximum (`ncclMax`).
    Max,
    /// Average: the sum divided by the number of ranks (`ncclAvg`).
    Avg,
}

impl ReduceOp {
    pub(crate) const fn to_raw(self) -> ncclRedOp_t {
        match self {
            ReduceOp::Sum => ncclRedOp_t::ncclSum,
            ReduceOp::Prod => ncclRedOp_t::ncclProd,
            ReduceOp::Min => ncclRedOp_t::ncclMin,
            ReduceOp::Max => ncclRedOp_t::ncclMax,
            ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        }
    }
}
