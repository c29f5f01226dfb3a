//! Typed launches checked against the parameter layout the driver reports, from
//! tuples and from argument lists built at run time.

use crate::common::*;
use crate::harness::Test;

fn parameter_layouts_read_back() {
    let reg = MetraleRegistry::load(0, &[("ptx", PTX), ("cubin", CUBIN)]).unwrap();
    for module in ["ptx", "cubin"] {
        let f = reg.function(module, "layout_probe").unwrap();
        let params = f.params().expect("the driver reports parameter layouts");
        eprintln!("    {module}::layout_probe parameters: {params:?}");
        let sizes: Vec<usize> = params.iter().map(|p| p.size).collect();
        assert_eq!(sizes, [8, 4, 4, 3, 1, 8, 8], "{module}");
        let offsets: Vec<usize> = params.iter().map(|p| p.offset).collect();
        assert_eq!(offsets, [0, 8, 12, 16, 19, 24, 32], "{module}");
        let sizes: Vec<usize> = reg
            .function(module, "vec_add")
            .unwrap()
            .params()
            .unwrap()
            .iter()
            .map(|p| p.size)
            .collect();
        assert_eq!(sizes, [8, 8, 8, 4]);
        assert_eq!(
            reg.function(module, "count_launch")
                .unwrap()
                .params()
                .unwrap()
                .len(),
            1
        );
    }
}

fn mismatches_are_refused_and_a_correct_launch_works_after_each() {
    let reg = registry();
    let s = reg.stream();
    let f = reg.function("kernels", "layout_probe").unwrap();
    let p = DeviceBuffer::<f32>::alloc(s, 1).unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(s, 8).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    let rgb = [0x11u8, 0x22, 0x33];
    let check_correct = |out: &mut DeviceBuffer<u32>, round: u32| {
        s.zero(out).unwrap();
        // SAFETY: layout_probe(const float*, unsigned, float, Rgb, unsigned char,
        // double, unsigned*) writes out[0..7].
        unsafe { s.launch(&f, cfg, (&p, round, 1.5f32, rgb, 7u8, 42.0f64, &mut *out)) }.unwrap();
        let got = s.to_vec(out).unwrap();
        assert_eq!(got[0], p.device_ptr() as u32);
        assert_eq!(
            got[1..7],
            [round, 1.5f32.to_bits(), 0x33_2211, 7, 42, 0x600d]
        );
    };
    check_correct(&mut out, 0);
    macro_rules! refused {
        ($args:expr) => {{
            // SAFETY: refused before the driver is called.
            unsafe { s.launch(&f, cfg, $args) }.unwrap_err()
        }};
    }
    let refusals: Vec<(&str, MetraleError)> = vec![
        ("count", refused!((&p, 1u32, 1.5f32))),
        (
            "0",
            refused!((1u32, 1u32, 1.5f32, rgb, 7u8, 1.0f64, &mut out)),
        ),
        (
            "1",
            refused!((&p, 1u64, 1.5f32, rgb, 7u8, 1.0f64, &mut out)),
        ),
        (
            "2",
            refused!((&p, 1u32, 1.5f64, rgb, 7u8, 1.0f64, &mut out)),
        ),
        (
            "3",
            refused!((&p, 1u32, 1.5f32, [0u8; 2], 7u8, 1.0f64, &mut out)),
        ),
        (
            "4",
            refused!((&p, 1u32, 1.5f32, rgb, 7u32, 1.0f64, &mut out)),
        ),
        (
            "5",
            refused!((&p, 1u32, 1.5f32, rgb, 7u8, 1.0f32, &mut out)),
        ),
        ("6", refused!((&p, 1u32, 1.5f32, rgb, 7u8, 1.0f64, 5u32))),
        (
            "big",
            refused!((&p, 1u32, 1.5f32, [0u8; 40], 7u8, 1.0f64, &mut out)),
        ),
    ];
    let expect = [
        "3 argument(s) given, the kernel takes 7 parameter(s)",
        "argument 0 is 4 bytes, the kernel's parameter 0 is 8 bytes",
        "argument 1 is 8 bytes, the kernel's parameter 1 is 4 bytes",
        "argument 2 is 8 bytes, the kernel's parameter 2 is 4 bytes",
        "argument 3 is 2 bytes, the kernel's parameter 3 is 3 bytes",
        "argument 4 is 4 bytes, the kernel's parameter 4 is 1 bytes",
        "argument 5 is 4 bytes, the kernel's parameter 5 is 8 bytes",
        "argument 6 is 4 bytes, the kernel's parameter 6 is 8 bytes",
        "argument 3 is 40 bytes, the kernel's parameter 3 is 3 bytes",
    ];
    for (i, (what, e)) in refusals.into_iter().enumerate() {
        assert_eq!(
            e.to_string(),
            format!(
                "kernel 'kernels::layout_probe': launch not attempted, {}",
                expect[i]
            ),
            "{what}"
        );
        check_correct(&mut out, i as u32 + 1);
    }
    eprintln!(
        "    refused: kernel 'kernels::layout_probe': launch not attempted, {}",
        expect[2]
    );
}

static ARGS_PTX: &[u8] = include_bytes!("../fixtures/args.ptx");

/// `args20`'s structs: `struct { unsigned x, y, z; }` and `struct { u64 a, b; }`.
#[derive(Clone, Copy)]
#[repr(C)]
struct Xyz([u32; 3]);
// SAFETY: three u32s, no padding.
unsafe impl DeviceRepr for Xyz {}
#[derive(Clone, Copy)]
#[repr(C)]
struct Pair([u64; 2]);
// SAFETY: two u64s, no padding.
unsafe impl DeviceRepr for Pair {}

