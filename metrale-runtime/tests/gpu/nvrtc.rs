//! Run-time compiled kernels on the GPU (feature `nvrtc`): compiled for the device
//! found, loaded, launched with checked arguments, results exact. Needs NVRTC and
//! nvJitLink (`METRALE_LIBNVRTC_PATH`, `METRALE_LIBNVJITLINK_PATH`, see
//! scripts/fetch-nvrtc.sh, or the libraries on the loader path); without them
//! these tests fail, naming the libraries.

use crate::common::*;
use crate::harness::Test;

use metrale_runtime::nvrtc::{CompileCache, Linker, Program, Target};

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "nvrtc::template_compiled_for_the_device_runs",
            run: template_compiled_for_the_device_runs,
        },
        Test {
            name: "nvrtc::sm80_code_on_this_device",
            run: sm80_code_on_this_device,
        },
        Test {
            name: "nvrtc::lto_linked_kernel_runs",
            run: lto_linked_kernel_runs,
        },
        Test {
            name: "nvrtc::cached_output_loads",
            run: cached_output_loads,
        },
    ]
}

const SCALE_SRC: &str = r#"
template <typename T>
__global__ void scale_add(T* x, T a, T b, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * a + b;
}
"#;

fn device_arch(host: &CudaHost) -> u32 {
    let (major, minor) = host.limits().compute_capability;
    major * 10 + minor
}

fn template_compiled_for_the_device_runs() {
    let host = host(0).unwrap();
    let out = Program::new("scale_add.cu", SCALE_SRC)
        .name_expression("scale_add<float>")
        .name_expression("scale_add<double>")
        .compile_for(host.ctx())
        .unwrap();
    assert_eq!(out.target(), Target::Sm(device_arch(&host)), "{out:?}");
    let reg = MetraleRegistry::load_into(host.clone(), &[&out]).unwrap();
    assert_eq!(reg.module_kind("scale_add.cu"), Some(BlobKind::Cubin));
    let s = reg.stream();
    let n = 10_000u32;
    let cfg = LaunchConfig::for_num_elems(n as usize, 256).unwrap();

    let f32_name = out.lowered_name("scale_add<float>").unwrap();
    let k = reg.function("scale_add.cu", f32_name).unwrap();
    let host_x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut x = DeviceBuffer::from_host(s, &host_x).unwrap();
    // SAFETY: scale_add<float>(float*, float, float, unsigned) over n elements of x.
    unsafe { s.launch(&k, cfg, (&mut x, 3.0f32, 0.5f32, n)) }.unwrap();
    let back = s.to_vec(&x).unwrap();
    assert!(back
        .iter()
        .enumerate()
        .all(|(i, &v)| v == i as f32 * 3.0 + 0.5));
    // Wrong argument types are refused before the driver (sizes checked).
    // SAFETY: refused before launch: a f64 where a float is expected.
    let e = unsafe { s.launch(&k, cfg, (&mut x, 3.0f64, 0.5f32, n)) }.unwrap_err();
    assert!(
        matches!(e.kind(), ErrorKind::ArgumentMismatch { .. }),
        "{e}"
    );

    let f64_name = out.lowered_name("scale_add<double>").unwrap();
    let k = reg.function("scale_add.cu", f64_name).unwrap();
    let host_y: Vec<f64> = (0..n).map(|i| f64::from(i) * 0.25).collect();
    let mut y = DeviceBuffer::from_host(s, &host_y).unwrap();
    // SAFETY: scale_add<double>(double*, double, double, unsigned) over n elements.
    unsafe { s.launch(&k, cfg, (&mut y, -2.0f64, 1.0f64, n)) }.unwrap();
    let back = s.to_vec(&y).unwrap();
    assert!(back
        .iter()
        .enumerate()
        .all(|(i, &v)| v == i as f64 * 0.25 * -2.0 + 1.0));
}

