//! Host functions: Rust closures the driver runs on a thread of its own once the
//! work queued before them on a stream has finished (`cuLaunchHostFunc`).
//!
//! Invariants:
//! - What the driver is handed owns the closure: a once-run closure of at most
//!   48 bytes (8-aligned) is moved into a free slot of a process-wide pool, and
//!   the driver gets the slot's tag (index and generation), not a pointer; a
//!   slot is claimed by one compare-exchange and taken by the one trampoline
//!   call that finds it full in the generation its tag names, which moves the
//!   closure out and frees the slot. A larger closure is a `Box` the trampoline
//!   takes back and frees (a box costs a `malloc` here and a `free` on the
//!   driver's thread, measured on the H200 at about a sixth of the raw call); a
//!   repeatable closure captured into a graph is held (an `Arc`) by the
//!   lifetime room's capture keeps, tagged with the driver's id of the capture it went into,
//!   until that capture's end (which releases only its own entries, after its
//!   graph took its holds), and then by the graph and its executable graphs,
//!   so every replay finds it alive.
//! - A once-run closure is refused on a stream marked for a metrale capture (a
//!   graph would replay it). A boxed one is queued inside a section, so no
//!   metrale capture begins before it is queued. A slot one is queued without a
//!   section (one load says the stream is not marked): a capture that begins in
//!   between may take the host function, and its replays then find the slot's
//!   generation taken or moved on, so the closure runs at most once, never on
//!   freed or foreign bytes.
//! - A panic never unwinds into the driver: it is caught, reported on stderr, and
//!   the stream goes on with the work after the host function.
//! - While a host function runs, the thread is marked: metrale calls from it are
//!   refused with [`ErrorKind::InHostFunction`](crate::ErrorKind::InHostFunction)
//!   instead of calling the driver (which forbids it and may deadlock).

use std::cell::{Cell, UnsafeCell};
use std::ffi::c_void;
use std::mem::{align_of, size_of, MaybeUninit};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::CudaStream;
use crate::error::{cu, invalid_arg, report_line, Result};
use crate::lifetime::{capture_keeps, release_capture_keeps, CaptureKeep, HostFunctionScope};

/// A host function that can run more than once: what
/// [`CudaStream::launch_host_fn_repeat`] takes, so that a graph replaying it can
/// hold it.
pub type HostFn = Arc<dyn Fn() + Send + Sync + 'static>;

/// A repeatable host function as a graph holds it (a thin pointer for the
/// driver's `userData`).
pub(crate) type HostKeep = Arc<HostFn>;

/// Host function panics caught in this process.
static PANICS: AtomicU64 = AtomicU64::new(0);

/// The repeatable host function queued into a capture with `user_data` as the
/// driver's argument, if metrale queued it (for the graph to hold).
pub(crate) fn take_captured_host_fn(user_data: *mut c_void) -> Option<HostKeep> {
    let held = capture_keeps();
    held.iter()
        .find(|c| Arc::as_ptr(&c.keep).cast::<c_void>() == user_data.cast_const())
        .and_then(|c| Arc::clone(&c.keep).downcast::<HostFn>().ok())
}

/// Capture `capture` has ended (and its graph, if any, took what it replays):
/// release the host functions queued into it, and only those.
pub(crate) fn release_captured_host_fns(capture: u64) {
    release_capture_keeps(|c| c.capture == Some(capture));
}

/// A capture has ended and its graph took its holds (`graph`: the addresses
/// of the keepers it holds, however held): release the host functions tagged
/// with its id `capture` (when known) and those the graph holds, whatever
/// their tag (a keep goes into one capture only).
pub(crate) fn release_captured_host_fns_of(capture: Option<u64>, graph: &[usize]) {
    release_capture_keeps(|c| {
        (capture.is_some() && c.capture == capture)
            || graph
                .iter()
                .any(|&k| k == Arc::as_ptr(&c.keep).cast::<()>() as usize)
    });
}

