//! One process per GPU: rank 0 makes the NCCL id and hands it to the other ranks
//! over TCP (std only), every rank joins, and they all-reduce a buffer and check
//! it.
//!
//! ```text
//! # on the machine of rank 0 (it listens on the address):
//! cargo run --release -p metrale-runtime --features nccl --example nccl_tcp -- \
//!     --rank 0 --nranks 2 --addr 10.0.0.1:29500
//! # on each other rank (anywhere that reaches the address):
//! cargo run --release -p metrale-runtime --features nccl --example nccl_tcp -- \
//!     --rank 1 --nranks 2 --addr 10.0.0.1:29500 [--device 0]
//! ```
//!
//! The device defaults to `rank % (number of devices)`, for several ranks on one
//! machine. The TCP exchange only carries the id (256 hex digits and a newline);
//! the collectives go over whatever NCCL picks (NVLink, PCIe, InfiniBand,
//! sockets): see the guide's NCCL chapter (`metrale_runtime::guide::nccl`) for the
//! variables that steer it.
//!
//! Exits with status 2 and the message when the driver or NCCL cannot be loaded,
//! or the rendezvous fails.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use metrale_runtime::nccl::{CommConfig, Communicator, NcclId, ReduceOp};
use metrale_runtime::{context, device_count, CudaStream, DeviceBuffer};

struct Args {
    rank: usize,
    nranks: usize,
    addr: String,
    device: Option<usize>,
}

fn parse() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let (mut rank, mut nranks, mut addr, mut device) = (None, None, None, None);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--rank" => rank = Some(number()?),
            "--nranks" => nranks = Some(number()?),
            "--device" => device = Some(number()?),
            "--addr" => addr = Some(value),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let usage = "usage: nccl_tcp --rank R --nranks N --addr HOST:PORT [--device D]";
    Ok(Args {
        rank: rank.ok_or(usage)?,
        nranks: nranks.ok_or(usage)?,
        addr: addr.ok_or(usage)?,
        device,
    })
}

/// Rank 0: make the id, send it to every other rank that connects.
fn serve_id(addr: &str, others: usize) -> Result<NcclId, Box<dyn std::error::Error>> {
    let id = NcclId::new()?;
    let listener = TcpListener::bind(addr)?;
    println!("rank 0: listening on {addr} for {others} rank(s)");
    for _ in 0..others {
        let (mut peer, from) = listener.accept()?;
        writeln!(peer, "{id}")?;
        println!("rank 0: id sent to {from}");
    }
    Ok(id)
}

/// Other ranks: connect (retrying for a minute while rank 0 starts) and read it.
fn fetch_id(addr: &str) -> Result<NcclId, Box<dyn std::error::Error>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(format!("cannot reach rank 0 at {addr}: {e}").into()),
        }
    };
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    Ok(line.parse()?)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse()?;
    if args.rank >= args.nranks {
        return Err(format!("rank {} is not below nranks {}", args.rank, args.nranks).into());
    }
    let device = match args.device {
        Some(d) => d,
        None => args.rank % device_count()?.max(1),
    };
    let ctx = context(device)?;
    let id = if args.rank == 0 {
        serve_id(&args.addr, args.nranks - 1)?
    } else {
        fetch_id(&args.addr)?
    };
    let t = Instant::now();
    let comm = Communicator::init_rank(&id, args.nranks, args.rank, &ctx, &CommConfig::new())?;
    println!(
        "rank {} of {} on device {device}: joined in {:?}",
        comm.rank(),
        comm.size(),
        t.elapsed()
    );
    let stream = CudaStream::new(&ctx)?;
    let n = 1 << 24;
    let mine = vec![(args.rank + 1) as f32; n];
    let mut buf = DeviceBuffer::from_host(&stream, &mine)?;
    let t = Instant::now();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &stream)?;
    comm.wait(&stream, Duration::from_secs(120))?;
    let took = t.elapsed();
    let want = (args.nranks * (args.nranks + 1) / 2) as f32;
    let got = stream.to_vec(&buf)?;
    if let Some(i) = got.iter().position(|&v| v != want) {
        return Err(format!("element {i} is {}, not {want}", got[i]).into());
    }
    println!(
        "rank {}: all-reduce of {} MiB correct ({want} everywhere) in {took:?}",
        args.rank,
        (n * 4) >> 20
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nccl_tcp: {e}");
            ExitCode::from(2)
        }
    }
}
