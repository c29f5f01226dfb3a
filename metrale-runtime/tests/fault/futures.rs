//! Host functions and futures against the stand-in, which runs host functions
//! and stream callbacks in order on a worker thread per stream, as the driver
//! runs them on threads of its own.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use crate::common::*;
use crate::harness::Test;

/// A waker that counts its wake-ups and unparks the thread that made it.
struct Counting {
    wakes: AtomicUsize,
    thread: std::thread::Thread,
}

impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        self.thread.unpark();
    }
}

fn counting() -> (Arc<Counting>, Waker) {
    let c = Arc::new(Counting {
        wakes: AtomicUsize::new(0),
        thread: std::thread::current(),
    });
    (Arc::clone(&c), Waker::from(c))
}

/// Wait (at most 5 s) until `count` was woken `n` times.
fn wait_for_wakes(count: &Counting, n: usize) {
    let t = std::time::Instant::now();
    while count.wakes.load(Ordering::SeqCst) < n {
        assert!(t.elapsed() < Duration::from_secs(5), "woken {n} time(s)");
        std::thread::park_timeout(Duration::from_millis(1));
    }
}

/// The smallest executor: poll, park until woken, poll again.
fn block_on<F: Future>(f: F) -> (F::Output, usize) {
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return (out, count.wakes.load(Ordering::SeqCst));
        }
        std::thread::park_timeout(Duration::from_secs(5));
    }
}

/// A host function that blocks its stream until the returned sender sends.
fn gate(s: &CudaStream) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    s.launch_host_fn(move || {
        let _ = rx.recv();
    })
    .unwrap();
    tx
}

fn host_functions_run_in_order_on_a_driver_thread() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let me = std::thread::current().id();
    for i in 0..100 {
        let seen = Arc::clone(&seen);
        s.launch_host_fn(move || {
            assert_ne!(std::thread::current().id(), me);
            seen.lock().unwrap().push(i);
        })
        .unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(*seen.lock().unwrap(), (0..100).collect::<Vec<_>>());
}

