//! The agreement check of ranks one thread drives in one [`group`](super::group):
//! which NCCL communicator a [`Communicator`](super::Communicator) is a rank of
//! (its clique key), and the collectives each rank queued in the open group,
//! compared rank against rank before NCCL sees them.
//!
//! NCCL matches the k-th collective of every rank of a communicator; ranks that
//! disagree on its count, type, operation or root may move the wrong bytes,
//! past a buffer that metrale checked for the rank's own arguments. When one
//! process drives several ranks in one group (`init_all` plus `group`), metrale
//! sees every one of them, so it refuses a collective that disagrees with
//! another rank's collective of the same sequence number, before NCCL is
//! called. Sends and receives likewise: the k-th send from rank a to rank b
//! must have the count and type of the k-th receive of b from a (for
//! communicators of at most [`P2P_CHECKED_RANKS`] ranks, which count their
//! sends and receives per peer). Ranks in other processes, or queued from
//! other threads, are not seen: their agreement stays the user's duty (and
//! NCCL's `NCCL_CHECK_MODE`).

use std::cell::RefCell;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use metrale_cuda_sys::nccl::ncclDataType_t;

use super::{NcclId, NcclType, ReduceOp};

/// The clique key of the ranks an `init_rank` with `id` of `nranks` joins.
pub(crate) fn clique_of_id(id: &NcclId, nranks: usize) -> u64 {
    let mut h = DefaultHasher::new();
    (0u8, id.as_bytes(), nranks).hash(&mut h);
    h.finish()
}

/// A new clique key (one `init_all`).
pub(crate) fn fresh_clique() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let mut h = DefaultHasher::new();
    (1u8, NEXT.fetch_add(1, Ordering::Relaxed)).hash(&mut h);
    h.finish()
}

/// The clique key of the children of `parent`'s `index`-th split with `color`
/// (every rank splits in the same order).
pub(crate) fn clique_of_split(parent: u64, index: u64, color: i32) -> u64 {
    let mut h = DefaultHasher::new();
    (2u8, parent, index, color).hash(&mut h);
    h.finish()
}

/// What NCCL is told about one collective, as ranks must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    /// The NCCL function.
    pub(crate) call: &'static str,
    /// NCCL's count argument (elements).
    pub(crate) count: usize,
    pub(crate) dtype: ncclDataType_t,
    pub(crate) op: Option<ReduceOp>,
    pub(crate) root: Option<i32>,
}

impl Shape {
    /// The shape of `call` over `count` elements of `T`.
    #[inline]
    pub(crate) fn of<T: NcclType>(
        call: &'static str,
        count: usize,
        op: Option<ReduceOp>,
        root: Option<i32>,
    ) -> Option<Shape> {
        Some(Shape {
            call,
            count,
            dtype: T::DATA_TYPE,
            op,
            root,
        })
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} elements of NCCL type {}",
            self.call, self.count, self.dtype.0
        )?;
        if let Some(op) = self.op {
            write!(f, ", {op:?}")?;
        }
        if let Some(root) = self.root {
            write!(f, ", root {root}")?;
        }
        Ok(())
    }
}

/// The most ranks a communicator may have for its sends and receives to be
/// checked: it keeps two counters per peer, made at init (16 KiB at most).
pub(crate) const P2P_CHECKED_RANKS: usize = 1024;

/// One send or receive queued in this thread's open group.
struct QueuedP2p {
    clique: u64,
    from: usize,
    to: usize,
    /// Which send from `from` to `to` (or receive of `to` from `from`) this is.
    seq: u64,
    sent: bool,
    count: usize,
    dtype: ncclDataType_t,
}

/// One collective queued in this thread's open group.
struct Queued {
    clique: u64,
    rank: usize,
    seq: u64,
    shape: Shape,
}

