//! NCCL on the real library, one rank on device 0 (feature `nccl`): every
//! collective exact for each data type and sizes from 1 element to 256 MiB,
//! inside and outside a graph capture; refusals; a non-blocking init; a bounded
//! wait behind a spinning kernel that aborts cleanly; a wait, an abort and a
//! drop that return within their bounds behind a kernel spinning longer than
//! those bounds (NCCL's abort, finalize and destroy wait for it).
//!
//! The library is found like any user's: `METRALE_LIBNCCL_PATH`, else
//! `libnccl.so.2`. Without it these tests fail with the loader's message.

use std::time::{Duration, Instant};

use metrale_runtime::nccl::{
    nccl_version, CommConfig, Communicator, NcclError, NcclId, NcclType, ReduceOp,
};

use crate::common::*;
use crate::harness::{run_child, Child, Test};

#[path = "nccl_buffers.rs"]
mod buffers;

fn one_rank(config: &CommConfig) -> (Communicator, CudaStream) {
    let v = nccl_version().unwrap();
    eprintln!("    NCCL {v:?}");
    let ctx = context(0).unwrap();
    let id = NcclId::new().unwrap();
    let comm = Communicator::init_rank(&id, 1, 0, &ctx, config).unwrap();
    (comm, CudaStream::new(&ctx).unwrap())
}

/// Every collective on one rank over `n` elements of `T`; each result exact.
fn every_collective<T>(comm: &Communicator, s: &CudaStream, n: usize, make: impl Fn(usize) -> T)
where
    T: NcclType + DevicePod + PartialEq + std::fmt::Debug,
{
    let host: Vec<T> = (0..n).map(&make).collect();
    let send = DeviceBuffer::from_host(s, &host).unwrap();
    let mut recv = DeviceBuffer::<T>::zeroed(s, n).unwrap();
    for op in [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ] {
        s.memset_u8(&mut recv, 0).unwrap();
        comm.all_reduce(&send, &mut recv, op, s).unwrap();
        assert!(s.to_vec(&recv).unwrap() == host, "all_reduce {op:?} of {n}");
    }
    let mut inplace = DeviceBuffer::from_host(s, &host).unwrap();
    comm.all_reduce_in_place(&mut inplace, ReduceOp::Sum, s)
        .unwrap();
    assert!(
        s.to_vec(&inplace).unwrap() == host,
        "in-place all_reduce of {n}"
    );
    for (name, run) in [
        ("broadcast", 0),
        ("reduce", 1),
        ("all_gather", 2),
        ("reduce_scatter", 3),
    ] {
        s.memset_u8(&mut recv, 0).unwrap();
        match run {
            0 => comm.broadcast(&send, &mut recv, 0, s),
            1 => comm.reduce(&send, &mut recv, ReduceOp::Max, 0, s),
            2 => comm.all_gather(&send, &mut recv, s),
            _ => comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum, s),
        }
        .unwrap();
        assert!(s.to_vec(&recv).unwrap() == host, "{name} of {n}");
    }
    comm.broadcast_in_place(&mut inplace, 0, s).unwrap();
    comm.reduce_in_place(&mut inplace, ReduceOp::Min, 0, s)
        .unwrap();
    assert!(
        s.to_vec(&inplace).unwrap() == host,
        "in-place broadcast/reduce of {n}"
    );
}

fn every_collective_every_type_one_rank() {
    let (comm, s) = one_rank(&CommConfig::new());
    for n in [1usize, 7, 1000, 1 << 16] {
        every_collective(&comm, &s, n, |i| (i % 100) as f32 - 50.0);
        every_collective(&comm, &s, n, |i| (i % 100) as f64 * 0.25);
        every_collective(&comm, &s, n, |i| (i % 100) as i8 - 50);
        every_collective(&comm, &s, n, |i| (i % 200) as u8);
        every_collective(&comm, &s, n, |i| (i as i32 % 1000) - 500);
        every_collective(&comm, &s, n, |i| i as u32);
        every_collective(&comm, &s, n, |i| i as i64 - (1 << 40));
        every_collective(&comm, &s, n, |i| (i as u64) << 20);
        #[cfg(feature = "half")]
        {
            every_collective(&comm, &s, n, |i| half::f16::from_f32((i % 100) as f32));
            every_collective(&comm, &s, n, |i| half::bf16::from_f32((i % 100) as f32));
        }
    }
}

