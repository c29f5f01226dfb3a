//! Kernel blobs: what a blob is ([`BlobKind`]) and how it is handed to the driver.
//!
//! The driver's module loaders take a bare pointer: they find the end of PTX at its
//! NUL and the extent of a cubin or fatbin in its own headers. So before any driver
//! call this module checks what a caller's bytes claim about themselves:
//! - PTX must be valid UTF-8 without interior NUL; it is passed NUL-terminated
//!   (borrowed when the caller already ends it with a NUL, copied once otherwise);
//! - an ELF cubin must be a consistent ELF64 file: entry sizes of 64 and 56 bytes,
//!   a section name table that exists, every section, segment and section name
//!   inside the blob; symbol and relocation tables of whole ELF64 entries, linked
//!   to a string table and a symbol table, whose symbol names, section indices,
//!   symbol indices and relocation offsets lie inside what they name (a
//!   relocation table must name the section it relocates: `sh_info` 0, the null
//!   section, and a NOBITS section, which has no bytes to relocate, are refused);
//! - a fatbin's header must describe no more bytes than the blob has, and every
//!   entry must lie inside it; a cubin entry is checked as above, and a
//!   compressed (LZ4 or zstd) cubin entry, which cannot be checked, is refused
//!   (compressed PTX entries are passed on as they are);
//! - a clang offload bundle is unpacked to its CUDA entry.
//!
//! An empty or inconsistent blob is an error naming the module, never a driver read
//! past the end of the caller's bytes. A header that contradicts itself is reported
//! as corrupted; only a consistent header whose tables run past the end is reported
//! as a possible truncation.

//!
//! `kind.rs` owns [`BlobKind`] and the shared readers; `elf.rs` the cubin check;
//! `fatbin.rs` the fatbin and offload-bundle checks; `mod.rs` the entry points.

mod elf;
mod fatbin;
mod kind;

use std::borrow::Cow;

pub(crate) use elf::{elf_info, ElfInfo};
pub use kind::BlobKind;

use crate::error::Result;
use elf::check_elf;
use fatbin::{bundle_entry, check_fatbin};
use kind::refuse;

/// Check `blob` exactly as loading it would, without a driver: the kind of image
/// the driver would be given (for an offload bundle, the kind of its CUDA entry).
///
/// For tools that read a blob's own tables (`metrale inspect`): once this has
/// passed, every section, segment and fatbin entry the headers describe lies
/// inside `blob`. A fatbin's compressed cubin entries are refused (they cannot
/// be checked without decompressing them); compressed PTX entries pass as they are.
///
/// # Errors
/// [`ErrorKind::InvalidBlob`](crate::ErrorKind::InvalidBlob) naming `module` and what is wrong, as a load gives.
pub fn check(module: &str, blob: &[u8]) -> Result<BlobKind> {
    prepare(module, blob).map(|image| image.kind)
}

/// The `sm_XX` a well-formed cubin was built for, as the number XX (90 for
/// sm_90); `None` for anything else. Read from the ELF header the way the load
/// error's architecture hint reads it.
pub fn cubin_sm(blob: &[u8]) -> Option<u32> {
    elf_info(blob).map(ElfInfo::sm)
}

/// A blob checked and ready for `cuModuleLoadDataEx`.
#[derive(Debug)]
pub(crate) struct Image<'a> {
    /// What the driver will be given (for a bundle: the entry inside it).
    pub kind: BlobKind,
    /// The bytes, NUL-terminated for PTX.
    pub bytes: Cow<'a, [u8]>,
}

/// Check `blob` and give the bytes to hand to the driver.
pub(crate) fn prepare<'a>(module: &str, blob: &'a [u8]) -> Result<Image<'a>> {
    if blob.is_empty() {
        return Err(refuse(module, "empty kernel blob"));
    }
    match BlobKind::of(blob) {
        BlobKind::Ptx => prepare_ptx(module, blob),
        BlobKind::Cubin => {
            check_elf(module, blob)?;
            Ok(Image {
                kind: BlobKind::Cubin,
                bytes: Cow::Borrowed(blob),
            })
        }
        BlobKind::Fatbin => {
            check_fatbin(module, blob)?;
            Ok(Image {
                kind: BlobKind::Fatbin,
                bytes: Cow::Borrowed(blob),
            })
        }
        BlobKind::OffloadBundle => {
            let entry = bundle_entry(module, blob)?;
            if BlobKind::of(entry) == BlobKind::OffloadBundle {
                return Err(refuse(module, "offload bundle nested in an offload bundle"));
            }
            prepare(module, entry)
        }
    }
}

fn prepare_ptx<'a>(module: &str, blob: &'a [u8]) -> Result<Image<'a>> {
    let text = match blob.split_last() {
        Some((0, body)) => body,
        _ => blob,
    };
    if let Err(e) = std::str::from_utf8(text) {
        return Err(refuse(module, format_args!("PTX is not valid UTF-8: {e}")));
    }
    if let Some(at) = text.iter().position(|&b| b == 0) {
        return Err(refuse(
            module,
            format_args!("PTX has a NUL byte at offset {at}, before its end"),
        ));
    }
    let bytes = if text.len() < blob.len() {
        Cow::Borrowed(blob)
    } else {
        let mut owned = Vec::with_capacity(blob.len() + 1);
        owned.extend_from_slice(blob);
        owned.push(0);
        Cow::Owned(owned)
    };
    Ok(Image {
        kind: BlobKind::Ptx,
        bytes,
    })
}

#[cfg(test)]
use crate::error::ErrorKind;
#[cfg(test)]
use kind::{BUNDLE_MAGIC, ELF_MAGIC, FATBIN_MAGIC};

#[cfg(test)]
#[path = "../tests/blob.rs"]
mod tests;
