//! Freeing device memory only after every use a safe operation queued: the one
//! Drop path of [`DeviceBuffer`](super::DeviceBuffer) and
//! [`ManagedBuffer`](super::ManagedBuffer), and the frees deferred while a stream
//! involved is being captured.
//!
//! Invariants:
//! - A stream-ordered allocation is freed on its own stream, after an event of
//!   every other stream a safe operation used it on (any device): the free never
//!   blocks the host and never runs before that work.
//! - Memory from `cuMemAlloc` (and managed memory) used by a stream of another
//!   device waits for that stream before `cuMemFree` (which waits for its own
//!   device's work).
//! - Nothing is queued on a stream that is being captured (the free would be
//!   recorded into the graph, and the capture invalidated): such a free is
//!   deferred and retried when a capture ends, never leaked silently.
//! - While an NCCL group is open anywhere in the process (feature `nccl`), every
//!   free is deferred the same way and retried when the last open group ends: a
//!   collective queued inside a group reaches its stream only at the outermost
//!   `ncclGroupEnd`, so the uses noted for it are not yet on the stream. The
//!   fast path pays one atomic load for this.
//! - Pinned host memory (`cuMemFreeHost` waits for the whole context's work)
//!   is freed only while no GPU-side wait on a mapped word is pending on its
//!   context, outside host functions and captures on the dropping thread;
//!   otherwise its free is deferred like the others (so a Drop never blocks
//!   behind a wait only the host can end).

use std::sync::{Arc, PoisonError};

use metrale_cuda_sys::CUdeviceptr;

use super::Uses;
use crate::context::{CudaContext, Generation};
use crate::error::{cu, report_line};
use crate::lifetime::{self, nccl_groups_open};
use crate::stream::{CudaEvent, CudaStream};

/// How an allocation was made, so how it is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `cuMemAlloc` or `cuMemAllocAsync` (per [`Uses::own`]).
    Device,
    /// `cuMemAllocManaged`.
    Managed,
    /// `cuMemAllocHost` / `cuMemHostAlloc` (a pinned buffer): `cuMemFreeHost`
    /// waits for the whole context's work, so it goes only when no GPU-side
    /// wait on a mapped word is pending and no capture is on this thread.
    Host,
    /// `ncclMemAlloc` (an NCCL buffer, feature `nccl`): freed by `ncclMemFree`
    /// after `cuCtxSynchronize` (NCCL may unmap it with `cuMemUnmap`, which is
    /// not promised to wait for the device's work), so never while a capture
    /// is in progress anywhere in the process (the synchronisation would end
    /// it) nor while an NCCL group is open. The wait is bounded by the
    /// duration (the buffer's drop timeout): it runs on a helper thread, which
    /// the dropping thread waits for at most that long.
    #[cfg(feature = "nccl")]
    Nccl(std::time::Duration),
}

/// An allocation whose owner went: freed as soon as nothing can use it.
pub(crate) struct FreeJob {
    pub(crate) ptr: CUdeviceptr,
    pub(crate) kind: Kind,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) made: Generation,
    pub(crate) uses: Uses,
}

/// A free that must wait for a capture to end.
struct Deferred;

/// What a capture check inside a free says to do.
enum Check {
    /// Go on: not captured.
    Free,
    /// Hand the job back: captured.
    Defer,
    /// Give up (reported): the state could not be read.
    Leak,
}

/// Check `stream`, inside `section`, for a free described by `what`.
fn check_capture(
    stream: &CudaStream,
    section: &crate::stream::Section<'_>,
    what: &str,
    whose: &str,
) -> Check {
    match stream.capturing_now(section) {
        Ok(false) => Check::Free,
        Ok(true) => Check::Defer,
        Err(e) => {
            report_line(format_args!(
                "{what}: leaked, the capture state of {whose} could not be read: {e}"
            ));
            Check::Leak
        }
    }
}

