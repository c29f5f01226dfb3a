//! What a [`Communicator`](super::Communicator) keeps beyond its handle for
//! registrations and fault tolerance: whether it was revoked, the bytes it has
//! registered now and the bound on them, and how many window registrations it
//! has made (the collective sequence every rank must keep in step).

use std::cell::Cell;

/// A communicator's registration and revocation state (its thread's only:
/// communicators are not `Sync`).
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    /// Revoked (`ncclCommRevoke`): collectives and registrations are refused;
    /// shrink and Drop remain.
    pub(crate) revoked: Cell<bool>,
    /// Bytes registered through live guards (buffers and windows).
    pub(crate) registered: Cell<usize>,
    /// The most bytes that may be registered at once (`None`: no bound).
    pub(crate) limit: Cell<Option<usize>>,
    /// Live guards (buffers and windows).
    pub(crate) guards: Cell<usize>,
    /// Window registrations made so far (each rank counts the same calls).
    pub(crate) windows_made: Cell<u64>,
}
