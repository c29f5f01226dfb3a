//! Tier 2 for the `nccl` feature: the runtime's NCCL room against the stand-in
//! NCCL (metrale-fakecuda's `fakenccl.c`: ranks as threads of this process) on
//! the stand-in driver, both loaded through their `METRALE_LIB*_PATH` variables.
//! Runs everywhere, with no GPU: every collective's results, every refusal,
//! error texts, `ncclInProgress`, asynchronous errors, the timeout-and-abort
//! path, every Drop path, and the missing-library and missing-symbol errors.

#![cfg(feature = "nccl")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/harness.rs"]
mod harness;

#[path = "nccl/audit6.rs"]
mod audit6;
#[path = "nccl/buffers_and_faults.rs"]
mod buffers_and_faults;
#[path = "nccl/round5.rs"]
mod round5;

use std::process::ExitCode;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use metrale_fakecuda::{Fake, FakeNccl};
use metrale_runtime::nccl::{group, CommConfig, Communicator, NcclError, NcclId, ReduceOp};
use metrale_runtime::sys::nccl::ncclResult_t;
use metrale_runtime::NcclStatus;
use metrale_runtime::{
    context, deferred_frees, CudaContext, CudaStream, DeviceBuffer, ErrorKind, ManagedBuffer,
    Result,
};

fn fake() -> &'static Fake {
    static F: OnceLock<Fake> = OnceLock::new();
    F.get_or_init(|| Fake::open(metrale_fakecuda::library_path()))
}

fn nccl() -> &'static FakeNccl {
    static F: OnceLock<FakeNccl> = OnceLock::new();
    F.get_or_init(|| FakeNccl::open(metrale_fakecuda::nccl_library_path()))
}

fn reset() {
    fake().reset();
    nccl().reset();
}

fn ctx(dev: usize) -> Arc<CudaContext> {
    context(dev).unwrap()
}

fn one_rank(config: &CommConfig) -> (Communicator, CudaStream) {
    let c = ctx(0);
    let id = NcclId::new().unwrap();
    let comm = Communicator::init_rank(&id, 1, 0, &c, config).unwrap();
    (comm, CudaStream::new(&c).unwrap())
}

/// Run `f(rank, comm, stream)` on two threads, rank r on device r.
fn two_ranks<R: Send + 'static>(
    config: CommConfig,
    f: impl Fn(usize, &Communicator, &CudaStream) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let id = NcclId::new().unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let f = Arc::clone(&f);
            let config = config.clone();
            std::thread::spawn(move || {
                let c = ctx(rank);
                let comm = Communicator::init_rank(&id, 2, rank, &c, &config).unwrap();
                let s = CudaStream::new(&c).unwrap();
                f(rank, &comm, &s)
            })
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(
        nccl().would_hang(),
        0,
        "a blocking finalize or destroy was made with work pending"
    );
    out
}

fn refusal(e: &metrale_runtime::MetraleError) -> String {
    match e.as_nccl() {
        Some(NcclError::Refused { .. }) => e.to_string(),
        other => panic!("expected a refusal, got {other:?}: {e}"),
    }
}

// ---- ids --------------------------------------------------------------------

fn id_bytes_and_text() {
    reset();
    let id = NcclId::new().unwrap();
    let text = id.to_string();
    assert_eq!(text.len(), 256);
    assert!(text.starts_with("66616b656e63636c"), "{text}"); // "fakenccl"
    let back: NcclId = text.parse().unwrap();
    assert_eq!(back, id);
    assert_eq!(NcclId::from_bytes(*id.as_bytes()), id);
    assert_ne!(NcclId::new().unwrap(), id);
    let e = "abc".parse::<NcclId>().unwrap_err();
    assert!(e.to_string().contains("256 hex digits; got 3"), "{e}");
    let bad = format!("zz{}", &text[2..]);
    let e = bad.parse::<NcclId>().unwrap_err();
    assert!(e.to_string().contains("`zz` at offset 0"), "{e}");
}

// ---- results ----------------------------------------------------------------

macro_rules! sum_each_type {
    ($($t:ty),*) => { $(
        {
            let out = two_ranks(CommConfig::new(), |rank, comm, s| {
                let data: Vec<$t> = (1..=5u8).map(|i| (i + rank as u8) as $t).collect();
                let send = DeviceBuffer::from_host(s, &data).unwrap();
                let mut recv = DeviceBuffer::<$t>::alloc(s, 6).unwrap();
                s.memset_u8(&mut recv, 0).unwrap();
                comm.all_reduce(&send, &mut recv, ReduceOp::Sum, s).unwrap();
                s.synchronize().unwrap();
                s.to_vec(&recv).unwrap()
            });
            let want: Vec<$t> = [3u8, 5, 7, 9, 11, 0].iter().map(|&v| v as $t).collect();
            assert_eq!(out[0], want, stringify!($t));
            assert_eq!(out[1], want, stringify!($t));
        }
    )* };
}

fn all_reduce_every_type() {
    reset();
    sum_each_type!(f32, f64, i8, u8, i32, u32, i64, u64);
}

#[cfg(feature = "half")]
fn all_reduce_half_types() {
    use half::{bf16, f16};
    reset();
    let out = two_ranks(CommConfig::new(), |rank, comm, s| {
        let a: Vec<f16> = (0..4).map(|i| f16::from_f32((i + rank) as f32)).collect();
        let b: Vec<bf16> = (0..4)
            .map(|i| bf16::from_f32((i * 2 + rank) as f32))
            .collect();
        let mut da = DeviceBuffer::from_host(s, &a).unwrap();
        let mut db = DeviceBuffer::from_host(s, &b).unwrap();
        comm.all_reduce_in_place(&mut da, ReduceOp::Sum, s).unwrap();
        comm.all_reduce_in_place(&mut db, ReduceOp::Max, s).unwrap();
        s.synchronize().unwrap();
        (s.to_vec(&da).unwrap(), s.to_vec(&db).unwrap())
    });
    for (a, b) in out {
        assert_eq!(a, [1.0, 3.0, 5.0, 7.0].map(f16::from_f32).to_vec());
        assert_eq!(b, [1.0, 3.0, 5.0, 7.0].map(bf16::from_f32).to_vec());
    }
}

fn all_reduce_every_op() {
    reset();
    for (op, want) in [
        (ReduceOp::Sum, [5.0f32, 12.0]),
        (ReduceOp::Prod, [6.0, 35.0]),
        (ReduceOp::Min, [2.0, 5.0]),
        (ReduceOp::Max, [3.0, 7.0]),
        (ReduceOp::Avg, [2.5, 6.0]),
    ] {
        let out = two_ranks(CommConfig::new(), move |rank, comm, s| {
            let v = if rank == 0 { [2.0f32, 5.0] } else { [3.0, 7.0] };
            let mut b = DeviceBuffer::from_host(s, &v).unwrap();
            comm.all_reduce_in_place(&mut b, op, s).unwrap();
            s.synchronize().unwrap();
            s.to_vec(&b).unwrap()
        });
        assert_eq!(out, vec![want.to_vec(), want.to_vec()], "{op:?}");
    }
}

