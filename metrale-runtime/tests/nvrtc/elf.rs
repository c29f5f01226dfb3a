//! Just enough ELF reading to check a cubin: its section names, its function
//! symbols, and each kernel's parameter sizes from `.nv.info.<kernel>`.

#![allow(dead_code)]

fn u16_at(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap()) as usize
}
fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}
fn u64_at(b: &[u8], at: usize) -> usize {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize
}

pub struct Section<'a> {
    pub name: String,
    pub kind: usize,
    pub data: &'a [u8],
    pub link: usize,
}

pub fn sections(elf: &[u8]) -> Vec<Section<'_>> {
    assert_eq!(&elf[..4], b"\x7fELF");
    let (shoff, shnum, shstrndx) = (u64_at(elf, 0x28), u16_at(elf, 0x3c), u16_at(elf, 0x3e));
    let header = |i: usize| shoff + i * 64;
    let body = |i: usize| {
        let h = header(i);
        let (kind, off, size) = (
            u32_at(elf, h + 4),
            u64_at(elf, h + 0x18),
            u64_at(elf, h + 0x20),
        );
        let data = if kind == 8 {
            &elf[0..0]
        } else {
            &elf[off..off + size]
        };
        (kind, data, u32_at(elf, h + 0x28))
    };
    let names = body(shstrndx).1;
    (0..shnum)
        .map(|i| {
            let name_at = u32_at(elf, header(i));
            let end = names[name_at..].iter().position(|&b| b == 0).unwrap();
            let (kind, data, link) = body(i);
            Section {
                name: String::from_utf8_lossy(&names[name_at..name_at + end]).into_owned(),
                kind,
                data,
                link,
            }
        })
        .collect()
}

/// Names of the function symbols (`STT_FUNC`) of the symbol table.
pub fn functions(elf: &[u8]) -> Vec<String> {
    let secs = sections(elf);
    let Some(symtab) = secs.iter().find(|s| s.kind == 2) else {
        return Vec::new();
    };
    let strtab = secs[symtab.link].data;
    symtab
        .data
        .chunks_exact(24)
        .filter(|sym| sym[4] & 0xf == 2)
        .map(|sym| {
            let at = u32_at(sym, 0);
            let end = strtab[at..].iter().position(|&b| b == 0).unwrap();
            String::from_utf8_lossy(&strtab[at..at + end]).into_owned()
        })
        .collect()
}

/// The kernels: functions with an `.nv.info.<name>` section.
pub fn kernels(elf: &[u8]) -> Vec<String> {
    let secs = sections(elf);
    let mut out: Vec<String> = functions(elf)
        .into_iter()
        .filter(|f| secs.iter().any(|s| s.name == format!(".nv.info.{f}")))
        .collect();
    out.sort();
    out
}

/// Parameter sizes of `kernel` in parameter order, from its `EIATTR_KPARAM_INFO`
/// records.
pub fn param_sizes(elf: &[u8], kernel: &str) -> Vec<usize> {
    let secs = sections(elf);
    let info = secs
        .iter()
        .find(|s| s.name == format!(".nv.info.{kernel}"))
        .unwrap_or_else(|| panic!("no .nv.info.{kernel}"));
    let d = info.data;
    let mut params: Vec<(usize, usize)> = Vec::new();
    let mut at = 0;
    while at + 4 <= d.len() {
        let (format, attr) = (d[at], d[at + 1]);
        let size = u16_at(d, at + 2);
        if format == 0x04 {
            if attr == 0x17 {
                let rec = &d[at + 4..at + 4 + size];
                let ordinal = u16_at(rec, 4);
                let word = u32_at(rec, 8);
                params.push((ordinal, (word >> 18) & 0x3fff));
            }
            at += 4 + size;
        } else {
            at += 4;
        }
    }
    params.sort();
    params.into_iter().map(|(_, s)| s).collect()
}
