//! Virtual memory: granularity checks, reservation, mapping and access, the
//! growable buffer, sleep and wake, failure injection; nothing leaks (the
//! stand-in counts physical memory, ranges and mappings).

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use crate::common::*;
use crate::harness::{run_child, Child, Test};

const MIB: usize = 1 << 20;

fn vmm_counts() -> (i32, i32, i32) {
    (
        fake().live(Live::PhysicalMemory),
        fake().live(Live::ReservedRanges),
        fake().live(Live::Mappings),
    )
}

fn granularity_is_checked_and_said() {
    let reg = setup();
    let s = reg.stream();
    let g = granularity(s, HandleTypes::NONE).unwrap();
    assert_eq!((g.minimum, g.recommended), (2 * MIB, 2 * MIB));
    let e = VirtualRange::reserve(s, 3 * MIB).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: device 0: reserving address space: size 3145728 bytes is not a non-zero multiple of the allocation granularity (2097152 bytes)"
    );
    let e = PhysicalMemory::new(s, MIB, HandleTypes::NONE).unwrap_err();
    assert!(e.to_string().contains("granularity (2097152 bytes)"), "{e}");
    assert!(PhysicalMemory::new(s, 0, HandleTypes::NONE).is_err());
    assert_eq!(vmm_counts(), (0, 0, 0), "nothing made by refused calls");
    done(reg);
}

fn map_access_and_unmap() {
    let reg = setup();
    let s = reg.stream();
    let ctx = Arc::clone(s.context());
    let mut range = VirtualRange::reserve(s, 8 * MIB).unwrap();
    assert_eq!(range.size(), 8 * MIB);
    assert_eq!(range.device_ptr() % (2 * MIB) as u64, 0);
    let phys = Arc::new(PhysicalMemory::new(s, 4 * MIB, HandleTypes::NONE).unwrap());
    assert_eq!(vmm_counts(), (1, 1, 0));
    let rw = [(&ctx, Access::ReadWrite)];
    // Unaligned offset, past the end of the range, past the end of the memory.
    let e = range
        .map(MIB, Arc::clone(&phys), 0, 2 * MIB, &rw)
        .unwrap_err();
    assert!(
        e.to_string().contains(
            "mapping: offset 1048576 bytes is not a multiple of the allocation granularity (2097152 bytes)"
        ),
        "{e}"
    );
    let e = range
        .map(6 * MIB, Arc::clone(&phys), 0, 4 * MIB, &rw)
        .unwrap_err();
    assert!(e.to_string().contains("reach past the end"), "{e}");
    let e = range
        .map(0, Arc::clone(&phys), 2 * MIB, 4 * MIB, &rw)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("past the end of the physical memory (4194304 bytes)"),
        "{e}"
    );
    range.map(0, Arc::clone(&phys), 0, 4 * MIB, &rw).unwrap();
    assert_eq!(vmm_counts(), (1, 1, 1));
    // Over a mapped part: refused before the driver.
    let maps = fake().calls("cuMemMap");
    let other = Arc::new(PhysicalMemory::new(s, 4 * MIB, HandleTypes::NONE).unwrap());
    let e = range
        .map(2 * MIB, Arc::clone(&other), 0, 4 * MIB, &rw)
        .unwrap_err();
    assert!(e.to_string().contains("that part is already mapped"), "{e}");
    assert_eq!(fake().calls("cuMemMap"), maps);
    range
        .map(4 * MIB, Arc::clone(&other), 0, 4 * MIB, &[])
        .unwrap();
    assert_eq!(
        range.mappings().collect::<Vec<_>>(),
        [(0, 4 * MIB), (4 * MIB, 4 * MIB)]
    );
    // Access is set for part of the range only where it is all mapped.
    range.set_access(4 * MIB, 4 * MIB, &rw).unwrap();
    // Releasing our handles: the mappings keep the memory.
    drop(phys);
    drop(other);
    assert_eq!(vmm_counts(), (2, 1, 2));
    let e = range.unmap(2 * MIB).unwrap_err();
    assert!(
        e.to_string()
            .contains("no mapping starts at offset 2097152"),
        "{e}"
    );
    let back = range.unmap(0).unwrap();
    assert_eq!(back.size(), 4 * MIB);
    drop(back);
    assert_eq!(vmm_counts(), (1, 1, 1));
    let e = range.set_access(0, 8 * MIB, &rw).unwrap_err();
    assert!(e.to_string().contains("are not all mapped"), "{e}");
    // Drop unmaps what is left, then frees the range.
    drop(range);
    assert_eq!(vmm_counts(), (0, 0, 0));
    drop(ctx);
    done(reg);
}

