//! Streams and events on the GPU: overlap, timing, event ordering, threads,
//! priorities.

use std::sync::Arc;

use crate::common::*;
use crate::harness::Test;

/// Runs `spin` for `cycles` on each stream in `streams`, timed from the first
/// stream with events that the others join; returns milliseconds.
fn spin_on(reg: &MetraleRegistry, streams: &[&CudaStream], cycles: u64) -> f32 {
    let f = reg.function("kernels", "spin").unwrap();
    let main = streams[0];
    let mut done = DeviceBuffer::<u32>::zeroed(main, 1).unwrap();
    let (start, end) = (
        CudaEvent::timed(reg.ctx()).unwrap(),
        CudaEvent::timed(reg.ctx()).unwrap(),
    );
    let fork = CudaEvent::new(reg.ctx()).unwrap();
    start.record(main).unwrap();
    fork.record(main).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    for s in streams {
        s.wait(&fork).unwrap();
        // SAFETY: spin(unsigned long long, unsigned*) adds one to done[0].
        unsafe { s.launch(&f, cfg, (cycles, &mut done)) }.unwrap();
    }
    for s in &streams[1..] {
        let joined = CudaEvent::new(reg.ctx()).unwrap();
        joined.record(s).unwrap();
        main.wait(&joined).unwrap();
    }
    end.record(main).unwrap();
    end.synchronize().unwrap();
    assert_eq!(main.to_vec(&done).unwrap()[0], streams.len() as u32);
    start.elapsed_ms(&end).unwrap()
}

fn two_kernels_on_two_streams_overlap() {
    let reg = registry();
    let ctx = reg.ctx();
    let (a, b) = (CudaStream::new(ctx).unwrap(), CudaStream::new(ctx).unwrap());
    let cycles = cycles_per_ms(&reg) * 2;
    spin_on(&reg, &[&a], cycles / 10); // warm up
    let one = spin_on(&reg, &[&a], cycles);
    let two = spin_on(&reg, &[&a, &b], cycles);
    eprintln!("    one 2 ms spin: {one:.3} ms; two on two streams: {two:.3} ms");
    assert!(one > 1.0, "the spin ran {one} ms");
    assert!(
        two < 1.5 * one,
        "{two} ms for two is not under 1.5 x {one} ms"
    );
}

fn event_timing_of_a_1_ms_spin() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let per_ms = cycles_per_ms(&reg);
    // Warm the clocks up first: the spin counts cycles of the rated clock.
    spin_on(&reg, &[&s], per_ms * 20);
    let ms = spin_on(&reg, &[&s], per_ms);
    eprintln!("    a spin of {per_ms} cycles (1 ms at the rated clock) took {ms:.3} ms by events");
    assert!((0.8..=1.2).contains(&ms), "{ms} ms");
}

fn producer_and_consumer_ordered_only_by_an_event() {
    let reg = registry();
    let ctx = reg.ctx();
    let (pa, pb) = (CudaStream::new(ctx).unwrap(), CudaStream::new(ctx).unwrap());
    let produce = reg.function("kernels", "produce").unwrap();
    let consume = reg.function("kernels", "consume").unwrap();
    let n = 1 << 16;
    let mut buf = DeviceBuffer::<u32>::zeroed(&pa, n).unwrap();
    let mut bad = DeviceBuffer::<u32>::zeroed(&pb, 1).unwrap();
    let ready = CudaEvent::new(ctx).unwrap();
    let cfg = LaunchConfig::new((64, 1, 1), (256, 1, 1), 0).unwrap();
    let spin = cycles_per_ms(&reg) / 50; // 20 us before the producer writes
    for round in 1..=1000u32 {
        // SAFETY: produce(unsigned*, unsigned, unsigned, unsigned long long) writes buf.
        unsafe { pa.launch(&produce, cfg, (&mut buf, n as u32, round, spin)) }.unwrap();
        ready.record(&pa).unwrap();
        pb.wait(&ready).unwrap();
        // SAFETY: consume(const unsigned*, unsigned, unsigned, unsigned*) reads buf.
        unsafe { pb.launch(&consume, cfg, (&buf, n as u32, round, &mut bad)) }.unwrap();
        // The next round's producer must not overwrite before the consumer read.
        let read = CudaEvent::new(ctx).unwrap();
        read.record(&pb).unwrap();
        pa.wait(&read).unwrap();
    }
    assert_eq!(
        pb.to_vec(&bad).unwrap()[0],
        0,
        "mismatches over 1000 rounds"
    );
}

fn streams_created_and_used_from_eight_threads() {
    let reg = registry();
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let reg = Arc::clone(&reg);
            std::thread::spawn(move || {
                for round in 0..10u32 {
                    let s = CudaStream::new(reg.ctx()).unwrap();
                    check_vec_add_on(&reg, &s, "kernels", 5000 + t as usize, t * 10 + round);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

fn priorities_read_back() {
    let reg = registry();
    let (least, greatest) = reg.ctx().stream_priority_range().unwrap();
    eprintln!("    priority range: least {least}, greatest {greatest}");
    assert!(greatest < least);
    for p in [least, greatest, (least + greatest) / 2] {
        let s =
            CudaStream::with_options(reg.ctx(), StreamOptions::default().with_priority(p)).unwrap();
        assert_eq!(s.priority().unwrap(), p);
    }
    let e = CudaStream::with_options(
        reg.ctx(),
        StreamOptions::default().with_priority(greatest - 1),
    )
    .unwrap_err();
    assert!(e.to_string().contains("is outside device 0's range"), "{e}");
    assert!(CudaStream::new(reg.ctx()).unwrap().query().unwrap());
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "streams::two_kernels_on_two_streams_overlap",
            run: two_kernels_on_two_streams_overlap,
        },
        Test {
            name: "streams::event_timing_of_a_1_ms_spin",
            run: event_timing_of_a_1_ms_spin,
        },
        Test {
            name: "streams::producer_and_consumer_ordered_only_by_an_event",
            run: producer_and_consumer_ordered_only_by_an_event,
        },
        Test {
            name: "streams::created_and_used_from_eight_threads",
            run: streams_created_and_used_from_eight_threads,
        },
        Test {
            name: "streams::priorities_read_back",
            run: priorities_read_back,
        },
    ]
}
