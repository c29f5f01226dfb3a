//! metrale-decode on the GPU: the engine against the host reference in f32
//! (`tiny` for 32 greedy steps, `llama-1b` shapes for 4), eager against graph
//! bit for bit, and a long run of graph steps with memory watched.
//!
//! Without a GPU every test is reported ignored with the reason;
//! `METRALE_REQUIRE_GPU=1` makes that a failure. NVRTC must be loadable
//! (`METRALE_LIBNVRTC_PATH`, or on the loader's path).
//!
//! # The tolerance
//!
//! The reference rounds to bf16 where the GPU stores bf16 and accumulates in
//! f32, so the two differ only in summation order (cuBLASLt's tiling and
//! split-K, the kernels' warp reductions). Each such sum can land one bf16 unit
//! in the last place apart (2^-8 relative, 0.4 %), and the residual stream
//! carries such a difference through the later layers. A logit must therefore
//! be within `0.02 + 0.02 * |ref|` of the reference (5 units in the last
//! place at the logits' scale, well above what reordering gives and far below
//! what a wrong head mapping, RoPE sign or softmax scale gives: those move
//! logits by their own size). The largest difference seen is printed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../metrale-runtime/tests/support/harness.rs"]
mod harness;

use std::process::ExitCode;

use metrale_decode::reference::{argmax, Reference};
use metrale_decode::weights::{random_host_tensor, tensor_specs, write_checkpoint, HostTensors};
use metrale_decode::{generate, Config, Engine, Mode, Session, Source};
use metrale_runtime::half::bf16;

const ATOL: f32 = 0.02;
const RTOL: f32 = 0.02;

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("metrale-decode-gpu-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Random host tensors of `cfg`, made on all cores, and the checkpoint
/// written from them.
fn checkpoint(cfg: &Config, seed: u64, std: f32, name: &str) -> (HostTensors, std::path::PathBuf) {
    let specs = tensor_specs(cfg);
    let mut made: Vec<Option<Vec<bf16>>> = vec![None; specs.len()];
    std::thread::scope(|s| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (t, part) in made.chunks_mut(specs.len().div_ceil(threads)).enumerate() {
            let specs = &specs;
            s.spawn(move || {
                let base = t * specs.len().div_ceil(threads);
                for (j, slot) in part.iter_mut().enumerate() {
                    *slot = Some(random_host_tensor(&specs[base + j], base + j, seed, std));
                }
            });
        }
    });
    let tensors: HostTensors = specs
        .iter()
        .zip(made)
        .map(|(s, m)| (s.name.clone(), m.unwrap()))
        .collect();
    let dir = tmp(name);
    write_checkpoint(cfg, &dir, 1 << 30, false, |spec, _| {
        tensors[&spec.name].clone()
    })
    .unwrap();
    (tensors, dir)
}

/// Compare the GPU's logits of each step with the reference's, and the tokens.
fn check_against_reference(
    cfg: &Config,
    tensors: &HostTensors,
    prompt: &[i64],
    steps: usize,
    logits: &[Vec<bf16>],
    tokens: &[i64],
) {
    let total = prompt.len() - 1 + steps;
    assert_eq!(logits.len(), total);
    let mut reference = Reference::new(cfg, tensors, total + 1);
    let mut next = prompt[0] as usize;
    let mut chosen = Vec::new();
    let mut worst = 0.0f32;
    for (i, gpu) in logits.iter().enumerate() {
        let want = reference.step(next, i);
        for (v, (&g, &w)) in gpu.iter().zip(&want).enumerate() {
            let g = g.to_f32();
            let diff = (g - w).abs();
            worst = worst.max(diff);
            assert!(
                diff <= ATOL + RTOL * w.abs(),
                "{} step {i} logit {v}: GPU {g}, reference {w} (difference {diff})",
                cfg.name
            );
        }
        let pick = argmax(&want);
        if i + 1 < prompt.len() {
            next = prompt[i + 1] as usize;
        } else {
            chosen.push(pick as i64);
            next = pick;
        }
    }
    assert_eq!(
        tokens,
        chosen.as_slice(),
        "{}: the GPU's tokens and the reference's",
        cfg.name
    );
    println!(
        "{}: {} steps, tokens identical, largest logit difference {worst}",
        cfg.name, total
    );
}

fn tiny_eager_graph_and_reference() {
    let cfg = Config::preset("tiny").unwrap();
    let (tensors, dir) = checkpoint(&cfg, 11, 0.02, "tiny");
    let engine = Engine::new(0, cfg.clone(), &Source::Files(dir.clone()), false).unwrap();
    let prompt = [1i64, 2, 3];
    let (mut le, mut lg) = (Vec::new(), Vec::new());
    let te = generate(&engine, &prompt, 32, Mode::Eager, Some(&mut le)).unwrap();
    let tg = generate(&engine, &prompt, 32, Mode::Graph, Some(&mut lg)).unwrap();
    assert_eq!(te.len(), 32);
    assert_eq!(te, tg, "eager and graph tokens");
    let bits = |l: &[Vec<bf16>]| l.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&le) == bits(&lg),
        "eager and graph logits are bit-identical"
    );
    check_against_reference(&cfg, &tensors, &prompt, 32, &le, &te);
    let _ = std::fs::remove_dir_all(dir);
}

