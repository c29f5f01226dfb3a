//! [`GrowableBuffer`]: a device buffer over a reserved range that grows in place,
//! and sleeps ([`SleepingBuffer`]) with its physical memory released.
//!
//! Invariants: element 0 never moves; `len()` elements are always mapped with
//! read-write access for the buffer's device; a sleeping buffer has no address
//! to pass and no slices; a failed sleep or wake hands back the buffer as it
//! really is (awake, or asleep and possibly partly mapped).

use std::fmt;
use std::ops::RangeBounds;
use std::sync::Arc;

use metrale_cuda_sys::{CUdeviceptr, CUevent};

use super::device::bounds;
use super::vmm::{granularity, round_up, Access, HandleTypes, PhysicalMemory, VirtualRange};
use super::{byte_len, sealed, DeviceMemory, DeviceMemoryMut, DeviceRepr, Uses};
use super::{DeviceSlice, DeviceSliceMut, PinnedBuffer};
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, MetraleError, Result};
use crate::stream::{AsStream, CudaStream};

/// A device buffer that grows without moving: a large range is reserved once and
/// physical memory is mapped on demand ([`GrowableBuffer::grow_to`]), so the
/// address of element 0 never changes. Usable wherever a [`DeviceBuffer`]
/// is (copies, fills, kernel arguments, slices).
///
/// [`GrowableBuffer::sleep`] releases its physical memory (optionally saving the
/// contents in pinned host memory) and [`SleepingBuffer::wake`] restores it at
/// the same addresses.
///
/// Dropping it, or sleeping it, waits for every use of the context
/// (`cuCtxSynchronize`); while the context has waits on mapped words pending
/// ([`CudaContext::pending_waits`]) that could block for ever, or an NCCL group
/// is open, a drop leaks the memory (one line on stderr; a group open on
/// another thread is waited out first, up to five seconds) and `sleep` returns
/// an error instead.
///
/// [`DeviceBuffer`]: super::DeviceBuffer
///
/// ```no_run
/// use metrale_runtime::{host, GrowableBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let s = h.stream();
/// let mut kv = GrowableBuffer::<f32>::new(&h, 1 << 30)?; // up to 4 GiB of address space
/// kv.grow_to(1 << 20)?;                                   // 4 MiB mapped
/// let p = kv.device_ptr();
/// kv.grow_to(1 << 24)?;
/// assert_eq!(kv.device_ptr(), p);
/// s.zero(&mut kv)?;
/// # Ok(()) }
/// ```
pub struct GrowableBuffer<T: DeviceRepr> {
    /// `range.device_ptr()`, held by reference for kernel arguments.
    ptr: CUdeviceptr,
    len: usize,
    range: VirtualRange,
    /// Bytes mapped from the start of the range (a multiple of the granularity).
    mapped: usize,
    /// What the physical memory it maps can be exported as.
    types: HandleTypes,
    /// The size every piece is rounded to: the larger of the range's and the
    /// physical memory's granularity (powers of two).
    grain: usize,
    /// Made by [`GrowableBuffer::from_physical`]: the memory is shared (imported,
    /// say), so it cannot sleep (waking would map fresh private memory).
    shared: bool,
    uses: Uses,
    _elem: std::marker::PhantomData<T>,
}

impl<T: DeviceRepr> GrowableBuffer<T> {
    /// Reserve room for `capacity` elements (rounded up to the granularity) on
    /// `ctx`'s device; nothing is mapped yet (`len() == 0`).
    ///
    /// # Errors
    /// `InvalidArgument` for a zero or overflowing capacity, or a type whose
    /// alignment exceeds the granularity; the failing reservation.
    pub fn new(ctx: &impl AsContext, capacity: usize) -> Result<GrowableBuffer<T>> {
        GrowableBuffer::with_handle_types(ctx, capacity, HandleTypes::NONE)
    }

