//! The OpenAPI document, through `app()` without a socket: the Python and TypeScript SDKs are
//! generated from it, so it must say exactly what the server accepts and answers. Every
//! `$ref` resolves; ids carry their pattern, status filters and orders their names, integers
//! the bounds the server enforces; cursors are opaque strings; request bodies require what
//! the server requires and refuse unknown fields as the server does.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use ratchet_core::{DeliveryStatus, InboxStatus, RunConfigSnapshot};
use ratchet_engine::Coordinator;
use ratchet_server::{Active, AppState};
use ratchet_store::{ApprovalStatus, Store};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

const SESSION_ID: &str = "^ses_[A-Za-z0-9-]{1,64}$";
const RUN_ID: &str = "^run_[A-Za-z0-9-]{1,64}$";
const APPROVAL_ID: &str = "^apr_[A-Za-z0-9-]{1,85}$";
const WEBHOOK_ID: &str = "^whk_[A-Za-z0-9-]{1,64}$";
const SCHEDULE_ID: &str = "^sch_[A-Za-z0-9-]{1,64}$";

/// `GET /openapi.json` of a server on a fresh SQLite file.
async fn document() -> Value {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("ratchet.db").display());
    let store: Arc<dyn Store> = Arc::new(ratchet_sqlite::open_url(&db).unwrap());
    let state = AppState::new(
        Coordinator::new(Arc::clone(&store)),
        store,
        Active::new(RunConfigSnapshot::default(), Vec::new(), Default::default()),
        CancellationToken::new(),
    );
    let request = Request::get("/openapi.json").body(Body::empty()).unwrap();
    let response = ratchet_server::app(state).oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

/// Every value of a `$ref` anywhere in `value`, with where it was found.
fn references(value: &Value, at: &str, found: &mut Vec<(String, String)>) {
    match value {
        Value::Object(object) => {
            for (key, inner) in object {
                match (key.as_str(), inner) {
                    ("$ref", Value::String(target)) => found.push((at.to_owned(), target.clone())),
                    _ => references(inner, &format!("{at}/{key}"), found),
                }
            }
        }
        Value::Array(items) => {
            for (index, inner) in items.iter().enumerate() {
                references(inner, &format!("{at}/{index}"), found);
            }
        }
        _ => {}
    }
}

/// The schema `schema` stands for: a `$ref` followed, and a nullable `oneOf` of null and one
/// schema taken as that schema.
fn resolved<'a>(document: &'a Value, schema: &'a Value) -> &'a Value {
    if let Some(target) = schema["$ref"].as_str() {
        let pointer = target.strip_prefix('#').unwrap();
        return resolved(document, document.pointer(pointer).unwrap());
    }
    if let Some(branches) = schema["oneOf"].as_array() {
        let not_null: Vec<&Value> = (branches.iter())
            .filter(|branch| branch["type"] != "null")
            .collect();
        if let [only] = not_null[..] {
            return resolved(document, only);
        }
    }
    schema
}

/// Every operation: its method, path and description.
fn operations(document: &Value) -> Vec<(String, String, &Value)> {
    let mut found = Vec::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            found.push((method.clone(), path.clone(), operation));
        }
    }
    found
}

/// The schema of each parameter of `operation` named `name`.
fn parameter<'a>(document: &'a Value, operation: &'a Value, name: &str) -> Option<&'a Value> {
    let parameters = operation["parameters"].as_array()?;
    let found = parameters.iter().find(|p| p["name"] == name)?;
    Some(resolved(document, &found["schema"]))
}

fn names(all: impl IntoIterator<Item = &'static str>) -> Value {
    Value::Array(all.into_iter().map(Value::from).collect())
}

#[tokio::test]
async fn every_reference_names_a_part_of_the_document() {
    let document = document().await;
    let mut found = Vec::new();
    references(&document, "#", &mut found);
    assert!(
        found.len() > 100,
        "the document refers to its components: {found:?}"
    );
    let dangling: Vec<&(String, String)> = (found.iter())
        .filter(|(_, target)| {
            let pointer = target.strip_prefix('#');
            pointer.and_then(|p| document.pointer(p)).is_none()
        })
        .collect();
    assert!(
        dangling.is_empty(),
        "references to nothing (where, target): {dangling:#?}"
    );
}

