//! Virtual memory management: reserved address ranges ([`VirtualRange`]),
//! physical memory ([`PhysicalMemory`]), mappings of one into the other with
//! access for chosen devices, and the wait before unmapping; `growable.rs` builds
//! [`GrowableBuffer`](super::GrowableBuffer) on them, a buffer whose address never
//! changes while it grows, which can sleep (release its physical memory) and wake
//! (get it back at the same addresses).
//!
//! Invariants:
//! - A range records every mapping it holds; a map over a mapped part is refused
//!   before the driver, and sizes and offsets are checked against the device's
//!   allocation granularity (the error says the granularity).
//! - Unmapping waits for the work that may use the memory: every stream of the
//!   range's context (`cuCtxSynchronize`) and the streams of other devices that a
//!   safe operation used it on. A wait that fails for another reason than
//!   abandoned work keeps the mapping (an error, or a reported leak in Drop).
//! - A range is freed (`cuMemAddressFree`) only after everything in it was
//!   unmapped; when an unmap fails the range stays reserved (a reported leak),
//!   never freed while mapped.
//! - A mapping holds its [`PhysicalMemory`] (an `Arc`), so the handle lives while
//!   it is mapped, and can still be exported.
//! - Memory of a sleeping buffer is unreachable from safe code: sleeping is a
//!   different type ([`SleepingBuffer`](super::SleepingBuffer)) with no device
//!   address to pass.

use std::fmt;
use std::sync::{Arc, PoisonError};

use metrale_cuda_sys::{
    CUdeviceptr, CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType, CUmemAllocationProp, CUmemAllocationType,
    CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType,
};

use super::Uses;
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, report_line, MetraleError, Result};

/// Which shareable handles physical memory can be exported as (a set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct HandleTypes(u32);

impl HandleTypes {
    /// Not exportable.
    pub const NONE: HandleTypes = HandleTypes(0);
    /// Exportable as a POSIX file descriptor (Linux).
    pub const POSIX_FD: HandleTypes =
        HandleTypes(CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0);

    /// Whether every type of `other` is in `self`.
    pub fn contains(self, other: HandleTypes) -> bool {
        self.0 & other.0 == other.0
    }

    /// The driver's bit set.
    pub fn bits(self) -> u32 {
        self.0
    }
}

/// The allocation properties of pinned device memory on `ordinal`.
fn props(ordinal: usize, types: HandleTypes) -> Result<CUmemAllocationProp> {
    let id = i32::try_from(ordinal)
        .map_err(|_| invalid_arg(format!("device ordinal {ordinal} is out of range")))?;
    // SAFETY: a plain C struct of integers and one pointer; all zero is its
    // documented default.
    let mut p: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = CUmemAllocationHandleType(types.0);
    p.location = CUmemLocation {
        type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id,
    };
    Ok(p)
}

/// A device's allocation granularity for virtual memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granularity {
    /// Every size and offset must be a multiple of this.
    pub minimum: usize,
    /// What the driver recommends for performance (a multiple of `minimum`).
    pub recommended: usize,
}