    /// As [`GrowableBuffer::new`], with every piece of physical memory it maps
    /// exportable as `types` (find a piece with [`VirtualRange::physical`]).
    ///
    /// # Errors
    /// As [`GrowableBuffer::new`].
    pub fn with_handle_types(
        ctx: &impl AsContext,
        capacity: usize,
        types: HandleTypes,
    ) -> Result<GrowableBuffer<T>> {
        let ctx = ctx.context();
        let bytes = byte_len::<T>(capacity, "growable buffer")?;
        if bytes == 0 {
            return Err(invalid_arg("growable buffer: a capacity of 0 bytes"));
        }
        let g = granularity(ctx, HandleTypes::NONE)?.minimum;
        let g_types = if types == HandleTypes::NONE {
            g
        } else {
            granularity(ctx, types)?.minimum
        };
        let grain = g.max(g_types);
        if !grain.is_multiple_of(g) || !grain.is_multiple_of(g_types) {
            return Err(invalid_arg(format!(
                "device {}: growable buffer: the granularities of address space ({g} bytes) and of exportable memory ({g_types} bytes) do not divide each other",
                ctx.ordinal()
            )));
        }
        // Pieces are mapped at multiples of `grain`: the range must start at one.
        let range = VirtualRange::reserve_aligned(ctx, round_up(bytes, grain)?, Some(grain))?;
        super::device::check_alignment::<T>(range.base, "growable buffer")?;
        Ok(GrowableBuffer {
            ptr: range.base,
            len: 0,
            range,
            mapped: 0,
            types,
            grain,
            shared: false,
            uses: Uses::new(None),
            _elem: std::marker::PhantomData,
        })
    }

    /// A buffer over all of `phys` (imported from another process, say): a range
    /// of its size is reserved, `phys` is mapped there with read-write access for
    /// its device, and every element is usable (`len() == capacity()`, which
    /// does not grow further). Both processes see the same memory: order their
    /// accesses yourself (an IPC event, a message on the socket). Such a buffer
    /// cannot [`sleep`](GrowableBuffer::sleep): waking would map fresh private
    /// memory and silently end the sharing.
    ///
    /// # Errors
    /// `InvalidArgument` when the size is not a multiple of `T`'s size; the
    /// failing reservation or mapping.
    pub fn from_physical(phys: Arc<PhysicalMemory>) -> Result<GrowableBuffer<T>> {
        let elem = std::mem::size_of::<T>();
        if elem == 0 || !phys.size.is_multiple_of(elem) {
            return Err(invalid_arg(format!(
                "a buffer of {} over {} bytes of physical memory: not a whole number of elements",
                std::any::type_name::<T>(),
                phys.size
            )));
        }
        let ctx = Arc::clone(&phys.ctx);
        let (size, types) = (phys.size, phys.types);
        let mut range = VirtualRange::reserve(&ctx, size)?;
        super::device::check_alignment::<T>(range.base, "growable buffer")?;
        range.map(0, phys, 0, size, &[(&ctx, Access::ReadWrite)])?;
        Ok(GrowableBuffer {
            ptr: range.base,
            len: size / elem,
            grain: range.granularity,
            range,
            mapped: size,
            types,
            shared: true,
            uses: Uses::new(None),
            _elem: std::marker::PhantomData,
        })
    }

    /// Number of elements usable now.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no element is usable yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most elements it can grow to (the reserved range).
    pub fn capacity(&self) -> usize {
        self.range.size / std::mem::size_of::<T>().max(1)
    }

