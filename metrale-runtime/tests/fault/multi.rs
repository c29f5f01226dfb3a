//! Two devices on the stand-in: one model loaded once for both, peer access and
//! copies, one thread per device, and handles refused on the other device.

use std::sync::Arc;

use crate::common::*;
use crate::harness::Test;

fn one_model_loaded_once_for_two_devices() {
    fake().reset();
    let regs = MetraleRegistry::load_on_devices(&[0, 1], &[("kernels", PTX)]).unwrap();
    assert_eq!(fake().calls("cuLibraryLoadData"), 1, "loaded once");
    assert_eq!(fake().calls("cuModuleLoadDataEx"), 0);
    assert!(regs.iter().all(|r| r.shares_code()));
    let (r0, r1) = (&regs[0], &regs[1]);
    assert_eq!((r0.host().ordinal(), r1.host().ordinal()), (0, 1));
    let (f0, f1) = (
        r0.function("kernels", "vec_add").unwrap(),
        r1.function("kernels", "vec_add").unwrap(),
    );
    assert_ne!(f0.as_raw(), f1.as_raw(), "one function per device");
    assert_eq!(f1.params().unwrap().len(), 4);
    for r in &regs {
        launch_vec_add(r);
        assert_eq!(fake().last_launch_stream(), raw(r.stream()));
    }
    // Symbols per device.
    let (s0, s1) = (
        r0.symbol_array::<u32>("kernels", COUNTERS, 16).unwrap(),
        r1.symbol_array::<u32>("kernels", COUNTERS, 16).unwrap(),
    );
    assert_ne!(s0.device_ptr(), s1.device_ptr());
    s0.write(r0.stream(), &[1; 16]).unwrap();
    s1.write(r1.stream(), &[2; 16]).unwrap();
    assert_eq!(s0.read(r0.stream()).unwrap(), vec![1; 16]);
    assert_eq!(s1.read(r1.stream()).unwrap(), vec![2; 16]);
    assert_eq!(r1.function_names("kernels").unwrap()[0], "vec_add");
    // A kernel of device 0 on device 1's stream, a buffer of device 1 in a
    // device-0 copy: refused, naming both devices.
    let buf = DeviceBuffer::<f32>::alloc(r1.stream(), 4).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (4, 1, 1), 0).unwrap();
    // SAFETY: refused before the driver.
    let e = unsafe { r1.stream().launch(&f0, cfg, (&buf, &buf, &buf, 4u32)) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add' belongs to device 0, but the stream is on device 1"
    );
    // SAFETY: refused before the driver.
    let e = unsafe { r0.launch(f1.raw(), cfg, r0.stream(), (&buf, &buf, &buf, 4u32)) }.unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::ForeignHandle { .. }), "{e}");
    drop((f0, f1, s0, s1, buf));
    let mut regs = regs;
    let last = regs.pop().unwrap();
    drop(regs);
    assert_eq!(fake().live(Live::Libraries), 1, "still used by device 1");
    done(last);
}

fn peer_access_and_peer_copies() {
    fake().reset();
    let (h0, h1) = (host(0).unwrap(), host(1).unwrap());
    let (d0, d1) = (Device::get(0).unwrap(), Device::get(1).unwrap());
    assert!(d0.can_access_peer(&d1).unwrap());
    assert!(!d0.can_access_peer(&d0).unwrap());
    let link = d0.peer_link(&d1).unwrap();
    assert!(link.access_supported && link.native_atomics);
    enable_peer_access(&h1, &h0).unwrap();
    enable_peer_access(&h1, &h0).unwrap();
    assert_eq!(
        fake().calls("cuCtxEnablePeerAccess"),
        2,
        "the second is a no-op"
    );
    let e = enable_peer_access(&h0, &h0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: peer access from device 0 to itself"
    );
    let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let a = DeviceBuffer::from_host(&h0, &values).unwrap();
    let mut b = DeviceBuffer::<f32>::zeroed(&h1, 1000).unwrap();
    h1.stream().copy_peer(&a, &mut b).unwrap();
    assert_eq!(h1.stream().to_vec(&b).unwrap(), values);
    let mut back = DeviceBuffer::<f32>::zeroed(&h0, 1000).unwrap();
    h0.stream()
        .copy_peer(&b.slice(..).unwrap(), &mut back)
        .unwrap();
    assert_eq!(h0.stream().to_vec(&back).unwrap(), values);
    // A plain device-to-device copy across devices is refused.
    let e = h0.stream().copy_d2d(&b, &mut back).unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::WrongDevice {
                belongs_to: 1,
                used_device: 0,
                ..
            }
        ),
        "{e}"
    );
    drop((a, b, back, h0, h1));
    release(0);
    release(1);
    assert_eq!(fake().primary_refs(), 0);
}

fn one_thread_per_device() {
    fake().reset();
    let regs = MetraleRegistry::load_on_devices(&[0, 1], &[("kernels", PTX)]).unwrap();
    let threads: Vec<_> = regs
        .iter()
        .map(|r| {
            let r = Arc::clone(r);
            std::thread::spawn(move || {
                let s = CudaStream::new(r.ctx()).unwrap();
                let f = r.function("kernels", "count_launch").unwrap();
                let counter = DeviceBuffer::<u64>::zeroed(&s, 1).unwrap();
                let cfg = LaunchConfig::new((1, 1, 1), (1, 1, 1), 0).unwrap();
                for _ in 0..1000 {
                    // SAFETY: the stand-in only records the arguments.
                    unsafe { s.launch(&f, cfg, (&counter,)) }.unwrap();
                }
                s.synchronize().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(fake().launches(), 2000);
    let mut regs = regs;
    let last = regs.pop().unwrap();
    drop(regs);
    done(last);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "multi::one_model_loaded_once_for_two_devices",
            run: one_model_loaded_once_for_two_devices,
        },
        Test {
            name: "multi::peer_access_and_peer_copies",
            run: peer_access_and_peer_copies,
        },
        Test {
            name: "multi::one_thread_per_device",
            run: one_thread_per_device,
        },
    ]
}