fn broadcast_reduce_gather_scatter() {
    reset();
    let out = two_ranks(CommConfig::new(), |rank, comm, s| {
        let r = rank as i32;
        // broadcast from rank 1
        let send = DeviceBuffer::from_host(s, &[10 + r, 20 + r, 30 + r]).unwrap();
        let mut recv = DeviceBuffer::<i32>::alloc(s, 3).unwrap();
        comm.broadcast(&send, &mut recv, 1, s).unwrap();
        let mut inplace = DeviceBuffer::from_host(s, &[r; 2]).unwrap();
        comm.broadcast_in_place(&mut inplace, 0, s).unwrap();
        // reduce to rank 0
        let mut red = DeviceBuffer::from_host(s, &[-1i32; 3]).unwrap();
        comm.reduce(&send, &mut red, ReduceOp::Max, 0, s).unwrap();
        // all-gather
        let mine = DeviceBuffer::from_host(s, &[r * 100, r * 100 + 1]).unwrap();
        let mut all = DeviceBuffer::<i32>::alloc(s, 4).unwrap();
        comm.all_gather(&mine, &mut all, s).unwrap();
        // reduce-scatter
        let blocks = DeviceBuffer::from_host(s, &[1 + r, 2 + r, 3 + r, 4 + r]).unwrap();
        let mut part = DeviceBuffer::<i32>::alloc(s, 2).unwrap();
        comm.reduce_scatter(&blocks, &mut part, ReduceOp::Sum, s)
            .unwrap();
        s.synchronize().unwrap();
        (
            s.to_vec(&recv).unwrap(),
            s.to_vec(&inplace).unwrap(),
            s.to_vec(&red).unwrap(),
            s.to_vec(&all).unwrap(),
            s.to_vec(&part).unwrap(),
        )
    });
    for (rank, (bcast, inplace, red, all, part)) in out.into_iter().enumerate() {
        assert_eq!(bcast, vec![11, 21, 31]);
        assert_eq!(inplace, vec![0, 0]);
        if rank == 0 {
            assert_eq!(red, vec![11, 21, 31]);
        } else {
            assert_eq!(red, vec![-1, -1, -1], "written on the root only");
        }
        assert_eq!(all, vec![0, 1, 100, 101]);
        let want = if rank == 0 { vec![3, 5] } else { vec![7, 9] };
        assert_eq!(part, want);
    }
}

fn send_and_recv_between_threads() {
    reset();
    let out = two_ranks(CommConfig::new(), |rank, comm, s| {
        let mut b = DeviceBuffer::from_host(s, &[rank as u64 + 40; 4]).unwrap();
        if rank == 0 {
            comm.send(&b, 1, s).unwrap();
        } else {
            comm.recv(&mut b, 0, s).unwrap();
        }
        s.synchronize().unwrap();
        s.to_vec(&b).unwrap()
    });
    assert_eq!(out, vec![vec![40u64; 4], vec![40; 4]]);
}

fn one_rank_every_collective_and_slices() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    assert_eq!((comm.rank(), comm.size(), comm.device()), (0, 1, 0));
    let send = DeviceBuffer::from_host(&s, &[1.5f64, 2.5, 3.5, 4.5]).unwrap();
    let mut recv = DeviceBuffer::<f64>::alloc(&s, 4).unwrap();
    {
        let part = send.slice(1..3).unwrap();
        let mut out = recv.slice_mut(0..2).unwrap();
        comm.all_reduce(&part, &mut out, ReduceOp::Sum, &s).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(&s.to_vec(&recv).unwrap()[..2], &[2.5, 3.5]);
    comm.all_gather(&send, &mut recv, &s).unwrap();
    comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum, &s)
        .unwrap();
    comm.broadcast(&send, &mut recv, 0, &s).unwrap();
    comm.reduce(&send, &mut recv, ReduceOp::Min, 0, &s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(s.to_vec(&recv).unwrap(), vec![1.5, 2.5, 3.5, 4.5]);
    // Empty buffers are not handed to NCCL.
    let before = nccl().calls("ncclAllReduce");
    let e0 = DeviceBuffer::<f64>::alloc(&s, 0).unwrap();
    let mut e1 = DeviceBuffer::<f64>::alloc(&s, 0).unwrap();
    comm.all_reduce(&e0, &mut e1, ReduceOp::Sum, &s).unwrap();
    assert_eq!(nccl().calls("ncclAllReduce"), before);
}

fn init_all_and_a_group_on_one_thread() {
    reset();
    let ctxs = [ctx(0), ctx(1)];
    let comms = Communicator::init_all(&ctxs).unwrap();
    assert_eq!(comms.len(), 2);
    assert_eq!(
        comms
            .iter()
            .map(|c| (c.rank(), c.size(), c.device()))
            .collect::<Vec<_>>(),
        vec![(0, 2, 0), (1, 2, 1)]
    );
    let streams = [
        CudaStream::new(&ctxs[0]).unwrap(),
        CudaStream::new(&ctxs[1]).unwrap(),
    ];
    let mut bufs = [
        DeviceBuffer::from_host(&streams[0], &[1u32, 2]).unwrap(),
        DeviceBuffer::from_host(&streams[1], &[10u32, 20]).unwrap(),
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
        s.synchronize().unwrap();
        assert_eq!(s.to_vec(b).unwrap(), vec![11, 22]);
    }
    // Send and receive between two ranks of one thread, in one group.
    let [b0, b1] = &mut bufs;
    group(&listed, || {
        comms[0].send(b0, 1, &streams[0])?;
        comms[1].recv(b1, 0, &streams[1])
    })
    .unwrap();
    streams[1].synchronize().unwrap();
    assert_eq!(streams[1].to_vec(b1).unwrap(), vec![11, 22]);
    // Two ranks made by init_rank on one thread, inside a group.
    let id = NcclId::new().unwrap();
    let (a, b) = group(&[], || {
        Ok((
            Communicator::init_rank(&id, 2, 0, &ctxs[0], &CommConfig::new())?,
            Communicator::init_rank(&id, 2, 1, &ctxs[1], &CommConfig::new())?,
        ))
    })
    .unwrap();
    assert_eq!((a.rank(), b.rank()), (0, 1));
    // Dropped inside a group: aborted, not finalized into the group.
    let aborts = nccl().calls("ncclCommAbort");
    group(&[], || {
        drop(a);
        Ok(())
    })
    .unwrap();
    assert_eq!(nccl().calls("ncclCommAbort"), aborts + 1);
    drop(b);
    // A panic inside a group still ends the NCCL group.
    let (starts, ends) = (nccl().calls("ncclGroupStart"), nccl().calls("ncclGroupEnd"));
    let panicked =
        std::panic::catch_unwind(|| group(&[], || -> Result<()> { panic!("inside a group") }));
    assert!(panicked.is_err());
    assert_eq!(
        (nccl().calls("ncclGroupStart"), nccl().calls("ncclGroupEnd")),
        (starts + 1, ends + 1)
    );
    // A device given twice is refused before NCCL.
    let e = Communicator::init_all(&[ctx(0), ctx(0)]).unwrap_err();
    assert!(refusal(&e).contains("device 0 is given twice"), "{e}");
}

fn split_by_color_and_key() {
    reset();
    let out = two_ranks(CommConfig::new(), |rank, comm, _| {
        let swapped = comm
            .split(Some(3), 1 - rank as i32, &CommConfig::new())
            .unwrap()
            .unwrap();
        let r = (swapped.rank(), swapped.size(), swapped.device());
        let color = if rank == 0 { Some(7) } else { None };
        let alone = comm.split(color, 0, &CommConfig::new()).unwrap();
        (r, alone.map(|c| (c.rank(), c.size())))
    });
    assert_eq!(out[0], ((1, 2, 0), Some((0, 1))));
    assert_eq!(out[1], ((0, 2, 1), None));
}

// ---- refusals ---------------------------------------------------------------