/// The 20-parameter `args20` (hand-written PTX, JIT-compiled by the driver)
/// launched through a run-time list and through a 20-tuple: every parameter
/// arrives exactly; the driver's layout is the one the list is checked against,
/// and a list of a wrong size is refused before the driver.
fn a_20_parameter_kernel_through_a_run_time_list() {
    let reg = registry();
    let s = reg.stream();
    let m = MetraleRegistry::load(0, &[("args", ARGS_PTX)]).unwrap();
    let f = m.function("args", "args20").unwrap();
    let params = f.params().expect("the driver reports parameter layouts");
    let offsets: Vec<usize> = params.iter().map(|p| p.offset).collect();
    let sizes: Vec<usize> = params.iter().map(|p| p.size).collect();
    assert_eq!(
        offsets,
        [0, 8, 16, 24, 32, 40, 48, 56, 60, 72, 76, 80, 88, 92, 96, 104, 120, 128, 136, 140]
    );
    assert_eq!(
        sizes,
        [8, 8, 8, 4, 8, 4, 8, 1, 12, 2, 4, 8, 1, 4, 4, 16, 4, 8, 2, 4]
    );
    let mut out = DeviceBuffer::<u64>::zeroed(s, 24).unwrap();
    let src = DeviceBuffer::from_host(s, &[1000u32, 234]).unwrap();
    let cfg = LaunchConfig::new((2, 1, 1), (64, 1, 1), 0).unwrap();
    let xyz_bytes: Vec<u8> = [11u32, 12, 13]
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    let pair_bytes: Vec<u8> = [21u64 << 33, 22]
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    let po = out.device_ptr();
    let expect = |step: u32| -> Vec<u64> {
        vec![
            po,
            1234,
            0,
            3 + u64::from(step),
            4 << 40,
            5.5f32.to_bits().into(),
            (-6.25f64).to_bits(),
            0xf7,
            11,
            0xfff9,
            (-10i64) as u64,
            u64::MAX - 11,
            12,
            13,
            14.5f32.to_bits().into(),
            21 << 33,
            16,
            17,
            0x8018,
            19,
            12,
            13,
            22,
            0x600d,
        ]
    };
    let mut spare = KernelArgList::with_capacity(20, 144);
    for step in 0..3u32 {
        let mut args = spare.recycle();
        args.push(&mut out)
            .push(&src)
            .push_null()
            .push(3 + step)
            .push(4u64 << 40)
            .push(5.5f32)
            .push(-6.25f64)
            .push(0xf7u8);
        args.push_bytes(&xyz_bytes, 4).unwrap();
        args.push(0xfff9u16)
            .push(-10i32)
            .push(u64::MAX - 11)
            .push(12u8)
            .push(13u32)
            .push(14.5f32);
        args.push_bytes(&pair_bytes, 8).unwrap();
        args.push(16u32).push(17u64).push(0x8018u16).push(19u32);
        // SAFETY: args20 writes out[0..24) from thread 0 and reads src[0..2); both
        // outlive the launch (the stream is waited by to_vec).
        unsafe { s.launch(&f, cfg, &args) }.unwrap();
        spare = args.recycle();
        assert_eq!(s.to_vec(&out).unwrap(), expect(step), "list, step {step}");
        s.zero(&mut out).unwrap();
    }
    // The same through a 20-tuple.
    // SAFETY: as above.
    unsafe {
        s.launch(
            &f,
            cfg,
            (
                &mut out,
                &src,
                NullPtr,
                3u32,
                4u64 << 40,
                5.5f32,
                -6.25f64,
                0xf7u8,
                Xyz([11, 12, 13]),
                0xfff9u16,
                -10i32,
                u64::MAX - 11,
                12u8,
                13u32,
                14.5f32,
                Pair([21 << 33, 22]),
                16u32,
                17u64,
                0x8018u16,
                19u32,
            ),
        )
    }
    .unwrap();
    assert_eq!(s.to_vec(&out).unwrap(), expect(0), "tuple");
    // Refusals against the real driver's layout.
    let mut args = spare.recycle();
    args.push(&mut out).push(&src).push_null();
    // SAFETY: refused before the driver.
    let e = unsafe { s.launch(&f, cfg, &args) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'args::args20': launch not attempted, 3 argument(s) given, the kernel takes 20 parameter(s)"
    );
    args.push(3u32)
        .push(4u64)
        .push(5.5f32)
        .push(-6.25f64)
        .push(0xf7u8);
    args.push_bytes(&xyz_bytes, 8).unwrap();
    for _ in 9..20 {
        args.push(0u8);
    }
    // SAFETY: refused before the driver.
    let e = unsafe { s.launch(&f, cfg, &args) }.unwrap_err();
    assert!(
        e.to_string()
            .ends_with("argument 9 is 1 bytes, the kernel's parameter 9 is 2 bytes"),
        "{e}"
    );
    drop(args);
    assert_eq!(
        s.to_vec(&out).unwrap(),
        expect(0),
        "nothing ran after the refusals"
    );
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "layout::parameter_layouts_read_back",
            run: parameter_layouts_read_back,
        },
        Test {
            name: "layout::mismatches_are_refused_and_a_correct_launch_works_after_each",
            run: mismatches_are_refused_and_a_correct_launch_works_after_each,
        },
        Test {
            name: "layout::a_20_parameter_kernel_through_a_run_time_list",
            run: a_20_parameter_kernel_through_a_run_time_list,
        },
    ]
}