/// Run `f` as a host function: the thread marked, a panic caught and reported.
pub(crate) fn run_guarded(f: impl FnOnce()) {
    let _scope = HostFunctionScope::enter();
    if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
        PANICS.fetch_add(1, Ordering::Relaxed);
        let text = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a non-string payload".to_owned());
        report_line(format_args!(
            "a host function panicked ({text}); the panic was caught (it cannot unwind \
             into the driver) and the stream goes on"
        ));
        // Dropping the payload may panic in turn.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(payload)));
    }
}

/// Bytes of a pool slot: closures up to this size (and 8-aligned) take no box.
const SLOT_BYTES: usize = 48;
/// Slots in the pool; when the few tried are all in flight, the closure is boxed.
const SLOTS: usize = 1024;

/// One place for a small closure on its way to the driver's thread.
#[repr(C, align(64))]
struct Slot {
    /// `generation << 2 | state` (`FREE`, `FULL`, `TAKING`): claimed by a
    /// compare-exchange from `FREE` to `FULL` with the next generation, taken by
    /// the one trampoline call that finds `FULL` with the generation its tag
    /// names (a compare-exchange to `TAKING`), freed after the closure is moved
    /// out (or by the submitter when the driver refused the call).
    state: AtomicU64,
    bytes: UnsafeCell<MaybeUninit<[u64; SLOT_BYTES / 8]>>,
}

const FREE: u64 = 0;
const FULL: u64 = 1;
const TAKING: u64 = 2;
/// Bits of the driver's argument naming the slot (`SLOTS` is 2^10).
const INDEX_BITS: u32 = 10;
/// The generation bits the driver's argument carries beside the index.
const TAG_GEN_MASK: u64 = (1 << (usize::BITS - INDEX_BITS)) - 1;

// SAFETY: `bytes` is written only by the thread whose compare-exchange claimed
// the slot (`FREE` to `FULL`), and read only by the one party whose
// compare-exchange took it (`FULL` to `TAKING`, same generation): a trampoline
// call (the driver orders the submit before it) or the claiming thread after a
// refusal; the slot is freed (`Release`) after that read and claimed again
// (`Acquire`) before the next write.
unsafe impl Sync for Slot {}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_SLOT: Slot = Slot {
    state: AtomicU64::new(FREE),
    bytes: UnsafeCell::new(MaybeUninit::uninit()),
};
static POOL: [Slot; SLOTS] = [FREE_SLOT; SLOTS];
/// Where a thread that has not claimed a slot yet starts looking (threads start
/// 64 slots apart).
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Where this thread's next claim starts looking (`usize::MAX`: not yet
    /// placed): a thread-local cursor keeps the claim at one compare-exchange,
    /// with no shared counter to bounce between submitting threads.
    static CURSOR: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// Whether closures of type `F` travel in a pool slot (a zero-sized one too:
/// the slot's tag is what keeps it to one run).
const fn fits_slot<F>() -> bool {
    // Only where the tag keeps 54 bits of generation (a 64-bit `usize`): with
    // fewer, a stale tag held by a graph could meet its generation again.
    usize::BITS == 64 && size_of::<F>() <= SLOT_BYTES && align_of::<F>() <= 8
}

/// A claimed slot: the slot, its state as claimed, and the driver's argument
/// naming it (index and generation).
struct Claimed {
    slot: &'static Slot,
    state: u64,
    tag: usize,
}

/// Claim a free slot (four tries from this thread's cursor), or `None`.
#[inline]
fn claim_slot() -> Option<Claimed> {
    let start = CURSOR
        .try_with(|c| {
            let mut at = c.get();
            if at == usize::MAX {
                at = NEXT_SLOT.fetch_add(64, Ordering::Relaxed);
            }
            c.set(at.wrapping_add(1));
            at
        })
        .ok()?;
    (0..4).find_map(|k| {
        let index = start.wrapping_add(k) % SLOTS;
        let slot = POOL.get(index)?;
        let now = slot.state.load(Ordering::Relaxed);
        if now & 3 != FREE {
            return None;
        }
        let state = ((now >> 2).wrapping_add(1) << 2) | FULL;
        slot.state
            .compare_exchange(now, state, Ordering::Acquire, Ordering::Relaxed)
            .ok()?;
        let tag = (((state >> 2) & TAG_GEN_MASK) as usize) << INDEX_BITS | index;
        Some(Claimed { slot, state, tag })
    })
}

