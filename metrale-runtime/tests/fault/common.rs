//! What every fault-injection test shares: the stand-in's control handle, a fresh
//! registry, the fixtures, and an allocation counter.

#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

pub use metrale_fakecuda::{Fake, Live};
pub use metrale_runtime::sys::{self, CUresult};
pub use metrale_runtime::*;

pub static PTX: &[u8] = include_bytes!("../fixtures/kernels.ptx");
pub static CUBIN: &[u8] = include_bytes!("../fixtures/kernels.sm_90.cubin");
pub const COUNTERS: &str = "_ZN12metrale_test8countersE";
pub const SCALE: &str = "_ZN7tq_plus14d_innerq_scaleE";
pub const SEED: &str = "_ZN12metrale_test4seedE";

/// Counts every allocation in this process (the harness runs tests one at a time).
pub struct CountingAlloc;
pub static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

pub fn allocations() -> usize {
    ALLOCATIONS.load(Ordering::SeqCst)
}

pub fn fake() -> &'static Fake {
    static FAKE: OnceLock<Fake> = OnceLock::new();
    FAKE.get_or_init(|| {
        let path = std::env::var_os("METRALE_LIBCUDA_PATH").expect("set by main");
        Fake::open(std::path::Path::new(&path))
    })
}

/// A clean stand-in and a registry with the PTX fixture as module "kernels".
pub fn setup() -> Arc<MetraleRegistry> {
    fake().reset();
    MetraleRegistry::load(0, &[("kernels", PTX)]).expect("fixture loads into the stand-in")
}

pub fn vec_add(reg: &MetraleRegistry) -> RawCudaFunc {
    let cache = OnceLock::new();
    reg.raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap()
}

/// Launch vec_add over 1000 elements through the typed path; checks the record.
pub fn launch_vec_add(reg: &MetraleRegistry) {
    let s = reg.stream();
    let a = DeviceBuffer::<f32>::alloc(s, 1000).unwrap();
    let b = DeviceBuffer::<f32>::alloc(s, 1000).unwrap();
    let mut c = DeviceBuffer::<f32>::alloc(s, 1000).unwrap();
    let cfg = LaunchConfig::for_num_elems(1000, 256).unwrap();
    // SAFETY: the stand-in only records the arguments.
    unsafe { reg.launch(vec_add(reg), cfg, s, (&a, &b, &mut c, 1000u32)) }.unwrap();
    let l = fake().last_launch();
    assert_eq!(l.kernel, "vec_add");
    assert_eq!((l.grid, l.block, l.params), ([4, 1, 1], [256, 1, 1], 4));
    assert_eq!(fake().last_param(0), a.device_ptr());
    assert_eq!(fake().last_param(2), c.device_ptr());
    assert_eq!(fake().last_param(3), 1000);
}

/// Drop the registry and the process's hosts; nothing may be left behind.
pub fn done(reg: Arc<MetraleRegistry>) {
    // What host functions left to drop (the last holds of mapped words) goes at
    // a drain; making mapped words drains without waiting for anything.
    if let Ok(words) = metrale_runtime::MappedWords::<u32>::new(reg.ctx(), 1) {
        drop(words);
    }
    drop(reg);
    release(0);
    release(1);
    assert_eq!(fake().live(Live::Modules), 0, "modules left loaded");
    assert_eq!(fake().live(Live::Libraries), 0, "libraries left loaded");
    assert_eq!(fake().live(Live::Streams), 0, "streams left");
    assert_eq!(fake().live(Live::Events), 0, "events left");
    assert_eq!(fake().live(Live::DeviceMemory), 0, "device memory left");
    assert_eq!(fake().live(Live::HostMemory), 0, "pinned memory left");
    assert_eq!(fake().live(Live::Graphs), 0, "graphs left");
    assert_eq!(fake().live(Live::Execs), 0, "executable graphs left");
    assert_eq!(fake().live(Live::PhysicalMemory), 0, "physical memory left");
    assert_eq!(fake().live(Live::ReservedRanges), 0, "reserved ranges left");
    assert_eq!(fake().live(Live::Mappings), 0, "mappings left");
    assert_eq!(fake().ipc_open(), 0, "IPC memory handles left open");
    assert_eq!(fake().primary_refs(), 0, "primary context still retained");
}

/// The raw stream as the stand-in sees it.
pub fn raw(s: &CudaStream) -> *mut c_void {
    s.raw().cast()
}
