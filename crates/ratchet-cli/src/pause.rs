//! `ratchet runs pause|resume|cancel`: stop a run at its next step boundary and take it up
//! again, or end it, through a server or straight in the database.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use ratchet_core::{RunId, RunStatus};
use ratchet_store::{CancelOutcome, PauseOutcome, ResumeOutcome};

use crate::approve::Target;
use ratchet::open_existing_store;

pub async fn pause(target: Target, run_id: &str) -> anyhow::Result<ExitCode> {
    let run_id = RunId::parse(run_id)?;
    let paused_now = match target {
        Target::Server(api) => {
            let view = api.run_action(run_id.as_str(), "pause").await?;
            view["status"] == "paused"
        }
        Target::Db(db) => {
            let coordinator = ratchet_engine::Coordinator::new(open_existing_store(&db)?);
            let outcome = coordinator
                .request_pause(&run_id)
                .await
                .with_context(|| format!("cannot pause run {run_id}"))?;
            matches!(outcome, PauseOutcome::Paused { .. })
        }
    };
    let mut out = std::io::stdout().lock();
    if paused_now {
        writeln!(
            out,
            "{run_id} is paused; `ratchet runs resume {run_id}` takes it up again"
        )?;
    } else {
        writeln!(out, "{run_id} pauses when the step it is taking ends")?;
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn resume(target: Target, run_id: &str) -> anyhow::Result<ExitCode> {
    let run_id = RunId::parse(run_id)?;
    let said = match target {
        Target::Server(api) => {
            api.run_action(run_id.as_str(), "resume").await?;
            format!("{run_id} is running again")
        }
        Target::Db(db) => {
            let coordinator = ratchet_engine::Coordinator::new(open_existing_store(&db)?);
            let outcome = coordinator
                .resume_paused(&run_id)
                .await
                .with_context(|| format!("cannot resume run {run_id}"))?;
            match outcome {
                ResumeOutcome::Resumed { .. } => format!(
                    "{run_id} is running again; `ratchet resume` (or a server) carries it on"
                ),
                ResumeOutcome::PauseWithdrawn => format!("{run_id} had not paused yet; it goes on"),
            }
        }
    };
    writeln!(std::io::stdout(), "{said}")?;
    Ok(ExitCode::SUCCESS)
}

/// Cancelling a run that is cancelled already succeeds (the request is met); one that ended
/// otherwise is refused: its end stands.
pub async fn cancel(target: Target, run_id: &str) -> anyhow::Result<ExitCode> {
    let run_id = RunId::parse(run_id)?;
    let status = match target {
        Target::Server(api) => {
            let view = api.run_action(run_id.as_str(), "cancel").await?;
            view["status"]
                .as_str()
                .and_then(RunStatus::parse)
                .with_context(|| {
                    format!("the server answered the cancel without a status: {view}")
                })?
        }
        Target::Db(db) => {
            let coordinator = ratchet_engine::Coordinator::new(open_existing_store(&db)?);
            let outcome = coordinator
                .request_cancel(&run_id)
                .await
                .with_context(|| format!("cannot cancel run {run_id}"))?;
            match outcome {
                CancelOutcome::Cancelled { .. } => RunStatus::Cancelled,
                CancelOutcome::Cancelling { .. } => RunStatus::Cancelling,
                CancelOutcome::AlreadyTerminal(status) => status,
            }
        }
    };
    let said = match status {
        RunStatus::Cancelled => format!("{run_id} is cancelled"),
        RunStatus::Cancelling => {
            format!("{run_id} is cancelling: the step it is taking ends it")
        }
        ended => anyhow::bail!("cannot cancel run {run_id}: it has already ended ({ended})"),
    };
    writeln!(std::io::stdout(), "{said}")?;
    Ok(ExitCode::SUCCESS)
}
