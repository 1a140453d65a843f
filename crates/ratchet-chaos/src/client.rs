//! The clients: one task per session sends its runs' messages, follows the session's event
//! stream (reconnecting with `Last-Event-ID` whenever the server dies), answers approvals and
//! reconciliations the way a person would, and cancels some runs. Every event it receives is
//! kept in its log, which the checks later hold against the database.
//!
//! A request that dies with the server is retried when that is safe; a message is first looked
//! for among the session's runs, since its first attempt may have committed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use ratchet_core::RunId;
use ratchet_llm::sse::SseParser;
use ratchet_store::Reads;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::mcp_log;
use crate::model::ModelState;
use crate::plan::{MCP_SERVER, Plan};

/// An event as a client received it.
#[derive(Debug, Clone)]
pub struct ClientEvent {
    pub seq: i64,
    pub kind: String,
    pub run_id: Option<String>,
    pub payload: Value,
}

/// The runs one client drives in one session.
#[derive(Debug, Clone)]
pub struct SessionPlan {
    /// The catalog agent the session is of (the dispatcher), or the server's model.
    pub agent: Option<&'static str>,
    pub plans: Vec<Plan>,
}

/// What one session's client saw and did.
#[derive(Debug, Default)]
pub struct SessionLog {
    pub session_id: String,
    /// The session's runs delegate in the background: its inbox is checked.
    pub delegating: bool,
    pub events: Vec<ClientEvent>,
    pub runs: Vec<RunLog>,
    /// Messages sent with `multitask: "interrupt"`.
    pub interrupts: usize,
    /// Messages sent again under their `Idempotency-Key` because no answer came back.
    pub message_resends: usize,
    /// Messages whose answer was a kept response (`Idempotent-Replayed`), not a new run.
    pub message_replays: usize,
    /// Things the client saw go wrong (a run that never finished, a 5xx).
    pub problems: Vec<String>,
}

/// A keyed POST's answer.
#[derive(Debug)]
pub struct Sent {
    pub answer: Value,
    /// How many times it was sent again after no answer came.
    pub resends: usize,
    /// Whether the answer was a kept response or a recorded effect's.
    pub replayed: bool,
}

#[derive(Debug)]
pub struct RunLog {
    pub run_id: String,
    pub tag: String,
    /// The user message that started it.
    pub message: String,
    /// The run's frozen configuration as first read from the database.
    pub config_at_start: Value,
    pub finished: bool,
    /// The calls this client reconciled, each with when it first sent the answer: no answer
    /// can have been committed before then.
    pub reconciled: Vec<(String, Instant)>,
}

/// What every client shares.
pub struct Clients {
    pub api: String,
    pub http: reqwest::Client,
    pub stream_http: reqwest::Client,
    pub store: Arc<dyn Reads>,
    pub model: ModelState,
    /// Where the runs' tools write (to reconcile appends).
    pub workspace: PathBuf,
    /// Where the chaos MCP server records the calls it executed (to reconcile its calls).
    pub mcp_log: PathBuf,
    /// No client waits past this: a run still going then is stranded.
    pub deadline: Instant,
}

