//! Issue 34 items 1-3 against the stand-in NCCL: NCCL buffers, registrations
//! and windows (lifetimes in every drop order, refusals during a capture, the
//! registered-bytes bound, window collectives), all-to-all, gather and
//! scatter (results and every count and root check), pre-multiplied sums,
//! revoke and shrink after a dead rank, the scalable init, and the version
//! gates and missing symbols of an older NCCL.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use metrale_runtime::nccl::{
    CommConfig, Communicator, NcclBuffer, NcclError, NcclId, OnFailure, PreMulSum, ReduceOp,
    WindowFlags,
};
use metrale_runtime::{deferred_frees, CudaStream, DeviceBuffer, Result};

use super::{ctx, fake, group, harness, nccl, one_rank, refusal, reset, two_ranks};

/// Run `f(rank, comm, stream)` on `n` threads, rank r on device r % 2.
fn ranks<R: Send + 'static>(
    n: usize,
    f: impl Fn(usize, Communicator, CudaStream) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let id = NcclId::new().unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let f = Arc::clone(&f);
            std::thread::spawn(move || {
                let c = ctx(rank % 2);
                let comm = Communicator::init_rank(&id, n, rank, &c, &CommConfig::new()).unwrap();
                let s = CudaStream::new(&c).unwrap();
                f(rank, comm, s)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

// ---- NCCL buffers -------------------------------------------------------------

fn nccl_buffer_moves_data_and_frees_after_captures() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let before = nccl().mem_live();
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 8).unwrap();
    assert_eq!(nccl().mem_live(), before + 1);
    assert_eq!((buf.len(), buf.byte_len()), (8, 32));
    s.copy_h2d(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], &mut buf)
        .unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s)
        .unwrap();
    s.memset_u32(&mut buf.slice_mut(6..).unwrap(), 0).unwrap();
    assert_eq!(
        s.to_vec(&buf.as_slice()).unwrap(),
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]
    );
    assert_eq!(s.to_vec(&buf.slice(1..3).unwrap()).unwrap(), [2.0, 3.0]);
    assert!(buf.slice(7..9).is_err());
    // Dropped during a capture: deferred (its free synchronises), freed after.
    let frees = nccl().calls("ncclMemFree");
    let other = CudaStream::new(comm.context()).unwrap();
    let deferred = deferred_frees();
    let graph = other
        .capture(|_cs| -> Result<()> {
            drop(buf);
            assert_eq!(
                deferred_frees(),
                deferred + 1,
                "deferred during the capture"
            );
            Ok(())
        })
        .unwrap();
    drop(graph);
    assert_eq!(
        nccl().calls("ncclMemFree"),
        frees + 1,
        "freed after the capture"
    );
    assert_eq!(nccl().mem_live(), before);
    // Zero length: no allocation.
    let empty = NcclBuffer::<u8>::alloc(comm.context(), 0).unwrap();
    assert_eq!(empty.device_ptr(), 0);
    drop(empty);
    assert_eq!(nccl().mem_live(), before);
    // A failed allocation names the call, status and size.
    nccl().fail("ncclMemAlloc", 1, nccl().calls("ncclMemAlloc") + 1, Some(1));
    let e = NcclBuffer::<u8>::alloc(comm.context(), 100).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("ncclMemAlloc failed: ncclUnhandledCudaError (1): "),
        "{text}"
    );
    assert!(text.contains("allocating 100 bytes on device 0"), "{text}");
}

// ---- registrations --------------------------------------------------------------

/// What one drop order leaves: every registration deregistered, none left
/// for NCCL to release with a communicator.
fn check_clean(what: &str) {
    assert_eq!(nccl().registrations(), 0, "{what}: registrations left");
    assert_eq!(nccl().windows(), 0, "{what}: windows left");
    assert_eq!(
        nccl().orphaned_registrations(),
        0,
        "{what}: a registration outlived its communicator"
    );
}

