//! The model's shape: the two presets of the step's definition (`llama-1b`,
//! `llama-8b`), a `tiny` one for tests, or a Hugging Face `config.json`; the
//! bytes a step must move; the RoPE tables.
//!
//! Invariant: a [`Config`] that exists has passed [`Config::validate`], so the
//! kernels' shape rules (head size 32, 64 or 128; 1, 2, 4 or 8 query heads per
//! KV head; widths a multiple of 8) hold everywhere downstream.

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Llama-3's frequency scaling (`rope_scaling` of type `llama3`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// Divides the low frequencies.
    pub factor: f64,
    /// Wavelengths above `original / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths below `original / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context the base model was trained with.
    pub original_max_position_embeddings: f64,
}

/// A Llama-style decoder's shape and constants.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// A name for tables (`llama-8b`, or `config.json`'s folder).
    pub name: String,
    /// Hidden width H.
    pub hidden: usize,
    /// Layers L.
    pub layers: usize,
    /// Query heads Hq.
    pub heads: usize,
    /// Key and value heads Hkv.
    pub kv_heads: usize,
    /// Head size D.
    pub head_dim: usize,
    /// MLP width I.
    pub ffn: usize,
    /// Vocabulary V.
    pub vocab: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Llama-3 frequency scaling, if any.
    pub rope_scaling: Option<Llama3Scaling>,
    /// Whether `lm_head` is the embedding (Llama-3.2-1B's checkpoints).
    pub tie_embeddings: bool,
}

/// The preset names [`Config::preset`] knows.
pub const PRESETS: &[&str] = &["tiny", "llama-1b", "llama-8b"];

impl Config {
    /// One of [`PRESETS`]: the exact shapes of the step's definition, or `tiny`
    /// (H 128, 2 layers, 4 heads over 2 KV heads of 32, I 256, V 512).
    pub fn preset(name: &str) -> Result<Config> {
        let (hidden, layers, heads, kv_heads, head_dim, ffn, vocab) = match name {
            "tiny" => (128, 2, 4, 2, 32, 256, 512),
            "llama-1b" => (2048, 16, 32, 8, 64, 8192, 128_256),
            "llama-8b" => (4096, 32, 32, 8, 128, 14_336, 128_256),
            other => {
                return Err(Error::Config(format!(
                    "no preset named '{other}' (the presets are {}; or give a config.json)",
                    PRESETS.join(", ")
                )))
            }
        };
        let c = Config {
            name: name.to_string(),
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            ffn,
            vocab,
            rope_theta: 500_000.0,
            eps: 1e-5,
            rope_scaling: None,
            tie_embeddings: false,
        };
        c.validate()?;
        Ok(c)
    }

