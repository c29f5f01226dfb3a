//! Run-time compilation cost: the same ~100-line program compiled by raw NVRTC
//! calls through the sys table and by [`Program::compile`], rounds interleaved in
//! one process (raw and ours take turns), and the compile cache's hits in memory
//! and on disk against the compile time they save. Runs on CPU: no GPU needed.
//!
//! `cargo bench -p metrale-runtime --features nvrtc --bench nvrtc`
//! (with `METRALE_LIBNVRTC_PATH` set, see scripts/fetch-nvrtc.sh).
//!
//! Options (after `--`): `--rounds N` (default 21), `--quick`. Without NVRTC it
//! exits with status 2 and the loader's message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::ffi::{c_char, CString};
use std::hint::black_box;
use std::process::ExitCode;

use common::{header, line, ratios, rounds, time, Row};
use metrale_runtime::nvrtc::{CompileCache, Program, Target};
use metrale_runtime::sys::nvrtc::{self as rtc, nvrtcProgram};
use metrale_runtime::MetraleError;

const TARGET: Target = Target::Sm(90);

/// About 100 lines: templates, device functions, shared memory, several kernels.
fn source() -> String {
    let mut s = String::from(
        "template <typename T> __device__ T clamp01(T v) { return v < T(0) ? T(0) : (v > T(1) ? T(1) : v); }\n\
         template <typename T> __device__ T lerp(T a, T b, T t) { return a + (b - a) * t; }\n\
         __device__ float warp_sum(float v) {\n\
             for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);\n\
             return v;\n\
         }\n\
         template <typename T, int B>\n\
         __global__ void block_sum(const T* x, T* out, unsigned n) {\n\
             __shared__ T tile[B];\n\
             unsigned i = blockIdx.x * B + threadIdx.x;\n\
             tile[threadIdx.x] = i < n ? x[i] : T(0);\n\
             __syncthreads();\n\
             for (int s = B / 2; s > 0; s >>= 1) {\n\
                 if (threadIdx.x < s) tile[threadIdx.x] += tile[threadIdx.x + s];\n\
                 __syncthreads();\n\
             }\n\
             if (threadIdx.x == 0) out[blockIdx.x] = tile[0];\n\
         }\n\
         template __global__ void block_sum<float, 256>(const float*, float*, unsigned);\n\
         template __global__ void block_sum<double, 128>(const double*, double*, unsigned);\n",
    );
    for k in 0..8 {
        s.push_str(&format!(
            "extern \"C\" __global__ void step{k}(float* x, const float* y, float a, unsigned n) {{\n\
                 unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
                 if (i >= n) return;\n\
                 float v = lerp(x[i], y[i], clamp01(a * {k}.5f));\n\
                 for (int r = 0; r < {k} + 2; ++r) v = v * 0.99f + sinf(v) * 0.01f;\n\
                 v += warp_sum(v) * 1e-6f;\n\
                 x[i] = v;\n\
             }}\n\
             extern \"C\" __global__ void scale{k}(double* x, double a, unsigned n) {{\n\
                 unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
                 if (i < n) x[i] = lerp(x[i], x[i] * a, 0.5) + {k}.0;\n\
             }}\n"
        ));
    }
    s
}

fn check(call: &str, s: rtc::nvrtcResult) {
    assert!(s.is_success(), "{call} failed: {s}");
}

