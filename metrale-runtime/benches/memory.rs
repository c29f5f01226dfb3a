//! Memory against the raw driver, same process, same stream: stream-ordered
//! allocation + free pairs, fills and device-to-device copies of 1 GiB, and a typed
//! `__device__` symbol written and read back; then virtual memory
//! (`memory/vmm_rows.rs`: map, grown-buffer copies, sleep/wake, import in a
//! second process) and a TMA copy kernel (`memory/tma_row.rs`).
//!
//! `cargo bench -p metrale-runtime --bench memory [-- --rounds N | --quick]`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "memory/batch_rows.rs"]
mod batch_rows;
mod common;
#[path = "memory/tma_row.rs"]
mod tma_row;
#[path = "memory/vmm_rows.rs"]
mod vmm_rows;

use std::ffi::c_void;
use std::hint::black_box;
use std::process::ExitCode;

use common::{header, line, ratios, rounds, time, Row};
use metrale_runtime::sys::{self, CUresult};
use metrale_runtime::{DeviceBuffer, MemPool, MetraleError, MetraleRegistry};

static PTX: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");
const SCALE: &str = "_ZN7tq_plus14d_innerq_scaleE";

pub(crate) fn ok(call: &str, s: CUresult) {
    assert!(s.is_success(), "{call} failed: {s}");
}

