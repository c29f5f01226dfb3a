//! Issue 34: a paged-KV move, 512 blocks of 16 KiB from pinned host memory to
//! device blocks in reverse order, as `copy_batch` (one `cuMemcpyBatchAsync`),
//! as the raw `cuMemcpyBatchAsync_v2` of the same arrays, and as 512 single
//! `copy_h2d` calls; each waited for (µs per batch). Rounds alternate which path
//! goes first.

use crate::common::{header, line, ratios, time, Row};
use crate::ok;
use metrale_runtime::sys;
use metrale_runtime::{
    BatchCopy, CudaStream, DeviceBuffer, DeviceSliceMut, MetraleError, PinnedBuffer,
};

pub fn run(s: &CudaStream, rounds: usize) -> Result<(), MetraleError> {
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let Ok(raw_batch) = d.cuMemcpyBatchAsync_v2() else {
        println!("batched copies: the driver has no cuMemcpyBatchAsync_v2; rows skipped");
        return Ok(());
    };
    let raw_sync = d.cuStreamSynchronize().unwrap();
    let (blocks, block) = (512usize, 16usize << 10);
    let elems = block / 4;
    let mut host = PinnedBuffer::<u32>::zeroed(s, blocks * elems)?;
    for (i, v) in host.iter_mut().enumerate() {
        *v = i as u32;
    }
    let mut cache = DeviceBuffer::<u32>::zeroed(s, blocks * elems)?;
    s.synchronize()?;
    let raw_s = s.raw();
    // The raw arrays: block i of the host to block (blocks - 1 - i) of the cache.
    let mut dsts: Vec<sys::CUdeviceptr> = (0..blocks)
        .map(|i| cache.device_ptr() + ((blocks - 1 - i) * block) as u64)
        .collect();
    let mut srcs: Vec<sys::CUdeviceptr> = (0..blocks)
        .map(|i| host.as_ptr() as usize as u64 + (i * block) as u64)
        .collect();
    let mut sizes = vec![block; blocks];
    // SAFETY: a plain C struct of integers; all-zero is valid.
    let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder_enum::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    let raw = |dsts: &mut [u64],
               srcs: &mut [u64],
               sizes: &mut [usize],
               attrs: &mut sys::CUmemcpyAttributes| {
        let mut first = 0usize;
        // SAFETY: 512 pairs of pinned host and device blocks alive for the call
        // and waited for below.
        unsafe {
            ok(
                "cuMemcpyBatchAsync_v2",
                raw_batch(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    blocks,
                    attrs,
                    &mut first,
                    1,
                    raw_s,
                ),
            );
            ok("cuStreamSynchronize", raw_sync(raw_s));
        }
    };
    let mut r: Vec<Row> = vec![Row::default(); 3];
    for round in 0..rounds + 1 {
        let order: [usize; 3] = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
        for k in order {
            let t = match k {
                0 => time(|| raw(&mut dsts, &mut srcs, &mut sizes, &mut attrs)),
                1 => {
                    let mut views: Vec<DeviceSliceMut<'_, u32>> = cache.chunks_mut(elems).collect();
                    time(|| {
                        let copies: Vec<BatchCopy<'_>> = host
                            .chunks(elems)
                            .zip(views.iter_mut().rev())
                            .map(|(f, t)| BatchCopy::h2d(f, t))
                            .collect();
                        s.copy_batch(&copies).unwrap();
                    })
                }
                _ => {
                    let mut views: Vec<DeviceSliceMut<'_, u32>> = cache.chunks_mut(elems).collect();
                    time(|| {
                        for (f, t) in host.chunks(elems).zip(views.iter_mut().rev()) {
                            s.copy_h2d(f, t).unwrap();
                        }
                    })
                }
            };
            if round > 0 {
                r[k].push(t * 1e6);
            }
        }
    }
    // Exact: every block landed where it was sent.
    let back = s.to_vec(&cache)?;
    for i in 0..blocks {
        let at = (blocks - 1 - i) * elems;
        assert_eq!(back[at], (i * elems) as u32, "block {i}");
    }
    header("batched copies: 512 x 16 KiB pinned host -> device blocks, waited (us per batch)");
    line(
        "raw cuMemcpyBatchAsync_v2",
        &r[0],
        "us",
        Some(&ratios(&r[0], &r[0])),
    );
    line(
        "stream.copy_batch",
        &r[1],
        "us",
        Some(&ratios(&r[1], &r[0])),
    );
    line(
        "512 single copy_h2d calls",
        &r[2],
        "us",
        Some(&ratios(&r[2], &r[0])),
    );
    line(
        "  copy_batch vs the single calls",
        &r[1],
        "us",
        Some(&ratios(&r[1], &r[2])),
    );
    Ok(())
}
