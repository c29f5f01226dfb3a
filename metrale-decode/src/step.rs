//! The decode step: the engine (a model on one GPU: kernels, weights, the
//! cuBLASLt handle) and a session (the KV caches and activations of one
//! (max batch, context capacity), taken from one capture arena, the GEMM plans
//! and launch shapes of each batch bucket). A step runs eagerly on a stream, or
//! is captured once per bucket into `GraphBuckets` and replayed.
//!
//! Invariants: every buffer a step touches is a view of the session's arena or
//! a weight of the engine, so captured graphs replay fixed addresses that live
//! as long as the session; positions and tokens are read from device memory,
//! so a graph serves every step; no plan, allocation or heuristic happens in a
//! step (plans are made with the session).

use std::sync::Arc;

use metrale_runtime::blas::{BlasLt, MatmulDesc, Transpose};
use metrale_runtime::half::bf16;
use metrale_runtime::nvtx::{self, EventAttributes};
use metrale_runtime::{
    memory_info, CaptureArena, CudaEvent, CudaHost, CudaStream, DeviceSliceMut, GraphBuckets,
    LaunchConfig,
};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::gemm::{run_gate_up, run_gemm, silu_config, Gemm, Plans};
use crate::kernels::{Kernels, Split, ATTN_THREADS};
use crate::weights::Weights;

/// A model on one GPU.
#[derive(Debug)]
pub struct Engine {
    /// The model's shape.
    pub cfg: Config,
    /// The device.
    pub host: Arc<CudaHost>,
    /// The stream every step runs on (its own, so it can be captured).
    pub stream: CudaStream,
    /// The compiled kernels.
    pub kernels: Kernels,
    /// The weights.
    pub weights: Weights,
    /// The cuBLASLt handle (plans cached per problem).
    pub blas: BlasLt,
    /// Streaming multiprocessors (the attention split is chosen for them).
    pub sms: usize,
    /// Whether sessions time the heuristic's algorithms for each GEMM and keep
    /// the fastest (on by default; `METRALE_DECODE_TUNE=0` turns it off).
    pub tune: bool,
    /// Whether the step's own kernels are launched with programmatic dependent
    /// launch (compute capability 9.0+; `METRALE_DECODE_PDL=0` turns it off):
    /// each may be launched while the one before it drains, and waits for it
    /// in the kernel (`griddepcontrol.wait`) before touching its results.
    pub pdl: bool,
    /// The GEMMs tuned for each batch, kept for the engine's later sessions.
    tuned: std::sync::Mutex<std::collections::HashMap<usize, Plans>>,
}

/// Where the weights come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// `.safetensors` files in a folder.
    Files(std::path::PathBuf),
    /// N(0, 0.02) made on the device from a seed (benches without files).
    Random(u64),
}