fn registration_lifetimes_in_every_drop_order() {
    // Of the six orders of (guard, communicator, buffer), the four that drop
    // the communicator or the buffer before the guard do not compile (the
    // guard borrows both: `Registration`'s compile_fail examples). The two
    // that remain, and two guards in both orders, each deregistered once:
    for order in ["guard comm buffer", "guard buffer comm"] {
        reset();
        let (comm, _s) = one_rank(&CommConfig::new());
        let mut buf = NcclBuffer::<u32>::alloc(comm.context(), 64).unwrap();
        let reg = comm.register(&mut buf).unwrap();
        assert_eq!(nccl().registrations(), 1);
        assert_eq!(comm.registered_bytes(), 256);
        drop(reg);
        assert_eq!(comm.registered_bytes(), 0);
        if order == "guard comm buffer" {
            drop(comm);
            drop(buf);
        } else {
            drop(buf);
            drop(comm);
        }
        assert_eq!(nccl().calls("ncclCommDeregister"), 1, "{order}");
        check_clean(order);
        assert_eq!(nccl().mem_live(), 0, "{order}");
    }
    for first in [0, 1] {
        reset();
        let (comm, _s) = one_rank(&CommConfig::new());
        let mut a = NcclBuffer::<u8>::alloc(comm.context(), 16).unwrap();
        let mut b = NcclBuffer::<u8>::alloc(comm.context(), 32).unwrap();
        let ra = comm.register(&mut a).unwrap();
        let rb = comm.register_window(&mut b, WindowFlags::DEFAULT).unwrap();
        assert_eq!(comm.registered_bytes(), 48);
        assert_eq!((nccl().registrations(), nccl().windows()), (1, 1));
        if first == 0 {
            drop(ra);
            drop(rb);
        } else {
            drop(rb);
            drop(ra);
        }
        drop(comm);
        check_clean("two guards");
    }
    // Explicit deregistration, then Drop does nothing more.
    reset();
    let (comm, _s) = one_rank(&CommConfig::new());
    let mut buf = NcclBuffer::<u8>::alloc(comm.context(), 16).unwrap();
    comm.register(&mut buf).unwrap().deregister().unwrap();
    assert_eq!(nccl().calls("ncclCommDeregister"), 1);
    // An aborted communicator released its registrations itself: the guard
    // makes no call on the dangling handle.
    let reg = comm.register(&mut buf).unwrap();
    comm.abort();
    drop(reg);
    assert_eq!(nccl().calls("ncclCommDeregister"), 1);
    assert_eq!(nccl().registrations(), 0);
}

fn registration_is_refused_during_a_capture() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut a = NcclBuffer::<f32>::alloc(comm.context(), 16).unwrap();
    let mut b = NcclBuffer::<f32>::alloc(comm.context(), 16).unwrap();
    let reg = comm.register(&mut a).unwrap();
    let other = CudaStream::new(comm.context()).unwrap();
    let mut back = None;
    let graph = other
        .capture(|_cs| -> Result<()> {
            let e = comm.register(&mut b).unwrap_err();
            let text = refusal(&e);
            assert!(
                text.starts_with("ncclCommRegister not called (communicator rank 0 of 1, device 0): registering during a graph capture is refused"),
                "{text}"
            );
            let e = comm
                .register_window(&mut b, WindowFlags::COLL_SYMMETRIC)
                .unwrap_err();
            assert!(refusal(&e).contains("during a graph capture"), "{e}");
            let (guard, e) = reg.deregister().unwrap_err();
            assert!(refusal(&e).contains("deregistering during a graph capture"), "{e}");
            back = Some(guard);
            let e = NcclBuffer::<u8>::alloc(comm.context(), 8).unwrap_err();
            assert!(
                refusal(&e).contains("allocating while this thread captures a graph is refused"),
                "{e}"
            );
            Ok(())
        })
        .unwrap();
    drop(graph);
    assert_eq!(
        nccl().calls("ncclCommRegister"),
        1,
        "no refused call reached NCCL"
    );
    assert_eq!(nccl().calls("ncclCommWindowRegister"), 0);
    assert_eq!(nccl().calls("ncclCommDeregister"), 0);
    back.unwrap().deregister().unwrap();
    assert_eq!(nccl().registrations(), 0);
    // A guard dropped during a capture stays registered (one line on stderr);
    // NCCL releases it with the communicator.
    let dropped = comm.register(&mut b).unwrap();
    let graph = other
        .capture(|_cs| -> Result<()> {
            drop(dropped);
            Ok(())
        })
        .unwrap();
    drop(graph);
    assert_eq!(nccl().registrations(), 1);
    assert_eq!(
        comm.registered_bytes(),
        64,
        "still registered, still counted"
    );
    // Registered buffers work in a capture (the collective path never syncs).
    let mut reg = comm.register(&mut a).unwrap();
    s.copy_h2d(&[2.0f32; 16], &mut *reg).unwrap();
    let graph = s
        .capture(|cs| comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, cs))
        .unwrap();
    drop(graph);
    assert_eq!(s.to_vec(&reg.as_slice()).unwrap(), vec![2.0f32; 16]);
    drop(reg);
    drop(comm);
    assert_eq!(
        nccl().orphaned_registrations(),
        1,
        "released with the communicator"
    );
    assert_eq!(nccl().registrations(), 0);
}

