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