impl Engine {
    /// Compile the kernels, load or make the weights, open cuBLASLt, on device
    /// `ordinal`.
    pub fn new(ordinal: usize, cfg: Config, source: &Source, progress: bool) -> Result<Engine> {
        let host = metrale_runtime::host(ordinal)?;
        let stream = CudaStream::new(host.ctx())?;
        crate::trace(format_args!(
            "{}: compiling or finding the kernels",
            cfg.name
        ));
        let kernels = Kernels::load(&host, &crate::kernels::cache(), &cfg)?;
        crate::trace(format_args!("{}: weights", cfg.name));
        let weights = match source {
            Source::Files(dir) => Weights::load(&stream, &cfg, dir, progress)?,
            Source::Random(seed) => Weights::random_on_device(&stream, &kernels, &cfg, *seed)?,
        };
        crate::trace(format_args!("{}: cuBLASLt", cfg.name));
        let blas = BlasLt::new(host.ctx())?;
        blas.prepare(&stream)?;
        let sms = host.limits().multiprocessor_count as usize;
        let pdl = host.limits().compute_capability.0 >= 9
            && std::env::var("METRALE_DECODE_PDL").map_or(true, |v| v != "0");
        Ok(Engine {
            cfg,
            host,
            stream,
            kernels,
            weights,
            blas,
            sms,
            tune: std::env::var("METRALE_DECODE_TUNE").map_or(true, |v| v != "0"),
            pdl,
            tuned: std::sync::Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// Bytes of device memory in use on this device now (free memory's
    /// complement).
    pub fn device_bytes_used(&self) -> Result<usize> {
        let (free, total) = memory_info(self.host.ctx())?;
        Ok(total.saturating_sub(free))
    }
}

/// One batch bucket: its plans, attention split and launch shapes.
#[derive(Debug, Clone)]
struct Bucket {
    batch: usize,
    split: Split,
    plans: Plans,
    rows: LaunchConfig,
    argmax: LaunchConfig,
    attention: LaunchConfig,
    combine: LaunchConfig,
    silu: LaunchConfig,
}

/// The state of decoding up to `max_batch` sequences up to `capacity`
/// positions: KV caches, RoPE tables, activations, all views of one arena.
#[derive(Debug)]
pub struct Session<'a> {
    engine: &'a Engine,
    /// Most sequences.
    pub max_batch: usize,
    /// Positions per sequence.
    pub capacity: usize,
    tokens: DeviceSliceMut<'a, i64>,
    pos: DeviceSliceMut<'a, i64>,
    acts: Acts<'a>,
    part_o: DeviceSliceMut<'a, f32>,
    part_ml: DeviceSliceMut<'a, f32>,
    cos: DeviceSliceMut<'a, bf16>,
    sin: DeviceSliceMut<'a, bf16>,
    kv: Vec<(DeviceSliceMut<'a, bf16>, DeviceSliceMut<'a, bf16>)>,
    buckets: Vec<Bucket>,
}

/// A step's activations, [B, ...] rows of bf16.
#[derive(Debug)]
struct Acts<'a> {
    /// The residual stream `[B, H]`.
    x: DeviceSliceMut<'a, bf16>,
    /// A normed input `[B, H]`.
    h: DeviceSliceMut<'a, bf16>,
    /// `[B, (Hq + 2 Hkv) D]`.
    qkv: DeviceSliceMut<'a, bf16>,
    /// Rotated queries `[B, Hq, D]`.
    q: DeviceSliceMut<'a, bf16>,
    /// Attention output `[B, Hq D]`.
    o: DeviceSliceMut<'a, bf16>,
    /// Gate and up `[B, 2 I]`.
    gu: DeviceSliceMut<'a, bf16>,
    /// SiLU(gate) * up `[B, I]`.
    act: DeviceSliceMut<'a, bf16>,
    /// `[B, V]`.
    logits: DeviceSliceMut<'a, bf16>,
}

/// The views a session takes, in order: (bytes of one element, elements).
fn layout(
    cfg: &Config,
    max_batch: usize,
    capacity: usize,
    max_parts: usize,
) -> Vec<(usize, usize)> {
    let (b, h, d) = (max_batch, cfg.hidden, cfg.head_dim);
    let kv = b * cfg.kv_heads * capacity * d;
    let mut v = vec![
        (8, b),                  // tokens
        (8, 1),                  // pos
        (2, b * h),              // x
        (2, b * h),              // h
        (2, b * cfg.qkv_rows()), // qkv
        (2, b * cfg.heads * d),  // q
        (2, b * cfg.heads * d),  // o
        (2, b * 2 * cfg.ffn),    // gu
        (2, b * cfg.ffn),        // act
        (2, b * cfg.vocab),      // logits
        (4, max_parts * d),      // part_o
        (4, max_parts * 2),      // part_ml
        (2, capacity * d),       // cos
        (2, capacity * d),       // sin
    ];
    for _ in 0..cfg.layers {
        v.push((2, kv));
        v.push((2, kv));
    }
    v
}

/// A session's sizes: a batch of 1 to 65,535 (a grid dimension) and a
/// capacity of 1 to `i32::MAX` positions, whose KV caches' bytes fit a `usize`.
fn check_sizes(cfg: &Config, max_batch: usize, capacity: usize) -> Result<()> {
    if !(1..=65_535).contains(&max_batch) || capacity == 0 || i32::try_from(capacity).is_err() {
        return Err(Error::Invalid(format!(
            "a session of batch {max_batch} and capacity {capacity}: the batch must be 1 to 65535, \
             the capacity 1 to {}",
            i32::MAX
        )));
    }
    let kv = [
        max_batch,
        cfg.kv_heads,
        capacity,
        cfg.head_dim,
        2,
        2,
        cfg.layers,
    ]
    .iter()
    .try_fold(1usize, |a, &b| a.checked_mul(b));
    if kv.is_none() {
        return Err(Error::Invalid(format!(
            "a session of batch {max_batch} and capacity {capacity}: its KV caches' size overflows"
        )));
    }
    Ok(())
}

/// Arena bytes for a layout: each view 256-byte aligned, as the arena takes.
fn arena_bytes(views: &[(usize, usize)]) -> usize {
    views
        .iter()
        .map(|&(e, n)| (e * n).next_multiple_of(256))
        .sum::<usize>()
        + 256
}

impl<'a> Session<'a> {
    /// The arena a session of these sizes takes its views from (make it once,
    /// keep it beside the session).
    pub fn arena(
        engine: &Engine,
        max_batch: usize,
        capacity: usize,
        buckets: &[usize],
    ) -> Result<CaptureArena> {
        check_sizes(&engine.cfg, max_batch, capacity)?;
        let views = layout(
            &engine.cfg,
            max_batch,
            capacity,
            max_parts(engine, buckets, capacity),
        );
        Ok(CaptureArena::new(engine.host.ctx(), arena_bytes(&views))?)
    }

