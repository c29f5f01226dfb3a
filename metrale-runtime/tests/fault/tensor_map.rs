//! Tensor maps: every documented rule refused with its text before the driver, the
//! fields reaching `cuTensorMapEncodeTiled` unchanged (the stand-in writes what it
//! received into the map's 128 bytes), the map as a 128-byte kernel argument,
//! `replace_address`, and an old driver's missing symbol.

use metrale_fakecuda::decode_tensor_map;

use crate::common::*;
use crate::harness::{run_child, Child, Test};

/// A kernel taking a tensor map (128 bytes, 64-aligned) and a pointer, and one
/// taking a pointer where the map would go.
const TMA_TEXT: &str = "
.version 8.0
.target sm_90a
.address_size 64
.visible .entry tma_copy(
    .param .align 64 .b8 tma_copy_param_0[128],
    .param .u64 tma_copy_param_1
)
{ ret; }
.visible .entry takes_pointer(
    .param .u64 takes_pointer_param_0,
    .param .u64 takes_pointer_param_1
)
{ ret; }
";

fn encoded<T: TensorElement>(map: &TensorMap<'_, T>) -> metrale_fakecuda::EncodedTensorMap {
    decode_tensor_map(&map.as_raw().opaque)
}

fn refused<T: TensorElement>(b: TensorMapBuilder<'_, T>, text: &str) {
    let before = fake().calls("cuTensorMapEncodeTiled");
    let e = b.encode().unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
    assert_eq!(
        e.to_string(),
        format!("invalid argument: tensor map: {text}")
    );
    assert_eq!(
        fake().calls("cuTensorMapEncodeTiled"),
        before,
        "refused before the driver: {text}"
    );
}

fn every_rule_is_refused_before_the_driver() {
    let reg = setup();
    let s = reg.stream();
    let buf = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let bytes = DeviceBuffer::<u8>::alloc(s, 1 << 16).unwrap();
    let m = || TensorMap::tiled(&buf);
    refused(
        m().dims(&[1, 1, 1, 1, 1, 1]),
        "6 sizes given; a tensor map has at most 5 dimensions",
    );
    refused(m().dims(&[]), "the rank must be 1..=5: no sizes given");
    refused(
        m().dims(&[64, 64]).interleave(Interleave::B16),
        "an interleaved map needs rank 3 or more: rank 2 with interleave B16",
    );
    refused(
        m().dims(&[0, 64]).strides(&[256]),
        "size 0 must be in 1..=2^32: 0",
    );
    refused(
        m().dims(&[4, (1 << 32) + 1]).strides(&[16]),
        "size 1 must be in 1..=2^32: 4294967297",
    );
    refused(
        m().dims(&[64, 64]).strides(&[256, 16]),
        "2 strides given for rank 2: give rank - 1 = 1 byte strides (of dimensions 1..)",
    );
    refused(
        m().dims(&[60, 64]).strides(&[240 + 8]),
        "the byte stride of dimension 1 must be a multiple of 16: 248",
    );
    refused(
        m().dims(&[1, 2]).strides(&[1 << 40]),
        "the byte stride of dimension 1 must be below 2^40: 1099511627776",
    );
    refused(
        m().dims(&[64, 65]).strides(&[256]),
        "sizes [64, 65] with byte strides [256] reach 16640 bytes, beyond the 16384 bytes of the \
         memory",
    );
    refused(
        m().dims(&[64, 64]).box_dims(&[32, 0]),
        "box size 1 must be in 1..=256: 0",
    );
    refused(
        m().dims(&[64, 64]).box_dims(&[32, 257]),
        "box size 1 must be in 1..=256: 257",
    );
    refused(
        m().dims(&[64, 64]).box_dims(&[32]),
        "1 box sizes given for rank 2",
    );
    refused(
        m().dims(&[64, 64]).box_dims(&[6, 8]),
        "without interleave the inner box row (box size 0 x element size = 6 x 4 = 24 bytes) \
         must be a multiple of 16 bytes",
    );
    refused(
        m().dims(&[64, 64]).box_dims(&[32, 8]).swizzle(Swizzle::B64),
        "the inner box row (128 bytes) must fit the swizzle span of 64 bytes (B64)",
    );
    refused(
        m().dims(&[64, 64]).element_strides(&[1, 9]),
        "element stride 1 must be in 1..=8: 9",
    );
    refused(
        m().dims(&[64, 64]).element_strides(&[0, 1]),
        "element stride 0 must be in 1..=8: 0",
    );
    refused(
        m().data_type(TensorDataType::F16),
        "data type F16 has 2-byte elements, the memory's have 4",
    );
    refused(
        TensorMap::tiled(&bytes).oob_fill(OobFill::NanRequestZeroFma),
        "NaN out-of-bounds fill needs a floating-point type, not U8",
    );
    // The global address: 16 bytes, 32 with 32-byte interleave.
    let off = buf.slice(1..).unwrap();
    refused(
        TensorMap::tiled(&off).dims(&[16]),
        &format!(
            "the global address must be aligned to 16 bytes: {:#x} is not",
            off.device_ptr()
        ),
    );
    let off16 = bytes.slice(16..).unwrap();
    refused(
        TensorMap::tiled(&off16)
            .dims(&[32, 4, 4])
            .strides(&[32, 128])
            .interleave(Interleave::B32),
        &format!(
            "the global address must be aligned to 32 bytes (32-byte interleave): {:#x} is not",
            off16.device_ptr()
        ),
    );
    refused(
        TensorMap::tiled(&bytes)
            .dims(&[16, 4, 4])
            .strides(&[16, 64])
            .interleave(Interleave::B32),
        "the byte stride of dimension 1 must be a multiple of 32 (32-byte interleave): 16",
    );
    // 32-byte interleave needs the 32-byte swizzle, through the builder and
    // through a layout.
    let interleaved = || {
        TensorMap::tiled(&bytes)
            .dims(&[32, 4, 4])
            .strides(&[32, 128])
            .box_dims(&[32, 4, 4])
            .interleave(Interleave::B32)
    };
    for swizzle in [Swizzle::None, Swizzle::B64, Swizzle::B128] {
        refused(
            interleaved().swizzle(swizzle),
            &format!(
                "32-byte interleave needs the 32-byte swizzle (Swizzle::B32): swizzle {swizzle:?}"
            ),
        );
        let e = interleaved().swizzle(swizzle).layout().unwrap_err();
        assert!(
            e.to_string()
                .contains("32-byte interleave needs the 32-byte swizzle"),
            "{e}"
        );
    }
    assert_eq!(fake().calls("cuTensorMapEncodeTiled"), 0);
    let ok = interleaved().swizzle(Swizzle::B32).encode().unwrap();
    assert_eq!(encoded(&ok).modes[..2], [2, 1]);
    // Other interleaves take any swizzle.
    TensorMap::tiled(&bytes)
        .dims(&[32, 4, 4])
        .strides(&[32, 128])
        .box_dims(&[32, 4, 4])
        .interleave(Interleave::B16)
        .swizzle(Swizzle::B128)
        .encode()
        .unwrap();
}