    /// Bytes of physical memory mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped
    }

    /// The address of element 0: the same for the buffer's whole life.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The address, by reference (what a kernel argument points at).
    pub(crate) fn device_ptr_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }

    /// The context the memory lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.range.ctx
    }

    /// The reserved range (its mappings, granularity).
    pub fn range(&self) -> &VirtualRange {
        &self.range
    }

    /// Grow to `len` elements: physical memory is mapped (one piece, rounded up
    /// to the granularity) with read-write access for the buffer's device. New
    /// elements hold whatever the memory held. A `len` not above the current one
    /// changes nothing.
    ///
    /// # Errors
    /// `InvalidArgument` past [`GrowableBuffer::capacity`]; the failing
    /// `cuMemCreate`, `cuMemMap` or `cuMemSetAccess` (then the buffer is as
    /// before).
    pub fn grow_to(&mut self, len: usize) -> Result<()> {
        if len <= self.len {
            return Ok(());
        }
        if len > self.capacity() {
            return Err(invalid_arg(format!(
                "growing a buffer to {len} elements: its capacity is {} elements",
                self.capacity()
            )));
        }
        let bytes = byte_len::<T>(len, "growable buffer")?;
        if bytes > self.mapped {
            let piece = round_up(bytes - self.mapped, self.grain)?;
            let ctx = Arc::clone(&self.range.ctx);
            // `piece` is a multiple of the grain, so of the memory's granularity.
            let phys = Arc::new(PhysicalMemory::create(&ctx, piece, self.types)?);
            self.range
                .map(self.mapped, phys, 0, piece, &[(&ctx, Access::ReadWrite)])?;
            self.mapped += piece;
        }
        self.len = len;
        Ok(())
    }

    /// A shared view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        let (start, len) = bounds(&range, self.len)?;
        Ok(DeviceSlice::from_parts(
            self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
            &self.range.ctx,
            Some(&self.uses),
        ))
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let (start, len) = bounds(&range, self.len)?;
        Ok(DeviceSliceMut::from_parts(
            self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
            &self.range.ctx,
            Some(&self.uses),
        ))
    }

    /// Release the physical memory, keeping the addresses, and save the
    /// contents: after every use (the context's streams and foreign streams are
    /// waited for), every mapped byte is copied to pinned host memory on
    /// `stream`, each group of pieces (64 MiB or more) is unmapped and released
    /// as soon as its copy has completed, while the rest still copies (so the
    /// driver's work after a release overlaps the copies), and
    /// [`SleepingBuffer::wake`] copies them back. To release without saving,
    /// [`GrowableBuffer::sleep_discarding`].
    ///
    /// # Cost
    /// This form allocates and pins a new host buffer of
    /// [`mapped_bytes`](GrowableBuffer::mapped_bytes) for every sleep, and
    /// pinning dominates: measured on the H200 at 0.5–0.7 s per GiB, far more
    /// than the copy itself. A buffer that sleeps more than once, or whose
    /// sleep is on a latency path, should pin once and use
    /// [`GrowableBuffer::sleep_into`].
    ///
    /// `?` turns the error into a [`MetraleError`] (the buffer is then
    /// dropped); match the [`SleepError`] to keep it:
    ///
    /// ```no_run
    /// # use metrale_runtime::{host, GrowableBuffer, Result};
    /// fn park(kv: GrowableBuffer<f32>) -> Result<()> {
    ///     let h = host(0)?;
    ///     let asleep = kv.sleep(h.stream())?; // saved to new pinned memory
    ///     let _kv = asleep.wake(h.stream())?;  // restored at the same address
    ///     Ok(())
    /// }
    /// ```
    ///
    /// # Errors
    /// A [`SleepError`]: before anything was released (waiting or the first
    /// copies failed) it holds the buffer as it was ([`SleepState::Awake`]);
    /// when a copy or an unmap failed after some piece was released it holds the
    /// sleeping buffer, part of whose memory is still mapped with its contents
    /// (waking maps and restores only what was released; dropping unmaps the
    /// rest). `InvalidArgument`
    /// (the buffer awake) for a buffer made by [`GrowableBuffer::from_physical`],
    /// and while the context has waits on mapped words pending
    /// ([`CudaContext::pending_waits`]: waiting for every use could block for
    /// ever) or an NCCL group is open.
    pub fn sleep(
        self,
        stream: &impl AsStream,
    ) -> std::result::Result<SleepingBuffer<T>, Box<SleepError<T>>> {
        self.sleep_with(Some((stream.stream(), None)))
    }

    /// Release the physical memory, keeping the addresses, without saving the
    /// contents (a cache to refill, say): after every use (the context's
    /// streams and foreign streams are waited for), each mapping is unmapped
    /// and its memory released. A [`SleepingBuffer::wake`] maps fresh memory
    /// whose contents are whatever it held.
    ///
    /// # Cost
    /// No host memory and no copy: the wait for every use, then one unmap and
    /// release per piece.
    ///
    /// ```no_run
    /// # use metrale_runtime::{host, GrowableBuffer, Result};
    /// fn drop_cache(kv: GrowableBuffer<f32>) -> Result<()> {
    ///     let h = host(0)?;
    ///     let asleep = kv.sleep_discarding()?;
    ///     let _kv = asleep.wake(h.stream())?; // same address, contents undefined
    ///     Ok(())
    /// }
    /// ```
    ///
    /// # Errors
    /// As [`GrowableBuffer::sleep`] (without the copies).
    pub fn sleep_discarding(self) -> std::result::Result<SleepingBuffer<T>, Box<SleepError<T>>> {
        self.sleep_with(None)
    }

    /// [`sleep`](GrowableBuffer::sleep) saving the contents into `host`, pinned
    /// memory the caller keeps from one sleep to the next:
    /// [`SleepingBuffer::wake_keeping_host`] hands it back. `host` needs at least
    /// [`mapped_bytes`](GrowableBuffer::mapped_bytes).
    ///
    /// # Cost
    /// Pin once ([`PinnedBuffer::zeroed`](crate::PinnedBuffer::zeroed), 0.5–0.7
    /// s per GiB measured on the H200), then each sleep is the copy alone: the
    /// `sleep_into` + [`wake_keeping_host`](SleepingBuffer::wake_keeping_host)
    /// round trip measured 50.8–51.6 GB/s on the H200. Pre-pin whenever a buffer sleeps more than once or
    /// a sleep must be quick.
    ///
    /// ```no_run
    /// # use metrale_runtime::{host, GrowableBuffer, PinnedBuffer, Result};
    /// fn cycle(mut kv: GrowableBuffer<f32>, times: usize) -> Result<GrowableBuffer<f32>> {
    ///     let h = host(0)?;
    ///     let mut pinned = PinnedBuffer::<u8>::zeroed(&h, kv.mapped_bytes())?; // pinned once
    ///     for _ in 0..times {
    ///         let asleep = kv.sleep_into(h.stream(), pinned)?;
    ///         let (awake, back) = asleep.wake_keeping_host(h.stream())?;
    ///         kv = awake;
    ///         let Some(back) = back else { break }; // `Some`: the contents were saved
    ///         pinned = back;
    ///     }
    ///     Ok(kv)
    /// }
    /// ```
    ///
    /// # Errors
    /// As `sleep`; `InvalidArgument` (the buffer awake, `host` dropped) for a
    /// `host` shorter than the mapped bytes. On any failure `host` stays with
    /// the buffer only when part of it was released (asleep: it holds those
    /// bytes for the wake); otherwise it is dropped, after every copy into it
    /// finished.
    pub fn sleep_into(
        self,
        stream: &impl AsStream,
        host: PinnedBuffer<u8>,
    ) -> std::result::Result<SleepingBuffer<T>, Box<SleepError<T>>> {
        if host.len() < self.mapped {
            let error = invalid_arg(format!(
                "sleeping a growable buffer: the host buffer has {} bytes, {} are mapped",
                host.len(),
                self.mapped
            ));
            return Err(sleep_error(error, SleepState::Awake(self)));
        }
        self.sleep_with(Some((stream.stream(), Some(host))))
    }

    fn sleep_with(
        mut self,
        save: Option<(&CudaStream, Option<PinnedBuffer<u8>>)>,
    ) -> std::result::Result<SleepingBuffer<T>, Box<SleepError<T>>> {
        if self.shared {
            let error = invalid_arg(format!(
                "sleeping a growable buffer over shared physical memory (from_physical, {} bytes at {:#x} on device {}): waking would map fresh private memory and end the sharing",
                self.mapped,
                self.ptr,
                self.context().ordinal()
            ));
            return Err(sleep_error(error, SleepState::Awake(self)));
        }
        // Every use first (work on any stream may still write the memory), then
        // the save (each piece unmapped once its copy has completed), then the
        // unmaps of what is left.
        if let Err(error) = self.range.wait_for_uses(Some(&self.uses)) {
            return Err(sleep_error(error, SleepState::Awake(self)));
        }
        let pieces: Vec<(usize, usize)> = self.range.mappings().collect();
        let (saved, failed) = match save {
            Some((stream, host)) => match self.save_and_release(stream, host, &pieces) {
                Ok(host) => (Some(host), None),
                Err(Unsaved { error, host: None }) => {
                    return Err(sleep_error(error, SleepState::Awake(self)))
                }
                Err(Unsaved { error, host }) => (host, Some(error)),
            },
            None => (None, None),
        };
        let result = match failed {
            Some(error) => Err(error),
            None => self.range.unmap_all(),
        };
        let to_restore = pieces
            .iter()
            .map(|&(offset, size)| saved.is_some() && !self.range.is_mapped(offset, size))
            .collect();
        let sleeping = SleepingBuffer {
            len: self.len,
            mapped: self.mapped,
            pieces,
            to_restore,
            saved,
            buffer: self,
        };
        match result {
            Ok(()) => Ok(sleeping),
            Err(error) => Err(sleep_error(error, SleepState::Asleep(sleeping))),
        }
    }

    /// Copy every mapped byte into pinned memory on `stream` (`host`, or a new
    /// buffer), queued piece by piece with an event after each group of at
    /// least 64 MiB, and unmap each group as soon as its copy has completed:
    /// the work the driver does after a release (on the H200 an H2D copy started
    /// right after releasing 1 GiB ran ~2.5 ms longer) then overlaps the copies
    /// still running, instead of the wake that follows.
    ///
    /// All of it happens inside one section of `stream` (no metrale capture can
    /// begin there), and every copy queued has finished or been abandoned by a
    /// fault when this returns (the crate's waits poll until then). On failure
    /// `host` is handed back when some piece was unmapped (its saved bytes are
    /// needed to wake); pieces whose copy did not complete stay mapped.
    fn save_and_release(
        &mut self,
        stream: &CudaStream,
        host: Option<PinnedBuffer<u8>>,
        pieces: &[(usize, usize)],
    ) -> std::result::Result<PinnedBuffer<u8>, Unsaved> {
        let unsaved = |error| Unsaved { error, host: None };
        let ctx = Arc::clone(&self.range.ctx);
        stream
            .context()
            .check_same(&ctx, || "saving a sleeping buffer".to_owned(), "the stream")
            .map_err(unsaved)?;
        let mut host = match host {
            Some(h) => h,
            None => PinnedBuffer::<u8>::zeroed(stream, self.mapped.max(1)).map_err(unsaved)?,
        };
        if self.mapped == 0 {
            return Ok(host);
        }
        if host.len() < self.mapped {
            return Err(unsaved(invalid_arg(
                "saving a sleeping buffer: the host buffer is short",
            )));
        }
        const GROUP: usize = 64 << 20;
        let mut events = RawEvents {
            ctx: &ctx,
            made: ctx.generation(),
            list: Vec::new(),
        };
        let section = stream.section();
        if let Err(e) = stream.refuse_if_capturing(&section, "saving a sleeping buffer") {
            // Nothing queued.
            return Err(unsaved(e));
        }
        // Groups of pieces, each ended by an event: (first piece, end piece, event).
        let mut groups: Vec<(usize, usize, CUevent)> = Vec::new();
        let mut queued_any = false;
        let queued: Result<()> = (|| {
            let (mut first, mut bytes) = (0, 0);
            for (i, &(offset, size)) in pieces.iter().enumerate() {
                let n = size.min(self.mapped.saturating_sub(offset));
                if n > 0 {
                    let (to, from) = (
                        host.as_mut_ptr()
                            .wrapping_add(offset)
                            .cast::<std::ffi::c_void>(),
                        self.ptr + offset as u64,
                    );
                    // SAFETY: `[offset, offset + n)` lies inside the mapped bytes
                    // (this piece, mapped) and inside `host` (checked: it covers
                    // every mapped byte); nothing else uses either (every use was
                    // waited for; the buffer is consumed by the sleep); `host`
                    // outlives the copy and the piece stays mapped until it has
                    // finished (each is unmapped only after its group's event,
                    // and every path out waits for the stream first); the stream
                    // is not being captured (this section).
                    stream.call("saving a sleeping buffer", |d, s| unsafe {
                        cu!(d, cuMemcpyDtoHAsync_v2(to, from, n, s))
                    })?;
                    queued_any = true;
                    bytes += n;
                }
                if bytes >= GROUP || i + 1 == pieces.len() {
                    let ev = events.record(stream)?;
                    groups.push((first, i + 1, ev));
                    (first, bytes) = (i + 1, 0);
                }
            }
            Ok(())
        })();
        let mut released = false;
        let mut failed = queued.err();
        if failed.is_none() {
            for &(first, end, ev) in &groups {
                if let Err(e) = stream.wait_event(ev) {
                    failed = Some(e);
                    break;
                }
                let unmapped =
                    pieces
                        .get(first..end)
                        .unwrap_or(&[])
                        .iter()
                        .try_for_each(|&(offset, _)| {
                            self.range.unmap_waited(offset).map(|phys| {
                                released = true;
                                drop(phys);
                            })
                        });
                if let Err(e) = unmapped {
                    failed = Some(e);
                    break;
                }
            }
        }
        let Some(error) = failed else {
            return Ok(host);
        };
        if queued_any {
            // Nothing may still read the pieces or write `host` once it is handed
            // back or dropped: wait for the stream inside the section (the
            // crate's waits return once the work finished or was abandoned; a
            // failed record waits for the stream itself).
            if let Ok(done) = stream.record_done_in(&section) {
                let _ = stream.wait_done(done);
            }
        }
        drop(section);
        Err(Unsaved {
            error,
            host: released.then_some(host),
        })
    }
}

