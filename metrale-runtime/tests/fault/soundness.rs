//! The third soundness audit's findings, one test each (each fails on the code
//! before its fix), and a bounded multi-thread stress over shared streams,
//! captures, frees and two devices.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::common::*;
use crate::harness::Test;

fn hosts2() -> (Arc<CudaHost>, Arc<CudaHost>) {
    fake().reset();
    (host(0).unwrap(), host(1).unwrap())
}

fn finish() {
    release(0);
    release(1);
    assert_eq!(fake().live(Live::DeviceMemory), 0, "device memory left");
    assert_eq!(fake().live(Live::Streams), 0, "streams left");
    assert_eq!(fake().live(Live::Events), 0, "events left");
    assert_eq!(deferred_frees(), 0, "a deferred free was never done");
}

/// Item 1: a stream-ordered buffer used by a peer copy on another device's stream
/// is freed only after that stream's work (an event of device 1 that the own
/// stream waits for), not after its own context alone.
fn stream_ordered_buffer_used_on_another_device_is_freed_after_it() {
    let (h0, h1) = hosts2();
    let (s0, s1) = (CudaStream::new(&h0).unwrap(), CudaStream::new(&h1).unwrap());
    let src = s0.alloc::<u32>(64).unwrap();
    let mut dst = DeviceBuffer::<u32>::alloc(&h1, 64).unwrap();
    s1.copy_peer(&src, &mut dst).unwrap();
    let (records, waits) = (
        fake().calls("cuEventRecord"),
        fake().calls("cuStreamWaitEvent"),
    );
    drop(src);
    assert_eq!(
        fake().calls("cuEventRecord"),
        records + 1,
        "an event of device 1's stream"
    );
    assert_eq!(
        fake().calls("cuStreamWaitEvent"),
        waits + 1,
        "waited for by the own stream"
    );
    assert_eq!(
        fake().last_free_stream(),
        raw(&s0),
        "then freed on its own stream"
    );
    drop((dst, s0, s1, h0, h1));
    finish();
}

/// Item 1 for `cuMemAlloc` memory: the free waits for the other device's stream.
fn plain_buffer_used_on_another_device_waits_for_it() {
    let (h0, h1) = hosts2();
    let s1 = CudaStream::new(&h1).unwrap();
    let src = DeviceBuffer::<u32>::zeroed(&h0, 64).unwrap();
    let mut dst = DeviceBuffer::<u32>::alloc(&h1, 64).unwrap();
    s1.copy_peer(&src, &mut dst).unwrap();
    let syncs = fake().calls("cuStreamSynchronize");
    drop(src);
    assert_eq!(
        fake().calls("cuStreamSynchronize"),
        syncs + 1,
        "device 1's stream waited for"
    );
    drop((dst, s1, h0, h1));
    finish();
}

/// Item 2: `host_slice` waits for streams of other devices that used the buffer;
/// zeroing needs no host access where concurrent access is not allowed, and
/// `host_slice` is refused there.
fn managed_host_access_waits_for_other_devices() {
    let (h0, h1) = hosts2();
    let s1 = CudaStream::new(&h1).unwrap();
    let mut m = ManagedBuffer::<u32>::zeroed(&h0, 64).unwrap();
    let src = DeviceBuffer::<u32>::from_host(&h1, &[9; 64]).unwrap();
    s1.copy_peer(&src, &mut m).unwrap();
    let syncs = fake().calls("cuStreamSynchronize");
    assert_eq!(m.host_slice().unwrap()[0], 9);
    assert_eq!(
        fake().calls("cuStreamSynchronize"),
        syncs + 1,
        "the peer stream was waited for"
    );
    drop((m, src, s1));
    // A device without concurrent managed access (attribute 89).
    fake().set_attribute(0, 89, 0);
    release(0);
    drop(h0);
    let h0 = host(0).unwrap();
    let memsets = fake().calls("cuMemsetD8_v2");
    let mut m = ManagedBuffer::<u32>::zeroed(&h0, 64).unwrap();
    assert_eq!(
        fake().calls("cuMemsetD8_v2"),
        memsets + 1,
        "zeroed by the driver"
    );
    let e = m.host_slice().unwrap_err();
    assert!(
        e.to_string().contains("CONCURRENT_MANAGED_ACCESS = 0"),
        "{e}"
    );
    assert_eq!(h0.stream().to_vec(&m).unwrap(), vec![0; 64]);
    drop((m, h0, h1));
    finish();
}

