//! Review 4 (adversarial, safe code only) of the batched copies, the capture
//! arena and its graph holds, and foreign device slices. `held_*`: attacks the
//! code withstood; `defect_*`: failing on the code reviewed, kept out of the
//! list so the suite stays green (see the report of branch wt-review4).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::common::*;
use crate::harness::Test;

/// `vec_add(a, a, c, n)` into the capture on `s`.
fn queue_add(
    reg: &MetraleRegistry,
    s: &CudaStream,
    a: &DeviceSliceMut<'_, f32>,
    c: &mut DeviceSliceMut<'_, f32>,
    n: u32,
) -> Result<()> {
    let cfg = LaunchConfig::for_num_elems(n as usize, 256)?;
    let src = a.slice(..)?;
    // SAFETY: the stand-in only records the arguments.
    unsafe { reg.launch(vec_add(reg), cfg, s, (&src, &src, &mut *c, n)) }
}

/// A batch with a host end, queued from inside a host function (where every
/// driver call is refused): it must come back with an error, as `copy_h2d`
/// does there. On the code reviewed the refused batch call is followed by the
/// "wait even when it failed" path: the completion event cannot be recorded
/// (refused too), so `finish_raw` polls `cuStreamQuery`, which `cu!` refuses
/// with `InHostFunction` forever: the host function never returns and the
/// stream is wedged for good.
fn defect_batch_with_a_host_end_in_a_host_function_spins_forever() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream().clone();
    let dev = DeviceBuffer::from_host(&s, &[7u32; 16]).unwrap();
    // The single copy refuses and returns there (the contrast).
    let (tx, rx) = mpsc::channel::<(bool, bool)>();
    let s2 = s.clone();
    s.launch_host_fn(move || {
        let mut out = vec![0u32; 16];
        let single = s2.copy_d2h(&dev, &mut out).is_err();
        let batch = s2.copy_batch(&[BatchCopy::d2h(&dev, &mut out)]).is_err();
        let _ = tx.send((single, batch));
        drop(dev);
    })
    .unwrap();
    let got = rx.recv_timeout(Duration::from_secs(5));
    match got {
        Ok((single, batch)) => {
            assert!(single, "copy_d2h refused in a host function");
            assert!(batch, "copy_batch refused in a host function");
            s.synchronize().unwrap();
        }
        Err(_) => {
            // The host function spins; never touch the stream again.
            std::mem::forget(s);
            std::mem::forget(h);
            panic!("copy_batch inside a host function never returned (5 s)");
        }
    }
}

/// The completion event after a device-to-host batch cannot be recorded: the
/// stream is still finished before the error comes back (the write landed).
fn held_batch_whose_completion_record_fails_is_still_waited_for() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream();
    let dev = DeviceBuffer::from_host(s, &[9u32; 64]).unwrap();
    let mut out = vec![0u32; 64];
    fake().fail("cuEventRecord", 1, 1, Some(1));
    let r = s.copy_batch(&[BatchCopy::d2h(&dev, &mut out)]);
    assert!(r.is_err(), "the record's failure is reported");
    assert_eq!(fake().pending(raw(s)), 0, "no write left pending");
    assert_eq!(out, [9; 64], "the write landed before the return");
    // The batch call itself fails after queuing nothing, and the event too.
    fake().fail("cuMemcpyBatchAsync_v2", 1, 1, Some(1));
    fake().fail("cuEventRecord", 1, 1, Some(1));
    assert!(s.copy_batch(&[BatchCopy::d2h(&dev, &mut out)]).is_err());
    assert_eq!(fake().pending(raw(s)), 0);
}

