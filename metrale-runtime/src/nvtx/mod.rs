//! NVTX ranges, marks, domains and names (feature `nvtx`), for profilers such as
//! Nsight Systems.
//!
//! This room owns the safe NVTX API: pushed and popped ranges ([`range_push`],
//! [`range_pop`], the guard [`range`]), start/end ranges that may cross threads
//! ([`range_start`], [`RangeId`]), marks, [`Domain`]s with their categories and
//! registered strings, [`EventAttributes`] (category, [`Color`], [`Payload`]),
//! and names for OS threads, devices, contexts, streams and events.
//!
//! NVTX is a protocol, not a library: a tool named by `NVTX_INJECTION64_PATH`
//! (Nsight sets it) is attached at the first call and receives every call; with
//! none attached every call returns at once. The loader is the sys crate's
//! [`metrale_cuda_sys::nvtx`]; nothing is linked.
//!
//! Invariants:
//! - With no tool attached, each call is one atomic load and a branch: no
//!   string is converted, nothing allocated (bench `nvtx`: a range push + pop
//!   beside an empty function).
//! - Strings are `&str`; texts under 128 bytes become C strings on the stack,
//!   longer ones in a heap copy for the call. A text with an interior NUL is cut
//!   there (what C reads); nothing here panics.
//! - NVTX's push and pop are per thread, so the guards ([`Range`],
//!   [`DomainRange`]) are not `Send`; a [`RangeId`] may end on any thread.
//! - A [`RegisteredString`] borrows its domain; used as the message of another
//!   domain's (or a core) call, its text is sent instead of its handle.
//! - Names of devices, contexts, streams and events pass the handle of a live
//!   metrale object; the tool only records it.
//!
//! ```
//! use metrale_runtime::nvtx;
//!
//! fn decode_step() {
//!     let _step = nvtx::range("decode"); // popped at the end of the scope
//!     nvtx::mark("sampled");
//! }
//! decode_step();
//! ```

use std::ffi::c_int;
use std::marker::PhantomData;

use metrale_cuda_sys::nvtx::nvtx;

use crate::context::AsContext;
use crate::device::Device;
use crate::stream::{CudaEvent, CudaStream};

mod attributes;
mod cstr;
mod domain;
mod string;

pub use attributes::{Color, EventAttributes, Payload};
pub use domain::{Domain, DomainRange};
pub use metrale_cuda_sys::nvtx::Injection;
pub use string::RegisteredString;

use cstr::with_cstr;

/// A level a push or pop returned, if it is one (negative: no tracking, error).
#[inline]
fn level(r: c_int) -> Option<u32> {
    u32::try_from(r).ok()
}

/// How attaching a tool went (attaching now if no NVTX call has yet).
pub fn injection() -> &'static Injection {
    metrale_cuda_sys::nvtx::injection()
}

/// Whether a tool is attached (its entries receive the calls).
pub fn is_attached() -> bool {
    injection().is_attached()
}

/// A mark: an instant event with `message`.
#[inline]
pub fn mark(message: &str) {
    if let Some(f) = nvtx().nvtxMarkA() {
        // SAFETY: a NUL-terminated message, valid during the call.
        with_cstr(message, |p| unsafe { f(p) });
    }
}

/// A mark with attributes.
#[inline]
pub fn mark_with(attrs: &EventAttributes<'_>) {
    if let Some(f) = nvtx().nvtxMarkEx() {
        // SAFETY: attributes valid during the call.
        attrs.with_raw(std::ptr::null_mut(), |a| unsafe { f(a) });
    }
}

/// Push a range on this thread's stack; the level the tool reports (0 for the
/// outermost), `None` with no tool or no tracking.
#[inline]
pub fn range_push(message: &str) -> Option<u32> {
    let f = nvtx().nvtxRangePushA()?;
    // SAFETY: a NUL-terminated message, valid during the call.
    level(with_cstr(message, |p| unsafe { f(p) }))
}

/// Push a range with attributes on this thread's stack.
#[inline]
pub fn range_push_with(attrs: &EventAttributes<'_>) -> Option<u32> {
    let f = nvtx().nvtxRangePushEx()?;
    // SAFETY: attributes valid during the call.
    level(attrs.with_raw(std::ptr::null_mut(), |a| unsafe { f(a) }))
}

/// Pop this thread's innermost range; the level it had (`None` with no tool, no
/// tracking, or nothing to pop).
#[inline]
pub fn range_pop() -> Option<u32> {
    let f = nvtx().nvtxRangePop()?;
    // SAFETY: no arguments.
    level(unsafe { f() })
}

/// A range pushed on this thread, popped when dropped ([`range`],
/// [`range_with`]). Not `Send`: NVTX's push and pop are per thread.
///
/// ```compile_fail
/// fn send<T: Send>(_: T) {}
/// send(metrale_runtime::nvtx::range("pushed here, popped elsewhere"));
/// ```
#[must_use = "the range ends when the guard is dropped"]
#[derive(Debug)]
pub struct Range {
    _not_send: PhantomData<*const ()>,
}

