//! Issue 21: virtual memory beside the raw driver calls, same process (and a
//! second process for the import):
//! - map + set access of one granularity chunk: `VirtualRange::map` against
//!   `cuMemMap` + `cuMemSetAccess` of a handle made once (the unmap that undoes
//!   each one is not timed);
//! - device-to-device copies over two buffers grown in eight steps against two
//!   `cuMemAlloc` buffers of the same size;
//! - sleep + wake of a grown buffer with its contents saved into reused pinned
//!   memory, against the raw pinned copies out and back of the same bytes;
//! - import + map in a second process: `PhysicalMemory::import_fd` + reserve +
//!   map against the raw `cuMemImportFromShareableHandle` + `cuMemAddressReserve`
//!   + `cuMemMap` + `cuMemSetAccess`, the descriptors sent by this process.

use std::ffi::c_void;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use crate::common::{header, line, ratios, time, Row};
use crate::ok;
use metrale_runtime::sys::{self, CUdeviceptr};
use metrale_runtime::{
    granularity, recv_fd, Access, CudaContext, CudaStream, DeviceBuffer, GrowableBuffer,
    HandleTypes, MetraleError, PhysicalMemory, PinnedBuffer, VirtualRange,
};

/// Set in the second process: the socket to receive descriptors on.
pub const CHILD_VAR: &str = "METRALE_BENCH_VMM_SOCKET";

fn prop(ordinal: i32, types: u32) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all zero is its default.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = sys::CUmemAllocationHandleType(types);
    p.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    };
    p
}

fn rw(ordinal: i32) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

