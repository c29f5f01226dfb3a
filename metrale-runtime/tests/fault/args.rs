//! Argument lists built at run time ([`KernelArgList`]) checked against the same
//! parameter layouts as tuples (vec_add, layout_probe, the 20-parameter `args20`
//! of mixed alignments, tensor maps): correct launches deliver their bytes, wrong
//! counts, sizes and alignments are refused before the driver. Also 24-element
//! tuples, null pointers, graph nodes, and a list reused without allocating.

use crate::common::*;
use crate::harness::Test;

pub static ARGS_PTX: &[u8] = include_bytes!("../fixtures/args.ptx");

/// A kernel of 24 parameters for the stand-in (it reads only the parameter list):
/// pointers, scalars of every width and an 8-byte struct aligned to 4 at offset 36.
const WIDE_TEXT: &str = "
.version 8.0
.target sm_90
.address_size 64
.visible .entry wide24(
    .param .u64 w0, .param .u32 w1, .param .u8 w2, .param .u16 w3,
    .param .u64 w4, .param .u64 w5, .param .u32 w6, .param .align 4 .b8 w7[8],
    .param .u64 w8, .param .u64 w9, .param .u8 w10, .param .u32 w11,
    .param .f64 w12, .param .u16 w13, .param .u32 w14, .param .u64 w15,
    .param .u32 w16, .param .u32 w17, .param .u8 w18, .param .u64 w19,
    .param .u16 w20, .param .u32 w21, .param .f32 w22, .param .u64 w23
)
{ ret; }
";

/// A kernel with a tensor map after a pointer, at offset 64 (aligned to 64), and
/// one that puts 128 bytes at offset 8 (aligned to 8 only).
const MAP_TEXT: &str = "
.version 8.0
.target sm_90a
.address_size 64
.visible .entry map_second(
    .param .u64 m0,
    .param .align 64 .b8 m1[128]
)
{ ret; }
.visible .entry bytes_second(
    .param .u64 b0,
    .param .align 8 .b8 b1[128]
)
{ ret; }
";

/// A struct of 16 bytes aligned to 16 (where `args20` has one aligned to 8).
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct A16([u64; 2]);
// SAFETY: two u64s, no padding.
unsafe impl DeviceRepr for A16 {}

/// The 12-byte struct of `args20`'s parameter 8 (`struct { unsigned x, y, z; }`).
#[derive(Clone, Copy)]
#[repr(C)]
struct Xyz([u32; 3]);
// SAFETY: three u32s, no padding.
unsafe impl DeviceRepr for Xyz {}

/// The 16-byte struct of parameter 15 (`struct { unsigned long long a, b; }`).
#[derive(Clone, Copy)]
#[repr(C)]
struct Pair([u64; 2]);
// SAFETY: two u64s, no padding.
unsafe impl DeviceRepr for Pair {}

fn cfg() -> LaunchConfig {
    LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap()
}

/// The parameters of the last launch, first 8 bytes of each.
fn recorded(n: i32) -> Vec<u64> {
    (0..n).map(|i| fake().last_param(i)).collect()
}

