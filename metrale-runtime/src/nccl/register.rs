//! Registered buffers and symmetric windows: [`Communicator::register`]
//! (`ncclCommRegister`, here) and [`Communicator::register_window`]
//! (`ncclCommWindowRegister`, NCCL 2.27: `window.rs`), each giving a guard
//! that borrows both the communicator and the [`NcclBuffer`], and hands the
//! buffer back to collectives through itself; the checks, the accounting and
//! the guard side they share are here.
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
//!   communicator; [`Registration::deregister`] and [`Window::deregister`](super::Window::deregister)
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
//!   ([`Window::index`](super::Window::index)) so ranks can compare what they made. Ranks in other
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

use metrale_cuda_sys::nccl::{ncclComm_t, ncclResult_t, Nccl};
use metrale_cuda_sys::{CUdeviceptr, LibraryMissingSymbol};

use crate::context::CudaContext;
use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut, DeviceRepr, Sealed, SealedMut, Uses};

use super::buffer::NcclBuffer;
use super::comm::Communicator;
use super::error::{missing, refused};
use super::state::in_group;

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

    /// The handle `make` (the NCCL call, handed the library, the
    /// communicator, the buffer's address and where to write the handle) gives
    /// for `bytes` of `buf`, made in this communicator's turn, its outcome
    /// settled and the bytes counted.
    pub(super) fn registered<T: DeviceRepr, X>(
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
    pub(super) fn registrable<T: DeviceRepr>(
        &self,
        call: &'static str,
        buf: &NcclBuffer<T>,
    ) -> Result<usize> {
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

    pub(super) fn note_registered(&self, bytes: usize) {
        let l = &self.ledger;
        l.registered.set(l.registered.get().saturating_add(bytes));
        l.guards.set(l.guards.get().saturating_add(1));
    }

    pub(super) fn note_deregistered(&self, bytes: usize) {
        let l = &self.ledger;
        l.registered.set(l.registered.get().saturating_sub(bytes));
        l.guards.set(l.guards.get().saturating_sub(1));
    }
}

/// Refuse `what` (registering, deregistering) during a capture begun through
/// metrale anywhere in the process.
fn refuse_in_capture(comm: &Communicator, call: &'static str, what: &str) -> Result<()> {
    if crate::lifetime::captures_in_progress() {
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
pub(super) fn must_deregister(comm: &Communicator, call: &'static str) -> Result<bool> {
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
        loop {
            // Asked inside a section of the stream: no capture begins on it
            // between the check and the query, so the query never lands in
            // another thread's capture (which it would invalidate).
            let section = s.section();
            let capturing = s
                .capturing_now(&section)
                .map_err(|e| e.about(s.subject("capture status")))?;
            if capturing {
                return Err(refused(
                    call,
                    Some(comm.info()),
                    format!(
                        "{} is being captured (by another thread, which began after this \
                         deregistration's capture check): whether the communicator's work on it \
                         passed cannot be asked without ending that capture; deregister after it",
                        s.subject("")
                    ),
                ));
            }
            let idle = s.query()?;
            drop(section);
            if idle {
                break;
            }
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

/// The guard side shared by [`Registration`] and [`Window`](super::Window): `deregister`,
/// Drop, `Deref` to the buffer, and device memory through the guard.
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

        impl<T: DeviceRepr> Sealed for $name<'_, '_, T> {
            fn address_ref(&self) -> &CUdeviceptr {
                Sealed::address_ref(&*self.buf)
            }
        }
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
        impl<T: DeviceRepr> SealedMut for $name<'_, '_, T> {}
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
pub(super) use guard_memory;
