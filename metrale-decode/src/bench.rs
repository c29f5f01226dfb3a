//! `metrale-decode bench`: the step definition's grid (models × batch ×
//! context × eager/graph), timed as the definition says (CUDA events around
//! many steps or replays, the median of several repetitions, warm-up
//! excluded), beside the card's measured bandwidth floor and, when given,
//! PyTorch's rows from the same card; JSON rows, a per-operation profile and a
//! chart (feature `plot`).

use std::path::PathBuf;
use std::time::Instant;

use metrale_runtime::half::bf16;
use metrale_runtime::{CudaEvent, CudaStream, DeviceBuffer, LaunchConfig};
use serde_json::{json, Value};

use crate::config::Config;
use crate::error::{io, Error, Result};
use crate::kernels::Kernels;
use crate::step::{Engine, Op, Probe, Session, Source};
use crate::Mode;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Model presets or config.json paths.
    pub models: Vec<String>,
    /// Batch sizes (the session's graph buckets).
    pub batches: Vec<usize>,
    /// Contexts (keys attended per step).
    pub contexts: Vec<usize>,
    /// Modes.
    pub modes: Vec<Mode>,
    /// Steps per eager repetition.
    pub steps_eager: usize,
    /// Replays per graph repetition.
    pub steps_graph: usize,
    /// Repetitions (the median is reported).
    pub reps: usize,
    /// Untimed steps before each row.
    pub warmup: usize,
    /// A checkpoint folder (one model only), else random weights on the device.
    pub weights: Option<PathBuf>,
    /// Seed of random weights, caches and tokens.
    pub seed: u64,
    /// Progress bars on stderr.
    pub progress: bool,
    /// Time each operation of one eager step per row (events between kernels).
    pub profile: bool,
}

impl Default for BenchOptions {
    fn default() -> BenchOptions {
        BenchOptions {
            models: vec!["llama-1b".into(), "llama-8b".into()],
            batches: vec![1, 8, 64],
            contexts: vec![512, 2048],
            modes: vec![Mode::Eager, Mode::Graph],
            steps_eager: 20,
            steps_graph: 50,
            reps: 5,
            warmup: 3,
            weights: None,
            seed: 0,
            progress: true,
            profile: false,
        }
    }
}

/// One timed row.
#[derive(Debug, Clone)]
pub struct Row {
    /// Model name.
    pub model: String,
    /// Batch.
    pub batch: usize,
    /// Context.
    pub context: usize,
    /// Mode.
    pub mode: Mode,
    /// Median ms per step.
    pub ms_per_step: f64,
    /// Each repetition's ms per step.
    pub ms_reps: Vec<f64>,
    /// The step definition's bytes per step.
    pub bytes_per_step: u64,
    /// Capture time of the session's graphs (graph rows).
    pub capture_ms: Option<f64>,
    /// Per operation: (name, µs per step, GB/s), from one profiled step.
    pub profile: Vec<(String, f64, f64)>,
    /// Which implementation each GEMM of the row's bucket uses.
    pub gemms: String,
}

impl Row {
    /// Tokens per second: batch / step time.
    pub fn tokens_per_s(&self) -> f64 {
        self.batch as f64 * 1e3 / self.ms_per_step
    }

    /// Bytes per step over the step time, GB/s.
    pub fn achieved_gbps(&self) -> f64 {
        self.bytes_per_step as f64 / (self.ms_per_step * 1e-3) / 1e9
    }
}

/// The card's measured ceilings (GB = 1e9 bytes).
#[derive(Debug, Clone, Copy, Default)]
pub struct Ceilings {
    /// A 4 GiB device-to-device copy, bytes read plus written.
    pub copy_gbps: f64,
    /// A read-only pass over 4 GiB.
    pub read_gbps: f64,
}

impl Ceilings {
    /// The bandwidth the floor uses: the larger of the two, as the PyTorch anchor does.
    pub fn floor_gbps(&self) -> f64 {
        self.copy_gbps.max(self.read_gbps)
    }
}

/// Device memory of one session, against what it needs.
#[derive(Debug, Clone)]
pub struct MemoryRow {
    /// Model.
    pub model: String,
    /// Context capacity of the session.
    pub context: usize,
    /// Peak bytes in use on the device above the level before the engine
    /// (weights, arena, workspaces, graphs, library modules).
    pub peak_bytes: u64,
    /// Weights + KV caches and activations (the arena) + GEMM workspace.
    pub needed_bytes: u64,
}