fn lists_launch_vec_add_and_layout_probe_as_tuples_do() {
    let reg = setup();
    let s = reg.stream();
    let vec_add = reg.function("kernels", "vec_add").unwrap();
    let a = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let b = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let mut c = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let (pa, pb, pc) = (a.device_ptr(), b.device_ptr(), c.device_ptr());
    {
        let mut args = KernelArgList::new();
        args.push(&a)
            .push(b.slice(..).unwrap())
            .push(&mut c)
            .push(16u32);
        assert_eq!(args.sizes(), [8, 8, 8, 4]);
        // SAFETY: the stand-in only records the arguments (for every launch below).
        unsafe { s.launch(&vec_add, cfg(), &args) }.unwrap();
        assert_eq!(recorded(4), [pa, pb, pc, 16]);
        // Through the registry too.
        // SAFETY: as above.
        unsafe { reg.launch(vec_add.raw(), cfg(), s, &args) }.unwrap();
        assert_eq!(fake().last_launch().params, 4);
    }
    let probe = reg.function("kernels", "layout_probe").unwrap();
    let mut out = DeviceBuffer::<u32>::alloc(s, 8).unwrap();
    let po = out.device_ptr();
    let mut args = KernelArgList::new();
    args.push(&a)
        .push(4u32)
        .push(1.5f32)
        .push([1u8, 2, 3])
        .push(9u8)
        .push(2.5f64)
        .push(&mut out);
    // SAFETY: as above.
    unsafe { s.launch(&probe, cfg(), &args) }.unwrap();
    let by_list = recorded(7);
    // SAFETY: as above.
    unsafe {
        s.launch(
            &probe,
            cfg(),
            (&a, 4u32, 1.5f32, [1u8, 2, 3], 9u8, 2.5f64, po),
        )
    }
    .unwrap();
    assert_eq!(
        by_list,
        recorded(7),
        "the list delivers what the tuple does"
    );
    assert_eq!(
        by_list,
        [
            pa,
            4,
            1.5f32.to_bits().into(),
            0x03_0201,
            9,
            2.5f64.to_bits(),
            po
        ]
    );
    drop(args);
    drop((a, b, c, out, vec_add, probe));
    done(reg);
}

fn list_mismatches_are_refused_like_tuples() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "layout_probe").unwrap();
    let p = DeviceBuffer::<f32>::alloc(s, 4).unwrap();
    let launches = fake().launches();
    let text = |e: MetraleError| e.to_string();
    let refused = |args: &KernelArgList<'_>| {
        // SAFETY: refused before the driver.
        text(unsafe { s.launch(&f, cfg(), args) }.unwrap_err())
    };
    let prefix = "kernel 'kernels::layout_probe': launch not attempted, ";
    // Wrong counts: none, too few, too many.
    let mut args = KernelArgList::new();
    assert_eq!(
        refused(&args),
        format!("{prefix}0 argument(s) given, the kernel takes 7 parameter(s)")
    );
    args.push(&p).push(4u32).push(1.5f32);
    assert_eq!(
        refused(&args),
        format!("{prefix}3 argument(s) given, the kernel takes 7 parameter(s)")
    );
    args.push([1u8, 2, 3])
        .push(9u8)
        .push(2.5f64)
        .push(&p)
        .push(0u8);
    // SAFETY: refused before the driver.
    let e = unsafe { s.launch(&f, cfg(), &args) }.unwrap_err();
    assert!(matches!(
        e.kind(),
        ErrorKind::ArgumentMismatch {
            index: None,
            expected: 7,
            given: 8,
            ..
        }
    ));
    // A wrong size at each position, as the tuple test has them.
    let sizes = [8, 4, 4, 3, 1, 8, 8];
    let given = [4, 8, 8, 4, 2, 4, 4];
    for i in 0..7 {
        let mut args = KernelArgList::new();
        let good: [&[u8]; 7] = [
            &[0; 8], &[0; 4], &[0; 4], &[0; 3], &[0; 1], &[0; 8], &[0; 8],
        ];
        let aligns = [8, 4, 4, 1, 1, 8, 8];
        for (j, bytes) in good.iter().enumerate() {
            if j == i {
                args.push_bytes(&vec![7; given[i]], given[i].min(8))
                    .unwrap();
            } else {
                args.push_bytes(bytes, aligns[j]).unwrap();
            }
        }
        assert_eq!(
            refused(&args),
            format!(
                "{prefix}argument {i} is {} bytes, the kernel's parameter {i} is {} bytes",
                given[i], sizes[i]
            )
        );
    }
    // Typed pushes: a u64 where a u32 goes, a too-large struct for the 3 bytes.
    let mut args = KernelArgList::new();
    args.push(&p)
        .push(4u64)
        .push(1.5f32)
        .push([0u8; 24])
        .push(9u8)
        .push(2.5f64)
        .push(&p);
    // SAFETY: refused before the driver.
    let e = unsafe { s.launch(&f, cfg(), &args) }.unwrap_err();
    assert!(matches!(
        e.kind(),
        ErrorKind::ArgumentMismatch {
            index: Some(1),
            expected: 4,
            given: 8,
            ..
        }
    ));
    args.set(1, 4u32).unwrap_err();
    let mut fixed = KernelArgList::new();
    fixed
        .push(&p)
        .push(4u32)
        .push(1.5f32)
        .push([0u8; 24])
        .push(9u8)
        .push(2.5f64)
        .push(&p);
    assert_eq!(
        refused(&fixed),
        format!("{prefix}argument 3 is 24 bytes, the kernel's parameter 3 is 3 bytes")
    );
    assert_eq!(fake().launches(), launches, "nothing reached the driver");
    drop((args, fixed));
    drop((p, f));
    done(reg);
}