fn lengths_roots_and_devices_are_refused_before_nccl() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let four = DeviceBuffer::<f32>::alloc(&s, 4).unwrap();
    let mut three = DeviceBuffer::<f32>::alloc(&s, 3).unwrap();
    let mut five = DeviceBuffer::<f32>::alloc(&s, 5).unwrap();
    let calls = |n: &str| nccl().calls(n);
    let before: Vec<i64> = [
        "ncclAllReduce",
        "ncclAllGather",
        "ncclReduceScatter",
        "ncclBroadcast",
        "ncclReduce",
        "ncclSend",
    ]
    .iter()
    .map(|n| calls(n))
    .collect();

    let e = comm
        .all_reduce(&four, &mut three, ReduceOp::Sum, &s)
        .unwrap_err();
    assert_eq!(
        refusal(&e),
        "ncclAllReduce not called (communicator rank 0 of 1, device 0): the receive buffer \
         has 3 elements, fewer than the send buffer's 4"
    );
    let e = comm.all_gather(&four, &mut five, &s).unwrap_err();
    assert!(
        refusal(&e).contains("ncclAllGather not called (communicator rank 0 of 1, device 0): the receive buffer has 5 elements; it needs ranks × send = 1 × 4 = 4"),
        "{e}"
    );
    let e = comm
        .reduce_scatter(&four, &mut three, ReduceOp::Sum, &s)
        .unwrap_err();
    assert!(
        refusal(&e)
            .contains("the send buffer has 4 elements; it needs ranks × receive = 1 × 3 = 3"),
        "{e}"
    );
    let e = comm.broadcast(&four, &mut three, 1, &s).unwrap_err();
    assert!(
        refusal(&e).contains("root 1 is not a rank (the communicator has 1 ranks)"),
        "{e}"
    );
    let e = comm
        .reduce(&four, &mut five, ReduceOp::Sum, 2, &s)
        .unwrap_err();
    assert!(refusal(&e).contains("ncclReduce not called"), "{e}");
    let e = comm.send(&four, 1, &s).unwrap_err();
    assert!(refusal(&e).contains("peer 1 is not a rank"), "{e}");
    let e = comm.broadcast(&three, &mut five, 0, &s).unwrap_err();
    assert!(
        refusal(&e).contains("the send buffer has 3 elements, fewer than the receive buffer's 5"),
        "{e}"
    );

    // Memory and streams of another device.
    let other = CudaStream::new(&ctx(1)).unwrap();
    let far = DeviceBuffer::<f32>::alloc(&other, 4).unwrap();
    let e = comm
        .all_reduce(&far, &mut five, ReduceOp::Sum, &s)
        .unwrap_err();
    assert!(
        refusal(&e).contains("the send buffer is on device 1, the communicator on device 0"),
        "{e}"
    );
    let e = comm
        .all_reduce_in_place(&mut five, ReduceOp::Sum, &other)
        .unwrap_err();
    assert!(
        refusal(&e).contains("ncclAllReduce not called (communicator rank 0 of 1, device 0): the stream is on device 1, the communicator on device 0"),
        "{e}"
    );
    let after: Vec<i64> = [
        "ncclAllReduce",
        "ncclAllGather",
        "ncclReduceScatter",
        "ncclBroadcast",
        "ncclReduce",
        "ncclSend",
    ]
    .iter()
    .map(|n| calls(n))
    .collect();
    assert_eq!(before, after, "no refused call reached NCCL");

    // Init: a rank not below the size, bad config values.
    let id = NcclId::new().unwrap();
    let e = Communicator::init_rank(&id, 2, 2, &ctx(0), &CommConfig::new()).unwrap_err();
    assert!(
        refusal(&e).contains("rank 2 is not below the number of ranks 2"),
        "{e}"
    );
    for (config, text) in [
        (
            CommConfig::new().cga_cluster_size(9),
            "cga_cluster_size is 0 to 8, not 9",
        ),
        (
            CommConfig::new().min_ctas(8).max_ctas(4),
            "min_ctas 8 is more than max_ctas 4",
        ),
        (CommConfig::new().max_ctas(0), "max_ctas must be at least 1"),
        (
            CommConfig::new().net_name("a\0b"),
            "net_name `a\0b` contains a NUL byte",
        ),
    ] {
        let e = Communicator::init_rank(&id, 1, 0, &ctx(0), &config).unwrap_err();
        assert!(refusal(&e).contains(text), "{e}");
    }
    assert_eq!(
        nccl().calls("ncclCommInitRankConfig"),
        1,
        "only the first one_rank init"
    );
    // A config with every setting is accepted.
    let config = CommConfig::new()
        .blocking(true)
        .cga_cluster_size(2)
        .min_ctas(1)
        .max_ctas(8)
        .split_share(true)
        .net_name("Socket")
        .comm_name("metrale-test");
    let c = Communicator::init_rank(&id, 1, 0, &ctx(0), &config).unwrap();
    assert!(c.is_blocking());
}

// ---- errors -----------------------------------------------------------------

fn errors_name_the_call_status_text_and_communicator() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::<i64>::alloc(&s, 8).unwrap();
    nccl().fail("ncclAllReduce", 5, 1, Some(1));
    let e = comm
        .all_reduce_in_place(&mut b, ReduceOp::Sum, &s)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "ncclAllReduce failed: ncclInvalidUsage (5): invalid usage (the stand-in's words); \
         last error: fakenccl: ncclAllReduce failed as asked (communicator rank 0 of 1, device 0)"
    );
    assert_eq!(
        e.as_nccl().unwrap().status(),
        Some(ncclResult_t::ncclInvalidUsage)
    );
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();

    let next = nccl().calls("ncclCommInitRankConfig") + 1;
    nccl().fail("ncclCommInitRankConfig", 2, next, Some(1));
    let id = NcclId::new().unwrap();
    let e = Communicator::init_rank(&id, 1, 0, &ctx(0), &CommConfig::new()).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("ncclCommInitRankConfig failed: ncclSystemError (2): "),
        "{e}"
    );
    assert!(
        e.to_string()
            .ends_with("(communicator rank 0 of 1, device 0)"),
        "{e}"
    );

    // A blocking init whose peer never comes: NCCL's own bound, its message.
    nccl().set_timeout_ms(50);
    let id = NcclId::new().unwrap();
    let e = Communicator::init_rank(&id, 2, 0, &ctx(0), &CommConfig::new()).unwrap_err();
    assert!(
        e.to_string()
            .contains("last error: fakenccl: rendezvous timed out: 1 of 2 ranks joined"),
        "{e}"
    );
    assert_eq!(
        nccl().live(),
        1,
        "the failed init's communicator was aborted"
    );
    drop(comm);
    assert_eq!(nccl().live(), 0);

    // Missing symbols name the library's version.
    let lib = metrale_runtime::sys::nccl::nccl().unwrap();
    let m = lib.ncclBcast().unwrap_err();
    assert_eq!(
        m.to_string(),
        "the loaded NCCL library does not export `ncclBcast` (it is version 2.28)"
    );
    assert_eq!(lib.version(), Some((2, 28, 9)));
    assert_eq!(
        metrale_runtime::nccl::nccl_version().unwrap(),
        Some(metrale_runtime::Version::new(2, 28, 9))
    );
}

fn async_errors_abort_and_refuse_later_calls() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    assert_eq!(comm.async_status().unwrap(), NcclStatus::SUCCESS);
    comm.check_async().unwrap();
    nccl().set_async_error(comm.raw().cast(), 6);
    let e = comm.check_async().unwrap_err();
    assert_eq!(
        e.to_string(),
        "ncclCommGetAsyncError: NCCL reported an asynchronous error: ncclRemoteError (6): \
         remote process exited or there was a network error (the stand-in's words); last \
         error: fakenccl: remote peer failed (injected) (communicator rank 0 of 1, device 0; aborted)"
    );
    assert!(comm.is_aborted());
    assert_eq!(nccl().calls("ncclCommAbort"), 1);
    let mut b = DeviceBuffer::<u8>::alloc(&s, 4).unwrap();
    let e = comm
        .all_reduce_in_place(&mut b, ReduceOp::Sum, &s)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "ncclAllReduce not called: the communicator (rank 0 of 1, device 0) was aborted"
    );
    comm.abort();
    drop(comm);
    assert_eq!(nccl().calls("ncclCommAbort"), 1, "aborted once");
    assert_eq!(nccl().calls("ncclCommFinalize"), 0);
    assert_eq!(nccl().calls("ncclCommDestroy"), 0);
    assert_eq!(nccl().live(), 0);

    // An asynchronous error seen by wait.
    let (comm, s) = one_rank(&CommConfig::new());
    nccl().set_async_error(comm.raw().cast(), 6);
    let e = comm.wait(&s, Duration::from_secs(1)).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("wait: NCCL reported an asynchronous error"),
        "{e}"
    );
    assert!(comm.is_aborted());
}

