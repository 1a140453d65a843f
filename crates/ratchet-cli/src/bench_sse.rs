//! `ratchet bench sse`: event delivery over Server-Sent Events, as clients see it.
//!
//! N subscribers follow one session's event stream (one HTTP client, one task each) while R
//! runs are driven in that session, one after another. Reported: events delivered per second
//! (all subscribers' events over the wall time from the first message to the last delivery)
//! and the delivery latency from the event's `created_at` (written with its transaction, ms
//! resolution, the server's clock) to its arrival at the client. Every subscriber also checks
//! that it saw the session's `seq`s without a gap or a duplicate.
//!
//! Without `--server`, an in-process server on 127.0.0.1 with a fresh temporary SQLite
//! database and a scripted model without delays is started, so the bench runs standalone.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ratchet_core::RunStatus;
use ratchet_engine::{PoolConfig, WorkerPool};
use ratchet_server::{Active, AppState, Tokens};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::bench::{percentile, print_report};
use crate::client::{self, Api, ClientError};
use crate::runtime::{Runtime, Schema, Toolbox, open_store};

/// Subscribers connecting at the same time (the rest wait their turn), so a thousand of
/// them do not overflow the server's accept queue at once.
const CONNECTING_AT_ONCE: usize = 64;
/// Time for every subscriber to connect, and for the last event to reach every subscriber
/// once the last run has ended.
const CONNECT_DEADLINE: Duration = Duration::from_secs(60);
const DELIVERY_DEADLINE: Duration = Duration::from_secs(60);

pub struct SseArgs {
    pub server: Option<String>,
    pub token: Option<String>,
    pub subscribers: usize,
    pub runs: usize,
    pub json: bool,
}

/// What one subscriber received.
struct Delivery {
    events: u64,
    latencies_ms: Vec<f64>,
    done_at: Instant,
}

pub async fn sse(args: SseArgs) -> anyhow::Result<ExitCode> {
    if args.subscribers == 0 || args.runs == 0 {
        bail!("--subscribers and --runs must be at least 1");
    }
    let local = match &args.server {
        Some(_) => None,
        None => Some(LocalServer::start().await?),
    };
    let server = match (&args.server, &local) {
        (Some(server), _) => server.clone(),
        (None, Some(local)) => local.url.clone(),
        (None, None) => unreachable!("a local server is started when none is given"),
    };
    let outcome = measure(&args, &server).await;
    if let Some(local) = local {
        local.stop().await;
    }
    let report = outcome?;
    print_report(&report, args.json, || {
        format!(
            "{} subscribers, {} runs: {} events delivered in {:.2} s: {:.0} events/s, delivery latency p50 {:.2} ms, p99 {:.2} ms",
            args.subscribers,
            args.runs,
            report["events"],
            report["seconds"].as_f64().unwrap_or_default(),
            report["events_per_s"].as_f64().unwrap_or_default(),
            report["p50_ms"].as_f64().unwrap_or_default(),
            report["p99_ms"].as_f64().unwrap_or_default(),
        )
    })
}

async fn measure(args: &SseArgs, server: &str) -> anyhow::Result<serde_json::Value> {
    let api = Api::new(server, args.token.clone(), args.subscribers + 8)?;
    let session = api.create_session().await?.id;
    let path = format!("/v1/sessions/{session}/events");

    // Dropping the set (on any error below) aborts every subscriber.
    let mut subscribers = JoinSet::new();
    let (ready, mut readies) = mpsc::channel(args.subscribers);
    let connecting = Arc::new(Semaphore::new(CONNECTING_AT_ONCE));
    for _ in 0..args.subscribers {
        subscribers.spawn(subscribe(
            api.clone(),
            path.clone(),
            args.runs,
            ready.clone(),
            Arc::clone(&connecting),
        ));
    }
    drop(ready);
    let deadline = tokio::time::Instant::now() + CONNECT_DEADLINE;
    for connected in 0..args.subscribers {
        match tokio::time::timeout_at(deadline, readies.recv()).await {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(error))) => {
                bail!("subscriber {connected} could not connect: {error}")
            }
            Ok(None) => bail!("a subscriber ended before connecting"),
            Err(_) => bail!(
                "only {connected} of {} subscribers connected within {CONNECT_DEADLINE:?}",
                args.subscribers
            ),
        }
    }
    if !args.json {
        eprintln!(
            "{} subscribers connected to {}; driving {} runs",
            args.subscribers,
            api.base(),
            args.runs
        );
    }

    let started = Instant::now();
    for i in 0..args.runs {
        let accepted = api
            .send_message(&session, &format!("bench message {i}"))
            .await?;
        let run = client::follow_run(&api, &accepted.run_id, 0, |_| {}).await?;
        if run.status != RunStatus::Completed {
            bail!(
                "run {} ended {} ({}); the benchmark needs runs that complete",
                run.id,
                run.status,
                run.stop_reason.map_or("-".to_owned(), |r| r.to_string())
            );
        }
    }

    let deadline = tokio::time::Instant::now() + DELIVERY_DEADLINE;
    let mut events = 0;
    let mut per_subscriber = None;
    let mut latencies = Vec::new();
    let mut last = started;
    for done in 0..args.subscribers {
        let delivery = match tokio::time::timeout_at(deadline, subscribers.join_next()).await {
            Ok(Some(joined)) => joined.context("a subscriber task failed")??,
            Ok(None) => break,
            Err(_) => bail!(
                "only {done} of {} subscribers received every event within {DELIVERY_DEADLINE:?} after the last run ended",
                args.subscribers
            ),
        };
        if *per_subscriber.get_or_insert(delivery.events) != delivery.events {
            bail!(
                "subscribers received different numbers of events ({} and {})",
                per_subscriber.unwrap_or_default(),
                delivery.events
            );
        }
        events += delivery.events;
        latencies.extend(delivery.latencies_ms);
        last = last.max(delivery.done_at);
    }
    let seconds = (last - started).as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    Ok(json!({
        "server": if args.server.is_some() { api.base() } else { "in-process (temporary SQLite file, scripted model)" },
        "subscribers": args.subscribers,
        "runs": args.runs,
        "events": events,
        "events_per_subscriber": per_subscriber.unwrap_or_default(),
        "seconds": seconds,
        "events_per_s": if seconds > 0.0 { events as f64 / seconds } else { 0.0 },
        "p50_ms": percentile(&latencies, 0.50),
        "p99_ms": percentile(&latencies, 0.99),
        "latency_samples": latencies.len(),
    }))
}

