//! A small async server loop: 64 request slots over 4 streams, each slot a tokio
//! task that launches a kernel for its request, queues the copy of the answer
//! into pinned memory, and awaits the stream's future, so that the executor's
//! threads stay free while the GPU works (no thread blocks in a synchronize).
//!
//! `cargo run --release -p metrale-runtime --example async_server`
//!
//! Without a driver it exits with status 2 and the loader's message.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use metrale_runtime::{
    CudaStream, DeviceBuffer, ErrorKind, LaunchConfig, MetraleError, MetraleRegistry, PinnedBuffer,
    Result,
};

static KERNELS: &[u8] = include_bytes!("../tests/fixtures/kernels.ptx");

/// Requests served in all.
const REQUESTS: u32 = 4096;
/// Requests in flight at once.
const SLOTS: usize = 64;
/// Streams the slots share.
const STREAMS: usize = 4;
/// Words in an answer.
const WORDS: usize = 1 << 14;

/// One slot: serve requests until none is left; returns how many it served.
async fn serve(stream: CudaStream, reg: Arc<MetraleRegistry>, next: Arc<AtomicU32>) -> Result<u32> {
    let fill = reg.function("kernels", "fill_index")?;
    let cfg = LaunchConfig::for_num_elems(WORDS, 256)?;
    let mut answer = DeviceBuffer::<u32>::alloc(&stream, WORDS)?;
    let mut staging = Some(PinnedBuffer::<u32>::zeroed(&stream, WORDS)?);
    let mut served = 0;
    loop {
        let request = next.fetch_add(1, Ordering::Relaxed);
        if request >= REQUESTS {
            return Ok(served);
        }
        // SAFETY: fill_index(unsigned*, unsigned, unsigned) writes WORDS words of
        // `answer`, which this task owns past the copy below.
        unsafe { stream.launch(&fill, cfg, (&mut answer, WORDS as u32, request))? };
        let Some(buffer) = staging.take() else {
            return Err(ErrorKind::InvalidArgument("staging buffer lost".into()).into());
        };
        let copy = stream.copy_d2h_pinned(&answer, buffer)?;
        // The executor runs other slots while this request is on the GPU.
        stream.done().await?;
        let buffer = copy.wait()?; // done already: returns at once
        if buffer[0] != request || buffer[WORDS - 1] != request + WORDS as u32 - 1 {
            return Err(ErrorKind::InvalidArgument(format!(
                "request {request}: wrong answer {} .. {}",
                buffer[0],
                buffer[WORDS - 1]
            ))
            .into());
        }
        staging = Some(buffer);
        served += 1;
    }
}

fn run() -> std::result::Result<(), MetraleError> {
    let reg = MetraleRegistry::load(0, &[("kernels", KERNELS)])?;
    let streams: Vec<CudaStream> = (0..STREAMS)
        .map(|_| CudaStream::new(reg.ctx()))
        .collect::<Result<_>>()?;
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return Err(ErrorKind::InvalidArgument(format!("tokio runtime: {e}")).into());
        }
    };
    let next = Arc::new(AtomicU32::new(0));
    let t = Instant::now();
    let served = rt.block_on(async {
        let mut slots = Vec::with_capacity(SLOTS);
        for i in 0..SLOTS {
            let stream = streams[i % STREAMS].clone();
            slots.push(tokio::spawn(serve(
                stream,
                Arc::clone(&reg),
                Arc::clone(&next),
            )));
        }
        let mut served = 0;
        for slot in slots {
            match slot.await {
                Ok(r) => served += r?,
                Err(e) => {
                    return Err(MetraleError::from(ErrorKind::InvalidArgument(format!(
                        "a slot's task failed: {e}"
                    ))))
                }
            }
        }
        Ok(served)
    })?;
    let secs = t.elapsed().as_secs_f64();
    println!(
        "served {served} requests ({SLOTS} in flight over {STREAMS} streams) in {:.1} ms: {:.0} requests/s, every answer checked",
        secs * 1e3,
        f64::from(served) / secs
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unavailable() => {
            eprintln!("async_server: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("async_server: {e}");
            ExitCode::FAILURE
        }
    }
}
