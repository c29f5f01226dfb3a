//! Host functions, futures and GPU-side signals on the real driver.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::harness::{Child, Test};

struct Unpark(std::thread::Thread, AtomicUsize);
impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.unpark();
    }
}

/// Poll `f` once now, then park until woken; the output, the wake count, and
/// whether the first poll was pending.
fn block_on<F: Future>(f: F) -> (F::Output, usize, bool) {
    let unpark = Arc::new(Unpark(std::thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(Arc::clone(&unpark));
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    let mut first = true;
    let mut first_pending = false;
    loop {
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(out) => return (out, unpark.1.load(Ordering::SeqCst), first_pending),
            Poll::Pending => first_pending |= first,
        }
        first = false;
        std::thread::park_timeout(Duration::from_secs(10));
    }
}

fn a_host_function_sees_the_result_of_the_kernel_before_it() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let f = reg.function("kernels", "fill_index").unwrap();
    let n = 4096usize;
    let out = Arc::new(PinnedBuffer::<u32>::mapped(reg.ctx(), n).unwrap());
    let ptr = out.device_ptr().unwrap();
    let cfg = LaunchConfig::for_num_elems(n, 256).unwrap();
    let (tx, rx) = mpsc::channel();
    for round in 0..20u32 {
        // SAFETY: fill_index(unsigned*, unsigned, unsigned) writes n words at ptr,
        // mapped memory that lives until the host function below has run.
        unsafe { s.launch(&f, cfg, (ptr, n as u32, round * 100)) }.unwrap();
        let out = Arc::clone(&out);
        let tx = tx.clone();
        s.launch_host_fn(move || {
            let ok = (0..n).all(|i| out[i] == i as u32 + round * 100);
            let _ = tx.send((round, ok));
        })
        .unwrap();
    }
    s.synchronize().unwrap();
    drop(tx);
    let seen: Vec<_> = rx.iter().collect();
    assert_eq!(seen, (0..20).map(|r| (r, true)).collect::<Vec<_>>());
}

fn a_future_resolves_after_a_1_ms_kernel_and_not_before() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let spin = reg.function("kernels", "spin").unwrap();
    let per_ms = cycles_per_ms(&reg);
    let mut done = DeviceBuffer::<u32>::zeroed(&s, 1).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    // Warm the clocks up.
    // SAFETY: spin(unsigned long long, unsigned*) adds one to done[0].
    unsafe { s.launch(&spin, cfg, (per_ms * 20, &mut done)) }.unwrap();
    s.synchronize().unwrap();
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: as above.
        unsafe { s.launch(&spin, cfg, (per_ms, &mut done)) }.unwrap();
        let (out, wakes, pending) = block_on(s.done());
        let took = t.elapsed();
        out.unwrap();
        assert!(pending, "resolved before the kernel ran");
        assert_eq!(wakes, 1, "woken once");
        assert!(
            took >= Duration::from_micros(800),
            "resolved after {took:?}"
        );
        assert!(s.query().unwrap());
        eprintln!("    1 ms spin: the future resolved after {took:?}");
    }
    // An event's future, under tokio.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let ev = CudaEvent::new(&s).unwrap();
    rt.block_on(async {
        // SAFETY: as above.
        unsafe { s.launch(&spin, cfg, (per_ms, &mut done)) }.unwrap();
        ev.record(&s).unwrap();
        ev.done().await.unwrap();
    });
    assert!(ev.query().unwrap());
    assert_eq!(s.to_vec(&done).unwrap(), [7]);
}

