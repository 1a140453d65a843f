//! Event streams over Server-Sent Events: `/v1/sessions/{id}/events`, `/v1/runs/{id}/events`
//! and `/v1/runs/{id}/tree/events`.
//!
//! A stream subscribes to the live bus first, then replays the stored backlog after the
//! client's cursor (`Last-Event-ID` or `?after=`), then follows live events (`feed.rs` keeps
//! each session's events gap-free and in order).
//!
//! Between stored events, a following stream also sends the live activity of the steps in
//! flight in this process (`Coordinator::observe`): `activity` events without an `id` and
//! without a `seq`, never stored, each after the stored events published before it. They do
//! not touch the cursor, so a client that reconnects resumes exactly where the stored events
//! left it, and a replay never holds them.
//!
//! The live bus carries this process's events and those other processes announce; an
//! announcement can be lost (or, on SQLite, never made), so a following stream that has
//! delivered nothing for a second also looks in the store: the events of steps another
//! process runs reach it within that delay at worst.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde::Deserialize;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::{ErrorBody, ServerSentEvent, ServerSentTreeEvent};
use crate::auth::Tenant;
use crate::error::{ApiPath, ApiQuery};
use crate::feed::{Feed, Lane, PageSize, Place, TreeCursor};
use crate::routes::{parse_run_id, parse_session_id, tenant_run, tenant_session};
use crate::schemas::{RunIdSchema, SessionIdSchema};
use crate::streams::StreamPermit;
use crate::{ApiError, AppState};

/// What a session or run stream reads from the store at a time.
const PAGE: PageSize = PageSize {
    events: 500,
    bytes: 64 * 1024,
};
/// What each run's lane of a tree stream reads at a time: a tree has many.
const TREE_PAGE: PageSize = PageSize {
    events: 100,
    bytes: 16 * 1024,
};
/// How long a client should wait before reconnecting, sent first on every stream.
const RETRY: Duration = Duration::from_secs(2);

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(session_events))
        .routes(routes!(run_events))
        .routes(routes!(tree_events))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StreamQuery {
    /// Replay events with `seq` greater than this (default: from the beginning). The
    /// `Last-Event-ID` header takes precedence.
    #[param(minimum = 0)]
    after: Option<i64>,
    /// `false` ends the stream after the stored backlog instead of following live events.
    follow: Option<bool>,
    /// The bearer token, for clients (browsers' `EventSource`) that cannot set headers.
    #[expect(dead_code, reason = "read by the Tenant extractor from the raw query")]
    access_token: Option<String>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct TreeStreamQuery {
    /// Replay after this opaque cursor the server issued: the `id` of an event of this stream,
    /// unchanged (default: from the beginning). The `Last-Event-ID` header takes precedence.
    after: Option<String>,
    /// `false` ends the stream after the stored backlog instead of following live events.
    follow: Option<bool>,
    /// The bearer token, for clients (browsers' `EventSource`) that cannot set headers.
    #[expect(dead_code, reason = "read by the Tenant extractor from the raw query")]
    access_token: Option<String>,
}

fn start_after(headers: &HeaderMap, query: &StreamQuery) -> Result<i64, ApiError> {
    match headers.get("last-event-id") {
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<i64>().ok())
            .filter(|seq| *seq >= 0)
            .ok_or_else(|| ApiError::bad_request("Last-Event-ID must be a non-negative integer")),
        None => match query.after {
            Some(after) if after < 0 => Err(ApiError::bad_request("after must be non-negative")),
            Some(after) => Ok(after),
            None => Ok(0),
        },
    }
}

fn tree_start_after(headers: &HeaderMap, query: &TreeStreamQuery) -> Result<TreeCursor, ApiError> {
    let (text, name) = match headers.get("last-event-id") {
        Some(value) => (
            value
                .to_str()
                .map_err(|_| ApiError::bad_request("Last-Event-ID must be text"))?,
            "Last-Event-ID",
        ),
        None => (query.after.as_deref().unwrap_or_default(), "after"),
    };
    TreeCursor::parse(text).map_err(|problem| ApiError::bad_request(format!("{name}: {problem}")))
}

