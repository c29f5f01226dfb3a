//! CPU tests of metrale-decode (CI): configuration parsing, the checkpoint
//! checks (every refusal), the shape and plan bookkeeping, the attention split,
//! the host reference's invariants, and the kernels compiling with the real
//! NVRTC (ignored without it; `.ci/run` runs it with the pinned wheel).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use metrale_decode::bench::{median, op_bytes};
use metrale_decode::config::{Config, PRESETS};
use metrale_decode::kernels::{Split, ATTN_MAX_SPLIT};
use metrale_decode::reference::{argmax, Reference};
use metrale_decode::step::Op;
use metrale_decode::weights::{random_host_tensors, tensor_specs, write_checkpoint, Slot};
use metrale_decode::Error;
use metrale_runtime::half::bf16;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("metrale-decode-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

const LLAMA31_8B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256
}"#;

#[test]
fn presets_have_the_step_definitions_shapes() {
    let one = Config::preset("llama-1b").unwrap();
    let eight = Config::preset("llama-8b").unwrap();
    // The parameter counts of the step definition's table.
    assert_eq!(one.params_per_step(), 1_235_814_400);
    assert_eq!(eight.params_per_step(), 7_504_924_672);
    assert_eq!(one.kv_bytes_per_token(), 32 << 10);
    assert_eq!(eight.kv_bytes_per_token(), 128 << 10);
    // Its bytes column: llama-8b B=64 C=2048 total 32.1986 GB.
    let b = eight.step_bytes(64, 2048) as f64 / 1e9;
    assert!((b - 32.1986).abs() < 1e-3, "{b}");
    let b = one.step_bytes(1, 512) as f64 / 1e9;
    assert!((b - 2.4884).abs() < 1e-3, "{b}");
    for p in PRESETS {
        Config::preset(p).unwrap().validate().unwrap();
    }
    assert!(matches!(Config::preset("llama-70b"), Err(Error::Config(_))));
}

#[test]
fn a_real_llama31_config_parses_with_its_scaling() {
    let c = Config::from_hf_json("llama-3.1-8b", LLAMA31_8B).unwrap();
    let eight = Config::preset("llama-8b").unwrap();
    assert_eq!(
        (c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab),
        (4096, 32, 32, 8, 128, 14336, 128256)
    );
    assert_eq!(c.params_per_step(), eight.params_per_step());
    let s = c.rope_scaling.unwrap();
    assert_eq!(
        (
            s.factor,
            s.low_freq_factor,
            s.high_freq_factor,
            s.original_max_position_embeddings
        ),
        (8.0, 1.0, 4.0, 8192.0)
    );
    // Llama-3 scaling: the highest frequency is kept, the lowest divided by 8.
    let plain = eight.inv_freq();
    let scaled = c.inv_freq();
    assert_eq!(scaled[0], plain[0]);
    let last = plain.len() - 1;
    assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-15 * plain[last].abs().max(1.0));
    // A middle frequency is between the two.
    let mid = (0..plain.len())
        .find(|&i| scaled[i] != plain[i] && (scaled[i] - plain[i] / 8.0).abs() > 1e-12)
        .unwrap();
    assert!(scaled[mid] < plain[mid] && scaled[mid] > plain[mid] / 8.0);
    // The round trip through what init writes.
    let back = Config::from_hf_json("llama-3.1-8b", &c.to_hf_json()).unwrap();
    assert_eq!(back, c);
}