fn sizes_up_to_256_mib() {
    let (comm, s) = one_rank(&CommConfig::new());
    for bytes in [4usize, 4 << 10, 4 << 20, 64 << 20, 256 << 20] {
        let n = bytes / 4;
        let host: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let send = DeviceBuffer::from_host(&s, &host).unwrap();
        let mut recv = DeviceBuffer::<u32>::zeroed(&s, n).unwrap();
        let t = Instant::now();
        comm.all_reduce(&send, &mut recv, ReduceOp::Sum, &s)
            .unwrap();
        s.synchronize().unwrap();
        let took = t.elapsed();
        assert!(
            s.to_vec(&recv).unwrap() == host,
            "all_reduce of {bytes} bytes"
        );
        s.memset_u8(&mut recv, 0).unwrap();
        comm.all_gather(&send, &mut recv, &s).unwrap();
        assert!(
            s.to_vec(&recv).unwrap() == host,
            "all_gather of {bytes} bytes"
        );
        eprintln!("    {bytes} bytes: all_reduce {took:?}");
    }
}

fn collectives_in_a_graph_capture_replay() {
    let (comm, s) = one_rank(&CommConfig::new());
    let n = 1 << 20;
    let mut send = DeviceBuffer::<f32>::zeroed(&s, n).unwrap();
    let mut recv = DeviceBuffer::<f32>::zeroed(&s, n).unwrap();
    let mut gathered = DeviceBuffer::<f32>::zeroed(&s, n).unwrap();
    let graph = s
        .capture(|cs| -> Result<()> {
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum, cs)?;
            comm.all_gather(&recv, &mut gathered, cs)?;
            Ok(())
        })
        .unwrap();
    let exec = graph.instantiate().unwrap();
    for round in 1..=3u32 {
        let host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * round as f32).collect();
        s.copy_h2d(&host, &mut send).unwrap();
        // SAFETY: the captured buffers are alive and not borrowed elsewhere.
        unsafe { exec.launch(&s) }.unwrap();
        s.synchronize().unwrap();
        assert!(
            s.to_vec(&recv).unwrap() == host,
            "replay {round}: all_reduce"
        );
        assert!(
            s.to_vec(&gathered).unwrap() == host,
            "replay {round}: all_gather"
        );
    }
    // 100 small all-reduces in one graph.
    let mut small = DeviceBuffer::from_host(&s, &[1.0f32, 2.0]).unwrap();
    let graph = s
        .capture(|cs| -> Result<()> {
            for _ in 0..100 {
                comm.all_reduce_in_place(&mut small, ReduceOp::Max, cs)?;
            }
            Ok(())
        })
        .unwrap();
    let exec = graph.instantiate().unwrap();
    // SAFETY: `small` is alive.
    unsafe { exec.launch(&s) }.unwrap();
    assert_eq!(s.to_vec(&small).unwrap(), vec![1.0, 2.0]);
}

fn wrong_lengths_and_roots_are_refused() {
    let (comm, s) = one_rank(&CommConfig::new());
    let four = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let mut three = DeviceBuffer::<f32>::zeroed(&s, 3).unwrap();
    let mut five = DeviceBuffer::<f32>::zeroed(&s, 5).unwrap();
    for e in [
        comm.all_reduce(&four, &mut three, ReduceOp::Sum, &s)
            .unwrap_err(),
        comm.all_gather(&four, &mut five, &s).unwrap_err(),
        comm.reduce_scatter(&four, &mut three, ReduceOp::Sum, &s)
            .unwrap_err(),
        comm.broadcast(&four, &mut three, 1, &s).unwrap_err(),
        comm.send(&four, 3, &s).unwrap_err(),
    ] {
        assert!(
            matches!(e.as_nccl(), Some(NcclError::Refused { .. })),
            "{e}"
        );
        assert!(e.to_string().contains("rank 0 of 1, device 0"), "{e}");
    }
    if device_count().unwrap() > 1 {
        let other = CudaStream::new(&context(1).unwrap()).unwrap();
        let far = DeviceBuffer::<f32>::zeroed(&other, 4).unwrap();
        let e = comm
            .all_reduce(&far, &mut five, ReduceOp::Sum, &s)
            .unwrap_err();
        assert!(
            e.to_string().contains("the send buffer is on device 1"),
            "{e}"
        );
        let e = comm
            .all_reduce_in_place(&mut five, ReduceOp::Sum, &other)
            .unwrap_err();
        assert!(e.to_string().contains("the stream is on device 1"), "{e}");
    }
    // The communicator still works.
    comm.all_reduce_in_place(&mut five, ReduceOp::Sum, &s)
        .unwrap();
    comm.wait(&s, Duration::from_secs(10)).unwrap();
}

