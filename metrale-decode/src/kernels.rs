//! The step's CUDA kernels (`kernels.cu` beside this file): compiled once per
//! GPU architecture with metrale's NVRTC and its on-disk cache, loaded into one
//! module, looked up once. Each launch below states the kernel's C signature
//! it relies on; the runtime checks count and sizes against the kernel's real
//! parameter list before the driver sees them.

use std::path::PathBuf;
use std::sync::Arc;

use metrale_runtime::nvrtc::{CompileCache, Compiled, Program};
use metrale_runtime::{CudaFunction, CudaHost, MetraleRegistry};

use crate::config::Config;
use crate::error::{Error, Result};

/// The CUDA C++ source of every kernel of the step.
pub const SOURCE: &str = include_str!("kernels.cu");

/// The module's name in the registry (and NVRTC's program name).
pub const MODULE: &str = "metrale_decode.cu";

/// The program NVRTC compiles (C++17, no headers, no fast-math flag: the
/// kernels choose their fast intrinsics themselves).
pub fn program() -> Program {
    Program::new(MODULE, SOURCE).std("c++17")
}

/// The compile cache: `METRALE_DECODE_CACHE`, else `$XDG_CACHE_HOME/metrale-decode`,
/// else `~/.cache/metrale-decode`; in memory only when none can be made.
pub fn cache() -> CompileCache {
    let folder = std::env::var_os("METRALE_DECODE_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("metrale-decode"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/metrale-decode"))
        });
    match folder {
        Some(f) => match CompileCache::new().on_disk(&f) {
            Ok(c) => c,
            Err(_) => CompileCache::new(),
        },
        None => CompileCache::new(),
    }
}

/// The step's kernels on one device.
#[derive(Debug)]
pub struct Kernels {
    /// Keeps the module loaded (the functions do too).
    pub registry: MetraleRegistry,
    /// The cubin NVRTC made (or the cache gave back).
    pub compiled: Arc<Compiled>,
    /// `embed_rmsnorm(const i64* tokens, const bf16* embed, const bf16* w, bf16* x, bf16* h, int H, float eps, int vocab)`
    pub embed_rmsnorm: CudaFunction,
    /// `rmsnorm(const bf16* x, const bf16* w, bf16* h, int H, float eps)`
    pub rmsnorm: CudaFunction,
    /// `rope_append(const bf16* qkv, const i64* pos, const bf16* cos, const bf16* sin, bf16* q, bf16* k_cache, bf16* v_cache, int Hq, int Hkv, int D, int cap)`
    pub rope_append: CudaFunction,
    /// `attn_d{D}_g{G}(const bf16* q, const bf16* k, const bf16* v, const i64* pos, float* part_o, float* part_ml, int Hkv, int cap, int split_len, float scale)`
    pub attention: CudaFunction,
    /// `attn_combine(const float* part_o, const float* part_ml, bf16* o, int nsplit, int D)`
    pub attn_combine: CudaFunction,
    /// `silu_mul(const bf16* gu, bf16* act, int I)`
    pub silu_mul: CudaFunction,
    /// `argmax_rows(const bf16* logits, i64* tokens, i64* pos, int V, int pos_inc)`
    pub argmax: CudaFunction,
    /// `fill_normal(bf16* out, unsigned long long n, unsigned long long seed, float std)`
    pub fill_normal: CudaFunction,
    /// `read_sum(const bf16* in, unsigned long long n, float* partial)`
    pub read_sum: CudaFunction,
    /// `spin(unsigned long long ns)`
    pub spin: CudaFunction,
    /// `gemv_store(const bf16* W, const bf16* x, bf16* y, int N, int K)`
    pub gemv_store: CudaFunction,
    /// `gemv_residual(const bf16* W, const bf16* x, bf16* y, int N, int K)`
    pub gemv_residual: CudaFunction,
    /// `gemv_silu(const bf16* W, const bf16* x, bf16* y, int N, int K)`
    pub gemv_silu: CudaFunction,
}

impl Kernels {
    /// Compile (or find in `cache`) and load the kernels for `host`'s GPU, with
    /// the attention kernel of `cfg`'s head size and group.
    pub fn load(host: &Arc<CudaHost>, cache: &CompileCache, cfg: &Config) -> Result<Kernels> {
        let compiled = cache.compile_for(&program(), host.ctx())?;
        if !compiled.log().trim().is_empty() {
            eprintln!("metrale-decode: NVRTC said:\n{}", compiled.log());
        }
        let registry = MetraleRegistry::load_into(Arc::clone(host), &[&*compiled])?;
        let f = |name: &str| registry.function(MODULE, name).map_err(Error::from);
        let attention = format!("attn_d{}_g{}", cfg.head_dim, cfg.group());
        Ok(Kernels {
            embed_rmsnorm: f("embed_rmsnorm")?,
            rmsnorm: f("rmsnorm")?,
            rope_append: f("rope_append")?,
            attention: f(&attention)?,
            attn_combine: f("attn_combine")?,
            silu_mul: f("silu_mul")?,
            argmax: f("argmax_rows")?,
            fill_normal: f("fill_normal")?,
            read_sum: f("read_sum")?,
            spin: f("spin")?,
            gemv_store: f("gemv_store")?,
            gemv_residual: f("gemv_residual")?,
            gemv_silu: f("gemv_silu")?,
            registry,
            compiled,
        })
    }
}

/// The longest input a GEMV takes (`GEMV_MAX_K`: the vector sits in shared memory).
pub const GEMV_MAX_K: usize = 16384;
/// Rows per GEMV block (`GEMV_WARPS`: one warp per row).
pub const GEMV_ROWS: usize = 8;

/// Threads of one attention block (`ATTN_THREADS` in the source).
pub const ATTN_THREADS: u32 = 128;
/// The most keys one attention block takes (`ATTN_MAX_SPLIT`).
pub const ATTN_MAX_SPLIT: usize = 512;

/// How the context is split for attention: `nsplit` blocks of `split_len`
/// keys per (row, KV head). Chosen for the capacity, so one graph serves every
/// position: blocks past the current length exit at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Keys per block, a multiple of 32, at most [`ATTN_MAX_SPLIT`].
    pub split_len: usize,
    /// Blocks per (row, KV head).
    pub nsplit: usize,
}

impl Split {
    /// About two blocks per SM over all (row, KV head) pairs, each block at
    /// least 64 keys and at most [`ATTN_MAX_SPLIT`].
    pub fn choose(batch: usize, kv_heads: usize, cap: usize, sms: usize) -> Split {
        let pairs = (batch * kv_heads).max(1);
        let want = (2 * sms.max(1)).div_ceil(pairs).max(1);
        let mut split_len = cap.div_ceil(want).max(64).next_multiple_of(32);
        split_len = split_len.min(ATTN_MAX_SPLIT);
        Split {
            split_len,
            nsplit: cap.div_ceil(split_len).max(1),
        }
    }
}
