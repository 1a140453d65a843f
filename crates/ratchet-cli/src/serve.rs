//! `ratchet serve` (the HTTP API and the worker pool in one process) and `ratchet worker`
//! (the worker pool alone): one configuration, one way of assembling the process, and a
//! graceful shutdown on SIGTERM or SIGINT that lets steps in flight commit.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use ratchet_core::Limits;
use ratchet_engine::{PoolConfig, WorkerPool};
use ratchet_server::{AppState, Config};
use tokio_util::sync::CancellationToken;

use crate::runtime::{Runtime, Schema, ToolOverrides, Toolbox, open_store};

/// How long in-flight steps get to commit after a shutdown signal; what is still running
/// then is left to lease expiry and taken over by the next process.
const GRACE: Duration = Duration::from_secs(10);

/// What `serve` and `worker` share: where the settings come from and how the workers run.
pub struct ProcessArgs {
    pub config: Option<PathBuf>,
    pub db: Option<String>,
    pub workers: Option<u64>,
    pub lease_ms: Option<u64>,
    pub heartbeat_ms: Option<u64>,
    pub poll_ms: Option<u64>,
    pub no_migrate: bool,
}

pub struct ServeArgs {
    pub process: ProcessArgs,
    pub listen: Option<String>,
    pub model: Option<String>,
    pub workspace: Option<PathBuf>,
    pub agents: Option<PathBuf>,
}

/// File, then `RATCHET_*` environment, then flags.
fn settings(args: &ProcessArgs) -> anyhow::Result<Config> {
    let file = Config::load_or_default(args.config.as_deref())?;
    let mut config = file.with_env(|key| std::env::var(key).ok())?;
    if let Some(db) = &args.db {
        config.db = Some(db.clone());
    }
    for (flag, slot) in [
        (args.workers, &mut config.workers),
        (args.lease_ms, &mut config.lease_ms),
        (args.heartbeat_ms, &mut config.heartbeat_ms),
        (args.poll_ms, &mut config.poll_ms),
    ] {
        if flag.is_some() {
            *slot = flag;
        }
    }
    Ok(config)
}

/// The parts of a process both commands build the same way, once the settings are checked:
/// the tools and models (MCP servers started, profiles checked), then the store.
struct Process {
    db: String,
    runtime: Runtime,
}

impl Process {
    async fn open(config: &Config, toolbox: Toolbox, no_migrate: bool) -> anyhow::Result<Process> {
        let db = config
            .db
            .clone()
            .unwrap_or_else(|| "sqlite://ratchet.db".to_owned());
        let schema = if no_migrate {
            Schema::Require
        } else {
            Schema::Migrate
        };
        let runtime = Runtime::gated(
            open_store(&db, schema)?,
            toolbox,
            config.quota()?,
            config.permits()?,
        );
        runtime
            .recover()
            .await
            .context("recovering the steps of dead processes")?;
        Ok(Process { db, runtime })
    }
}

