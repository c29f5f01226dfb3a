//! [`RawCudaFunc`], the copyable handle of the memoized lookup, and the side
//! cache that maps one registry's handle to another's.

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use metrale_cuda_sys::CUfunction;

use super::info::KernelInfo;

/// A raw `CUfunction` from [`MetraleRegistry::raw_function_cached`], cheap to copy,
/// with the identity of the registry it came from.
///
/// A registry accepts only its own handles: one from another registry, or from one
/// that was dropped, is detected (looked up again by
/// [`raw_function_cached`](crate::MetraleRegistry::raw_function_cached), refused
/// by launches) rather than handed to the driver.
///
/// [`MetraleRegistry::raw_function_cached`]: crate::MetraleRegistry::raw_function_cached
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawCudaFunc {
    pub(super) raw: CUfunction,
    pub(super) info: *const KernelInfo,
    pub(super) table: u64,
}

// SAFETY: the handle is copied and compared; `info` is only dereferenced by the
// table that made it (see `KernelTable::resolve`), which is Sync.
unsafe impl Send for RawCudaFunc {}
// SAFETY: as for Send; a shared reference only copies the fields.
unsafe impl Sync for RawCudaFunc {}

impl RawCudaFunc {
    /// The driver's `CUfunction`, for driver calls of your own. It is valid while
    /// the registry it came from (or a [`CudaFunction`](crate::CudaFunction) of it) is alive.
    pub fn as_raw(self) -> CUfunction {
        self.raw
    }

    /// The id of the table that made it (see `KernelTable::owns`).
    #[inline(always)]
    pub(crate) fn table_id(self) -> u64 {
        self.table
    }
}

impl fmt::Debug for RawCudaFunc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawCudaFunc")
            .field("raw", &self.raw)
            .field("registry", &self.table)
            .finish()
    }
}

/// A registry's own answers for caller caches (`OnceLock<RawCudaFunc>`) that hold
/// another registry's handle: a static filled by a registry since dropped keeps
/// that handle for good, and the registry in use answers from here in a few loads
/// instead of a lock and a hash. Direct-mapped slots keyed by the cache's address,
/// each under a sequence counter: readers never block, writers take a lock.
pub(crate) struct SideCache {
    slots: [SideSlot; SIDE_SLOTS],
    write: Mutex<()>,
}

const SIDE_SLOTS: usize = 64;

#[derive(Default)]
struct SideSlot {
    /// Odd while a writer changes the slot.
    seq: AtomicU32,
    key: AtomicUsize,
    /// The foreign handle the cache held when the answer was stored: a cache at a
    /// reused address (holding another handle) does not match.
    held_raw: AtomicPtr<c_void>,
    held_table: AtomicU64,
    raw: AtomicPtr<c_void>,
    info: AtomicPtr<KernelInfo>,
    table: AtomicU64,
}

impl Default for SideCache {
    fn default() -> Self {
        SideCache {
            slots: std::array::from_fn(|_| SideSlot::default()),
            write: Mutex::new(()),
        }
    }
}

impl SideCache {
    fn slot(&self, key: usize) -> &SideSlot {
        &self.slots[(key >> 3) % SIDE_SLOTS]
    }

    /// The handle remembered for `cache`, if any.
    #[inline]
    pub(crate) fn get<C>(&self, cache: &C, held: RawCudaFunc) -> Option<RawCudaFunc> {
        let key = cache as *const C as usize;
        let slot = self.slot(key);
        let before = slot.seq.load(Ordering::Acquire);
        if before & 1 == 1
            || slot.key.load(Ordering::Acquire) != key
            || slot.held_table.load(Ordering::Acquire) != held.table
            || slot.held_raw.load(Ordering::Acquire) != held.raw.cast()
        {
            return None;
        }
        let f = RawCudaFunc {
            raw: slot.raw.load(Ordering::Acquire).cast(),
            info: slot.info.load(Ordering::Acquire),
            table: slot.table.load(Ordering::Acquire),
        };
        std::sync::atomic::fence(Ordering::Acquire);
        (slot.seq.load(Ordering::Relaxed) == before).then_some(f)
    }

    /// Remember `f` (a handle of this registry's table) for `cache`.
    pub(crate) fn put<C>(&self, cache: &C, held: RawCudaFunc, f: RawCudaFunc) {
        let key = cache as *const C as usize;
        let _serial = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = self.slot(key);
        slot.seq.fetch_add(1, Ordering::AcqRel);
        std::sync::atomic::fence(Ordering::Release);
        slot.key.store(key, Ordering::Release);
        slot.held_raw.store(held.raw.cast(), Ordering::Release);
        slot.held_table.store(held.table, Ordering::Release);
        slot.raw.store(f.raw.cast(), Ordering::Release);
        slot.info.store(f.info.cast_mut(), Ordering::Release);
        slot.table.store(f.table, Ordering::Release);
        slot.seq.fetch_add(1, Ordering::Release);
    }
}