#[utoipa::path(
    get, path = "/v1/sessions/{id}/events", tag = "events",
    params(("id" = SessionIdSchema, Path, description = "The session's id"), StreamQuery),
    responses(
        (status = 200, content_type = "text/event-stream", body = ServerSentEvent,
         description = "One `ServerSentEvent` per event; keep-alive comments"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn session_events(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<StreamQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let id = parse_session_id(&id)?;
    let after = start_after(&headers, &query)?;
    tenant_session(&state, &tenant, &id).await?;
    let lane = Lane::new(id, None, None, after);
    let follow = query.follow.unwrap_or(true);
    let permit = state.streams.open(&tenant.0)?;
    Ok(stream(state, permit, vec![lane], false, follow))
}

#[utoipa::path(
    get, path = "/v1/runs/{id}/events", tag = "events",
    params(("id" = RunIdSchema, Path, description = "The run's id"), StreamQuery),
    responses(
        (status = 200, content_type = "text/event-stream", body = ServerSentEvent,
         description = "The run's events only; `seq` is the session's"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn run_events(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<StreamQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let id = parse_run_id(&id)?;
    let after = start_after(&headers, &query)?;
    let run = tenant_run(&state, &tenant, &id).await?;
    let after = before_first_event(&state, &id, after).await?;
    let lane = Lane::new(run.session_id, Some(id), None, after);
    let follow = query.follow.unwrap_or(true);
    let permit = state.streams.open(&tenant.0)?;
    Ok(stream(state, permit, vec![lane], false, follow))
}

#[utoipa::path(
    get, path = "/v1/runs/{id}/tree/events", tag = "events",
    params(("id" = RunIdSchema, Path, description = "The run's id"), TreeStreamQuery),
    responses(
        (status = 200, content_type = "text/event-stream", body = ServerSentTreeEvent,
         description = "Every event of the run and of every run below it, each with its run's \
                        place in the tree; each `id` is the whole stream's cursor"),
        (status = "4XX", body = ErrorBody),
    ),
)]
async fn tree_events(
    State(state): State<AppState>,
    tenant: Tenant,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<TreeStreamQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let id = parse_run_id(&id)?;
    let cursor = tree_start_after(&headers, &query)?;
    tenant_run(&state, &tenant, &id).await?;
    let nodes = state.coordinator.store().run_tree(&id).await?;
    if let Some(stranger) = cursor
        .sessions()
        .find(|session| !nodes.iter().any(|node| &node.session_id == *session))
    {
        return Err(ApiError::bad_request(format!(
            "the cursor names {stranger}, which holds no run of {id}'s tree; resume with the \
             id of an event this stream sent"
        )));
    }
    let mut lanes = Vec::with_capacity(nodes.len());
    for node in nodes {
        let seen = cursor.seen(&node.session_id);
        // The asked run shares its session with the session's other runs: skip theirs.
        let seen = if node.run_id == id {
            before_first_event(&state, &id, seen).await?
        } else {
            seen
        };
        let place = Place {
            parent_run_id: node.parent_run_id,
            depth: node.depth,
        };
        lanes.push(Lane::new(
            node.session_id,
            Some(node.run_id),
            Some(place),
            seen,
        ));
    }
    let follow = query.follow.unwrap_or(true);
    let permit = state.streams.open(&tenant.0)?;
    Ok(stream(state, permit, lanes, true, follow))
}

/// Where a run's lane may start reading its session: after `after`, and not before the run's
/// first event (the session's earlier runs wrote everything before it).
async fn before_first_event(
    state: &AppState,
    run: &ratchet_core::RunId,
    after: i64,
) -> Result<i64, ApiError> {
    let first = state
        .coordinator
        .store()
        .run_events_after(run, after, 1)
        .await?;
    Ok(first.first().map_or(after, |event| event.seq - 1))
}

fn stream(
    state: AppState,
    permit: StreamPermit,
    lanes: Vec<Lane>,
    tree: bool,
    follow: bool,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    // Subscribe before reading the backlog, so nothing published meanwhile is missed.
    let observed = state.coordinator.observe();
    let page = if tree { TREE_PAGE } else { PAGE };
    let feed = Feed::new(state, permit, observed, lanes, tree, follow, page);
    let retry = Event::default().retry(RETRY);
    let events = futures::stream::unfold(feed, |mut feed| async move {
        let event = feed.next_event().await?;
        Some((Ok(event), feed))
    });
    let events = futures::stream::once(async move { Ok(retry) }).chain(events);
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
