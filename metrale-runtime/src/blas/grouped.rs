//! Grouped batched GEMMs (`cublasGemmGroupedBatchedEx`, cuBLAS 12.5+):
//! [`GemmGroup`] and [`Blas::gemm_grouped_batched`].
//!
//! Invariants: the call is made only on cuBLAS 12.5 or newer (an older
//! library is [`BlasError::TooOld`]); every problem of every group is checked
//! as `gemm_ex` checks; the device pointer arrays outlive the GEMMs reading
//! them (the call waits for its stream before freeing them), so it is refused
//! on a stream being captured.

use std::ffi::c_void;

use metrale_cuda_sys::cublas::cublasPointerMode_t;

use crate::error::Result;
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
    /// which therefore waits for the GEMMs and cannot be captured.
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
        let section = stream.section();
        stream.refuse_if_capturing(
            &section,
            "a grouped GEMM (it uploads and frees its pointer arrays)",
        )?;
        drop(section);
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
        let arrays = DeviceBuffer::from_host(stream, &ptrs)?;
        let base = arrays.device_ptr();
        let (pa, pb, pc) = (base, base + 8 * total as u64, base + 16 * total as u64);
        let (section, ws) = self.workspace_for(stream, call)?;
        let mut state = self.lock();
        self.configure(
            &mut state,
            stream,
            &ws,
            cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST,
        )?;
        let raw = state.raw;
        let (at, bt, ct) = (A::DATA_TYPE.raw(), B::DATA_TYPE.raw(), C::DATA_TYPE.raw());
        let Ok(groups_n) = i32::try_from(sizes.len()) else {
            return Err(refused(call, self.subject(), "more than i32::MAX groups"));
        };
        let done = self.call(
            call,
            || self.subject(),
            |_| {
                // SAFETY: every problem of every group was checked; the pointer
                // arrays are device memory of `total` pointers each, alive until
                // the stream is synchronised below; the per-group arrays are host
                // memory read during the call.
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
        );
        drop(state);
        drop(section);
        // The pointer arrays must outlive the GEMMs that read them.
        let waited = stream.synchronize();
        drop(arrays);
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
