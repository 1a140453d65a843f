//! Approvals at the terminal: `ratchet run` and `ratchet chat` ask a person about a gated
//! tool batch, and `ratchet approvals list|decide` answer from anywhere.

use std::collections::HashSet;
use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, bail};
use ratchet_core::{
    ApprovalAnswer, ApprovalCall, ApprovalId, CallDecision, HumanRequest, RunStatus, Verdict,
};
use ratchet_store::{ApprovalStatus, DEFAULT_TENANT};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use ratchet::open_existing_store;
use ratchet_client::{Api, ClientError, EventView, IDLE_CHECK, LiveView, RunView, Streamed};

/// Lines of stdin, read on their own thread: a blocking read never holds up the runtime,
/// and one still pending when the command ends does not delay the exit.
pub fn stdin_lines() -> mpsc::Receiver<std::io::Result<String>> {
    let (sender, receiver) = mpsc::channel(1);
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let failed = line.is_err();
            if sender.blocking_send(line).is_err() || failed {
                break;
            }
        }
    });
    receiver
}

/// Shows the gated batch and asks what to do until the answer is one it understands. None
/// when stdin has ended: nobody is there to answer.
pub async fn ask(
    id: &ApprovalId,
    calls: &[ApprovalCall],
    lines: &mut mpsc::Receiver<std::io::Result<String>>,
) -> anyhow::Result<Option<ApprovalAnswer>> {
    let mut err = std::io::stderr();
    writeln!(err, "approval {id}: the agent asks to run")?;
    for call in calls {
        let why = if call.needs_approval {
            "needs approval"
        } else {
            "held with its batch"
        };
        writeln!(
            err,
            "  [{}] {} {} ({why})",
            call.call_id, call.tool, call.arguments
        )?;
    }
    loop {
        write!(err, "run them? [y]es, [n]o (deny all), [a]bort the run: ")?;
        err.flush()?;
        let Some(line) = lines.recv().await else {
            writeln!(err)?;
            return Ok(None);
        };
        let line = line.context("cannot read the answer from stdin")?;
        let everything = |decision| {
            ApprovalAnswer::Decisions(
                calls
                    .iter()
                    .map(|c| CallDecision {
                        call_id: c.call_id.clone(),
                        decision,
                        note: None,
                    })
                    .collect(),
            )
        };
        match line.trim().to_ascii_lowercase().as_str() {
            "y" | "yes" => return Ok(Some(everything(Verdict::Approve))),
            "n" | "no" => return Ok(Some(everything(Verdict::Deny))),
            "a" | "abort" => return Ok(Some(ApprovalAnswer::Abort)),
            other => writeln!(err, "{other:?} is not an answer; type y, n or a")?,
        }
    }
}

/// Follows a run and every run below it on a server (`/v1/runs/{id}/tree/events`) until the
/// run ends or waits for something other than its children. Whenever a run of the tree asks
/// for an approval, the person at stdin is asked and the answer sent. Returns the run when it
/// has ended, is paused, waits for something else (a reconciliation), or nobody answered.
pub async fn follow_answering(
    api: &Api,
    run_id: &str,
    lines: &mut mpsc::Receiver<std::io::Result<String>>,
    mut on_event: impl FnMut(&EventView),
    mut on_live: impl FnMut(&LiveView),
) -> anyhow::Result<RunView> {
    let mut events = api.follow(&format!("/v1/runs/{run_id}/tree/events"));
    // Approvals asked about here: each is asked once, however often it is seen.
    let mut asked: HashSet<String> = HashSet::new();
    loop {
        let settled = match tokio::time::timeout(IDLE_CHECK, events.next_streamed()).await {
            Ok(streamed) => match streamed? {
                Streamed::Live(activity) => {
                    on_live(&activity);
                    continue;
                }
                Streamed::Stored(event) => {
                    on_event(&event);
                    if let Some((id, calls)) = requested(&event)
                        && !answer(api, &id, &calls, lines, &mut asked).await?
                    {
                        return Ok(api.get_run(run_id).await?);
                    }
                    event.depth == 0 && settles(&event)
                }
            },
            // Silence: ask for the run's state rather than trust the stream blindly.
            Err(_) => true,
        };
        if !settled {
            continue;
        }
        let run = api.get_run(run_id).await?;
        match run.status {
            RunStatus::WaitingHuman => {
                let Some((id, calls)) = run.pending_human.as_ref().and_then(HumanRequest::approval)
                else {
                    return Ok(run);
                };
                if !answer(api, id, calls, lines, &mut asked).await? {
                    return Ok(run);
                }
            }
            status if status.is_terminal() || status == RunStatus::Paused => return Ok(run),
            _ => {}
        }
    }
}

/// A root event after which the run may have stopped moving by itself.
fn settles(event: &EventView) -> bool {
    matches!(event.kind.as_str(), "run.status" | "run.finished")
        && event.payload["status"]
            .as_str()
            .and_then(RunStatus::parse)
            .is_some_and(|s| s != RunStatus::WaitingChildren && (s.is_terminal() || s.is_waiting()))
}

/// The approval an `approval.required` event asks for.
fn requested(event: &EventView) -> Option<(ApprovalId, Vec<ApprovalCall>)> {
    if event.kind != "approval.required" {
        return None;
    }
    let id = ApprovalId::parse(event.payload["approval_id"].as_str()?).ok()?;
    let calls = serde_json::from_value(event.payload["calls"].clone()).ok()?;
    Some((id, calls))
}

