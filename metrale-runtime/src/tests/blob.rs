//! Unit tests of `blob`.

use super::*;

#[test]
fn classifies_by_magic() {
    assert_eq!(BlobKind::of(b"\x7fELF\x02\x01"), BlobKind::Cubin);
    assert_eq!(
        BlobKind::of(&[0x50, 0xed, 0x55, 0xba, 1, 0]),
        BlobKind::Fatbin
    );
    assert_eq!(
        BlobKind::of(b"__CLANG_OFFLOAD_BUNDLE__\x01"),
        BlobKind::OffloadBundle
    );
    assert_eq!(BlobKind::of(b".version 8.0"), BlobKind::Ptx);
}

#[test]
fn ptx_gets_exactly_one_trailing_nul() {
    let image = prepare("m", b".version 8.0\n").unwrap();
    assert_eq!(&*image.bytes, b".version 8.0\n\0");
    assert!(matches!(image.bytes, Cow::Owned(_)));
    let image = prepare("m", b".version 8.0\n\0").unwrap();
    assert_eq!(&*image.bytes, b".version 8.0\n\0");
    assert!(matches!(image.bytes, Cow::Borrowed(_)));
}

#[test]
fn bad_ptx_and_empty_blobs_name_the_module() {
    let e = prepare("vec", b"").unwrap_err().to_string();
    assert_eq!(e, "vec: empty kernel blob");
    let e = prepare("vec", b".version\xff 8.0").unwrap_err().to_string();
    assert_eq!(
        e,
        "vec: PTX is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 8"
    );
    let e = prepare("vec", b".version\0 8.0").unwrap_err().to_string();
    assert_eq!(e, "vec: PTX has a NUL byte at offset 8, before its end");
}