fn a_future_resolves_to_a_kernel_fault() {
    // In a child: the fault ends the context for the process.
    let t = Instant::now();
    let out = crate::harness::run_child("future_of_a_faulting_kernel", &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {out:?}");
    assert!(t.elapsed() < Duration::from_secs(60));
    assert!(
        stdout.contains("CUDA_ERROR_ILLEGAL_ADDRESS (700)"),
        "{stdout}"
    );
    eprintln!("    child said: {}", stdout.trim());
}

fn child_future_of_a_faulting_kernel() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let f = reg.function("kernels", "write_illegal").unwrap();
    let mut out = DeviceBuffer::<u32>::alloc(&s, 1).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (1, 1, 1), 0).unwrap();
    // SAFETY: the kernel faults on purpose; the future reports it.
    unsafe { s.launch(&f, cfg, (&mut out,)) }.unwrap();
    let unpark = Arc::new(Unpark(std::thread::current(), AtomicUsize::new(0)));
    let waker = Waker::from(Arc::clone(&unpark));
    let mut cx = Context::from_waker(&waker);
    let mut done = pin!(s.done());
    let t = Instant::now();
    let code = loop {
        if let Poll::Ready(r) = done.as_mut().poll(&mut cx) {
            match r {
                Err(e) => println!("{e}"),
                Ok(()) => println!("no error reported"),
            }
            break 0;
        }
        if t.elapsed() > Duration::from_secs(30) {
            println!("never woken");
            break 1;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    };
    // The context is unusable now; leave without tearing it down.
    std::process::exit(code);
}

pub fn children() -> Vec<Child> {
    vec![Child {
        name: "future_of_a_faulting_kernel",
        run: child_future_of_a_faulting_kernel,
    }]
}

fn a_host_node_runs_on_every_replay() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let f = reg.function("kernels", "fill_index").unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
    let cfg = LaunchConfig::for_num_elems(256, 256).unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&runs);
    let host: HostFn = Arc::new(move || {
        r.fetch_add(1, Ordering::SeqCst);
    });
    let graph = s
        .capture(|s| -> metrale_runtime::Result<()> {
            // SAFETY: fill_index writes 256 words of `out`, alive past the replays.
            unsafe { s.launch(&f, cfg, (&mut out, 256u32, 1u32)) }?;
            s.launch_host_fn_repeat(Arc::clone(&host))
        })
        .unwrap();
    drop(host);
    let exec = graph.instantiate().unwrap();
    drop(graph);
    for _ in 0..10 {
        // SAFETY: the graph's kernel writes `out`, alive until the sync below.
        unsafe { exec.launch(&s) }.unwrap();
    }
    drop(exec);
    s.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 10);
    // The driver holds the closure through a user object, whose destructor
    // runs on a thread of its own once the replays are done (it may come after
    // this synchronisation); a later synchronisation drops it. Bounded: 2 s.
    let t = std::time::Instant::now();
    while Arc::strong_count(&runs) > 1 && t.elapsed() < std::time::Duration::from_secs(2) {
        std::thread::sleep(std::time::Duration::from_millis(1));
        s.synchronize().unwrap();
    }
    assert_eq!(
        Arc::strong_count(&runs),
        1,
        "the graph let go of the closure within 2 s of the replays"
    );
}

fn a_wait_value_is_released_by_another_stream_and_by_the_host() {
    let reg = registry();
    let (a, b) = (
        CudaStream::new(reg.ctx()).unwrap(),
        CudaStream::new(reg.ctx()).unwrap(),
    );
    let flag = DeviceBuffer::<u32>::zeroed(&a, 1).unwrap();
    a.synchronize().unwrap();
    let word = SignalWord::device(&flag, 0).unwrap();
    a.wait_value32(&word, 1, WaitFlags::GEQ).unwrap();
    let after = CudaEvent::new(&a).unwrap();
    after.record(&a).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    assert!(!after.query().unwrap(), "a waits on the word");
    b.write_value32(&word, 1, WriteFlags::default()).unwrap();
    after.synchronize().unwrap();

    let mapped = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let host_word = SignalWord::mapped(&mapped, 0).unwrap();
    a.wait_value32(&host_word, 3, WaitFlags::EQ).unwrap();
    after.record(&a).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    assert!(!after.query().unwrap(), "a waits on mapped memory");
    mapped.atomic(0).unwrap().store(3, Ordering::Release);
    after.synchronize().unwrap();

    // 64-bit words where the device has them.
    let wide = DeviceBuffer::<u64>::zeroed(&a, 1).unwrap();
    a.synchronize().unwrap();
    let w64 = SignalWord::device(&wide, 0).unwrap();
    match b.write_value64(&w64, 1 << 33, WriteFlags::default()) {
        Ok(()) => {
            a.wait_value64(&w64, 1 << 33, WaitFlags::EQ).unwrap();
            a.synchronize().unwrap();
            assert_eq!(a.to_vec(&wide).unwrap(), [1 << 33]);
        }
        Err(e) => assert!(matches!(e.kind(), ErrorKind::Unsupported { .. }), "{e}"),
    }
}

