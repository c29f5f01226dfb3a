//! A probe for counting the instructions of one call of each per-step path
//! (issue 33) against the stand-ins: `floor_probe MODE N` runs one path N times,
//! ours or its raw call through the sys table, in the same binary. Under
//! `valgrind --tool=callgrind`, the difference between two N divided by their
//! difference is the instructions of one call (the setup cancels out):
//!
//! ```text
//! cargo build --release --features nccl,cublas --example floor_probe
//! for m in raw_replace replace set raw_matmul matmul raw_gemm gemm; do
//!   for n in 1000 2000; do
//!     valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!       target/release/examples/floor_probe $m $n 2>&1 | grep refs
//!   done
//! done
//! ```
//!
//! Modes: tensor maps `raw_encode`, `encode` (`TensorMap::tiled().encode()`),
//! `layout` (`TensorMapLayout::encode`), `raw_replace`, `replace`
//! (`replace_address`), `set` (`set_address`); stream-ordered allocations
//! `raw_alloc`, `alloc` (a 1 MiB `stream.alloc` dropped at once); the per-node
//! update `raw_node`, `node` (`set_kernel_params`); with feature `nccl`, the
//! 8-byte all-reduce `raw_nccl`, `nccl` (`all_reduce_in_place`); with feature
//! `cublas`, a planned 16^3 f32 GEMM `raw_matmul` (`cublasLtMatmul` with the
//! plan's algorithm, own descriptors), `matmul` (`MatmulPlan::matmul`), a 16^3
//! f32 `raw_gemm` (`cublasGemmEx`, own handle), `gemm` (`Blas::gemm_ex`); `none`
//! (setup only). Without `METRALE_LIBCUDA_PATH` (`METRALE_LIBNCCL_PATH`,
//! `METRALE_LIBCUBLASLT_PATH`) it loads the stand-in driver (NCCL, cuBLASLt).

use std::ffi::c_void;
use std::hint::black_box;

use metrale_runtime::sys::{self, CUtensorMap};
use metrale_runtime::{
    host, CudaGraph, CudaStream, DeviceBuffer, LaunchConfig, MetraleRegistry, Swizzle, TensorMap,
};

static PTX: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");

