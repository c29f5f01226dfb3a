//! [`CaptureArena`] (device memory with addresses stable across captures, carved
//! without a driver call) and [`GraphBuckets`] (one captured step per batch-size
//! bucket: pick, replay, update in place).
//!
//! Invariants:
//! - The arena is one `cuMemAlloc` made when it is created, outside any capture;
//!   [`CaptureArena::take`] only moves a cursor, so a buffer taken inside a
//!   capture adds no allocation or free node to the graph, and the same takes
//!   after a [`CaptureArena::reset`] give the same addresses.
//! - A graph captured through [`CaptureArena::capture`] holds the arena, and so
//!   does every executable made from it and every replay in flight: through a
//!   user object the graph retains (the driver clones it into executables and
//!   holds it for launches in flight, so a replay is one `cuGraphLaunch`), or on
//!   a driver without user objects with the graph's host functions, kept by a
//!   host function queued after each replay. The memory outlives them all.
//! - `reset` needs `&mut self` (no view is borrowed) and is refused while any such
//!   graph, executable or replay holds the arena. It first drops what the
//!   user objects' destructors handed to the drop-later list, so a reset after
//!   the holders are dropped and their replays synchronised succeeds.
//! - Views carry the arena allocation's use record: its free waits for the
//!   streams of other devices that used them, as any buffer's does.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{CudaGraph, CudaGraphExec};
use crate::context::AsContext;
use crate::error::{invalid_arg, MetraleError, Result};
use crate::memory::{DeviceBuffer, DeviceRepr, DeviceSliceMut};
use crate::stream::CudaStream;

/// What graphs hold of an arena: its memory.
struct ArenaMemory {
    buffer: DeviceBuffer<u8>,
}

/// Device memory for the buffers of captured steps: taken by moving a cursor
/// (no driver call, so no allocation node in a capture), at addresses that are
/// the same at every capture that takes in the same order, and kept alive by the
/// graphs that used it.
///
/// ```no_run
/// use metrale_runtime::{host, CaptureArena};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let s = h.stream();
/// let arena = CaptureArena::new(&h, 64 << 20)?;
/// let mut scratch = arena.take::<f32>(1 << 20)?;
/// let graph = arena.capture(s, |s| s.memset_u32(&mut scratch, 0))?;
/// let exec = graph.instantiate()?;
/// // SAFETY: the graph only fills `scratch`, which the arena keeps alive.
/// unsafe { exec.launch(s)? };
/// # Ok(()) }
/// ```
pub struct CaptureArena {
    memory: Arc<ArenaMemory>,
    /// The one keeper graphs hold of the memory (counted by `reset`).
    keep: crate::stream::HostKeep,
    /// Bytes taken so far.
    cursor: AtomicUsize,
}

impl std::fmt::Debug for CaptureArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureArena")
            .field(
                "base",
                &format_args!("{:#x}", self.memory.buffer.device_ptr()),
            )
            .field("capacity", &self.capacity())
            .field("taken", &self.taken())
            .finish()
    }
}

/// Alignment of every buffer taken from an arena (the driver's own for
/// allocations).
const ARENA_ALIGN: usize = 256;

impl CaptureArena {
    /// An arena of `bytes` bytes of device memory (`cuMemAlloc`), made now.
    ///
    /// # Errors
    /// `cuMemAlloc_v2`'s failure; `InvalidArgument` inside a capture on this
    /// thread or for 0 bytes.
    pub fn new(ctx: &impl AsContext, bytes: usize) -> Result<CaptureArena> {
        if bytes == 0 {
            return Err(invalid_arg(format!(
                "device {}: a capture arena needs at least one byte",
                ctx.context().ordinal()
            )));
        }
        if crate::lifetime::capturing_on_this_thread() {
            return Err(invalid_arg(format!(
                "device {}: a capture arena is made before capturing (an allocation in \
                 a capture would become a graph node)",
                ctx.context().ordinal()
            )));
        }
        let buffer = DeviceBuffer::<u8>::alloc(ctx, bytes)?;
        let memory = Arc::new(ArenaMemory { buffer });
        Ok(CaptureArena {
            keep: CudaGraph::holder(Arc::clone(&memory) as Arc<dyn Send + Sync>),
            memory,
            cursor: AtomicUsize::new(0),
        })
    }