/// The allocation granularity of `ctx`'s device for memory exportable as `types`
/// (`cuMemGetAllocationGranularity`).
///
/// # Errors
/// The failing call (a device without virtual memory management says
/// NOT_SUPPORTED).
pub fn granularity(ctx: &impl AsContext, types: HandleTypes) -> Result<Granularity> {
    let ctx = ctx.context();
    let prop = props(ctx.ordinal(), types)?;
    let get = |flag: CUmemAllocationGranularity_flags| -> Result<usize> {
        let mut g: usize = 0;
        ctx.call(
            || format!("device {}: allocation granularity", ctx.ordinal()),
            // SAFETY: writes one size; `prop` is a valid property struct.
            |d| unsafe { cu!(d, cuMemGetAllocationGranularity(&mut g, &prop, flag)) },
        )?;
        if g == 0 {
            return Err(invalid_arg(format!(
                "device {}: the driver reported an allocation granularity of 0",
                ctx.ordinal()
            )));
        }
        Ok(g)
    };
    Ok(Granularity {
        minimum: get(CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)?,
        recommended: get(CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?,
    })
}

/// `Ok` when `value` is a non-zero multiple of `g` (or zero where `zero_ok`);
/// the error reads "{subject}: {label} {value} bytes is not a multiple ...".
fn check_multiple(
    value: usize,
    g: usize,
    zero_ok: bool,
    label: &str,
    subject: impl Fn() -> String,
) -> Result<()> {
    if (value == 0 && !zero_ok) || !value.is_multiple_of(g) {
        return Err(invalid_arg(format!(
            "{}: {label} {value} bytes is not a {}multiple of the allocation granularity ({g} bytes)",
            subject(),
            if zero_ok { "" } else { "non-zero " }
        )));
    }
    Ok(())
}

/// `value` rounded up to a multiple of `g`, or an error when that overflows.
pub(super) fn round_up(value: usize, g: usize) -> Result<usize> {
    value
        .checked_next_multiple_of(g)
        .ok_or_else(|| invalid_arg(format!("{value} bytes rounded up to {g} overflows usize")))
}

/// Physical device memory (`cuMemCreate`, or imported from another process),
/// released (`cuMemRelease`) on drop. Map it into a [`VirtualRange`] to use it;
/// the driver keeps mapped memory alive until it is unmapped.
pub struct PhysicalMemory {
    handle: CUmemGenericAllocationHandle,
    pub(super) size: usize,
    pub(super) types: HandleTypes,
    pub(super) ctx: Arc<CudaContext>,
    made: Generation,
}

impl PhysicalMemory {
    /// Allocate `size` bytes on `ctx`'s device, exportable as `types`. `size` must
    /// be a non-zero multiple of the minimum [`granularity`].
    ///
    /// # Errors
    /// `InvalidArgument` (saying the granularity) for a size that is not a
    /// multiple; the failing `cuMemCreate` (out of memory, ...).
    pub fn new(ctx: &impl AsContext, size: usize, types: HandleTypes) -> Result<PhysicalMemory> {
        let ctx = ctx.context();
        let g = granularity(ctx, types)?.minimum;
        check_multiple(size, g, false, "size", || {
            format!("device {}: creating physical memory", ctx.ordinal())
        })?;
        PhysicalMemory::create(ctx, size, types)
    }

    /// `cuMemCreate` of `size` bytes, already checked against the granularity
    /// (the growable buffer's path: no granularity query per piece).
    pub(crate) fn create(
        ctx: &Arc<CudaContext>,
        size: usize,
        types: HandleTypes,
    ) -> Result<PhysicalMemory> {
        let prop = props(ctx.ordinal(), types)?;
        let mut handle: CUmemGenericAllocationHandle = 0;
        ctx.call(
            || {
                format!(
                    "device {}: creating {size} bytes of physical memory",
                    ctx.ordinal()
                )
            },
            // SAFETY: writes one handle; `prop` is valid; no flags.
            |d| unsafe { cu!(d, cuMemCreate(&mut handle, size, &prop, 0)) },
        )?;
        Ok(PhysicalMemory::from_handle(handle, size, types, ctx))
    }

    /// Own `handle` (of `size` bytes, made in `ctx` just now).
    pub(crate) fn from_handle(
        handle: CUmemGenericAllocationHandle,
        size: usize,
        types: HandleTypes,
        ctx: &Arc<CudaContext>,
    ) -> PhysicalMemory {
        PhysicalMemory {
            handle,
            size,
            types,
            ctx: Arc::clone(ctx),
            made: ctx.generation(),
        }
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The handle types it can be exported as.
    pub fn handle_types(&self) -> HandleTypes {
        self.types
    }

    /// The context (device) it lives on.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The driver's handle, for calls of your own (do not release it).
    pub fn raw(&self) -> CUmemGenericAllocationHandle {
        self.handle
    }
}

impl fmt::Debug for PhysicalMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PhysicalMemory")
            .field("device", &self.ctx.ordinal())
            .field("size", &self.size)
            .field("handle_types", &self.types)
            .finish()
    }
}

