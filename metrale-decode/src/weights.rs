//! The model's weights: which tensors a checkpoint must hold (Hugging Face
//! Llama names, shapes, bf16), loading them from `.safetensors` shards into
//! fused device buffers through pinned staging and `copy_batch`, writing
//! seeded random ones (`init`), and filling random ones on the device (benches
//! without files).
//!
//! Invariant: every tensor is checked (present, bf16, its shape) before any
//! device memory is allocated, and every allocation is an owned buffer, so a
//! failed load leaves nothing allocated.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use metrale_runtime::half::bf16;
use metrale_runtime::{BatchCopy, CudaStream, DeviceBuffer, LaunchConfig, PinnedBuffer};
use safetensors::{Dtype, SafeTensors};

use crate::config::Config;
use crate::error::{io, Error, Result};
use crate::kernels::Kernels;

/// One layer's weights on the device, fused where the step reads them together.
#[derive(Debug)]
pub struct LayerWeights {
    /// `input_layernorm` `[H]`.
    pub attn_norm: DeviceBuffer<bf16>,
    /// `q_proj`, `k_proj`, `v_proj` stacked: `[(Hq + 2 Hkv) D, H]`.
    pub wqkv: DeviceBuffer<bf16>,
    /// `o_proj` `[H, Hq D]`.
    pub wo: DeviceBuffer<bf16>,
    /// `post_attention_layernorm` `[H]`.
    pub ffn_norm: DeviceBuffer<bf16>,
    /// `gate_proj`, `up_proj` stacked: `[2 I, H]`.
    pub w_gate_up: DeviceBuffer<bf16>,
    /// `down_proj` `[H, I]`.
    pub w_down: DeviceBuffer<bf16>,
}

/// Every weight of the model on the device.
#[derive(Debug)]
pub struct Weights {
    /// `embed_tokens` `[V, H]`.
    pub embed: DeviceBuffer<bf16>,
    /// The layers.
    pub layers: Vec<LayerWeights>,
    /// `norm` `[H]`.
    pub final_norm: DeviceBuffer<bf16>,
    /// `lm_head` `[V, H]`; `None` when tied to the embedding.
    pub lm_head: Option<DeviceBuffer<bf16>>,
}

impl Weights {
    /// `lm_head`, or the embedding when tied.
    pub fn lm_head(&self) -> &DeviceBuffer<bf16> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Where a checkpoint tensor lands on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The embedding.
    Embed,
    /// `lm_head`.
    LmHead,
    /// The final norm.
    FinalNorm,
    /// A layer's tensor, at an element offset of its (fused) buffer.
    Layer(usize, Part, usize),
}

/// A layer buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// `attn_norm`
    AttnNorm,
    /// `wqkv`
    Qkv,
    /// `wo`
    O,
    /// `ffn_norm`
    FfnNorm,
    /// `w_gate_up`
    GateUp,
    /// `w_down`
    Down,
}

/// One tensor a checkpoint must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Its Hugging Face name.
    pub name: String,
    /// Its shape, row-major.
    pub shape: Vec<usize>,
    /// Where it goes.
    pub slot: Slot,
}

impl TensorSpec {
    /// Elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it is a norm weight (ones in random checkpoints).
    pub fn is_norm(&self) -> bool {
        self.shape.len() == 1
    }
}