fn deregistration_waits_for_queued_work_and_groups() {
    reset();
    let config = CommConfig::new().drop_timeout(Duration::from_millis(50));
    let (comm, s) = one_rank(&config);
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 8).unwrap();
    // Inside a group: refused (the group's work is launched at its end).
    let reg = comm.register(&mut buf).unwrap();
    let (reg, e) = group(&[&comm], || Ok(reg.deregister()))
        .unwrap()
        .unwrap_err();
    assert!(
        refusal(&e).contains("deregistering inside `group` is refused"),
        "{e}"
    );
    // Behind queued work that never finishes: refused past the drop timeout.
    let mut reg = reg;
    nccl().set_hang(true);
    comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &s)
        .unwrap();
    let start = std::time::Instant::now();
    let (reg, e) = reg.deregister().unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(50));
    assert!(
        refusal(&e).contains("work the communicator queued (ncclAllReduce) had not finished after"),
        "{e}"
    );
    assert_eq!(nccl().calls("ncclCommDeregister"), 0);
    assert_eq!(nccl().registrations(), 1);
    // The work finishes (here: the communicator is aborted, which releases
    // it); then the guard goes quietly.
    nccl().set_hang(false);
    comm.abort();
    s.synchronize().unwrap();
    drop(reg);
    assert_eq!(nccl().registrations(), 0, "released with the communicator");
    drop(comm);
}

fn registration_bound_and_checks() {
    reset();
    let (comm, _s) = one_rank(&CommConfig::new());
    comm.set_registration_limit(Some(100));
    let mut a = NcclBuffer::<u8>::alloc(comm.context(), 64).unwrap();
    let mut b = NcclBuffer::<u8>::alloc(comm.context(), 64).unwrap();
    let ra = comm.register(&mut a).unwrap();
    let e = comm.register(&mut b).unwrap_err();
    assert!(
        refusal(&e).contains(
            "registering 64 more bytes would pass the communicator's bound of 100 registered \
             bytes (64 registered now)"
        ),
        "{e}"
    );
    drop(ra);
    let rb = comm.register(&mut b).unwrap();
    drop(rb);
    comm.set_registration_limit(None);
    // Empty buffers and other devices are refused before NCCL.
    let mut empty = NcclBuffer::<u8>::alloc(comm.context(), 0).unwrap();
    assert!(refusal(&comm.register(&mut empty).unwrap_err()).contains("the buffer is empty"));
    let mut far = NcclBuffer::<u8>::alloc(&ctx(1), 8).unwrap();
    let e = comm.register(&mut far).unwrap_err();
    assert!(
        refusal(&e).contains("the buffer is on device 1, the communicator on device 0"),
        "{e}"
    );
    assert_eq!(nccl().calls("ncclCommRegister"), 2);
}

fn window_all_reduce_and_registered_collectives() {
    reset();
    let out = two_ranks(CommConfig::new(), |rank, comm, s| {
        let mut wbuf = NcclBuffer::<i32>::alloc(comm.context(), 4).unwrap();
        let mut rbuf = NcclBuffer::<i32>::alloc(comm.context(), 4).unwrap();
        let r = rank as i32;
        s.copy_h2d(&[r, 10 + r, 20 + r, 30 + r], &mut wbuf).unwrap();
        s.copy_h2d(&[1, 2, 3, 4], &mut rbuf).unwrap();
        let mut win = comm
            .register_window(&mut wbuf, WindowFlags::COLL_SYMMETRIC)
            .unwrap();
        assert_eq!(win.index(), 0);
        assert!(win.flags().is_symmetric());
        let mut reg = comm.register(&mut rbuf).unwrap();
        comm.all_reduce_in_place(&mut win, ReduceOp::Sum, s)
            .unwrap();
        comm.all_reduce(&win, &mut reg, ReduceOp::Max, s).unwrap();
        s.synchronize().unwrap();
        let got = (
            s.to_vec(&win.as_slice()).unwrap(),
            s.to_vec(&reg.as_slice()).unwrap(),
        );
        // A window collective keeps the length checks.
        let short = NcclBuffer::<i32>::alloc(comm.context(), 2).unwrap();
        let e = comm.all_reduce(&win, &mut reg.slice_mut(..1).unwrap(), ReduceOp::Sum, s);
        assert!(refusal(&e.unwrap_err()).contains("fewer than the send buffer's 4"));
        drop(short);
        drop(reg);
        drop(win);
        got
    });
    for (w, r) in out {
        assert_eq!(w, [1, 21, 41, 61]);
        assert_eq!(r, [1, 21, 41, 61]);
    }
    check_clean("window");
    assert_eq!(nccl().calls("ncclCommWindowDeregister"), 2);
}

