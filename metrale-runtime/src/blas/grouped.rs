//! Grouped batched GEMMs (`cublasGemmGroupedBatchedEx`, cuBLAS 12.5+):
//! [`GemmGroup`] and [`Blas::gemm_grouped_batched`].
//!
//! Invariants: the call is made only on cuBLAS 12.5 or newer (an older
//! library is [`BlasError::TooOld`]); every problem of every group is checked
//! as `gemm_ex` checks, and every buffer (the pointer arrays too) gets a use
//! record; the device pointer arrays outlive the GEMMs reading them (the call
//! waits for its stream before freeing them), so it is refused on a stream
//! being captured, and one section of the stream covers the capture check,
//! the upload, the call and the wait: no capture begins in between.

use std::ffi::c_void;

use metrale_cuda_sys::cublas::cublasPointerMode_t;

use crate::error::{cu, Result};
use crate::memory::{note_use, DeviceBuffer};
use crate::stream::CudaStream;

use super::check::{check, MatmulExtras, Operand};
use super::error::{into_error, missing, refused, BlasError};
use super::gemm::Blas;
use super::shape::GemmShape;
use super::{BlasElement, ComputeType, DataType};

impl Blas {
    /// Groups of GEMMs of different shapes in one call
    /// (`cublasGemmGroupedBatchedEx`, cuBLAS 12.5+): each group is a shape
    /// (not batched, its own alpha and beta) and its problems' buffers. Every
    /// problem is checked as [`Blas::gemm_ex`] checks. The pointer arrays go
    /// to the device through a buffer made, filled and freed by this call,
    /// which therefore waits for the GEMMs and cannot be captured: a capture
    /// another thread begins on the stream meanwhile waits for this call.
    ///
    /// # Errors
    /// [`BlasError::TooOld`] before 12.5, the missing symbol, a refused
    /// problem, a stream being captured, the call's failure.
    #[allow(clippy::type_complexity)]
    pub fn gemm_grouped_batched<A: BlasElement, B: BlasElement, C: BlasElement>(
        &self,
        stream: &CudaStream,
        groups: &mut [GemmGroup<'_, A, B, C>],
        compute: ComputeType,
    ) -> Result<()> {
        let call = "cublasGemmGroupedBatchedEx";
        let inner = &*self.inner;
        let version = inner.lib.version();
        if version.is_some_and(|(a, b, _)| (a, b) < (12, 5)) {
            return Err(into_error(BlasError::TooOld {
                call,
                needs: (12, 5),
                version,
            }));
        }
        let grouped = inner
            .lib
            .cublasGemmGroupedBatchedEx()
            .map_err(|m| missing(m, self.subject()))?;
        if compute.scale_type() != DataType::F32 {
            return Err(refused(
                call,
                self.subject(),
                "grouped GEMMs take f32 scalars here: not ComputeType::F16",
            ));
        }
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
        let what = "a grouped GEMM (it uploads and frees its pointer arrays)";
        // A first answer before the checks (refused early, nothing noted); the
        // one that counts is given again in the section below.
        {
            let section = stream.section();
            stream.refuse_if_capturing(&section, what)?;
        }
        let (mut ta, mut tb, mut ms, mut ns, mut ks) = (vec![], vec![], vec![], vec![], vec![]);
        let (mut ldas, mut ldbs, mut ldcs, mut alphas, mut betas, mut sizes) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut ptrs: Vec<u64> = Vec::new();
        let mut cs: Vec<u64> = Vec::new();
        let mut bs: Vec<u64> = Vec::new();
        for (g, group) in groups.iter_mut().enumerate() {
            let s = group.shape;
            if s.batch != 1 || group.a.len() != group.b.len() || group.a.len() != group.c.len() {
                return Err(refused(
                    call,
                    self.subject(),
                    format!(
                        "group {g}: one shape (batch 1) and as many A, B and C buffers ({}, {}, {})",
                        group.a.len(),
                        group.b.len(),
                        group.c.len()
                    ),
                ));
            }
            if let Some(r) = s.too_large() {
                return Err(refused(call, self.subject(), format!("group {g}: {r}")));
            }
            if group.a.len() > i32::MAX as usize {
                return Err(refused(
                    call,
                    self.subject(),
                    format!(
                        "group {g}: {} products is above cuBLAS's int limit (i32::MAX = {})",
                        group.a.len(),
                        i32::MAX
                    ),
                ));
            }
            let p = s
                .problem([A::DATA_TYPE, B::DATA_TYPE, C::DATA_TYPE], compute)
                .map_err(|r| refused(call, self.subject(), format!("group {g}: {r}")))?;
            for i in 0..group.a.len() {
                let cc = Operand::of(&*group.c[i]);
                let ops = [Operand::of(group.a[i]), Operand::of(group.b[i]), cc, cc];
                check(
                    &p,
                    &inner.ctx,
                    stream,
                    &ops,
                    &MatmulExtras::new(),
                    true,
                    call,
                )?;
                note_use(group.a[i], stream)?;
                note_use(group.b[i], stream)?;
                note_use(&*group.c[i], stream)?;
                ptrs.push(ops[0].ptr);
                bs.push(ops[1].ptr);
                cs.push(cc.ptr);
            }
            ta.push(s.trans_a.raw());
            tb.push(s.trans_b.raw());
            ms.push(s.m as i32);
            ns.push(s.n as i32);
            ks.push(s.k as i32);
            ldas.push(s.lda as i32);
            ldbs.push(s.ldb as i32);
            ldcs.push(s.ldc as i32);
            alphas.push(group.alpha);
            betas.push(group.beta);
            sizes.push(group.a.len() as i32);
        }
        let total = ptrs.len();
        ptrs.extend_from_slice(&bs);
        ptrs.extend_from_slice(&cs);
        let Ok(groups_n) = i32::try_from(sizes.len()) else {
            return Err(refused(call, self.subject(), "more than i32::MAX groups"));
        };
        // One section from the capture check through the upload, the call and
        // the wait: a capture begun by another thread waits for it to end, so
        // neither the GEMM nor the wait can land in a capture. (The checks and
        // use records above come first: a use on another stream takes that
        // stream's section, and two streams' sections are never held at once.)
        let section = stream.section();
        stream.refuse_if_capturing(&section, what)?;
        // Everything that can fail without queueing work comes before the
        // upload: from the upload on, every path waits for the stream before
        // `ptrs`, the copy's source, goes.
        let ws = inner.workspaces.get_or_make(&inner.ctx, stream)?;
        ws.note_use(stream)?;
        let arrays = DeviceBuffer::<u64>::alloc(&inner.ctx, ptrs.len().max(1))?;
        note_use(&arrays, stream)?;
        let base = arrays.device_ptr();
        let (pa, pb, pc) = (base, base + 8 * total as u64, base + 16 * total as u64);
        let from = ptrs.as_ptr().cast::<c_void>();
        let bytes = std::mem::size_of_val(ptrs.as_slice());
        if bytes > 0 {
            stream
                .call("uploading the grouped GEMM's pointer arrays", |d, s| {
                    // SAFETY: `arrays` holds `bytes` in this stream's context; `ptrs`
                    // is `bytes` long and lives until the stream is synchronised below,
                    // on every path; the stream is not being captured (checked in this
                    // section), so the copy runs now.
                    unsafe { cu!(d, cuMemcpyHtoDAsync_v2(base, from, bytes, s)) }
                })
                .inspect_err(|_| {
                    // Nothing of the copy may outlive `ptrs`: wait for it anyway.
                    let _ = stream.call("synchronize", |d, s| {
                        // SAFETY: a live stream of the bound context.
                        unsafe { cu!(d, cuStreamSynchronize(s)) }
                    });
                })?;
        }
        let mut state = self.lock();
        let configured = self.configure(
            &mut state,
            stream,
            &ws,
            cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST,
        );
        let raw = state.raw;
        let (at, bt, ct) = (A::DATA_TYPE.raw(), B::DATA_TYPE.raw(), C::DATA_TYPE.raw());
        let done = configured.and_then(|()| {
            self.call(
                call,
                || self.subject(),
                |_| {
                    // SAFETY: every problem of every group was checked; the
                    // pointer arrays are device memory of `total` pointers each,
                    // alive until the stream is synchronised below; the
                    // per-group arrays are host memory read during the call.
                    Ok(unsafe {
                        grouped(
                            raw,
                            ta.as_ptr(),
                            tb.as_ptr(),
                            ms.as_ptr(),
                            ns.as_ptr(),
                            ks.as_ptr(),
                            alphas.as_ptr().cast(),
                            pa as usize as *const *const c_void,
                            at,
                            ldas.as_ptr(),
                            pb as usize as *const *const c_void,
                            bt,
                            ldbs.as_ptr(),
                            betas.as_ptr().cast(),
                            pc as usize as *const *mut c_void,
                            ct,
                            ldcs.as_ptr(),
                            groups_n,
                            sizes.as_ptr(),
                            compute.raw(),
                        )
                    })
                },
            )
        });
        drop(state);
        // The pointer arrays (and `ptrs`, the copy's source) must outlive the
        // work that reads them: wait in the section, so the wait cannot join
        // a capture begun meanwhile.
        let waited = stream.call("synchronize", |d, s| {
            // SAFETY: a live stream of the bound context.
            unsafe { cu!(d, cuStreamSynchronize(s)) }
        });
        drop(section);
        crate::lifetime::drain();
        drop(arrays);
        drop(ptrs);
        done.and(waited)
    }
}

/// One group of [`Blas::gemm_grouped_batched`]: a shape, its scalars, and the
/// buffers of each of its problems.
pub struct GemmGroup<'a, A: BlasElement, B: BlasElement, C: BlasElement> {
    /// The shape every problem of the group has (batch 1).
    pub shape: GemmShape,
    /// The group's alpha.
    pub alpha: f32,
    /// The group's beta.
    pub beta: f32,
    /// Each problem's A.
    pub a: Vec<&'a DeviceBuffer<A>>,
    /// Each problem's B.
    pub b: Vec<&'a DeviceBuffer<B>>,
    /// Each problem's C (written).
    pub c: Vec<&'a mut DeviceBuffer<C>>,
}
