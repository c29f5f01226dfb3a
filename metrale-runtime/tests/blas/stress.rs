//! Issue 40, item 9: the mixed stress with captures on shared streams. Threads
//! share three streams of one device: batched copies of stream-ordered
//! buffers (used on a second stream too), capture-arena captures and
//! replays, cuBLASLt GEMMs eagerly and inside captures, NCCL all-reduces
//! (alone and in groups) and registered NCCL buffers (feature `nccl`), and
//! empty captures of the shared streams by other threads, so every kind of
//! operation meets a stream that another thread is capturing. After the
//! threads stop, every stream is synchronised and everything dropped: no
//! device allocation, user object, graph or deferred free may be left. Each
//! run is bounded (its threads stop at a deadline); several runs are made,
//! since the leak showed in one of two.
//!
//! The leak did not show here (see each test's runs). Reading the retry
//! path found how frees deferred behind captures could be left for good: a
//! retry asked whether its jobs were still blocked *before* handing them
//! back to the list, so a capture that ended between the answer and the
//! push retried a list without them, and nothing retried them afterwards
//! (a synchronisation's drain retried deferred releases only when
//! something had been dropped later too). The stress also found that a
//! registration's deregistration queried its streams outside a section,
//! invalidating a capture another thread began meanwhile
//! (`tests/nccl/round5.rs`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use metrale_fakecuda::Live;
use metrale_runtime::blas::{BlasLt, MatmulDesc};
use metrale_runtime::{BatchCopy, CaptureArena, CudaStream, DeviceBuffer, MetraleError};

use super::{ctx, fake, reset};

/// What each kind of thread got done, and how often a capture refused it.
#[derive(Default)]
struct Counts {
    copies: AtomicUsize,
    replays: AtomicUsize,
    gemms: AtomicUsize,
    captured_gemms: AtomicUsize,
    collectives: AtomicUsize,
    captures: AtomicUsize,
    refused: AtomicUsize,
}

/// A refusal by a capture (or a driver status), which the stress allows;
/// anything else (an error that names nothing) fails it.
fn allowed(e: &MetraleError, refused: &AtomicUsize) {
    let text = e.to_string();
    assert!(
        text.contains("captur") || text.contains(" failed: ") || text.contains("refused"),
        "an error that names nothing: {text}"
    );
    refused.fetch_add(1, Ordering::Relaxed);
}

