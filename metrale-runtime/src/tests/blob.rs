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

fn elf(len: usize, shoff: u64, shnum: u16) -> Vec<u8> {
    let mut b = vec![0u8; len];
    b[..4].copy_from_slice(ELF_MAGIC);
    b[4] = 2;
    b[5] = 1;
    b[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
    b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    b[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
    b
}

#[test]
fn truncated_cubin_is_refused_before_the_driver() {
    assert!(prepare("k", &elf(64 + 128, 64, 2)).is_ok());
    let e = prepare("k", &elf(64 + 100, 64, 2)).unwrap_err().to_string();
    assert_eq!(
        e,
        "k: malformed cubin: section headers lie past the end of the blob (truncated?)"
    );
    let short = &elf(64, 64, 0)[..40];
    let e = prepare("k", short).unwrap_err().to_string();
    assert_eq!(e, "k: malformed cubin: shorter than an ELF header");
}

#[test]
fn fatbin_size_is_checked() {
    let mut b = vec![0u8; 48];
    b[..4].copy_from_slice(&FATBIN_MAGIC);
    b[6..8].copy_from_slice(&16u16.to_le_bytes());
    b[8..16].copy_from_slice(&32u64.to_le_bytes());
    assert!(prepare("f", &b).is_ok());
    b[8..16].copy_from_slice(&33u64.to_le_bytes());
    let e = prepare("f", &b).unwrap_err().to_string();
    assert_eq!(
        e,
        "f: malformed fatbin: its header describes 16 + 33 bytes, the blob has 48"
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
