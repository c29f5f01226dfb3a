//! [`PhysicalMemory`]: a handle to physical device memory (`cuMemCreate`),
//! mapped into ranges, exportable as its handle types allow.

use std::fmt;
use std::sync::Arc;

use metrale_cuda_sys::CUmemGenericAllocationHandle;

use super::{check_multiple, granularity, props, HandleTypes};
use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, Result};

/// Physical device memory (`cuMemCreate`, or imported from another process),
/// released (`cuMemRelease`) on drop. Map it into a [`VirtualRange`](super::VirtualRange) to use it;
/// the driver keeps mapped memory alive until it is unmapped.
pub struct PhysicalMemory {
    pub(super) handle: CUmemGenericAllocationHandle,
    pub(in crate::memory) size: usize,
    pub(in crate::memory) types: HandleTypes,
    pub(in crate::memory) ctx: Arc<CudaContext>,
    pub(super) made: Generation,
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