/// One bounded run of `run_for`; what is left afterwards, as
/// "device memory, user objects, graphs, executables, deferred frees" above
/// what was there before.
fn one_run(run_for: Duration) -> (String, Counts) {
    let c0 = ctx(0);
    c0.synchronize().unwrap();
    let before = (
        fake().live(Live::DeviceMemory),
        fake().user_objects(),
        fake().live(Live::Graphs),
        fake().live(Live::Execs),
    );
    let streams = [
        CudaStream::new(&c0).unwrap(),
        CudaStream::new(&c0).unwrap(),
        CudaStream::new(&c0).unwrap(),
    ];
    let lt = BlasLt::new(&c0).unwrap();
    for s in &streams {
        lt.prepare(s).unwrap();
    }
    let plan = lt
        .plan(&MatmulDesc::new::<f32, f32, f32, f32>(4, 4, 4))
        .unwrap();
    let counts = Counts::default();
    let stop = AtomicBool::new(false);
    let deadline = Instant::now() + run_for;
    std::thread::scope(|t| {
        // Batched copies: stream-ordered buffers made on one shared stream,
        // read back through another (a foreign use), dropped.
        for w in 0..2usize {
            let (streams, stop, counts) = (&streams, &stop, &counts);
            t.spawn(move || {
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let (s, peer) = (&streams[i % 3], &streams[(i + 1) % 3]);
                    let values: Vec<u32> = (0..64u32).map(|k| k ^ i as u32).collect();
                    let result = (|| -> metrale_runtime::Result<()> {
                        let mut a = s.alloc::<u32>(64)?;
                        let mut b = s.alloc::<u32>(64)?;
                        s.copy_batch([BatchCopy::h2d(&values, &mut a)])?;
                        s.copy_batch([BatchCopy::d2d(&a, &mut b)])?;
                        drop(a);
                        let mut out = vec![0u32; 64];
                        peer.copy_batch([BatchCopy::d2h(&b, &mut out)])?;
                        assert_eq!(out, values, "a copy landed after its call returned");
                        Ok(())
                    })();
                    match result {
                        Ok(()) => {
                            counts.copies.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => allowed(&e, &counts.refused),
                    }
                }
            });
        }
        // Arena captures (a GEMM over arena memory) on the shared streams,
        // replayed on them.
        {
            let (streams, stop, counts, plan, c0) = (&streams, &stop, &counts, &plan, &c0);
            t.spawn(move || {
                let mut arena = CaptureArena::new(c0, 1 << 16).unwrap();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let s = &streams[i % 3];
                    let result = (|| -> metrale_runtime::Result<()> {
                        let exec = {
                            let a = arena.take::<f32>(16)?;
                            let c = arena.take::<f32>(16)?;
                            let mut d = arena.take::<f32>(16)?;
                            let graph = arena
                                .capture(s, |s| plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d))?;
                            graph.instantiate()?
                        };
                        let replay_on = &streams[(i + 2) % 3];
                        // SAFETY: the graph touches only arena memory and
                        // the stream's workspace, which the executable and
                        // its replays hold.
                        unsafe { exec.launch(replay_on)? };
                        // SAFETY: as above.
                        unsafe { exec.launch(s)? };
                        counts.replays.fetch_add(2, Ordering::Relaxed);
                        Ok(())
                    })();
                    if let Err(e) = result {
                        allowed(&e, &counts.refused);
                    }
                    // Refused while replays hold it; fine.
                    if i.is_multiple_of(8) {
                        let _ = arena.reset();
                    }
                }
            });
        }
        // GEMMs: eager on the shared streams, and captured and replayed.
        for w in 0..2usize {
            let (streams, stop, counts, plan, c0) = (&streams, &stop, &counts, &plan, &c0);
            t.spawn(move || {
                // Alive until after the final synchronisation: replays use them.
                let a = DeviceBuffer::<f32>::alloc(c0, 16).unwrap();
                let c = DeviceBuffer::<f32>::alloc(c0, 16).unwrap();
                let mut d = DeviceBuffer::<f32>::alloc(c0, 16).unwrap();
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let s = &streams[i % 3];
                    let result = if i.is_multiple_of(2) {
                        plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d)
                            .map(|()| counts.gemms.fetch_add(1, Ordering::Relaxed))
                    } else {
                        (|| -> metrale_runtime::Result<usize> {
                            let graph =
                                s.capture(|s| plan.matmul(s, 1.0, &a, &a, 0.0, &c, &mut d))?;
                            let exec = graph.instantiate()?;
                            drop(graph);
                            // SAFETY: A, C and D live until after the final
                            // synchronisation; the workspace is held by the
                            // executable.
                            unsafe { exec.launch(&streams[(i + 1) % 3])? };
                            Ok(counts.captured_gemms.fetch_add(1, Ordering::Relaxed))
                        })()
                    };
                    if let Err(e) = result {
                        allowed(&e, &counts.refused);
                    }
                    // A stream-ordered operand made and dropped on a shared stream.
                    if let Ok(x) = s.alloc::<f32>(16) {
                        let _ = plan.matmul(s, 1.0, &x, &a, 0.0, &c, &mut d);
                        drop(x);
                    }
                }
                (a, c, d)
            });
        }
        // NCCL all-reduces on the shared streams, alone and in groups.
        #[cfg(feature = "nccl")]
        {
            let (streams, stop, counts, c0) = (&streams, &stop, &counts, &c0);
            t.spawn(move || {
                use metrale_runtime::{group, CommConfig, Communicator, NcclId, ReduceOp};
                let id = NcclId::new().unwrap();
                let comm = Communicator::init_rank(&id, 1, 0, c0, &CommConfig::new()).unwrap();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let s = &streams[i % 3];
                    let result = (|| -> metrale_runtime::Result<()> {
                        let mut b = s.alloc::<f32>(64)?;
                        if i.is_multiple_of(2) {
                            comm.all_reduce_in_place(&mut b, ReduceOp::Sum, s)?;
                        } else {
                            group(&[&comm], || {
                                comm.all_reduce_in_place(&mut b, ReduceOp::Sum, s)
                            })?;
                        }
                        drop(b);
                        if i % 4 == 1 {
                            // An NCCL buffer, registered, reduced through.
                            let mut nb = metrale_runtime::nccl::NcclBuffer::<f32>::alloc(c0, 64)?;
                            let mut reg = comm.register(&mut nb)?;
                            comm.all_reduce_in_place(&mut *reg, ReduceOp::Sum, s)?;
                            drop(reg);
                            drop(nb);
                        }
                        Ok(())
                    })();
                    match result {
                        Ok(()) => {
                            counts.collectives.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => allowed(&e, &counts.refused),
                    }
                }
                for s in streams {
                    let _ = s.synchronize();
                }
                drop(comm);
            });
        }
        // Captures of the shared streams by threads that queue nothing.
        for w in 0..2usize {
            let (streams, stop, counts) = (&streams, &stop, &counts);
            t.spawn(move || {
                let mut i = w;
                while Instant::now() < deadline {
                    i += 1;
                    match streams[i % 3].capture(|_| {
                        std::thread::yield_now();
                        Ok(())
                    }) {
                        Ok(g) => {
                            drop(g);
                            counts.captures.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => allowed(&e, &counts.refused),
                    }
                }
                stop.store(true, Ordering::Relaxed);
            });
        }
    });
    for s in &streams {
        s.synchronize().unwrap();
    }
    drop(plan);
    drop(lt);
    drop(streams);
    let dropped = (
        fake().live(Live::DeviceMemory) - before.0,
        metrale_runtime::deferred_frees(),
    );
    c0.synchronize().unwrap();
    let left = format!(
        "at the drops: device memory {} deferred {}; then device memory {}, user objects {}, graphs {}, executables {}, deferred frees {}",
        dropped.0,
        dropped.1,
        fake().live(Live::DeviceMemory) - before.0,
        fake().user_objects() - before.1,
        fake().live(Live::Graphs) - before.2,
        fake().live(Live::Execs) - before.3,
        metrale_runtime::deferred_frees(),
    );
    (left, counts)
}

