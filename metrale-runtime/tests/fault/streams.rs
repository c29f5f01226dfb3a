//! Streams and events: creation, priorities, ordering, timing, device checks, and
//! the safe-handle rules of the launch, copy and synchronisation entry points.

use std::sync::Arc;

use crate::common::*;
use crate::harness::Test;

fn streams_are_created_queried_and_destroyed() {
    let reg = setup();
    let ctx = reg.ctx();
    let before = fake().live(Live::Streams);
    let s = CudaStream::new(ctx).unwrap();
    assert_eq!(fake().live(Live::Streams), before + 1);
    assert!(s.query().unwrap());
    s.synchronize().unwrap();
    let clone = s.clone();
    assert!(clone.same_stream(&s));
    drop(s);
    assert_eq!(
        fake().live(Live::Streams),
        before + 1,
        "a clone keeps the stream"
    );
    drop(clone);
    assert_eq!(fake().live(Live::Streams), before);

    // Priorities: the device's range, checked before the driver.
    assert_eq!(ctx.stream_priority_range().unwrap(), (0, -5));
    let high = CudaStream::with_options(ctx, StreamOptions::default().with_priority(-5)).unwrap();
    assert_eq!(high.priority().unwrap(), -5);
    let e = CudaStream::with_options(ctx, StreamOptions::default().with_priority(3)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: stream priority 3 is outside device 0's range -5 (greatest) ..= 0 (least)"
    );
    // NOT_READY is an answer, not an error.
    fake().fail("cuStreamQuery", 600, 1, Some(1));
    assert!(!high.query().unwrap());
    assert!(high.query().unwrap());
    drop(high);
    done(reg);
}

fn events_order_streams_and_time_them() {
    let reg = setup();
    let ctx = reg.ctx();
    let (a, b) = (CudaStream::new(ctx).unwrap(), CudaStream::new(ctx).unwrap());
    let e = CudaEvent::new(ctx).unwrap();
    assert!(
        !e.has_timing(),
        "events are created without timing by default"
    );
    e.record(&a).unwrap();
    b.wait(&e).unwrap();
    assert!(e.query().unwrap());
    e.synchronize().unwrap();
    assert_eq!(fake().calls("cuStreamWaitEvent"), 1);

    let (start, end) = (
        CudaEvent::timed(ctx).unwrap(),
        CudaEvent::timed(ctx).unwrap(),
    );
    start.record(&a).unwrap();
    end.record(&a).unwrap();
    assert_eq!(start.elapsed_ms(&end).unwrap(), 0.5);
    // Timing needs timed events, checked before the driver.
    let calls = fake().calls("cuEventElapsedTime_v2");
    let err = e.elapsed_ms(&end).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument: elapsed time between events of device 0: the start event was created \
         without timing (use CudaEvent::timed)"
    );
    assert_eq!(fake().calls("cuEventElapsedTime_v2"), calls);
    drop((a, b, e, start, end));
    done(reg);
}

/// Before, `stream_synchronize(0xdeadbeef)` handed any pointer to the driver from
/// safe code; now only streams of the registry's device are accepted.
fn safe_entry_points_take_only_checked_streams() {
    let reg = setup();
    let other_device = host(1).unwrap();
    let foreign = other_device.stream();
    let e = reg.stream_synchronize(foreign).unwrap_err();
    assert_eq!(
        e.to_string(),
        "registry belongs to device 0, but the stream is on device 1"
    );
    let f = reg.function("kernels", "vec_add").unwrap();
    let buf = DeviceBuffer::<f32>::alloc(reg.stream(), 4).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (4, 1, 1), 0).unwrap();
    let launches = fake().launches();
    // SAFETY: refused before the driver.
    let e = unsafe { foreign.launch(&f, cfg, (&buf, &buf, &buf, 4u32)) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add' belongs to device 0, but the stream is on device 1"
    );
    assert!(matches!(
        e.kind(),
        ErrorKind::WrongDevice {
            belongs_to: 0,
            used_device: 1,
            ..
        }
    ));
    // A buffer of device 0 with a stream of device 1.
    let e = foreign.to_vec(&buf).unwrap_err();
    assert!(
        e.to_string().starts_with("device buffer 0x")
            && e.to_string()
                .ends_with("(4 x f32) belongs to device 0, but the stream is on device 1"),
        "{e}"
    );
    let event = CudaEvent::new(reg.ctx()).unwrap();
    let e = event.record(foreign).unwrap_err();
    assert_eq!(
        e.to_string(),
        "event belongs to device 0, but the stream it is recorded on is on device 1"
    );
    // Waiting may cross devices.
    event.record(reg.stream()).unwrap();
    foreign.wait(&event).unwrap();
    assert_eq!(fake().launches(), launches);
    drop((f, buf, event, other_device));
    done(reg);
}

fn streams_work_from_many_threads() {
    let reg = setup();
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let reg = Arc::clone(&reg);
            std::thread::spawn(move || {
                for _ in 0..20 {
                    let s = CudaStream::new(reg.ctx()).unwrap();
                    let f = reg.function("kernels", "empty").unwrap();
                    let buf = DeviceBuffer::<f32>::alloc(&s, 1).unwrap();
                    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
                    // SAFETY: the stand-in only records the arguments.
                    unsafe { s.launch(&f, cfg, (&buf, 1u32, 2.0f32)) }.unwrap();
                    s.synchronize().unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(fake().launches(), 160);
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "streams::created_queried_and_destroyed",
            run: streams_are_created_queried_and_destroyed,
        },
        Test {
            name: "streams::events_order_streams_and_time_them",
            run: events_order_streams_and_time_them,
        },
        Test {
            name: "streams::safe_entry_points_take_only_checked_streams",
            run: safe_entry_points_take_only_checked_streams,
        },
        Test {
            name: "streams::work_from_many_threads",
            run: streams_work_from_many_threads,
        },
    ]
}