impl FreeJob {
    fn what(&self) -> String {
        let kind = match (self.kind, self.uses.own.is_some()) {
            (Kind::Managed, _) => "managed buffer",
            (Kind::Host, _) => "pinned buffer",
            (Kind::Device, true) => "stream-ordered buffer",
            (Kind::Device, false) => "device buffer",
            #[cfg(feature = "nccl")]
            (Kind::Nccl(_), _) => "NCCL buffer",
        };
        format!(
            "freeing {kind} {:#x} on device {}",
            self.ptr,
            self.ctx.ordinal()
        )
    }

    /// Free now, or defer when a stream involved is being captured or an NCCL
    /// group is open.
    pub(crate) fn release(self) {
        if let Some(job) = self.try_free() {
            // Retried at once when the capture or group ended meanwhile.
            crate::lifetime::defer(Box::new(job));
        }
    }

    /// Free, or hand the job back when it must wait for a capture or an NCCL
    /// group to end.
    fn try_free(self) -> Option<FreeJob> {
        if self.kind == Kind::Host {
            // No collective takes pinned memory metrale hands out, and no
            // stream use is recorded for it: only the context-wide wait matters.
            return self.free_now(&[]);
        }
        if nccl_groups_open() {
            // A collective queued in the group may use this memory and reach
            // its stream only at the group's end.
            return Some(self);
        }
        #[cfg(feature = "nccl")]
        if matches!(self.kind, Kind::Nccl(_)) && crate::lifetime::captures_in_progress() {
            // Its free synchronises the context: after the captures.
            return Some(self);
        }
        let any_foreign = self
            .uses
            .any_foreign
            .load(std::sync::atomic::Ordering::Acquire);
        if !any_foreign {
            if let Some(own) = &self.uses.own {
                // The hot path: a stream-ordered buffer only its own stream used.
                return match self.free_on_own(own) {
                    Ok(()) => None,
                    Err(Deferred) => Some(self),
                };
            }
        }
        let foreign: Vec<CudaStream> = if any_foreign {
            self.uses
                .foreign
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        } else {
            Vec::new()
        };
        match self.uses.own.clone() {
            Some(own) => self.free_ordered(&own, &foreign),
            None => self.free_now(&foreign),
        }
    }

    /// The stream-ordered free of a buffer no other stream used.
    fn free_on_own(&self, own: &CudaStream) -> Result<(), Deferred> {
        free_on_own(self.ptr, &self.ctx, self.made, own)
    }

    /// A stream-ordered free on `own`, after the work of every foreign stream.
    fn free_ordered(self, own: &CudaStream, foreign: &[CudaStream]) -> Option<FreeJob> {
        let what = self.what();
        // Sections of two streams are never held at once (a capture start holds its
        // stream's lock while it waits for that stream's sections).
        match check_capture(own, &own.section(), &what, "its stream") {
            Check::Free => {}
            Check::Defer => return Some(self),
            Check::Leak => return None,
        }
        if !self.ctx.may_release(self.made, format_args!("{what}")) {
            return None;
        }
        // An event at the end of each foreign stream's work so far.
        let mut after = Vec::with_capacity(foreign.len());
        for f in foreign {
            let f_section = f.section();
            match check_capture(f, &f_section, &what, "a stream that used it") {
                Check::Free => {}
                Check::Defer => return Some(self),
                Check::Leak => return None,
            }
            match CudaEvent::new(f).and_then(|ev| ev.record(f).map(|()| ev)) {
                Ok(ev) => after.push(ev),
                Err(e) => {
                    // The stream cannot be ordered: wait for it instead; if that
                    // fails too, leaking is the only safe choice.
                    drop(f_section);
                    if let Err(e2) = f.synchronize() {
                        report_line(format_args!(
                            "{what}: leaked, it could not be ordered after {} ({e}), nor waited for ({e2})",
                            f.subject("")
                        ));
                        return None;
                    }
                }
            }
        }
        let section = own.section();
        match check_capture(own, &section, &what, "its stream") {
            Check::Free => {}
            Check::Defer => return Some(self),
            Check::Leak => return None,
        }
        for ev in &after {
            if let Err(e) = own.wait_unmarked(ev) {
                report_line(format_args!(
                    "{what}: leaked, its stream could not be ordered after a stream that used it: {e}"
                ));
                return None;
            }
        }
        let ptr = self.ptr;
        // SAFETY: this allocation's own stream-ordered free, once, on the stream it
        // was allocated on (alive: `own` holds it), after every use recorded above;
        // the stream is not being captured (checked in this section).
        let freed = own.call_by_stream(|d, s| unsafe { cu!(d, cuMemFreeAsync(ptr, s)) });
        if let Err(e) = freed {
            crate::error::report_drop_failures(format_args!("{what}"), &[e]);
        }
        drop(section);
        None
    }