    /// Bytes a session's arena takes (KV caches, activations, tables).
    pub fn arena_size(
        engine: &Engine,
        max_batch: usize,
        capacity: usize,
        buckets: &[usize],
    ) -> usize {
        arena_bytes(&layout(
            &engine.cfg,
            max_batch,
            capacity,
            max_parts(engine, buckets, capacity),
        ))
    }

    /// A session over `arena` (made by [`Session::arena`] with the same sizes)
    /// for batch buckets `buckets` (each at most `max_batch`): views taken,
    /// RoPE tables written, KV caches filled with N(0, 1) from `seed` (the step
    /// definition's prefill), plans made, pos 0, tokens 0.
    pub fn new(
        engine: &'a Engine,
        arena: &'a CaptureArena,
        max_batch: usize,
        capacity: usize,
        buckets: &[usize],
        seed: u64,
    ) -> Result<Session<'a>> {
        let cfg = &engine.cfg;
        check_sizes(cfg, max_batch, capacity)?;
        if i32::try_from(capacity).is_err() {
            return Err(Error::Invalid(format!(
                "capacity {capacity} does not fit 31 bits"
            )));
        }
        let mut sizes = buckets.to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.is_empty() || sizes[0] == 0 || sizes[sizes.len() - 1] > max_batch {
            return Err(Error::Invalid(format!(
                "batch buckets {buckets:?}: at least one, each from 1 to the session's batch {max_batch}"
            )));
        }
        let d = cfg.head_dim;
        let parts = max_parts(engine, &sizes, capacity);
        let kv_len = max_batch * cfg.kv_heads * capacity * d;
        let s = &engine.stream;
        let mut sess = Session {
            engine,
            max_batch,
            capacity,
            tokens: arena.take(max_batch)?,
            pos: arena.take(1)?,
            acts: Acts {
                x: arena.take(max_batch * cfg.hidden)?,
                h: arena.take(max_batch * cfg.hidden)?,
                qkv: arena.take(max_batch * cfg.qkv_rows())?,
                q: arena.take(max_batch * cfg.heads * d)?,
                o: arena.take(max_batch * cfg.heads * d)?,
                gu: arena.take(max_batch * 2 * cfg.ffn)?,
                act: arena.take(max_batch * cfg.ffn)?,
                logits: arena.take(max_batch * cfg.vocab)?,
            },
            part_o: arena.take(parts * d)?,
            part_ml: arena.take(parts * 2)?,
            cos: arena.take(capacity * d)?,
            sin: arena.take(capacity * d)?,
            kv: Vec::with_capacity(cfg.layers),
            buckets: Vec::with_capacity(sizes.len()),
        };
        for _ in 0..cfg.layers {
            sess.kv.push((arena.take(kv_len)?, arena.take(kv_len)?));
        }
        let (cos, sin) = cfg.rope_tables(capacity);
        s.copy_h2d(&bits(&cos), &mut sess.cos)?;
        s.copy_h2d(&bits(&sin), &mut sess.sin)?;
        for (l, (k, v)) in sess.kv.iter_mut().enumerate() {
            let base = seed.wrapping_mul(7919).wrapping_add(2 * l as u64);
            crate::weights::fill_normal(s, &engine.kernels, k, base, 1.0)?;
            crate::weights::fill_normal(s, &engine.kernels, v, base + 1, 1.0)?;
        }
        s.zero(&mut sess.tokens)?;
        s.zero(&mut sess.pos)?;
        for &b in &sizes {
            crate::trace(format_args!("session: plans of batch {b}"));
            let mut bk = bucket(engine, b, capacity)?;
            if engine.tune {
                bk.plans = sess.tune(b)?;
                crate::trace(format_args!(
                    "session: batch {b} tuned: {}",
                    bk.plans.describe()
                ));
            }
            sess.buckets.push(bk);
        }
        s.synchronize()?;
        Ok(sess)
    }

