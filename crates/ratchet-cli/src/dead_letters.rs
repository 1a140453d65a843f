//! Dead letters at the terminal: `ratchet inbox requeue|discard` for a session's inbox and
//! `ratchet webhooks requeue` for a webhook's deliveries, against a server or a database.

use std::io::Write;
use std::process::ExitCode;

use anyhow::bail;
use ratchet_core::{InboxStatus, SessionId, WebhookId};
use ratchet_store::DeadLetterAction;
use serde_json::{Value, json};

use crate::approve::Target;
use ratchet::open_existing_store;

/// Who acts, for the record: `--by`, or the user at this terminal.
fn operator(by: Option<String>) -> String {
    by.or_else(|| std::env::var("USER").ok().filter(|u| !u.is_empty()))
        .unwrap_or_else(|| "the ratchet CLI".to_owned())
}

/// Requeues or discards a dead letter of a session's inbox.
pub async fn inbox(
    target: Target,
    action: DeadLetterAction,
    session: &str,
    event: i64,
    by: Option<String>,
) -> anyhow::Result<ExitCode> {
    let session = SessionId::parse(session)?;
    let by = operator(by);
    let (status, reason) = match target {
        Target::Server(api) => {
            let path = format!("/v1/sessions/{session}/inbox/{event}/{}", action.as_str());
            let changed = api.post(&path, &json!({"by": by})).await?;
            (text(&changed["status"]), text(&changed["reason"]))
        }
        Target::Db(db) => {
            let coordinator = ratchet_engine::Coordinator::new(open_existing_store(&db)?);
            let changed = (coordinator)
                .act_on_dead_letter(&session, event, action, &by)
                .await?;
            if changed.status == InboxStatus::Leased {
                eprintln!(
                    "a continuation turn holds it now; `ratchet resume --db {db}` carries it on"
                );
            }
            (
                changed.status.as_str().to_owned(),
                changed.reason.unwrap_or_default(),
            )
        }
    };
    writeln!(
        std::io::stdout(),
        "inbox event {event} of session {session} is {status}: {reason}"
    )?;
    Ok(ExitCode::SUCCESS)
}

/// Requeues one dead delivery of a webhook, or (`delivery` None) every one.
pub async fn webhook(
    target: Target,
    webhook: &str,
    delivery: Option<i64>,
) -> anyhow::Result<ExitCode> {
    let webhook = WebhookId::parse(webhook)?;
    let mut out = std::io::stdout();
    let now = ratchet_engine::Clock::System.now();
    match (target, delivery) {
        (Target::Server(api), Some(delivery)) => {
            let path = format!("/v1/webhooks/{webhook}/deliveries/{delivery}/requeue");
            let requeued = api.post(&path, &json!({})).await?;
            let status = text(&requeued["status"]);
            writeln!(out, "delivery {delivery} of webhook {webhook} is {status}")?;
        }
        (Target::Server(api), None) => {
            let path = format!("/v1/webhooks/{webhook}/deliveries/requeue");
            let requeued = api.post(&path, &json!({})).await?;
            let count = requeued["requeued"].as_u64().unwrap_or_default();
            writeln!(out, "requeued {count} dead deliveries of webhook {webhook}")?;
        }
        (Target::Db(db), Some(delivery)) => {
            let store = open_existing_store(&db)?;
            let requeued = store.requeue_delivery(&webhook, delivery, now).await?;
            let status = requeued.status.as_str();
            writeln!(out, "delivery {delivery} of webhook {webhook} is {status}")?;
        }
        (Target::Db(db), None) => {
            let store = open_existing_store(&db)?;
            let count = store.requeue_dead_deliveries(&webhook, now).await?;
            writeln!(out, "requeued {count} dead deliveries of webhook {webhook}")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The delivery to requeue: exactly one of an id and `--all-dead`.
pub fn chosen_delivery(delivery: Option<i64>, all_dead: bool) -> anyhow::Result<Option<i64>> {
    match (delivery, all_dead) {
        (Some(delivery), false) => Ok(Some(delivery)),
        (None, true) => Ok(None),
        (Some(_), true) => bail!("give a DELIVERY_ID or --all-dead, not both"),
        (None, false) => {
            bail!("give the DELIVERY_ID of a dead delivery, or --all-dead for every one")
        }
    }
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_owned()
}
