//! NCCL buffers, registrations, windows, all-to-all / gather / scatter and
//! pre-multiplied sums on the real library, one rank on device 0: every new
//! collective exact, registered and not, in and out of a graph capture
//! (replayed), a symmetric-window all-reduce, registration refused inside a
//! capture, and revoke, shrink and the scalable init on one rank.

use metrale_runtime::nccl::{
    nccl_version, CommConfig, Communicator, NcclBuffer, NcclError, NcclId, PreMulSum, ReduceOp,
    WindowFlags,
};

use crate::common::*;
use crate::harness::Test;

fn one_rank() -> (Communicator, CudaStream) {
    let ctx = context(0).unwrap();
    let id = NcclId::new().unwrap();
    let comm = Communicator::init_rank(&id, 1, 0, &ctx, &CommConfig::new()).unwrap();
    (comm, CudaStream::new(&ctx).unwrap())
}

fn at_least(v: (u32, u32, u32)) -> bool {
    nccl_version()
        .unwrap()
        .is_some_and(|have| have >= Version::from(v))
}

/// All-to-all, gather, scatter and both pre-multiplied sums on one rank over
/// `send` into `recv` (each `n` elements), checked against `host`.
fn new_collectives(
    comm: &Communicator,
    s: &CudaStream,
    send: &mut impl DeviceMemoryMut<f32>,
    recv: &mut impl DeviceMemoryMut<f32>,
    host: &[f32],
) {
    let half: Vec<f32> = host.iter().map(|v| v * 0.5).collect();
    let scalar = DeviceBuffer::from_host(s, &[0.5f32]).unwrap();
    let mean = PreMulSum::host(comm, 0.5f32).unwrap();
    let scaled = PreMulSum::device(comm, &scalar).unwrap();
    s.copy_h2d(host, &mut *send).unwrap();
    for (name, step) in [
        ("all_to_all", 0),
        ("gather", 1),
        ("scatter", 2),
        ("premul host", 3),
        ("premul device", 4),
    ] {
        s.memset_u8(&mut *recv, 0).unwrap();
        match step {
            0 => comm.all_to_all(&*send, &mut *recv, s),
            1 => comm.gather(&*send, &mut *recv, 0, s),
            2 => comm.scatter(&*send, &mut *recv, 0, s),
            3 => comm.all_reduce(&*send, &mut *recv, &mean, s),
            _ => comm.all_reduce(&*send, &mut *recv, &scaled, s),
        }
        .unwrap();
        let got = s.to_vec(&*recv).unwrap();
        let want = if step >= 3 { &half[..] } else { host };
        assert!(got == want, "{name} of {}", host.len());
    }
}

fn every_new_collective_exact_registered_and_not() {
    if !at_least((2, 28, 0)) {
        eprintln!("    skipped: all-to-all, gather and scatter need NCCL 2.28");
        return;
    }
    let (comm, s) = one_rank();
    for n in [1usize, 1000, 1 << 20] {
        let host: Vec<f32> = (0..n).map(|i| (i % 4096) as f32).collect();
        let mut send = DeviceBuffer::<f32>::zeroed(&s, n).unwrap();
        let mut recv = DeviceBuffer::<f32>::zeroed(&s, n).unwrap();
        new_collectives(&comm, &s, &mut send, &mut recv, &host);
        let mut a = NcclBuffer::<f32>::alloc(comm.context(), n).unwrap();
        let mut b = NcclBuffer::<f32>::alloc(comm.context(), n).unwrap();
        let mut ra = comm.register(&mut a).unwrap();
        let mut rb = comm.register(&mut b).unwrap();
        new_collectives(&comm, &s, &mut ra, &mut rb, &host);
        drop((ra, rb));
    }
    // Checked before NCCL on the real library too.
    let mut a = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let b = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    let e = comm.gather(&b, &mut a, 1, &s).unwrap_err();
    assert!(
        matches!(e.as_nccl(), Some(NcclError::Refused { .. })),
        "{e}"
    );
}

fn new_collectives_in_a_graph_capture_replay() {
    if !at_least((2, 28, 0)) {
        eprintln!("    skipped: all-to-all, gather and scatter need NCCL 2.28");
        return;
    }
    let (comm, s) = one_rank();
    let n = 1 << 16;
    let mut a = NcclBuffer::<f32>::alloc(comm.context(), n).unwrap();
    let mut b = NcclBuffer::<f32>::alloc(comm.context(), n).unwrap();
    let mut c = DeviceBuffer::<f32>::zeroed(&s, n).unwrap();
    let mut d = DeviceBuffer::<f32>::zeroed(&s, n).unwrap();
    let mut ra = comm.register(&mut a).unwrap();
    let mut rb = comm.register(&mut b).unwrap();
    let mean = PreMulSum::host(&comm, 0.5f32).unwrap();
    let graph = s
        .capture(|cs| -> Result<()> {
            comm.all_to_all(&ra, &mut rb, cs)?;
            comm.gather(&rb, &mut c, 0, cs)?;
            comm.scatter(&c, &mut d, 0, cs)?;
            comm.all_reduce_in_place(&mut d, &mean, cs)?;
            Ok(())
        })
        .unwrap();
    let exec = graph.instantiate().unwrap();
    for round in 1..=3u32 {
        let host: Vec<f32> = (0..n)
            .map(|i| ((i % 512) * round as usize) as f32)
            .collect();
        s.copy_h2d(&host, &mut *ra).unwrap();
        // SAFETY: the captured buffers, guards and operation are alive and not
        // used elsewhere while the replay runs (synchronised below).
        unsafe { exec.launch(&s) }.unwrap();
        s.synchronize().unwrap();
        assert!(
            s.to_vec(&rb.as_slice()).unwrap() == host,
            "replay {round}: all_to_all"
        );
        assert!(s.to_vec(&c).unwrap() == host, "replay {round}: gather");
        let half: Vec<f32> = host.iter().map(|v| v * 0.5).collect();
        assert!(
            s.to_vec(&d).unwrap() == half,
            "replay {round}: scatter, premul"
        );
    }
    drop(exec);
    // Registration is refused inside a capture.
    let mut e_buf = NcclBuffer::<f32>::alloc(comm.context(), 16).unwrap();
    let other = CudaStream::new(comm.context()).unwrap();
    let graph = other
        .capture(|_cs| -> Result<()> {
            let e = comm.register(&mut e_buf).unwrap_err();
            assert!(
                e.to_string().contains("during a graph capture is refused"),
                "{e}"
            );
            Ok(())
        })
        .unwrap();
    drop(graph);
}