/// A whole run.
#[derive(Debug, Clone)]
pub struct Report {
    /// The device's name.
    pub device: String,
    /// The driver's CUDA version (e.g. 13000).
    pub driver: i32,
    /// Measured ceilings.
    pub ceilings: Ceilings,
    /// Timed rows.
    pub rows: Vec<Row>,
    /// Memory per session.
    pub memory: Vec<MemoryRow>,
}

/// Events after each operation of a step (a profile).
struct EventProbe {
    events: Vec<(Op, CudaEvent)>,
    used: usize,
}

impl Probe for EventProbe {
    fn after(&mut self, s: &CudaStream, op: Op) -> metrale_runtime::Result<()> {
        if self.used == self.events.len() {
            self.events.push((op, CudaEvent::timed(s)?));
        }
        let slot = &mut self.events[self.used];
        slot.0 = op;
        slot.1.record(s)?;
        self.used += 1;
        Ok(())
    }
}

/// Run the grid.
pub fn run(opts: &BenchOptions) -> Result<Report> {
    if opts.weights.is_some() && opts.models.len() != 1 {
        return Err(Error::Invalid(
            "--weights names the checkpoint of one model: give one --models".into(),
        ));
    }
    if opts.batches.is_empty()
        || opts.contexts.is_empty()
        || opts.models.is_empty()
        || opts.reps == 0
    {
        return Err(Error::Invalid(
            "bench: at least one model, batch, context and repetition".into(),
        ));
    }
    let configs = opts
        .models
        .iter()
        .map(|m| Config::load(m))
        .collect::<Result<Vec<_>>>()?;
    let host = metrale_runtime::host(0)?;
    let device = host.device_name().to_string();
    let driver = host.driver_version();
    let ceilings = {
        let s = CudaStream::new(host.ctx())?;
        let kernels = Kernels::load(&host, &crate::kernels::cache(), &configs[0])?;
        measure_ceilings(&s, &kernels, host.limits().multiprocessor_count)?
    };
    eprintln!(
        "# {device}: copy {:.0} GB/s (read + write), read {:.0} GB/s; the floor uses {:.0} GB/s",
        ceilings.copy_gbps,
        ceilings.read_gbps,
        ceilings.floor_gbps()
    );
    let bmax = opts.batches.iter().copied().max().unwrap_or(1);
    let total =
        (configs.len() * opts.contexts.len() * opts.modes.len() * opts.batches.len()) as u64;
    let bar = if opts.progress {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg:40} [{bar:30}] {pos}/{len} rows {elapsed}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    let mut rows = Vec::new();
    let mut memory = Vec::new();
    for cfg in configs {
        let base_used = used(&host)?;
        let t0 = Instant::now();
        let source = match &opts.weights {
            Some(dir) => Source::Files(dir.clone()),
            None => Source::Random(opts.seed),
        };
        bar.set_message(format!("{}: weights, kernels, cuBLASLt", cfg.name));
        let engine = Engine::new(0, cfg.clone(), &source, opts.progress)?;
        eprintln!(
            "# {}: {:.3} B params read per step, weights ready in {:.1} s",
            cfg.name,
            cfg.params_per_step() as f64 / 1e9,
            t0.elapsed().as_secs_f64()
        );
        for &context in &opts.contexts {
            bar.set_message(format!("{} C={context}: caches, plans (tuning)", cfg.name));
            let arena = Session::arena(&engine, bmax, context, &opts.batches)?;
            let mut sess = Session::new(&engine, &arena, bmax, context, &opts.batches, opts.seed)?;
            let tokens = start_tokens(&cfg, bmax, opts.seed);
            let mut peak = used(&host)?;
            for &mode in &opts.modes {
                bar.set_message(format!("{} C={context} {mode}: capture, warm-up", cfg.name));
                let (graphs, capture_ms) = match mode {
                    Mode::Graph => {
                        let t = Instant::now();
                        let g = sess.capture(&arena, 0)?;
                        (Some(g), Some(t.elapsed().as_secs_f64() * 1e3))
                    }
                    Mode::Eager => (None, None),
                };
                peak = peak.max(used(&host)?);
                for &batch in &opts.batches {
                    sess.set_inputs(&tokens, context - 1)?;
                    let steps = if mode == Mode::Graph {
                        opts.steps_graph
                    } else {
                        opts.steps_eager
                    };
                    let one = |sess: &mut Session<'_>| -> Result<()> {
                        match &graphs {
                            // SAFETY: the graphs touch the session's arena views
                            // and the engine's weights, alive, used by nothing else.
                            Some(g) => unsafe { g.replay(&engine.stream, batch)? },
                            None => {
                                sess.step(batch, 0)?;
                                batch
                            }
                        };
                        Ok(())
                    };
                    for _ in 0..opts.warmup {
                        one(&mut sess)?;
                    }
                    engine.stream.synchronize()?;
                    let mut reps = Vec::with_capacity(opts.reps);
                    for _ in 0..opts.reps {
                        let start = CudaEvent::timed(&engine.stream)?;
                        let end = CudaEvent::timed(&engine.stream)?;
                        start.record(&engine.stream)?;
                        for _ in 0..steps {
                            one(&mut sess)?;
                        }
                        end.record(&engine.stream)?;
                        end.synchronize()?;
                        reps.push(f64::from(start.elapsed_ms(&end)?) / steps as f64);
                    }
                    let profile = if opts.profile && mode == Mode::Eager {
                        profile_step(&engine, &mut sess, batch, context)?
                    } else {
                        Vec::new()
                    };
                    let row = Row {
                        model: cfg.name.clone(),
                        batch,
                        context,
                        mode,
                        ms_per_step: median(&reps),
                        ms_reps: reps,
                        bytes_per_step: cfg.step_bytes(batch, context),
                        capture_ms,
                        profile,
                        gemms: sess.plans(batch).map(|p| p.describe()).unwrap_or_default(),
                    };
                    bar.suspend(|| print_row(&row, &ceilings, None, rows.is_empty()));
                    bar.inc(1);
                    rows.push(row);
                }
                drop(graphs);
            }
            memory.push(MemoryRow {
                model: cfg.name.clone(),
                context,
                peak_bytes: (peak.max(used(&host)?)).saturating_sub(base_used) as u64,
                needed_bytes: cfg.weight_bytes()
                    + Session::arena_size(&engine, bmax, context, &opts.batches) as u64
                    + engine.blas.workspace_bytes() as u64,
            });
        }
    }
    bar.finish_and_clear();
    Ok(Report {
        device,
        driver,
        ceilings,
        rows,
        memory,
    })
}

