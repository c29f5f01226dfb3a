//! NVTX domains: a named scope of ranges, marks, categories and registered strings.

use std::ffi::c_char;
use std::fmt;
use std::marker::PhantomData;

use metrale_cuda_sys::nvtx::{nvtx, nvtxDomainHandle_t, nvtxStringHandle_t};

use super::cstr::{owned, with_cstr};
use super::{level, EventAttributes, RangeId};

/// A named NVTX domain (`nvtxDomainCreateA`): its ranges, marks, categories and
/// registered strings are grouped under its name by the tool. Create it once
/// (a `static` [`LazyLock`](std::sync::LazyLock) is the usual place) and use
/// it from any thread; dropping it destroys the domain.
///
/// ```
/// use std::sync::LazyLock;
/// use metrale_runtime::nvtx::{Domain, EventAttributes};
///
/// static DOMAIN: LazyLock<Domain> = LazyLock::new(|| Domain::new("my-model"));
///
/// let decode = DOMAIN.register_string("decode");
/// DOMAIN.name_category(1, "attention");
/// let _r = DOMAIN.range(&EventAttributes::new().registered(&decode).category(1));
/// ```
pub struct Domain {
    raw: nvtxDomainHandle_t,
    name: Box<str>,
}

// SAFETY: the handle is an opaque id the tool made; NVTX's API may be called
// with it from any thread (the tools are thread-safe by NVTX's contract), and
// nothing of it is read or written on the Rust side.
unsafe impl Send for Domain {}
// SAFETY: as above; every method takes `&self` and only passes the id on.
unsafe impl Sync for Domain {}

impl fmt::Debug for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Domain").field("name", &self.name).finish()
    }
}

impl Domain {
    /// Create the domain `name` (cut at an interior NUL). With no tool attached
    /// this is a no-op and every call on the domain is too.
    pub fn new(name: &str) -> Domain {
        let raw = match nvtx().nvtxDomainCreateA() {
            // SAFETY: a NUL-terminated name, valid during the call.
            Some(create) => with_cstr(name, |p| unsafe { create(p) }),
            None => std::ptr::null_mut(),
        };
        Domain {
            raw,
            name: name.into(),
        }
    }

    /// The name it was created with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tool's handle (null with no tool), for NVTX calls of your own.
    pub fn raw(&self) -> nvtxDomainHandle_t {
        self.raw
    }

    /// A mark in this domain.
    #[inline]
    pub fn mark(&self, attrs: &EventAttributes<'_>) {
        if let Some(f) = nvtx().nvtxDomainMarkEx() {
            // SAFETY: the domain's handle and attributes valid during the call.
            attrs.with_raw(self.raw, |a| unsafe { f(self.raw, a) });
        }
    }

    /// Push a range on this thread's stack of this domain; the level the tool
    /// reports (0 for the outermost), `None` with no tool or no tracking.
    #[inline]
    pub fn range_push(&self, attrs: &EventAttributes<'_>) -> Option<u32> {
        let f = nvtx().nvtxDomainRangePushEx()?;
        // SAFETY: as in `mark`.
        level(attrs.with_raw(self.raw, |a| unsafe { f(self.raw, a) }))
    }

    /// Pop this thread's innermost range of this domain; the level it had.
    #[inline]
    pub fn range_pop(&self) -> Option<u32> {
        let f = nvtx().nvtxDomainRangePop()?;
        // SAFETY: the domain's handle.
        level(unsafe { f(self.raw) })
    }

    /// A range of this domain on this thread, popped when the guard drops.
    #[inline]
    pub fn range(&self, attrs: &EventAttributes<'_>) -> DomainRange<'_> {
        self.range_push(attrs);
        DomainRange {
            domain: self,
            _not_send: PhantomData,
        }
    }

    /// Start a range of this domain that may end on any thread.
    #[inline]
    pub fn range_start(&self, attrs: &EventAttributes<'_>) -> RangeId {
        match nvtx().nvtxDomainRangeStartEx() {
            // SAFETY: as in `mark`.
            Some(f) => RangeId(attrs.with_raw(self.raw, |a| unsafe { f(self.raw, a) })),
            None => RangeId(0),
        }
    }

    /// End a range this domain started.
    #[inline]
    pub fn range_end(&self, id: RangeId) {
        if let Some(f) = nvtx().nvtxDomainRangeEnd() {
            // SAFETY: the domain's handle and an id (any value is accepted).
            unsafe { f(self.raw, id.0) };
        }
    }

    /// Name category `id` in this domain.
    pub fn name_category(&self, id: u32, name: &str) {
        if let Some(f) = nvtx().nvtxDomainNameCategoryA() {
            // SAFETY: the domain's handle and a NUL-terminated name.
            with_cstr(name, |p| unsafe { f(self.raw, id, p) });
        }
    }

    /// Register `text` (cut at an interior NUL) once, to use as a message
    /// without the tool reading the text again ([`EventAttributes::registered`]).
    pub fn register_string(&self, text: &str) -> RegisteredString<'_> {
        let text = owned(text.as_bytes());
        let handle = match nvtx().nvtxDomainRegisterStringA() {
            // SAFETY: the domain's handle and a NUL-terminated text.
            Some(f) => unsafe { f(self.raw, text.as_ptr().cast()) },
            None => std::ptr::null_mut(),
        };
        RegisteredString {
            handle,
            domain: self.raw,
            text,
            _domain: PhantomData,
        }
    }
}

impl Drop for Domain {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        if let Some(f) = nvtx().nvtxDomainDestroy() {
            // SAFETY: the handle the tool made, destroyed once; nothing of this
            // domain (guards, registered strings) outlives it (they borrow it).
            unsafe { f(self.raw) };
        }
    }
}

/// A string registered with a [`Domain`] (`nvtxDomainRegisterStringA`); it
/// cannot outlive the domain. Used as a message with
/// [`EventAttributes::registered`].
pub struct RegisteredString<'d> {
    handle: nvtxStringHandle_t,
    domain: nvtxDomainHandle_t,
    /// The text, NUL-terminated: sent instead of the handle outside its domain.
    text: Box<[u8]>,
    _domain: PhantomData<&'d Domain>,
}

// SAFETY: the handles are opaque ids of the tool, passed on only (see Domain).
unsafe impl Send for RegisteredString<'_> {}
// SAFETY: as above.
unsafe impl Sync for RegisteredString<'_> {}

impl fmt::Debug for RegisteredString<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredString")
            .field("text", &self.text())
            .finish()
    }
}

impl RegisteredString<'_> {
    /// The text registered (up to an interior NUL).
    pub fn text(&self) -> &str {
        let bytes = self.text.split_last().map_or(&[][..], |(_, head)| head);
        std::str::from_utf8(bytes).unwrap_or_default()
    }

    pub(crate) fn handle(&self) -> nvtxStringHandle_t {
        self.handle
    }

    pub(crate) fn domain_handle(&self) -> nvtxDomainHandle_t {
        self.domain
    }

    pub(crate) fn text_ptr(&self) -> *const c_char {
        self.text.as_ptr().cast()
    }
}

/// A range of a [`Domain`] on this thread, popped when dropped
/// ([`Domain::range`]). Not `Send`: NVTX's push and pop are per thread.
#[must_use = "the range ends when the guard is dropped"]
pub struct DomainRange<'d> {
    domain: &'d Domain,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for DomainRange<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DomainRange")
            .field("domain", &self.domain.name)
            .finish()
    }
}

impl Drop for DomainRange<'_> {
    #[inline]
    fn drop(&mut self) {
        self.domain.range_pop();
    }
}