fn host_functions_order_with_other_work() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let other = CudaStream::new(reg.ctx()).unwrap();
    let open = gate(&s);
    let after = CudaEvent::new(&s).unwrap();
    after.record(&s).unwrap();
    // Work after the host function waits for it; so does a stream waiting on it.
    other.wait(&after).unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&ran);
    other
        .launch_host_fn(move || {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(!s.query().unwrap());
    assert!(!after.query().unwrap());
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the other stream waits for it"
    );
    open.send(()).unwrap();
    after.synchronize().unwrap();
    other.synchronize().unwrap();
    assert!(s.query().unwrap());
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

fn host_function_panics_are_caught() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let before = host_function_panics();
    s.launch_host_fn(|| panic!("inside a host function"))
        .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&ran);
    s.launch_host_fn(move || {
        r.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(host_function_panics(), before + 1);
    assert_eq!(ran.load(Ordering::SeqCst), 1, "the stream goes on");
}

/// A refused slot submit (here inside a host function, where every call is
/// refused) hands its closure back while other threads claim slots: each
/// closure is dropped exactly once, the refused ones never run, and the pool
/// keeps serving.
fn refused_slot_submits_race_other_claims_cleanly() {
    let reg = setup();
    let (s, t) = (
        CudaStream::new(reg.ctx()).unwrap(),
        CudaStream::new(reg.ctx()).unwrap(),
    );
    let token = Arc::new(());
    let ran = Arc::new(AtomicUsize::new(0));
    let refusals = Arc::new(AtomicUsize::new(0));
    let (inner, tok, r, n) = (
        t.clone(),
        Arc::clone(&token),
        Arc::clone(&ran),
        Arc::clone(&refusals),
    );
    s.launch_host_fn(move || {
        for _ in 0..2000 {
            let (tok, r) = (Arc::clone(&tok), Arc::clone(&r));
            let refused = inner.launch_host_fn(move || {
                drop(tok);
                r.fetch_add(1_000_000, Ordering::SeqCst);
            });
            if refused.is_err() {
                n.fetch_add(1, Ordering::SeqCst);
            }
        }
        drop((tok, r, n));
    })
    .unwrap();
    for _ in 0..2000 {
        let (tok, r) = (Arc::clone(&token), Arc::clone(&ran));
        t.launch_host_fn(move || {
            drop(tok);
            r.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    }
    s.synchronize().unwrap();
    t.synchronize().unwrap();
    assert_eq!(
        refusals.load(Ordering::SeqCst),
        2000,
        "refused inside a host function"
    );
    assert_eq!(
        ran.load(Ordering::SeqCst),
        2000,
        "only the accepted ones ran"
    );
    assert_eq!(Arc::strong_count(&token), 1, "every closure dropped once");
    drop((s, t));
    done(reg);
}

fn metrale_calls_inside_a_host_function_are_refused() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let (tx, rx) = mpsc::channel();
    let inner = s.clone();
    let calls_before = fake().calls("cuStreamQuery");
    s.launch_host_fn(move || {
        let _ = tx.send(inner.query().map_err(|e| e.to_string()));
    })
    .unwrap();
    s.synchronize().unwrap();
    let e = rx.recv().unwrap().unwrap_err();
    assert!(
        e.contains("refused inside a host function") && e.contains("stream"),
        "{e}"
    );
    // Every other call too: creating handles, allocating, loading.
    let (tx, rx) = mpsc::channel();
    let ctx = Arc::clone(reg.ctx());
    s.launch_host_fn(move || {
        let results = [
            CudaStream::new(&ctx).map(drop),
            DeviceBuffer::<u32>::alloc(&ctx, 4).map(drop),
            CudaEvent::new(&ctx).map(drop),
            MetraleRegistry::load(0, &[("k", PTX)]).map(drop),
            ctx.synchronize(),
        ];
        let _ = tx.send(results.iter().all(|r| {
            matches!(
                r.as_ref().map_err(|e| e.kind()),
                Err(ErrorKind::InHostFunction { .. })
            )
        }));
    })
    .unwrap();
    s.synchronize().unwrap();
    assert!(rx.recv().unwrap(), "every call refused");
    assert_eq!(
        fake().calls("cuStreamQuery"),
        calls_before,
        "the driver was not called"
    );
    // Afterwards the thread is no longer marked: the same call works here.
    assert!(s.query().unwrap());

    // A future polled on the driver's thread (a waker that runs tasks inline)
    // resolves from the status its waker recorded, with no CUDA call. Polled
    // here first, so the wake is seen before the future moves there (the
    // stream's waiting thread wakes it just after the work finished).
    let mut fired = Box::pin(s.done());
    let (count, waker) = counting();
    let first = fired.as_mut().poll(&mut Context::from_waker(&waker));
    s.synchronize().unwrap();
    if first.is_pending() {
        wait_for_wakes(&count, 1);
    }
    let (tx, rx) = mpsc::channel();
    s.launch_host_fn(move || {
        let (_c, waker) = counting();
        let mut cx = Context::from_waker(&waker);
        let _ = tx.send(matches!(fired.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
    })
    .unwrap();
    s.synchronize().unwrap();
    assert!(rx.recv().unwrap());
}

/// Wait (at most 5 s) until at most `n` waiting threads are alive.
fn wait_for_waiters(n: usize) {
    let t = std::time::Instant::now();
    while metrale_runtime::live_waiters() > n {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{} waiting threads, expected at most {n}",
            metrale_runtime::live_waiters()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn futures_of_many_streams_take_a_few_threads_and_all_resolve() {
    let reg = setup();
    let before = metrale_runtime::live_waiters();
    let streams: Vec<CudaStream> = (0..20)
        .map(|_| CudaStream::new(reg.ctx()).unwrap())
        .collect();
    let futures: Vec<_> = streams
        .iter()
        .flat_map(|s| (0..50).map(|_| s.done()).collect::<Vec<_>>())
        .collect();
    assert!(
        metrale_runtime::live_waiters() <= 8,
        "{} waiting threads for 1,000 futures on 20 streams",
        metrale_runtime::live_waiters()
    );
    // Those beyond the threads are woken by driver callbacks: all resolve.
    for f in futures {
        block_on(f).0.unwrap();
    }
    drop(streams);
    // The threads of dropped streams leave.
    wait_for_waiters(before);
}

fn a_stream_dropped_with_work_pending_lets_its_thread_finish_then_leave() {
    let reg = setup();
    let before = metrale_runtime::live_waiters();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let open = gate(&s);
    let (count, waker) = counting();
    let mut done = Box::pin(s.done());
    assert!(done
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    // The future holds the stream: its last handle goes with the future.
    drop(done);
    drop(s);
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(count.wakes.load(Ordering::SeqCst), 0, "the work is held");
    open.send(()).unwrap();
    wait_for_waiters(before);
}

/// A waker that panics.
struct Panicky;
impl Wake for Panicky {
    fn wake(self: Arc<Self>) {
        panic!("a waker that panics");
    }
}

fn a_waker_that_panics_leaves_the_waiting_thread_serving() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let open = gate(&s);
    let mut first = Box::pin(s.done());
    let panicky = Waker::from(Arc::new(Panicky));
    assert!(first
        .as_mut()
        .poll(&mut Context::from_waker(&panicky))
        .is_pending());
    open.send(()).unwrap();
    s.synchronize().unwrap();
    // The next future of the stream is woken by the same thread.
    let open = gate(&s);
    let next = s.done();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(10));
        open.send(()).unwrap();
    });
    let (out, wakes) = block_on(next);
    out.unwrap();
    assert!(wakes <= 1, "{wakes}");
    t.join().unwrap();
    assert!(matches!(
        first.as_mut().poll(&mut Context::from_waker(&panicky)),
        Poll::Ready(Ok(()))
    ));
}

fn a_handle_dropped_inside_a_host_function_is_leaked_not_deadlocked() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let buf = DeviceBuffer::<u32>::alloc(reg.ctx(), 16).unwrap();
    let ptr = buf.device_ptr();
    let live = fake().live(Live::DeviceMemory);
    let frees = fake().calls("cuMemFree_v2");
    s.launch_host_fn(move || drop(buf)).unwrap();
    s.synchronize().unwrap();
    assert_eq!(
        fake().calls("cuMemFree_v2"),
        frees,
        "no driver call in the host function"
    );
    assert_eq!(
        fake().live(Live::DeviceMemory),
        live,
        "leaked, with a line on stderr"
    );
    // Free the leak by hand, so later tests find the stand-in clean.
    reg.ctx().bind().unwrap();
    // SAFETY: the leaked allocation, freed once; its buffer is gone.
    let st = unsafe { (sys::driver().unwrap().cuMemFree_v2().unwrap())(ptr) };
    assert!(st.is_success());
}

fn futures_on_two_devices_and_many_streams() {
    let reg = setup();
    let other = context(1).unwrap();
    let streams: Vec<_> = (0..8)
        .map(|i| {
            if i % 2 == 0 {
                CudaStream::new(reg.ctx()).unwrap()
            } else {
                CudaStream::new(&other).unwrap()
            }
        })
        .collect();
    let gates: Vec<_> = streams.iter().map(gate).collect();
    let futures: Vec<_> = (0..800).map(|i| streams[i % 8].done()).collect();
    for g in gates {
        g.send(()).unwrap();
    }
    let (out, _) = block_on(async {
        for f in futures {
            f.await?;
        }
        Ok::<(), MetraleError>(())
    });
    out.unwrap();
}

/// A pool-slot host function taken by a capture that metrale did not see begin
/// (here a raw one; in safe code, a capture racing the submit on another thread)
/// runs at most once however often the graph replays: the slot's generation tag
/// is taken by the first replay.
fn a_slot_host_function_taken_by_a_capture_runs_at_most_once() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let d = sys::driver().unwrap();
    let raw_s = s.raw();
    let runs = Arc::new(AtomicUsize::new(0));
    // SAFETY: a live stream, captured in global mode until the end below.
    let st = unsafe {
        (d.cuStreamBeginCapture_v2().unwrap())(
            raw_s,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
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
    // Another closure claims slots meanwhile (the pool moves on).
    for _ in 0..3 {
        let r = Arc::clone(&runs);
        let x = 1000u64;
        s.launch_host_fn(move || {
            r.fetch_add(x as usize, Ordering::SeqCst);
        })
        .unwrap();
    }
    for _ in 0..3 {
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
    // A stale replay meeting its slot full again in a newer generation (the
    // pool went round while every host function of `s` waits behind a gate)
    // leaves that closure alone: replayed on another stream, then `s` opened.
    let open = gate(&s);
    let others = Arc::new(AtomicUsize::new(0));
    for _ in 0..1100 {
        let o = Arc::clone(&others);
        let one = 1u64;
        s.launch_host_fn(move || {
            o.fetch_add(one as usize, Ordering::SeqCst);
        })
        .unwrap();
    }
    let t = CudaStream::new(reg.ctx()).unwrap();
    for _ in 0..3 {
        // SAFETY: as above, on another live stream of the context.
        let st = unsafe { (d.cuGraphLaunch().unwrap())(exec, t.raw()) };
        assert!(st.is_success(), "{st}");
    }
    t.synchronize().unwrap();
    assert_eq!(others.load(Ordering::SeqCst), 0, "nothing ran: s waits");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3007,
        "the stale replays ran nothing"
    );
    open.send(()).unwrap();
    s.synchronize().unwrap();
    assert_eq!(others.load(Ordering::SeqCst), 1100, "each ran once");
    assert_eq!(Arc::strong_count(&others), 1);
    drop(t);
    // SAFETY: the executable graph and graph made above, idle now.
    unsafe {
        assert!((d.cuGraphExecDestroy().unwrap())(exec).is_success());
        assert!((d.cuGraphDestroy().unwrap())(graph).is_success());
    }
    assert_eq!(Arc::strong_count(&runs), 1, "every closure was dropped");
    drop(s);
    done(reg);
}

fn once_host_functions_are_refused_in_a_capture_and_repeatable_ones_replay() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let e = s
        .capture(|s| -> metrale_runtime::Result<()> { s.launch_host_fn(|| {}) })
        .unwrap_err();
    assert!(e.to_string().contains("launch_host_fn"), "{e}");

    let runs = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&runs);
    let f: HostFn = Arc::new(move || {
        r.fetch_add(1, Ordering::SeqCst);
    });
    let graph = s
        .capture(|s| -> metrale_runtime::Result<()> { s.launch_host_fn_repeat(Arc::clone(&f)) })
        .unwrap();
    drop(f);
    let kinds: Vec<_> = graph.nodes().unwrap().iter().map(|n| n.kind()).collect();
    assert_eq!(kinds, [GraphNodeKind::Host]);
    let exec = graph.instantiate().unwrap();
    drop(graph);
    for _ in 0..3 {
        // SAFETY: the graph runs a host function only.
        unsafe { exec.launch(&s) }.unwrap();
    }
    // Dropped with replays in flight: they hold the closure.
    let open = gate(&s);
    // SAFETY: as above.
    unsafe { exec.launch(&s) }.unwrap();
    drop(exec);
    open.send(()).unwrap();
    s.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(
        Arc::strong_count(&runs),
        1,
        "the closure went with the graph"
    );

    // Outside a capture a repeatable host function runs once.
    let r = Arc::clone(&runs);
    s.launch_host_fn_repeat(Arc::new(move || {
        r.fetch_add(1, Ordering::SeqCst);
    }))
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 5);
}

