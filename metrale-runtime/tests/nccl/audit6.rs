//! Audit of issue 43's round, the NCCL items, against the stand-ins.
//! `held_*`: attacks that held.

use std::time::Duration;

use metrale_runtime::nccl::{CommConfig, NcclBuffer, WindowFlags};
use metrale_runtime::{
    DeviceMemory, DeviceMemoryMut, KernelArgList, LaunchConfig, MetraleRegistry,
};

use super::{fake, harness, one_rank, reset};

static PTX: &[u8] = include_bytes!("../fixtures/kernels.ptx");

/// `&buf` and `&mut buf` of an NCCL buffer, of a registration and of a
/// window (guards that borrow the buffer, and whose `device_ptr` is the
/// buffer's), and `&dyn DeviceMemory` of a registration, are kernel
/// arguments: the kernel receives the buffer's device address each time,
/// never the guard's own host address.
fn held_nccl_memory_passes_the_buffers_address() {
    reset();
    let config = CommConfig::new().drop_timeout(Duration::from_millis(200));
    let (comm, s) = one_rank(&config);
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    let f = reg.function("kernels", "vec_add").unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap();
    let last = |n: i32| (0..n).map(|i| fake().last_param(i)).collect::<Vec<u64>>();
    let mut buf = NcclBuffer::<f32>::alloc(comm.context(), 64).unwrap();
    let mut other = NcclBuffer::<f32>::alloc(comm.context(), 64).unwrap();
    let (pb, po) = (buf.device_ptr(), other.device_ptr());
    // SAFETY: the stand-in only records the arguments (every launch here).
    unsafe { s.launch(&f, cfg, (&buf, &buf, &mut other, 1u32)) }.unwrap();
    assert_eq!(last(4), [pb, pb, po, 1]);
    {
        let mut registration = comm.register(&mut buf).unwrap();
        let as_dyn: &dyn DeviceMemory<f32> = &registration;
        // SAFETY: as above.
        unsafe { s.launch(&f, cfg, (as_dyn, as_dyn, &mut other_view(&mut other), 2u32)) }.unwrap();
        assert_eq!(last(4), [pb, pb, po, 2]);
        let mut list = KernelArgList::new();
        list.push(&mut registration)
            .push(&other)
            .push(&other)
            .push(3u32);
        // SAFETY: as above.
        unsafe { s.launch(&f, cfg, &list) }.unwrap();
        assert_eq!(last(4), [pb, po, po, 3]);
        drop(list);
        registration.deregister().map_err(|(_, e)| e).unwrap();
    }
    if let Ok(mut window) = comm.register_window(&mut other, WindowFlags::DEFAULT) {
        let out: &mut dyn DeviceMemoryMut<f32> = &mut window;
        // SAFETY: as above.
        unsafe { s.launch(&f, cfg, (&buf, &buf, out, 4u32)) }.unwrap();
        assert_eq!(last(4), [pb, pb, po, 4]);
        window.deregister().map_err(|(_, e)| e).unwrap();
    }
    s.synchronize().unwrap();
    drop((buf, other, f, reg));
    drop(comm);
}

/// A writable view of the whole of `b`.
fn other_view(b: &mut NcclBuffer<f32>) -> metrale_runtime::DeviceSliceMut<'_, f32> {
    b.slice_mut(..).unwrap()
}

pub(super) fn tests() -> Vec<harness::Test> {
    vec![harness::Test {
        name: "held_nccl_memory_passes_the_buffers_address",
        run: held_nccl_memory_passes_the_buffers_address,
    }]
}
