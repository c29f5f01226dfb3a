//! Review regression test (wt-review1): a relocation table whose target
//! (`sh_info`) is a NOBITS section skips the r_offset bound in `blob::check`,
//! so an r_offset of 2^47 reaches the driver. Driver 580.159.04 on the H200
//! loaded such cubins without a crash (the same offset into a PROGBITS target
//! segfaults the driver, which is why the bound exists); nothing promises the
//! driver will keep ignoring them. No toolchain cubin relocates a NOBITS
//! section: refuse it, or at least bound r_offset by its sh_size.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use metrale_runtime::blob;

const KERNELS: &[u8] = include_bytes!("fixtures/kernels.sm_90.cubin");

/// `kernels.sm_90.cubin` with `.rela.nv.constant4` (section 28) retargeted at
/// `.nv.global` (section 49, NOBITS, 0x148 bytes) and its first r_offset set.
fn retargeted(r_offset: u64) -> Vec<u8> {
    let mut b = KERNELS.to_vec();
    let shoff = u64::from_le_bytes(b[0x28..0x30].try_into().unwrap()) as usize;
    let rela = shoff + 28 * 64;
    let nobits = shoff + 49 * 64;
    assert_eq!(
        u32::from_le_bytes(b[rela + 4..rela + 8].try_into().unwrap()),
        4,
        "SHT_RELA"
    );
    assert_eq!(
        u32::from_le_bytes(b[nobits + 4..nobits + 8].try_into().unwrap()),
        8,
        "SHT_NOBITS"
    );
    b[rela + 44..rela + 48].copy_from_slice(&49u32.to_le_bytes());
    let table = u64::from_le_bytes(b[rela + 24..rela + 32].try_into().unwrap()) as usize;
    b[table..table + 8].copy_from_slice(&r_offset.to_le_bytes());
    b
}

#[test]
fn a_relocation_past_a_nobits_section_is_refused() {
    for r_offset in [0x148 + 0x10_0000, 0x7fff_fff0_0000, u64::MAX - 15] {
        let e = blob::check("nobits.cubin", &retargeted(r_offset));
        assert!(
            e.is_err(),
            "r_offset {r_offset:#x} into a 0x148-byte NOBITS section was accepted"
        );
    }
}

/// `kernels.sm_90.cubin` with its first `.rela.nv.constant4` r_offset at 2^47:
/// the driver (580.159.04, H200) segfaults loading it, and `check` refuses it.
fn out_of_bounds_cubin() -> Vec<u8> {
    let mut b = KERNELS.to_vec();
    let shoff = u64::from_le_bytes(b[0x28..0x30].try_into().unwrap()) as usize;
    let rela = shoff + 28 * 64;
    let table = u64::from_le_bytes(b[rela + 24..rela + 32].try_into().unwrap()) as usize;
    b[table..table + 8].copy_from_slice(&0x7fff_fff0_0000u64.to_le_bytes());
    b
}

/// A fatbin of one sm_90 ELF entry holding `payload` (compressed when `flag`
/// is LZ4 0x2000 or zstd 0x8000; `plain` is the uncompressed size).
fn fatbin(payload: &[u8], flag: u64, plain: usize) -> Vec<u8> {
    let mut p = payload.to_vec();
    p.resize(p.len().div_ceil(8) * 8, 0);
    let mut e = Vec::new();
    e.extend_from_slice(&2u16.to_le_bytes());
    e.extend_from_slice(&257u16.to_le_bytes());
    e.extend_from_slice(&64u32.to_le_bytes());
    e.extend_from_slice(&(p.len() as u64).to_le_bytes());
    e.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    e.extend_from_slice(&0u32.to_le_bytes());
    e.extend_from_slice(&8u16.to_le_bytes());
    e.extend_from_slice(&1u16.to_le_bytes());
    e.extend_from_slice(&90u32.to_le_bytes());
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&(0x11 | flag).to_le_bytes());
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&(plain as u64).to_le_bytes());
    assert_eq!(e.len(), 64);
    e.extend_from_slice(&p);
    let mut f = Vec::new();
    f.extend_from_slice(&0xBA55_ED50u32.to_le_bytes());
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&16u16.to_le_bytes());
    f.extend_from_slice(&(e.len() as u64).to_le_bytes());
    f.extend_from_slice(&e);
    f
}

/// An LZ4 block of literals only.
fn lz4_literals(x: &[u8]) -> Vec<u8> {
    let mut out = vec![0xf0];
    let mut n = x.len() - 15;
    while n >= 255 {
        out.push(255);
        n -= 255;
    }
    out.push(n as u8);
    out.extend_from_slice(x);
    out
}

/// A zstd frame of one raw (stored) block.
fn zstd_raw(x: &[u8]) -> Vec<u8> {
    let mut out = vec![0x28, 0xb5, 0x2f, 0xfd, 0xa0];
    out.extend_from_slice(&(x.len() as u32).to_le_bytes());
    out.extend_from_slice(&(((x.len() as u32) << 3) | 1).to_le_bytes()[..3]);
    out.extend_from_slice(x);
    out
}

/// A compressed ELF entry is passed to the driver unchecked, so the cubin that
/// `check` refuses bare (and that crashes the driver) passes inside an LZ4 or
/// zstd fatbin entry. Decompress and check it, or refuse compressed entries
/// that cannot be checked.
#[test]
fn a_compressed_cubin_entry_gets_the_same_checks() {
    let bad = out_of_bounds_cubin();
    assert!(blob::check("bad.cubin", &bad).is_err());
    assert!(blob::check("plain.fatbin", &fatbin(&bad, 0, 0)).is_err());
    for (how, packed, flag) in [
        ("lz4", lz4_literals(&bad), 0x2000),
        ("zstd", zstd_raw(&bad), 0x8000),
    ] {
        let f = fatbin(&packed, flag, bad.len());
        assert!(
            blob::check("packed.fatbin", &f).is_err(),
            "a {how}-compressed entry holding the refused cubin was accepted"
        );
    }
}
