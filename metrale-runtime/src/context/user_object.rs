//! Holding a value for a graph through a CUDA user object: the one keep-alive
//! mechanism of the graphs the driver replays without a host node.
//!
//! Invariants:
//! - The value is owned by one user object whose only reference is moved into
//!   the graph (`cuGraphRetainUserObject` with `CU_GRAPH_USER_OBJECT_MOVE`):
//!   the graph, every executable graph instantiated or updated from it, and
//!   every launch of those still in flight hold it, and nothing else does.
//! - The destructor runs on a thread of the driver's, where the driver may
//!   not be called: it never drops the value there, it hands it to the
//!   drop-later list (`lifetime::drop_later`, emptied at the next
//!   synchronisation, or by whoever counts holders and drains first).
//! - On a refusal nothing holds the value (dropped here, or by the drop-later
//!   list when the object was made but not moved); a driver without user objects is an answer (`Ok(false)`), not an
//!   error, so the caller can fall back to a host node.

use std::ffi::c_void;

use metrale_cuda_sys::{CUgraph, CUuserObject, CUuserObjectRetain_flags, CUuserObject_flags};

use super::CudaContext;
use crate::error::{cu, Result};

/// The value a user object owns (a thin pointer for the driver).
type Held = Box<dyn Send>;

/// The user object's destructor: the value goes to the drop-later list.
unsafe extern "C" fn release(held: *mut c_void) {
    // SAFETY: `held` is the box made in `hold_in_graph` for exactly one user
    // object, whose destructor the driver runs once.
    let held = unsafe { Box::from_raw(held.cast::<Held>()) };
    crate::lifetime::drop_later(*held);
}

impl CudaContext {
    /// Whether the driver has user objects (CUDA 11.3+).
    pub(crate) fn has_user_objects(&self) -> bool {
        let d = self.driver();
        d.cuUserObjectCreate().is_ok()
            && d.cuGraphRetainUserObject().is_ok()
            && d.cuUserObjectRelease().is_ok()
    }

    /// Make `graph` (a graph of this context, finished or being captured
    /// into) hold `value` through a user object, so the graph, its
    /// executables and their launches in flight keep it; `what` names the
    /// value in errors. `Ok(false)`: the driver has no user objects (`value`
    /// is dropped; hold it another way).
    ///
    /// # Errors
    /// `cuUserObjectCreate`'s or `cuGraphRetainUserObject`'s status (`value`
    /// is then dropped, nothing is held).
    pub(crate) fn hold_in_graph<T: Send + 'static>(
        &self,
        graph: CUgraph,
        value: T,
        what: &str,
    ) -> Result<bool> {
        if !self.has_user_objects() {
            return Ok(false);
        }
        let boxed: Held = Box::new(value);
        let held = Box::into_raw(Box::new(boxed)).cast::<c_void>();
        let mut object: CUuserObject = std::ptr::null_mut();
        let made = self.call(
            || format!("device {}: making a user object for {what}", self.ordinal()),
            |d| {
                // SAFETY: `release` takes back `held` once, when the object's
                // last reference goes; the flag is the one the driver requires.
                unsafe {
                    cu!(
                        d,
                        cuUserObjectCreate(
                            &mut object,
                            held,
                            Some(release),
                            1,
                            CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC.0
                        )
                    )
                }
            },
        );
        if let Err(e) = made {
            // SAFETY: the driver refused the object, so it never received `held`.
            drop(unsafe { Box::from_raw(held.cast::<Held>()) });
            return Err(e);
        }
        let moved = self.call(
            || format!("device {} graph {graph:p}: holding {what}", self.ordinal()),
            |d| {
                // SAFETY: a live user object (our one reference, moved) and a
                // graph of this context (the caller's).
                unsafe {
                    cu!(
                        d,
                        cuGraphRetainUserObject(
                            graph,
                            object,
                            1,
                            CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE.0
                        )
                    )
                }
            },
        );
        if let Err(e) = moved {
            // Our reference was not moved: releasing it runs the destructor
            // (the value goes to the drop-later list).
            let _ = self.call(
                || format!("device {}: releasing a user object", self.ordinal()),
                // SAFETY: the live object made above, released once.
                |d| unsafe { cu!(d, cuUserObjectRelease(object, 1)) },
            );
            return Err(e);
        }
        Ok(true)
    }
}
