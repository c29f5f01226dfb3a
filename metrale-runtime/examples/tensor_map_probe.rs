//! A probe for counting instructions per tensor-map call (issue 33), against the
//! stand-in driver: `tensor_map_probe MODE N` runs one path N times, each ours or
//! its raw call through the sys table in the same binary. Under
//! `valgrind --tool=callgrind`, the difference between two N divided by their
//! difference is the instructions of one call (the setup cancels out):
//!
//! ```text
//! cargo build --release --example tensor_map_probe
//! for m in raw_encode encode layout raw_replace replace set; do
//!   for n in 1000 2000; do
//!     valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!       target/release/examples/tensor_map_probe $m $n 2>&1 | grep refs
//!   done
//! done
//! ```
//!
//! Modes: `raw_encode`, `encode` (`TensorMap::tiled().encode()`), `layout`
//! (`TensorMapLayout::encode`), `raw_replace`, `replace` (`replace_address`),
//! `set` (`set_address`), `none` (setup only). Without `METRALE_LIBCUDA_PATH` it
//! loads the stand-in.

use std::ffi::c_void;
use std::hint::black_box;

use metrale_runtime::sys::{self, CUtensorMap};
use metrale_runtime::{host, DeviceBuffer, Swizzle, TensorMap};

fn main() -> metrale_runtime::Result<()> {
    if std::env::var_os("METRALE_LIBCUDA_PATH").is_none() {
        std::env::set_var("METRALE_LIBCUDA_PATH", metrale_fakecuda::library_path());
    }
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("none", String::as_str);
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let d = sys::driver().map_err(|e| metrale_runtime::MetraleError::from(e.clone()))?;
    let (Ok(encode), Ok(replace)) = (d.cuTensorMapEncodeTiled(), d.cuTensorMapReplaceAddress())
    else {
        eprintln!("the driver lacks tensor maps");
        return Ok(());
    };
    let h = host(0)?;
    let s = h.stream();
    let (rows, cols) = (256u64, 512u64);
    let a = DeviceBuffer::<f32>::alloc(s, (rows * cols) as usize)?;
    let b = DeviceBuffer::<f32>::alloc(s, (rows * cols) as usize)?;
    let dims = [cols, rows];
    let strides = [cols * 4];
    let boxes = [32u32, 32];
    let estrides = [1u32, 1];
    let ours = || {
        TensorMap::tiled(black_box(&a))
            .dims(black_box(&dims))
            .strides(black_box(&strides))
            .box_dims(black_box(&boxes))
            .swizzle(Swizzle::B128)
            .encode()
    };
    let layout = TensorMap::tiled(&a)
        .dims(&dims)
        .strides(&strides)
        .box_dims(&boxes)
        .swizzle(Swizzle::B128)
        .layout()?;
    let raw = || {
        let mut m = CUtensorMap { opaque: [0; 16] };
        // SAFETY: a writable map; arrays of the rank's length; `a` covers the tensor.
        let st = unsafe {
            encode(
                &mut m,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                2,
                black_box(a.device_ptr()) as *mut c_void,
                black_box(&dims).as_ptr(),
                black_box(&strides).as_ptr(),
                black_box(&boxes).as_ptr(),
                estrides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        (st.is_success(), m)
    };
    match mode {
        "raw_encode" => (0..n).for_each(|_| {
            black_box(raw());
        }),
        "encode" => (0..n).for_each(|_| {
            black_box(ours().is_ok());
        }),
        "layout" => (0..n).for_each(|_| {
            black_box(layout.encode(black_box(&a)).is_ok());
        }),
        "raw_replace" => {
            let (_, mut m) = raw();
            for i in 0..n {
                let p = if i % 2 == 0 { &b } else { &a };
                // SAFETY: an encoded map; both addresses cover the tensor.
                let st = unsafe { replace(&mut m, black_box(p).device_ptr() as *mut c_void) };
                black_box(st.is_success());
            }
            black_box(&m);
        }
        "replace" => {
            let mut map = ours()?;
            for i in 0..n {
                let p = if i % 2 == 0 { &b } else { &a };
                map = map.replace_address(black_box(p))?;
            }
            black_box(&map);
        }
        "set" => {
            let mut map = ours()?;
            for i in 0..n {
                let p = if i % 2 == 0 { &b } else { &a };
                black_box(map.set_address(black_box(p)).is_ok());
            }
            black_box(&map);
        }
        "sizes" => println!(
            "TensorMap {} bytes, Result<TensorMap> {} bytes",
            std::mem::size_of::<TensorMap<'_, f32>>(),
            std::mem::size_of::<metrale_runtime::Result<TensorMap<'_, f32>>>()
        ),
        _ => {}
    }
    Ok(())
}
