//! Green contexts (CUDA 12.4+): a device's streaming multiprocessors as a
//! resource ([`SmResource`]), split into groups ([`SmResource::split_by_count`]),
//! and [`GreenContext`]s that run work on one group only. Streams on a green
//! context are ordinary [`CudaStream`](crate::CudaStream)s
//! ([`CudaStream::on_green_context`](crate::CudaStream::on_green_context)).
//!
//! Invariants:
//! - A green context belongs to its device's primary context
//!   ([`CudaContext`]): its streams carry that context, so memory, kernels, events
//!   and graphs of the device are used with them as with any stream of the device,
//!   and every cross-device check applies.
//! - Each stream holds its green context (an `Arc`), so the green context is
//!   destroyed only after its last stream (`cuGreenCtxDestroy` through the release
//!   rule; a reset or shut-down driver is nothing left to destroy).
//! - A driver without the API gives the typed missing-symbol error naming the call.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use metrale_cuda_sys::{self as sys, CUdevResource, CUdevResourceDesc, CUgreenCtx};

use crate::context::{AsContext, CudaContext, Generation};
use crate::error::{cu, invalid_arg, Result};

/// The SM resource type's value.
const SM: sys::CUdevResourceType = sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM;

/// A set of a device's streaming multiprocessors: the whole device
/// ([`SmResource::of_device`]), a group of a split, or a green context's.
#[derive(Clone)]
pub struct SmResource {
    raw: CUdevResource,
    ctx: Arc<CudaContext>,
}

impl fmt::Debug for SmResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmResource")
            .field("device", &self.ctx.ordinal())
            .field("sm_count", &self.sm_count())
            .field("min_partition_size", &self.min_partition_size())
            .field("coscheduled_alignment", &self.coscheduled_alignment())
            .finish()
    }
}

/// An all-zero `CUdevResource`, for the driver to fill.
fn empty_resource() -> CUdevResource {
    // SAFETY: CUdevResource is plain C data (integers, bytes and a union of
    // them); all zeros is a valid value of each.
    unsafe { std::mem::zeroed() }
}

impl SmResource {
    /// Every SM of the device of `ctx` (`cuDeviceGetDevResource`).
    ///
    /// # Errors
    /// The driver's status naming the device; a missing-symbol error before CUDA
    /// 12.4.
    pub fn of_device(ctx: &impl AsContext) -> Result<SmResource> {
        let ctx = ctx.context();
        let mut raw = empty_resource();
        ctx.call(
            || format!("device {}: reading its SM resource", ctx.ordinal()),
            // SAFETY: writes one CUdevResource of a valid device.
            |d| unsafe { cu!(d, cuDeviceGetDevResource(ctx.device(), &mut raw, SM)) },
        )?;
        Ok(SmResource {
            raw,
            ctx: Arc::clone(ctx),
        })
    }

    fn sm(&self) -> sys::CUdevSmResource {
        // SAFETY: every resource of this type is an SM resource (the driver filled
        // it for CU_DEV_RESOURCE_TYPE_SM), so `sm` is the union's live field.
        unsafe { self.raw.__bindgen_anon_1.sm }
    }

    /// SMs in the set.
    pub fn sm_count(&self) -> u32 {
        self.sm().smCount
    }

    /// The smallest group a split makes on this device.
    pub fn min_partition_size(&self) -> u32 {
        self.sm().minSmPartitionSize
    }

    /// The granularity group sizes are rounded up to.
    pub fn coscheduled_alignment(&self) -> u32 {
        self.sm().smCoscheduledAlignment
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The driver's structure.
    pub fn as_raw(&self) -> &CUdevResource {
        &self.raw
    }

    /// Split into at most `groups` groups of at least `min_count` SMs each
    /// (`cuDevSmResourceSplitByCount`); the driver rounds the size up to its
    /// granularity and may make fewer groups. What no group took is the split's
    /// remainder.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for zero
    /// groups, or more SMs asked than the set has, before the driver; the
    /// driver's status otherwise.
    pub fn split_by_count(&self, groups: u32, min_count: u32) -> Result<SmSplit> {
        if groups == 0 {
            return Err(invalid_arg("SM split: at least one group is needed"));
        }
        if min_count > self.sm_count() {
            return Err(invalid_arg(format!(
                "SM split: groups of at least {min_count} SMs asked, the set has {}",
                self.sm_count()
            )));
        }
        // At most one group per SM: bounds the buffer the driver fills.
        let cap = groups.min(self.sm_count().max(1));
        let mut out = vec![empty_resource(); cap as usize];
        let mut n = cap;
        let mut remaining = empty_resource();
        let ctx = &self.ctx;
        ctx.call(
            || {
                format!(
                    "device {}: splitting {} SMs into {groups} groups of {min_count}",
                    ctx.ordinal(),
                    self.sm_count()
                )
            },
            // SAFETY: `out` holds `n` resources for the driver to fill, the input
            // and the remainder are valid CUdevResources; flags 0.
            |d| unsafe {
                cu!(
                    d,
                    cuDevSmResourceSplitByCount(
                        out.as_mut_ptr(),
                        &mut n,
                        &self.raw,
                        &mut remaining,
                        0,
                        min_count
                    )
                )
            },
        )?;
        out.truncate(n.min(cap) as usize);
        Ok(SmSplit {
            groups: out
                .into_iter()
                .map(|raw| SmResource {
                    raw,
                    ctx: Arc::clone(ctx),
                })
                .collect(),
            remaining: SmResource {
                raw: remaining,
                ctx: Arc::clone(ctx),
            },
            min_count,
        })
    }
}

/// What [`SmResource::split_by_count`] made.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SmSplit {
    /// The groups, each of the same (rounded-up) size.
    pub groups: Vec<SmResource>,
    /// The SMs no group took (possibly none).
    pub remaining: SmResource,
    /// The minimum size asked for.
    pub min_count: u32,
}

