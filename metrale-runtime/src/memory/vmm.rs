//! Virtual memory management: reserved address ranges ([`VirtualRange`]),
//! physical memory ([`PhysicalMemory`]), mappings of one into the other with
//! access for chosen devices, and [`GrowableBuffer`], a buffer whose address never
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
//!   different type ([`SleepingBuffer`]) with no device address to pass.

use std::fmt;
use std::ops::RangeBounds;
use std::sync::{Arc, PoisonError};

use metrale_cuda_sys::{
    CUdeviceptr, CUmemAccessDesc, CUmemAccess_flags, CUmemAllocationGranularity_flags,
    CUmemAllocationHandleType, CUmemAllocationProp, CUmemAllocationType,
    CUmemGenericAllocationHandle, CUmemLocation, CUmemLocationType,
};

use super::device::bounds;
use super::{byte_len, sealed, DeviceMemory, DeviceMemoryMut, DeviceRepr, Uses};
use super::{DeviceSlice, DeviceSliceMut, PinnedBuffer};
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, report_line, MetraleError, Result};
use crate::stream::{AsStream, CudaStream};

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
fn round_up(value: usize, g: usize) -> Result<usize> {
    value
        .checked_next_multiple_of(g)
        .ok_or_else(|| invalid_arg(format!("{value} bytes rounded up to {g} overflows usize")))
}

