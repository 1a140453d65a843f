//! `ratchet serve`: the HTTP API and the worker pool in one process, with a graceful
//! shutdown on SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use ratchet_core::Limits;
use ratchet_engine::PoolConfig;
use ratchet_server::{AppState, Config};
use tokio_util::sync::CancellationToken;

use crate::runtime::{Runtime, ToolOverrides, Toolbox, open_store};

/// How long in-flight steps get to commit after a shutdown signal; what is still running
/// then is left to lease expiry and taken over by the next process.
const GRACE: Duration = Duration::from_secs(10);

pub struct ServeArgs {
    pub config: Option<PathBuf>,
    pub db: Option<String>,
    pub listen: Option<String>,
    pub model: Option<String>,
    pub workspace: Option<PathBuf>,
}

/// File, then `RATCHET_*` environment, then flags.
fn settings(args: &ServeArgs) -> anyhow::Result<Config> {
    let file = Config::load_or_default(args.config.as_deref())?;
    let mut config = file.with_env(|key| std::env::var(key).ok())?;
    if let Some(db) = &args.db {
        config.db = Some(db.clone());
    }
    if let Some(listen) = &args.listen {
        config.listen = Some(listen.clone());
    }
    if let Some(model) = &args.model {
        config.model = Some(model.clone());
    }
    if let Some(workspace) = &args.workspace {
        config.workspace = Some(workspace.display().to_string());
    }
    Ok(config)
}

pub async fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let config = settings(&args)?;
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
    let toolbox = Toolbox::with_mcp(&config.mcp)
        .await?
        .with_profiles(config.models.clone())?;
    let template = toolbox.run_template(
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
    let db = config.db.as_deref().unwrap_or("sqlite://ratchet.db");
    let runtime = Runtime::new(open_store(db)?, toolbox);
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("cannot listen on {address}"))?;
    let pool = runtime.recover_and_start(PoolConfig::default()).await?;
    let shutdown = CancellationToken::new();
    let state = AppState::new(
        runtime.coordinator.clone(),
        template,
        tokens,
        shutdown.clone(),
    );
    let app = ratchet_server::app(state);
    eprintln!(
        "ratchet listening on http://{} (database {db}{})",
        listener.local_addr()?,
        if config.tokens.is_empty() {
            ", no authentication"
        } else {
            ""
        }
    );
    let signalled = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        eprintln!("shutting down: no new steps; in-flight steps get {GRACE:?} to commit");
        signalled.cancel();
    });
    // Workers stop claiming the moment the signal arrives, while HTTP winds down beside them.
    let workers = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            shutdown.cancelled().await;
            tokio::time::timeout(GRACE, pool.shutdown()).await.is_ok()
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