fn encoded_fields_reach_the_driver_unchanged() {
    let reg = setup();
    let s = reg.stream();
    let buf = DeviceBuffer::<f32>::alloc(s, 8 * 16 * 64).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[64, 16, 8])
        .strides(&[256, 256 * 16])
        .box_dims(&[32, 8, 2])
        .element_strides(&[1, 2, 8])
        .swizzle(Swizzle::B128)
        .l2_promotion(L2Promotion::B256)
        .oob_fill(OobFill::NanRequestZeroFma)
        .data_type(TensorDataType::Tf32)
        .encode()
        .unwrap();
    assert_eq!(fake().calls("cuTensorMapEncodeTiled"), 1);
    let e = encoded(&map);
    assert!(e.valid);
    assert_eq!((e.data_type, e.rank, e.address), (11, 3, buf.device_ptr()));
    assert_eq!(e.dims, [64, 16, 8]);
    assert_eq!(e.strides, [256, 4096]);
    assert_eq!(e.box_dims, [32, 8, 2]);
    assert_eq!(e.element_strides, [1, 2, 8]);
    assert_eq!(e.modes, [0, 3, 3, 1]);
    assert_eq!(map.address(), buf.device_ptr());

    // Defaults: one dimension of the whole buffer, packed strides, box capped at 256.
    let flat = TensorMap::tiled(&buf).encode().unwrap();
    let e = encoded(&flat);
    assert_eq!((e.data_type, e.rank), (7, 1));
    assert_eq!(e.dims, [8 * 16 * 64]);
    assert_eq!(e.box_dims, [256]);
    assert_eq!(e.element_strides, [1]);
    assert_eq!(e.modes, [0, 0, 0, 0]);
    let packed = TensorMap::tiled(&buf)
        .dims(&[64, 16, 8])
        .box_dims(&[64, 1, 1])
        .encode()
        .unwrap();
    assert_eq!(encoded(&packed).strides, [256, 4096]);
    // Five dimensions, interleaved.
    let b = DeviceBuffer::<u8>::alloc(s, 32 * 2 * 2 * 2 * 2).unwrap();
    let five = TensorMap::tiled(&b)
        .dims(&[32, 2, 2, 2, 2])
        .interleave(Interleave::B32)
        .swizzle(Swizzle::B32)
        .box_dims(&[32, 2, 2, 2, 2])
        .element_strides(&[1, 1, 2, 1, 1])
        .encode()
        .unwrap();
    let e = encoded(&five);
    assert_eq!(e.strides, [32, 64, 128, 256]);
    assert_eq!(e.box_dims, [32, 2, 2, 2, 2]);
    assert_eq!(e.element_strides, [1, 1, 2, 1, 1]);
    assert_eq!(e.modes[..2], [2, 1]);
    // A slice: the extent is the slice's, not the buffer's.
    let half = buf.slice(..4096).unwrap();
    TensorMap::tiled(&half).dims(&[64, 64]).encode().unwrap();
    let e = TensorMap::tiled(&half)
        .dims(&[64, 65])
        .encode()
        .unwrap_err();
    assert!(e.to_string().contains("beyond the 16384 bytes"), "{e}");
}