/// Items 4 and 5: graph nodes carry their graph; a node of another graph (or of
/// a dropped one) is refused before the driver, for `add_while` and node updates.
fn nodes_of_another_graph_are_refused() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "empty").unwrap();
    let x = DeviceBuffer::<f32>::alloc(s, 1).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    let capture = || {
        s.capture(|s| -> metrale_runtime::Result<()> {
            // SAFETY: the stand-in only records the arguments.
            unsafe { s.launch(&f, cfg, (&x, 1u32, 1.0f32)) }
        })
        .unwrap()
    };
    let (a, mut b) = (capture(), capture());
    let foreign = a.nodes().unwrap();
    let adds = fake().calls("cuGraphAddNode_v2");
    let e = b.add_while(&foreign, true, |_, _| Ok(())).unwrap_err();
    assert!(e.to_string().contains("is a node of another graph"), "{e}");
    assert_eq!(
        fake().calls("cuGraphAddNode_v2"),
        adds,
        "refused before the driver"
    );
    let exec = b.instantiate().unwrap();
    let node = &a.kernel_nodes().unwrap()[0];
    drop(a);
    // SAFETY: refused before the driver.
    let e = unsafe { exec.set_kernel_params(node, &f, cfg, (&x, 1u32, 2.0f32)) }.unwrap_err();
    assert!(
        e.to_string()
            .contains("is not a node of the graph this executable graph"),
        "{e}"
    );
    drop((exec, b, x, f));
    done(reg);
}

/// Item 6: a registry dropped inside the capture closure cannot take the code of
/// the kernels queued into the capture with it.
fn code_queued_into_a_capture_outlives_its_registry() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    let x = DeviceBuffer::<f32>::alloc(&h, 1).unwrap();
    let graph = s
        .capture(|s| -> metrale_runtime::Result<()> {
            let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
            let f = reg.function("kernels", "empty")?;
            let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
            // SAFETY: the stand-in only records the arguments.
            unsafe { s.launch(&f, cfg, (&x, 1u32, 1.0f32))? };
            drop((f, reg));
            Ok(())
        })
        .unwrap();
    assert_eq!(fake().live(Live::Modules), 1, "the graph holds the module");
    let nodes = graph.kernel_nodes().unwrap();
    assert_eq!(nodes[0].name, "kernels::empty");
    let exec = graph.instantiate().unwrap();
    drop(graph);
    assert_eq!(
        fake().live(Live::Modules),
        1,
        "the executable graph holds it"
    );
    drop(exec);
    assert_eq!(fake().live(Live::Modules), 0);
    assert_eq!(fake().stale_uses(), 0);
    drop((x, s, h));
    finish();
}

/// Items 8 and 9: a stream-ordered buffer dropped while its stream is captured is
/// freed after the capture, without invalidating it; a panic inside the capture
/// closure ends the capture.
fn frees_wait_for_captures_and_panics_end_them() {
    fake().reset();
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    let buf = s.alloc::<u32>(16).unwrap();
    let other = s.clone();
    let frees = fake().calls("cuMemFreeAsync");
    let graph = s
        .capture(move |_| -> metrale_runtime::Result<()> {
            drop(buf);
            assert_eq!(deferred_frees(), 1, "deferred, not queued into the capture");
            Ok(())
        })
        .unwrap();
    assert_eq!(
        fake().calls("cuMemFreeAsync"),
        frees + 1,
        "freed once the capture ended"
    );
    assert_eq!(deferred_frees(), 0);
    drop(graph);
    // A borrowed-host copy inside a capture is refused, naming why.
    let dev = DeviceBuffer::<u32>::zeroed(&h, 4).unwrap();
    let r = other.capture(|s| -> metrale_runtime::Result<()> {
        let e = s.to_vec(&dev).unwrap_err();
        assert!(
            e.to_string().contains("the stream is being captured"),
            "{e}"
        );
        // A stream-ordered allocation in a capture would be a graph allocation
        // (no memory outside replays, freed with the graph): refused.
        let allocs = fake().calls("cuMemAllocAsync");
        let e = s.alloc::<u32>(16).unwrap_err();
        assert!(
            e.to_string()
                .contains("a stream-ordered allocation cannot be"),
            "{e}"
        );
        assert_eq!(
            fake().calls("cuMemAllocAsync"),
            allocs,
            "refused before the driver"
        );
        Ok(())
    });
    assert!(r.is_ok());
    // A panic inside the closure.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = other.capture(|_| -> metrale_runtime::Result<()> { panic!("inside a capture") });
    }));
    assert!(panicked.is_err());
    assert!(!other.is_capturing().unwrap(), "the capture was ended");
    assert_eq!(
        other.to_vec(&dev).unwrap(),
        vec![0; 4],
        "the stream works again"
    );
    drop((dev, other, s, h));
    finish();
}

