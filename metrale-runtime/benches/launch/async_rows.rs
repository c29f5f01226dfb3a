//! The rows of issue 22 in the launch bench: future wake-up latency against
//! `cuStreamSynchronize`, process CPU time while futures wait, and the submit
//! cost of host functions and stream memory operations against the raw calls.

use std::ffi::c_void;
use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use super::common::{line, ratios, time, Row};
use metrale_runtime::sys;
use metrale_runtime::{
    CudaStream, Device, DeviceBuffer, LaunchConfig, MetraleError, MetraleRegistry, SignalWord,
    WaitFlags, WriteFlags,
};

struct Unpark(std::thread::Thread);
impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// The smallest executor: poll, park until woken.
fn block_on<F: Future>(f: F) -> F::Output {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = pin!(f);
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

/// Process CPU time (user + system) in seconds, from /proc/self/stat (clock
/// ticks of 1/100 s, the Linux default USER_HZ).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after ')'.
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (tick(11) + tick(12)) / 100.0
}

unsafe extern "C" fn noop(_: *mut c_void) {}

/// A raw host function freeing the 8 bytes its submitter allocated (what a boxed
/// closure costs, without metrale).
unsafe extern "C" fn free_box(data: *mut c_void) {
    // SAFETY: `data` is the `Box<u64>` leaked for this one call.
    drop(unsafe { Box::from_raw(data.cast::<u64>()) });
}

/// What the raw host-function wake-up sets and unparks.
struct Flag {
    done: std::sync::atomic::AtomicBool,
    thread: std::thread::Thread,
}

/// A raw host function that wakes the waiting thread (the floor of any
/// callback-driven wake-up).
unsafe extern "C" fn unpark_flag(data: *mut c_void) {
    // SAFETY: `data` is the `Flag` the waiting thread keeps alive until `done`.
    let f = unsafe { &*data.cast_const().cast::<Flag>() };
    f.done.store(true, std::sync::atomic::Ordering::Release);
    f.thread.unpark();
}