fn im2col_rules_are_refused_before_the_driver() {
    let reg = setup();
    let s = reg.stream();
    // NHWC: 2 images of 8 x 8 pixels of 16 f32 channels.
    let buf = DeviceBuffer::<f32>::alloc(s, 2 * 8 * 8 * 16).unwrap();
    let nhwc = || TensorMap::tiled(&buf).dims(&[16, 8, 8, 2]);
    refused(
        TensorMap::tiled(&buf)
            .dims(&[16, 128])
            .im2col(&[], &[], 16, 8),
        "an im2col map needs rank 3, 4 or 5: rank 2",
    );
    refused(
        nhwc().im2col(&[-1], &[-1, -1], 16, 8),
        "1 lower corners given for rank 4: give rank - 2 = 2",
    );
    refused(
        nhwc().im2col(&[-1, -129], &[0, 0], 16, 8),
        "lower corner 1 must be in -128..=127 for rank 4: -129",
    );
    refused(
        nhwc().im2col(&[-1, -1], &[128, 0], 16, 8),
        "upper corner 0 must be in -128..=127 for rank 4: 128",
    );
    refused(
        nhwc().im2col(&[-1, -1], &[0, 0], 0, 8),
        "channels per pixel must be in 1..=256: 0",
    );
    refused(
        nhwc().im2col(&[-1, -1], &[0, 0], 16, 1025),
        "pixels per column must be in 1..=1024: 1025",
    );
    refused(
        nhwc().im2col(&[-1, -1], &[0, 0], 2, 8),
        "without interleave a pixel's channels (2 x 4 = 8 bytes) must be a multiple of 16 bytes",
    );
    refused(
        nhwc()
            .im2col(&[-1, -1], &[0, 0], 16, 8)
            .swizzle(Swizzle::B32),
        "a pixel's channels (64 bytes) must fit the swizzle span of 32 bytes (B32)",
    );
    refused(
        nhwc()
            .box_dims(&[16, 1, 1, 1])
            .im2col(&[-1, -1], &[0, 0], 16, 8),
        "box sizes do not apply to an im2col map (it gathers pixels)",
    );
    let five = DeviceBuffer::<f32>::alloc(s, 16 * 4 * 4 * 4 * 2).unwrap();
    refused(
        TensorMap::tiled(&five)
            .dims(&[16, 4, 4, 4, 2])
            .im2col(&[-17, 0, 0], &[0, 0, 0], 16, 8),
        "lower corner 0 must be in -16..=15 for rank 5: -17",
    );
    assert_eq!(fake().calls("cuTensorMapEncodeIm2col"), 0);
}

fn im2col_fields_reach_the_driver_unchanged() {
    let reg = setup();
    let s = reg.stream();
    let buf = DeviceBuffer::<f32>::alloc(s, 2 * 8 * 8 * 16).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[16, 8, 8, 2])
        .im2col(&[-1, -2], &[3, -4], 16, 64)
        .element_strides(&[1, 2, 2, 1])
        .swizzle(Swizzle::B64)
        .encode()
        .unwrap();
    assert_eq!(fake().calls("cuTensorMapEncodeIm2col"), 1);
    assert_eq!(fake().calls("cuTensorMapEncodeTiled"), 0);
    let e = encoded(&map);
    assert!(e.valid && e.im2col);
    assert_eq!((e.data_type, e.rank, e.address), (7, 4, buf.device_ptr()));
    assert_eq!(e.dims, [16, 8, 8, 2]);
    assert_eq!(e.strides, [64, 512, 4096]);
    assert_eq!((e.lower, e.upper), (vec![-1, -2], vec![3, -4]));
    assert_eq!((e.channels_per_pixel, e.pixels_per_column), (16, 64));
    assert_eq!(e.element_strides, [1, 2, 2, 1]);
    assert_eq!(e.modes, [0, 2, 0, 0]);
    // The extent rule holds for im2col maps too.
    let e = TensorMap::tiled(&buf)
        .dims(&[16, 8, 8, 3])
        .im2col(&[0, 0], &[0, 0], 16, 8)
        .encode()
        .unwrap_err();
    assert!(e.to_string().contains("beyond the 8192 bytes"), "{e}");
}

fn a_driver_failure_names_the_call_and_the_address() {
    let reg = setup();
    let buf = DeviceBuffer::<u32>::alloc(reg.stream(), 64).unwrap();
    fake().fail("cuTensorMapEncodeTiled", 1, 1, Some(1));
    let e = TensorMap::tiled(&buf).encode().unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Driver {
                call: "cuTensorMapEncodeTiled",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains(&format!("tensor map at {:#x}", buf.device_ptr())),
        "{e}"
    );
}

fn a_map_is_a_128_byte_kernel_argument() {
    let reg = setup();
    let s = reg.stream();
    let tma = MetraleRegistry::load(0, &[("tma", TMA_TEXT.as_bytes())]).unwrap();
    let f = tma.function("tma", "tma_copy").unwrap();
    let buf = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let out = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[64, 64])
        .box_dims(&[32, 32])
        .encode()
        .unwrap();
    assert_eq!(<&TensorMap<'_, f32> as KernelArg>::SIZE, 128);
    let cfg = LaunchConfig::new((2, 2, 1), (128, 1, 1), 0).unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg, (&map, &out)) }.unwrap();
    let l = fake().last_launch();
    assert_eq!((l.kernel.as_str(), l.params), ("tma_copy", 2));
    assert_eq!(
        fake().last_param(0),
        map.as_raw().opaque[0],
        "the map's bytes"
    );
    assert_eq!(fake().last_param(1), out.device_ptr());
    // A map where the kernel takes a pointer: refused by the launch check.
    let g = tma.function("tma", "takes_pointer").unwrap();
    let launches = fake().launches();
    // SAFETY: refused before the driver.
    let e = unsafe { s.launch(&g, cfg, (&map, &out)) }.unwrap_err();
    assert!(e.to_string().contains("128"), "{e}");
    assert_eq!(fake().launches(), launches);
    // A pointer where the kernel takes a map: refused too.
    // SAFETY: refused before the driver.
    let e = unsafe { s.launch(&f, cfg, (&buf, &out)) }.unwrap_err();
    assert!(e.to_string().contains("128"), "{e}");
}