/// The tensors of `cfg`'s checkpoint, in file order (the embedding, each
/// layer, the final norm, `lm_head` unless tied).
pub fn tensor_specs(cfg: &Config) -> Vec<TensorSpec> {
    let (h, d) = (cfg.hidden, cfg.head_dim);
    let (qd, kd) = (cfg.heads * d, cfg.kv_heads * d);
    let mut v = vec![TensorSpec {
        name: "model.embed_tokens.weight".into(),
        shape: vec![cfg.vocab, h],
        slot: Slot::Embed,
    }];
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}.");
        let t = |n: &str, shape: Vec<usize>, part: Part, off: usize| TensorSpec {
            name: format!("{p}{n}.weight"),
            shape,
            slot: Slot::Layer(l, part, off),
        };
        v.push(t("input_layernorm", vec![h], Part::AttnNorm, 0));
        v.push(t("self_attn.q_proj", vec![qd, h], Part::Qkv, 0));
        v.push(t("self_attn.k_proj", vec![kd, h], Part::Qkv, qd * h));
        v.push(t("self_attn.v_proj", vec![kd, h], Part::Qkv, (qd + kd) * h));
        v.push(t("self_attn.o_proj", vec![h, qd], Part::O, 0));
        v.push(t("post_attention_layernorm", vec![h], Part::FfnNorm, 0));
        v.push(t("mlp.gate_proj", vec![cfg.ffn, h], Part::GateUp, 0));
        v.push(t(
            "mlp.up_proj",
            vec![cfg.ffn, h],
            Part::GateUp,
            cfg.ffn * h,
        ));
        v.push(t("mlp.down_proj", vec![h, cfg.ffn], Part::Down, 0));
    }
    v.push(TensorSpec {
        name: "model.norm.weight".into(),
        shape: vec![h],
        slot: Slot::FinalNorm,
    });
    if !cfg.tie_embeddings {
        v.push(TensorSpec {
            name: "lm_head.weight".into(),
            shape: vec![cfg.vocab, h],
            slot: Slot::LmHead,
        });
    }
    v
}

/// Device buffers for `cfg`, uninitialised (their contents come next).
fn allocate(stream: &CudaStream, cfg: &Config) -> Result<Weights> {
    let alloc = |n: usize| DeviceBuffer::<bf16>::alloc(stream, n).map_err(Error::from);
    let h = cfg.hidden;
    let mut layers = Vec::with_capacity(cfg.layers);
    for _ in 0..cfg.layers {
        layers.push(LayerWeights {
            attn_norm: alloc(h)?,
            wqkv: alloc(cfg.qkv_rows() * h)?,
            wo: alloc(h * cfg.heads * cfg.head_dim)?,
            ffn_norm: alloc(h)?,
            w_gate_up: alloc(2 * cfg.ffn * h)?,
            w_down: alloc(h * cfg.ffn)?,
        });
    }
    Ok(Weights {
        embed: alloc(cfg.vocab * h)?,
        layers,
        final_norm: alloc(h)?,
        lm_head: if cfg.tie_embeddings {
            None
        } else {
            Some(alloc(cfg.vocab * h)?)
        },
    })
}

impl Weights {
    /// The buffer a slot names, and the element offset in it.
    fn target(&mut self, slot: Slot) -> (&mut DeviceBuffer<bf16>, usize) {
        match slot {
            Slot::Embed => (&mut self.embed, 0),
            Slot::FinalNorm => (&mut self.final_norm, 0),
            Slot::LmHead => match self.lm_head.as_mut() {
                Some(b) => (b, 0),
                None => (&mut self.embed, 0),
            },
            Slot::Layer(l, part, off) => {
                let w = &mut self.layers[l];
                let b = match part {
                    Part::AttnNorm => &mut w.attn_norm,
                    Part::Qkv => &mut w.wqkv,
                    Part::O => &mut w.wo,
                    Part::FfnNorm => &mut w.ffn_norm,
                    Part::GateUp => &mut w.w_gate_up,
                    Part::Down => &mut w.w_down,
                };
                (b, off)
            }
        }
    }

    /// Random weights made on the device: N(0, 0.02) from `seed`, norms ones
    /// (the step definition's values; no files, for benches).
    pub fn random_on_device(
        stream: &CudaStream,
        kernels: &Kernels,
        cfg: &Config,
        seed: u64,
    ) -> Result<Weights> {
        let mut w = allocate(stream, cfg)?;
        for (i, spec) in tensor_specs(cfg).iter().enumerate() {
            let (buf, off) = w.target(spec.slot);
            let mut dst = buf.slice_mut(off..off + spec.len())?;
            if spec.is_norm() {
                stream.memset_u16(&mut dst, bf16::ONE.to_bits())?;
            } else {
                fill_normal(
                    stream,
                    kernels,
                    &mut dst,
                    seed.wrapping_add(i as u64 + 1),
                    0.02,
                )?;
            }
        }
        stream.synchronize()?;
        Ok(w)
    }

