//! NCCL against raw `ncclAllReduce` through the sys table, same process, rounds
//! interleaved (the paths take turns going first), one rank on device 0: the
//! submit cost of an 8-byte all-reduce, the bandwidth of a 256 MiB all-reduce,
//! a graph of 100 small all-reduces replayed against the same 100 queued
//! eagerly, and all-reduce latency from 8 B to 1 MiB on plain, registered and
//! symmetric-window buffers (`ncclMemAlloc`), ours beside the raw calls.
//!
//! `cargo bench -p metrale-runtime --features nccl --bench nccl [-- --rounds N | --quick]`.
//! Without a GPU or NCCL it says so and exits with status 2.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::ExitCode;

use common::{differences, header, line, ratios, rounds, time, Row};
use metrale_runtime::nccl::{CommConfig, Communicator, NcclBuffer, NcclId, ReduceOp, WindowFlags};
use metrale_runtime::sys::nccl::{self as raw, ncclDataType_t, ncclRedOp_t};
use metrale_runtime::{context, CudaStream, DeviceBuffer, MetraleError};

fn run() -> Result<(), MetraleError> {
    let ctx = context(0)?;
    let id = NcclId::new()?;
    let comm = Communicator::init_rank(&id, 1, 0, &ctx, &CommConfig::new())?;
    let s = CudaStream::new(&ctx)?;
    let lib = raw::nccl().unwrap();
    println!(
        "NCCL {:?} from {}, device 0, one rank",
        lib.version(),
        lib.path()
    );
    let raw_all_reduce = lib.ncclAllReduce().unwrap();
    let raw_stream = s.raw().cast::<raw::CUstream_st>();
    let raw_comm = comm.raw();
    let n_rounds = rounds(15, 3);

    // 8-byte all-reduce: submit cost per call (1000 calls, then one sync).
    let calls = if common::is_quick() { 200 } else { 1000 };
    let mut small = DeviceBuffer::<f32>::zeroed(&s, 2)?;
    let small_ptr = small.device_ptr() as usize as *mut std::ffi::c_void;
    let (mut ours, mut base) = (Row::default(), Row::default());
    for _ in 0..3 {
        comm.all_reduce_in_place(&mut small, ReduceOp::Sum, &s)?;
    }
    s.synchronize()?;
    // The two paths take turns going first, round by round (as in the other
    // benches), so an effect of going first or second falls on both alike.
    let raw_batch = || {
        time(|| {
            for _ in 0..calls {
                // SAFETY: 2 floats at `small_ptr` on device 0; a live
                // communicator and stream of that device.
                let st = unsafe {
                    raw_all_reduce(
                        small_ptr,
                        small_ptr,
                        2,
                        ncclDataType_t::ncclFloat32,
                        ncclRedOp_t::ncclSum,
                        raw_comm,
                        raw_stream,
                    )
                };
                assert!(st.is_success(), "{st}");
            }
        }) * 1e6
            / calls as f64
    };
    for round in 0..n_rounds {
        for k in 0..2 {
            if (round + k) % 2 == 0 {
                base.push(raw_batch());
            } else {
                ours.push(
                    time(|| {
                        for _ in 0..calls {
                            comm.all_reduce_in_place(&mut small, ReduceOp::Sum, &s)
                                .unwrap();
                        }
                    }) * 1e6
                        / calls as f64,
                );
            }
            s.synchronize()?;
        }
    }
    header("8-byte all-reduce, submit cost per call");
    line("raw ncclAllReduce (sys table)", &base, "us", None);
    line(
        "Communicator::all_reduce_in_place",
        &ours,
        "us",
        Some(&ratios(&ours, &base)),
    );
    // The budget is an added cost, not a ratio: NCCL's own spread between
    // rounds is larger than a few percent of 0.2 us.
    line(
        "  paired difference, ours - raw (ns per call)",
        &differences(&ours, &base, 1e3),
        "ns",
        None,
    );

    // 256 MiB all-reduce bandwidth (bytes / time, one rank).
    let n = (256usize << 20) / 4;
    let big = DeviceBuffer::<f32>::zeroed(&s, n)?;
    let mut out = DeviceBuffer::<f32>::zeroed(&s, n)?;
    let (bp, op) = (
        big.device_ptr() as usize as *mut std::ffi::c_void,
        out.device_ptr() as usize as *mut std::ffi::c_void,
    );
    let (mut ours, mut base) = (Row::default(), Row::default());
    comm.all_reduce(&big, &mut out, ReduceOp::Sum, &s)?;
    s.synchronize()?;
    let gb = (n * 4) as f64 / 1e9;
    for _ in 0..n_rounds {
        base.push(
            gb / time(|| {
                // SAFETY: n floats at both pointers on device 0.
                let st = unsafe {
                    raw_all_reduce(
                        bp,
                        op,
                        n,
                        ncclDataType_t::ncclFloat32,
                        ncclRedOp_t::ncclSum,
                        raw_comm,
                        raw_stream,
                    )
                };
                assert!(st.is_success(), "{st}");
                s.synchronize().unwrap();
            }),
        );
        ours.push(
            gb / time(|| {
                comm.all_reduce(&big, &mut out, ReduceOp::Sum, &s).unwrap();
                s.synchronize().unwrap();
            }),
        );
    }
    header("256 MiB all-reduce, GB/s (higher is better)");
    line("raw ncclAllReduce (sys table)", &base, "GB", None);
    line(
        "Communicator::all_reduce",
        &ours,
        "GB",
        Some(&ratios(&ours, &base)),
    );

    // A graph of 100 small all-reduces, replayed, against 100 eager calls.
    let graph = s.capture(|cs| -> metrale_runtime::Result<()> {
        for _ in 0..100 {
            comm.all_reduce_in_place(&mut small, ReduceOp::Sum, cs)?;
        }
        Ok(())
    })?;
    let exec = graph.instantiate()?;
    let (mut replay, mut eager) = (Row::default(), Row::default());
    for _ in 0..n_rounds {
        eager.push(
            time(|| {
                for _ in 0..100 {
                    comm.all_reduce_in_place(&mut small, ReduceOp::Sum, &s)
                        .unwrap();
                }
                s.synchronize().unwrap();
            }) * 1e6,
        );
        replay.push(
            time(|| {
                // SAFETY: `small` is alive and not borrowed elsewhere.
                unsafe { exec.launch(&s) }.unwrap();
                s.synchronize().unwrap();
            }) * 1e6,
        );
    }
    header("100 8-byte all-reduces: eager vs one graph replay (us per step)");
    line("eager (100 calls + sync)", &eager, "us", None);
    line(
        "graph replay (+ sync)",
        &replay,
        "us",
        Some(&ratios(&replay, &eager)),
    );
    drop(exec);
    drop(big);
    registered_latency(&comm, &s, n_rounds)?;
    Ok(())
}