fn a_non_blocking_init_completes() {
    let config = CommConfig::new()
        .blocking(false)
        .timeout(Duration::from_secs(60));
    let (comm, s) = one_rank(&config);
    assert!(!comm.is_blocking());
    let mut b = DeviceBuffer::from_host(&s, &[3i32; 1000]).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    comm.wait(&s, Duration::from_secs(10)).unwrap();
    assert_eq!(s.to_vec(&b).unwrap(), vec![3; 1000]);
    comm.check_async().unwrap();
    // Splitting a non-blocking communicator is refused: NCCL 2.28.3 writes the
    // new handle after the call returns (seen on the H200: null at return).
    let e = comm.split(Some(0), 0, &CommConfig::new()).unwrap_err();
    assert!(
        e.to_string()
            .contains("splitting a non-blocking communicator"),
        "{e}"
    );
    // A blocking communicator splits, and a non-blocking split is refused.
    let (blocking, _s2) = one_rank(&CommConfig::new());
    let split = blocking
        .split(Some(0), 0, &CommConfig::new())
        .unwrap()
        .unwrap();
    assert_eq!((split.rank(), split.size()), (0, 1));
    let e = blocking
        .split(Some(0), 0, &CommConfig::new().blocking(false))
        .unwrap_err();
    assert!(e.to_string().contains("non-blocking split"), "{e}");
}

/// In a child process: NCCL's kernel queued behind the spin may still run after
/// the abort, and what it does then is NCCL's (a fault there must not take the
/// rest of the suite's context with it). The child prints what happened.
fn child_wait_times_out() {
    let reg = registry();
    let (comm, s) = one_rank(&CommConfig::new());
    let spin = reg.function("kernels", "spin").unwrap();
    let mut done = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    // Allocated before the spin: `zeroed` waits for the stream.
    let mut b = DeviceBuffer::<f32>::zeroed(&s, 1 << 20).unwrap();
    let cycles = cycles_per_ms(&reg) * 300;
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    // SAFETY: spin(unsigned long long, unsigned*) adds one to done[0].
    unsafe { s.launch(&spin, cfg, (cycles, &mut done)) }.unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    let t = Instant::now();
    let e = comm.wait(&s, Duration::from_millis(5)).unwrap_err();
    eprintln!("    {e} (after {:?})", t.elapsed());
    assert!(
        matches!(e.as_nccl(), Some(NcclError::Timeout { .. })),
        "{e}"
    );
    assert!(
        e.to_string().starts_with("ncclAllReduce had not completed"),
        "{e}"
    );
    assert!(comm.is_aborted());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the wait (and abort) was bounded"
    );
    println!("bounded wait and abort: ok after {:?}", t.elapsed());
    match s.synchronize() {
        Ok(()) => {
            assert_eq!(s.to_vec(&done).unwrap(), vec![1]);
            println!("stream after abort: drained");
            drop(comm);
            // A new communicator works after the abort.
            let (comm, s) = one_rank(&CommConfig::new());
            comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
            comm.wait(&s, Duration::from_secs(10)).unwrap();
            println!("a new communicator: ok");
        }
        Err(e) => println!("stream after abort: {e}"),
    }
}

fn a_wait_behind_a_spinning_kernel_times_out_and_aborts() {
    let out = run_child("nccl_wait_times_out", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("    child: {}", stdout.trim().replace('\n', "; "));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("bounded wait and abort: ok"),
        "{stdout}{stderr}"
    );
}

fn child_drop_pending() {
    let reg = registry();
    let (comm, s) = one_rank(&CommConfig::new().drop_timeout(Duration::from_millis(20)));
    let spin = reg.function("kernels", "spin").unwrap();
    let mut done = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    // Allocated before the spin: `zeroed` waits for the stream.
    let mut b = DeviceBuffer::<f32>::zeroed(&s, 1024).unwrap();
    let cycles = cycles_per_ms(&reg) * 300;
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    // SAFETY: spin(unsigned long long, unsigned*) adds one to done[0].
    unsafe { s.launch(&spin, cfg, (cycles, &mut done)) }.unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    let t = Instant::now();
    drop(comm); // one stderr line: aborted after 20 ms
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    println!("bounded drop: {:?}", t.elapsed());
    if let Err(e) = s.synchronize() {
        println!("stream after abort: {e}");
    }
}

