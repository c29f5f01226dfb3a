//! Unmapping and freeing a [`VirtualRange`]: the wait for every use first
//! (the context, and foreign streams), a failure leaks and is reported.

use std::sync::{Arc, PoisonError};

use super::PhysicalMemory;
use super::VirtualRange;
use crate::context::{ContextWideWait, CudaContext};
use crate::error::{cu, invalid_arg, report_line, MetraleError, Result};
use crate::memory::Uses;

impl VirtualRange {
    /// Unmap the mapping that starts at `offset` and give its physical memory
    /// back, after the work that may use it: every stream of the range's context
    /// is waited for (`cuCtxSynchronize`).
    ///
    /// # Errors
    /// `InvalidArgument` when no mapping starts at `offset`, or while the
    /// context has GPU-side waits pending ([`CudaContext::pending_waits`]: the
    /// wait could block for ever; the mapping stays); the failing wait (the
    /// mapping stays) or `cuMemUnmap`.
    pub fn unmap(&mut self, offset: usize) -> Result<Arc<PhysicalMemory>> {
        let Some(pos) = self.mappings.iter().position(|m| m.offset == offset) else {
            return Err(invalid_arg(self.subject(format_args!(
                "unmapping: no mapping starts at offset {offset}"
            ))));
        };
        let _in_flight = self.wait_for_uses(None)?;
        self.unmap_at(pos)
    }

    /// Wait for every use of the range's memory (see [`wait_for_context`]);
    /// the wait stays in flight while the guard lives (hold it through the
    /// unmaps).
    pub(in crate::memory) fn wait_for_uses(&self, uses: Option<&Uses>) -> Result<ContextWideWait> {
        wait_for_context(&self.ctx, uses).map_err(|e| match e.kind() {
            crate::error::ErrorKind::InvalidArgument(text) => {
                invalid_arg(self.subject(format_args!("{text}")))
            }
            _ => e,
        })
    }

    /// Unmap the mapping that starts at `offset`, whose uses the caller waited
    /// for (a sleep releasing each piece once its saved copy has completed).
    pub(in crate::memory) fn unmap_waited(&mut self, offset: usize) -> Result<Arc<PhysicalMemory>> {
        let Some(pos) = self.mappings.iter().position(|m| m.offset == offset) else {
            return Err(invalid_arg(self.subject(format_args!(
                "unmapping: no mapping starts at offset {offset}"
            ))));
        };
        self.unmap_at(pos)
    }

    /// Unmap mapping `pos` (its uses were waited for).
    fn unmap_at(&mut self, pos: usize) -> Result<Arc<PhysicalMemory>> {
        let Some(m) = self.mappings.get(pos) else {
            return Err(invalid_arg("unmapping: no such mapping"));
        };
        let (ptr, size, offset) = (self.base + m.offset as u64, m.size, m.offset);
        self.ctx.call(
            || self.subject(format_args!("unmapping {size} bytes at offset {offset}")),
            // SAFETY: exactly one recorded mapping; the work that may use it was
            // waited for by the caller.
            |d| unsafe { cu!(d, cuMemUnmap(ptr, size)) },
        )?;
        Ok(self.mappings.remove(pos).phys)
    }

    /// Unmap everything (uses waited for), from the top; stops at the first
    /// failure, keeping the record of what is still mapped.
    pub(in crate::memory) fn unmap_all(&mut self) -> Result<()> {
        while let Some(last) = self.mappings.len().checked_sub(1) {
            self.unmap_at(last)?;
        }
        Ok(())
    }
}

/// Wait for every use of memory of `ctx`: the foreign streams of `uses`, then
/// the whole context (`cuCtxSynchronize`). Work abandoned by an earlier fault
/// counts as done. Refused on a thread that captures (the wait would invalidate
/// its capture), and while `ctx` (or the context of a foreign stream) has GPU-side
/// waits pending ([`CudaContext::pending_waits`]): a wait on a word nobody
/// writes would make this block for ever.
///
/// Every context involved counts this wait in flight from its check on
/// (`enter_context_wide_wait`, the count the pinned and `cuMemFree` frees
/// keep): a wait on a mapped word another thread counts after the check is
/// queued only once this is over, so it can never block it. The returned
/// guard keeps the own context's count until the caller's last driver call
/// that may wait for the context's work (the unmap, the close) is done.
pub(in crate::memory) fn wait_for_context(
    ctx: &Arc<CudaContext>,
    uses: Option<&Uses>,
) -> Result<ContextWideWait> {
    if crate::lifetime::capturing_on_this_thread() {
        return Err(invalid_arg(
            "waiting for the work that uses the memory while this thread captures a graph (the wait would invalidate the capture)",
        ));
    }
    let waiting = "waiting for the work that uses the memory";
    if crate::lifetime::nccl_groups_open() {
        return Err(invalid_arg(format!(
            "{waiting}: an NCCL group is open, whose collectives reach their streams only \
             when it ends (retry after the group)"
        )));
    }
    let in_flight = ctx.enter_context_wide_wait();
    ctx.refuse_with_pending_waits(&waiting)?;
    let abandoned = |e: &MetraleError| e.status().is_some_and(crate::lifetime::work_abandoned);
    if let Some(uses) = uses {
        if uses.any_foreign.load(std::sync::atomic::Ordering::Acquire) {
            let foreign = uses
                .foreign
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            // In flight on every foreign context too, from its check through
            // its stream's synchronize.
            let _foreign_in_flight: Vec<ContextWideWait> = foreign
                .iter()
                .map(|f| f.context().enter_context_wide_wait())
                .collect();
            for f in &foreign {
                f.context().refuse_with_pending_waits(&waiting)?;
            }
            for f in &foreign {
                if let Err(e) = f.synchronize() {
                    if !abandoned(&e) {
                        return Err(e);
                    }
                }
            }
        }
    }
    match ctx.synchronize() {
        Err(e) if !abandoned(&e) => Err(e),
        _ => Ok(in_flight),
    }
}

impl VirtualRange {
    /// The Drop body: wait for uses, unmap everything, free the range; a failure
    /// leaks what is left (reported), never frees a mapped range.
    pub(in crate::memory) fn release(&mut self, uses: Option<&Uses>) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        let what = self.subject(format_args!("freeing"));
        if !self.ctx.may_release(self.made, format_args!("{what}")) {
            // Gone or reset: the driver freed everything.
            self.mappings.clear();
            return;
        }
        if !self.mappings.is_empty() {
            // An open NCCL group's collectives are not on their streams yet:
            // another thread's group is waited out; what still blocks the wait
            // (this thread's group, pending mapped waits) leaks it below.
            crate::lifetime::wait_out_nccl_groups();
            let unmapped = self.wait_for_uses(uses).and_then(|in_flight| {
                let unmapped = self.unmap_all();
                drop(in_flight);
                unmapped
            });
            if let Err(e) = unmapped {
                report_line(format_args!(
                    "{what}: leaked, {} mapping(s) could not be unmapped: {e}",
                    self.mappings.len()
                ));
                return;
            }
        }
        let (base, size) = (self.base, self.size);
        self.ctx
            .release_with(self.made, format_args!("{what}"), |d, failures| {
                // SAFETY: this range's own free, once, after every mapping in it was
                // unmapped.
                if let Err(e) = unsafe { cu!(d, cuMemAddressFree(base, size)) } {
                    failures.push(e);
                }
            });
    }
}

impl Drop for VirtualRange {
    fn drop(&mut self) {
        self.release(None);
    }
}
