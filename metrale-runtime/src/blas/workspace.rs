//! One workspace per stream, owned by metrale: the device memory cuBLASLt and
//! cuBLAS use as scratch during a GEMM.
//!
//! Invariants:
//! - A workspace belongs to one stream and is handed to no other: two GEMMs
//!   on two streams never share scratch memory (a race), and GEMMs of one
//!   stream run in order, so they share it safely.
//! - A workspace is made outside capture: on the stream's first eager GEMM,
//!   or by `BlasLt::prepare` / `Blas::prepare`. A GEMM on a stream being
//!   captured without one is refused (an allocation recorded into a capture
//!   is one leak per graph).
//! - The table holds a clone of each stream it has a workspace for, so a
//!   stream's handle is never confused with a later stream's at the same
//!   address; [`Workspaces::release`] gives one back.
//! - A graph that captured a GEMM holds that GEMM's workspace
//!   ([`keep_for_capture`]: a user object, or on drivers without them a host
//!   node) as long as the graph or an executable graph made from it lives;
//!   freeing a workspace (`cuMemFree`) waits for the work that uses it.
//! - A GEMM is recorded into a capture only after that capture's holder
//!   exists: the mark a GEMM trusts (`kept_for`) is stored only once the
//!   holder is in the capture's graph, and the holders are made one at a time
//!   (`keeping`), so a second thread on the same capturing stream waits for
//!   the first thread's holder instead of recording without one.
//! - The capture's graph is read and the holder retained into it inside one
//!   section of the stream: the capture's end waits for it, so the graph
//!   handle (valid only while the capture is in progress) is never used
//!   after its end; and the capture's id is noted
//!   (`lifetime::note_held_in_capture`), so the graph that ends it knows it
//!   holds something and its executables' replays are refused in captures.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::context::CudaContext;
use crate::error::{cu, Result};
use crate::memory::{note_use, DeviceBuffer};
use crate::stream::{CudaStream, Section};

use super::error::refused;

/// The scratch memory of one stream.
pub(crate) struct Workspace {
    buf: DeviceBuffer<u8>,
    /// The last capture (the driver's id) that holds this workspace, so each
    /// capture queues one holder, not one per GEMM; 0 for none. Stored only
    /// after the holder is in that capture's graph, under `keeping`.
    kept_for: AtomicU64,
    /// Held while a holder is made and marked: never taken inside a stream's
    /// section (making a holder takes one, and the capture-keep list).
    keeping: Mutex<()>,
}

impl Workspace {
    /// Its device address, as the libraries take it.
    pub(crate) fn ptr(&self) -> *mut c_void {
        self.buf.device_ptr() as usize as *mut c_void
    }

    /// Its size in bytes.
    pub(crate) fn size(&self) -> usize {
        self.buf.len()
    }

    /// Note a use on `stream`, as every operand gets (a workspace is plain
    /// memory of the stream's own device, so this records nothing today and
    /// takes no other stream's section; it keeps the one rule uniform).
    pub(crate) fn note_use(&self, stream: &CudaStream) -> Result<()> {
        note_use(&self.buf, stream)
    }
}

/// The workspaces of one handle, one per stream.
pub(crate) struct Workspaces {
    bytes: usize,
    list: Mutex<Vec<(CudaStream, Arc<Workspace>)>>,
}

impl Workspaces {
    /// Workspaces of `bytes` bytes each.
    pub(crate) fn new(bytes: usize) -> Workspaces {
        Workspaces {
            bytes,
            list: Mutex::new(Vec::new()),
        }
    }

    /// The size of each workspace.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// The workspace of `stream`, if one was made.
    #[inline]
    pub(crate) fn get(&self, stream: &CudaStream) -> Option<Arc<Workspace>> {
        let list = self.list.lock().unwrap_or_else(PoisonError::into_inner);
        list.iter()
            .find(|(s, _)| s.same_stream(stream))
            .map(|(_, w)| Arc::clone(w))
    }

