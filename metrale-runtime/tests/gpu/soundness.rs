//! The third soundness audit on the real driver: what the stand-in models only
//! roughly (the driver's capture rules, real copy engines).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::common::*;
use crate::harness::Test;

/// Item 6: dropping the registry (and its functions) inside the capture closure
/// crashed the process at `kernel_nodes()` / `instantiate()`; the code is now held
/// from the moment the kernel is queued.
fn a_registry_dropped_inside_a_capture_keeps_the_graph_runnable() {
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    let mut out = DeviceBuffer::<u32>::alloc(&h, 1024).unwrap();
    let graph = s
        .capture(|s| -> metrale_runtime::Result<()> {
            let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
            let f = reg.function("kernels", "fill_index")?;
            let cfg = LaunchConfig::for_num_elems(1024, 256)?;
            // SAFETY: fill_index(unsigned* out, unsigned n, unsigned base) over 1024.
            unsafe { s.launch(&f, cfg, (&mut out, 1024u32, 7u32))? };
            drop((f, reg));
            Ok(())
        })
        .unwrap();
    let nodes = graph.kernel_nodes().unwrap();
    assert_eq!(nodes[0].name, "kernels::fill_index");
    let exec = graph.instantiate().unwrap();
    drop(graph);
    // SAFETY: `out` is alive for the replay.
    unsafe { exec.launch(&s) }.unwrap();
    let got = s.to_vec(&out).unwrap();
    assert!(
        (0..1024).all(|i| got[i] == 7 + i as u32),
        "replayed exactly"
    );
}

/// Items 7 and 8: copies into borrowed memory and frees on a stream that another
/// thread keeps capturing: every copy is exact or refused with the reason, every
/// capture ends valid, nothing is freed into a graph.
fn captures_on_a_shared_stream_never_catch_a_copy_or_a_free() {
    let h = host(0).unwrap();
    let s = CudaStream::new(&h).unwrap();
    let values: Vec<u32> = (0..4096).map(|i| i * 3 + 1).collect();
    let src = DeviceBuffer::from_host(&s, &values).unwrap();
    let stop = AtomicBool::new(false);
    let (ok, refused, captures) = (
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    );
    std::thread::scope(|t| {
        let (s, src, values, stop, ok, refused) = (&s, &src, &values, &stop, &ok, &refused);
        t.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut out = vec![0u32; 4096];
                match s.copy_d2h(src, &mut out) {
                    Ok(()) => {
                        assert_eq!(&out, values, "a copy returned before it landed");
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        assert!(e.to_string().contains("being captured"), "{e}");
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
                if let Ok(tmp) = s.alloc::<u32>(256) {
                    drop(tmp);
                }
            }
        });
        let captures = &captures;
        t.spawn(move || {
            /// Stops the copying thread however this one ends.
            struct Stop<'a>(&'a AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = Stop(stop);
            // At least 300 captures, and on until the copying thread has met
            // them 20 times (a fast host can finish 300 before its first copy
            // returns), within 20 s.
            let t = std::time::Instant::now();
            let mut n = 0;
            while n < 300
                || (ok.load(Ordering::Relaxed) + refused.load(Ordering::Relaxed) < 20
                    && t.elapsed() < std::time::Duration::from_secs(20))
            {
                n += 1;
                let g = s
                    .capture(|_| -> metrale_runtime::Result<()> {
                        std::thread::yield_now();
                        Ok(())
                    })
                    .expect("no capture is invalidated by another thread's copy or free");
                drop(g);
                captures.fetch_add(1, Ordering::Relaxed);
            }
            stop.store(true, Ordering::Relaxed);
        });
    });
    eprintln!(
        "    {} copies exact, {} refused during a capture, {} captures",
        ok.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        captures.load(Ordering::Relaxed)
    );
    assert_eq!(deferred_frees(), 0, "every deferred free was done");
    assert!(ok.load(Ordering::Relaxed) > 0);
}

/// Items 4 and 5 on the driver: a node of another graph never reaches it.
fn nodes_of_another_graph_are_refused() {
    let reg = registry();
    let s = reg.stream();
    let f = reg.function("kernels", "fill_index").unwrap();
    let mut out = DeviceBuffer::<u32>::alloc(s, 64).unwrap();
    let cfg = LaunchConfig::for_num_elems(64, 64).unwrap();
    let a = CudaStream::new(reg.ctx())
        .unwrap()
        .capture(|s| -> metrale_runtime::Result<()> {
            // SAFETY: fill_index over 64 elements of `out`.
            unsafe { s.launch(&f, cfg, (&mut out, 64u32, 1u32)) }
        })
        .unwrap();
    let mut b = CudaGraph::new(reg.ctx()).unwrap();
    let e = b
        .add_while(&a.nodes().unwrap(), true, |_, _| Ok(()))
        .unwrap_err();
    assert!(e.to_string().contains("is a node of another graph"), "{e}");
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "soundness::a_registry_dropped_inside_a_capture_keeps_the_graph_runnable",
            run: a_registry_dropped_inside_a_capture_keeps_the_graph_runnable,
        },
        Test {
            name: "soundness::captures_on_a_shared_stream_never_catch_a_copy_or_a_free",
            run: captures_on_a_shared_stream_never_catch_a_copy_or_a_free,
        },
        Test {
            name: "soundness::nodes_of_another_graph_are_refused",
            run: nodes_of_another_graph_are_refused,
        },
    ]
}
