//! The stream memory operations on a [`SignalWord`]: waits, writes and batches,
//! each with the host function that holds the mapped words it uses.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use metrale_cuda_sys::{self as sys, CUstream};

use super::word::SignalWord;
use super::{require, SignalValue, WaitCondition, WaitFlags, WriteFlags};
use crate::error::{cu, invalid_arg, report_line, CallError, Result};
use crate::lifetime::drop_later;
use crate::stream::CudaStream;

/// The most operations one [`CudaStream::batch_mem_ops`] batch takes: the
/// driver refuses 256 and more (measured on driver 580: 255 succeed, 256 fail).
pub const MAX_BATCH_MEM_OPS: usize = 255;

/// One operation of a [`CudaStream::batch_mem_ops`] batch.
#[derive(Debug)]
#[non_exhaustive]
pub enum MemOp<'w, 'a> {
    /// Wait on a 32-bit word.
    Wait32(&'w SignalWord<'a, u32>, u32, WaitFlags),
    /// Wait on a 64-bit word.
    Wait64(&'w SignalWord<'a, u64>, u64, WaitFlags),
    /// Write a 32-bit word.
    Write32(&'w SignalWord<'a, u32>, u32, WriteFlags),
    /// Write a 64-bit word.
    Write64(&'w SignalWord<'a, u64>, u64, WriteFlags),
}