fn a_symmetric_window_all_reduce() {
    let (comm, s) = one_rank();
    let n = 1 << 18;
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), n).unwrap();
    if !at_least((2, 27, 0)) {
        let e = comm
            .register_window(&mut buf, WindowFlags::COLL_SYMMETRIC)
            .unwrap_err();
        assert!(
            matches!(e.as_nccl(), Some(NcclError::Unsupported { .. })),
            "{e}"
        );
        return;
    }
    let host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let mut win = comm
        .register_window(&mut buf, WindowFlags::COLL_SYMMETRIC)
        .unwrap();
    s.copy_h2d(&host, &mut *win).unwrap();
    comm.all_reduce_in_place(&mut win, ReduceOp::Sum, &s)
        .unwrap();
    assert!(
        s.to_vec(&win.as_slice()).unwrap() == host,
        "window all_reduce"
    );
    let graph = s
        .capture(|cs| comm.all_reduce_in_place(&mut win, ReduceOp::Max, cs))
        .unwrap();
    let exec = graph.instantiate().unwrap();
    // SAFETY: the window's buffer is alive and not used elsewhere meanwhile.
    unsafe { exec.launch(&s) }.unwrap();
    s.synchronize().unwrap();
    assert!(
        s.to_vec(&win.as_slice()).unwrap() == host,
        "window all_reduce replayed"
    );
    drop(exec);
    win.deregister().map_err(|(_, e)| e).unwrap();
    assert_eq!(comm.registered_bytes(), 0);
}

fn revoke_shrink_and_a_scalable_init_on_one_rank() {
    let ctx = context(0).unwrap();
    let ids = [NcclId::new().unwrap(), NcclId::new().unwrap()];
    // Two ids for one rank: refused before NCCL (which refuses it too).
    let e = Communicator::init_rank_scalable(&ids, 1, 0, &ctx, &CommConfig::new()).unwrap_err();
    assert!(e.to_string().contains("at most one id per rank"), "{e}");
    let comm = Communicator::init_rank_scalable(&ids[..1], 1, 0, &ctx, &CommConfig::new()).unwrap();
    let s = CudaStream::new(&ctx).unwrap();
    let mut b = DeviceBuffer::from_host(&s, &[1.0f32, 2.0, 3.0]).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    assert_eq!(s.to_vec(&b).unwrap(), [1.0, 2.0, 3.0]);
    if !at_least((2, 28, 0)) {
        let e = comm.revoke().unwrap_err();
        assert!(
            matches!(e.as_nccl(), Some(NcclError::Unsupported { .. })),
            "{e}"
        );
        return;
    }
    // NCCL 2.28.3 (this machine's) lacks ncclCommRevoke, which later 2.28
    // releases export: then the call is the typed missing-symbol error and
    // the communicator stays usable.
    match comm.revoke() {
        Ok(()) => {
            assert!(comm.is_revoked());
            let e = comm
                .all_reduce_in_place(&mut b, ReduceOp::Sum, &s)
                .unwrap_err();
            assert!(
                matches!(e.as_nccl(), Some(NcclError::Revoked { .. })),
                "{e}"
            );
        }
        Err(e) => {
            assert!(
                e.to_string().contains("does not export `ncclCommRevoke`"),
                "{e}"
            );
            eprintln!("    revoke: {e}");
            assert!(!comm.is_revoked());
            comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
        }
    }
    // On one rank there is nothing to shrink away: an empty list is refused
    // before NCCL (which answers ncclInvalidArgument), and so is this rank;
    // the two-rank test shrinks for real.
    let e = comm.shrink(&[], &CommConfig::new()).unwrap_err();
    assert!(e.to_string().contains("no rank to exclude"), "{e}");
    let e = comm.shrink(&[0], &CommConfig::new()).unwrap_err();
    assert!(e.to_string().contains("this rank (0) is excluded"), "{e}");
    s.synchronize().unwrap();
    assert_eq!(s.to_vec(&b).unwrap(), [1.0, 2.0, 3.0]);
    drop(comm); // revoked (aborted) or not, bounded
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "nccl::revoke_shrink_and_a_scalable_init_on_one_rank",
            run: revoke_shrink_and_a_scalable_init_on_one_rank,
        },
        Test {
            name: "nccl::every_new_collective_exact_registered_and_not",
            run: every_new_collective_exact_registered_and_not,
        },
        Test {
            name: "nccl::new_collectives_in_a_graph_capture_replay",
            run: new_collectives_in_a_graph_capture_replay,
        },
        Test {
            name: "nccl::a_symmetric_window_all_reduce",
            run: a_symmetric_window_all_reduce,
        },
    ]
}
