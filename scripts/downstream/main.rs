//! A downstream program, built against the packaged crates by
//! `scripts/check-package.sh`: the prelude, owned blobs, a user's error type
//! (anyhow) inside a capture, and the conveniences of the public API.

use metrale_runtime::prelude::*;
use metrale_runtime::{host, LaunchAttributes, PrefetchTarget, StreamOptions};

fn step() -> anyhow::Result<()> {
    // Kernels read from disk: owned names and bytes.
    let blobs = vec![("kernels".to_string(), std::fs::read("kernels.ptx")?)];
    let reg = MetraleRegistry::load(0, &blobs)?;
    let f = reg.function("kernels", "vec_add")?;
    let s = reg.stream();
    let n: usize = 1 << 16;
    let a = DeviceBuffer::from_host(s, &vec![1.0f32; n])?;
    let mut c = DeviceBuffer::<f32>::zeroed(s, n)?;
    let cfg = LaunchConfig::for_num_elems(n, 256)?;
    let graph = s.try_capture(|s| -> anyhow::Result<()> {
        // SAFETY: vec_add(const float*, const float*, float*, unsigned) over n.
        unsafe { s.launch(&f, cfg, (&a, &a, &mut c, n as u32))? };
        anyhow::ensure!(n > 0, "an error of the program's own type");
        Ok(())
    })?;
    let exec = graph.instantiate()?;
    // SAFETY: a and c outlive the replay (the read below waits for it).
    unsafe { exec.launch(s)? };
    let other = CudaStream::with_options(s, StreamOptions::default().with_priority(0))?;
    other.join(s)?;
    let pinned = PinnedBuffer::from_slice(s, &vec![2.0f32; n])?;
    let pinned = other.copy_h2d_pinned(pinned, &mut c)?.wait()?;
    let m = ManagedBuffer::<f32>::zeroed(s, n)?;
    s.prefetch(&m, PrefetchTarget::Device)?;
    let _cluster = cfg.with_attributes(LaunchAttributes::cluster(1, 1, 1));
    let back = other.to_vec(&c)?;
    anyhow::ensure!(back == *pinned, "copies agree");
    let _host = host(0)?;
    Ok(())
}

fn main() {
    match step() {
        Ok(()) => println!("downstream: ok"),
        Err(e) => eprintln!("downstream: {e:#}"),
    }
}