impl Clients {
    pub fn new(
        api: String,
        store: Arc<dyn Reads>,
        model: ModelState,
        workspace: PathBuf,
        mcp_log: PathBuf,
        deadline: Instant,
    ) -> anyhow::Result<Clients> {
        Ok(Clients {
            api,
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(20))
                .build()?,
            stream_http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(2))
                .build()?,
            store,
            model,
            workspace,
            mcp_log,
            deadline,
        })
    }

    /// Runs the session's plans one after the other in a new session.
    pub async fn drive_session(self: Arc<Self>, session: SessionPlan) -> SessionLog {
        let mut log = SessionLog {
            delegating: session.agent.is_some(),
            ..SessionLog::default()
        };
        if let Err(error) = self.drive(&session, &mut log).await {
            log.problems.push(format!(
                "session {}: {error:#}",
                if log.session_id.is_empty() {
                    "(not created)"
                } else {
                    &log.session_id
                }
            ));
        }
        log
    }

    async fn drive(
        self: &Arc<Self>,
        session: &SessionPlan,
        log: &mut SessionLog,
    ) -> anyhow::Result<()> {
        let body = match session.agent {
            Some(agent) => json!({"agent": agent}),
            None => json!({}),
        };
        let created = self
            .retrying(Method::POST, "/v1/sessions", Some(body))
            .await?;
        log.session_id = text(&created, "id")?;
        let (events, mut received) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let _stop_following = stop.clone().drop_guard();
        tokio::spawn(follow(
            self.stream_http.clone(),
            format!("{}/v1/sessions/{}/events", self.api, log.session_id),
            events,
            stop,
        ));
        for plan in &session.plans {
            let run_id = self.start_run(plan, "enqueue", log).await?;
            if let Some(after) = plan.cancel_after_ms {
                let (client, run_id) = (Arc::clone(self), run_id.clone());
                tokio::spawn(async move {
                    client
                        .cancel_later(run_id, Duration::from_millis(after))
                        .await;
                });
            }
            // The runs this turn waits for: the plan's, and the one that interrupts it.
            let mut waiting = vec![run_id];
            let mut interrupt_at = plan
                .interrupt_after_ms
                .map(|after| tokio::time::Instant::now() + Duration::from_millis(after));
            while !waiting.is_empty() || interrupt_at.is_some() {
                let wait = self.deadline.saturating_duration_since(Instant::now());
                let received = tokio::select! {
                    received = tokio::time::timeout(wait, received.recv()) => received,
                    () = sleep_until(interrupt_at) => {
                        interrupt_at = None;
                        waiting.push(self.start_run(&plan.interrupting(), "interrupt", log).await?);
                        log.interrupts += 1;
                        continue;
                    }
                };
                let Ok(Some(event)) = received else {
                    bail!("runs {waiting:?} did not finish by the deadline (stranded)");
                };
                log.events.push(event.clone());
                let Some(run_id) = (event.run_id.clone()).filter(|run| waiting.contains(run))
                else {
                    continue;
                };
                match event.kind.as_str() {
                    "approval.required" => self.decide(&event.payload).await?,
                    "reconciliation.required" => {
                        let run = (log.runs.iter_mut())
                            .find(|run| run.run_id == run_id)
                            .context("the run being driven")?;
                        self.reconcile(&run_id, &event.payload, &mut run.reconciled)
                            .await?;
                    }
                    "run.finished" => {
                        waiting.retain(|run| *run != run_id);
                        if let Some(run) = log.runs.iter_mut().find(|run| run.run_id == run_id) {
                            run.finished = true;
                        }
                    }
                    _ => {}
                }
            }
        }
        if log.delegating {
            self.settle(&mut received, log).await?;
        }
        Ok(())
    }

    /// Sends a plan's message and records its run; the model learns the plan (and its
    /// helpers') first.
    async fn start_run(
        &self,
        plan: &Plan,
        multitask: &str,
        log: &mut SessionLog,
    ) -> anyhow::Result<String> {
        self.model.add_plan(plan);
        let message = plan.user_message();
        let run_id = self.send_message(plan, &message, multitask, log).await?;
        let config_at_start = self.frozen_config(&run_id).await?;
        log.runs.push(RunLog {
            run_id: run_id.clone(),
            tag: plan.tag.clone(),
            message,
            config_at_start,
            finished: false,
            reconciled: Vec::new(),
        });
        Ok(run_id)
    }

    /// Waits for the session's background work to be told: no run active, and every report
    /// of its inbox consumed or dead-lettered. The events meanwhile are logged.
    async fn settle(
        &self,
        received: &mut mpsc::UnboundedReceiver<ClientEvent>,
        log: &mut SessionLog,
    ) -> anyhow::Result<()> {
        let session = &log.session_id;
        loop {
            while let Ok(event) = received.try_recv() {
                log.events.push(event);
            }
            let state = self
                .retrying(Method::GET, &format!("/v1/sessions/{session}"), None)
                .await?;
            let inbox = self
                .retrying(
                    Method::GET,
                    &format!("/v1/sessions/{session}/inbox?limit=200"),
                    None,
                )
                .await?;
            let open = (inbox["items"].as_array().into_iter().flatten())
                .filter(|item| !matches!(item["status"].as_str(), Some("consumed" | "dead_letter")))
                .count();
            if state["active_run_id"].is_null() && open == 0 {
                return Ok(());
            }
            if Instant::now() >= self.deadline {
                bail!(
                    "the session's background work was not told by the deadline: {open} reports open, active run {}",
                    state["active_run_id"]
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Sends a plan's message under an `Idempotency-Key` of its own, and sends it again under
    /// the same key until an answer comes back: when the server died meanwhile, the message
    /// may have committed, and the key makes the repeat answer with its run instead of
    /// starting another (the checks hold the session to one run per message).
    async fn send_message(
        &self,
        plan: &Plan,
        message: &str,
        multitask: &str,
        log: &mut SessionLog,
    ) -> anyhow::Result<String> {
        let path = format!("/v1/sessions/{}/messages", log.session_id);
        let body = json!({"content": message, "multitask": multitask});
        let sent = self
            .keyed_post(&path, &format!("message-{}", plan.tag), &body)
            .await?;
        log.message_resends += sent.resends;
        log.message_replays += usize::from(sent.replayed);
        text(&sent.answer, "run_id")
    }

    /// POSTs `body` under `key`, and again under the same key until an answer comes back:
    /// a connection lost with a killed process, or a key its dead holder still holds, is sent
    /// again. A refusal is an error.
    pub async fn keyed_post(&self, path: &str, key: &str, body: &Value) -> anyhow::Result<Sent> {
        let mut resends = 0;
        loop {
            let request = (self.http.post(format!("{}{path}", self.api)))
                .header("idempotency-key", key)
                .json(body);
            let answered = match request.send().await {
                Ok(response) => {
                    let (status, replayed) = (
                        response.status(),
                        response.headers().contains_key("idempotent-replayed"),
                    );
                    response
                        .bytes()
                        .await
                        .ok()
                        .map(|bytes| (status, replayed, bytes))
                }
                Err(_) => None,
            };
            let Some((status, replayed, bytes)) = answered else {
                if Instant::now() >= self.deadline {
                    bail!("POST {path} got no answer by the deadline");
                }
                resends += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let answer: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            if status == StatusCode::CONFLICT && answer["error"]["code"] == "request_in_progress" {
                // The process that took the key died before answering: its hold runs out.
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            if !status.is_success() {
                bail!("POST {path}: {status} {answer}");
            }
            return Ok(Sent {
                answer,
                resends,
                replayed,
            });
        }
    }

    /// Every webhook of the (default) tenant.
    pub async fn webhooks(&self) -> anyhow::Result<Vec<Value>> {
        let listed = self.retrying(Method::GET, "/v1/webhooks", None).await?;
        Ok(listed["items"].as_array().cloned().unwrap_or_default())
    }

    /// Creates a schedule; its id.
    pub async fn create_schedule(&self, body: &Value) -> anyhow::Result<String> {
        let created = self
            .retrying(Method::POST, "/v1/schedules", Some(body.clone()))
            .await?;
        text(&created, "id")
    }

    /// Pauses the schedule, then waits until every run it fired has ended.
    pub async fn settle_schedule(&self, id: &str) -> anyhow::Result<()> {
        self.retrying(Method::POST, &format!("/v1/schedules/{id}/pause"), None)
            .await?;
        loop {
            let runs = self.store.list_runs().await?;
            let open = (runs.iter())
                .filter(|r| r.schedule_id.as_ref().is_some_and(|s| s.as_str() == id))
                .filter(|r| !r.status.is_terminal())
                .count();
            if open == 0 {
                return Ok(());
            }
            if Instant::now() >= self.deadline {
                bail!("{open} runs of schedule {id} had not ended by the deadline");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn frozen_config(&self, run_id: &str) -> anyhow::Result<Value> {
        let id = RunId::parse(run_id).map_err(|e| anyhow!("run id {run_id:?}: {e}"))?;
        let state = self.store.load_state(&id).await?;
        Ok(serde_json::to_value(&*state.config)?)
    }

    async fn cancel_later(&self, run_id: String, after: Duration) {
        tokio::time::sleep(after).await;
        let path = format!("/v1/runs/{run_id}/cancel");
        // A cancel of a run that already ended is refused with 409: nothing to do.
        let _ = self
            .retrying_status(Method::POST, &path, Some(json!({})))
            .await;
    }

    /// Answers an approval the same way every time it is asked (a retry after a crash must
    /// not change its mind): mostly approve, sometimes deny, rarely abort the run.
    async fn decide(&self, payload: &Value) -> anyhow::Result<()> {
        let approval_id = text(payload, "approval_id")?;
        let body = match stable_hash(&approval_id) % 10 {
            9 => json!({"abort": true}),
            choice => {
                let decision = if choice < 7 { "approve" } else { "deny" };
                let decisions: Vec<Value> = payload["calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|call| call["needs_approval"] == true)
                    .map(|call| json!({"call_id": call["call_id"], "decision": decision}))
                    .collect();
                json!({"decisions": decisions})
            }
        };
        self.answer(&format!("/v1/approvals/{approval_id}"), body)
            .await
    }

    /// Says what happened to each call whose outcome is unknown (a crash, a timeout, a
    /// dropped connection), as an operator would: the effect is looked up where it would be
    /// (the line in its workspace file, the call's key in the MCP server's record). One that
    /// happened succeeded; one that did not is skipped or failed — never run again.
    async fn reconcile(
        &self,
        run_id: &str,
        payload: &Value,
        reconciled: &mut Vec<(String, Instant)>,
    ) -> anyhow::Result<()> {
        let calls = payload["request"]["calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for call in calls {
            let call_id = text(&call, "call_id")?;
            let body = if self.effect_happened(&call)? {
                json!({"call_id": call_id, "outcome": "succeeded",
                       "result": "the effect is there"})
            } else if stable_hash(&call_id).is_multiple_of(2) {
                json!({"call_id": call_id, "outcome": "skip"})
            } else {
                json!({"call_id": call_id, "outcome": "failed",
                       "result": "the effect is not there; not done again"})
            };
            reconciled.push((call_id, Instant::now()));
            self.answer(&format!("/v1/runs/{run_id}/reconcile"), body)
                .await?;
        }
        Ok(())
    }

    fn effect_happened(&self, call: &Value) -> anyhow::Result<bool> {
        if call["tool"]
            .as_str()
            .is_some_and(|tool| tool.starts_with(&format!("{MCP_SERVER}.")))
        {
            let key = text(call, "idempotency_key")?;
            return Ok(mcp_log::executed(&self.mcp_log, &key)?);
        }
        let arguments = &call["arguments"];
        let (Some(path), Some(line)) = (arguments["path"].as_str(), arguments["line"].as_str())
        else {
            return Ok(false);
        };
        Ok(std::fs::read_to_string(self.workspace.join(path))
            .is_ok_and(|text| text.lines().any(|l| l == line)))
    }

    /// A human's answer: 409 means it was already given (by an attempt that died with the
    /// server after it committed) or the run has ended meanwhile (a cancel).
    async fn answer(&self, path: &str, body: Value) -> anyhow::Result<()> {
        match self.retrying_status(Method::POST, path, Some(body)).await? {
            (status, _) if status.is_success() || status == StatusCode::CONFLICT => Ok(()),
            (status, body) => bail!("POST {path}: {status} {body}"),
        }
    }

    async fn retrying(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        match self.retrying_status(method.clone(), path, body).await? {
            (status, body) if status.is_success() => Ok(body),
            (status, body) => bail!("{method} {path}: {status} {body}"),
        }
    }

    /// Repeats a request the server may not have received until it answers.
    async fn retrying_status(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<(StatusCode, Value)> {
        loop {
            match self.send(method.clone(), path, body.as_ref()).await {
                Ok(answer) => return Ok(answer),
                Err(error) if Instant::now() >= self.deadline => {
                    return Err(
                        anyhow!(error).context(format!("{method} {path} until the deadline"))
                    );
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Value), reqwest::Error> {
        let mut request = self.http.request(method, format!("{}{path}", self.api));
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await?;
        let status = response.status();
        let bytes = response.bytes().await?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Follows a session's events until `stop`, reconnecting with `Last-Event-ID` after every
/// broken connection; forwards every event as received (checks judge the order later).
async fn follow(
    http: reqwest::Client,
    url: String,
    events: mpsc::UnboundedSender<ClientEvent>,
    stop: CancellationToken,
) {
    let mut last_seq = 0i64;
    while !stop.is_cancelled() {
        let request = http
            .get(&url)
            .header("Last-Event-ID", last_seq.to_string())
            .send();
        let response = tokio::select! {
            () = stop.cancelled() => return,
            response = request => response,
        };
        if let Ok(mut response) = response
            && response.status().is_success()
        {
            let mut parser = SseParser::default();
            loop {
                let chunk = tokio::select! {
                    () = stop.cancelled() => return,
                    chunk = response.chunk() => chunk,
                };
                let Ok(Some(bytes)) = chunk else { break };
                for event in parser.feed(&bytes) {
                    let Some(event) = parse_event(&event.data) else {
                        continue;
                    };
                    last_seq = event.seq;
                    if events.send(event).is_err() {
                        return;
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn parse_event(data: &str) -> Option<ClientEvent> {
    let value: Value = serde_json::from_str(data).ok()?;
    Some(ClientEvent {
        seq: value["seq"].as_i64()?,
        kind: value["kind"].as_str()?.to_owned(),
        run_id: value["run_id"].as_str().map(str::to_owned),
        payload: value["payload"].clone(),
    })
}

fn text(value: &Value, field: &str) -> anyhow::Result<String> {
    value[field]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("expected a string `{field}` in {value}"))
}

/// FNV-1a: stable across processes and runs, unlike the standard library's hasher.
fn stable_hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