/// A save that did not complete (see `GrowableBuffer::save_and_release`).
struct Unsaved {
    error: MetraleError,
    /// The saved bytes, when some piece was released (the buffer is then
    /// asleep, and they restore it); `None`: nothing was released.
    host: Option<PinnedBuffer<u8>>,
}

/// Events a sleep records between its copies, destroyed on every path under
/// the release rule (a failed destroy or bind is reported, never silent).
struct RawEvents<'a> {
    ctx: &'a CudaContext,
    /// The context generation the events are made in.
    made: Generation,
    list: Vec<CUevent>,
}

impl RawEvents<'_> {
    /// Record a new event on `stream` (it is destroyed with this list).
    fn record(&mut self, stream: &CudaStream) -> Result<CUevent> {
        let mut ev: CUevent = std::ptr::null_mut();
        self.ctx.call(
            || "saving a sleeping buffer: an event",
            // SAFETY: writes one event handle; timing disabled.
            |d| unsafe { cu!(d, cuEventCreate(&mut ev, 0x2)) },
        )?;
        self.list.push(ev);
        stream.call("saving a sleeping buffer", |d, s| {
            // SAFETY: an event of this context, made above, and a live stream of it.
            unsafe { cu!(d, cuEventRecord(ev, s)) }
        })?;
        Ok(ev)
    }
}

