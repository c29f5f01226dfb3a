//! The one launch path: the checks before the driver (context, shape,
//! attributes, argument layout, shared-memory opt-in) and the launch call,
//! plain or extended; `CudaStream::launch` and its raw forms.

use std::ffi::{c_uint, c_void};
use std::sync::Arc;

use metrale_cuda_sys::{self as sys};

use crate::context::CudaContext;
use crate::error::{cu, ErrorKind, LaunchFailure, LaunchShape, MetraleError, Result};
use crate::function::{keep_for_capture, CudaFunction, KernelInfo, KernelTable};
use crate::lifetime::captures_in_progress;
use crate::stream::CudaStream;

use super::config::{LaunchAttributes, LaunchConfig};
use super::{ArgLayout, KernelArgs};

/// The shape of a launch as an error reports it.
#[cold]
pub(crate) fn shape(cfg: &LaunchConfig, attrs: Option<&LaunchAttributes>) -> LaunchShape {
    let (g, b) = (cfg.grid_dim, cfg.block_dim);
    LaunchShape {
        grid: [g.0, g.1, g.2],
        block: [b.0, b.1, b.2],
        shared_mem_bytes: cfg.shared_mem_bytes,
        attributes: attrs.map(ToString::to_string).unwrap_or_default(),
    }
}

#[cold]
fn refused(
    info: &KernelInfo,
    cfg: &LaunchConfig,
    attrs: Option<&LaunchAttributes>,
    why: String,
) -> MetraleError {
    ErrorKind::KernelLaunch {
        kernel: info.name.to_string(),
        shape: shape(cfg, attrs),
        failure: LaunchFailure::Refused(why),
    }
    .into()
}

/// Compare typed arguments with the kernel's layout (when the driver can report
/// one; a failure to read it refuses the launch and is tried again next time):
/// the count and each size. The context must be current.
///
/// Alignment is not compared: the `void**` launch copies each argument's bytes to
/// the offset the driver chose, so the host-side alignment never matters, and the
/// driver's offsets are not always multiples of the parameter's declared alignment
/// (on the H200, driver 580, a `.align 64` tensor map parameter is reported at
/// offset 48).
#[inline]
pub(crate) fn check_args(
    d: &'static sys::Driver,
    info: &KernelInfo,
    cfg: &LaunchConfig,
    attrs: Option<&LaunchAttributes>,
    args: ArgLayout<'_>,
) -> Result<()> {
    let params = match info.layout(d) {
        Ok(Some(params)) => params,
        Ok(None) => return Ok(()),
        Err(e) => return Err(e.launch(&info.name, shape(cfg, attrs))),
    };
    let sizes = args.sizes();
    if params.len() != sizes.len() {
        return Err(mismatch(info, None, params.len(), sizes.len()));
    }
    for (i, (p, &given)) in params.iter().zip(sizes).enumerate() {
        if p.size != given {
            return Err(mismatch(info, Some(i), p.size, given));
        }
    }
    Ok(())
}

#[cold]
fn mismatch(
    info: &KernelInfo,
    index: Option<usize>,
    expected: usize,
    given: usize,
) -> MetraleError {
    ErrorKind::ArgumentMismatch {
        kernel: info.name.to_string(),
        index,
        expected,
        given,
    }
    .into()
}

#[cold]
fn wrong_device(info: &KernelInfo, kernel_ctx: &CudaContext, stream: &CudaStream) -> MetraleError {
    ErrorKind::WrongDevice {
        what: format!("kernel '{}'", info.name),
        belongs_to: kernel_ctx.ordinal(),
        used_with: "the stream".to_owned(),
        used_device: stream.ordinal(),
    }
    .into()
}

/// Check a launch against the device (shape, attributes, typed argument sizes when
/// given) and opt the kernel in to the dynamic shared memory it needs. The context
/// must be current. Also used by graph node updates.
#[inline]
pub(crate) fn prepare(
    ctx: &CudaContext,
    info: &KernelInfo,
    cfg: &LaunchConfig,
    args: Option<ArgLayout<'_>>,
) -> Result<()> {
    let attrs = cfg.extended();
    let limits = ctx.limits();
    if let Err(why) = cfg.check_limits(limits) {
        return Err(refused(info, cfg, attrs, why));
    }
    if let Some(a) = attrs {
        if let Err(why) = a.check(cfg, limits) {
            return Err(refused(info, cfg, attrs, why));
        }
    }
    if let Some(args) = args {
        check_args(ctx.driver(), info, cfg, attrs, args)?;
    }
    if !info.smem_ready(cfg.shared_mem_bytes) {
        info.opt_in(ctx.driver(), cfg.shared_mem_bytes)
            .map_err(|e| e.launch(&info.name, shape(cfg, attrs)))?;
    }
    Ok(())
}