/// An sm_80 cubin runs only on devices of compute capability 8.x (cubins are
/// compatible within one major version): on a 9.0 device the driver refuses it
/// with an architecture hint, while PTX for compute_80 is compiled by the driver
/// and runs.
fn sm80_code_on_this_device() {
    let host = host(0).unwrap();
    let src = "extern \"C\" __global__ void fill(unsigned* x, unsigned v, unsigned n) {\n\
        unsigned i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = v + i; }\n";
    let cubin = Program::new("fill80.cu", src)
        .compile(Target::Sm(80))
        .unwrap();
    assert_eq!(cubin.cubin_arch(), Some(80));
    let loaded = MetraleRegistry::load_into(host.clone(), &[&cubin]);
    if host.limits().compute_capability.0 == 8 {
        run_fill(&loaded.unwrap(), "fill80.cu");
    } else {
        let e = loaded.expect_err("an sm_80 cubin on a device of another major version");
        let text = e.to_string();
        assert!(matches!(e.kind(), ErrorKind::ModuleLoad { .. }), "{text}");
        assert!(text.contains("the cubin was built for sm_80"), "{text}");
    }
    let ptx = Program::new("fill80ptx.cu", src)
        .compile(Target::Compute(80))
        .unwrap();
    let reg = MetraleRegistry::load_into(host, &[&ptx]).unwrap();
    assert_eq!(reg.module_kind("fill80ptx.cu"), Some(BlobKind::Ptx));
    run_fill(&reg, "fill80ptx.cu");
}

fn run_fill(reg: &MetraleRegistry, module: &str) {
    let s = reg.stream();
    let k = reg.function(module, "fill").unwrap();
    let n = 4096u32;
    let mut x = DeviceBuffer::<u32>::zeroed(s, n as usize).unwrap();
    let cfg = LaunchConfig::for_num_elems(n as usize, 128).unwrap();
    // SAFETY: fill(unsigned*, unsigned, unsigned) over n elements of x.
    unsafe { s.launch(&k, cfg, (&mut x, 7u32, n)) }.unwrap();
    let back = s.to_vec(&x).unwrap();
    assert!(back.iter().enumerate().all(|(i, &v)| v == 7 + i as u32));
}

fn lto_linked_kernel_runs() {
    let host = host(0).unwrap();
    let target = Target::Sm(device_arch(&host));
    let a = Program::new(
        "lto_a.cu",
        "extern __device__ float twice(float v);\n\
         extern \"C\" __global__ void twice_all(float* x, unsigned n) {\n\
             unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
             if (i < n) x[i] = twice(x[i]);\n}\n",
    )
    .raw_option("--relocatable-device-code=true")
    .lto()
    .compile(target)
    .unwrap();
    let b = Program::new(
        "lto_b.cu",
        "__device__ float twice(float v) { return 2.0f * v; }\n",
    )
    .raw_option("--relocatable-device-code=true")
    .lto()
    .compile(target)
    .unwrap();
    let linked = Linker::new(target)
        .add_compiled(&a)
        .unwrap()
        .add_compiled(&b)
        .unwrap()
        .link()
        .unwrap();
    let reg = MetraleRegistry::load_into(host, &[("linked", linked.cubin())]).unwrap();
    let s = reg.stream();
    let k = reg.function("linked", "twice_all").unwrap();
    let n = 5000u32;
    let host_x: Vec<f32> = (0..n).map(|i| i as f32 - 100.0).collect();
    let mut x = DeviceBuffer::from_host(s, &host_x).unwrap();
    let cfg = LaunchConfig::for_num_elems(n as usize, 256).unwrap();
    // SAFETY: twice_all(float*, unsigned) over n elements of x.
    unsafe { s.launch(&k, cfg, (&mut x, n)) }.unwrap();
    let back = s.to_vec(&x).unwrap();
    assert!(back.iter().zip(&host_x).all(|(&v, &h)| v == 2.0 * h));
}

fn cached_output_loads() {
    let host = host(0).unwrap();
    let dir = std::env::temp_dir().join(format!("metrale-gpu-nvrtc-{}", std::process::id()));
    let p = Program::new("scale_add.cu", SCALE_SRC).name_expression("scale_add<float>");
    let first = CompileCache::new().on_disk(&dir).unwrap();
    first.compile_for(&p, host.ctx()).unwrap();
    let second = CompileCache::new().on_disk(&dir).unwrap();
    let out = second.compile_for(&p, host.ctx()).unwrap();
    assert_eq!(second.stats().disk_hits, 1);
    let reg = MetraleRegistry::load_into(host, &[&*out]).unwrap();
    let k = reg
        .function(
            "scale_add.cu",
            out.lowered_name("scale_add<float>").unwrap(),
        )
        .unwrap();
    let s = reg.stream();
    let mut x = DeviceBuffer::from_host(s, &[1.0f32, 2.0, 3.0]).unwrap();
    let cfg = LaunchConfig::for_num_elems(3, 32).unwrap();
    // SAFETY: scale_add<float> over the 3 elements of x.
    unsafe { s.launch(&k, cfg, (&mut x, 2.0f32, 1.0f32, 3u32)) }.unwrap();
    assert_eq!(s.to_vec(&x).unwrap(), [3.0, 5.0, 7.0]);
    let _ = std::fs::remove_dir_all(&dir);
}