/// One subscriber: connects (signalling `ready` once the server is subscribed), then
/// receives the session's events until `runs` runs have finished.
async fn subscribe(
    api: Api,
    path: String,
    runs: usize,
    ready: mpsc::Sender<Result<(), String>>,
    connecting: Arc<Semaphore>,
) -> Result<Delivery, ClientError> {
    let mut stream = api.follow(&path);
    let opened = {
        let _permit = connecting.acquire().await;
        stream.open().await
    };
    let _ = ready
        .send(opened.as_ref().map_err(ToString::to_string).copied())
        .await;
    drop(ready);
    opened?;
    let mut delivery = Delivery {
        events: 0,
        latencies_ms: Vec::new(),
        done_at: Instant::now(),
    };
    let mut seen = 0;
    let mut finished = 0;
    while finished < runs {
        let event = stream.next().await?;
        let received = now_ms();
        if event.seq != seen + 1 {
            return Err(ClientError::Protocol(format!(
                "event seq {} arrived after seq {seen}",
                event.seq
            )));
        }
        seen = event.seq;
        delivery.events += 1;
        delivery
            .latencies_ms
            .push(received - event.created_at as f64);
        if event.kind == "run.finished" {
            finished += 1;
        }
    }
    delivery.done_at = Instant::now();
    Ok(delivery)
}

/// Milliseconds since the epoch, with a fraction.
fn now_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// A server in this process, for a standalone bench.
struct LocalServer {
    url: String,
    shutdown: CancellationToken,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    pool: WorkerPool,
    _runtime: Runtime,
    _scratch: tempfile::TempDir,
}

impl LocalServer {
    async fn start() -> anyhow::Result<LocalServer> {
        let scratch = tempfile::tempdir().context("cannot create a scratch directory")?;
        let model = crate::bench::scripted_model(
            scratch.path(),
            json!([
                {"text": "Let me add those.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]},
                {"text": "1 + 2 = 3."},
            ]),
        )?;
        let toolbox = Toolbox::new();
        let template = toolbox.run_template(
            &model,
            Some(scratch.path()),
            ratchet_core::Limits::default(),
            &crate::runtime::ToolOverrides::default(),
            ratchet_core::MemoryScope::Session,
        )?;
        let db = format!("sqlite://{}", scratch.path().join("bench.db").display());
        let runtime = Runtime::new(open_store(&db, Schema::Migrate)?, toolbox);
        let pool = runtime.start_workers(PoolConfig::default());
        let shutdown = CancellationToken::new();
        let state = AppState::new(
            Arc::clone(&runtime.coordinator),
            Active::new(template, Vec::new(), Tokens::default()),
            shutdown.clone(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen on 127.0.0.1")?;
        let url = format!("http://{}", listener.local_addr()?);
        let serve = axum::serve(listener, ratchet_server::app(state))
            .with_graceful_shutdown(shutdown.clone().cancelled_owned());
        let server = tokio::spawn(async move { serve.await });
        Ok(LocalServer {
            url,
            shutdown,
            server,
            pool,
            _runtime: runtime,
            _scratch: scratch,
        })
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.server).await;
        self.pool.shutdown().await;
    }
}
