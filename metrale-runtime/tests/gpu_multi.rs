//! Tier 3 on two GPUs: one model on both devices, peer copies, a kernel reading
//! the other device's memory, and one thread per device.
//!
//! With fewer than two devices every test is reported ignored, with the reason;
//! `METRALE_REQUIRE_GPUS=2` turns that into failures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/harness.rs"]
mod harness;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use harness::Test;
use metrale_runtime::*;

static PTX: &[u8] = include_bytes!("fixtures/kernels.ptx");

fn both() -> Vec<Arc<MetraleRegistry>> {
    MetraleRegistry::load_on_devices(&[0, 1], &[("kernels", PTX)]).unwrap()
}

fn one_model_loaded_once_runs_on_both_devices() {
    let regs = both();
    assert!(
        regs.iter().all(|r| r.shares_code()),
        "the library API is used"
    );
    for (d, reg) in regs.iter().enumerate() {
        let s = reg.stream();
        let f = reg.function("kernels", "vec_add").unwrap();
        let n = 1 << 20;
        let a: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 + d as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        let (da, db) = (
            DeviceBuffer::from_host(s, &a).unwrap(),
            DeviceBuffer::from_host(s, &b).unwrap(),
        );
        let mut dc = DeviceBuffer::<f32>::alloc(s, n).unwrap();
        // SAFETY: vec_add over n elements.
        unsafe {
            s.launch(
                &f,
                LaunchConfig::for_num_elems(n, 256).unwrap(),
                (&da, &db, &mut dc, n as u32),
            )
        }
        .unwrap();
        let c = s.to_vec(&dc).unwrap();
        assert!((0..n).all(|i| c[i] == a[i] + b[i]), "device {d}");
        // Symbols per device.
        let sym = reg
            .symbol_array::<u32>("kernels", "_ZN12metrale_test8countersE", 16)
            .unwrap();
        sym.write(s, &[d as u32; 16]).unwrap();
    }
    for (d, reg) in regs.iter().enumerate() {
        let sym = reg
            .symbol_array::<u32>("kernels", "_ZN12metrale_test8countersE", 16)
            .unwrap();
        assert_eq!(sym.read(reg.stream()).unwrap(), vec![d as u32; 16]);
    }
    // A kernel of device 0 on device 1's stream is refused.
    let f0 = regs[0].function("kernels", "count_launch").unwrap();
    let mut c1 = DeviceBuffer::<u64>::zeroed(regs[1].stream(), 1).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (1, 1, 1), 0).unwrap();
    // SAFETY: refused before the driver.
    let e = unsafe { regs[1].stream().launch(&f0, cfg, (&mut c1,)) }.unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::WrongDevice { .. }), "{e}");
}

fn peer_copy_round_trip_of_1_gib() {
    let (h0, h1) = (host(0).unwrap(), host(1).unwrap());
    let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    eprintln!("    link 0 -> 1: {:?}", d0.peer_link(&d1).unwrap());
    if d0.can_access_peer(&d1).unwrap() {
        enable_peer_access(&h0, &h1).unwrap();
        enable_peer_access(&h1, &h0).unwrap();
        enable_peer_access(&h0, &h1).unwrap();
    }
    let n = (1usize << 30) / 4;
    let mut src = DeviceBuffer::<u32>::alloc(&h0, n).unwrap();
    // A pattern that differs per word: fill_index on device 0.
    let reg0 = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    let f = reg0.function("kernels", "fill_index").unwrap();
    // SAFETY: fill_index(unsigned*, unsigned, unsigned) over n elements.
    unsafe {
        h0.stream().launch(
            &f,
            LaunchConfig::for_num_elems(n, 256).unwrap(),
            (&mut src, n as u32, 12345u32),
        )
    }
    .unwrap();
    let mut mid = DeviceBuffer::<u32>::zeroed(&h1, n).unwrap();
    let mut back = DeviceBuffer::<u32>::zeroed(&h0, n).unwrap();
    h0.stream().synchronize().unwrap();
    let t = Instant::now();
    h1.stream().copy_peer(&src, &mut mid).unwrap();
    h1.stream().synchronize().unwrap();
    let there = t.elapsed();
    let t = Instant::now();
    h0.stream().copy_peer(&mid, &mut back).unwrap();
    h0.stream().synchronize().unwrap();
    let home = t.elapsed();
    eprintln!(
        "    1 GiB 0 -> 1 in {:.2} ms, 1 -> 0 in {:.2} ms",
        there.as_secs_f64() * 1e3,
        home.as_secs_f64() * 1e3
    );
    let got = h0.stream().to_vec(&back).unwrap();
    for (i, &v) in got.iter().enumerate() {
        assert_eq!(v, (i as u32).wrapping_add(12345), "word {i}");
    }
}