fn drop_with_work_pending_is_bounded() {
    let out = run_child("nccl_drop_pending", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("    child: {}", stdout.trim().replace('\n', "; "));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("bounded drop: "), "{stdout}{stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("metrale: NCCL communicator"))
        .collect();
    // The drop's own line (aborted, or leaked to the helper thread whose abort
    // waits for the spin), and perhaps the helper's when it ends.
    assert!(!lines.is_empty() && lines.len() <= 2, "{stderr}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("aborted") || l.contains("leaked to a helper thread")),
        "{stderr}"
    );
}

/// The spin queued on `s` for `ms` milliseconds (one block, 32 threads).
fn spin_for(reg: &MetraleRegistry, s: &CudaStream, done: &mut DeviceBuffer<u32>, ms: u64) {
    let spin = reg.function("kernels", "spin").unwrap();
    let cycles = cycles_per_ms(reg) * ms;
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    // SAFETY: spin(unsigned long long, unsigned*) adds one to done[0].
    unsafe { s.launch(&spin, cfg, (cycles, done)) }.unwrap();
}

/// Give a helper thread still finishing NCCL's abort or teardown (after the
/// spin) time to end before the child exits.
fn let_helpers_finish() {
    std::thread::sleep(Duration::from_millis(1_000));
}

/// How long the spins behind the bounds run: longer than every bound below.
const LONG_SPIN_MS: u64 = 3_000;

/// In a child: a wait of 1 µs behind a collective queued after a 3 s spin
/// times out, and returns within its bound (the timeout plus 200 ms, and
/// slack), although NCCL's abort waits for the spin (issue 29, item 15).
fn child_wait_is_a_bound() {
    let reg = registry();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut done = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    let mut b = DeviceBuffer::<f32>::zeroed(&s, 1 << 10).unwrap();
    spin_for(&reg, &s, &mut done, LONG_SPIN_MS);
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    let t = Instant::now();
    let e = comm.wait(&s, Duration::from_micros(1)).unwrap_err();
    let took = t.elapsed();
    eprintln!("    {e} (after {took:?})");
    assert!(
        matches!(e.as_nccl(), Some(NcclError::Timeout { .. })),
        "{e}"
    );
    assert!(comm.is_aborted());
    assert!(
        took < Duration::from_millis(1_000),
        "wait(1µs) took {took:?}"
    );
    println!("bounded wait: ok after {took:?}");
    drop(comm);
    if let Err(e) = s.synchronize() {
        println!("stream after abort: {e}");
    }
    let_helpers_finish();
}

fn a_wait_is_a_bound_behind_a_longer_kernel() {
    let out = run_child("nccl_wait_is_a_bound", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("    child: {}", stdout.trim().replace('\n', "; "));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("bounded wait: ok"), "{stdout}{stderr}");
}

/// In a child: `abort()` of an idle communicator while a 3 s spin runs on
/// another stream of the device returns within the drop timeout (300 ms) plus
/// 200 ms, and slack.
fn child_abort_is_a_bound() {
    let reg = registry();
    let (comm, s) = one_rank(&CommConfig::new().drop_timeout(Duration::from_millis(300)));
    let other = CudaStream::new(comm.context()).unwrap();
    let mut done = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    let mut b = DeviceBuffer::<f32>::zeroed(&s, 1 << 10).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    comm.wait(&s, Duration::from_secs(10)).unwrap();
    spin_for(&reg, &other, &mut done, LONG_SPIN_MS);
    let t = Instant::now();
    comm.abort();
    let took = t.elapsed();
    assert!(comm.is_aborted());
    assert!(took < Duration::from_millis(1_500), "abort took {took:?}");
    println!("bounded abort: ok after {took:?}");
    drop(comm);
    if let Err(e) = other.synchronize() {
        println!("stream after abort: {e}");
    }
    let_helpers_finish();
}

fn an_abort_is_a_bound_behind_a_longer_kernel() {
    let out = run_child("nccl_abort_is_a_bound", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("    child: {}", stdout.trim().replace('\n', "; "));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("bounded abort: ok"), "{stdout}{stderr}");
}

/// In a child: dropping a communicator (drop timeout 300 ms) behind a 3 s
/// spin returns within the drop timeout plus 200 ms, and slack: with the
/// collective queued after the spin on its stream (`same`), or idle while the
/// spin runs on another stream of the device.
fn child_drop_is_a_bound(same: bool) {
    let reg = registry();
    let (comm, s) = one_rank(&CommConfig::new().drop_timeout(Duration::from_millis(300)));
    let other = CudaStream::new(comm.context()).unwrap();
    let mut done = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    let mut b = DeviceBuffer::<f32>::zeroed(&s, 1 << 10).unwrap();
    if same {
        spin_for(&reg, &s, &mut done, LONG_SPIN_MS);
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    } else {
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
        comm.wait(&s, Duration::from_secs(10)).unwrap();
        spin_for(&reg, &other, &mut done, LONG_SPIN_MS);
    }
    let t = Instant::now();
    drop(comm);
    let took = t.elapsed();
    assert!(took < Duration::from_millis(1_500), "drop took {took:?}");
    println!("bounded drop: ok after {took:?}");
    for st in [&s, &other] {
        if let Err(e) = st.synchronize() {
            println!("stream after drop: {e}");
        }
    }
    let_helpers_finish();
}

fn a_drop_is_a_bound_behind_a_longer_kernel() {
    for (child, what) in [
        ("nccl_drop_is_a_bound_same_stream", "same stream"),
        ("nccl_drop_is_a_bound_other_stream", "other stream"),
    ] {
        let out = run_child(child, &[]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("    {what}: {}", stdout.trim().replace('\n', "; "));
        assert!(out.status.success(), "{what}: {stdout}{stderr}");
        assert!(
            stdout.contains("bounded drop: ok"),
            "{what}: {stdout}{stderr}"
        );
        // Never silent when it had to abort or leak.
        if stderr.contains("metrale: NCCL communicator") {
            assert!(
                stderr.contains("aborted") || stderr.contains("leaked to a helper thread"),
                "{what}: {stderr}"
            );
        }
    }
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "nccl_wait_times_out",
            run: child_wait_times_out,
        },
        Child {
            name: "nccl_drop_pending",
            run: child_drop_pending,
        },
        Child {
            name: "nccl_wait_is_a_bound",
            run: child_wait_is_a_bound,
        },
        Child {
            name: "nccl_abort_is_a_bound",
            run: child_abort_is_a_bound,
        },
        Child {
            name: "nccl_drop_is_a_bound_same_stream",
            run: || child_drop_is_a_bound(true),
        },
        Child {
            name: "nccl_drop_is_a_bound_other_stream",
            run: || child_drop_is_a_bound(false),
        },
    ]
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "nccl::every_collective_every_type_one_rank",
            run: every_collective_every_type_one_rank,
        },
        Test {
            name: "nccl::sizes_up_to_256_mib",
            run: sizes_up_to_256_mib,
        },
        Test {
            name: "nccl::collectives_in_a_graph_capture_replay",
            run: collectives_in_a_graph_capture_replay,
        },
        Test {
            name: "nccl::wrong_lengths_and_roots_are_refused",
            run: wrong_lengths_and_roots_are_refused,
        },
        Test {
            name: "nccl::a_non_blocking_init_completes",
            run: a_non_blocking_init_completes,
        },
        Test {
            name: "nccl::a_wait_behind_a_spinning_kernel_times_out_and_aborts",
            run: a_wait_behind_a_spinning_kernel_times_out_and_aborts,
        },
        Test {
            name: "nccl::drop_with_work_pending_is_bounded",
            run: drop_with_work_pending_is_bounded,
        },
        Test {
            name: "nccl::a_wait_is_a_bound_behind_a_longer_kernel",
            run: a_wait_is_a_bound_behind_a_longer_kernel,
        },
        Test {
            name: "nccl::an_abort_is_a_bound_behind_a_longer_kernel",
            run: an_abort_is_a_bound_behind_a_longer_kernel,
        },
        Test {
            name: "nccl::a_drop_is_a_bound_behind_a_longer_kernel",
            run: a_drop_is_a_bound_behind_a_longer_kernel,
        },
    ]
    .into_iter()
    .chain(buffers::tests())
    .collect()
}
