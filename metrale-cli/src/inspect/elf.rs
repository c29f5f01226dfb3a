//! What a cubin's own tables say about its kernels: the `.nv.info` records the
//! CUDA toolchain writes (`EIATTR_*`), the per-kernel `.nv.shared.*` sections, and
//! the toolkit note. Called only on a blob that `metrale_runtime::blob::check`
//! accepted, so every section lies inside it; reads still go through `get`.

use std::collections::HashMap;

use super::kernel::{Kernel, Param};

/// A cubin's architecture, toolkit and kernels.
#[derive(Debug, Default)]
pub struct Cubin {
    /// `sm_XX` as XX.
    pub sm: u32,
    /// The `-arch` ptxas was given (`sm_90a`), from `.note.nv.tkinfo`.
    pub arch: Option<String>,
    /// The toolkit release (`13.0`), from `.note.nv.tkinfo`.
    pub toolkit: Option<(u32, u32)>,
    /// The kernels (`STO_CUDA_ENTRY` functions), in symbol-table order.
    pub kernels: Vec<Kernel>,
}

const SHT_SYMTAB: u32 = 2;
const STT_FUNC: u8 = 2;
const STO_CUDA_ENTRY: u8 = 0x10;

// `.nv.info` record formats and the attributes read here.
const EIFMT_SVAL: u8 = 4;
const EIATTR_MAX_THREADS: u8 = 0x05;
const EIATTR_REQNTID: u8 = 0x10;
const EIATTR_FRAME_SIZE: u8 = 0x11;
const EIATTR_KPARAM_INFO: u8 = 0x17;
const EIATTR_CBANK_PARAM_SIZE: u8 = 0x19;
const EIATTR_MAXREG_COUNT: u8 = 0x1b;
const EIATTR_REGCOUNT: u8 = 0x2f;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

struct Section<'a> {
    name: &'a str,
    kind: u32,
    size: u64,
    info: u32,
    link: u32,
    bytes: &'a [u8],
}

/// The longest name read from a string table: longer ones are cut there (a
/// crafted table can name one long string from every symbol, and reading it
/// whole for each would make the output, and the time, symbols × its length).
const MAX_NAME: usize = 4096;

fn c_str(b: &[u8], at: usize) -> &str {
    let tail = b.get(at..).unwrap_or_default();
    let tail = &tail[..tail.len().min(MAX_NAME)];
    let end = tail.iter().position(|&c| c == 0).unwrap_or(tail.len());
    match std::str::from_utf8(&tail[..end]) {
        Ok(name) => name,
        // Cut inside a character: the part before it.
        Err(e) if e.error_len().is_none() => {
            std::str::from_utf8(&tail[..e.valid_up_to()]).unwrap_or("")
        }
        Err(_) => "",
    }
}

fn sections(blob: &[u8]) -> Vec<Section<'_>> {
    let (Some(shoff), Some(shnum), Some(shstrndx)) =
        (u64_at(blob, 0x28), u16_at(blob, 0x3c), u16_at(blob, 0x3e))
    else {
        return Vec::new();
    };
    let header = |i: usize| -> Option<(u32, u32, u64, u64, u32, u32)> {
        let at = usize::try_from(shoff)
            .ok()?
            .checked_add(i.checked_mul(64)?)?;
        Some((
            u32_at(blob, at)?,
            u32_at(blob, at + 4)?,
            u64_at(blob, at + 0x18)?,
            u64_at(blob, at + 0x20)?,
            u32_at(blob, at + 0x28)?,
            u32_at(blob, at + 0x2c)?,
        ))
    };
    let bytes_of = |kind: u32, offset: u64, size: u64| -> &[u8] {
        if kind == 8 {
            return &[];
        }
        usize::try_from(offset)
            .ok()
            .zip(usize::try_from(size).ok())
            .and_then(|(at, n)| blob.get(at..at.checked_add(n)?))
            .unwrap_or_default()
    };
    let names = header(usize::from(shstrndx))
        .map(|(_, kind, off, size, _, _)| bytes_of(kind, off, size))
        .unwrap_or_default();
    (0..usize::from(shnum))
        .filter_map(|i| {
            let (name, kind, offset, size, link, info) = header(i)?;
            Some(Section {
                name: c_str(names, usize::try_from(name).ok()?),
                kind,
                size,
                info,
                link,
                bytes: bytes_of(kind, offset, size),
            })
        })
        .collect()
}

/// The `.nv.info` records of a section: (attribute, value bytes).
fn records(bytes: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= bytes.len() {
        let (format, attr) = (bytes[at], bytes[at + 1]);
        if format == EIFMT_SVAL {
            let size = usize::from(u16_at(bytes, at + 2).unwrap_or(0));
            let Some(value) = bytes.get(at + 4..at + 4 + size) else {
                break;
            };
            out.push((attr, value));
            at += 4 + size;
        } else {
            // EIFMT_NVAL, _BVAL, _HVAL: the value sits in the record's last two bytes.
            out.push((attr, &bytes[at + 2..at + 4]));
            at += 4;
        }
    }
    out
}

fn dims(value: &[u8]) -> Option<u64> {
    // The last three words are x, y, z (EIATTR_MAX_THREADS has the function's
    // symbol first).
    let n = value.len();
    if n < 12 {
        return None;
    }
    let d = |k: usize| u32_at(value, n - 12 + 4 * k).map(u64::from);
    // Checked: three hand-made words of 0xffffffff overflow u64 (no bound is
    // reported then, and the kernel gets a note).
    d(0)?.checked_mul(d(1)?.max(1))?.checked_mul(d(2)?.max(1))
}

