//! # metrale-decode: a Llama decode engine on metrale alone
//!
//! The flagship example of metrale: one transformer decode step of a
//! Llama-style model (the step `shared/decode/STEP.md` defines), built only from
//! metrale's parts: kernels compiled at run time with NVRTC (`kernels.cu`),
//! cuBLASLt plans made once per shape, the whole step captured per batch bucket
//! into CUDA graphs over one capture arena, weights from safetensors through
//! pinned staging and batched copies, NVTX ranges per step and layer.
//!
//! Read it top to bottom:
//! - [`config`]: the model's shape (presets, `config.json`), bytes per step,
//!   RoPE tables;
//! - [`weights`]: checkpoint tensors, loading, random checkpoints;
//! - [`kernels`]: the CUDA source, its compilation, the attention split;
//! - [`gemm`]: each GEMM as a cuBLASLt plan or the batch-1 GEMV;
//! - [`step`]: the engine, a session (caches, activations, plans), the step,
//!   its capture;
//! - [`reference`](mod@reference): the same step on the host in f32, for the tests;
//! - [`bench`](mod@bench): the grid, the table, the JSON rows and the chart;
//! - the `metrale-decode` command (`init`, `generate`, `bench`).

pub mod bench;
pub mod config;
pub mod error;
pub mod gemm;
pub mod kernels;
pub mod reference;
pub mod step;
pub mod weights;

pub use config::Config;
pub use error::{Error, Result};
pub use gemm::{Gemm, Plans};
pub use step::{Engine, Session, Source};
pub use weights::Weights;

/// With `METRALE_DECODE_TRACE=1`, one line on stderr per phase of setting up
/// (kernels, weights, plans, tuning, capture): where a slow or stuck start is.
pub(crate) fn trace(what: std::fmt::Arguments<'_>) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var("METRALE_DECODE_TRACE").is_ok_and(|v| v == "1")) {
        eprintln!("metrale-decode: {what}");
    }
}

/// How a step is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Each kernel and GEMM launched on the stream.
    Eager,
    /// The step replayed from its bucket's CUDA graph.
    Graph,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Eager => "eager",
            Mode::Graph => "graph",
        })
    }
}

/// Greedy decoding of one sequence: the prompt is fed one token per step
/// (prefill as decode steps), then `steps` tokens are chosen; returns them.
/// With `logits`, every step's logits row is kept too.
pub fn generate(
    engine: &Engine,
    prompt: &[i64],
    steps: usize,
    mode: Mode,
    mut logits: Option<&mut Vec<Vec<metrale_runtime::half::bf16>>>,
) -> Result<Vec<i64>> {
    if prompt.is_empty() {
        return Err(Error::Invalid("the prompt needs at least one token".into()));
    }
    let capacity = (prompt.len() + steps).next_multiple_of(64);
    let arena = Session::arena(engine, 1, capacity, &[1])?;
    let mut sess = Session::new(engine, &arena, 1, capacity, &[1], 0)?;
    sess.set_inputs(&prompt[..1], 0)?;
    trace(format_args!("generate: session ready, {mode}"));
    let graphs = match mode {
        Mode::Graph => Some(sess.capture(&arena, 1)?),
        Mode::Eager => None,
    };
    let mut out = Vec::with_capacity(steps);
    let total = prompt.len() - 1 + steps;
    trace(format_args!("generate: {total} steps"));
    for i in 0..total {
        match &graphs {
            // SAFETY: the graph touches the session's arena views and the
            // engine's weights, both alive and used by nothing else meanwhile.
            Some(g) => unsafe { g.replay(&engine.stream, 1)? },
            None => {
                sess.step(1, 1)?;
                1
            }
        };
        if let Some(l) = logits.as_deref_mut() {
            l.push(sess.logits(1)?);
        }
        if i + 1 < prompt.len() {
            let pos = i + 1;
            sess.set_inputs(&prompt[pos..pos + 1], pos)?;
        } else {
            out.push(sess.tokens(1)?.first().copied().unwrap_or(0));
        }
    }
    engine.stream.synchronize()?;
    Ok(out)
}
