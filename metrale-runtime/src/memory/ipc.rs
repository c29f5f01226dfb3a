//! Sharing device memory between processes (Linux): physical memory exported as a
//! POSIX file descriptor and imported in another process, and the descriptor
//! passed over a Unix socket (`SCM_RIGHTS`).
//!
//! Who frees what, and when:
//! - Each process owns its own [`PhysicalMemory`] handle: the exporter's and the
//!   importer's are released independently (`cuMemRelease`); the memory lives
//!   until the last handle is released and the last mapping, in any process, is
//!   unmapped. Neither process can free it under the other.
//! - A descriptor from [`PhysicalMemory::export_fd`] is an [`OwnedFd`], made
//!   close-on-exec (as received ones are): closing it
//!   (dropping it) after it was sent or imported is right, and does not free the
//!   memory. The receiver owns what [`recv_fd`] gives it.
//! - The contents are shared: order the two processes' accesses yourself (wait
//!   for your stream before you tell the other side over the socket).
//!
//! Invariants: the descriptor passing is `std` plus `libc::sendmsg` /
//! `libc::recvmsg` (std's `UnixStream` has no stable descriptor passing); every
//! descriptor received is owned at once (extra ones are closed), received
//! descriptors are close-on-exec, and a truncated control message is an error.

use std::ffi::{c_int, c_void};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use metrale_cuda_sys::{
    CUmemAllocationHandleType, CUmemAllocationProp, CUmemGenericAllocationHandle,
    CUmemLocationType, CUresult,
};

use super::vmm::{granularity, HandleTypes, PhysicalMemory};
use crate::context::AsContext;
use crate::error::{cu, invalid_arg, ErrorKind, MetraleError, Result};

/// Own the descriptor `fd` the driver exported for the caller, made close-on-exec
/// (`FD_CLOEXEC`): the driver does not set the flag, and a descriptor inherited
/// across a fork and exec would keep the memory alive and mappable in a program
/// that never asked for it. On an error the descriptor is closed. The driver
/// takes no flag for this, so a fork and exec on another thread between its
/// export and this call (a few instructions) can still pass it on.
pub(super) fn own_exported(fd: c_int, what: impl FnOnce() -> String) -> Result<OwnedFd> {
    if fd < 0 {
        return Err(invalid_arg(format!(
            "{}: the driver exported the descriptor {fd}",
            what()
        )));
    }
    // SAFETY: the driver made a new descriptor for the caller; nothing else
    // owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fcntl with F_GETFD / F_SETFD reads and writes only the flags of a
    // descriptor that is open (owned above) for both calls.
    let set = unsafe {
        let flags = libc::fcntl(owned.as_raw_fd(), libc::F_GETFD);
        flags >= 0 && libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, flags | libc::FD_CLOEXEC) == 0
    };
    if !set {
        let e = io::Error::last_os_error();
        return Err(os_error(
            format!("{}: making descriptor {fd} close-on-exec (fcntl)", what()),
            e,
        ));
    }
    Ok(owned)
}

/// A failed import of a descriptor, with the likely cause when the driver's
/// status says only CUDA_ERROR_UNKNOWN (999): what it answers for a descriptor
/// that no CUDA export made.
pub(super) fn explain_import(e: MetraleError, made_by: &str) -> MetraleError {
    match e.kind() {
        ErrorKind::Driver {
            call,
            status,
            subject,
        } if *status == CUresult::CUDA_ERROR_UNKNOWN => ErrorKind::Driver {
            call,
            status: *status,
            subject: format!(
                "{subject}, which is likely not a descriptor that {made_by} made (a file, \
                 pipe or socket, or a descriptor number sent as data instead of with \
                 SCM_RIGHTS)"
            ),
        }
        .into(),
        _ => e,
    }
}

fn os_error(what: impl Into<String>, e: io::Error) -> MetraleError {
    ErrorKind::Os {
        what: what.into(),
        source: Arc::new(e),
    }
    .into()
}