fn a_kernel_on_device_1_reads_device_0_memory() {
    let regs = both();
    let (h0, h1) = (regs[0].host(), regs[1].host());
    enable_peer_access(h1, h0).unwrap();
    let n = 1 << 20;
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let on0 = DeviceBuffer::from_host(h0, &values).unwrap();
    let mut on1 = DeviceBuffer::<f32>::zeroed(h1, n).unwrap();
    let f = regs[1].function("kernels", "scale2").unwrap();
    let s = h1.stream();
    // SAFETY: scale2(const float*, float*, unsigned): reads device 0's buffer
    // through peer access, writes device 1's.
    unsafe {
        s.launch(
            &f,
            LaunchConfig::for_num_elems(n, 256).unwrap(),
            (on0.device_ptr(), &mut on1, n as u32),
        )
    }
    .unwrap();
    let got = s.to_vec(&on1).unwrap();
    assert!((0..n).all(|i| got[i] == values[i] * 2.0));
}

fn two_threads_each_launch_100000_kernels_on_their_device() {
    let regs = both();
    let threads: Vec<_> = regs
        .iter()
        .map(|r| {
            let r = Arc::clone(r);
            std::thread::spawn(move || {
                let s = CudaStream::new(r.ctx()).unwrap();
                let f = r.function("kernels", "count_launch").unwrap();
                let mut counter = DeviceBuffer::<u64>::zeroed(&s, 1).unwrap();
                let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
                let t = Instant::now();
                for _ in 0..100_000 {
                    // SAFETY: count_launch(unsigned long long*).
                    unsafe { s.launch(&f, cfg, (&mut counter,)) }.unwrap();
                }
                let got = s.to_vec(&counter).unwrap()[0];
                (got, t.elapsed())
            })
        })
        .collect();
    for (d, t) in threads.into_iter().enumerate() {
        let (count, took) = t.join().unwrap();
        eprintln!(
            "    device {d}: 100000 launches in {:.1} ms",
            took.as_secs_f64() * 1e3
        );
        assert_eq!(count, 100_000, "device {d}");
    }
}

/// Issue 22: 512 futures of both devices' streams (4 each) in flight at once,
/// under tokio; each resolves, and every kernel before it ran.
fn futures_of_two_devices_under_tokio() {
    let regs = both();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let mut work = Vec::new();
    for r in &regs {
        let streams: Vec<_> = (0..4).map(|_| CudaStream::new(r.ctx()).unwrap()).collect();
        let f = r.function("kernels", "count_launch").unwrap();
        let counters: Vec<_> = streams
            .iter()
            .map(|s| DeviceBuffer::<u64>::zeroed(s, 1).unwrap())
            .collect();
        work.push((streams, f, counters));
    }
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    rt.block_on(async {
        let mut waiting = Vec::new();
        for round in 0..256 {
            for (streams, f, counters) in &mut work {
                let i = round % 4;
                // SAFETY: count_launch(unsigned long long*) on a live counter.
                unsafe { streams[i].launch(f, cfg, (&mut counters[i],)) }.unwrap();
                waiting.push(tokio::spawn(streams[i].done()));
            }
        }
        for w in waiting {
            w.await.unwrap().unwrap();
        }
    });
    for (d, (streams, _, counters)) in work.iter().enumerate() {
        for (s, c) in streams.iter().zip(counters) {
            assert_eq!(s.to_vec(c).unwrap(), [64], "device {d}");
        }
    }
}