/// Item 12: a transient `cuFuncGetParamInfo` failure does not switch the kernel's
/// argument check off for good.
fn a_failed_layout_read_is_not_remembered() {
    fake().reset();
    fake().fail("cuFuncGetParamInfo", 999, 1, Some(1));
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    let f = reg.function("kernels", "vec_add").unwrap();
    assert!(f.params().is_none(), "not known yet");
    let s = reg.stream();
    let a = DeviceBuffer::<f32>::alloc(s, 4).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (4, 1, 1), 0).unwrap();
    // SAFETY: refused before the driver (wrong argument count).
    let e = unsafe { s.launch(&f, cfg, (&a, 4u32)) }.unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::ArgumentMismatch { .. }),
        "{e}"
    );
    assert_eq!(f.params().unwrap().len(), 4, "read again and kept");
    drop((a, f));
    done(reg);
}

/// Items 13 and 14: a shared `OnceLock` filled concurrently by two registries
/// never hands one registry the other's kernel, and a static cache filled by a
/// dropped registry still gives the registry in use its own handle.
fn caches_shared_between_registries() {
    fake().reset();
    let regs: Vec<_> = (0..2)
        .map(|_| MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap())
        .collect();
    let mine: Vec<RawCudaFunc> = regs
        .iter()
        .map(|r| {
            r.raw_function_cached(&OnceLock::new(), "kernels", "vec_add")
                .unwrap()
        })
        .collect();
    let wrong = AtomicUsize::new(0);
    for _ in 0..200 {
        let cache: OnceLock<CudaFunction> = OnceLock::new();
        std::thread::scope(|t| {
            for (i, r) in regs.iter().enumerate() {
                let (cache, wrong, mine) = (&cache, &wrong, &mine);
                t.spawn(move || {
                    let f = r.function_cached(cache, "kernels", "vec_add").unwrap();
                    if f.raw() != mine[i] {
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        });
    }
    assert_eq!(
        wrong.load(Ordering::Relaxed),
        0,
        "another registry's kernel was returned"
    );
    // A cache filled by a registry that is then dropped.
    let cache: OnceLock<RawCudaFunc> = OnceLock::new();
    let mut regs = regs;
    let first = regs.remove(0);
    first
        .raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    drop(first);
    let reg = regs.remove(0);
    let lookups = reg.slow_lookups();
    for _ in 0..100 {
        assert_eq!(
            reg.raw_function_cached(&cache, "kernels", "vec_add")
                .unwrap(),
            mine[1]
        );
    }
    assert_eq!(
        reg.slow_lookups(),
        lookups + 1,
        "one slow lookup, then the fast path"
    );
    done(reg);
}

/// A bounded stress: threads share streams of two devices while others capture
/// on them, drop stream-ordered buffers and copy across devices. No copy may land
/// after its call returned, nothing may leak, every error must name the call.
fn stress_shared_streams_with_captures() {
    let (h0, h1) = hosts2();
    let streams = [
        CudaStream::new(&h0).unwrap(),
        CudaStream::new(&h0).unwrap(),
        CudaStream::new(&h1).unwrap(),
    ];
    let stop = AtomicBool::new(false);
    let (copies, refused, captured) = (
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1500);
    std::thread::scope(|t| {
        for w in 0..4usize {
            let (streams, stop, copies, refused) = (&streams, &stop, &copies, &refused);
            t.spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i = i.wrapping_add(1);
                    let s = &streams[(w + i as usize) % 3];
                    let peer = &streams[(w + i as usize + 1) % 3];
                    let values: Vec<u32> = (0..32).map(|k| k ^ i).collect();
                    let result = (|| -> metrale_runtime::Result<()> {
                        let mut buf = s.alloc::<u32>(32)?;
                        s.copy_h2d(&values, &mut buf)?;
                        let mut there = peer.alloc::<u32>(32)?;
                        peer.copy_peer(&buf, &mut there)?;
                        drop(buf);
                        let mut out = vec![0u32; 32];
                        peer.copy_d2h(&there, &mut out)?;
                        assert_eq!(out, values, "a copy landed after its call returned");
                        Ok(())
                    })();
                    match result {
                        Ok(()) => copies.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            let text = e.to_string();
                            assert!(
                                text.contains("being captured") || text.contains(" failed: "),
                                "an error that names nothing: {text}"
                            );
                            refused.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            });
        }
        let (streams, stop, captured) = (&streams, &stop, &captured);
        t.spawn(move || {
            let mut i = 0usize;
            while std::time::Instant::now() < deadline {
                i += 1;
                let s = &streams[i % 3];
                if let Ok(g) = s.capture(|_| -> metrale_runtime::Result<()> {
                    std::thread::yield_now();
                    Ok(())
                }) {
                    drop(g);
                    captured.fetch_add(1, Ordering::Relaxed);
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
    });
    eprintln!(
        "    {} copy rounds, {} refused during captures, {} captures",
        copies.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        captured.load(Ordering::Relaxed)
    );
    assert!(copies.load(Ordering::Relaxed) > 0 && captured.load(Ordering::Relaxed) > 0);
    for s in &streams {
        assert_eq!(fake().pending(raw(s)), 0);
    }
    drop((streams, h0, h1));
    finish();
}

/// Audit findings on the fixes themselves: an `end_capture` of a stream never
/// captured must not undo another capture's bookkeeping; a node of a dropped
/// source graph is refused; a `cuMemFree` due on a capturing thread waits for
/// the capture instead of invalidating it.
fn capture_bookkeeping_holds_against_misuse() {
    let (h0, h1) = hosts2();
    let (s, other) = (CudaStream::new(&h0).unwrap(), CudaStream::new(&h0).unwrap());
    let x = DeviceBuffer::<f32>::alloc(&h0, 1).unwrap();
    let graph = s
        .capture(|s| -> metrale_runtime::Result<()> {
            let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
            let f = reg.function("kernels", "empty")?;
            assert!(other.end_capture().is_err(), "never captured");
            let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
            // SAFETY: the stand-in only records the arguments.
            unsafe { s.launch(&f, cfg, (&x, 1u32, 1.0f32))? };
            drop((f, reg));
            Ok(())
        })
        .unwrap();
    assert_eq!(
        fake().live(Live::Modules),
        1,
        "the code is still held by the graph"
    );
    // A node of a dropped source graph.
    let exec = graph.instantiate().unwrap();
    let node = graph.kernel_nodes().unwrap().remove(0);
    drop(graph);
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    let f = reg.function("kernels", "empty").unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    // SAFETY: refused before the driver.
    let e = unsafe { exec.set_kernel_params(&node, &f, cfg, (&x, 1u32, 2.0f32)) }.unwrap_err();
    assert!(e.to_string().contains("was dropped"), "{e}");
    drop((exec, f, reg));
    // A buffer used by another device's stream, dropped on a capturing thread.
    let s1 = CudaStream::new(&h1).unwrap();
    let src = DeviceBuffer::<u32>::zeroed(&h0, 16).unwrap();
    let mut dst = DeviceBuffer::<u32>::alloc(&h1, 16).unwrap();
    s1.copy_peer(&src, &mut dst).unwrap();
    let g = s
        .capture(move |_| -> metrale_runtime::Result<()> {
            drop(src);
            assert_eq!(deferred_frees(), 1, "waits for the capture");
            Ok(())
        })
        .unwrap();
    assert_eq!(deferred_frees(), 0);
    drop((g, dst, s1, s, other, x, h0, h1));
    finish();
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "soundness::capture_bookkeeping_holds_against_misuse",
            run: capture_bookkeeping_holds_against_misuse,
        },
        Test {
            name: "soundness::stream_ordered_buffer_used_on_another_device_is_freed_after_it",
            run: stream_ordered_buffer_used_on_another_device_is_freed_after_it,
        },
        Test {
            name: "soundness::plain_buffer_used_on_another_device_waits_for_it",
            run: plain_buffer_used_on_another_device_waits_for_it,
        },
        Test {
            name: "soundness::managed_host_access_waits_for_other_devices",
            run: managed_host_access_waits_for_other_devices,
        },
        Test {
            name: "soundness::nodes_of_another_graph_are_refused",
            run: nodes_of_another_graph_are_refused,
        },
        Test {
            name: "soundness::code_queued_into_a_capture_outlives_its_registry",
            run: code_queued_into_a_capture_outlives_its_registry,
        },
        Test {
            name: "soundness::frees_wait_for_captures_and_panics_end_them",
            run: frees_wait_for_captures_and_panics_end_them,
        },
        Test {
            name: "soundness::a_failed_layout_read_is_not_remembered",
            run: a_failed_layout_read_is_not_remembered,
        },
        Test {
            name: "soundness::caches_shared_between_registries",
            run: caches_shared_between_registries,
        },
        Test {
            name: "soundness::stress_shared_streams_with_captures",
            run: stress_shared_streams_with_captures,
        },
    ]
}