impl CudaStream {
    /// Make work queued on this stream from now on wait until `word` meets
    /// `flags`' condition with `value` (`cuStreamWaitValue32_v2`): a wait on the
    /// GPU, released by another stream's [`CudaStream::write_value32`], a kernel,
    /// or the host writing mapped memory.
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice) for a word of another context;
    /// [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) for [`WaitCondition::Nor`] on a device without
    /// it; the driver's status.
    pub fn wait_value32(
        &self,
        word: &SignalWord<'_, u32>,
        value: u32,
        flags: WaitFlags,
    ) -> Result<()> {
        self.wait_checks(word, flags, "wait_value32")?;
        let (a, f) = (word.addr, flags.to_driver());
        // SAFETY: a live stream; `a` is a word of live memory the stream may use
        // (noted, or held by the host function `queue_mem_ops` queues after it),
        // aligned for u32.
        self.queue_word_op("wait_value32", word, 1, |d, s| unsafe {
            cu!(d, cuStreamWaitValue32_v2(s, a, value, f))
        })
    }

    /// As [`CudaStream::wait_value32`] on a 64-bit word
    /// (`cuStreamWaitValue64_v2`).
    ///
    /// # Errors
    /// As [`CudaStream::wait_value32`]; [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) without
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`.
    pub fn wait_value64(
        &self,
        word: &SignalWord<'_, u64>,
        value: u64,
        flags: WaitFlags,
    ) -> Result<()> {
        self.wait_checks(word, flags, "wait_value64")?;
        let (a, f) = (word.addr, flags.to_driver());
        // SAFETY: as for wait_value32, aligned for u64.
        self.queue_word_op("wait_value64", word, 1, |d, s| unsafe {
            cu!(d, cuStreamWaitValue64_v2(s, a, value, f))
        })
    }

    /// Write `value` to `word` once the work queued before it on this stream has
    /// finished (`cuStreamWriteValue32_v2`).
    ///
    /// # Errors
    /// [`ErrorKind::WrongDevice`](crate::ErrorKind::WrongDevice) for a word of another context; the driver's
    /// status.
    pub fn write_value32(
        &self,
        word: &SignalWord<'_, u32>,
        value: u32,
        flags: WriteFlags,
    ) -> Result<()> {
        let f = flags.to_driver(self, "write_value32")?;
        word.prepare(self, "write_value32")?;
        let a = word.addr;
        // SAFETY: as for wait_value32.
        self.queue_word_op("write_value32", word, 0, |d, s| unsafe {
            cu!(d, cuStreamWriteValue32_v2(s, a, value, f))
        })
    }

    /// As [`CudaStream::write_value32`] on a 64-bit word
    /// (`cuStreamWriteValue64_v2`).
    ///
    /// # Errors
    /// As [`CudaStream::write_value32`]; [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) without
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`.
    pub fn write_value64(
        &self,
        word: &SignalWord<'_, u64>,
        value: u64,
        flags: WriteFlags,
    ) -> Result<()> {
        let f = flags.to_driver(self, "write_value64")?;
        word.prepare(self, "write_value64")?;
        let a = word.addr;
        // SAFETY: as for wait_value64.
        self.queue_word_op("write_value64", word, 0, |d, s| unsafe {
            cu!(d, cuStreamWriteValue64_v2(s, a, value, f))
        })
    }

    /// Queue several waits and writes as one batch (`cuStreamBatchMemOp_v2`), in
    /// order. Every word is checked before the driver sees any.
    ///
    /// # Errors
    /// As the single operations; `InvalidArgument` for more than
    /// [`MAX_BATCH_MEM_OPS`] (255) operations, before the driver.
    pub fn batch_mem_ops(&self, ops: &[MemOp<'_, '_>]) -> Result<()> {
        if ops.len() > MAX_BATCH_MEM_OPS {
            return Err(invalid_arg(format!(
                "{}: a batch of {} memory operations (at most {MAX_BATCH_MEM_OPS}: the \
                 driver refuses more)",
                self.subject("batch_mem_ops"),
                ops.len()
            )));
        }
        if ops.is_empty() {
            return Ok(());
        }
        use sys::CUstreamBatchMemOpType as Op;
        let mut params: Vec<sys::CUstreamBatchMemOpParams> = Vec::with_capacity(ops.len());
        let (mut held, mut waits) = (Vec::new(), 0);
        for op in ops {
            // SAFETY: a plain C union of integers, all-zero is a valid value.
            let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
            match *op {
                MemOp::Wait32(w, v, f) => {
                    self.wait_checks(w, f, "batch_mem_ops")?;
                    w.held(&mut held);
                    waits += 1;
                    p.waitValue.operation = Op::CU_STREAM_MEM_OP_WAIT_VALUE_32;
                    p.waitValue.address = w.addr;
                    p.waitValue.__bindgen_anon_1.value = v;
                    p.waitValue.flags = f.to_driver();
                }
                MemOp::Wait64(w, v, f) => {
                    self.wait_checks(w, f, "batch_mem_ops")?;
                    w.held(&mut held);
                    waits += 1;
                    p.waitValue.operation = Op::CU_STREAM_MEM_OP_WAIT_VALUE_64;
                    p.waitValue.address = w.addr;
                    p.waitValue.__bindgen_anon_1.value64 = v;
                    p.waitValue.flags = f.to_driver();
                }
                MemOp::Write32(w, v, f) => {
                    w.prepare(self, "batch_mem_ops")?;
                    w.held(&mut held);
                    p.writeValue.operation = Op::CU_STREAM_MEM_OP_WRITE_VALUE_32;
                    p.writeValue.address = w.addr;
                    p.writeValue.__bindgen_anon_1.value = v;
                    p.writeValue.flags = f.to_driver(self, "batch_mem_ops")?;
                }
                MemOp::Write64(w, v, f) => {
                    w.prepare(self, "batch_mem_ops")?;
                    w.held(&mut held);
                    p.writeValue.operation = Op::CU_STREAM_MEM_OP_WRITE_VALUE_64;
                    p.writeValue.address = w.addr;
                    p.writeValue.__bindgen_anon_1.value64 = v;
                    p.writeValue.flags = f.to_driver(self, "batch_mem_ops")?;
                }
            }
            params.push(p);
        }
        let (n, ptr) = (params.len() as u32, params.as_mut_ptr());
        // SAFETY: `n` initialised operations on checked words (device words noted,
        // mapped words held by the one host function queued after the batch),
        // read during the call.
        self.queue_mem_ops("batch_mem_ops", held, waits, |d, s| unsafe {
            cu!(d, cuStreamBatchMemOp_v2(s, n, ptr, 0))
        })
    }

    /// Queue one operation on `word`: a device word straight to the driver (no
    /// hold list to build and drop), a mapped one through `queue_mem_ops`.
    #[inline(always)]
    fn queue_word_op<T: SignalValue>(
        &self,
        what: &'static str,
        word: &SignalWord<'_, T>,
        waits: usize,
        queue: impl FnMut(&'static sys::Driver, CUstream) -> Result<(), CallError>,
    ) -> Result<()> {
        if word.mapped.is_none() {
            // A device word: nothing to hold, no host function (see
            // `queue_mem_ops`), so the submit is the driver's call.
            return self.call_unbound(what, queue);
        }
        let mut held = Vec::new();
        word.held(&mut held);
        self.queue_mem_ops(what, held, waits, queue)
    }

    /// Queue memory operations (`queue`, one driver call), then one host function
    /// that holds every mapped word of them (`held`) until they are done and
    /// counts their `waits` passed; all inside one section, so no metrale capture
    /// begins between the check and the queueing.
    ///
    /// Mapped words on a capturing stream are refused before anything is queued.
    /// Their waits are counted on the context before they are queued. When the
    /// host function cannot be queued, the operations are already: an event
    /// recorded after them stands in for it, and the context counts the waits
    /// down and hands the words on once it says they passed (see
    /// `CudaContext::note_unseen_wait`), never freeing them under the
    /// operations.
    fn queue_mem_ops(
        &self,
        what: &'static str,
        held: Vec<Box<dyn Send>>,
        waits: usize,
        queue: impl FnMut(&'static sys::Driver, CUstream) -> Result<(), CallError>,
    ) -> Result<()> {
        if held.is_empty() {
            // Device words only: nothing to hold, no capture to refuse (the
            // operation may become a graph node) and no host function, so the
            // submit is the driver's call. Their waits are GPU work like a
            // kernel's: one that never passes is the program's, as an endless
            // kernel is (see the module docs).
            return self.call_unbound(what, queue);
        }
        if crate::lifetime::in_host_function() {
            // Refused before the count: waiting out a context-wide free in
            // flight below would spin for ever on a host function that free
            // waits for (the driver refuses the call there anyway).
            return Err(CallError::InHostFunction.about(self.subject(what)));
        }
        let section = self.section();
        let capturing = self
            .capturing_now(&section)
            .map_err(|e| e.about(self.subject(&format!("{what}: capture status"))))?;
        if capturing {
            return Err(invalid_arg(format!(
                "{}: {} mapped signal word(s) while the stream is being captured: every \
                 replay of the graph would use host memory that may be freed by then \
                 (use device words in a capture)",
                self.subject(what),
                held.len()
            )));
        }
        // Waits on mapped words are passed by the host, which may never write:
        // counted until the host function (queued anyway to hold the words).
        let counted = waits;
        let counter = Arc::clone(self.context().pending_waits_counter());
        counter.fetch_add(counted, Ordering::SeqCst);
        // A pinned free that checked the count before it rose waits for the
        // context's work: queued after it returns, this wait cannot block it.
        self.context().wait_out_context_wide_frees();
        if let Err(e) = self.call_unbound(what, queue) {
            counter.fetch_sub(counted, Ordering::AcqRel);
            return Err(e);
        }
        let keeper = move || {
            // The waits passed: counted first, so a drain that sees the flag
            // below also sees the count fall (and retries what waited for it).
            counter.fetch_sub(counted, Ordering::AcqRel);
            // Not dropped here: the last hold would free pinned memory inside a
            // host function, where the driver may not be called.
            drop_later(Box::new(held));
        };
        match self.launch_host_fn_in(&section, keeper) {
            Ok(()) => Ok(()),
            Err((e, None)) => {
                // A driver that reported an error ran the holder anyway: the
                // waits were counted down and the words handed on.
                drop(section);
                Err(e)
            }
            Err((e, Some(keeper))) => {
                // The operations are queued: their words stay held and their
                // waits counted until an event recorded after them (still in the
                // section: not captured) or, without one, the stream, idle,
                // says they passed; then the context does the keeper's work.
                let event = self.event_after_ops();
                drop(section);
                let stream = self.clone();
                self.context().note_unseen_wait(
                    event,
                    self.raw(),
                    Box::new(move || {
                        keeper();
                        drop(stream);
                    }),
                );
                report_line(format_args!(
                    "{}: the operation is queued, but the host function holding its \
                     mapped words could not be: the words stay held and its \
                     {counted} wait(s) counted until an event after it says it \
                     passed: {e}",
                    self.subject(what)
                ));
                Err(e)
            }
        }
    }

    /// An event recorded now at the end of the stream's queue (outside any
    /// capture: the caller's section), or null when none could be made or
    /// recorded (one made but not recorded is destroyed under the release rule).
    #[cold]
    fn event_after_ops(&self) -> sys::CUevent {
        let mut ev: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0;
        let made = self.call("creating an event after memory operations", |d, _| {
            // SAFETY: writes one event handle; the context is current.
            unsafe { cu!(d, cuEventCreate(&mut ev, flags as std::ffi::c_uint)) }
        });
        if made.is_err() {
            return std::ptr::null_mut();
        }
        // SAFETY: a live event and stream of the bound context.
        let recorded = self.call(
            "recording an event after memory operations",
            |d, s| unsafe { cu!(d, cuEventRecord(ev, s)) },
        );
        if recorded.is_ok() {
            return ev;
        }
        let ctx = self.context();
        ctx.release_with(
            ctx.generation(),
            format_args!("destroying an unrecorded event on device {}", ctx.ordinal()),
            |d, failures| {
                // SAFETY: the event made above, never recorded, destroyed once.
                if let Err(e) = unsafe { cu!(d, cuEventDestroy_v2(ev)) } {
                    failures.push(e);
                }
            },
        );
        std::ptr::null_mut()
    }

    fn wait_checks<T: SignalValue>(
        &self,
        word: &SignalWord<'_, T>,
        flags: WaitFlags,
        what: &str,
    ) -> Result<()> {
        word.prepare(self, what)?;
        if flags.condition == WaitCondition::Nor {
            require(
                self,
                what,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR,
                "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR",
            )?;
        }
        Ok(())
    }
}
