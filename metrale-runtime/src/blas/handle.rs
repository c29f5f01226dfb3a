//! [`BlasLt`]: the cuBLASLt handle of one device, its per-stream workspaces and
//! its plan cache.
//!
//! Invariants:
//! - The handle is made with the device's context bound, and every call on it
//!   binds that context first ([`LtCore::call`]).
//! - The plan cache maps a checked [`Problem`] to its plan; plans hold the
//!   core (handle, context, workspaces), never the cache, so no cycle keeps a
//!   handle alive.
//! - The handle is destroyed when the last `BlasLt` clone and the last plan
//!   made from it are gone, under the release rule; its workspaces after it.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, PoisonError};

use metrale_cuda_sys::cublas::{self as raw, cublasLtHandle_t};

use crate::context::{AsContext, CudaContext};
use crate::error::Result;
use crate::stream::CudaStream;

use super::core::LtCore;
use super::error::{lt_call_error, missing, refused, unavailable};
use super::matmul::{MatmulPlan, PlanInner};
use super::plan::{MatmulDesc, Problem};
use super::workspace::Workspaces;

/// The plan cache's hasher: a multiply-rotate over the key's words (the
/// Fx hash). Keys are small plain data the program itself makes, so no
/// flooding resistance is needed, and a hit costs a few nanoseconds of
/// hashing instead of SipHash's hundred.
struct KeyHasher(u64);

impl Default for KeyHasher {
    /// A non-zero start, so that zero words still change the state.
    fn default() -> KeyHasher {
        KeyHasher(0x243f_6a88_85a3_08d3)
    }
}

impl KeyHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    #[inline]
    fn write_isize(&mut self, n: isize) {
        // Enum discriminants come here (derived `Hash`).
        self.add(n as u64);
    }

    #[inline]
    fn write_u16(&mut self, n: u16) {
        self.add(u64::from(n));
    }

    #[inline]
    fn write_i32(&mut self, n: i32) {
        self.add(n as u32 as u64);
    }

    #[inline]
    fn write_i64(&mut self, n: i64) {
        self.add(n as u64);
    }
}

/// The plan cache: checked problems to their plans, and in front of it the
/// descriptions already seen to their plans, so a hit skips the checks (a
/// description always checks into the same problem for one handle).
#[derive(Default)]
struct PlanCache {
    by_problem: HashMap<Problem, Arc<PlanInner>, BuildHasherDefault<KeyHasher>>,
    by_desc: HashMap<MatmulDesc, Arc<PlanInner>, BuildHasherDefault<KeyHasher>>,
}

/// Descriptions remembered in front of the problem map, at most (a bound on
/// what a stream of distinct descriptions can hold: past it, the front map is
/// emptied and fills again).
const DESC_CACHE_MAX: usize = 4096;

/// How a [`BlasLt`] handle is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BlasLtOptions {
    /// Bytes of each stream's workspace (default 32 MiB, what cuBLAS
    /// recommends for Hopper); also the most a plan may ask for.
    pub workspace_bytes: usize,
}

impl Default for BlasLtOptions {
    fn default() -> Self {
        BlasLtOptions {
            workspace_bytes: 32 << 20,
        }
    }
}

impl BlasLtOptions {
    /// These options with workspaces of `bytes` bytes.
    #[must_use]
    pub fn with_workspace_bytes(mut self, bytes: usize) -> BlasLtOptions {
        self.workspace_bytes = bytes;
        self
    }
}

/// The cuBLASLt handle of one device: plans, per-stream workspaces, and a
/// cache of plans (feature `cublas`).
///
/// Cloning is cheap and shares the handle, its workspaces and its cache.
///
/// ```no_run
/// use metrale_runtime::blas::{BlasLt, MatmulDesc};
/// use metrale_runtime::{context, CudaStream, DeviceBuffer};
/// # fn main() -> metrale_runtime::Result<()> {
/// let ctx = context(0)?;
/// let stream = CudaStream::new(&ctx)?;
/// let blas = BlasLt::new(&ctx)?;
/// let plan = blas.plan(&MatmulDesc::new::<f32, f32, f32, f32>(64, 64, 64))?;
/// let a = DeviceBuffer::from_host(&stream, &[1.0f32; 64 * 64])?;
/// let b = DeviceBuffer::from_host(&stream, &[1.0f32; 64 * 64])?;
/// let c = DeviceBuffer::<f32>::zeroed(&stream, 64 * 64)?;
/// let mut d = DeviceBuffer::<f32>::zeroed(&stream, 64 * 64)?;
/// plan.matmul(&stream, 1.0, &a, &b, 0.0, &c, &mut d)?;
/// assert!(stream.to_vec(&d)?.iter().all(|&x| x == 64.0));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct BlasLt {
    core: Arc<LtCore>,
    cache: Arc<Mutex<PlanCache>>,
}