/// A capture begun from another thread while a host batch is inside the
/// driver call: it waits until the batch (and its wait) is done; the batch is
/// not recorded into the graph.
fn held_capture_begun_during_a_host_batch_waits_for_it() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream().clone();
    let dev = DeviceBuffer::from_host(&s, &[3u32; 32]).unwrap();
    let dev = Arc::new(dev);
    fake().pause_next("cuMemcpyBatchAsync_v2");
    let (s1, d1) = (s.clone(), Arc::clone(&dev));
    let copier = std::thread::spawn(move || {
        let mut out = vec![0u32; 32];
        let r = s1.copy_batch(&[BatchCopy::d2h(&*d1, &mut out)]);
        (r.is_ok(), out)
    });
    assert!(fake().wait_paused("cuMemcpyBatchAsync_v2", 5000));
    let begun = Arc::new(AtomicBool::new(false));
    let (s2, b2) = (s.clone(), Arc::clone(&begun));
    let capturer = std::thread::spawn(move || {
        let g = s2.capture(|_| {
            b2.store(true, Ordering::SeqCst);
            Ok(())
        });
        g.map(|g| g.nodes().map(|n| n.len()))
    });
    std::thread::sleep(Duration::from_millis(200));
    let early = begun.load(Ordering::SeqCst);
    fake().resume("cuMemcpyBatchAsync_v2");
    let (ok, out) = copier.join().unwrap();
    let nodes = capturer.join().unwrap();
    assert!(
        !early,
        "the capture began while the batch was in the driver"
    );
    assert!(ok);
    assert_eq!(out, [3; 32]);
    assert_eq!(nodes.unwrap().unwrap(), 0, "nothing of the batch captured");
    assert_eq!(fake().pending(raw(&s)), 0);
}

/// Zero-length host pairs mixed with device-only pairs: a device-only batch
/// (no wait) even on a capturing stream; a live host pair in the same batch
/// refuses the whole batch there, before anything is queued.
fn held_zero_length_host_pairs_and_capture_refusal() {
    let reg = setup();
    let s = reg.stream();
    let a = DeviceBuffer::from_host(s, &[1u32; 8]).unwrap();
    let mut b = DeviceBuffer::<u32>::zeroed(s, 8).unwrap();
    let mut none = DeviceBuffer::<u32>::zeroed(s, 0).unwrap();
    let mut host = vec![0u32; 8];
    let empty: [u32; 0] = [];
    s.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let refused = s.copy_batch(&[BatchCopy::d2d(&a, &mut b), BatchCopy::d2h(&a, &mut host)]);
    let zero = s.copy_batch(&[BatchCopy::h2d(&empty, &mut none)]);
    let g = s.end_capture().unwrap();
    let e = refused.unwrap_err();
    assert!(e.to_string().contains("being captured"), "{e}");
    zero.unwrap();
    assert_eq!(
        g.nodes().unwrap().len(),
        0,
        "nothing of a refused batch captured"
    );
    assert_eq!(host, [0; 8]);
    drop(g);
    drop((a, b, none));
    done(reg);
}

/// A device end allocated on another stream (stream-ordered) in a
/// device-only batch: the batch's stream is noted, so the buffer's free waits
/// for it; mismatched lengths refused before the driver.
fn held_device_batch_of_another_streams_buffer() {
    fake().reset();
    let h = host(0).unwrap();
    let s1 = h.stream().clone();
    let s2 = CudaStream::new(&h).unwrap();
    let a = DeviceBuffer::from_host(&s1, &[5u16; 100]).unwrap();
    let mut b = DeviceBuffer::<u16>::zeroed(&s1, 100).unwrap();
    let mut short = DeviceBuffer::<u16>::zeroed(&s1, 99).unwrap();
    let calls = fake().calls("cuMemcpyBatchAsync_v2");
    assert!(s2.copy_batch(&[BatchCopy::d2d(&a, &mut short)]).is_err());
    assert_eq!(
        fake().calls("cuMemcpyBatchAsync_v2"),
        calls,
        "refused before the driver"
    );
    s2.copy_batch(&[BatchCopy::d2d(&a, &mut b)]).unwrap();
    drop(a);
    assert_eq!(fake().stale_uses(), 0);
    assert_eq!(s1.to_vec(&b).unwrap(), vec![5u16; 100]);
    drop((b, short));
    s2.synchronize().unwrap();
}

