//! Issue 34: a bucketed decode step (64 `empty` kernels over an arena buffer)
//! for a batch of 5 (the bucket of 8, of buckets 1..64), launched eagerly and
//! replayed through `GraphBuckets` (one graph launch and the arena's keeper),
//! each waited (wall µs per step); rounds alternate which goes first.

use crate::common::{header, line, ratios, time, Row};
use metrale_runtime::{
    CaptureArena, CudaFunction, CudaStream, GraphBuckets, LaunchConfig, MetraleError,
};

const KERNELS: usize = 64;

pub fn run(s: &CudaStream, f: &CudaFunction, rounds: usize) -> Result<(), MetraleError> {
    let arena = CaptureArena::new(s, 1 << 20)?;
    let buf = arena.take::<f32>(64 * 256)?;
    let view = buf.slice(..)?;
    let step = |s: &CudaStream, size: usize| -> Result<(), MetraleError> {
        let cfg = LaunchConfig::new((size as u32, 1, 1), (32, 1, 1), 0)?;
        for _ in 0..KERNELS {
            // SAFETY: empty(float*, unsigned, float) does nothing with its arguments.
            unsafe { s.launch(f, cfg, (&view, 7u32, 1.5f32))? };
        }
        Ok(())
    };
    let buckets = GraphBuckets::capture(s, &arena, &[1, 2, 4, 8, 16, 32, 64], step)?;
    let (mut eager, mut graph) = (Row::default(), Row::default());
    for round in 0..rounds + 1 {
        for k in if round % 2 == 0 { [0, 1] } else { [1, 0] } {
            let t = if k == 0 {
                time(|| {
                    step(s, 8).unwrap();
                    s.synchronize().unwrap();
                })
            } else {
                time(|| {
                    // SAFETY: the step's kernels touch nothing; the arena is held.
                    unsafe { buckets.replay(s, 5) }.unwrap();
                    s.synchronize().unwrap();
                })
            };
            if round > 0 {
                if k == 0 { &mut eager } else { &mut graph }.push(t * 1e6);
            }
        }
    }
    header(
        "bucketed decode step: 64 kernels, batch 5 -> bucket 8 (wall us per step, synchronized)",
    );
    line(
        "eager step (64 stream.launch)",
        &eager,
        "us",
        Some(&ratios(&eager, &eager)),
    );
    line(
        "GraphBuckets::replay",
        &graph,
        "us",
        Some(&ratios(&graph, &eager)),
    );
    drop(buckets);
    Ok(())
}