fn used(host: &metrale_runtime::CudaHost) -> Result<usize> {
    let (free, total) = metrale_runtime::memory_info(host.ctx())?;
    Ok(total.saturating_sub(free))
}

/// Seeded start tokens, as the anchor draws its own.
fn start_tokens(cfg: &Config, n: usize, seed: u64) -> Vec<i64> {
    let mut g = crate::weights::Normal::new(seed.wrapping_add(7));
    (0..n)
        .map(|_| ((g.sample().abs() * 1e6) as u64 % cfg.vocab as u64) as i64)
        .collect()
}

/// The median (the mean of the middle two for an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// A 4 GiB copy (read + write counted) and a read-only pass, 10 each after one
/// untimed, as the anchor measures them.
pub fn measure_ceilings(s: &CudaStream, kernels: &Kernels, sms: u32) -> Result<Ceilings> {
    const N: usize = 2 << 30; // bf16 elements: 4 GiB
    const REPS: usize = 10;
    let mut a = DeviceBuffer::<bf16>::alloc(s, N)?;
    let mut b = DeviceBuffer::<bf16>::alloc(s, N)?;
    crate::weights::fill_normal(s, kernels, &mut a.slice_mut(..)?, 1, 1.0)?;
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        let (e0, e1) = (CudaEvent::timed(s)?, CudaEvent::timed(s)?);
        e0.record(s)?;
        for _ in 0..REPS {
            f()?;
        }
        e1.record(s)?;
        e1.synchronize()?;
        Ok(f64::from(e0.elapsed_ms(&e1)?) * 1e-3)
    };
    let copy_s = time(&mut || Ok(s.copy_d2d(&a, &mut b)?))?;
    let blocks = 4 * sms.max(1);
    let mut partial = DeviceBuffer::<f32>::alloc(s, blocks as usize)?;
    let cfg = LaunchConfig::new((blocks, 1, 1), (512, 1, 1), 0)?;
    let read_s = time(&mut || {
        // SAFETY: read_sum(const bf16* in, unsigned long long n, float* partial)
        // reads in[0..n) and writes partial[0..gridDim.x); both are that long.
        unsafe { s.launch(&kernels.read_sum, cfg, (&a, N as u64, &mut partial))? };
        Ok(())
    })?;
    Ok(Ceilings {
        copy_gbps: 2.0 * 2.0 * N as f64 * REPS as f64 / copy_s / 1e9,
        read_gbps: 2.0 * N as f64 * REPS as f64 / read_s / 1e9,
    })
}