pub(crate) async fn toolbox(config: &Config) -> anyhow::Result<Toolbox> {
    Toolbox::with_mcp(&config.mcp)
        .await?
        .with_profiles(config.models.clone())
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let mut config = settings(&args.process)?;
    if let Some(listen) = &args.listen {
        config.listen = Some(listen.clone());
    }
    if let Some(model) = &args.model {
        config.model = Some(model.clone());
    }
    if let Some(workspace) = &args.workspace {
        config.workspace = Some(workspace.display().to_string());
    }
    if let Some(agents) = &args.agents {
        config.agents = Some(agents.display().to_string());
    }
    let pool_config = config.pool()?;
    let tokens = config.tokens(|key| std::env::var(key).ok())?;
    let listen = config.listen.as_deref().unwrap_or("127.0.0.1:7700");
    let address: SocketAddr = listen
        .parse()
        .with_context(|| format!("listen address {listen:?} is not IP:PORT"))?;
    if tokens.is_empty() && !address.ip().is_loopback() {
        bail!(
            "refusing to listen on {address} without authentication: configure [[tokens]] in the \
             config file, or listen on a loopback address such as 127.0.0.1"
        );
    }
    let toolbox = toolbox(&config).await?;
    let mut template = toolbox.run_template(
        config.model.as_deref().unwrap_or("scripted:demo"),
        config.workspace.as_deref().map(std::path::Path::new),
        Limits {
            max_steps: config.max_steps.unwrap_or(50),
            max_model_calls: config.max_model_calls,
            max_tool_calls: config.max_tool_calls,
            max_tokens: config.max_tokens,
            max_prompt_tokens: config.max_prompt_tokens,
            max_duration_ms: config.max_duration_ms,
            ..Limits::default()
        },
        &ToolOverrides {
            approval: config.approval_policies()?,
            replay: config.replay_policies(),
        },
        config.memory_scope.unwrap_or_default(),
    )?;
    template.delegation.inbox = config.inbox_policy()?;
    let agents = match &config.agents {
        Some(dir) => {
            let catalog = crate::agents::load(std::path::Path::new(dir), &toolbox)?;
            let limits = crate::agents::TreeLimits::of(&config);
            crate::agents::profiles(&catalog, &toolbox, &template, limits)?
        }
        None => Vec::new(),
    };
    let Process { db, runtime } = Process::open(&config, toolbox, args.process.no_migrate).await?;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))?;
    // `--workers 0`: the API only; other processes sharing the database run the steps.
    let pool = (pool_config.workers > 0).then(|| runtime.start_workers(pool_config.clone()));
    let shutdown = CancellationToken::new();
    let agent_count = agents.len();
    let state = AppState::new(
        runtime.coordinator.clone(),
        template,
        tokens,
        shutdown.clone(),
    )
    .with_agents(agents);
    let app = ratchet_server::app(state);
    eprintln!(
        "ratchet listening on http://{} (database {db}{}{}; {})",
        listener.local_addr()?,
        if config.tokens.is_empty() {
            ", no authentication"
        } else {
            ""
        },
        match agent_count {
            0 => String::new(),
            n => format!(", {n} agents"),
        },
        describe_pool(pool.as_ref(), &pool_config),
    );
    spawn_signal_watch(shutdown.clone());
    // Workers stop claiming the moment the signal arrives, while HTTP winds down beside them.
    let workers = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            shutdown.cancelled().await;
            stop_within_grace(pool).await
        }
    });
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .await;
    // The server may also stop on an error of its own: the workers stop with it.
    shutdown.cancel();
    if !workers.await.unwrap_or(false) {
        eprintln!(
            "some steps did not commit in time; their leases will expire and another process will take them over"
        );
    }
    runtime.close_tools().await;
    served.context("the HTTP server failed")?;
    Ok(ExitCode::SUCCESS)
}

/// `ratchet worker`: the workers alone, over a database other processes share. It claims any
/// run's steps, takes over those whose lease expired, and stops on SIGTERM or Ctrl-C.
pub async fn worker(args: ProcessArgs) -> anyhow::Result<ExitCode> {
    let config = settings(&args)?;
    let pool_config = config.pool()?;
    if pool_config.workers == 0 {
        bail!("--workers must be at least 1 for `ratchet worker` (it runs nothing else)");
    }
    let toolbox = toolbox(&config).await?;
    let Process { db, runtime } = Process::open(&config, toolbox, args.no_migrate).await?;
    let pool = runtime.start_workers(pool_config.clone());
    eprintln!(
        "ratchet worker on database {db}; {}",
        describe_pool(Some(&pool), &pool_config)
    );
    let shutdown = CancellationToken::new();
    spawn_signal_watch(shutdown.clone());
    shutdown.cancelled().await;
    if !stop_within_grace(Some(pool)).await {
        eprintln!(
            "some steps did not commit in time; their leases will expire and another process will take them over"
        );
    }
    runtime.close_tools().await;
    Ok(ExitCode::SUCCESS)
}

fn describe_pool(pool: Option<&WorkerPool>, config: &PoolConfig) -> String {
    match pool {
        Some(pool) => format!(
            "{} workers as {}, lease {} ms, heartbeat {} ms, poll {} ms",
            config.workers,
            pool.owner(),
            config.lease.as_millis(),
            config.heartbeat.as_millis(),
            config.poll.as_millis()
        ),
        None => "no workers: the API only".to_owned(),
    }
}

/// Cancels `shutdown` at the first SIGTERM or SIGINT.
fn spawn_signal_watch(shutdown: CancellationToken) {
    tokio::spawn(async move {
        wait_for_signal().await;
        eprintln!("shutting down: no new steps; in-flight steps get {GRACE:?} to commit");
        shutdown.cancel();
    });
}

/// Stops the workers claiming and waits up to `GRACE` for their steps to commit; false when
/// some did not.
async fn stop_within_grace(pool: Option<WorkerPool>) -> bool {
    match pool {
        Some(pool) => tokio::time::timeout(GRACE, pool.shutdown()).await.is_ok(),
        None => true,
    }
}

async fn wait_for_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(error) => {
                    tracing::warn!(%error, "cannot watch SIGTERM; only Ctrl-C stops the server");
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