/// Asks about an approval not asked about before and sends the answer. False when nobody
/// answered (stdin has ended). An approval someone else answered first is said so, not an
/// error.
async fn answer(
    api: &Api,
    id: &ApprovalId,
    calls: &[ApprovalCall],
    lines: &mut mpsc::Receiver<std::io::Result<String>>,
    asked: &mut HashSet<String>,
) -> anyhow::Result<bool> {
    if !asked.insert(id.to_string()) {
        return Ok(true);
    }
    let Some(answer) = ask(id, calls, lines).await? else {
        return Ok(false);
    };
    match api.answer_approval(id, &answer).await {
        Ok(_) => Ok(true),
        Err(ClientError::Api {
            status, message, ..
        }) if status == StatusCode::CONFLICT => {
            eprintln!("approval {id} was not taken: {message}");
            Ok(true)
        }
        Err(error) => Err(error.into()),
    }
}

/// Where `ratchet approvals` reads and answers: a server, or a database file directly.
pub enum Target {
    Server(Api),
    Db(String),
}

pub async fn list(target: Target, status: Option<String>, json: bool) -> anyhow::Result<ExitCode> {
    let approvals: Vec<Value> = match target {
        Target::Server(api) => api.approvals(status.as_deref()).await?,
        Target::Db(db) => {
            let status = status
                .map(|s| {
                    ApprovalStatus::parse(&s).with_context(|| {
                        format!(
                            "unknown status {s:?}; expected pending, decided, aborted or cancelled"
                        )
                    })
                })
                .transpose()?;
            let store = open_existing_store(&db)?;
            let mut all = Vec::new();
            let mut after = None;
            loop {
                let page = store
                    .approvals(DEFAULT_TENANT, status, after.as_ref(), 200)
                    .await?;
                after = page.last().map(|a| a.id.clone());
                let full = page.len() == 200;
                all.extend(page.into_iter().map(|a| {
                    json!({
                        "id": a.id, "run_id": a.run_id, "status": a.status.as_str(),
                        "calls": a.calls.iter().map(|c| json!({
                            "call_id": c.call_id, "name": c.tool,
                            "arguments": c.arguments, "needs_approval": c.needs_approval,
                        })).collect::<Vec<_>>(),
                    })
                }));
                if !full {
                    break;
                }
            }
            all
        }
    };
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", Value::Array(approvals))?;
        return Ok(ExitCode::SUCCESS);
    }
    if approvals.is_empty() {
        writeln!(out, "no approvals")?;
    }
    for approval in &approvals {
        writeln!(
            out,
            "{} {} run {}",
            approval["id"].as_str().unwrap_or_default(),
            approval["status"].as_str().unwrap_or_default(),
            approval["run_id"].as_str().unwrap_or_default()
        )?;
        for call in approval["calls"].as_array().into_iter().flatten() {
            writeln!(
                out,
                "  [{}] {} {}{}",
                call["call_id"].as_str().unwrap_or_default(),
                call["name"].as_str().unwrap_or_default(),
                call["arguments"],
                if call["needs_approval"] == true {
                    " (needs approval)"
                } else {
                    ""
                }
            )?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What `ratchet approvals decide` was told to do.
#[derive(Debug, clap::Args)]
pub struct Decide {
    #[arg(value_name = "APPROVAL_ID")]
    pub id: String,
    /// A call to run; repeatable.
    #[arg(long = "approve", value_name = "CALL")]
    pub approve: Vec<String>,
    /// A call not to run (the model is told it was denied); repeatable.
    #[arg(long = "deny", value_name = "CALL")]
    pub deny: Vec<String>,
    /// Why, shown to the model with each denied call.
    #[arg(long)]
    pub note: Option<String>,
    /// End the run as cancelled instead.
    #[arg(long)]
    pub abort: bool,
}

impl Decide {
    fn answer(self) -> anyhow::Result<ApprovalAnswer> {
        if self.abort {
            if !self.approve.is_empty() || !self.deny.is_empty() {
                bail!("--abort ends the run; it cannot be combined with --approve or --deny");
            }
            return Ok(ApprovalAnswer::Abort);
        }
        if self.approve.is_empty() && self.deny.is_empty() {
            bail!(
                "give --approve CALL and/or --deny CALL for the calls that need approval, or --abort"
            );
        }
        let decide = |call_id: &String, decision, note: Option<String>| CallDecision {
            call_id: call_id.clone(),
            decision,
            note,
        };
        let approved = self
            .approve
            .iter()
            .map(|c| decide(c, Verdict::Approve, None));
        let denied = (self.deny.iter()).map(|c| decide(c, Verdict::Deny, self.note.clone()));
        let decisions = approved.chain(denied).collect();
        Ok(ApprovalAnswer::Decisions(decisions))
    }
}

pub async fn decide(target: Target, args: Decide) -> anyhow::Result<ExitCode> {
    let id = ApprovalId::parse(&args.id)?;
    let answer = args.answer()?;
    let status = match target {
        Target::Server(api) => {
            let answered = api.answer_approval(&id, &answer).await?;
            answered["status"].as_str().unwrap_or_default().to_owned()
        }
        Target::Db(db) => {
            let coordinator = ratchet_engine::Coordinator::new(open_existing_store(&db)?);
            coordinator
                .answer_approval(&id, answer, crate::drive::COMMAND_LINE)
                .await
                .with_context(|| format!("cannot answer approval {id}"))?;
            let approval = coordinator.store().get_approval(&id).await?;
            approval.status.as_str().to_owned()
        }
    };
    writeln!(std::io::stdout(), "approval {id} is {status}")?;
    Ok(ExitCode::SUCCESS)
}
