//! Registered buffers and symmetric windows: [`Communicator::register`]
//! (`ncclCommRegister`) and [`Communicator::register_window`]
//! (`ncclCommWindowRegister`, NCCL 2.27), each giving a guard that borrows
//! both the communicator and the [`NcclBuffer`], and hands the buffer back to
//! collectives through itself.
//!
//! Invariants:
//! - A guard borrows its communicator (shared) and its buffer (exclusively),
//!   so neither can be dropped, nor the buffer used except through the guard,
//!   while it lives; the guard is device memory itself ([`DeviceMemory`],
//!   [`DeviceMemoryMut`], and `Deref` to the buffer), so collectives, copies
//!   and launches take it with the same length and device checks as the
//!   buffer.
//! - Registering and deregistering are refused while any capture begun
//!   through metrale is in progress in the process (metrale counts its
//!   captures process-wide, which covers every stream of the communicator's
//!   device): NCCL's registration allocates and synchronises, which a capture
//!   records or is invalidated by. A guard dropped during a capture is left
//!   registered, with a line on stderr, and NCCL releases it with the
//!   communicator; [`Registration::deregister`] and [`Window::deregister`]
//!   refuse it and hand the guard back instead.
//! - Registered bytes per communicator can be bounded
//!   ([`Communicator::set_registration_limit`]): past the bound a registration
//!   is refused before NCCL, with both numbers.
//! - A window is collective (NCCL waits for the other ranks at its
//!   registration and deregistration): every rank registers a window of the
//!   same size, in the same order relative to its other windows and
//!   collectives, and drops it in the same order. metrale keeps ranks in step
//!   where it can see them: it refuses windows inside a `group` (one thread
//!   cannot drive several ranks through a blocking collective), checks the
//!   NCCL version, the size, the device and (for a symmetric window) the
//!   4096-byte alignment before NCCL, and numbers each communicator's windows
//!   ([`Window::index`]) so ranks can compare what they made. Ranks in other
//!   threads and processes stay the user's duty.
//! - Deregistering (a guard's Drop or `deregister`) first waits, within the
//!   communicator's drop timeout, for the work the communicator queued (on
//!   every stream it used), so no queued collective loses its registration;
//!   it is refused inside a `group` (whose work is launched at its end).
//!   Past the bound the guard stays registered (NCCL releases it with the
//!   communicator). A window's deregistration then runs on a
//!   helper thread, bounded by the communicator's drop timeout: a peer that
//!   never deregisters makes the communicator count as aborted (aborted when
//!   the deregistration returns), so Drop never blocks forever.

use std::ffi::c_void;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Instant;

use metrale_cuda_sys::nccl::{self as raw, ncclComm_t, ncclResult_t, ncclWindow_t, Nccl};
use metrale_cuda_sys::{CUdeviceptr, LibraryMissingSymbol};

use crate::context::CudaContext;
use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut, DeviceRepr, Sealed, Uses};

use super::buffer::NcclBuffer;
use super::comm::Communicator;
use super::error::{missing, refused, require_version};
use super::state::in_group;
use super::teardown::{abort_raw, bound_deadline, on_helper, Handle, Helped, ABORT_GRACE};

/// The first NCCL with windows (`ncclCommWindowRegister`).
pub(super) const WINDOWS_SINCE: (u32, u32, u32) = (2, 27, 0);

/// How a window is registered (`winFlags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WindowFlags(i32);

impl WindowFlags {
    /// `NCCL_WIN_DEFAULT`: a registered window, not symmetric.
    pub const DEFAULT: WindowFlags = WindowFlags(raw::NCCL_WIN_DEFAULT as i32);
    /// `NCCL_WIN_COLL_SYMMETRIC`: the same offsets on every rank, so NCCL's
    /// symmetric kernels can be used (the fast path for small collectives).
    /// The buffer must be 4096-byte aligned (`ncclMemAlloc`'s are).
    pub const COLL_SYMMETRIC: WindowFlags = WindowFlags(raw::NCCL_WIN_COLL_SYMMETRIC as i32);