/// One eager step queued behind a 20 ms wait on the GPU, with an event after
/// each operation: (operation, µs per step summed over layers, GB/s).
fn profile_step(
    engine: &Engine,
    sess: &mut Session<'_>,
    batch: usize,
    context: usize,
) -> Result<Vec<(String, f64, f64)>> {
    let s = &engine.stream;
    let mut probe = EventProbe {
        events: Vec::new(),
        used: 0,
    };
    // Make the events first, so the timed step queues only records.
    sess.step_probed(s, batch, 0, &mut probe)?;
    s.synchronize()?;
    probe.used = 0;
    let start = CudaEvent::timed(s)?;
    let one = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    // SAFETY: spin(unsigned long long ns) reads no memory.
    unsafe { s.launch(&engine.kernels.spin, one, (20_000_000u64,))? };
    start.record(s)?;
    sess.step_probed(s, batch, 0, &mut probe)?;
    s.synchronize()?;
    let mut per_op: Vec<(Op, f64)> = Op::ALL.iter().map(|&o| (o, 0.0)).collect();
    let mut prev = &start;
    for (op, ev) in &probe.events[..probe.used] {
        let us = f64::from(prev.elapsed_ms(ev)?) * 1e3;
        if let Some(slot) = per_op.iter_mut().find(|(o, _)| o == op) {
            slot.1 += us;
        }
        prev = ev;
    }
    let cfg = &engine.cfg;
    Ok(per_op
        .into_iter()
        .filter(|(_, us)| *us > 0.0)
        .map(|(op, us)| {
            let bytes = op_bytes(cfg, op, batch, context);
            (format!("{op:?}"), us, bytes as f64 / (us * 1e-6) / 1e9)
        })
        .collect())
}

/// Bytes an operation must move per step (all layers), the weights and caches
/// it reads and the activations it reads and writes.
pub fn op_bytes(cfg: &Config, op: Op, b: usize, c: usize) -> u64 {
    let (h, d, l) = (cfg.hidden as u64, cfg.head_dim as u64, cfg.layers as u64);
    let (b, c) = (b as u64, c as u64);
    let (hq, hkv, i, v) = (
        cfg.heads as u64,
        cfg.kv_heads as u64,
        cfg.ffn as u64,
        cfg.vocab as u64,
    );
    let qkv = (hq + 2 * hkv) * d;
    let gemm = |out: u64, inp: u64| 2 * (out * inp + b * (out + inp));
    let norm = 2 * (h + 2 * b * h);
    match op {
        Op::Embed => norm + 2 * b * h,
        Op::AttnNorm => (l - 1) * norm,
        Op::FfnNorm => l * norm,
        Op::FinalNorm => norm,
        Op::Qkv => l * gemm(qkv, h),
        Op::Rope => l * 2 * b * (qkv + qkv),
        Op::Attention => l * (2 * 2 * b * hkv * c * d + 4 * b * hq * d),
        Op::Combine => l * (4 * b * hq * d + 2 * b * hq * d),
        Op::O => l * (gemm(h, hq * d) + 2 * b * h),
        Op::GateUp => l * gemm(2 * i, h),
        Op::Silu => l * 2 * b * 3 * i,
        Op::Down => l * (gemm(h, i) + 2 * b * h),
        Op::LmHead => gemm(v, h),
        Op::Argmax => 2 * b * v,
    }
}

/// PyTorch's rows (its JSON), keyed by (model, batch, context, mode).
#[derive(Debug, Clone, Default)]
pub struct TorchRows {
    /// (model, batch, context, mode, ms per step).
    pub rows: Vec<(String, usize, usize, String, f64)>,
    /// Its GPU's name.
    pub gpu: String,
    /// Its measured copy and read GB/s.
    pub ceilings: Ceilings,
}

