//! Issue 34: a bucketed decode step (64 `empty` kernels over an arena buffer)
//! for a batch of 5 (the bucket of 8, of buckets 1..64), launched eagerly and
//! replayed through `GraphBuckets` (one graph launch: the arena is held by a
//! user object the graphs retain),
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
    submit_rows(s, &buckets, rounds)?;
    drop(buckets);
    Ok(())
}

/// Replays queued per round in the submit rows.
const SUBMITS: usize = 100;

/// Issue 43, item 2: the submit cost of a replay of an arena-holding bucket
/// (`GraphBuckets::replay`, one `cuGraphLaunch` now that the arena is a user
/// object) beside a raw `cuGraphLaunch` of the same executable through the
/// sys table: `SUBMITS` replays queued and timed, then waited (untimed);
/// rounds alternate which goes first.
fn submit_rows(s: &CudaStream, buckets: &GraphBuckets, rounds: usize) -> Result<(), MetraleError> {
    let d = metrale_runtime::sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let Ok(raw_launch) = d.cuGraphLaunch() else {
        return Ok(());
    };
    let Some(exec) = buckets.exec(8) else {
        return Ok(());
    };
    let (raw_exec, raw_s) = (exec.raw(), s.raw());
    let (mut ours, mut raw) = (Row::default(), Row::default());
    for round in 0..rounds + 1 {
        for k in if round % 2 == 0 { [0, 1] } else { [1, 0] } {
            let t = if k == 0 {
                time(|| {
                    for _ in 0..SUBMITS {
                        // SAFETY: the step's kernels touch nothing; the arena is held.
                        unsafe { buckets.replay(s, 5) }.unwrap();
                    }
                })
            } else {
                time(|| {
                    for _ in 0..SUBMITS {
                        // SAFETY: the same executable and our stream, through the
                        // sys table.
                        let r = unsafe { raw_launch(raw_exec, raw_s) };
                        assert_eq!(r, metrale_runtime::sys::CUresult::CUDA_SUCCESS);
                    }
                })
            };
            s.synchronize()?;
            if round > 0 {
                if k == 0 { &mut ours } else { &mut raw }.push(t * 1e6 / SUBMITS as f64);
            }
        }
    }
    header("bucketed replay submit: bucket 8, 100 replays queued per round (us per replay)");
    line(
        "raw cuGraphLaunch, same executable",
        &raw,
        "us",
        Some(&ratios(&raw, &raw)),
    );
    line(
        "GraphBuckets::replay",
        &ours,
        "us",
        Some(&ratios(&ours, &raw)),
    );
    Ok(())
}