impl Drop for PhysicalMemory {
    fn drop(&mut self) {
        let handle = self.handle;
        self.ctx.release_with(
            self.made,
            format_args!(
                "releasing {} bytes of physical memory on device {}",
                self.size,
                self.ctx.ordinal()
            ),
            |d, failures| {
                // SAFETY: this handle's own release, once; mappings of it keep the
                // memory alive in the driver until they are unmapped.
                if let Err(e) = unsafe { cu!(d, cuMemRelease(handle)) } {
                    failures.push(e);
                }
            },
        );
    }
}

/// How a device may access mapped memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

impl Access {
    fn flags(self) -> CUmemAccess_flags {
        match self {
            Access::Read => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access::ReadWrite => CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }
}

/// One mapping of a range: `size` bytes at `offset`, from `phys` at `phys_offset`.
struct Mapping {
    offset: usize,
    size: usize,
    phys: Arc<PhysicalMemory>,
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
/// access is [`GrowableBuffer`](super::GrowableBuffer).
pub struct VirtualRange {
    pub(super) base: CUdeviceptr,
    pub(super) size: usize,
    pub(super) granularity: usize,
    pub(super) ctx: Arc<CudaContext>,
    made: Generation,
    /// Sorted by offset, never overlapping.
    mappings: Vec<Mapping>,
    /// Whether the Drop body ran (a growable buffer runs it first).
    released: bool,
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
    pub(super) fn reserve_aligned(
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

    fn subject(&self, what: fmt::Arguments<'_>) -> String {
        format!(
            "device {}, range {:#x} ({} bytes): {what}",
            self.ctx.ordinal(),
            self.base,
            self.size
        )
    }

    /// Check `[offset, offset + size)` against the granularity and the range.
    fn check_part(&self, offset: usize, size: usize, what: &str) -> Result<()> {
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

    /// Unmap the mapping that starts at `offset` and give its physical memory
    /// back, after the work that may use it: every stream of the range's context
    /// is waited for (`cuCtxSynchronize`).
    ///
    /// # Errors
    /// `InvalidArgument` when no mapping starts at `offset`, or while the
    /// context has GPU-side waits pending ([`CudaContext::pending_waits`]: the
    /// wait could block for ever; the mapping stays); the failing wait (the
    /// mapping stays) or `cuMemUnmap`.
    pub fn unmap(&mut self, offset: usize) -> Result<Arc<PhysicalMemory>> {
        let Some(pos) = self.mappings.iter().position(|m| m.offset == offset) else {
            return Err(invalid_arg(self.subject(format_args!(
                "unmapping: no mapping starts at offset {offset}"
            ))));
        };
        self.wait_for_uses(None)?;
        self.unmap_at(pos)
    }

    /// Wait for every use of the range's memory (see [`wait_for_context`]).
    pub(super) fn wait_for_uses(&self, uses: Option<&Uses>) -> Result<()> {
        wait_for_context(&self.ctx, uses).map_err(|e| match e.kind() {
            crate::error::ErrorKind::InvalidArgument(text) => {
                invalid_arg(self.subject(format_args!("{text}")))
            }
            _ => e,
        })
    }

    /// Unmap the mapping that starts at `offset`, whose uses the caller waited
    /// for (a sleep releasing each piece once its saved copy has completed).
    pub(super) fn unmap_waited(&mut self, offset: usize) -> Result<Arc<PhysicalMemory>> {
        let Some(pos) = self.mappings.iter().position(|m| m.offset == offset) else {
            return Err(invalid_arg(self.subject(format_args!(
                "unmapping: no mapping starts at offset {offset}"
            ))));
        };
        self.unmap_at(pos)
    }

    /// Unmap mapping `pos` (its uses were waited for).
    fn unmap_at(&mut self, pos: usize) -> Result<Arc<PhysicalMemory>> {
        let Some(m) = self.mappings.get(pos) else {
            return Err(invalid_arg("unmapping: no such mapping"));
        };
        let (ptr, size, offset) = (self.base + m.offset as u64, m.size, m.offset);
        self.ctx.call(
            || self.subject(format_args!("unmapping {size} bytes at offset {offset}")),
            // SAFETY: exactly one recorded mapping; the work that may use it was
            // waited for by the caller.
            |d| unsafe { cu!(d, cuMemUnmap(ptr, size)) },
        )?;
        Ok(self.mappings.remove(pos).phys)
    }

    /// Unmap everything (uses waited for), from the top; stops at the first
    /// failure, keeping the record of what is still mapped.
    pub(super) fn unmap_all(&mut self) -> Result<()> {
        while let Some(last) = self.mappings.len().checked_sub(1) {
            self.unmap_at(last)?;
        }
        Ok(())
    }
}

/// Wait for every use of memory of `ctx`: the foreign streams of `uses`, then
/// the whole context (`cuCtxSynchronize`). Work abandoned by an earlier fault
/// counts as done. Refused on a thread that captures (the wait would invalidate
/// its capture), and while `ctx` (or the context of a foreign stream) has GPU-side
/// waits pending ([`CudaContext::pending_waits`]): a wait on a word nobody
/// writes would make this block for ever.
pub(super) fn wait_for_context(ctx: &CudaContext, uses: Option<&Uses>) -> Result<()> {
    if crate::stream::capturing_on_this_thread() {
        return Err(invalid_arg(
            "waiting for the work that uses the memory while this thread captures a graph (the wait would invalidate the capture)",
        ));
    }
    let waiting = "waiting for the work that uses the memory";
    if crate::lifetime::nccl_groups_open() {
        return Err(invalid_arg(format!(
            "{waiting}: an NCCL group is open, whose collectives reach their streams only \
             when it ends (retry after the group)"
        )));
    }
    ctx.refuse_with_pending_waits(&waiting)?;
    let abandoned = |e: &MetraleError| e.status().is_some_and(crate::lifetime::work_abandoned);
    if let Some(uses) = uses {
        if uses.any_foreign.load(std::sync::atomic::Ordering::Acquire) {
            let foreign = uses
                .foreign
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            for f in &foreign {
                f.context().refuse_with_pending_waits(&waiting)?;
            }
            for f in &foreign {
                if let Err(e) = f.synchronize() {
                    if !abandoned(&e) {
                        return Err(e);
                    }
                }
            }
        }
    }
    match ctx.synchronize() {
        Err(e) if !abandoned(&e) => Err(e),
        _ => Ok(()),
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

impl VirtualRange {
    /// The Drop body: wait for uses, unmap everything, free the range; a failure
    /// leaks what is left (reported), never frees a mapped range.
    pub(super) fn release(&mut self, uses: Option<&Uses>) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        let what = self.subject(format_args!("freeing"));
        if !self.ctx.may_release(self.made, format_args!("{what}")) {
            // Gone or reset: the driver freed everything.
            self.mappings.clear();
            return;
        }
        if !self.mappings.is_empty() {
            // An open NCCL group's collectives are not on their streams yet:
            // another thread's group is waited out; what still blocks the wait
            // (this thread's group, pending mapped waits) leaks it below.
            crate::lifetime::wait_out_nccl_groups();
            if let Err(e) = self.wait_for_uses(uses).and_then(|()| self.unmap_all()) {
                report_line(format_args!(
                    "{what}: leaked, {} mapping(s) could not be unmapped: {e}",
                    self.mappings.len()
                ));
                return;
            }
        }
        let (base, size) = (self.base, self.size);
        self.ctx
            .release_with(self.made, format_args!("{what}"), |d, failures| {
                // SAFETY: this range's own free, once, after every mapping in it was
                // unmapped.
                if let Err(e) = unsafe { cu!(d, cuMemAddressFree(base, size)) } {
                    failures.push(e);
                }
            });
    }
}

impl Drop for VirtualRange {
    fn drop(&mut self) {
        self.release(None);
    }
}
