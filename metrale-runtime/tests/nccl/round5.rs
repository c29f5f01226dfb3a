//! Issue 40 (soundness, round 5), the NCCL items, against the stand-in NCCL:
//! a deregistration behind a collective on a stream the communicator forgot
//! (item 3), a failed revoke (item 5), and the registrations of item 13
//! (after `shrink`, under a graph that captured a collective through one).
//! `defect_*`: failed on the code of the round; `held_*`: attacks that held.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use metrale_runtime::nccl::{
    CommConfig, Communicator, NcclBuffer, NcclError, NcclId, OnFailure, ReduceOp,
};
use metrale_runtime::{CudaStream, DeviceBuffer};

use super::{ctx, harness, nccl, one_rank, refusal, reset};

/// Item 3. A collective queued through a registration on a stream whose only
/// handle is then the communicator's, behind work that does not finish (the
/// stand-in's hang), then eight other streams used: the communicator kept at
/// most eight streams and let go of those only it held, busy or not, so the
/// deregistration waited for none of the collective's work and called
/// `ncclCommDeregister` at once. A busy stream is kept now: the
/// deregistration waits for it (bounded by the drop timeout) and refuses.
fn defect_deregistration_behind_a_collective_on_a_forgotten_stream() {
    reset();
    let config = CommConfig::new().drop_timeout(Duration::from_millis(50));
    let (comm, s) = one_rank(&config);
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 8).unwrap();
    let mut reg = comm.register(&mut buf).unwrap();
    nccl().set_hang(true);
    {
        let busy = CudaStream::new(comm.context()).unwrap();
        comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &busy)
            .unwrap();
        assert!(!busy.query().unwrap(), "the collective is still queued");
    }
    nccl().set_hang(false);
    for _ in 0..8 {
        let other = CudaStream::new(comm.context()).unwrap();
        let mut b = DeviceBuffer::<f32>::alloc(&other, 4).unwrap();
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &other)
            .unwrap();
        other.synchronize().unwrap();
    }
    let (reg, e) = match reg.deregister() {
        Ok(()) => panic!(
            "deregistered with the collective still queued ({} ncclCommDeregister)",
            nccl().calls("ncclCommDeregister")
        ),
        Err(back) => back,
    };
    assert!(refusal(&e).contains("work the communicator queued"), "{e}");
    assert_eq!(nccl().calls("ncclCommDeregister"), 0);
    assert_eq!(nccl().registrations(), 1);
    // Stopping the work lets everything go.
    comm.abort();
    s.synchronize().unwrap();
    drop(reg);
    drop(buf);
    drop(comm);
    assert_eq!(nccl().registrations(), 0);
}

/// Item 3, the other side: streams whose work finished are still let go of
/// (the list does not grow with a new stream per step), and a registration
/// then deregisters at once.
fn held_finished_streams_are_still_forgotten() {
    reset();
    let (comm, _s) = one_rank(&CommConfig::new());
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 8).unwrap();
    let mut reg = comm.register(&mut buf).unwrap();
    for _ in 0..100 {
        let other = CudaStream::new(comm.context()).unwrap();
        comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &other)
            .unwrap();
        other.synchronize().unwrap();
    }
    let live = nccl_streams_live();
    assert!(live <= 10, "{live} streams kept alive by the communicator");
    reg.deregister().unwrap();
    assert_eq!(nccl().calls("ncclCommDeregister"), 1);
}

/// Streams still alive in the stand-in driver.
fn nccl_streams_live() -> i32 {
    super::fake().live(metrale_fakecuda::Live::Streams)
}

/// Item 5. `ncclCommRevoke` fails: the communicator was marked revoked before
/// the call, so `is_revoked()` said true and a second `revoke()` returned `Ok`
/// without calling NCCL, while the work went on. Now a failed revoke leaves
/// it unrevoked (usable), and the second calls NCCL again.
fn defect_a_failed_revoke_reads_as_revoked() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    nccl().fail("ncclCommRevoke", 3, 1, Some(1)); // ncclInternalError, once
    let e = comm.revoke().unwrap_err();
    let text = e.to_string();
    assert!(text.contains("ncclCommRevoke"), "{text}");
    assert!(text.contains("ncclInternalError"), "{text}");
    assert!(!comm.is_revoked(), "a failed revoke reads as revoked");
    assert!(!comm.is_aborted());
    // Still usable: not revoked.
    let mut b = DeviceBuffer::<f32>::alloc(&s, 4).unwrap();
    comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &s).unwrap();
    s.synchronize().unwrap();
    comm.revoke().unwrap();
    assert_eq!(
        nccl().calls("ncclCommRevoke"),
        2,
        "the second revoke called NCCL"
    );
    assert!(comm.is_revoked());
    comm.revoke().unwrap(); // a third: nothing
    assert_eq!(nccl().calls("ncclCommRevoke"), 2);
}

