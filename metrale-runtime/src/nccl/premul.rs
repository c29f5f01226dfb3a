//! [`PreMulSum`]: NCCL's pre-multiplied sum (`ncclRedOpCreatePreMulSum`), a
//! reduction made for one communicator that multiplies each rank's input by a
//! scalar before summing (an average over any divisor without an extra
//! kernel), and [`Reduction`], what the reducing collectives take.
//!
//! Invariants:
//! - The operation borrows its communicator, so it cannot outlive it nor move
//!   to another thread without it; Drop destroys it (`ncclRedOpDestroy`)
//!   before the communicator can go. NCCL allows the destroy as soon as the
//!   calls that used it have returned; inside an open group (whose calls are
//!   launched only at its end) it is left to NCCL, which frees it with the
//!   communicator, with a line on stderr.
//! - A device scalar stays borrowed while the operation lives, and each
//!   collective that uses the operation notes the scalar's use on its stream,
//!   like its buffers, so its memory is freed only after that work.
//! - A collective given another communicator's operation is refused before
//!   NCCL.

use std::ffi::c_void;
use std::fmt;

use metrale_cuda_sys::nccl::{ncclRedOp_t, ncclScalarResidence_t};

use crate::error::Result;
use crate::memory::DeviceMemory;

use super::comm::Communicator;
use super::error::{missing, refused};
use super::state::in_group;
use super::{NcclType, ReduceOp};

/// What a reducing collective takes: a built-in [`ReduceOp`] or a
/// communicator's own [`PreMulSum`] (both convert with `into()`, so pass
/// either directly).
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum Reduction<'a, T: NcclType> {
    /// A built-in operation.
    Op(ReduceOp),
    /// A pre-multiplied sum made for the communicator the collective runs on.
    PreMulSum(&'a PreMulSum<'a, T>),
}

impl<T: NcclType> From<ReduceOp> for Reduction<'_, T> {
    fn from(op: ReduceOp) -> Self {
        Reduction::Op(op)
    }
}

impl<'a, T: NcclType> From<&'a PreMulSum<'a, T>> for Reduction<'a, T> {
    fn from(op: &'a PreMulSum<'a, T>) -> Self {
        Reduction::PreMulSum(op)
    }
}

impl<T: NcclType> fmt::Debug for Reduction<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reduction::Op(op) => write!(f, "{op:?}"),
            Reduction::PreMulSum(p) => write!(f, "{p:?}"),
        }
    }
}

/// A pre-multiplied sum of one communicator: each rank's input times its
/// scalar, summed (`ncclRedOpCreatePreMulSum`). Made with
/// [`PreMulSum::host`] (the value is copied now) or [`PreMulSum::device`]
/// (NCCL reads one element of device memory when each collective runs); pass
/// `&op` where a collective takes a reduction. A graph that captured a
/// collective with it refers to it: replay such a graph (`unsafe`, as every
/// replay) only while the operation lives.
///
/// ```no_run
/// # use metrale_runtime::nccl::{Communicator, PreMulSum};
/// # use metrale_runtime::{CudaStream, DeviceBuffer};
/// # fn f(comm: &Communicator, grads: &mut DeviceBuffer<f32>, s: &CudaStream) -> metrale_runtime::Result<()> {
/// // The mean over the ranks, in the collective itself.
/// let mean = PreMulSum::host(comm, 1.0 / comm.size() as f32)?;
/// comm.all_reduce_in_place(grads, &mean, s)?;
/// # Ok(()) }
/// ```
pub struct PreMulSum<'a, T: NcclType> {
    comm: &'a Communicator,
    raw: ncclRedOp_t,
    scalar: Option<&'a dyn DeviceMemory<T>>,
}

