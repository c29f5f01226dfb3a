//! [`Blas`]: plain cuBLAS for the engines that use it: `gemm_ex`, strided
//! batched and grouped batched GEMMs (column-major, as cuBLAS is), checked as
//! the plans are, on the same per-stream workspaces.
//!
//! Invariants:
//! - The cuBLAS handle's stream, workspace, math mode and pointer mode are
//!   handle state: they are set and used under one lock, so a call never runs
//!   with another thread's settings. The workspace is set after the stream
//!   (`cublasSetStream` forgets it) and is always the stream's own.
//! - Every call's shapes, leading dimensions, types and buffers are checked by
//!   the plans' rules (a [`MatmulDesc`] of the same problem) before cuBLAS.
//! - `cublasGemmGroupedBatchedEx` is called only on cuBLAS 12.5 or newer; an
//!   older library is [`BlasError::TooOld`], a missing symbol its typed error.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use metrale_cuda_sys::cublas::{
    self as raw, cublasGemmAlgo_t, cublasHandle_t, cublasPointerMode_t, cublasStatus_t,
    CUstream_st, Cublas,
};
use metrale_cuda_sys::LibraryMissingSymbol;

use crate::context::{AsContext, CudaContext, Generation};
use crate::error::Result;
use crate::memory::{note_use, DeviceMemory, DeviceMemoryMut};
use crate::stream::{CudaStream, Section};

use super::check::{check, MatmulExtras, Operand};
use super::error::{missing, plain_call_error, refused, unavailable};
use super::shape::{GemmShape, MathMode};
use super::workspace::{Workspace, Workspaces};
use super::{scale_bytes, BlasElement, ComputeType};

pub(super) struct State {
    pub(super) raw: cublasHandle_t,
    stream: raw::cudaStream_t,
    workspace: *mut c_void,
    pointer_mode: cublasPointerMode_t,
}

pub(super) struct PlainInner {
    pub(super) lib: &'static Cublas,
    pub(super) ctx: Arc<CudaContext>,
    made: Generation,
    state: Mutex<State>,
    pub(super) workspaces: Workspaces,
}

// SAFETY: the raw handle and the last stream and workspace set on it are used
// only under the state lock; cuBLAS lets any thread use a handle.
unsafe impl Send for PlainInner {}
// SAFETY: as for Send.
unsafe impl Sync for PlainInner {}

impl Drop for PlainInner {
    fn drop(&mut self) {
        let raw = self
            .state
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .raw;
        let lib = self.lib;
        self.ctx.release_with(
            self.made,
            format_args!("destroying the cuBLAS handle of device {}", self.ctx.ordinal()),
            |_, _| match lib.cublasDestroy_v2() {
                Ok(f) => {
                    // SAFETY: made by cublasCreate_v2, destroyed once.
                    let status = unsafe { f(raw) };
                    if !status.is_success() {
                        crate::error::report_line(format_args!(
                            "destroying the cuBLAS handle {raw:p}: cublasDestroy_v2 failed: {status}"
                        ));
                    }
                }
                Err(_) => crate::error::report_line(format_args!(
                    "the cuBLAS handle {raw:p}: leaked, the library lacks cublasDestroy_v2"
                )),
            },
        );
    }
}

