//! Sub-agents over HTTP: the catalog's agents (`GET /v1/agents`), sessions that name one and
//! the configuration their runs are frozen with, a delegation run to its end through the API
//! with its run tree (`GET /v1/runs/{id}/tree`), the answers a message gets when its
//! session's agent left the catalog (409) or a run quota is full (429), and reloads
//! (`POST /v1/admin/reload`): a whole new catalog, template and tokens or none of them, and
//! runs that keep what they were frozen with.

use std::path::Path;
use std::sync::Arc;

use ratchet_core::delegation::delegate_tool;
use ratchet_core::{AgentProfile, AgentRef, RunConfigSnapshot};
use ratchet_engine::Coordinator;
use ratchet_server::reload::Prepared;
use ratchet_server::{Active, AppState, Tokens};
use ratchet_store::{RunQuota, Store, WebhookAdmin};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::*;

/// A catalog agent whose runs start from `template` with a script of their own (written to
/// `dir/ID.json`), offered the `delegate` tool when it has `delegates`.
fn agent(
    id: &str,
    template: &RunConfigSnapshot,
    dir: &Path,
    script: Value,
    delegates: Vec<AgentProfile>,
) -> AgentProfile {
    let path = dir.join(format!("{id}.json"));
    std::fs::write(&path, script.to_string()).unwrap();
    let mut config = template.clone();
    config.model = format!("scripted:{}", path.display());
    config.agent = Some(AgentRef {
        id: id.to_owned(),
        hash: format!("hash-of-{id}"),
    });
    if !delegates.is_empty() {
        config.tools.push(delegate_tool(&delegates));
        config.delegation.agents = delegates;
    }
    AgentProfile {
        id: id.to_owned(),
        description: format!("the {id} agent"),
        config,
    }
}

fn answer(text: &str) -> Value {
    json!({"replies": [{"text": text}]})
}

/// `writer` answers "written"; `boss` may delegate to `writer`. Listed out of id order.
fn writer_and_boss(template: &RunConfigSnapshot, dir: &Path) -> Vec<AgentProfile> {
    let mut writer = agent("writer", template, dir, answer("written"), Vec::new());
    for tool in &mut writer.config.tools {
        if tool.name == "append_line" {
            tool.approval = ratchet_core::ApprovalPolicy::Always;
        }
    }
    writer.config.limits.max_steps = 7;
    let boss = agent(
        "boss",
        template,
        dir,
        answer("bossed"),
        vec![writer.clone()],
    );
    vec![writer, boss]
}

async fn create_session_with(server: &Server, token: &str, body: Value) -> Reply {
    call(server.post(token, "/v1/sessions", body)).await
}

