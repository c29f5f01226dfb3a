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
//! - the agreement check of the ranks one thread drives in one group
//!   (`agree.rs`);
//! - [`NcclBuffer`] (`buffer.rs`, `ncclMemAlloc`), its registrations and
//!   symmetric windows ([`Registration`], [`Window`]: `register.rs`), the
//!   per-communicator registration ledger and bound (`ledger.rs`);
//! - all-to-all, gather and scatter (`moe.rs`) and the pre-multiplied sum
//!   [`PreMulSum`] with [`Reduction`] (`premul.rs`);
//! - revoke, shrink, the revoking wait ([`OnFailure`]) and the scalable init
//!   (`fault.rs`), each version-gated against the loaded NCCL;
//! - [`NcclError`] and [`NcclStatus`] (`error.rs`): the room's error data, which
//!   fills the crate's library-error shape
//!   ([`LibraryFailure`](crate::error::LibraryFailure)), and the one constructor
//!   of its [`MetraleError`];
//! - the helper thread that bounds NCCL's blocking abort, finalize and destroy
//!   (`teardown.rs`).
//!
//! Invariants:
//! - Each rank checks its own lengths, root, peer and devices before NCCL sees
//!   them: all-reduce receive ≥ send, all-gather receive = ranks × send,
//!   reduce-scatter send = ranks × receive, root and peer < ranks, memory and
//!   stream on the communicator's device. A refusal names the call, the rank
//!   and both sizes.
//! - Whether the ranks agree with each other (the same count, type, operation
//!   and root for the k-th collective of every rank) is checked where metrale
//!   sees the ranks: those one thread queues in one [`group`] (`init_all` plus
//!   `group`, or several `init_rank`s). A collective that disagrees with
//!   another rank's of the same sequence number is refused before NCCL, and so
//!   is a send or receive whose count or type differs from its partner's (the
//!   k-th send from a to b against the k-th receive of b from a; for
//!   communicators of at most 1024 ranks); every listed rank of that
//!   communicator is then aborted when the group ends (what was queued could
//!   never complete). Ranks in other processes, or driven by other threads,
//!   are not seen: their agreement stays the user's duty, and NCCL's
//!   (`NCCL_CHECK_MODE`); ranks that disagree may hang, fail, or move the
//!   wrong bytes.
//! - Inside [`group`] every communicator used is listed (and so borrowed until
//!   the group's end), split is refused, [`Communicator::wait`] is refused
//!   (the group's work reaches the stream only at its end), an abort of a
//!   listed communicator (direct, or by a failed check) is deferred to the
//!   outermost group's end (its queued work still names it), device memory
//!   dropped anywhere in the process waits to be freed until no group is open,
//!   and managed memory's host access is refused.
//! - No NCCL call is made from inside a host function: [`NcclId::new`], every
//!   communicator call and [`group`] are refused there
//!   ([`ErrorKind::InHostFunction`](crate::ErrorKind::InHostFunction)), as
//!   every CUDA call; an abort there is skipped and a Drop there leaks, each
//!   with a line on stderr.
//! - The collective path never synchronises with the host (no stream query, no
//!   event wait), so collectives can be captured into CUDA graphs; a
//!   non-blocking communicator's `ncclInProgress` is polled through
//!   `ncclCommGetAsyncError` only, which does not touch streams.
//! - A communicator is `Send` but not `Sync` (NCCL communicators are not
//!   thread-safe); a split sharing resources and its parent take turns on one
//!   lock for every NCCL call; it holds its device's context and every stream it queued
//!   work on, so its Drop can wait for that work, boundedly.
//! - Timeouts are bounds. NCCL's `ncclCommAbort`, `ncclCommFinalize` and
//!   `ncclCommDestroy` can wait for the device's queued work, on any stream of
//!   the device, so metrale never makes them on the caller's thread: they run
//!   on a helper thread, handed the raw communicator after it was marked
//!   aborted (or while it is dropped), so no other NCCL call is made on it
//!   from then on. A timed-out wait or settle returns at most 200 ms after its
//!   timeout, [`Communicator::abort`] at most 200 ms after the drop timeout;
//!   an abort still running then finishes alone, with a line on stderr.
//! - Drop never blocks forever: on a helper thread it finalizes within the
//!   config's drop timeout (waiting first for the streams it used when the
//!   communicator is blocking; a transient `cuStreamQuery` failure is asked
//!   again until the deadline), destroys only when finalize completed, aborts
//!   otherwise; the dropping thread waits at most the drop timeout plus 200 ms
//!   and then leaks the communicator to that thread. One line on stderr when
//!   it had to abort, leak, or a call failed (naming the call and its status,
//!   and the time actually waited), silence when the context is already gone.
//! - Memory is tracked like any other safe operation's (`note_use`), so freeing
//!   a buffer waits for the collectives that used it.
//! - A registration or window borrows its communicator and its buffer, so
//!   neither can go first; registering and deregistering are refused while
//!   any metrale capture is in progress. A window is collective: ranks
//!   register and drop windows in the same order (refused inside a group;
//!   numbered per communicator).
//! - A call newer than the loaded NCCL is refused with
//!   [`NcclError::Unsupported`] naming both versions (windows and shrink 2.27,
//!   revoke 2.28, the scalable init 2.23) or, for all-to-all, gather and
//!   scatter, with the missing symbol.

use std::fmt;
use std::str::FromStr;

use metrale_cuda_sys::nccl::{self as raw, ncclDataType_t, ncclRedOp_t, Nccl};

use crate::error::{invalid_arg, MetraleError, Result};
use crate::memory::DeviceRepr;
#[allow(unused_imports)]
use crate::stream::CudaStream;

mod agree;
mod buffer;
mod collective;
mod comm;
mod config;
mod error;
mod fault;
mod group;
mod init;
mod ledger;
mod moe;
mod premul;
mod reducing;
mod register;
mod state;
mod teardown;
mod wait;
mod window;

pub use buffer::NcclBuffer;
pub use comm::Communicator;
pub use config::CommConfig;
pub use error::{CommInfo, NcclError, NcclStatus};
pub use group::group;
pub use premul::{PreMulSum, Reduction};
pub use register::Registration;
pub use wait::OnFailure;
pub use window::{Window, WindowFlags};

/// The process-wide NCCL library, or the load error as a [`MetraleError`].
pub(crate) fn lib() -> Result<&'static Nccl> {
    raw::nccl().map_err(|e| error::into_error(NcclError::Unavailable(e.clone())))
}

/// The version of the loaded NCCL library (`v >= Version::new(2, 27, 0)`).
///
/// # Errors
/// The library could not be loaded; `None` inside when it does not say.
pub fn nccl_version() -> Result<Option<crate::Version>> {
    Ok(lib()?.version().map(crate::Version::from))
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
    /// Inside a host function, refused before NCCL
    /// ([`ErrorKind::InHostFunction`](crate::ErrorKind::InHostFunction)); the
    /// library could not be loaded, or the call failed.
    pub fn new() -> Result<NcclId> {
        if crate::lifetime::in_host_function() {
            // The driver forbids CUDA calls there, and NCCL may make them.
            return Err(
                crate::error::CallError::InHostFunction.about("ncclGetUniqueId (NcclId::new)")
            );
        }
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