impl Drop for RawEvents<'_> {
    fn drop(&mut self) {
        if self.list.is_empty() {
            return;
        }
        let list = &self.list;
        self.ctx.release_with(
            self.made,
            format_args!(
                "destroying {} event(s) of a saving sleep on device {}",
                list.len(),
                self.ctx.ordinal()
            ),
            |d, failures| {
                for &ev in list {
                    // SAFETY: an event made by `record`, destroyed once here (the
                    // driver lets a pending event be destroyed: it is freed once
                    // complete).
                    if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(ev)) } {
                        failures.push(e);
                    }
                }
            },
        );
    }
}

fn sleep_error<T: DeviceRepr>(error: MetraleError, buffer: SleepState<T>) -> Box<SleepError<T>> {
    Box::new(SleepError { error, buffer })
}

/// A [`GrowableBuffer::sleep`] that did not complete.
pub struct SleepError<T: DeviceRepr> {
    /// What failed.
    pub error: MetraleError,
    /// The buffer, awake or asleep.
    pub buffer: SleepState<T>,
}

/// Where a failed sleep left a buffer.
pub enum SleepState<T: DeviceRepr> {
    /// Nothing was released.
    Awake(GrowableBuffer<T>),
    /// Asleep, part of the memory possibly still mapped.
    Asleep(SleepingBuffer<T>),
}