    /// The raw flags.
    pub const fn bits(self) -> i32 {
        self.0
    }

    /// Whether the window is symmetric.
    pub const fn is_symmetric(self) -> bool {
        self.0 & (raw::NCCL_WIN_COLL_SYMMETRIC as i32) != 0
    }
}

/// A buffer registered with a communicator (`ncclCommRegister`), until
/// dropped (`ncclCommDeregister`). It borrows both; use the buffer through it.
///
/// Neither the communicator nor the buffer can go first:
/// ```compile_fail
/// # use metrale_runtime::nccl::{Communicator, NcclBuffer};
/// # fn f(comm: Communicator, mut buf: NcclBuffer<f32>) {
/// let reg = comm.register(&mut buf).unwrap();
/// drop(comm); // borrowed by `reg`
/// drop(reg);
/// # }
/// ```
/// ```compile_fail
/// # use metrale_runtime::nccl::{Communicator, NcclBuffer};
/// # fn f(comm: Communicator, mut buf: NcclBuffer<f32>) {
/// let reg = comm.register(&mut buf).unwrap();
/// drop(buf); // borrowed by `reg`
/// drop(reg);
/// # }
/// ```
pub struct Registration<'c, 'b, T: DeviceRepr> {
    comm: &'c Communicator,
    buf: &'b mut NcclBuffer<T>,
    handle: *mut c_void,
    bytes: usize,
    /// Deregistered (or released with the communicator): Drop does nothing.
    done: bool,
}

/// A window of a buffer registered with a communicator
/// (`ncclCommWindowRegister`), until dropped (`ncclCommWindowDeregister`,
/// collective like the registration). It borrows both; use the buffer
/// through it.
///
/// ```compile_fail
/// # use metrale_runtime::nccl::{Communicator, NcclBuffer, WindowFlags};
/// # fn f(comm: Communicator, mut buf: NcclBuffer<f32>) {
/// let win = comm.register_window(&mut buf, WindowFlags::COLL_SYMMETRIC).unwrap();
/// drop(comm); // borrowed by `win`
/// drop(win);
/// # }
/// ```
pub struct Window<'c, 'b, T: DeviceRepr> {
    comm: &'c Communicator,
    buf: &'b mut NcclBuffer<T>,
    win: ncclWindow_t,
    bytes: usize,
    flags: WindowFlags,
    index: u64,
    /// Deregistered (or released with the communicator): Drop does nothing.
    done: bool,
}

impl Communicator {
    /// Bound the bytes registered at once through [`register`](Self::register)
    /// and [`register_window`](Self::register_window) (`None`: no bound, the
    /// default). Registered scratch that grows without end is refused, not
    /// left to exhaust NCCL's resources; the bound does not touch what is
    /// registered already.
    pub fn set_registration_limit(&self, bytes: Option<usize>) {
        self.ledger.limit.set(bytes);
    }

    /// Bytes registered now through live guards (buffers and windows).
    pub fn registered_bytes(&self) -> usize {
        self.ledger.registered.get()
    }

    /// Register `buf` with this communicator (`ncclCommRegister`), so NCCL's
    /// collectives on it skip their staging copies. Local to this rank. Use
    /// the buffer through the returned guard, which deregisters it when
    /// dropped.
    ///
    /// # Errors
    /// Refused before NCCL: a capture in progress (see the module's notes), an
    /// empty buffer or one on another device, a registration past the bound
    /// ([`set_registration_limit`](Self::set_registration_limit)), an aborted
    /// or revoked communicator, inside a host function; the missing symbol;
    /// NCCL's status.
    pub fn register<'c, 'b, T: DeviceRepr>(
        &'c self,
        buf: &'b mut NcclBuffer<T>,
    ) -> Result<Registration<'c, 'b, T>> {
        const CALL: &str = "ncclCommRegister";
        let bytes = self.registrable(CALL, buf)?;
        let handle = self.registered(CALL, buf, bytes, |lib, comm, p, out| {
            let f = lib.ncclCommRegister()?;
            // SAFETY: a live communicator (`enter` refused an aborted one);
            // the buffer is device memory of its device (checked), `bytes`
            // long, and stays allocated while the returned guard borrows it
            // (deregistered in its Drop, or freed by NCCL with the
            // communicator, which the guard also borrows); writes one handle.
            Ok(unsafe { f(comm, p, bytes, out) })
        })?;
        Ok(Registration {
            comm: self,
            buf,
            handle,
            bytes,
            done: false,
        })
    }