/// Physical device memory (`cuMemCreate`, or imported from another process),
/// released (`cuMemRelease`) on drop. Map it into a [`VirtualRange`] to use it;
/// the driver keeps mapped memory alive until it is unmapped.
pub struct PhysicalMemory {
    handle: CUmemGenericAllocationHandle,
    size: usize,
    types: HandleTypes,
    ctx: Arc<CudaContext>,
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
/// work that may use it) and the range is freed.
///
/// The range gives raw addresses only ([`VirtualRange::device_ptr`]); safe typed
/// access is [`GrowableBuffer`].
pub struct VirtualRange {
    base: CUdeviceptr,
    size: usize,
    granularity: usize,
    ctx: Arc<CudaContext>,
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
        let ctx = ctx.context();
        let g = granularity(ctx, HandleTypes::NONE)?.minimum;
        check_multiple(size, g, false, "size", || {
            format!("device {}: reserving address space", ctx.ordinal())
        })?;
        let mut base: CUdeviceptr = 0;
        ctx.call(
            || {
                format!(
                    "device {}: reserving {size} bytes of address space",
                    ctx.ordinal()
                )
            },
            // SAFETY: writes one address; alignment of one granule, no fixed address.
            |d| unsafe { cu!(d, cuMemAddressReserve(&mut base, size, g, 0, 0)) },
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
    pub fn physical(&self, offset: usize) -> Option<&Arc<PhysicalMemory>> {
        self.mappings
            .iter()
            .find(|m| m.offset == offset)
            .map(|m| &m.phys)
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
            if let Err(e) = self.set_access_raw(ptr, size, &descs) {
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

    fn set_access_raw(
        &self,
        ptr: CUdeviceptr,
        size: usize,
        descs: &[CUmemAccessDesc],
    ) -> Result<()> {
        self.ctx.call(
            || self.subject(format_args!("setting access to {size} bytes at {ptr:#x}")),
            // SAFETY: the part is mapped (the caller's check); `descs` is valid for
            // its length.
            |d| unsafe { cu!(d, cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())) },
        )
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
        self.set_access_raw(self.base + offset as u64, size, &descs)
    }

    /// Unmap the mapping that starts at `offset` and give its physical memory
    /// back, after the work that may use it: every stream of the range's context
    /// is waited for (`cuCtxSynchronize`).
    ///
    /// # Errors
    /// `InvalidArgument` when no mapping starts at `offset`; the failing wait
    /// (the mapping stays) or `cuMemUnmap`.
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
    fn wait_for_uses(&self, uses: Option<&Uses>) -> Result<()> {
        wait_for_context(&self.ctx, uses).map_err(|e| match e.kind() {
            crate::error::ErrorKind::InvalidArgument(text) => {
                invalid_arg(self.subject(format_args!("{text}")))
            }
            _ => e,
        })
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
    fn unmap_all(&mut self) -> Result<()> {
        while let Some(last) = self.mappings.len().checked_sub(1) {
            self.unmap_at(last)?;
        }
        Ok(())
    }
}

/// Wait for every use of memory of `ctx`: the foreign streams of `uses`, then
/// the whole context (`cuCtxSynchronize`). Work abandoned by an earlier fault
/// counts as done. Refused on a thread that captures (the wait would invalidate
/// its capture).
pub(super) fn wait_for_context(ctx: &CudaContext, uses: Option<&Uses>) -> Result<()> {
    if crate::stream::capturing_on_this_thread() {
        return Err(invalid_arg(
            "waiting for the work that uses the memory while this thread captures a graph (the wait would invalidate the capture)",
        ));
    }
    let abandoned = |e: &MetraleError| e.status().is_some_and(crate::stream::work_abandoned);
    if let Some(uses) = uses {
        if uses.any_foreign.load(std::sync::atomic::Ordering::Acquire) {
            let foreign = uses
                .foreign
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
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

fn access_descs(access: &[(&Arc<CudaContext>, Access)]) -> Result<Vec<CUmemAccessDesc>> {
    access
        .iter()
        .map(|(ctx, a)| {
            let id = i32::try_from(ctx.ordinal()).map_err(|_| {
                invalid_arg(format!("device ordinal {} is out of range", ctx.ordinal()))
            })?;
            Ok(CUmemAccessDesc {
                location: CUmemLocation {
                    type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id,
                },
                flags: a.flags(),
            })
        })
        .collect()
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
    fn release(&mut self, uses: Option<&Uses>) {
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

/// A device buffer that grows without moving: a large range is reserved once and
/// physical memory is mapped on demand ([`GrowableBuffer::grow_to`]), so the
/// address of element 0 never changes. Usable wherever a [`DeviceBuffer`]
/// is (copies, fills, kernel arguments, slices).
///
/// [`GrowableBuffer::sleep`] releases its physical memory (optionally saving the
/// contents in pinned host memory) and [`SleepingBuffer::wake`] restores it at
/// the same addresses.
///
/// [`DeviceBuffer`]: super::DeviceBuffer
///
/// ```no_run
/// use metrale_runtime::{host, GrowableBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let h = host(0)?;
/// let s = h.stream();
/// let mut kv = GrowableBuffer::<f32>::new(&h, 1 << 30)?; // up to 4 GiB of address space
/// kv.grow_to(1 << 20)?;                                   // 4 MiB mapped
/// let p = kv.device_ptr();
/// kv.grow_to(1 << 24)?;
/// assert_eq!(kv.device_ptr(), p);
/// s.zero(&mut kv)?;
/// # Ok(()) }
/// ```
pub struct GrowableBuffer<T: DeviceRepr> {
    /// `range.device_ptr()`, held by reference for kernel arguments.
    ptr: CUdeviceptr,
    len: usize,
    range: VirtualRange,
    /// Bytes mapped from the start of the range (a multiple of the granularity).
    mapped: usize,
    /// What the physical memory it maps can be exported as.
    types: HandleTypes,
    /// The size every piece is rounded to: the larger of the range's and the
    /// physical memory's granularity (powers of two).
    grain: usize,
    uses: Uses,
    _elem: std::marker::PhantomData<T>,
}

impl<T: DeviceRepr> GrowableBuffer<T> {
    /// Reserve room for `capacity` elements (rounded up to the granularity) on
    /// `ctx`'s device; nothing is mapped yet (`len() == 0`).
    ///
    /// # Errors
    /// `InvalidArgument` for a zero or overflowing capacity, or a type whose
    /// alignment exceeds the granularity; the failing reservation.
    pub fn new(ctx: &impl AsContext, capacity: usize) -> Result<GrowableBuffer<T>> {
        GrowableBuffer::with_handle_types(ctx, capacity, HandleTypes::NONE)
    }

    /// As [`GrowableBuffer::new`], with every piece of physical memory it maps
    /// exportable as `types` (find a piece with [`VirtualRange::physical`]).
    ///
    /// # Errors
    /// As [`GrowableBuffer::new`].
    pub fn with_handle_types(
        ctx: &impl AsContext,
        capacity: usize,
        types: HandleTypes,
    ) -> Result<GrowableBuffer<T>> {
        let ctx = ctx.context();
        let bytes = byte_len::<T>(capacity, "growable buffer")?;
        if bytes == 0 {
            return Err(invalid_arg("growable buffer: a capacity of 0 bytes"));
        }
        let g = granularity(ctx, HandleTypes::NONE)?.minimum;
        let g_types = if types == HandleTypes::NONE {
            g
        } else {
            granularity(ctx, types)?.minimum
        };
        let grain = g.max(g_types);
        if !grain.is_multiple_of(g) || !grain.is_multiple_of(g_types) {
            return Err(invalid_arg(format!(
                "device {}: growable buffer: the granularities of address space ({g} bytes) and of exportable memory ({g_types} bytes) do not divide each other",
                ctx.ordinal()
            )));
        }
        let range = VirtualRange::reserve(ctx, round_up(bytes, grain)?)?;
        super::device::check_alignment::<T>(range.base, "growable buffer")?;
        Ok(GrowableBuffer {
            ptr: range.base,
            len: 0,
            range,
            mapped: 0,
            types,
            grain,
            uses: Uses::new(None),
            _elem: std::marker::PhantomData,
        })
    }

    /// A buffer over all of `phys` (imported from another process, say): a range
    /// of its size is reserved, `phys` is mapped there with read-write access for
    /// its device, and every element is usable (`len() == capacity()`, which
    /// does not grow further). Both processes see the same memory: order their
    /// accesses yourself (an IPC event, a message on the socket).
    ///
    /// # Errors
    /// `InvalidArgument` when the size is not a multiple of `T`'s size; the
    /// failing reservation or mapping.
    pub fn from_physical(phys: Arc<PhysicalMemory>) -> Result<GrowableBuffer<T>> {
        let elem = std::mem::size_of::<T>();
        if elem == 0 || !phys.size.is_multiple_of(elem) {
            return Err(invalid_arg(format!(
                "a buffer of {} over {} bytes of physical memory: not a whole number of elements",
                std::any::type_name::<T>(),
                phys.size
            )));
        }
        let ctx = Arc::clone(&phys.ctx);
        let (size, types) = (phys.size, phys.types);
        let mut range = VirtualRange::reserve(&ctx, size)?;
        super::device::check_alignment::<T>(range.base, "growable buffer")?;
        range.map(0, phys, 0, size, &[(&ctx, Access::ReadWrite)])?;
        Ok(GrowableBuffer {
            ptr: range.base,
            len: size / elem,
            grain: range.granularity,
            range,
            mapped: size,
            types,
            uses: Uses::new(None),
            _elem: std::marker::PhantomData,
        })
    }

    /// Number of elements usable now.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no element is usable yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most elements it can grow to (the reserved range).
    pub fn capacity(&self) -> usize {
        self.range.size / std::mem::size_of::<T>().max(1)
    }

    /// Bytes of physical memory mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped
    }

    /// The address of element 0: the same for the buffer's whole life.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The address, by reference (what a kernel argument points at).
    pub(crate) fn device_ptr_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }

    /// The context the memory lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.range.ctx
    }

    /// The reserved range (its mappings, granularity).
    pub fn range(&self) -> &VirtualRange {
        &self.range
    }

    /// Grow to `len` elements: physical memory is mapped (one piece, rounded up
    /// to the granularity) with read-write access for the buffer's device. New
    /// elements hold whatever the memory held. A `len` not above the current one
    /// changes nothing.
    ///
    /// # Errors
    /// `InvalidArgument` past [`GrowableBuffer::capacity`]; the failing
    /// `cuMemCreate`, `cuMemMap` or `cuMemSetAccess` (then the buffer is as
    /// before).
    pub fn grow_to(&mut self, len: usize) -> Result<()> {
        if len <= self.len {
            return Ok(());
        }
        if len > self.capacity() {
            return Err(invalid_arg(format!(
                "growing a buffer to {len} elements: its capacity is {} elements",
                self.capacity()
            )));
        }
        let bytes = byte_len::<T>(len, "growable buffer")?;
        if bytes > self.mapped {
            let piece = round_up(bytes - self.mapped, self.grain)?;
            let ctx = Arc::clone(&self.range.ctx);
            // `piece` is a multiple of the grain, so of the memory's granularity.
            let phys = Arc::new(PhysicalMemory::create(&ctx, piece, self.types)?);
            self.range
                .map(self.mapped, phys, 0, piece, &[(&ctx, Access::ReadWrite)])?;
            self.mapped += piece;
        }
        self.len = len;
        Ok(())
    }

    /// A shared view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceSlice<'_, T>> {
        let (start, len) = bounds(&range, self.len)?;
        Ok(DeviceSlice::from_parts(
            self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
            &self.range.ctx,
            Some(&self.uses),
        ))
    }

    /// A mutable view of `range`.
    ///
    /// # Errors
    /// `InvalidArgument` for a range out of bounds or reversed.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceSliceMut<'_, T>> {
        let (start, len) = bounds(&range, self.len)?;
        Ok(DeviceSliceMut::from_parts(
            self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
            &self.range.ctx,
            Some(&self.uses),
        ))
    }

    /// The mapped bytes as a byte view (for saving and restoring).
    fn bytes(&self) -> DeviceSlice<'_, u8> {
        DeviceSlice::from_parts(self.ptr, self.mapped, &self.range.ctx, Some(&self.uses))
    }

    /// Release the physical memory, keeping the addresses: after every use (the
    /// context's streams and foreign streams are waited for), each mapping is
    /// unmapped and its memory released. With `save`, the contents (every mapped
    /// byte) are copied to pinned host memory on that stream after that wait and
    /// before the unmaps, and [`SleepingBuffer::wake`] copies them back.
    ///
    /// # Errors
    /// A [`SleepError`]: before anything was released (saving or waiting failed)
    /// it holds the buffer as it was ([`SleepState::Awake`]); when an unmap failed
    /// it holds the sleeping buffer, part of whose memory is still mapped (waking
    /// maps only what is missing; dropping unmaps the rest).
    pub fn sleep(
        mut self,
        save: Option<&impl AsStream>,
    ) -> std::result::Result<SleepingBuffer<T>, Box<SleepError<T>>> {
        // Every use first (work on any stream may still write the memory), then
        // the save (which waits for its own copy), then the unmaps.
        if let Err(error) = self.range.wait_for_uses(Some(&self.uses)) {
            return Err(sleep_error(error, SleepState::Awake(self)));
        }
        let saved = match save {
            Some(stream) => match self.save(stream.stream()) {
                Ok(p) => Some(p),
                Err(error) => return Err(sleep_error(error, SleepState::Awake(self))),
            },
            None => None,
        };
        let pieces: Vec<(usize, usize)> = self.range.mappings().collect();
        let result = self.range.unmap_all();
        let sleeping = SleepingBuffer {
            len: self.len,
            mapped: self.mapped,
            pieces,
            saved,
            buffer: self,
        };
        match result {
            Ok(()) => Ok(sleeping),
            Err(error) => Err(sleep_error(error, SleepState::Asleep(sleeping))),
        }
    }

    fn save(&self, stream: &CudaStream) -> Result<PinnedBuffer<u8>> {
        let mut host = PinnedBuffer::<u8>::zeroed(stream, self.mapped.max(1))?;
        if self.mapped > 0 {
            stream.copy_d2h(&self.bytes(), &mut host[..self.mapped])?;
        }
        Ok(host)
    }
}

fn sleep_error<T: DeviceRepr>(error: MetraleError, buffer: SleepState<T>) -> Box<SleepError<T>> {
    Box::new(SleepError { error, buffer })
}

/// A [`GrowableBuffer::sleep`] that did not complete.
#[derive(Debug)]
pub struct SleepError<T: DeviceRepr> {
    /// What failed.
    pub error: MetraleError,
    /// The buffer, awake or asleep.
    pub buffer: SleepState<T>,
}

/// Where a failed sleep left a buffer.
#[derive(Debug)]
pub enum SleepState<T: DeviceRepr> {
    /// Nothing was released.
    Awake(GrowableBuffer<T>),
    /// Asleep, part of the memory possibly still mapped.
    Asleep(SleepingBuffer<T>),
}

/// A [`SleepingBuffer::wake`] that did not complete: the buffer is still asleep
/// (what was mapped again stays mapped; waking again maps the rest).
#[derive(Debug)]
pub struct WakeError<T: DeviceRepr> {
    /// What failed.
    pub error: MetraleError,
    /// The buffer, still asleep.
    pub buffer: SleepingBuffer<T>,
}

/// A [`GrowableBuffer`] whose physical memory was released: its addresses stay
/// reserved, and nothing can reach them until [`SleepingBuffer::wake`].
pub struct SleepingBuffer<T: DeviceRepr> {
    len: usize,
    mapped: usize,
    /// `(offset, size)` of each mapping it had.
    pieces: Vec<(usize, usize)>,
    saved: Option<PinnedBuffer<u8>>,
    /// The buffer (its `len` is not usable while asleep: no slice can be made).
    buffer: GrowableBuffer<T>,
}

impl<T: DeviceRepr> SleepingBuffer<T> {
    /// The length it wakes with.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it wakes empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address it wakes at.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.buffer.ptr
    }

    /// Whether the contents were saved (and will be restored).
    pub fn is_saved(&self) -> bool {
        self.saved.is_some()
    }

    /// Map new physical memory at the same addresses (the same pieces as before)
    /// and, when the contents were saved, copy them back on `stream` (waiting for
    /// the copy). Unsaved contents are whatever the new memory holds.
    ///
    /// # Errors
    /// A [`WakeError`] holding the buffer, still asleep, for the failing
    /// allocation, mapping or copy.
    pub fn wake(
        mut self,
        stream: &impl AsStream,
    ) -> std::result::Result<GrowableBuffer<T>, Box<WakeError<T>>> {
        let stream = stream.stream();
        if let Err(error) = self.map_missing() {
            return Err(Box::new(WakeError {
                error,
                buffer: self,
            }));
        }
        if let Err(error) = self.restore(stream) {
            return Err(Box::new(WakeError {
                error,
                buffer: self,
            }));
        }
        let SleepingBuffer {
            len,
            mapped,
            mut buffer,
            ..
        } = self;
        buffer.len = len;
        buffer.mapped = mapped;
        Ok(buffer)
    }

    /// Copy the saved contents back (the memory is mapped).
    fn restore(&self, stream: &CudaStream) -> Result<()> {
        let Some(saved) = &self.saved else {
            return Ok(());
        };
        if self.mapped == 0 {
            return Ok(());
        }
        let src = saved
            .get(..self.mapped)
            .ok_or_else(|| invalid_arg("waking a buffer: the saved contents are short"))?;
        let mut bytes = DeviceSliceMut::<u8>::from_parts(
            self.buffer.ptr,
            self.mapped,
            &self.buffer.range.ctx,
            Some(&self.buffer.uses),
        );
        stream.copy_h2d(src, &mut bytes)
    }

    fn map_missing(&mut self) -> Result<()> {
        let ctx = Arc::clone(&self.buffer.range.ctx);
        for &(offset, size) in &self.pieces {
            if self.buffer.range.is_mapped(offset, size) {
                continue;
            }
            // The pieces were made with this granularity before.
            let phys = Arc::new(PhysicalMemory::create(&ctx, size, self.buffer.types)?);
            self.buffer
                .range
                .map(offset, phys, 0, size, &[(&ctx, Access::ReadWrite)])?;
        }
        Ok(())
    }
}

impl<T: DeviceRepr> fmt::Debug for SleepingBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SleepingBuffer")
            .field("device", &self.buffer.range.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.buffer.ptr))
            .field("len", &self.len)
            .field("saved", &self.saved.is_some())
            .finish()
    }
}

impl<T: DeviceRepr> fmt::Debug for GrowableBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrowableBuffer")
            .field("device", &self.range.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("mapped_bytes", &self.mapped)
            .finish()
    }
}

impl<T: DeviceRepr> Drop for GrowableBuffer<T> {
    fn drop(&mut self) {
        // The range's own Drop would not know the foreign streams.
        self.range.release(Some(&self.uses));
    }
}

impl<T: DeviceRepr> sealed::Sealed for GrowableBuffer<T> {}
impl<T: DeviceRepr> DeviceMemory<T> for GrowableBuffer<T> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn memory_context(&self) -> &Arc<CudaContext> {
        &self.range.ctx
    }
    fn uses(&self) -> Option<&Uses> {
        Some(&self.uses)
    }
    fn describe(&self) -> String {
        format!(
            "growable buffer {:#x} ({} x {})",
            self.ptr,
            self.len,
            std::any::type_name::<T>()
        )
    }
}
impl<T: DeviceRepr> DeviceMemoryMut<T> for GrowableBuffer<T> {}