fn replace_address_moves_the_map_to_memory_of_the_same_shape() {
    let reg = setup();
    let s = reg.stream();
    let a = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let b = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let small = DeviceBuffer::<f32>::alloc(s, 64 * 63).unwrap();
    let map = TensorMap::tiled(&a)
        .dims(&[64, 64])
        .box_dims(&[16, 16])
        .encode()
        .unwrap();
    let moved = map.replace_address(&b).unwrap();
    assert_eq!(fake().calls("cuTensorMapReplaceAddress"), 1);
    let e = encoded(&moved);
    assert_eq!(e.address, b.device_ptr());
    assert_eq!((e.dims, e.box_dims), (vec![64, 64], vec![16, 16]));
    assert_eq!(moved.address(), b.device_ptr());

    let e = moved.replace_address(&small).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: tensor map: the map reaches 16384 bytes, beyond the 16128 \
         bytes of the memory"
    );
    let again = TensorMap::tiled(&a).dims(&[64, 64]).encode().unwrap();
    let off = b.slice(2..).unwrap();
    let e = again.replace_address(&off).unwrap_err();
    assert!(e.to_string().contains("aligned to 16 bytes"), "{e}");
    assert_eq!(
        fake().calls("cuTensorMapReplaceAddress"),
        1,
        "refusals never reach it"
    );
}

fn set_address_moves_the_map_in_place_and_a_refusal_leaves_it() {
    let reg = setup();
    let s = reg.stream();
    let a = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let b = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let small = DeviceBuffer::<f32>::alloc(s, 64 * 63).unwrap();
    let mut map = TensorMap::tiled(&a)
        .dims(&[64, 64])
        .box_dims(&[16, 16])
        .encode()
        .unwrap();
    let before = fake().calls("cuTensorMapReplaceAddress");
    map.set_address(&b).unwrap();
    assert_eq!(fake().calls("cuTensorMapReplaceAddress"), before + 1);
    assert_eq!(map.address(), b.device_ptr());
    assert_eq!(encoded(&map).address, b.device_ptr());
    let e = map.set_address(&small).unwrap_err();
    assert!(e.to_string().contains("beyond the 16128 bytes"), "{e}");
    // Unchanged: still the map over `b`, and the refusal never reached the driver.
    assert_eq!(map.address(), b.device_ptr());
    assert_eq!(encoded(&map).address, b.device_ptr());
    assert_eq!(fake().calls("cuTensorMapReplaceAddress"), before + 1);
    fake().fail("cuTensorMapReplaceAddress", 1, 1, Some(1));
    let e = map.set_address(&a).unwrap_err();
    assert!(e.to_string().contains("cuTensorMapReplaceAddress"), "{e}");
    assert_eq!(
        map.address(),
        b.device_ptr(),
        "a failed call leaves the map"
    );
    assert_eq!(encoded(&map).address, b.device_ptr());
    map.set_address(&a).unwrap();
    assert_eq!(encoded(&map).address, a.device_ptr());
}

fn maps_on_an_old_driver_are_a_missing_symbol() {
    let old = metrale_fakecuda::old_library_path().to_str().unwrap();
    let out = run_child("old_driver_tensor_map", &[("METRALE_LIBCUDA_PATH", old)]);
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "old driver tensor map: ok\n"
    );
}

fn child_old_driver_tensor_map() {
    let reg = setup();
    let buf = DeviceBuffer::<u32>::alloc(reg.stream(), 64).unwrap();
    let e = TensorMap::tiled(&buf).encode().unwrap_err();
    assert!(matches!(
        e.kind(),
        ErrorKind::MissingSymbol {
            symbol: "cuTensorMapEncodeTiled",
            ..
        }
    ));
    // The rules still come first.
    let e = TensorMap::tiled(&buf).dims(&[0]).encode().unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
    println!("old driver tensor map: ok");
}