    /// Make `buf` a window of this communicator (`ncclCommWindowRegister`,
    /// NCCL 2.27 or newer); [`WindowFlags::COLL_SYMMETRIC`] makes it symmetric,
    /// for NCCL's fastest small collectives. **Collective**: every rank calls
    /// it with a buffer of the same size, in the same order relative to its
    /// other windows and collectives (see the module's notes for what metrale
    /// checks). Use the buffer through the returned guard, which deregisters
    /// the window when dropped (collectively too: drop windows in the same
    /// order on every rank).
    ///
    /// # Errors
    /// [`NcclError::Unsupported`](super::NcclError::Unsupported) naming both
    /// versions on an NCCL older than 2.27; refused before NCCL: inside a
    /// `group`, a capture in progress, an empty buffer or one on another
    /// device, a symmetric window of a buffer not 4096-byte aligned, a
    /// registration past the bound, an aborted or revoked communicator; the
    /// missing symbol; NCCL's status.
    pub fn register_window<'c, 'b, T: DeviceRepr>(
        &'c self,
        buf: &'b mut NcclBuffer<T>,
        flags: WindowFlags,
    ) -> Result<Window<'c, 'b, T>> {
        const CALL: &str = "ncclCommWindowRegister";
        require_version(self.lib(), CALL, WINDOWS_SINCE, Some(self.info()))?;
        if in_group() {
            return Err(refused(
                CALL,
                Some(self.info()),
                "a window is registered collectively, and NCCL makes it at the call: \
                 register windows outside `group`, one thread (or process) per rank",
            ));
        }
        let bytes = self.registrable(CALL, buf)?;
        let align = raw::NCCL_WIN_REQUIRED_ALIGNMENT as u64;
        if flags.is_symmetric() && !buf.device_ptr().is_multiple_of(align) {
            return Err(refused(
                CALL,
                Some(self.info()),
                format!(
                    "a symmetric window needs a buffer aligned to {align} bytes; {:#x} is not",
                    buf.device_ptr()
                ),
            ));
        }
        let win = self.registered(CALL, buf, bytes, |lib, comm, p, out| {
            let f = lib.ncclCommWindowRegister()?;
            // SAFETY: as in `register`: a live communicator, device memory of
            // its device (checked) of `bytes` bytes, kept allocated while the
            // returned guard borrows it; writes one window handle.
            Ok(unsafe { f(comm, p, bytes, out, flags.bits()) })
        })?;
        let index = self.ledger.windows_made.get();
        self.ledger.windows_made.set(index.wrapping_add(1));
        Ok(Window {
            comm: self,
            buf,
            win,
            bytes,
            flags,
            index,
            done: false,
        })
    }

    /// The handle `make` (the NCCL call, handed the library, the
    /// communicator, the buffer's address and where to write the handle) gives
    /// for `bytes` of `buf`, made in this communicator's turn, its outcome
    /// settled and the bytes counted.
    fn registered<T: DeviceRepr, X>(
        &self,
        call: &'static str,
        buf: &NcclBuffer<T>,
        bytes: usize,
        make: impl FnOnce(
            &Nccl,
            ncclComm_t,
            *mut c_void,
            &mut *mut X,
        ) -> std::result::Result<ncclResult_t, LibraryMissingSymbol>,
    ) -> Result<*mut X> {
        let mut handle: *mut X = std::ptr::null_mut();
        let status = {
            let _turn = self.turn();
            let p = buf.device_ptr() as usize as *mut c_void;
            make(self.lib(), self.raw_handle(), p, &mut handle)
                .map_err(|m| missing(m, Some(self.info())))?
        };
        self.finish(call, status)?;
        self.note_registered(bytes);
        Ok(handle)
    }