    /// A preset name, a `config.json` file, or a folder holding one.
    pub fn load(spec: &str) -> Result<Config> {
        if PRESETS.contains(&spec) {
            return Config::preset(spec);
        }
        let mut path = std::path::PathBuf::from(spec);
        if path.is_dir() {
            path.push("config.json");
        }
        let text = std::fs::read_to_string(&path)
            .map_err(crate::error::io(format!("reading {}", path.display())))?;
        let name = path
            .parent()
            .and_then(|p| p.file_name())
            .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned());
        Config::from_hf_json(&name, &text)
            .map_err(|e| Error::Config(format!("{}: {}", path.display(), strip(e))))
    }

    /// Parse a Hugging Face Llama `config.json`. Every key is either used,
    /// checked against the one value the engine implements, or known to leave
    /// the decode step unchanged; any other key is an error naming it.
    pub fn from_hf_json(name: &str, text: &str) -> Result<Config> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("config.json is not JSON: {e}")))?;
        let Value::Object(map) = v else {
            return Err(Error::Config("config.json is not a JSON object".into()));
        };
        for (key, value) in &map {
            check_key(key, value)?;
        }
        let hidden = need_usize(&map, "hidden_size")?;
        let heads = need_usize(&map, "num_attention_heads")?;
        let head_dim = match map.get("head_dim") {
            None | Some(Value::Null) => hidden.checked_div(heads).unwrap_or(0),
            Some(_) => need_usize(&map, "head_dim")?,
        };
        let c = Config {
            name: name.to_string(),
            hidden,
            layers: need_usize(&map, "num_hidden_layers")?,
            heads,
            kv_heads: match map.get("num_key_value_heads") {
                None | Some(Value::Null) => heads,
                Some(_) => need_usize(&map, "num_key_value_heads")?,
            },
            head_dim,
            ffn: need_usize(&map, "intermediate_size")?,
            vocab: need_usize(&map, "vocab_size")?,
            rope_theta: opt_f64(&map, "rope_theta")?.unwrap_or(10_000.0),
            eps: opt_f64(&map, "rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_scaling: parse_scaling(map.get("rope_scaling"))?,
            tie_embeddings: matches!(map.get("tie_word_embeddings"), Some(Value::Bool(true))),
        };
        c.validate()?;
        Ok(c)
    }

    /// The shape rules of the engine's kernels.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config(format!("{}: {why}", self.name)));
        if [
            self.hidden,
            self.layers,
            self.heads,
            self.kv_heads,
            self.ffn,
            self.vocab,
        ]
        .contains(&0)
        {
            return bad("hidden_size, layers, heads, KV heads, intermediate_size and vocab_size must all be above 0".into());
        }
        if ![32, 64, 128].contains(&self.head_dim) {
            return bad(format!(
                "head_dim {} is not supported (32, 64 or 128)",
                self.head_dim
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads)
            || ![1, 2, 4, 8].contains(&(self.heads / self.kv_heads))
        {
            return bad(format!(
                "{} query heads over {} KV heads: the group must be 1, 2, 4 or 8",
                self.heads, self.kv_heads
            ));
        }
        if !self.hidden.is_multiple_of(8) || !self.ffn.is_multiple_of(8) {
            return bad(format!(
                "hidden {} and intermediate {} must be multiples of 8 (16-byte rows)",
                self.hidden, self.ffn
            ));
        }
        if i32::try_from(self.vocab).is_err()
            || i32::try_from(self.qkv_rows().max(2 * self.ffn)).is_err()
        {
            return bad("a dimension does not fit 31 bits".into());
        }
        if !(self.rope_theta.is_finite()
            && self.rope_theta > 1.0
            && self.eps.is_finite()
            && self.eps > 0.0)
        {
            return bad(format!(
                "rope_theta {} and rms_norm_eps {} must be positive",
                self.rope_theta, self.eps
            ));
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Rows of the fused QKV weight: (Hq + 2 Hkv) D.
    pub fn qkv_rows(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Parameters a step reads: every layer, the final norm and `lm_head`
    /// (the embedding is gathered, B rows; a tied `lm_head` is counted once,
    /// as `lm_head`).
    pub fn params_per_step(&self) -> u64 {
        let (h, d) = (self.hidden as u64, self.head_dim as u64);
        let per_layer = h * self.qkv_rows() as u64
            + self.heads as u64 * d * h
            + h * 2 * self.ffn as u64
            + self.ffn as u64 * h
            + 2 * h;
        self.layers as u64 * per_layer + h + self.vocab as u64 * h
    }

    /// Bytes of every weight tensor on the device (bf16; the embedding once,
    /// and `lm_head` again unless tied).
    pub fn weight_bytes(&self) -> u64 {
        let emb = self.vocab as u64 * self.hidden as u64;
        2 * (self.params_per_step() + if self.tie_embeddings { 0 } else { emb })
    }

    /// KV cache bytes per cached token, all layers, K and V.
    pub fn kv_bytes_per_token(&self) -> u64 {
        (self.layers * 2 * self.kv_heads * self.head_dim * 2) as u64
    }

    /// The step definition's minimum bytes of one step at batch `b`, context
    /// `c`: weights once, B embedding rows, all C cached keys and values read,
    /// one slot written.
    pub fn step_bytes(&self, b: usize, c: usize) -> u64 {
        let kv_token = (self.layers * 2 * self.kv_heads * self.head_dim * 2) as u64;
        2 * self.params_per_step()
            + (b * self.hidden * 2) as u64
            + b as u64 * c as u64 * kv_token
            + b as u64 * kv_token
    }

    /// The inverse frequencies `theta^(-2i/D)`, i < D/2, with Llama-3 scaling
    /// applied when configured.
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| {
                let f = self.rope_theta.powf(-(2.0 * i as f64) / d);
                match self.rope_scaling {
                    None => f,
                    Some(s) => llama3_scale(f, s),
                }
            })
            .collect()
    }

    /// The RoPE tables for positions `0..cap`, row-major `[cap, D]` in the HF
    /// layout (`cat(freqs, freqs)`): computed in f32, stored as bf16 bits.
    pub fn rope_tables(&self, cap: usize) -> (Vec<u16>, Vec<u16>) {
        let inv = self.inv_freq();
        let d = self.head_dim;
        let mut cos = Vec::with_capacity(cap * d);
        let mut sin = Vec::with_capacity(cap * d);
        for t in 0..cap {
            for j in 0..d {
                let freq = (t as f32) * (inv[j % (d / 2)] as f32);
                cos.push(bf16_bits(freq.cos()));
                sin.push(bf16_bits(freq.sin()));
            }
        }
        (cos, sin)
    }

    /// This configuration as a Hugging Face `config.json` (what `init` writes).
    pub fn to_hf_json(&self) -> String {
        let mut m = Map::new();
        m.insert(
            "architectures".into(),
            Value::from(vec!["LlamaForCausalLM"]),
        );
        m.insert("model_type".into(), "llama".into());
        m.insert("hidden_act".into(), "silu".into());
        m.insert("hidden_size".into(), self.hidden.into());
        m.insert("intermediate_size".into(), self.ffn.into());
        m.insert("num_hidden_layers".into(), self.layers.into());
        m.insert("num_attention_heads".into(), self.heads.into());
        m.insert("num_key_value_heads".into(), self.kv_heads.into());
        m.insert("head_dim".into(), self.head_dim.into());
        m.insert("vocab_size".into(), self.vocab.into());
        m.insert("rope_theta".into(), self.rope_theta.into());
        m.insert("rms_norm_eps".into(), f64::from(self.eps).into());
        m.insert("tie_word_embeddings".into(), self.tie_embeddings.into());
        m.insert("attention_bias".into(), false.into());
        m.insert("mlp_bias".into(), false.into());
        m.insert("torch_dtype".into(), "bfloat16".into());
        m.insert(
            "rope_scaling".into(),
            match self.rope_scaling {
                None => Value::Null,
                Some(s) => serde_json::json!({
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                }),
            },
        );
        let mut text = serde_json::to_string_pretty(&Value::Object(m)).unwrap_or_default();
        text.push('\n');
        text
    }
}

/// f32 to bf16 bits, round to nearest even (NaN kept), as the kernels round.
pub fn bf16_bits(f: f32) -> u16 {
    metrale_runtime::half::bf16::from_f32(f).to_bits()
}

fn llama3_scale(freq: f64, s: Llama3Scaling) -> f64 {
    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    if wavelen < high_wavelen {
        freq
    } else if wavelen > low_wavelen {
        freq / s.factor
    } else {
        let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * freq / s.factor + smooth * freq
    }
}

/// Keys of `config.json` that leave the decode step unchanged.
const INERT_KEYS: &[&str] = &[
    "_name_or_path",
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "max_position_embeddings",
    "transformers_version",
    "use_cache",
    "attention_dropout",
];

/// Keys the engine reads.
const USED_KEYS: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rope_theta",
    "rms_norm_eps",
    "rope_scaling",
    "tie_word_embeddings",
];