/// A layout checked once encodes maps over other memory of its shape: the same
/// fields reach the driver, and only the memory's checks run per map (refused
/// before the driver for memory too small or misaligned).
fn a_layout_is_checked_once_and_encoded_over_memory_of_its_shape() {
    let reg = setup();
    let s = reg.stream();
    let a = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let b = DeviceBuffer::<f32>::alloc(s, 64 * 64 + 8).unwrap();
    let small = DeviceBuffer::<f32>::alloc(s, 64 * 63).unwrap();
    let before = fake().calls("cuTensorMapEncodeTiled");
    let layout = TensorMap::tiled(&a)
        .dims(&[64, 64])
        .box_dims(&[16, 16])
        .swizzle(Swizzle::B64)
        .layout()
        .unwrap();
    assert_eq!(
        fake().calls("cuTensorMapEncodeTiled"),
        before,
        "no driver call"
    );
    assert_eq!(layout.extent(), 64 * 64 * 4);
    let direct = TensorMap::tiled(&b)
        .dims(&[64, 64])
        .box_dims(&[16, 16])
        .swizzle(Swizzle::B64)
        .encode()
        .unwrap();
    let via = layout.encode(&b).unwrap();
    assert_eq!(
        via.as_raw().opaque,
        direct.as_raw().opaque,
        "the same bytes"
    );
    assert_eq!(via.address(), b.device_ptr());
    let on_a = layout.encode(&a).unwrap();
    assert_eq!(encoded(&on_a).address, a.device_ptr());
    let calls = fake().calls("cuTensorMapEncodeTiled");
    let e = layout.encode(&small).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: tensor map: sizes [64, 64] with byte strides [256] reach 16384 \
         bytes, beyond the 16128 bytes of the memory"
    );
    let off = b.slice(1..).unwrap();
    let e = layout.encode(&off).unwrap_err();
    assert!(e.to_string().contains("aligned to 16 bytes"), "{e}");
    assert_eq!(
        fake().calls("cuTensorMapEncodeTiled"),
        calls,
        "refused before the driver"
    );
    // The rules are checked when the layout is made, with the same texts.
    let e = TensorMap::tiled(&a)
        .dims(&[64, 64])
        .box_dims(&[300, 16])
        .layout()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: tensor map: box size 0 must be in 1..=256: 300"
    );
    // A driver failure names the call, as for the builder.
    fake().fail("cuTensorMapEncodeTiled", 1, 1, Some(1));
    let e = layout.encode(&a).unwrap_err();
    assert!(e.to_string().contains("cuTensorMapEncodeTiled"), "{e}");
    layout.encode(&a).unwrap();
}

/// The calls that encode a map, all together (a refusal reaches none of them).
fn encodes() -> i64 {
    [
        "cuTensorMapEncodeTiled",
        "cuTensorMapEncodeIm2col",
        "cuTensorMapEncodeIm2colWide",
    ]
    .iter()
    .map(|c| fake().calls(c))
    .sum()
}

fn refused_with<T: TensorElement>(b: TensorMapBuilder<'_, T>, text: &str) {
    let before = encodes();
    let e = b.encode().unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
    assert_eq!(
        e.to_string(),
        format!("invalid argument: tensor map: {text}")
    );
    assert_eq!(encodes(), before, "refused before the driver: {text}");
}

/// A feature of compute capability 10.0 refused on the stand-in's 9.0 device,
/// with the typed error, before the driver.
fn unavailable<T: TensorElement>(b: TensorMapBuilder<'_, T>, feature: &str) {
    let before = encodes();
    let e = b.encode().unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::FeatureUnavailable {
                needs: (10, 0),
                has: (9, 0),
                needs_driver: 12080,
                driver: 13000,
                device: 0,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().ends_with(&format!(
            ": {feature} needs compute capability 10.0 and a CUDA 12.8 driver: device 0 has \
             compute capability 9.0, the driver is CUDA 13.0"
        )),
        "{e}"
    );
    assert!(e.to_string().starts_with("tensor map at 0x"), "{e}");
    assert_eq!(encodes(), before, "refused before the driver: {feature}");
}

/// The packed sub-byte types, the 128-byte atom swizzles and wide im2col maps
/// need compute capability 10.0: refused on the stand-in's 9.0 device with a
/// typed error, for a builder and a layout, after the rules (which still come
/// first and name the value).
fn compute_capability_10_features_are_refused_on_9_0() {
    let reg = setup();
    let s = reg.stream();
    let bytes = DeviceBuffer::<u8>::alloc(s, 64 * 64).unwrap();
    let buf = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let packed = |t| {
        TensorMap::tiled(&bytes)
            .data_type(t)
            .dims(&[128, 32])
            .strides(&[128])
            .box_dims(&[128, 4])
    };
    unavailable(
        TensorMap::tiled(&bytes)
            .data_type(TensorDataType::U4x16Align8)
            .dims(&[128, 64])
            .strides(&[64])
            .box_dims(&[32, 8]),
        "data type 16U4_ALIGN8B",
    );
    unavailable(
        packed(TensorDataType::U4x16Align16),
        "data type 16U4_ALIGN16B",
    );
    unavailable(
        packed(TensorDataType::U6x16Align16),
        "data type 16U6_ALIGN16B",
    );
    for (sw, name) in [
        (Swizzle::B128Atom32, "swizzle B128Atom32"),
        (Swizzle::B128Atom32Flip8, "swizzle B128Atom32Flip8"),
        (Swizzle::B128Atom64, "swizzle B128Atom64"),
    ] {
        unavailable(
            TensorMap::tiled(&buf)
                .dims(&[64, 64])
                .box_dims(&[32, 32])
                .swizzle(sw),
            name,
        );
    }
    let wide = || {
        TensorMap::tiled(&buf)
            .dims(&[64, 32, 2])
            .swizzle(Swizzle::B128)
            .im2col_wide(-1, 1, 32, 64, Im2colWideMode::W)
    };
    unavailable(wide(), "a wide im2col map");
    let e = TensorMap::tiled(&buf)
        .dims(&[64, 32, 2])
        .swizzle(Swizzle::B128)
        .encode_im2col_wide(-1, 1, 32, 64, Im2colWideMode::W128)
        .unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::FeatureUnavailable { .. }),
        "{e}"
    );
    // A layout is refused when made, before any memory is given.
    let e = packed(TensorDataType::U6x16Align16).layout().unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::FeatureUnavailable { .. }),
        "{e}"
    );
    assert_eq!(fake().calls("cuTensorMapEncodeIm2colWide"), 0);
    // The rules come first, and name the value.
    refused_with(
        packed(TensorDataType::U4x16Align16).dims(&[64, 32]),
        "size 0 of a 16U4_ALIGN16B map (in values) must be a multiple of 128: 64",
    );
}