impl fmt::Debug for BlasLt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlasLt")
            .field("device", &self.core.ctx.ordinal())
            .field("raw", &self.core.raw)
            .field("workspace_bytes", &self.core.workspaces.bytes())
            .finish_non_exhaustive()
    }
}

impl BlasLt {
    /// A cuBLASLt handle for `ctx`'s device, with the default options.
    ///
    /// # Errors
    /// The library missing (every try), `cublasLtCreate`'s failure.
    pub fn new(ctx: &impl AsContext) -> Result<BlasLt> {
        BlasLt::with_options(ctx, BlasLtOptions::default())
    }

    /// A cuBLASLt handle for `ctx`'s device.
    ///
    /// # Errors
    /// As [`BlasLt::new`]; a workspace size of 0 bytes is allowed (algorithms
    /// needing none).
    pub fn with_options(ctx: &impl AsContext, options: BlasLtOptions) -> Result<BlasLt> {
        let ctx = ctx.context();
        let lib = raw::cublas_lt().map_err(unavailable)?;
        let subject = || format!("device {}: creating a cuBLASLt handle", ctx.ordinal());
        ctx.bind_fast().map_err(|e| e.about(subject()))?;
        let create = lib.cublasLtCreate().map_err(|m| missing(m, subject()))?;
        let mut handle: cublasLtHandle_t = std::ptr::null_mut();
        // SAFETY: writes one handle; the device's context is current.
        let status = unsafe { create(&mut handle) };
        if !status.is_success() {
            return Err(lt_call_error(lib, "cublasLtCreate", status, subject()));
        }
        Ok(BlasLt {
            core: Arc::new(LtCore {
                lib,
                ctx: Arc::clone(ctx),
                raw: handle,
                made: ctx.generation(),
                workspaces: Workspaces::new(options.workspace_bytes),
            }),
            cache: Arc::default(),
        })
    }

    /// The plan of `desc`: from the cache when an equal problem was planned
    /// before, else checked, built and run through the heuristic once.
    ///
    /// # Errors
    /// A broken rule of `desc` ([`BlasError::Refused`](super::BlasError::Refused)),
    /// a workspace limit above the handle's workspace, no algorithm
    /// ([`BlasError::NoAlgorithm`](super::BlasError::NoAlgorithm)), a failing
    /// cuBLASLt call.
    pub fn plan(&self, desc: &MatmulDesc) -> Result<MatmulPlan> {
        if let Some(plan) = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_desc
            .get(desc)
        {
            return Ok(MatmulPlan::from_inner(Arc::clone(plan)));
        }
        let mut problem = desc.check().map_err(|reason| {
            refused(
                "cublasLtMatmulAlgoGetHeuristic",
                format!("device {} matmul plan", self.core.ctx.ordinal()),
                reason,
            )
        })?;
        let limit = self.core.workspaces.bytes();
        match problem.workspace_limit {
            Some(w) if w > limit => {
                return Err(refused(
                    "cublasLtMatmulAlgoGetHeuristic",
                    format!("device {} {problem}", self.core.ctx.ordinal()),
                    format!(
                        "the workspace limit {w} is more than the handle's workspace ({limit} \
                         bytes per stream; see BlasLtOptions::workspace_bytes)"
                    ),
                ))
            }
            Some(_) => {}
            None => problem.workspace_limit = Some(limit),
        }
        let cached = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_problem
            .get(&problem)
            .cloned();
        let plan = match cached {
            Some(plan) => plan,
            None => {
                // Built outside the lock (the heuristic is a library call).
                let built = Arc::new(PlanInner::build(&self.core, problem)?);
                let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
                Arc::clone(cache.by_problem.entry(problem).or_insert(built))
            }
        };
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.by_desc.len() >= DESC_CACHE_MAX {
            cache.by_desc.clear();
        }
        cache.by_desc.insert(desc.clone(), Arc::clone(&plan));
        Ok(MatmulPlan::from_inner(plan))
    }