    /// The checks every registration makes; the buffer's bytes.
    fn registrable<T: DeviceRepr>(&self, call: &'static str, buf: &NcclBuffer<T>) -> Result<usize> {
        self.enter(call)?;
        self.refuse_revoked(call)?;
        refuse_in_capture(self, call, "registering")?;
        if !Arc::ptr_eq(buf.context(), self.context()) {
            return Err(refused(
                call,
                Some(self.info()),
                format!(
                    "the buffer is on device {}, the communicator on device {}",
                    buf.context().ordinal(),
                    self.device()
                ),
            ));
        }
        let bytes = buf.byte_len();
        if bytes == 0 {
            return Err(refused(
                call,
                Some(self.info()),
                "the buffer is empty (NCCL registers at least one byte)",
            ));
        }
        if let Some(limit) = self.ledger.limit.get() {
            let now = self.ledger.registered.get();
            if now.checked_add(bytes).is_none_or(|n| n > limit) {
                return Err(refused(
                    call,
                    Some(self.info()),
                    format!(
                        "registering {bytes} more bytes would pass the communicator's bound of \
                         {limit} registered bytes ({now} registered now); drop a registration \
                         or raise the bound (Communicator::set_registration_limit)"
                    ),
                ));
            }
        }
        Ok(bytes)
    }

    fn note_registered(&self, bytes: usize) {
        let l = &self.ledger;
        l.registered.set(l.registered.get().saturating_add(bytes));
        l.guards.set(l.guards.get().saturating_add(1));
    }

    fn note_deregistered(&self, bytes: usize) {
        let l = &self.ledger;
        l.registered.set(l.registered.get().saturating_sub(bytes));
        l.guards.set(l.guards.get().saturating_sub(1));
    }
}

/// Refuse `what` (registering, deregistering) during a capture begun through
/// metrale anywhere in the process.
fn refuse_in_capture(comm: &Communicator, call: &'static str, what: &str) -> Result<()> {
    if crate::stream::captures_in_progress() {
        return Err(refused(
            call,
            Some(comm.info()),
            format!(
                "{what} during a graph capture is refused: a capture is in progress in this \
                 process (metrale counts captures process-wide, which covers every stream of \
                 the communicator's device), and NCCL's registration allocates and \
                 synchronises, which the capture would record or be invalidated by; \
                 register before the capture, or after it"
            ),
        ));
    }
    Ok(())
}

/// Whether a guard of `comm` still needs NCCL to deregister it (`false`:
/// NCCL released it, or will, with the communicator); refused during a
/// capture, inside a host function.
fn must_deregister(comm: &Communicator, call: &'static str) -> Result<bool> {
    if comm.is_aborted() || !comm.usable_here() {
        return Ok(false);
    }
    comm.enter(call)?;
    refuse_in_capture(comm, call, "deregistering")?;
    if in_group() {
        return Err(refused(
            call,
            Some(comm.info()),
            "deregistering inside `group` is refused: the group's collectives, which may \
             use the buffer, are launched only at its end; deregister after the group",
        ));
    }
    wait_for_queued(comm, call)?;
    Ok(true)
}