/// Tenant A sends `content` in a new session of `agent` and waits for the run to end: the
/// run and the run as it ended.
async fn run_as(server: &Server, agent: &str, content: &str) -> (String, Value) {
    let created = create_session_with(server, TOKEN_A, json!({"agent": agent})).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let session = created.body["id"].as_str().unwrap();
    let run = server.send(TOKEN_A, session, content).await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let ended = server.finish(&run).await;
    (run, ended)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catalog_is_listed_in_id_order_with_each_agents_model_tools_and_delegates() {
    let server = Server::start_with_agents(quick_script(), writer_and_boss).await;
    let page = server.get_ok(TOKEN_B, "/v1/agents").await;
    assert_eq!(keys(&page), ["items", "next_cursor"], "{page}");
    assert!(page["next_cursor"].is_null(), "{page}");
    assert_eq!(ids(&page["items"]), ["boss", "writer"]);
    let template_tools: Vec<String> = ratchet_tools::Registry::builtin().names();
    let boss = &page["items"][0];
    assert_eq!(
        keys(boss),
        [
            "approvals",
            "delegates",
            "description",
            "hash",
            "id",
            "limits",
            "model",
            "tools"
        ],
        "{boss}"
    );
    assert_eq!(boss["approvals"], json!([]), "{boss}");
    assert_eq!(boss["description"], "the boss agent");
    assert_eq!(boss["hash"], "hash-of-boss");
    assert!(
        boss["model"].as_str().unwrap().ends_with("boss.json"),
        "{boss}"
    );
    assert_eq!(boss["delegates"], json!(["writer"]));
    let mut boss_tools = tools_of(boss);
    assert_eq!(boss_tools.pop().as_deref(), Some("delegate"), "{boss}");
    assert_eq!(sorted(boss_tools), sorted(template_tools.clone()));
    let writer = &page["items"][1];
    assert_eq!(writer["delegates"], json!([]));
    assert_eq!(
        writer["approvals"],
        json!([{"tool": "append_line", "policy": "always"}])
    );
    assert_eq!(writer["limits"]["max_steps"], 7, "{writer}");
    assert!(writer["limits"]["max_tokens"].is_null(), "{writer}");
    assert_eq!(sorted(tools_of(writer)), sorted(template_tools));

    let anonymous = call(server.http.get(server.url("/v1/agents"))).await;
    assert_error(
        "no token",
        &anonymous,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
}

fn tools_of(agent: &Value) -> Vec<String> {
    agent["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_owned())
        .collect()
}

fn sorted(mut names: Vec<String>) -> Vec<String> {
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_of_an_agent_runs_with_its_configuration_and_an_unknown_agent_is_refused() {
    let server = Server::start_with_agents(quick_script(), writer_and_boss).await;
    let created = create_session_with(&server, TOKEN_A, json!({"agent": "writer"})).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    assert_eq!(created.body["agent"], "writer");
    let session = created.body["id"].as_str().unwrap();
    let run = server.send(TOKEN_A, session, "write something").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let ended = server.finish(&run).await;
    assert_eq!(ended["final_answer"], "written", "{ended}");

    for template in [json!({}), json!({"agent": "default"})] {
        let created = create_session_with(&server, TOKEN_A, template.clone()).await;
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
        let session = created.body["id"].as_str().unwrap();
        let run = server.send(TOKEN_A, session, "add").await["run_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let ended = server.finish(&run).await;
        assert_eq!(
            ended["final_answer"], "The sum is 5.",
            "{template} runs with the server's template: {ended}"
        );
    }

    let refused = create_session_with(&server, TOKEN_A, json!({"agent": "nobody"})).await;
    assert_error(
        "unknown agent",
        &refused,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    );
    assert_eq!(
        refused.body["error"]["message"],
        "unknown agent \"nobody\"; available agents: default, boss, writer"
    );
    let listed = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert_eq!(
        listed["items"].as_array().unwrap().len(),
        3,
        "the refused session was not created: {listed}"
    );
}

/// `lead` hands two tasks to `worker` in one `delegate` call, then answers "done".
fn lead_and_worker(template: &RunConfigSnapshot, dir: &Path) -> Vec<AgentProfile> {
    let worker = agent("worker", template, dir, answer("worked"), Vec::new());
    let delegate = json!({"replies": [
        {"tool_calls": [{"name": "delegate", "arguments": {"mode": "foreground", "tasks": [
            {"agent": "worker", "task": "t1"},
            {"agent": "worker", "task": "t2"}
        ]}}]},
        {"text": "done"}
    ]});
    let lead = agent("lead", template, dir, delegate, vec![worker.clone()]);
    vec![lead, worker]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegation_runs_through_the_api_and_its_tree_lists_the_children() {
    let server = Server::start_with_agents(quick_script(), lead_and_worker).await;
    let created = create_session_with(&server, TOKEN_A, json!({"agent": "lead"})).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let session = created.body["id"].as_str().unwrap().to_owned();
    let root = server.send(TOKEN_A, &session, "split the work").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let ended = server.finish(&root).await;
    assert_eq!(
        (&ended["status"], &ended["final_answer"]),
        (&json!("completed"), &json!("done")),
        "{ended}"
    );
    assert_eq!(
        ended["agent"],
        json!({"id": "lead", "hash": "hash-of-lead"}),
        "a run records the definition it was started from"
    );
    assert!(ended["parent_run_id"].is_null());

    let tree = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{root}/tree"))
        .await;
    assert_eq!(keys(&tree), ["nodes", "run_id"], "{tree}");
    assert_eq!(tree["run_id"], root.as_str());
    let nodes = tree["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "the root and its two children: {tree}");
    assert_eq!(
        keys(&nodes[0]),
        [
            "agent",
            "background",
            "created_at",
            "depth",
            "finished_at",
            "parent_run_id",
            "run_id",
            "session_id",
            "status",
            "steps",
            "stop_reason",
            "usage",
        ]
    );
    let root_node = &nodes[0];
    assert_eq!(root_node["run_id"], root.as_str());
    assert_eq!(root_node["session_id"], session.as_str());
    assert!(root_node["parent_run_id"].is_null(), "{root_node}");
    assert_eq!(
        (
            &root_node["agent"],
            &root_node["depth"],
            &root_node["status"]
        ),
        (&json!("lead"), &json!(0), &json!("completed"))
    );
    assert_eq!(root_node["steps"], ended["step_index"]);
    assert_eq!(
        root_node["usage"], ended["usage"],
        "a node's usage is its own run's"
    );
    for child in &nodes[1..] {
        let run = server
            .get_ok(
                TOKEN_A,
                &format!("/v1/runs/{}", child["run_id"].as_str().unwrap()),
            )
            .await;
        assert_eq!(child["usage"], run["usage"], "{child}");
        assert!(
            child["usage"]["model_calls"].as_u64().unwrap() >= 1,
            "{child}"
        );
    }
    let children = &nodes[1..];
    for child in children {
        assert_eq!(
            (
                &child["parent_run_id"],
                &child["depth"],
                &child["agent"],
                &child["status"],
                &child["stop_reason"],
            ),
            (
                &json!(root),
                &json!(1),
                &json!("worker"),
                &json!("completed"),
                &json!("completed"),
            ),
            "{child}"
        );
        assert_ne!(child["session_id"], session.as_str(), "{child}");
        let child_session = server
            .get_ok(
                TOKEN_A,
                &format!("/v1/sessions/{}", child["session_id"].as_str().unwrap()),
            )
            .await;
        assert_eq!(
            child_session["parent_session_id"],
            session.as_str(),
            "a child's session names its parent's: {child_session}"
        );
        assert!(child["steps"].as_u64().unwrap() >= 1, "{child}");
        assert!(child["finished_at"].is_i64(), "{child}");
    }
    let child_ids: Vec<&str> = children
        .iter()
        .map(|c| c["run_id"].as_str().unwrap())
        .collect();

    // The root's last model call saw one result per task, in task order.
    let messages = server.messages(&session).await;
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    let results: Value = serde_json::from_str(messages[2]["content"].as_str().unwrap()).unwrap();
    assert_eq!(
        results,
        json!({"results": [
            {"agent": "worker", "run_id": child_ids[0], "status": "completed", "answer": "worked"},
            {"agent": "worker", "run_id": child_ids[1], "status": "completed", "answer": "worked"},
        ]})
    );
    assert_eq!(messages[3]["content"], "done");

    // The parent's session tells of each child's start and end.
    let events = server
        .replay(&format!("/v1/sessions/{session}/events?follow=false"), None)
        .await;
    let of_kind = |kind: &str| -> Vec<Value> {
        events
            .iter()
            .filter(|e| e.kind == kind)
            .map(|e| e.data["payload"].clone())
            .collect()
    };
    let started = of_kind("subagent.started");
    assert_eq!(started.len(), 2, "{started:?}");
    for (payload, (child, task)) in started.iter().zip(children.iter().zip(["t1", "t2"])) {
        assert_eq!(
            payload,
            &json!({
                "run_id": root,
                "child_run_id": child["run_id"],
                "child_session_id": child["session_id"],
                "call_id": messages[1]["tool_calls"][0]["id"],
                "agent": "worker",
                "task": task,
                "depth": 1,
                "background": false,
            })
        );
    }
    let mut finished: Vec<String> = Vec::new();
    for payload in &of_kind("subagent.finished") {
        let child = payload["child_run_id"].as_str().unwrap();
        assert_eq!(
            payload,
            &json!({
                "run_id": root,
                "child_run_id": child,
                "agent": "worker",
                "status": "completed",
                "stop_reason": "completed",
            })
        );
        finished.push(child.to_owned());
    }
    finished.sort_unstable();
    let mut expected: Vec<String> = child_ids.iter().map(|c| c.to_string()).collect();
    expected.sort_unstable();
    assert_eq!(finished, expected, "one subagent.finished per child");

    // A child's tree is the child alone; another tenant sees no tree at all.
    let child_tree = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{}/tree", child_ids[0]))
        .await;
    assert_eq!(
        child_tree["nodes"].as_array().unwrap().len(),
        1,
        "{child_tree}"
    );
    assert_eq!(child_tree["nodes"][0]["depth"], 1);
    let child = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{}", child_ids[0]))
        .await;
    assert_eq!(child["parent_run_id"], root.as_str());
    assert_eq!(child["agent"]["id"], "worker");
    for run in [root.as_str(), child_ids[0]] {
        let path = format!("/v1/runs/{run}/tree");
        let foreign = call(server.get(TOKEN_B, &path)).await;
        assert_error(&path, &foreign, StatusCode::NOT_FOUND, "not_found");
        assert_eq!(
            foreign.body["error"]["message"],
            format!("no run {run}"),
            "as for a run that does not exist"
        );
    }
}

/// `top` hands one task to `lead`, which hands two to `worker`s: a tree three levels deep.
fn three_levels(template: &RunConfigSnapshot, dir: &Path) -> Vec<AgentProfile> {
    let mut agents = lead_and_worker(template, dir);
    let delegate = json!({"replies": [
        {"tool_calls": [{"name": "delegate", "arguments": {"mode": "foreground", "tasks": [
            {"agent": "lead", "task": "lead it"}
        ]}}]},
        {"text": "topped"}
    ]});
    let top = agent("top", template, dir, delegate, vec![agents[0].clone()]);
    agents.push(top);
    agents
}

/// A key for an event wherever a stream sent it: its session and seq.
fn at(event: &Ev) -> (String, i64) {
    (
        event.data["session_id"].as_str().unwrap().to_owned(),
        event.seq,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_stream_sends_every_event_of_every_run_once_and_resumes_after_any_of_them() {
    let server = Server::start_with_agents(quick_script(), three_levels).await;
    let created = create_session_with(&server, TOKEN_A, json!({"agent": "top"})).await;
    let session = created.body["id"].as_str().unwrap().to_owned();
    let root = server.send(TOKEN_A, &session, "go").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let tree_path = format!("/v1/runs/{root}/tree/events");
    // Followed live from the start, to the root's end.
    let mut live = server.stream(&tree_path, None).await;
    let followed = live
        .until(|e| e.kind == "run.finished" && e.run_id.as_deref() == Some(root.as_str()))
        .await;
    drop(live);

    let tree = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{root}/tree"))
        .await;
    let nodes = tree["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 4, "top, lead and two workers: {tree}");
    assert_eq!(nodes.iter().filter(|n| n["depth"] == 2).count(), 2);
    let replay = server
        .replay(&format!("{tree_path}?follow=false"), None)
        .await;

    // Every event of every run of the tree, as each run's own stream sends it, and nothing
    // else; each with its run's place.
    let mut expected = Vec::new();
    for node in nodes {
        let run = node["run_id"].as_str().unwrap();
        let own = server
            .replay(&format!("/v1/runs/{run}/events?follow=false"), None)
            .await;
        let in_tree: Vec<&Ev> = (replay.iter())
            .filter(|e| e.run_id.as_deref() == Some(run))
            .collect();
        assert_eq!(
            in_tree
                .iter()
                .map(|e| (e.seq, &e.kind, &e.data["payload"]))
                .collect::<Vec<_>>(),
            own.iter()
                .map(|e| (e.seq, &e.kind, &e.data["payload"]))
                .collect::<Vec<_>>(),
            "run {run}'s events, in its order"
        );
        for event in in_tree {
            assert_eq!(
                (&event.data["parent_run_id"], &event.data["depth"]),
                (&node["parent_run_id"], &node["depth"]),
                "{event:?}"
            );
        }
        expected.extend(own.iter().map(at));
    }
    let mut sent: Vec<_> = replay.iter().map(at).collect();
    assert_eq!(sent.len(), expected.len(), "nothing twice");
    sent.sort();
    expected.sort();
    assert_eq!(sent, expected, "every event once");

    // A child's first event comes after the `subagent.started` that tells of it.
    for node in &nodes[1..] {
        let run = node["run_id"].as_str().unwrap();
        let started = (replay.iter())
            .position(|e| e.kind == "subagent.started" && e.data["payload"]["child_run_id"] == run)
            .unwrap_or_else(|| panic!("no subagent.started for {run}"));
        let first = (replay.iter())
            .position(|e| e.run_id.as_deref() == Some(run))
            .unwrap();
        assert!(
            started < first,
            "{run}: started at {started}, first event at {first}"
        );
    }

    // What was followed live is what a replay holds (each run's events in its order).
    let mut followed_at: Vec<_> = followed.iter().map(at).collect();
    followed_at.sort();
    assert_eq!(
        followed_at, sent,
        "the live stream sent what the replay does"
    );

    // Resumed after any event, a replay sends exactly the rest.
    for (index, event) in replay.iter().enumerate() {
        let rest = server
            .replay(&format!("{tree_path}?follow=false"), Some(&event.id))
            .await;
        assert_eq!(
            rest,
            replay[index + 1..],
            "resumed after event {index} ({})",
            event.id
        );
    }
    let middle = &replay[replay.len() / 2];
    let by_query = server
        .replay(
            &format!(
                "{tree_path}?follow=false&after={}",
                middle.id.replace(',', "%2C")
            ),
            None,
        )
        .await;
    assert_eq!(
        by_query,
        replay[replay.len() / 2 + 1..],
        "?after= is Last-Event-ID"
    );

    // A child's tree stream is its subtree.
    let lead = nodes[1]["run_id"].as_str().unwrap();
    let subtree = server
        .replay(&format!("/v1/runs/{lead}/tree/events?follow=false"), None)
        .await;
    let mut runs: Vec<&str> = subtree.iter().filter_map(|e| e.run_id.as_deref()).collect();
    runs.dedup();
    assert!(!runs.contains(&root.as_str()), "{runs:?}");
    assert_eq!(
        subtree[0].data["depth"], 1,
        "depth is counted from the tree's root"
    );

    // Cursors that are not this stream's, and another tenant, are refused.
    let stranger = create_session_with(&server, TOKEN_A, json!({})).await.body["id"]
        .as_str()
        .unwrap()
        .to_owned();
    for (cursor, says) in [
        (format!("{stranger}:1"), "holds no run of"),
        ("17".to_owned(), "is not SESSION:SEQ"),
        (format!("{session}:-3"), "not a non-negative seq"),
    ] {
        let reply = call(
            server
                .get(TOKEN_A, &tree_path)
                .header("last-event-id", &cursor),
        )
        .await;
        assert_error(&cursor, &reply, StatusCode::BAD_REQUEST, "bad_request");
        let message = reply.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{cursor}: {message}");
    }
    let foreign = call(server.get(TOKEN_B, &tree_path)).await;
    assert_error(&tree_path, &foreign, StatusCode::NOT_FOUND, "not_found");
}

// ---------------------------------------------------------------------------------------
// Refusals, on a server without workers: nothing moves between requests.

/// A server on `coordinator`'s database whose catalog is `agents`, without tokens (every
/// request is the default tenant's) and without workers. Stops when `stop` is cancelled.
async fn serve_idle(
    coordinator: &Arc<Coordinator>,
    store: &Arc<dyn Store>,
    agents: Vec<AgentProfile>,
    stop: &CancellationToken,
) -> String {
    let template = RunConfigSnapshot {
        model: "scripted:demo".into(),
        ..RunConfigSnapshot::default()
    };
    let state = AppState::new(
        Arc::clone(coordinator),
        Arc::clone(store) as Arc<dyn WebhookAdmin>,
        Active::new(template, agents, Tokens::default()),
        stop.clone(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let stop = stop.clone();
    tokio::spawn(async move {
        axum::serve(listener, ratchet_server::app(state))
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
            .unwrap();
    });
    format!("http://{address}")
}

fn sqlite(dir: &tempfile::TempDir) -> Arc<dyn Store> {
    let db = format!("sqlite://{}", dir.path().join("ratchet.db").display());
    Arc::new(ratchet_sqlite::open_url(&db).unwrap())
}

fn plain_agent(id: &str) -> AgentProfile {
    AgentProfile {
        id: id.to_owned(),
        description: format!("the {id} agent"),
        config: RunConfigSnapshot {
            model: "scripted:demo".into(),
            ..RunConfigSnapshot::default()
        },
    }
}

async fn user_messages(http: &reqwest::Client, base: &str, session: &str) -> Vec<String> {
    let page = call(http.get(format!("{base}/v1/sessions/{session}/messages"))).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    page.body["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_to_a_session_whose_agent_left_the_catalog_is_a_conflict() {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir);
    let coordinator = Coordinator::new(Arc::clone(&store));
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let before = CancellationToken::new();
    let base = serve_idle(&coordinator, &store, vec![plain_agent("retired")], &before).await;
    let created = call(
        http.post(format!("{base}/v1/sessions"))
            .json(&json!({"agent": "retired"})),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.body);
    let session = created.body["id"].as_str().unwrap().to_owned();
    before.cancel();

    // The server comes back over the same database with another catalog.
    let after = CancellationToken::new();
    let base = serve_idle(&coordinator, &store, vec![plain_agent("worker")], &after).await;
    let path = format!("{base}/v1/sessions/{session}/messages");
    let refused = call(http.post(&path).json(&json!({"content": "still there?"}))).await;
    assert_error("retired agent", &refused, StatusCode::CONFLICT, "conflict");
    let message = refused.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("agent \"retired\" is no longer in the server's catalog")
            && message.contains("available agents: default, worker"),
        "{message}"
    );
    assert!(
        user_messages(&http, &base, &session).await.is_empty(),
        "nothing was recorded"
    );
    after.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_beyond_the_run_quota_is_too_many_requests() {
    let dir = tempfile::tempdir().unwrap();
    let quota = RunQuota {
        per_session: Some(1),
        global: None,
    };
    let store = sqlite(&dir);
    let coordinator = Coordinator::with_quota(Arc::clone(&store), quota);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let stop = CancellationToken::new();
    let base = serve_idle(&coordinator, &store, Vec::new(), &stop).await;
    let created = call(http.post(format!("{base}/v1/sessions")).json(&json!({}))).await;
    let session = created.body["id"].as_str().unwrap().to_owned();
    let path = format!("{base}/v1/sessions/{session}/messages");

    let first = call(http.post(&path).json(&json!({"content": "first"}))).await;
    assert_eq!(first.status, StatusCode::ACCEPTED, "{}", first.body);
    assert_eq!(first.body["run_status"], "running", "no worker ends it");
    let second = call(http.post(&path).json(&json!({"content": "second"}))).await;
    assert_error(
        "second message",
        &second,
        StatusCode::TOO_MANY_REQUESTS,
        "quota_exceeded",
    );
    let message = second.body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("has 1 unfinished runs and may have at most 1"),
        "{message}"
    );
    assert_eq!(user_messages(&http, &base, &session).await, ["first"]);
    stop.cancel();
}

// ---------------------------------------------------------------------------------------
// Background work, the inbox and the end of a session.

/// `lead` hands two tasks to `worker` in the background, then answers "started"; a later turn
/// of the same script reports.
fn lead_in_the_background(template: &RunConfigSnapshot, dir: &Path) -> Vec<AgentProfile> {
    let worker = agent("worker", template, dir, answer("worked"), Vec::new());
    let script = json!({"replies": [
        {"tool_calls": [{"name": "delegate", "arguments": {"mode": "background", "tasks": [
            {"agent": "worker", "task": "t1"},
            {"agent": "worker", "task": "t2"}
        ]}}]},
        {"text": "started"}
    ]});
    let lead = agent("lead", template, dir, script, vec![worker.clone()]);
    vec![lead, worker]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_work_reports_back_in_a_continuation_turn_and_an_archived_session_takes_nothing()
{
    let server = Server::start_with_agents(quick_script(), lead_in_the_background).await;
    let created = create_session_with(&server, TOKEN_A, json!({"agent": "lead"})).await;
    let session = created.body["id"].as_str().unwrap().to_owned();
    let mut events = server
        .stream(&format!("/v1/sessions/{session}/events"), None)
        .await;
    let root = server.send(TOKEN_A, &session, "start the work").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let ended = server.finish(&root).await;
    assert_eq!(ended["final_answer"], "started", "{ended}");
    let seen = events.until(|e| e.kind == "inbox.consumed").await;
    assert_eq!(
        inbox_kinds(&seen),
        [
            "inbox.reserved",
            "inbox.pending",
            "inbox.leased",
            "inbox.consumed"
        ],
        "one place for the group, filled once, consumed by one continuation"
    );

    let inbox = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/inbox"))
        .await;
    let items = inbox["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{inbox}");
    let event = &items[0];
    assert_eq!(
        (&event["kind"], &event["status"], &event["attempts"]),
        (&json!("group_completion"), &json!("consumed"), &json!(1)),
        "{event}"
    );
    assert_eq!(event["parent_run_id"], root.as_str());
    let answers: Vec<&Value> = event["payload"]["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["answer"])
        .collect();
    assert_eq!(answers, [&json!("worked"), &json!("worked")], "{event}");
    let continuation = event["lease_run_id"].as_str().unwrap().to_owned();
    let turn = server.finish(&continuation).await;
    assert_eq!(turn["status"], "completed", "{turn}");

    let messages = server.messages(&session).await;
    let origins: Vec<(&str, &str)> = messages
        .iter()
        .map(|m| (m["role"].as_str().unwrap(), m["origin"].as_str().unwrap()))
        .collect();
    assert_eq!(
        origins[..3],
        [("user", "user"), ("assistant", "agent"), ("tool", "agent")],
        "{messages:?}"
    );
    assert!(
        origins[4..]
            .iter()
            .all(|(_, origin)| *origin == "continuation"),
        "everything after the first turn is the continuation's: {origins:?}"
    );
    assert!(
        !messages
            .iter()
            .any(|m| m["content"].as_str().unwrap().contains("[runtime]")),
        "the hidden trigger never reaches client history"
    );
    assert_eq!(
        messages.iter().filter(|m| m["role"] == "user").count(),
        1,
        "the continuation shows no user message"
    );
    let refused_delegation = messages.iter().find(|m| {
        m["origin"] == "continuation"
            && m["role"] == "tool"
            && m["content"].as_str().unwrap().contains("delegate")
    });
    assert!(
        refused_delegation.is_some(),
        "the script asks the continuation to delegate, and a continuation may not: {messages:?}"
    );

    for (query, status) in [
        ("?status=dead_letter", StatusCode::OK),
        ("?status=lost", StatusCode::BAD_REQUEST),
        ("?cursor=x", StatusCode::BAD_REQUEST),
    ] {
        let reply =
            call(server.get(TOKEN_A, &format!("/v1/sessions/{session}/inbox{query}"))).await;
        assert_eq!(reply.status, status, "{query}: {}", reply.body);
    }
    let foreign = call(server.get(TOKEN_B, &format!("/v1/sessions/{session}/inbox"))).await;
    assert_error(
        "another tenant's inbox",
        &foreign,
        StatusCode::NOT_FOUND,
        "not_found",
    );

    let archived = call(server.post(
        TOKEN_A,
        &format!("/v1/sessions/{session}/archive"),
        json!({}),
    ))
    .await;
    assert_eq!(archived.status, StatusCode::OK, "{}", archived.body);
    assert!(archived.body["archived_at"].is_i64(), "{}", archived.body);
    let path = format!("/v1/sessions/{session}/messages");
    let refused = call(server.post(TOKEN_A, &path, json!({"content": "more"}))).await;
    assert_error(
        "a message to an archived session",
        &refused,
        StatusCode::CONFLICT,
        "conflict",
    );
    let again = call(server.post(
        TOKEN_A,
        &format!("/v1/sessions/{session}/archive"),
        json!({}),
    ))
    .await;
    assert_error("archiving twice", &again, StatusCode::CONFLICT, "conflict");
    assert_eq!(
        server.messages(&session).await.len(),
        messages.len(),
        "archived, still readable"
    );

    let deleted = server
        .http
        .delete(server.url(&format!("/v1/sessions/{session}")))
        .bearer_auth(TOKEN_A)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), StatusCode::NO_CONTENT);
    let gone = call(server.get(TOKEN_A, &format!("/v1/sessions/{session}"))).await;
    assert_error(
        "a deleted session",
        &gone,
        StatusCode::NOT_FOUND,
        "not_found",
    );
    let listed = server.get_ok(TOKEN_A, "/v1/sessions").await;
    assert!(!ids(&listed["items"]).contains(&session), "{listed}");
}

/// A worker's answer larger than a continuation's trigger and than one tool result may be.
fn long_answer() -> String {
    (0..1_500)
        .map(|i| format!("line {i:05} of the answer\n"))
        .collect()
}

/// One model for a whole tree: a lead with `delegate` sends the work to the background and
/// says "started"; a worker answers `long_answer()`; a continuation reads the reported run's
/// answer with `agent_task get_result`, page after page, and tells whether it read it whole.
struct PagingReader;

#[async_trait::async_trait]
impl ratchet_llm::Model for PagingReader {
    async fn complete(
        &self,
        request: ratchet_llm::ModelRequest,
        _deltas: tokio::sync::mpsc::UnboundedSender<String>,
        _cancel: CancellationToken,
    ) -> ratchet_llm::Result<ratchet_core::ModelReply> {
        let text = |text: String| ratchet_core::ModelReply {
            text,
            ..Default::default()
        };
        let call = |name: &str, arguments: Value| ratchet_core::ModelReply {
            tool_calls: vec![ratchet_core::ToolCall {
                id: format!("c{}", request.call_index),
                name: name.into(),
                arguments,
            }],
            ..Default::default()
        };
        let trigger = (request.messages.iter())
            .position(|m| m.role == ratchet_core::Role::User && m.content.starts_with("[runtime]"));
        let Some(trigger) = trigger else {
            let offered = |name: &str| request.tools.iter().any(|t| t.name == name);
            return Ok(match (offered("delegate"), request.call_index) {
                (true, 0) => call(
                    "delegate",
                    json!({"mode": "background", "tasks": [{"agent": "worker", "task": "write it"}]}),
                ),
                (true, _) => text("started".into()),
                (false, _) => text(long_answer()),
            });
        };
        let shown = &request.messages[trigger].content;
        let reports: Value =
            serde_json::from_str(&shown[shown.find("\n[").unwrap() + 1..]).unwrap();
        let run = reports[0]["report"]["results"][0]["run_id"].clone();
        let pages: Vec<Value> = (request.messages[trigger..].iter())
            .filter(|m| m.role == ratchet_core::Role::Tool)
            .map(|m| serde_json::from_str(&m.content).unwrap())
            .collect();
        let next = match pages.last() {
            None => json!(0),
            Some(page) => page["next_offset"].clone(),
        };
        if !next.is_null() {
            let arguments = json!({"action": "get_result", "run_id": run, "offset": next});
            return Ok(call("agent_task", arguments));
        }
        let read: String = pages
            .iter()
            .map(|p| p["answer"].as_str().unwrap())
            .collect();
        Ok(text(format!(
            "read {} bytes in {} pages, whole: {}",
            read.len(),
            pages.len(),
            read == long_answer()
        )))
    }
}

/// A report whose answer is longer than the trigger holds: the trigger carries a part and
/// says where the rest is, and the continuation reads it whole through `agent_task
/// get_result`, one page at a time, no page cut on its way to the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_reads_a_long_report_whole_a_page_at_a_time() {
    let server = Server::launch(
        quick_script(),
        |_, models| models.register("reader", Arc::new(PagingReader)),
        |template, dir| {
            let mut template = template.clone();
            template.model = "reader".into();
            template.limits.max_tool_result_bytes = 8_192;
            let mut worker = agent("worker", &template, dir, answer("unused"), Vec::new());
            worker.config.model = "reader".into();
            let mut lead = agent(
                "lead",
                &template,
                dir,
                answer("unused"),
                vec![worker.clone()],
            );
            lead.config.model = "reader".into();
            vec![lead, worker]
        },
    )
    .await;
    let created = create_session_with(&server, TOKEN_A, json!({"agent": "lead"})).await;
    let session = created.body["id"].as_str().unwrap().to_owned();
    let root = server.send(TOKEN_A, &session, "start the work").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(server.finish(&root).await["final_answer"], "started");
    let settle = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let continuation = loop {
        let inbox = (server.get_ok(TOKEN_A, &format!("/v1/sessions/{session}/inbox"))).await;
        if let Some(run) = inbox["items"][0]["lease_run_id"].as_str() {
            break run.to_owned();
        }
        assert!(
            tokio::time::Instant::now() < settle,
            "no continuation: {inbox}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let turn = server.finish(&continuation).await;
    let whole = long_answer().len();
    let pages = whole.div_ceil(8_192 / 2 - 512);
    assert_eq!(
        turn["final_answer"],
        format!("read {whole} bytes in {pages} pages, whole: true"),
        "{turn}"
    );
    let trigger = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{continuation}/steps/1"))
        .await;
    let shown = trigger.to_string();
    assert!(
        shown.contains(&format!("of {whole} bytes")) && !shown.contains(&long_answer()),
        "the trigger carries a part of the answer and says how long it is: {shown}"
    );
}

/// A continuation whose model call keeps failing: the failed turn gives its report back, a
/// later turn tries again, and after the last attempt the report goes to the dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_whose_model_keeps_failing_is_retried_then_dead_lettered() {
    let server = Server::start_with(quick_script(), |template, models| {
        // Delegates when it may, answers otherwise, and fails whenever it is asked to report.
        let picky = crate::common::FnModel(|request: ratchet_llm::ModelRequest| {
            let reporting = request
                .messages
                .last()
                .is_some_and(|m| m.content.starts_with("[runtime]"));
            if reporting {
                return Err(ratchet_llm::Error::transient("HTTP 503 while reporting"));
            }
            let delegates = request.tools.iter().any(|t| t.name == "delegate");
            let reply = match (delegates, request.call_index) {
                (true, 0) => ratchet_core::ModelReply {
                    tool_calls: vec![ratchet_core::ToolCall {
                        id: "call-1".into(),
                        name: "delegate".into(),
                        arguments: json!({"mode": "background", "tasks": [{"agent": "worker", "task": "t1"}]}),
                    }],
                    ..Default::default()
                },
                (true, _) => ratchet_core::ModelReply {
                    text: "started".into(),
                    ..Default::default()
                },
                (false, _) => ratchet_core::ModelReply {
                    text: "worked".into(),
                    ..Default::default()
                },
            };
            Ok(reply)
        });
        models.register("picky", Arc::new(picky));
        template.model = "picky".into();
        template.limits.max_model_attempts = 2;
        template.delegation.inbox.max_attempts = 2;
        template.delegation.inbox.retry_backoff_ms = 20;
        let worker = AgentProfile {
            id: "worker".into(),
            description: "works".into(),
            config: template.clone(),
        };
        template.tools.push(delegate_tool(std::slice::from_ref(&worker)));
        template.delegation.agents = vec![worker];
    })
    .await;
    let session = server.create_session(TOKEN_A).await;
    let mut events = server
        .stream(&format!("/v1/sessions/{session}/events"), None)
        .await;
    let root = server.send(TOKEN_A, &session, "start").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(server.finish(&root).await["final_answer"], "started");
    let seen = events.until(|e| e.kind == "inbox.dead_lettered").await;
    assert_eq!(
        inbox_kinds(&seen),
        [
            "inbox.reserved",
            "inbox.pending",
            "inbox.leased",
            "inbox.released",
            "inbox.leased",
            "inbox.dead_lettered"
        ]
    );
    let dead = server
        .get_ok(
            TOKEN_A,
            &format!("/v1/sessions/{session}/inbox?status=dead_letter"),
        )
        .await;
    let event = &dead["items"][0];
    assert_eq!(
        (&event["attempts"], &event["max_attempts"]),
        (&json!(2), &json!(2)),
        "{dead}"
    );
    assert!(
        event["reason"].as_str().unwrap().contains("llm_error"),
        "{event}"
    );
    let runs = server
        .get_ok(TOKEN_A, &format!("/v1/sessions/{session}/runs"))
        .await;
    let statuses: Vec<(&str, &str)> = runs["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["status"].as_str().unwrap(),
                r["stop_reason"].as_str().unwrap_or("-"),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        [
            ("completed", "completed"),
            ("failed", "llm_error"),
            ("failed", "llm_error")
        ],
        "the first turn, then two continuations that failed"
    );
    assert!(
        !server
            .messages(&session)
            .await
            .iter()
            .any(|m| m["content"].as_str().unwrap().contains("[runtime]")),
        "failed triggers stay hidden too"
    );

    // An operator acts on the dead letter.
    let id = event["id"].as_i64().unwrap();
    let path = |action: &str| format!("/v1/sessions/{session}/inbox/{id}/{action}");
    for (what, reply, status, code) in [
        (
            "a blank name",
            call(server.post(TOKEN_A, &path("requeue"), json!({"by": " "}))).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            "an unknown field",
            call(server.post(TOKEN_A, &path("requeue"), json!({"who": "x"}))).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        ),
        (
            "an event id that is not a number",
            call(server.post(
                TOKEN_A,
                &format!("/v1/sessions/{session}/inbox/x/requeue"),
                json!({}),
            ))
            .await,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "an event the inbox does not have",
            call(server.post(
                TOKEN_A,
                &format!("/v1/sessions/{session}/inbox/999999/discard"),
                json!({}),
            ))
            .await,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "another tenant's dead letter",
            call(server.post(TOKEN_B, &path("requeue"), json!({}))).await,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
    ] {
        assert_error(what, &reply, status, code);
    }
    let requeued = call(server.post(TOKEN_A, &path("requeue"), json!({"by": "ops"}))).await;
    assert_eq!(requeued.status, StatusCode::OK, "{}", requeued.body);
    assert_eq!(
        (&requeued.body["status"], &requeued.body["attempts"]),
        (&json!("leased"), &json!(1)),
        "its attempts afresh, and at once a continuation's: {}",
        requeued.body
    );
    assert!(requeued.body["requeued_at"].is_i64(), "{}", requeued.body);
    let seen = events.until(|e| e.kind == "inbox.dead_lettered").await;
    assert_eq!(
        inbox_kinds(&seen),
        [
            "inbox.requeued",
            "inbox.leased",
            "inbox.released",
            "inbox.leased",
            "inbox.dead_lettered"
        ],
        "a requeued report gets its attempts afresh"
    );
    let discarded = call(server.post(TOKEN_A, &path("discard"), json!({"by": "alice"}))).await;
    assert_eq!(discarded.status, StatusCode::OK, "{}", discarded.body);
    assert_eq!(discarded.body["status"], "discarded");
    assert!(
        discarded.body["reason"]
            .as_str()
            .unwrap()
            .starts_with("discarded by alice"),
        "{}",
        discarded.body
    );
    let again = call(server.post(TOKEN_A, &path("discard"), json!({"by": "alice"}))).await;
    assert_eq!(
        (again.status, &again.body),
        (StatusCode::OK, &discarded.body),
        "a repeat"
    );
    let refused = call(server.post(TOKEN_A, &path("requeue"), json!({}))).await;
    assert_error(
        "requeue of a discarded event",
        &refused,
        StatusCode::CONFLICT,
        "conflict",
    );
}

// ---------------------------------------------------------------------------------------
// Reloads: a whole new catalog and template, or none of it.

/// `profile` as a later version of its definition would freeze it: another hash, another
/// script (written to `dir/ID-VERSION.json`), another prompt and step budget.
fn revised(
    profile: &AgentProfile,
    version: &str,
    dir: &Path,
    script: Value,
    max_steps: u64,
) -> AgentProfile {
    let path = dir.join(format!("{}-{version}.json", profile.id));
    std::fs::write(&path, script.to_string()).unwrap();
    let mut revised = profile.clone();
    revised.config.model = format!("scripted:{}", path.display());
    revised.config.system_prompt = format!("You are {} {version}.", profile.id);
    revised.config.limits.max_steps = max_steps;
    revised.config.agent = Some(AgentRef {
        id: profile.id.clone(),
        hash: format!("hash-of-{}-{version}", profile.id),
    });
    revised
}

async fn reload(server: &Server, token: &str) -> Reply {
    call(server.post(token, "/v1/admin/reload", json!({}))).await
}

/// The configuration a run was frozen with, as stored.
async fn frozen_config(server: &Server, run: &str) -> RunConfigSnapshot {
    let id = ratchet_core::RunId::parse(run).unwrap();
    let state = server.coordinator.store().load_state(&id).await.unwrap();
    state.config.as_ref().clone()
}

/// One agent's `hash` in a listing of agents.
fn hash_of<'a>(items: &'a Value, id: &str) -> &'a Value {
    let items = items.as_array().unwrap();
    &items.iter().find(|a| a["id"] == id).unwrap()["hash"]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_replaces_the_catalog_and_the_template_whole() {
    let server = Server::start_with_agents(quick_script(), writer_and_boss).await;
    let old = writer_and_boss(&server.template, &server.dir);
    let writer = revised(&old[0], "v2", &server.dir, answer("rewritten"), 10);
    let editor = agent(
        "editor",
        &server.template,
        &server.dir,
        answer("edited"),
        Vec::new(),
    );
    let mut template = server.template.clone();
    template.limits.max_steps = 7;
    template.system_prompt = "The reloaded template.".into();
    server.queue_reload(Ok(Prepared {
        active: Active::new(
            template.clone(),
            vec![writer.clone(), editor.clone()],
            server_tokens(),
        ),
        restart_required: vec!["listen".into()],
    }));

    let anonymous = call(server.http.post(server.url("/v1/admin/reload"))).await;
    assert_error(
        "no token",
        &anonymous,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    let reloaded = reload(&server, TOKEN_B).await;
    assert_eq!(
        reloaded.status,
        StatusCode::OK,
        "any tenant may reload: {}",
        reloaded.body
    );
    assert_eq!(
        keys(&reloaded.body),
        ["agents", "model", "reloaded_at", "restart_required"],
        "{}",
        reloaded.body
    );
    assert_eq!(
        reloaded.body["agents"],
        json!([
            {"id": "editor", "hash": "hash-of-editor"},
            {"id": "writer", "hash": "hash-of-writer-v2"}
        ])
    );
    assert_eq!(reloaded.body["model"], template.model.as_str());
    assert_eq!(reloaded.body["restart_required"], json!(["listen"]));

    let listed = server.get_ok(TOKEN_A, "/v1/agents").await;
    assert_eq!(ids(&listed["items"]), ["editor", "writer"], "boss is gone");
    assert_eq!(hash_of(&listed["items"], "writer"), "hash-of-writer-v2");
    let refused = create_session_with(&server, TOKEN_A, json!({"agent": "boss"})).await;
    assert_error(
        "an agent the reload removed",
        &refused,
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid_request",
    );

    let (run, ended) = run_as(&server, "writer", "write").await;
    assert_eq!(ended["final_answer"], "rewritten", "{ended}");
    assert_eq!(ended["agent"]["hash"], "hash-of-writer-v2", "{ended}");
    assert_eq!(frozen_config(&server, &run).await, writer.config);

    let (_, run, ended) = server.run_to_end("add").await;
    assert_eq!(ended["final_answer"], "The sum is 5.", "{ended}");
    assert_eq!(
        frozen_config(&server, &run).await,
        template,
        "a session that names no agent runs with the new template"
    );
}

/// The tokens the harness starts with.
fn server_tokens() -> Tokens {
    Tokens::new(std::collections::HashMap::from([
        (ratchet_server::hash_token(TOKEN_A), "tenant-a".to_owned()),
        (ratchet_server::hash_token(TOKEN_B), "tenant-b".to_owned()),
    ]))
    .with_admins([TOKEN_A, TOKEN_B].map(ratchet_server::hash_token))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_reload_lists_every_problem_and_keeps_the_old_catalog() {
    let server = Server::start_with_agents(quick_script(), writer_and_boss).await;
    let before = server.get_ok(TOKEN_A, "/v1/agents").await;
    let problems = [
        "agents/writer.md:4: tools: unknown tool \"rm_rf\"",
        "agents/boss.md:3: model: unknown model profile \"huge\"",
    ];
    server.queue_reload(Err(problems.map(str::to_owned).to_vec()));

    let rejected = reload(&server, TOKEN_A).await;
    assert_eq!(
        rejected.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        rejected.body
    );
    let error = &rejected.body["error"];
    assert_eq!(keys(error), ["code", "message", "problems"], "{error}");
    assert_eq!(error["code"], "invalid_request");
    assert_eq!(
        error["message"],
        "reload rejected (2 problems); the previous configuration stays active"
    );
    assert_eq!(error["problems"], json!(problems));

    assert_eq!(server.get_ok(TOKEN_A, "/v1/agents").await, before);
    let (_, ended) = run_as(&server, "writer", "write").await;
    assert_eq!(
        (&ended["final_answer"], &ended["agent"]["hash"]),
        (&json!("written"), &json!("hash-of-writer")),
        "a new session still runs the old definition: {ended}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_keeps_the_definition_and_configuration_it_was_frozen_with_across_a_reload() {
    let slow_writer = |template: &RunConfigSnapshot, dir: &Path| {
        let script = json!({"replies": [
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 400}}]},
            {"text": "written before the reload"}
        ]});
        vec![agent("writer", template, dir, script, Vec::new())]
    };
    let server = Server::start_with_agents(quick_script(), slow_writer).await;
    let old = slow_writer(&server.template, &server.dir).remove(0);
    let created = create_session_with(&server, TOKEN_A, json!({"agent": "writer"})).await;
    let session = created.body["id"].as_str().unwrap().to_owned();
    let old_run = server.send(TOKEN_A, &session, "write").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut events = server
        .stream(&format!("/v1/runs/{old_run}/events"), None)
        .await;
    events.until_running("sleep_ms").await;

    // One step: the old run, which needs three, would stop early if it took this budget.
    let new = revised(
        &old,
        "v2",
        &server.dir,
        answer("written after the reload"),
        1,
    );
    server.queue_reload(Ok(Prepared {
        active: Active::new(server.template.clone(), vec![new.clone()], server_tokens()),
        restart_required: Vec::new(),
    }));
    assert_eq!(reload(&server, TOKEN_A).await.status, StatusCode::OK);

    let ended = server.finish(&old_run).await;
    assert_eq!(
        (
            &ended["status"],
            &ended["final_answer"],
            &ended["step_index"]
        ),
        (
            &json!("completed"),
            &json!("written before the reload"),
            &json!(3)
        ),
        "{ended}"
    );
    assert_eq!(ended["agent"]["hash"], "hash-of-writer", "{ended}");
    assert_eq!(frozen_config(&server, &old_run).await, old.config);

    let next_run = server.send(TOKEN_A, &session, "write again").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let ended = server.finish(&next_run).await;
    assert_eq!(
        (&ended["final_answer"], &ended["agent"]["hash"]),
        (
            &json!("written after the reload"),
            &json!("hash-of-writer-v2")
        ),
        "the session's next run is frozen from the definition active now: {ended}"
    );
    assert_eq!(frozen_config(&server, &next_run).await, new.config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_rotates_the_tokens() {
    let server = Server::start(quick_script()).await;
    let only_b = Tokens::new(std::collections::HashMap::from([(
        ratchet_server::hash_token(TOKEN_B),
        "tenant-b".to_owned(),
    )]))
    .with_admins([ratchet_server::hash_token(TOKEN_B)]);
    server.queue_reload(Ok(Prepared {
        active: Active::new(server.template.clone(), Vec::new(), only_b),
        restart_required: Vec::new(),
    }));
    assert_eq!(reload(&server, TOKEN_A).await.status, StatusCode::OK);
    let retired = call(server.get(TOKEN_A, "/v1/sessions")).await;
    assert_error(
        "a retired token",
        &retired,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    server.get_ok(TOKEN_B, "/v1/sessions").await;

    let nothing_queued = reload(&server, TOKEN_B).await;
    assert_eq!(nothing_queued.status, StatusCode::UNPROCESSABLE_ENTITY);
    server.get_ok(TOKEN_B, "/v1/sessions").await;
}

/// Reloads asked for at once are prepared one after the other, and activated in that order:
/// the last one prepared is the one left active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reloads_are_prepared_and_activated_one_at_a_time() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite(&dir);
    let coordinator = Coordinator::new(Arc::clone(&store));
    let preparing = Arc::new(AtomicUsize::new(0));
    let most_at_once = Arc::new(AtomicUsize::new(0));
    let prepared = Arc::new(AtomicUsize::new(0));
    let reloader = {
        let (preparing, most_at_once, prepared) =
            (preparing.clone(), most_at_once.clone(), prepared.clone());
        move || {
            let now = preparing.fetch_add(1, Ordering::SeqCst) + 1;
            most_at_once.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(30));
            let n = prepared.fetch_add(1, Ordering::SeqCst) + 1;
            preparing.fetch_sub(1, Ordering::SeqCst);
            let template = RunConfigSnapshot {
                model: format!("scripted:reload-{n}"),
                ..RunConfigSnapshot::default()
            };
            Ok(Prepared {
                active: Active::new(template, Vec::new(), Tokens::default()),
                restart_required: Vec::new(),
            })
        }
    };
    let state = AppState::new(
        coordinator,
        store,
        Active::default(),
        CancellationToken::new(),
    )
    .with_reloader(reloader);
    let reloads = state.reloads().unwrap();
    let answers = futures::future::join_all((0..4).map(|_| reloads.reload())).await;
    let mut models: Vec<String> = answers
        .into_iter()
        .map(|a| a.unwrap().active.run_template().model.clone())
        .collect();
    models.sort();
    assert_eq!(
        models,
        [
            "scripted:reload-1",
            "scripted:reload-2",
            "scripted:reload-3",
            "scripted:reload-4"
        ]
    );
    assert_eq!(
        most_at_once.load(Ordering::SeqCst),
        1,
        "prepares overlapped"
    );
    assert_eq!(state.active().run_template().model, "scripted:reload-4");
}

/// The kinds of the inbox's events among `events`, in order.
fn inbox_kinds(events: &[Ev]) -> Vec<&str> {
    (kinds(events).into_iter())
        .filter(|k| k.starts_with("inbox."))
        .collect()
}

/// `lead` starts `worker` in the background and answers at once: the worker's report to the
/// session's inbox names it as its source.
fn background_worker(template: &RunConfigSnapshot, dir: &Path) -> Vec<AgentProfile> {
    let worker = agent("worker", template, dir, answer("worked"), Vec::new());
    let delegate = json!({"replies": [
        {"tool_calls": [{"name": "delegate", "arguments": {"mode": "background", "tasks": [
            {"agent": "worker", "task": "t1"}
        ]}}]},
        {"text": "started it"},
        {"text": "the worker reported"}
    ]});
    let lead = agent("lead", template, dir, delegate, vec![worker.clone()]);
    vec![lead, worker]
}

/// The events of the root session's own that a run of the tree is the source of — the
/// inbox report of a background child — are part of the tree stream, live and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_stream_carries_the_inbox_reports_its_runs_are_the_source_of() {
    let server = Server::start_with_agents(quick_script(), background_worker).await;
    let created = create_session_with(&server, TOKEN_A, json!({"agent": "lead"})).await;
    let session = created.body["id"].as_str().unwrap().to_owned();
    let root = server.send(TOKEN_A, &session, "go").await["run_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let tree_path = format!("/v1/runs/{root}/tree/events");
    let mut live = server.stream(&tree_path, None).await;
    let followed = live.until(|e| e.kind == "inbox.pending").await;
    drop(live);
    let report = followed.last().unwrap();
    assert_eq!(report.run_id, None, "{report:?}");
    let child = report.data["payload"]["source_run_id"].as_str().unwrap();
    let tree = server
        .get_ok(TOKEN_A, &format!("/v1/runs/{root}/tree"))
        .await;
    let runs: Vec<&str> = (tree["nodes"].as_array().unwrap().iter())
        .map(|n| n["run_id"].as_str().unwrap())
        .collect();
    assert!(runs.contains(&child), "{child} is of the tree {runs:?}");
    let replay = server
        .replay(&format!("{tree_path}?follow=false"), None)
        .await;
    let replayed: Vec<&Ev> = (replay.iter())
        .filter(|e| e.kind == "inbox.pending")
        .collect();
    assert_eq!(replayed.len(), 1, "{replayed:?}");
    assert_eq!(replayed[0].data["payload"], report.data["payload"]);
    // The root run's own stream is its events alone.
    let own = server
        .replay(&format!("/v1/runs/{root}/events?follow=false"), None)
        .await;
    assert!(
        own.iter()
            .all(|e| e.run_id.as_deref() == Some(root.as_str()))
    );
}
