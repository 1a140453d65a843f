//! `ratchet serve` (the HTTP API and the worker pool in one process) and `ratchet worker`
//! (the worker pool alone): one configuration, one way of assembling the process, and a
//! graceful shutdown on SIGTERM or SIGINT that lets steps in flight commit. `serve` reloads
//! its configuration and catalog on SIGHUP (or `POST /v1/admin/reload`): what it activates is
//! built by the same code as at start, and checked whole before anything is replaced.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use ratchet::Config;
use ratchet_engine::{PoolConfig, WorkerPool};
use ratchet_server::reload::{Prepared, Reloader};
use ratchet_server::{AppState, GuardedListener, HostPolicy, Reloads};
use ratchet_store::Keyring;
use tokio_util::sync::CancellationToken;

use crate::secrets::Source;
use ratchet::{Runtime, Schema, Toolbox, open_sealed_store, open_store, own_key_file};

/// How long in-flight steps get to commit after a shutdown signal; what is still running
/// then is left to lease expiry and taken over by the next process.
const GRACE: Duration = Duration::from_secs(10);

/// What `serve` and `worker` share: where the settings come from and how the workers run.
/// What `serve` and `worker` share. Each setting also comes from the config file (the same
/// name with `_` for `-`) or a `RATCHET_*` variable; a flag wins.
#[derive(Debug, Clone, clap::Args)]
pub struct ProcessArgs {
    /// Configuration file (TOML); `RATCHET_*` variables and flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Database URL (default sqlite://ratchet.db).
    #[arg(long)]
    pub db: Option<String>,
    /// Steps this process runs at once (default 16).
    #[arg(long, value_name = "N")]
    pub workers: Option<u64>,
    /// How long a claimed step stays this process's without a heartbeat, in ms (default
    /// 15000); after it, another process takes the step over.
    #[arg(long, value_name = "MS")]
    pub lease_ms: Option<u64>,
    /// How often a running step renews its lease, in ms (default a third of the lease).
    #[arg(long, value_name = "MS")]
    pub heartbeat_ms: Option<u64>,
    /// How often an idle worker looks for work nobody announced, in ms (default 250).
    #[arg(long, value_name = "MS")]
    pub poll_ms: Option<u64>,
    /// Refuse a database whose schema is behind instead of migrating it (`ratchet migrate`
    /// applies the migrations).
    #[arg(long)]
    pub no_migrate: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub process: ProcessArgs,
    /// Address to listen on (default 127.0.0.1:7700).
    #[arg(long)]
    pub listen: Option<String>,
    /// Model spec new runs are frozen with (default scripted:demo).
    #[arg(long)]
    pub model: Option<String>,
    /// Directory file tools may write in (default: the current directory).
    #[arg(long)]
    pub workspace: Option<PathBuf>,
    /// Directory of agent definitions sessions may pick (`{"agent": ID}`); checked whole
    /// at start and at each reload (default: the config file's `agents`).
    #[arg(long, value_name = "DIR")]
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

fn database_url(config: &Config) -> String {
    config
        .db
        .clone()
        .unwrap_or_else(|| "sqlite://ratchet.db".to_owned())
}

impl Process {
    /// `secrets`: for a process that creates webhooks or sends to them.
    async fn open(
        config: &Config,
        toolbox: Toolbox,
        no_migrate: bool,
        secrets: Option<Keyring>,
    ) -> anyhow::Result<Process> {
        let db = database_url(config);
        let schema = if no_migrate {
            Schema::Require
        } else {
            Schema::Migrate
        };
        let store = match secrets {
            Some(keyring) => open_sealed_store(&db, schema, keyring)?,
            None => open_store(&db, schema)?,
        };
        let runtime = Runtime::gated(store, toolbox, config.quota()?, config.permits()?);
        runtime
            .recover()
            .await
            .context("recovering the steps of dead processes")?;
        Ok(Process { db, runtime })
    }
}

pub(crate) async fn toolbox(config: &Config) -> anyhow::Result<Toolbox> {
    Ok(
        Toolbox::with_mcp(&config.mcp, config.limits()?.max_snippet_bytes)
            .await?
            .with_profiles(config.models.clone())?,
    )
}

/// `serve`'s settings: the file, the environment, then the flags (those of `worker` and
/// `serve`'s own). A reload reads them again the same way.
fn serve_settings(args: &ServeArgs) -> anyhow::Result<Config> {
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
    Ok(config)
}

/// How a running `serve` reads its configuration and catalog again: the same file,
/// environment and flags it started with, checked against the tools and models it started
/// with.
struct ServeReloader {
    args: ServeArgs,
    started: Config,
    /// The configuration of the set last activated, made again when the tools change.
    activated: std::sync::Mutex<Config>,
    /// The running toolbox's tools, models and profiles; its MCP connections stay with the
    /// runtime.
    toolbox: Toolbox,
    address: SocketAddr,
}

impl Reloader for ServeReloader {
    fn prepare(&self) -> Result<Prepared, Vec<String>> {
        let config = serve_settings(&self.args).map_err(|error| vec![format!("{error:#}")])?;
        let prepared = self.prepare_from(&config)?;
        *self.activated.lock().unwrap_or_else(|e| e.into_inner()) = config;
        Ok(prepared)
    }

