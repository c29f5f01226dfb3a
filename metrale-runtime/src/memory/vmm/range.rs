//! [`VirtualRange`]: a reserved address range, its mappings and their access.

use std::fmt;
use std::sync::Arc;

use metrale_cuda_sys::{
    CUdeviceptr, CUmemAccessDesc, CUmemAccess_flags, CUmemLocation, CUmemLocationType,
};

use super::{check_multiple, granularity, Access, HandleTypes, PhysicalMemory};
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, report_line, Result};

/// One mapping of a range: `size` bytes at `offset`, from `phys` at `phys_offset`.
pub(super) struct Mapping {
    pub(super) offset: usize,
    pub(super) size: usize,
    pub(super) phys: Arc<PhysicalMemory>,
}

/// Reserved device address space (`cuMemAddressReserve`), with the physical
/// memory mapped into it. On drop everything still mapped is unmapped (after the
/// work that may use it: `cuCtxSynchronize`) and the range is freed. While the
/// context has waits on mapped words pending ([`CudaContext::pending_waits`]),
/// that wait could block for ever, and while an NCCL group is open its
/// collectives are not yet on their streams: a drop with mappings then waits
/// for a group open on another thread (up to five seconds) and otherwise leaks
/// the range with one line on stderr, and [`VirtualRange::unmap`] returns an
/// error.
///
/// The range gives raw addresses only ([`VirtualRange::device_ptr`]); safe typed
/// access is [`GrowableBuffer`](crate::GrowableBuffer).
pub struct VirtualRange {
    pub(in crate::memory) base: CUdeviceptr,
    pub(in crate::memory) size: usize,
    pub(in crate::memory) granularity: usize,
    pub(in crate::memory) ctx: Arc<CudaContext>,
    pub(super) made: Generation,
    /// Sorted by offset, never overlapping.
    pub(super) mappings: Vec<Mapping>,
    /// Whether the Drop body ran (a growable buffer runs it first).
    pub(super) released: bool,
}

impl VirtualRange {
    /// Reserve `size` bytes of address space on `ctx`'s device, a non-zero
    /// multiple of the minimum [`granularity`].
    ///
    /// # Errors
    /// `InvalidArgument` (saying the granularity); the failing
    /// `cuMemAddressReserve`.
    pub fn reserve(ctx: &impl AsContext, size: usize) -> Result<VirtualRange> {
        VirtualRange::reserve_aligned(ctx.context(), size, None)
    }

    /// As [`VirtualRange::reserve`], the range aligned to `align` (a multiple of
    /// the minimum granularity, a power of two), or to the granularity for `None`.
    pub(in crate::memory) fn reserve_aligned(
        ctx: &Arc<CudaContext>,
        size: usize,
        align: Option<usize>,
    ) -> Result<VirtualRange> {
        let g = granularity(ctx, HandleTypes::NONE)?.minimum;
        check_multiple(size, g, false, "size", || {
            format!("device {}: reserving address space", ctx.ordinal())
        })?;
        let align = align.unwrap_or(g);
        if !align.is_power_of_two() || !align.is_multiple_of(g) {
            return Err(invalid_arg(format!(
                "device {}: reserving address space aligned to {align} bytes: not a power of two multiple of the granularity ({g} bytes)",
                ctx.ordinal()
            )));
        }
        let mut base: CUdeviceptr = 0;
        ctx.call(
            || {
                format!(
                    "device {}: reserving {size} bytes of address space",
                    ctx.ordinal()
                )
            },
            // SAFETY: writes one address; alignment a multiple of the granularity,
            // no fixed address.
            |d| unsafe { cu!(d, cuMemAddressReserve(&mut base, size, align, 0, 0)) },
        )?;
        Ok(VirtualRange {
            base,
            size,
            granularity: g,
            ctx: Arc::clone(ctx),
            made: ctx.generation(),
            mappings: Vec::new(),
            released: false,
        })
    }

    /// The first address of the range.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.base
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The granularity every offset and size is checked against.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// The context (device) it was reserved on.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `(offset, size)` of each mapping, in address order.
    pub fn mappings(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.mappings.iter().map(|m| (m.offset, m.size))
    }