fn a_future_resolves_after_the_work_and_is_woken_once() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let open = gate(&s);
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    let mut done = pin!(s.done());
    assert!(done.as_mut().poll(&mut cx).is_pending());
    assert!(done.as_mut().poll(&mut cx).is_pending());
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(count.wakes.load(Ordering::SeqCst), 0);
    open.send(()).unwrap();
    s.synchronize().unwrap();
    // The stream's waiting thread wakes it just after the work finished.
    wait_for_wakes(&count, 1);
    assert!(matches!(done.as_mut().poll(&mut cx), Poll::Ready(Ok(()))));
    assert_eq!(count.wakes.load(Ordering::SeqCst), 1, "woken exactly once");

    // The minimal executor, and an event's future.
    let open = gate(&s);
    let ev = CudaEvent::new(&s).unwrap();
    ev.record(&s).unwrap();
    let waiting = ev.done();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(10));
        open.send(()).unwrap();
    });
    let (out, wakes) = block_on(waiting);
    out.unwrap();
    assert!(wakes <= 1, "{wakes}");
    assert!(ev.query().unwrap());
    t.join().unwrap();
    // A never-recorded event's future is ready at once.
    let (out, wakes) = block_on(CudaEvent::new(&s).unwrap().done());
    out.unwrap();
    assert_eq!(wakes, 0);
}