/// When several lists are too long, the refusal names each; a list given again
/// with five values or fewer is no longer named.
fn every_list_too_long_is_named() {
    let reg = setup();
    let buf = DeviceBuffer::<f32>::alloc(reg.stream(), 64 * 64).unwrap();
    let m = || TensorMap::tiled(&buf);
    refused_with(
        m().dims(&[1; 6]).box_dims(&[1; 6]),
        "6 sizes and 6 box sizes given; a tensor map has at most 5 dimensions",
    );
    refused_with(
        m().dims(&[1; 6]).strides(&[16; 7]).element_strides(&[1; 8]),
        "6 sizes, 7 strides and 8 element strides given; a tensor map has at most 5 dimensions",
    );
    refused_with(
        m().dims(&[1; 6]).box_dims(&[1; 7]).dims(&[64, 64]),
        "7 box sizes given; a tensor map has at most 5 dimensions",
    );
    refused_with(
        m().dims(&[64, 64, 1]).im2col(&[0; 6], &[0; 7], 16, 16),
        "6 lower corners and 7 upper corners given; a tensor map has at most 5 dimensions",
    );
    m().dims(&[1; 6]).dims(&[64, 64]).encode().unwrap();
}

/// `as_bytes` is the driver's 128 bytes.
fn as_bytes_is_the_maps_bytes() {
    let reg = setup();
    let buf = DeviceBuffer::<f32>::alloc(reg.stream(), 64 * 64).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[64, 64])
        .box_dims(&[16, 16])
        .encode()
        .unwrap();
    let want: Vec<u8> = map
        .as_raw()
        .opaque
        .iter()
        .flat_map(|q| q.to_ne_bytes())
        .collect();
    assert_eq!(&map.as_bytes()[..], &want[..]);
    assert_eq!(
        u64::from_ne_bytes(map.as_bytes()[8..16].try_into().unwrap()),
        buf.device_ptr(),
        "the stand-in writes the address into bytes 8..16"
    );
}

fn compute_capability_10_rules_are_checked() {
    let out = run_child("tensor_map_sm100", &[]);
    assert!(
        out.status.success(),
        "child failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "tensor map sm100: ok\n"
    );
}