    /// Its size in bytes.
    pub fn capacity(&self) -> usize {
        self.memory.buffer.len()
    }

    /// Bytes taken since it was made or last reset (with alignment padding).
    pub fn taken(&self) -> usize {
        self.cursor.load(Ordering::Acquire)
    }

    /// Take `len` elements of `T`, 256-byte aligned (or `T`'s alignment when
    /// larger), as a mutable view of the
    /// arena: no driver call, inside a capture or not. Views are disjoint; the
    /// memory is not zeroed (it holds whatever was last written there).
    ///
    /// # Errors
    /// `InvalidArgument` when the arena has no room left (naming what is
    /// left), or the byte size overflows.
    pub fn take<T: DeviceRepr>(&self, len: usize) -> Result<DeviceSliceMut<'_, T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| invalid_arg("capture arena: the byte size overflows"))?;
        let capacity = self.capacity();
        let base = self.memory.buffer.device_ptr();
        // The address, not the offset, is aligned: for T's alignment too when
        // it is above the arena's own.
        let align = ARENA_ALIGN.max(std::mem::align_of::<T>()) as u64;
        let mut at = self.cursor.load(Ordering::Acquire);
        loop {
            let start = (base + at as u64).next_multiple_of(align) - base;
            let end = usize::try_from(start)
                .ok()
                .and_then(|start| start.checked_add(bytes))
                .filter(|&e| e <= capacity);
            let Some(end) = end else {
                return Err(invalid_arg(format!(
                    "capture arena {:#x} on device {}: {bytes} bytes ({len} x {}) do not fit: \
                     {} of {capacity} bytes are taken (reset it, or make it larger)",
                    self.memory.buffer.device_ptr(),
                    self.memory.buffer.context().ordinal(),
                    std::any::type_name::<T>(),
                    at
                )));
            };
            match self
                .cursor
                .compare_exchange_weak(at, end, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    let buffer = &self.memory.buffer;
                    return Ok(DeviceSliceMut::from_parts(
                        base + start,
                        len,
                        buffer.context(),
                        Some(buffer.uses_ref()),
                    ));
                }
                Err(now) => at = now,
            }
        }
    }

    /// Give every byte back, so the next takes start at the base again (the
    /// same addresses as before, for the same takes).
    ///
    /// Holds through user objects are given back by the driver's destructors,
    /// which hand them to the drop-later list; `reset` empties that list
    /// first (as a synchronisation does). A driver that runs a destructor
    /// later than the synchronisation after the last replay makes `reset`
    /// refuse until it has run: try again then.
    ///
    /// # Errors
    /// `InvalidArgument` while a graph captured with it, an executable made from
    /// one, or a replay in flight still holds it (they use its addresses).
    pub fn reset(&mut self) -> Result<()> {
        crate::lifetime::drain();
        let holders = Arc::strong_count(&self.keep) - 1;
        if holders > 0 {
            return Err(invalid_arg(format!(
                "capture arena {:#x} on device {}: {holders} hold(s) of graphs, executables or \
                 replays in flight made with it still use its addresses; drop them (and \
                 let their replays finish) before reset",
                self.memory.buffer.device_ptr(),
                self.memory.buffer.context().ordinal()
            )));
        }
        self.cursor.store(0, Ordering::Release);
        Ok(())
    }

    /// Capture `f` on `stream` (as [`CudaStream::capture`]); the graph then
    /// holds this arena, and so do its executables and their replays.
    ///
    /// # Errors
    /// As [`CudaStream::capture`]; `WrongDevice` for a stream of another device.
    pub fn capture<F>(&self, stream: &CudaStream, f: F) -> Result<CudaGraph>
    where
        F: FnOnce(&CudaStream) -> Result<()>,
    {
        stream.context().check_same(
            self.memory.buffer.context(),
            || format!("capture arena {:#x}", self.memory.buffer.device_ptr()),
            "the stream",
        )?;
        let mut graph = stream.capture(f)?;
        graph.hold(&self.keep);
        Ok(graph)
    }

    /// As [`CaptureArena::capture`], with `f` returning any error type that a
    /// [`MetraleError`] converts into, as [`CudaStream::try_capture`] (name it in
    /// the closure, `|s| -> Result<(), AppError> { .. }`, or with a turbofish).
    ///
    /// ```no_run
    /// use metrale_runtime::{host, CaptureArena, CudaGraph, MetraleError};
    /// #[derive(Debug)]
    /// enum AppError { Gpu(MetraleError), Config(&'static str) }
    /// impl From<MetraleError> for AppError {
    ///     fn from(e: MetraleError) -> Self { AppError::Gpu(e) }
    /// }
    /// fn record(arena: &CaptureArena, layers: usize) -> Result<CudaGraph, AppError> {
    ///     let h = host(0)?;
    ///     let mut scratch = arena.take::<f32>(1024)?;
    ///     arena.try_capture(h.stream(), |s| -> Result<(), AppError> {
    ///         if layers == 0 {
    ///             return Err(AppError::Config("no layers"));
    ///         }
    ///         s.zero(&mut scratch)?;
    ///         Ok(())
    ///     })
    /// }
    /// ```
    ///
    /// # Errors
    /// As [`CudaStream::try_capture`]; `WrongDevice` for a stream of another
    /// device.
    pub fn try_capture<E, F>(&self, stream: &CudaStream, f: F) -> std::result::Result<CudaGraph, E>
    where
        E: From<MetraleError>,
        F: FnOnce(&CudaStream) -> std::result::Result<(), E>,
    {
        stream.context().check_same(
            self.memory.buffer.context(),
            || format!("capture arena {:#x}", self.memory.buffer.device_ptr()),
            "the stream",
        )?;
        let mut graph = stream.try_capture(f)?;
        graph.hold(&self.keep);
        Ok(graph)
    }
}

