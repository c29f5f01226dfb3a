//! The decode step on the host, in f32, for one sequence: the tests' reference.
//!
//! It rounds to bf16 exactly where the GPU stores bf16 (the residual stream,
//! normed inputs, GEMM outputs, rotated heads, the caches, the attention
//! output, the SiLU product, the logits) and accumulates in f32 as the GPU
//! does, so the two differ only by summation order: a bf16 value may land one
//! unit in the last place apart, and such differences pass through later
//! layers. The tests' tolerance (in `tests/gpu.rs`) is set from that.

use metrale_runtime::half::bf16;

use crate::config::Config;
use crate::weights::{tensor_specs, HostTensors, Part, Slot};

fn r(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// One layer's weights as f32, fused as on the device.
struct Layer {
    attn_norm: Vec<f32>,
    wqkv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    w_gate_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// The host model and its caches.
pub struct Reference {
    cfg: Config,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    lm_head: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// Per layer: K and V, `[capacity, Hkv, D]`.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
    capacity: usize,
}

impl std::fmt::Debug for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reference")
            .field("cfg", &self.cfg.name)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl Reference {
    /// The reference of `cfg` with `tensors` (every tensor of
    /// [`tensor_specs`]), for positions `0..capacity`.
    ///
    /// A missing tensor is taken as zeros, a short one is zero-padded; a
    /// capacity of 0 is taken as 1.
    pub fn new(cfg: &Config, tensors: &HostTensors, capacity: usize) -> Reference {
        let capacity = capacity.max(1);
        let h = cfg.hidden;
        let zeros = |n: usize| vec![0.0f32; n];
        let mut layers: Vec<Layer> = (0..cfg.layers)
            .map(|_| Layer {
                attn_norm: zeros(h),
                wqkv: zeros(cfg.qkv_rows() * h),
                wo: zeros(h * cfg.heads * cfg.head_dim),
                ffn_norm: zeros(h),
                w_gate_up: zeros(2 * cfg.ffn * h),
                w_down: zeros(h * cfg.ffn),
            })
            .collect();
        let mut embed = zeros(cfg.vocab * h);
        let mut final_norm = zeros(h);
        let mut lm_head = zeros(if cfg.tie_embeddings { 0 } else { cfg.vocab * h });
        for spec in tensor_specs(cfg) {
            let Some(src) = tensors.get(&spec.name) else {
                continue;
            };
            let (dst, off): (&mut Vec<f32>, usize) = match spec.slot {
                Slot::Embed => (&mut embed, 0),
                Slot::FinalNorm => (&mut final_norm, 0),
                Slot::LmHead => (&mut lm_head, 0),
                Slot::Layer(l, part, off) => {
                    let w = &mut layers[l];
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
            };
            for (d, s) in dst[off..].iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
        if cfg.tie_embeddings {
            lm_head = embed.clone();
        }
        let (cos, sin) = cfg.rope_tables(capacity);
        let f = |v: Vec<u16>| {
            v.into_iter()
                .map(|b| bf16::from_bits(b).to_f32())
                .collect::<Vec<_>>()
        };
        let kv_len = capacity * cfg.kv_heads * cfg.head_dim;
        Reference {
            cfg: cfg.clone(),
            embed,
            layers,
            final_norm,
            lm_head,
            cos: f(cos),
            sin: f(sin),
            kv: (0..cfg.layers)
                .map(|_| (zeros(kv_len), zeros(kv_len)))
                .collect(),
            capacity,
        }
    }

    /// One step: `token` at position `pos` (< capacity), attending positions
    /// `0..=pos`; returns the logits (bf16 values as f32).
    pub fn step(&mut self, token: usize, pos: usize) -> Vec<f32> {
        let c = self.cfg.clone();
        let (h, d, hq, hkv) = (c.hidden, c.head_dim, c.heads, c.kv_heads);
        let g = c.group();
        let pos = pos.min(self.capacity - 1);
        let token = if token < c.vocab { token } else { 0 };
        let mut x: Vec<f32> = self.embed[token * h..(token + 1) * h].to_vec();
        let scale = 1.0 / (d as f32).sqrt();
        for l in 0..c.layers {
            let lw = &self.layers[l];
            let hn = rmsnorm(&x, &lw.attn_norm, c.eps);
            let qkv: Vec<f32> = matvec(&lw.wqkv, &hn, c.qkv_rows())
                .into_iter()
                .map(r)
                .collect();
            // RoPE on q and k heads.
            let half = d / 2;
            let (cs, sn) = (
                &self.cos[pos * d..(pos + 1) * d],
                &self.sin[pos * d..(pos + 1) * d],
            );
            let mut rot = vec![0.0f32; (hq + hkv) * d];
            for head in 0..hq + hkv {
                for i in 0..half {
                    let (x1, x2) = (qkv[head * d + i], qkv[head * d + i + half]);
                    rot[head * d + i] = r(x1 * cs[i] - x2 * sn[i]);
                    rot[head * d + i + half] = r(x2 * cs[i + half] + x1 * sn[i + half]);
                }
            }
            let (kc, vc) = &mut self.kv[l];
            for kh in 0..hkv {
                let at = (pos * hkv + kh) * d;
                kc[at..at + d].copy_from_slice(&rot[(hq + kh) * d..(hq + kh + 1) * d]);
                vc[at..at + d].copy_from_slice(&qkv[(hq + hkv + kh) * d..(hq + hkv + kh + 1) * d]);
            }
            // Attention over 0..=pos.
            let mut o = vec![0.0f32; hq * d];
            for qh in 0..hq {
                let kh = qh / g;
                let q = &rot[qh * d..(qh + 1) * d];
                let scores: Vec<f32> = (0..=pos)
                    .map(|t| {
                        let k = &kc[(t * hkv + kh) * d..(t * hkv + kh + 1) * d];
                        q.iter().zip(k).map(|(a, b)| a * scale * b).sum::<f32>()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let p: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f32 = p.iter().sum();
                for e in 0..d {
                    let acc: f32 = (0..=pos).map(|t| p[t] * vc[(t * hkv + kh) * d + e]).sum();
                    o[qh * d + e] = r(acc / sum);
                }
            }
            let delta = matvec(&lw.wo, &o, h);
            for (xi, di) in x.iter_mut().zip(&delta) {
                *xi = r(*xi + di);
            }
            let hn = rmsnorm(&x, &lw.ffn_norm, c.eps);
            let gu: Vec<f32> = matvec(&lw.w_gate_up, &hn, 2 * c.ffn)
                .into_iter()
                .map(r)
                .collect();
            let act: Vec<f32> = (0..c.ffn)
                .map(|i| {
                    let gi = gu[i];
                    r(gi / (1.0 + (-gi).exp()) * gu[c.ffn + i])
                })
                .collect();
            let delta = matvec(&lw.w_down, &act, h);
            for (xi, di) in x.iter_mut().zip(&delta) {
                *xi = r(*xi + di);
            }
        }
        let hn = rmsnorm(&x, &self.final_norm, c.eps);
        matvec(&self.lm_head, &hn, c.vocab)
            .into_iter()
            .map(r)
            .collect()
    }
}

/// The greedy choice: the largest value, ties to the lowest index.
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let rs = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| r(v * rs * g)).collect()
}

/// `W x` for W [rows, x.len()] row-major, rows split over the host's threads.
fn matvec(w: &[f32], x: &[f32], rows: usize) -> Vec<f32> {
    let n = x.len();
    let mut out = vec![0.0f32; rows];
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(32);
    let chunk = rows.div_ceil(threads).max(64);
    std::thread::scope(|scope| {
        for (ci, part) in out.chunks_mut(chunk).enumerate() {
            scope.spawn(move || {
                for (j, o) in part.iter_mut().enumerate() {
                    let row = ci * chunk + j;
                    let wr = &w[row * n..(row + 1) * n];
                    *o = wr.iter().zip(x).map(|(a, b)| a * b).sum();
                }
            });
        }
    });
    out
}
