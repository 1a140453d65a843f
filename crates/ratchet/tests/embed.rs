//! The library as a program embeds it: a Rust tool registered beside the built-in ones, a
//! message sent, the run followed to its answer, on a real SQLite database.

use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use ratchet::{
    ApprovalPolicy, CallDecision, Error, Ratchet, ReplayPolicy, RunStatus, ToolOutcome, Verdict,
    tool_fn,
};
use ratchet_store::ApprovalStatus;
use serde_json::{Value, json};

/// A scripted model that calls `lookup_order` for order 42, then answers.
fn script(dir: &Path) -> String {
    let path = dir.join("script.json");
    let replies = json!({"replies": [
        {"tool_calls": [{"name": "lookup_order", "arguments": {"id": 42}}]},
        {"text": "Order 42 ships tomorrow."},
    ]});
    std::fs::write(&path, replies.to_string()).unwrap();
    format!("scripted:{}", path.display())
}

fn database(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("agents.db").display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_tool_is_called_once_with_its_key_and_the_run_answers_from_its_result() {
    let dir = tempfile::tempdir().unwrap();
    let calls: Arc<Mutex<Vec<(Value, String)>>> = Arc::default();
    let seen = Arc::clone(&calls);
    let lookup = tool_fn(
        "lookup_order",
        "Finds an order by its id",
        ReplayPolicy::Keyed,
        move |arguments, context| {
            let seen = Arc::clone(&seen);
            async move {
                seen.lock()
                    .unwrap()
                    .push((arguments, context.idempotency_key));
                ToolOutcome::ok(r#"{"id": 42, "ships": "tomorrow"}"#)
            }
        },
    )
    .parameters(json!({
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "required": ["id"],
        "additionalProperties": false,
    }));
    let ratchet = Ratchet::builder()
        .database(&database(dir.path()))
        .model(&script(dir.path()))
        .workspace(dir.path())
        .tool(lookup)
        .build()
        .await
        .unwrap();
    let session = ratchet.session().await.unwrap();
    let run = session.send("Where is order 42?").await.unwrap();
    let outcome = run.wait().await.unwrap();
    assert_eq!(outcome.status, RunStatus::Completed, "{outcome:?}");
    assert_eq!(outcome.answer.as_deref(), Some("Order 42 ships tomorrow."));
    assert_eq!(outcome.steps, 3, "a model call, the tool batch, the answer");

    // Its events, from the first, ending with the run.
    let kinds: Vec<String> = run
        .events()
        .map(|event| event.unwrap().kind)
        .collect()
        .await;
    assert_eq!(
        kinds.first().map(String::as_str),
        Some("run.created"),
        "{kinds:?}"
    );
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("run.finished"),
        "{kinds:?}"
    );
    let position = |kind: &str| kinds.iter().position(|k| k == kind);
    assert!(
        position("tool.call").is_some() && position("tool.call") < position("tool.result"),
        "the call, then its result: {kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| *k == "step.committed").count(),
        3,
        "each committed step once: {kinds:?}"
    );

    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1, "called once: {calls:?}");
    assert_eq!(calls[0].0, json!({"id": 42}));
    assert!(
        calls[0].1.starts_with(run.id().as_str()),
        "the idempotency key names the run: {}",
        calls[0].1
    );
    let history = ratchet.store().history(session.id()).await.unwrap();
    assert!(
        history
            .iter()
            .any(|m| m.content.contains("\"ships\": \"tomorrow\"")),
        "the model read the tool's result: {history:?}"
    );
    ratchet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_it_cannot_run_with_are_refused_before_a_database_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |result: Result<Ratchet, Error>| match result {
        Ok(_) => panic!("expected a refusal, found a running Ratchet"),
        Err(error) => error.to_string(),
    };
    let no_database = refused(Ratchet::builder().build().await);
    assert!(
        no_database.contains("a database is needed"),
        "{no_database}"
    );

    let url = database(dir.path());
    let unknown_model = refused(
        Ratchet::builder()
            .database(&url)
            .model("nonsense")
            .workspace(dir.path())
            .build()
            .await,
    );
    assert!(unknown_model.contains("nonsense"), "{unknown_model}");

    let twice = tool_fn("add", "Adds again", ReplayPolicy::Safe, |_, _| async {
        ToolOutcome::ok("0")
    });
    let with_tool = |tool: ratchet::FnTool| {
        Ratchet::builder()
            .database(&url)
            .workspace(dir.path())
            .tool(tool)
            .build()
    };
    let duplicate = refused(with_tool(twice).await);
    assert!(
        duplicate.contains("\"add\" is registered twice"),
        "{duplicate}"
    );

    let bad_schema = tool_fn(
        "odd",
        "Has a bad schema",
        ReplayPolicy::Safe,
        |_, _| async { ToolOutcome::ok("") },
    )
    .parameters(json!({"type": 7}));
    let schema = refused(with_tool(bad_schema).await);
    let short_token = refused(
        Ratchet::builder()
            .database(&url)
            .workspace(dir.path())
            .token("acme", "guessable")
            .build()
            .await,
    );
    assert!(
        short_token.contains("the token of tenant \"acme\" has 9 characters; expected at least 16"),
        "{short_token}"
    );
    assert!(
        schema.contains("\"odd\" has an invalid parameter schema"),
        "{schema}"
    );
    assert!(
        !dir.path().join("agents.db").exists(),
        "nothing refused made a database"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_decides_an_approval_and_only_the_approved_call_runs() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.json");
    let replies = json!({"replies": [
        {"tool_calls": [
            {"name": "refund", "arguments": {"order": 1}},
            {"name": "refund", "arguments": {"order": 2}},
        ]},
        {"text": "Done."},
    ]});
    std::fs::write(&script, replies.to_string()).unwrap();
    let refunded: Arc<Mutex<Vec<Value>>> = Arc::default();
    let done = Arc::clone(&refunded);
    let refund = tool_fn(
        "refund",
        "Refunds an order",
        ReplayPolicy::Never,
        move |arguments, _| {
            let done = Arc::clone(&done);
            async move {
                done.lock().unwrap().push(arguments);
                ToolOutcome::ok("refunded")
            }
        },
    )
    .approval(ApprovalPolicy::Always);
    let ratchet = Ratchet::builder()
        .database(&database(dir.path()))
        .model(&format!("scripted:{}", script.display()))
        .workspace(dir.path())
        .tool(refund)
        .build()
        .await
        .unwrap();
    let session = ratchet.session().await.unwrap();
    let run = session.send("Refund both").await.unwrap();
    let waiting = run.wait().await.unwrap();
    assert_eq!(waiting.status, RunStatus::WaitingHuman, "{waiting:?}");
    assert!(
        refunded.lock().unwrap().is_empty(),
        "nothing runs before the decision"
    );
    let approval = run
        .approval()
        .await
        .unwrap()
        .expect("the run waits on an approval");
    assert_eq!(approval.calls.len(), 2);
    let decisions = approval
        .calls
        .iter()
        .map(|call| CallDecision {
            call_id: call.call_id.clone(),
            decision: if call.arguments["order"] == 1 {
                Verdict::Approve
            } else {
                Verdict::Deny
            },
            note: Some("not this one".to_owned()),
        })
        .collect();
    // Followed while the run waits, the stream goes on through the decision to the run's end.
    let follower = run
        .events()
        .map(|event| event.unwrap().kind)
        .collect::<Vec<_>>();
    let decided = async { run.decide(&approval, decisions, "the test's policy").await };
    let (kinds, decided) = tokio::join!(follower, decided);
    decided.unwrap();
    assert!(kinds.contains(&"approval.decided".to_owned()), "{kinds:?}");
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("run.finished"),
        "{kinds:?}"
    );
    let outcome = run.wait().await.unwrap();
    assert_eq!(outcome.status, RunStatus::Completed, "{outcome:?}");
    assert_eq!(
        *refunded.lock().unwrap(),
        [json!({"order": 1})],
        "only the approved call ran"
    );
    assert!(
        run.approval().await.unwrap().is_none(),
        "nothing waits any more"
    );
    let recorded = ratchet.store().get_approval(&approval.id).await.unwrap();
    assert_eq!(recorded.status, ApprovalStatus::Decided, "{recorded:?}");
    assert!(
        recorded.answer.is_some(),
        "the answer is kept: {recorded:?}"
    );
    let history = ratchet.store().history(session.id()).await.unwrap();
    assert!(
        history.iter().any(|m| m.content.contains("not this one")),
        "the model read the denial's note: {history:?}"
    );
    ratchet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_api_over_an_embedded_runtime_runs_its_rust_tools_behind_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let lookup = tool_fn(
        "lookup_order",
        "Finds an order by its id",
        ReplayPolicy::Keyed,
        |_, _| async { ToolOutcome::ok("shipped") },
    );
    let ratchet = Ratchet::builder()
        .database(&database(dir.path()))
        .model(&script(dir.path()))
        .workspace(dir.path())
        .tool(lookup)
        .token("acme", "secret-token-of-acme")
        .build()
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(axum::serve(listener, ratchet.app()).into_future());
    let http = reqwest::Client::new();

    let anonymous = http
        .post(format!("{base}/v1/sessions"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401, "the token is required");
    let session: Value = http
        .post(format!("{base}/v1/sessions"))
        .bearer_auth("secret-token-of-acme")
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let session_id = session["id"].as_str().unwrap();
    let accepted: Value = http
        .post(format!("{base}/v1/sessions/{session_id}/messages"))
        .bearer_auth("secret-token-of-acme")
        .json(&json!({"content": "Where is order 42?"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let run_id = ratchet::RunId::parse(accepted["run_id"].as_str().unwrap()).unwrap();
    let outcome = ratchet.run(run_id.clone()).wait().await.unwrap();
    assert_eq!(
        outcome.answer.as_deref(),
        Some("Order 42 ships tomorrow."),
        "{outcome:?}"
    );
    let run: Value = http
        .get(format!("{base}/v1/runs/{run_id}"))
        .bearer_auth("secret-token-of-acme")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(run["status"], "completed", "{run}");
    assert_eq!(
        run["usage"]["tool_calls"], 1,
        "the Rust tool ran through the API: {run}"
    );
    server.abort();
    ratchet.shutdown().await;
}

/// A model the program implements: it answers with what it was asked and under which prompt.
struct Echo;

#[ratchet::async_trait]
impl ratchet::Model for Echo {
    async fn complete(
        &self,
        request: ratchet::ModelRequest,
        _deltas: tokio::sync::mpsc::UnboundedSender<String>,
        _cancel: ratchet::CancellationToken,
    ) -> Result<ratchet::ModelReply, ratchet::ModelError> {
        let asked = request
            .messages
            .last()
            .map(|m| m.content.clone())
            .unwrap_or_default();
        Ok(ratchet::ModelReply {
            text: format!("{} / {asked}", request.system_prompt),
            tool_calls: Vec::new(),
            usage: ratchet::Usage {
                input_tokens: 3,
                output_tokens: 2,
                reasoning_tokens: 0,
                cache_write_tokens: 0,
                cache_read_tokens: 0,
            },
            reasoning: String::new(),
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_the_program_implements_answers_its_runs() {
    let dir = tempfile::tempdir().unwrap();
    let ratchet = Ratchet::builder()
        .database(&database(dir.path()))
        .model_impl("echo", Echo)
        .system_prompt("Be brief.")
        .workspace(dir.path())
        .build()
        .await
        .unwrap();
    let run = ratchet
        .session()
        .await
        .unwrap()
        .send("Hello")
        .await
        .unwrap();
    let outcome = run.wait().await.unwrap();
    assert_eq!(outcome.status, RunStatus::Completed, "{outcome:?}");
    assert_eq!(outcome.answer.as_deref(), Some("Be brief. / Hello"));
    let state = ratchet.store().load_state(run.id()).await.unwrap();
    assert_eq!(
        state.config.model, "echo",
        "runs are frozen with the model's name"
    );
    assert_eq!(state.counters.output_tokens, 2, "its usage is counted");
    ratchet.shutdown().await;
}