pub fn run(reg: &MetraleRegistry, rounds: usize, quick: bool) -> Result<(), MetraleError> {
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let stream = CudaStream::new(reg.ctx())?;
    let raw_stream = stream.raw();
    let empty = reg.function("kernels", "empty")?;
    let spin = reg.function("kernels", "spin")?;
    let buf = DeviceBuffer::<f32>::alloc(&stream, 1024)?;
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    let raw_sync = d.cuStreamSynchronize().unwrap();
    let raw_host_fn = d.cuLaunchHostFunc().unwrap();
    let raw_write = d.cuStreamWriteValue32_v2().unwrap();
    let raw_wait = d.cuStreamWaitValue32_v2().unwrap();
    let launch_empty = || {
        // SAFETY: `empty(float*, unsigned, float)` on a live buffer.
        unsafe { stream.launch(&empty, cfg, (&buf, 7u32, 1.5f32)) }.unwrap();
    };
    let sync_raw = || {
        // SAFETY: a live stream.
        assert!(unsafe { raw_sync(raw_stream) }.is_success());
    };

    // Latency: an empty kernel, then the wait; the waits take turns: the
    // spinning cuStreamSynchronize, metrale's future, and two raw waits that do
    // not spin (a host function unparking the thread, a blocking-sync event).
    let flag = Flag {
        done: std::sync::atomic::AtomicBool::new(false),
        thread: std::thread::current(),
    };
    let flag_ptr = (&flag as *const Flag).cast_mut().cast::<c_void>();
    let mut blocking_event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: writes one event; CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING.
    assert!(unsafe { (d.cuEventCreate().unwrap())(&mut blocking_event, 0x1 | 0x2) }.is_success());
    let (ev_record, ev_sync) = (d.cuEventRecord().unwrap(), d.cuEventSynchronize().unwrap());
    let k = if quick { 200 } else { 2_000 };
    let (mut lat_sync, mut lat_future) = (Row::default(), Row::default());
    let (mut lat_hostfn, mut lat_event) = (Row::default(), Row::default());
    for _ in 0..rounds {
        let mut t = [0.0f64; 4];
        for i in 0..k {
            match i % 4 {
                0 => {
                    t[0] += time(|| {
                        launch_empty();
                        sync_raw();
                    })
                }
                1 => {
                    t[1] += time(|| {
                        launch_empty();
                        block_on(stream.done()).unwrap();
                    })
                }
                2 => {
                    t[2] += time(|| {
                        launch_empty();
                        flag.done.store(false, std::sync::atomic::Ordering::Relaxed);
                        // SAFETY: `flag` outlives the wait below, which lasts until
                        // the host function has run.
                        let st = unsafe { raw_host_fn(raw_stream, Some(unpark_flag), flag_ptr) };
                        assert!(st.is_success());
                        while !flag.done.load(std::sync::atomic::Ordering::Acquire) {
                            std::thread::park_timeout(Duration::from_secs(1));
                        }
                    })
                }
                _ => {
                    t[3] += time(|| {
                        launch_empty();
                        // SAFETY: a live event and stream of one context.
                        unsafe {
                            assert!(ev_record(blocking_event, raw_stream).is_success());
                            assert!(ev_sync(blocking_event).is_success());
                        }
                    })
                }
            }
        }
        let q = (k / 4) as f64;
        lat_sync.push(t[0] * 1e6 / q);
        lat_future.push(t[1] * 1e6 / q);
        lat_hostfn.push(t[2] * 1e6 / q);
        lat_event.push(t[3] * 1e6 / q);
    }

    // Submit cost: batches of 250, the raw and safe paths taking turns.
    let word_buf = DeviceBuffer::<u32>::zeroed(&stream, 1)?;
    stream.synchronize()?;
    let word = SignalWord::device(&word_buf, 0)?;
    let addr = word.device_ptr();
    let batches = if quick { 4 } else { 40 };
    let submit = |paths: [&dyn Fn(); 2]| -> (f64, f64) {
        let mut total = [0.0; 2];
        for b in 0..batches {
            for j in 0..2 {
                let i = (b + j) % 2;
                total[i] += time(|| {
                    for _ in 0..250 {
                        paths[i]();
                    }
                });
                sync_raw();
            }
        }
        let n = (batches * 250) as f64;
        (total[0] * 1e6 / n, total[1] * 1e6 / n)
    };
    let host_raw = || {
        // SAFETY: a no-op host function with no data.
        assert!(unsafe { raw_host_fn(raw_stream, Some(noop), std::ptr::null_mut()) }.is_success());
    };
    let host_ours = || {
        let x = black_box(1u64);
        stream
            .launch_host_fn(move || {
                black_box(x);
            })
            .unwrap();
    };
    let write_raw = || {
        // SAFETY: a word of a live device buffer.
        assert!(unsafe { raw_write(raw_stream, addr, 1, 0) }.is_success());
    };
    let write_ours = || {
        stream
            .write_value32(&word, 1, WriteFlags::default())
            .unwrap()
    };
    let wait_raw = || {
        // SAFETY: as above; the word is 1, so the wait passes at once.
        assert!(unsafe { raw_wait(raw_stream, addr, 1, 0) }.is_success());
    };
    let wait_ours = || stream.wait_value32(&word, 1, WaitFlags::GEQ).unwrap();
    stream.write_value32(&word, 1, WriteFlags::default())?;
    // What the difference is made of: the raw call with a boxed 8 bytes freed by
    // the host function, and ours with a closure that captures nothing.
    let host_raw_boxed = || {
        let data = Box::into_raw(Box::new(black_box(1u64))).cast::<c_void>();
        // SAFETY: `free_box` takes the box back once.
        assert!(unsafe { raw_host_fn(raw_stream, Some(free_box), data) }.is_success());
    };
    let host_ours_zst = || {
        stream
            .launch_host_fn(|| {
                black_box(());
            })
            .unwrap();
    };
    let (mut h_raw, mut h_ours) = (Row::default(), Row::default());
    let (mut hb_raw, mut hz_ours) = (Row::default(), Row::default());
    let (mut w_raw, mut w_ours) = (Row::default(), Row::default());
    let (mut v_raw, mut v_ours) = (Row::default(), Row::default());
    for _ in 0..rounds {
        let (r, o) = submit([&host_raw, &host_ours]);
        h_raw.push(r);
        h_ours.push(o);
        let (r, o) = submit([&host_raw_boxed, &host_ours_zst]);
        hb_raw.push(r);
        hz_ours.push(o);
        let (r, o) = submit([&write_raw, &write_ours]);
        w_raw.push(r);
        w_ours.push(o);
        let (r, o) = submit([&wait_raw, &wait_ours]);
        v_raw.push(r);
        v_ours.push(o);
    }

    // CPU time while 1,000 futures wait on 1 ms kernels (4 streams, 250 each),
    // against cuStreamSynchronize on the same work.
    let khz = Device::get(reg.host().ordinal())?
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?;
    let per_ms = khz as u64;
    let streams: Vec<_> = (0..4)
        .map(|_| CudaStream::new(reg.ctx()))
        .collect::<Result<_, _>>()?;
    let mut counters: Vec<_> = streams
        .iter()
        .map(|s| DeviceBuffer::<u32>::zeroed(s, 1))
        .collect::<Result<_, _>>()?;
    let n = if quick { 200 } else { 1_000 };
    let queue = |counters: &mut Vec<DeviceBuffer<u32>>| {
        for i in 0..n {
            // SAFETY: spin(unsigned long long, unsigned*) adds one to a live counter.
            unsafe { streams[i % 4].launch(&spin, cfg, (per_ms, &mut counters[i % 4])) }.unwrap();
        }
    };
    let (mut cpu_f, mut cpu_s) = (Row::default(), Row::default());
    let (mut wall_f, mut wall_s) = (Row::default(), Row::default());
    for _ in 0..rounds.min(3) {
        let (c0, t0) = (cpu_seconds(), Instant::now());
        let mut futures = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: as above.
            unsafe { streams[i % 4].launch(&spin, cfg, (per_ms, &mut counters[i % 4])) }.unwrap();
            futures.push(streams[i % 4].done());
        }
        block_on(async {
            for f in futures {
                f.await.unwrap();
            }
        });
        wall_f.push(t0.elapsed().as_secs_f64() * 1e3);
        cpu_f.push((cpu_seconds() - c0) * 1e3);
        let (c0, t0) = (cpu_seconds(), Instant::now());
        queue(&mut counters);
        for s in &streams {
            s.synchronize()?;
        }
        wall_s.push(t0.elapsed().as_secs_f64() * 1e3);
        cpu_s.push((cpu_seconds() - c0) * 1e3);
    }

    line(
        "empty kernel, then cuStreamSynchronize (us)",
        &lat_sync,
        "us",
        Some(&ratios(&lat_sync, &lat_sync)),
    );
    line(
        "empty kernel, then stream.done() woken (us)",
        &lat_future,
        "us",
        Some(&ratios(&lat_future, &lat_sync)),
    );
    line(
        "empty kernel, then raw host function unparks (us)",
        &lat_hostfn,
        "us",
        Some(&ratios(&lat_hostfn, &lat_sync)),
    );
    line(
        "empty kernel, then blocking-sync event wait (us)",
        &lat_event,
        "us",
        Some(&ratios(&lat_event, &lat_sync)),
    );
    line(
        "raw cuLaunchHostFunc submit",
        &h_raw,
        "us",
        Some(&ratios(&h_raw, &h_raw)),
    );
    line(
        "stream.launch_host_fn submit",
        &h_ours,
        "us",
        Some(&ratios(&h_ours, &h_raw)),
    );
    line(
        "  raw, 8 boxed bytes freed by the host function",
        &hb_raw,
        "us",
        Some(&ratios(&hb_raw, &h_raw)),
    );
    line(
        "  ours, a closure capturing nothing",
        &hz_ours,
        "us",
        Some(&ratios(&hz_ours, &h_raw)),
    );
    line(
        "raw cuStreamWriteValue32_v2 submit",
        &w_raw,
        "us",
        Some(&ratios(&w_raw, &w_raw)),
    );
    line(
        "stream.write_value32 submit",
        &w_ours,
        "us",
        Some(&ratios(&w_ours, &w_raw)),
    );
    line(
        "raw cuStreamWaitValue32_v2 submit",
        &v_raw,
        "us",
        Some(&ratios(&v_raw, &v_raw)),
    );
    line(
        "stream.wait_value32 submit",
        &v_ours,
        "us",
        Some(&ratios(&v_ours, &v_raw)),
    );
    let label = format!("{n} x 1 ms spins on 4 streams");
    line(&format!("{label}, futures: wall ms"), &wall_f, "  ", None);
    line(
        &format!("{label}, futures: CPU ms"),
        &cpu_f,
        "  ",
        Some(&ratios(&cpu_f, &wall_f)),
    );
    line(&format!("{label}, sync: wall ms"), &wall_s, "  ", None);
    line(
        &format!("{label}, sync: CPU ms"),
        &cpu_s,
        "  ",
        Some(&ratios(&cpu_s, &wall_s)),
    );
    println!(
        "(CPU rows: the ratio column is CPU time / wall time; /proc/self/stat at 100 ticks/s)"
    );
    Ok(())
}