impl<'a, T: NcclType> PreMulSum<'a, T> {
    /// A pre-multiplied sum by `scalar` (copied now:
    /// `ncclScalarHostImmediate`).
    ///
    /// # Errors
    /// An aborted or revoked communicator, inside a host function (before
    /// NCCL); the missing symbol; NCCL's status.
    pub fn host(comm: &'a Communicator, scalar: T) -> Result<PreMulSum<'a, T>> {
        let mut value = scalar;
        let raw = create::<T>(
            comm,
            (&mut value as *mut T).cast(),
            ncclScalarResidence_t::ncclScalarHostImmediate,
        )?;
        Ok(PreMulSum {
            comm,
            raw,
            scalar: None,
        })
    }

    /// A pre-multiplied sum by the first element of `scalar`, device memory
    /// of the communicator's device that NCCL reads when each collective runs
    /// (`ncclScalarDevice`): write it on the stream before the collective to
    /// change the factor per step. It stays borrowed while the operation
    /// lives.
    ///
    /// # Errors
    /// An empty `scalar` or one on another device, an aborted or revoked
    /// communicator (before NCCL); the missing symbol; NCCL's status.
    pub fn device(
        comm: &'a Communicator,
        scalar: &'a dyn DeviceMemory<T>,
    ) -> Result<PreMulSum<'a, T>> {
        const CALL: &str = "ncclRedOpCreatePreMulSum";
        if scalar.is_empty() {
            return Err(refused(
                CALL,
                Some(comm.info()),
                "the device scalar is empty (one element is read)",
            ));
        }
        if !std::sync::Arc::ptr_eq(scalar.memory_context(), comm.context()) {
            return Err(refused(
                CALL,
                Some(comm.info()),
                format!(
                    "the device scalar is on device {}, the communicator on device {}",
                    scalar.memory_context().ordinal(),
                    comm.device()
                ),
            ));
        }
        let raw = create::<T>(
            comm,
            scalar.device_ptr() as usize as *mut c_void,
            ncclScalarResidence_t::ncclScalarDevice,
        )?;
        Ok(PreMulSum {
            comm,
            raw,
            scalar: Some(scalar),
        })
    }

    /// The communicator it was made for.
    pub fn comm(&self) -> &'a Communicator {
        self.comm
    }

    /// NCCL's handle of the operation (valid while this value lives).
    pub fn raw(&self) -> ncclRedOp_t {
        self.raw
    }

    /// The device scalar, when it has one.
    pub(super) fn scalar(&self) -> Option<&'a dyn DeviceMemory<T>> {
        self.scalar
    }
}

/// `ncclRedOpCreatePreMulSum` on `comm` with the scalar at `scalar`.
fn create<T: NcclType>(
    comm: &Communicator,
    scalar: *mut c_void,
    residence: ncclScalarResidence_t,
) -> Result<ncclRedOp_t> {
    const CALL: &str = "ncclRedOpCreatePreMulSum";
    comm.enter(CALL)?;
    comm.refuse_revoked(CALL)?;
    let f = comm
        .lib()
        .ncclRedOpCreatePreMulSum()
        .map_err(|m| missing(m, Some(comm.info())))?;
    let mut op = ncclRedOp_t(0);
    let status = {
        let _turn = comm.turn();
        // SAFETY: a live communicator (`enter` refused an aborted one); NCCL
        // writes one operation handle and reads one `T` at `scalar` now (host
        // immediate: a local the caller holds) or when a collective runs
        // (device: memory of the communicator's device, checked, borrowed by
        // the returned operation and noted by each collective that uses it).
        unsafe { f(&mut op, scalar, T::DATA_TYPE, residence, comm.raw_handle()) }
    };
    comm.finish(CALL, status)?;
    Ok(op)
}

impl<T: NcclType> fmt::Debug for PreMulSum<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreMulSum")
            .field("comm", &self.comm.info())
            .field("op", &self.raw.0)
            .field("device_scalar", &self.scalar.is_some())
            .finish()
    }
}

impl<T: NcclType> Drop for PreMulSum<'_, T> {
    fn drop(&mut self) {
        let comm = self.comm;
        if comm.is_aborted() || !comm.usable_here() {
            // NCCL freed it with the communicator (or will).
            return;
        }
        if in_group() || crate::lifetime::in_host_function() {
            crate::error::report_line(format_args!(
                "NCCL pre-multiplied sum (communicator {}): dropped inside a group or a host \
                 function; left to NCCL, which frees it with the communicator",
                comm.info()
            ));
            return;
        }
        let Ok(f) = comm.lib().ncclRedOpDestroy() else {
            return;
        };
        let status = {
            let _turn = comm.turn();
            // SAFETY: an operation made for this live communicator, destroyed
            // once; the calls that used it have returned (outside any group).
            unsafe { f(self.raw, comm.raw_handle()) }
        };
        if !status.is_success() {
            crate::error::report_line(format_args!(
                "NCCL pre-multiplied sum (communicator {}): ncclRedOpDestroy failed: {status}",
                comm.info()
            ));
        }
    }
}