impl PhysicalMemory {
    /// Export as a POSIX file descriptor (`cuMemExportToShareableHandle`), for
    /// another process to import with [`PhysicalMemory::import_fd`]. The memory
    /// must have been made with [`HandleTypes::POSIX_FD`]. The descriptor is
    /// close-on-exec: a program started by `exec` does not inherit it.
    ///
    /// # Errors
    /// `InvalidArgument` for memory not made exportable as a descriptor; the
    /// failing call.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        if !self.handle_types().contains(HandleTypes::POSIX_FD) {
            return Err(invalid_arg(format!(
                "exporting {} bytes of physical memory on device {}: it was not made with HandleTypes::POSIX_FD",
                self.size(),
                self.context().ordinal()
            )));
        }
        let mut fd: c_int = -1;
        let handle = self.raw();
        self.context().call(
            || {
                format!(
                    "device {}: exporting {} bytes of physical memory as a descriptor",
                    self.context().ordinal(),
                    self.size()
                )
            },
            // SAFETY: for POSIX_FD the driver writes one int, the descriptor;
            // `handle` is live (held by `self`); no flags.
            |d| unsafe {
                cu!(
                    d,
                    cuMemExportToShareableHandle(
                        (&mut fd as *mut c_int).cast::<c_void>(),
                        handle,
                        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0
                    )
                )
            },
        )?;
        own_exported(fd, || {
            format!(
                "device {}: exporting {} bytes of physical memory",
                self.context().ordinal(),
                self.size()
            )
        })
    }

    /// Import physical memory another process exported
    /// (`cuMemImportFromShareableHandle`), on `ctx`'s device. `size` is the
    /// exporter's size (the driver does not say it; send it with the
    /// descriptor, as [`PhysicalMemory::send`] does); a mapping larger than the
    /// real memory is refused by the driver. The descriptor stays the caller's
    /// (close it when you like; the import holds the memory).
    ///
    /// # Errors
    /// `InvalidArgument` for a size that is not a multiple of the granularity,
    /// or for memory that does not live on `ctx`'s device
    /// (`cuMemGetAllocationPropertiesFromHandle`; the import is released); the
    /// failing call (a descriptor that is not exported device memory).
    pub fn import_fd(ctx: &impl AsContext, fd: BorrowedFd<'_>, size: usize) -> Result<Self> {
        let ctx = ctx.context();
        let g = granularity(ctx, HandleTypes::POSIX_FD)?.minimum;
        if size == 0 || !size.is_multiple_of(g) {
            return Err(invalid_arg(format!(
                "device {}: importing physical memory: size {size} bytes is not a non-zero multiple of the allocation granularity ({g} bytes)",
                ctx.ordinal()
            )));
        }
        let raw = fd.as_raw_fd();
        let mut handle: CUmemGenericAllocationHandle = 0;
        ctx.call(
            || {
                format!(
                    "device {}: importing {size} bytes of physical memory from descriptor {raw}",
                    ctx.ordinal()
                )
            },
            // SAFETY: writes one handle; for POSIX_FD the "OS handle" is the
            // descriptor's value passed as a pointer-sized integer (the driver's
            // convention), open for the whole call (borrowed).
            |d| unsafe {
                cu!(
                    d,
                    cuMemImportFromShareableHandle(
                        &mut handle,
                        raw as isize as *mut c_void,
                        CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                    )
                )
            },
        )
        .map_err(|e| {
            explain_import(
                e,
                "PhysicalMemory::export_fd (cuMemExportToShareableHandle)",
            )
        })?;
        // Owned from here: an error below releases the handle (`cuMemRelease`).
        let phys = PhysicalMemory::from_handle(handle, size, HandleTypes::POSIX_FD, ctx);
        // The peer chose the device the memory lives on: check it is ours.
        // SAFETY: a plain C struct of integers and a pointer; all-zero is valid.
        let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
        ctx.call(
            || {
                format!(
                    "device {}: properties of physical memory imported from descriptor {raw}",
                    ctx.ordinal()
                )
            },
            // SAFETY: writes one property struct for the handle imported just now.
            |d| unsafe { cu!(d, cuMemGetAllocationPropertiesFromHandle(&mut prop, handle)) },
        )?;
        let (kind, id) = (prop.location.type_, prop.location.id);
        if kind != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE || id != ctx.device() {
            return Err(invalid_arg(format!(
                "device {}: importing physical memory from descriptor {raw}: it lives at location type {} id {id}, not on this device (released)",
                ctx.ordinal(),
                kind.0
            )));
        }
        Ok(phys)
    }

    /// Export as a descriptor and send it, with the size, over `sock` (one
    /// message: 8 bytes of size, little-endian, and the descriptor).
    ///
    /// # Errors
    /// As [`PhysicalMemory::export_fd`] and [`send_fd`].
    pub fn send(&self, sock: &UnixStream) -> Result<()> {
        let fd = self.export_fd()?;
        let size = u64::try_from(self.size())
            .map_err(|_| invalid_arg("a physical memory size past u64"))?;
        send_fd(sock, std::os::fd::AsFd::as_fd(&fd), &size.to_le_bytes())
    }

    /// Receive what [`PhysicalMemory::send`] sent and import it on `ctx`'s
    /// device.
    ///
    /// # Errors
    /// As [`recv_fd`] and [`PhysicalMemory::import_fd`]; a message that is not 8
    /// bytes.
    pub fn receive(ctx: &impl AsContext, sock: &UnixStream) -> Result<Self> {
        let mut size = [0u8; 8];
        let (fd, n) = recv_fd(sock, &mut size)?;
        if n != size.len() {
            return Err(invalid_arg(format!(
                "receiving physical memory: a message of {n} bytes, not the 8 of its size"
            )));
        }
        let size = usize::try_from(u64::from_le_bytes(size))
            .map_err(|_| invalid_arg("receiving physical memory: a size past usize"))?;
        PhysicalMemory::import_fd(ctx, std::os::fd::AsFd::as_fd(&fd), size)
    }
}