fn run() -> Result<(), MetraleError> {
    let rounds = rounds(15, 3);
    let big: usize = if common::is_quick() {
        64 << 20
    } else {
        1 << 30
    };
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
    let s = reg.stream();
    let raw_s = s.raw();
    let sync = || {
        // SAFETY: the host's stream.
        ok("cuStreamSynchronize", unsafe {
            (d.cuStreamSynchronize().unwrap())(raw_s)
        });
    };
    // The default pool keeps freed memory, as in the C measurement.
    MemPool::device_default(s)?.set_release_threshold(u64::MAX)?;

    let raw_alloc = d.cuMemAllocAsync().unwrap();
    let raw_free = d.cuMemFreeAsync().unwrap();
    let pairs = 10_000;
    let bytes = 1 << 20;
    let alloc_raw = || {
        for _ in 0..pairs {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: a stream-ordered allocation freed at once on the same stream.
            unsafe {
                ok("cuMemAllocAsync", raw_alloc(&mut p, bytes, raw_s));
                ok("cuMemFreeAsync", raw_free(black_box(p), raw_s));
            }
        }
    };
    let alloc_ours = || {
        for _ in 0..pairs {
            drop(black_box(s.alloc::<u8>(bytes).unwrap()));
        }
    };
    let mut dst = DeviceBuffer::<u32>::alloc(s, big / 4)?;
    let src = DeviceBuffer::<u32>::zeroed(s, big / 4)?;
    let raw_memset = d.cuMemsetD32Async().unwrap();
    let raw_d2d = d.cuMemcpyDtoDAsync_v2().unwrap();
    let (dptr, sptr) = (dst.device_ptr(), src.device_ptr());
    let symbol = reg.symbol_array::<f32>("kernels", SCALE, 64)?;
    let (sym_ptr, _) = reg.device_symbol("kernels", SCALE)?;
    let values = [1.25f32; 64];
    let mut back = [0f32; 64];
    let raw_h2d = d.cuMemcpyHtoDAsync_v2().unwrap();
    let raw_d2h = d.cuMemcpyDtoHAsync_v2().unwrap();
    let sym_raw = |back: &mut [f32; 64]| {
        // SAFETY: 256 bytes each way between host arrays alive for the call and the
        // symbol; each copy is waited for.
        unsafe {
            ok(
                "cuMemcpyHtoDAsync_v2",
                raw_h2d(sym_ptr, values.as_ptr().cast::<c_void>(), 256, raw_s),
            );
            sync();
            ok(
                "cuMemcpyDtoHAsync_v2",
                raw_d2h(back.as_mut_ptr().cast::<c_void>(), sym_ptr, 256, raw_s),
            );
            sync();
        }
    };
    // Warm up.
    alloc_raw();
    alloc_ours();
    sync();

    let mut r: Vec<Row> = vec![Row::default(); 8];
    for round in 0..rounds {
        let first_raw = round % 2 == 0;
        for k in 0..2 {
            if (k == 0) == first_raw {
                r[0].push(
                    time(|| {
                        alloc_raw();
                        sync();
                    }) * 1e6
                        / pairs as f64,
                );
                r[2].push(
                    big as f64
                        / time(|| {
                            // SAFETY: `big` bytes of dst, in the stream's context.
                            ok("cuMemsetD32Async", unsafe {
                                raw_memset(dptr, 7, big / 4, raw_s)
                            });
                            sync();
                        })
                        / 1e9,
                );
                r[4].push(
                    big as f64
                        / time(|| {
                            // SAFETY: `big` bytes of both buffers.
                            ok("cuMemcpyDtoDAsync_v2", unsafe {
                                raw_d2d(dptr, sptr, big, raw_s)
                            });
                            sync();
                        })
                        / 1e9,
                );
                r[6].push(
                    time(|| {
                        for _ in 0..100 {
                            sym_raw(&mut back);
                        }
                    }) * 1e6
                        / 100.0,
                );
            } else {
                r[1].push(
                    time(|| {
                        alloc_ours();
                        s.synchronize().unwrap();
                    }) * 1e6
                        / pairs as f64,
                );
                r[3].push(
                    big as f64
                        / time(|| {
                            s.memset_u32(&mut dst, 7).unwrap();
                            s.synchronize().unwrap();
                        })
                        / 1e9,
                );
                r[5].push(
                    big as f64
                        / time(|| {
                            s.copy_d2d(&src, &mut dst).unwrap();
                            s.synchronize().unwrap();
                        })
                        / 1e9,
                );
                r[7].push(
                    time(|| {
                        for _ in 0..100 {
                            symbol.write(s, &values).unwrap();
                            black_box(symbol.read(s).unwrap());
                        }
                    }) * 1e6
                        / 100.0,
                );
            }
        }
    }
    let h = reg.host();
    header(&format!(
        "metrale memory benchmark: {} (sm_{}{}), driver {}, {rounds} rounds",
        h.device_name(),
        h.limits().compute_capability.0,
        h.limits().compute_capability.1,
        h.driver_version()
    ));
    let gib = if big >= 1 << 30 {
        "1 GiB".to_owned()
    } else {
        format!("{} MiB", big >> 20)
    };
    line(
        "stream-ordered alloc + free 1 MiB, raw (us/pair)",
        &r[0],
        "  ",
        Some(&ratios(&r[0], &r[0])),
    );
    line(
        "stream-ordered alloc + free 1 MiB, ours (us/pair)",
        &r[1],
        "  ",
        Some(&ratios(&r[1], &r[0])),
    );
    line(
        &format!("memset 32-bit {gib}, raw (GB/s)"),
        &r[2],
        "  ",
        Some(&ratios(&r[2], &r[2])),
    );
    line(
        &format!("memset 32-bit {gib}, memset_u32 (GB/s)"),
        &r[3],
        "  ",
        Some(&ratios(&r[3], &r[2])),
    );
    line(
        &format!("device-to-device {gib}, raw (GB/s)"),
        &r[4],
        "  ",
        Some(&ratios(&r[4], &r[4])),
    );
    line(
        &format!("device-to-device {gib}, copy_d2d (GB/s)"),
        &r[5],
        "  ",
        Some(&ratios(&r[5], &r[4])),
    );
    line(
        "symbol write + read 256 B, raw (us)",
        &r[6],
        "  ",
        Some(&ratios(&r[6], &r[6])),
    );
    line(
        "symbol write + read 256 B, DeviceSymbol (us)",
        &r[7],
        "  ",
        Some(&ratios(&r[7], &r[6])),
    );
    assert_eq!(back, values);
    drop((dst, src));
    // Issue 21: virtual memory; issue 23: the TMA copy.
    vmm_rows::run(s, big, rounds.min(7))?;
    tma_row::run(&reg, s, big, rounds.min(7))?;
    // Issue 34: batched copies.
    batch_rows::run(s, rounds.max(5))?;
    Ok(())
}

fn main() -> ExitCode {
    if let Ok(path) = std::env::var(vmm_rows::CHILD_VAR) {
        // The second process of the import rows.
        return match vmm_rows::child(&path) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("memory bench (second process): {e}");
                ExitCode::FAILURE
            }
        };
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("memory bench: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("memory bench: {e}");
            ExitCode::FAILURE
        }
    }
}
