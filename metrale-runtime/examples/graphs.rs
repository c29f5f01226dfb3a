//! CUDA graphs in a few lines: capture a small step from two streams (fork/join),
//! write it as Graphviz DOT, replay it, update one node's arguments in place, and
//! run a device-side `while` loop (a conditional node, CUDA 12.4+).
//!
//! `cargo run --release -p metrale-runtime --example graphs [-- out.dot]`
//! (render with `dot -Tpng out.dot -o graph.png`).

use std::process::ExitCode;

use metrale_runtime::{
    CudaEvent, CudaGraph, CudaStream, DeviceBuffer, LaunchConfig, MetraleError, MetraleRegistry,
};

static KERNELS: &[u8] = include_bytes!("../tests/fixtures/kernels.sm_90.cubin");
static CONDITIONAL: &[u8] = include_bytes!("../tests/fixtures/conditional.sm_90.cubin");

fn run() -> Result<(), MetraleError> {
    let dot = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "graph.dot".to_owned());
    let reg = MetraleRegistry::load(0, &[("kernels", KERNELS), ("cond", CONDITIONAL)])?;
    let axpb = reg.function("kernels", "axpb")?;
    let (a, b) = (reg.stream(), CudaStream::new(reg.ctx())?);
    let mut x = DeviceBuffer::<u32>::zeroed(a, 1)?;
    let mut y = DeviceBuffer::<u32>::zeroed(a, 1)?;
    let one = LaunchConfig::new((1, 1, 1), (32, 1, 1), 0)?;
    let (fork, join) = (CudaEvent::new(reg.ctx())?, CudaEvent::new(reg.ctx())?);

    // A diamond: x = 2x + 1 on stream a; then y = y + 5 on stream b beside
    // x = 2x + 1 on a; then, once both are done, x = 3x + 0 on a.
    let graph = a.capture(|a| -> metrale_runtime::Result<()> {
        // SAFETY: axpb(unsigned*, unsigned, unsigned) updates element 0 of its buffer.
        unsafe { a.launch(&axpb, one, (&mut x, 2u32, 1u32))? };
        fork.record(a)?;
        b.wait(&fork)?;
        // SAFETY: as above.
        unsafe {
            b.launch(&axpb, one, (&mut y, 1u32, 5u32))?;
            a.launch(&axpb, one, (&mut x, 2u32, 1u32))?;
        }
        join.record(&b)?;
        a.wait(&join)?;
        // SAFETY: as above.
        unsafe { a.launch(&axpb, one, (&mut x, 3u32, 0u32)) }
    })?;
    graph.write_dot(&dot)?;
    println!(
        "captured {} nodes, edges {:?}; DOT written to {dot}",
        graph.nodes()?.len(),
        graph.edges()?
    );

    let exec = graph.instantiate()?;
    // SAFETY: x and y, the only memory the graph touches, outlive the replays.
    unsafe {
        exec.launch(a)?;
        exec.launch(a)?;
    }
    println!(
        "after 2 replays: x = {}, y = {}",
        a.to_vec(&x)?[0],
        a.to_vec(&y)?[0]
    );

    // Change the last node's arguments in the executable graph: x = 10x + 0.
    let nodes = graph.kernel_nodes()?;
    let last = nodes
        .iter()
        .rev()
        .find(|n| n.name == "kernels::axpb")
        .ok_or_else(|| {
            MetraleError::from(metrale_runtime::ErrorKind::InvalidArgument(
                "no axpb node".into(),
            ))
        })?;
    // SAFETY: as a launch of axpb on x.
    unsafe {
        exec.set_kernel_params(last, &axpb, one, (&mut x, 10u32, 0u32))?;
        exec.launch(a)?;
    }
    println!(
        "after an in-place update and a replay: x = {}",
        a.to_vec(&x)?[0]
    );

    // A device-side while loop: the body runs until its kernel clears the condition.
    let body = reg.function("cond", "loop_body")?;
    let mut counter = DeviceBuffer::from_host(a, &[4u32])?;
    let mut z = DeviceBuffer::<u32>::zeroed(a, 1)?;
    let mut looped = CudaGraph::new(reg.ctx())?;
    looped.add_while(&[], true, |body_graph, handle| {
        // SAFETY: loop_body(handle, unsigned*, unsigned*) on one element each.
        unsafe { body_graph.add_kernel_node(&[], &body, one, (handle, &mut counter, &mut z)) }?;
        Ok(())
    })?;
    let exec_loop = looped.instantiate()?;
    // SAFETY: counter and z outlive the replay.
    unsafe { exec_loop.launch(a)? };
    println!(
        "a while loop of 4 rounds on the device: z = {}",
        a.to_vec(&z)?[0]
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("graphs: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("graphs: {e}");
            ExitCode::FAILURE
        }
    }
}