    /// The fastest of the heuristic's algorithms (up to 8) for each GEMM of
    /// batch `b`, timed on this session's buffers over every layer's weights
    /// (so the weights stream from memory as in a step, not from L2).
    fn tune(&mut self, b: usize) -> Result<Plans> {
        let e = self.engine;
        let (cfg, w, s) = (&e.cfg, &e.weights, &e.stream);
        // Tuned once per engine and batch: every later session of the engine
        // runs the same algorithms (so its results are the same bits).
        if let Some(p) = e
            .tuned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&b)
        {
            return Ok(p.clone());
        }
        let mut plans = Plans::new(&e.blas, cfg, b)?;
        // Inputs of random values, not whatever the arena held (zeros run faster).
        for (i, v) in [&mut self.acts.h, &mut self.acts.o, &mut self.acts.act]
            .into_iter()
            .enumerate()
        {
            crate::weights::fill_normal(s, &e.kernels, v, 99 + i as u64, 1.0)?;
        }
        let h = cfg.hidden;
        let shapes = [
            (Op::Qkv, cfg.qkv_rows(), h),
            (Op::O, h, cfg.heads * cfg.head_dim),
            (Op::GateUp, 2 * cfg.ffn, h),
            (Op::Down, h, cfg.ffn),
            (Op::LmHead, cfg.vocab, h),
        ];
        for (op, out, inp) in shapes {
            let desc =
                MatmulDesc::new::<bf16, bf16, bf16, bf16>(out, b, inp).transpose_a(Transpose::Yes);
            let mut candidates: Vec<Gemm> = e
                .blas
                .plan_candidates(&desc, 8)?
                .into_iter()
                .map(Gemm::Lt)
                .collect();
            if b == 1 && inp <= crate::kernels::GEMV_MAX_K {
                candidates.push(Gemm::Gemv);
            }
            let silu = silu_config(cfg, b)?.with_programmatic_serialization(e.pdl);
            let mut best: Option<(f32, Gemm)> = None;
            for g in candidates {
                crate::trace(format_args!("tuning {op:?} batch {b}: {}", g.describe()));
                let run = |sess: &mut Session<'a>| -> metrale_runtime::Result<()> {
                    let k = &e.kernels;
                    let a = &mut sess.acts;
                    // Residual GEMMs run with beta 1 as in a step: x drifts, and
                    // every step writes x first (from the embedding).
                    for lw in &w.layers {
                        match op {
                            Op::Qkv => run_gemm(
                                s, k, &g, &lw.wqkv, &a.h, &mut a.qkv, out, inp, false, e.pdl,
                            )?,
                            Op::O => {
                                run_gemm(s, k, &g, &lw.wo, &a.o, &mut a.x, out, inp, true, e.pdl)?
                            }
                            Op::GateUp => run_gate_up(
                                s,
                                k,
                                &g,
                                &lw.w_gate_up,
                                &a.h,
                                &mut a.gu,
                                &mut a.act,
                                cfg.ffn,
                                inp,
                                silu,
                                e.pdl,
                            )?,
                            Op::Down => run_gemm(
                                s, k, &g, &lw.w_down, &a.act, &mut a.x, out, inp, true, e.pdl,
                            )?,
                            _ => {
                                return run_gemm(
                                    s,
                                    k,
                                    &g,
                                    w.lm_head(),
                                    &a.h,
                                    &mut a.logits,
                                    out,
                                    inp,
                                    false,
                                    e.pdl,
                                )
                            }
                        }
                    }
                    Ok(())
                };
                // A candidate that fails to run (a workspace it cannot have, say) is skipped.
                if run(self).is_err() {
                    continue;
                }
                let (t0, t1) = (CudaEvent::timed(s)?, CudaEvent::timed(s)?);
                t0.record(s)?;
                for _ in 0..3 {
                    run(self)?;
                }
                t1.record(s)?;
                t1.synchronize()?;
                let ms = t0.elapsed_ms(&t1)?;
                if best.as_ref().is_none_or(|(b, _)| ms < *b) {
                    best = Some((ms, g));
                }
            }
            if let Some((_, g)) = best {
                match op {
                    Op::Qkv => plans.qkv = g,
                    Op::O => plans.o = g,
                    Op::GateUp => plans.gate_up = g,
                    Op::Down => plans.down = g,
                    _ => plans.lm_head = g,
                }
            }
        }
        e.tuned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(b, plans.clone());
        Ok(plans)
    }

    /// The bucket sizes, ascending.
    pub fn bucket_sizes(&self) -> Vec<usize> {
        self.buckets.iter().map(|b| b.batch).collect()
    }

    /// The GEMMs of bucket `batch` (after tuning).
    pub fn plans(&self, batch: usize) -> Option<&Plans> {
        self.buckets
            .iter()
            .find(|b| b.batch == batch)
            .map(|b| &b.plans)
    }

    /// The attention split of bucket `batch`.
    pub fn split(&self, batch: usize) -> Option<Split> {
        self.buckets
            .iter()
            .find(|b| b.batch == batch)
            .map(|b| b.split)
    }

    /// Set the first `tokens.len()` tokens and the position (host values,
    /// copied and waited for; not inside a step).
    pub fn set_inputs(&mut self, tokens: &[i64], pos: usize) -> Result<()> {
        let cfg = &self.engine.cfg;
        if tokens.len() > self.max_batch {
            return Err(Error::Invalid(format!(
                "{} tokens for a session of {} sequences",
                tokens.len(),
                self.max_batch
            )));
        }
        if let Some(t) = tokens
            .iter()
            .find(|&&t| t < 0 || t as u64 >= cfg.vocab as u64)
        {
            return Err(Error::Invalid(format!(
                "token {t} is outside the vocabulary (0..{})",
                cfg.vocab
            )));
        }
        if pos >= self.capacity {
            return Err(Error::Invalid(format!(
                "position {pos} is past the session's capacity {}",
                self.capacity
            )));
        }
        let s = &self.engine.stream;
        s.copy_h2d(tokens, &mut self.tokens.slice_mut(..tokens.len())?)?;
        s.copy_h2d(&[pos as i64], &mut self.pos)?;
        Ok(())
    }

    /// The current tokens of the first `batch` sequences (waits for the stream).
    pub fn tokens(&self, batch: usize) -> Result<Vec<i64>> {
        Ok(self
            .engine
            .stream
            .to_vec(&self.tokens.slice(..batch.min(self.max_batch))?)?)
    }

    /// The current position (waits for the stream).
    pub fn position(&self) -> Result<i64> {
        Ok(self
            .engine
            .stream
            .to_vec(&self.pos)?
            .first()
            .copied()
            .unwrap_or(0))
    }

    /// The last step's logits of the first `batch` sequences, `[batch, V]`
    /// (waits for the stream).
    pub fn logits(&self, batch: usize) -> Result<Vec<bf16>> {
        let v = self.engine.cfg.vocab;
        Ok(self
            .engine
            .stream
            .to_vec(&self.acts.logits.slice(..batch.min(self.max_batch) * v)?)?)
    }

    /// One decode step of bucket `batch` on the engine's stream: embedding
    /// through argmax, the chosen tokens written over the inputs; then
    /// `pos += pos_inc` on the device. Queued, not waited for.
    pub fn step(&mut self, batch: usize, pos_inc: i32) -> metrale_runtime::Result<()> {
        let s = &self.engine.stream;
        self.step_on(s, batch, pos_inc)
    }

    /// [`Session::step`] on `s` (a capture's stream).
    pub fn step_on(
        &mut self,
        s: &CudaStream,
        batch: usize,
        pos_inc: i32,
    ) -> metrale_runtime::Result<()> {
        self.step_probed(s, batch, pos_inc, &mut NoProbe)
    }

    /// [`Session::step_on`] with `probe` called after each kernel or GEMM
    /// (the profile's events; [`NoProbe`] costs nothing).
    pub fn step_probed<P: Probe>(
        &mut self,
        s: &CudaStream,
        batch: usize,
        pos_inc: i32,
        probe: &mut P,
    ) -> metrale_runtime::Result<()> {
        let e = self.engine;
        let (cfg, k, w) = (&e.cfg, &e.kernels, &e.weights);
        let Some(bk) = self.buckets.iter().find(|b| b.batch == batch) else {
            return Err(metrale_runtime::MetraleError::from(
                metrale_runtime::ErrorKind::InvalidArgument(format!(
                    "decode step: no bucket of batch {batch} (the buckets are {:?})",
                    self.buckets.iter().map(|b| b.batch).collect::<Vec<_>>()
                )),
            ));
        };
        let _step = nvtx::range_with(
            &EventAttributes::new()
                .message("decode step")
                .payload(batch as u64),
        );
        let (hid, eps) = (cfg.hidden as i32, cfg.eps);
        let (hq, hkv, d, cap) = (
            cfg.heads as i32,
            cfg.kv_heads as i32,
            cfg.head_dim as i32,
            self.capacity as i32,
        );
        let scale = 1.0 / (cfg.head_dim as f32).sqrt();
        let (nqkv, nq) = (cfg.qkv_rows(), cfg.heads * cfg.head_dim);
        // Every launch below relies on this: the kernel's C signature is the one
        // its field in `Kernels` documents; each pointer is a session view or a
        // weight sized for the session's max batch, capacity and the model, and
        // the grid reads and writes only the first `batch` rows of them.
        // SAFETY: as just said.
        unsafe {
            s.launch(
                &k.embed_rmsnorm,
                bk.rows,
                (
                    &self.tokens,
                    &w.embed,
                    &w.layers[0].attn_norm,
                    &mut self.acts.x,
                    &mut self.acts.h,
                    hid,
                    eps,
                    cfg.vocab as i32,
                ),
            )?;
        }
        probe.after(s, Op::Embed)?;
        for (l, lw) in w.layers.iter().enumerate() {
            let _layer =
                nvtx::range_with(&EventAttributes::new().message("layer").payload(l as u64));
            if l > 0 {
                // SAFETY: as above.
                unsafe {
                    s.launch(
                        &k.rmsnorm,
                        bk.rows,
                        (&self.acts.x, &lw.attn_norm, &mut self.acts.h, hid, eps),
                    )?
                };
                probe.after(s, Op::AttnNorm)?;
            }
            let a = &mut self.acts;
            run_gemm(
                s,
                k,
                &bk.plans.qkv,
                &lw.wqkv,
                &a.h,
                &mut a.qkv,
                nqkv,
                cfg.hidden,
                false,
                e.pdl,
            )?;
            probe.after(s, Op::Qkv)?;
            let (kc, vc) = &mut self.kv[l];
            // SAFETY: as above; slot pos of each cache row is written.
            unsafe {
                s.launch(
                    &k.rope_append,
                    bk.rows,
                    (
                        &self.acts.qkv,
                        &self.pos,
                        &self.cos,
                        &self.sin,
                        &mut self.acts.q,
                        &mut *kc,
                        &mut *vc,
                        hq,
                        hkv,
                        d,
                        cap,
                    ),
                )?;
                probe.after(s, Op::Rope)?;
                s.launch(
                    &k.attention,
                    bk.attention,
                    (
                        &self.acts.q,
                        &*kc,
                        &*vc,
                        &self.pos,
                        &mut self.part_o,
                        &mut self.part_ml,
                        hkv,
                        cap,
                        bk.split.split_len as i32,
                        scale,
                    ),
                )?;
                probe.after(s, Op::Attention)?;
                s.launch(
                    &k.attn_combine,
                    bk.combine,
                    (
                        &self.part_o,
                        &self.part_ml,
                        &mut self.acts.o,
                        bk.split.nsplit as i32,
                        d,
                    ),
                )?;
                probe.after(s, Op::Combine)?;
            }
            let a = &mut self.acts;
            run_gemm(
                s,
                k,
                &bk.plans.o,
                &lw.wo,
                &a.o,
                &mut a.x,
                cfg.hidden,
                nq,
                true,
                e.pdl,
            )?;
            probe.after(s, Op::O)?;
            // SAFETY: as above.
            unsafe {
                s.launch(
                    &k.rmsnorm,
                    bk.rows,
                    (&self.acts.x, &lw.ffn_norm, &mut self.acts.h, hid, eps),
                )?
            };
            probe.after(s, Op::FfnNorm)?;
            run_gate_up(
                s,
                k,
                &bk.plans.gate_up,
                &lw.w_gate_up,
                &self.acts.h,
                &mut self.acts.gu,
                &mut self.acts.act,
                cfg.ffn,
                cfg.hidden,
                bk.silu,
                e.pdl,
            )?;
            probe.after(s, Op::GateUp)?;
            let a = &mut self.acts;
            run_gemm(
                s,
                k,
                &bk.plans.down,
                &lw.w_down,
                &a.act,
                &mut a.x,
                cfg.hidden,
                cfg.ffn,
                true,
                e.pdl,
            )?;
            probe.after(s, Op::Down)?;
        }
        // SAFETY: as above.
        unsafe {
            s.launch(
                &k.rmsnorm,
                bk.rows,
                (&self.acts.x, &w.final_norm, &mut self.acts.h, hid, eps),
            )?
        };
        probe.after(s, Op::FinalNorm)?;
        let a = &mut self.acts;
        run_gemm(
            s,
            k,
            &bk.plans.lm_head,
            w.lm_head(),
            &a.h,
            &mut a.logits,
            cfg.vocab,
            cfg.hidden,
            false,
            e.pdl,
        )?;
        probe.after(s, Op::LmHead)?;
        // SAFETY: as above; one thread of row 0 advances pos after every reader.
        unsafe {
            s.launch(
                &k.argmax,
                bk.argmax,
                (
                    &self.acts.logits,
                    &mut self.tokens,
                    &mut self.pos,
                    cfg.vocab as i32,
                    pos_inc,
                ),
            )?;
        }
        probe.after(s, Op::Argmax)?;
        Ok(())
    }

    /// Capture one step per bucket into graphs (through the session's arena),
    /// each advancing pos by `pos_inc`.
    pub fn capture(&mut self, arena: &CaptureArena, pos_inc: i32) -> Result<GraphBuckets> {
        let sizes = self.bucket_sizes();
        crate::trace(format_args!("capturing buckets {sizes:?}"));
        let s = &self.engine.stream;
        Ok(GraphBuckets::capture(s, arena, &sizes, |s, b| {
            self.step_on(s, b, pos_inc)
        })?)
    }
}