fn the_20_parameter_kernel_takes_a_list_and_a_tuple() {
    let reg = setup();
    let s = reg.stream();
    let m = MetraleRegistry::load(0, &[("args", ARGS_PTX)]).unwrap();
    let f = m.function("args", "args20").unwrap();
    let offsets: Vec<usize> = f.params().unwrap().iter().map(|p| p.offset).collect();
    assert_eq!(
        offsets,
        [0, 8, 16, 24, 32, 40, 48, 56, 60, 72, 76, 80, 88, 92, 96, 104, 120, 128, 136, 140]
    );
    let mut out = DeviceBuffer::<u64>::alloc(s, 24).unwrap();
    let src = DeviceBuffer::<u32>::alloc(s, 2).unwrap();
    let (po, ps) = (out.device_ptr(), src.device_ptr());
    let xyz = [11u32, 12, 13];
    let xyz_bytes: Vec<u8> = xyz.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let pair_bytes: Vec<u8> = [21u64, 22].iter().flat_map(|v| v.to_ne_bytes()).collect();
    let mut args = KernelArgList::with_capacity(20, 144);
    args.push(&mut out)
        .push(&src)
        .push_null()
        .push(3u32)
        .push(4u64 << 40)
        .push(5.5f32)
        .push(-6.25f64)
        .push(7u8);
    args.push_bytes(&xyz_bytes, 4).unwrap();
    args.push(9u16)
        .push(-10i32)
        .push(11u64)
        .push(12u8)
        .push(13u32)
        .push(14.5f32);
    args.push_bytes(&pair_bytes, 8).unwrap();
    args.push(16u32).push(17u64).push(18u16).push(19u32);
    assert_eq!(args.len(), 20);
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg(), &args) }.unwrap();
    let expect = [
        po,
        ps,
        0,
        3,
        4 << 40,
        5.5f32.to_bits().into(),
        (-6.25f64).to_bits(),
        7,
        11 | 12 << 32,
        9,
        (-10i32) as u32 as u64,
        11,
        12,
        13,
        14.5f32.to_bits().into(),
        21,
        16,
        17,
        18,
        19,
    ];
    assert_eq!(recorded(20), expect);
    drop(args);
    // The same through a 20-element tuple, with the structs as Rust types.
    // SAFETY: as above.
    unsafe {
        s.launch(
            &f,
            cfg(),
            (
                &mut out,
                &src,
                NullPtr,
                3u32,
                4u64 << 40,
                5.5f32,
                -6.25f64,
                7u8,
                Xyz(xyz),
                9u16,
                -10i32,
                11u64,
                12u8,
                13u32,
                14.5f32,
                Pair([21, 22]),
                16u32,
                17u64,
                18u16,
                19u32,
            ),
        )
    }
    .unwrap();
    assert_eq!(recorded(20), expect);
    drop((out, src, f, m));
    done(reg);
}

