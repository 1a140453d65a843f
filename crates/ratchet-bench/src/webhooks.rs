//! `ratchet bench steps --webhook answering|hanging`: the same runs with a webhook receiving
//! every event, from an in-process receiver that answers at once or never. It shows what a
//! webhook costs the steps (compare steps/s with `--webhook none`) and, when the receiver
//! answers, how fast and how late the deliveries follow the commits.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use ratchet_core::{SessionId, WebhookId};
use ratchet_store::{DEFAULT_TENANT, Deliveries, NewWebhook, Reads, WebhookAdmin};
use ratchet_webhooks::{DispatcherConfig, WebhookPolicy};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::report::percentile;

/// How long the deliveries may take to catch up once the runs have ended.
const CATCH_UP: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WebhookLoad {
    None,
    /// A receiver that answers 204 at once.
    Answering,
    /// A receiver that never answers: every attempt hangs until its timeout.
    Hanging,
}

/// A webhook on the benchmark's tenant, its receiver and its dispatcher.
pub struct Observer {
    load: WebhookLoad,
    events: Option<Vec<String>>,
    received: Arc<Mutex<Received>>,
    stop: CancellationToken,
}

#[derive(Default)]
struct Received {
    /// Attempts that arrived, answered or not.
    arrived: u64,
    /// Per answered delivery: how long after its event was committed it arrived (ms).
    lags_ms: Vec<f64>,
    first: Option<Instant>,
    last: Option<Instant>,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Starts the receiver and the dispatcher and creates the webhook, sent the event kinds
/// `events` names (every kind when None); None for `--webhook none`.
pub async fn attach(
    load: WebhookLoad,
    events: Option<Vec<String>>,
    webhooks: &dyn WebhookAdmin,
    deliveries: Arc<dyn Deliveries>,
) -> anyhow::Result<Option<Observer>> {
    if load == WebhookLoad::None {
        return Ok(None);
    }
    let unknown: Vec<&String> = (events.iter().flatten())
        .filter(|kind| ratchet_core::EventKind::parse(kind).is_none())
        .collect();
    if !unknown.is_empty() {
        bail!("--webhook-events: unknown event kinds {unknown:?}");
    }
    let received: Arc<Mutex<Received>> = Arc::default();
    let stop = CancellationToken::new();
    let hangs = load == WebhookLoad::Hanging;
    let app = axum::Router::new()
        .route(
            "/hook",
            axum::routing::post(
                move |axum::extract::State(received): axum::extract::State<
                    Arc<Mutex<Received>>,
                >,
                      body: String| async move {
                    let lag = serde_json::from_str::<Value>(&body)
                        .ok()
                        .and_then(|delivery| delivery["event"]["created_at"].as_i64())
                        .map(|created_at| (now_ms() - created_at) as f64);
                    {
                        let mut received = received.lock().expect("bench receiver");
                        received.arrived += 1;
                        if !hangs {
                            let now = Instant::now();
                            received.first.get_or_insert(now);
                            received.last = Some(now);
                            received.lags_ms.extend(lag);
                        }
                    }
                    if hangs {
                        std::future::pending::<()>().await;
                    }
                    axum::http::StatusCode::NO_CONTENT
                },
            ),
        )
        .with_state(Arc::clone(&received));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot start the benchmark's webhook receiver")?;
    let url = format!("http://{}/hook", listener.local_addr()?);
    let serving = stop.clone();
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(serving.cancelled_owned())
            .await
    });
    let id = WebhookId::from_suffix(&uuid::Uuid::now_v7().to_string())?;
    webhooks
        .create_webhook(
            NewWebhook {
                id,
                tenant: DEFAULT_TENANT.to_owned(),
                url,
                events: events.clone(),
                secret: "a-benchmark-webhook-secret".to_owned(),
                max_attempts: 10,
                request: None,
            },
            now_ms(),
        )
        .await?;
    // The receiver is this process's, on loopback.
    let dispatch = DispatcherConfig {
        policy: WebhookPolicy::default().loopback_allowed(true),
        ..DispatcherConfig::default()
    };
    ratchet_webhooks::spawn(deliveries, dispatch, stop.clone())?;
    Ok(Some(Observer {
        load,
        events,
        received,
        stop,
    }))
}

impl Observer {
    /// Once the runs have ended: waits for every event of `sessions` to be delivered (an
    /// answering receiver) and reports the deliveries.
    pub async fn finish(self, store: &dyn Reads, sessions: &[SessionId]) -> anyhow::Result<Value> {
        let report = match self.load {
            WebhookLoad::Answering => {
                let mut events = 0u64;
                for session in sessions {
                    let mut after = 0;
                    loop {
                        let page = store.events_after(session, after, 1000).await?;
                        let Some(last) = page.last() else { break };
                        after = last.seq;
                        events += page
                            .iter()
                            .filter(|e| {
                                self.events
                                    .as_ref()
                                    .is_none_or(|kinds| kinds.contains(&e.kind))
                            })
                            .count() as u64;
                    }
                }
                let started = Instant::now();
                while (self.received.lock().expect("bench receiver").lags_ms.len() as u64) < events
                {
                    if started.elapsed() > CATCH_UP {
                        bail!(
                            "the webhook had not received all {events} events {} s after the runs ended",
                            CATCH_UP.as_secs()
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let received = self.received.lock().expect("bench receiver");
                let mut lags = received.lags_ms.clone();
                lags.sort_by(f64::total_cmp);
                let span = match (received.first, received.last) {
                    (Some(first), Some(last)) => (last - first).as_secs_f64(),
                    _ => 0.0,
                };
                json!({
                    "receiver": "answering",
                    "deliveries": lags.len(),
                    "deliveries_per_s": if span > 0.0 { lags.len() as f64 / span } else { 0.0 },
                    "lag_p50_ms": percentile(&lags, 0.50),
                    "lag_p99_ms": percentile(&lags, 0.99),
                })
            }
            WebhookLoad::Hanging => {
                let received = self.received.lock().expect("bench receiver");
                json!({
                    "receiver": "hanging",
                    "attempts_in_flight": received.arrived,
                    "deliveries": 0,
                })
            }
            WebhookLoad::None => Value::Null,
        };
        self.stop.cancel();
        Ok(report)
    }
}