thread_local! {
    /// The collectives queued in this thread's open groups (cleared at the
    /// outermost end; its capacity is kept).
    static QUEUED: RefCell<Vec<Queued>> = const { RefCell::new(Vec::new()) };
    /// The cliques a refused disagreement left with work that can never
    /// complete: their listed ranks are aborted at the group's end.
    static DISAGREED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// The sends and receives queued in this thread's open groups.
    static QUEUED_P2P: RefCell<Vec<QueuedP2p>> = const { RefCell::new(Vec::new()) };
}

fn mark_disagreed(clique: u64) {
    DISAGREED.with(|d| {
        let mut d = d.borrow_mut();
        if !d.contains(&clique) {
            d.push(clique);
        }
    });
}

/// Record that `rank` of `clique` queues its `seq`-th send to (`sent`) or
/// receive from `peer` of `count` elements of `dtype`, or the text of the
/// disagreement with its partner queued in this group (then nothing is
/// recorded and the clique is marked to be aborted).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record_p2p(
    clique: u64,
    rank: usize,
    peer: usize,
    sent: bool,
    seq: u64,
    count: usize,
    dtype: ncclDataType_t,
) -> Result<(), String> {
    let (from, to) = if sent { (rank, peer) } else { (peer, rank) };
    let clash = QUEUED_P2P.with(|q| {
        q.borrow()
            .iter()
            .find(|o| {
                o.clique == clique
                    && o.from == from
                    && o.to == to
                    && o.seq == seq
                    && o.sent != sent
                    && (o.count, o.dtype) != (count, dtype)
            })
            .map(|o| (o.count, o.dtype))
    });
    if let Some((their_count, their_type)) = clash {
        mark_disagreed(clique);
        let (send, recv) = if sent {
            ((count, dtype), (their_count, their_type))
        } else {
            ((their_count, their_type), (count, dtype))
        };
        return Err(format!(
            "send #{seq} from rank {from} to rank {to} in this group is {} elements of NCCL \
             type {}, its receive {} elements of NCCL type {}: they must agree (NCCL would \
             move bytes past the receive buffer or leave it short). Not queued; every \
             listed rank of this communicator is aborted when the group ends",
            send.0, send.1 .0, recv.0, recv.1 .0
        ));
    }
    QUEUED_P2P.with(|q| {
        q.borrow_mut().push(QueuedP2p {
            clique,
            from,
            to,
            seq,
            sent,
            count,
            dtype,
        });
    });
    Ok(())
}

/// Record that `rank` of `clique` queues `shape` as its collective `seq`, or
/// the text of the disagreement with another rank's collective `seq` (then
/// nothing is recorded and the clique is marked to be aborted).
pub(crate) fn record(clique: u64, rank: usize, seq: u64, shape: Shape) -> Result<(), String> {
    let clash = QUEUED.with(|q| {
        let q = q.borrow();
        q.iter()
            .find(|o| o.clique == clique && o.seq == seq && o.rank != rank && o.shape != shape)
            .map(|o| (o.rank, o.shape))
    });
    if let Some((other, theirs)) = clash {
        mark_disagreed(clique);
        return Err(format!(
            "the ranks of one communicator disagree on their collective #{seq} in this \
             group: rank {other} queued {theirs}, this rank {rank} {shape}; NCCL would \
             match them (and could move bytes past a buffer). Not queued; every listed \
             rank of this communicator is aborted when the group ends (what was queued \
             could never complete)"
        ));
    }
    QUEUED.with(|q| {
        q.borrow_mut().push(Queued {
            clique,
            rank,
            seq,
            shape,
        });
    });
    Ok(())
}

/// Whether a disagreement was refused in `clique` during the open group.
pub(crate) fn disagreed(clique: u64) -> bool {
    DISAGREED.with(|d| d.borrow().contains(&clique))
}

/// The outermost group ended: forget its records.
pub(crate) fn clear() {
    QUEUED.with(|q| q.borrow_mut().clear());
    QUEUED_P2P.with(|q| q.borrow_mut().clear());
    DISAGREED.with(|d| d.borrow_mut().clear());
}