/// The driver's entry for a once-run closure `F` in a pool slot; `data` is the
/// slot's tag, not a pointer. A call whose tag no longer names a full slot of
/// its generation (a graph that captured the host function, replayed again or
/// after the slot was reused) does nothing: the closure runs at most once.
unsafe extern "C" fn run_slot<F: FnOnce() + Send + 'static>(data: *mut c_void) {
    let tag = data.addr();
    let Some(slot) = POOL.get(tag & (SLOTS - 1)) else {
        return;
    };
    let now = slot.state.load(Ordering::Acquire);
    if now & 3 != FULL || (now >> 2) & TAG_GEN_MASK != (tag >> INDEX_BITS) as u64 {
        return;
    }
    if slot
        .state
        .compare_exchange(
            now,
            (now & !3) | TAKING,
            Ordering::Acquire,
            Ordering::Relaxed,
        )
        .is_err()
    {
        return;
    }
    // SAFETY: this call took the slot (`FULL` to `TAKING` in the generation its
    // tag names), so it holds the `F` the submitter wrote under that claim (the
    // function is instantiated for that `F`); it is moved out before the slot is
    // freed, and no other call can take it.
    let f = unsafe { std::ptr::read(slot.bytes.get().cast::<F>()) };
    slot.state.store(now & !3, Ordering::Release);
    run_guarded(f);
}

/// The driver's entry for a once-run closure `F`.
unsafe extern "C" fn run_once<F: FnOnce() + Send + 'static>(data: *mut c_void) {
    // SAFETY: `data` is the `Box<F>` `launch_host_fn` leaked for this one call; it
    // was queued outside any capture, so the driver calls this exactly once.
    let f = unsafe { Box::from_raw(data.cast::<F>()) };
    // The closure's captures are dropped inside the guard too.
    run_guarded(*f);
}

/// The driver's entry for a repeatable closure held by a graph.
unsafe extern "C" fn run_held(data: *mut c_void) {
    // SAFETY: `data` is `Arc::as_ptr` of a `HostKeep` that the capture list
    // holds, tagged with the capture it was queued into, until that capture
    // has ended and its graph took its own hold (or for the life of the
    // process, when the capture may have ended before the call was queued);
    // then the graph and every executable graph made from it hold it, and each
    // replay in flight (see `CudaGraphExec::launch`).
    let f = unsafe { &*data.cast_const().cast::<HostFn>() };
    run_guarded(|| f());
}

/// Host function panics caught so far in this process (each is also reported on
/// stderr).
pub fn host_function_panics() -> u64 {
    PANICS.load(Ordering::Relaxed)
}