fn alignment_is_left_to_the_drivers_offsets() {
    let reg = setup();
    let s = reg.stream();
    let m = MetraleRegistry::load(0, &[("args", ARGS_PTX)]).unwrap();
    let f = m.function("args", "args20").unwrap();
    let out = DeviceBuffer::<u64>::alloc(s, 24).unwrap();
    let launches = fake().launches();
    let build = |p8_align: usize, p15: Option<A16>| {
        let mut args = KernelArgList::new();
        args.push(&out)
            .push(&out)
            .push_null()
            .push(3u32)
            .push(4u64)
            .push(5.5f32)
            .push(6.0f64)
            .push(7u8);
        args.push_bytes(&[0; 12], p8_align).unwrap();
        args.push(9u16)
            .push(10i32)
            .push(11u64)
            .push(12u8)
            .push(13u32)
            .push(14.5f32);
        match p15 {
            Some(v) => args.push(v),
            None => args.push(Pair([0, 0])),
        };
        args.push(16u32).push(17u64).push(18u16).push(19u32);
        args
    };
    // Alignment is left to the driver's offsets: 12 bytes aligned to 8 where the
    // kernel has them at offset 60, a 16-aligned type at offset 104, a tuple's u64
    // at offset 36 and a tensor map at offset 8 are all launched (the `void**`
    // launch copies each argument's bytes to its parameter's offset).
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg(), &build(8, None)) }.unwrap();
    // SAFETY: as above.
    unsafe { s.launch(&f, cfg(), &build(4, Some(A16([0, 0])))) }.unwrap();
    let wide = MetraleRegistry::load(0, &[("wide", WIDE_TEXT.as_bytes())]).unwrap();
    let w = wide.function("wide", "wide24").unwrap();
    assert_eq!(w.params().unwrap()[7].offset, 36);
    // SAFETY: as above.
    unsafe { s.launch(&w, cfg(), wide_args(9u64)) }.unwrap();
    // SAFETY: as above.
    unsafe { s.launch(&f, cfg(), &build(1, None)) }.unwrap();
    let maps = MetraleRegistry::load(0, &[("maps", MAP_TEXT.as_bytes())]).unwrap();
    let g = maps.function("maps", "bytes_second").unwrap();
    let buf = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[64, 64])
        .box_dims(&[32, 32])
        .encode()
        .unwrap();
    let mut args = KernelArgList::new();
    args.push(&out).push_tensor_map(&map);
    // SAFETY: as above.
    unsafe { s.launch(&g, cfg(), &args) }.unwrap();
    assert_eq!(fake().launches(), launches + 5, "every launch ran");

    drop(args);
    drop((buf, out, f, g, w, m, wide, maps));
    done(reg);
}

/// The types of `wide24`'s arguments, with `P` as parameter 7's.
type Wide<P> = (
    u64,
    u32,
    u8,
    u16,
    u64,
    u64,
    u32,
    P,
    u64,
    u64,
    u8,
    u32,
    f64,
    u16,
    u32,
    u64,
    u32,
    u32,
    u8,
    u64,
    u16,
    u32,
    f32,
    NullPtr,
);

/// The 24 arguments of `wide24`, with `p7` as parameter 7.
fn wide_args<P: KernelArg>(p7: P) -> Wide<P> {
    (
        100, 1, 2, 3, 4, 5, 6, p7, 8, 9, 10, 11, 12.0, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22.0,
        NullPtr,
    )
}