impl TorchRows {
    /// Read `torch_decode.json`.
    pub fn read(path: &std::path::Path) -> Result<TorchRows> {
        let text =
            std::fs::read_to_string(path).map_err(io(format!("reading {}", path.display())))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Invalid(format!("{}: not JSON: {e}", path.display())))?;
        let mut rows = Vec::new();
        for r in v["results"].as_array().into_iter().flatten() {
            if r["status"].as_str() != Some("ok") {
                continue;
            }
            let (Some(m), Some(b), Some(c), Some(mode), Some(ms)) = (
                r["model"].as_str(),
                r["batch"].as_u64(),
                r["context"].as_u64(),
                r["mode"].as_str(),
                r["ms_per_step"].as_f64(),
            ) else {
                continue;
            };
            rows.push((m.to_string(), b as usize, c as usize, mode.to_string(), ms));
        }
        Ok(TorchRows {
            rows,
            gpu: v["env"]["gpu"].as_str().unwrap_or("").to_string(),
            ceilings: Ceilings {
                copy_gbps: v["ceilings_measured"]["copy_gbps_read_plus_write"]
                    .as_f64()
                    .unwrap_or(0.0),
                read_gbps: v["ceilings_measured"]["read_gbps"].as_f64().unwrap_or(0.0),
            },
        })
    }

    /// PyTorch's ms per step for a row of ours.
    pub fn ms(&self, r: &Row) -> Option<f64> {
        self.rows
            .iter()
            .find(|(m, b, c, mode, _)| {
                *m == r.model && *b == r.batch && *c == r.context && *mode == r.mode.to_string()
            })
            .map(|t| t.4)
    }
}

/// Print one row (and the header first).
pub fn print_row(r: &Row, ceil: &Ceilings, torch: Option<&TorchRows>, header: bool) {
    if header {
        println!(
            "{:9} {:>3} {:>5} {:>6} {:>9} {:>10} {:>7} {:>10} {:>9} {:>10} {:>8}",
            "model",
            "B",
            "ctx",
            "mode",
            "ms/step",
            "tok/s",
            "GB/s",
            "floor ms",
            "of floor",
            "torch ms",
            "x torch"
        );
    }
    let floor_ms = r.bytes_per_step as f64 / (ceil.floor_gbps() * 1e9) * 1e3;
    let t = torch.and_then(|t| t.ms(r));
    println!(
        "{:9} {:>3} {:>5} {:>6} {:>9.4} {:>10.1} {:>7.0} {:>10.4} {:>9.3} {:>10} {:>8}",
        r.model,
        r.batch,
        r.context,
        r.mode.to_string(),
        r.ms_per_step,
        r.tokens_per_s(),
        r.achieved_gbps(),
        floor_ms,
        floor_ms / r.ms_per_step,
        t.map_or_else(|| "-".into(), |v| format!("{v:.4}")),
        t.map_or_else(|| "-".into(), |v| format!("{:.3}", v / r.ms_per_step)),
    );
}

/// The whole table, with PyTorch's rows beside ours when given, and the
/// memory and profile sections.
pub fn print_report(report: &Report, torch: Option<&TorchRows>) {
    println!(
        "\n# metrale-decode on {} (driver {}), floor at {:.0} GB/s measured (copy {:.0}, read {:.0})",
        report.device,
        report.driver,
        report.ceilings.floor_gbps(),
        report.ceilings.copy_gbps,
        report.ceilings.read_gbps
    );
    if let Some(t) = torch {
        println!(
            "# PyTorch rows from {} (its floor {:.0} GB/s)",
            t.gpu,
            t.ceilings.floor_gbps()
        );
    }
    for (i, r) in report.rows.iter().enumerate() {
        print_row(r, &report.ceilings, torch, i == 0);
    }
    println!("\n# device memory per session: peak above the level before the engine vs weights + arena + workspace");
    for m in &report.memory {
        println!(
            "{:9} ctx {:>5}: {:.2} GB peak, {:.2} GB needed, {:.3} x",
            m.model,
            m.context,
            m.peak_bytes as f64 / 1e9,
            m.needed_bytes as f64 / 1e9,
            m.peak_bytes as f64 / m.needed_bytes as f64
        );
    }
    for r in report.rows.iter().filter(|r| !r.profile.is_empty()) {
        println!(
            "\n# profile {} B={} C={} (one eager step queued behind a wait; µs per step, GB/s); {}",
            r.model, r.batch, r.context, r.gemms
        );
        for (op, us, gbps) in &r.profile {
            println!("  {op:10} {us:>9.1} µs {gbps:>7.0} GB/s");
        }
    }
}