/// `sizes` ascending without duplicates, or an error for none or a 0.
fn bucket_sizes(sizes: &[usize]) -> Result<Vec<usize>> {
    let mut sorted = sizes.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.first().is_none_or(|&s| s == 0) {
        return Err(invalid_arg(format!(
            "graph buckets: sizes {sizes:?}: at least one, each above 0"
        )));
    }
    Ok(sorted)
}

/// One captured step per batch-size bucket, replayed for the smallest bucket
/// that fits a batch: the shape an engine writes for its decode step.
///
/// ```no_run
/// use metrale_runtime::{host, CaptureArena, GraphBuckets};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let s = h.stream();
/// let arena = CaptureArena::new(&h, 16 << 20)?;
/// let mut scratch = arena.take::<u32>(64 * 1024)?;
/// let mut buckets = GraphBuckets::capture(s, &arena, &[1, 2, 4, 8, 16, 32, 64], |s, size| {
///     s.memset_u32(&mut scratch.slice_mut(..size * 1024)?, size as u32)
/// })?;
/// // SAFETY: each step only fills `scratch`, which the arena keeps alive.
/// let used = unsafe { buckets.replay(s, 5)? }; // the bucket of 8
/// assert_eq!(used, 8);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct GraphBuckets {
    /// Ascending bucket sizes, each with its executable.
    buckets: Vec<(usize, CudaGraphExec)>,
}

impl GraphBuckets {
    /// Capture `step(stream, size)` once per size of `sizes` (any order,
    /// duplicates removed) through `arena`, and instantiate each.
    ///
    /// # Errors
    /// `InvalidArgument` for no sizes or a size of 0; the first failing
    /// capture, step or instantiation, as it failed.
    pub fn capture<F>(
        stream: &CudaStream,
        arena: &CaptureArena,
        sizes: &[usize],
        mut step: F,
    ) -> Result<GraphBuckets>
    where
        F: FnMut(&CudaStream, usize) -> Result<()>,
    {
        let sorted = bucket_sizes(sizes)?;
        let mut buckets = Vec::with_capacity(sorted.len());
        for size in sorted {
            let graph = arena.capture(stream, |s| step(s, size))?;
            let exec = graph.instantiate()?;
            buckets.push((size, exec));
        }
        Ok(GraphBuckets { buckets })
    }