/// The one launch path: the kernel `info` (of context `kernel_ctx`) on `stream`.
///
/// # Safety
/// `params` holds one pointer per kernel parameter, each to a value of the
/// parameter's type, valid for this call; what the kernel reads and writes stays
/// valid until it finishes.
#[inline]
pub(crate) unsafe fn launch_kernel(
    stream: &CudaStream,
    table: &Arc<KernelTable>,
    info: &KernelInfo,
    cfg: &LaunchConfig,
    args: Option<ArgLayout<'_>>,
    params: *mut *mut c_void,
) -> Result<()> {
    let attrs = cfg.extended();
    let ctx = stream.context();
    if !Arc::ptr_eq(ctx, table.ctx()) {
        return Err(wrong_device(info, table.ctx(), stream));
    }

    if let Err(e) = ctx.bind_fast() {
        return Err(e.launch(&info.name, shape(cfg, attrs)));
    }
    prepare(ctx, info, cfg, args)?;
    let d = ctx.driver();
    let (g, b) = (cfg.grid_dim, cfg.block_dim);
    let launched = match attrs {
        // SAFETY: the caller's contract covers the parameters; the handle is live (its
        // table is held by the caller), the stream is of this current context and the
        // shape was checked.
        None => unsafe {
            cu!(
                d,
                cuLaunchKernel(
                    info.raw,
                    g.0,
                    g.1,
                    g.2,
                    b.0,
                    b.1,
                    b.2,
                    cfg.shared_mem_bytes,
                    stream.raw(),
                    params,
                    std::ptr::null_mut()
                )
            )
        },
        Some(a) => {
            let (mut driver_attrs, n) = a.to_driver();
            let config = sys::CUlaunchConfig {
                gridDimX: g.0,
                gridDimY: g.1,
                gridDimZ: g.2,
                blockDimX: b.0,
                blockDimY: b.1,
                blockDimZ: b.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: stream.raw(),
                attrs: driver_attrs.as_mut_ptr(),
                numAttrs: n as c_uint,
            };
            // SAFETY: as above; `config` and its attribute array live on this frame.
            unsafe {
                cu!(
                    d,
                    cuLaunchKernelEx(&config, info.raw, params, std::ptr::null_mut())
                )
            }
        }
    };
    if captures_in_progress() {
        // The launch may have been recorded into a graph (a capture that began
        // before it returned): its code must outlive this handle until the capture
        // ends and the graph holds it. A capture that already ended found the code
        // through the table, which is alive here.
        keep_for_capture(table);
    }
    launched.map_err(|e| e.launch(&info.name, shape(cfg, attrs)))
}

impl CudaStream {
    /// Launch `f` with typed arguments: a tuple of values and device memory
    /// (`(&a, &b, &mut c, n)`), packed on the stack, or a [`KernelArgList`](crate::KernelArgList) built
    /// at run time (`&list`). The argument count and each argument's size are
    /// checked against the kernel's parameter layout before the driver is called
    /// (where the driver reports it, CUDA 12.4+), as are the launch shape and the
    /// stream's device. Alignment is not compared: each argument's bytes are
    /// copied to the offset the driver reports for its parameter.
    ///
    /// ```no_run
    /// # use metrale_runtime::*;
    /// # fn main() -> Result<()> {
    /// # let reg = MetraleRegistry::load(0, &[("kernels", b"...")])?;
    /// let vec_add = reg.function("kernels", "vec_add")?;
    /// let s = reg.stream();
    /// let a = DeviceBuffer::from_host(&s, &[1.0f32; 1024])?;
    /// let b = DeviceBuffer::from_host(&s, &[2.0f32; 1024])?;
    /// let mut c = DeviceBuffer::<f32>::alloc(&s, 1024)?;
    /// // SAFETY: vec_add(const float*, const float*, float*, unsigned) over 1024 elements.
    /// unsafe { s.launch(&vec_add, LaunchConfig::for_num_elems(1024, 256)?, (&a, &b, &mut c, 1024u32))? };
    /// # Ok(()) }
    /// ```
    ///
    /// # Safety
    /// The arguments must mean what the kernel expects (a pointer where it takes a
    /// pointer to enough elements of the right type, ...): sizes are checked, meaning
    /// is not. Memory the kernel reads or writes must stay valid until it finishes.
    ///
    /// # Errors
    /// [`ErrorKind::ArgumentMismatch`] (count or a size, naming the parameter),
    /// [`ErrorKind::WrongDevice`], [`ErrorKind::KernelLaunch`] for an
    /// impossible shape or the driver's refusal.
    #[inline]
    pub unsafe fn launch<A: KernelArgs<K>, K>(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: A,
    ) -> Result<()> {
        args.with_params(|p| {
            // SAFETY: the packed pointers point into `args`, alive here; the rest is
            // the caller's contract.
            unsafe {
                launch_kernel(
                    self,
                    f.table(),
                    f.info(),
                    &cfg,
                    Some(args.layout()),
                    p.as_mut_ptr(),
                )
            }
        })
    }

    /// Launch with the driver's `void*` parameter array, built by hand. The
    /// library cannot know the arguments' sizes here: prefer the typed
    /// [`CudaStream::launch`], which checks them.
    ///
    /// # Safety
    /// `params` holds one pointer per kernel parameter, each to a value of the
    /// parameter's type, valid for this call; as [`CudaStream::launch`] otherwise.
    ///
    /// # Errors
    /// As [`CudaStream::launch`], without the argument check.
    #[inline]
    pub unsafe fn launch_raw(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { launch_kernel(self, f.table(), f.info(), &cfg, None, params.as_mut_ptr()) }
    }
}