    /// Up to `max` plans of `desc`, one per algorithm the heuristic offers,
    /// best first (`max` at most 16): for a caller that times them on its own
    /// buffers and keeps the fastest (an autotuned plan). Not cached; each is
    /// a plan like [`BlasLt::plan`]'s, with every check.
    ///
    /// # Errors
    /// As [`BlasLt::plan`]; `NoAlgorithm` when the heuristic offers none.
    pub fn plan_candidates(&self, desc: &MatmulDesc, max: usize) -> Result<Vec<MatmulPlan>> {
        let first = self.plan(desc)?;
        let problem = *first.problem();
        let mut plans = vec![first];
        for nth in 1..max.min(super::matmul::MAX_CANDIDATES) {
            match PlanInner::build_nth(&self.core, problem, nth) {
                Ok(p) => plans.push(MatmulPlan::from_inner(Arc::new(p))),
                // Fewer algorithms than asked: the list ends here.
                Err(e)
                    if e.as_cublas()
                        .is_some_and(|b| matches!(b, super::BlasError::NoAlgorithm { .. })) =>
                {
                    break
                }
                Err(e) => return Err(e),
            }
        }
        Ok(plans)
    }

    /// How many plans the cache holds.
    pub fn cached_plans(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_problem
            .len()
    }

    /// Empty the plan cache (plans in use stay valid).
    pub fn clear_cache(&self) {
        let taken = std::mem::take(&mut *self.cache.lock().unwrap_or_else(PoisonError::into_inner));
        drop(taken);
    }

    /// Make `stream`'s workspace now, so the stream can be captured: a GEMM on
    /// a stream being captured without one is refused.
    ///
    /// # Errors
    /// Another device's stream, a stream being captured, the allocation's
    /// failure.
    pub fn prepare(&self, stream: &CudaStream) -> Result<()> {
        self.core
            .workspaces
            .prepare(&self.core.ctx, stream, "cuBLASLt")
            .map(|_| ())
    }

    /// Forget `stream`'s workspace (freed once no graph holds it); whether it
    /// had one. The handle otherwise keeps each stream it ran on alive, with
    /// its workspace, until the handle goes.
    pub fn release_workspace(&self, stream: &CudaStream) -> bool {
        self.core.workspaces.release(stream)
    }

    /// How many streams have a workspace of this handle.
    pub fn workspaces(&self) -> usize {
        self.core.workspaces.count()
    }

    /// The size of each stream's workspace.
    pub fn workspace_bytes(&self) -> usize {
        self.core.workspaces.bytes()
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.core.ctx
    }

    /// The raw handle, for calls metrale does not wrap. It stays valid while
    /// this value lives; destroying it is metrale's.
    pub fn raw(&self) -> cublasLtHandle_t {
        self.core.raw
    }

    /// The loaded cuBLASLt's version.
    pub fn version(&self) -> Option<crate::Version> {
        self.core.lib.version().map(crate::Version::from)
    }
}

#[cfg(test)]
mod tests {
    use std::hash::Hasher;

    use super::KeyHasher;

    #[test]
    fn the_key_hasher_tells_words_and_their_order_apart() {
        let hash = |words: &[u64]| {
            let mut h = KeyHasher::default();
            words.iter().for_each(|&w| h.write_u64(w));
            h.finish()
        };
        assert_ne!(hash(&[1, 2]), hash(&[2, 1]));
        assert_ne!(hash(&[0]), hash(&[0, 0]));
        assert_eq!(hash(&[7, 9]), hash(&[7, 9]));
        let mut bytes = KeyHasher::default();
        bytes.write(&[1, 0, 0, 0, 0, 0, 0, 0, 2]);
        let mut words = KeyHasher::default();
        words.write_u64(1);
        words.write_u64(2);
        assert_eq!(
            bytes.finish(),
            words.finish(),
            "bytes are read as little-endian words"
        );
    }
}
