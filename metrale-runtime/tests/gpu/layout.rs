//! Typed launches checked against the parameter layout the driver reports.

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
    ]
}