    /// Load `cfg`'s weights from the `.safetensors` files of `dir` (one or
    /// several shards). Every tensor is checked first; then each is copied
    /// into its (fused) device buffer through one pinned staging buffer and
    /// `copy_batch`, with a progress bar when `progress` is set.
    pub fn load(stream: &CudaStream, cfg: &Config, dir: &Path, progress: bool) -> Result<Weights> {
        let shards = Shards::open(dir)?;
        let specs = tensor_specs(cfg);
        let mut found = Vec::with_capacity(specs.len());
        for spec in &specs {
            found.push(shards.find(spec)?);
        }
        shards.refuse_unknown(&specs)?;

        let mut w = allocate(stream, cfg)?;
        let total: u64 = specs.iter().map(|s| 2 * s.len() as u64).sum();
        let bar = progress_bar(progress, total, "loading weights");
        const STAGING: usize = 64 << 20; // elements: 128 MiB
        const PIECE: usize = 8 << 20; // elements per pair of a batch
        let mut staging = PinnedBuffer::<bf16>::zeroed(stream, STAGING.min(max_len(&specs)))?;
        for (spec, &(shard, ref name)) in specs.iter().zip(&found) {
            let bytes = shards.bytes(shard, name)?;
            let (buf, off) = w.target(spec.slot);
            let mut done = 0;
            while done < spec.len() {
                let n = (spec.len() - done).min(staging.len());
                let src = &bytes[2 * done..2 * (done + n)];
                for (d, s) in staging[..n].iter_mut().zip(src.chunks_exact(2)) {
                    *d = bf16::from_bits(u16::from_le_bytes([s[0], s[1]]));
                }
                let mut dst = buf.slice_mut(off + done..off + done + n)?;
                let mut pieces: Vec<_> = dst.chunks_mut(PIECE).collect();
                let pairs: Vec<BatchCopy<'_>> = staging[..n]
                    .chunks(PIECE)
                    .zip(pieces.iter_mut())
                    .map(|(s, d)| BatchCopy::h2d(s, d))
                    .collect();
                stream.copy_batch(&pairs)?;
                done += n;
                bar.inc(2 * n as u64);
            }
        }
        bar.finish_and_clear();
        Ok(w)
    }
}

/// Check the checkpoint in `dir` against `cfg` (every tensor present, bf16, of
/// its shape; nothing else) without a device: what [`Weights::load`] checks
/// before it allocates.
pub fn check_checkpoint(cfg: &Config, dir: &Path) -> Result<()> {
    let shards = Shards::open(dir)?;
    let specs = tensor_specs(cfg);
    for spec in &specs {
        shards.find(spec)?;
    }
    shards.refuse_unknown(&specs)
}

/// `fill_normal` over `dst`.
pub fn fill_normal(
    stream: &CudaStream,
    kernels: &Kernels,
    dst: &mut metrale_runtime::DeviceSliceMut<'_, bf16>,
    seed: u64,
    std: f32,
) -> Result<()> {
    let n = dst.len() as u64;
    if n == 0 {
        return Ok(());
    }
    let blocks = (n.div_ceil(2).div_ceil(256)).min(65_536) as u32;
    let cfg = LaunchConfig::new((blocks, 1, 1), (256, 1, 1), 0)?;
    // SAFETY: fill_normal(bf16* out, unsigned long long n, unsigned long long seed,
    // float std) writes out[0..n); dst holds n elements.
    unsafe { stream.launch(&kernels.fill_normal, cfg, (dst, n, seed, std))? };
    Ok(())
}

fn max_len(specs: &[TensorSpec]) -> usize {
    specs.iter().map(TensorSpec::len).max().unwrap_or(1).max(1)
}

/// A progress bar over bytes, hidden when not wanted.
pub fn progress_bar(show: bool, total: u64, what: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} {eta}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_string());
    bar
}