/// Room for one descriptor's control message, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct ControlBuffer([u8; 64]);

/// Send `data` (at least one byte) with a copy of `fd` over `sock`
/// (`sendmsg`, `SCM_RIGHTS`). The descriptor stays the caller's.
///
/// # Errors
/// `InvalidArgument` for empty `data`; [`ErrorKind::Os`] for the failing
/// `sendmsg` or a short send.
pub fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Err(invalid_arg(
            "sending a descriptor: at least one byte of data must go with it",
        ));
    }
    let mut control = ControlBuffer([0; 64]);
    let fd_bytes = std::mem::size_of::<c_int>() as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    if space > control.0.len() {
        return Err(invalid_arg(
            "sending a descriptor: control message too large",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast::<c_void>(),
        iov_len: data.len(),
    };
    // SAFETY: msghdr is a plain C struct; all zero is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast::<c_void>();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `control`, `space` bytes (checked above), aligned
    // for cmsghdr; CMSG_FIRSTHDR returns its start (non-null: space > 0).
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    if cmsg.is_null() {
        return Err(invalid_arg(
            "sending a descriptor: no room for the control message",
        ));
    }
    // SAFETY: `cmsg` points at the first header inside `control`, with room for
    // the header and one int of data (CMSG_SPACE above); the data may be
    // unaligned, so it is written unaligned.
    unsafe {
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<c_int>(), fd.as_raw_fd());
    }
    let sent = loop {
        // SAFETY: `msg` and everything it points at (`iov` over `data`,
        // `control`) live across the call; the socket is open (borrowed).
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(os_error("sending a descriptor over a Unix socket", e));
        }
    };
    if sent != data.len() {
        return Err(os_error(
            "sending a descriptor over a Unix socket",
            io::Error::new(
                io::ErrorKind::WriteZero,
                format!("sent {sent} of {} bytes", data.len()),
            ),
        ));
    }
    Ok(())
}

/// Receive a message and the descriptor sent with it (`recvmsg`, `SCM_RIGHTS`,
/// close-on-exec) into `buf`: `(descriptor, bytes received)`.
///
/// # Errors
/// [`ErrorKind::Os`] for the failing `recvmsg`, a peer that closed the socket,
/// a message without a descriptor, a truncated message (`MSG_TRUNC`: a
/// datagram or sequenced-packet socket whose message is longer than `buf`), or
/// a truncated control message (any descriptors received are closed).
pub fn recv_fd(sock: &UnixStream, buf: &mut [u8]) -> Result<(OwnedFd, usize)> {
    let what = "receiving a descriptor over a Unix socket";
    let mut control = ControlBuffer([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast::<c_void>(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is a plain C struct; all zero is a valid empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast::<c_void>();
    msg.msg_controllen = control.0.len() as _;
    let n = loop {
        // SAFETY: `msg` points at `iov` (over `buf`, writable for its length) and
        // `control` (64 bytes, aligned for cmsghdr), alive across the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(os_error(what, e));
        }
    };
    // Own every descriptor received first, so none leaks on any error below.
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR / CMSG_NXTHDR walk the
    // headers inside `control` within `msg_controllen` and return null at the end.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: `cmsg` is a header inside `control` (see above).
        let (level, kind, len) = unsafe {
            (
                (*cmsg).cmsg_level,
                (*cmsg).cmsg_type,
                (*cmsg).cmsg_len as usize,
            )
        };
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN only computes a size.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = len.saturating_sub(header) / std::mem::size_of::<c_int>();
            for i in 0..count {
                // SAFETY: the kernel wrote `count` ints after the header, inside
                // `control`; they may be unaligned.
                let raw = unsafe {
                    std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<c_int>().add(i))
                };
                if raw >= 0 {
                    // SAFETY: SCM_RIGHTS installed a new descriptor in this
                    // process for us; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                }
            }
        }
        // SAFETY: as for CMSG_FIRSTHDR.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        // A datagram or sequenced-packet socket dropped the rest of the message.
        return Err(os_error(
            what,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the message was truncated (longer than the {} bytes expected)",
                    buf.len()
                ),
            ),
        ));
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(os_error(
            what,
            io::Error::new(
                io::ErrorKind::InvalidData,
                "the control message was truncated",
            ),
        ));
    }
    if n == 0 && fds.is_empty() {
        return Err(os_error(
            what,
            io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the socket"),
        ));
    }
    let mut fds = fds.into_iter();
    match fds.next() {
        Some(fd) => Ok((fd, n)),
        None => Err(os_error(
            what,
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a message of {n} bytes came without a descriptor"),
            ),
        )),
    }
}