fn tuples_of_24_are_checked_and_delivered() {
    let reg = setup();
    let s = reg.stream();
    let wide = MetraleRegistry::load(0, &[("wide", WIDE_TEXT.as_bytes())]).unwrap();
    let w = wide.function("wide", "wide24").unwrap();
    assert_eq!(w.params().unwrap().len(), 24);
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&w, cfg(), wide_args([7u32, 7])) }.unwrap();
    let got = recorded(24);
    let mut expect: Vec<u64> = vec![100, 1, 2, 3, 4, 5, 6, 7 | 7 << 32];
    expect.extend([
        8,
        9,
        10,
        11,
        12.0f64.to_bits(),
        13,
        14,
        15,
        16,
        17,
        18,
        19,
        20,
        21,
    ]);
    expect.extend([u64::from(22.0f32.to_bits()), 0]);
    assert_eq!(got, expect);
    // A wrong size at the last position is named.
    // SAFETY: refused before the driver.
    let e = unsafe {
        s.launch(
            &w,
            cfg(),
            (
                100u64,
                1u32,
                2u8,
                3u16,
                4u64,
                5u64,
                6u32,
                [7u32, 7],
                8u64,
                9u64,
                10u8,
                11u32,
                12.0f64,
                13u16,
                14u32,
                15u64,
                16u32,
                17u32,
                18u8,
                19u64,
                20u16,
                21u32,
                22.0f32,
                0u32,
            ),
        )
    }
    .unwrap_err();
    assert!(
        e.to_string()
            .ends_with("argument 23 is 4 bytes, the kernel's parameter 23 is 8 bytes"),
        "{e}"
    );
    // The same 24 through a list.
    let mut args = KernelArgList::new();
    args.push(100u64)
        .push(1u32)
        .push(2u8)
        .push(3u16)
        .push(4u64)
        .push(5u64)
        .push(6u32)
        .push([7u32, 7]);
    for v in [8u64, 9] {
        args.push(v);
    }
    args.push(10u8)
        .push(11u32)
        .push(12.0f64)
        .push(13u16)
        .push(14u32);
    args.push(15u64)
        .push(16u32)
        .push(17u32)
        .push(18u8)
        .push(19u64);
    args.push(20u16).push(21u32).push(22.0f32).push_null();
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&w, cfg(), &args) }.unwrap();
    assert_eq!(recorded(24), expect);
    drop(args);
    drop((w, wide));
    done(reg);
}

fn tensor_maps_go_by_value_in_a_list() {
    let reg = setup();
    let s = reg.stream();
    let maps = MetraleRegistry::load(0, &[("maps", MAP_TEXT.as_bytes())]).unwrap();
    let f = maps.function("maps", "map_second").unwrap();
    assert_eq!(f.params().unwrap()[1].offset, 64);
    let buf = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let out = DeviceBuffer::<f32>::alloc(s, 64 * 64).unwrap();
    let map = TensorMap::tiled(&buf)
        .dims(&[64, 64])
        .box_dims(&[32, 32])
        .encode()
        .unwrap();
    let mut args = KernelArgList::new();
    args.push(&out).push_tensor_map(&map);
    assert_eq!((args.sizes(), args.aligns()), (&[8, 128][..], &[8, 64][..]));
    assert_eq!(
        args.arg_bytes(1).unwrap(),
        map.as_raw()
            .opaque
            .iter()
            .flat_map(|q| q.to_ne_bytes())
            .collect::<Vec<u8>>()
    );
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg(), &args) }.unwrap();
    assert_eq!(fake().last_param(0), out.device_ptr());
    assert_eq!(
        fake().last_param(1),
        map.as_raw().opaque[0],
        "the map's bytes"
    );
    // By reference too (`push(&map)`), and as raw bytes of the stated alignment.
    let mut again = KernelArgList::new();
    again.push(&out).push(&map);
    // SAFETY: as above.
    unsafe { s.launch(&f, cfg(), &again) }.unwrap();
    assert_eq!(fake().last_param(1), map.as_raw().opaque[0]);
    let mut raw = KernelArgList::new();
    raw.push(&out)
        .push_bytes(args.arg_bytes(1).unwrap(), 64)
        .unwrap();
    // SAFETY: as above.
    unsafe { s.launch(&f, cfg(), &raw) }.unwrap();
    assert_eq!(fake().last_param(1), map.as_raw().opaque[0]);
    drop((args, again, raw));
    drop((buf, out, f, maps));
    done(reg);
}