/// The operations of a step, in order (a probe is told each as it is queued).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Embedding gather and the first RMSNorm.
    Embed,
    /// A layer's attention RMSNorm.
    AttnNorm,
    /// The QKV GEMM.
    Qkv,
    /// RoPE and the KV append.
    Rope,
    /// Split attention.
    Attention,
    /// Merging the splits.
    Combine,
    /// The output projection, residual added.
    O,
    /// The MLP's RMSNorm.
    FfnNorm,
    /// The gate|up GEMM.
    GateUp,
    /// SiLU(gate) * up.
    Silu,
    /// The down GEMM, residual added.
    Down,
    /// The final RMSNorm.
    FinalNorm,
    /// The vocabulary GEMM.
    LmHead,
    /// The greedy choice.
    Argmax,
}

impl Op {
    /// Every operation, in step order.
    pub const ALL: [Op; 14] = [
        Op::Embed,
        Op::AttnNorm,
        Op::Qkv,
        Op::Rope,
        Op::Attention,
        Op::Combine,
        Op::O,
        Op::FfnNorm,
        Op::GateUp,
        Op::Silu,
        Op::Down,
        Op::FinalNorm,
        Op::LmHead,
        Op::Argmax,
    ];
}

/// Told after each operation of a step is queued.
pub trait Probe {
    /// `op` was just queued on `s`.
    fn after(&mut self, s: &CudaStream, op: Op) -> metrale_runtime::Result<()>;
}