/// The toolkit release and `-arch` from `.note.nv.tkinfo`'s strings.
fn toolkit(note: &[u8]) -> (Option<(u32, u32)>, Option<String>) {
    let text = String::from_utf8_lossy(note);
    let release = text.split("release ").nth(1).and_then(|r| {
        let v: String = r
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let (a, b) = v.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    });
    let arch = text.split("-arch ").nth(1).and_then(|r| {
        let a: String = r
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        (!a.is_empty()).then_some(a)
    });
    (release, arch)
}

/// What a kernel's own `.nv.info.<name>` section says (read once per section,
/// however many symbols name it).
#[derive(Clone, Default)]
struct Own {
    params: Vec<Param>,
    param_bytes: Option<u64>,
    max_registers: Option<u64>,
    max_threads: Option<u64>,
    note: Option<String>,
}

fn own_info(bytes: &[u8]) -> Own {
    let own = records(bytes);
    let mut params: Vec<(u16, Param)> = own
        .iter()
        .filter(|(a, _)| *a == EIATTR_KPARAM_INFO)
        .filter_map(|(_, v)| {
            let ordinal = u16_at(v, 4)?;
            let offset = u64::from(u16_at(v, 6)?);
            let size = u64::from((u32_at(v, 8)? >> 18) & 0x3fff);
            Some((ordinal, Param { offset, size }))
        })
        .collect();
    params.sort_by_key(|(ordinal, _)| *ordinal);
    let value16 = |attr: u8| {
        own.iter()
            .find(|(a, _)| *a == attr)
            .and_then(|(_, v)| u16_at(v, 0))
            .map(u64::from)
    };
    let bound = own
        .iter()
        .find(|(a, _)| *a == EIATTR_REQNTID || *a == EIATTR_MAX_THREADS);
    let max_threads = bound.and_then(|(_, v)| dims(v));
    let note = bound
        .filter(|(_, v)| v.len() >= 12 && max_threads.is_none())
        .map(|_| "a thread bound whose product overflows u64: not shown".to_owned());
    Own {
        params: params.into_iter().map(|(_, p)| p).collect(),
        param_bytes: value16(EIATTR_CBANK_PARAM_SIZE),
        max_registers: value16(EIATTR_MAXREG_COUNT).filter(|&n| n != 0xff),
        max_threads,
        note,
    }
}

/// Read the kernels of the cubin `blob` built for `sm_<sm>`.
///
/// Linear in the blob: the sections are looked up by name in a map built
/// once (the first of a name wins, as a scan in order would find), the
/// global records by attribute and symbol likewise, and each kernel's own
/// section is read once.
pub fn parse(blob: &[u8], sm: u32) -> Cubin {
    let secs = sections(blob);
    let mut by_name: HashMap<&str, usize> = HashMap::with_capacity(secs.len());
    for (i, s) in secs.iter().enumerate() {
        by_name.entry(s.name).or_insert(i);
    }
    let named = |name: &str| by_name.get(name).and_then(|&i| secs.get(i).map(|s| (i, s)));
    let (toolkit, arch) = named(".note.nv.tkinfo").map_or((None, None), |(_, s)| toolkit(s.bytes));
    let mut cubin = Cubin {
        sm,
        arch,
        toolkit,
        kernels: Vec::new(),
    };
    let Some(symtab) = secs.iter().find(|s| s.kind == SHT_SYMTAB) else {
        return cubin;
    };
    let strtab = secs
        .get(symtab.link as usize)
        .map(|s| s.bytes)
        .unwrap_or_default();
    // (attribute, symbol index) -> value, the first record of each.
    let mut global: HashMap<(u8, u32), Option<u64>> = HashMap::new();
    if let Some((_, s)) = named(".nv.info") {
        for (attr, v) in records(s.bytes) {
            if attr != EIATTR_REGCOUNT && attr != EIATTR_FRAME_SIZE {
                continue;
            }
            if let Some(index) = u32_at(v, 0) {
                global
                    .entry((attr, index))
                    .or_insert_with(|| u32_at(v, 4).map(u64::from));
            }
        }
    }
    let per_symbol =
        |attr: u8, index: u32| -> Option<u64> { global.get(&(attr, index)).copied().flatten() };
    let mut owns: HashMap<usize, Own> = HashMap::new();
    let mut key = String::new();
    for (index, sym) in symtab.bytes.chunks_exact(24).enumerate() {
        let (info, other) = (sym[4], sym[5]);
        if info & 0xf != STT_FUNC || other & STO_CUDA_ENTRY == 0 {
            continue;
        }
        let name = c_str(strtab, u32_at(sym, 0).unwrap_or(0) as usize);
        let index = u32::try_from(index).unwrap_or(u32::MAX);
        let mut find = |prefix: &str| {
            key.clear();
            key.push_str(prefix);
            key.push_str(name);
            named(&key)
        };
        let own = match find(".nv.info.") {
            Some((i, s)) => owns.entry(i).or_insert_with(|| own_info(s.bytes)).clone(),
            None => Own::default(),
        };
        let text_info = find(".text.").map(|(_, s)| u64::from(s.info >> 24));
        let static_shared = find(".nv.shared.").map_or(0, |(_, s)| s.size);
        let registers = per_symbol(EIATTR_REGCOUNT, index).or(text_info);
        cubin.kernels.push(Kernel {
            params: own.params,
            param_bytes: own.param_bytes,
            registers,
            max_registers: own.max_registers,
            static_shared: Some(static_shared),
            local: per_symbol(EIATTR_FRAME_SIZE, index),
            max_threads: own.max_threads,
            name: name.to_owned(),
            note: own.note,
        });
    }
    cubin
}