/// An executable updated from a graph of another arena takes that arena's
/// hold: the second arena cannot be reset, nor its memory freed, while the
/// executable (which now runs on its addresses) lives. (The update replaces
/// the driver's references, so the first arena, which the executable no
/// longer runs on, goes once its own handle does. The failed-keeper case of
/// this review lives in `arena.rs`, on the old driver, the one path that
/// still queues keepers.)
fn held_exec_updated_from_another_arenas_graph_holds_it() {
    let reg = setup();
    let s = reg.stream();
    let a = CaptureArena::new(s, 1 << 16).unwrap();
    let mut b = CaptureArena::new(s, 1 << 16).unwrap();
    let mut exec = {
        let x = a.take::<f32>(64).unwrap();
        let mut y = a.take::<f32>(64).unwrap();
        let g = a
            .capture(s, |s| queue_add(&reg, s, &x, &mut y, 64))
            .unwrap();
        g.instantiate().unwrap()
    };
    {
        let x = b.take::<f32>(64).unwrap();
        let mut y = b.take::<f32>(64).unwrap();
        let g = b
            .capture(s, |s| queue_add(&reg, s, &x, &mut y, 64))
            .unwrap();
        exec.update(&g).unwrap();
    }
    let e = b.reset().unwrap_err();
    assert!(e.to_string().contains("still use its addresses"), "{e}");
    let live = fake().live(Live::DeviceMemory);
    drop((a, b));
    s.synchronize().unwrap();
    assert_eq!(
        fake().live(Live::DeviceMemory),
        live - 1,
        "the second arena held by the executable, the first one released by the update"
    );
    // SAFETY: the stand-in records the launch only.
    unsafe { exec.launch(s) }.unwrap();
    s.synchronize().unwrap();
    drop(exec);
    assert_eq!(fake().live(Live::DeviceMemory), live - 2);
    done(reg);
}

/// Overlapping takes from many threads: disjoint, aligned, inside the arena.
fn held_concurrent_takes_are_disjoint() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream();
    let arena = CaptureArena::new(s, 1 << 20).unwrap();
    let mut spans: Vec<(u64, u64)> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|t| {
                let arena = &arena;
                sc.spawn(move || {
                    let mut v = Vec::new();
                    for i in 0..200usize {
                        match arena.take::<u8>(1 + (i * 7 + t) % 300) {
                            Ok(sl) => v.push((sl.device_ptr(), sl.device_ptr() + sl.len() as u64)),
                            Err(_) => break,
                        }
                    }
                    v
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    spans.sort();
    let base = spans[0].0;
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "overlap {w:?}");
    }
    for (start, end) in &spans {
        assert_eq!((start - base) % 256, 0);
        assert!(*end <= base + (1 << 20));
    }
    assert!(arena.take::<u64>(usize::MAX / 4).is_err());
}