    /// `cuMemFree` after the foreign streams' work.
    fn free_now(self, foreign: &[CudaStream]) -> Option<FreeJob> {
        // Every free here waits for the whole context's work (`cuMemFree`,
        // `cuMemFreeHost`, the synchronize before `ncclMemFree`): it is in
        // flight from its check through the free, so a wait on a mapped word
        // counted meanwhile is queued after it, never under it.
        let ctx = Arc::clone(&self.ctx);
        let _in_flight = ctx.enter_context_wide_free();
        // The same on the context of every foreign stream, whose synchronize
        // below would wait behind a wait on a mapped word queued after the
        // check (nothing is allocated when there is none).
        let _foreign_in_flight: Vec<crate::context::ContextWideWait> = foreign
            .iter()
            .map(|f| f.context().enter_context_wide_wait())
            .collect();
        if self.ctx.pending_waits() > 0 || foreign.iter().any(|f| f.context().pending_waits() > 0) {
            // `cuMemFree` waits for the device's work, which a wait on a mapped
            // word nobody writes never ends: after those waits pass, then (the
            // next drain retries it).
            crate::lifetime::retry_at_next_drain();
            return Some(self);
        }
        if crate::lifetime::capturing_on_this_thread() {
            // `cuMemFree` and synchronisations are refused on a capturing thread
            // (and would invalidate its capture): after the capture, then.
            return Some(self);
        }
        let what = self.what();
        for f in foreign {
            let f_section = f.section();
            match check_capture(f, &f_section, &what, "a stream that used it") {
                Check::Free => {}
                Check::Defer => return Some(self),
                Check::Leak => return None,
            }
            drop(f_section);
            if let Err(e) = f.synchronize() {
                let abandoned = e.status().is_some_and(crate::lifetime::work_abandoned);
                if !abandoned {
                    report_line(format_args!("{what}: leaked, a stream of another device that used it could not be waited for: {e}"));
                    return None;
                }
            }
        }
        let (ptr, kind) = (self.ptr, self.kind);
        #[cfg(feature = "nccl")]
        if let Kind::Nccl(bound) = kind {
            free_nccl_bounded(&self.ctx, self.made, ptr, bound, &what);
            return None;
        }
        self.ctx
            .release_with(self.made, format_args!("{what}"), |d, failures| {
                let freed = if kind == Kind::Host {
                    // SAFETY: a pinned allocation of this context handed over by
                    // its dropped owner, freed once, here; `cuMemFreeHost` waits
                    // for the context's work (none can wait for ever: checked).
                    unsafe { cu!(d, cuMemFreeHost(ptr as usize as *mut std::ffi::c_void)) }
                } else {
                    // SAFETY: this allocation's own, freed once; `cuMemFree` waits
                    // for the work of its context, and foreign streams were waited
                    // for above.
                    unsafe { cu!(d, cuMemFree_v2(ptr)) }
                };
                if let Err(e) = freed {
                    failures.push(e);
                }
            });
        None
    }
}

