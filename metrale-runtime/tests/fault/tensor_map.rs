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

pub fn tests() -> Vec<Test> {
    vec![
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
    vec![Child {
        name: "old_driver_tensor_map",
        run: child_old_driver_tensor_map,
    }]
}