fn non_blocking_in_progress_is_polled_to_completion() {
    reset();
    nccl().set_inprogress_polls(3);
    let config = CommConfig::new().blocking(false);
    let (comm, s) = one_rank(&config);
    assert!(!comm.is_blocking());
    assert!(nccl().calls("ncclCommGetAsyncError") >= 4);
    let polls = nccl().calls("ncclCommGetAsyncError");
    let mut b = DeviceBuffer::from_host(&s, &[2.0f32; 3]).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Prod, &s)
        .unwrap();
    assert!(nccl().calls("ncclCommGetAsyncError") >= polls + 4);
    s.synchronize().unwrap();
    assert_eq!(s.to_vec(&b).unwrap(), vec![2.0; 3]);
    // In a group, listed: polled at the end.
    group(&[&comm], || {
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)
    })
    .unwrap();
    // Not listed: refused before NCCL.
    let e = group(&[], || comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)).unwrap_err();
    assert!(refusal(&e).contains("must be listed"), "{e}");
    drop(comm);
    assert_eq!(
        nccl().calls("ncclCommDestroy"),
        1,
        "finalize completed, then destroy"
    );

    // Two ranks on two threads: rank 0's init is polled until rank 1 joins.
    nccl().set_inprogress_polls(0);
    let out = two_ranks(CommConfig::new().blocking(false), |rank, comm, s| {
        let mut b = DeviceBuffer::from_host(s, &[rank as i32 + 1]).unwrap();
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, s).unwrap();
        s.synchronize().unwrap();
        s.to_vec(&b).unwrap()[0]
    });
    assert_eq!(out, vec![3, 3]);

    // A peer that never joins: the config's timeout, then abort.
    let id = NcclId::new().unwrap();
    let config = CommConfig::new()
        .blocking(false)
        .timeout(Duration::from_millis(50));
    let e = Communicator::init_rank(&id, 2, 0, &ctx(0), &config).unwrap_err();
    assert!(
        e.to_string().starts_with("ncclCommInitRankConfig had not completed after 50ms; the communicator (rank 0 of 2, device 0) was aborted"),
        "{e}"
    );
    assert_eq!(nccl().live(), 0);
}

fn wait_times_out_names_the_operation_and_aborts() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::<f32>::alloc(&s, 16).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    comm.wait(&s, Duration::from_secs(1)).unwrap();
    nccl().set_hang(true);
    comm.broadcast_in_place(&mut b, 0, &s).unwrap();
    assert!(
        !s.query().unwrap(),
        "the stream is busy with the collective"
    );
    let e = comm.wait(&s, Duration::from_millis(30)).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("ncclBroadcast had not completed after "),
        "{text}"
    );
    assert!(
        text.ends_with("; the communicator (rank 0 of 1, device 0) was aborted (ncclCommAbort) and cannot be used again"),
        "{text}"
    );
    assert!(matches!(e.as_nccl(), Some(NcclError::Timeout { .. })));
    assert!(comm.is_aborted());
    assert_eq!(nccl().calls("ncclCommAbort"), 1);
    assert!(s.query().unwrap(), "the abort ended the pending work");
    s.synchronize().unwrap();
    drop(comm);
    assert_eq!(nccl().live(), 0);
    assert_eq!(nccl().would_hang(), 0);
    nccl().set_hang(false);
}

fn wait_is_refused_on_another_device_and_inside_a_capture() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let other = CudaStream::new(&ctx(1)).unwrap();
    let e = comm.wait(&other, Duration::from_millis(1)).unwrap_err();
    assert!(refusal(&e).contains("wait not called"), "{e}");
    let mut seen = None;
    let _graph = s
        .capture(|cs| -> Result<()> {
            seen = Some(
                comm.wait(cs, Duration::from_millis(1))
                    .unwrap_err()
                    .to_string(),
            );
            Ok(())
        })
        .unwrap();
    let seen = seen.unwrap();
    assert!(seen.contains("the stream is being captured"), "{seen}");
    assert!(!comm.is_aborted());
}

fn collectives_capture_without_host_sync() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::from_host(&s, &[1u32, 2, 3]).unwrap();
    let send = DeviceBuffer::from_host(&s, &[1u32, 2, 3]).unwrap();
    s.synchronize().unwrap();
    let syncs = (
        fake().calls("cuStreamSynchronize"),
        fake().calls("cuStreamQuery"),
        fake().calls("cuCtxSynchronize"),
        fake().calls("cuEventSynchronize"),
    );
    let graph = s
        .capture(|cs| -> Result<()> {
            for _ in 0..10 {
                comm.all_reduce_in_place(&mut b, ReduceOp::Sum, cs)?;
                comm.all_reduce(&send, &mut b, ReduceOp::Max, cs)?;
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(
        syncs,
        (
            fake().calls("cuStreamSynchronize"),
            fake().calls("cuStreamQuery"),
            fake().calls("cuCtxSynchronize"),
            fake().calls("cuEventSynchronize"),
        ),
        "nothing in the collective path synchronised with the host"
    );
    let exec = graph.instantiate().unwrap();
    drop(exec);
    assert_eq!(nccl().calls("ncclAllReduce"), 20);
}

// ---- groups, splits and the host-function guard ----------------------------

fn frees() -> i64 {
    fake().calls("cuMemFree_v2") + fake().calls("cuMemFreeAsync")
}

fn group_defers_frees_and_refuses_unlisted_communicators() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let (other, _) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::from_host(&s, &[1u32, 2, 3]).unwrap();
    let mut kept = DeviceBuffer::from_host(&s, &[4u32]).unwrap();
    let far = DeviceBuffer::<u32>::alloc(&s, 8).unwrap();
    s.synchronize().unwrap();
    let (before, calls) = (frees(), nccl().calls("ncclAllReduce"));
    let mut inside = None;
    group(&[&comm], || {
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)?;
        // Dropped here, and on another thread: the collective reaches the
        // stream only at the group's end, so neither may be freed yet.
        drop(b);
        std::thread::spawn(move || drop(far)).join().unwrap();
        // A communicator the group does not list is refused, blocking or not.
        let e = other
            .all_reduce_in_place(&mut kept, ReduceOp::Sum, &s)
            .unwrap_err();
        inside = Some((frees(), deferred_frees(), refusal(&e)));
        Ok(())
    })
    .unwrap();
    let (freed_inside, deferred, text) = inside.unwrap();
    assert_eq!(freed_inside, before, "nothing freed inside the group");
    assert_eq!(deferred, 2, "both frees deferred");
    assert!(
        text.starts_with("ncclAllReduce not called (communicator rank 0 of 1, device 0): a communicator used inside `group` must be listed"),
        "{text}"
    );
    assert_eq!(
        nccl().calls("ncclAllReduce"),
        calls + 1,
        "the refused one never reached NCCL"
    );
    assert_eq!(deferred_frees(), 0, "retried at the group's end");
    assert_eq!(frees(), before + 2);
    // A group that fails, or unwinds, still lets the frees go.
    let gone = DeviceBuffer::<u8>::alloc(&s, 4).unwrap();
    let mut one = DeviceBuffer::<u8>::alloc(&s, 1).unwrap();
    let e = group(&[&comm], || {
        drop(gone);
        comm.broadcast_in_place(&mut one, 5, &s)
    })
    .unwrap_err();
    assert!(refusal(&e).contains("root 5 is not a rank"), "{e}");
    assert_eq!((deferred_frees(), frees()), (0, before + 3));
    let gone = DeviceBuffer::<u8>::alloc(&s, 4).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        group(&[&comm], || -> Result<()> {
            drop(gone);
            panic!("inside a group")
        })
    }));
    assert!(panicked.is_err());
    assert_eq!((deferred_frees(), frees()), (0, before + 4));
    // Managed memory's host view is refused while a group is open.
    let mut m = ManagedBuffer::<u32>::zeroed(&ctx(0), 4).unwrap();
    let e = group(&[&comm], || m.host_slice().map(|_| ())).unwrap_err();
    assert!(
        e.to_string().contains(
            "host_slice refused while an NCCL group is open (this thread is inside `nccl::group`)"
        ),
        "{e}"
    );
}