#[tokio::test]
async fn ids_carry_their_pattern_in_paths_and_fields() {
    let document = document().await;
    let id_of_path = |path: &str| match path.split('/').nth(2) {
        Some("sessions") => SESSION_ID,
        Some("runs") => RUN_ID,
        Some("approvals") => APPROVAL_ID,
        Some("webhooks") => WEBHOOK_ID,
        Some("schedules") => SCHEDULE_ID,
        other => panic!("{path}: an id of what? {other:?}"),
    };
    let mut checked = 0;
    for (method, path, operation) in operations(&document) {
        let Some(id) = parameter(&document, operation, "id") else {
            continue;
        };
        assert_eq!(id["pattern"], id_of_path(&path), "{method} {path}: {id}");
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} operations take an id");

    let field_pattern = |field: &str| match field {
        "session_id" | "parent_session_id" => Some(SESSION_ID),
        "run_id" | "active_run_id" | "parent_run_id" | "source_run_id" | "lease_run_id"
        | "last_run_id" => Some(RUN_ID),
        "schedule_id" => Some(SCHEDULE_ID),
        _ => None,
    };
    let mut fields = 0;
    for (name, schema) in document["components"]["schemas"].as_object().unwrap() {
        let Some(properties) = schema["properties"].as_object() else {
            continue;
        };
        for (field, property) in properties {
            if let Some(pattern) = field_pattern(field) {
                let property = resolved(&document, property);
                assert_eq!(property["pattern"], pattern, "{name}.{field}: {property}");
                fields += 1;
            }
        }
    }
    assert!(fields >= 20, "only {fields} id fields");
    let own_id = [
        ("SessionView", SESSION_ID),
        ("RunView", RUN_ID),
        ("RunSummaryView", RUN_ID),
        ("ApprovalView", APPROVAL_ID),
        ("WebhookView", WEBHOOK_ID),
        ("RotatedSecret", WEBHOOK_ID),
        ("ScheduleView", SCHEDULE_ID),
    ];
    for (name, pattern) in own_id {
        let id = &document["components"]["schemas"][name]["properties"]["id"];
        assert_eq!(resolved(&document, id)["pattern"], pattern, "{name}.id");
    }
    let message = &document["components"]["schemas"]["MessageView"]["properties"]["id"];
    assert_eq!(
        resolved(&document, message)["pattern"],
        "^msg_[A-Za-z0-9-]+$"
    );
}

#[tokio::test]
async fn status_filters_and_orders_name_every_value_the_server_takes() {
    let document = document().await;
    let paths = &document["paths"];
    let sessions = &paths["/v1/sessions"]["get"];
    let enum_of = |operation: &Value, name: &str| {
        parameter(&document, operation, name).unwrap()["enum"].clone()
    };
    assert_eq!(
        enum_of(sessions, "order"),
        json!(["oldest", "newest", "activity"])
    );
    assert_eq!(
        enum_of(sessions, "status"),
        json!(["waiting_human", "active", "failed", "idle", "archived"])
    );
    assert_eq!(
        enum_of(&paths["/v1/approvals"]["get"], "status"),
        names(ApprovalStatus::ALL.map(ApprovalStatus::as_str))
    );
    assert_eq!(
        enum_of(&paths["/v1/sessions/{id}/inbox"]["get"], "status"),
        names(InboxStatus::ALL.map(InboxStatus::as_str))
    );
    assert_eq!(
        enum_of(&paths["/v1/webhooks/{id}/deliveries"]["get"], "status"),
        names(DeliveryStatus::ALL.map(DeliveryStatus::as_str))
    );
}

#[tokio::test]
async fn integers_carry_the_bounds_the_server_enforces() {
    let document = document().await;
    let bounds = |schema: &Value| (schema["minimum"].clone(), schema["maximum"].clone());
    let mut limits = 0;
    for (method, path, operation) in operations(&document) {
        if let Some(limit) = parameter(&document, operation, "limit") {
            assert_eq!(bounds(limit), (json!(1), json!(200)), "{method} {path}");
            limits += 1;
        }
        if let Some(after) = parameter(&document, operation, "after")
            && after["type"] == "integer"
        {
            assert_eq!(after["minimum"], 0, "{method} {path}: {after}");
        }
    }
    assert_eq!(limits, 9, "every paged list takes a limit");
    let paths = &document["paths"];
    let step = parameter(
        &document,
        &paths["/v1/runs/{id}/steps/{index}"]["get"],
        "index",
    );
    assert_eq!(step.unwrap()["minimum"], 1);
    for path in ["/v1/sessions/{id}/events", "/v1/runs/{id}/events"] {
        let after = parameter(&document, &paths[path]["get"], "after").unwrap();
        assert_eq!(
            (&after["type"], &after["minimum"]),
            (&json!("integer"), &json!(0))
        );
    }
    let sessions = &paths["/v1/sessions"]["get"];
    for name in ["created_from", "created_before"] {
        let time = parameter(&document, sessions, name).unwrap();
        assert_eq!(time["minimum"], 0, "{name}");
    }
    let webhook = &document["components"]["schemas"]["CreateWebhook"]["properties"];
    assert_eq!(
        bounds(resolved(&document, &webhook["max_attempts"])),
        (json!(1), json!(50))
    );
}