    /// As [`GraphBuckets::capture`], with `step` returning any error type that a
    /// [`MetraleError`] converts into, as [`CudaStream::try_capture`].
    ///
    /// ```no_run
    /// use metrale_runtime::{host, CaptureArena, GraphBuckets, MetraleError};
    /// #[derive(Debug)]
    /// enum AppError { Gpu(MetraleError), TooBig(usize) }
    /// impl From<MetraleError> for AppError {
    ///     fn from(e: MetraleError) -> Self { AppError::Gpu(e) }
    /// }
    /// fn buckets(arena: &CaptureArena) -> Result<GraphBuckets, AppError> {
    ///     let h = host(0)?;
    ///     let mut scratch = arena.take::<u32>(64 * 1024)?;
    ///     GraphBuckets::try_capture(h.stream(), arena, &[1, 8, 64], |s, size| -> Result<(), AppError> {
    ///         if size > 64 {
    ///             return Err(AppError::TooBig(size));
    ///         }
    ///         s.memset_u32(&mut scratch.slice_mut(..size * 1024)?, 0)?;
    ///         Ok(())
    ///     })
    /// }
    /// ```
    ///
    /// # Errors
    /// As [`GraphBuckets::capture`], with `step`'s own error as it failed.
    pub fn try_capture<E, F>(
        stream: &CudaStream,
        arena: &CaptureArena,
        sizes: &[usize],
        mut step: F,
    ) -> std::result::Result<GraphBuckets, E>
    where
        E: From<MetraleError>,
        F: FnMut(&CudaStream, usize) -> std::result::Result<(), E>,
    {
        let sorted = bucket_sizes(sizes)?;
        let mut buckets = Vec::with_capacity(sorted.len());
        for size in sorted {
            let graph = arena.try_capture(stream, |s| step(s, size))?;
            let exec = graph.instantiate()?;
            buckets.push((size, exec));
        }
        Ok(GraphBuckets { buckets })
    }

    /// The bucket sizes, ascending.
    pub fn sizes(&self) -> impl Iterator<Item = usize> + '_ {
        self.buckets.iter().map(|(s, _)| *s)
    }

    /// The smallest bucket that holds `batch`, if any.
    pub fn bucket_for(&self, batch: usize) -> Option<usize> {
        self.buckets.iter().map(|(s, _)| *s).find(|&s| s >= batch)
    }

    /// The executable of the bucket of exactly `size`.
    pub fn exec(&self, size: usize) -> Option<&CudaGraphExec> {
        self.buckets
            .iter()
            .find(|(s, _)| *s == size)
            .map(|(_, e)| e)
    }

    /// Replay the smallest bucket that holds `batch` on `stream`; returns its
    /// size.
    ///
    /// # Safety
    /// As [`CudaGraphExec::launch`]: every buffer the captured step uses is
    /// still alive and not used meanwhile by other work, unless ordered.
    ///
    /// # Errors
    /// `InvalidArgument` when `batch` is above the largest bucket; as
    /// [`CudaGraphExec::launch`].
    pub unsafe fn replay(&self, stream: &CudaStream, batch: usize) -> Result<usize> {
        let Some((size, exec)) = self.buckets.iter().find(|(s, _)| *s >= batch) else {
            return Err(invalid_arg(format!(
                "graph buckets: a batch of {batch} is above the largest bucket ({})",
                self.buckets.last().map_or(0, |(s, _)| *s)
            )));
        };
        // SAFETY: the caller's contract, passed on.
        unsafe { exec.launch(stream)? };
        Ok(*size)
    }

    /// Capture the bucket of `size` again (its pointers moved) and update its
    /// executable in place (`CudaGraphExec::update`); the new graph holds
    /// `arena`.
    ///
    /// # Errors
    /// `InvalidArgument` for a size that is not a bucket; the failing capture,
    /// step or update (a changed topology is refused by the driver).
    pub fn update<F>(
        &mut self,
        stream: &CudaStream,
        arena: &CaptureArena,
        size: usize,
        step: F,
    ) -> Result<()>
    where
        F: FnOnce(&CudaStream, usize) -> Result<()>,
    {
        let Some((_, exec)) = self.buckets.iter_mut().find(|(s, _)| *s == size) else {
            return Err(invalid_arg(format!(
                "graph buckets: no bucket of {size} (the buckets are {:?})",
                self.buckets.iter().map(|(s, _)| *s).collect::<Vec<_>>()
            )));
        };
        let graph = arena.capture(stream, |s| step(s, size))?;
        exec.update(&graph)
    }
}