fn a_future_resolves_to_the_error_of_failed_work() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let open = gate(&s);
    let done = s.done();
    // The work fails: the stream reports it once the future is woken.
    fake().fail("cuStreamQuery", 700, 1, Some(1));
    open.send(()).unwrap();
    let (out, _) = block_on(done);
    let e = out.unwrap_err();
    assert!(
        e.to_string()
            .contains("cuStreamQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)"),
        "{e}"
    );
    assert!(e.to_string().contains("stream"), "{e}");
    fake().reset();
    // Queueing refused (in a capture): the future says so.
    s.begin_capture(CaptureMode::default()).unwrap();
    let (out, _) = block_on(s.done());
    drop(s.end_capture());
    assert!(out.unwrap_err().to_string().contains("being captured"));
}

fn a_future_dropped_before_completion_frees_nothing_in_use() {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let open = gate(&s);
    let (_count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    {
        let mut done = Box::pin(s.done());
        assert!(done.as_mut().poll(&mut cx).is_pending());
        let never_polled = s.done();
        drop(never_polled);
    }
    open.send(()).unwrap();
    s.synchronize().unwrap();
    drop(s);
}

fn ten_thousand_futures_in_flight() {
    let reg = setup();
    let streams: Vec<_> = (0..4)
        .map(|_| CudaStream::new(reg.ctx()).unwrap())
        .collect();
    let gates: Vec<_> = streams.iter().map(gate).collect();
    let mut futures: Vec<_> = (0..10_000)
        .map(|i| Box::pin(streams[i % 4].done()))
        .collect();
    let (count, waker) = counting();
    let mut cx = Context::from_waker(&waker);
    for f in &mut futures {
        assert!(f.as_mut().poll(&mut cx).is_pending());
    }
    for g in gates {
        g.send(()).unwrap();
    }
    let mut left = futures.len();
    let mut ready = vec![false; futures.len()];
    while left > 0 {
        for (i, f) in futures.iter_mut().enumerate() {
            if !ready[i] {
                if let Poll::Ready(r) = f.as_mut().poll(&mut cx) {
                    r.unwrap();
                    ready[i] = true;
                    left -= 1;
                }
            }
        }
        if left > 0 {
            std::thread::park_timeout(Duration::from_millis(1));
        }
    }
    assert_eq!(count.wakes.load(Ordering::SeqCst), 10_000, "one wake each");
}

/// Owned event futures (issue 31): `into_done` and `done_owned` are `'static`
/// and `Send`, so they go into `tokio::spawn`, and resolve after the work.
fn event_futures_spawn_under_tokio() {
    fn spawnable<F: std::future::Future + Send + 'static>(f: F) -> F {
        f
    }
    let reg = setup();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let finished = rt.block_on(async {
        let open = gate(&s);
        let owned = CudaEvent::new(&s).unwrap();
        owned.record(&s).unwrap();
        let shared = Arc::new(CudaEvent::new(&s).unwrap());
        shared.record(&s).unwrap();
        let a = tokio::spawn(spawnable(owned.into_done()));
        let b = tokio::spawn(spawnable(shared.done_owned()));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            !a.is_finished() && !b.is_finished(),
            "pending behind the gate"
        );
        open.send(()).unwrap();
        a.await.unwrap().unwrap();
        b.await.unwrap().unwrap();
        shared.query().unwrap()
    });
    assert!(finished);
    // A never-recorded event's owned future is ready at once.
    let (out, wakes) = block_on(CudaEvent::new(&s).unwrap().into_done());
    out.unwrap();
    assert_eq!(wakes, 0);
}

