//! Putting a [`GrowableBuffer`] to sleep: its physical memory released, the
//! contents optionally saved in pinned host memory first (events order the
//! copies; every event is destroyed under the release rule).

use std::sync::Arc;

use metrale_cuda_sys::CUevent;

use super::{GrowableBuffer, SleepError, SleepState, SleepingBuffer};
use crate::context::{CudaContext, Generation};
use crate::error::{cu, invalid_arg, MetraleError, Result};
use crate::memory::{DeviceRepr, PinnedBuffer};
use crate::stream::{AsStream, CudaStream};

impl<T: DeviceRepr> GrowableBuffer<T> {
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
        // In flight until the sleep is over: a wait on a mapped word counted
        // meanwhile is queued after it, never under the save's waits.
        let _in_flight = match self.range.wait_for_uses(Some(&self.uses)) {
            Ok(in_flight) => in_flight,
            Err(error) => return Err(sleep_error(error, SleepState::Awake(self))),
        };
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
