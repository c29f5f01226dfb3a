//! Green contexts against the stand-in: the device's SM resource, splits (groups,
//! minimum, remainder), green contexts and their SM count read back, streams on
//! them used as ordinary streams (kernels of the device, copies, events), the
//! drop order, refusals before the driver, and an old driver's missing symbol.

use std::sync::Arc;

use crate::common::*;
use crate::harness::{run_child, Child, Test};

fn the_device_resource_splits_into_groups_and_a_remainder() {
    let reg = setup();
    let all = SmResource::of_device(reg.host().context()).unwrap();
    assert_eq!(
        (
            all.sm_count(),
            all.min_partition_size(),
            all.coscheduled_alignment()
        ),
        (132, 8, 8)
    );
    let halves = all.split_by_count(2, 64).unwrap();
    assert_eq!(halves.groups.len(), 2);
    assert!(halves.groups.iter().all(|g| g.sm_count() == 64));
    assert_eq!((halves.remaining.sm_count(), halves.min_count), (4, 64));
    // 66 rounds up to 72: one group only, the rest left over.
    let odd = all.split_by_count(2, 66).unwrap();
    assert_eq!(odd.groups.len(), 1);
    assert_eq!(odd.groups[0].sm_count(), 72);
    assert_eq!(odd.remaining.sm_count(), 60);
    // A group splits again.
    let quarter = halves.groups[0].split_by_count(4, 16).unwrap();
    assert_eq!(quarter.groups.len(), 4);
    assert_eq!(quarter.remaining.sm_count(), 0);
    assert_eq!(fake().calls("cuDevSmResourceSplitByCount"), 3);
}

fn refusals_come_before_the_driver() {
    let reg = setup();
    let all = SmResource::of_device(reg.host().context()).unwrap();
    let e = all.split_by_count(0, 8).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: SM split: at least one group is needed"
    );
    let e = all.split_by_count(1, 133).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: SM split: groups of at least 133 SMs asked, the set has 132"
    );
    assert_eq!(fake().calls("cuDevSmResourceSplitByCount"), 0);
    let e = GreenContext::new(&[]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: green context: no SM resources given"
    );
    let other = SmResource::of_device(&context(1).unwrap()).unwrap();
    let e = GreenContext::new(&[&all, &other]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: green context: SM resources of device 0 and device 1"
    );
    assert_eq!(fake().calls("cuDevResourceGenerateDesc"), 0);
    assert_eq!(fake().calls("cuGreenCtxCreate"), 0);
}

fn a_green_context_reads_its_sms_back_and_its_streams_are_ordinary() {
    let reg = setup();
    let split = SmResource::of_device(reg.host().context())
        .unwrap()
        .split_by_count(2, 64)
        .unwrap();
    let green = GreenContext::new(&[&split.groups[0]]).unwrap();
    assert_eq!(fake().live(Live::GreenContexts), 1);
    assert_eq!(green.sm_count().unwrap(), 64);
    let both = GreenContext::new(&[&split.groups[0], &split.groups[1]]).unwrap();
    assert_eq!(both.sm_count().unwrap(), 128);
    drop(both);

    let s = CudaStream::on_green_context(&green).unwrap();
    assert_eq!(fake().stream_green(s.raw().cast()), green.raw().cast());
    assert!(Arc::ptr_eq(s.green_context().unwrap(), &green));
    assert!(Arc::ptr_eq(s.context(), reg.host().context()));
    // Kernels loaded for the device, memory, copies and events, as on any stream.
    let f = reg.function("kernels", "vec_add").unwrap();
    let a = DeviceBuffer::from_host(&s, &[1.0f32; 64]).unwrap();
    let b = DeviceBuffer::from_host(&s, &[2.0f32; 64]).unwrap();
    let mut c = DeviceBuffer::<f32>::alloc(&s, 64).unwrap();
    let cfg = LaunchConfig::for_num_elems(64, 64).unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&f, cfg, (&a, &b, &mut c, 64u32)) }.unwrap();
    assert_eq!(fake().last_launch_stream(), s.raw().cast());
    assert_eq!(s.to_vec(&a).unwrap(), vec![1.0; 64]);
    let e = CudaEvent::new(&s).unwrap();
    e.record(&s).unwrap();
    reg.stream().wait(&e).unwrap();
    s.synchronize().unwrap();

    // The stream holds the green context: dropping ours first destroys nothing;
    // the stream's drop destroys the stream, then the green context.
    drop(green);
    assert_eq!(fake().live(Live::GreenContexts), 1);
    drop((a, b, c, e));
    drop(s);
    assert_eq!(fake().live(Live::GreenContexts), 0);
    assert_eq!(
        fake().green_orphans(),
        0,
        "no green context outlived by its streams"
    );
}