#[test]
fn config_keys_the_engine_does_not_implement_are_refused_by_name() {
    let with = |k: &str, v: &str| {
        LLAMA31_8B.replacen(
            "\"use_cache\": true",
            &format!("\"use_cache\": true, \"{k}\": {v}"),
            1,
        )
    };
    for (k, v, says) in [
        ("sliding_window", "4096", "sliding_window"),
        ("quantization_config", "{}", "quantization_config"),
    ] {
        let e = Config::from_hf_json("m", &with(k, v))
            .unwrap_err()
            .to_string();
        assert!(e.contains(says) && e.contains("not supported"), "{e}");
    }
    for (from, to, says) in [
        (
            "\"hidden_act\": \"silu\"",
            "\"hidden_act\": \"gelu\"",
            "hidden_act",
        ),
        (
            "\"attention_bias\": false",
            "\"attention_bias\": true",
            "attention_bias",
        ),
        (
            "\"model_type\": \"llama\"",
            "\"model_type\": \"mistral\"",
            "model_type",
        ),
        (
            "\"torch_dtype\": \"bfloat16\"",
            "\"torch_dtype\": \"float32\"",
            "torch_dtype",
        ),
        (
            "\"rope_type\": \"llama3\"",
            "\"rope_type\": \"yarn\"",
            "yarn",
        ),
        (
            "\"num_key_value_heads\": 8",
            "\"num_key_value_heads\": 3",
            "group",
        ),
        (
            "\"hidden_size\": 4096",
            "\"hidden_size\": 4100",
            "multiples of 8",
        ),
        ("\"vocab_size\": 128256", "\"vocab_size\": -1", "vocab_size"),
    ] {
        let text = LLAMA31_8B.replacen(from, to, 1);
        assert_ne!(text, LLAMA31_8B, "{from}");
        let e = Config::from_hf_json("m", &text).unwrap_err().to_string();
        assert!(e.contains(says), "{from} -> {e}");
    }
    let e = Config::from_hf_json("m", "[1]").unwrap_err().to_string();
    assert!(e.contains("not a JSON object"), "{e}");
    let e = Config::from_hf_json("m", "{\"hidden_size\": 64}")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("num_attention_heads") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn tensor_specs_fuse_qkv_and_gate_up_in_order() {
    let c = Config::preset("tiny").unwrap();
    let specs = tensor_specs(&c);
    assert_eq!(specs.len(), 1 + 9 * c.layers + 2);
    let find = |n: &str| specs.iter().find(|s| s.name == n).unwrap();
    let (h, d) = (c.hidden, c.head_dim);
    assert_eq!(
        find("model.layers.1.self_attn.k_proj.weight").slot,
        Slot::Layer(1, metrale_decode::weights::Part::Qkv, c.heads * d * h)
    );
    assert_eq!(
        find("model.layers.0.self_attn.v_proj.weight").slot,
        Slot::Layer(
            0,
            metrale_decode::weights::Part::Qkv,
            (c.heads + c.kv_heads) * d * h
        )
    );
    assert_eq!(
        find("model.layers.0.mlp.up_proj.weight").slot,
        Slot::Layer(0, metrale_decode::weights::Part::GateUp, c.ffn * h)
    );
    // The parts of each fused buffer tile it exactly.
    let qkv: usize = specs
        .iter()
        .filter(|s| {
            matches!(
                s.slot,
                Slot::Layer(0, metrale_decode::weights::Part::Qkv, _)
            )
        })
        .map(|s| s.len())
        .sum();
    assert_eq!(qkv, c.qkv_rows() * h);
    let mut tied = c.clone();
    tied.tie_embeddings = true;
    assert!(tensor_specs(&tied)
        .iter()
        .all(|s| s.name != "lm_head.weight"));
    // Every parameter the step reads is a tensor.
    let n: u64 = specs
        .iter()
        .filter(|s| s.slot != Slot::Embed)
        .map(|s| s.len() as u64)
        .sum();
    assert_eq!(n, c.params_per_step());
}

/// A checkpoint written by `init`'s code, then damaged one way each.
#[test]
fn checkpoint_refusals_name_the_tensor_the_file_and_what_was_expected() {
    let c = Config::preset("tiny").unwrap();
    let dir = tmp("refusals");
    let files = write_checkpoint(&c, &dir, 200_000, false, |s, i| {
        metrale_decode::weights::random_host_tensor(s, i, 3, 0.02)
    })
    .unwrap();
    assert!(files.len() > 1, "several shards: {files:?}");
    let back = Config::load(dir.to_str().unwrap()).unwrap();
    assert_eq!(
        (back.hidden, back.layers, back.vocab),
        (c.hidden, c.layers, c.vocab)
    );
    check_only(&c, &dir).unwrap();
    // Missing tensor.
    let broken = tmp("missing");
    write_checkpoint(&c, &broken, 1 << 30, false, |s, i| {
        metrale_decode::weights::random_host_tensor(s, i, 3, 0.02)
    })
    .unwrap();
    rewrite(&broken, |name, shape| {
        if name == "model.layers.1.mlp.up_proj.weight" {
            None
        } else {
            Some(shape)
        }
    });
    let e = check_only(&c, &broken).unwrap_err().to_string();
    assert!(
        e.contains("model.layers.1.mlp.up_proj.weight")
            && e.contains("missing")
            && e.contains("[256, 128]"),
        "{e}"
    );
    // Wrong shape.
    rewrite_fresh(&c, &broken, |name, shape| {
        if name == "model.layers.0.self_attn.k_proj.weight" {
            Some(vec![shape[0] + 1, shape[1]])
        } else {
            Some(shape)
        }
    });
    let e = check_only(&c, &broken).unwrap_err().to_string();
    assert!(
        e.contains("model.layers.0.self_attn.k_proj.weight")
            && e.contains("expected bf16 [64, 128]")
            && e.contains("[65, 128]")
            && e.contains(".safetensors"),
        "{e}"
    );
    // Wrong dtype.
    let f = broken.join("model-00001-of-00001.safetensors");
    write_checkpoint(&c, &broken, 1 << 30, false, |s, i| {
        metrale_decode::weights::random_host_tensor(s, i, 3, 0.02)
    })
    .unwrap();
    retype(&f, "model.norm.weight");
    let e = check_only(&c, &broken).unwrap_err().to_string();
    assert!(e.contains("model.norm.weight") && e.contains("F16"), "{e}");
    // A tensor of another architecture.
    write_checkpoint(&c, &broken, 1 << 30, false, |s, i| {
        metrale_decode::weights::random_host_tensor(s, i, 3, 0.02)
    })
    .unwrap();
    add_tensor(&f, "model.layers.0.self_attn.q_norm.weight");
    let e = check_only(&c, &broken).unwrap_err().to_string();
    assert!(e.contains("q_norm") && e.contains("not part of"), "{e}");
    // Not a safetensors file; no files at all.
    std::fs::write(&f, b"garbage").unwrap();
    let e = check_only(&c, &broken).unwrap_err().to_string();
    assert!(e.contains("not a safetensors file"), "{e}");
    let empty = tmp("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = check_only(&c, &empty).unwrap_err().to_string();
    assert!(e.contains("no .safetensors files"), "{e}");
    for d in [dir, broken, empty] {
        let _ = std::fs::remove_dir_all(d);
    }
}

fn check_only(c: &Config, dir: &std::path::Path) -> metrale_decode::Result<()> {
    metrale_decode::weights::check_checkpoint(c, dir)
}

/// Rewrite the one shard of `dir` with each tensor's shape changed (or the
/// tensor dropped) by `f`, values zero.
fn rewrite(dir: &std::path::Path, f: impl Fn(&str, Vec<usize>) -> Option<Vec<usize>>) {
    let path = dir.join("model-00001-of-00001.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if let Some(shape) = f(&name, view.shape().to_vec()) {
            let n: usize = shape.iter().product();
            out.push((name, shape, vec![0u8; 2 * n]));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = out
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn rewrite_fresh(
    c: &Config,
    dir: &std::path::Path,
    f: impl Fn(&str, Vec<usize>) -> Option<Vec<usize>>,
) {
    write_checkpoint(c, dir, 1 << 30, false, |s, i| {
        metrale_decode::weights::random_host_tensor(s, i, 3, 0.02)
    })
    .unwrap();
    rewrite(dir, f);
}

fn retype(path: &std::path::Path, which: &str) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let dt = if n == which {
                safetensors::Dtype::F16
            } else {
                v.dtype()
            };
            (n, dt, v.shape().to_vec(), v.data().to_vec())
        })
        .collect();
    let views: Vec<_> = owned
        .iter()
        .map(|(n, dt, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, s.clone(), d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn add_tensor(path: &std::path::Path, name: &str) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    owned.push((name.to_string(), vec![4], vec![0u8; 8]));
    let views: Vec<_> = owned
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn the_attention_split_covers_the_capacity_and_fills_the_gpu() {
    for (b, cap) in [
        (1, 512),
        (1, 2048),
        (8, 2048),
        (64, 512),
        (64, 2048),
        (3, 100),
        (1, 1),
        (1, 100_000),
    ] {
        let s = Split::choose(b, 8, cap, 132);
        assert!(
            s.split_len.is_multiple_of(32) && s.split_len >= 32 && s.split_len <= ATTN_MAX_SPLIT,
            "{b} {cap} {s:?}"
        );
        assert!(
            s.split_len * s.nsplit >= cap && s.split_len * (s.nsplit - 1) < cap,
            "{b} {cap} {s:?}"
        );
        if cap >= 64 * 33 {
            assert!(b * 8 * s.nsplit >= 132, "fills 132 SMs: {b} {cap} {s:?}");
        }
    }
}

#[test]
fn op_bytes_add_up_to_about_the_step_bytes() {
    for name in ["llama-1b", "llama-8b"] {
        let c = Config::preset(name).unwrap();
        for (b, ctx) in [(1, 512), (64, 2048)] {
            let sum: u64 = Op::ALL.iter().map(|&o| op_bytes(&c, o, b, ctx)).sum();
            let step = c.step_bytes(b, ctx);
            assert!(
                sum >= step && (sum as f64) < step as f64 * 1.1,
                "{name} {b} {ctx}: {sum} vs {step}"
            );
        }
    }
    assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
}

#[test]
fn the_reference_attends_its_past_and_is_deterministic() {
    let c = Config::preset("tiny").unwrap();
    let w = random_host_tensors(&c, 5, 0.02);
    let mut a = Reference::new(&c, &w, 64);
    let mut b = Reference::new(&c, &w, 64);
    let la: Vec<Vec<f32>> = (0..4).map(|p| a.step(p + 1, p)).collect();
    let lb: Vec<Vec<f32>> = (0..4).map(|p| b.step(p + 1, p)).collect();
    assert_eq!(la, lb);
    assert!(la.iter().flatten().all(|v| v.is_finite()));
    // Every logit is a bf16 value.
    assert!(la
        .iter()
        .flatten()
        .all(|&v| bf16::from_f32(v).to_f32() == v));
    // The same token at the same position after another history differs.
    let mut d = Reference::new(&c, &w, 64);
    d.step(9, 0);
    d.step(9, 1);
    d.step(9, 2);
    assert_ne!(d.step(4, 3), la[3]);
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
}

/// Needs NVRTC: `.ci/run` runs it with the pinned wheel's library
/// (`--include-ignored`, `METRALE_LIBNVRTC_PATH`).
#[test]
#[ignore = "needs NVRTC (METRALE_LIBNVRTC_PATH); .ci/run runs it with the pinned wheel"]
fn the_kernels_compile_with_nvrtc() {
    let out = metrale_decode::kernels::program()
        .compile(metrale_runtime::nvrtc::Target::Sm(90))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(out.cubin().is_some_and(|c| c.len() > 10_000));
    assert!(!out.log().contains("warning"), "{}", out.log());
    for name in [
        "embed_rmsnorm",
        "rmsnorm",
        "rope_append",
        "attn_d128_g4",
        "attn_d64_g4",
        "attn_d32_g2",
        "attn_combine",
        "silu_mul",
        "argmax_rows",
        "fill_normal",
    ] {
        let cubin = out.cubin().unwrap_or_default();
        assert!(
            cubin.windows(name.len()).any(|w| w == name.as_bytes()),
            "{name} is in the cubin"
        );
    }
}
