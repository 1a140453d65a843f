//! `Idempotency-Key`: a keyed `POST` is carried out once and its response sent again to a
//! repeat; keys are per tenant and name one request; a response that did nothing for now
//! gives the key back; a bad key is a 400.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::common::*;

const REPLAYED: &str = "idempotent-replayed";

struct Keyed {
    status: StatusCode,
    replayed: bool,
    body: Value,
}

async fn keyed(server: &Server, token: &str, path: &str, key: &str, body: Value) -> Keyed {
    let response = server
        .post(token, path, body)
        .header("idempotency-key", key)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let replayed = match response.headers().get(REPLAYED) {
        None => false,
        Some(value) => {
            assert_eq!(value, "true", "{REPLAYED} is true when sent");
            true
        }
    };
    let body = response.json().await.unwrap();
    Keyed {
        status,
        replayed,
        body,
    }
}

async fn run_ids(server: &Server, token: &str, session: &str) -> Vec<String> {
    let runs = server
        .get_ok(token, &format!("/v1/sessions/{session}/runs"))
        .await;
    ids(&runs["items"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_message_starts_one_run_and_a_repeat_gets_the_first_answer() {
    let server = Server::start(quick_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let path = format!("/v1/sessions/{session}/messages");
    let first = keyed(&server, TOKEN_A, &path, "msg-1", json!({"content": "add"})).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", first.body);
    assert!(!first.replayed, "the first request is carried out");
    let run = first.body["run_id"].as_str().unwrap().to_owned();
    server.finish(&run).await;

    // The same request again, its JSON written otherwise: the first answer, nothing done.
    let body: Value = serde_json::from_str("{ \"content\" :\"add\" }").unwrap();
    let again = keyed(&server, TOKEN_A, &path, "msg-1", body).await;
    assert_eq!(again.status, StatusCode::ACCEPTED);
    assert!(again.replayed);
    assert_eq!(again.body, first.body, "the stored response, byte for byte");
    assert_eq!(
        run_ids(&server, TOKEN_A, &session).await,
        std::slice::from_ref(&run)
    );

    // The key names that request: another body or another path is refused.
    let other_body = keyed(&server, TOKEN_A, &path, "msg-1", json!({"content": "sub"})).await;
    assert_eq!(other_body.status, StatusCode::UNPROCESSABLE_ENTITY);
    let message = other_body.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("first used for POST") && message.contains("another body"),
        "{message}"
    );
    let other_path = keyed(&server, TOKEN_A, "/v1/sessions", "msg-1", json!({})).await;
    assert_eq!(other_path.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(run_ids(&server, TOKEN_A, &session).await, [run]);

    // Another tenant's key of the same name is its own.
    let theirs = keyed(&server, TOKEN_B, "/v1/sessions", "msg-1", json!({})).await;
    assert_eq!(theirs.status, StatusCode::CREATED, "{}", theirs.body);
    assert!(!theirs.replayed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_session_is_created_once() {
    let server = Server::start(quick_script()).await;
    let body = json!({"metadata": {"team": "a"}});
    let first = keyed(&server, TOKEN_A, "/v1/sessions", "ses-1", body.clone()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let again = keyed(&server, TOKEN_A, "/v1/sessions", "ses-1", body).await;
    assert_eq!((again.status, again.replayed), (StatusCode::CREATED, true));
    assert_eq!(again.body["id"], first.body["id"]);
    let listed = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(ids(&listed["items"]), [first.body["id"].as_str().unwrap()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_for_now_gives_the_key_back_and_a_final_one_is_kept() {
    let server = Server::start(sleepy_script()).await;
    let session = server.create_session(TOKEN_A).await;
    let first = server.send(TOKEN_A, &session, "sleep").await;
    let active = first["run_id"].as_str().unwrap().to_owned();
    let path = format!("/v1/sessions/{session}/messages");
    let body = json!({"content": "now", "multitask": "reject"});
    let refused = keyed(&server, TOKEN_A, &path, "later-1", body.clone()).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.body);
    let cancel = call(server.post(TOKEN_A, &format!("/v1/runs/{active}/cancel"), json!({})));
    assert_eq!(cancel.await.status, StatusCode::OK);
    server.finish(&active).await;
    let accepted = keyed(&server, TOKEN_A, &path, "later-1", body).await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED, "{}", accepted.body);
    assert!(
        !accepted.replayed,
        "the 409 was not kept: the repeat is carried out"
    );

    // A 404 is final: kept and sent again.
    let missing = "/v1/runs/run_nothing-here/cancel";
    let gone = keyed(&server, TOKEN_A, missing, "gone-1", json!({})).await;
    assert_eq!((gone.status, gone.replayed), (StatusCode::NOT_FOUND, false));
    let again = keyed(&server, TOKEN_A, missing, "gone-1", json!({})).await;
    assert_eq!(
        (again.status, again.replayed),
        (StatusCode::NOT_FOUND, true)
    );
    assert_eq!(again.body, gone.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_is_not_1_to_255_printable_characters_is_a_bad_request() {
    let server = Server::start(quick_script()).await;
    let long = "k".repeat(256);
    for bad in ["", long.as_str(), "tab\there"] {
        let request = server
            .post(TOKEN_A, "/v1/sessions", json!({}))
            .header("idempotency-key", bad);
        let reply = call(request).await;
        assert_error(
            &format!("key {bad:?}"),
            &reply,
            StatusCode::BAD_REQUEST,
            "bad_request",
        );
        assert!(
            reply.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("1 to 255 printable ASCII"),
            "{}",
            reply.body
        );
    }
    let listed = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(listed["items"], json!([]), "nothing was created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_fork_forks_once() {
    let server = Server::start(quick_script()).await;
    let (_, run, _) = server.run_to_end("What is 2 + 3?").await;
    let path = format!("/v1/runs/{run}/fork");
    let body = json!({"at_step": 2});
    let first = keyed(&server, TOKEN_A, &path, "fork-1", body.clone()).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let again = keyed(&server, TOKEN_A, &path, "fork-1", body).await;
    assert_eq!((again.status, again.replayed), (StatusCode::CREATED, true));
    assert_eq!(again.body, first.body);
    let sessions = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(
        sessions["items"].as_array().unwrap().len(),
        2,
        "the source's session and one fork's: {sessions}"
    );
}