/// Item 6. An NCCL buffer dropped behind a collective that never completes (a
/// dead peer; here the stand-in's hang, with its `cuCtxSynchronize` waiting
/// for NCCL's work as the driver does): its free waited for the device's
/// work (`cuCtxSynchronize` before `ncclMemFree`) without a bound. Now the
/// Drop returns at its drop timeout, with one line on stderr, and a helper
/// thread frees the memory once the work ends (here: the abort).
fn defect_nccl_buffer_dropped_behind_a_collective_that_never_completes() {
    reset();
    super::fake().set_ctx_sync_waits_holds(true);
    let (comm, s) = one_rank(&CommConfig::new());
    let before = nccl().mem_live();
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 8).unwrap();
    buf.set_drop_timeout(Duration::from_millis(100));
    nccl().set_hang(true);
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s)
        .unwrap();
    nccl().set_hang(false);
    let (tx, rx) = std::sync::mpsc::channel();
    let dropper = std::thread::spawn(move || {
        let t = Instant::now();
        drop(buf);
        let _ = tx.send(t.elapsed());
    });
    let took = rx.recv_timeout(Duration::from_secs(3));
    // Whatever happened, end the collective so that everything can go.
    comm.abort();
    dropper.join().unwrap();
    let took = took.expect("the NCCL buffer's drop blocked behind a collective that never ends");
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_secs(2),
        "the drop took {took:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while nccl().mem_live() > before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        nccl().mem_live(),
        before,
        "freed by the helper once the work ended"
    );
    s.synchronize().unwrap();
    drop(comm);
}

/// Item 6, the other side: with no work in the way the helper frees the
/// buffer before the drop returns.
fn held_nccl_buffer_dropped_when_idle_is_freed_before_the_drop_returns() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let before = nccl().mem_live();
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 8).unwrap();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &s)
        .unwrap();
    s.synchronize().unwrap();
    drop(buf);
    assert_eq!(nccl().mem_live(), before);
    drop(comm);
}

/// Item 13. Registrations of a communicator that was revoked and shrunk
/// after a peer died: the parent's registration is refused by the parent
/// (revoked), works as device memory in the shrunk communicator's
/// collectives (which have their own registrations), and deregisters with the
/// parent once; nothing is left registered.
fn held_registrations_used_after_shrink() {
    reset();
    let id = NcclId::new().unwrap();
    let queued = Arc::new(Barrier::new(2));
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let queued = Arc::clone(&queued);
            std::thread::spawn(move || {
                let c = ctx(rank);
                let comm = Communicator::init_rank(&id, 2, rank, &c, &CommConfig::new()).unwrap();
                let s = CudaStream::new(&c).unwrap();
                if rank == 1 {
                    queued.wait();
                    nccl().kill(comm.raw().cast());
                    comm.abort();
                    return None;
                }
                let mut buf = NcclBuffer::<f32>::alloc(&c, 4).unwrap();
                s.copy_h2d(&[1.0f32, 2.0, 3.0, 4.0], &mut buf).unwrap();
                let mut reg = comm.register(&mut buf).unwrap();
                comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &s)
                    .unwrap();
                queued.wait();
                let e = comm
                    .wait_with(&s, Duration::from_secs(5), OnFailure::Revoke)
                    .unwrap_err();
                assert!(comm.is_revoked(), "{e}");
                // The parent refuses it now.
                let e = comm
                    .all_reduce_in_place(&mut reg, ReduceOp::Sum, &s)
                    .unwrap_err();
                assert!(
                    matches!(e.as_nccl(), Some(NcclError::Revoked { .. })),
                    "{e}"
                );
                let small = comm.shrink(&[1], &CommConfig::new()).unwrap();
                // Device memory to the shrunk communicator, with a
                // registration of its own beside the parent's.
                small
                    .all_reduce_in_place(&mut reg, ReduceOp::Sum, &s)
                    .unwrap();
                small.wait(&s, Duration::from_secs(5)).unwrap();
                let mut other = NcclBuffer::<f32>::alloc(&c, 4).unwrap();
                let own = small.register(&mut other).unwrap();
                assert_eq!(small.registered_bytes(), 16);
                assert_eq!(comm.registered_bytes(), 16);
                drop(own);
                let got = s.to_vec(&*reg).unwrap();
                drop(reg);
                assert_eq!(comm.registered_bytes(), 0);
                drop(small);
                drop(buf);
                drop(other);
                drop(comm);
                Some(got)
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(out[0].is_some());
    assert_eq!(nccl().registrations(), 0, "every registration released");
    assert_eq!(nccl().calls("ncclCommDeregister"), 2);
    assert_eq!(nccl().live(), 0);
}

/// Item 13. A registration dropped while a graph that captured a collective
/// through it still lives: registering and deregistering are refused during
/// the capture, and allowed after it (a guard borrows its buffer and
/// communicator, so a graph cannot hold it). Replaying that graph after the
/// deregistration is the caller's contract (`CudaGraphExec::launch`'s
/// safety section names the registrations and windows); safe code cannot
/// replay it, and the drops in any order leave nothing registered.
fn held_registration_dropped_while_a_graph_that_captured_through_it_lives() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 8).unwrap();
    let mut reg = comm.register(&mut buf).unwrap();
    s.synchronize().unwrap();
    let graph = s
        .capture(|cs| comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, cs))
        .unwrap();
    let exec = graph.instantiate().unwrap();
    reg.deregister().unwrap();
    assert_eq!(nccl().calls("ncclCommDeregister"), 1);
    assert_eq!(nccl().registrations(), 0);
    drop(exec);
    drop(graph);
    drop(buf);
    drop(comm);
    assert_eq!(nccl().live(), 0);
}