    /// The physical memory of the mapping that starts at `offset` (to export it).
    /// The reference borrows the range (and a growable buffer it belongs to);
    /// [`VirtualRange::physical_cloned`] gives a handle of your own.
    pub fn physical(&self, offset: usize) -> Option<&Arc<PhysicalMemory>> {
        self.mappings
            .iter()
            .find(|m| m.offset == offset)
            .map(|m| &m.phys)
    }

    /// As [`VirtualRange::physical`], a handle of your own (a clone of the
    /// `Arc`): it borrows nothing, so the buffer the range belongs to can be
    /// used mutably while you keep it. The memory lives while any handle does;
    /// unmapping (a sleep, a drop) releases the mapping, not your handle.
    ///
    /// ```no_run
    /// # use metrale_runtime::{host, GrowableBuffer, HandleTypes};
    /// # fn main() -> metrale_runtime::Result<()> {
    /// # let h = host(0)?;
    /// # let s = h.stream();
    /// let mut buf = GrowableBuffer::<u32>::with_handle_types(s, 1 << 20, HandleTypes::POSIX_FD)?;
    /// buf.grow_to(1 << 20)?;
    /// let piece = buf.range().physical_cloned(0);
    /// s.zero(&mut buf)?; // a mutable use while the piece is kept
    /// if let Some(piece) = piece {
    ///     let _fd = piece.export_fd()?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn physical_cloned(&self, offset: usize) -> Option<Arc<PhysicalMemory>> {
        self.physical(offset).cloned()
    }

    /// Whether any byte of `[offset, offset + size)` is mapped.
    pub fn is_mapped(&self, offset: usize, size: usize) -> bool {
        let end = offset.saturating_add(size);
        self.mappings
            .iter()
            .any(|m| m.offset < end && offset < m.offset + m.size)
    }

    pub(super) fn subject(&self, what: fmt::Arguments<'_>) -> String {
        format!(
            "device {}, range {:#x} ({} bytes): {what}",
            self.ctx.ordinal(),
            self.base,
            self.size
        )
    }

    /// Check `[offset, offset + size)` against the granularity and the range.
    pub(super) fn check_part(&self, offset: usize, size: usize, what: &str) -> Result<()> {
        let g = self.granularity;
        check_multiple(offset, g, true, "offset", || {
            self.subject(format_args!("{what}"))
        })?;
        check_multiple(size, g, false, "size", || {
            self.subject(format_args!("{what}"))
        })?;
        if offset.checked_add(size).is_none_or(|end| end > self.size) {
            return Err(invalid_arg(self.subject(format_args!(
                "{what}: {size} bytes at offset {offset} reach past the end"
            ))));
        }
        Ok(())
    }

    /// Map `size` bytes of `phys`, from `phys_offset`, at `offset` of this range,
    /// and give each device of `access` that access (`cuMemMap`,
    /// `cuMemSetAccess`). Memory is unusable by any device until access is set.
    ///
    /// # Errors
    /// `InvalidArgument` for offsets or sizes that are not multiples of the
    /// granularity (saying it), parts past the end of the range or of `phys`, a
    /// part that is already mapped (in part), or physical memory of another
    /// device; the failing call. When setting access fails the mapping is undone.
    pub fn map(
        &mut self,
        offset: usize,
        phys: Arc<PhysicalMemory>,
        phys_offset: usize,
        size: usize,
        access: &[(&Arc<CudaContext>, Access)],
    ) -> Result<()> {
        self.check_part(offset, size, "mapping")?;
        let g = self.granularity;
        check_multiple(
            phys_offset,
            g,
            true,
            "offset in the physical memory",
            || self.subject(format_args!("mapping")),
        )?;
        if phys_offset
            .checked_add(size)
            .is_none_or(|end| end > phys.size)
        {
            return Err(invalid_arg(self.subject(format_args!(
                "mapping: {size} bytes from offset {phys_offset} reach past the end of the physical memory ({} bytes)",
                phys.size
            ))));
        }
        if !phys.ctx.same(&self.ctx) {
            return Err(invalid_arg(self.subject(format_args!(
                "mapping: the physical memory is on device {}",
                phys.ctx.ordinal()
            ))));
        }
        if self.is_mapped(offset, size) {
            return Err(invalid_arg(self.subject(format_args!(
                "mapping {size} bytes at offset {offset}: that part is already mapped (unmap it first)"
            ))));
        }
        let descs = access_descs(access)?;
        let (ptr, handle) = (self.base + offset as u64, phys.handle);
        self.ctx.call(
            || self.subject(format_args!("mapping {size} bytes at offset {offset}")),
            // SAFETY: the part lies inside this reserved range and is not mapped
            // (checked above against the complete record); `handle` is live
            // (`phys` holds it) and has `size` bytes from `phys_offset`.
            |d| unsafe { cu!(d, cuMemMap(ptr, size, phys_offset, handle, 0)) },
        )?;
        let pos = self.mappings.partition_point(|m| m.offset < offset);
        self.mappings.insert(pos, Mapping { offset, size, phys });
        if !descs.is_empty() {
            if let Err(e) = self.set_access_raw(ptr, size, descs.as_slice(), true) {
                // Nothing can have used memory without access: undo at once.
                let undo = self.ctx.with(|d| {
                    // SAFETY: the mapping made just above, unused.
                    unsafe { cu!(d, cuMemUnmap(ptr, size)) }
                });
                match undo {
                    Ok(()) => {
                        self.mappings.remove(pos);
                    }
                    Err(e2) => report_line(format_args!(
                        "{}: the mapping stays ({e2})",
                        self.subject(format_args!("undoing a mapping after access failed"))
                    )),
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// `cuMemSetAccess`; `bound`: this thread bound the context for the call just
    /// before (the mapping), so it is not checked again.
    fn set_access_raw(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        descs: &[CUmemAccessDesc],
        bound: bool,
    ) -> Result<()> {
        let subject = || self.subject(format_args!("setting access to {size} bytes at {ptr:#x}"));
        // SAFETY: the part is mapped (the caller's check); `descs` is valid for
        // its length.
        let call = |d: &'static metrale_cuda_sys::Driver| unsafe {
            cu!(d, cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len()))
        };
        if bound {
            self.ctx.call_unbound(subject, call)
        } else {
            self.ctx.call(subject, call)
        }
    }

    /// Give each device of `access` that access to `[offset, offset + size)`,
    /// which must be mapped entirely.
    ///
    /// # Errors
    /// `InvalidArgument` for an unaligned or unmapped part; the failing
    /// `cuMemSetAccess`.
    pub fn set_access(
        &mut self,
        offset: usize,
        size: usize,
        access: &[(&Arc<CudaContext>, Access)],
    ) -> Result<()> {
        self.check_part(offset, size, "setting access")?;
        let mut at = offset;
        for m in &self.mappings {
            if m.offset <= at && at < m.offset + m.size {
                at = m.offset + m.size;
            }
        }
        if at < offset + size {
            return Err(invalid_arg(self.subject(format_args!(
                "setting access: {size} bytes at offset {offset} are not all mapped"
            ))));
        }
        let descs = access_descs(access)?;
        if descs.is_empty() {
            return Ok(());
        }
        self.set_access_raw(self.base + offset as u64, size, descs.as_slice(), false)
    }
}

/// Access descriptors, for up to eight devices without an allocation.
struct AccessDescs {
    inline: [CUmemAccessDesc; 8],
    len: usize,
    more: Vec<CUmemAccessDesc>,
}

impl AccessDescs {
    fn as_slice(&self) -> &[CUmemAccessDesc] {
        if self.more.is_empty() {
            self.inline.get(..self.len).unwrap_or(&[])
        } else {
            &self.more
        }
    }

    fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }
}

fn access_descs(access: &[(&Arc<CudaContext>, Access)]) -> Result<AccessDescs> {
    let none = CUmemAccessDesc {
        location: CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
    };
    let mut out = AccessDescs {
        inline: [none; 8],
        len: 0,
        more: Vec::new(),
    };
    for (i, (ctx, a)) in access.iter().enumerate() {
        let id = i32::try_from(ctx.ordinal()).map_err(|_| {
            invalid_arg(format!("device ordinal {} is out of range", ctx.ordinal()))
        })?;
        let desc = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id,
            },
            flags: a.flags(),
        };
        match out.inline.get_mut(i) {
            Some(slot) if access.len() <= 8 => {
                *slot = desc;
                out.len = i + 1;
            }
            _ => out.more.push(desc),
        }
    }
    Ok(out)
}

impl fmt::Debug for VirtualRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtualRange")
            .field("device", &self.ctx.ordinal())
            .field("base", &format_args!("{:#x}", self.base))
            .field("size", &self.size)
            .field("mappings", &self.mappings.len())
            .finish()
    }
}