/// NCCL initializes a communicator made inside a group at the group's end: until
/// then another thread cannot use it (refused) or drop it (leaked, never
/// finalized or aborted under the pending init).
fn a_communicator_made_in_a_group_waits_for_its_end() {
    reset();
    let c = ctx(0);
    let id = NcclId::new().unwrap();
    let id2 = NcclId::new().unwrap();
    let (destroys, aborts, finals) = (
        nccl().calls("ncclCommDestroy"),
        nccl().calls("ncclCommAbort"),
        nccl().calls("ncclCommFinalize"),
    );
    let mut leaked_raw = std::ptr::null_mut();
    let comm = group(&[], || {
        let comm = Communicator::init_rank(&id, 1, 0, &c, &CommConfig::new())?;
        let leaked = Communicator::init_rank(&id2, 1, 0, &c, &CommConfig::new())?;
        leaked_raw = leaked.raw();
        let comm = std::thread::scope(|t| {
            t.spawn(move || drop(leaked)).join().unwrap();
            t.spawn(move || {
                let e = comm.async_status().unwrap_err();
                assert!(
                    refusal(&e).contains("made inside a `group` that has not ended"),
                    "{e}"
                );
                // Nor listed in this thread's group, nor aborted here.
                let e = group(&[&comm], || Ok(())).unwrap_err();
                assert!(refusal(&e).contains("has not ended"), "{e}");
                comm.abort();
                assert!(!comm.is_aborted(), "the abort was skipped");
                comm
            })
            .join()
            .unwrap()
        });
        // Inside the group, on its thread, it may be used.
        comm.async_status()?;
        Ok(comm)
    })
    .unwrap();
    assert_eq!(
        (
            nccl().calls("ncclCommDestroy"),
            nccl().calls("ncclCommAbort"),
            nccl().calls("ncclCommFinalize")
        ),
        (destroys, aborts, finals),
        "the communicator dropped on another thread was leaked, not torn down"
    );
    // Clean the leaked one up through the raw table (its init ran at the end).
    let lib = metrale_runtime::sys::nccl::nccl().unwrap();
    // SAFETY: the leaked communicator's handle, initialized, destroyed once.
    let st = unsafe { (lib.ncclCommDestroy().unwrap())(leaked_raw) };
    assert!(st.is_success(), "{st}");
    // The group ended: usable on any thread.
    let comm = std::thread::spawn(move || {
        comm.async_status().unwrap();
        comm
    })
    .join()
    .unwrap();
    drop(comm);
    assert_eq!(
        nccl().calls("ncclCommDestroy"),
        destroys + 2,
        "the raw clean-up and the drop"
    );
    assert_eq!(nccl().live(), 0);
}

/// A nested group's work launches at the outermost end: it may list only what
/// the outer group lists. A grown buffer (a virtual range) dropped on another
/// thread while a group is open is released once the group has ended.
fn nested_groups_and_ranges_wait_for_the_outermost_end() {
    reset();
    let (a, s) = one_rank(&CommConfig::new());
    let (b, _s2) = one_rank(&CommConfig::new());
    let starts = nccl().calls("ncclGroupStart");
    let e = group(&[&a], || group(&[&b], || Ok(()))).unwrap_err();
    assert!(
        refusal(&e).contains("a nested group may list only communicators an enclosing group lists"),
        "{e}"
    );
    assert_eq!(
        nccl().calls("ncclGroupStart"),
        starts + 1,
        "the inner group never started"
    );
    group(&[&a, &b], || group(&[&b], || Ok(()))).unwrap();
    // A grown buffer dropped on another thread while the group is open waits
    // for the group to end (bounded), then releases.
    let ranges = fake().live(metrale_fakecuda::Live::ReservedRanges);
    let mut g = metrale_runtime::GrowableBuffer::<f32>::new(&s, 1 << 20).unwrap();
    g.grow_to(1024).unwrap();
    s.zero(&mut g).unwrap();
    let (comm, stream) = (&a, &s);
    let t0 = std::time::Instant::now();
    let dropper = group(&[&a], move || {
        comm.all_reduce_in_place(&mut g, ReduceOp::Sum, stream)?;
        let dropper = std::thread::spawn(move || drop(g));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!dropper.is_finished(), "the release waits for the group");
        Ok(dropper)
    })
    .unwrap();
    dropper.join().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "waited for the group, not the bound"
    );
    assert_eq!(
        fake().live(metrale_fakecuda::Live::ReservedRanges),
        ranges,
        "released after the group's end"
    );
}

fn split_inside_a_group_is_refused() {
    reset();
    let (comm, _s) = one_rank(&CommConfig::new());
    let splits = nccl().calls("ncclCommSplit");
    let e = group(&[&comm], || {
        comm.split(Some(0), 0, &CommConfig::new()).map(|_| ())
    })
    .unwrap_err();
    assert!(
        refusal(&e).starts_with("ncclCommSplit not called (communicator rank 0 of 1, device 0): split inside `group` is not supported"),
        "{e}"
    );
    assert_eq!(nccl().calls("ncclCommSplit"), splits);
    // Outside the group it works.
    let child = comm.split(Some(0), 0, &CommConfig::new()).unwrap().unwrap();
    assert_eq!((child.rank(), child.size()), (0, 1));
}

fn nccl_comm_blocking_overrides_the_config() {
    for (env, child) in [("0", "blocking_env_0"), ("1", "blocking_env_1")] {
        let (ok, stdout, stderr) = child_output(child, &[("NCCL_COMM_BLOCKING", env)]);
        assert!(ok, "NCCL_COMM_BLOCKING={env}: {stdout}{stderr}");
        assert!(stdout.contains("checked"), "{stdout}");
    }
}

fn blocking_env_0() {
    nccl().set_inprogress_polls(2);
    let (comm, s) = one_rank(&CommConfig::new());
    assert!(!comm.is_blocking(), "NCCL_COMM_BLOCKING=0 wins");
    let mut b = DeviceBuffer::from_host(&s, &[1.0f32; 2]).unwrap();
    let polls = nccl().calls("ncclCommGetAsyncError");
    group(&[&comm], || {
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)
    })
    .unwrap();
    assert!(
        nccl().calls("ncclCommGetAsyncError") > polls,
        "the group's end polled it"
    );
    assert_eq!(comm.async_status().unwrap(), NcclStatus::SUCCESS);
    let e = comm.split(Some(0), 0, &CommConfig::new()).unwrap_err();
    assert!(refusal(&e).contains("non-blocking"), "{e}");
    let all = Communicator::init_all(&[ctx(0)]).unwrap();
    assert!(!all[0].is_blocking());
    drop(all);
    drop(comm);
    assert_eq!(nccl().live(), 0);
    println!("checked");
}

fn blocking_env_1() {
    let (comm, _s) = one_rank(&CommConfig::new().blocking(false));
    assert!(comm.is_blocking(), "NCCL_COMM_BLOCKING=1 wins");
    drop(comm);
    assert_eq!(nccl().would_hang(), 0);
    println!("checked");
}

fn shared_split_and_parent_take_turns() {
    reset();
    let (parent, _s) = one_rank(&CommConfig::new().split_share(true));
    let child = parent
        .split(Some(0), 0, &CommConfig::new())
        .unwrap()
        .unwrap();
    nccl().set_call_delay_us(300);
    let t = std::thread::spawn(move || {
        for _ in 0..40 {
            child.async_status().unwrap();
        }
        child
    });
    for _ in 0..40 {
        parent.async_status().unwrap();
    }
    let child = t.join().unwrap();
    nccl().set_call_delay_us(0);
    assert_eq!(
        nccl().shared_overlaps(),
        0,
        "parent and child never overlapped"
    );
    drop(child);
    drop(parent);
    assert_eq!(nccl().live(), 0);
}

fn comm_name_outlives_the_init_call() {
    reset();
    let config = CommConfig::new().comm_name("alpha-communicator");
    let (comm, _s) = one_rank(&config);
    let child = comm
        .split(Some(0), 0, &CommConfig::new().comm_name("the-child"))
        .unwrap()
        .unwrap();
    drop(config);
    // Churn the heap so freed strings would be overwritten.
    let churn: Vec<String> = (0..1000).map(|i| format!("{i:0>18}")).collect();
    assert_eq!(churn.len(), 1000);
    assert_eq!(
        nccl().comm_name(comm.raw().cast()).as_deref(),
        Some("alpha-communicator")
    );
    assert_eq!(
        nccl().comm_name(child.raw().cast()).as_deref(),
        Some("the-child")
    );
}

