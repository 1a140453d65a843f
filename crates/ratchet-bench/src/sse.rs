//! `ratchet bench sse`: event delivery over Server-Sent Events, as clients see it.
//!
//! N subscribers follow one session's event stream (one HTTP client, one task each) while R
//! runs are driven in that session, one after another. Reported: events delivered per second
//! (all subscribers' events over the wall time from the first message to the last delivery)
//! and the delivery latency from the event's `created_at` (written with its transaction, ms
//! resolution, the server's clock) to its arrival at the client. Every subscriber also checks
//! that it saw the session's `seq`s without a gap or a duplicate.
//!
//! With `--stalled-subscribers M`, it measures what clients that stop reading cost instead: a
//! session's backlog is built up to `--backlog-bytes` with large messages, then M clients ask
//! for its event stream and never read. Reported: the server's resident memory before, at its
//! peak while they hang there, and after they leave (`/proc/PID/status`; the server is this
//! process, or `--server-pid` with `--server`).
//!
//! Without `--server`, an in-process server on 127.0.0.1 with a fresh temporary SQLite
//! database and a scripted model without delays is started, so the bench runs standalone.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ratchet_core::RunStatus;
use ratchet_engine::{PoolConfig, WorkerPool};
use ratchet_server::{Active, AppState, GuardedListener, StreamLimits, Tokens};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::report::{percentile, print_report};
use ratchet::{Runtime, Schema, Toolbox, open_store};
use ratchet_client::{self as client, Api, ClientError};

/// Subscribers connecting at the same time (the rest wait their turn), so a thousand of
/// them do not overflow the server's accept queue at once.
const CONNECTING_AT_ONCE: usize = 64;
/// Time for every subscriber to connect, and for the last event to reach every subscriber
/// once the last run has ended.
const CONNECT_DEADLINE: Duration = Duration::from_secs(60);
const DELIVERY_DEADLINE: Duration = Duration::from_secs(60);

#[derive(Debug, clap::Args)]
pub struct SseArgs {
    /// The server's URL; an in-process server on a temporary database when absent.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// Bearer token for the server.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "RATCHET_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// Clients following the session's event stream at once.
    #[arg(long, required_unless_present = "stalled_subscribers")]
    pub subscribers: Option<usize>,
    /// Runs driven in the session, one after another.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Clients that ask for the session's event stream and never read it.
    #[arg(long, conflicts_with = "subscribers", requires = "backlog_bytes")]
    pub stalled_subscribers: Option<usize>,
    /// The session's backlog the stalled clients ask for, built with 900 KiB messages.
    #[arg(long, requires = "stalled_subscribers")]
    pub backlog_bytes: Option<u64>,
    /// The process of `--server`, whose memory a stalled bench reads.
    #[arg(long, requires = "server")]
    pub server_pid: Option<u32>,
    /// Print the figures as one JSON object.
    #[arg(long)]
    pub json: bool,
}

impl SseArgs {
    /// What stalled clients to measure, when the bench measures them.
    fn stalled(&self) -> Option<StalledArgs> {
        Some(StalledArgs {
            subscribers: self.stalled_subscribers?,
            backlog_bytes: self.backlog_bytes.unwrap_or_default(),
            server_pid: self.server_pid,
        })
    }
}

/// `--stalled-subscribers`, `--backlog-bytes`, `--server-pid`.
struct StalledArgs {
    subscribers: usize,
    backlog_bytes: u64,
    /// The server's process, when it is not this one.
    server_pid: Option<u32>,
}

/// The size of each message that builds a stalled bench's backlog: large, as an attacker's
/// would be, and under the API's body limit.
const BACKLOG_MESSAGE_BYTES: usize = 900 * 1024;
/// How long stalled clients hang on before they leave, and how long the server then has to
/// give their memory back.
const STALLED_FOR: Duration = Duration::from_secs(5);
const AFTER_LEAVING: Duration = Duration::from_secs(3);

/// What one subscriber received.
struct Delivery {
    events: u64,
    latencies_ms: Vec<f64>,
    done_at: Instant,
}