// ---- all-to-all, gather, scatter ---------------------------------------------

fn all_to_all_gather_scatter_results() {
    reset();
    let out = ranks(3, |rank, comm, s| {
        let r = rank as i32;
        // all-to-all: block j of rank i's send goes to block i of rank j.
        let send = DeviceBuffer::from_host(&s, &[10 * r, 10 * r + 1, 10 * r + 2]).unwrap();
        let mut recv = DeviceBuffer::<i32>::alloc(&s, 3).unwrap();
        comm.all_to_all(&send, &mut recv, &s).unwrap();
        // gather to rank 1
        let mine = DeviceBuffer::from_host(&s, &[r, -r]).unwrap();
        let mut all = DeviceBuffer::from_host(&s, &[99i32; 6]).unwrap();
        comm.gather(&mine, &mut all, 1, &s).unwrap();
        // scatter from rank 2
        let blocks = DeviceBuffer::from_host(&s, &[100 * r, 1, 2, 3, 4, 5]).unwrap();
        let mut part = DeviceBuffer::<i32>::alloc(&s, 2).unwrap();
        comm.scatter(&blocks, &mut part, 2, &s).unwrap();
        s.synchronize().unwrap();
        (
            s.to_vec(&recv).unwrap(),
            s.to_vec(&all).unwrap(),
            s.to_vec(&part).unwrap(),
        )
    });
    assert_eq!(out[0].0, [0, 10, 20]);
    assert_eq!(out[1].0, [1, 11, 21]);
    assert_eq!(out[2].0, [2, 12, 22]);
    assert_eq!(out[1].1, [0, 0, 1, -1, 2, -2]);
    assert_eq!(out[0].1, [99; 6], "gather writes on the root only");
    assert_eq!(out[0].2, [200, 1]);
    assert_eq!(out[1].2, [2, 3]);
    assert_eq!(out[2].2, [4, 5]);
    assert_eq!(nccl().calls("ncclAlltoAll"), 3);
}

fn all_to_all_gather_scatter_counts_and_roots_are_refused() {
    reset();
    two_ranks(CommConfig::new(), |_rank, comm, s| {
        let b = |n: usize| DeviceBuffer::<f32>::alloc(s, n).unwrap();
        let cases: Vec<(Result<()>, &str)> = vec![
            (
                comm.all_to_all(&b(3), &mut b(3), s),
                "ncclAlltoAll not called (communicator rank ?, device ?): the send buffer has 3 elements and the receive buffer 3; both need ranks × per-rank count (2 × k) elements, the same on both",
            ),
            (
                comm.all_to_all(&b(4), &mut b(6), s),
                "the send buffer has 4 elements and the receive buffer 6",
            ),
            (
                comm.gather(&b(2), &mut b(3), 0, s),
                "ncclGather not called (communicator rank ?, device ?): the receive buffer has 3 elements; it needs ranks × send = 2 × 2 = 4",
            ),
            (
                comm.gather(&b(2), &mut b(4), 2, s),
                "ncclGather not called (communicator rank ?, device ?): root 2 is not a rank (the communicator has 2 ranks)",
            ),
            (
                comm.scatter(&b(3), &mut b(2), 0, s),
                "ncclScatter not called (communicator rank ?, device ?): the send buffer has 3 elements; it needs ranks × receive = 2 × 2 = 4",
            ),
            (
                comm.scatter(&b(4), &mut b(2), 7, s),
                "root 7 is not a rank (the communicator has 2 ranks)",
            ),
        ];
        for (got, want) in cases {
            let text = refusal(&got.unwrap_err());
            let want = want
                .replace("rank ?", &format!("rank {} of 2", comm.rank()))
                .replace("device ?", &format!("device {}", comm.device()));
            assert!(text.contains(&want), "{text}\nwanted: {want}");
        }
        // Another device's buffer.
        let far = DeviceBuffer::<f32>::alloc(&ctx(1 - comm.device()), 4).unwrap();
        let e = comm.all_to_all(&far, &mut b(4), s).unwrap_err();
        assert!(refusal(&e).contains("the send buffer is on device"), "{e}");
    });
    for call in ["ncclAlltoAll", "ncclGather", "ncclScatter"] {
        assert_eq!(nccl().calls(call), 0, "{call}: a refused call reached NCCL");
    }
}

