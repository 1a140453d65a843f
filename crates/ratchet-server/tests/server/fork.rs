//! Forks over HTTP: `POST /v1/runs/{id}/fork` creates a session holding the run's history as a
//! step left it and a run that continues from there, recording where it came from; every
//! request that cannot be right is a 4xx saying what is expected, and changes nothing.

use reqwest::StatusCode;
use serde_json::json;

use crate::common::*;

#[tokio::test]
async fn a_fork_continues_from_its_step_in_a_session_of_its_own() {
    let server = Server::start(quick_script()).await;
    let (session, run, _) = server.run_to_end("What is 2 + 3?").await;
    let source_messages = server.messages(&session).await;
    let path = format!("/v1/runs/{run}/fork");
    let reply = call(server.post(TOKEN_A, &path, json!({"at_step": 2}))).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    assert_eq!(
        keys(&reply.body),
        ["forked_from", "run_id", "session_id", "status"]
    );
    assert_eq!(reply.body["forked_from"], json!({"run_id": run, "step": 2}));
    assert_eq!(reply.body["status"], "running");
    let fork = reply.body["run_id"].as_str().unwrap().to_owned();
    let fork_session = reply.body["session_id"].as_str().unwrap().to_owned();
    assert_ne!(fork_session, session);
    let ended = server.finish(&fork).await;
    assert_eq!(ended["status"], "completed", "{ended}");
    assert_eq!(ended["forked_from"], json!({"run_id": run, "step": 2}));
    let runs = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{fork_session}/runs"))
        .await;
    assert_eq!(runs["items"][0]["forked_from"]["run_id"], run.as_str());
    let source_run = server.get_ok(TOKEN_A, &format!("/v1/runs/{run}")).await;
    assert_eq!(source_run["forked_from"], serde_json::Value::Null);

    let content = |messages: &[serde_json::Value]| -> Vec<String> {
        (messages.iter())
            .map(|m| m["content"].as_str().unwrap().to_owned())
            .collect()
    };
    let forked = content(&server.messages(&fork_session).await);
    let source = content(&source_messages);
    assert_eq!(forked[..3], source[..3], "the history through step 2");
    assert_eq!(forked.len(), 3 + 3, "then the fork's own steps");
    assert_eq!(
        content(&server.messages(&session).await),
        source,
        "the source is untouched"
    );

    // A fork with a new question calls the model with it.
    let edit = json!({"at_step": 3, "edit": {"replace_user_message": "And 4 + 4?"}});
    let reply = call(server.post(TOKEN_A, &path, edit)).await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.body);
    let edited = reply.body["session_id"].as_str().unwrap().to_owned();
    assert_eq!(
        content(&server.messages(&edited).await)[..1],
        ["And 4 + 4?"]
    );
}

#[tokio::test]
async fn a_fork_that_cannot_be_right_is_refused_saying_why() {
    let server = Server::start(quick_script()).await;
    let (_, run, _) = server.run_to_end("What is 2 + 3?").await;
    let path = format!("/v1/runs/{run}/fork");
    for (body, says) in [
        (json!({"at_step": 0}), "1 to 3"),
        (json!({"at_step": 4}), "1 to 3"),
        (json!({"at_step": 3}), "nothing to continue"),
        (
            json!({"at_step": 3, "edit": {"replace_tool_result": {"call_id": "nope", "result": 1}}}),
            "no call \"nope\"",
        ),
        (
            json!({"at_step": 2, "edit": {"replace_user_message": "  "}}),
            "replace_user_message is empty",
        ),
        (
            json!({"at_step": 2, "agent": "nobody"}),
            "unknown agent \"nobody\"",
        ),
        (json!({"at_step": 2, "edit": {"rewrite": "x"}}), "rewrite"),
        (json!({"at_step": 2, "extra": true}), "extra"),
        (json!({}), "at_step"),
        (json!({"at_step": -1}), "at_step"),
    ] {
        let reply = call(server.post(TOKEN_A, &path, body.clone())).await;
        assert_error(
            &body.to_string(),
            &reply,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        );
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    let missing = "/v1/runs/run_nope/fork";
    let reply = call(server.post(TOKEN_A, missing, json!({"at_step": 1}))).await;
    assert_error("unknown run", &reply, StatusCode::NOT_FOUND, "not_found");
    let reply = call(server.post(TOKEN_B, &path, json!({"at_step": 1}))).await;
    assert_error(
        "another tenant's run",
        &reply,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let runs = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(
        runs["items"].as_array().unwrap().len(),
        1,
        "no fork was created: {runs}"
    );
}