/// A [`SleepingBuffer::wake`] that did not complete: the buffer is still asleep
/// (what was mapped again stays mapped; waking again maps the rest).
pub struct WakeError<T: DeviceRepr> {
    /// What failed.
    pub error: MetraleError,
    /// The buffer, still asleep.
    pub buffer: SleepingBuffer<T>,
}

impl<T: DeviceRepr> fmt::Debug for SleepError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SleepError")
            .field("error", &self.error)
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl<T: DeviceRepr> fmt::Debug for SleepState<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SleepState::Awake(b) => f.debug_tuple("Awake").field(b).finish(),
            SleepState::Asleep(b) => f.debug_tuple("Asleep").field(b).finish(),
        }
    }
}

impl<T: DeviceRepr> fmt::Display for SleepError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<T: DeviceRepr> std::error::Error for SleepError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// `?` on a sleep in a function returning metrale's `Result`: the error is
/// kept, the buffer is dropped (match the [`SleepError`] to keep it).
impl<T: DeviceRepr> From<SleepError<T>> for MetraleError {
    fn from(e: SleepError<T>) -> MetraleError {
        e.error
    }
}

/// As `From<SleepError<T>>`: what [`GrowableBuffer::sleep`] returns.
impl<T: DeviceRepr> From<Box<SleepError<T>>> for MetraleError {
    fn from(e: Box<SleepError<T>>) -> MetraleError {
        e.error
    }
}

