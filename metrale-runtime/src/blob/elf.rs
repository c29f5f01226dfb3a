//! The ELF64 cubin check: headers, sections, segments, names, symbol and
//! relocation tables, all inside the blob; the arch a cubin is for. Sections
//! with bytes never overlap (refused), and each string table is scanned once,
//! so the check is linear in the blob (sorting the section spans aside).

use super::kind::{refuse, u16_at, u32_at, u64_at, BlobKind};
use crate::error::{MetraleError, Result};

/// The parts of a cubin's ELF header that say where its tables are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ElfInfo {
    /// `e_flags`, where the CUDA toolchain records the target architecture.
    pub flags: u32,
    /// `e_ident[EI_ABIVERSION]`.
    pub abi_version: u8,
}

impl ElfInfo {
    /// The `sm_XX` the cubin was built for, as the number XX (90 for sm_90).
    ///
    /// Older CUDA ELF ABIs keep it in the low byte of `e_flags`; ABI version 8 and
    /// later (CUDA 12.8+) keep it in bits 8..16.
    pub fn sm(self) -> u32 {
        if self.abi_version >= 8 {
            (self.flags >> 8) & 0xff
        } else {
            self.flags & 0xff
        }
    }
}

/// ELF64 section header size, the only one a cubin uses.
const SHDR: u64 = 64;
/// ELF64 program header size.
const PHDR: u64 = 56;
const SHT_SYMTAB: u64 = 2;
const SHT_STRTAB: u64 = 3;
const SHT_RELA: u64 = 4;
const SHT_NOBITS: u64 = 8;
const SHT_REL: u64 = 9;
const SHT_DYNSYM: u64 = 11;
/// ELF64 symbol (`Elf64_Sym`) size.
const SYM: u64 = 24;
/// ELF64 relocation sizes (`Elf64_Rel`, `Elf64_Rela`).
const REL: u64 = 16;
const RELA: u64 = 24;
/// Section indices from here up are special (`SHN_ABS`, `SHN_COMMON`, ...), not
/// sections.
const SHN_LORESERVE: u64 = 0xff00;
/// `e_shstrndx` escape to extended numbering, which no cubin uses.
const SHN_XINDEX: u64 = 0xffff;

pub(super) fn check_elf(module: &str, blob: &[u8]) -> Result<ElfInfo> {
    let bad =
        |what: std::fmt::Arguments<'_>| refuse(module, format_args!("malformed cubin: {what}"));
    // 64-bit little-endian only: every CUDA cubin is.
    if blob.len() < 64 {
        return Err(bad(format_args!("shorter than an ELF header")));
    }
    if blob[4] != 2 || blob[5] != 1 {
        return Err(bad(format_args!("not a 64-bit little-endian ELF file")));
    }
    let header = (|| {
        Some((
            u64_at(blob, 0x20)?, // e_phoff
            u64_at(blob, 0x28)?, // e_shoff
            u32_at(blob, 0x30)?, // e_flags
            u16_at(blob, 0x36)?, // e_phentsize
            u16_at(blob, 0x38)?, // e_phnum
            u16_at(blob, 0x3a)?, // e_shentsize
            u16_at(blob, 0x3c)?, // e_shnum
            u16_at(blob, 0x3e)?, // e_shstrndx
        ))
    })();
    let Some((phoff, shoff, flags, phentsize, phnum, shentsize, shnum, shstrndx)) = header else {
        return Err(bad(format_args!("truncated header")));
    };
    // A header that contradicts itself is corruption, not truncation.
    if shnum > 0 && shentsize != SHDR {
        return Err(bad(format_args!(
            "corrupted header: e_shentsize is {shentsize}, ELF64 section headers are {SHDR} bytes"
        )));
    }
    if phnum > 0 && phentsize != PHDR {
        return Err(bad(format_args!(
            "corrupted header: e_phentsize is {phentsize}, ELF64 program headers are {PHDR} bytes"
        )));
    }
    if shnum == 0 && shoff != 0 {
        return Err(bad(format_args!(
            "corrupted header: extended section numbering (e_shnum 0 with a section table)"
        )));
    }
    if shnum > 0 && (shstrndx >= shnum || shstrndx == SHN_XINDEX) {
        return Err(bad(format_args!(
            "corrupted header: e_shstrndx {shstrndx} names no section (there are {shnum})"
        )));
    }
    let len = blob.len() as u64;
    let end_of = |off: u64, size: u64| off.checked_add(size).filter(|&end| end <= len);
    // The header is consistent: a table past the end means the file was cut short.
    if end_of(shoff, SHDR * shnum).is_none() {
        return Err(bad(format_args!(
            "section headers lie past the end of the blob (truncated?)"
        )));
    }
    if end_of(phoff, PHDR * phnum).is_none() {
        return Err(bad(format_args!(
            "program headers lie past the end of the blob (truncated?)"
        )));
    }
    let field = |at: u64, f: fn(&[u8], usize) -> Option<u64>| {
        usize::try_from(at)
            .ok()
            .and_then(|at| f(blob, at))
            .unwrap_or(0)
    };
    let section = |i: u64| Shdr::read(blob, shoff, i);
    for i in 0..shnum {
        let Shdr {
            kind, offset, size, ..
        } = section(i);
        if kind != SHT_NOBITS && end_of(offset, size).is_none() {
            return Err(bad(format_args!(
                "section {i} ({size} bytes at offset {offset}) lies past the end of the blob of {len} bytes"
            )));
        }
    }
    // Sections with bytes in the file never overlap in a cubin the toolchain
    // writes; refusing overlaps keeps every later check linear in the blob
    // (thousands of headers naming one table would have it read once each).
    let mut spans: Vec<(u64, u64, u64)> = (0..shnum)
        .filter_map(|i| {
            let s = section(i);
            (s.kind != SHT_NOBITS && s.size > 0).then(|| (s.offset, s.offset + s.size, i))
        })
        .collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        if let [(a_start, a_end, a), (b_start, b_end, b)] = *pair {
            if b_start < a_end {
                return Err(bad(format_args!(
                    "sections {a} (bytes {a_start}..{a_end}) and {b} (bytes {b_start}..{b_end}) overlap"
                )));
            }
        }
    }
    for i in 0..phnum {
        let at = phoff + i * PHDR;
        let (offset, filesz) = (field(at + 8, u64_at), field(at + 0x20, u64_at));
        if end_of(offset, filesz).is_none() {
            return Err(bad(format_args!(
                "segment {i} ({filesz} bytes at offset {offset}) lies past the end of the blob of {len} bytes"
            )));
        }
    }
    if shnum > 0 {
        let shstrtab = section(shstrndx);
        if shstrtab.kind != SHT_STRTAB {
            return Err(bad(format_args!(
                "corrupted header: section {shstrndx} (e_shstrndx) is not a string table"
            )));
        }
        // In bounds: checked above for every section that is not NOBITS.
        let names = names_end(shstrtab.bytes(blob));
        for i in 0..shnum {
            let name = section(i).name;
            if name >= names {
                return Err(bad(format_args!(
                    "section {i}'s name (offset {name}) lies outside the section name table of {} bytes",
                    shstrtab.size
                )));
            }
        }
        check_tables(blob, shoff, shnum, &bad)?;
    }
    Ok(ElfInfo {
        flags: u32::try_from(flags).unwrap_or(0),
        abi_version: blob[8],
    })
}