// ---- pre-multiplied sums ----------------------------------------------------------

fn pre_mul_sum_with_host_and_device_scalars() {
    reset();
    let out = two_ranks(CommConfig::new(), |rank, comm, s| {
        let r = rank as f32;
        // host: the mean
        let mean = PreMulSum::host(comm, 0.5f32).unwrap();
        let mut a = DeviceBuffer::from_host(s, &[2.0 + r, 4.0 + r]).unwrap();
        comm.all_reduce_in_place(&mut a, &mean, s).unwrap();
        // device: rank r scales by r + 1
        let scalar = DeviceBuffer::from_host(s, &[r + 1.0]).unwrap();
        let scaled = PreMulSum::device(comm, &scalar).unwrap();
        let send = DeviceBuffer::from_host(s, &[1.0f32, 10.0]).unwrap();
        let mut recv = DeviceBuffer::<f32>::alloc(s, 2).unwrap();
        comm.all_reduce(&send, &mut recv, &scaled, s).unwrap();
        // reduce and reduce-scatter take it too
        let mut red = DeviceBuffer::from_host(s, &[0.0f32; 2]).unwrap();
        comm.reduce(&send, &mut red, &scaled, 0, s).unwrap();
        let blocks = DeviceBuffer::from_host(s, &[1.0f32, 2.0]).unwrap();
        let mut part = DeviceBuffer::<f32>::alloc(s, 1).unwrap();
        comm.reduce_scatter(&blocks, &mut part, &mean, s).unwrap();
        s.synchronize().unwrap();
        assert!(
            nccl().premul_live() >= 2,
            "this rank's two operations are live"
        );
        drop((mean, scaled));
        (
            s.to_vec(&a).unwrap(),
            s.to_vec(&recv).unwrap(),
            s.to_vec(&red).unwrap(),
            s.to_vec(&part).unwrap(),
        )
    });
    for (rank, (a, recv, red, part)) in out.into_iter().enumerate() {
        assert_eq!(a, [2.5, 4.5]);
        assert_eq!(recv, [3.0, 30.0]);
        if rank == 0 {
            assert_eq!(red, [3.0, 30.0]);
        }
        assert_eq!(part, [if rank == 0 { 1.0 } else { 2.0 }]);
    }
    assert_eq!(nccl().premul_live(), 0, "every operation was destroyed");
    assert_eq!(nccl().calls("ncclRedOpDestroy"), 4);
    // Another communicator's operation is refused; an empty device scalar too.
    reset();
    let (a, s) = one_rank(&CommConfig::new());
    let (b, _) = one_rank(&CommConfig::new());
    let op = PreMulSum::host(&a, 2.0f64).unwrap();
    let mut buf = DeviceBuffer::from_host(&s, &[1.0f64]).unwrap();
    let e = b.all_reduce_in_place(&mut buf, &op, &s).unwrap_err();
    assert!(
        refusal(&e).contains("the pre-multiplied sum was made for another communicator"),
        "{e}"
    );
    let empty = DeviceBuffer::<f64>::alloc(&s, 0).unwrap();
    let e = PreMulSum::device(&a, &empty).unwrap_err();
    assert!(refusal(&e).contains("the device scalar is empty"), "{e}");
    a.all_reduce_in_place(&mut buf, &op, &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(s.to_vec(&buf).unwrap(), [2.0]);
    drop(op);
    drop(b);
    // Dropped inside a group (whose calls are launched at its end): left to
    // NCCL, which frees it with the communicator.
    let destroys = nccl().calls("ncclRedOpDestroy");
    group(&[&a], || {
        let op = PreMulSum::host(&a, 3.0f64)?;
        a.all_reduce_in_place(&mut buf, &op, &s)
    })
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(s.to_vec(&buf).unwrap(), [6.0]);
    assert_eq!(nccl().calls("ncclRedOpDestroy"), destroys);
    assert_eq!(nccl().premul_live(), 1);
    // An operation left when its communicator goes is freed by NCCL.
    let op = PreMulSum::host(&a, 1i32).unwrap();
    std::mem::forget(op);
    drop(a);
    assert_eq!(nccl().premul_live(), 0);
}

// ---- revoke, shrink, scalable init ------------------------------------------------

fn revoke_and_shrink_after_a_dead_rank() {
    reset();
    let queued = Arc::new(Barrier::new(3));
    let out = ranks(3, move |rank, comm, s| {
        if rank == 2 {
            // This rank dies while the others' all-reduce waits for it.
            queued.wait();
            nccl().kill(comm.raw().cast());
            queued.wait();
            comm.abort();
            return None;
        }
        let mut b = DeviceBuffer::from_host(&s, &[rank as f32 + 1.0; 4]).unwrap();
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
        queued.wait();
        queued.wait();
        assert!(
            !s.query().unwrap(),
            "the all-reduce waits for the dead rank"
        );
        let e = comm
            .wait_with(&s, Duration::from_secs(5), OnFailure::Revoke)
            .unwrap_err();
        assert!(
            matches!(
                e.as_nccl(),
                Some(NcclError::WaitRevoked {
                    status: Some(_),
                    ..
                })
            ),
            "{e}"
        );
        let text = e.to_string();
        assert!(text.contains("ncclRemoteError (6)"), "{text}");
        assert!(text.contains("fakenccl: rank 2 died (killed)"), "{text}");
        assert!(
            text.ends_with(
                "was revoked (ncclCommRevoke), not aborted: shrink it to go on with the live ranks"
            ),
            "{text}"
        );
        assert!(comm.is_revoked() && !comm.is_aborted());
        assert!(s.query().unwrap(), "the revoke stopped the in-flight work");
        let e = comm
            .all_reduce_in_place(&mut b, ReduceOp::Sum, &s)
            .unwrap_err();
        assert!(
            matches!(e.as_nccl(), Some(NcclError::Revoked { .. })),
            "{e}"
        );
        // Checked before NCCL.
        for (bad, want) in [
            (
                vec![5],
                "excluded rank 5 is not a rank (the communicator has 3 ranks)",
            ),
            (vec![2, 2], "rank 2 is excluded twice"),
            (vec![], "no rank to exclude"),
            (
                vec![rank],
                "is excluded: only the ranks that stay call shrink",
            ),
        ] {
            let e = comm.shrink(&bad, &CommConfig::new()).unwrap_err();
            assert!(refusal(&e).contains(want), "{e}");
        }
        let small = comm.shrink(&[2], &CommConfig::new()).unwrap();
        assert_eq!((small.rank(), small.size()), (rank, 2));
        let mut c = DeviceBuffer::from_host(&s, &[rank as f32 + 1.0; 4]).unwrap();
        small
            .all_reduce_in_place(&mut c, ReduceOp::Sum, &s)
            .unwrap();
        small.wait(&s, Duration::from_secs(5)).unwrap();
        let got = s.to_vec(&c).unwrap();
        drop(small);
        drop(comm); // revoked: aborted, not finalized
        Some(got)
    });
    assert_eq!(out[0].as_deref(), Some(&[3.0f32; 4][..]));
    assert_eq!(out[1].as_deref(), Some(&[3.0f32; 4][..]));
    assert_eq!(nccl().calls("ncclCommRevoke"), 2);
    assert_eq!(nccl().calls("ncclCommShrink"), 2);
    assert_eq!(nccl().calls("ncclCommAbort"), 3);
    assert_eq!(nccl().would_hang(), 0);
    assert_eq!(nccl().live(), 0);
}

fn revoke_on_a_timed_out_wait_and_explicitly() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::<f32>::alloc(&s, 4).unwrap();
    nccl().set_hang(true);
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    let e = comm
        .wait_with(&s, Duration::from_millis(30), OnFailure::Revoke)
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("ncclAllReduce had not completed after "),
        "{text}"
    );
    assert!(
        text.contains("was revoked (ncclCommRevoke), not aborted"),
        "{text}"
    );
    assert!(comm.is_revoked());
    nccl().set_hang(false);
    comm.revoke().unwrap(); // twice: nothing
    assert_eq!(nccl().calls("ncclCommRevoke"), 1);
    let mut buf = NcclBuffer::<u8>::alloc(comm.context(), 8).unwrap();
    let e = comm.register(&mut buf).unwrap_err();
    assert!(
        e.to_string().contains("was revoked (ncclCommRevoke)"),
        "{e}"
    );
    assert!(PreMulSum::host(&comm, 1.0f32).is_err());
    drop(comm);
    assert_eq!(nccl().calls("ncclCommAbort"), 1);
    assert_eq!(nccl().calls("ncclCommFinalize"), 0);
    s.synchronize().unwrap();
    // Explicit revoke of a healthy communicator.
    let (comm, _s) = one_rank(&CommConfig::new());
    comm.revoke().unwrap();
    assert!(comm.is_revoked());
}