/// The stream-ordered free of a buffer no other stream used: one section, one
/// context check, the free; no allocation, text made only on failure.
#[inline]
fn free_on_own(
    ptr: CUdeviceptr,
    ctx: &CudaContext,
    made: Generation,
    own: &CudaStream,
) -> Result<(), Deferred> {
    let what = || {
        format!(
            "freeing stream-ordered buffer {ptr:#x} on device {}",
            ctx.ordinal()
        )
    };
    let section = own.section();
    match own.capturing_now(&section) {
        Ok(false) => {}
        Ok(true) => return Err(Deferred),
        Err(e) => {
            report_line(format_args!(
                "{}: leaked, the capture state of its stream could not be read: {e}",
                what()
            ));
            return Ok(());
        }
    }
    if !ctx.may_release(made, format_args!("{}", Lazy(&what))) {
        return Ok(());
    }
    // SAFETY: this allocation's own stream-ordered free, once, on the stream it was
    // allocated on (alive: `own` holds it); no other stream used it, and the
    // stream is not being captured (checked in this section).
    let freed = own.call_by_stream(|d, s| unsafe { cu!(d, cuMemFreeAsync(ptr, s)) });
    if let Err(e) = freed {
        crate::error::report_drop_failures(format_args!("{}", what()), &[e]);
    }
    drop(section);
    Ok(())
}

/// Free a device allocation whose owner is dropping: the hot path (stream-ordered,
/// used on its own stream only) by reference, everything else as a [`FreeJob`].
#[inline]
pub(crate) fn release(
    ptr: CUdeviceptr,
    kind: Kind,
    ctx: &Arc<CudaContext>,
    made: Generation,
    uses: &mut Uses,
) {
    if kind == Kind::Device
        && !nccl_groups_open()
        && !uses.any_foreign.load(std::sync::atomic::Ordering::Acquire)
    {
        if let Some(own) = &uses.own {
            if free_on_own(ptr, ctx, made, own).is_ok() {
                return;
            }
        }
    }
    FreeJob {
        ptr,
        kind,
        ctx: Arc::clone(ctx),
        made,
        uses: std::mem::replace(uses, Uses::new(None)),
    }
    .release();
}

/// [`free_nccl`] on a helper thread (it waits for the device's work, which a
/// collective whose peer died never ends), waited for at most `bound`; past
/// it the helper finishes alone (one line on stderr says so), so a Drop never
/// blocks for ever.
#[cfg(feature = "nccl")]
fn free_nccl_bounded(
    ctx: &Arc<CudaContext>,
    made: Generation,
    ptr: CUdeviceptr,
    bound: std::time::Duration,
    what: &str,
) {
    let (tx, rx) = std::sync::mpsc::channel();
    let helper_ctx = Arc::clone(ctx);
    let helper_what = what.to_owned();
    let spawned = std::thread::Builder::new()
        .name("metrale-nccl-free".to_owned())
        .spawn(move || {
            helper_ctx.release_with(made, format_args!("{helper_what}"), |d, failures| {
                free_nccl(d, ptr, failures);
            });
            let _ = tx.send(());
        });
    match spawned {
        Err(e) => report_line(format_args!(
            "{what}: leaked: no helper thread for its free could be started ({e}), and on \
             this thread its wait for the device's work could block without bound"
        )),
        Ok(_) => {
            if rx.recv_timeout(bound).is_err() {
                report_line(format_args!(
                    "{what}: its free waits for the device's work (cuCtxSynchronize before \
                     ncclMemFree), which had not finished after {bound:?} (its drop timeout); \
                     left to a helper thread that frees it when that work ends (a collective \
                     whose peer died never does: abort its communicator)"
                ));
            }
        }
    }
}