fn check_key(key: &str, value: &Value) -> Result<()> {
    let only = |want: &Value| -> Result<()> {
        if value == want {
            Ok(())
        } else {
            Err(Error::Config(format!(
                "key '{key}' is {value}: the engine implements only {want}"
            )))
        }
    };
    match key {
        "model_type" => only(&Value::from("llama")),
        "hidden_act" => only(&Value::from("silu")),
        "attention_bias" | "mlp_bias" => only(&Value::from(false)),
        "pretraining_tp" => only(&Value::from(1)),
        "torch_dtype" | "dtype" => only(&Value::from("bfloat16")),
        k if USED_KEYS.contains(&k) || INERT_KEYS.contains(&k) => Ok(()),
        k => Err(Error::Config(format!(
            "key '{k}' is not supported by metrale-decode (it may change the step; \
             supported: {}; ignored as inert: {})",
            USED_KEYS.join(", "),
            INERT_KEYS.join(", ")
        ))),
    }
}

fn need_usize(map: &Map<String, Value>, key: &str) -> Result<usize> {
    match map.get(key) {
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                Error::Config(format!(
                    "key '{key}' is {v}: expected a non-negative integer"
                ))
            }),
        None => Err(Error::Config(format!("key '{key}' is missing"))),
    }
}

fn opt_f64(map: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| Error::Config(format!("key '{key}' is {v}: expected a number"))),
    }
}

fn parse_scaling(v: Option<&Value>) -> Result<Option<Llama3Scaling>> {
    let map = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(Error::Config(format!(
                "key 'rope_scaling' is {other}: expected an object or null"
            )))
        }
    };
    let kind = map.get("rope_type").or_else(|| map.get("type"));
    if kind != Some(&Value::from("llama3")) {
        return Err(Error::Config(format!(
            "rope_scaling of type {} is not supported (only 'llama3')",
            kind.map_or_else(|| "(none)".to_string(), Value::to_string)
        )));
    }
    for key in map.keys() {
        if ![
            "rope_type",
            "type",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ]
        .contains(&key.as_str())
        {
            return Err(Error::Config(format!(
                "rope_scaling key '{key}' is not supported"
            )));
        }
    }
    let get = |k: &str| -> Result<f64> {
        opt_f64(map, k)?.ok_or_else(|| Error::Config(format!("rope_scaling key '{k}' is missing")))
    };
    let s = Llama3Scaling {
        factor: get("factor")?,
        low_freq_factor: get("low_freq_factor")?,
        high_freq_factor: get("high_freq_factor")?,
        original_max_position_embeddings: get("original_max_position_embeddings")?,
    };
    if !(s.factor > 0.0
        && s.low_freq_factor > 0.0
        && s.high_freq_factor > s.low_freq_factor
        && s.original_max_position_embeddings > 0.0)
    {
        return Err(Error::Config(format!(
            "rope_scaling {s:?}: factor and low_freq_factor above 0, high_freq_factor above low_freq_factor"
        )));
    }
    Ok(Some(s))
}

/// The message of a config error without its "configuration: " prefix.
fn strip(e: Error) -> String {
    match e {
        Error::Config(s) => s,
        other => other.to_string(),
    }
}
