//! [`Window`]: a buffer registered as a window of a communicator
//! (`ncclCommWindowRegister`, NCCL 2.27), symmetric with
//! [`WindowFlags::COLL_SYMMETRIC`]; collective at registration and
//! deregistration (see `register.rs` for the rules both guards keep, and how
//! ranks stay in step).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Instant;

use metrale_cuda_sys::nccl::{self as raw, ncclWindow_t};
use metrale_cuda_sys::CUdeviceptr;

use crate::context::CudaContext;
use crate::error::Result;
use crate::memory::{DeviceMemory, DeviceMemoryMut, DeviceRepr, Sealed, SealedMut, Uses};

use super::buffer::NcclBuffer;
use super::comm::Communicator;
use super::error::{missing, refused, require_version};
use super::register::{guard_memory, must_deregister};
use super::state::in_group;
use super::teardown::{abort_raw, bound_deadline, on_helper, Handle, Helped};

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
            // The drop timeout plus the grace, as an abort's.
            let wait_until = bound_deadline(comm.drop_timeout);
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

guard_memory!(Window, "window");