fn growable_buffer_keeps_its_address() {
    let reg = setup();
    let s = reg.stream();
    let mut buf = GrowableBuffer::<u32>::new(s, 16 * MIB).unwrap();
    assert_eq!(buf.capacity(), 16 * MIB);
    assert!(buf.is_empty());
    assert_eq!(vmm_counts(), (0, 1, 0));
    let p = buf.device_ptr();
    buf.grow_to(1000).unwrap();
    assert_eq!((buf.len(), buf.mapped_bytes()), (1000, 2 * MIB));
    let first: Vec<u32> = (0..1000).collect();
    s.copy_h2d(&first, &mut buf).unwrap();
    buf.grow_to(MIB).unwrap(); // 4 MiB of u32
    assert_eq!(buf.device_ptr(), p, "element 0 never moves");
    assert_eq!(buf.mapped_bytes(), 4 * MIB);
    assert_eq!(buf.range().mappings().count(), 2);
    assert_eq!(s.to_vec(&buf.slice(..1000).unwrap()).unwrap(), first);
    // Across the boundary of the two pieces.
    let across: Vec<u32> = (0..2000).map(|i| i * 3 + 1).collect();
    let start = 2 * MIB / 4 - 1000;
    s.copy_h2d(&across, &mut buf.slice_mut(start..start + 2000).unwrap())
        .unwrap();
    assert_eq!(
        s.to_vec(&buf.slice(start..start + 2000).unwrap()).unwrap(),
        across
    );
    s.memset_u32(&mut buf.slice_mut(MIB - 10..).unwrap(), 7)
        .unwrap();
    assert_eq!(s.to_vec(&buf.slice(MIB - 10..).unwrap()).unwrap(), [7; 10]);
    // One piece: one create, one map, one access call, no granularity query.
    let calls = |name| fake().calls(name);
    let before = (
        calls("cuMemGetAllocationGranularity"),
        calls("cuMemCreate"),
        calls("cuMemMap"),
        calls("cuMemSetAccess"),
    );
    buf.grow_to(MIB + 1).unwrap();
    assert_eq!(
        (
            calls("cuMemGetAllocationGranularity") - before.0,
            calls("cuMemCreate") - before.1,
            calls("cuMemMap") - before.2,
            calls("cuMemSetAccess") - before.3,
        ),
        (0, 1, 1, 1)
    );
    // Shrinking changes nothing; past the capacity is refused.
    buf.grow_to(10).unwrap();
    assert_eq!(buf.len(), MIB + 1);
    let e = buf.grow_to(16 * MIB + 1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: growing a buffer to 16777217 elements: its capacity is 16777216 elements"
    );
    assert!(buf.slice(..MIB + 2).is_err(), "slices end at len()");
    // A kernel argument is the address of element 0.
    let k = reg.function("kernels", "fill_index").unwrap();
    let n = u32::try_from(buf.len()).unwrap();
    let cfg = LaunchConfig::for_num_elems(buf.len(), 256).unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(&k, cfg, (&mut buf, n, 5u32)) }.unwrap();
    assert_eq!(fake().last_param(0), p);
    drop(k);
    assert_eq!(vmm_counts(), (3, 1, 3));
    drop(buf);
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

/// A copy still queued when the buffer is dropped: the stand-in's unmap does not
/// wait (its deferred copy would read unmapped memory and crash the process), so
/// the buffer must wait first.
fn dropping_waits_for_queued_work() {
    let reg = setup();
    let s = reg.stream();
    let mut buf = GrowableBuffer::<u32>::new(s, MIB).unwrap();
    buf.grow_to(4096).unwrap();
    let values: Vec<u32> = (0..4096).map(|i| i ^ 0x5a5a).collect();
    s.copy_h2d(&values, &mut buf).unwrap();
    let pinned = PinnedBuffer::<u32>::zeroed(s, 4096).unwrap();
    let pending = s.copy_d2h_pinned(&buf, pinned).unwrap();
    assert!(fake().pending(raw(s)) > 0, "the copy is still queued");
    drop(buf);
    assert_eq!(fake().pending(raw(s)), 0, "the drop waited for it");
    assert_eq!(vmm_counts(), (0, 0, 0));
    let back = pending.wait().unwrap();
    assert_eq!(&back[..], &values[..]);
    drop(back);
    done(reg);
}

/// A use on another device's stream (a peer copy) is waited for before the
/// memory is released: that stream is synchronised, not only this context.
fn uses_on_another_device_are_waited_for() {
    let reg = setup();
    let h0 = Arc::clone(reg.host());
    let h1 = host(1).unwrap();
    let mut buf = GrowableBuffer::<f32>::new(&h0, MIB).unwrap();
    buf.grow_to(1000).unwrap();
    let values: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    h0.stream().copy_h2d(&values, &mut buf).unwrap();
    let mut other = DeviceBuffer::<f32>::zeroed(&h1, 1000).unwrap();
    h1.stream().copy_peer(&buf, &mut other).unwrap();
    let syncs = fake().calls("cuStreamSynchronize");
    let asleep = buf.sleep_discarding().unwrap();
    assert!(
        fake().calls("cuStreamSynchronize") > syncs,
        "the other device's stream was waited for"
    );
    assert_eq!(h1.stream().to_vec(&other).unwrap(), values);
    drop(asleep);
    drop(other);
    drop(h1);
    drop(h0);
    done(reg);
}