/// Soundness item 1: a stream-ordered buffer of device 0 read by a peer copy on a
/// stream of device 1, then dropped: the free waits for device 1's stream, so the
/// pool cannot hand the memory out again under the copy. A new allocation that
/// could reuse the address is filled at once; the copy's result must be the
/// original data.
fn a_stream_ordered_buffer_read_by_another_device_is_freed_after_the_read() {
    let (h0, h1) = (host(0).unwrap(), host(1).unwrap());
    let (s0, s1) = (CudaStream::new(&h0).unwrap(), CudaStream::new(&h1).unwrap());
    let n = 64 << 20;
    let values: Vec<u32> = (0..n as u32).map(|i| i ^ 0x5a5a_5a5a).collect();
    for round in 0..4 {
        let mut src = s0.alloc::<u32>(n).unwrap();
        s0.copy_h2d(&values, &mut src).unwrap();
        let mut dst = DeviceBuffer::<u32>::alloc(&h1, n).unwrap();
        s1.copy_peer(&src, &mut dst).unwrap();
        drop(src);
        let mut reuse = s0.alloc::<u32>(n).unwrap();
        s0.memset_u32(&mut reuse, 0xdead_beef).unwrap();
        let got = s1.to_vec(&dst).unwrap();
        assert!(
            got == values,
            "round {round}: the peer copy read freed memory"
        );
        drop(reuse);
    }
}

/// Soundness item 2: `host_slice` of a managed buffer written by a peer copy on
/// device 1's stream sees the copy's data (it waited for that stream).
fn managed_host_slice_waits_for_a_peer_copy() {
    let (h0, h1) = (host(0).unwrap(), host(1).unwrap());
    let s1 = CudaStream::new(&h1).unwrap();
    let n = 32 << 20;
    let values: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(7)).collect();
    let src = DeviceBuffer::from_host(&s1, &values).unwrap();
    let mut m = ManagedBuffer::<u32>::zeroed(&h0, n).unwrap();
    s1.copy_peer(&src, &mut m).unwrap();
    let host = m.host_slice().unwrap();
    assert!(
        host == &values[..],
        "host_slice returned before the peer copy landed"
    );
}