/// A plain cuBLAS handle of one device (feature `cublas`): `gemm_ex`, strided
/// and grouped batched GEMMs, each stream with its own workspace. Cloning is
/// cheap and shares the handle.
///
/// ```no_run
/// use metrale_runtime::blas::{Blas, ComputeType, GemmShape};
/// use metrale_runtime::{context, CudaStream, DeviceBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let ctx = context(0)?;
/// let stream = CudaStream::new(&ctx)?;
/// let blas = Blas::new(&ctx)?;
/// let a = DeviceBuffer::from_host(&stream, &[1.0f32; 8 * 4])?;
/// let b = DeviceBuffer::from_host(&stream, &[1.0f32; 4 * 2])?;
/// let mut c = DeviceBuffer::<f32>::zeroed(&stream, 8 * 2)?;
/// blas.gemm_ex(&stream, &GemmShape::new(8, 2, 4), 1.0, &a, &b, 0.0, &mut c, ComputeType::F32)?;
/// assert!(stream.to_vec(&c)?.iter().all(|&x| x == 4.0));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Blas {
    pub(super) inner: Arc<PlainInner>,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas")
            .field("device", &self.inner.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl Blas {
    /// A cuBLAS handle for `ctx`'s device with 32 MiB workspaces per stream.
    ///
    /// # Errors
    /// The library missing, `cublasCreate_v2`'s failure.
    pub fn new(ctx: &impl AsContext) -> Result<Blas> {
        Blas::with_workspace_bytes(ctx, 32 << 20)
    }

    /// A cuBLAS handle whose per-stream workspaces have `bytes` bytes.
    ///
    /// # Errors
    /// As [`Blas::new`].
    pub fn with_workspace_bytes(ctx: &impl AsContext, bytes: usize) -> Result<Blas> {
        let ctx = ctx.context();
        let lib = raw::cublas().map_err(unavailable)?;
        let subject = || format!("device {}: creating a cuBLAS handle", ctx.ordinal());
        ctx.bind_fast().map_err(|e| e.about(subject()))?;
        let create = lib.cublasCreate_v2().map_err(|m| missing(m, subject()))?;
        let mut handle: cublasHandle_t = std::ptr::null_mut();
        // SAFETY: writes one handle; the device's context is current, so the
        // handle is made on its device.
        let status = unsafe { create(&mut handle) };
        if !status.is_success() {
            return Err(plain_call_error(lib, "cublasCreate_v2", status, subject()));
        }
        Ok(Blas {
            inner: Arc::new(PlainInner {
                lib,
                ctx: Arc::clone(ctx),
                made: ctx.generation(),
                state: Mutex::new(State {
                    raw: handle,
                    stream: std::ptr::null_mut(),
                    workspace: std::ptr::null_mut(),
                    pointer_mode: cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST,
                }),
                workspaces: Workspaces::new(bytes),
            }),
        })
    }

    /// The loaded cuBLAS's version.
    pub fn version(&self) -> Option<crate::Version> {
        self.inner.lib.version().map(crate::Version::from)
    }

    /// Make `stream`'s workspace now, so the stream can be captured.
    ///
    /// # Errors
    /// Another device's stream, a stream being captured, the allocation.
    pub fn prepare(&self, stream: &CudaStream) -> Result<()> {
        self.inner
            .workspaces
            .prepare(&self.inner.ctx, stream, "cuBLAS")
            .map(|_| ())
    }

    /// Forget `stream`'s workspace; whether it had one.
    pub fn release_workspace(&self, stream: &CudaStream) -> bool {
        self.inner.workspaces.release(stream)
    }

    /// Set the math mode (`cublasSetMathMode`) for later calls.
    ///
    /// # Errors
    /// The call's failure.
    pub fn set_math_mode(&self, mode: MathMode) -> Result<()> {
        let state = self.lock();
        let raw = state.raw;
        self.call(
            "cublasSetMathMode",
            || self.subject(),
            |lib| {
                let f = lib.cublasSetMathMode()?;
                // SAFETY: a live handle, under its lock.
                Ok(unsafe { f(raw, mode.raw()) })
            },
        )
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn subject(&self) -> String {
        format!("device {} cuBLAS handle", self.inner.ctx.ordinal())
    }

    /// Bind the context and make one cuBLAS call: the room's one path into
    /// cuBLAS.
    pub(super) fn call<S: std::fmt::Display>(
        &self,
        call: &'static str,
        subject: impl FnOnce() -> S,
        f: impl FnOnce(&'static Cublas) -> std::result::Result<cublasStatus_t, LibraryMissingSymbol>,
    ) -> Result<()> {
        let lib = self.inner.lib;
        if let Err(e) = self.inner.ctx.bind_fast() {
            return Err(e.about(subject()));
        }
        match f(lib) {
            Ok(s) if s.is_success() => Ok(()),
            Ok(s) => Err(plain_call_error(lib, call, s, subject())),
            Err(m) => Err(missing(m, subject())),
        }
    }

    /// The stream's workspace and the section to call in (refused in capture
    /// when not made; held by a capture that records it), after the device
    /// check.
    pub(super) fn workspace_for<'s>(
        &self,
        stream: &'s CudaStream,
        call: &'static str,
    ) -> Result<(Section<'s>, Arc<Workspace>)> {
        let inner = &*self.inner;
        if !stream.context().same(&inner.ctx) {
            return Err(refused(
                call,
                self.subject(),
                format!(
                    "the stream is of device {}, the handle of device {}",
                    stream.ordinal(),
                    inner.ctx.ordinal()
                ),
            ));
        }
        inner
            .workspaces
            .for_call(&inner.ctx, stream, call, || self.subject())
    }

    /// Under the state lock: point the handle at `stream`, its workspace and
    /// `mode`.
    pub(super) fn configure(
        &self,
        state: &mut State,
        stream: &CudaStream,
        ws: &Workspace,
        mode: cublasPointerMode_t,
    ) -> Result<()> {
        let raw = state.raw;
        let s = stream.raw().cast::<CUstream_st>();
        if state.stream != s {
            self.call(
                "cublasSetStream_v2",
                || self.subject(),
                |lib| {
                    let f = lib.cublasSetStream_v2()?;
                    // SAFETY: a live handle and stream of its device, under the lock.
                    Ok(unsafe { f(raw, s) })
                },
            )?;
            state.stream = s;
            state.workspace = std::ptr::null_mut();
        }
        if state.workspace != ws.ptr() {
            let (p, n) = (ws.ptr(), ws.size());
            self.call(
                "cublasSetWorkspace_v2",
                || self.subject(),
                |lib| {
                    let f = lib.cublasSetWorkspace_v2()?;
                    // SAFETY: the stream's own workspace, `n` bytes, 256-aligned
                    // (cuMemAlloc); it lives while the handle lists it, or the
                    // graph capturing it holds it.
                    Ok(unsafe { f(raw, p, n) })
                },
            )?;
            state.workspace = p;
        }
        if state.pointer_mode != mode {
            self.call(
                "cublasSetPointerMode_v2",
                || self.subject(),
                |lib| {
                    let f = lib.cublasSetPointerMode_v2()?;
                    // SAFETY: a live handle, under the lock.
                    Ok(unsafe { f(raw, mode) })
                },
            )?;
            state.pointer_mode = mode;
        }
        Ok(())
    }

    /// `C = alpha * op(A) op(B) + beta * C` (`cublasGemmEx`), column-major,
    /// checked first; alpha and beta from the host.
    ///
    /// # Errors
    /// A refused shape, leading dimension, type, length, device or overlap;
    /// the call's failure.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_ex<A: BlasElement, B: BlasElement, C: BlasElement>(
        &self,
        stream: &CudaStream,
        shape: &GemmShape,
        alpha: f32,
        a: &impl DeviceMemory<A>,
        b: &impl DeviceMemory<B>,
        beta: f32,
        c: &mut impl DeviceMemoryMut<C>,
        compute: ComputeType,
    ) -> Result<()> {
        let call = if shape.batch == 1 {
            "cublasGemmEx"
        } else {
            "cublasGemmStridedBatchedEx"
        };
        self.gemm(
            stream,
            call,
            shape,
            Scalars::Host(alpha, beta),
            a,
            b,
            c,
            compute,
        )
    }

    /// A strided batch of GEMMs (`cublasGemmStridedBatchedEx`); `shape.batch`
    /// and its strides say the batch.
    ///
    /// # Errors
    /// As [`Blas::gemm_ex`].
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_strided_batched<A: BlasElement, B: BlasElement, C: BlasElement>(
        &self,
        stream: &CudaStream,
        shape: &GemmShape,
        alpha: f32,
        a: &impl DeviceMemory<A>,
        b: &impl DeviceMemory<B>,
        beta: f32,
        c: &mut impl DeviceMemoryMut<C>,
        compute: ComputeType,
    ) -> Result<()> {
        self.gemm(
            stream,
            "cublasGemmStridedBatchedEx",
            shape,
            Scalars::Host(alpha, beta),
            a,
            b,
            c,
            compute,
        )
    }

    /// [`Blas::gemm_strided_batched`] with alpha and beta read from device
    /// memory when the GEMM runs (pointer mode device; one f32 each): a
    /// captured graph then takes new scalars without an update.
    ///
    /// # Errors
    /// As [`Blas::gemm_ex`]; an f16 compute type (its scalars are f16).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_device_scalars<A: BlasElement, B: BlasElement, C: BlasElement>(
        &self,
        stream: &CudaStream,
        shape: &GemmShape,
        alpha: &impl DeviceMemory<f32>,
        a: &impl DeviceMemory<A>,
        b: &impl DeviceMemory<B>,
        beta: &impl DeviceMemory<f32>,
        c: &mut impl DeviceMemoryMut<C>,
        compute: ComputeType,
    ) -> Result<()> {
        let call = "cublasGemmStridedBatchedEx";
        for (what, s) in [("alpha", Operand::of(alpha)), ("beta", Operand::of(beta))] {
            if s.len < 1 || !s.ctx.same(&self.inner.ctx) || s.ptr % 4 != 0 {
                return Err(refused(
                    call,
                    self.subject(),
                    format!(
                        "{what}: one aligned f32 on device {} is needed",
                        self.inner.ctx.ordinal()
                    ),
                ));
            }
        }
        if compute == ComputeType::F16 {
            return Err(refused(
                call,
                self.subject(),
                "device scalars are f32: not for ComputeType::F16",
            ));
        }
        note_use(alpha, stream)?;
        note_use(beta, stream)?;
        self.gemm(
            stream,
            call,
            shape,
            Scalars::Device(alpha.device_ptr(), beta.device_ptr()),
            a,
            b,
            c,
            compute,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm<A: BlasElement, B: BlasElement, C: BlasElement>(
        &self,
        stream: &CudaStream,
        call: &'static str,
        shape: &GemmShape,
        scalars: Scalars,
        a: &impl DeviceMemory<A>,
        b: &impl DeviceMemory<B>,
        c: &mut impl DeviceMemoryMut<C>,
        compute: ComputeType,
    ) -> Result<()> {
        let inner = &*self.inner;
        if let Some(r) = shape.too_large() {
            return Err(refused(call, self.subject(), r));
        }
        let p = shape
            .problem_cached([A::DATA_TYPE, B::DATA_TYPE, C::DATA_TYPE], compute)
            .map_err(|r| refused(call, self.subject(), r))?;
        let cc = Operand::of(&*c);
        let ops = [Operand::of(a), Operand::of(b), cc, cc];
        check(
            &p,
            &inner.ctx,
            stream,
            &ops,
            &MatmulExtras::new(),
            true,
            call,
        )?;
        note_use(a, stream)?;
        note_use(b, stream)?;
        note_use(&*c, stream)?;
        let (_section, ws) = self.workspace_for(stream, call)?;
        let mut state = self.lock();
        let (mode, alpha, beta, host);
        match scalars {
            Scalars::Host(al, be) => {
                let scale = compute.scale_type();
                host = (scale_bytes(al, scale), scale_bytes(be, scale));
                mode = cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST;
                alpha = host.0.as_ptr();
                beta = host.1.as_ptr();
            }
            Scalars::Device(al, be) => {
                mode = cublasPointerMode_t::CUBLAS_POINTER_MODE_DEVICE;
                alpha = al as usize as *const c_void;
                beta = be as usize as *const c_void;
            }
        }
        self.configure(&mut state, stream, &ws, mode)?;
        let raw = state.raw;
        let [pa, pb, pc, _] = ops.map(|o| o.ptr as usize as *mut c_void);
        let s = *shape;
        let (ta, tb) = (s.trans_a.raw(), s.trans_b.raw());
        let (m, n, k) = (s.m as i32, s.n as i32, s.k as i32);
        let (lda, ldb, ldc) = (s.lda as i32, s.ldb as i32, s.ldc as i32);
        let (at, bt, ct) = (A::DATA_TYPE.raw(), B::DATA_TYPE.raw(), C::DATA_TYPE.raw());
        let algo = cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let subject = || format!("device {} {p}", inner.ctx.ordinal());
        if call == "cublasGemmEx" {
            self.call(call, subject, |lib| {
                let f = lib.cublasGemmEx()?;
                // SAFETY: the buffers were checked against the shape (lengths,
                // types, device, overlap); the handle is on this stream with its
                // own workspace and the pointer mode of `alpha` and `beta`.
                Ok(unsafe {
                    f(
                        raw,
                        ta,
                        tb,
                        m,
                        n,
                        k,
                        alpha,
                        pa,
                        at,
                        lda,
                        pb,
                        bt,
                        ldb,
                        beta,
                        pc,
                        ct,
                        ldc,
                        compute.raw(),
                        algo,
                    )
                })
            })
        } else {
            let (sa, sb, sc) = (s.stride_a as i64, s.stride_b as i64, s.stride_c as i64);
            let batch = s.batch as i32;
            self.call(call, subject, |lib| {
                let f = lib.cublasGemmStridedBatchedEx()?;
                // SAFETY: as for cublasGemmEx, every batch checked.
                Ok(unsafe {
                    f(
                        raw,
                        ta,
                        tb,
                        m,
                        n,
                        k,
                        alpha,
                        pa,
                        at,
                        lda,
                        sa,
                        pb,
                        bt,
                        ldb,
                        sb,
                        beta,
                        pc,
                        ct,
                        ldc,
                        sc,
                        batch,
                        compute.raw(),
                        algo,
                    )
                })
            })
        }
    }
}

/// Where alpha and beta are.
#[derive(Clone, Copy)]
enum Scalars {
    Host(f32, f32),
    Device(u64, u64),
}
