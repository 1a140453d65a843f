//! A program with its own Rust tool: an agent looks an order up with `lookup_order` and
//! answers from what it found. Every step is durable in a SQLite file of a fresh directory.
//!
//! The model is scripted here so that the example runs anywhere with no key; with a key, put
//! `.model("openai:gpt-4.1-mini")` in its place and ask anything about orders.
//!
//!     cargo run -p ratchet --example custom_tool

use ratchet::{Ratchet, ReplayPolicy, RunStatus, ToolOutcome, tool_fn};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("model.json");
    std::fs::write(
        &script,
        json!({"replies": [
            {"tool_calls": [{"name": "lookup_order", "arguments": {"id": 42}}]},
            {"text": "Order 42 (two lamps) left the warehouse and arrives tomorrow."},
        ]})
        .to_string(),
    )?;

    // A keyed tool: after a crash its call runs again with the same idempotency key, which a
    // real order service would use to answer the first call's result.
    let lookup_order = tool_fn(
        "lookup_order",
        "Finds an order by its id and tells its items and where it is.",
        ReplayPolicy::Keyed,
        |arguments, context| async move {
            let id = arguments["id"].as_i64().unwrap_or_default();
            println!("lookup_order({id}) with key {}", context.idempotency_key);
            ToolOutcome::ok(
                json!({"id": id, "items": ["lamp", "lamp"], "status": "shipped"}).to_string(),
            )
        },
    )
    .parameters(json!({
        "type": "object",
        "properties": {"id": {"type": "integer", "description": "The order's id"}},
        "required": ["id"],
        "additionalProperties": false,
    }));

    let ratchet = Ratchet::builder()
        .database(&format!(
            "sqlite://{}",
            dir.path().join("agents.db").display()
        ))
        .model(&format!("scripted:{}", script.display()))
        .workspace(dir.path())
        .tool(lookup_order)
        .build()
        .await?;
    let run = ratchet.session().await?.send("Where is order 42?").await?;
    let outcome = run.wait().await?;
    println!(
        "{}: {}",
        outcome.status,
        outcome.answer.as_deref().unwrap_or("(no answer)")
    );
    ratchet.shutdown().await;
    if outcome.status != RunStatus::Completed {
        return Err(format!("the run ended {}", outcome.status).into());
    }
    Ok(())
}