/// Two ranks on two GPUs, one thread each (`init_rank`): every collective's
/// results, send and receive, and a split.
#[cfg(feature = "nccl")]
fn nccl_two_ranks_on_two_threads() {
    use metrale_runtime::nccl::{CommConfig, Communicator, NcclId, ReduceOp};
    let id = NcclId::new().unwrap();
    let text = id.to_string();
    let handles: Vec<_> = (0..2usize)
        .map(|rank| {
            let text = text.clone();
            std::thread::spawn(move || {
                let id: NcclId = text.parse().unwrap();
                let ctx = context(rank).unwrap();
                let s = CudaStream::new(&ctx).unwrap();
                let comm = Communicator::init_rank(&id, 2, rank, &ctx, &CommConfig::new()).unwrap();
                let n = 1 << 22;
                let r = rank as f32;
                let send = DeviceBuffer::from_host(&s, &vec![r + 1.0; n]).unwrap();
                let mut recv = DeviceBuffer::<f32>::zeroed(&s, n).unwrap();
                comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
                    .unwrap();
                assert!(s.to_vec(&recv).unwrap().iter().all(|&v| v == 3.0));
                let mut all = DeviceBuffer::<f32>::zeroed(&s, 2 * n).unwrap();
                comm.all_gather(&send, &mut all, &s).unwrap();
                let all = s.to_vec(&all).unwrap();
                assert!(all[..n].iter().all(|&v| v == 1.0) && all[n..].iter().all(|&v| v == 2.0));
                let blocks = DeviceBuffer::from_host(&s, &[1.0f32 + r, 10.0 + r]).unwrap();
                let mut part = DeviceBuffer::<f32>::zeroed(&s, 1).unwrap();
                comm.reduce_scatter(&blocks, &mut part, ReduceOp::Sum, &s)
                    .unwrap();
                let want = if rank == 0 { 3.0 } else { 21.0 };
                assert_eq!(s.to_vec(&part).unwrap(), vec![want]);
                let mut b = DeviceBuffer::from_host(&s, &[r; 16]).unwrap();
                comm.broadcast_in_place(&mut b, 1, &s).unwrap();
                assert_eq!(s.to_vec(&b).unwrap(), vec![1.0; 16]);
                let mut p = DeviceBuffer::from_host(&s, &[7 + rank as u64; 8]).unwrap();
                metrale_runtime::nccl::group(&[&comm], || {
                    if rank == 0 {
                        comm.send(&p, 1, &s)
                    } else {
                        comm.recv(&mut p, 0, &s)
                    }
                })
                .unwrap();
                assert_eq!(s.to_vec(&p).unwrap(), vec![7; 8]);
                let other = CudaStream::new(&context(1 - rank).unwrap()).unwrap();
                let far = DeviceBuffer::<f32>::zeroed(&other, 4).unwrap();
                let mut near = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
                let e = comm
                    .all_reduce(&far, &mut near, ReduceOp::Sum, &s)
                    .unwrap_err();
                assert!(
                    e.to_string().contains("the send buffer is on device"),
                    "{e}"
                );
                let swapped = comm
                    .split(Some(0), 1 - rank as i32, &CommConfig::new())
                    .unwrap()
                    .unwrap();
                assert_eq!((swapped.rank(), swapped.size()), (1 - rank, 2));
                comm.wait(&s, std::time::Duration::from_secs(30)).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// One thread drives both GPUs (`init_all` and a group).
#[cfg(feature = "nccl")]
fn nccl_one_thread_two_gpus_in_a_group() {
    use metrale_runtime::nccl::{group, Communicator, ReduceOp};
    let ctxs = [context(0).unwrap(), context(1).unwrap()];
    let comms = Communicator::init_all(&ctxs).unwrap();
    let streams = [
        CudaStream::new(&ctxs[0]).unwrap(),
        CudaStream::new(&ctxs[1]).unwrap(),
    ];
    let n = 1 << 20;
    let mut bufs = [
        DeviceBuffer::from_host(&streams[0], &vec![1i64; n]).unwrap(),
        DeviceBuffer::from_host(&streams[1], &vec![2i64; n]).unwrap(),
    ];
    let listed: Vec<&Communicator> = comms.iter().collect();
    group(&listed, || {
        for ((c, b), s) in comms.iter().zip(bufs.iter_mut()).zip(&streams) {
            c.all_reduce_in_place(b, ReduceOp::Sum, s)?;
        }
        Ok(())
    })
    .unwrap();
    for (b, s) in bufs.iter().zip(&streams) {
        assert!(s.to_vec(b).unwrap().iter().all(|&v| v == 3));
    }
}

/// In a child (aborted NCCL kernels must not touch the suite's contexts): one
/// thread drives both GPUs; a collective whose count disagrees with the other
/// rank's is refused before NCCL, both ranks are aborted when the group ends
/// (the first rank's collective was launched without its peer), within
/// bounds; an abort asked for inside a group runs after its end; a fresh
/// `init_all` then works (issue 29, items 2 and 6, on the real library).
#[cfg(feature = "nccl")]
fn child_nccl_disagreeing_ranks() {
    use metrale_runtime::nccl::{group, Communicator, ReduceOp};
    use std::time::Duration;
    let ctxs = [context(0).unwrap(), context(1).unwrap()];
    let streams = [
        CudaStream::new(&ctxs[0]).unwrap(),
        CudaStream::new(&ctxs[1]).unwrap(),
    ];
    let n = 1 << 20;
    let mut a = DeviceBuffer::from_host(&streams[0], &vec![1i64; n]).unwrap();
    let mut short = DeviceBuffer::from_host(&streams[1], &vec![2i64; n - 1]).unwrap();
    let comms = Communicator::init_all(&ctxs).unwrap();
    let listed: Vec<&Communicator> = comms.iter().collect();
    let t = Instant::now();
    let e = group(&listed, || {
        comms[0].all_reduce_in_place(&mut a, ReduceOp::Sum, &streams[0])?;
        comms[1].all_reduce_in_place(&mut short, ReduceOp::Sum, &streams[1])
    })
    .unwrap_err();
    let took = t.elapsed();
    assert!(e.to_string().contains("disagree"), "{e}");
    assert!(comms.iter().all(Communicator::is_aborted));
    // Each abort waits at most 200 ms for NCCL (whose abort may wait for the
    // lone collective's kernel), then goes on alone.
    assert!(took < Duration::from_secs(2), "the group took {took:?}");
    println!("disagreement refused, both aborted after {took:?}");
    drop(comms);

    // An abort inside a group, after both ranks' collectives were queued.
    let mut b = DeviceBuffer::from_host(&streams[1], &vec![2i64; n]).unwrap();
    let comms = Communicator::init_all(&ctxs).unwrap();
    let listed: Vec<&Communicator> = comms.iter().collect();
    group(&listed, || {
        comms[0].all_reduce_in_place(&mut a, ReduceOp::Sum, &streams[0])?;
        comms[1].all_reduce_in_place(&mut b, ReduceOp::Sum, &streams[1])?;
        comms[0].abort();
        assert!(comms[0].is_aborted());
        Ok(())
    })
    .unwrap();
    let waited = comms[1].wait(&streams[1], Duration::from_secs(3));
    println!("abort deferred to the group's end; the peer's wait: {waited:?}");
    drop(comms);
    for s in &streams {
        if let Err(e) = s.synchronize() {
            println!("stream after the aborts: {e}");
            return;
        }
    }

    // A fresh pair works.
    let comms = Communicator::init_all(&ctxs).unwrap();
    let mut x = DeviceBuffer::from_host(&streams[0], &vec![1i64; n]).unwrap();
    let mut y = DeviceBuffer::from_host(&streams[1], &vec![2i64; n]).unwrap();
    let listed: Vec<&Communicator> = comms.iter().collect();
    group(&listed, || {
        comms[0].all_reduce_in_place(&mut x, ReduceOp::Sum, &streams[0])?;
        comms[1].all_reduce_in_place(&mut y, ReduceOp::Sum, &streams[1])
    })
    .unwrap();
    assert!(streams[0].to_vec(&x).unwrap().iter().all(|&v| v == 3));
    assert!(streams[1].to_vec(&y).unwrap().iter().all(|&v| v == 3));
    println!("a fresh pair: ok");
    std::thread::sleep(Duration::from_millis(500)); // helpers still finishing
}

#[cfg(feature = "nccl")]
fn nccl_disagreeing_ranks_in_a_group_are_refused_and_aborted() {
    let out = harness::run_child("nccl_disagreeing_ranks", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("    child: {}", stdout.trim().replace('\n', "; "));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("disagreement refused, both aborted"),
        "{stdout}{stderr}"
    );
    assert!(
        stdout.contains("abort deferred to the group's end"),
        "{stdout}{stderr}"
    );
}

/// The rank and id a two-process NCCL child runs with.
#[cfg(feature = "nccl")]
fn nccl_child_rank() -> (usize, metrale_runtime::nccl::NcclId) {
    let rank = std::env::var("METRALE_TEST_RANK").unwrap().parse().unwrap();
    let id = std::env::var("METRALE_TEST_NCCL_ID")
        .unwrap()
        .parse()
        .unwrap();
    (rank, id)
}

/// Run `scenario` as two child processes, rank 0 and 1, sharing a new id;
/// each one's (success, stdout + stderr).
#[cfg(feature = "nccl")]
fn two_processes(scenario: &'static str) -> Vec<(bool, String)> {
    let id = metrale_runtime::nccl::NcclId::new().unwrap().to_string();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let id = id.clone();
            std::thread::spawn(move || {
                let rank = rank.to_string();
                let out = harness::run_child(
                    scenario,
                    &[("METRALE_TEST_RANK", &rank), ("METRALE_TEST_NCCL_ID", &id)],
                );
                (
                    out.status.success(),
                    format!(
                        "{}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    ),
                )
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// One rank of the two-process window all-reduce.
#[cfg(feature = "nccl")]
fn child_nccl_window_rank() {
    use metrale_runtime::nccl::{CommConfig, Communicator, NcclBuffer, ReduceOp, WindowFlags};
    let (rank, id) = nccl_child_rank();
    let ctx = context(rank).unwrap();
    let s = CudaStream::new(&ctx).unwrap();
    let comm = Communicator::init_rank(&id, 2, rank, &ctx, &CommConfig::new()).unwrap();
    for n in [2usize, 1 << 10, 1 << 18] {
        let mut buf = NcclBuffer::<f32>::alloc(&ctx, n).unwrap();
        let mut win = comm
            .register_window(&mut buf, WindowFlags::COLL_SYMMETRIC)
            .unwrap();
        let host: Vec<f32> = (0..n).map(|i| (i % 100) as f32 + rank as f32).collect();
        s.copy_h2d(&host, &mut *win).unwrap();
        comm.all_reduce_in_place(&mut win, ReduceOp::Sum, &s)
            .unwrap();
        comm.wait(&s, std::time::Duration::from_secs(60)).unwrap();
        let got = s.to_vec(&win.as_slice()).unwrap();
        assert!(
            (0..n).all(|i| got[i] == 2.0 * (i % 100) as f32 + 1.0),
            "window all-reduce of {n} on rank {rank}"
        );
        drop(win);
    }
    println!("rank {rank}: window all-reduces exact");
}

/// A window all-reduce across two processes, one GPU each.
#[cfg(feature = "nccl")]
fn nccl_window_all_reduce_across_two_processes() {
    for (rank, (ok, out)) in two_processes("nccl_window_rank").into_iter().enumerate() {
        assert!(ok, "rank {rank}: {out}");
        assert!(
            out.contains("window all-reduces exact"),
            "rank {rank}: {out}"
        );
    }
}

/// One rank of the shrink after a killed rank: rank 1 dies (its process
/// exits) while rank 0's all-reduce waits for it; rank 0 revokes through the
/// bounded wait, shrinks to itself and finishes an all-reduce alone.
#[cfg(feature = "nccl")]
fn child_nccl_shrink_rank() {
    use metrale_runtime::nccl::{CommConfig, Communicator, OnFailure, ReduceOp};
    use std::time::Duration;
    let (rank, id) = nccl_child_rank();
    let ctx = context(rank).unwrap();
    let s = CudaStream::new(&ctx).unwrap();
    let comm = Communicator::init_rank(&id, 2, rank, &ctx, &CommConfig::new()).unwrap();
    let mut b = DeviceBuffer::from_host(&s, &[1.0f32; 256]).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    comm.wait(&s, Duration::from_secs(60)).unwrap();
    if rank == 1 {
        // Killed: gone without a word to NCCL.
        std::process::exit(0);
    }
    std::thread::sleep(Duration::from_millis(500));
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    let e = comm
        .wait_with(&s, Duration::from_secs(10), OnFailure::Revoke)
        .unwrap_err();
    println!("rank 0: wait failed: {e}");
    assert!(comm.is_revoked(), "{e}");
    let alone = comm.shrink(&[1], &CommConfig::new()).unwrap();
    assert_eq!((alone.rank(), alone.size()), (0, 1));
    let mut c = DeviceBuffer::from_host(&s, &[3.0f32; 256]).unwrap();
    alone
        .all_reduce_in_place(&mut c, ReduceOp::Sum, &s)
        .unwrap();
    alone.wait(&s, Duration::from_secs(60)).unwrap();
    assert_eq!(s.to_vec(&c).unwrap(), vec![3.0f32; 256]);
    println!("rank 0: shrunk and finished alone");
}

/// Shrink after a killed rank, two processes on two GPUs.
#[cfg(feature = "nccl")]
fn nccl_shrink_after_a_killed_rank() {
    let out = two_processes("nccl_shrink_rank");
    assert!(out[0].0, "rank 0: {}", out[0].1);
    assert!(
        out[0].1.contains("shrunk and finished alone"),
        "{}",
        out[0].1
    );
    assert!(out[1].0, "rank 1: {}", out[1].1);
}

fn main() -> ExitCode {
    let tests = [
        #[cfg(feature = "nccl")]
        Test {
            name: "multi::nccl_window_all_reduce_across_two_processes",
            run: nccl_window_all_reduce_across_two_processes,
        },
        #[cfg(feature = "nccl")]
        Test {
            name: "multi::nccl_shrink_after_a_killed_rank",
            run: nccl_shrink_after_a_killed_rank,
        },
        #[cfg(feature = "nccl")]
        Test {
            name: "multi::nccl_two_ranks_on_two_threads",
            run: nccl_two_ranks_on_two_threads,
        },
        #[cfg(feature = "nccl")]
        Test {
            name: "multi::nccl_one_thread_two_gpus_in_a_group",
            run: nccl_one_thread_two_gpus_in_a_group,
        },
        #[cfg(feature = "nccl")]
        Test {
            name: "multi::nccl_disagreeing_ranks_in_a_group_are_refused_and_aborted",
            run: nccl_disagreeing_ranks_in_a_group_are_refused_and_aborted,
        },
        Test {
            name: "multi::a_stream_ordered_buffer_read_by_another_device_is_freed_after_the_read",
            run: a_stream_ordered_buffer_read_by_another_device_is_freed_after_the_read,
        },
        Test {
            name: "multi::managed_host_slice_waits_for_a_peer_copy",
            run: managed_host_slice_waits_for_a_peer_copy,
        },
        Test {
            name: "multi::futures_of_two_devices_under_tokio",
            run: futures_of_two_devices_under_tokio,
        },
        Test {
            name: "multi::one_model_loaded_once_runs_on_both_devices",
            run: one_model_loaded_once_runs_on_both_devices,
        },
        Test {
            name: "multi::peer_copy_round_trip_of_1_gib",
            run: peer_copy_round_trip_of_1_gib,
        },
        Test {
            name: "multi::a_kernel_on_device_1_reads_device_0_memory",
            run: a_kernel_on_device_1_reads_device_0_memory,
        },
        Test {
            name: "multi::two_threads_each_launch_100000_kernels_on_their_device",
            run: two_threads_each_launch_100000_kernels_on_their_device,
        },
    ];
    let gate = || match device_count() {
        Ok(n) if n >= 2 => Ok(()),
        Ok(n) => Err(format!(
            "needs two CUDA devices of one host; the driver reports {n}"
        )),
        Err(e) => Err(format!(
            "needs two CUDA devices of one host; the driver could not count them: {e}"
        )),
    };
    let require = std::env::var("METRALE_REQUIRE_GPUS").is_ok_and(|v| v == "2");
    let children = [
        #[cfg(feature = "nccl")]
        harness::Child {
            name: "nccl_disagreeing_ranks",
            run: child_nccl_disagreeing_ranks,
        },
        #[cfg(feature = "nccl")]
        harness::Child {
            name: "nccl_window_rank",
            run: child_nccl_window_rank,
        },
        #[cfg(feature = "nccl")]
        harness::Child {
            name: "nccl_shrink_rank",
            run: child_nccl_shrink_rank,
        },
    ];
    harness::main(
        &tests,
        &children,
        gate,
        require.then_some("METRALE_REQUIRE_GPUS=2"),
    )
}
