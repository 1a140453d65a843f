//! The `ratchet` binary: the composition root that wires the store, models, tools and
//! workers together, and the command-line interface on top of them.

mod bench;
mod drive;
mod inspect;
mod runtime;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "ratchet", version, about = "A durable runtime for LLM agents")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct DbArg {
    /// Database URL (sqlite://PATH[?synchronous=normal]).
    #[arg(long, env = "RATCHET_DB", default_value = "sqlite://ratchet.db")]
    db: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a session with MESSAGE and drive its run until it ends or waits for a human.
    Run {
        #[command(flatten)]
        db: DbArg,
        /// Model spec: scripted:FILE or scripted:demo.
        #[arg(long, default_value = "scripted:demo")]
        model: String,
        /// Directory that file tools may write in (default: the current directory).
        #[arg(long)]
        workspace: Option<PathBuf>,
        /// Most steps the run may take; its last model call is made without tools.
        #[arg(long, default_value_t = 50)]
        max_steps: u64,
        /// Print one JSON object on stdout instead of the answer.
        #[arg(long)]
        json: bool,
        message: String,
    },
    /// Serve the HTTP API and run the workers (SIGTERM or Ctrl-C stops it gracefully).
    Serve {
        /// Configuration file (TOML); `RATCHET_*` variables and flags override it.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Database URL (default sqlite://ratchet.db).
        #[arg(long)]
        db: Option<String>,
        /// Address to listen on (default 127.0.0.1:7700).
        #[arg(long)]
        listen: Option<String>,
        /// Model spec new runs are frozen with (default scripted:demo).
        #[arg(long)]
        model: Option<String>,
        /// Directory file tools may write in (default: the current directory).
        #[arg(long)]
        workspace: Option<PathBuf>,
    },
    /// Recover every active run in the database and drive them until none is running.
    Resume {
        #[command(flatten)]
        db: DbArg,
        #[arg(long)]
        json: bool,
    },
    /// Inspect runs.
    Runs {
        #[command(subcommand)]
        command: RunsCommand,
    },
    /// Measure the runtime.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
enum RunsCommand {
    /// List every run.
    List {
        #[command(flatten)]
        db: DbArg,
        #[arg(long)]
        json: bool,
    },
    /// Show one run: status, steps and any pending human request.
    Show {
        run_id: String,
        #[command(flatten)]
        db: DbArg,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Durable steps per second: N runs, C at a time, each K tool round-trips and an answer.
    Steps {
        /// Database URL; a fresh temporary SQLite file when absent.
        #[arg(long)]
        db: Option<String>,
        #[arg(long, default_value_t = 200)]
        runs: usize,
        #[arg(long, default_value_t = 100)]
        concurrency: usize,
        #[arg(long, default_value_t = 5)]
        turns: usize,
        #[arg(long)]
        json: bool,
    },
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
    match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run {
            db,
            model,
            workspace,
            max_steps,
            json,
            message,
        } => {
            drive::run(drive::RunArgs {
                db: db.db,
                model,
                workspace,
                max_steps,
                json,
                message,
            })
            .await
        }
        Command::Serve {
            config,
            db,
            listen,
            model,
            workspace,
        } => {
            serve::serve(serve::ServeArgs {
                config,
                db,
                listen,
                model,
                workspace,
            })
            .await
        }
        Command::Resume { db, json } => drive::resume(&db.db, json).await,
        Command::Runs {
            command: RunsCommand::List { db, json },
        } => inspect::list(&db.db, json).await,
        Command::Runs {
            command: RunsCommand::Show { run_id, db, json },
        } => inspect::show(&db.db, &run_id, json).await,
        Command::Bench {
            command:
                BenchCommand::Steps {
                    db,
                    runs,
                    concurrency,
                    turns,
                    json,
                },
        } => {
            bench::steps(bench::StepsArgs {
                db,
                runs,
                concurrency,
                turns,
                json,
            })
            .await
        }
    }
}