/// The report as JSON (`bench --json`).
pub fn to_json(report: &Report, torch: Option<&TorchRows>) -> String {
    let floor = report.ceilings.floor_gbps();
    let rows: Vec<Value> = report
        .rows
        .iter()
        .map(|r| {
            let floor_ms = r.bytes_per_step as f64 / (floor * 1e9) * 1e3;
            json!({
                "model": r.model, "batch": r.batch, "context": r.context, "mode": r.mode.to_string(),
                "ms_per_step": r.ms_per_step, "ms_per_step_reps": r.ms_reps,
                "tokens_per_s": r.tokens_per_s(), "bytes_per_step": r.bytes_per_step,
                "achieved_gbps": r.achieved_gbps(), "floor_ms_measured_bw": floor_ms,
                "fraction_of_measured_floor": floor_ms / r.ms_per_step,
                "capture_ms": r.capture_ms, "gemms": r.gemms,
                "torch_ms_per_step": torch.and_then(|t| t.ms(r)),
                "profile": r.profile.iter().map(|(o, us, g)| json!([o, us, g])).collect::<Vec<_>>(),
            })
        })
        .collect();
    let memory: Vec<Value> = report
        .memory
        .iter()
        .map(|m| json!({"model": m.model, "context": m.context, "peak_bytes": m.peak_bytes, "needed_bytes": m.needed_bytes}))
        .collect();
    let doc = json!({
        "schema": "metrale.decode_bench.v1",
        "device": report.device, "driver": report.driver,
        "ceilings_measured": {"copy_gbps_read_plus_write": report.ceilings.copy_gbps, "read_gbps": report.ceilings.read_gbps},
        "results": rows, "memory": memory,
    });
    serde_json::to_string_pretty(&doc).unwrap_or_default()
}

/// Draw tokens/s per row: ours, PyTorch's (when given) and the floor's, one
/// group of bars per row, on a log scale (feature `plot`).
#[cfg(feature = "plot")]
pub fn plot(report: &Report, torch: Option<&TorchRows>, path: &std::path::Path) -> Result<()> {
    use plotters::prelude::*;
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let n = report.rows.len().max(1);
        let root = SVGBackend::new(path, (160 + 60 * n as u32, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let floor = report.ceilings.floor_gbps();
        let floor_tps = |r: &Row| r.batch as f64 * floor * 1e9 / r.bytes_per_step as f64;
        let top = report.rows.iter().map(floor_tps).fold(10.0, f64::max) * 1.5;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("metrale-decode tokens/s on {}", report.device),
                ("sans-serif", 18),
            )
            .margin(10)
            .x_label_area_size(90)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..n as f64, (50.0..top).log_scale())?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&|x| {
                report
                    .rows
                    .get(*x as usize)
                    .map(|r| {
                        format!(
                            "{} B{} C{} {}",
                            r.model.trim_start_matches("llama-"),
                            r.batch,
                            r.context,
                            r.mode
                        )
                    })
                    .unwrap_or_default()
            })
            .y_desc("tokens/s")
            .draw()?;
        let bar = |i: usize, k: usize, v: f64, color: RGBColor| {
            let x0 = i as f64 + 0.1 + 0.27 * k as f64;
            Rectangle::new([(x0, 50.0), (x0 + 0.25, v.max(50.0))], color.filled())
        };
        chart
            .draw_series(
                report
                    .rows
                    .iter()
                    .enumerate()
                    .map(|(i, r)| bar(i, 0, r.tokens_per_s(), RGBColor(0x76, 0xb9, 0x00))),
            )?
            .label("metrale-decode")
            .legend(|(x, y)| {
                Rectangle::new(
                    [(x, y - 5), (x + 10, y + 5)],
                    RGBColor(0x76, 0xb9, 0x00).filled(),
                )
            });
        if let Some(t) = torch {
            chart
                .draw_series(report.rows.iter().enumerate().filter_map(|(i, r)| {
                    t.ms(r)
                        .map(|ms| bar(i, 1, r.batch as f64 * 1e3 / ms, RGBColor(0xee, 0x4c, 0x2c)))
                }))?
                .label("PyTorch")
                .legend(|(x, y)| {
                    Rectangle::new(
                        [(x, y - 5), (x + 10, y + 5)],
                        RGBColor(0xee, 0x4c, 0x2c).filled(),
                    )
                });
        }
        chart
            .draw_series(
                report
                    .rows
                    .iter()
                    .enumerate()
                    .map(|(i, r)| bar(i, 2, floor_tps(r), RGBColor(0x99, 0x99, 0x99))),
            )?
            .label("bandwidth floor")
            .legend(|(x, y)| {
                Rectangle::new(
                    [(x, y - 5), (x + 10, y + 5)],
                    RGBColor(0x99, 0x99, 0x99).filled(),
                )
            });
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| Error::Invalid(format!("drawing {}: {e}", path.display())))
}