/// Wait, within the communicator's drop timeout, for the work it queued on
/// every stream it used: NCCL must not lose a registration that queued work
/// still uses. Past the bound it is an error (and the guard stays
/// registered).
fn wait_for_queued(comm: &Communicator, call: &'static str) -> Result<()> {
    let streams: Vec<crate::stream::CudaStream> = match comm.streams.try_borrow() {
        Ok(s) => s.clone(),
        Err(_) => Vec::new(),
    };
    let start = Instant::now();
    let mut spins = 0u32;
    for s in &streams {
        while !s.query()? {
            if start.elapsed() >= comm.drop_timeout {
                return Err(refused(
                    call,
                    Some(comm.info()),
                    format!(
                        "work the communicator queued ({}) had not finished after {:?} (its drop \
                         timeout), and it may use the registered buffer",
                        comm.last_op.get(),
                        start.elapsed()
                    ),
                ));
            }
            super::teardown::backoff(&mut spins);
        }
    }
    Ok(())
}

impl<T: DeviceRepr> Registration<'_, '_, T> {
    /// The registered bytes.
    pub fn byte_len(&self) -> usize {
        self.bytes
    }

    /// NCCL's registration handle (valid while the guard lives).
    pub fn raw(&self) -> *mut c_void {
        self.handle
    }

    fn release(&mut self) -> Result<()> {
        const CALL: &str = "ncclCommDeregister";
        let comm = self.comm;
        if must_deregister(comm, CALL)? {
            let f = comm
                .lib()
                .ncclCommDeregister()
                .map_err(|m| missing(m, Some(comm.info())))?;
            let status = {
                let _turn = comm.turn();
                // SAFETY: a live communicator's own registration, deregistered
                // once (`done` is set below, and Drop checks it).
                unsafe { f(comm.raw_handle(), self.handle) }
            };
            comm.finish(CALL, status)?;
        }
        self.done = true;
        comm.note_deregistered(self.bytes);
        Ok(())
    }
}

impl<T: DeviceRepr> Window<'_, '_, T> {
    /// The window's bytes.
    pub fn byte_len(&self) -> usize {
        self.bytes
    }

    /// The flags it was registered with.
    pub fn flags(&self) -> WindowFlags {
        self.flags
    }

    /// Which window of its communicator this is (0 for the first): every rank
    /// that registers its windows in step gives each the same index.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// NCCL's window handle (valid while the guard lives).
    pub fn raw(&self) -> ncclWindow_t {
        self.win
    }

