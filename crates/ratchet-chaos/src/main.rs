//! `ratchet-chaos`: kills Ratchet processes at random instants while clients work, then checks
//! every invariant. Exits 0 only when there is no violation.
//!
//!     cargo build -p ratchet-cli -p ratchet-chaos --release
//!     target/release/ratchet-chaos --duration 600 --runs 3000
//!     target/release/ratchet-chaos --db postgres://postgres@127.0.0.1:5432/chaos --worker-processes 1

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use ratchet_chaos::{Database, Options};

#[derive(Parser)]
#[command(
    version,
    about = "Kill Ratchet processes at random while clients work; check every invariant"
)]
struct Args {
    /// The `ratchet` binary (default: the one beside this program).
    #[arg(long)]
    ratchet: Option<PathBuf>,
    /// A PostgreSQL url; a new SQLite file in the working directory when absent.
    #[arg(long)]
    db: Option<String>,
    /// Seconds of kills and restarts.
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// At most this many runs (in sessions of one to three); none starts after the kills stop.
    #[arg(long, default_value_t = 10_000)]
    runs: usize,
    /// Sessions driven at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// `ratchet worker` processes beside `ratchet serve` (default: 1 on PostgreSQL, 0 on SQLite).
    #[arg(long)]
    worker_processes: Option<usize>,
    /// Least and most milliseconds a process lives before it is killed.
    #[arg(long, default_value_t = 300)]
    min_uptime_ms: u64,
    #[arg(long, default_value_t = 3000)]
    max_uptime_ms: u64,
    /// The random seed (default: from the clock); the report prints it.
    #[arg(long)]
    seed: Option<u64>,
    /// Where to keep the database, workspace and logs (default: a new temporary directory,
    /// kept when there are violations).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Seconds the runs still going get to finish after the kills stop.
    #[arg(long, default_value_t = 60)]
    settle: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("ratchet-chaos: {error:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> anyhow::Result<ExitCode> {
    if args.min_uptime_ms > args.max_uptime_ms {
        bail!(
            "--min-uptime-ms {} is above --max-uptime-ms {}",
            args.min_uptime_ms,
            args.max_uptime_ms
        );
    }
    let ratchet = match args.ratchet {
        Some(path) => path,
        None => std::env::current_exe()?
            .parent()
            .context("this program's directory")?
            .join("ratchet"),
    };
    if !ratchet.is_file() {
        bail!(
            "no ratchet binary at {}: build it (cargo build -p ratchet-cli) or pass --ratchet",
            ratchet.display()
        );
    }
    let database = match args.db {
        Some(url) if url.starts_with("postgres") => Database::Postgres { url },
        Some(url) => bail!("--db takes a postgres:// url (SQLite is the default), found {url:?}"),
        None => Database::Sqlite,
    };
    let worker_processes = args
        .worker_processes
        .unwrap_or(usize::from(matches!(database, Database::Postgres { .. })));
    let temporary = match &args.dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)?;
            None
        }
        None => Some(
            tempfile::Builder::new()
                .prefix("ratchet-chaos-")
                .tempdir()?,
        ),
    };
    let dir = args
        .dir
        .clone()
        .or_else(|| temporary.as_ref().map(|t| t.path().to_owned()))
        .context("a working directory")?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let report = ratchet_chaos::run(Options {
        ratchet,
        database,
        duration: Duration::from_secs(args.duration),
        runs: args.runs,
        concurrency: args.concurrency,
        worker_processes,
        uptime_ms: (args.min_uptime_ms, args.max_uptime_ms),
        seed,
        dir: dir.clone(),
        settle: Duration::from_secs(args.settle),
    })
    .await?;
    print!("{report}");
    if report.violations.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(temporary) = temporary {
        let kept = temporary.keep();
        eprintln!(
            "kept the database, workspace and logs in {}",
            kept.display()
        );
    }
    Ok(ExitCode::FAILURE)
}
