//! Hopper features on the real device: a 2-D TMA copy through a tensor map (the
//! hand-written PTX of `fixtures/tma.ptx`, sm_90a).

use crate::common::*;
use crate::harness::Test;

pub static TMA_PTX: &[u8] = include_bytes!("../fixtures/tma.ptx");

/// Whether device 0 has the TMA (compute capability 9.0+); says so when not.
fn has_tma(reg: &MetraleRegistry) -> bool {
    let (major, _) = reg.host().limits().compute_capability;
    if major < 9 {
        eprintln!("skipped: the TMA needs compute capability 9.0 or newer");
    }
    major >= 9
}

/// A 64 x 96 f32 matrix copied tile by tile (32 x 32 boxes) through a tensor map,
/// then through the same map moved to another matrix by `replace_address`.
fn a_2d_tensor_map_copy_moves_every_tile() {
    let reg = registry();
    if !has_tma(&reg) {
        return;
    }
    let (rows, cols) = (64usize, 96usize);
    let tma = MetraleRegistry::load(0, [("tma", TMA_PTX)]).unwrap();
    let f = tma.function("tma", "tma_copy_2d").unwrap();
    let s = reg.stream();
    let a = data(rows * cols, 7);
    let b = data(rows * cols, 8);
    let da = DeviceBuffer::from_host(s, &a).unwrap();
    let db = DeviceBuffer::from_host(s, &b).unwrap();
    let mut out = DeviceBuffer::<f32>::alloc(s, rows * cols).unwrap();
    let map = TensorMap::tiled(&da)
        .dims(&[cols as u64, rows as u64])
        .strides(&[(cols * 4) as u64])
        .box_dims(&[32, 32])
        .encode()
        .unwrap();
    let cfg =
        LaunchConfig::new(((cols / 32) as u32, (rows / 32) as u32, 1), (128, 1, 1), 0).unwrap();
    s.memset_u32(&mut out, f32::NAN.to_bits()).unwrap();
    // SAFETY: tma_copy_2d(map, float*, unsigned width) writes rows x cols floats of
    // `out`; the map covers `da`, which outlives the launch (the stream is waited).
    unsafe { s.launch(&f, cfg, (&map, &mut out, cols as u32)) }.unwrap();
    assert_eq!(s.to_vec(&out).unwrap(), a, "the copy through the map");
    if let Some(layout) = f.params() {
        assert_eq!(layout.first().map(|p| p.size), Some(128), "{layout:?}");
    }

    let moved = map.replace_address(&db).unwrap();
    s.memset_u32(&mut out, f32::NAN.to_bits()).unwrap();
    // SAFETY: as above, the map now covering `db`.
    unsafe { s.launch(&f, cfg, (&moved, &mut out, cols as u32)) }.unwrap();
    assert_eq!(s.to_vec(&out).unwrap(), b, "the copy after replace_address");
}

/// The real driver agrees with the checks: what they accept it encodes, and the
/// bytes are a map (not all zeros).
fn the_driver_encodes_what_the_checks_accept() {
    let reg = registry();
    if !has_tma(&reg) {
        return;
    }
    let s = reg.stream();
    let buf = DeviceBuffer::<u16>::alloc(s, 8 * 16 * 128).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[128, 16, 8])
        .box_dims(&[64, 16, 2])
        .swizzle(Swizzle::B128)
        .l2_promotion(L2Promotion::B128)
        .encode()
        .unwrap();
    assert!(map.as_raw().opaque.iter().any(|&q| q != 0));
    let flat = TensorMap::tiled(&buf).box_dims(&[256]).encode().unwrap();
    assert!(flat.as_raw().opaque.iter().any(|&q| q != 0));
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "hopper::a_2d_tensor_map_copy_moves_every_tile",
            run: a_2d_tensor_map_copy_moves_every_tile,
        },
        Test {
            name: "hopper::the_driver_encodes_what_the_checks_accept",
            run: the_driver_encodes_what_the_checks_accept,
        },
    ]
}