/// How far into the string table `table` a name may start: an offset names a
/// NUL-terminated string inside the table exactly when it is below this (one past
/// the table's last NUL). One scan per table, not one per name.
fn names_end(table: &[u8]) -> u64 {
    table
        .iter()
        .rposition(|&b| b == 0)
        .map_or(0, |at| at as u64 + 1)
}

/// One ELF64 section header, as far as the checks need it.
#[derive(Debug, Clone, Copy)]
struct Shdr {
    name: u64,
    kind: u64,
    offset: u64,
    size: u64,
    link: u64,
    info: u64,
    entsize: u64,
}

impl Shdr {
    /// Section `i` of the table at `shoff`; a field outside `blob` reads as 0 (the
    /// caller has checked that the table lies inside it).
    fn read(blob: &[u8], shoff: u64, i: u64) -> Shdr {
        let at = i.checked_mul(SHDR).and_then(|o| o.checked_add(shoff));
        let field = |off: u64, f: fn(&[u8], usize) -> Option<u64>| {
            at.and_then(|at| at.checked_add(off))
                .and_then(|at| usize::try_from(at).ok())
                .and_then(|at| f(blob, at))
                .unwrap_or(0)
        };
        Shdr {
            name: field(0, u32_at),
            kind: field(4, u32_at),
            offset: field(0x18, u64_at),
            size: field(0x20, u64_at),
            link: field(0x28, u32_at),
            info: field(0x2c, u32_at),
            entsize: field(0x38, u64_at),
        }
    }

    /// The section's bytes (empty for NOBITS, or where they are not in `blob`).
    fn bytes(self, blob: &[u8]) -> &[u8] {
        if self.kind == SHT_NOBITS {
            return &[];
        }
        usize::try_from(self.offset)
            .ok()
            .zip(usize::try_from(self.size).ok())
            .and_then(|(at, n)| blob.get(at..at.checked_add(n)?))
            .unwrap_or_default()
    }
}

