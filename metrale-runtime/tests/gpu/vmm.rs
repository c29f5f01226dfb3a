//! Virtual memory on the GPU: a growable buffer grown to 16 GiB while kernels
//! write and read it, sleep and wake.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use crate::common::*;
use crate::harness::{run_child, Child, Test};

const MIB: usize = 1 << 20;

/// fill_index over `view` (at most `u32::MAX` elements): element j = base + j.
fn fill(reg: &MetraleRegistry, s: &CudaStream, view: &mut DeviceSliceMut<'_, u32>, base: u32) {
    let f = reg.function("kernels", "fill_index").unwrap();
    let n = u32::try_from(view.len()).unwrap();
    let cfg = LaunchConfig::for_num_elems(view.len(), 256).unwrap();
    // SAFETY: fill_index(unsigned*, unsigned, unsigned) writes view[0..n].
    unsafe { s.launch(&f, cfg, (view, n, base)) }.unwrap();
}

/// consume over `view`: how many elements differ from `value`.
fn count_not(
    reg: &MetraleRegistry,
    s: &CudaStream,
    view: &DeviceSlice<'_, u32>,
    value: u32,
) -> u32 {
    let f = reg.function("kernels", "consume").unwrap();
    let mut bad = DeviceBuffer::<u32>::zeroed(s, 1).unwrap();
    let n = u32::try_from(view.len()).unwrap();
    let cfg = LaunchConfig::new((4096, 1, 1), (256, 1, 1), 0).unwrap();
    // SAFETY: consume(const unsigned*, unsigned, unsigned, unsigned*) reads
    // view[0..n] (grid-stride) and adds to bad[0].
    unsafe { s.launch(&f, cfg, (view, n, value, &mut bad)) }.unwrap();
    s.to_vec(&bad).unwrap()[0]
}

fn growable_buffer_grows_to_16_gib_in_place() {
    let reg = registry();
    let s = reg.stream();
    let total = 16usize << 30;
    let cap = total / 4; // u32 elements: 2^32
    let mut buf = GrowableBuffer::<u32>::new(s, cap).unwrap();
    assert_eq!(buf.capacity(), cap);
    let p = buf.device_ptr();
    let mut len = 0usize;
    let mut bytes = 2 * MIB;
    while bytes <= total {
        let new_len = bytes / 4;
        buf.grow_to(new_len).unwrap();
        assert_eq!(buf.device_ptr(), p, "element 0 never moves");
        assert_eq!(buf.len(), new_len);
        // Write the new part: element k holds k (k < 2^32).
        let base = u32::try_from(len).unwrap();
        fill(&reg, s, &mut buf.slice_mut(len..new_len).unwrap(), base);
        // Read across the boundary of the old and the new piece.
        if len > 0 {
            let window = buf.slice(len - 1024..len + 1024).unwrap();
            let got = s.to_vec(&window).unwrap();
            for (j, &v) in got.iter().enumerate() {
                assert_eq!(
                    v as usize,
                    len - 1024 + j,
                    "element {} at {bytes} bytes",
                    len - 1024 + j
                );
            }
        }
        len = new_len;
        bytes *= 2;
    }
    assert_eq!(buf.mapped_bytes(), total);
    // The last element, and every element read by a kernel across all pieces.
    assert_eq!(
        s.to_vec(&buf.slice(cap - 1..).unwrap()).unwrap(),
        [u32::MAX]
    );
    s.memset_u32(&mut buf, 0x1234_5678).unwrap();
    let half = cap / 2;
    assert_eq!(
        count_not(&reg, s, &buf.slice(..half).unwrap(), 0x1234_5678),
        0
    );
    assert_eq!(
        count_not(&reg, s, &buf.slice(half..).unwrap(), 0x1234_5678),
        0
    );
    // A copy spanning every piece boundary of the first 64 MiB.
    let mut other = DeviceBuffer::<u32>::zeroed(s, 16 * MIB).unwrap();
    s.copy_d2d(&buf.slice(..16 * MIB).unwrap(), &mut other)
        .unwrap();
    assert_eq!(
        count_not(&reg, s, &other.slice(..).unwrap(), 0x1234_5678),
        0
    );
}

fn sleep_releases_memory_and_wake_restores_every_byte() {
    let reg = registry();
    let s = reg.stream();
    let dev = Device::get(0).unwrap();
    let n = 512 * MIB / 4;
    let mut buf = GrowableBuffer::<u32>::new(s, 4 * n).unwrap();
    buf.grow_to(n / 2).unwrap();
    buf.grow_to(n).unwrap();
    fill(&reg, s, &mut buf.slice_mut(..).unwrap(), 7);
    s.synchronize().unwrap();
    let p = buf.device_ptr();
    let (free_awake, _) = dev.memory_info().unwrap();
    let asleep = buf.sleep(s).unwrap();
    let (free_asleep, _) = dev.memory_info().unwrap();
    assert!(
        free_asleep >= free_awake + 512 * MIB - 64 * MIB,
        "free memory rose by {} MiB, expected about 512",
        (free_asleep.saturating_sub(free_awake)) / MIB
    );
    let buf = asleep.wake(s).unwrap();
    assert_eq!(buf.device_ptr(), p);
    let got = s.to_vec(&buf).unwrap();
    for (i, &v) in got.iter().enumerate() {
        assert_eq!(v, i as u32 + 7, "element {i}");
    }
    // Kernels use the woken memory.
    let mut buf = buf;
    s.memset_u32(&mut buf, 9).unwrap();
    assert_eq!(count_not(&reg, s, &buf.slice(..).unwrap(), 9), 0);
}