/// On a device of compute capability 10.0 (the stand-in told so before the
/// context is made): every rule of the packed types, the atom swizzles and wide
/// im2col maps refused before the driver, and the fields reaching the driver.
fn child_tensor_map_sm100() {
    fake().reset();
    fake().set_attribute(0, 75, 10);
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    let s = reg.stream();
    let bytes = DeviceBuffer::<u8>::alloc(s, 64 * 64).unwrap();
    let buf = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();

    // 16U4_ALIGN8B: sizes count values (two a byte).
    let u4 = || {
        TensorMap::tiled(&bytes)
            .data_type(TensorDataType::U4x16Align8)
            .dims(&[128, 64])
            .strides(&[64])
            .box_dims(&[32, 8])
    };
    let map = u4().encode().unwrap();
    let e = encoded(&map);
    assert_eq!(
        (e.data_type, e.rank, e.dims.clone()),
        (13, 2, vec![128, 64])
    );
    assert_eq!((e.strides, e.box_dims), (vec![64], vec![32, 8]));
    refused_with(
        u4().dims(&[127, 64]),
        "size 0 of a 16U4_ALIGN8B map (in values) must be a multiple of 2: 127",
    );
    refused_with(
        u4().box_dims(&[16, 8]),
        "without interleave the inner box row (box size 0 x element size = 16 x 1/2 = 8 \
         bytes) must be a multiple of 16 bytes",
    );
    refused_with(
        u4().dims(&[130, 64]),
        "sizes [130, 64] with byte strides [64] reach 4097 bytes, beyond the 4096 bytes of \
         the memory",
    );
    refused_with(
        u4().oob_fill(OobFill::NanRequestZeroFma),
        "NaN out-of-bounds fill needs a floating-point type, not U4x16Align8",
    );
    // Packed strides by default: a row of 128 values is 64 bytes.
    let map = TensorMap::tiled(&bytes)
        .data_type(TensorDataType::U4x16Align8)
        .dims(&[128, 64])
        .box_dims(&[32, 8])
        .encode()
        .unwrap();
    assert_eq!(encoded(&map).strides, [64]);
    // Without sizes: one dimension of every value of the memory.
    let map = TensorMap::tiled(&bytes)
        .data_type(TensorDataType::U4x16Align8)
        .box_dims(&[32])
        .encode()
        .unwrap();
    assert_eq!(encoded(&map).dims, [8192]);

    // 16U4_ALIGN16B and 16U6_ALIGN16B: 16-byte groups, one byte a value.
    let p16 = |t| {
        TensorMap::tiled(&bytes)
            .data_type(t)
            .dims(&[128, 32])
            .strides(&[128])
            .box_dims(&[128, 4])
    };
    for (t, v) in [
        (TensorDataType::U4x16Align16, 14),
        (TensorDataType::U6x16Align16, 15),
    ] {
        let map = p16(t).swizzle(Swizzle::B128).encode().unwrap();
        let e = encoded(&map);
        assert_eq!((e.data_type, e.modes[1]), (v, 3));
        p16(t).swizzle(Swizzle::B128Atom32).encode().unwrap();
        p16(t).encode().unwrap();
    }
    let u4w = || p16(TensorDataType::U4x16Align16);
    refused_with(
        u4w().dims(&[64, 32]).strides(&[128]).box_dims(&[64, 4]),
        "size 0 of a 16U4_ALIGN16B map (in values) must be a multiple of 128: 64",
    );
    refused_with(
        u4w().strides(&[112]),
        "the byte stride of dimension 1 must be a multiple of 32 (16U4_ALIGN16B): 112",
    );
    refused_with(
        u4w().box_dims(&[64, 4]),
        "box size 0 of a 16U4_ALIGN16B map must be 128 (values): 64",
    );
    refused_with(
        u4w().swizzle(Swizzle::B64),
        "the inner box row (128 bytes) must fit the swizzle span of 64 bytes (B64)",
    );
    refused_with(
        u4w().swizzle(Swizzle::B128Atom64),
        "a 16U4_ALIGN16B map allows the swizzles None, B128, B128Atom32: swizzle B128Atom64",
    );
    // 16U6_ALIGN16B may use the 64-byte atom (for stores), and no interleave.
    p16(TensorDataType::U6x16Align16)
        .swizzle(Swizzle::B128Atom64)
        .encode()
        .unwrap();
    refused_with(
        p16(TensorDataType::U6x16Align16).swizzle(Swizzle::B128Atom32Flip8),
        "a 16U6_ALIGN16B map allows the swizzles None, B128, B128Atom32, B128Atom64 (stores): \
         swizzle B128Atom32Flip8",
    );
    refused_with(
        TensorMap::tiled(&bytes)
            .data_type(TensorDataType::U6x16Align16)
            .dims(&[128, 4, 8])
            .box_dims(&[128, 4, 1])
            .interleave(Interleave::B16),
        "a 16U6_ALIGN16B map needs no interleave: interleave B16",
    );
    let off = bytes.slice(16..).unwrap();
    let e = TensorMap::tiled(&off)
        .data_type(TensorDataType::U4x16Align16)
        .dims(&[128, 30])
        .strides(&[128])
        .box_dims(&[128, 4])
        .encode()
        .unwrap_err();
    assert!(
        e.to_string().contains(&format!(
            "the global address must be aligned to 32 bytes (16U4_ALIGN16B): {:#x} is not",
            off.device_ptr()
        )),
        "{e}"
    );
    // A layout of a packed type encodes over memory of a 10.0 device.
    let layout = p16(TensorDataType::U6x16Align16).layout().unwrap();
    assert_eq!(encoded(&layout.encode(&bytes).unwrap()).data_type, 15);

    // The atom swizzles: a 128-byte span.
    for (sw, v) in [
        (Swizzle::B128Atom32, 4),
        (Swizzle::B128Atom32Flip8, 5),
        (Swizzle::B128Atom64, 6),
    ] {
        let atom = || TensorMap::tiled(&buf).dims(&[64, 64]).swizzle(sw);
        let map = atom().box_dims(&[32, 32]).encode().unwrap();
        assert_eq!(encoded(&map).modes[1], v);
        refused_with(
            atom().box_dims(&[64, 32]),
            &format!(
                "the inner box row (256 bytes) must fit the swizzle span of 128 bytes ({sw:?})"
            ),
        );
    }

    // Wide im2col maps (NWC: channels, width, batch).
    let wide = || {
        TensorMap::tiled(&buf)
            .dims(&[64, 32, 2])
            .swizzle(Swizzle::B128)
    };
    let map = wide()
        .encode_im2col_wide(-1, 1, 32, 64, Im2colWideMode::W)
        .unwrap();
    assert_eq!(fake().calls("cuTensorMapEncodeIm2colWide"), 1);
    let e = encoded(&map);
    assert!(e.im2col && e.wide, "{e:?}");
    assert_eq!((e.wide_mode, e.data_type, e.rank), (0, 7, 3));
    assert_eq!((e.lower, e.upper), (vec![-1], vec![1]));
    assert_eq!((e.channels_per_pixel, e.pixels_per_column), (32, 64));
    assert_eq!(e.modes, [0, 3, 0, 0]);
    // W128 ignores pixels per column.
    let map = wide()
        .encode_im2col_wide(0, 0, 32, 0, Im2colWideMode::W128)
        .unwrap();
    assert_eq!(encoded(&map).wide_mode, 1);
    refused_with(
        wide().im2col_wide(0, 0, 32, 0, Im2colWideMode::W),
        "pixels per column must be in 1..=1024: 0",
    );
    refused_with(
        wide()
            .swizzle(Swizzle::None)
            .im2col_wide(0, 0, 32, 64, Im2colWideMode::W),
        "a wide im2col map allows the swizzles B64, B128, B128Atom32: swizzle None",
    );
    refused_with(
        wide().im2col_wide(40_000, 0, 32, 64, Im2colWideMode::W),
        "lower corner 0 must be in -32768..=32767 for rank 3: 40000",
    );
    refused_with(
        TensorMap::tiled(&buf)
            .dims(&[64, 64])
            .swizzle(Swizzle::B128)
            .im2col_wide(0, 0, 32, 64, Im2colWideMode::W),
        "an im2col map needs rank 3, 4 or 5: rank 2",
    );
    refused_with(
        wide().im2col_wide(0, 0, 48, 64, Im2colWideMode::W),
        "a pixel's channels (192 bytes) must fit the swizzle span of 128 bytes (B128)",
    );
    refused_with(
        TensorMap::tiled(&bytes)
            .data_type(TensorDataType::U4x16Align16)
            .dims(&[128, 16, 2])
            .swizzle(Swizzle::B128)
            .im2col_wide(0, 0, 64, 16, Im2colWideMode::W),
        "channels per pixel of a 16U4_ALIGN16B map must be 128: 64",
    );
    refused_with(
        TensorMap::tiled(&bytes)
            .data_type(TensorDataType::U4x16Align16)
            .dims(&[128, 16, 2])
            .swizzle(Swizzle::B64)
            .im2col_wide(0, 0, 128, 16, Im2colWideMode::W),
        "a pixel's channels (128 bytes) must fit the swizzle span of 64 bytes (B64)",
    );
    // The plain im2col map of a packed type: 128 channels.
    refused_with(
        TensorMap::tiled(&bytes)
            .data_type(TensorDataType::U6x16Align16)
            .dims(&[128, 16, 2])
            .im2col(&[0], &[0], 64, 16),
        "channels per pixel of a 16U6_ALIGN16B map must be 128: 64",
    );
    println!("tensor map sm100: ok");
}