pub fn run(s: &CudaStream, big: usize, rounds: usize) -> Result<(), MetraleError> {
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let ctx: Arc<CudaContext> = Arc::clone(s.context());
    let dev = ctx.ordinal() as i32;
    let g = granularity(&ctx, HandleTypes::NONE)?.minimum;
    let raw_s = s.raw();
    let sync = || {
        // SAFETY: a live stream.
        ok("cuStreamSynchronize", unsafe {
            (d.cuStreamSynchronize().unwrap())(raw_s)
        });
    };

    // Map + set access of one chunk.
    let (map, set_access, unmap) = (
        d.cuMemMap().unwrap(),
        d.cuMemSetAccess().unwrap(),
        d.cuMemUnmap().unwrap(),
    );
    let mut raw_base: CUdeviceptr = 0;
    let mut raw_handle: sys::CUmemGenericAllocationHandle = 0;
    let p = prop(dev, 0);
    // SAFETY: out-pointers to locals; a valid property struct.
    unsafe {
        ok(
            "cuMemAddressReserve",
            (d.cuMemAddressReserve().unwrap())(&mut raw_base, g, g, 0, 0),
        );
        ok(
            "cuMemCreate",
            (d.cuMemCreate().unwrap())(&mut raw_handle, g, &p, 0),
        );
    }
    let mut range = VirtualRange::reserve(&ctx, g)?;
    let phys = Arc::new(PhysicalMemory::new(&ctx, g, HandleTypes::NONE)?);
    let access = [rw(dev)];
    let n_map = 200;
    let (mut m_raw, mut m_ours) = (Row::default(), Row::default());
    let mut m_raw_sync = Row::default();
    let ctx_sync = d.cuCtxSynchronize().unwrap();
    for round in 0..rounds {
        let (mut tr, mut to, mut ts) = (0.0, 0.0, 0.0);
        for k in 0..3 {
            let path = (round + k) % 3;
            if path != 1 {
                for _ in 0..n_map {
                    let t = Instant::now();
                    // SAFETY: one chunk of a reserved, unmapped range and a live
                    // handle of that size; unmapped right after (unused).
                    unsafe {
                        ok("cuMemMap", map(raw_base, g, 0, raw_handle, 0));
                        ok(
                            "cuMemSetAccess",
                            set_access(raw_base, g, access.as_ptr(), 1),
                        );
                    }
                    let dt = t.elapsed().as_secs_f64();
                    if path == 0 {
                        tr += dt;
                    } else {
                        ts += dt;
                        // As `VirtualRange::unmap` does: wait for the context
                        // before unmapping (untimed, like the unmap).
                        // SAFETY: the current context, bound by the stream's work.
                        ok("cuCtxSynchronize", unsafe { ctx_sync() });
                    }
                    // SAFETY: the mapping made above; nothing used it.
                    ok("cuMemUnmap", unsafe { unmap(raw_base, g) });
                }
            } else {
                for _ in 0..n_map {
                    let t = Instant::now();
                    range.map(0, Arc::clone(&phys), 0, g, &[(&ctx, Access::ReadWrite)])?;
                    to += t.elapsed().as_secs_f64();
                    range.unmap(0)?;
                }
            }
        }
        m_raw_sync.push(ts * 1e6 / n_map as f64);
        m_raw.push(tr * 1e6 / n_map as f64);
        m_ours.push(to * 1e6 / n_map as f64);
    }
    drop(range);
    // SAFETY: the raw chunk is unmapped; release the handle and the range.
    unsafe {
        ok("cuMemRelease", (d.cuMemRelease().unwrap())(raw_handle));
        ok(
            "cuMemAddressFree",
            (d.cuMemAddressFree().unwrap())(raw_base, g),
        );
    }

    // Copies over grown buffers.
    let n = big / 4;
    let grow = |b: &mut GrowableBuffer<u32>| -> Result<(), MetraleError> {
        for step in 1..=8 {
            b.grow_to(n / 8 * step)?;
        }
        b.grow_to(n)
    };
    let mut gsrc = GrowableBuffer::<u32>::new(&ctx, n)?;
    let mut gdst = GrowableBuffer::<u32>::new(&ctx, n)?;
    grow(&mut gsrc)?;
    grow(&mut gdst)?;
    s.memset_u32(&mut gsrc, 3)?;
    let asrc = DeviceBuffer::<u32>::zeroed(s, n)?;
    let adst = DeviceBuffer::<u32>::alloc(s, n)?;
    let raw_d2d = d.cuMemcpyDtoDAsync_v2().unwrap();
    let (ap, aq) = (asrc.device_ptr(), adst.device_ptr());
    s.synchronize()?;
    let (mut c_raw, mut c_ours) = (Row::default(), Row::default());
    for round in 0..rounds {
        for k in 0..2 {
            if (round + k) % 2 == 0 {
                c_raw.push(
                    big as f64
                        / time(|| {
                            // SAFETY: `big` bytes of two live buffers.
                            ok("cuMemcpyDtoDAsync_v2", unsafe {
                                raw_d2d(aq, ap, big, raw_s)
                            });
                            sync();
                        })
                        / 1e9,
                );
            } else {
                c_ours.push(
                    big as f64
                        / time(|| {
                            s.copy_d2d(&gsrc, &mut gdst).unwrap();
                            s.synchronize().unwrap();
                        })
                        / 1e9,
                );
            }
        }
    }
    drop((asrc, adst, gdst));

    // Sleep + wake with the contents saved, against the pinned copies.
    let mut host = PinnedBuffer::<u8>::zeroed(&ctx, big)?;
    let pinned = DeviceBuffer::<u8>::alloc(s, big)?;
    let (d2h, h2d) = (
        d.cuMemcpyDtoHAsync_v2().unwrap(),
        d.cuMemcpyHtoDAsync_v2().unwrap(),
    );
    let (hp, dp) = (host.as_mut_ptr().cast::<c_void>(), pinned.device_ptr());
    let mut gbuf = Some(gsrc);
    let (mut w_raw, mut w_ours) = (Row::default(), Row::default());
    let (mut w_sleep, mut w_wake) = (Row::default(), Row::default());
    let mut w_vmm = Row::default();
    // The same with a pause between sleep and wake (untimed): a released range's
    // memory keeps the copy engines busy for a while (measured: an H2D copy
    // right after releasing 1 GiB takes ~2.5 ms longer), which a model that
    // sleeps for longer than that never meets.
    let (mut w_apart, mut w_vmm_apart) = (Row::default(), Row::default());
    let pause = std::time::Duration::from_millis(50);
    let mut host = Some(host);
    // The same sleep and wake through the raw driver: eight pieces, as grown.
    let piece = big / 8;
    let (create, release) = (d.cuMemCreate().unwrap(), d.cuMemRelease().unwrap());
    let mut vbase: CUdeviceptr = 0;
    // SAFETY: writes one address; a reservation of `big` bytes.
    ok("cuMemAddressReserve", unsafe {
        (d.cuMemAddressReserve().unwrap())(&mut vbase, big, g, 0, 0)
    });
    let mut handles = vec![0 as sys::CUmemGenericAllocationHandle; 8];
    let map_all = |handles: &mut [sys::CUmemGenericAllocationHandle]| {
        for (i, h) in handles.iter_mut().enumerate() {
            let at = vbase + (i * piece) as u64;
            // SAFETY: a new handle of `piece` bytes mapped into its unmapped part
            // of the reservation, with access for this device.
            unsafe {
                ok("cuMemCreate", create(h, piece, &p, 0));
                ok("cuMemMap", map(at, piece, 0, *h, 0));
                ok("cuMemSetAccess", set_access(at, piece, access.as_ptr(), 1));
            }
        }
    };
    map_all(&mut handles);
    let raw_sleep = |handles: &[sys::CUmemGenericAllocationHandle]| {
        // SAFETY: `big` mapped bytes of the reservation and of the pinned
        // buffer; the copy is waited for before the memory is unmapped.
        unsafe {
            ok("cuMemcpyDtoHAsync_v2", d2h(hp, vbase, big, raw_s));
            sync();
            for (i, h) in handles.iter().enumerate() {
                ok("cuMemUnmap", unmap(vbase + (i * piece) as u64, piece));
                ok("cuMemRelease", release(*h));
            }
        }
    };
    let raw_wake = |handles: &mut Vec<sys::CUmemGenericAllocationHandle>| {
        map_all(handles);
        // SAFETY: as above, the new mappings; waited for.
        unsafe {
            ok("cuMemcpyHtoDAsync_v2", h2d(vbase, hp, big, raw_s));
        }
        sync();
    };
    for round in 0..rounds {
        for k in 0..5 {
            match (round + k) % 5 {
                2 => {
                    w_vmm.push(
                        2.0 * big as f64
                            / time(|| {
                                raw_sleep(&handles);
                                raw_wake(&mut handles);
                            })
                            / 1e9,
                    );
                }
                3 => {
                    let t_sleep = time(|| raw_sleep(&handles));
                    std::thread::sleep(pause);
                    let t_wake = time(|| raw_wake(&mut handles));
                    w_vmm_apart.push(2.0 * big as f64 / (t_sleep + t_wake) / 1e9);
                }
                0 => {
                    w_raw.push(
                        2.0 * big as f64
                            / time(|| {
                                // SAFETY: `big` bytes of the pinned buffer and the
                                // device buffer, each copy waited for.
                                unsafe {
                                    ok("cuMemcpyDtoHAsync_v2", d2h(hp, dp, big, raw_s));
                                    sync();
                                    ok("cuMemcpyHtoDAsync_v2", h2d(dp, hp, big, raw_s));
                                    sync();
                                }
                            })
                            / 1e9,
                    );
                }
                path => {
                    let apart = path == 4;
                    let b = gbuf.take().unwrap();
                    let h = host.take().unwrap();
                    let t = Instant::now();
                    let asleep = b.sleep_into(s, h).map_err(|e| e.error)?;
                    let t_sleep = t.elapsed().as_secs_f64();
                    if apart {
                        std::thread::sleep(pause);
                    }
                    let t = Instant::now();
                    let (b, h) = asleep.wake_keeping_host(s).map_err(|e| e.error)?;
                    let t_wake = t.elapsed().as_secs_f64();
                    let rate = 2.0 * big as f64 / (t_sleep + t_wake) / 1e9;
                    if apart {
                        w_apart.push(rate);
                    } else {
                        w_ours.push(rate);
                        w_sleep.push(big as f64 / t_sleep / 1e9);
                        w_wake.push(big as f64 / t_wake / 1e9);
                    }
                    gbuf = Some(b);
                    host = h;
                }
            }
        }
    }
    // SAFETY: the raw pieces are idle (the last copy was waited for).
    unsafe {
        for (i, h) in handles.iter().enumerate() {
            ok("cuMemUnmap", unmap(vbase + (i * piece) as u64, piece));
            ok("cuMemRelease", release(*h));
        }
        ok(
            "cuMemAddressFree",
            (d.cuMemAddressFree().unwrap())(vbase, big),
        );
    }
    // The contents came back.
    let back = gbuf.as_ref().unwrap();
    let mut probe = [0u32; 4];
    s.copy_d2h(&back.slice(n - 4..)?, &mut probe)?;
    assert_eq!(probe, [3; 4], "sleep + wake lost the contents");
    drop((gbuf, host, pinned));

    let (i_raw, i_ours) = import_rows(&ctx, big, rounds)?;

    let gib = if big >= 1 << 30 {
        "1 GiB".to_owned()
    } else {
        format!("{} MiB", big >> 20)
    };
    header(&format!("virtual memory (granularity {} KiB)", g >> 10));
    line(
        "map + set access 1 chunk, raw (us)",
        &m_raw,
        "  ",
        Some(&ratios(&m_raw, &m_raw)),
    );
    line(
        "map + set access 1 chunk, VirtualRange::map (us)",
        &m_ours,
        "  ",
        Some(&ratios(&m_ours, &m_raw)),
    );
    line(
        "  raw, each untimed unmap after cuCtxSynchronize as ours (us)",
        &m_raw_sync,
        "  ",
        Some(&ratios(&m_raw_sync, &m_raw)),
    );
    line(
        "  VirtualRange::map vs that raw row",
        &m_ours,
        "  ",
        Some(&ratios(&m_ours, &m_raw_sync)),
    );
    line(
        &format!("device-to-device {gib}, cuMemAlloc buffers (GB/s)"),
        &c_raw,
        "  ",
        Some(&ratios(&c_raw, &c_raw)),
    );
    line(
        &format!("device-to-device {gib}, grown buffers (GB/s)"),
        &c_ours,
        "  ",
        Some(&ratios(&c_ours, &c_raw)),
    );
    line(
        &format!("pinned D2H + H2D {gib}, raw (GB/s)"),
        &w_raw,
        "  ",
        Some(&ratios(&w_raw, &w_raw)),
    );
    line(
        &format!("sleep_into + wake {gib}, saved (GB/s)"),
        &w_ours,
        "  ",
        Some(&ratios(&w_ours, &w_raw)),
    );
    line(
        "  the same through raw VMM calls (GB/s)",
        &w_vmm,
        "  ",
        Some(&ratios(&w_vmm, &w_raw)),
    );
    line(
        "  sleep_into + wake vs the raw VMM calls",
        &w_ours,
        "  ",
        Some(&ratios(&w_ours, &w_vmm)),
    );
    line(
        &format!("  sleep_into {gib} alone (GB/s)"),
        &w_sleep,
        "  ",
        None,
    );
    line(&format!("  wake {gib} alone (GB/s)"), &w_wake, "  ", None);
    line(
        &format!("sleep_into, 50 ms, wake {gib}, saved (GB/s)"),
        &w_apart,
        "  ",
        Some(&ratios(&w_apart, &w_raw)),
    );
    line(
        "  the same through raw VMM calls (GB/s)",
        &w_vmm_apart,
        "  ",
        Some(&ratios(&w_vmm_apart, &w_raw)),
    );
    match (i_raw, i_ours) {
        (Some(r), Some(o)) => {
            line(
                &format!("import + map {gib}, 2nd process, raw (us)"),
                &r,
                "  ",
                Some(&ratios(&r, &r)),
            );
            line(
                &format!("import + map {gib}, 2nd process, ours (us)"),
                &o,
                "  ",
                Some(&ratios(&o, &r)),
            );
        }
        _ => println!("import + map: the second process gave no times"),
    }
    Ok(())
}