const SOCKET_VAR: &str = "METRALE_TEST_VMM_SOCKET";

/// Two processes on one GPU: this one exports exportable pieces of a growable
/// buffer and writes them, the child imports through the socket, checks every
/// element with a kernel, writes its own, and says so; this one reads them.
fn two_processes_share_vmm_memory_through_a_descriptor() {
    let reg = registry();
    let s = reg.stream();
    let n = 64 * MIB / 4;
    let mut buf = GrowableBuffer::<u32>::with_handle_types(s, n, HandleTypes::POSIX_FD).unwrap();
    buf.grow_to(n).unwrap();
    fill(&reg, s, &mut buf.slice_mut(..).unwrap(), 0);
    s.synchronize().unwrap();
    let path = std::env::temp_dir().join(format!("metrale-gpu-vmm-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let phys = Arc::clone(buf.range().physical(0).unwrap());
    let server = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        phys.send(&conn).unwrap();
        let mut done = [0u8; 1];
        (&conn).read_exact(&mut done).unwrap();
        done[0]
    });
    let out = run_child(
        "vmm_import_and_write",
        &[(SOCKET_VAR, path.to_str().unwrap())],
    );
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "child failed: {out:?}");
    assert_eq!(server.join().unwrap(), 1);
    let got = s.to_vec(&buf.slice(..2048).unwrap()).unwrap();
    for (i, &v) in got.iter().enumerate() {
        let want = if i < 1000 {
            i as u32 + 100_000
        } else {
            i as u32
        };
        assert_eq!(v, want, "element {i}");
    }
}

fn child_vmm_import_and_write() {
    let path = std::env::var(SOCKET_VAR).unwrap();
    let conn = UnixStream::connect(path).unwrap();
    let reg = registry();
    let s = reg.stream();
    let phys = PhysicalMemory::receive(s, &conn).unwrap();
    let n = phys.size() / 4;
    let mut buf = GrowableBuffer::<u32>::from_physical(Arc::new(phys)).unwrap();
    let got = s.to_vec(&buf).unwrap();
    for (i, &v) in got.iter().enumerate() {
        assert_eq!(v, i as u32, "element {i} as the parent wrote it");
    }
    assert_eq!(got.len(), n);
    fill(&reg, s, &mut buf.slice_mut(..1000).unwrap(), 100_000);
    s.synchronize().unwrap();
    drop(buf);
    (&conn).write_all(&[1]).unwrap();
}