/// A 10.0 device under a driver before CUDA 12.8: the typed error names the
/// driver.
fn child_tensor_map_old_12_driver() {
    fake().reset();
    fake().set_attribute(0, 75, 10);
    fake().set_driver_version(12060);
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    let buf = DeviceBuffer::<f32>::alloc(reg.stream(), 64 * 64).unwrap();
    let e = TensorMap::tiled(&buf)
        .dims(&[64, 64])
        .box_dims(&[32, 32])
        .swizzle(Swizzle::B128Atom64)
        .encode()
        .unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::FeatureUnavailable {
                has: (10, 0),
                driver: 12060,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().ends_with(
            "swizzle B128Atom64 needs compute capability 10.0 and a CUDA 12.8 driver: device 0 \
             has compute capability 10.0, the driver is CUDA 12.6"
        ),
        "{e}"
    );
    println!("tensor map on CUDA 12.6: ok");
}

fn a_driver_before_12_8_is_refused() {
    let out = run_child("tensor_map_old_12_driver", &[]);
    assert!(
        out.status.success(),
        "child failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "tensor map on CUDA 12.6: ok\n"
    );
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "tensor_map::compute_capability_10_features_are_refused_on_9_0",
            run: compute_capability_10_features_are_refused_on_9_0,
        },
        Test {
            name: "tensor_map::compute_capability_10_rules_are_checked",
            run: compute_capability_10_rules_are_checked,
        },
        Test {
            name: "tensor_map::a_driver_before_12_8_is_refused",
            run: a_driver_before_12_8_is_refused,
        },
        Test {
            name: "tensor_map::every_list_too_long_is_named",
            run: every_list_too_long_is_named,
        },
        Test {
            name: "tensor_map::as_bytes_is_the_maps_bytes",
            run: as_bytes_is_the_maps_bytes,
        },
        Test {
            name: "tensor_map::a_layout_is_checked_once_and_encoded_over_memory_of_its_shape",
            run: a_layout_is_checked_once_and_encoded_over_memory_of_its_shape,
        },
        Test {
            name: "tensor_map::every_rule_is_refused_before_the_driver",
            run: every_rule_is_refused_before_the_driver,
        },
        Test {
            name: "tensor_map::encoded_fields_reach_the_driver_unchanged",
            run: encoded_fields_reach_the_driver_unchanged,
        },
        Test {
            name: "tensor_map::im2col_rules_are_refused_before_the_driver",
            run: im2col_rules_are_refused_before_the_driver,
        },
        Test {
            name: "tensor_map::im2col_fields_reach_the_driver_unchanged",
            run: im2col_fields_reach_the_driver_unchanged,
        },
        Test {
            name: "tensor_map::a_driver_failure_names_the_call_and_the_address",
            run: a_driver_failure_names_the_call_and_the_address,
        },
        Test {
            name: "tensor_map::a_map_is_a_128_byte_kernel_argument",
            run: a_map_is_a_128_byte_kernel_argument,
        },
        Test {
            name: "tensor_map::replace_address_moves_the_map_to_memory_of_the_same_shape",
            run: replace_address_moves_the_map_to_memory_of_the_same_shape,
        },
        Test {
            name: "tensor_map::set_address_moves_the_map_in_place_and_a_refusal_leaves_it",
            run: set_address_moves_the_map_in_place_and_a_refusal_leaves_it,
        },
        Test {
            name: "tensor_map::maps_on_an_old_driver_are_a_missing_symbol",
            run: maps_on_an_old_driver_are_a_missing_symbol,
        },
    ]
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "old_driver_tensor_map",
            run: child_old_driver_tensor_map,
        },
        Child {
            name: "tensor_map_sm100",
            run: child_tensor_map_sm100,
        },
        Child {
            name: "tensor_map_old_12_driver",
            run: child_tensor_map_old_12_driver,
        },
    ]
}