fn lists_build_graph_nodes_and_updates() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "axpb").unwrap();
    let x = DeviceBuffer::<u32>::alloc(s, 4).unwrap();
    let mut args = KernelArgList::new();
    args.push(&x).push(2u32).push(1u32);
    let mut g = CudaGraph::new(reg.ctx()).unwrap();
    // SAFETY: the stand-in only records the arguments (for every launch below).
    unsafe { g.add_kernel_node(&[], &f, cfg(), &args) }.unwrap();
    let exec = g.instantiate().unwrap();
    let node = &g.kernel_nodes().unwrap()[0];
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(recorded(3), [x.device_ptr(), 2, 1]);
    args.set(1, 5u32).unwrap();
    // SAFETY: as above.
    unsafe { exec.set_kernel_params(node, &f, cfg(), &args) }.unwrap();
    // SAFETY: as above.
    unsafe { exec.launch(s) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(recorded(3), [x.device_ptr(), 5, 1]);
    // A wrong list is refused by the node's check too.
    let mut short = KernelArgList::new();
    short.push(&x);
    // SAFETY: refused before the driver.
    let e = unsafe { g.add_kernel_node(&[], &f, cfg(), &short) }.unwrap_err();
    assert!(e.to_string().contains("1 argument(s) given"), "{e}");
    drop((args, short));
    drop((exec, g, x, f));
    done(reg);
}

fn a_list_is_reused_without_allocating() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "vec_add").unwrap();
    let raw_f = f.raw();
    let a = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let mut c = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let mut args = KernelArgList::new();
    args.push(&a).push(&a).push(&mut c).push(16u32);
    let before = allocations();
    for n in 0..10_000u32 {
        // SAFETY: the stand-in only records the arguments (for every launch below).
        unsafe {
            s.launch(&f, cfg(), &args).unwrap();
            reg.launch(raw_f, cfg(), s, &args).unwrap();
        }
        args.set(3, n).unwrap();
    }
    assert_eq!(allocations() - before, 0, "allocations launching a list");
    // Emptied and rebuilt to the same shape: nothing allocated either, also for
    // memory of another borrow (`recycle`).
    let mut spare = args.recycle();
    let before = allocations();
    for n in 0..100u32 {
        let mut args = spare.recycle();
        args.push(&a).push(&a).push(&mut c).push(n);
        // SAFETY: as above.
        unsafe { s.launch(&f, cfg(), &args) }.unwrap();
        spare = args.recycle();
    }
    spare.push(&a).push(&a).push(&a).push(1u32);
    spare.clear();
    spare.push(&a).push(&a).push(&a).push(2u32);
    assert_eq!(allocations() - before, 0, "allocations rebuilding a list");
    assert_eq!(fake().last_param(3), 99);
    drop(spare);
    drop((a, c, f));
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "args::lists_launch_vec_add_and_layout_probe_as_tuples_do",
            run: lists_launch_vec_add_and_layout_probe_as_tuples_do,
        },
        Test {
            name: "args::list_mismatches_are_refused_like_tuples",
            run: list_mismatches_are_refused_like_tuples,
        },
        Test {
            name: "args::the_20_parameter_kernel_takes_a_list_and_a_tuple",
            run: the_20_parameter_kernel_takes_a_list_and_a_tuple,
        },
        Test {
            name: "args::alignment_is_left_to_the_drivers_offsets",
            run: alignment_is_left_to_the_drivers_offsets,
        },
        Test {
            name: "args::tuples_of_24_are_checked_and_delivered",
            run: tuples_of_24_are_checked_and_delivered,
        },
        Test {
            name: "args::tensor_maps_go_by_value_in_a_list",
            run: tensor_maps_go_by_value_in_a_list,
        },
        Test {
            name: "args::lists_build_graph_nodes_and_updates",
            run: lists_build_graph_nodes_and_updates,
        },
        Test {
            name: "args::a_list_is_reused_without_allocating",
            run: a_list_is_reused_without_allocating,
        },
    ]
}