    fn refresh(&self) -> Result<Prepared, Vec<String>> {
        let config = (self.activated.lock().unwrap_or_else(|e| e.into_inner())).clone();
        self.prepare_from(&config)
    }
}

impl ServeReloader {
    fn prepare_from(&self, config: &Config) -> Result<Prepared, Vec<String>> {
        let active = ratchet::serving::prepare_active(config, &self.toolbox, self.address)?;
        Ok(Prepared {
            active,
            restart_required: ratchet::serving::restart_required(&self.started, config),
        })
    }
}

/// Every problem, for a process that cannot start with them.
fn rejected(problems: Vec<String>) -> anyhow::Error {
    match problems.as_slice() {
        [one] => anyhow::anyhow!("{one}"),
        _ => anyhow::anyhow!(
            "the configuration was rejected ({} problems):\n{}",
            problems.len(),
            problems.join("\n")
        ),
    }
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let config = serve_settings(&args)?;
    let pool_config = config.pool()?;
    let limits = config.limits()?;
    let idempotency = config.idempotency()?;
    let listen = config.listen.as_deref().unwrap_or("127.0.0.1:7700");
    let address: SocketAddr = listen
        .parse()
        .with_context(|| format!("listen address {listen:?} is not IP:PORT"))?;
    let hosts = HostPolicy::new(
        address,
        config.server.allowed_hosts.as_deref().unwrap_or_default(),
    )
    .map_err(|reason| anyhow::anyhow!("invalid configuration: {reason}"))?;
    // Loopback is a webhook destination only when no one beyond this machine can reach the
    // API to create a webhook.
    let webhook_policy = config.webhook_policy(address.ip().is_loopback())?;
    let webhooks = config.webhooks(webhook_policy.clone())?;
    let secrets = crate::secrets::load(
        &config.secrets,
        |key| std::env::var(key).ok(),
        own_key_file(&database_url(&config))?.as_deref(),
    )?;
    let key_id = secrets.keyring.current().id().to_owned();
    let toolbox = toolbox(&config).await?;
    let active = match ratchet::serving::prepare_active(&config, &toolbox, address) {
        Ok(active) => active,
        Err(problems) => {
            toolbox.close().await;
            return Err(rejected(problems));
        }
    };
    let tool_changes = toolbox.changes();
    let reloader = ServeReloader {
        args: args.clone(),
        started: config.clone(),
        activated: std::sync::Mutex::new(config.clone()),
        toolbox: toolbox.detached(),
        address,
    };
    let Process { db, runtime } = Process::open(
        &config,
        toolbox,
        args.process.no_migrate,
        Some(secrets.keyring),
    )
    .await?;
    if let Source::Generated(path) = &secrets.source {
        eprintln!(
            "made the key that seals webhook secrets at rest: {} (readable by this user only). \
             Back it up apart from the database: without it, the webhooks' secrets cannot be read",
            path.display()
        );
    }
    // Secrets written in clear by an older version, or sealed with a previous key.
    let sealed = (runtime.webhooks.seal_webhook_secrets().await).with_context(|| {
        format!(
            "cannot seal the webhook secrets under the current key ({key_id}); if the key was \
             changed, give the one they were sealed with in [secrets] previous_key_files or \
             {}",
            crate::secrets::PREVIOUS_KEYS_VARIABLE
        )
    })?;
    if sealed > 0 {
        eprintln!("sealed {sealed} webhook secrets under key {key_id}");
    }
    let shutdown = CancellationToken::new();
    let agent_count = active.agents().len();
    let state = AppState::new(
        runtime.coordinator.clone(),
        runtime.webhooks.clone(),
        active,
        shutdown.clone(),
    )
    .with_stream_limits(limits.streams)
    .with_host_policy(hosts)
    .with_idempotency(idempotency.0, idempotency.1)
    .with_reloader(reloader)
    .with_webhook_policy(webhook_policy);
    // Before the socket accepts anyone who could send one: from here on a SIGHUP reloads
    // instead of ending the process.
    if let Some(reloads) = state.reloads() {
        spawn_reload_on_hangup(reloads.clone(), shutdown.clone())?;
        spawn_refresh_on_tool_changes(reloads, tool_changes, shutdown.clone());
    }
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))?;
    let listener = GuardedListener::new(listener, limits.stream_stall);
    // The dispatcher is handed the observation plane's part of the store only.
    let dispatcher = match webhooks {
        Some(dispatch) => Some(
            ratchet_webhooks::spawn(runtime.deliveries.clone(), dispatch, shutdown.clone())
                .context("cannot start the webhook dispatcher")?,
        ),
        None => None,
    };
    // `--workers 0`: the API only; other processes sharing the database run the steps.
    let pool = (pool_config.workers > 0).then(|| runtime.start_workers(pool_config.clone()));
    let app = ratchet_server::app(state);
    eprintln!(
        "ratchet listening on http://{} (database {}{}{}; {})",
        listener.local_addr()?,
        ratchet_postgres::redacted(&db),
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
    if let Some(dispatcher) = dispatcher {
        // It stops at once; attempts in flight are made again after their leases expire.
        let _ = dispatcher.await;
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
    let Process { db, runtime } = Process::open(&config, toolbox, args.no_migrate, None).await?;
    let pool = runtime.start_workers(pool_config.clone());
    eprintln!(
        "ratchet worker on database {}; {}",
        ratchet_postgres::redacted(&db),
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

/// Makes the active set again each time an MCP server's tools change, so that the runs
/// created from then on are frozen with the new tools; runs already created keep theirs.
fn spawn_refresh_on_tool_changes(
    reloads: Reloads,
    mut changes: tokio::sync::watch::Receiver<u64>,
    shutdown: CancellationToken,
) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = changes.changed() => if changed.is_err() { return },
            }
            match reloads.refresh().await {
                Ok(_) => {
                    eprintln!("an MCP server's tools changed: new runs are offered its new tools")
                }
                Err(error) => eprintln!("an MCP server's tools changed, but {error}"),
            }
        }
    });
}

