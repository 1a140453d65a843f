//! The `ratchet` binary: the composition root that wires the store, models, tools and
//! workers together, and the command-line interface on top of them.

mod agents;
mod approve;
mod chat;
mod dead_letters;
mod drive;
mod fork;
mod inspect;
mod pause;
mod schedules;
mod secrets;
mod serve;
mod telemetry;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "ratchet",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("RATCHET_BUILD_COMMIT"), ")"),
    about = "A durable runtime for LLM agents"
)]
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

#[derive(Debug, clap::Args)]
struct TokenArg {
    /// Bearer token for the server.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "RATCHET_TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum MemoryScopeArg {
    Session,
    Tenant,
}

impl From<MemoryScopeArg> for ratchet_core::MemoryScope {
    fn from(scope: MemoryScopeArg) -> Self {
        match scope {
            MemoryScopeArg::Session => ratchet_core::MemoryScope::Session,
            MemoryScopeArg::Tenant => ratchet_core::MemoryScope::Tenant,
        }
    }
}

/// A run's budgets. The last model call a budget allows is made without tools.
#[derive(Debug, clap::Args)]
struct BudgetArgs {
    /// Most steps the run may take [default: 50].
    #[arg(long)]
    max_steps: Option<u64>,
    /// Most model calls the run may make.
    #[arg(long)]
    max_model_calls: Option<u64>,
    /// Tool calls after which the model is offered no more tools.
    #[arg(long)]
    max_tool_calls: Option<u64>,
    /// Model tokens (input and output) the run may spend.
    #[arg(long)]
    max_tokens: Option<u64>,
    /// Estimated tokens a prompt may hold; a longer one is compacted (older turns summarised).
    #[arg(long)]
    max_prompt_tokens: Option<u64>,
    /// Milliseconds the run may take; past them the step in flight is cut off and the run ends
    /// `timed_out` (exit code 1).
    #[arg(long)]
    max_duration_ms: Option<u64>,
}