/// Stream memory operations and host functions are queued without binding a
/// context: with another context of the device current (made through the
/// driver) and with none, they run on the stream's context, and another context
/// current stays current.
fn stream_operations_run_on_the_streams_context_whatever_is_current() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let flag = DeviceBuffer::<u32>::zeroed(&s, 2).unwrap();
    s.synchronize().unwrap();
    let word = SignalWord::device(&flag, 1).unwrap();
    let d = sys::driver().unwrap();
    let mut other: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one context; no creation parameters.
    let made = unsafe {
        (d.cuCtxCreate_v4().unwrap())(&mut other, std::ptr::null_mut(), 0, reg.ctx().device())
    };
    assert!(made.is_success(), "cuCtxCreate_v4: {made}");
    let (get, set) = (d.cuCtxGetCurrent().unwrap(), d.cuCtxSetCurrent().unwrap());
    let ran = Arc::new(AtomicUsize::new(0));
    for (i, current) in [other, std::ptr::null_mut()].into_iter().enumerate() {
        // SAFETY: a live context made above, or none.
        assert!(unsafe { set(current) }.is_success());
        let v = 10 + i as u32;
        s.write_value32(&word, v, WriteFlags::default()).unwrap();
        s.wait_value32(&word, v, WaitFlags::EQ).unwrap();
        let r = Arc::clone(&ran);
        s.launch_host_fn(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        let mut now: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context.
        assert!(unsafe { get(&mut now) }.is_success());
        if current.is_null() {
            // With none current, driver 580 leaves the stream's context current
            // after these calls (seen on the H200; metrale binds nothing here,
            // the stand-in's test counts that): never another context.
            assert!(
                now.is_null() || now == reg.ctx().raw(),
                "{now:p} is current: neither none nor the stream's context"
            );
        } else {
            assert_eq!(now, current, "another context current stays current");
        }
        s.synchronize().unwrap();
        assert_eq!(s.to_vec(&flag).unwrap(), [0, v]);
    }
    assert_eq!(ran.load(Ordering::SeqCst), 2);
    // A stream on a green context (CUDA 12.4+), with none current.
    match SmResource::of_device(reg.host().context()) {
        Ok(all) => {
            let green = GreenContext::new(&[&all]).unwrap();
            let g = CudaStream::on_green_context(&green).unwrap();
            // SAFETY: no context current.
            assert!(unsafe { set(std::ptr::null_mut()) }.is_success());
            g.write_value32(&word, 42, WriteFlags::default()).unwrap();
            let r = Arc::clone(&ran);
            g.launch_host_fn(move || {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            g.synchronize().unwrap();
            assert_eq!(s.to_vec(&flag).unwrap(), [0, 42]);
            assert_eq!(ran.load(Ordering::SeqCst), 3);
            drop((g, green));
        }
        Err(e) => assert!(matches!(e.kind(), ErrorKind::MissingSymbol { .. }), "{e}"),
    }
    reg.ctx().bind().unwrap();
    // SAFETY: the context made above, current on no thread now.
    assert!(unsafe { (d.cuCtxDestroy_v2().unwrap())(other) }.is_success());
}

/// On the real driver: a pool-slot host function taken by a capture metrale did
/// not begin (a raw one here) runs at most once over three replays, and every
/// closure is dropped.
fn a_slot_host_function_taken_by_a_raw_capture_runs_at_most_once() {
    let reg = registry();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let d = sys::driver().unwrap();
    let raw_s = s.raw();
    let runs = Arc::new(AtomicUsize::new(0));
    // SAFETY: a live stream, captured until the end below.
    let st = unsafe {
        (d.cuStreamBeginCapture_v2().unwrap())(
            raw_s,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
    };
    assert!(st.is_success(), "{st}");
    let (r, marker) = (Arc::clone(&runs), 7u64);
    s.launch_host_fn(move || {
        r.fetch_add(marker as usize, Ordering::SeqCst);
    })
    .unwrap();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above.
    let st = unsafe { (d.cuStreamEndCapture().unwrap())(raw_s, &mut graph) };
    assert!(st.is_success(), "{st}");
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: a graph made by the capture above.
    let st = unsafe { (d.cuGraphInstantiateWithFlags().unwrap())(&mut exec, graph, 0) };
    assert!(st.is_success(), "{st}");
    for _ in 0..3 {
        let r = Arc::clone(&runs);
        let x = 1000u64;
        s.launch_host_fn(move || {
            r.fetch_add(x as usize, Ordering::SeqCst);
        })
        .unwrap();
        // SAFETY: an executable graph of one host node, on a live stream.
        let st = unsafe { (d.cuGraphLaunch().unwrap())(exec, raw_s) };
        assert!(st.is_success(), "{st}");
    }
    s.synchronize().unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3000 + 7,
        "the captured closure ran once"
    );
    // SAFETY: the executable graph and graph made above, idle now.
    unsafe {
        assert!((d.cuGraphExecDestroy().unwrap())(exec).is_success());
        assert!((d.cuGraphDestroy().unwrap())(graph).is_success());
    }
    assert_eq!(Arc::strong_count(&runs), 1, "every closure was dropped");
}

fn sixty_four_futures_over_four_streams_under_tokio() {
    let reg = registry();
    let spin = reg.function("kernels", "spin").unwrap();
    let per_ms = cycles_per_ms(&reg);
    let streams: Vec<_> = (0..4)
        .map(|_| CudaStream::new(reg.ctx()).unwrap())
        .collect();
    let mut counters: Vec<_> = streams
        .iter()
        .map(|s| DeviceBuffer::<u32>::zeroed(s, 1).unwrap())
        .collect();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let t = Instant::now();
    rt.block_on(async {
        let mut waiting = Vec::new();
        for i in 0..64 {
            let s = &streams[i % 4];
            // SAFETY: spin adds one to its stream's counter, alive to the end.
            unsafe { s.launch(&spin, cfg, (per_ms / 4, &mut counters[i % 4])) }.unwrap();
            waiting.push(tokio::spawn(s.done()));
        }
        for w in waiting {
            w.await.unwrap().unwrap();
        }
    });
    eprintln!(
        "    64 quarter-ms kernels over 4 streams awaited in {:?}",
        t.elapsed()
    );
    for (s, c) in streams.iter().zip(&counters) {
        assert_eq!(s.to_vec(c).unwrap(), [16]);
    }
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "futures::a_host_function_sees_the_kernel_before_it",
            run: a_host_function_sees_the_result_of_the_kernel_before_it,
        },
        Test {
            name: "futures::resolves_after_a_1_ms_kernel_not_before",
            run: a_future_resolves_after_a_1_ms_kernel_and_not_before,
        },
        Test {
            name: "futures::resolves_to_a_kernel_fault",
            run: a_future_resolves_to_a_kernel_fault,
        },
        Test {
            name: "futures::a_host_node_runs_on_every_replay",
            run: a_host_node_runs_on_every_replay,
        },
        Test {
            name: "signals::wait_value_released_by_a_stream_and_the_host",
            run: a_wait_value_is_released_by_another_stream_and_by_the_host,
        },
        Test {
            name: "signals::stream_operations_run_on_the_streams_context",
            run: stream_operations_run_on_the_streams_context_whatever_is_current,
        },
        Test {
            name: "futures::a_slot_host_function_in_a_raw_capture_runs_once",
            run: a_slot_host_function_taken_by_a_raw_capture_runs_at_most_once,
        },
        Test {
            name: "futures::sixty_four_over_four_streams_under_tokio",
            run: sixty_four_futures_over_four_streams_under_tokio,
        },
    ]
}