fn nccl_calls_are_refused_in_a_host_function() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let polls = nccl().calls("ncclCommGetAsyncError");
    let starts = nccl().calls("ncclGroupStart");
    let ids = nccl().calls("ncclGetUniqueId");
    let (tx, rx) = std::sync::mpsc::channel();
    s.launch_host_fn(move || {
        let status = comm.async_status().map(|_| ());
        let grouped = group(&[], || Ok(()));
        let id = NcclId::new().map(|_| ());
        let _ = tx.send((status, grouped, id, comm));
    })
    .unwrap();
    s.synchronize().unwrap();
    let (status, grouped, id, comm) = rx.recv().unwrap();
    for (e, subject) in [
        (id.unwrap_err(), "ncclGetUniqueId (NcclId::new)"),
        (
            status.unwrap_err(),
            "ncclCommGetAsyncError on the NCCL communicator (rank 0 of 1, device 0)",
        ),
        (grouped.unwrap_err(), "ncclGroupStart (nccl::group)"),
    ] {
        assert!(matches!(e.kind(), ErrorKind::InHostFunction { .. }), "{e}");
        assert!(
            e.to_string()
                .starts_with(&format!("{subject}: refused inside a host function")),
            "{e}"
        );
    }
    assert_eq!(nccl().calls("ncclCommGetAsyncError"), polls);
    assert_eq!(nccl().calls("ncclGroupStart"), starts);
    assert!(!comm.is_aborted());
    assert_eq!(nccl().calls("ncclGetUniqueId"), ids);
}

fn huge_timeouts_do_not_panic() {
    reset();
    nccl().set_inprogress_polls(2);
    let config = CommConfig::new()
        .blocking(false)
        .timeout(Duration::MAX)
        .drop_timeout(Duration::MAX);
    let (comm, s) = one_rank(&config);
    let mut b = DeviceBuffer::from_host(&s, &[3u64]).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    group(&[&comm], || {
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)
    })
    .unwrap();
    drop(comm);
    let (blocking, _s2) = one_rank(&CommConfig::new().drop_timeout(Duration::MAX));
    drop(blocking);
    assert_eq!(nccl().calls("ncclCommDestroy"), 2);
    assert_eq!(nccl().calls("ncclCommAbort"), 0);
    assert_eq!(nccl().live(), 0);
}

fn group_settles_every_listed_communicator() {
    reset();
    nccl().set_inprogress_polls(3);
    let config = CommConfig::new().blocking(false);
    let (a, s) = one_rank(&config);
    let (b, _) = one_rank(&config);
    let mut x = DeviceBuffer::from_host(&s, &[1i32]).unwrap();
    let mut y = DeviceBuffer::from_host(&s, &[2i32]).unwrap();
    let e = group(&[&a, &b], || {
        a.all_reduce_in_place(&mut x, ReduceOp::Sum, &s)?;
        b.all_reduce_in_place(&mut y, ReduceOp::Sum, &s)?;
        // `a` fails once its work is launched.
        nccl().set_async_error(a.raw().cast(), 6);
        Ok(())
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("ncclGroupEnd: NCCL reported an asynchronous error: ncclRemoteError (6)"),
        "{e}"
    );
    assert!(a.is_aborted());
    assert!(!b.is_aborted());
    assert_eq!(
        b.async_status().unwrap(),
        NcclStatus::SUCCESS,
        "b was settled too"
    );
}

// ---- aborts, waits and agreement inside a group ----------------------------

fn an_abort_inside_a_group_waits_for_its_end() {
    reset();
    // Directly.
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::from_host(&s, &[1.0f32; 4]).unwrap();
    group(&[&comm], || {
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)?;
        comm.abort();
        assert!(comm.is_aborted(), "aborted for metrale at once");
        assert_eq!(nccl().calls("ncclCommAbort"), 0, "NCCL's abort waits");
        let e = comm
            .all_reduce_in_place(&mut b, ReduceOp::Sum, &s)
            .unwrap_err();
        assert!(
            matches!(e.as_nccl(), Some(NcclError::Aborted { .. })),
            "{e}"
        );
        Ok(())
    })
    .unwrap(); // ncclGroupEnd found its communicator alive
    assert_eq!(
        nccl().calls("ncclCommAbort"),
        1,
        "aborted at the group's end"
    );
    assert_eq!(nccl().live(), 0);
    drop(comm);
    assert_eq!(nccl().calls("ncclCommAbort"), 1);

    // Through check_async on an asynchronous error, in a nested group.
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::from_host(&s, &[1.0f32; 4]).unwrap();
    let mut seen = None;
    group(&[&comm], || {
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)?;
        group(&[&comm], || {
            nccl().set_async_error(comm.raw().cast(), 6);
            seen = Some(comm.check_async().unwrap_err());
            Ok(())
        })?;
        assert_eq!(nccl().calls("ncclCommAbort"), 1, "not at the inner end");
        Ok(())
    })
    .unwrap();
    let e = seen.unwrap();
    assert!(matches!(e.as_nccl(), Some(NcclError::Async { .. })), "{e}");
    assert!(comm.is_aborted());
    assert_eq!(nccl().calls("ncclCommAbort"), 2);
    assert_eq!(nccl().live(), 0);

    // A panic after the abort: the group still ends, then the abort runs.
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::from_host(&s, &[1.0f32; 4]).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        group(&[&comm], || -> Result<()> {
            comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)?;
            comm.abort();
            panic!("after an abort inside a group")
        })
    }));
    assert!(panicked.is_err());
    assert!(comm.is_aborted());
    assert_eq!(
        nccl().calls("ncclCommAbort"),
        3,
        "run on unwind, after the end"
    );
    assert_eq!(nccl().live(), 0);
    drop(comm);

    // A communicator no group lists is aborted at once, also inside a group.
    let (listed, _) = one_rank(&CommConfig::new());
    let (other, _) = one_rank(&CommConfig::new());
    group(&[&listed], || {
        other.abort();
        assert_eq!(nccl().calls("ncclCommAbort"), 4);
        Ok(())
    })
    .unwrap();
}

fn a_wait_inside_a_group_is_refused() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::from_host(&s, &[1.0f32; 4]).unwrap();
    let e = group(&[&comm], || {
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s)?;
        comm.wait(&s, Duration::from_secs(1))
    })
    .unwrap_err();
    let text = refusal(&e);
    assert!(
        text.starts_with("wait not called (communicator rank 0 of 1, device 0): a wait inside `group` is refused"),
        "{text}"
    );
    assert!(!comm.is_aborted());
    comm.wait(&s, Duration::from_secs(1)).unwrap();
}