fn llama_1b_shapes_against_reference() {
    let cfg = Config::preset("llama-1b").unwrap();
    let (tensors, dir) = checkpoint(&cfg, 12, 0.02, "llama1b");
    let engine = Engine::new(0, cfg.clone(), &Source::Files(dir.clone()), false).unwrap();
    let prompt = [128_000i64, 9906];
    let mut logits = Vec::new();
    let tokens = generate(&engine, &prompt, 3, Mode::Graph, Some(&mut logits)).unwrap();
    check_against_reference(&cfg, &tensors, &prompt, 3, &logits, &tokens);
    let _ = std::fs::remove_dir_all(dir);
}

fn batch_rows_are_independent_and_graph_equals_eager() {
    // Eight sequences with different tokens in one bucket: eager and graph
    // steps give bit-identical logits, and rows with equal inputs agree.
    let cfg = Config::preset("tiny").unwrap();
    let engine = Engine::new(0, cfg.clone(), &Source::Random(3), false).unwrap();
    let arena = Session::arena(&engine, 8, 128, &[1, 8]).unwrap();
    let mut sess = Session::new(&engine, &arena, 8, 128, &[1, 8], 5).unwrap();
    let tokens = [7i64, 8, 9, 7, 10, 11, 12, 13];
    sess.set_inputs(&tokens, 100).unwrap();
    sess.step(8, 0).unwrap();
    let eager = sess.logits(8).unwrap();
    let graphs = sess.capture(&arena, 0).unwrap();
    sess.set_inputs(&tokens, 100).unwrap();
    // SAFETY: the graph uses the session's views and the engine's weights, alive.
    let used = unsafe { graphs.replay(&engine.stream, 5).unwrap() };
    assert_eq!(used, 8);
    let graph = sess.logits(8).unwrap();
    assert!(eager
        .iter()
        .zip(&graph)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let v = cfg.vocab;
    // Rows 0 and 3 read the same token but different caches (seeded per row): they differ.
    assert_ne!(&eager[..v], &eager[3 * v..4 * v]);
    assert_eq!(
        sess.position().unwrap(),
        100,
        "pos_inc 0 keeps the position"
    );
    assert!(eager.iter().all(|x| x.to_f32().is_finite()));
}

fn ten_thousand_graph_steps_hold_memory() {
    let cfg = Config::preset("llama-1b").unwrap();
    let engine = Engine::new(0, cfg, &Source::Random(1), false).unwrap();
    let arena = Session::arena(&engine, 1, 512, &[1]).unwrap();
    let mut sess = Session::new(&engine, &arena, 1, 512, &[1], 1).unwrap();
    sess.set_inputs(&[1], 511).unwrap();
    let graphs = sess.capture(&arena, 0).unwrap();
    let rss = || -> u64 {
        let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        s.split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u64>().ok())
            .unwrap_or(0)
            * 4096
    };
    for _ in 0..100 {
        // SAFETY: as above.
        unsafe { graphs.replay(&engine.stream, 1).unwrap() };
    }
    engine.stream.synchronize().unwrap();
    let (dev0, host0) = (engine.device_bytes_used().unwrap(), rss());
    let t = std::time::Instant::now();
    for _ in 0..10_000 {
        // SAFETY: as above.
        unsafe { graphs.replay(&engine.stream, 1).unwrap() };
    }
    engine.stream.synchronize().unwrap();
    let secs = t.elapsed().as_secs_f64();
    let (dev1, host1) = (engine.device_bytes_used().unwrap(), rss());
    println!(
        "10,000 graph steps (llama-1b B=1 C=512) in {secs:.2} s: device {dev0} -> {dev1} bytes, host resident {host0} -> {host1} bytes"
    );
    assert_eq!(dev1, dev0, "device memory grew");
    assert!(
        host1 <= host0 + (1 << 20),
        "host memory grew by {} bytes",
        host1 - host0
    );
}

fn gate() -> Result<(), String> {
    let h = metrale_runtime::host(0).map_err(|e| format!("no CUDA GPU: {e}"))?;
    metrale_runtime::nvrtc::nvrtc_version().map_err(|e| format!("no NVRTC: {e}"))?;
    eprintln!(
        "device 0: {}, driver {}",
        h.device_name(),
        h.driver_version()
    );
    Ok(())
}

fn main() -> ExitCode {
    let tests = [
        harness::Test {
            name: "tiny_eager_graph_and_reference",
            run: tiny_eager_graph_and_reference,
        },
        harness::Test {
            name: "batch_rows_are_independent_and_graph_equals_eager",
            run: batch_rows_are_independent_and_graph_equals_eager,
        },
        harness::Test {
            name: "llama_1b_shapes_against_reference",
            run: llama_1b_shapes_against_reference,
        },
        harness::Test {
            name: "ten_thousand_graph_steps_hold_memory",
            run: ten_thousand_graph_steps_hold_memory,
        },
    ];
    let require = std::env::var("METRALE_REQUIRE_GPU").is_ok_and(|v| v == "1");
    harness::main(
        &tests,
        &[],
        gate,
        require.then_some("METRALE_REQUIRE_GPU=1"),
    )
}