/// A foreign view (from_raw over a buffer's memory): slices and chunks stay
/// inside it, out-of-range ranges refused.
fn held_foreign_views_stay_in_range() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream();
    let buf = DeviceBuffer::from_host(s, &(0..100u32).collect::<Vec<_>>()).unwrap();
    let base = buf.device_ptr();
    // SAFETY: 40 elements inside a live buffer that outlives the view.
    let mut v = unsafe { DeviceSliceMut::<u32>::from_raw_mut(s, base + 40 * 4, 40) }.unwrap();
    // SAFETY: as above; a zero-length view of a null address.
    let z = unsafe { DeviceSlice::<u32>::from_raw(s, 0, 0) }.unwrap();
    assert!(z.slice(0..1).is_err());
    assert_eq!(z.slice(..).unwrap().len(), 0);
    assert!(v.slice(..41).is_err());
    assert!(v.slice(41..).is_err());
    assert!(v.slice(usize::MAX..).is_err());
    #[allow(clippy::reversed_empty_ranges)]
    let rev = v.slice(5..4);
    assert!(rev.is_err());
    let end = base + 80 * 4;
    let mut total = 0;
    for c in v.chunks_mut(7) {
        assert!(c.device_ptr() + (c.len() * 4) as u64 <= end);
        total += c.len();
        let sub = c.slice(..).unwrap();
        assert!(sub.device_ptr() + (sub.len() * 4) as u64 <= end);
    }
    assert_eq!(total, 40);
    assert_eq!(v.chunks_mut(usize::MAX).count(), 1);
    let mut out = vec![0u32; 40];
    s.copy_batch(&[BatchCopy::d2h(&v, &mut out)]).unwrap();
    assert_eq!(out, (40..80).collect::<Vec<_>>());
    // Past the allocation refused at construction.
    // SAFETY: refused by the check (nothing is accessed).
    assert!(unsafe { DeviceSlice::<u32>::from_raw(s, base + 40 * 4, 100) }.is_err());
    drop(buf);
}

/// An element type aligned above the arena's 256 bytes (a `#[repr(C)]` type
/// without padding: a valid `DeviceRepr`).
#[repr(C, align(512))]
#[derive(Clone, Copy)]
struct Wide([u8; 512]);
// SAFETY: `#[repr(C)]`, 512 bytes of `u8`, no padding.
unsafe impl DeviceRepr for Wide {}

/// A take of a type aligned to 512 after a take of one byte: the view must be
/// aligned for its type (`DeviceSlice::from_raw` refuses a misaligned one).
/// On the code reviewed `take` aligns every take to 256 bytes only, so the
/// view starts 256 bytes into the arena: misaligned for `Wide`.
fn defect_arena_take_of_a_type_aligned_above_256_is_misaligned() {
    fake().reset();
    let h = host(0).unwrap();
    let s = h.stream();
    let arena = CaptureArena::new(s, 1 << 16).unwrap();
    // The stand-in's base is 256-aligned only: the view's address, not its
    // offset, must be aligned for the type.
    let first = arena.take::<u8>(1).unwrap().device_ptr();
    assert_eq!(first % 256, 0, "the arena's base is aligned (cuMemAlloc)");
    let w = arena.take::<Wide>(2).unwrap();
    let p = w.device_ptr();
    assert_eq!(
        p % std::mem::align_of::<Wide>() as u64,
        0,
        "a view of Wide at {p:#x} (offset {}) is misaligned",
        p - first
    );
}

/// Updating one bucket again and again (a serving loop's new argument each
/// step): the executable should hold the arena once. On the code reviewed
/// every update appends the new graph's hold (a fresh closure, never equal to
/// the ones held, so never deduplicated) and copies the whole list: after n
/// updates the executable holds the arena n + 1 times, growing without bound
/// (memory and an O(n) copy per update, and a replay's keeper list with it).
fn defect_repeated_updates_grow_the_executables_holds_without_bound() {
    let reg = setup();
    let s = reg.stream();
    let mut arena = CaptureArena::new(s, 1 << 16).unwrap();
    let buckets = {
        let x = arena.take::<f32>(64).unwrap();
        let mut y = arena.take::<f32>(64).unwrap();
        let mut b = GraphBuckets::capture(s, &arena, &[64], |s, n| {
            queue_add(&reg, s, &x, &mut y, n as u32)
        })
        .unwrap();
        for _ in 0..100 {
            b.update(s, &arena, 64, |s, n| {
                queue_add(&reg, s, &x, &mut y, n as u32)
            })
            .unwrap();
        }
        b
    };
    let e = arena.reset().unwrap_err().to_string();
    eprintln!("{e}");
    drop(buckets);
    s.synchronize().unwrap();
    arena.reset().unwrap();
    eprintln!("live before arena drop {}", fake().live(Live::DeviceMemory));
    drop(arena);
    eprintln!("live after arena drop {}", fake().live(Live::DeviceMemory));
    s.synchronize().unwrap();
    eprintln!("live after sync {}", fake().live(Live::DeviceMemory));
    assert!(
        e.contains(" 1 hold(s)"),
        "one executable alive, yet the arena counts: {e}"
    );
    done(reg);
}