fn failures_leave_the_buffer_as_it_was() {
    let reg = setup();
    let s = reg.stream();
    let mut buf = GrowableBuffer::<u8>::new(s, 8 * MIB).unwrap();
    buf.grow_to(MIB).unwrap();
    fake().fail("cuMemCreate", 2, 1, Some(1));
    let e = buf.grow_to(3 * MIB).unwrap_err();
    assert_eq!(e.status(), Some(CUresult(2)));
    assert!(e.to_string().contains("cuMemCreate"), "{e}");
    assert!(
        e.to_string()
            .contains("creating 2097152 bytes of physical memory"),
        "{e}"
    );
    fake().fail("cuMemMap", 2, 1, Some(1));
    assert!(buf.grow_to(3 * MIB).is_err());
    assert_eq!(vmm_counts(), (1, 1, 1), "the refused piece was released");
    fake().fail("cuMemSetAccess", 999, 1, Some(1));
    let e = buf.grow_to(3 * MIB).unwrap_err();
    assert!(e.to_string().contains("cuMemSetAccess"), "{e}");
    assert_eq!(vmm_counts(), (1, 1, 1), "the mapping was undone");
    assert_eq!((buf.len(), buf.mapped_bytes()), (MIB, 2 * MIB));
    buf.grow_to(3 * MIB).unwrap();
    assert_eq!(vmm_counts(), (2, 1, 2));
    // A failed wait keeps the mapping: nothing is unmapped under queued work.
    let mut range = VirtualRange::reserve(s, 2 * MIB).unwrap();
    let phys = Arc::new(PhysicalMemory::new(s, 2 * MIB, HandleTypes::NONE).unwrap());
    range.map(0, phys, 0, 2 * MIB, &[]).unwrap();
    fake().fail("cuCtxSynchronize", 999, 1, Some(1));
    let e = range.unmap(0).unwrap_err();
    assert!(e.to_string().contains("cuCtxSynchronize"), "{e}");
    assert_eq!(range.mappings().count(), 1);
    drop(range);
    drop(buf);
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

fn sleep_and_wake_restore_every_byte() {
    let reg = setup();
    let s = reg.stream();
    let mut buf = GrowableBuffer::<u32>::new(s, 4 * MIB).unwrap();
    buf.grow_to(MIB / 2).unwrap(); // 2 MiB
    buf.grow_to(MIB + 3).unwrap(); // two more granules
    let values: Vec<u32> = (0..MIB as u32 + 3)
        .map(|i| i.wrapping_mul(2654435761))
        .collect();
    s.copy_h2d(&values, &mut buf).unwrap();
    let p = buf.device_ptr();
    let (free_awake, _) = memory_info(s).unwrap();
    let asleep = buf.sleep(s).unwrap();
    assert!(asleep.is_saved());
    assert_eq!((asleep.len(), asleep.device_ptr()), (MIB + 3, p));
    let (free_asleep, _) = memory_info(s).unwrap();
    assert_eq!(
        free_asleep - free_awake,
        6 * MIB,
        "the physical memory went"
    );
    assert_eq!(vmm_counts(), (0, 1, 0), "addresses kept, memory released");
    let buf = asleep.wake(s).unwrap();
    assert_eq!(buf.device_ptr(), p);
    assert_eq!(
        buf.range().mappings().collect::<Vec<_>>(),
        [(0, 2 * MIB), (2 * MIB, 4 * MIB)]
    );
    assert_eq!(s.to_vec(&buf).unwrap(), values);
    // Without saving: the length and addresses come back.
    let asleep = buf.sleep_discarding().unwrap();
    assert!(!asleep.is_saved());
    let mut buf = asleep.wake(s).unwrap();
    assert_eq!((buf.len(), buf.device_ptr()), (MIB + 3, p));
    s.zero(&mut buf).unwrap();
    // A failed save releases nothing and hands the buffer back.
    fake().fail("cuMemcpyDtoHAsync_v2", 999, 1, Some(1));
    let err = buf.sleep(s).unwrap_err();
    assert!(
        err.error.to_string().contains("cuMemcpyDtoHAsync_v2"),
        "{}",
        err.error
    );
    let SleepState::Awake(buf) = err.buffer else {
        panic!("nothing was released, the buffer is awake");
    };
    assert_eq!(vmm_counts(), (2, 1, 2));
    // A failed wake keeps it asleep; waking again maps only what is missing.
    let asleep = buf.sleep(s).unwrap();
    fake().fail("cuMemCreate", 2, 1, Some(1));
    let err = asleep.wake(s).unwrap_err();
    assert_eq!(err.error.status(), Some(CUresult(2)));
    assert_eq!(
        vmm_counts(),
        (0, 1, 0),
        "nothing mapped, the addresses kept"
    );
    let mut buf = err.buffer.wake(s).unwrap();
    assert_eq!(s.to_vec(&buf).unwrap(), vec![0; MIB + 3]);
    // Saving into the caller's pinned memory, handed back on waking; too short
    // a host buffer is refused with the buffer awake.
    s.copy_h2d(&values, &mut buf).unwrap();
    let short = PinnedBuffer::<u8>::zeroed(s, 6 * MIB - 1).unwrap();
    let err = buf.sleep_into(s, short).unwrap_err();
    assert!(
        err.error.to_string().contains("6291455 bytes"),
        "{}",
        err.error
    );
    let SleepState::Awake(buf) = err.buffer else {
        panic!("a refused sleep releases nothing");
    };
    let host = PinnedBuffer::<u8>::zeroed(s, 6 * MIB).unwrap();
    let host_ptr = host.as_ptr();
    let asleep = buf.sleep_into(s, host).unwrap();
    assert!(asleep.is_saved());
    let (buf, host) = asleep.wake_keeping_host(s).unwrap();
    let host = host.expect("the saved contents' memory comes back");
    assert_eq!(host.as_ptr(), host_ptr, "the same pinned memory");
    assert_eq!(s.to_vec(&buf).unwrap(), values);
    let asleep = buf.sleep_into(s, host).unwrap();
    let (buf, _) = asleep.wake_keeping_host(s).unwrap();
    assert_eq!(s.to_vec(&buf).unwrap(), values, "reused for a second sleep");
    // A sleeping buffer dropped frees everything.
    let asleep = buf.sleep_discarding().unwrap();
    drop(asleep);
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

fn shared_values(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i ^ 0xabc).collect()
}

/// Export, send, import in the same process: two ranges over one memory. The
/// sender's descriptor and handle go before the import: the message holds it.
fn export_and_import_share_the_memory() {
    let reg = setup();
    let s = reg.stream();
    let n = 2 * MIB / 4;
    let mut a = GrowableBuffer::<u32>::with_handle_types(s, n, HandleTypes::POSIX_FD).unwrap();
    a.grow_to(n).unwrap();
    s.copy_h2d(&shared_values(n), &mut a).unwrap();
    let (tx, rx) = UnixStream::pair().unwrap();
    a.range().physical(0).unwrap().send(&tx).unwrap();
    let phys = PhysicalMemory::receive(s, &rx).unwrap();
    assert_eq!(phys.size(), 2 * MIB);
    assert_eq!(fake().live(Live::PhysicalMemory), 2, "one handle per side");
    let mut b = GrowableBuffer::<u32>::from_physical(Arc::new(phys)).unwrap();
    assert_eq!((b.len(), b.capacity()), (n, n));
    assert_ne!(b.device_ptr(), a.device_ptr());
    assert_eq!(s.to_vec(&b).unwrap(), shared_values(n));
    s.memset_u32(&mut b.slice_mut(..10).unwrap(), 42).unwrap();
    assert_eq!(s.to_vec(&a.slice(..10).unwrap()).unwrap(), [42; 10]);
    // Either side may go first.
    drop(a);
    assert_eq!(
        s.to_vec(&b.slice(10..20).unwrap()).unwrap(),
        shared_values(20)[10..]
    );
    assert!(
        b.grow_to(n + 1).is_err(),
        "an imported buffer does not grow"
    );
    drop(b);
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

fn close_on_exec(fd: &impl AsRawFd) -> bool {
    // SAFETY: reads the flags of a descriptor the caller holds open.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
    assert!(flags >= 0, "fcntl: {}", std::io::Error::last_os_error());
    flags & libc::FD_CLOEXEC != 0
}

/// Exported descriptors are close-on-exec (the stand-in, like the driver, hands
/// out descriptors without the flag), so no exec'd program inherits the memory.
fn exported_descriptors_are_close_on_exec() {
    let reg = setup();
    let s = reg.stream();
    let mut a = GrowableBuffer::<u32>::with_handle_types(s, 1, HandleTypes::POSIX_FD).unwrap();
    a.grow_to(1).unwrap();
    let fd = a.range().physical(0).unwrap().export_fd().unwrap();
    assert!(close_on_exec(&fd), "PhysicalMemory::export_fd");
    let pool = MemPool::with_handle_types(s, HandleTypes::POSIX_FD).unwrap();
    let pool_fd = pool.export_fd().unwrap();
    assert!(close_on_exec(&pool_fd), "MemPool::export_fd");
    drop((fd, pool_fd, pool, a));
    done(reg);
}

fn sharing_misuse_is_refused_clearly() {
    let reg = setup();
    let s = reg.stream();
    let plain = PhysicalMemory::new(s, 2 * MIB, HandleTypes::NONE).unwrap();
    let e = plain.export_fd().unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: exporting 2097152 bytes of physical memory on device 0: it was not made with HandleTypes::POSIX_FD"
    );
    // A descriptor that is not exported device memory.
    let null = std::fs::File::open("/dev/null").unwrap();
    let e = PhysicalMemory::import_fd(s, null.as_fd(), 2 * MIB).unwrap_err();
    assert!(
        e.to_string().contains("cuMemImportFromShareableHandle"),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("importing 2097152 bytes of physical memory from descriptor"),
        "{e}"
    );
    // The driver says only CUDA_ERROR_UNKNOWN: the text says the likely cause.
    assert_eq!(e.status(), Some(CUresult(999)));
    assert!(
        e.to_string().contains(&format!(
            "from descriptor {}, which is likely not a descriptor that \
             PhysicalMemory::export_fd (cuMemExportToShareableHandle) made (a file, pipe or \
             socket, or a descriptor number sent as data instead of with SCM_RIGHTS): \
             cuMemImportFromShareableHandle failed: CUDA_ERROR_UNKNOWN (999)",
            null.as_raw_fd()
        )),
        "{e}"
    );
    let shared = PhysicalMemory::new(s, 2 * MIB, HandleTypes::POSIX_FD).unwrap();
    let fd = shared.export_fd().unwrap();
    let e = PhysicalMemory::import_fd(s, fd.as_fd(), 3 * MIB).unwrap_err();
    assert!(e.to_string().contains("granularity (2097152 bytes)"), "{e}");
    // A failed export makes no descriptor.
    fake().fail("cuMemExportToShareableHandle", 999, 1, Some(1));
    assert!(shared.export_fd().is_err());
    // Sockets: a peer that closed, a message without a descriptor, empty data.
    let (tx, rx) = UnixStream::pair().unwrap();
    let e = send_fd(&tx, fd.as_fd(), &[]).unwrap_err();
    assert!(e.to_string().contains("at least one byte"), "{e}");
    (&tx).write_all(&[1, 2, 3]).unwrap();
    let mut buf = [0u8; 8];
    let e = recv_fd(&rx, &mut buf).unwrap_err();
    assert_eq!(
        e.to_string(),
        "receiving a descriptor over a Unix socket: a message of 3 bytes came without a descriptor"
    );
    drop(tx);
    let e = PhysicalMemory::receive(s, &rx).unwrap_err();
    assert_eq!(
        e.to_string(),
        "receiving a descriptor over a Unix socket: the peer closed the socket"
    );
    // The descriptor received is the memory's even after the sender closed its own.
    let (tx, rx) = UnixStream::pair().unwrap();
    send_fd(&tx, fd.as_fd(), b"x").unwrap();
    drop(fd);
    drop(shared);
    let (got, n) = recv_fd(&rx, &mut buf).unwrap();
    assert_eq!(n, 1);
    let imported = PhysicalMemory::import_fd(s, got.as_fd(), 2 * MIB).unwrap();
    drop(got);
    let mut range = VirtualRange::reserve(s, 2 * MIB).unwrap();
    range
        .map(
            0,
            Arc::new(imported),
            0,
            2 * MIB,
            &[(s.context(), Access::Read)],
        )
        .unwrap();
    drop(range);
    drop(plain);
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

const SOCKET_VAR: &str = "METRALE_TEST_VMM_SOCKET";

/// Two real processes: this one exports and writes, a child imports through the
/// socket, checks every value, writes its own, and says so; this one reads them.
fn two_processes_share_memory_through_a_descriptor() {
    let reg = setup();
    let s = reg.stream();
    let n = 4 * MIB / 4;
    let mut buf = GrowableBuffer::<u32>::with_handle_types(s, n, HandleTypes::POSIX_FD).unwrap();
    buf.grow_to(n).unwrap();
    s.copy_h2d(&shared_values(n), &mut buf).unwrap();
    let path = std::env::temp_dir().join(format!("metrale-vmm-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let phys = Arc::clone(buf.range().physical(0).unwrap());
    let server = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        phys.send(&conn).unwrap();
        drop(phys);
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
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "",
        "stderr must stay empty"
    );
    assert_eq!(server.join().unwrap(), 1);
    let got = s.to_vec(&buf).unwrap();
    for (i, &v) in got.iter().enumerate() {
        let want = if i < 1000 {
            i as u32 * 7
        } else {
            i as u32 ^ 0xabc
        };
        assert_eq!(v, want, "element {i}");
    }
    drop(buf);
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

fn child_vmm_import_and_write() {
    let path = std::env::var(SOCKET_VAR).unwrap();
    let conn = UnixStream::connect(path).unwrap();
    let h = host(0).unwrap();
    let s = h.stream();
    let phys = PhysicalMemory::receive(&h, &conn).unwrap();
    let n = phys.size() / 4;
    let mut buf = GrowableBuffer::<u32>::from_physical(Arc::new(phys)).unwrap();
    assert_eq!(s.to_vec(&buf).unwrap(), shared_values(n));
    let mine: Vec<u32> = (0..1000).map(|i| i * 7).collect();
    s.copy_h2d(&mine, &mut buf.slice_mut(..1000).unwrap())
        .unwrap();
    drop(buf);
    drop(h);
    release(0);
    assert_eq!(vmm_counts(), (0, 0, 0), "the child's handles are its own");
    (&conn).write_all(&[1]).unwrap();
}

/// Legacy IPC: a cuMemAlloc buffer and an interprocess event as 64 bytes. The
/// stand-in opens them in the same process (its device memory is heap memory).
fn legacy_ipc_handles_as_bytes() {
    let reg = setup();
    let s = reg.stream();
    let values: Vec<u32> = (0..4096).collect();
    let buf = DeviceBuffer::from_host(s, &values).unwrap();
    let bytes = buf.ipc_handle().unwrap().to_bytes();
    let handle = IpcMemHandle::from_bytes(bytes);
    // SAFETY: the buffer holds 4096 u32 and outlives the opened one.
    let mut opened = unsafe { IpcBuffer::<u32>::open(s, &handle, 4096) }.unwrap();
    assert_eq!(fake().ipc_open(), 1);
    assert_eq!(s.to_vec(&opened).unwrap(), values);
    s.memset_u32(&mut opened.slice_mut(..4).unwrap(), 9)
        .unwrap();
    assert_eq!(s.to_vec(&buf.slice(..4).unwrap()).unwrap(), [9; 4]);
    drop(opened);
    assert_eq!(fake().ipc_open(), 0, "closed on drop");
    // Misuse: a stream-ordered buffer, bytes that name nothing.
    let ordered = s.alloc::<u32>(16).unwrap();
    let e = ordered.ipc_handle().unwrap_err();
    assert!(
        e.to_string()
            .contains("only a non-empty buffer from cuMemAlloc has a legacy IPC handle"),
        "{e}"
    );
    // SAFETY: the open fails (the bytes name no buffer).
    let e =
        unsafe { IpcBuffer::<u32>::open(s, &IpcMemHandle::from_bytes([7; 64]), 16) }.unwrap_err();
    assert!(e.to_string().contains("cuIpcOpenMemHandle_v2"), "{e}");
    assert!(
        e.to_string().contains("opening an IPC memory handle"),
        "{e}"
    );
    // Events.
    let e = CudaEvent::with_options(
        s,
        EventOptions::default()
            .with_interprocess(true)
            .with_timing(true),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("an interprocess event cannot record timing"),
        "{e}"
    );
    let plain = CudaEvent::new(s).unwrap();
    let e = plain.ipc_handle().unwrap_err();
    assert!(e.to_string().contains("cuIpcGetEventHandle"), "{e}");
    let shared =
        CudaEvent::with_options(s, EventOptions::default().with_interprocess(true)).unwrap();
    let h = IpcEventHandle::from_bytes(shared.ipc_handle().unwrap().to_bytes());
    let opened = CudaEvent::open_ipc(s, &h).unwrap();
    opened.record(s).unwrap();
    s.wait(&opened).unwrap();
    opened.synchronize().unwrap();
    let e = CudaEvent::open_ipc(s, &IpcEventHandle::from_bytes([0; 64])).unwrap_err();
    assert!(e.to_string().contains("cuIpcOpenEventHandle"), "{e}");
    drop(opened);
    drop(shared);
    drop(plain);
    drop(ordered);
    drop(buf);
    done(reg);
}

/// Exportable pools: the pool as a descriptor, each buffer as 64 bytes; the
/// importer's buffer releases its reference only.
fn pools_shared_by_descriptor_and_pointer() {
    let reg = setup();
    let s = reg.stream();
    let pool = MemPool::with_handle_types(s, HandleTypes::POSIX_FD).unwrap();
    let values: Vec<u32> = (0..1024).map(|i| i * 5).collect();
    let mut buf = s.alloc_from::<u32>(&pool, 1024).unwrap();
    s.copy_h2d(&values, &mut buf).unwrap();
    let fd = pool.export_fd().unwrap();
    let imported = Arc::new(MemPool::import_fd(s, fd.as_fd()).unwrap());
    drop(fd);
    let e = s.alloc_from::<u32>(&imported, 16).unwrap_err();
    assert_eq!(
        e.status(),
        Some(CUresult(801)),
        "an imported pool does not allocate: {e}"
    );
    let data = PoolPointer::from_bytes(buf.export_pointer().unwrap().to_bytes());
    // SAFETY: `buf` holds 1024 u32 and outlives the import.
    let mut shared = unsafe { IpcBuffer::<u32>::from_pool(&imported, &data, 1024) }.unwrap();
    assert_eq!(fake().ipc_open(), 1);
    assert_eq!(s.to_vec(&shared).unwrap(), values);
    s.memset_u32(&mut shared.slice_mut(..2).unwrap(), 3)
        .unwrap();
    drop(shared);
    assert_eq!(fake().ipc_open(), 0, "the importer's reference went");
    assert_eq!(
        s.to_vec(&buf.slice(..3).unwrap()).unwrap(),
        [3, 3, 10],
        "the exporter's buffer stays"
    );
    // Misuse.
    let plain = MemPool::new(s).unwrap();
    let e = plain.export_fd().unwrap_err();
    assert!(
        e.to_string().contains("cuMemPoolExportToShareableHandle"),
        "{e}"
    );
    let dev = DeviceBuffer::<u32>::alloc(s, 16).unwrap();
    let e = dev.export_pointer().unwrap_err();
    assert!(
        e.to_string()
            .contains("only a non-empty stream-ordered buffer of an exportable pool"),
        "{e}"
    );
    let not_imported = Arc::new(MemPool::new(s).unwrap());
    // SAFETY: the import fails (the pool was not imported).
    let e = unsafe { IpcBuffer::<u32>::from_pool(&not_imported, &data, 16) }.unwrap_err();
    assert!(e.to_string().contains("cuMemPoolImportPointer"), "{e}");
    let null = std::fs::File::open("/dev/null").unwrap();
    let e = MemPool::import_fd(s, null.as_fd()).unwrap_err();
    assert!(
        e.to_string()
            .contains("importing a memory pool from descriptor"),
        "{e}"
    );
    assert!(
        e.to_string().contains(
            "which is likely not a descriptor that MemPool::export_fd \
             (cuMemPoolExportToShareableHandle) made (a file, pipe or socket, or a descriptor \
             number sent as data instead of with SCM_RIGHTS): \
             cuMemPoolImportFromShareableHandle failed: CUDA_ERROR_UNKNOWN (999)"
        ),
        "{e}"
    );
    drop(buf);
    drop(dev);
    drop(plain);
    drop(not_imported);
    drop(imported);
    drop(pool);
    assert_eq!(fake().live(Live::Pools), 0);
    done(reg);
}

pub fn children() -> Vec<Child> {
    vec![Child {
        name: "vmm_import_and_write",
        run: child_vmm_import_and_write,
    }]
}

/// With a GPU-side wait pending on a mapped word the host never writes, a wait
/// for the whole context would never return: sleep and unmap refuse, drops leak (reported).
fn a_pending_wait_makes_sleep_refuse_and_drop_leak() {
    let reg = setup();
    let s = reg.stream();
    let (a, b) = (
        CudaStream::new(reg.ctx()).unwrap(),
        CudaStream::new(reg.ctx()).unwrap(),
    );
    let flags = Arc::new(MappedWords::<u32>::new(reg.ctx(), 1).unwrap());
    let word = SignalWord::mapped(&flags, 0).unwrap();
    let mut buf = GrowableBuffer::<u32>::new(s, MIB).unwrap();
    buf.grow_to(1024).unwrap();
    let mut range = VirtualRange::reserve(s, 2 * MIB).unwrap();
    let phys = Arc::new(PhysicalMemory::new(s, 2 * MIB, HandleTypes::NONE).unwrap());
    range
        .map(0, phys, 0, 2 * MIB, &[(reg.ctx(), Access::ReadWrite)])
        .unwrap();
    let (gb, rb) = (buf.device_ptr(), range.device_ptr());
    a.wait_value32(&word, 1, WaitFlags::EQ).unwrap();
    // Run in a thread so that a blocking wait fails the test instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let e = buf.sleep_discarding().unwrap_err();
        let buf = match e.buffer {
            SleepState::Awake(buf) => buf,
            _ => panic!("still awake"),
        };
        let text = e.error.to_string();
        let unmapped = range.unmap(0).unwrap_err().to_string();
        tx.send((text, unmapped, buf, range)).unwrap();
    });
    let (text, unmapped, buf, range) = rx
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("sleep / unmap blocked on the pending wait");
    t.join().unwrap();
    assert!(text.contains("1 pending GPU-side wait(s)"), "{text}");
    assert!(unmapped.contains("pending GPU-side wait(s)"), "{unmapped}");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(buf);
        drop(range);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(std::time::Duration::from_secs(5))
        .expect("drop blocked on the pending wait");
    assert_eq!(
        vmm_counts(),
        (2, 2, 2),
        "both leaked, nothing freed under the wait"
    );
    // Clean up what was leaked, through the raw driver.
    reg.ctx().bind().unwrap();
    let d = sys::driver().unwrap();
    for (base, size) in [(gb, 4 * MIB), (rb, 2 * MIB)] {
        // SAFETY: the leaked ranges' own mappings and reservations, once.
        unsafe {
            assert_eq!(
                (d.cuMemUnmap().unwrap())(base, 2 * MIB),
                CUresult::CUDA_SUCCESS
            );
            assert_eq!(
                (d.cuMemAddressFree().unwrap())(base, size),
                CUresult::CUDA_SUCCESS
            );
        }
    }
    assert_eq!(vmm_counts(), (0, 0, 0));
    // Released: the count falls and waits for the context work again.
    b.write_value32(&word, 1, WriteFlags::default()).unwrap();
    a.synchronize().unwrap();
    assert_eq!(reg.ctx().pending_waits(), 0);
    // `b`'s holder of the word may run after `a`'s drain: drain it too.
    b.synchronize().unwrap();
    let mut buf = GrowableBuffer::<u32>::new(s, MIB).unwrap();
    buf.grow_to(1024).unwrap();
    let asleep = buf.sleep_discarding().map_err(|e| e.error).unwrap();
    drop(asleep);
    drop(word);
    drop(flags);
    drop(a);
    drop(b);
    // Releasing the primary context frees what was leaked.
    done(reg);
}

/// A buffer over imported memory cannot sleep: waking would map private memory.
fn a_buffer_over_shared_memory_refuses_to_sleep() {
    let reg = setup();
    let s = reg.stream();
    let phys = Arc::new(PhysicalMemory::new(s, 2 * MIB, HandleTypes::POSIX_FD).unwrap());
    let buf = GrowableBuffer::<u32>::from_physical(phys).unwrap();
    let e = buf.sleep_discarding().unwrap_err();
    assert!(
        e.error
            .to_string()
            .contains("sleeping a growable buffer over shared physical memory"),
        "{}",
        e.error
    );
    let buf = match e.buffer {
        SleepState::Awake(buf) => buf,
        _ => panic!("awake"),
    };
    let host = PinnedBuffer::<u8>::zeroed(s, 2 * MIB).unwrap();
    let e = buf.sleep_into(s, host).unwrap_err();
    assert!(e.error.to_string().contains("from_physical"), "{}", e.error);
    drop(e);
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

/// Memory exported on another device is refused at import (and released).
fn an_import_of_another_devices_memory_is_refused() {
    let reg = setup();
    let s = reg.stream();
    let one = context(1).unwrap();
    let theirs = PhysicalMemory::new(&one, 2 * MIB, HandleTypes::POSIX_FD).unwrap();
    let fd = theirs.export_fd().unwrap();
    let e = PhysicalMemory::import_fd(s, fd.as_fd(), 2 * MIB).unwrap_err();
    assert!(
        e.to_string()
            .contains("lives at location type 1 id 1, not on this device"),
        "{e}"
    );
    drop(theirs);
    assert_eq!(
        fake().live(Live::PhysicalMemory),
        0,
        "the import was released"
    );
    let ok = PhysicalMemory::import_fd(&one, fd.as_fd(), 2 * MIB).unwrap();
    drop(ok);
    drop(fd);
    drop(one);
    done(reg);
}

/// A message longer than the buffer on a sequenced-packet socket is an error.
fn a_truncated_message_is_refused() {
    let mut fds = [0; 2];
    // SAFETY: writes two descriptors.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0);
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: the two descriptors socketpair made, owned here.
    let (tx, rx) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let (tx, rx) = (UnixStream::from(tx), UnixStream::from(rx));
    let file = std::fs::File::open("/dev/null").unwrap();
    send_fd(&tx, file.as_fd(), &[7u8; 16]).unwrap();
    let mut buf = [0u8; 8];
    let e = recv_fd(&rx, &mut buf).unwrap_err();
    assert!(e.to_string().contains("the message was truncated"), "{e}");
}

/// A save is released group by group (64 MiB or more each) as its copies
/// complete: a failure partway leaves the released part asleep with its bytes
/// saved and the rest mapped with its contents; waking restores only what was
/// released. A failure before anything was released hands the buffer back awake.
fn a_save_that_fails_partway_keeps_what_it_released() {
    let reg = setup();
    let s = reg.stream();
    let n = 32 * MIB; // u32 elements: 128 MiB in two pieces of 64 MiB
    let mut buf = GrowableBuffer::<u32>::new(s, n).unwrap();
    buf.grow_to(n / 2).unwrap();
    buf.grow_to(n).unwrap();
    let values: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2654435761)).collect();
    s.copy_h2d(&values, &mut buf).unwrap();
    // The second piece's copy cannot be queued: nothing released yet.
    fake().fail("cuMemcpyDtoHAsync_v2", 999, 2, Some(1));
    let err = buf.sleep(s).unwrap_err();
    assert!(
        err.error.to_string().contains("cuMemcpyDtoHAsync_v2"),
        "{}",
        err.error
    );
    let SleepState::Awake(buf) = err.buffer else {
        panic!("nothing was released, the buffer is awake");
    };
    assert_eq!(vmm_counts(), (2, 1, 2), "both pieces still mapped");
    assert_eq!(s.to_vec(&buf).unwrap(), values);
    // Refused while this thread captures, before anything is queued or waited
    // for: awake, and the capture goes on.
    let mut outcome = None;
    let graph = s
        .capture(|cs| -> metrale_runtime::Result<()> {
            outcome = Some(buf.sleep(cs));
            Ok(())
        })
        .unwrap();
    drop(graph);
    let err = outcome.unwrap().unwrap_err();
    assert!(
        err.error.to_string().contains("captures a graph"),
        "{}",
        err.error
    );
    let SleepState::Awake(buf) = err.buffer else {
        panic!("refused in a capture: the buffer is awake");
    };
    assert_eq!(vmm_counts(), (2, 1, 2));
    // The wait for the second group fails after the first group was released
    // (and the stream's own wait fails too): asleep, saved, nothing leaked.
    fake().fail("cuEventSynchronize", 999, 2, Some(1));
    fake().fail("cuStreamSynchronize", 999, 1, Some(1));
    let err = buf.sleep(s).unwrap_err();
    assert!(
        err.error.to_string().contains("cuEventSynchronize"),
        "{}",
        err.error
    );
    let SleepState::Asleep(asleep) = err.buffer else {
        panic!("the first piece was released: the buffer is asleep");
    };
    assert!(asleep.is_saved());
    assert_eq!(vmm_counts(), (1, 1, 1), "the second piece still mapped");
    let copies = fake().calls("cuMemcpyHtoDAsync_v2");
    let buf = asleep.wake(s).unwrap();
    assert_eq!(
        fake().calls("cuMemcpyHtoDAsync_v2"),
        copies + 1,
        "only the released piece is restored"
    );
    assert_eq!(vmm_counts(), (2, 1, 2));
    assert_eq!(s.to_vec(&buf).unwrap(), values, "every byte back");
    // And a whole sleep and wake, group by group.
    let asleep = buf.sleep(s).unwrap();
    assert_eq!(vmm_counts(), (0, 1, 0));
    let buf = asleep.wake(s).unwrap();
    assert_eq!(s.to_vec(&buf).unwrap(), values);
    drop(buf);
    assert_eq!(vmm_counts(), (0, 0, 0));
}

/// `?` on a sleep and a wake in a function returning metrale's `Result`
/// (issue 31): the errors convert, keeping the message.
fn sleep_and_wake_take_the_question_mark() {
    fn cycle(
        s: &CudaStream,
        buf: GrowableBuffer<u32>,
    ) -> metrale_runtime::Result<GrowableBuffer<u32>> {
        let buf = buf.sleep(s)?.wake(s)?;
        let buf = buf.sleep_discarding()?.wake(s)?;
        Ok(buf)
    }
    let reg = setup();
    let s = reg.stream();
    let mut buf = GrowableBuffer::<u32>::new(s, MIB).unwrap();
    buf.grow_to(1024).unwrap();
    s.copy_h2d(&[7u32; 1024], &mut buf).unwrap();
    let buf = cycle(s, buf).unwrap();
    assert_eq!(buf.len(), 1024);
    drop(buf);
    // A refusal comes out of `?` as the MetraleError the SleepError held.
    let phys = Arc::new(PhysicalMemory::new(s, 2 * MIB, HandleTypes::POSIX_FD).unwrap());
    let shared = GrowableBuffer::<u32>::from_physical(phys).unwrap();
    let e = cycle(s, shared).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains("from_physical"), "{e}");
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

/// `physical_cloned` (issue 31): a piece kept while the buffer is used
/// mutably, the same memory as the mapping, alive until its last handle.
fn a_cloned_piece_outlives_its_borrow() {
    let reg = setup();
    let s = reg.stream();
    let mut buf = GrowableBuffer::<u32>::with_handle_types(s, MIB, HandleTypes::POSIX_FD).unwrap();
    buf.grow_to(1024).unwrap();
    let piece = buf.range().physical_cloned(0).unwrap();
    s.zero(&mut buf).unwrap(); // a mutable use while the piece is kept
    assert!(Arc::ptr_eq(&piece, buf.range().physical(0).unwrap()));
    assert!(
        buf.range().physical_cloned(4096).is_none(),
        "no mapping starts there"
    );
    drop(buf);
    assert_eq!(
        vmm_counts(),
        (1, 0, 0),
        "unmapped; the piece lives while held"
    );
    drop(piece);
    assert_eq!(vmm_counts(), (0, 0, 0));
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "vmm::a_cloned_piece_outlives_its_borrow",
            run: a_cloned_piece_outlives_its_borrow,
        },
        Test {
            name: "vmm::sleep_and_wake_take_the_question_mark",
            run: sleep_and_wake_take_the_question_mark,
        },
        Test {
            name: "vmm::a_save_that_fails_partway_keeps_what_it_released",
            run: a_save_that_fails_partway_keeps_what_it_released,
        },
        Test {
            name: "vmm::a_pending_wait_makes_sleep_refuse_and_drop_leak",
            run: a_pending_wait_makes_sleep_refuse_and_drop_leak,
        },
        Test {
            name: "vmm::a_buffer_over_shared_memory_refuses_to_sleep",
            run: a_buffer_over_shared_memory_refuses_to_sleep,
        },
        Test {
            name: "vmm::an_import_of_another_devices_memory_is_refused",
            run: an_import_of_another_devices_memory_is_refused,
        },
        Test {
            name: "vmm::a_truncated_message_is_refused",
            run: a_truncated_message_is_refused,
        },
        Test {
            name: "vmm::pools_shared_by_descriptor_and_pointer",
            run: pools_shared_by_descriptor_and_pointer,
        },
        Test {
            name: "vmm::legacy_ipc_handles_as_bytes",
            run: legacy_ipc_handles_as_bytes,
        },
        Test {
            name: "vmm::export_and_import_share_the_memory",
            run: export_and_import_share_the_memory,
        },
        Test {
            name: "vmm::exported_descriptors_are_close_on_exec",
            run: exported_descriptors_are_close_on_exec,
        },
        Test {
            name: "vmm::sharing_misuse_is_refused_clearly",
            run: sharing_misuse_is_refused_clearly,
        },
        Test {
            name: "vmm::two_processes_share_memory_through_a_descriptor",
            run: two_processes_share_memory_through_a_descriptor,
        },
        Test {
            name: "vmm::granularity_is_checked_and_said",
            run: granularity_is_checked_and_said,
        },
        Test {
            name: "vmm::map_access_and_unmap",
            run: map_access_and_unmap,
        },
        Test {
            name: "vmm::growable_buffer_keeps_its_address",
            run: growable_buffer_keeps_its_address,
        },
        Test {
            name: "vmm::dropping_waits_for_queued_work",
            run: dropping_waits_for_queued_work,
        },
        Test {
            name: "vmm::uses_on_another_device_are_waited_for",
            run: uses_on_another_device_are_waited_for,
        },
        Test {
            name: "vmm::failures_leave_the_buffer_as_it_was",
            run: failures_leave_the_buffer_as_it_was,
        },
        Test {
            name: "vmm::sleep_and_wake_restore_every_byte",
            run: sleep_and_wake_restore_every_byte,
        },
    ]
}