impl CudaStream {
    /// Queue `f` to run on a driver thread once the work queued on this stream so
    /// far has finished; work queued after it waits for it (`cuLaunchHostFunc`).
    ///
    /// **The driver forbids CUDA calls inside a host function** (they may
    /// deadlock): while `f` runs, every metrale call on that thread returns
    /// [`ErrorKind::InHostFunction`](crate::ErrorKind::InHostFunction) without
    /// calling the driver, and a metrale handle dropped there is leaked with a
    /// line on stderr rather than freed. Do the work `f` unblocks elsewhere (send
    /// on a channel, wake a future). Host functions of one stream run in order;
    /// those of different streams in no given order, possibly on one thread, so
    /// keep them short and never block on other GPU work.
    ///
    /// A panic in `f` is caught (it cannot unwind into the driver), reported on
    /// stderr and counted ([`host_function_panics`]); the stream goes on with the
    /// work after it. After an error of the context (a faulting kernel) the
    /// driver no longer calls host functions; `f` is then never run nor freed.
    ///
    /// A capture that another thread begins on this stream while the call is
    /// being made may take the host function: it then runs at most once, on
    /// that graph's first replay, or never (and is never freed) if the graph is
    /// not replayed.
    ///
    /// # Errors
    /// `InvalidArgument` while the stream is being captured through metrale (a
    /// graph would run a once-only closure on every replay: use
    /// [`CudaStream::launch_host_fn_repeat`]); `cuLaunchHostFunc`'s status (then
    /// `f` is dropped here).
    pub fn launch_host_fn<F: FnOnce() + Send + 'static>(&self, f: F) -> Result<()> {
        let f = if self.marked_for_capture() {
            f
        } else {
            // Not marked: no metrale capture is in progress on this stream, so
            // no section is taken. One that begins concurrently may take the
            // host function; the slot's generation tag then lets its replays
            // run the closure at most once.
            match self.launch_in_slot(f) {
                Ok(Ok(())) => return Ok(()),
                Ok(Err((e, f))) => {
                    drop(f);
                    return Err(e);
                }
                Err(f) => f,
            }
        };
        let section = self.section();
        match self.capturing_now(&section) {
            Ok(false) => {}
            Ok(true) => {
                return Err(invalid_arg(format!(
                    "{}: launch_host_fn while the stream is being captured: every replay \
                     of the graph would run the once-only closure; use \
                     launch_host_fn_repeat",
                    self.subject("")
                )))
            }
            Err(e) => return Err(e.about(self.subject("capture status"))),
        }
        let queued = self.launch_host_fn_in(&section, f);
        drop(section);
        // `f` drops after the section: its captures may queue stream work.
        queued.map_err(|(e, f)| {
            drop(f);
            e
        })
    }

    /// Queue a once-run host function inside `section`, whose caller found the
    /// stream not capturing (so the driver calls it exactly once). On failure `f`
    /// is handed back, not dropped, so the caller decides (a holder of memory
    /// that queued work may still touch must be leaked, not freed); `None` when
    /// a driver that reported an error ran it anyway.
    pub(crate) fn launch_host_fn_in<F: FnOnce() + Send + 'static>(
        &self,
        _section: &super::Section<'_>,
        f: F,
    ) -> std::result::Result<(), (crate::MetraleError, Option<F>)> {
        let f = match self.launch_in_slot(f) {
            Ok(queued) => return queued,
            Err(f) => f,
        };
        let data = Box::into_raw(Box::new(f)).cast::<c_void>();
        let queued = self.call_unbound("launching a host function", |d, s| {
            // SAFETY: `run_once::<F>` takes back the box `data` points to, once:
            // the caller's section saw no capture, and none begins before it ends.
            unsafe { cu!(d, cuLaunchHostFunc(s, Some(run_once::<F>), data)) }
        });
        match queued {
            Ok(()) => Ok(()),
            // SAFETY: the driver refused every attempt, so it never received `data`.
            Err(e) => Err((e, Some(*unsafe { Box::from_raw(data.cast::<F>()) }))),
        }
    }

    /// Queue `f` in a pool slot: `Err(f)` when `F` does not fit or no slot is
    /// free; otherwise the driver's answer, with `f` handed back when it refused
    /// (`None` should a driver have run the host function anyway).
    #[inline]
    #[allow(clippy::type_complexity)]
    fn launch_in_slot<F: FnOnce() + Send + 'static>(
        &self,
        f: F,
    ) -> std::result::Result<std::result::Result<(), (crate::MetraleError, Option<F>)>, F> {
        if !fits_slot::<F>() {
            return Err(f);
        }
        let Some(Claimed { slot, state, tag }) = claim_slot() else {
            return Err(f);
        };
        let bytes = slot.bytes.get().cast::<F>();
        // SAFETY: the slot is ours (claimed above) and holds `SLOT_BYTES` bytes,
        // 8-aligned: `F` fits (size and alignment checked).
        unsafe { bytes.write(f) };
        let data = std::ptr::without_provenance_mut::<c_void>(tag);
        let queued = self.call_unbound("launching a host function", |d, s| {
            // SAFETY: `run_slot::<F>` moves the `F` out of the slot its tag
            // names, at most once whatever the driver does with the call (a
            // capture replaying it finds the generation taken or moved on).
            unsafe { cu!(d, cuLaunchHostFunc(s, Some(run_slot::<F>), data)) }
        });
        Ok(match queued {
            Ok(()) => Ok(()),
            Err(e) => {
                // Take the slot back as a trampoline would (full to taking, this
                // generation): should a driver have queued the call anyway, the
                // closure is then read once, here or there, never twice; the slot
                // is freed only after the read.
                if slot
                    .state
                    .compare_exchange(
                        state,
                        (state & !3) | TAKING,
                        Ordering::Acquire,
                        Ordering::Relaxed,
                    )
                    .is_err()
                {
                    return Ok(Err((e, None)));
                }
                // SAFETY: this exchange took the slot (full to taking, in this
                // claim's generation), so no trampoline took it and no claim can
                // reuse it before it is freed below: the `F` written above is
                // still there, ours.
                let f = unsafe { bytes.read() };
                slot.state.store(state & !3, Ordering::Release);
                Err((e, Some(f)))
            }
        })
    }

    /// Queue a host function that may run more than once: as
    /// [`CudaStream::launch_host_fn`], and also inside a capture, where it becomes
    /// a host node of the graph that every replay runs. The graph and every
    /// executable graph made from it hold `f` (and a replay in flight holds it
    /// until it has run), so `f` lives as long as anything may run it.
    ///
    /// # Errors
    /// As [`CudaStream::launch_host_fn`], less the refusal in a capture.
    pub fn launch_host_fn_repeat(&self, f: HostFn) -> Result<()> {
        self.launch_host_fn_repeat_in_capture(f).map(|_| ())
    }

    /// [`CudaStream::launch_host_fn_repeat`], saying which capture (the
    /// driver's id) recorded the host function into its graph: `None` when the
    /// stream was not capturing, or the capture ended while it was queued.
    pub(crate) fn launch_host_fn_repeat_in_capture(&self, f: HostFn) -> Result<Option<u64>> {
        let section = self.section();
        let capture = if section.may_capture {
            self.capture_id_raw()
                .map_err(|e| e.about(self.subject("capture status")))?
        } else {
            None
        };
        let Some(capture) = capture else {
            // Not capturing: queued once, inside this section, so no capture
            // begins between the answer and the driver's call (a capture's
            // start waits for the section), and no graph can take a run-once
            // closure from this repeatable one.
            let queued = self.launch_host_fn_in(&section, move || f());
            drop(section);
            // A refused closure drops after the section: its captures may
            // queue stream work.
            return queued.map(|()| None).map_err(|(e, f)| {
                drop(f);
                e
            });
        };
        let keep: HostKeep = Arc::new(f);
        let data = Arc::as_ptr(&keep).cast_mut().cast::<c_void>();
        // The push, the call and the check after it happen under the list's
        // lock, which a capture's end takes to release what it took: no end
        // releases this entry in between.
        let mut held = capture_keeps();
        held.push(CaptureKeep {
            capture: Some(capture),
            keep,
        });
        // SAFETY: `run_held` borrows `data`, held by the capture list from now on
        // (for the life of the process if the capture ended meanwhile, below).
        let queued = self.call_unbound("capturing a host function", |d, s| unsafe {
            cu!(d, cuLaunchHostFunc(s, Some(run_held), data))
        });
        if queued.is_err() {
            // The driver refused it, so it never received `data`.
            let refused = held.pop();
            drop(held);
            drop(refused);
            return queued.map(|()| None);
        }
        // A capture may end between the check above and the call (another
        // thread ending the capture this stream joined): the host function may
        // then run on the stream instead of in a graph, after the end released
        // its capture's entries. Unless the stream is still in that capture,
        // keep the entry for the life of the process (a small leak, never a
        // dangling host function).
        let for_good = self.capture_id_raw().ok().flatten() != Some(capture);
        if for_good {
            if let Some(last) = held.last_mut() {
                last.capture = None;
            }
        }
        drop(held);
        drop(section);
        if for_good {
            // A leak is never silent.
            report_line(format_args!(
                "{}: the capture this repeatable host function was queued into ended \
                 while it was being queued (it may run on the stream instead of in a \
                 graph): it stays held for the life of the process",
                self.subject("launch_host_fn_repeat")
            ));
        }
        queued.map(|()| (!for_good).then_some(capture))
    }
}