/// The `.safetensors` files of a folder, memory-mapped, and which file holds
/// which tensor.
struct Shards {
    files: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name to (file index).
    index: BTreeMap<String, usize>,
}

impl Shards {
    fn open(dir: &Path) -> Result<Shards> {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io(format!("reading the folder {}", dir.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(Error::Weights(format!(
                "{}: no .safetensors files",
                dir.display()
            )));
        }
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for (i, path) in paths.into_iter().enumerate() {
            let file =
                std::fs::File::open(&path).map_err(io(format!("opening {}", path.display())))?;
            // SAFETY: the mapping is read-only and private to this process; the
            // checkpoint is not expected to change while it loads (a file
            // truncated meanwhile can fault, as with every mmap reader).
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(io(format!("mapping {}", path.display())))?;
            let names = SafeTensors::deserialize(&map)
                .map_err(|e| {
                    Error::Weights(format!("{}: not a safetensors file: {e}", path.display()))
                })?
                .names()
                .into_iter()
                .map(str::to_string)
                .collect::<Vec<_>>();
            for name in names {
                if let Some(other) = index.insert(name.clone(), i) {
                    return Err(Error::Weights(format!(
                        "tensor {name} is in both {} and {}",
                        files_path(&files, other),
                        path.display()
                    )));
                }
            }
            files.push((path, map));
        }
        Ok(Shards { files, index })
    }

    fn tensors(&self, file: usize) -> Result<SafeTensors<'_>> {
        let (path, map) = &self.files[file];
        SafeTensors::deserialize(map)
            .map_err(|e| Error::Weights(format!("{}: not a safetensors file: {e}", path.display())))
    }

    /// Which file holds `spec`, checked for dtype and shape.
    fn find(&self, spec: &TensorSpec) -> Result<(usize, String)> {
        let Some(&file) = self.index.get(&spec.name) else {
            return Err(Error::Weights(format!(
                "tensor {} is missing (expected bf16 {:?}; the files hold {} tensors)",
                spec.name,
                spec.shape,
                self.index.len()
            )));
        };
        let tensors = self.tensors(file)?;
        let view = tensors.tensor(&spec.name).map_err(|e| {
            Error::Weights(format!(
                "{}: {}: {e}",
                self.files[file].0.display(),
                spec.name
            ))
        })?;
        if view.dtype() != Dtype::BF16 || view.shape() != spec.shape.as_slice() {
            return Err(Error::Weights(format!(
                "{}: tensor {}: expected bf16 {:?}, found {:?} {:?}",
                self.files[file].0.display(),
                spec.name,
                spec.shape,
                view.dtype(),
                view.shape()
            )));
        }
        Ok((file, spec.name.clone()))
    }

    /// Any tensor the model does not use is an error (a checkpoint of another
    /// architecture), except RoPE's `inv_freq`, which is computed.
    fn refuse_unknown(&self, specs: &[TensorSpec]) -> Result<()> {
        for (name, &file) in &self.index {
            if name.ends_with("rotary_emb.inv_freq") || specs.iter().any(|s| &s.name == name) {
                continue;
            }
            return Err(Error::Weights(format!(
                "{}: tensor {name} is not part of a Llama model of this configuration",
                self.files[file].0.display()
            )));
        }
        Ok(())
    }

    fn bytes(&self, file: usize, name: &str) -> Result<&[u8]> {
        let (path, map) = &self.files[file];
        let tensors = SafeTensors::deserialize(map)
            .map_err(|e| Error::Weights(format!("{}: {e}", path.display())))?;
        let view = tensors
            .tensor(name)
            .map_err(|e| Error::Weights(format!("{}: {name}: {e}", path.display())))?;
        // The view's bytes borrow the map itself, not the parsed header.
        Ok(view.data())
    }
}

fn files_path(files: &[(PathBuf, memmap2::Mmap)], i: usize) -> String {
    files
        .get(i)
        .map_or_else(String::new, |(p, _)| p.display().to_string())
}

