//! `ratchet runs fork`: a new session holding a run's history as one of its steps left it,
//! and a run that continues from there, through a server or straight in the database.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use ratchet::open_existing_store;
use ratchet_core::{ForkEdit, RunId, RunStatus};

use crate::approve::Target;

pub async fn fork(
    target: Target,
    run_id: &str,
    at_step: u64,
    message: Option<&str>,
    agent: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let run_id = RunId::parse(run_id)?;
    if message.is_some_and(|m| m.trim().is_empty()) {
        anyhow::bail!("--message is empty; expected the text that replaces the user message");
    }
    let (session, run, status, carried) = match target {
        Target::Server(api) => {
            let forked = api
                .fork_run(run_id.as_str(), at_step, message, agent)
                .await?;
            (forked.session_id, forked.run_id, forked.status, "")
        }
        Target::Db(db) => {
            if let Some(agent) = agent {
                anyhow::bail!(
                    "--agent {agent:?} names an agent of a server's catalog; give --server, or fork without it to keep the run's own configuration"
                );
            }
            let coordinator = ratchet_engine::Coordinator::new(open_existing_store(&db)?);
            let edit = message.map(|m| ForkEdit::ReplaceUserMessage(m.to_owned()));
            let forked = coordinator
                .fork(&run_id, at_step, edit, None, None)
                .await
                .with_context(|| format!("cannot fork run {run_id} at step {at_step}"))?;
            let carried = "; `ratchet resume` (or a server) carries it on";
            (
                forked.session.id.to_string(),
                forked.run_id.to_string(),
                forked.status,
                carried,
            )
        }
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "session {session}")?;
    writeln!(out, "run {run}")?;
    let waits = if status == RunStatus::WaitingHuman {
        format!(
            "; a call {run_id} started has no known outcome: `ratchet runs show {run}` names it, `ratchet runs reconcile` answers it"
        )
    } else {
        String::new()
    };
    writeln!(
        out,
        "forked {run_id} at step {at_step}: {run} is {status}{carried}{waits}"
    )?;
    Ok(ExitCode::SUCCESS)
}