fn ranks_of_one_group_must_agree() {
    reset();
    let ctxs = [ctx(0), ctx(1)];
    let s = [
        CudaStream::new(&ctxs[0]).unwrap(),
        CudaStream::new(&ctxs[1]).unwrap(),
    ];
    // Agreeing ranks, then counts that disagree on the second collective.
    let comms = Communicator::init_all(&ctxs).unwrap();
    let mut a = DeviceBuffer::from_host(&s[0], &[1i32; 4]).unwrap();
    let mut b = DeviceBuffer::from_host(&s[1], &[2i32; 4]).unwrap();
    let mut short = DeviceBuffer::from_host(&s[1], &[2i32; 3]).unwrap();
    let listed: Vec<&Communicator> = comms.iter().collect();
    group(&listed, || {
        comms[0].all_reduce_in_place(&mut a, ReduceOp::Sum, &s[0])?;
        comms[1].all_reduce_in_place(&mut b, ReduceOp::Sum, &s[1])
    })
    .unwrap();
    s[0].synchronize().unwrap();
    assert_eq!(s[0].to_vec(&a).unwrap(), vec![3; 4]);
    let e = group(&listed, || {
        comms[0].all_reduce_in_place(&mut a, ReduceOp::Sum, &s[0])?;
        comms[1].all_reduce_in_place(&mut short, ReduceOp::Sum, &s[1])
    })
    .unwrap_err();
    let text = refusal(&e);
    assert!(
        text.starts_with(
            "ncclAllReduce not called (communicator rank 1 of 2, device 1): the ranks of one \
             communicator disagree on their collective #1 in this group: rank 0 queued \
             ncclAllReduce of 4 elements of NCCL type 2, Sum, this rank 1 ncclAllReduce of 3 \
             elements of NCCL type 2, Sum"
        ),
        "{text}"
    );
    assert!(
        comms.iter().all(Communicator::is_aborted),
        "both ranks aborted"
    );
    assert_eq!(nccl().live(), 0);
    s[0].synchronize().unwrap();
    drop(comms);

    // Types, operations and roots too.
    let comms = Communicator::init_all(&ctxs).unwrap();
    let listed: Vec<&Communicator> = comms.iter().collect();
    let mut f = DeviceBuffer::from_host(&s[1], &[2.0f32; 4]).unwrap();
    let e = group(&listed, || {
        comms[0].broadcast_in_place(&mut a, 0, &s[0])?;
        comms[1].broadcast_in_place(&mut f, 0, &s[1])
    })
    .unwrap_err();
    assert!(refusal(&e).contains("disagree"), "{e}");
    let comms = Communicator::init_all(&ctxs).unwrap();
    let listed: Vec<&Communicator> = comms.iter().collect();
    let e = group(&listed, || {
        comms[0].reduce_in_place(&mut a, ReduceOp::Sum, 0, &s[0])?;
        comms[1].reduce_in_place(&mut b, ReduceOp::Sum, 1, &s[1])
    })
    .unwrap_err();
    assert!(refusal(&e).contains("root 0"), "{e}");
    let comms = Communicator::init_all(&ctxs).unwrap();
    let listed: Vec<&Communicator> = comms.iter().collect();
    let e = group(&listed, || {
        comms[0].all_reduce_in_place(&mut a, ReduceOp::Max, &s[0])?;
        comms[1].all_reduce_in_place(&mut b, ReduceOp::Min, &s[1])
    })
    .unwrap_err();
    assert!(refusal(&e).contains("Max"), "{e}");
    assert_eq!(nccl().live(), 0);

    // Sends and receives: the k-th send from a to b against the k-th receive
    // of b from a, whatever came before outside the group.
    let comms = Communicator::init_all(&ctxs).unwrap();
    let listed: Vec<&Communicator> = comms.iter().collect();
    let mut r4 = DeviceBuffer::<i32>::alloc(&s[1], 4).unwrap();
    let mut r3 = DeviceBuffer::<i32>::alloc(&s[1], 3).unwrap();
    group(&listed, || {
        comms[0].send(&a, 1, &s[0])?;
        comms[1].recv(&mut r4, 0, &s[1])
    })
    .unwrap();
    s[1].synchronize().unwrap();
    assert_eq!(s[1].to_vec(&r4).unwrap(), s[0].to_vec(&a).unwrap());
    let e = group(&listed, || {
        comms[0].send(&a, 1, &s[0])?;
        comms[1].recv(&mut r3, 0, &s[1])
    })
    .unwrap_err();
    let text = refusal(&e);
    assert!(
        text.starts_with(
            "ncclRecv not called (communicator rank 1 of 2, device 1): send #1 from rank 0 to \
             rank 1 in this group is 4 elements of NCCL type 2, its receive 3 elements of \
             NCCL type 2: they must agree"
        ),
        "{text}"
    );
    assert!(
        comms.iter().all(Communicator::is_aborted),
        "both ranks aborted"
    );
    assert_eq!(nccl().live(), 0);
    s[0].synchronize().unwrap();
    s[1].synchronize().unwrap();
}

// ---- bounds -----------------------------------------------------------------

fn timeouts_are_bounds_when_the_abort_blocks() {
    reset();
    // NCCL's abort waits for the device's queued work: 2 s here.
    nccl().set_abort_delay_us(2_000_000);
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::<f32>::alloc(&s, 16).unwrap();
    nccl().set_hang(true);
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    let t = Instant::now();
    let e = comm.wait(&s, Duration::from_micros(1)).unwrap_err();
    let took = t.elapsed();
    let Some(NcclError::Timeout { waited, .. }) = e.as_nccl() else {
        panic!("expected a timeout: {e}");
    };
    assert!(
        *waited < Duration::from_millis(150),
        "the text says the time waited for the work ({waited:?}), not for the abort after it"
    );
    assert!(
        took < Duration::from_millis(1_000),
        "wait(1µs) took {took:?}"
    );
    assert!(comm.is_aborted(), "refused from the timeout on");
    drop(comm); // nothing more: the helper thread owns the abort
                // A direct abort, bounded by the drop timeout.
    let (comm, _s2) = one_rank(&CommConfig::new().drop_timeout(Duration::from_millis(100)));
    let t = Instant::now();
    comm.abort();
    let took = t.elapsed();
    assert!(took < Duration::from_millis(1_000), "abort took {took:?}");
    assert!(comm.is_aborted());
    drop(comm);
    // Both helpers finish their aborts.
    let t = Instant::now();
    while nccl().live() > 0 && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(nccl().live(), 0);
    nccl().set_hang(false);
    s.synchronize().unwrap();
    reset();
}

fn drop_is_bounded_when_the_abort_blocks() {
    let (ok, stdout, stderr) = child_output("drop_abort_blocks", &[]);
    assert!(ok, "{stdout}{stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("metrale:"))
        .collect();
    assert!(
        lines[0].starts_with("metrale: NCCL communicator (rank 0 of 1, device 0): its teardown"),
        "{stderr}"
    );
    assert!(
        lines[0].contains("leaked to a helper thread that finishes it"),
        "{stderr}"
    );
    assert!(stdout.contains("bounded drop: ok"), "{stdout}{stderr}");
    // The helper finished later, and said what it did.
    assert!(
        lines.iter().any(|l| l.contains("had not completed after")
            && l.ends_with("(drop timeout 50ms); aborted")),
        "{stderr}"
    );
    assert!(stdout.contains("live=0"), "{stdout}");
}

fn drop_abort_blocks() {
    nccl().set_abort_delay_us(1_000_000);
    let (comm, s) = one_rank(&CommConfig::new().drop_timeout(Duration::from_millis(50)));
    let mut b = DeviceBuffer::<f32>::alloc(&s, 4).unwrap();
    nccl().set_hang(true);
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    let t = Instant::now();
    drop(comm);
    let took = t.elapsed();
    if took < Duration::from_millis(800) {
        println!("bounded drop: ok");
    } else {
        println!("bounded drop: took {took:?}");
    }
    let t = Instant::now();
    while nccl().live() > 0 && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Let the helper's line out.
    std::thread::sleep(Duration::from_millis(100));
    println!("live={}", nccl().live());
    s.synchronize().unwrap();
}

fn drop_retries_a_transient_query_failure() {
    let (ok, stdout, stderr) = child_output("drop_query_transient", &[]);
    assert!(ok, "{stdout}{stderr}");
    assert!(!stderr.contains("metrale:"), "{stderr}");
    assert!(
        stdout.contains("abort=0 destroy=1 live=0"),
        "{stdout}{stderr}"
    );
    let (ok, stdout, stderr) = child_output("drop_query_fault", &[]);
    assert!(ok, "{stdout}{stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("metrale:"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with(
            "metrale: NCCL communicator (rank 0 of 1, device 0): a stream it used could not be \
             queried before ncclCommFinalize: "
        ),
        "{stderr}"
    );
    assert!(lines[0].contains("cuStreamQuery"), "{stderr}");
    assert!(lines[0].contains("(700)"), "{stderr}");
    assert!(lines[0].ends_with("; aborted"), "{stderr}");
    assert!(
        stdout.contains("abort=1 destroy=0 live=0"),
        "{stdout}{stderr}"
    );
}

fn drop_query(status: u32, times: Option<i64>) {
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::<f32>::alloc(&s, 4).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    fake().fail("cuStreamQuery", status, 1, times);
    drop(comm);
    fake().reset();
    println!(
        "abort={} destroy={} live={}",
        nccl().calls("ncclCommAbort"),
        nccl().calls("ncclCommDestroy"),
        nccl().live()
    );
}

// ---- drop -------------------------------------------------------------------

