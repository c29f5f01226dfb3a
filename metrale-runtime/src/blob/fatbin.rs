//! The fatbin check (header and entries inside the blob, cubin entries checked
//! as cubins, compressed cubins refused) and the clang offload bundle's CUDA
//! entry.

use super::elf::check_elf;
use super::kind::{refuse, u16_at, u32_at, u64_at, BUNDLE_MAGIC, ELF_MAGIC};
use crate::error::{ErrorKind, Result};

/// Fatbin entry kind of an ELF cubin.
const FATBIN_ELF: u64 = 2;
/// Fatbin entry flag: the payload is LZ4-compressed.
const FATBIN_LZ4: u64 = 0x2000;
/// Fatbin entry flag: the payload is zstd-compressed.
const FATBIN_ZSTD: u64 = 0x8000;
/// The magic number that starts a zstd frame.
const ZSTD_MAGIC: &[u8; 4] = &[0x28, 0xb5, 0x2f, 0xfd];

pub(super) fn check_fatbin(module: &str, blob: &[u8]) -> Result<()> {
    let bad =
        |what: std::fmt::Arguments<'_>| refuse(module, format_args!("malformed fatbin: {what}"));
    // Header: magic u32, version u16, header size u16, payload size u64.
    let header = (|| Some((u16_at(blob, 6)?, u64_at(blob, 8)?)))();
    let Some((header_size, payload)) = header else {
        return Err(bad(format_args!("truncated header")));
    };
    let total = header_size.checked_add(payload);
    let end = match total {
        Some(total) if header_size >= 16 && total <= blob.len() as u64 => total,
        _ => {
            return Err(bad(format_args!(
                "its header describes {header_size} + {payload} bytes, the blob has {}",
                blob.len()
            )))
        }
    };
    // Entries follow back to back: kind u16, version u16, header size u32, payload
    // size u64, ..., flags u64 at 0x28. Each must lie inside the container.
    let mut at = header_size;
    let mut index = 0;
    while at < end {
        let field = |off: u64, f: fn(&[u8], usize) -> Option<u64>| {
            usize::try_from(at + off).ok().and_then(|i| f(blob, i))
        };
        let (Some(kind), Some(entry_header), Some(size)) =
            (field(0, u16_at), field(4, u32_at), field(8, u64_at))
        else {
            return Err(bad(format_args!(
                "entry {index} at offset {at}: truncated entry header"
            )));
        };
        let flags = field(0x28, u64_at).unwrap_or(0);
        let entry_end = at
            .checked_add(entry_header)
            .and_then(|p| p.checked_add(size));
        if entry_header < 16 || entry_end.is_none_or(|e| e > end) {
            return Err(bad(format_args!(
                "entry {index} at offset {at} claims {entry_header} + {size} bytes, past the end of the fatbin ({end} bytes)"
            )));
        }
        let start = (at + entry_header) as usize;
        let body = &blob[start..start + size as usize];
        // A compressed ELF entry cannot be checked without decompressing it,
        // and the driver would load the cubin inside unexamined: refused. (The
        // toolchain's default leaves ELF entries uncompressed and compresses
        // PTX; `-Xfatbin -compress-all` compresses ELF entries too.)
        if kind == FATBIN_ELF {
            let how = if flags & FATBIN_ZSTD != 0 || body.starts_with(ZSTD_MAGIC) {
                Some("zstd")
            } else if flags & FATBIN_LZ4 != 0 {
                Some("LZ4")
            } else {
                None
            };
            if let Some(how) = how {
                return Err(bad(format_args!(
                    "entry {index} is a {how}-compressed cubin, which metrale cannot check before \
                     the driver reads it; rebuild it without compressing its cubins \
                     (no `-Xfatbin -compress-all`)"
                )));
            }
        }
        if kind == FATBIN_ELF && body.starts_with(ELF_MAGIC) {
            check_elf(module, body).map_err(|e| match e.into_kind() {
                ErrorKind::InvalidBlob { reason, .. } => {
                    bad(format_args!("entry {index}: {reason}"))
                }
                other => other.into(),
            })?;
        }
        at = entry_end.unwrap_or(end);
        index += 1;
    }
    Ok(())
}

/// The CUDA entry of a clang offload bundle (the first whose target triple names
/// `nvptx` or `cuda`).
pub(super) fn bundle_entry<'a>(module: &str, blob: &'a [u8]) -> Result<&'a [u8]> {
    let bad = |what: &str| refuse(module, format_args!("malformed offload bundle: {what}"));
    let mut at = BUNDLE_MAGIC.len();
    let count = u64_at(blob, at).ok_or_else(|| bad("truncated header"))?;
    at += 8;
    for _ in 0..count {
        let (Some(offset), Some(size), Some(triple_len)) = (
            u64_at(blob, at),
            u64_at(blob, at + 8),
            u64_at(blob, at + 16),
        ) else {
            return Err(bad("truncated entry table"));
        };
        at += 24;
        let triple_end = usize::try_from(triple_len)
            .ok()
            .and_then(|n| at.checked_add(n))
            .filter(|&end| end <= blob.len())
            .ok_or_else(|| bad("truncated target triple"))?;
        let triple = String::from_utf8_lossy(&blob[at..triple_end]);
        at = triple_end;
        if triple.contains("nvptx") || triple.contains("cuda") {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            let end = usize::try_from(size)
                .ok()
                .and_then(|n| start.checked_add(n))
                .filter(|&end| end <= blob.len())
                .ok_or_else(|| bad("entry lies past the end of the blob"))?;
            return Ok(&blob[start..end]);
        }
    }
    Err(bad("no CUDA (nvptx) entry"))
}
