//! What the GPU tests share: fixtures, a registry, data, and a checked vec_add.

#![allow(dead_code)]

use std::sync::Arc;

pub use metrale_runtime::sys::{self, CUresult};
pub use metrale_runtime::*;

pub static PTX: &[u8] = include_bytes!("../fixtures/kernels.ptx");
pub static CUBIN: &[u8] = include_bytes!("../fixtures/kernels.sm_90.cubin");
pub static FATBIN: &[u8] = include_bytes!("../fixtures/kernels.fatbin");
pub static COND_CUBIN: &[u8] = include_bytes!("../fixtures/conditional.sm_90.cubin");
pub static COND_PTX: &[u8] = include_bytes!("../fixtures/conditional.ptx");
pub const COUNTERS: &str = "_ZN12metrale_test8countersE";
pub const SCALE: &str = "_ZN7tq_plus14d_innerq_scaleE";
pub const SEED: &str = "_ZN12metrale_test4seedE";

pub fn registry() -> Arc<MetraleRegistry> {
    MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap()
}

/// Deterministic, non-trivial floats (never zeros).
pub fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 8) as f32 / 65536.0 - 128.0
        })
        .collect()
}

/// vec_add over `n` elements of module `module` on `s`; checks every element.
pub fn check_vec_add_on(reg: &MetraleRegistry, s: &CudaStream, module: &str, n: usize, seed: u32) {
    let (a, b) = (data(n, seed), data(n, seed + 1));
    let da = DeviceBuffer::from_host(s, &a).unwrap();
    let db = DeviceBuffer::from_host(s, &b).unwrap();
    let mut dc = DeviceBuffer::<f32>::alloc(s, n).unwrap();
    // Poison the output so an unwritten element cannot pass.
    s.memset_u32(&mut dc, f32::NAN.to_bits()).unwrap();
    let f = reg.function(module, "vec_add").unwrap();
    let cfg = LaunchConfig::for_num_elems(n, 256).unwrap();
    // SAFETY: vec_add(const float*, const float*, float*, unsigned) over n elements.
    unsafe { s.launch(&f, cfg, (&da, &db, &mut dc, n as u32)) }.unwrap();
    let c = s.to_vec(&dc).unwrap();
    for i in 0..n {
        assert_eq!(c[i], a[i] + b[i], "{module}: element {i}");
    }
}

pub fn check_vec_add(reg: &MetraleRegistry, module: &str, n: usize, seed: u32) {
    check_vec_add_on(reg, reg.stream(), module, n, seed);
}

/// Cycles per millisecond of the device's SM clock (its maximum rate).
pub fn cycles_per_ms(reg: &MetraleRegistry) -> u64 {
    let d = Device::get(reg.host().ordinal()).unwrap();
    let khz = d
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
        .unwrap();
    khz as u64
}