#[tokio::test]
async fn cursors_are_opaque_strings_the_server_issued() {
    let document = document().await;
    let mut cursors = 0;
    for (method, path, operation) in operations(&document) {
        let Some(cursor) = parameter(&document, operation, "cursor") else {
            continue;
        };
        assert_eq!(cursor["type"], "string", "{method} {path}");
        assert_eq!(cursor["minLength"], 1, "{method} {path}");
        let parameters = operation["parameters"].as_array().unwrap();
        let described = parameters.iter().find(|p| p["name"] == "cursor").unwrap();
        let description = described["description"].as_str().unwrap_or_default();
        assert!(
            description.contains("opaque cursor the server issued"),
            "{method} {path}: {description:?}"
        );
        cursors += 1;
    }
    assert_eq!(cursors, 9, "every paged list takes a cursor");
}

#[tokio::test]
async fn request_bodies_require_what_the_server_requires_and_nothing_else() {
    let document = document().await;
    // Per body: whether it must be sent, and the fields each of its shapes requires.
    let expected = json!({
        "post /v1/sessions": [true, [[]]],
        "patch /v1/sessions/{id}": [true, [["title"]]],
        "post /v1/sessions/{id}/messages": [true, [["content"]]],
        "post /v1/runs/{id}/reconcile": [true, [["call_id", "outcome"]]],
        "post /v1/runs/{id}/continue": [true, [[]]],
        "post /v1/runs/{id}/fork": [true, [["at_step"]]],
        "post /v1/approvals/{id}": [true, [["decisions"], ["abort"]]],
        "post /v1/webhooks": [true, [["url"]]],
        "post /v1/webhooks/{id}/rotate-secret": [false, [[]]],
        "post /v1/sessions/{id}/inbox/{event_id}/requeue": [false, [[]]],
        "post /v1/sessions/{id}/inbox/{event_id}/discard": [false, [[]]],
        "post /v1/schedules": [true, [["message", "session", "overlap", "catch_up"]]],
        "patch /v1/schedules/{id}": [true, [[]]],
    });
    let mut found = serde_json::Map::new();
    for (method, path, operation) in operations(&document) {
        let body = &operation["requestBody"];
        if body.is_null() {
            continue;
        }
        let schema = resolved(&document, &body["content"]["application/json"]["schema"]);
        let shapes = match schema["oneOf"].as_array() {
            Some(shapes) => shapes.iter().collect(),
            None => vec![schema],
        };
        let mut required = Vec::new();
        for shape in shapes {
            assert_eq!(
                (&shape["type"], &shape["additionalProperties"]),
                (&json!("object"), &json!(false)),
                "{method} {path}: an object, and the server refuses unknown fields: {shape}"
            );
            required.push(shape.get("required").cloned().unwrap_or(json!([])));
        }
        let must_send = body["required"].as_bool().unwrap_or(false);
        found.insert(format!("{method} {path}"), json!([must_send, required]));
    }
    assert_eq!(Value::Object(found), expected);
}

#[tokio::test]
async fn an_optional_body_is_absent_or_an_object_never_null() {
    let document = document().await;
    let paths = &document["paths"];
    for path in [
        "/v1/webhooks/{id}/rotate-secret",
        "/v1/sessions/{id}/inbox/{event_id}/requeue",
        "/v1/sessions/{id}/inbox/{event_id}/discard",
    ] {
        let body = &paths[path]["post"]["requestBody"];
        let schema = &body["content"]["application/json"]["schema"];
        assert!(
            schema["$ref"].is_string(),
            "{path}: the server refuses a `null` body: {schema}"
        );
    }
}

#[tokio::test]
async fn every_post_under_v1_takes_an_idempotency_key() {
    let document = document().await;
    let posts: Vec<_> = operations(&document)
        .into_iter()
        .filter(|(method, path, _)| method == "post" && path.starts_with("/v1/"))
        .collect();
    assert!(posts.len() > 10, "found {} POSTs", posts.len());
    for (_, path, operation) in posts {
        let key = parameter(&document, operation, "Idempotency-Key")
            .unwrap_or_else(|| panic!("POST {path} names no Idempotency-Key"));
        assert_eq!(key["type"], "string", "POST {path}");
        assert_eq!(
            (&key["minLength"], &key["maxLength"]),
            (&json!(1), &json!(255)),
            "POST {path}"
        );
    }
}
