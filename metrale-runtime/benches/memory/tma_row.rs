//! Issue 23: a TMA copy kernel (`tests/fixtures/tma.ptx`: one 32 x 32 f32 box a
//! block, loaded by `cp.async.bulk.tensor` through a tensor map, stored by the
//! block's threads) over a `big`-byte 2-D tensor, beside `copy_d2d` and the raw
//! `cuMemcpyDtoDAsync` of the same bytes (GB/s of tensor copied).

use crate::common::{header, line, ratios, time, Row};
use crate::ok;
use metrale_runtime::sys;
use metrale_runtime::{
    CudaStream, DeviceBuffer, LaunchConfig, MetraleError, MetraleRegistry, TensorMap,
};

static TMA_PTX: &[u8] = include_bytes!("../../tests/fixtures/tma.ptx");

pub fn run(
    reg: &MetraleRegistry,
    s: &CudaStream,
    big: usize,
    rounds: usize,
) -> Result<(), MetraleError> {
    if reg.host().limits().compute_capability.0 < 9 {
        println!("TMA copy: needs compute capability 9.0; row skipped");
        return Ok(());
    }
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let tma = MetraleRegistry::load(reg.host().ordinal(), &[("tma", TMA_PTX)])?;
    let f = tma.function("tma", "tma_copy_2d")?;
    let cols = 16_384usize;
    let rows = (big / 4 / cols).max(32) / 32 * 32;
    let n = rows * cols;
    let bytes = n * 4;
    let src = DeviceBuffer::<f32>::zeroed(s, n)?;
    let mut dst = DeviceBuffer::<f32>::alloc(s, n)?;
    let map = TensorMap::tiled(&src)
        .dims(&[cols as u64, rows as u64])
        .strides(&[(cols * 4) as u64])
        .box_dims(&[32, 32])
        .encode()?;
    let cfg = LaunchConfig::new(((cols / 32) as u32, (rows / 32) as u32, 1), (128, 1, 1), 0)?;
    let raw_d2d = d.cuMemcpyDtoDAsync_v2().unwrap();
    let (sp, dp, raw_s) = (src.device_ptr(), dst.device_ptr(), s.raw());
    let sync = || {
        // SAFETY: a live stream.
        ok("cuStreamSynchronize", unsafe {
            (d.cuStreamSynchronize().unwrap())(raw_s)
        });
    };
    let (mut raw, mut copy, mut tmac) = (Row::default(), Row::default(), Row::default());
    for round in 0..rounds {
        for k in 0..3 {
            match (round + k) % 3 {
                0 => raw.push(
                    bytes as f64
                        / time(|| {
                            // SAFETY: `bytes` of two live buffers.
                            ok("cuMemcpyDtoDAsync_v2", unsafe {
                                raw_d2d(dp, sp, bytes, raw_s)
                            });
                            sync();
                        })
                        / 1e9,
                ),
                1 => copy.push(
                    bytes as f64
                        / time(|| {
                            s.copy_d2d(&src, &mut dst).unwrap();
                            s.synchronize().unwrap();
                        })
                        / 1e9,
                ),
                _ => tmac.push(
                    bytes as f64
                        / time(|| {
                            // SAFETY: tma_copy_2d(map, float*, width) writes rows x
                            // cols floats of `dst`; the map covers `src`; both
                            // outlive the launch (waited for).
                            unsafe { s.launch(&f, cfg, (&map, &mut dst, cols as u32)) }.unwrap();
                            s.synchronize().unwrap();
                        })
                        / 1e9,
                ),
            }
        }
    }
    let size = if bytes >= 1 << 30 {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes >> 20)
    };
    header(&format!("TMA copy ({rows} x {cols} f32, 32 x 32 boxes)"));
    line(
        &format!("device-to-device {size}, raw (GB/s)"),
        &raw,
        "  ",
        Some(&ratios(&raw, &raw)),
    );
    line(
        &format!("device-to-device {size}, copy_d2d (GB/s)"),
        &copy,
        "  ",
        Some(&ratios(&copy, &raw)),
    );
    line(
        &format!("TMA copy kernel {size}, tensor map (GB/s)"),
        &tmac,
        "  ",
        Some(&ratios(&tmac, &raw)),
    );
    Ok(())
}