    /// The workspace of `stream`, made now (in `ctx`) when it has none.
    /// Not for a stream being captured (the caller checks).
    pub(crate) fn get_or_make(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
    ) -> Result<Arc<Workspace>> {
        if let Some(w) = self.get(stream) {
            return Ok(w);
        }
        // Allocated outside the lock (cuMemAlloc may take a while); a racing
        // call for the same stream keeps the first one listed.
        let made = Arc::new(Workspace {
            buf: DeviceBuffer::<u8>::alloc(ctx, self.bytes.max(1))?,
            kept_for: AtomicU64::new(0),
            keeping: Mutex::new(()),
        });
        let mut list = self.list.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, w)) = list.iter().find(|(s, _)| s.same_stream(stream)) {
            return Ok(Arc::clone(w));
        }
        list.push((stream.clone(), Arc::clone(&made)));
        Ok(made)
    }

    /// Forget `stream`'s workspace (freed once no graph holds it); whether it
    /// had one.
    pub(crate) fn release(&self, stream: &CudaStream) -> bool {
        let taken = {
            let mut list = self.list.lock().unwrap_or_else(PoisonError::into_inner);
            let at = list.iter().position(|(s, _)| s.same_stream(stream));
            at.map(|i| list.swap_remove(i))
        };
        // Dropped outside the lock: freeing calls the driver.
        taken.is_some()
    }

    /// How many streams have a workspace.
    pub(crate) fn count(&self) -> usize {
        self.list
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Workspaces {
    /// Make `stream`'s workspace (in `ctx`), refusing another device's stream
    /// and a stream being captured.
    pub(crate) fn prepare(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        library: &str,
    ) -> Result<Arc<Workspace>> {
        let call = "cublasSetWorkspace_v2";
        if !stream.context().same(ctx) {
            return Err(refused(
                call,
                format!("device {} {library} handle", ctx.ordinal()),
                format!(
                    "the stream is of device {}, the handle of device {}",
                    stream.ordinal(),
                    ctx.ordinal()
                ),
            ));
        }
        let section = stream.section();
        let capturing = stream
            .capturing_now(&section)
            .map_err(|e| e.about(stream.subject("capture status")))?;
        if capturing {
            return Err(refused(
                call,
                stream.subject(""),
                "the stream is being captured: its workspace must be made before the capture \
                 begins (prepare the stream, or run one GEMM on it eagerly, first)",
            ));
        }
        drop(section);
        self.get_or_make(ctx, stream)
    }

    /// The workspace a GEMM `call` on `stream` uses, and the section of the
    /// stream to make the call in (so no capture begins between this answer
    /// and the call): outside capture the stream's workspace, made now if
    /// need be; in a capture the stream's existing workspace, held by the
    /// capture's graph, or a refusal when there is none.
    pub(crate) fn for_call<'s>(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &'s CudaStream,
        call: &'static str,
        subject: impl Fn() -> String,
    ) -> Result<(Section<'s>, Arc<Workspace>)> {
        // At most a few rounds: a round that queued the capture's holder
        // looks again (the capture may have ended or changed meanwhile).
        for _ in 0..3 {
            let section = stream.section();
            let capturing = stream
                .capturing_now(&section)
                .map_err(|e| e.about(stream.subject("capture status")))?;
            if !capturing {
                let w = self.get_or_make(ctx, stream)?;
                w.note_use(stream)?;
                return Ok((section, w));
            }
            let id = stream
                .capture_id_raw()
                .map_err(|e| e.about(stream.subject("capture id")))?;
            let Some(w) = self.get(stream) else {
                return Err(refused(
                    call,
                    subject(),
                    format!(
                        "{} is being captured and has no workspace of this handle yet: make it \
                         before the capture (prepare the stream, or run one GEMM on it eagerly)",
                        stream.subject("")
                    ),
                ));
            };
            match id {
                Some(id) if w.kept_for.load(Ordering::Acquire) != id => {
                    // Queued outside the section: it takes one of its own.
                    // The mark is stored only once the holder is in the
                    // graph, so a GEMM that sees it is held; this round looks
                    // again.
                    drop(section);
                    keep_for_capture(stream, &w, id)?;
                }
                _ => {
                    w.note_use(stream)?;
                    return Ok((section, w));
                }
            }
        }
        Err(refused(
            call,
            subject(),
            format!(
                "{}: its capture kept changing while its workspace was being attached",
                stream.subject("")
            ),
        ))
    }
}