/// Reloads at each SIGHUP until `shutdown`, and says on stderr what came of it.
#[cfg(unix)]
fn spawn_reload_on_hangup(reloads: Reloads, shutdown: CancellationToken) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangups = signal(SignalKind::hangup()).context("cannot watch SIGHUP")?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                received = hangups.recv() => if received.is_none() { return },
            }
            match reloads.reload().await {
                Ok(reloaded) => eprintln!("{}", describe_reload(&reloaded)),
                Err(error) => eprintln!("{error}"),
            }
        }
    });
    Ok(())
}

#[cfg(not(unix))]
fn spawn_reload_on_hangup(_: Reloads, _: CancellationToken) -> anyhow::Result<()> {
    Ok(())
}

/// One line: what is active now, and what waits for a restart.
#[cfg(unix)]
fn describe_reload(reloaded: &ratchet_server::reload::Reloaded) -> String {
    let agents: Vec<&str> = (reloaded.active.agents().iter())
        .map(|a| a.id.as_str())
        .collect();
    let catalog = match agents.len() {
        0 => "no agents".to_owned(),
        n => format!("{n} agents ({})", agents.join(", ")),
    };
    let mut line = format!(
        "reloaded with {catalog}, model {}",
        reloaded.active.run_template().model
    );
    if !reloaded.restart_required.is_empty() {
        line.push_str(&format!(
            "; changed but in force only after a restart: {}",
            reloaded.restart_required.join(", ")
        ));
    }
    line
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
