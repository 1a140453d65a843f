//! A user's program, outside the Ratchet workspace, that depends on `ratchet` by path and
//! registers a Rust tool of its own. Its run survives `kill -9`: the program starts itself
//! again as a child process, whose agent calls a tool that hangs the first time; it kills the
//! child with SIGKILL in the middle of that call, then opens the same database and waits: the
//! run goes on from its last committed step, and the tool's call runs again with the same
//! idempotency key.
//!
//!     cargo run --manifest-path embedding/Cargo.toml

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use ratchet::{Ratchet, ReplayPolicy, RunId, RunStatus, ToolOutcome, tool_fn};
use serde_json::json;

/// Everything both processes share lives in `dir`: the database, the model's script, and a
/// file each attempt of the tool's call writes its key to.
async fn ratchet(dir: &Path) -> ratchet::Result<Ratchet> {
    let script = dir.join("model.json");
    std::fs::write(
        &script,
        json!({"replies": [
            {"tool_calls": [{"name": "charge_card", "arguments": {"cents": 1299}}]},
            {"text": "Charged $12.99."},
        ]})
        .to_string(),
    )
    .expect("the script can be written");
    let attempts = dir.join("attempts.txt");
    // Keyed: a call cut off by a crash runs again with the same key, which a payment provider
    // uses to answer with the first charge instead of charging twice.
    let charge = tool_fn(
        "charge_card",
        "Charges the customer's card.",
        ReplayPolicy::Keyed,
        move |arguments, context| {
            let attempts = attempts.clone();
            async move {
                let before = std::fs::read_to_string(&attempts).unwrap_or_default();
                std::fs::write(&attempts, format!("{before}{}\n", context.idempotency_key))
                    .expect("the attempt can be recorded");
                if before.is_empty() {
                    // The first attempt hangs, as a slow provider would, until the process dies.
                    std::future::pending::<()>().await;
                }
                ToolOutcome::ok(
                    json!({"charged_cents": arguments["cents"], "key": context.idempotency_key})
                        .to_string(),
                )
            }
        },
    );
    Ratchet::builder()
        .database(&format!("sqlite://{}", dir.join("agents.db").display()))
        .model(&format!("scripted:{}", script.display()))
        .workspace(dir)
        .tool(charge)
        .build()
        .await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("--child") {
        let dir = PathBuf::from(args.next().ok_or("--child needs a directory")?);
        let ratchet = ratchet(&dir).await?;
        let run = ratchet
            .session()
            .await?
            .send("Charge the customer $12.99")
            .await?;
        println!("{}", run.id());
        run.wait().await?;
        return Err("the child was meant to be killed before its run ended".into());
    }

    let dir = tempfile::tempdir()?;
    let mut child = Command::new(std::env::current_exe()?)
        .arg("--child")
        .arg(dir.path())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
    let run_id = RunId::parse(line.trim())?;
    let attempts = dir.path().join("attempts.txt");
    while !attempts.exists() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill()?; // SIGKILL: nothing of the child runs after this.
    child.wait()?;
    println!("killed the child in the middle of charge_card in run {run_id}");

    let ratchet = ratchet(dir.path()).await?;
    let outcome = ratchet.run(run_id).wait().await?;
    ratchet.shutdown().await;
    let keys: Vec<String> = std::fs::read_to_string(&attempts)?
        .lines()
        .map(str::to_owned)
        .collect();
    println!(
        "{}: {}",
        outcome.status,
        outcome.answer.as_deref().unwrap_or("(no answer)")
    );
    println!(
        "charge_card was attempted {} times, with the keys {keys:?}",
        keys.len()
    );
    if outcome.status != RunStatus::Completed {
        return Err(format!("the run ended {}", outcome.status).into());
    }
    if keys.len() != 2 || keys[0] != keys[1] {
        return Err("the call cut off by the crash should have run again with the same key".into());
    }
    Ok(())
}