fn main() -> metrale_runtime::Result<()> {
    if std::env::var_os("METRALE_LIBCUDA_PATH").is_none() {
        std::env::set_var("METRALE_LIBCUDA_PATH", metrale_fakecuda::library_path());
    }
    if std::env::var_os("METRALE_LIBNCCL_PATH").is_none() {
        std::env::set_var(
            "METRALE_LIBNCCL_PATH",
            metrale_fakecuda::nccl_library_path(),
        );
    }
    if std::env::var_os("METRALE_LIBCUBLAS_PATH").is_none() {
        std::env::set_var(
            "METRALE_LIBCUBLAS_PATH",
            metrale_fakecuda::blas_library_path(),
        );
    }
    if std::env::var_os("METRALE_LIBCUBLASLT_PATH").is_none() {
        std::env::set_var(
            "METRALE_LIBCUBLASLT_PATH",
            metrale_fakecuda::blas_library_path(),
        );
    }
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("none", String::as_str);
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let d = sys::driver().map_err(|e| metrale_runtime::MetraleError::from(e.clone()))?;
    let (Ok(encode), Ok(replace)) = (d.cuTensorMapEncodeTiled(), d.cuTensorMapReplaceAddress())
    else {
        eprintln!("the driver lacks tensor maps");
        return Ok(());
    };
    let h = host(0)?;
    let s = h.stream();
    let (rows, cols) = (256u64, 512u64);
    let a = DeviceBuffer::<f32>::alloc(s, (rows * cols) as usize)?;
    let b = DeviceBuffer::<f32>::alloc(s, (rows * cols) as usize)?;
    let dims = [cols, rows];
    let strides = [cols * 4];
    let boxes = [32u32, 32];
    let estrides = [1u32, 1];
    let ours = || {
        TensorMap::tiled(black_box(&a))
            .dims(black_box(&dims))
            .strides(black_box(&strides))
            .box_dims(black_box(&boxes))
            .swizzle(Swizzle::B128)
            .encode()
    };
    let layout = TensorMap::tiled(&a)
        .dims(&dims)
        .strides(&strides)
        .box_dims(&boxes)
        .swizzle(Swizzle::B128)
        .layout()?;
    let raw = || {
        let mut m = CUtensorMap { opaque: [0; 16] };
        // SAFETY: a writable map; arrays of the rank's length; `a` covers the tensor.
        let st = unsafe {
            encode(
                &mut m,
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                2,
                black_box(a.device_ptr()) as *mut c_void,
                black_box(&dims).as_ptr(),
                black_box(&strides).as_ptr(),
                black_box(&boxes).as_ptr(),
                estrides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        (st.is_success(), m)
    };
    match mode {
        "raw_encode" => (0..n).for_each(|_| {
            black_box(raw());
        }),
        "encode" => (0..n).for_each(|_| {
            black_box(ours().is_ok());
        }),
        "layout" => (0..n).for_each(|_| {
            black_box(layout.encode(black_box(&a)).is_ok());
        }),
        "raw_replace" => {
            let (_, mut m) = raw();
            for i in 0..n {
                let p = if i % 2 == 0 { &b } else { &a };
                // SAFETY: an encoded map; both addresses cover the tensor.
                let st = unsafe { replace(&mut m, black_box(p).device_ptr() as *mut c_void) };
                black_box(st.is_success());
            }
            black_box(&m);
        }
        "replace" => {
            let mut map = ours()?;
            for i in 0..n {
                let p = if i % 2 == 0 { &b } else { &a };
                map = map.replace_address(black_box(p))?;
            }
            black_box(&map);
        }
        "set" => {
            let mut map = ours()?;
            for i in 0..n {
                let p = if i % 2 == 0 { &b } else { &a };
                black_box(map.set_address(black_box(p)).is_ok());
            }
            black_box(&map);
        }
        "raw_alloc" | "alloc" => alloc(mode, n, s)?,
        "raw_node" | "node" => node(mode, n, s)?,
        #[cfg(feature = "nccl")]
        "raw_nccl" | "nccl" => nccl(mode, n, s)?,
        #[cfg(feature = "cublas")]
        "raw_matmul" | "matmul" => matmul(mode, n, s)?,
        #[cfg(feature = "cublas")]
        "raw_gemm" | "gemm" => gemm(mode, n, s)?,
        "sizes" => println!(
            "TensorMap {} bytes, Result<TensorMap> {} bytes",
            std::mem::size_of::<TensorMap<'_, f32>>(),
            std::mem::size_of::<metrale_runtime::Result<TensorMap<'_, f32>>>()
        ),
        _ => {}
    }
    Ok(())
}

/// A 1 MiB stream-ordered allocation freed at once, `n` times.
fn alloc(mode: &str, n: usize, s: &CudaStream) -> metrale_runtime::Result<()> {
    let d = sys::driver().map_err(|e| metrale_runtime::MetraleError::from(e.clone()))?;
    let (Ok(raw_alloc), Ok(raw_free)) = (d.cuMemAllocAsync(), d.cuMemFreeAsync()) else {
        return Ok(());
    };
    let raw_s = s.raw();
    for _ in 0..n {
        if mode == "raw_alloc" {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: a stream-ordered allocation freed at once on the same stream.
            unsafe {
                black_box(raw_alloc(&mut p, 1 << 20, raw_s));
                black_box(raw_free(black_box(p), raw_s));
            }
        } else {
            drop(black_box(s.alloc::<u8>(1 << 20)?));
        }
    }
    s.synchronize()
}

/// One kernel node's parameters set `n` times.
fn node(mode: &str, n: usize, s: &CudaStream) -> metrale_runtime::Result<()> {
    let d = sys::driver().map_err(|e| metrale_runtime::MetraleError::from(e.clone()))?;
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
    let f = reg.function("kernels", "empty")?;
    let buf = DeviceBuffer::<f32>::alloc(s, 1024)?;
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    let graph: CudaGraph = s.capture(|cs| -> metrale_runtime::Result<()> {
        // SAFETY: empty(float*, unsigned, float) on a live buffer.
        unsafe { cs.launch(&f, cfg, (&buf, 7u32, 1.5f32)) }
    })?;
    let nodes = graph.kernel_nodes()?;
    let exec = graph.instantiate()?;
    let Ok(set) = d.cuGraphExecKernelNodeSetParams_v2() else {
        return Ok(());
    };
    let (ptr, k, x) = (buf.device_ptr(), 7u32, 1.5f32);
    let mut params: [*mut c_void; 3] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&k as *const u32).cast_mut().cast(),
        (&x as *const f32).cast_mut().cast(),
    ];
    let np = sys::CUDA_KERNEL_NODE_PARAMS {
        func: f.as_raw(),
        gridDimX: 1,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: 32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        kernelParams: params.as_mut_ptr(),
        ..sys::CUDA_KERNEL_NODE_PARAMS::default()
    };
    for _ in 0..n {
        if mode == "raw_node" {
            // SAFETY: a kernel node of the graph `exec` was instantiated from.
            black_box(unsafe { set(exec.raw(), nodes[0].node.raw(), &np) });
        } else {
            // SAFETY: empty(float*, unsigned, float) on a live buffer.
            black_box(unsafe { exec.set_kernel_params(&nodes[0], &f, cfg, (&buf, k, x)) }.is_ok());
        }
    }
    Ok(())
}

