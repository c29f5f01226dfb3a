//! The guide: one chapter per topic, every example compiled as a doctest.
//!
//! The workspace README says what metrale is, how to add it and run it; this module
//! is the rest. It holds no code: each chapter is an empty module whose
//! documentation is a Markdown file next to this one, so `cargo test --doc` compiles
//! every example (examples that need a GPU are `no_run`; the `nvrtc`, `nccl`,
//! `nvtx` and `blas` chapters compile their examples with those features on).
//!
//! | chapter | what it covers |
//! | --- | --- |
//! | [`streams`] | streams, events, typed and checked launches, what a copy or a launch keeps alive |
//! | [`memory`] | device, pinned and managed memory, slices, fills, stream-ordered allocation, pools, symbols |
//! | [`graphs`] | capture, replay, in-place updates, DOT, device-side loops |
//! | [`multi_gpu`] | one model on several devices, peer access and peer copies |
//! | [`nccl`] | collective communication (feature `nccl`) |
//! | [`nvrtc`] | run-time compilation and linking (feature `nvrtc`) |
//! | [`blas`] | cuBLASLt plans and plain cuBLAS GEMMs (feature `cublas`) |
//! | [`nvtx`] | profiler ranges, marks, domains and names for Nsight (feature `nvtx`) |
//! | [`virtual_memory`] | growable buffers, sleep and wake, sharing memory between processes, legacy IPC |
//! | [`asynchronous`] | host functions, futures, GPU-side signals |
//! | [`tensor_maps`] | Hopper tensor maps (TMA) and green contexts |
//! | [`interop`] | foreign memory, run-time argument lists, other libraries' streams, `metrale doctor` |
//! | [`errors`] | what an error says, blob checks, what Drop does |
//! | [`registry_api`] | coming from the registry API: what changed and why |
//! | [`environment`] | the environment variables metrale reads |
//! | [`performance`] | every benchmark table, with its date, machine and commit |
//!
//! # Every feature, with the driver it needs
//!
//! The loader resolves each driver function on its own, so an older driver still
//! runs everything it has.
//!
//! | feature | API | driver |
//! | --- | --- | --- |
//! | load PTX / cubin / fatbin / clang offload bundle | `MetraleRegistry::load(0, blobs)` (borrowed or owned), `load_into(host, blobs)` | any CUDA 12/13 driver |
//! | one model on several devices, loaded once | `MetraleRegistry::load_on_devices(&[0, 1], blobs)` | 12.0+ library API; a module per device otherwise |
//! | typed launches checked against the parameter list | `stream.launch(&f, cfg, (&a, n, x))`, `f.params()` | 12.4+ (`cuFuncGetParamInfo`); unchecked before |
//! | any device memory as a kernel argument, generic included | `(x, y, n)` with `x: &impl DeviceMemory<f32>` (`const float*`), `y: &mut impl DeviceMemoryMut<f32>` (`float*`) | any |
//! | one version type for every library | `ctx.cuda_version() >= Version::new(12, 8, 0)`, `nccl_version()`, `BlasLt::version()` | any |
//! | >48 KiB dynamic shared memory | `LaunchConfig::new(grid, block, 100 << 10)?` (or `.with_shared_mem(..)`) | any; up to the opt-in limit |
//! | clusters, cooperative, programmatic dependent launch | `stream.launch(&f, cfg.with_cluster(4, 1, 1), args)` | 12.0+ (`cuLaunchKernelEx`) |
//! | streams with flags and priority; events (timed or not) | `CudaStream::with_options`, `CudaEvent::timed`, `stream.wait(&event)` | any |
//! | device fills, device and peer copies, slices | `stream.memset_u32(&mut buf.slice_mut(2..)?, v)`, `copy_d2d`, `copy_peer` | any |
//! | async host copies that cannot outlive their buffer | `stream.copy_h2d_pinned(pinned, &mut dev)?.wait()?` | any |
//! | stream-ordered allocation, memory pools | `stream.alloc::<T>(n)`, `MemPool::new`, `stream.alloc_from(&pool, n)` | 11.2+, and the device's pool support |
//! | managed memory, prefetch | `ManagedBuffer::zeroed`, `stream.prefetch(&m, PrefetchTarget::Device)` | 12.2+ for prefetch |
//! | typed `__device__` symbols | `reg.symbol_array::<f32>("m", "_ZN7tq_plus14d_innerq_scaleE", 64)?` | 12.0+ for libraries |
//! | CUDA graphs: capture, replay, update, DOT | `stream.capture(..)`, `graph.instantiate(..)`, `exec.update(&g)`, `exec.set_kernel_params(..)` | any (12.3+ for edge listing) |
//! | device-side `while` loops in graphs | `graph.add_while(&deps, true, \|body, handle\| ..)` | 12.4+ (conditional nodes) |
//! | device information, peer access | `Device::get(0)?.memory_info()`, `enable_peer_access(&h1, &h0)` | any |
//! | JIT log on load failure | `MetraleError::ModuleLoad` | any |
//! | kernel attributes, carveout, occupancy | `CudaFunction::attributes`, `max_active_blocks_per_sm`, `potential_block_size(_with)` | any |
//! | teardown detection after a context reset | automatic in every Drop | 12.0+ for `cuCtxGetId`; statuses alone before that |
//! | `half::f16` / `half::bf16` element types | feature `half` | any |
//! | virtual memory: growable buffers, sleep and wake | `GrowableBuffer::new(s, cap)?.grow_to(n)`, `buf.sleep(s)`, `VirtualRange::reserve`, `PhysicalMemory::new` | 10.2+ and the device's VMM support |
//! | sharing memory between processes (Linux) | `PhysicalMemory::export_fd`, `import_fd`, `send` / `receive` over a `UnixStream` | 10.2+, POSIX descriptors |
//! | host functions, futures, GPU-side signals | `stream.launch_host_fn(..)`, `stream.done().await`, `stream.wait_value32(..)` | any (64-bit signals: the device's support) |
//! | foreign device memory (another library's pointer) | `unsafe { DeviceSliceMut::from_raw_mut(&h, ptr, len)? }` | any (checked with `cuPointerGetAttribute`, `cuMemGetAddressRange`) |
//! | tensor maps (TMA) | `TensorMap::tiled(&buf)..encode()`, `TensorMapLayout::encode(&mem)` | 12.0+, compute capability 9.0 |
//! | green contexts | `SmResource::of_device(ctx)?.split_by_count(..)`, `GreenContext::new`, `CudaStream::on_green_context` | 12.4+ |
//! | run-time compilation | feature `nvrtc`: `Program`, `CompileCache`, `Linker` | NVRTC and nvJitLink 12 or 13 |
//! | collective communication | feature `nccl`: `Communicator`, `group` | NCCL 2 |
//! | GEMMs: cuBLASLt plans, plain cuBLAS | feature `cublas`: `BlasLt`, `MatmulPlan`, `Blas` | cuBLAS 12 or 13 (grouped GEMMs 12.5+) |
//! | profiler ranges, marks, domains, names (NVTX v3) | feature `nvtx`: `nvtx::range("decode")`, `Domain`, `EventAttributes` | any; a tool named by `NVTX_INJECTION64_PATH` (Nsight) |
//!
//! The table's calls, compiled:
//!
//! ```rust,no_run
//! # use metrale_runtime::*;
//! # fn main() -> Result<()> {
//! # static KERNELS: &[u8] = b"...";
//! let reg = MetraleRegistry::load(0, &[("kernels", KERNELS)])?;
//! let owned = vec![("kernels".to_string(), KERNELS.to_vec())];
//! let _again = MetraleRegistry::load_into(host(0)?, &owned)?;
//! let _both = MetraleRegistry::load_on_devices(&[0, 1], &[("kernels", KERNELS)])?;
//! let f = reg.function("kernels", "vec_add")?;
//! let s = reg.stream();
//! let a = DeviceBuffer::from_host(s, &[1.0f32; 1024])?;
//! let mut c = DeviceBuffer::<f32>::alloc(s, 1024)?;
//! let cfg = LaunchConfig::for_num_elems(1024, 256)?;
//! // SAFETY: vec_add(const float*, const float*, float*, unsigned) over 1024 elements.
//! unsafe { s.launch(&f, cfg, (&a, &a, &mut c, 1024u32))? };
//! let _layout = f.params();
//! let _big = LaunchConfig::new((8, 1, 1), (256, 1, 1), 100 << 10)?.with_shared_mem(120 << 10);
//! let _clustered = cfg.with_cluster(4, 1, 1).with_cooperative(false);
//! let _wide = cfg.with_block((512, 1, 1))?; // fields are private; setters check like `new`
//! assert_eq!(cfg.grid_dim(), (4, 1, 1));
//! let _hi = CudaStream::with_options(s, StreamOptions::default().with_priority(-1))?;
//! let ready = CudaEvent::timed(s)?;
//! ready.record(s)?;
//! s.wait(&ready)?;
//! s.memset_u32(&mut c.slice_mut(2..)?, 0)?;
//! let mut d = DeviceBuffer::<f32>::alloc(s, 1024)?;
//! s.copy_d2d(&a, &mut d)?;
//! let pinned = PinnedBuffer::from_slice(s, &[0.5f32; 1024])?;
//! let _pinned = s.copy_h2d_pinned(pinned, &mut d)?.wait()?;
//! let _tmp = s.alloc::<f32>(1 << 20)?;
//! let pool = MemPool::new(s)?;
//! let _from_pool = s.alloc_from::<f32>(&pool, 1 << 10)?;
//! let m = ManagedBuffer::<f32>::zeroed(s, 1024)?;
//! s.prefetch(&m, PrefetchTarget::Device)?;
//! let _scale = reg.symbol_array::<f32>("kernels", "_ZN7tq_plus14d_innerq_scaleE", 64)?;
//! let graph = s.capture(|s| {
//!     // SAFETY: as above.
//!     unsafe { s.launch(&f, cfg, (&a, &a, &mut c, 1024u32)) }
//! })?;
//! let mut exec = graph.instantiate()?;
//! exec.update(&graph)?;
//! let _dot = graph.write_dot("graph.dot");
//! let mut g = CudaGraph::new(s)?;
//! g.add_while(&[], true, |_body, _handle| Ok(()))?;
//! let (_free, _total) = Device::get(0)?.memory_info()?;
//! enable_peer_access(&host(1)?, &host(0)?)?;
//! let _attrs = f.attributes()?;
//! let _occupancy = f.max_active_blocks_per_sm(256, 0)?;
//! let mut grown = GrowableBuffer::<f32>::with_handle_types(s, 1 << 20, HandleTypes::POSIX_FD)?;
//! grown.grow_to(1 << 20)?;
//! let _fd = grown.range().physical(0).map(|p| p.export_fd());
//! let _range = VirtualRange::reserve(s, 2 << 20)?;
//! let _phys = PhysicalMemory::new(s, 2 << 20, HandleTypes::NONE)?;
//! let _asleep = grown.sleep(s);
//! # Ok(()) }
//! ```

#[doc = include_str!("streams.md")]
pub mod streams {}

#[doc = include_str!("memory.md")]
pub mod memory {}

#[doc = include_str!("graphs.md")]
pub mod graphs {}

#[doc = include_str!("multi_gpu.md")]
pub mod multi_gpu {}

#[doc = include_str!("nccl.md")]
pub mod nccl {}

#[doc = include_str!("nvrtc.md")]
pub mod nvrtc {}

#[doc = include_str!("blas.md")]
pub mod blas {}
#[doc = include_str!("nvtx.md")]
pub mod nvtx {}

#[doc = include_str!("virtual_memory.md")]
pub mod virtual_memory {}

#[doc = include_str!("asynchronous.md")]
pub mod asynchronous {}

#[doc = include_str!("interop.md")]
pub mod interop {}

#[doc = include_str!("tensor_maps.md")]
pub mod tensor_maps {}

#[doc = include_str!("errors.md")]
pub mod errors {}

#[doc = include_str!("registry_api.md")]
pub mod registry_api {}

#[doc = include_str!("environment.md")]
pub mod environment {}

#[doc = include_str!("performance.md")]
pub mod performance {}