impl BudgetArgs {
    fn given(&self) -> Vec<&'static str> {
        [
            self.max_steps.map(|_| "--max-steps"),
            self.max_model_calls.map(|_| "--max-model-calls"),
            self.max_tool_calls.map(|_| "--max-tool-calls"),
            self.max_tokens.map(|_| "--max-tokens"),
            self.max_prompt_tokens.map(|_| "--max-prompt-tokens"),
            self.max_duration_ms.map(|_| "--max-duration-ms"),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn limits(&self) -> ratchet_core::Limits {
        ratchet_core::Limits {
            max_steps: self.max_steps.unwrap_or(50),
            max_model_calls: self.max_model_calls,
            max_tool_calls: self.max_tool_calls,
            max_tokens: self.max_tokens,
            max_prompt_tokens: self.max_prompt_tokens,
            max_duration_ms: self.max_duration_ms,
            ..ratchet_core::Limits::default()
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a session with MESSAGE and drive its run until it ends or waits for a human.
    Run(RunArgs),
    /// Talk to an agent on a Ratchet server: each line of stdin is a message in one session.
    Chat(chat::ChatArgs),
    /// Serve the HTTP API and run the workers (SIGTERM or Ctrl-C stops it gracefully, SIGHUP
    /// reloads the configuration and catalog); `--workers 0` serves the API only.
    Serve(serve::ServeArgs),
    /// Run the workers alone, beside other processes on the same database: any run's steps,
    /// and those of processes whose lease expired (SIGTERM or Ctrl-C stops it gracefully).
    Worker(serve::ProcessArgs),
    /// Apply the database's missing schema migrations (creating it if needed) and print its
    /// schema version.
    Migrate(DbArg),
    /// Recover every active run in the database and drive them until none is running.
    Resume(ResumeArgs),
    /// Inspect runs.
    Runs {
        #[command(subcommand)]
        command: RunsCommand,
    },
    /// List and answer the gated tool batches runs wait on.
    Approvals {
        #[command(subcommand)]
        command: ApprovalsCommand,
    },
    /// Act on the dead letters of a session's inbox.
    Inbox {
        #[command(subcommand)]
        command: InboxCommand,
    },
    /// Manage a server's schedules: messages sent on a cadence, each slot fired once.
    Schedules {
        #[command(subcommand)]
        command: schedules::SchedulesCommand,
    },
    /// Act on the dead deliveries of a webhook.
    Webhooks {
        #[command(subcommand)]
        command: WebhooksCommand,
    },
    /// Check agent catalogs.
    Agents {
        #[command(subcommand)]
        command: AgentsCommand,
    },
    /// Measure the runtime: runs the `ratchet-bench` program beside this one with the same
    /// arguments (`ratchet bench --help` lists the benchmarks).
    #[command(disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

#[derive(Debug, clap::Args)]
struct ResumeArgs {
    #[command(flatten)]
    db: DbArg,
    /// A ratchet.toml whose `[mcp.servers]` the runs' tools come from.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    #[command(flatten)]
    db: DbArg,
    /// Model spec: scripted:FILE or scripted:demo [default: scripted:demo].
    #[arg(long)]
    model: Option<String>,
    /// Directory that file tools may write in (default: the current directory).
    #[arg(long)]
    workspace: Option<PathBuf>,
    #[command(flatten)]
    budget: BudgetArgs,
    /// A tool whose calls wait for a person's approval before their batch runs (asked at
    /// a prompt on stdin); repeatable.
    #[arg(long, value_name = "TOOL")]
    require_approval: Vec<String>,
    /// A ratchet.toml whose `[models.NAME]` profiles `--model NAME` may name and whose
    /// `[tools.NAME] approval` policies apply (`--require-approval` adds to them).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// What `memory_search` looks through: this run's session, or every session in the
    /// database (the tenant's) [default: session].
    #[arg(long, value_name = "SCOPE")]
    memory_scope: Option<MemoryScopeArg>,
    /// Run on a Ratchet server (http://HOST:PORT) instead of in this process; the
    /// server's configuration decides the model, workspace and step budget.
    #[arg(long, value_name = "URL")]
    server: Option<String>,
    /// A directory of agent definitions (default: the config file's `agents`); `--agent`
    /// picks the one that answers.
    #[arg(long, value_name = "DIR")]
    agents: Option<PathBuf>,
    /// The catalog agent that answers: its model, prompt, tools, limits and delegates
    /// (with `--server`, an agent of the server's catalog).
    #[arg(long, value_name = "ID")]
    agent: Option<String>,
    #[command(flatten)]
    token: TokenArg,
    /// Refuse a database whose schema is behind instead of migrating it.
    #[arg(long)]
    no_migrate: bool,
    /// Print one JSON object on stdout instead of the answer.
    #[arg(long)]
    json: bool,
    message: String,
}

#[derive(Debug, Subcommand)]
enum RunsCommand {
    /// Stop a running run at its next step boundary; it keeps its session (messages queue
    /// behind it) until resumed or cancelled.
    Pause(RunTarget),
    /// Take a paused run up again from the step it stopped before (or withdraw a pause it has
    /// not reached yet).
    Resume(RunTarget),
    /// Cancel a run: at once when no step is in flight, else when the step it is taking
    /// ends (its tools are told to stop); its queued messages then run.
    Cancel(RunTarget),
    /// Repeat the model call a failed run (stop reason llm_error) kept failing, with fresh
    /// attempts; `ratchet resume` (or a server) carries the run on.
    Retry(RetryArgs),
    /// Go on with a failed run from its last committed step, adding budget to it (needed
    /// when it stopped with budget_exhausted); `ratchet resume` carries the run on.
    Continue(ContinueArgs),
    /// Fork a run at one of its committed steps: a new session holding its history as that
    /// step left it, and a run that continues from there (the source is left as it is).
    /// Prints the new session and run; against the database, `ratchet resume` (or a server)
    /// carries the fork on.
    Fork(ForkArgs),
    /// List every run.
    List(ListArgs),
    /// Show one run: status, steps, any pending human request and the runs below it.
    Show(ShowArgs),
    /// Say what happened to a call whose outcome is unknown after a crash; once every call
    /// in doubt is answered, `ratchet resume` (or a server) carries the run on.
    Reconcile(ReconcileArgs),
}

#[derive(Debug, clap::Args)]
struct ForkArgs {
    run_id: String,
    /// The step to fork at, as `ratchet runs show` numbers them (from 1).
    #[arg(long, value_name = "N")]
    at_step: u64,
    /// Replace the last user message at or before the step with this text; the fork calls
    /// the model with it first.
    #[arg(long, value_name = "TEXT")]
    message: Option<String>,
    /// Run the fork as this agent of the server's catalog (needs --server); without it, the
    /// run's own frozen configuration.
    #[arg(long, value_name = "ID")]
    agent: Option<String>,
    #[command(flatten)]
    target: ServerOrDb,
}

#[derive(Debug, clap::Args)]
struct RetryArgs {
    run_id: String,
    #[command(flatten)]
    db: DbArg,
}

#[derive(Debug, clap::Args)]
struct ReconcileArgs {
    run_id: String,
    /// The call's id, as `ratchet runs show` names it.
    #[arg(long = "call")]
    call_id: String,
    /// succeeded, failed, retry (run it again) or skip.
    #[arg(long)]
    outcome: inspect::Outcome,
    /// What the call produced (for succeeded or failed); the model sees it.
    #[arg(long)]
    result: Option<String>,
    #[command(flatten)]
    db: DbArg,
}

#[derive(Debug, clap::Args)]
struct ShowArgs {
    run_id: String,
    #[command(flatten)]
    db: DbArg,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    #[command(flatten)]
    db: DbArg,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct ContinueArgs {
    run_id: String,
    /// Steps to add to the run's step budget.
    #[arg(long, default_value_t = 0)]
    extra_steps: u64,
    /// Model calls to add (to a run that has such a limit).
    #[arg(long, default_value_t = 0)]
    extra_model_calls: u64,
    /// Tool calls to add (to a run that has such a limit).
    #[arg(long, default_value_t = 0)]
    extra_tool_calls: u64,
    /// Tokens to add (to a run that has such a limit).
    #[arg(long, default_value_t = 0)]
    extra_tokens: u64,
    /// Milliseconds to add (to a run that has a deadline).
    #[arg(long, default_value_t = 0)]
    extra_duration_ms: u64,
    #[command(flatten)]
    db: DbArg,
}

#[derive(Debug, clap::Args)]
struct RunTarget {
    run_id: String,
    #[command(flatten)]
    target: ServerOrDb,
}

/// Where `ratchet approvals` and `ratchet runs pause|resume` work: a server when `--server`
/// is given, else the database.
#[derive(Debug, clap::Args)]
struct ServerOrDb {
    /// A Ratchet server's URL; without it the database is used directly.
    #[arg(long, value_name = "URL")]
    server: Option<String>,
    #[command(flatten)]
    token: TokenArg,
    #[command(flatten)]
    db: DbArg,
}

impl ServerOrDb {
    fn target(self) -> anyhow::Result<approve::Target> {
        Ok(match self.server {
            Some(server) => {
                approve::Target::Server(ratchet_client::Api::new(&server, self.token.token, 2)?)
            }
            None => approve::Target::Db(self.db.db),
        })
    }
}

#[derive(Debug, Subcommand)]
enum ApprovalsCommand {
    /// List approvals, each with the calls of its batch.
    List(ApprovalsListArgs),
    /// Answer an approval: decide every call that needs approval, or abort the run. Against
    /// a database, `ratchet resume` then carries the run on.
    Decide(DecideArgs),
}

#[derive(Debug, clap::Args)]
struct DecideArgs {
    #[command(flatten)]
    answer: approve::Decide,
    #[command(flatten)]
    target: ServerOrDb,
}

#[derive(Debug, clap::Args)]
struct ApprovalsListArgs {
    /// Only approvals with this status: pending, decided, aborted or cancelled.
    #[arg(long)]
    status: Option<String>,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    target: ServerOrDb,
}

#[derive(Debug, Subcommand)]
enum InboxCommand {
    /// Put a dead letter back to pending: due now, its attempts counted afresh; a continuation
    /// turn tells it when the session is free.
    Requeue(DeadLetterArgs),
    /// Drop a dead letter for good, recording who did and when.
    Discard(DeadLetterArgs),
}

#[derive(Debug, clap::Args)]
struct DeadLetterArgs {
    session_id: String,
    event_id: i64,
    /// Who acts on it, for the record [default: $USER].
    #[arg(long, value_name = "NAME")]
    by: Option<String>,
    #[command(flatten)]
    target: ServerOrDb,
}

#[derive(Debug, Subcommand)]
enum WebhooksCommand {
    /// Put a dead delivery back to pending (or, with --all-dead, every one of the webhook):
    /// due now, its attempts counted afresh.
    Requeue(WebhookRequeueArgs),
}

#[derive(Debug, clap::Args)]
struct WebhookRequeueArgs {
    webhook_id: String,
    delivery_id: Option<i64>,
    /// Every dead delivery of the webhook.
    #[arg(long)]
    all_dead: bool,
    #[command(flatten)]
    target: ServerOrDb,
}

#[derive(Debug, Subcommand)]
enum AgentsCommand {
    /// Load a directory of agent definitions (`*.md`) against this process's tools and
    /// models; print each agent, or every problem and exit 1 (the catalog is rejected whole).
    Check(CheckArgs),
}

#[derive(Debug, clap::Args)]
struct CheckArgs {
    /// The catalog: a directory of agent definitions.
    dir: PathBuf,
    /// A ratchet.toml whose `[models.NAME]` profiles and `[mcp.servers]` tools the
    /// definitions may name.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

fn main() -> ExitCode {
    // Only a build with fault injection reads `FAILPOINTS` (docs/ARCHITECTURE.md, "Fault
    // injection"); the guard keeps the configuration for the life of the process.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
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
    let exporting = {
        let _inside = runtime.enter();
        telemetry::install()
    };
    let exporting = match exporting {
        Ok(exporting) => exporting,
        Err(error) => {
            eprintln!("error: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    };
    // The last spans leave while the runtime (on which a gRPC exporter's connection lives)
    // still runs.
    let _inside = runtime.enter();
    drop(exporting);
    code
}

async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run(args) => match args.server.clone() {
            Some(server) => args.run_remote(server).await,
            None => args.run_here().await,
        },
        Command::Chat(args) => chat::chat(args).await,
        Command::Serve(args) => serve::serve(args).await,
        Command::Worker(process) => serve::worker(process).await,
        Command::Migrate(db) => migrate(&db.db),
        Command::Resume(args) => args.resume().await,
        Command::Runs { command } => command.execute().await,
        Command::Inbox { command } => command.execute().await,
        Command::Schedules { command } => command.execute().await,
        Command::Webhooks {
            command: WebhooksCommand::Requeue(args),
        } => {
            let delivery = dead_letters::chosen_delivery(args.delivery_id, args.all_dead)?;
            dead_letters::webhook(args.target.target()?, &args.webhook_id, delivery).await
        }
        Command::Approvals {
            command: ApprovalsCommand::List(args),
        } => approve::list(args.target.target()?, args.status, args.json).await,
        Command::Approvals {
            command: ApprovalsCommand::Decide(args),
        } => approve::decide(args.target.target()?, args.answer).await,
        Command::Agents {
            command: AgentsCommand::Check(args),
        } => agents::check(&args.dir, args.config.as_deref()).await,
        Command::Bench { args } => bench(args),
    }
}

fn migrate(db: &str) -> anyhow::Result<ExitCode> {
    let migrated = ratchet::migrate(db)?;
    if migrated.from == migrated.to {
        println!("schema version {} (up to date)", migrated.to);
    } else {
        println!(
            "schema version {} (migrated from {})",
            migrated.to, migrated.from
        );
    }
    Ok(ExitCode::SUCCESS)
}

impl RunArgs {
    /// `run --server`: the server's configuration decides everything but the message.
    async fn run_remote(self, server: String) -> anyhow::Result<ExitCode> {
        let local_only = [
            self.agents.is_some().then_some("--agents"),
            self.model.is_some().then_some("--model"),
            self.workspace.is_some().then_some("--workspace"),
            (!self.require_approval.is_empty()).then_some("--require-approval"),
            self.config.is_some().then_some("--config"),
            self.memory_scope.is_some().then_some("--memory-scope"),
            self.no_migrate.then_some("--no-migrate"),
        ];
        let mut given: Vec<&str> = local_only.into_iter().flatten().collect();
        given.extend(self.budget.given());
        if !given.is_empty() {
            bail!(
                "{} cannot be used with --server: the server's configuration decides the \
                 agents, the model, the workspace, the step budget, the approvals and the \
                 memory scope",
                given.join(", ")
            );
        }
        // The database is the server's too; --db (or RATCHET_DB) is not used.
        drive::run_remote(drive::RemoteRunArgs {
            server,
            agent: self.agent,
            token: self.token.token,
            json: self.json,
            message: self.message,
        })
        .await
    }

    /// `run` in this process.
    async fn run_here(self) -> anyhow::Result<ExitCode> {
        let file = ratchet::Config::load_or_default(self.config.as_deref())?;
        if let (Some(dir), None) = (&self.agents, &self.agent) {
            bail!(
                "--agents {} needs --agent ID: the agent that answers",
                dir.display()
            );
        }
        let agents = (self.agents).or_else(|| file.agents.as_ref().map(PathBuf::from));
        let catalog = match (agents, self.agent) {
            (Some(dir), Some(agent)) => Some(drive::Pick {
                dir,
                agent,
                tree: ratchet::agents::TreeLimits::of(&file)?,
            }),
            (None, Some(agent)) => bail!(
                "--agent {agent} needs a catalog: give --agents DIR (or `agents` in the config file)"
            ),
            (_, None) => None,
        };
        if catalog.is_some() && self.model.is_some() {
            bail!("--model cannot be used with --agent: the agent's definition names its model");
        }
        let (quota, permits) = (file.quota()?, file.permits()?);
        let tree_budget = file.tree_budget()?;
        let max_snippet_bytes = file.limits()?.max_snippet_bytes;
        let pool = file.pool()?;
        let mut overrides = ratchet::ToolOverrides {
            approval: file.approval_policies()?,
            replay: file.replay_policies(),
            calls: file.call_limits()?,
        };
        overrides.approval.extend(
            (self.require_approval)
                .into_iter()
                .map(|tool| (tool, ratchet_core::ApprovalPolicy::Always)),
        );
        drive::run(drive::RunArgs {
            db: self.db.db,
            model: (self.model).unwrap_or_else(|| "scripted:demo".to_owned()),
            workspace: self.workspace,
            limits: ratchet_core::Limits {
                max_wait_ms: file.max_wait_ms()?,
                ..self.budget.limits()
            },
            overrides,
            profiles: file.models,
            mcp: file.mcp,
            memory_scope: self.memory_scope.map(Into::into).unwrap_or_default(),
            schema: if self.no_migrate {
                ratchet::Schema::Require
            } else {
                ratchet::Schema::Migrate
            },
            json: self.json,
            message: self.message,
            catalog,
            quota,
            tree_budget,
            permits,
            max_snippet_bytes,
            pool,
        })
        .await
    }
}

impl ResumeArgs {
    async fn resume(self) -> anyhow::Result<ExitCode> {
        let file = ratchet::Config::load_or_default(self.config.as_deref())?;
        let max_snippet_bytes = file.limits()?.max_snippet_bytes;
        drive::resume(
            &self.db.db,
            self.json,
            &file.mcp,
            max_snippet_bytes,
            file.pool()?,
        )
        .await
    }
}

impl RunsCommand {
    async fn execute(self) -> anyhow::Result<ExitCode> {
        use ratchet_core::step::Resumption;
        match self {
            RunsCommand::List(args) => inspect::list(&args.db.db, args.json).await,
            RunsCommand::Show(args) => inspect::show(&args.db.db, &args.run_id, args.json).await,
            RunsCommand::Reconcile(args) => {
                let (db, run, call) = (&args.db.db, &args.run_id, &args.call_id);
                inspect::reconcile(db, run, call, args.outcome, args.result).await
            }
            RunsCommand::Pause(run) => pause::pause(run.target.target()?, &run.run_id).await,
            RunsCommand::Resume(run) => pause::resume(run.target.target()?, &run.run_id).await,
            RunsCommand::Cancel(run) => pause::cancel(run.target.target()?, &run.run_id).await,
            RunsCommand::Fork(args) => {
                let edit = args.message.as_deref();
                let (run, at, agent) = (&args.run_id, args.at_step, args.agent.as_deref());
                fork::fork(args.target.target()?, run, at, edit, agent).await
            }
            RunsCommand::Retry(args) => {
                inspect::resume_failed(&args.db.db, &args.run_id, Resumption::Retry).await
            }
            RunsCommand::Continue(args) => {
                let extension = ratchet_core::BudgetExtension {
                    steps: args.extra_steps,
                    model_calls: args.extra_model_calls,
                    tool_calls: args.extra_tool_calls,
                    tokens: args.extra_tokens,
                    duration_ms: args.extra_duration_ms,
                };
                let how = Resumption::Continue { extension };
                inspect::resume_failed(&args.db.db, &args.run_id, how).await
            }
        }
    }
}

impl InboxCommand {
    async fn execute(self) -> anyhow::Result<ExitCode> {
        let (action, letter) = match self {
            InboxCommand::Requeue(letter) => (ratchet_store::DeadLetterAction::Requeue, letter),
            InboxCommand::Discard(letter) => (ratchet_store::DeadLetterAction::Discard, letter),
        };
        let target = letter.target.target()?;
        dead_letters::inbox(
            target,
            action,
            &letter.session_id,
            letter.event_id,
            letter.by,
        )
        .await
    }
}

/// `ratchet bench ARGS…`: the benchmarks are a program of their own, `ratchet-bench`, so that
/// none of them is compiled into this one; it is looked for beside this program.
fn bench(args: Vec<std::ffi::OsString>) -> anyhow::Result<ExitCode> {
    let own = std::env::current_exe().context("cannot find this program's own path")?;
    let program = own.with_file_name(format!("ratchet-bench{}", std::env::consts::EXE_SUFFIX));
    if !program.is_file() {
        bail!(
            "`ratchet bench` runs {}, which is not there; build it with `cargo build --release \
             -p ratchet-bench` (or run `cargo run --release -p ratchet-bench -- …`)",
            program.display()
        );
    }
    let status = std::process::Command::new(&program)
        .args(args)
        .status()
        .with_context(|| format!("cannot run {}", program.display()))?;
    Ok(match status.code() {
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    })
}