impl Drop for Range {
    #[inline]
    fn drop(&mut self) {
        range_pop();
    }
}

/// Push a range named `message` on this thread; it is popped when the guard
/// drops.
#[inline]
pub fn range(message: &str) -> Range {
    range_push(message);
    Range {
        _not_send: PhantomData,
    }
}

/// Push a range with attributes on this thread; popped when the guard drops.
#[inline]
pub fn range_with(attrs: &EventAttributes<'_>) -> Range {
    range_push_with(attrs);
    Range {
        _not_send: PhantomData,
    }
}

/// A range started with [`range_start`] (or [`Domain::range_start`]): it may end
/// on any thread. Its id is the tool's (0 with no tool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "a started range is ended with `end` or `range_end`"]
pub struct RangeId(pub(crate) u64);

impl RangeId {
    /// The tool's id (0 with no tool).
    pub fn value(self) -> u64 {
        self.0
    }

    /// End the range (a core range; a domain's ends with [`Domain::range_end`]).
    #[inline]
    pub fn end(self) {
        range_end(self);
    }
}

/// Start a range named `message` that may end on any thread.
#[inline]
pub fn range_start(message: &str) -> RangeId {
    match nvtx().nvtxRangeStartA() {
        // SAFETY: a NUL-terminated message, valid during the call.
        Some(f) => RangeId(with_cstr(message, |p| unsafe { f(p) })),
        None => RangeId(0),
    }
}

/// Start a range with attributes that may end on any thread.
#[inline]
pub fn range_start_with(attrs: &EventAttributes<'_>) -> RangeId {
    match nvtx().nvtxRangeStartEx() {
        // SAFETY: attributes valid during the call.
        Some(f) => RangeId(attrs.with_raw(std::ptr::null_mut(), |a| unsafe { f(a) })),
        None => RangeId(0),
    }
}

/// End a range [`range_start`] started.
#[inline]
pub fn range_end(id: RangeId) {
    if let Some(f) = nvtx().nvtxRangeEnd() {
        // SAFETY: an id (the tool accepts any value).
        unsafe { f(id.0) };
    }
}

/// Name category `id` (of the core; a domain's with [`Domain::name_category`]).
pub fn name_category(id: u32, name: &str) {
    if let Some(f) = nvtx().nvtxNameCategoryA() {
        // SAFETY: a NUL-terminated name, valid during the call.
        with_cstr(name, |p| unsafe { f(id, p) });
    }
}

/// Name the OS thread `thread_id` (on Linux the kernel's thread id, `gettid`).
pub fn name_os_thread(thread_id: u32, name: &str) {
    if let Some(f) = nvtx().nvtxNameOsThreadA() {
        // SAFETY: a NUL-terminated name, valid during the call.
        with_cstr(name, |p| unsafe { f(thread_id, p) });
    }
}

/// Name the calling thread (Linux: its id is read from `/proc/thread-self`;
/// elsewhere, or when that cannot be read, nothing is named).
pub fn name_current_thread(name: &str) {
    if nvtx().nvtxNameOsThreadA().is_none() {
        return;
    }
    if let Some(tid) = current_thread_id() {
        name_os_thread(tid, name);
    }
}

/// The kernel's id of the calling thread (Linux).
pub fn current_thread_id() -> Option<u32> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// Name a device (`nvtxNameCuDeviceA`).
pub fn name_device(device: &Device, name: &str) {
    if let Some(f) = nvtx().nvtxNameCuDeviceA() {
        // SAFETY: the device's `CUdevice` and a NUL-terminated name.
        with_cstr(name, |p| unsafe { f(device.raw(), p) });
    }
}

/// Name a context (`nvtxNameCuContextA`): a context, a host or a stream's.
pub fn name_context(ctx: &impl AsContext, name: &str) {
    let ctx = ctx.context();
    if let Some(f) = nvtx().nvtxNameCuContextA() {
        // SAFETY: a live context's handle (the tool records it) and a name.
        with_cstr(name, |p| unsafe { f(ctx.raw().cast(), p) });
    }
}

/// Name a stream (`nvtxNameCuStreamA`).
pub fn name_stream(stream: &CudaStream, name: &str) {
    if let Some(f) = nvtx().nvtxNameCuStreamA() {
        // SAFETY: a live stream's handle (the tool records it) and a name.
        with_cstr(name, |p| unsafe { f(stream.raw().cast(), p) });
    }
}

/// Name an event (`nvtxNameCuEventA`).
pub fn name_event(event: &CudaEvent, name: &str) {
    if let Some(f) = nvtx().nvtxNameCuEventA() {
        // SAFETY: a live event's handle (the tool records it) and a name.
        with_cstr(name, |p| unsafe { f(event.raw().cast(), p) });
    }
}
