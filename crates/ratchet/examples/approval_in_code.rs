//! An approval answered by the program itself: every `refund` waits for a decision, and this
//! program approves the small ones and denies the rest with a note the model reads. A person
//! could answer the same approval from the console or `ratchet approvals decide`.
//!
//!     cargo run -p ratchet --example approval_in_code

use std::sync::{Arc, Mutex};

use ratchet::{
    ApprovalPolicy, CallDecision, Ratchet, ReplayPolicy, RunStatus, ToolOutcome, Verdict, tool_fn,
};
use serde_json::json;

/// Refunds up to this many cents are approved without a person.
const SMALL_REFUND_CENTS: i64 = 10_000;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("model.json");
    std::fs::write(
        &script,
        json!({"replies": [
            {"tool_calls": [
                {"name": "refund", "arguments": {"order": 42, "cents": 2000}},
                {"name": "refund", "arguments": {"order": 43, "cents": 250000}},
            ]},
            {"text": "Order 42 is refunded; the refund of order 43 needs a manager."},
        ]})
        .to_string(),
    )?;
    let refunded: Arc<Mutex<Vec<i64>>> = Arc::default();
    let done = Arc::clone(&refunded);
    let refund = tool_fn(
        "refund",
        "Refunds an order.",
        ReplayPolicy::Never,
        move |arguments, _| {
            let done = Arc::clone(&done);
            async move {
                done.lock()
                    .unwrap()
                    .push(arguments["order"].as_i64().unwrap_or_default());
                ToolOutcome::ok("refunded")
            }
        },
    )
    .approval(ApprovalPolicy::Always);

    let ratchet = Ratchet::builder()
        .database(&format!(
            "sqlite://{}",
            dir.path().join("agents.db").display()
        ))
        .model(&format!("scripted:{}", script.display()))
        .workspace(dir.path())
        .tool(refund)
        .build()
        .await?;
    let run = ratchet
        .session()
        .await?
        .send("Refund orders 42 and 43")
        .await?;
    let mut outcome = run.wait().await?;
    while outcome.status == RunStatus::WaitingHuman {
        let approval = run
            .approval()
            .await?
            .ok_or("the run waits for something other than an approval")?;
        let decisions = approval
            .calls
            .iter()
            .filter(|call| call.needs_approval)
            .map(|call| {
                let cents = call.arguments["cents"].as_i64().unwrap_or(i64::MAX);
                let small = cents <= SMALL_REFUND_CENTS;
                println!(
                    "{} {}: {}",
                    call.tool,
                    call.arguments,
                    if small { "approved" } else { "denied" }
                );
                CallDecision {
                    call_id: call.call_id.clone(),
                    decision: if small {
                        Verdict::Approve
                    } else {
                        Verdict::Deny
                    },
                    note: (!small).then(|| "refunds over $100 need a manager".to_owned()),
                }
            })
            .collect();
        run.decide(&approval, decisions, "the refund policy")
            .await?;
        outcome = run.wait().await?;
    }
    ratchet.shutdown().await;
    println!(
        "{}: {}",
        outcome.status,
        outcome.answer.as_deref().unwrap_or("(no answer)")
    );
    let refunded = refunded.lock().unwrap().clone();
    if outcome.status != RunStatus::Completed || refunded != [42] {
        return Err(format!(
            "expected only order 42 refunded and the run completed, found {refunded:?} and {}",
            outcome.status
        )
        .into());
    }
    Ok(())
}