/// Item 9's stress, a finding of its own: a deregistration asks whether the
/// communicator's work on its streams passed (`cuStreamQuery`) after its
/// capture check, so a capture another thread began on one of those
/// streams in between was invalidated by the query (the rule: never query a
/// capturing stream). Forced here: the deregistration stops at the query,
/// another thread begins a capture on the stream, the query goes on. The
/// query is made inside a section of the stream now, so the capture begins
/// after it, and ends whole.
fn defect_a_deregistration_query_invalidates_another_threads_capture() {
    reset();
    let (comm, s) = one_rank(&CommConfig::new());
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 8).unwrap();
    let mut reg = comm.register(&mut buf).unwrap();
    comm.all_reduce_in_place(&mut reg, ReduceOp::Sum, &s)
        .unwrap();
    s.synchronize().unwrap();
    let deregistered = nccl().calls("ncclCommDeregister");
    let f = super::fake();
    f.pause_next("cuStreamQuery");
    let (captured, paused) = std::thread::scope(|sc| {
        let capturer = sc.spawn(|| {
            if !f.wait_paused("cuStreamQuery", 2000) {
                f.resume("cuStreamQuery");
                return (None, false);
            }
            // The capture begins while the query waits (or, fixed, once the
            // query's section ends); the query is let go meanwhile.
            let resumer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                super::fake().resume("cuStreamQuery");
            });
            let graph = s.capture(|_| {
                std::thread::sleep(Duration::from_millis(300));
                Ok(())
            });
            let _ = resumer.join();
            (Some(graph.map(drop).map_err(|e| e.to_string())), true)
        });
        drop(reg);
        capturer.join().unwrap()
    });
    assert!(paused, "the deregistration never queried its stream");
    let captured = captured.unwrap();
    assert!(
        captured.is_ok(),
        "the capture was invalidated by the deregistration's query: {captured:?}"
    );
    assert_eq!(
        nccl().calls("ncclCommDeregister"),
        deregistered + 1,
        "deregistered once the query said the stream was idle"
    );
    s.synchronize().unwrap();
    drop(buf);
    drop(comm);
    assert_eq!(nccl().live(), 0);
}

/// The tests of this file.
pub(super) fn tests() -> Vec<harness::Test> {
    macro_rules! tests {
        ($($f:ident),* $(,)?) => { vec![$(harness::Test { name: stringify!($f), run: $f }),*] };
    }
    tests![
        defect_deregistration_behind_a_collective_on_a_forgotten_stream,
        held_finished_streams_are_still_forgotten,
        defect_a_failed_revoke_reads_as_revoked,
        defect_nccl_buffer_dropped_behind_a_collective_that_never_completes,
        held_nccl_buffer_dropped_when_idle_is_freed_before_the_drop_returns,
        held_registrations_used_after_shrink,
        held_registration_dropped_while_a_graph_that_captured_through_it_lives,
        defect_a_deregistration_query_invalidates_another_threads_capture,
    ]
}