/// Make the graph that `stream`'s capture `capture` (the driver's id) is
/// recording hold `workspace`, once per capture: the graph and every
/// executable graph made from it then keep the memory alive.
///
/// This is the room's one use of a keep-alive mechanism. With a driver that
/// has user objects (CUDA 11.3+), a user object owning a clone of the
/// workspace is moved into the capture's graph (`cuGraphRetainUserObject`):
/// no node is added, and the graph's executables hold it too. Its destructor
/// runs on a thread of the driver's, where the driver may not be called, so
/// it hands the clone to the drop-later list (emptied at the next
/// synchronisation). Without user objects, a repeatable host function
/// holding a clone is captured instead ([`CudaStream::launch_host_fn_repeat`]:
/// a host node that the graph holds).
pub(crate) fn keep_for_capture(
    stream: &CudaStream,
    workspace: &Arc<Workspace>,
    capture: u64,
) -> Result<()> {
    // One holder is made at a time: a second GEMM of the same capture waits
    // here for the first one's holder, then sees the mark.
    let _keeping: MutexGuard<'_, ()> = workspace
        .keeping
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if workspace.kept_for.load(Ordering::Acquire) == capture {
        return Ok(());
    }
    let held_for = match hold_by_user_object(stream, workspace)? {
        Some(held_for) => held_for,
        None => hold_by_host_function(stream, workspace)?,
    };
    // The mark says "this capture's graph holds it", so it is stored only now,
    // and only for the capture the holder went into (none: nothing to mark).
    if let Some(id) = held_for {
        workspace.kept_for.store(id, Ordering::Release);
    }
    Ok(())
}

/// Move a user object owning a clone of `workspace` into the graph `stream`
/// is capturing into (`CudaContext::hold_in_graph`), inside one section of
/// the stream (the graph handle lives only as long as the capture): `None` when the driver
/// has no user objects, else the capture (the driver's id) whose graph now
/// holds it (`Some(None)`: the stream was no longer capturing, nothing held).
fn hold_by_user_object(
    stream: &CudaStream,
    workspace: &Arc<Workspace>,
) -> Result<Option<Option<u64>>> {
    use metrale_cuda_sys::{CUgraph, CUstreamCaptureStatus};

    let ctx = stream.context();
    if !ctx.has_user_objects() {
        return Ok(None);
    }
    // The capture's graph handle is valid only while its capture is in
    // progress: one section of the stream from reading it through retaining
    // into it, so no end of this stream's capture (which waits for the
    // section) destroys it meanwhile. (Making the holder takes no section.)
    let _section = stream.section();
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut graph: CUgraph = std::ptr::null_mut();
    let mut id: std::ffi::c_ulonglong = 0;
    stream.call("capture graph", |d, s| {
        // SAFETY: writes the status, the id and the graph only; the other
        // outputs are optional (null).
        unsafe {
            cu!(
                d,
                cuStreamGetCaptureInfo_v3(
                    s,
                    &mut status,
                    &mut id,
                    &mut graph,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut()
                )
            )
        }
    })?;
    if graph.is_null() || status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
        // The capture ended (or was invalidated) meanwhile: nothing to hold.
        return Ok(Some(None));
    }
    let held = ctx.hold_in_graph(graph, Arc::clone(workspace), "a GEMM workspace")?;
    if held {
        // The graph that ends this capture learns of the hold (no node of it
        // names the workspace): its replays are refused in other captures.
        crate::lifetime::note_held_in_capture(id);
    }
    Ok(held.then_some(Some(id)))
}

/// Capture a repeatable host function owning a clone of `workspace` (for a
/// driver without user objects): the capture whose graph now holds it (`None`:
/// the stream was no longer capturing, and the function ran once instead).
fn hold_by_host_function(stream: &CudaStream, workspace: &Arc<Workspace>) -> Result<Option<u64>> {
    struct Hold(Option<Arc<Workspace>>);
    impl Drop for Hold {
        fn drop(&mut self) {
            if let Some(w) = self.0.take() {
                if crate::lifetime::in_host_function() {
                    crate::lifetime::drop_later(Box::new(w));
                }
            }
        }
    }
    let hold = Hold(Some(Arc::clone(workspace)));
    stream.launch_host_fn_repeat_in_capture(Arc::new(move || {
        let _ = &hold;
    }))
}