/// The stress, run `METRALE_STRESS_RUNS` times (default 6) of
/// `METRALE_STRESS_MS` milliseconds each (default 1000): nothing may be left
/// after any run. Held on the code before the fix: 43 runs of 1.5 s and 12
/// of 1 s (hundreds to tens of thousands of operations of each kind per
/// run; in 6 of the 1 s runs the arena captured memsets, which the stand-in
/// cannot capture, so those replayed almost nothing), every one leaving 0
/// device allocations, user objects, graphs, executables and deferred
/// frees; and after it, 6 runs of 5 s and the default runs.
pub fn held_mixed_stress_with_captures_on_shared_streams() {
    reset();
    let runs: usize = std::env::var("METRALE_STRESS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let ms: u64 = std::env::var("METRALE_STRESS_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let clean = "at the drops: device memory 0 deferred 0; then device memory 0, user objects 0, graphs 0, executables 0, deferred frees 0";
    let mut leaks = Vec::new();
    for run in 0..runs {
        let (left, n) = one_run(Duration::from_millis(ms));
        let g = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        eprintln!(
            "    run {run}: {} copy rounds, {} replays, {} GEMMs + {} captured, {} collectives, \
             {} captures, {} refused; left: {left}",
            g(&n.copies),
            g(&n.replays),
            g(&n.gemms),
            g(&n.captured_gemms),
            g(&n.collectives),
            g(&n.captures),
            g(&n.refused),
        );
        assert!(g(&n.copies) > 0 && g(&n.captures) > 0 && g(&n.gemms) > 0);
        if left != clean {
            leaks.push(format!("run {run}: {left}"));
        }
    }
    assert!(leaks.is_empty(), "left after runs: {leaks:?}");
}

/// One round of the deferred-free race: `droppers` threads drop
/// stream-ordered buffers of shared streams that `capturers` threads keep
/// capturing (so most frees are deferred and retried at the captures'
/// ends, by whichever thread ends one), while another thread keeps the
/// list's lock busy. After every thread stopped no capture is in progress,
/// so nothing may still be deferred, before any synchronisation, and
/// nothing may be left after one. Returns (frees deferred at the end,
/// device allocations left after a synchronize, drops).
fn deferred_free_round(run_for: Duration) -> (usize, i32, usize) {
    let c0 = ctx(0);
    c0.synchronize().unwrap();
    let before = fake().live(Live::DeviceMemory);
    let streams = [
        CudaStream::new(&c0).unwrap(),
        CudaStream::new(&c0).unwrap(),
        CudaStream::new(&c0).unwrap(),
    ];
    let stop = AtomicBool::new(false);
    let drops = AtomicUsize::new(0);
    let ended = AtomicUsize::new(0);
    let deadline = Instant::now() + run_for;
    std::thread::scope(|t| {
        for w in 0..3usize {
            let (streams, stop, drops) = (&streams, &stop, &drops);
            t.spawn(move || {
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    // Made outside any capture of its stream (refused inside).
                    if let Ok(b) = streams[i % 3].alloc::<u8>(16) {
                        drop(b);
                        drops.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        {
            let stop = &stop;
            t.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::black_box(metrale_runtime::deferred_frees());
                }
            });
        }
        let ended = &ended;
        for w in 0..3usize {
            let (streams, stop) = (&streams, &stop);
            t.spawn(move || {
                let mut i = w;
                while Instant::now() < deadline {
                    i += 1;
                    let _ = streams[i % 3].capture(|_| Ok(()));
                }
                if ended.fetch_add(1, Ordering::SeqCst) == 2 {
                    stop.store(true, Ordering::Relaxed);
                }
            });
        }
    });
    let deferred = metrale_runtime::deferred_frees();
    for s in &streams {
        s.synchronize().unwrap();
    }
    drop(streams);
    c0.synchronize().unwrap();
    let left = fake().live(Live::DeviceMemory) - before;
    (deferred, left, drops.into_inner())
}

/// Item 9's leak, narrowed: frees deferred behind captures on shared
/// streams, retried at the captures' ends on several threads at once; once
/// the last capture ended nothing may still be deferred. `METRALE_STRESS_RUNS`
/// rounds (default 10) of `METRALE_STRESS_MS` milliseconds (default 300).
/// Held on the code before the fix too (30 rounds of 300 ms, 99,000 to
/// 230,000 drops each): the window it looks for (between a retry's answer
/// and its push) is a few instructions wide.
pub fn held_deferred_frees_retried_as_captures_end_on_many_threads() {
    reset();
    let runs: usize = std::env::var("METRALE_STRESS_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let ms: u64 = std::env::var("METRALE_STRESS_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let mut bad = Vec::new();
    for run in 0..runs {
        let (deferred, left, drops) = deferred_free_round(Duration::from_millis(ms));
        eprintln!("    run {run}: {drops} drops; deferred at the end {deferred}, left {left}");
        if deferred != 0 || left != 0 {
            bad.push(format!("run {run}: {deferred} deferred, {left} left"));
        }
    }
    assert!(bad.is_empty(), "{bad:?}");
}