fn futures_under_tokio() {
    let reg = setup();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let streams: Vec<_> = (0..4)
        .map(|_| CudaStream::new(reg.ctx()).unwrap())
        .collect();
    let finished = rt.block_on(async {
        let gates: Vec<_> = streams.iter().map(gate).collect();
        let mut tasks = Vec::new();
        for i in 0..256 {
            let s = streams[i % 4].clone();
            tasks.push(tokio::spawn(async move { s.done().await }));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(tasks.iter().all(|t| !t.is_finished()));
        for g in gates {
            g.send(()).unwrap();
        }
        let mut n = 0;
        for t in tasks {
            t.await.unwrap().unwrap();
            n += 1;
        }
        n
    });
    assert_eq!(finished, 256);
}

/// Small closures travel in the pool's slots, large ones in a box; either way
/// each runs once and drops its captures once, more at a time than there are
/// slots, from several threads; a refused launch drops the closure at once.
fn small_and_large_host_functions_run_and_drop_once() {
    let reg = setup();
    let ran = Arc::new(AtomicUsize::new(0));
    let streams: Vec<CudaStream> = (0..3)
        .map(|_| CudaStream::new(reg.ctx()).unwrap())
        .collect();
    let gates: Vec<_> = streams.iter().map(gate).collect();
    std::thread::scope(|t| {
        for s in &streams {
            let ran = &ran;
            t.spawn(move || {
                for i in 0..1500u64 {
                    let r = Arc::clone(ran);
                    if i % 3 == 0 {
                        let big = [i; 16]; // 128 bytes and more: boxed
                        s.launch_host_fn(move || {
                            assert_eq!(big[15], i);
                            r.fetch_add(1, Ordering::Relaxed);
                        })
                        .unwrap();
                    } else {
                        s.launch_host_fn(move || {
                            r.fetch_add(1, Ordering::Relaxed);
                        })
                        .unwrap();
                    }
                }
            });
        }
    });
    // All 4500 are queued behind the gates: more than the pool's 1024 slots.
    assert_eq!(ran.load(Ordering::Relaxed), 0);
    assert_eq!(
        Arc::strong_count(&ran),
        4501,
        "every capture held until it runs"
    );
    for g in gates {
        g.send(()).unwrap();
    }
    for s in &streams {
        s.synchronize().unwrap();
    }
    assert_eq!(ran.load(Ordering::Relaxed), 4500);
    assert_eq!(Arc::strong_count(&ran), 1, "every capture dropped once");
    // Refused by the driver: the closure (slot or box) is dropped now.
    let s = &streams[0];
    for big in [false, true] {
        fake().fail("cuLaunchHostFunc", 999, 1, Some(1));
        let r = Arc::clone(&ran);
        let e = if big {
            let pad = [0u64; 16];
            s.launch_host_fn(move || drop((r, pad))).unwrap_err()
        } else {
            s.launch_host_fn(move || drop(r)).unwrap_err()
        };
        assert!(e.to_string().contains("cuLaunchHostFunc"), "{e}");
        assert_eq!(Arc::strong_count(&ran), 1, "refused closure dropped");
    }
    drop(streams);
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "futures::refused_slot_submits_race_other_claims_cleanly",
            run: refused_slot_submits_race_other_claims_cleanly,
        },
        Test {
            name: "futures::a_slot_host_function_taken_by_a_capture_runs_at_most_once",
            run: a_slot_host_function_taken_by_a_capture_runs_at_most_once,
        },
        Test {
            name: "futures::small_and_large_host_functions_run_and_drop_once",
            run: small_and_large_host_functions_run_and_drop_once,
        },
        Test {
            name: "futures::host_functions_run_in_order_on_a_driver_thread",
            run: host_functions_run_in_order_on_a_driver_thread,
        },
        Test {
            name: "futures::host_functions_order_with_other_work",
            run: host_functions_order_with_other_work,
        },
        Test {
            name: "futures::host_function_panics_are_caught",
            run: host_function_panics_are_caught,
        },
        Test {
            name: "futures::metrale_calls_inside_a_host_function_are_refused",
            run: metrale_calls_inside_a_host_function_are_refused,
        },
        Test {
            name: "futures::a_handle_dropped_inside_a_host_function_is_leaked",
            run: a_handle_dropped_inside_a_host_function_is_leaked_not_deadlocked,
        },
        Test {
            name: "futures::on_two_devices_and_many_streams",
            run: futures_on_two_devices_and_many_streams,
        },
        Test {
            name: "futures::once_refused_in_capture_repeatable_replays",
            run: once_host_functions_are_refused_in_a_capture_and_repeatable_ones_replay,
        },
        Test {
            name: "futures::resolves_after_the_work_woken_once",
            run: a_future_resolves_after_the_work_and_is_woken_once,
        },
        Test {
            name: "futures::many_streams_take_a_few_threads_and_all_resolve",
            run: futures_of_many_streams_take_a_few_threads_and_all_resolve,
        },
        Test {
            name: "futures::dropped_stream_lets_its_thread_finish_then_leave",
            run: a_stream_dropped_with_work_pending_lets_its_thread_finish_then_leave,
        },
        Test {
            name: "futures::a_waker_that_panics_leaves_the_thread_serving",
            run: a_waker_that_panics_leaves_the_waiting_thread_serving,
        },
        Test {
            name: "futures::resolves_to_the_error_of_failed_work",
            run: a_future_resolves_to_the_error_of_failed_work,
        },
        Test {
            name: "futures::dropped_before_completion",
            run: a_future_dropped_before_completion_frees_nothing_in_use,
        },
        Test {
            name: "futures::ten_thousand_in_flight",
            run: ten_thousand_futures_in_flight,
        },
        Test {
            name: "futures::under_tokio",
            run: futures_under_tokio,
        },
        Test {
            name: "futures::event_futures_spawn_under_tokio",
            run: event_futures_spawn_under_tokio,
        },
    ]
}