/// An 8-byte all-reduce in place on one rank, `n` times.
#[cfg(feature = "nccl")]
fn nccl(mode: &str, n: usize, s: &CudaStream) -> metrale_runtime::Result<()> {
    use metrale_runtime::nccl::{CommConfig, Communicator, NcclId, ReduceOp};
    use metrale_runtime::sys::nccl::{self as raw, ncclDataType_t, ncclRedOp_t};
    let ctx = s.context();
    let comm = Communicator::init_rank(&NcclId::new()?, 1, 0, ctx, &CommConfig::new())?;
    let mut small = DeviceBuffer::<f32>::zeroed(s, 2)?;
    let Ok(all_reduce) = raw::nccl().map(|l| l.ncclAllReduce()) else {
        return Ok(());
    };
    let Ok(all_reduce) = all_reduce else {
        return Ok(());
    };
    let p = small.device_ptr() as usize as *mut c_void;
    for _ in 0..n {
        if mode == "raw_nccl" {
            // SAFETY: 2 floats at `p` on the communicator's device; a live
            // communicator and stream of that device.
            black_box(unsafe {
                all_reduce(
                    p,
                    p,
                    2,
                    ncclDataType_t::ncclFloat32,
                    ncclRedOp_t::ncclSum,
                    comm.raw(),
                    s.raw().cast(),
                )
            });
        } else {
            black_box(
                comm.all_reduce_in_place(&mut small, ReduceOp::Sum, s)
                    .is_ok(),
            );
        }
    }
    s.synchronize()
}

/// A planned 16^3 f32 GEMM, `n` times: `MatmulPlan::matmul`, or a raw
/// `cublasLtMatmul` with the plan's algorithm on descriptors of its own.
#[cfg(feature = "cublas")]
fn matmul(mode: &str, n: usize, s: &CudaStream) -> metrale_runtime::Result<()> {
    use metrale_runtime::blas::{BlasLt, MatmulDesc};
    use metrale_runtime::sys::cublas::{self as raw, cublasComputeType_t, CUstream_st};
    const M: usize = 16;
    let lt = BlasLt::new(s)?;
    let plan = lt.plan(&MatmulDesc::new::<f32, f32, f32, f32>(M, M, M))?;
    let a = DeviceBuffer::<f32>::zeroed(s, M * M)?;
    let b = DeviceBuffer::<f32>::zeroed(s, M * M)?;
    let c = DeviceBuffer::<f32>::zeroed(s, M * M)?;
    let mut d = DeviceBuffer::<f32>::zeroed(s, M * M)?;
    let ws = DeviceBuffer::<u8>::alloc(s, 1 << 20)?;
    let Ok(lib) = raw::cublas_lt() else {
        return Ok(());
    };
    let (Ok(create), Ok(layout), Ok(f)) = (
        lib.cublasLtMatmulDescCreate(),
        lib.cublasLtMatrixLayoutCreate(),
        lib.cublasLtMatmul(),
    ) else {
        return Ok(());
    };
    let mut desc = std::ptr::null_mut();
    let mut layouts = [std::ptr::null_mut(); 4];
    // SAFETY: plain descriptor and layout creation (column-major, f32).
    unsafe {
        black_box(create(
            &mut desc,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            raw::cudaDataType::CUDA_R_32F,
        ));
        for l in &mut layouts {
            black_box(layout(
                l,
                raw::cudaDataType::CUDA_R_32F,
                M as u64,
                M as u64,
                M as i64,
            ));
        }
    }
    let algo = *plan.algo();
    let (alpha, beta) = (1.0f32, 0.0f32);
    let p = |x: u64| x as usize as *mut c_void;
    // Once before counting: the stream's workspace is made by the first call.
    plan.matmul(s, 1.0, &a, &b, 0.0, &c, &mut d)?;
    for _ in 0..n {
        if mode == "raw_matmul" {
            let [la, lb, lc, ld] = layouts;
            // SAFETY: buffers of the descriptors' sizes, the plan's algorithm,
            // a live handle, workspace and stream.
            black_box(unsafe {
                f(
                    lt.raw(),
                    desc,
                    std::ptr::from_ref(&alpha).cast(),
                    p(a.device_ptr()),
                    la,
                    p(b.device_ptr()),
                    lb,
                    std::ptr::from_ref(&beta).cast(),
                    p(c.device_ptr()),
                    lc,
                    p(d.device_ptr()),
                    ld,
                    &algo,
                    p(ws.device_ptr()),
                    1 << 20,
                    s.raw().cast::<CUstream_st>(),
                )
            });
        } else {
            black_box(
                plan.matmul(s, black_box(1.0), &a, &b, black_box(0.0), &c, &mut d)
                    .is_ok(),
            );
        }
    }
    s.synchronize()
}