/// The whole compile through the raw table: create, compile, log, cubin, destroy.
fn raw_compile(lib: &rtc::Nvrtc, src: &CString, name: &CString, opts: &[*const c_char]) -> usize {
    let mut prog: nvrtcProgram = std::ptr::null_mut();
    // SAFETY: live NUL-terminated strings, no headers; the options outlive the calls.
    unsafe {
        check(
            "create",
            (lib.nvrtcCreateProgram().unwrap())(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
        );
        check(
            "compile",
            (lib.nvrtcCompileProgram().unwrap())(prog, opts.len() as i32, opts.as_ptr()),
        );
        let mut log_size = 0;
        check(
            "log size",
            (lib.nvrtcGetProgramLogSize().unwrap())(prog, &mut log_size),
        );
        let mut log = vec![0u8; log_size];
        check(
            "log",
            (lib.nvrtcGetProgramLog().unwrap())(prog, log.as_mut_ptr().cast()),
        );
        let mut size = 0;
        check(
            "cubin size",
            (lib.nvrtcGetCUBINSize().unwrap())(prog, &mut size),
        );
        let mut cubin = vec![0u8; size];
        check(
            "cubin",
            (lib.nvrtcGetCUBIN().unwrap())(prog, cubin.as_mut_ptr().cast()),
        );
        check("destroy", (lib.nvrtcDestroyProgram().unwrap())(&mut prog));
        black_box(&cubin);
        black_box(&log);
        size
    }
}

fn run() -> Result<(), MetraleError> {
    let quick = common::is_quick();
    let rounds = rounds(21, 3);
    let hits = if quick { 200 } else { 2_000 };
    let disk_hits = if quick { 50 } else { 500 };

    let lib = rtc::nvrtc().map_err(|e| {
        MetraleError::from(metrale_runtime::ErrorKind::InvalidArgument(format!(
            "NVRTC is not available: {e}"
        )))
    })?;
    let text = source();
    let lines = text.lines().count();
    let program = Program::new("bench.cu", text.clone());
    let src = CString::new(text).unwrap();
    let name = CString::new("bench.cu").unwrap();
    let options: Vec<CString> = program
        .rendered_options(TARGET)
        .into_iter()
        .map(|o| CString::new(o).unwrap())
        .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();

    // Warm both paths once (first compile loads NVRTC's builtins and caches).
    let raw_bytes = raw_compile(lib, &src, &name, &option_ptrs);
    let ours_bytes = program.compile(TARGET)?.cubin().map_or(0, <[u8]>::len);
    assert_eq!(
        raw_bytes, ours_bytes,
        "both paths produce the same cubin size"
    );

    let (mut raw, mut ours) = (Row::default(), Row::default());
    for round in 0..rounds {
        // Alternate who goes first, so neither always runs on a warmer cache.
        let mut turn = |first_raw: bool| {
            if first_raw {
                raw.push(
                    time(|| {
                        black_box(raw_compile(lib, &src, &name, &option_ptrs));
                    }) * 1e3,
                );
            } else {
                ours.push(
                    time(|| {
                        black_box(program.compile(TARGET).unwrap());
                    }) * 1e3,
                );
            }
        };
        turn(round % 2 == 0);
        turn(round % 2 != 0);
    }

    let cache = CompileCache::new();
    cache.compile(&program, TARGET)?;
    let (mut mem, mut disk) = (Row::default(), Row::default());
    let dir = std::env::temp_dir().join(format!("metrale-bench-nvrtc-{}", std::process::id()));
    let writer = CompileCache::new().on_disk(&dir)?;
    writer.compile(&program, TARGET)?;
    // Memory budget 0: every call reads, checks and parses the file.
    let reader = CompileCache::with_memory_limit(0).on_disk(&dir)?;
    for _ in 0..rounds {
        mem.push(
            time(|| {
                for _ in 0..hits {
                    black_box(cache.compile(&program, TARGET).unwrap());
                }
            }) * 1e3
                / hits as f64,
        );
        disk.push(
            time(|| {
                for _ in 0..disk_hits {
                    black_box(reader.compile(&program, TARGET).unwrap());
                }
            }) * 1e3
                / disk_hits as f64,
        );
    }
    assert_eq!(reader.stats().misses, 0);
    let entry = std::fs::metadata(writer.entry_path(&program, TARGET)?.unwrap_or_default())
        .map(|m| m.len())
        .unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);

    let (maj, min) = lib.version().unwrap_or((0, 0));
    header(&format!(
        "NVRTC {maj}.{min}: a {lines}-line program for {TARGET} ({ours_bytes} bytes of cubin; disk entry {entry} bytes), {rounds} rounds"
    ));
    line("raw NVRTC compile (sys table)", &raw, "ms", None);
    line("Program::compile", &ours, "ms", Some(&ratios(&ours, &raw)));
    line(
        &format!("CompileCache hit, memory (mean of {hits})"),
        &mem,
        "ms",
        None,
    );
    line(
        &format!("CompileCache hit, disk (mean of {disk_hits})"),
        &disk,
        "ms",
        None,
    );
    println!(
        "\ncompile saved per memory hit: {:.1} ms ({:.0}x); per disk hit: {:.1} ms ({:.0}x)",
        raw.median() - mem.median(),
        raw.median() / mem.median(),
        raw.median() - disk.median(),
        raw.median() / disk.median()
    );
    end_to_end(&program, &cache, rounds)
}

/// With a GPU: compile + load + first launch (and the same from the memory
/// cache), each ending when the kernel has run.
fn end_to_end(program: &Program, cache: &CompileCache, rounds: usize) -> Result<(), MetraleError> {
    use metrale_runtime::{host, DeviceBuffer, LaunchConfig, MetraleRegistry};
    let Ok(h) = host(0) else {
        println!("\n(no GPU: the end-to-end rows need one)");
        return Ok(());
    };
    let n = 1usize << 20;
    let s = h.stream();
    let mut x = DeviceBuffer::<f32>::zeroed(s, n)?;
    let y = DeviceBuffer::<f32>::zeroed(s, n)?;
    let cfg = LaunchConfig::for_num_elems(n, 256)?;
    let mut step = |compiled: &metrale_runtime::nvrtc::Compiled| -> Result<(), MetraleError> {
        let reg = MetraleRegistry::load_into(std::sync::Arc::clone(&h), &[compiled])?;
        let f = reg.function("bench.cu", "step0")?;
        // SAFETY: step0(float* x, const float* y, float a, unsigned n) over n
        // elements of x and y.
        unsafe { s.launch(&f, cfg, (&mut x, &y, 0.5f32, n as u32))? };
        s.synchronize()
    };
    let (mut fresh, mut cached) = (Row::default(), Row::default());
    cache.compile_for(program, h.ctx())?;
    for _ in 0..rounds {
        let t = std::time::Instant::now();
        let out = program.compile_for(h.ctx())?;
        step(&out)?;
        fresh.push(t.elapsed().as_secs_f64() * 1e3);
        let t = std::time::Instant::now();
        let out = cache.compile_for(program, h.ctx())?;
        step(&out)?;
        cached.push(t.elapsed().as_secs_f64() * 1e3);
    }
    header(&format!(
        "end to end on {}: compile for the device, load, first launch of step0 over {n} floats, synchronised",
        h.device_name()
    ));
    line("compile + load + first launch", &fresh, "ms", None);
    line(
        "cache hit (memory) + load + first launch",
        &cached,
        "ms",
        None,
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvrtc bench: {e}");
            ExitCode::from(2)
        }
    }
}