/// The parent side: export `big` bytes as descriptors, two per round (raw, ours),
/// to a second copy of this bench that imports and maps them.
fn import_rows(
    ctx: &Arc<CudaContext>,
    big: usize,
    rounds: usize,
) -> Result<(Option<Row>, Option<Row>), MetraleError> {
    let g = granularity(ctx, HandleTypes::POSIX_FD)?.minimum;
    let size = big.div_ceil(g) * g;
    let phys = PhysicalMemory::new(ctx, size, HandleTypes::POSIX_FD)?;
    let path = std::env::temp_dir().join(format!("metrale-bench-vmm-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bench socket");
    let exe = std::env::current_exe().expect("bench socket");
    let mut child = Command::new(exe)
        .env(CHILD_VAR, &path)
        .env("METRALE_BENCH_VMM_ROUNDS", rounds.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("bench socket");
    let (sock, _) = listener.accept().expect("bench socket");
    let sent = (0..rounds * 2).try_for_each(|_| phys.send(&sock));
    if let Err(e) = sent {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    let out = child.stdout.take().unwrap();
    let (mut r, mut o) = (Row::default(), Row::default());
    for l in BufReader::new(out).lines().map_while(Result::ok) {
        let mut it = l.split_whitespace();
        if let (Some("import"), Some(a), Some(b)) = (it.next(), it.next(), it.next()) {
            r.push(a.parse().unwrap_or(f64::NAN));
            o.push(b.parse().unwrap_or(f64::NAN));
        }
    }
    let status = child.wait().expect("bench socket");
    let _ = std::fs::remove_file(&path);
    if !status.success() || r.samples.is_empty() {
        return Ok((None, None));
    }
    Ok((Some(r), Some(o)))
}

/// The second process: per round, import + map one descriptor raw and one
/// through metrale, timed, and print `import <raw us> <ours us>`.
pub fn child(path: &str) -> Result<(), MetraleError> {
    let rounds: usize = std::env::var("METRALE_BENCH_VMM_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let ctx = metrale_runtime::context(0)?;
    let dev = ctx.ordinal() as i32;
    let sock = UnixStream::connect(path).expect("bench socket");
    let access = [rw(dev)];
    for _ in 0..rounds {
        // Raw.
        let mut size_bytes = [0u8; 8];
        let (fd, _) = recv_fd(&sock, &mut size_bytes)?;
        let size = u64::from_le_bytes(size_bytes) as usize;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        let mut base: CUdeviceptr = 0;
        let g = granularity(&ctx, HandleTypes::POSIX_FD)?.minimum;
        let t = Instant::now();
        // SAFETY: an open descriptor of exported memory of `size` bytes; a new
        // range of that size; the mapping undone below before anything is freed.
        unsafe {
            ok(
                "cuMemImportFromShareableHandle",
                (d.cuMemImportFromShareableHandle().unwrap())(
                    &mut handle,
                    fd.as_raw_fd() as isize as *mut c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                ),
            );
            ok(
                "cuMemAddressReserve",
                (d.cuMemAddressReserve().unwrap())(&mut base, size, g, 0, 0),
            );
            ok(
                "cuMemMap",
                (d.cuMemMap().unwrap())(base, size, 0, handle, 0),
            );
            ok(
                "cuMemSetAccess",
                (d.cuMemSetAccess().unwrap())(base, size, access.as_ptr(), 1),
            );
        }
        let raw_us = t.elapsed().as_secs_f64() * 1e6;
        // SAFETY: the mapping, handle and range made above; nothing used them.
        unsafe {
            ok("cuMemUnmap", (d.cuMemUnmap().unwrap())(base, size));
            ok("cuMemRelease", (d.cuMemRelease().unwrap())(handle));
            ok(
                "cuMemAddressFree",
                (d.cuMemAddressFree().unwrap())(base, size),
            );
        }
        drop(fd);
        // Ours.
        let (fd, _) = recv_fd(&sock, &mut size_bytes)?;
        let size = u64::from_le_bytes(size_bytes) as usize;
        let t = Instant::now();
        let phys = Arc::new(PhysicalMemory::import_fd(&ctx, fd.as_fd(), size)?);
        let mut range = VirtualRange::reserve(&ctx, size)?;
        range.map(0, phys, 0, size, &[(&ctx, Access::ReadWrite)])?;
        let ours_us = t.elapsed().as_secs_f64() * 1e6;
        drop(range);
        drop(fd);
        println!("import {raw_us:.3} {ours_us:.3}");
    }
    Ok(())
}