fn driver_failures_name_the_call_and_the_device() {
    let reg = setup();
    let all = SmResource::of_device(reg.host().context()).unwrap();
    fake().fail("cuGreenCtxCreate", 2, 1, Some(1));
    let e = GreenContext::new(&[&all]).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Driver {
                call: "cuGreenCtxCreate",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("device 0: creating a green context of 132 SMs"),
        "{e}"
    );
    let green = GreenContext::new(&[&all]).unwrap();
    fake().fail("cuGreenCtxStreamCreate", 2, 1, Some(1));
    let e = CudaStream::on_green_context(&green).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::Driver {
                call: "cuGreenCtxStreamCreate",
                ..
            }
        ),
        "{e}"
    );
    fake().fail("cuDevSmResourceSplitByCount", 1, 1, Some(1));
    let e = all.split_by_count(2, 8).unwrap_err();
    assert!(
        e.to_string()
            .contains("splitting 132 SMs into 2 groups of 8"),
        "{e}"
    );
}

/// The SM count in the error text is summed before any check: 3 x (2^31 - 1) SMs
/// is past `u32::MAX`, which must not overflow (a panic in debug builds).
fn a_huge_sm_count_does_not_overflow_the_error_text() {
    let reg = setup();
    fake().set_attribute(0, 16, i32::MAX);
    let all = SmResource::of_device(reg.host().context()).unwrap();
    assert_eq!(all.sm_count(), i32::MAX as u32);
    fake().fail("cuGreenCtxCreate", 1, 1, Some(1));
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        GreenContext::new(&[&all, &all, &all]).map(|_| ())
    }))
    .expect("GreenContext::new panicked")
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("device 0: creating a green context of 6442450941 SMs"),
        "{e}"
    );
}

fn green_contexts_on_an_old_driver_are_a_missing_symbol() {
    let old = metrale_fakecuda::old_library_path().to_str().unwrap();
    let out = run_child("old_driver_green", &[("METRALE_LIBCUDA_PATH", old)]);
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "old driver green: ok\n"
    );
}

fn child_old_driver_green() {
    let reg = setup();
    let e = SmResource::of_device(reg.host().context()).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::MissingSymbol {
                symbol: "cuDeviceGetDevResource",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("device 0: reading its SM resource"),
        "{e}"
    );
    println!("old driver green: ok");
}

fn dropping_after_shutdown_is_quiet() {
    let out = run_child("green_drop_after_shutdown", &[]);
    assert!(
        out.status.success(),
        "child failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "green drop after shutdown: ok\n"
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "",
        "teardown statuses are success"
    );
}

fn child_green_drop_after_shutdown() {
    let reg = setup();
    let all = SmResource::of_device(reg.host().context()).unwrap();
    let green = GreenContext::new(&[&all]).unwrap();
    let s = CudaStream::on_green_context(&green).unwrap();
    fake().shutdown(true);
    drop(green);
    drop(s);
    drop(reg);
    println!("green drop after shutdown: ok");
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "green::the_device_resource_splits_into_groups_and_a_remainder",
            run: the_device_resource_splits_into_groups_and_a_remainder,
        },
        Test {
            name: "green::refusals_come_before_the_driver",
            run: refusals_come_before_the_driver,
        },
        Test {
            name: "green::a_green_context_reads_its_sms_back_and_its_streams_are_ordinary",
            run: a_green_context_reads_its_sms_back_and_its_streams_are_ordinary,
        },
        Test {
            name: "green::a_huge_sm_count_does_not_overflow_the_error_text",
            run: a_huge_sm_count_does_not_overflow_the_error_text,
        },
        Test {
            name: "green::driver_failures_name_the_call_and_the_device",
            run: driver_failures_name_the_call_and_the_device,
        },
        Test {
            name: "green::dropping_after_shutdown_is_quiet",
            run: dropping_after_shutdown_is_quiet,
        },
        Test {
            name: "green::green_contexts_on_an_old_driver_are_a_missing_symbol",
            run: green_contexts_on_an_old_driver_are_a_missing_symbol,
        },
    ]
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "old_driver_green",
            run: child_old_driver_green,
        },
        Child {
            name: "green_drop_after_shutdown",
            run: child_green_drop_after_shutdown,
        },
    ]
}