fn a_non_blocking_revoke_is_polled_and_a_late_window_deregistration_is_a_bound() {
    reset();
    nccl().set_inprogress_polls(3);
    let (comm, _s) = one_rank(&CommConfig::new().blocking(false));
    let polls = nccl().calls("ncclCommGetAsyncError");
    comm.revoke().unwrap();
    assert!(comm.is_revoked() && !comm.is_aborted());
    assert!(
        nccl().calls("ncclCommGetAsyncError") >= polls + 3,
        "the in-progress revoke was polled to completion"
    );
    drop(comm);
    nccl().set_inprogress_polls(0);
    // A window whose collective deregistration does not return within the
    // drop timeout: the drop returns at the bound, the communicator counts as
    // aborted, and the helper aborts it when the call returns.
    reset();
    let (comm, _s) = one_rank(&CommConfig::new().drop_timeout(Duration::from_millis(50)));
    let mut buf = NcclBuffer::<u8>::alloc(comm.context(), 4096).unwrap();
    let win = comm
        .register_window(&mut buf, WindowFlags::DEFAULT)
        .unwrap();
    nccl().set_window_deregister_delay_us(800_000);
    let start = std::time::Instant::now();
    drop(win);
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(600),
        "the drop waited {took:?}"
    );
    assert!(comm.is_aborted());
    drop(comm); // aborted: nothing more
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while nccl().live() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        nccl().live(),
        0,
        "the helper aborted it after the late deregistration"
    );
    assert_eq!(nccl().calls("ncclCommAbort"), 1);
    assert_eq!(nccl().windows(), 0);
}