/// A green context: work on its streams runs on its SMs only.
pub struct GreenContext {
    raw: CUgreenCtx,
    ctx: Arc<CudaContext>,
    made: Generation,
    /// Held around every driver call on the green context made through `&self`
    /// (`cuGreenCtxStreamCreate`, `cuGreenCtxGetDevResource`): the driver does
    /// not synchronize API calls on one green context from several threads.
    calls: Mutex<()>,
}

impl fmt::Debug for GreenContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GreenContext")
            .field("device", &self.ctx.ordinal())
            .field("raw", &self.raw)
            .finish()
    }
}

// SAFETY: the handle is written once and only read; the driver's green-context
// calls metrale makes (stream creation, resource query, destroy) take the handle
// and do not depend on the calling thread or on it being current.
unsafe impl Send for GreenContext {}
// SAFETY: as above. The driver has no internal synchronization for calls on one
// green context from several threads, so every call made through `&self`
// (stream creation, resource query) holds `calls`, one at a time; destroy needs
// `&mut self` (Drop).
unsafe impl Sync for GreenContext {}

impl GreenContext {
    /// A green context over `resources` (SM sets of one device, usually one group
    /// of a split): `cuDevResourceGenerateDesc`, then `cuGreenCtxCreate` with its
    /// default stream.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for no
    /// resources or resources of several devices; the driver's status naming
    /// the device; a missing-symbol error before CUDA 12.4.
    pub fn new(resources: &[&SmResource]) -> Result<Arc<GreenContext>> {
        let Some(first) = resources.first() else {
            return Err(invalid_arg("green context: no SM resources given"));
        };
        let ctx = &first.ctx;
        if let Some(other) = resources.iter().find(|r| !Arc::ptr_eq(&r.ctx, ctx)) {
            return Err(invalid_arg(format!(
                "green context: SM resources of device {} and device {}",
                ctx.ordinal(),
                other.ctx.ordinal()
            )));
        }
        let Ok(count) = u32::try_from(resources.len()) else {
            return Err(invalid_arg(format!(
                "green context: {} SM resources given; the driver takes at most {}",
                resources.len(),
                u32::MAX
            )));
        };
        // For the error text only: summed in u64, which cannot overflow (at most
        // u32::MAX resources of at most u32::MAX SMs each); the driver judges
        // whether the sum makes sense.
        let sms: u64 = resources.iter().map(|r| u64::from(r.sm_count())).sum();
        let mut raws: Vec<CUdevResource> = resources.iter().map(|r| r.raw).collect();
        let mut desc: CUdevResourceDesc = std::ptr::null_mut();
        let mut raw: CUgreenCtx = std::ptr::null_mut();
        let flags = sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM.0;
        ctx.call(
            || {
                format!(
                    "device {}: creating a green context of {sms} SMs",
                    ctx.ordinal()
                )
            },
            |d| {
                // SAFETY: `raws` holds `count` resources the driver made; writes
                // one descriptor.
                unsafe {
                    cu!(
                        d,
                        cuDevResourceGenerateDesc(&mut desc, raws.as_mut_ptr(), count)
                    )
                }?;
                // SAFETY: a descriptor the driver just made, a valid device, the
                // flag the driver requires; writes one handle.
                unsafe { cu!(d, cuGreenCtxCreate(&mut raw, desc, ctx.device(), flags)) }
            },
        )?;
        Ok(Arc::new(GreenContext {
            raw,
            made: ctx.generation(),
            ctx: Arc::clone(ctx),
            calls: Mutex::new(()),
        }))
    }

    /// The SMs the driver gave the green context (`cuGreenCtxGetDevResource`).
    ///
    /// # Errors
    /// The driver's status naming the green context.
    pub fn sm_resource(&self) -> Result<SmResource> {
        let mut raw = empty_resource();
        let g = self.raw;
        let one_call = self.lock_calls();
        self.ctx.call(
            || format!("green context {g:p} on device {}", self.ctx.ordinal()),
            // SAFETY: a live green context (held by `self`), no other call on it
            // meanwhile (`one_call`); writes one resource.
            |d| unsafe { cu!(d, cuGreenCtxGetDevResource(g, &mut raw, SM)) },
        )?;
        drop(one_call);
        Ok(SmResource {
            raw,
            ctx: Arc::clone(&self.ctx),
        })
    }

    /// SMs of the green context, read back from the driver.
    ///
    /// # Errors
    /// As [`GreenContext::sm_resource`].
    pub fn sm_count(&self) -> Result<u32> {
        self.sm_resource().map(|r| r.sm_count())
    }

    /// The device's primary context, which the green context's streams carry.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The driver's handle.
    pub fn raw(&self) -> CUgreenCtx {
        self.raw
    }

    /// Held around a driver call on the green context (the driver does not
    /// synchronize calls on one green context from several threads).
    pub(crate) fn lock_calls(&self) -> MutexGuard<'_, ()> {
        self.calls.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The generation of the device's context the green context was made in.
    pub(crate) fn made(&self) -> Generation {
        self.made
    }
}

impl AsContext for GreenContext {
    fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for GreenContext {
    fn drop(&mut self) {
        let raw = self.raw;
        self.ctx.release_with(
            self.made,
            format_args!(
                "destroying green context {raw:p} on device {}",
                self.ctx.ordinal()
            ),
            |d, failures| {
                // SAFETY: made by metrale, destroyed once; every stream of it held
                // this value and is gone.
                if let Err(e) = unsafe { cu!(d, cuGreenCtxDestroy(raw)) } {
                    failures.push(e);
                }
            },
        );
    }
}