fn drop_finalizes_then_destroys() {
    reset();
    // A new stream per step: the communicator does not keep them all.
    {
        let (comm, s) = one_rank(&CommConfig::new());
        let mut b = DeviceBuffer::<f32>::alloc(&s, 4).unwrap();
        let before = fake().live(metrale_fakecuda::Live::Streams);
        for _ in 0..100 {
            let step = CudaStream::new(comm.context()).unwrap();
            comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &step)
                .unwrap();
        }
        let held = fake().live(metrale_fakecuda::Live::Streams) - before;
        assert!((1..=9).contains(&held), "{held} streams held");
    }
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut b = DeviceBuffer::<f32>::alloc(&s, 4).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    assert_eq!(nccl().live(), 1);
    drop(comm);
    assert_eq!(nccl().calls("ncclCommFinalize"), 1);
    assert_eq!(nccl().calls("ncclCommDestroy"), 1);
    assert_eq!(nccl().calls("ncclCommAbort"), 0);
    assert_eq!(nccl().live(), 0);
    assert_eq!(nccl().would_hang(), 0);
    // Non-blocking: finalize reports in progress, polled, then destroy.
    nccl().set_inprogress_polls(2);
    let (comm, _s) = one_rank(&CommConfig::new().blocking(false));
    drop(comm);
    assert_eq!(nccl().calls("ncclCommDestroy"), 2);
    assert_eq!(nccl().live(), 0);
}

fn child_output(name: &str, env: &[(&str, &str)]) -> (bool, String, String) {
    let out = harness::run_child(name, env);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn drop_past_the_bound_aborts_with_one_line() {
    for (child, what) in [
        ("drop_pending_blocking", "blocking"),
        ("drop_pending_non_blocking", "non-blocking"),
    ] {
        let (ok, stdout, stderr) = child_output(child, &[]);
        assert!(ok, "{what}: {stdout}{stderr}");
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("metrale:"))
            .collect();
        assert_eq!(lines.len(), 1, "{what}: {stderr}");
        assert!(
            lines[0].starts_with("metrale: NCCL communicator (rank 0 of 1, device 0): work (ncclAllReduce) or finalize had not completed after "),
            "{what}: {stderr}"
        );
        assert!(
            lines[0].ends_with(" (drop timeout 50ms); aborted"),
            "{what}: {stderr}"
        );
        assert!(
            stdout.contains("abort=1 finalize_would_hang=0 live=0"),
            "{what}: {stdout}"
        );
    }
}

fn drop_pending(config: CommConfig) {
    let config = config.drop_timeout(Duration::from_millis(50));
    let (comm, s) = one_rank(&config);
    let mut b = DeviceBuffer::<f32>::alloc(&s, 4).unwrap();
    nccl().set_hang(true);
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    drop(comm);
    println!(
        "abort={} finalize_would_hang={} live={}",
        nccl().calls("ncclCommAbort"),
        nccl().would_hang(),
        nccl().live()
    );
    s.synchronize().unwrap();
}

fn drop_after_teardown_is_silent() {
    let (ok, stdout, stderr) = child_output("drop_after_shutdown", &[]);
    assert!(ok, "{stdout}{stderr}");
    assert!(!stderr.contains("metrale:"), "{stderr}");
    assert!(stdout.contains("finalize=0 destroy=0 abort=0"), "{stdout}");
}

fn missing_library_and_missing_symbol() {
    let (ok, stdout, stderr) = child_output(
        "missing",
        &[("METRALE_LIBNCCL_PATH", "/nonexistent/libnccl.so.2")],
    );
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains("could not load the NCCL library; tried `/nonexistent/libnccl.so.2`: "),
        "{stdout}"
    );
    assert!(
        stdout.contains("set METRALE_LIBNCCL_PATH to the library file"),
        "{stdout}"
    );
    // A library that is not NCCL: every function missing, named.
    let not_nccl = metrale_fakecuda::library_path().display().to_string();
    let (ok, stdout, stderr) = child_output("missing", &[("METRALE_LIBNCCL_PATH", &not_nccl)]);
    assert!(ok, "{stdout}{stderr}");
    assert!(
        stdout.contains("the loaded NCCL library does not export `ncclGetUniqueId` (its version is unknown: it does not say)"),
        "{stdout}"
    );
}

fn main() -> ExitCode {
    if std::env::var_os("METRALE_TEST_CHILD").is_none() {
        std::env::set_var("METRALE_LIBCUDA_PATH", metrale_fakecuda::library_path());
        std::env::set_var(
            "METRALE_LIBNCCL_PATH",
            metrale_fakecuda::nccl_library_path(),
        );
    }
    macro_rules! tests {
        ($($f:ident),* $(,)?) => { vec![$(harness::Test { name: stringify!($f), run: $f }),*] };
    }
    #[allow(unused_mut)]
    let mut tests = tests![
        id_bytes_and_text,
        all_reduce_every_type,
        all_reduce_every_op,
        broadcast_reduce_gather_scatter,
        send_and_recv_between_threads,
        one_rank_every_collective_and_slices,
        init_all_and_a_group_on_one_thread,
        split_by_color_and_key,
        lengths_roots_and_devices_are_refused_before_nccl,
        errors_name_the_call_status_text_and_communicator,
        async_errors_abort_and_refuse_later_calls,
        non_blocking_in_progress_is_polled_to_completion,
        wait_times_out_names_the_operation_and_aborts,
        wait_is_refused_on_another_device_and_inside_a_capture,
        collectives_capture_without_host_sync,
        drop_finalizes_then_destroys,
        drop_past_the_bound_aborts_with_one_line,
        drop_after_teardown_is_silent,
        missing_library_and_missing_symbol,
        group_defers_frees_and_refuses_unlisted_communicators,
        a_communicator_made_in_a_group_waits_for_its_end,
        nested_groups_and_ranges_wait_for_the_outermost_end,
        split_inside_a_group_is_refused,
        nccl_comm_blocking_overrides_the_config,
        shared_split_and_parent_take_turns,
        comm_name_outlives_the_init_call,
        nccl_calls_are_refused_in_a_host_function,
        huge_timeouts_do_not_panic,
        group_settles_every_listed_communicator,
        an_abort_inside_a_group_waits_for_its_end,
        a_wait_inside_a_group_is_refused,
        ranks_of_one_group_must_agree,
        timeouts_are_bounds_when_the_abort_blocks,
        drop_is_bounded_when_the_abort_blocks,
        drop_retries_a_transient_query_failure,
    ];
    tests.extend(buffers_and_faults::tests());
    tests.extend(round5::tests());
    tests.extend(audit6::tests());
    #[cfg(feature = "half")]
    tests.push(harness::Test {
        name: "all_reduce_half_types",
        run: all_reduce_half_types,
    });
    let mut children = vec![
        harness::Child {
            name: "drop_pending_blocking",
            run: || drop_pending(CommConfig::new()),
        },
        harness::Child {
            name: "drop_pending_non_blocking",
            run: || drop_pending(CommConfig::new().blocking(false)),
        },
        harness::Child {
            name: "drop_after_shutdown",
            run: || {
                let (comm, _s) = one_rank(&CommConfig::new());
                fake().shutdown(true);
                drop(comm);
                println!(
                    "finalize={} destroy={} abort={}",
                    nccl().calls("ncclCommFinalize"),
                    nccl().calls("ncclCommDestroy"),
                    nccl().calls("ncclCommAbort")
                );
            },
        },
        harness::Child {
            name: "drop_abort_blocks",
            run: drop_abort_blocks,
        },
        harness::Child {
            name: "drop_query_transient",
            run: || drop_query(2, Some(3)),
        },
        harness::Child {
            name: "drop_query_fault",
            run: || drop_query(700, None),
        },
        harness::Child {
            name: "blocking_env_0",
            run: blocking_env_0,
        },
        harness::Child {
            name: "blocking_env_1",
            run: blocking_env_1,
        },
        harness::Child {
            name: "missing",
            run: || match NcclId::new() {
                Ok(_) => println!("loaded?"),
                Err(e) => println!("{e}"),
            },
        },
    ];
    children.extend(buffers_and_faults::children());
    let gate = || match metrale_runtime::sys::nccl::nccl() {
        Ok(l) if l.path().contains("metrale_fakenccl") => Ok(()),
        Ok(l) => Err(format!(
            "METRALE_LIBNCCL_PATH names {}, not the stand-in",
            l.path()
        )),
        Err(e) => Err(e.to_string()),
    };
    harness::main(
        &tests,
        &children,
        gate,
        Some("the stand-in NCCL (always required here)"),
    )
}
