//! CUDA graphs against the raw driver: a 1,000-kernel step (the `empty` kernel, one
//! block of 32 threads) launched eagerly and replayed as a graph, through metrale
//! and through the sys table, in the same process; capture + instantiate, whole
//! graph update and per-node update beside the raw calls.
//!
//! `cargo bench -p metrale-runtime --bench graph [-- --rounds N | --quick]`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "graph/bucket_rows.rs"]
mod bucket_rows;
mod common;

use std::ffi::c_void;
use std::process::ExitCode;

use common::{header, line, ratios, rounds, time, Row};
use metrale_runtime::sys::{self, CUresult};
use metrale_runtime::{CudaGraph, DeviceBuffer, LaunchConfig, MetraleError, MetraleRegistry};

static PTX: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");
const STEP: usize = 1000;

fn ok(call: &str, s: CUresult) {
    assert!(s.is_success(), "{call} failed: {s}");
}

fn run() -> Result<(), MetraleError> {
    let rounds = rounds(21, 3);
    let d = sys::driver().map_err(|e| MetraleError::from(e.clone()))?;
    let reg = MetraleRegistry::load(0, &[("kernels", PTX)])?;
    let s = reg.stream();
    let raw_s = s.raw();
    let f = reg.function("kernels", "empty")?;
    let buf = DeviceBuffer::<f32>::alloc(s, 1)?;
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    let (ptr, n, x) = (buf.device_ptr(), 7u32, 1.5f32);
    let params: [*mut c_void; 3] = [
        (&ptr as *const u64).cast_mut().cast(),
        (&n as *const u32).cast_mut().cast(),
        (&x as *const f32).cast_mut().cast(),
    ];
    let raw_launch = d.cuLaunchKernel().unwrap();
    let raw_sync = d.cuStreamSynchronize().unwrap();
    let raw_graph_launch = d.cuGraphLaunch().unwrap();
    let sync = || {
        // SAFETY: the host's stream.
        ok("cuStreamSynchronize", unsafe { raw_sync(raw_s) });
    };
    let eager_ours = || {
        for _ in 0..STEP {
            // SAFETY: empty(float*, unsigned, float).
            unsafe { s.launch(&f, cfg, (&buf, n, x)) }.unwrap();
        }
    };
    let eager_raw = || {
        for _ in 0..STEP {
            // SAFETY: as above, through the sys table.
            ok("cuLaunchKernel", unsafe {
                raw_launch(
                    f.as_raw(),
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    raw_s,
                    params.as_ptr().cast_mut(),
                    std::ptr::null_mut(),
                )
            });
        }
    };
    let capture_ours = || -> CudaGraph {
        s.capture(|s| -> metrale_runtime::Result<()> {
            for _ in 0..STEP {
                // SAFETY: as above.
                unsafe { s.launch(&f, cfg, (&buf, n, x))? };
            }
            Ok(())
        })
        .unwrap()
    };
    // Raw capture and instantiation through the sys table.
    let capture_raw = || -> (sys::CUgraph, sys::CUgraphExec) {
        let mut g: sys::CUgraph = std::ptr::null_mut();
        let mut e: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a capture of the raw launches above on the host's stream.
        unsafe {
            ok(
                "cuStreamBeginCapture_v2",
                (d.cuStreamBeginCapture_v2().unwrap())(
                    raw_s,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
            );
        }
        eager_raw();
        // SAFETY: ends the capture begun above; instantiates the graph.
        unsafe {
            ok(
                "cuStreamEndCapture",
                (d.cuStreamEndCapture().unwrap())(raw_s, &mut g),
            );
            ok(
                "cuGraphInstantiateWithFlags",
                (d.cuGraphInstantiateWithFlags().unwrap())(&mut e, g, 0),
            );
        }
        (g, e)
    };
    let destroy_raw = |(g, e): (sys::CUgraph, sys::CUgraphExec)| {
        // SAFETY: both made by capture_raw, destroyed once.
        unsafe {
            ok("cuGraphExecDestroy", (d.cuGraphExecDestroy().unwrap())(e));
            ok("cuGraphDestroy", (d.cuGraphDestroy().unwrap())(g));
        }
    };

    let graph = capture_ours();
    let exec = graph.instantiate()?;
    exec.upload(s)?;
    let replay_ours = || {
        // SAFETY: buf, the only memory the graph touches, is alive.
        unsafe { exec.launch(s) }.unwrap();
    };
    let replay_raw = || {
        // SAFETY: our executable graph, replayed through the sys table.
        ok("cuGraphLaunch", unsafe {
            raw_graph_launch(exec.raw(), raw_s)
        });
    };
    for _ in 0..3 {
        eager_ours();
        eager_raw();
        replay_ours();
        replay_raw();
        sync();
    }

    let g2 = capture_ours();
    let nodes = graph.kernel_nodes()?;
    let mut exec_upd = graph.instantiate()?;
    let raw_update = d.cuGraphExecUpdate_v2().unwrap();
    let raw_node_set = d.cuGraphExecKernelNodeSetParams_v2().unwrap();

    let mut rows: Vec<Row> = vec![Row::default(); 12];
    // CPU time to submit one replay: 40 replays queued back to back, raw and ours
    // taking turns call by call, each call timed (a few microseconds each).
    let submit_pair = || -> (f64, f64) {
        let (mut raw, mut ours) = (0.0, 0.0);
        for i in 0..40 {
            if i % 2 == 0 {
                raw += time(replay_raw);
            } else {
                ours += time(replay_ours);
            }
        }
        sync();
        (raw * 1e6 / 20.0, ours * 1e6 / 20.0)
    };
    for round in 0..rounds {
        // Wall time per step: submit and wait, paths alternating.
        let order: [usize; 4] = if round % 2 == 0 {
            [0, 1, 2, 3]
        } else {
            [3, 2, 1, 0]
        };
        for k in order {
            let (cpu, wall) = match k {
                0 => {
                    let mut cpu = 0.0;
                    let wall = time(|| {
                        cpu = time(eager_raw);
                        sync();
                    });
                    (cpu, wall)
                }
                1 => {
                    let mut cpu = 0.0;
                    let wall = time(|| {
                        cpu = time(eager_ours);
                        sync();
                    });
                    (cpu, wall)
                }
                2 => {
                    let mut cpu = 0.0;
                    let wall = time(|| {
                        cpu = time(replay_raw);
                        sync();
                    });
                    (cpu, wall)
                }
                _ => {
                    let mut cpu = 0.0;
                    let wall = time(|| {
                        cpu = time(replay_ours);
                        sync();
                    });
                    (cpu, wall)
                }
            };
            rows[k].push(wall * 1e3);
            if k < 2 {
                rows[4 + k].push(cpu * 1e6);
            }
        }
        let (raw, ours) = submit_pair();
        rows[6].push(raw);
        rows[7].push(ours);
        // Capture + instantiate.
        let mut made = None;
        rows[8].push(time(|| made = Some(capture_raw())) * 1e3);
        destroy_raw(made.take().unwrap());
        rows[9].push(
            time(|| {
                let g = capture_ours();
                drop(g.instantiate().unwrap());
            }) * 1e3,
        );
        // Whole-graph update: raw to g2, ours back to the first graph (each call
        // switches graphs), taking turns at going first.
        let raw_exec = exec_upd.raw();
        let raw_upd = || {
            let mut info = sys::CUgraphExecUpdateResultInfo::default();
            time(|| {
                // SAFETY: a live executable graph and a graph of the same topology.
                ok("cuGraphExecUpdate_v2", unsafe {
                    raw_update(raw_exec, g2.raw(), &mut info)
                });
            }) * 1e6
        };
        if round % 2 == 0 {
            let raw = raw_upd();
            rows[10].push(raw);
            rows[11].push(time(|| exec_upd.update(&graph).unwrap()) * 1e6);
        } else {
            let ours = time(|| exec_upd.update(&graph).unwrap()) * 1e6;
            rows[11].push(ours);
            let raw = raw_upd();
            rows[10].push(raw);
        }
    }
    // Per-node update: 1,000 updates of each path per round, the paths taking
    // turns going first round by round.
    let (mut node_raw, mut node_ours) = (Row::default(), Row::default());
    let mut p = params;
    let np = sys::CUDA_KERNEL_NODE_PARAMS {
        func: f.as_raw(),
        gridDimX: 1,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: 32,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        kernelParams: p.as_mut_ptr(),
        ..sys::CUDA_KERNEL_NODE_PARAMS::default()
    };
    let k = 1000;
    let node_round = |ours: bool| -> f64 {
        time(|| {
            for i in 0..k {
                if ours {
                    // SAFETY: empty(float*, unsigned, float) on buf.
                    unsafe { exec_upd.set_kernel_params(&nodes[i % STEP], &f, cfg, (&buf, n, x)) }
                        .unwrap();
                } else {
                    // SAFETY: a kernel node of the graph exec_upd was instantiated from.
                    ok("cuGraphExecKernelNodeSetParams_v2", unsafe {
                        raw_node_set(exec_upd.raw(), nodes[i % STEP].node.raw(), &np)
                    });
                }
            }
        }) * 1e6
            / k as f64
    };
    for round in 0..rounds {
        for j in 0..2 {
            if (round + j) % 2 == 0 {
                node_raw.push(node_round(false));
            } else {
                node_ours.push(node_round(true));
            }
        }
    }

    let h = reg.host();
    header(&format!(
        "metrale graph benchmark: {} (sm_{}{}), driver {}, a step of {STEP} kernels, {rounds} rounds",
        h.device_name(),
        h.limits().compute_capability.0,
        h.limits().compute_capability.1,
        h.driver_version()
    ));
    let r = &rows;
    line(
        "eager step, raw cuLaunchKernel: wall (ms)",
        &r[0],
        "  ",
        Some(&ratios(&r[0], &r[0])),
    );
    line(
        "eager step, stream.launch: wall (ms)",
        &r[1],
        "  ",
        Some(&ratios(&r[1], &r[0])),
    );
    line(
        "graph replay, raw cuGraphLaunch: wall (ms)",
        &r[2],
        "  ",
        Some(&ratios(&r[2], &r[2])),
    );
    line(
        "graph replay, CudaGraphExec::launch: wall (ms)",
        &r[3],
        "  ",
        Some(&ratios(&r[3], &r[2])),
    );
    line(
        "eager step, raw: CPU submit (us)",
        &r[4],
        "  ",
        Some(&ratios(&r[4], &r[4])),
    );
    line(
        "eager step, stream.launch: CPU submit (us)",
        &r[5],
        "  ",
        Some(&ratios(&r[5], &r[4])),
    );
    line(
        "graph replay, raw: CPU submit (us, 20 queued)",
        &r[6],
        "  ",
        Some(&ratios(&r[6], &r[6])),
    );
    line(
        "graph replay, ours: CPU submit (us, 20 queued)",
        &r[7],
        "  ",
        Some(&ratios(&r[7], &r[6])),
    );
    line(
        "capture + instantiate 1000 kernels, raw (ms)",
        &r[8],
        "  ",
        Some(&ratios(&r[8], &r[8])),
    );
    line(
        "capture + instantiate 1000 kernels, ours (ms)",
        &r[9],
        "  ",
        Some(&ratios(&r[9], &r[8])),
    );
    line(
        "whole-graph update, raw (us)",
        &r[10],
        "  ",
        Some(&ratios(&r[10], &r[10])),
    );
    line(
        "whole-graph update, CudaGraphExec::update (us)",
        &r[11],
        "  ",
        Some(&ratios(&r[11], &r[10])),
    );
    line(
        "per-node update, raw (us)",
        &node_raw,
        "  ",
        Some(&ratios(&node_raw, &node_raw)),
    );
    line(
        "per-node update, set_kernel_params (us)",
        &node_ours,
        "  ",
        Some(&ratios(&node_ours, &node_raw)),
    );
    println!(
        "\neager -> graph speedup per step (stream.launch vs CudaGraphExec::launch, wall): {:.2}x",
        ratios(&r[1], &r[3]).median()
    );
    drop((exec, exec_upd, graph, g2, buf));
    // Issue 34: a bucketed step through the capture arena.
    bucket_rows::run(s, &f, rounds.max(5))?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("graph bench: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("graph bench: {e}");
            ExitCode::FAILURE
        }
    }
}
