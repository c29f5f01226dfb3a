//! [`RegisteredString`]: a string registered with a domain, sent as its handle
//! in that domain and as its text elsewhere.

use std::ffi::c_char;
use std::fmt;
use std::marker::PhantomData;

use metrale_cuda_sys::nvtx::{nvtxDomainHandle_t, nvtxStringHandle_t};

/// A string registered with a [`Domain`](super::Domain) (`nvtxDomainRegisterStringA`); it
/// cannot outlive the domain. Used as a message with
/// [`EventAttributes::registered`](super::EventAttributes::registered).
pub struct RegisteredString<'d> {
    pub(super) handle: nvtxStringHandle_t,
    pub(super) domain: nvtxDomainHandle_t,
    /// The text, NUL-terminated: sent instead of the handle outside its domain.
    pub(super) text: Box<[u8]>,
    /// The domain's borrow (a string cannot outlive its domain).
    pub(super) _domain: PhantomData<&'d ()>,
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