impl<T: DeviceRepr> fmt::Debug for WakeError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WakeError")
            .field("error", &self.error)
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl<T: DeviceRepr> fmt::Display for WakeError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<T: DeviceRepr> std::error::Error for WakeError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// `?` on a wake in a function returning metrale's `Result`: the error is
/// kept, the sleeping buffer is dropped (match the [`WakeError`] to keep it).
impl<T: DeviceRepr> From<WakeError<T>> for MetraleError {
    fn from(e: WakeError<T>) -> MetraleError {
        e.error
    }
}

/// As `From<WakeError<T>>`: what [`SleepingBuffer::wake`] returns.
impl<T: DeviceRepr> From<Box<WakeError<T>>> for MetraleError {
    fn from(e: Box<WakeError<T>>) -> MetraleError {
        e.error
    }
}

/// A [`GrowableBuffer`] whose physical memory was released: its addresses stay
/// reserved, and nothing can reach them until [`SleepingBuffer::wake`].
pub struct SleepingBuffer<T: DeviceRepr> {
    len: usize,
    mapped: usize,
    /// `(offset, size)` of each mapping it had.
    pieces: Vec<(usize, usize)>,
    /// Per piece: released with its bytes saved, so waking restores it (a piece
    /// still mapped kept its contents; a restored one is done).
    to_restore: Vec<bool>,
    saved: Option<PinnedBuffer<u8>>,
    /// The buffer (its `len` is not usable while asleep: no slice can be made).
    buffer: GrowableBuffer<T>,
}