pub async fn sse(args: SseArgs) -> anyhow::Result<ExitCode> {
    match (args.stalled(), args.subscribers) {
        (Some(stalled), None) => {
            if stalled.subscribers == 0 || stalled.backlog_bytes == 0 {
                bail!("--stalled-subscribers and --backlog-bytes must be at least 1");
            }
            if args.server.is_some() && stalled.server_pid.is_none() {
                bail!("--stalled-subscribers with --server needs --server-pid to read its memory");
            }
        }
        (None, Some(subscribers)) => {
            if subscribers == 0 || args.runs == 0 {
                bail!("--subscribers and --runs must be at least 1");
            }
        }
        (Some(_), Some(_)) => bail!("give --subscribers or --stalled-subscribers, not both"),
        (None, None) => bail!("give --subscribers (following clients) or --stalled-subscribers"),
    }
    let room = (args.stalled()).map_or(args.subscribers.unwrap_or_default(), |s| s.subscribers);
    let local = match &args.server {
        Some(_) => None,
        None => Some(LocalServer::start(room).await?),
    };
    let server = match (&args.server, &local) {
        (Some(server), _) => server.clone(),
        (None, Some(local)) => local.url.clone(),
        (None, None) => unreachable!("a local server is started when none is given"),
    };
    let outcome = match args.stalled() {
        Some(stalled) => measure_stalled(&args, &stalled, &server).await,
        None => measure(&args, &server).await,
    };
    if let Some(local) = local {
        local.stop().await;
    }
    let report = outcome?;
    if args.stalled().is_some() {
        return print_report(&report, args.json, || {
            format!(
                "{} stalled subscribers on a {:.1} MB backlog: resident memory {:.0} MB before, {:.0} MB at the peak (+{:.0} MB), {:.0} MB after they left",
                report["stalled_subscribers"],
                report["backlog_bytes"].as_f64().unwrap_or_default() / 1e6,
                report["rss_before_mb"].as_f64().unwrap_or_default(),
                report["rss_peak_mb"].as_f64().unwrap_or_default(),
                report["rss_growth_mb"].as_f64().unwrap_or_default(),
                report["rss_after_mb"].as_f64().unwrap_or_default(),
            )
        });
    }
    print_report(&report, args.json, || {
        format!(
            "{} subscribers, {} runs: {} events delivered in {:.2} s: {:.0} events/s, delivery latency p50 {:.2} ms, p99 {:.2} ms",
            report["subscribers"],
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
    let subscribers = args.subscribers.unwrap_or_default();
    let api = Api::new(server, args.token.clone(), subscribers + 8)?;
    let session = api.create_session(None).await?.id;
    let path = format!("/v1/sessions/{session}/events");

    // Dropping the set (on any error below) aborts every subscriber.
    let mut tasks = JoinSet::new();
    let (ready, mut readies) = mpsc::channel(subscribers);
    let connecting = Arc::new(Semaphore::new(CONNECTING_AT_ONCE));
    for _ in 0..subscribers {
        tasks.spawn(subscribe(
            api.clone(),
            path.clone(),
            args.runs,
            ready.clone(),
            Arc::clone(&connecting),
        ));
    }
    drop(ready);
    let deadline = tokio::time::Instant::now() + CONNECT_DEADLINE;
    for connected in 0..subscribers {
        match tokio::time::timeout_at(deadline, readies.recv()).await {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(error))) => {
                bail!("subscriber {connected} could not connect: {error}")
            }
            Ok(None) => bail!("a subscriber ended before connecting"),
            Err(_) => bail!(
                "only {connected} of {subscribers} subscribers connected within {CONNECT_DEADLINE:?}"
            ),
        }
    }
    if !args.json {
        eprintln!(
            "{subscribers} subscribers connected to {}; driving {} runs",
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
    for done in 0..subscribers {
        let delivery = match tokio::time::timeout_at(deadline, tasks.join_next()).await {
            Ok(Some(joined)) => joined.context("a subscriber task failed")??,
            Ok(None) => break,
            Err(_) => bail!(
                "only {done} of {subscribers} subscribers received every event within {DELIVERY_DEADLINE:?} after the last run ended"
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
        "subscribers": subscribers,
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

/// Builds a session's backlog of at least `backlog_bytes` (as a client reads it), then holds
/// `subscribers` connections that ask for its event stream and read nothing, sampling the
/// server's resident memory while they hang there and after they leave.
async fn measure_stalled(
    args: &SseArgs,
    stalled: &StalledArgs,
    server: &str,
) -> anyhow::Result<serde_json::Value> {
    let pid = stalled.server_pid.unwrap_or_else(std::process::id);
    let api = Api::new(server, args.token.clone(), 8)?;
    let session = api.create_session(None).await?.id;
    let path = format!("/v1/sessions/{session}/events");
    let large = "x".repeat(BACKLOG_MESSAGE_BYTES);
    let mut backlog = Backlog::default();
    while backlog.bytes < stalled.backlog_bytes {
        let accepted = api.send_message(&session, &large).await?;
        let run = client::follow_run(&api, &accepted.run_id, 0, |_| {}).await?;
        if run.status != RunStatus::Completed {
            bail!(
                "run {} ended {}; the benchmark needs runs that complete",
                run.id,
                run.status
            );
        }
        backlog = Backlog::read(&api, &format!("{path}?follow=false")).await?;
    }
    if !args.json {
        eprintln!(
            "backlog of {} events, {:.1} MB; {} clients will ask for it and read nothing",
            backlog.events,
            backlog.bytes as f64 / 1e6,
            stalled.subscribers
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = resident_mb(pid)?;
    let address = api
        .base()
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let mut authorization = String::new();
    if let Some(token) = &args.token {
        authorization = format!("Authorization: Bearer {token}\r\n");
    }
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\n{authorization}\r\n");
    let mut clients = Vec::with_capacity(stalled.subscribers);
    let mut peak = before;
    for _ in 0..stalled.subscribers {
        let mut client = tokio::net::TcpStream::connect(&address)
            .await
            .with_context(|| format!("cannot connect to {address}"))?;
        client.write_all(request.as_bytes()).await?;
        clients.push(client);
        peak = peak.max(resident_mb(pid)?);
    }
    let until = Instant::now() + STALLED_FOR;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        peak = peak.max(resident_mb(pid)?);
    }
    // Peeked, not read: the status line stays in the socket and nothing unstalls.
    let mut accepted = 0;
    for client in &clients {
        let mut status = [0; 12];
        if client.peek(&mut status).await? == status.len() && &status == b"HTTP/1.1 200" {
            accepted += 1;
        }
    }
    if accepted != clients.len() {
        bail!(
            "only {accepted} of {} stalled clients were given the stream; raise [limits] max_streams_per_tenant",
            clients.len()
        );
    }
    drop(clients);
    tokio::time::sleep(AFTER_LEAVING).await;
    let after = resident_mb(pid)?;
    Ok(json!({
        "server": if args.server.is_some() { api.base() } else { "in-process (temporary SQLite file, scripted model)" },
        "stalled_subscribers": stalled.subscribers,
        "backlog_bytes": backlog.bytes,
        "backlog_events": backlog.events,
        "rss_before_mb": before,
        "rss_peak_mb": peak,
        "rss_growth_mb": peak - before,
        "rss_after_mb": after,
        "stalled_for_s": STALLED_FOR.as_secs_f64(),
    }))
}

/// A session's backlog as a client reads it.
#[derive(Default)]
struct Backlog {
    events: u64,
    /// The events' `data` as sent.
    bytes: u64,
}

impl Backlog {
    /// Reads `path` (a stream that ends by itself) a chunk at a time, so that the bench, which
    /// may share the server's process, holds no copy of it.
    async fn read(api: &Api, path: &str) -> anyhow::Result<Backlog> {
        let mut response = api
            .request(reqwest::Method::GET, path)
            .send()
            .await?
            .error_for_status()?;
        let mut backlog = Backlog::default();
        let mut line = Vec::new();
        while let Some(chunk) = response.chunk().await? {
            for &byte in chunk.iter() {
                if byte != b'\n' {
                    line.push(byte);
                    continue;
                }
                if line.starts_with(b"id: ") {
                    backlog.events += 1;
                } else if let Some(data) = line.strip_prefix(b"data: ") {
                    backlog.bytes += data.len() as u64;
                }
                line.clear();
            }
        }
        Ok(backlog)
    }
}

/// The resident memory of process `pid` in MB (`VmRSS`).
fn resident_mb(pid: u32) -> anyhow::Result<f64> {
    Ok(crate::report::process_memory_bytes(pid, "VmRSS")? as f64 / 1e6)
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
    /// `room`: the event streams the bench opens, which the server allows beside a few of its
    /// own even past its default limits.
    async fn start(room: usize) -> anyhow::Result<LocalServer> {
        let scratch = tempfile::tempdir().context("cannot create a scratch directory")?;
        let model = crate::report::scripted_model(
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
            &ratchet::ToolOverrides::default(),
            ratchet_core::MemoryScope::Session,
        )?;
        let db = format!("sqlite://{}", scratch.path().join("bench.db").display());
        let runtime = Runtime::new(open_store(&db, Schema::Migrate)?, toolbox);
        let pool = runtime.start_workers(PoolConfig::default());
        let shutdown = CancellationToken::new();
        let defaults = ratchet::Config::default().limits()?;
        let streams = StreamLimits {
            max_streams: defaults.streams.max_streams.max(room + 8),
            max_streams_per_tenant: defaults.streams.max_streams_per_tenant.max(room + 8),
        };
        let state = AppState::new(
            Arc::clone(&runtime.coordinator),
            Arc::clone(&runtime.webhooks),
            Active::new(template, Vec::new(), Tokens::default()),
            shutdown.clone(),
        )
        .with_stream_limits(streams);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen on 127.0.0.1")?;
        let listener = GuardedListener::new(listener, defaults.stream_stall);
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