fn init_rank_scalable_with_several_ids() {
    reset();
    let ids = [NcclId::new().unwrap(), NcclId::new().unwrap()];
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let c = ctx(rank);
                let comm = Communicator::init_rank_scalable(&ids, 2, rank, &c, &CommConfig::new())
                    .unwrap();
                let s = CudaStream::new(&c).unwrap();
                let mut b = DeviceBuffer::from_host(&s, &[rank as u32 + 1]).unwrap();
                comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
                s.synchronize().unwrap();
                s.to_vec(&b).unwrap()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), [3]);
    }
    assert_eq!(nccl().calls("ncclCommInitRankScalable"), 2);
    let e = Communicator::init_rank_scalable(&[], 1, 0, &ctx(0), &CommConfig::new()).unwrap_err();
    assert!(refusal(&e).contains("no id given"), "{e}");
    let e = Communicator::init_rank_scalable(&ids, 2, 2, &ctx(0), &CommConfig::new()).unwrap_err();
    assert!(
        refusal(&e).contains("rank 2 is not below the number of ranks 2"),
        "{e}"
    );
    // More ids than ranks (NCCL 2.28.3 refuses it with ncclInvalidArgument).
    let e = Communicator::init_rank_scalable(&ids, 1, 0, &ctx(0), &CommConfig::new()).unwrap_err();
    assert!(refusal(&e).contains("2 ids for 1 rank(s)"), "{e}");
}

// ---- an older NCCL ------------------------------------------------------------