const HANDLE_VAR: &str = "METRALE_TEST_IPC_HANDLES";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> [u8; 64] {
    let mut out = [0u8; 64];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

/// Legacy IPC between two processes: a cuMemAlloc buffer and an interprocess
/// event as bytes (in the environment); the child waits for the event, checks
/// the buffer with a kernel and writes its own values.
fn two_processes_share_a_buffer_and_an_event_by_legacy_ipc() {
    let reg = registry();
    let s = reg.stream();
    let n = 1 << 20;
    let mut buf = DeviceBuffer::<u32>::zeroed(s, n).unwrap();
    fill(&reg, s, &mut buf.slice_mut(..).unwrap(), 0);
    let ready =
        CudaEvent::with_options(s, EventOptions::default().with_interprocess(true)).unwrap();
    ready.record(s).unwrap();
    s.synchronize().unwrap();
    let handles = format!(
        "{}{}",
        hex(&buf.ipc_handle().unwrap().to_bytes()),
        hex(&ready.ipc_handle().unwrap().to_bytes())
    );
    let out = run_child("legacy_ipc_open", &[(HANDLE_VAR, &handles)]);
    assert!(out.status.success(), "child failed: {out:?}");
    let got = s.to_vec(&buf.slice(..2048).unwrap()).unwrap();
    for (i, &v) in got.iter().enumerate() {
        let want = if i < 1000 { i as u32 + 500 } else { i as u32 };
        assert_eq!(v, want, "element {i}");
    }
}

fn child_legacy_ipc_open() {
    let handles = std::env::var(HANDLE_VAR).unwrap();
    let reg = registry();
    let s = reg.stream();
    let mem = IpcMemHandle::from_bytes(unhex(&handles[..128]));
    let event = IpcEventHandle::from_bytes(unhex(&handles[128..]));
    let ready = CudaEvent::open_ipc(s, &event).unwrap();
    s.wait(&ready).unwrap();
    // SAFETY: the parent's buffer holds 1 << 20 u32 and lives until this child
    // exits.
    let mut buf = unsafe { IpcBuffer::<u32>::open(s, &mem, 1 << 20) }.unwrap();
    let got = s.to_vec(&buf).unwrap();
    for (i, &v) in got.iter().enumerate() {
        assert_eq!(v, i as u32, "element {i} as the parent wrote it");
    }
    fill(&reg, s, &mut buf.slice_mut(..1000).unwrap(), 500);
    s.synchronize().unwrap();
}

const POOL_SOCKET_VAR: &str = "METRALE_TEST_POOL_SOCKET";

/// An exportable pool between two processes: the pool's descriptor and one
/// buffer's 64 bytes go in one message; the child imports both, checks and
/// writes, releases its reference, and says so before this side frees.
fn two_processes_share_a_pool_buffer() {
    let reg = registry();
    let s = reg.stream();
    let pool = MemPool::with_handle_types(s, HandleTypes::POSIX_FD).unwrap();
    let n = 1 << 20;
    let mut buf = s.alloc_from::<u32>(&pool, n).unwrap();
    fill(&reg, s, &mut buf.slice_mut(..).unwrap(), 0);
    s.synchronize().unwrap();
    let fd = pool.export_fd().unwrap();
    let data = buf.export_pointer().unwrap().to_bytes();
    let path = std::env::temp_dir().join(format!("metrale-gpu-pool-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let server = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        send_fd(&conn, std::os::fd::AsFd::as_fd(&fd), &data).unwrap();
        let mut done = [0u8; 1];
        (&conn).read_exact(&mut done).unwrap();
        done[0]
    });
    let out = run_child(
        "pool_import_and_write",
        &[(POOL_SOCKET_VAR, path.to_str().unwrap())],
    );
    let _ = std::fs::remove_file(&path);
    assert!(out.status.success(), "child failed: {out:?}");
    assert_eq!(server.join().unwrap(), 1);
    let got = s.to_vec(&buf.slice(..2048).unwrap()).unwrap();
    for (i, &v) in got.iter().enumerate() {
        let want = if i < 1000 { i as u32 + 77 } else { i as u32 };
        assert_eq!(v, want, "element {i}");
    }
    let child_err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !child_err.contains("metrale:"),
        "the child reported a leak or failure: {child_err}"
    );
    // The free is stream-ordered and the pool's destruction waits for it: let it
    // complete before the process may exit (memcheck counts it otherwise).
    drop(buf);
    s.synchronize().unwrap();
    drop(pool);
}

fn child_pool_import_and_write() {
    let path = std::env::var(POOL_SOCKET_VAR).unwrap();
    let conn = UnixStream::connect(path).unwrap();
    let reg = registry();
    let s = reg.stream();
    let mut data = [0u8; 64];
    let (fd, n) = recv_fd(&conn, &mut data).unwrap();
    assert_eq!(n, 64);
    let pool = Arc::new(MemPool::import_fd(s, std::os::fd::AsFd::as_fd(&fd)).unwrap());
    // SAFETY: the parent's buffer holds 1 << 20 u32 and is freed only after this
    // child says it is done.
    let mut buf =
        unsafe { IpcBuffer::<u32>::from_pool(&pool, &PoolPointer::from_bytes(data), 1 << 20) }
            .unwrap();
    let got = s.to_vec(&buf).unwrap();
    for (i, &v) in got.iter().enumerate() {
        assert_eq!(v, i as u32, "element {i} as the parent wrote it");
    }
    fill(&reg, s, &mut buf.slice_mut(..1000).unwrap(), 77);
    s.synchronize().unwrap();
    drop(buf);
    drop(pool);
    (&conn).write_all(&[1]).unwrap();
}

/// The child scenarios of this file.
pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "vmm_import_and_write",
            run: child_vmm_import_and_write,
        },
        Child {
            name: "legacy_ipc_open",
            run: child_legacy_ipc_open,
        },
        Child {
            name: "pool_import_and_write",
            run: child_pool_import_and_write,
        },
    ]
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "vmm::growable_buffer_grows_to_16_gib_in_place",
            run: growable_buffer_grows_to_16_gib_in_place,
        },
        Test {
            name: "vmm::sleep_releases_memory_and_wake_restores_every_byte",
            run: sleep_releases_memory_and_wake_restores_every_byte,
        },
        Test {
            name: "vmm::two_processes_share_vmm_memory_through_a_descriptor",
            run: two_processes_share_vmm_memory_through_a_descriptor,
        },
        Test {
            name: "vmm::two_processes_share_a_buffer_and_an_event_by_legacy_ipc",
            run: two_processes_share_a_buffer_and_an_event_by_legacy_ipc,
        },
        Test {
            name: "vmm::two_processes_share_a_pool_buffer",
            run: two_processes_share_a_pool_buffer,
        },
    ]
}
