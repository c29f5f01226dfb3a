//! Issue 40 item 10: the blob check and `metrale inspect` stay linear in the
//! blob. Each test crafts a large cubin that made one of them quadratic (the
//! round-5 review: 65,000 section headers naming one symbol table took 7.3 s
//! to check; `inspect` was symbols × sections) and bounds the time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const SHT_SYMTAB: u32 = 2;
const SHT_STRTAB: u32 = 3;
const SHT_PROGBITS: u32 = 1;

/// One section of a crafted cubin.
struct Sec {
    name: String,
    kind: u32,
    data: Vec<u8>,
    link: u32,
    info: u32,
    entsize: u64,
    /// Point at the bytes of this earlier section instead of its own.
    same_bytes_as: Option<usize>,
}

impl Sec {
    fn new(name: &str, kind: u32, data: Vec<u8>) -> Sec {
        Sec {
            name: name.to_owned(),
            kind,
            data,
            link: 0,
            info: 0,
            entsize: 0,
            same_bytes_as: None,
        }
    }
}

/// An sm_90 cubin (ELF ABI 8) of `secs` (after the null section and the
/// section name table, which this adds as sections 0 and 1).
fn cubin(secs: &[Sec]) -> Vec<u8> {
    let mut names = vec![0u8];
    let mut name_at = Vec::with_capacity(secs.len() + 1);
    name_at.push(names.len() as u32);
    names.extend_from_slice(b".shstrtab\0");
    for s in secs {
        name_at.push(names.len() as u32);
        names.extend_from_slice(s.name.as_bytes());
        names.push(0);
    }
    let mut b = vec![0u8; 64];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = 2; // 64-bit
    b[5] = 1; // little-endian
    b[6] = 1;
    b[8] = 8; // CUDA ELF ABI 8: the arch in e_flags bits 8..16
    b[0x30..0x34].copy_from_slice(&(90u32 << 8).to_le_bytes());
    let names_at = b.len() as u64;
    b.extend_from_slice(&names);
    let mut placed: Vec<(u64, u64)> = Vec::with_capacity(secs.len());
    for s in secs {
        let at = match s.same_bytes_as {
            Some(i) => placed[i],
            None => {
                while !b.len().is_multiple_of(8) {
                    b.push(0);
                }
                let at = b.len() as u64;
                b.extend_from_slice(&s.data);
                (at, s.data.len() as u64)
            }
        };
        placed.push(at);
    }
    while !b.len().is_multiple_of(8) {
        b.push(0);
    }
    let shoff = b.len() as u64;
    let shnum = u16::try_from(secs.len() + 2).unwrap();
    b[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
    b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    b[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
    b[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
    let header = |b: &mut Vec<u8>,
                  name: u32,
                  kind: u32,
                  (off, size): (u64, u64),
                  link: u32,
                  info: u32,
                  ent: u64| {
        let mut h = [0u8; 64];
        h[0..4].copy_from_slice(&name.to_le_bytes());
        h[4..8].copy_from_slice(&kind.to_le_bytes());
        h[0x18..0x20].copy_from_slice(&off.to_le_bytes());
        h[0x20..0x28].copy_from_slice(&size.to_le_bytes());
        h[0x28..0x2c].copy_from_slice(&link.to_le_bytes());
        h[0x2c..0x30].copy_from_slice(&info.to_le_bytes());
        h[0x38..0x40].copy_from_slice(&ent.to_le_bytes());
        b.extend_from_slice(&h);
    };
    b.extend_from_slice(&[0u8; 64]);
    header(
        &mut b,
        name_at[0],
        SHT_STRTAB,
        (names_at, names.len() as u64),
        0,
        0,
        0,
    );
    for (i, s) in secs.iter().enumerate() {
        header(
            &mut b,
            name_at[i + 1],
            s.kind,
            placed[i],
            s.link,
            s.info,
            s.entsize,
        );
    }
    b
}

/// A symbol table entry: a CUDA kernel (`STT_FUNC`, `STO_CUDA_ENTRY`) named
/// at `name` of its string table, in section `shndx`.
fn kernel_symbol(name: u32, shndx: u16) -> [u8; 24] {
    let mut e = [0u8; 24];
    e[0..4].copy_from_slice(&name.to_le_bytes());
    e[4] = 0x12; // global function
    e[5] = 0x10; // STO_CUDA_ENTRY
    e[6..8].copy_from_slice(&shndx.to_le_bytes());
    e
}

fn check_time(blob: &[u8]) -> (Duration, Result<(), String>) {
    let t = Instant::now();
    let r = metrale_runtime::blob::check("crafted", blob)
        .map(|_| ())
        .map_err(|e| e.to_string());
    (t.elapsed(), r)
}

/// 65,000 section headers naming the bytes of one symbol table (of 1,000
/// symbols): the check read the table once per header. Overlapping sections
/// are refused now, at once.
#[test]
fn overlapping_symbol_tables_are_refused_at_once() {
    let mut strtab = vec![0u8];
    strtab.extend_from_slice(b"k\0");
    let mut symtab = Vec::new();
    for _ in 0..1000 {
        symtab.extend_from_slice(&kernel_symbol(1, 0));
    }
    let mut secs = vec![Sec::new(".strtab", SHT_STRTAB, strtab)];
    for i in 0..65_000 {
        let mut s = Sec::new(".symtab", SHT_SYMTAB, Vec::new());
        s.link = 2;
        s.entsize = 24;
        if i == 0 {
            s.data = symtab.clone();
        } else {
            s.same_bytes_as = Some(1);
        }
        secs.push(s);
    }
    let blob = cubin(&secs);
    assert!(blob.len() > 4 << 20, "{} bytes", blob.len());
    let (took, r) = check_time(&blob);
    let e = r.unwrap_err();
    assert!(e.contains("malformed cubin: sections 3 (bytes"), "{e}");
    assert!(e.ends_with("overlap"), "{e}");
    assert!(took < Duration::from_millis(500), "the check took {took:?}");
}

/// 20,000 symbol tables, apart, all linking to one string table of 2 MiB
/// whose last NUL is at its start: where its names may start was scanned
/// once per symbol table. Once per string table now.
#[test]
fn many_symbol_tables_of_one_string_table_are_checked_once_each() {
    let mut strtab = vec![0u8; 2];
    strtab.extend(std::iter::repeat_n(b'a', 2 << 20));
    let mut secs = vec![Sec::new(".strtab", SHT_STRTAB, strtab)];
    for _ in 0..20_000 {
        let mut s = Sec::new(".symtab", SHT_SYMTAB, kernel_symbol(1, 0).to_vec());
        s.link = 2;
        s.entsize = 24;
        secs.push(s);
    }
    let blob = cubin(&secs);
    let (took, r) = check_time(&blob);
    r.unwrap();
    assert!(took < Duration::from_millis(500), "the check took {took:?}");
}

fn temp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("metrale-cli-linear-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// 20,000 kernels, each with its own `.nv.info.<name>`, `.text.<name>` and
/// `.nv.shared.<name>` sections (60,000 sections), and a global `.nv.info`
/// with a register count for each: `inspect` scanned every section for each
/// kernel (three times) and every global record, and deduplicated names in a
/// list. Each is a map lookup now.
#[test]
fn inspect_of_many_kernels_and_sections_is_linear() {
    const N: usize = 20_000;
    let mut strtab = vec![0u8];
    let mut at = Vec::with_capacity(N);
    for k in 0..N {
        at.push(strtab.len() as u32);
        strtab.extend_from_slice(format!("k{k}\0").as_bytes());
    }
    let mut global = Vec::new();
    let mut symtab = Vec::new();
    // Sections: 2 .strtab, 3 .symtab, 4 .nv.info, then per kernel three.
    for (k, &name) in at.iter().enumerate() {
        let text = u16::try_from(5 + 3 * k).unwrap();
        symtab.extend_from_slice(&kernel_symbol(name, text));
        // EIFMT_SVAL EIATTR_REGCOUNT, 8 bytes: symbol index, count.
        global.extend_from_slice(&[4, 0x2f, 8, 0]);
        global.extend_from_slice(&(k as u32).to_le_bytes());
        global.extend_from_slice(&32u32.to_le_bytes());
    }
    let mut secs = vec![Sec::new(".strtab", SHT_STRTAB, strtab)];
    let mut s = Sec::new(".symtab", SHT_SYMTAB, symtab);
    s.link = 2;
    s.entsize = 24;
    secs.push(s);
    secs.push(Sec::new(".nv.info", SHT_PROGBITS, global));
    for k in 0..N {
        secs.push(Sec::new(&format!(".text.k{k}"), SHT_PROGBITS, vec![0; 16]));
        // EIFMT_SVAL EIATTR_CBANK_PARAM_SIZE (2 bytes: 8).
        secs.push(Sec::new(
            &format!(".nv.info.k{k}"),
            SHT_PROGBITS,
            vec![4, 0x19, 2, 0, 8, 0, 0, 0],
        ));
        secs.push(Sec::new(&format!(".nv.shared.k{k}"), 8, vec![0; 0]));
    }
    let blob = cubin(&secs);
    let path = temp("many.cubin", &blob);
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_metrale"))
        .args(["inspect".as_ref(), "--offline".as_ref(), path.as_os_str()])
        .env("METRALE_LIBCUDA_PATH", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    let took = t.elapsed();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("kernels: {N}")), "{text:.400}");
    assert!(text.contains("k19999"), "the last kernel is listed");
    assert!(took < Duration::from_secs(3), "inspect took {took:?}");
}