/// `ncclMemFree` of `ptr` (the context current) after the context's work.
#[cfg(feature = "nccl")]
fn free_nccl(
    d: &'static metrale_cuda_sys::Driver,
    ptr: CUdeviceptr,
    failures: &mut Vec<crate::error::CallError>,
) {
    // SAFETY: the context is current (release_with bound it); waits for its work.
    match unsafe { cu!(d, cuCtxSynchronize()) } {
        Ok(()) => {}
        Err(crate::error::CallError::Status { status, .. })
            if crate::lifetime::work_abandoned(status) => {}
        Err(e) => {
            failures.push(e);
            report_line(format_args!(
                "NCCL buffer {ptr:#x}: leaked, the work of its device could not be waited for"
            ));
            return;
        }
    }
    let lib = match metrale_cuda_sys::nccl::nccl() {
        Ok(lib) => lib,
        Err(e) => {
            report_line(format_args!("NCCL buffer {ptr:#x}: leaked: {e}"));
            return;
        }
    };
    let f = match lib.ncclMemFree() {
        Ok(f) => f,
        Err(m) => {
            report_line(format_args!("NCCL buffer {ptr:#x}: leaked: {m}"));
            return;
        }
    };
    // SAFETY: an ncclMemAlloc allocation handed over by its dropped owner,
    // freed once, after every use (the context's work was waited for above,
    // and the streams of other devices that used it before this).
    let status = unsafe { f(ptr as usize as *mut std::ffi::c_void) };
    if !status.is_success() {
        report_line(format_args!(
            "NCCL buffer {ptr:#x} on device: ncclMemFree failed: {status}; leaked"
        ));
    }
}

/// Free an NCCL buffer (`ncclMemAlloc`) whose owner is dropping, as
/// [`release`] frees the others.
#[cfg(feature = "nccl")]
pub(crate) fn release_nccl(
    ptr: CUdeviceptr,
    ctx: &Arc<CudaContext>,
    made: Generation,
    uses: &mut Uses,
    bound: std::time::Duration,
) {
    FreeJob {
        ptr,
        kind: Kind::Nccl(bound),
        ctx: Arc::clone(ctx),
        made,
        uses: std::mem::replace(uses, Uses::new(None)),
    }
    .release();
}

/// Whether freeing pinned host memory of `ctx` now could block for ever or is
/// refused: inside a host function (no driver call), on a thread that is
/// capturing (a context-wide wait is refused there), or while a GPU-side wait
/// on a mapped word is pending on the context (`cuMemFreeHost` waits for the
/// context's work, which such a wait never ends until the host writes).
#[inline]
pub(crate) fn host_free_must_wait(ctx: &CudaContext) -> bool {
    crate::lifetime::in_host_function()
        || crate::lifetime::capturing_on_this_thread()
        || ctx.pending_waits() > 0
}

/// Hand pinned host memory `ptr` of `ctx` (made in `made`) to the deferred
/// frees: freed by the next drain at which [`host_free_must_wait`] no longer
/// holds (a stream's or context's synchronize, `MappedWords::new`, a capture's
/// end), never leaked silently.
pub(crate) fn defer_host_free(
    ptr: *mut std::ffi::c_void,
    ctx: &Arc<CudaContext>,
    made: Generation,
) {
    lifetime::defer_until_drain(Box::new(FreeJob {
        ptr: ptr as usize as CUdeviceptr,
        kind: Kind::Host,
        ctx: Arc::clone(ctx),
        made,
        uses: Uses::new(None),
    }));
    // What made it wait may have ended between the check and the push (a
    // capture whose retry ran meanwhile): then free now, as a release does.
    if !host_free_must_wait(ctx) && !crate::lifetime::captures_in_progress() {
        lifetime::retry_deferred();
    }
}

/// Formats a closure's text only when written.
struct Lazy<'a, F: Fn() -> String>(&'a F);

impl<F: Fn() -> String> std::fmt::Display for Lazy<'_, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&(self.0)())
    }
}

impl lifetime::Deferred for FreeJob {
    fn retry(self: Box<Self>) -> Option<Box<dyn lifetime::Deferred>> {
        self.try_free()
            .map(|job| Box::new(job) as Box<dyn lifetime::Deferred>)
    }

    fn still_blocked(&self) -> bool {
        crate::lifetime::captures_in_progress() || nccl_groups_open()
    }

    fn describe(&self) -> String {
        self.what()
    }
}

/// How many frees are waiting for a capture or an NCCL group to end (for tests
/// and diagnostics).
pub fn deferred_frees() -> usize {
    crate::lifetime::deferred_count()
}