    fn release(&mut self) -> Result<()> {
        const CALL: &str = "ncclCommWindowDeregister";
        let comm = self.comm;
        if must_deregister(comm, CALL)? {
            let f = comm
                .lib()
                .ncclCommWindowDeregister()
                .map_err(|m| missing(m, Some(comm.info())))?;
            let (lib, handle, win) = (comm.lib(), Handle(comm.raw_handle()), WinHandle(self.win));
            let ctx: Arc<CudaContext> = Arc::clone(comm.context());
            let serial = comm.serial().cloned();
            let start = Instant::now();
            let deadline = bound_deadline(comm.drop_timeout);
            let wait_until = deadline.checked_add(ABORT_GRACE).unwrap_or(deadline);
            let job = move || {
                let (handle, win) = (handle, win);
                if let Err(e) = ctx.bind() {
                    return (Err(e), handle);
                }
                let _turn = serial
                    .as_ref()
                    .map(|m| m.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
                // SAFETY: the communicator's own window, deregistered once; the
                // communicator is live (checked before the hand-over) and its
                // owner makes no other NCCL call on it until this returns, or
                // (past the bound) never again: it is then marked aborted, and
                // `late` aborts it here.
                let status = unsafe { f(handle.0, win.0) };
                (Ok(status), handle)
            };
            let info = comm.info();
            let late = move |(_, handle): (Result<_>, Handle)| {
                abort_raw(lib, handle.0);
                crate::error::report_line(format_args!(
                    "NCCL communicator ({info}): its late window deregistration returned; \
                     the communicator was aborted"
                ));
            };
            match on_helper(wait_until, job, late) {
                Helped::Done((Ok(status), _)) => comm.finish(CALL, status)?,
                Helped::Done((Err(e), _)) => return Err(e),
                Helped::Running => {
                    // The helper still holds the handle: no other NCCL call
                    // may be made on it; it aborts it when it returns.
                    comm.aborted.set(true);
                    self.done = true;
                    comm.note_deregistered(self.bytes);
                    return Err(super::error::into_error(super::NcclError::Timeout {
                        pending: CALL.to_owned(),
                        waited: start.elapsed(),
                        comm: info,
                    }));
                }
                Helped::NotStarted(e) => {
                    return Err(refused(
                        CALL,
                        Some(info),
                        format!(
                            "no helper thread could be started ({e}), and on this thread the \
                             collective deregistration could block without bound"
                        ),
                    ))
                }
            }
        }
        self.done = true;
        comm.note_deregistered(self.bytes);
        Ok(())
    }
}

/// A window handle handed to the helper thread with its communicator.
struct WinHandle(ncclWindow_t);

// SAFETY: handed over only with its communicator (`Handle`), whose owner
// makes no NCCL call on either while the helper holds them.
unsafe impl Send for WinHandle {}

macro_rules! guard_memory {
    ($name:ident, $what:literal) => {
        impl<T: DeviceRepr> $name<'_, '_, T> {
            /// Deregister now (`ncclCommDeregister`; a window's collectively,
            /// `ncclCommWindowDeregister`), or get the guard back with the
            /// reason.
            ///
            /// # Errors
            /// The guard and why it is still registered: a capture in
            /// progress, inside a host function (refused before NCCL), or
            /// NCCL's status. A window's deregistration that did not return
            /// within the communicator's drop timeout (a peer that never
            /// deregisters) leaves the communicator aborted and the guard
            /// inert.
            #[allow(clippy::result_large_err)]
            pub fn deregister(mut self) -> std::result::Result<(), (Self, crate::MetraleError)> {
                match self.release() {
                    Ok(()) => Ok(()),
                    Err(e) => Err((self, e)),
                }
            }
        }

        impl<T: DeviceRepr> Drop for $name<'_, '_, T> {
            fn drop(&mut self) {
                if self.done {
                    return;
                }
                if let Err(e) = self.release() {
                    if !self.done {
                        let l = &self.comm.ledger;
                        l.guards.set(l.guards.get().saturating_sub(1));
                    }
                    crate::error::report_line(format_args!(
                        "NCCL {} of {} bytes (communicator {}): {e}; left to NCCL, which \
                         releases it with the communicator",
                        $what,
                        self.bytes,
                        self.comm.info()
                    ));
                }
            }
        }

        impl<T: DeviceRepr> Deref for $name<'_, '_, T> {
            type Target = NcclBuffer<T>;
            fn deref(&self) -> &NcclBuffer<T> {
                self.buf
            }
        }

        impl<T: DeviceRepr> DerefMut for $name<'_, '_, T> {
            fn deref_mut(&mut self) -> &mut NcclBuffer<T> {
                self.buf
            }
        }

        impl<T: DeviceRepr> Sealed for $name<'_, '_, T> {}
        impl<T: DeviceRepr> DeviceMemory<T> for $name<'_, '_, T> {
            fn device_ptr(&self) -> CUdeviceptr {
                self.buf.device_ptr()
            }
            fn len(&self) -> usize {
                self.buf.len()
            }
            fn memory_context(&self) -> &Arc<CudaContext> {
                self.buf.context()
            }
            fn uses(&self) -> Option<&Uses> {
                DeviceMemory::uses(&*self.buf)
            }
            fn describe(&self) -> String {
                format!("{} ({})", self.buf.describe(), stringify!($name))
            }
        }
        impl<T: DeviceRepr> DeviceMemoryMut<T> for $name<'_, '_, T> {}

        impl<T: DeviceRepr> fmt::Debug for $name<'_, '_, T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("comm", &self.comm.info())
                    .field("buffer", &self.buf)
                    .field("bytes", &self.bytes)
                    .finish_non_exhaustive()
            }
        }
    };
}
guard_memory!(Registration, "registration");
guard_memory!(Window, "window");