/// A small, fast, seeded generator of N(0, std^2) values (splitmix64 and
/// Box-Muller): the host side of `init` and of the tests' reference weights.
#[derive(Debug, Clone)]
pub struct Normal {
    state: u64,
    spare: Option<f32>,
}

impl Normal {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Normal {
        Normal {
            state: seed ^ 0x6a09_e667_f3bc_c909,
            spare: None,
        }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The next N(0, 1) value.
    pub fn sample(&mut self) -> f32 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let r = self.next_u64();
        let u1 = ((r >> 40) as f32 + 1.0) / 16_777_217.0;
        let u2 = ((r >> 16) & 0xff_ffff) as f32 / 16_777_216.0;
        let rad = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        self.spare = Some(rad * s);
        rad * c
    }
}

/// Host copies of a checkpoint's tensors (bf16), by name: what `init` writes
/// and the tests' reference reads.
pub type HostTensors = BTreeMap<String, Vec<bf16>>;

/// Seeded random tensors for `cfg`: N(0, `std`^2), norms ones. The seed of
/// each tensor is derived from `seed` and its index, so they are independent.
pub fn random_host_tensor(spec: &TensorSpec, index: usize, seed: u64, std: f32) -> Vec<bf16> {
    if spec.is_norm() {
        return vec![bf16::ONE; spec.len()];
    }
    let mut g = Normal::new(seed.wrapping_mul(1_000_003).wrapping_add(index as u64));
    (0..spec.len())
        .map(|_| bf16::from_f32(g.sample() * std))
        .collect()
}

/// All of `cfg`'s tensors, random (see [`random_host_tensor`]).
pub fn random_host_tensors(cfg: &Config, seed: u64, std: f32) -> HostTensors {
    tensor_specs(cfg)
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.clone(), random_host_tensor(s, i, seed, std)))
        .collect()
}

/// Write a checkpoint for `cfg` into `dir`: `config.json` and shards of at
/// most `shard_bytes` each (`model-00001-of-0000N.safetensors`), tensors made
/// by `make(spec, index)` one shard at a time, so memory stays near one shard.
pub fn write_checkpoint(
    cfg: &Config,
    dir: &Path,
    shard_bytes: u64,
    progress: bool,
    mut make: impl FnMut(&TensorSpec, usize) -> Vec<bf16>,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, cfg.to_hf_json())
        .map_err(io(format!("writing {}", config_path.display())))?;
    let specs = tensor_specs(cfg);
    // Group tensors into shards by size, in order.
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, s) in specs.iter().enumerate() {
        let b = 2 * s.len() as u64;
        if size + b > shard_bytes && !groups.last().is_some_and(Vec::is_empty) {
            groups.push(Vec::new());
            size = 0;
        }
        size += b;
        if let Some(g) = groups.last_mut() {
            g.push(i);
        }
    }
    let total: u64 = specs.iter().map(|s| 2 * s.len() as u64).sum();
    let bar = progress_bar(progress, total, "writing weights");
    let mut written = Vec::new();
    let n = groups.len();
    for (gi, group) in groups.iter().enumerate() {
        let data: Vec<(usize, Vec<u8>)> = group
            .iter()
            .map(|&i| {
                let values = make(&specs[i], i);
                let bytes = values
                    .iter()
                    .flat_map(|v| v.to_bits().to_le_bytes())
                    .collect();
                bar.inc(2 * specs[i].len() as u64);
                (i, bytes)
            })
            .collect();
        let mut views = Vec::with_capacity(data.len());
        for (i, bytes) in &data {
            let view =
                safetensors::tensor::TensorView::new(Dtype::BF16, specs[*i].shape.clone(), bytes)
                    .map_err(|e| Error::Weights(format!("tensor {}: {e}", specs[*i].name)))?;
            views.push((specs[*i].name.clone(), view));
        }
        let path = dir.join(format!("model-{:05}-of-{n:05}.safetensors", gi + 1));
        safetensors::serialize_to_file(views, None, &path)
            .map_err(|e| Error::Weights(format!("writing {}: {e}", path.display())))?;
        written.push(path);
    }
    bar.finish_and_clear();
    Ok(written)
}
