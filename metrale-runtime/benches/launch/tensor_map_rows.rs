//! Issue 23: the cost of encoding a tensor map (a 2-D f32 map, 32 x 32 boxes,
//! 128-byte swizzle) through `TensorMap::tiled(..).encode()` (every rule checked
//! per call) and through a `TensorMapLayout` checked once (`layout.encode(&mem)`:
//! the memory's checks per call) beside the raw `cuTensorMapEncodeTiled` with
//! the same arguments, the three interleaved batch by batch; and of `replace_address`
//! (consuming the map) and `set_address` (in place) beside
//! `cuTensorMapReplaceAddress`. Batches of 1,000 calls; each group of rows
//! interleaved, its order rotating round by round; median and spread printed.

use std::ffi::c_void;

use crate::common::{header, line, ratios, time, Row};
use metrale_runtime::sys::{self, CUtensorMap};
use metrale_runtime::{DeviceBuffer, MetraleError, MetraleRegistry, Swizzle, TensorMap};

pub fn run(reg: &MetraleRegistry, rounds: usize, quick: bool) -> Result<(), MetraleError> {
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let (Ok(encode), Ok(replace)) = (d.cuTensorMapEncodeTiled(), d.cuTensorMapReplaceAddress())
    else {
        println!("tensor maps: the driver lacks cuTensorMapEncodeTiled; rows skipped");
        return Ok(());
    };
    let s = reg.stream();
    let (rows, cols) = (256u64, 512u64);
    let a = DeviceBuffer::<f32>::alloc(s, (rows * cols) as usize)?;
    let b = DeviceBuffer::<f32>::alloc(s, (rows * cols) as usize)?;
    let dims = [cols, rows];
    let strides = [cols * 4];
    let boxes = [32u32, 32];
    let estrides = [1u32, 1];
    let ours = || {
        TensorMap::tiled(&a)
            .dims(&dims)
            .strides(&strides)
            .box_dims(&boxes)
            .swizzle(Swizzle::B128)
            .encode()
            .unwrap()
    };
    let layout = TensorMap::tiled(&a)
        .dims(&dims)
        .strides(&strides)
        .box_dims(&boxes)
        .swizzle(Swizzle::B128)
        .layout()?;
    let via_layout = || layout.encode(&a).unwrap();
    let raw = || {
        let mut m = CUtensorMap { opaque: [0; 16] };
        // SAFETY: a writable map; arrays of the rank's length; `a` covers the tensor.
        let st = unsafe {
            encode(
                &mut m,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                2,
                a.device_ptr() as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                estrides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        assert!(st.is_success(), "cuTensorMapEncodeTiled: {st}");
        m
    };
    let batch = if quick { 200 } else { 1_000 };
    let (mut e_raw, mut e_ours) = (Row::default(), Row::default());
    let mut e_layout = Row::default();
    let (mut r_raw, mut r_ours) = (Row::default(), Row::default());
    let mut r_set = Row::default();
    let mut base = raw();
    for round in 0..rounds {
        let mut er = 0.0;
        let mut eo = 0.0;
        let mut el = 0.0;
        for k in 0..3 {
            match (round + k) % 3 {
                0 => {
                    er += time(|| {
                        (0..batch).for_each(|_| {
                            std::hint::black_box(raw());
                        })
                    })
                }
                1 => {
                    eo += time(|| {
                        (0..batch).for_each(|_| {
                            std::hint::black_box(ours());
                        })
                    })
                }
                _ => {
                    el += time(|| {
                        (0..batch).for_each(|_| {
                            std::hint::black_box(via_layout());
                        })
                    })
                }
            }
        }
        e_layout.push(el * 1e9 / batch as f64);
        e_raw.push(er * 1e9 / batch as f64);
        e_ours.push(eo * 1e9 / batch as f64);
        // The three address paths, their order rotating round by round.
        let (mut rr, mut ro, mut rs) = (0.0, 0.0, 0.0);
        let mut map = ours();
        let mut in_place = ours();
        for k in 0..3 {
            match (round + k) % 3 {
                0 => {
                    rr = time(|| {
                        for i in 0..batch {
                            let p = if i % 2 == 0 {
                                b.device_ptr()
                            } else {
                                a.device_ptr()
                            };
                            // SAFETY: an encoded map; both addresses cover the tensor.
                            let st = unsafe { replace(&mut base, p as *mut c_void) };
                            assert!(st.is_success(), "cuTensorMapReplaceAddress: {st}");
                        }
                    })
                }
                1 => {
                    // Timed in place: the map is moved out and back each call
                    // (`map = map.replace_address(..)`), which a closure cannot.
                    let t = std::time::Instant::now();
                    for i in 0..batch {
                        map = if i % 2 == 0 {
                            map.replace_address(&b).unwrap()
                        } else {
                            map.replace_address(&a).unwrap()
                        };
                    }
                    ro = t.elapsed().as_secs_f64();
                }
                _ => {
                    rs = time(|| {
                        for i in 0..batch {
                            if i % 2 == 0 {
                                in_place.set_address(&b).unwrap();
                            } else {
                                in_place.set_address(&a).unwrap();
                            }
                        }
                    })
                }
            }
        }
        std::hint::black_box((&map, &in_place, &base));
        r_raw.push(rr * 1e9 / batch as f64);
        r_ours.push(ro * 1e9 / batch as f64);
        r_set.push(rs * 1e9 / batch as f64);
    }
    header("tensor maps (ns per call)");
    line(
        "tensor map encode: cuTensorMapEncodeTiled",
        &e_raw,
        "ns",
        Some(&ratios(&e_raw, &e_raw)),
    );
    line(
        "tensor map encode: TensorMap::tiled().encode()",
        &e_ours,
        "ns",
        Some(&ratios(&e_ours, &e_raw)),
    );
    line(
        "tensor map encode: TensorMapLayout::encode(&mem)",
        &e_layout,
        "ns",
        Some(&ratios(&e_layout, &e_raw)),
    );
    line(
        "replace address: cuTensorMapReplaceAddress",
        &r_raw,
        "ns",
        Some(&ratios(&r_raw, &r_raw)),
    );
    line(
        "replace address: TensorMap::replace_address",
        &r_ours,
        "ns",
        Some(&ratios(&r_ours, &r_raw)),
    );
    line(
        "replace address in place: TensorMap::set_address",
        &r_set,
        "ns",
        Some(&ratios(&r_set, &r_raw)),
    );
    Ok(())
}
