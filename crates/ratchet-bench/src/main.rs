//! `ratchet-bench`: the runtime's benchmarks, a binary of their own so that none of them is
//! compiled into `ratchet`. `ratchet bench …` runs this program (found beside `ratchet`),
//! and `cargo run --release -p ratchet-bench -- …` does too. docs/BENCHMARKS.md quotes what
//! each one measured, with the command.

mod commits;
mod memory;
mod recovery;
mod report;
mod sse;
mod steps;
mod webhooks;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "ratchet-bench", version, about = "Measure the Ratchet runtime")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The disk's own limit: fsynced single-row SQLite commits per second (WAL, FULL).
    Commits {
        #[arg(long, default_value_t = 3000)]
        count: u32,
        #[arg(long)]
        json: bool,
    },
    /// Durable steps per second: N runs, C at a time, each K tool round-trips and an answer;
    /// with the disk's own commit rate beside them (SQLite) and the database bytes per step.
    Steps(steps::StepsArgs),
    /// Recovery after SIGKILL: N runs in flight in a `ratchet worker` that is killed, then
    /// carried on by a fresh worker; time from the kill until each went on and completed.
    Recovery(recovery::RecoveryArgs),
    /// Resident memory of a server per idle session and per run waiting for an approval.
    Memory(memory::MemoryArgs),
    /// Event delivery over SSE: N subscribers on one session's stream while R runs go by; or
    /// the memory M clients cost that ask for a large backlog and never read it.
    Sse(sse::SseArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            let _ = error.print();
            return if error.use_stderr() {
                ExitCode::from(64)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RATCHET_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let measured = runtime.block_on(async {
        match cli.command {
            Command::Commits { count, json } => commits::commits(count, json),
            Command::Steps(args) => steps::steps(args).await,
            Command::Recovery(args) => recovery::recovery(args).await,
            Command::Memory(args) => memory::memory(args).await,
            Command::Sse(args) => sse::sse(args).await,
        }
    });
    match measured {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