/// A 16^3 f32 GEMM, `n` times: `Blas::gemm_ex`, or a raw `cublasGemmEx` on a
/// handle of its own on the same stream.
#[cfg(feature = "cublas")]
fn gemm(mode: &str, n: usize, s: &CudaStream) -> metrale_runtime::Result<()> {
    use metrale_runtime::blas::{Blas, ComputeType, GemmShape};
    use metrale_runtime::sys::cublas::{
        self as raw, cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t,
    };
    const M: usize = 16;
    let plain = Blas::new(s)?;
    let shape = GemmShape::new(M, M, M);
    let a = DeviceBuffer::<f32>::zeroed(s, M * M)?;
    let b = DeviceBuffer::<f32>::zeroed(s, M * M)?;
    let mut c = DeviceBuffer::<f32>::zeroed(s, M * M)?;
    let Ok(lib) = raw::cublas() else {
        return Ok(());
    };
    let (Ok(create), Ok(set_stream), Ok(f)) = (
        lib.cublasCreate_v2(),
        lib.cublasSetStream_v2(),
        lib.cublasGemmEx(),
    ) else {
        return Ok(());
    };
    let mut h = std::ptr::null_mut();
    // SAFETY: writes one handle, then points it at a live stream.
    unsafe {
        black_box(create(&mut h));
        black_box(set_stream(h, s.raw().cast()));
    }
    let (alpha, beta) = (1.0f32, 0.0f32);
    let p = |x: u64| x as usize as *mut c_void;
    // Once before counting: the stream's workspace is made by the first call.
    plain.gemm_ex(s, &shape, 1.0, &a, &b, 0.0, &mut c, ComputeType::F32)?;
    let m = M as i32;
    for _ in 0..n {
        if mode == "raw_gemm" {
            // SAFETY: 16x16 f32 buffers, a live handle on this stream.
            black_box(unsafe {
                f(
                    h,
                    cublasOperation_t::CUBLAS_OP_N,
                    cublasOperation_t::CUBLAS_OP_N,
                    m,
                    m,
                    m,
                    std::ptr::from_ref(&alpha).cast(),
                    p(a.device_ptr()),
                    raw::cudaDataType::CUDA_R_32F,
                    m,
                    p(b.device_ptr()),
                    raw::cudaDataType::CUDA_R_32F,
                    m,
                    std::ptr::from_ref(&beta).cast(),
                    p(c.device_ptr()),
                    raw::cudaDataType::CUDA_R_32F,
                    m,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            });
        } else {
            black_box(
                plain
                    .gemm_ex(
                        s,
                        &shape,
                        black_box(1.0),
                        &a,
                        &b,
                        0.0,
                        &mut c,
                        ComputeType::F32,
                    )
                    .is_ok(),
            );
        }
    }
    s.synchronize()
}
