//! What a blob is by its first bytes ([`BlobKind`]), and the readers and the
//! refusal the checks share.

use crate::error::{ErrorKind, MetraleError};

/// ELF magic, which starts a cubin.
pub(super) const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
/// Fatbin magic (`0xBA55ED50`, little-endian).
pub(super) const FATBIN_MAGIC: [u8; 4] = 0xBA55_ED50_u32.to_le_bytes();
/// Clang offload bundle magic.
pub(super) const BUNDLE_MAGIC: &[u8] = b"__CLANG_OFFLOAD_BUNDLE__";

/// What a kernel blob is, judged by its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlobKind {
    /// PTX assembly text (anything that is not one of the binary formats).
    Ptx,
    /// An ELF cubin for one architecture.
    Cubin,
    /// A fatbin: cubins for several architectures and/or PTX.
    Fatbin,
    /// A clang offload bundle wrapping device code.
    OffloadBundle,
}

impl BlobKind {
    /// Classify `blob` by its magic bytes.
    pub fn of(blob: &[u8]) -> BlobKind {
        if blob.starts_with(ELF_MAGIC) {
            BlobKind::Cubin
        } else if blob.starts_with(&FATBIN_MAGIC) {
            BlobKind::Fatbin
        } else if blob.starts_with(BUNDLE_MAGIC) {
            BlobKind::OffloadBundle
        } else {
            BlobKind::Ptx
        }
    }

    /// `"PTX"`, `"cubin"`, `"fatbin"`, `"offload bundle"`.
    pub fn label(self) -> &'static str {
        match self {
            BlobKind::Ptx => "PTX",
            BlobKind::Cubin => "cubin",
            BlobKind::Fatbin => "fatbin",
            BlobKind::OffloadBundle => "offload bundle",
        }
    }
}

pub(super) fn refuse(module: &str, what: impl std::fmt::Display) -> MetraleError {
    ErrorKind::InvalidBlob {
        module: module.to_owned(),
        reason: what.to_string(),
    }
    .into()
}

pub(super) fn u16_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from(u16::from_le_bytes(
        b.get(at..at + 2)?.try_into().ok()?,
    )))
}
pub(super) fn u32_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from(u32::from_le_bytes(
        b.get(at..at + 4)?.try_into().ok()?,
    )))
}
pub(super) fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}