/// All-reduce latency (`calls` in-place all-reduces then one sync, per call)
/// for 8 B to 1 MiB: a `DeviceBuffer` (unregistered) and a registered
/// `NcclBuffer`, each through raw `ncclAllReduce` and through the
/// communicator, and a symmetric window (NCCL 2.27+) through the communicator.
fn registered_latency(
    comm: &Communicator,
    s: &CudaStream,
    n_rounds: usize,
) -> Result<(), MetraleError> {
    let lib = raw::nccl().unwrap();
    let raw_all_reduce = lib.ncclAllReduce().unwrap();
    let (raw_comm, raw_stream) = (comm.raw(), s.raw().cast::<raw::CUstream_st>());
    let calls = if common::is_quick() { 50 } else { 200 };
    let windows = lib.version().is_some_and(|v| v >= (2, 27, 0));
    header("in-place f32 all-reduce latency, one rank (us per call, 200 calls + sync)");
    for bytes in [8usize, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20] {
        let n = bytes / 4;
        let mut plain = DeviceBuffer::<f32>::zeroed(s, n)?;
        let mut reg_buf = NcclBuffer::<f32>::alloc(comm.context(), n)?;
        let mut win_buf = NcclBuffer::<f32>::alloc(comm.context(), n)?;
        let mut reg = comm.register(&mut reg_buf)?;
        let mut win = if windows {
            Some(comm.register_window(&mut win_buf, WindowFlags::COLL_SYMMETRIC)?)
        } else {
            None
        };
        // `calls` of `one`, then a sync: microseconds per call.
        let per_call = |one: &mut dyn FnMut()| {
            time(|| {
                for _ in 0..calls {
                    one();
                }
                s.synchronize().unwrap();
            }) * 1e6
                / calls as f64
        };
        let raw_on = |p: *mut std::ffi::c_void| {
            move || {
                // SAFETY: n floats at `p` on device 0 (a live buffer); a live
                // communicator and stream of that device.
                let st = unsafe {
                    raw_all_reduce(
                        p,
                        p,
                        n,
                        ncclDataType_t::ncclFloat32,
                        ncclRedOp_t::ncclSum,
                        raw_comm,
                        raw_stream,
                    )
                };
                assert!(st.is_success(), "{st}");
            }
        };
        let plain_ptr = plain.device_ptr() as usize as *mut std::ffi::c_void;
        let reg_ptr = reg.device_ptr() as usize as *mut std::ffi::c_void;
        let mut rows: [Row; 5] = Default::default();
        for round in 0..n_rounds {
            for k in 0..5 {
                let which = (round + k) % 5;
                let t = match (which, win.as_mut()) {
                    (0, _) => per_call(&mut raw_on(plain_ptr)),
                    (1, _) => per_call(&mut || {
                        comm.all_reduce_in_place(&mut plain, ReduceOp::Sum, s)
                            .unwrap()
                    }),
                    (2, _) => per_call(&mut raw_on(reg_ptr)),
                    (3, _) => per_call(&mut || {
                        comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, s)
                            .unwrap()
                    }),
                    (_, Some(w)) => {
                        per_call(&mut || comm.all_reduce_in_place(w, ReduceOp::Sum, s).unwrap())
                    }
                    (_, None) => continue,
                };
                rows[which].push(t);
            }
        }
        let [raw_plain, ours_plain, raw_reg, ours_reg, ours_win] = rows;
        println!("  {bytes} B:");
        line(
            "    raw ncclAllReduce, DeviceBuffer",
            &raw_plain,
            "us",
            None,
        );
        line(
            "    all_reduce_in_place, DeviceBuffer",
            &ours_plain,
            "us",
            Some(&ratios(&ours_plain, &raw_plain)),
        );
        line("    raw ncclAllReduce, registered", &raw_reg, "us", None);
        line(
            "    all_reduce_in_place, Registration",
            &ours_reg,
            "us",
            Some(&ratios(&ours_reg, &raw_reg)),
        );
        if windows {
            line(
                "    all_reduce_in_place, symmetric Window (vs unregistered raw)",
                &ours_win,
                "us",
                Some(&ratios(&ours_win, &raw_plain)),
            );
        }
        drop(win);
        drop(reg);
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nccl bench: {e}");
            ExitCode::from(2)
        }
    }
}