impl<T: DeviceRepr> SleepingBuffer<T> {
    /// The length it wakes with.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it wakes empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address it wakes at.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.buffer.ptr
    }

    /// Whether the contents were saved (and will be restored).
    pub fn is_saved(&self) -> bool {
        self.saved.is_some()
    }

    /// Map new physical memory at the same addresses (the same pieces as before)
    /// and, when the contents were saved, copy them back on `stream` (waiting for
    /// the copy). Unsaved contents are whatever the new memory holds.
    ///
    /// # Cost
    /// One `cuMemCreate` + map per piece, overlapped with the copy back of the
    /// piece before it; no pinning (the saved bytes are already pinned). After a
    /// [`sleep_into`](GrowableBuffer::sleep_into) the round trip measured
    /// 50.8–51.6 GB/s on the H200; after [`sleep`](GrowableBuffer::sleep) the
    /// wake costs the same, but the sleep paid 0.5–0.7 s per GiB to pin. The
    /// pinned memory is freed here; [`wake_keeping_host`](SleepingBuffer::wake_keeping_host)
    /// hands it back for the next sleep.
    ///
    /// # Errors
    /// A [`WakeError`] holding the buffer, still asleep, for the failing
    /// allocation, mapping or copy.
    pub fn wake(
        self,
        stream: &impl AsStream,
    ) -> std::result::Result<GrowableBuffer<T>, Box<WakeError<T>>> {
        self.wake_keeping_host(stream).map(|(buffer, _)| buffer)
    }

    /// [`wake`](SleepingBuffer::wake), handing back the pinned memory the
    /// contents were saved in (for the next [`GrowableBuffer::sleep_into`]);
    /// `None` when they were not saved.
    ///
    /// # Errors
    /// As `wake`.
    #[allow(clippy::type_complexity)]
    pub fn wake_keeping_host(
        mut self,
        stream: &impl AsStream,
    ) -> std::result::Result<(GrowableBuffer<T>, Option<PinnedBuffer<u8>>), Box<WakeError<T>>> {
        let stream = stream.stream();
        if let Err(error) = self.map_and_restore(stream) {
            return Err(Box::new(WakeError {
                error,
                buffer: self,
            }));
        }
        let SleepingBuffer {
            len,
            mapped,
            mut buffer,
            saved,
            ..
        } = self;
        buffer.len = len;
        buffer.mapped = mapped;
        Ok((buffer, saved))
    }

    /// Map what is missing, piece by piece, and queue the copy of each released
    /// piece's saved bytes right after its mapping, so that creating and mapping
    /// the next piece overlaps the copy of the last; then wait for the copies (on
    /// every path once one was queued: the saved bytes must outlive them). A
    /// piece that was never released, or that an earlier wake restored, is not
    /// copied again.
    fn map_and_restore(&mut self, stream: &CudaStream) -> Result<()> {
        let ctx = Arc::clone(&self.buffer.range.ctx);
        let restore = self.saved.is_some() && self.mapped > 0;
        if restore && !stream.context().same(&ctx) {
            return Err(invalid_arg(format!(
                "waking a buffer of device {}: the stream is of device {}",
                ctx.ordinal(),
                stream.ordinal()
            )));
        }
        if let Some(saved) = &self.saved {
            if saved.len() < self.mapped {
                return Err(invalid_arg("waking a buffer: the saved contents are short"));
            }
        }
        let section = stream.section();
        if restore {
            stream.refuse_if_capturing(&section, "restoring a sleeping buffer")?;
        }
        let mut queued = Vec::new();
        let mut failed = None;
        for (i, &(offset, size)) in self.pieces.iter().enumerate() {
            if !self.buffer.range.is_mapped(offset, size) {
                // The pieces were made with this granularity before.
                let mapped =
                    PhysicalMemory::create(&ctx, size, self.buffer.types).and_then(|phys| {
                        self.buffer.range.map(
                            offset,
                            Arc::new(phys),
                            0,
                            size,
                            &[(&ctx, Access::ReadWrite)],
                        )
                    });
                if let Err(e) = mapped {
                    failed = Some(e);
                    break;
                }
            }
            // A piece that was never released kept its contents; one restored
            // by an earlier wake is done.
            let (Some(saved), true) = (&self.saved, self.to_restore.get(i) == Some(&true)) else {
                continue;
            };
            let n = size.min(self.mapped.saturating_sub(offset));
            if n == 0 {
                continue;
            }
            let (to, from) = (
                self.buffer.ptr + offset as u64,
                saved
                    .as_ptr()
                    .wrapping_add(offset)
                    .cast::<std::ffi::c_void>(),
            );
            // SAFETY: `[offset, offset + n)` lies inside the saved bytes (checked
            // above: they cover every mapped byte) and inside this piece, mapped
            // with read-write access just now or before; the saved buffer lives in
            // `self` until the wait below, and nothing else uses either side (the
            // buffer is asleep); the stream is not being captured (this section).
            let copied = stream.call("restoring a sleeping buffer", |d, s| unsafe {
                cu!(d, cuMemcpyHtoDAsync_v2(to, from, n, s))
            });
            match copied {
                Ok(()) => queued.push(i),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if !queued.is_empty() {
            let waited = stream.record_done_in(&section).and_then(|done| {
                drop(section);
                stream.wait_done(done)
            });
            match waited {
                Ok(()) => {
                    for i in queued {
                        if let Some(r) = self.to_restore.get_mut(i) {
                            *r = false;
                        }
                    }
                }
                Err(e) => {
                    if failed.is_none() {
                        failed = Some(e);
                    }
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

impl<T: DeviceRepr> fmt::Debug for SleepingBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SleepingBuffer")
            .field("device", &self.buffer.range.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.buffer.ptr))
            .field("len", &self.len)
            .field("saved", &self.saved.is_some())
            .finish()
    }
}

impl<T: DeviceRepr> fmt::Debug for GrowableBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrowableBuffer")
            .field("device", &self.range.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("mapped_bytes", &self.mapped)
            .finish()
    }
}

impl<T: DeviceRepr> Drop for GrowableBuffer<T> {
    fn drop(&mut self) {
        // The range's own Drop would not know the foreign streams.
        self.range.release(Some(&self.uses));
    }
}

impl<T: DeviceRepr> sealed::Sealed for GrowableBuffer<T> {}
impl<T: DeviceRepr> DeviceMemory<T> for GrowableBuffer<T> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn memory_context(&self) -> &Arc<CudaContext> {
        &self.range.ctx
    }
    fn uses(&self) -> Option<&Uses> {
        Some(&self.uses)
    }
    fn describe(&self) -> String {
        format!(
            "growable buffer {:#x} ({} x {})",
            self.ptr,
            self.len,
            std::any::type_name::<T>()
        )
    }
}
impl<T: DeviceRepr> DeviceMemoryMut<T> for GrowableBuffer<T> {}