/// The probe of plain steps: nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProbe;

impl Probe for NoProbe {
    #[inline(always)]
    fn after(&mut self, _: &CudaStream, _: Op) -> metrale_runtime::Result<()> {
        Ok(())
    }
}

/// bf16 values from their bits.
fn bits(v: &[u16]) -> Vec<bf16> {
    v.iter().map(|&b| bf16::from_bits(b)).collect()
}

/// The largest (row, query head, split) count over the buckets.
fn max_parts(engine: &Engine, buckets: &[usize], capacity: usize) -> usize {
    let cfg = &engine.cfg;
    buckets
        .iter()
        .map(|&b| b * cfg.heads * Split::choose(b, cfg.kv_heads, capacity, engine.sms).nsplit)
        .max()
        .unwrap_or(1)
}

fn bucket(engine: &Engine, b: usize, capacity: usize) -> Result<Bucket> {
    let cfg = &engine.cfg;
    let split = Split::choose(b, cfg.kv_heads, capacity, engine.sms);
    let pdl = engine.pdl;
    let b32 =
        u32::try_from(b).map_err(|_| Error::Invalid(format!("batch {b} does not fit 32 bits")))?;
    Ok(Bucket {
        batch: b,
        split,
        plans: Plans::new(&engine.blas, cfg, b)?,
        rows: LaunchConfig::new((b32, 1, 1), (256, 1, 1), 0)?.with_programmatic_serialization(pdl),
        argmax: LaunchConfig::new((b32, 1, 1), (1024, 1, 1), 0)?
            .with_programmatic_serialization(pdl),
        attention: LaunchConfig::new(
            (split.nsplit as u32, cfg.kv_heads as u32, b32),
            (ATTN_THREADS, 1, 1),
            0,
        )?
        .with_programmatic_serialization(pdl),
        combine: LaunchConfig::new(
            (b32 * cfg.heads as u32, 1, 1),
            (cfg.head_dim as u32, 1, 1),
            0,
        )?
        .with_programmatic_serialization(pdl),
        silu: silu_config(cfg, b)?.with_programmatic_serialization(pdl),
    })
}
