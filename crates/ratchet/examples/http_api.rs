//! A program that serves the HTTP API and the web console with a tool of its own: the same
//! API `ratchet serve` has, its runs calling `lookup_order` in this process. A client (the
//! Rust one, `ratchet-client`) then talks to it over HTTP as any client would: it opens a
//! session, sends a message and follows the run's event stream to its answer.
//!
//!     cargo run -p ratchet --example http_api
//!
//! Served on a loopback address: without tokens (`Builder::token`), every request is the
//! default tenant's, and only loopback names are answered.

use ratchet::{Ratchet, ReplayPolicy, RunStatus, ToolOutcome, tool_fn};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("model.json");
    std::fs::write(
        &script,
        json!({"replies": [
            {"tool_calls": [{"name": "lookup_order", "arguments": {"id": 7}}]},
            {"text": "Order 7 is packed and leaves today."},
        ]})
        .to_string(),
    )?;
    let lookup_order = tool_fn(
        "lookup_order",
        "Finds an order by its id and tells where it is.",
        ReplayPolicy::Keyed,
        |arguments, _context| async move {
            let id = arguments["id"].as_i64().unwrap_or_default();
            ToolOutcome::ok(json!({"id": id, "status": "packed"}).to_string())
        },
    );
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

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = stop.clone();
    let app = ratchet.app();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(serving.cancelled_owned())
            .await
    });
    println!("serving the API and the console on http://{address}");

    let api = ratchet_client::Api::new(&address.to_string(), None, 2)?;
    let session = api.create_session(None).await?;
    let accepted = api.send_message(&session.id, "Where is order 7?").await?;
    let run = ratchet_client::follow_run(&api, &accepted.run_id, 0, |event| {
        println!("  {} {}", event.seq, event.kind);
    })
    .await?;
    println!(
        "{}: {}",
        run.status,
        run.final_answer.as_deref().unwrap_or_default()
    );

    stop.cancel();
    server.await??;
    ratchet.shutdown().await;
    if run.status != RunStatus::Completed {
        return Err(format!("the run ended {}", run.status).into());
    }
    Ok(())
}