/// A consistent ELF64 cubin skeleton of `len` bytes: section 0 (null) and
/// section 1, the name table (8 bytes at offset 64), with the section headers at
/// `shoff`. `len` below `shoff + 128` makes it truncated.
fn elf(len: usize, shoff: u64) -> Vec<u8> {
    let mut b = vec![0u8; len.max(shoff as usize + 128)];
    b[..4].copy_from_slice(ELF_MAGIC);
    b[4] = 2;
    b[5] = 1;
    b[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
    b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    b[0x3c..0x3e].copy_from_slice(&2u16.to_le_bytes());
    b[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
    b[64..72].copy_from_slice(b"\0.shstr\0");
    let sh = shoff as usize + 64;
    b[sh..sh + 4].copy_from_slice(&1u32.to_le_bytes()); // name ".shstr"
    b[sh + 4..sh + 8].copy_from_slice(&3u32.to_le_bytes()); // SHT_STRTAB
    b[sh + 0x18..sh + 0x20].copy_from_slice(&64u64.to_le_bytes());
    b[sh + 0x20..sh + 0x28].copy_from_slice(&8u64.to_le_bytes());
    b.truncate(len);
    b
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn refused(b: &[u8]) -> String {
    prepare("k", b).unwrap_err().to_string()
}

#[test]
fn truncated_cubin_is_refused_before_the_driver() {
    assert!(prepare("k", &elf(72 + 128, 72)).is_ok());
    assert_eq!(
        refused(&elf(72 + 100, 72)),
        "k: malformed cubin: section headers lie past the end of the blob (truncated?)"
    );
    let short = &elf(200, 72)[..40];
    assert_eq!(
        refused(short),
        "k: malformed cubin: shorter than an ELF header"
    );
}

#[test]
fn corrupted_cubin_headers_are_named_not_called_truncated() {
    let good = elf(200, 72);
    let mut b = good.clone();
    put16(&mut b, 0x3e, 65520);
    assert_eq!(
        refused(&b),
        "k: malformed cubin: corrupted header: e_shstrndx 65520 names no section (there are 2)"
    );
    let mut b = good.clone();
    put16(&mut b, 0x3a, 0);
    put16(&mut b, 0x3c, 65535);
    assert_eq!(
        refused(&b),
        "k: malformed cubin: corrupted header: e_shentsize is 0, ELF64 section headers are 64 bytes"
    );
    let mut b = good.clone();
    put64(&mut b, 0x20, 199);
    put16(&mut b, 0x38, 1);
    assert_eq!(
        refused(&b),
        "k: malformed cubin: corrupted header: e_phentsize is 0, ELF64 program headers are 56 bytes"
    );
    // A 1 GiB segment in a consistent file.
    let mut b = elf(72 + 128 + 56, 72);
    put64(&mut b, 0x20, 200);
    put16(&mut b, 0x36, 56);
    put16(&mut b, 0x38, 1);
    put64(&mut b, 200 + 8, 64);
    put64(&mut b, 200 + 0x20, 1 << 30);
    assert_eq!(
        refused(&b),
        "k: malformed cubin: segment 0 (1073741824 bytes at offset 64) lies past the end of the blob of 256 bytes"
    );
    // A section name outside the name table.
    let mut b = good.clone();
    b[72 + 64..72 + 68].copy_from_slice(&100u32.to_le_bytes());
    assert_eq!(
        refused(&b),
        "k: malformed cubin: section 1's name (offset 100) lies outside the section name table of 8 bytes"
    );
    // The name table must be a string table.
    let mut b = good.clone();
    b[72 + 68..72 + 72].copy_from_slice(&1u32.to_le_bytes());
    assert_eq!(
        refused(&b),
        "k: malformed cubin: corrupted header: section 1 (e_shstrndx) is not a string table"
    );
    let mut b = good;
    put64(&mut b, 72 + 64 + 0x20, 1 << 30);
    assert_eq!(
        refused(&b),
        "k: malformed cubin: section 1 (1073741824 bytes at offset 64) lies past the end of the blob of 200 bytes"
    );
}

fn fatbin(entries: &[(u16, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (kind, payload) in entries {
        let mut header = vec![0u8; 64];
        header[0..2].copy_from_slice(&kind.to_le_bytes());
        header[4..8].copy_from_slice(&64u32.to_le_bytes());
        header[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        body.extend_from_slice(&header);
        body.extend_from_slice(payload);
    }
    let mut b = vec![0u8; 16];
    b[..4].copy_from_slice(&FATBIN_MAGIC);
    b[6..8].copy_from_slice(&16u16.to_le_bytes());
    b[8..16].copy_from_slice(&(body.len() as u64).to_le_bytes());
    b.extend_from_slice(&body);
    b
}

#[test]
fn fatbin_size_and_every_entry_are_checked() {
    let cubin = elf(200, 72);
    let ptx = b".version 8.0\n";
    let mut b = fatbin(&[(2, &cubin), (1, ptx)]);
    assert!(prepare("f", &b).is_ok());
    // The outer header claims more than there is.
    let total = b.len() as u64;
    put64(&mut b, 8, total);
    assert_eq!(
        refused(&b).replace("k:", "f:"),
        format!(
            "f: malformed fatbin: its header describes 16 + {total} bytes, the blob has {total}"
        )
    );
    // A 32-byte fatbin whose only entry claims 12,704 bytes.
    let mut small = vec![0u8; 32];
    small[..4].copy_from_slice(&FATBIN_MAGIC);
    small[6..8].copy_from_slice(&16u16.to_le_bytes());
    small[8..16].copy_from_slice(&16u64.to_le_bytes());
    small[16..18].copy_from_slice(&2u16.to_le_bytes());
    small[20..24].copy_from_slice(&16u32.to_le_bytes());
    small[24..32].copy_from_slice(&12_704u64.to_le_bytes());
    assert_eq!(
        refused(&small),
        "k: malformed fatbin: entry 0 at offset 16 claims 16 + 12704 bytes, past the end of the fatbin (32 bytes)"
    );
    // An entry of 1 GiB.
    let mut b = fatbin(&[(2, &cubin)]);
    put64(&mut b, 16 + 8, 1 << 30);
    assert!(refused(&b).contains("entry 0 at offset 16 claims 64 + 1073741824 bytes"));
    // A corrupted cubin inside an entry.
    let mut bad = cubin.clone();
    put16(&mut bad, 0x3e, 9);
    let b = fatbin(&[(1, ptx), (2, &bad)]);
    assert_eq!(
        refused(&b),
        "k: malformed fatbin: entry 1: malformed cubin: corrupted header: e_shstrndx 9 names no section (there are 2)"
    );
}

#[test]
fn offload_bundle_yields_its_cuda_entry() {
    let payload = b".version 8.0\n";
    let host_triple = b"host-x86_64-unknown-linux-gnu";
    let dev_triple = b"cuda-nvptx64-nvidia-cuda-sm_90";
    let mut b = BUNDLE_MAGIC.to_vec();
    b.extend_from_slice(&2u64.to_le_bytes());
    let table_len = 2 * 24 + host_triple.len() + dev_triple.len();
    let data_at = (b.len() + table_len) as u64;
    for (triple, offset, size) in [
        (&host_triple[..], data_at, 0u64),
        (&dev_triple[..], data_at, payload.len() as u64),
    ] {
        b.extend_from_slice(&offset.to_le_bytes());
        b.extend_from_slice(&size.to_le_bytes());
        b.extend_from_slice(&(triple.len() as u64).to_le_bytes());
        b.extend_from_slice(triple);
    }
    b.extend_from_slice(payload);
    let image = prepare("b", &b).unwrap();
    assert_eq!(image.kind, BlobKind::Ptx);
    assert_eq!(&*image.bytes, b".version 8.0\n\0");
    b.truncate(b.len() - 3);
    let e = prepare("b", &b).unwrap_err().to_string();
    assert_eq!(
        e,
        "b: malformed offload bundle: entry lies past the end of the blob"
    );
}

#[test]
fn sm_from_elf_flags_for_both_abis() {
    let old = ElfInfo {
        flags: 0x0050_005a,
        abi_version: 7,
    };
    assert_eq!(old.sm(), 90);
    let new = ElfInfo {
        flags: 0x0000_5a00,
        abi_version: 8,
    };
    assert_eq!(new.sm(), 90);
}

#[test]
fn the_real_fixtures_pass_every_check() {
    let cubin = include_bytes!("../../tests/fixtures/kernels.sm_90.cubin");
    let fatbin = include_bytes!("../../tests/fixtures/kernels.fatbin");
    let ptx = include_bytes!("../../tests/fixtures/kernels.ptx");
    assert_eq!(prepare("c", cubin).unwrap().kind, BlobKind::Cubin);
    assert_eq!(prepare("f", fatbin).unwrap().kind, BlobKind::Fatbin);
    assert_eq!(prepare("p", ptx).unwrap().kind, BlobKind::Ptx);
    assert_eq!(elf_info(cubin).unwrap().sm(), 90);
}

const CUBIN: &[u8] = include_bytes!("../../tests/fixtures/kernels.sm_90.cubin");

/// Section header `i` of a cubin: where it is in the blob, and its type, offset,
/// size, `sh_link`, `sh_info`.
#[derive(Debug, Clone, Copy)]
struct Section {
    header: usize,
    kind: u32,
    offset: usize,
    size: usize,
    link: u32,
    info: u32,
}

fn sections(b: &[u8]) -> Vec<Section> {
    let u16_ = |at: usize| u16::from_le_bytes(b[at..at + 2].try_into().unwrap()) as usize;
    let u32_ = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
    let u64_ = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    let shoff = u64_(0x28);
    (0..u16_(0x3c))
        .map(|i| {
            let at = shoff + i * 64;
            Section {
                header: at,
                kind: u32_(at + 4),
                offset: u64_(at + 0x18),
                size: u64_(at + 0x20),
                link: u32_(at + 0x28),
                info: u32_(at + 0x2c),
            }
        })
        .collect()
}

/// The first section of type `kind` in `blob` with at least one entry (and, for
/// relocations, a target with contents), with its index.
fn section_of(blob: &[u8], kind: u32) -> (usize, Section) {
    let all = sections(blob);
    all.iter()
        .copied()
        .enumerate()
        .find(|(_, s)| {
            s.kind == kind
                && s.size > 0
                && (!matches!(kind, 4 | 9) || all[s.info as usize].size > 0)
        })
        .unwrap()
}

/// [`section_of`] the sm_90 cubin fixture.
fn fixture_section(kind: u32) -> (usize, Section) {
    section_of(CUBIN, kind)
}

/// The uncompressed cubins inside the fatbin fixture.
fn fatbin_cubins() -> Vec<&'static [u8]> {
    let fatbin: &'static [u8] = include_bytes!("../../tests/fixtures/kernels.fatbin");
    let mut inner = Vec::new();
    let mut at = 16;
    while at < fatbin.len() {
        let header = u32::from_le_bytes(fatbin[at + 4..at + 8].try_into().unwrap()) as usize;
        let size = u64::from_le_bytes(fatbin[at + 8..at + 16].try_into().unwrap()) as usize;
        let body = &fatbin[at + header..at + header + size];
        if body.starts_with(ELF_MAGIC) {
            inner.push(body);
        }
        at += header + size;
    }
    inner
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// The sm_90 fixture with `patch` applied; `prepare` must refuse it with `want`.
fn refused_after(patch: impl FnOnce(&mut Vec<u8>), want: &str) {
    let mut b = CUBIN.to_vec();
    patch(&mut b);
    assert_eq!(refused(&b), format!("k: malformed cubin: {want}"));
}

fn accepted_after(patch: impl FnOnce(&mut Vec<u8>)) {
    let mut b = CUBIN.to_vec();
    patch(&mut b);
    assert_eq!(prepare("k", &b).unwrap().kind, BlobKind::Cubin);
}

#[test]
fn the_real_fixtures_pass_the_table_checks() {
    let cubins: [&[u8]; 2] = [
        CUBIN,
        include_bytes!("../../tests/fixtures/conditional.sm_90.cubin"),
    ];
    let fatbin = include_bytes!("../../tests/fixtures/kernels.fatbin");
    let inner = fatbin_cubins();
    assert_eq!(inner.len(), 2, "the fatbin fixture holds two cubins");
    for b in cubins.into_iter().chain(inner) {
        // The fixtures really have the tables the checks read: a symbol table and
        // relocations (REL or RELA) with entries.
        let all = sections(b);
        assert!(all.iter().any(|s| s.kind == 2 && s.size > 0));
        assert!(all
            .iter()
            .any(|s| (s.kind == 4 || s.kind == 9) && s.size > 0));
        assert_eq!(prepare("c", b).unwrap().kind, BlobKind::Cubin);
    }
    assert_eq!(prepare("f", fatbin).unwrap().kind, BlobKind::Fatbin);
}

#[test]
fn symbol_name_past_its_string_table_is_refused() {
    let (i, symtab) = fixture_section(2);
    let strtab = sections(CUBIN)[symtab.link as usize];
    let name = symtab.offset + 24; // symbol 1's st_name
    refused_after(
        |b| put32(b, name, strtab.size as u32),
        &format!(
            "section {i} symbol 1's name (offset {}) lies outside its string table (section {}, {} bytes)",
            strtab.size, symtab.link, strtab.size
        ),
    );
    refused_after(
        |b| put32(b, name, u32::MAX),
        &format!(
            "section {i} symbol 1's name (offset 4294967295) lies outside its string table (section {}, {} bytes)",
            symtab.link, strtab.size
        ),
    );
    // A name that runs to the end of the table without its NUL.
    let last = strtab.offset + strtab.size - 1;
    refused_after(
        |b| {
            b[last] = b'x';
            put32(b, name, strtab.size as u32 - 1);
        },
        &format!(
            "section {i} symbol 1's name (offset {}) lies outside its string table (section {}, {} bytes)",
            strtab.size - 1,
            symtab.link,
            strtab.size
        ),
    );
}

#[test]
fn symbol_section_index_out_of_range_is_refused() {
    let (i, symtab) = fixture_section(2);
    let shnum = sections(CUBIN).len();
    let shndx = symtab.offset + 24 + 6; // symbol 1's st_shndx
    refused_after(
        |b| put16(b, shndx, shnum as u16),
        &format!("section {i} symbol 1's st_shndx {shnum} names no section (there are {shnum})"),
    );
    refused_after(
        |b| put16(b, shndx, 0xfeff),
        &format!("section {i} symbol 1's st_shndx 65279 names no section (there are {shnum})"),
    );
    // Undefined, SHN_ABS, SHN_COMMON and the last real section are indices a symbol may have.
    for ok in [0, 0xfff1, 0xfff2, shnum as u16 - 1] {
        accepted_after(|b| put16(b, shndx, ok));
    }
}

#[test]
fn relocation_symbol_index_past_the_symbol_table_is_refused() {
    // The sm_90 fixture's relocations are RELA; the fatbin's other cubin has REL.
    let rel_cubin = fatbin_cubins()
        .into_iter()
        .find(|b| sections(b).iter().any(|s| s.kind == 9 && s.size > 0))
        .unwrap();
    for (cubin, kind) in [(CUBIN, 4), (rel_cubin, 9)] {
        let (i, rel) = section_of(cubin, kind);
        let symbols = sections(cubin)[rel.link as usize].size / 24;
        let sym = rel.offset + 8 + 4; // entry 0's r_info, high half
        let with = |index: u32| {
            let mut b = cubin.to_vec();
            put32(&mut b, sym, index);
            b
        };
        assert_eq!(
            refused(&with(u32::MAX)),
            format!(
                "k: malformed cubin: section {i} relocation 0's symbol index 4294967295 is past the {symbols} symbols of section {}",
                rel.link
            )
        );
        assert_eq!(
            refused(&with(symbols as u32)),
            format!(
                "k: malformed cubin: section {i} relocation 0's symbol index {symbols} is past the {symbols} symbols of section {}",
                rel.link
            )
        );
        assert!(prepare("k", &with(symbols as u32 - 1)).is_ok());
        assert!(prepare("k", &with(0)).is_ok());
    }
}

#[test]
fn relocation_offset_past_its_section_is_refused() {
    let (i, rel) = fixture_section(4);
    let target = sections(CUBIN)[rel.info as usize];
    let r_offset = rel.offset; // entry 0's r_offset
    refused_after(
        |b| put64(b, r_offset, target.size as u64 - 7),
        &format!(
            "section {i} relocation 0's r_offset {} lies outside section {} of {} bytes",
            target.size - 7,
            rel.info,
            target.size
        ),
    );
    refused_after(
        |b| put64(b, r_offset, u64::MAX),
        &format!(
            "section {i} relocation 0's r_offset {} lies outside section {} of {} bytes",
            u64::MAX,
            rel.info,
            target.size
        ),
    );
    // The last 8-byte word is inside.
    accepted_after(|b| put64(b, r_offset, target.size as u64 - 8));
    // A relocation section must apply to a section that exists.
    let shnum = sections(CUBIN).len();
    refused_after(
        |b| put32(b, rel.header + 0x2c, shnum as u32),
        &format!(
            "section {i}'s sh_info {shnum} (the section relocated) names no section (there are {shnum})"
        ),
    );
}

/// `sh_info` 0 names the null section: no section to relocate and nothing to
/// bound the offsets by (the audit's fuzz found two such tables accepted, with
/// any r_offset). Refused, with an in-range offset as with a wild one.
#[test]
fn relocation_table_of_the_null_section_is_refused() {
    let (i, rel) = fixture_section(4);
    let r_offset = rel.offset;
    let want = format!("section {i}'s sh_info 0 names the null section, not the section relocated");
    refused_after(|b| put32(b, rel.header + 0x2c, 0), &want);
    refused_after(
        |b| {
            put32(b, rel.header + 0x2c, 0);
            put64(b, r_offset, u64::MAX);
        },
        &want,
    );
    // Every relocation table of the real fixtures names its section.
    for b in [CUBIN].into_iter().chain(fatbin_cubins()) {
        for s in sections(b).iter().filter(|s| matches!(s.kind, 4 | 9)) {
            assert_ne!(s.info, 0, "a fixture's relocation table of section 0");
        }
    }
}

#[test]
fn table_entry_sizes_are_checked() {
    let (s, symtab) = fixture_section(2);
    let (r, rel) = fixture_section(4);
    refused_after(
        |b| put64(b, symtab.header + 0x38, 16),
        &format!("section {s} (symbol table) has sh_entsize 16, ELF64 entries are 24 bytes"),
    );
    refused_after(
        |b| put64(b, symtab.header + 0x20, symtab.size as u64 - 1),
        &format!(
            "section {s} (symbol table) is {} bytes, not a whole number of 24-byte entries",
            symtab.size - 1
        ),
    );
    refused_after(
        |b| put64(b, rel.header + 0x38, 16),
        &format!("section {r} (RELA relocations) has sh_entsize 16, ELF64 entries are 24 bytes"),
    );
    refused_after(
        |b| put64(b, rel.header + 0x20, rel.size as u64 - 8),
        &format!(
            "section {r} (RELA relocations) is {} bytes, not a whole number of 24-byte entries",
            rel.size - 8
        ),
    );
    // A REL table keeps RELA's 24-byte entries.
    refused_after(
        |b| put32(b, rel.header + 4, 9),
        &format!("section {r} (REL relocations) has sh_entsize 24, ELF64 entries are 16 bytes"),
    );
    // A dynamic symbol table is held to the same rules as a symbol table.
    accepted_after(|b| put32(b, symtab.header + 4, 11));
    refused_after(
        |b| {
            put32(b, symtab.header + 4, 11);
            put64(b, symtab.header + 0x38, 0);
        },
        &format!("section {s} (symbol table) has sh_entsize 0, ELF64 entries are 24 bytes"),
    );
}

#[test]
fn sh_link_must_name_the_right_table() {
    let all = sections(CUBIN);
    let (s, symtab) = fixture_section(2);
    let (r, rel) = fixture_section(4);
    let progbits = all.iter().position(|x| x.kind == 1).unwrap();
    let shnum = all.len();
    // A symbol table's names come from a string table...
    refused_after(
        |b| put32(b, symtab.header + 0x28, progbits as u32),
        &format!(
            "section {s}'s sh_link {progbits} names a section of type 0x1, not a string table"
        ),
    );
    refused_after(
        |b| put32(b, symtab.header + 0x28, 0xffff),
        &format!(
            "section {s}'s sh_link 65535 names no section (there are {shnum}), it must name a string table"
        ),
    );
    // ...and a relocation table's symbols from a symbol table.
    refused_after(
        |b| put32(b, rel.header + 0x28, symtab.link),
        &format!(
            "section {r}'s sh_link {} names a section of type 0x3, not a symbol table",
            symtab.link
        ),
    );
    refused_after(
        |b| put32(b, rel.header + 0x28, shnum as u32),
        &format!(
            "section {r}'s sh_link {shnum} names no section (there are {shnum}), it must name a symbol table"
        ),
    );
}

/// Reads everything an accepted binary's headers point at, trusting them the way
/// a loader would: slicing panics on any range outside the blob.
fn read_as_the_driver_would(b: &[u8]) {
    let u16_ = |at: usize| u16::from_le_bytes(b[at..at + 2].try_into().unwrap()) as usize;
    let u32_ = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize;
    let u64_ = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize;
    match BlobKind::of(b) {
        BlobKind::Cubin => {
            let (phoff, shoff) = (u64_(0x20), u64_(0x28));
            let (phnum, shnum, shstrndx) = (u16_(0x38), u16_(0x3c), u16_(0x3e));
            let section = |i: usize| {
                let at = shoff + i * 64;
                (u32_(at), u32_(at + 4), u64_(at + 0x18), u64_(at + 0x20))
            };
            for i in 0..shnum {
                let (_, kind, off, size) = section(i);
                if kind != 8 {
                    let _ = &b[off..off + size];
                }
            }
            for i in 0..phnum {
                let at = phoff + i * 56;
                let (off, size) = (u64_(at + 8), u64_(at + 0x20));
                let _ = &b[off..off + size];
            }
            if shnum > 0 {
                let (_, _, names, len) = section(shstrndx);
                let table = &b[names..names + len];
                for i in 0..shnum {
                    let name = section(i).0;
                    assert!(table[name..].contains(&0));
                }
            }
            // Symbol and relocation tables, followed to what they name.
            for i in 0..shnum {
                let (_, kind, off, size) = section(i);
                let at = shoff + i * 64;
                let (link, info, entsize) = (u32_(at + 0x28), u32_(at + 0x2c), u64_(at + 0x38));
                match kind {
                    2 | 11 => {
                        assert!(link < shnum);
                        let (_, _, s_off, s_len) = section(link);
                        let strings = &b[s_off..s_off + s_len];
                        for k in 0..size / entsize {
                            let sym = &b[off + k * entsize..off + (k + 1) * entsize];
                            let name = u32::from_le_bytes(sym[0..4].try_into().unwrap()) as usize;
                            assert!(strings[name..].contains(&0));
                            let shndx = u16::from_le_bytes(sym[6..8].try_into().unwrap()) as usize;
                            assert!(shndx < shnum || shndx >= 0xff00);
                        }
                    }
                    4 | 9 => {
                        assert!(link < shnum && info != 0 && info < shnum);
                        let (_, _, sym_off, sym_len) = section(link);
                        let symbols = &b[sym_off..sym_off + sym_len];
                        let (_, t_kind, t_off, t_size) = section(info);
                        for k in 0..size / entsize {
                            let rel = &b[off + k * entsize..off + (k + 1) * entsize];
                            let r_offset =
                                u64::from_le_bytes(rel[0..8].try_into().unwrap()) as usize;
                            let r_info = u64::from_le_bytes(rel[8..16].try_into().unwrap());
                            let sym = (r_info >> 32) as usize;
                            let _ = &symbols[sym * 24..sym * 24 + 24];
                            if t_kind != 8 {
                                let _ = &b[t_off..t_off + t_size][r_offset..r_offset + 8];
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        BlobKind::Fatbin => {
            let (header, size) = (u16_(6), u64_(8));
            let end = header + size;
            let _ = &b[..end];
            let mut at = header;
            while at < end {
                let (entry_header, payload) = (u32_(at + 4), u64_(at + 8));
                let body = &b[at + entry_header..at + entry_header + payload];
                let compressed = u64_(at + 0x28) & 0x2000 != 0;
                if u16_(at) == 2 && !compressed && body.starts_with(ELF_MAGIC) {
                    read_as_the_driver_would(body);
                }
                at += entry_header + payload;
            }
        }
        _ => {}
    }
}

/// A bounded fuzz of the real fixtures: 30,000 mutations (fields set to extreme or
/// random values, bytes flipped, truncations). Nothing panics; every refusal names
/// the module; everything accepted stays inside its bytes when read as the driver
/// reads it.
#[test]
fn mutated_fixtures_are_refused_by_name_or_safe_to_read() {
    let fixtures: [&[u8]; 3] = [
        include_bytes!("../../tests/fixtures/kernels.sm_90.cubin"),
        include_bytes!("../../tests/fixtures/kernels.fatbin"),
        include_bytes!("../../tests/fixtures/kernels.ptx"),
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut refused, mut accepted) = (0, 0);
    for round in 0..30_000 {
        let original = fixtures[round % 3];
        let mut b = original.to_vec();
        let len = b.len();
        for _ in 0..1 + next() % 3 {
            let r = next();
            // Header fields are where the interesting lies are: aim there often.
            let at = if r % 2 == 0 {
                (r >> 8) as usize % 128
            } else {
                (r >> 8) as usize % len
            };
            let extreme = [
                0u64,
                1,
                0xff,
                0xffff,
                0xffff_ffff,
                u64::MAX,
                len as u64,
                (len - 1) as u64,
            ];
            let value = if r % 3 == 0 {
                extreme[(r >> 40) as usize % extreme.len()]
            } else {
                next()
            };
            let width = [1usize, 2, 4, 8][(r >> 20) as usize % 4];
            let end = (at + width).min(len);
            b[at..end].copy_from_slice(&value.to_le_bytes()[..end - at]);
        }
        if next() % 10 == 0 {
            b.truncate(next() as usize % len);
        }
        let outcome = std::panic::catch_unwind(|| prepare("fuzz", &b).map(|i| i.kind));
        match outcome {
            Err(_) => panic!("round {round}: prepare panicked"),
            Ok(Err(e)) => {
                refused += 1;
                assert!(
                    matches!(
        e.kind(),
        ErrorKind::InvalidBlob { module, .. } if module == "fuzz"),
                    "round {round}: {e}"
                );
                assert!(e.to_string().starts_with("fuzz: "), "round {round}: {e}");
            }
            Ok(Ok(_)) => {
                accepted += 1;
                let read = std::panic::catch_unwind(|| read_as_the_driver_would(&b));
                assert!(
                    read.is_ok(),
                    "round {round}: an accepted blob reads out of bounds"
                );
            }
        }
    }
    assert!(
        refused > 1000 && accepted > 1000,
        "{refused} refused, {accepted} accepted"
    );
}