fn an_older_nccl_gates_versions_and_lacks_symbols() {
    let old = metrale_fakecuda::nccl_old_library_path()
        .display()
        .to_string();
    let (ok, stdout, stderr) = super::child_output("old_nccl", &[("METRALE_LIBNCCL_PATH", &old)]);
    assert!(ok, "{stdout}{stderr}");
    for want in [
        "window: ncclCommWindowRegister not called (communicator rank 0 of 1, device 0): it needs NCCL 2.27.0 or newer; the loaded NCCL is 2.26.5",
        "revoke: ncclCommRevoke not called (communicator rank 0 of 1, device 0): it needs NCCL 2.28.0 or newer; the loaded NCCL is 2.26.5",
        "shrink: ncclCommShrink not called (communicator rank 0 of 1, device 0): it needs NCCL 2.27.0 or newer; the loaded NCCL is 2.26.5",
        "all_to_all: the loaded NCCL library does not export `ncclAlltoAll` (it is version 2.26) (communicator rank 0 of 1, device 0)",
        "gather: the loaded NCCL library does not export `ncclGather`",
        "wait_with: ncclCommRevoke not called (communicator rank 0 of 1, device 0): it needs NCCL 2.28.0",
        "aborted=true",
        "registered: ok",
    ] {
        assert!(stdout.contains(want), "wanted `{want}` in:\n{stdout}");
    }
}

fn old_nccl_child() {
    let (comm, s) = one_rank(&CommConfig::new());
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 1024).unwrap();
    match comm.register_window(&mut buf, WindowFlags::COLL_SYMMETRIC) {
        Ok(_) => println!("window: registered?"),
        Err(e) => println!("window: {e}"),
    }
    if comm.register(&mut buf).map(|r| r.deregister()).is_ok() {
        println!("registered: ok");
    }
    let says = |what: &str, r: Result<()>| match r {
        Ok(()) => println!("{what}: ok?"),
        Err(e) => println!("{what}: {e}"),
    };
    says("revoke", comm.revoke());
    says("shrink", comm.shrink(&[], &CommConfig::new()).map(drop));
    let send = DeviceBuffer::<f32>::alloc(&s, 2).unwrap();
    let mut recv = DeviceBuffer::<f32>::alloc(&s, 2).unwrap();
    says("all_to_all", comm.all_to_all(&send, &mut recv, &s));
    let mut two = DeviceBuffer::<f32>::alloc(&s, 2).unwrap();
    says("gather", comm.gather(&send, &mut two, 0, &s));
    // A revoking wait on an NCCL without revoke aborts after all.
    let mut b = DeviceBuffer::<f32>::alloc(&s, 2).unwrap();
    let _ = fake();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    comm_timeout_child(&comm, &s);
}

fn comm_timeout_child(comm: &Communicator, s: &CudaStream) {
    let hang = metrale_fakecuda::FakeNccl::open(metrale_fakecuda::nccl_old_library_path());
    hang.set_hang(true);
    let mut b = DeviceBuffer::<f32>::alloc(s, 2).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, s).unwrap();
    match comm.wait_with(s, Duration::from_millis(20), OnFailure::Revoke) {
        Ok(()) => println!("wait_with: ok?"),
        Err(e) => println!("wait_with: {e}"),
    }
    println!("aborted={}", comm.is_aborted());
    hang.set_hang(false);
}

/// The tests of this file.
pub(super) fn tests() -> Vec<harness::Test> {
    macro_rules! tests {
        ($($f:ident),* $(,)?) => { vec![$(harness::Test { name: stringify!($f), run: $f }),*] };
    }
    tests![
        nccl_buffer_moves_data_and_frees_after_captures,
        registration_lifetimes_in_every_drop_order,
        registration_is_refused_during_a_capture,
        registration_bound_and_checks,
        deregistration_waits_for_queued_work_and_groups,
        window_all_reduce_and_registered_collectives,
        all_to_all_gather_scatter_results,
        all_to_all_gather_scatter_counts_and_roots_are_refused,
        pre_mul_sum_with_host_and_device_scalars,
        revoke_and_shrink_after_a_dead_rank,
        revoke_on_a_timed_out_wait_and_explicitly,
        init_rank_scalable_with_several_ids,
        a_non_blocking_revoke_is_polled_and_a_late_window_deregistration_is_a_bound,
        an_older_nccl_gates_versions_and_lacks_symbols,
    ]
}

/// The child scenarios of this file.
pub(super) fn children() -> Vec<harness::Child> {
    vec![harness::Child {
        name: "old_nccl",
        run: old_nccl_child,
    }]
}
