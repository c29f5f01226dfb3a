//! Two processes on one GPU share device memory: this process maps exportable
//! physical memory into a growable buffer and fills it, starts itself again as a
//! second process, and sends it the memory as a file descriptor over a Unix
//! socket; the second process maps the same memory, checks every element, writes
//! its own, and says so; the first reads them back.
//!
//! `cargo run -p metrale-runtime --example share_memory` (Linux, a GPU with
//! virtual memory management; exits with status 2 and the reason otherwise).

use std::process::ExitCode;

#[cfg(unix)]
mod demo {
    use std::error::Error;
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::process::Command;
    use std::sync::Arc;

    use metrale_runtime::{host, GrowableBuffer, HandleTypes, PhysicalMemory};

    const SOCKET_VAR: &str = "METRALE_SHARE_MEMORY_SOCKET";
    const N: usize = 4 << 20; // 16 MiB of u32

    pub fn run() -> Result<(), Box<dyn Error>> {
        match std::env::var(SOCKET_VAR) {
            Ok(path) => second(&path),
            Err(_) => first(),
        }
    }

    fn first() -> Result<(), Box<dyn Error>> {
        let h = host(0)?;
        let s = h.stream();
        let mut buf = GrowableBuffer::<u32>::with_handle_types(&h, N, HandleTypes::POSIX_FD)?;
        buf.grow_to(N)?;
        let values: Vec<u32> = (0..N as u32).collect();
        s.copy_h2d(&values, &mut buf)?;

        let path = std::env::temp_dir().join(format!("metrale-share-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        let mut child = Command::new(std::env::current_exe()?)
            .env(SOCKET_VAR, &path)
            .spawn()?;
        let (conn, _) = listener.accept()?;
        let _ = std::fs::remove_file(&path);
        let piece = buf
            .range()
            .physical(0)
            .ok_or("the buffer maps no memory at offset 0")?;
        piece.send(&conn)?;
        let mut done = [0u8; 1];
        (&conn).read_exact(&mut done)?;
        if !child.wait()?.success() {
            return Err("the second process failed".into());
        }
        let head = s.to_vec(&buf.slice(..8)?)?;
        println!("first process reads back: {head:?}");
        if head.iter().any(|&v| v != 0xdead_beef) {
            return Err("the second process's writes are not visible".into());
        }
        println!("shared {} MiB between two processes", (N * 4) >> 20);
        Ok(())
    }

    fn second(path: &str) -> Result<(), Box<dyn Error>> {
        let conn = UnixStream::connect(path)?;
        let h = host(0)?;
        let s = h.stream();
        let phys = PhysicalMemory::receive(&h, &conn)?;
        let mut buf = GrowableBuffer::<u32>::from_physical(Arc::new(phys))?;
        let got = s.to_vec(&buf)?;
        if got.iter().enumerate().any(|(i, &v)| v as usize != i) {
            return Err("the second process sees other values".into());
        }
        println!("second process: {} elements as written", got.len());
        s.memset_u32(&mut buf.slice_mut(..8)?, 0xdead_beef)?;
        (&conn).write_all(&[1])?;
        Ok(())
    }
}

fn main() -> ExitCode {
    #[cfg(unix)]
    match demo::run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("share_memory: {e}");
            ExitCode::from(2)
        }
    }
    #[cfg(not(unix))]
    {
        eprintln!("share_memory: descriptors are passed over Unix sockets (Linux only)");
        ExitCode::from(2)
    }
}