/// The last holder of an arena (its executable) dropped inside a capture on
/// another stream of the thread: the capture is not broken by a free, and
/// the memory goes (after the capture), not leaked.
fn held_arena_last_holder_dropped_inside_a_capture() {
    let reg = setup();
    let s = reg.stream();
    let other = CudaStream::new(s).unwrap();
    let arena = CaptureArena::new(s, 1 << 16).unwrap();
    let exec = {
        let x = arena.take::<f32>(64).unwrap();
        let mut y = arena.take::<f32>(64).unwrap();
        let g = arena
            .capture(s, |s| queue_add(&reg, s, &x, &mut y, 64))
            .unwrap();
        g.instantiate().unwrap()
    };
    drop(arena);
    let live = fake().live(Live::DeviceMemory);
    let g = other
        .capture(|_| {
            drop(exec);
            Ok(())
        })
        .unwrap();
    assert_eq!(g.nodes().unwrap().len(), 0);
    drop(g);
    other.synchronize().unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        fake().live(Live::DeviceMemory),
        live - 1,
        "freed after the capture"
    );
    drop(other);
    // Not `done`: the failed-keeper test leaks one allocation on purpose.
    drop(reg);
}

pub fn tests() -> Vec<Test> {
    let _ = defect_batch_with_a_host_end_in_a_host_function_spins_forever;
    let _ = defect_arena_take_of_a_type_aligned_above_256_is_misaligned;
    let _ = defect_repeated_updates_grow_the_executables_holds_without_bound;
    vec![
        Test {
            name: "review4::held_batch_whose_completion_record_fails_is_still_waited_for",
            run: held_batch_whose_completion_record_fails_is_still_waited_for,
        },
        Test {
            name: "review4::held_capture_begun_during_a_host_batch_waits_for_it",
            run: held_capture_begun_during_a_host_batch_waits_for_it,
        },
        Test {
            name: "review4::held_zero_length_host_pairs_and_capture_refusal",
            run: held_zero_length_host_pairs_and_capture_refusal,
        },
        Test {
            name: "review4::held_device_batch_of_another_streams_buffer",
            run: held_device_batch_of_another_streams_buffer,
        },
        Test {
            name: "review4::held_exec_updated_from_another_arenas_graph_holds_it",
            run: held_exec_updated_from_another_arenas_graph_holds_it,
        },
        Test {
            name: "review4::held_concurrent_takes_are_disjoint",
            run: held_concurrent_takes_are_disjoint,
        },
        Test {
            name: "review4::held_arena_last_holder_dropped_inside_a_capture",
            run: held_arena_last_holder_dropped_inside_a_capture,
        },
        Test {
            name: "review4::held_foreign_views_stay_in_range",
            run: held_foreign_views_stay_in_range,
        },
        Test {
            name: "review4::defect_arena_take_of_a_type_aligned_above_256_is_misaligned",
            run: defect_arena_take_of_a_type_aligned_above_256_is_misaligned,
        },
        Test {
            name: "review4::defect_repeated_updates_grow_the_executables_holds_without_bound",
            run: defect_repeated_updates_grow_the_executables_holds_without_bound,
        },
        Test {
            name: "review4::defect_batch_with_a_host_end_in_a_host_function_spins_forever",
            run: defect_batch_with_a_host_end_in_a_host_function_spins_forever,
        },
        // Last: it leaks one allocation on purpose (the stand-in's count).
    ]
}