/// Symbol and relocation tables: entry sizes, the tables they link to, symbol
/// names and section indices, relocation symbols and offsets. Every section's
/// bytes have been checked to lie inside `blob`.
fn check_tables(
    blob: &[u8],
    shoff: u64,
    shnum: u64,
    bad: &dyn Fn(std::fmt::Arguments<'_>) -> MetraleError,
) -> Result<()> {
    // `sh_link` of section `i` must name a section of one of `kinds`.
    let linked = |i: u64, s: Shdr, kinds: &[u64], what: &str| {
        let link = s.link;
        if link >= shnum {
            return Err(bad(format_args!(
                "section {i}'s sh_link {link} names no section (there are {shnum}), it must name a {what}"
            )));
        }
        let target = Shdr::read(blob, shoff, link);
        if !kinds.contains(&target.kind) {
            return Err(bad(format_args!(
                "section {i}'s sh_link {link} names a section of type {:#x}, not a {what}",
                target.kind
            )));
        }
        Ok(target)
    };
    // Entry size `want`, and a size that is a whole number of entries.
    let entries = |i: u64, s: Shdr, want: u64, what: &str| {
        if s.entsize != want {
            return Err(bad(format_args!(
                "section {i} ({what}) has sh_entsize {}, ELF64 entries are {want} bytes",
                s.entsize
            )));
        }
        if !s.size.is_multiple_of(want) {
            return Err(bad(format_args!(
                "section {i} ({what}) is {} bytes, not a whole number of {want}-byte entries",
                s.size
            )));
        }
        Ok(s.size / want)
    };
    // Where each string table's names may start, scanned once per table
    // however many symbol tables link to it.
    let mut names_of: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    for i in 0..shnum {
        let s = Shdr::read(blob, shoff, i);
        match s.kind {
            SHT_SYMTAB | SHT_DYNSYM => {
                entries(i, s, SYM, "symbol table")?;
                let strtab = linked(i, s, &[SHT_STRTAB], "string table")?;
                let names = *names_of
                    .entry(s.link)
                    .or_insert_with(|| names_end(strtab.bytes(blob)));
                for (n, sym) in s.bytes(blob).chunks_exact(SYM as usize).enumerate() {
                    let name = u32_at(sym, 0).unwrap_or(0);
                    let shndx = u16_at(sym, 6).unwrap_or(0);
                    if name >= names {
                        return Err(bad(format_args!(
                            "section {i} symbol {n}'s name (offset {name}) lies outside its string table (section {}, {} bytes)",
                            s.link, strtab.size
                        )));
                    }
                    if shndx != 0 && shndx < SHN_LORESERVE && shndx >= shnum {
                        return Err(bad(format_args!(
                            "section {i} symbol {n}'s st_shndx {shndx} names no section (there are {shnum})"
                        )));
                    }
                }
            }
            SHT_REL | SHT_RELA => {
                let (size, what) = if s.kind == SHT_REL {
                    (REL, "REL relocations")
                } else {
                    (RELA, "RELA relocations")
                };
                entries(i, s, size, what)?;
                let symtab = linked(i, s, &[SHT_SYMTAB, SHT_DYNSYM], "symbol table")?;
                let symbols = symtab.size / SYM;
                // Section 0 is the null section: sh_info 0 names nothing to
                // relocate, and its r_offsets would be bounded by nothing, while
                // the loader applies them to section sh_info. Every cubin the
                // toolchain writes names the relocated section (SHF_INFO_LINK).
                if s.info == 0 {
                    return Err(bad(format_args!(
                        "section {i}'s sh_info 0 names the null section, not the section relocated"
                    )));
                }
                if s.info >= shnum {
                    return Err(bad(format_args!(
                        "section {i}'s sh_info {} (the section relocated) names no section (there are {shnum})",
                        s.info
                    )));
                }
                let target = Shdr::read(blob, shoff, s.info);
                // A NOBITS section has no bytes in the file to relocate, and no
                // toolchain cubin relocates one: refused, rather than trusting the
                // driver to ignore r_offsets that nothing bounds.
                if target.kind == SHT_NOBITS {
                    return Err(bad(format_args!(
                        "section {i} relocates section {}, a NOBITS section (no bytes to relocate)",
                        s.info
                    )));
                }
                for (n, rel) in s.bytes(blob).chunks_exact(size as usize).enumerate() {
                    let offset = u64_at(rel, 0).unwrap_or(0);
                    let symbol = u64_at(rel, 8).unwrap_or(0) >> 32;
                    if symbol >= symbols {
                        return Err(bad(format_args!(
                            "section {i} relocation {n}'s symbol index {symbol} is past the {symbols} symbols of section {}",
                            s.link
                        )));
                    }
                    // The widest relocated word (8 bytes) must lie inside the target.
                    if offset.checked_add(8).is_none_or(|end| end > target.size) {
                        return Err(bad(format_args!(
                            "section {i} relocation {n}'s r_offset {offset} lies outside section {} of {} bytes",
                            s.info, target.size
                        )));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The ELF facts of a cubin, when `blob` is a well-formed one.
pub(crate) fn elf_info(blob: &[u8]) -> Option<ElfInfo> {
    if BlobKind::of(blob) != BlobKind::Cubin {
        return None;
    }
    check_elf("", blob).ok()
}
