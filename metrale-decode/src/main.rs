//! `metrale-decode`: `init` writes a random checkpoint, `generate` decodes
//! greedily, `bench` times the step definition's grid.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use metrale_decode::bench::{self, BenchOptions, TorchRows};
use metrale_decode::weights::{random_host_tensor, write_checkpoint};
use metrale_decode::{generate, Config, Engine, Error, Mode, Result, Source};

#[derive(Parser)]
#[command(
    name = "metrale-decode",
    version,
    about = "A Llama decode engine on metrale alone"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    Eager,
    Graph,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Eager => Mode::Eager,
            ModeArg::Graph => Mode::Graph,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Write seeded random weights (N(0, 0.02), norms ones) in the Hugging Face
    /// Llama layout: config.json and .safetensors shards.
    Init {
        /// A preset (tiny, llama-1b, llama-8b) or a config.json.
        #[arg(long)]
        config: String,
        /// The folder to write.
        #[arg(long)]
        out: PathBuf,
        /// Seed of the values.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Largest shard, in GiB.
        #[arg(long, default_value_t = 2.0)]
        shard_gib: f64,
    },
    /// Greedy decoding of one prompt; prints the new token ids on a line
    /// starting with `tokens:`.
    Generate {
        /// A checkpoint folder (config.json and .safetensors files).
        #[arg(long)]
        weights: PathBuf,
        /// Prompt token ids, comma-separated.
        #[arg(long, value_delimiter = ',', num_args = 1..)]
        prompt: Vec<i64>,
        /// New tokens to choose.
        #[arg(long, default_value_t = 16)]
        steps: usize,
        /// Replay captured graphs or launch each kernel.
        #[arg(long, value_enum, default_value = "graph")]
        mode: ModeArg,
        /// The device.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// Time the grid of the step definition and print a table.
    Bench {
        /// Models: presets or config.json paths, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "llama-1b,llama-8b")]
        models: Vec<String>,
        /// Batch sizes (one graph bucket each).
        #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
        batches: Vec<usize>,
        /// Contexts.
        #[arg(long, value_delimiter = ',', default_value = "512,2048")]
        contexts: Vec<usize>,
        /// Modes.
        #[arg(long, value_delimiter = ',', value_enum, default_value = "eager,graph")]
        modes: Vec<ModeArg>,
        /// A checkpoint of the one model named; default: random weights made on the device.
        #[arg(long)]
        weights: Option<PathBuf>,
        /// Repetitions per row (the median is reported).
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Steps per eager repetition.
        #[arg(long, default_value_t = 20)]
        steps_eager: usize,
        /// Replays per graph repetition.
        #[arg(long, default_value_t = 50)]
        steps_graph: usize,
        /// Time each operation of one eager step per row.
        #[arg(long)]
        profile: bool,
        /// Write the rows as JSON.
        #[arg(long)]
        json: Option<PathBuf>,
        /// PyTorch's `torch_decode.json` from the same card, printed beside ours.
        #[arg(long)]
        torch: Option<PathBuf>,
        /// Draw tokens/s per row beside PyTorch's and the floor (SVG; feature `plot`).
        #[arg(long)]
        plot: Option<PathBuf>,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Init {
            config,
            out,
            seed,
            shard_gib,
        } => {
            let cfg = Config::load(&config)?;
            if shard_gib.is_nan() || shard_gib <= 0.0 {
                return Err(Error::Invalid("--shard-gib must be above 0".into()));
            }
            let files = write_checkpoint(
                &cfg,
                &out,
                (shard_gib * (1u64 << 30) as f64) as u64,
                true,
                |spec, i| random_host_tensor(spec, i, seed, 0.02),
            )?;
            println!(
                "wrote {} ({} shard(s), {:.2} GB of bf16) and config.json to {}",
                cfg.name,
                files.len(),
                cfg.weight_bytes() as f64 / 1e9,
                out.display()
            );
            Ok(())
        }
        Command::Generate {
            weights,
            prompt,
            steps,
            mode,
            device,
        } => {
            let cfg = Config::load(&weights.display().to_string())?;
            let engine = Engine::new(device, cfg, &Source::Files(weights), true)?;
            let tokens = generate(&engine, &prompt, steps, mode.into(), None)?;
            let text: Vec<String> = tokens.iter().map(i64::to_string).collect();
            println!("tokens: {}", text.join(","));
            Ok(())
        }
        Command::Bench {
            models,
            batches,
            contexts,
            modes,
            weights,
            reps,
            steps_eager,
            steps_graph,
            profile,
            json,
            torch,
            plot,
        } => {
            #[cfg(not(feature = "plot"))]
            if plot.is_some() {
                return Err(Error::Invalid(
                    "--plot needs the `plot` feature: cargo run -p metrale-decode --features plot -- bench ...".into(),
                ));
            }
            let torch = torch.as_deref().map(TorchRows::read).transpose()?;
            let opts = BenchOptions {
                models,
                batches,
                contexts,
                modes: modes.into_iter().map(Mode::from).collect(),
                reps,
                steps_eager,
                steps_graph,
                weights,
                profile,
                ..BenchOptions::default()
            };
            let report = bench::run(&opts)?;
            bench::print_report(&report, torch.as_ref());
            if let Some(path) = json {
                std::fs::write(&path, bench::to_json(&report, torch.as_ref()))
                    .map_err(|e| Error::Io(format!("writing {}", path.display()), e))?;
            }
            #[cfg(feature = "plot")]
            if let Some(path) = plot {
                bench::plot(&report, torch.as_ref(), &path)?;
            }
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("metrale-decode: {e}");
            ExitCode::from(2)
        }
    }
}
