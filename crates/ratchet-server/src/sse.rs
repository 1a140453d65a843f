//! Event streams over Server-Sent Events: `/v1/sessions/{id}/events` and
//! `/v1/runs/{id}/events`.
//!
//! A stream subscribes to the live bus first, then replays the stored backlog after the
//! client's cursor (`Last-Event-ID` or `?after=`), then follows live events. Per-session `seq`
//! is gap-free, so the stream knows exactly what it has seen: a live event that is not the
//! next `seq` (events of one session can be published out of order by concurrent writers),
//! or a lagged subscription, sends it back to the store to fill the gap. Nothing is sent
//! twice, nothing is skipped, and order is always `seq` order.
//!
//! The live bus carries this process's events and those other processes announce; an
//! announcement can be lost (or, on SQLite, never made), so a following stream that has
//! delivered nothing for `QUIET` also looks in the store: the events of steps another process
//! runs reach it within that delay at worst.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use ratchet_core::{RunId, SessionId};
use ratchet_store::StoredEvent;
use serde::Deserialize;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::{ErrorBody, ServerSentEvent};
use crate::auth::Tenant;
use crate::error::{ApiPath, ApiQuery};
use crate::routes::{parse_run_id, parse_session_id, tenant_run, tenant_session};
use crate::{ApiError, AppState};

/// Events read from the store per query while replaying.
const PAGE: u32 = 500;
/// Events buffered for a slow client before the stream waits on it.
const CLIENT_BUFFER: usize = 256;
/// How long a following stream waits without delivering anything before it reads the store.
const QUIET: Duration = Duration::from_secs(1);

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(session_events))
        .routes(routes!(run_events))
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

#[derive(Clone)]
enum Scope {
    Session(SessionId),
    Run(SessionId, RunId),
}

impl Scope {
    fn session(&self) -> &SessionId {
        match self {
            Scope::Session(session) | Scope::Run(session, _) => session,
        }
    }

    fn includes(&self, event: &StoredEvent) -> bool {
        match self {
            Scope::Session(_) => true,
            Scope::Run(_, run) => event.run_id.as_ref() == Some(run),
        }
    }
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

#[utoipa::path(
    get, path = "/v1/sessions/{id}/events", tag = "events",
    params(("id" = String, Path, description = "Session id (`ses_…`)", pattern = "^ses_[A-Za-z0-9-]{1,64}$"), StreamQuery),
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
    Ok(stream(
        state,
        Scope::Session(id),
        after,
        query.follow.unwrap_or(true),
    ))
}

#[utoipa::path(
    get, path = "/v1/runs/{id}/events", tag = "events",
    params(("id" = String, Path, description = "Run id (`run_…`)", pattern = "^run_[A-Za-z0-9-]{1,64}$"), StreamQuery),
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
    Ok(stream(
        state,
        Scope::Run(run.session_id, id),
        after,
        query.follow.unwrap_or(true),
    ))
}

fn stream(
    state: AppState,
    scope: Scope,
    after: i64,
    follow: bool,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let (sender, mut receiver) = mpsc::channel(CLIENT_BUFFER);
    // Subscribe before reading the backlog, so nothing published meanwhile is missed.
    let live = state.coordinator.subscribe();
    let subscribers = metrics::gauge!("ratchet_sse_subscribers");
    subscribers.increment(1.0);
    tokio::spawn(async move {
        let mut feed = Feed {
            state,
            scope,
            seen: after,
            sender,
        };
        if let Err(error) = feed.run(live, follow).await {
            tracing::warn!(%error, "event stream ended on a store error");
        }
        subscribers.decrement(1.0);
    });
    let events = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx));
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// One client's stream: owns its cursor and its channel; ends when the client goes away,
/// the server shuts down, or (without `follow`) the backlog is sent.
struct Feed {
    state: AppState,
    scope: Scope,
    /// Every event of the session with `seq <= seen` has been sent or filtered out.
    seen: i64,
    sender: mpsc::Sender<Result<Event, Infallible>>,
}

/// Why a feed stopped early; not an error for anyone but the log.
enum Stop {
    ClientGone,
    Store(ratchet_store::Error),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::ClientGone => f.write_str("client gone"),
            Stop::Store(error) => error.fmt(f),
        }
    }
}

impl Feed {
    async fn run(
        &mut self,
        mut live: tokio::sync::broadcast::Receiver<StoredEvent>,
        follow: bool,
    ) -> Result<(), ratchet_store::Error> {
        match self.catch_up().await {
            Ok(()) => {}
            Err(Stop::ClientGone) => return Ok(()),
            Err(Stop::Store(error)) => return Err(error),
        }
        if !follow {
            return Ok(());
        }
        let quiet = tokio::time::sleep(QUIET);
        tokio::pin!(quiet);
        loop {
            let seen = self.seen;
            let step = tokio::select! {
                () = self.state.shutdown.cancelled() => return Ok(()),
                () = self.sender.closed() => return Ok(()),
                received = live.recv() => match received {
                    Ok(event) => self.offer(event).await,
                    Err(RecvError::Lagged(_)) => self.catch_up().await,
                    Err(RecvError::Closed) => return Ok(()),
                },
                // Announcements can be lost: after a quiet spell, the store has the last word.
                () = &mut quiet => {
                    let caught_up = self.catch_up().await;
                    quiet.as_mut().reset(tokio::time::Instant::now() + QUIET);
                    caught_up
                }
            };
            if self.seen != seen {
                quiet.as_mut().reset(tokio::time::Instant::now() + QUIET);
            }
            match step {
                Ok(()) => {}
                Err(Stop::ClientGone) => return Ok(()),
                Err(Stop::Store(error)) => return Err(error),
            }
        }
    }

    /// A live event: the next one in order is sent (or filtered) at once; one beyond a gap
    /// sends the stream to the store for everything up to it.
    async fn offer(&mut self, event: StoredEvent) -> Result<(), Stop> {
        if &event.session_id != self.scope.session() || event.seq <= self.seen {
            return Ok(());
        }
        if event.seq == self.seen + 1 {
            return self.deliver(&event).await;
        }
        self.catch_up().await
    }

    /// Sends every stored event after `seen`, a page at a time.
    async fn catch_up(&mut self) -> Result<(), Stop> {
        loop {
            let page = self
                .state
                .coordinator
                .store()
                .events_after(self.scope.session(), self.seen, PAGE)
                .await
                .map_err(Stop::Store)?;
            for event in &page {
                self.deliver(event).await?;
            }
            if (page.len() as u32) < PAGE {
                return Ok(());
            }
        }
    }

    async fn deliver(&mut self, event: &StoredEvent) -> Result<(), Stop> {
        self.seen = event.seq;
        if !self.scope.includes(event) {
            return Ok(());
        }
        let sent = ServerSentEvent::from(event);
        let sse = Event::default()
            .id(sent.id)
            .event(sent.event)
            .data(sent.data);
        self.sender
            .send(Ok(sse))
            .await
            .map_err(|_| Stop::ClientGone)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ratchet_core::{EventDraft, EventKind};
    use ratchet_engine::Coordinator;
    use ratchet_store::SessionSpec;
    use serde_json::json;
    use tokio_util::sync::CancellationToken;

    use super::*;

    /// A coordinator over a fresh SQLite store with one session; the directory keeps the file.
    async fn one_session() -> (
        tempfile::TempDir,
        Arc<dyn ratchet_store::Store>,
        Arc<Coordinator>,
        ratchet_core::SessionId,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("r.db").display());
        let store: Arc<dyn ratchet_store::Store> =
            Arc::new(ratchet_sqlite::open_url(&url).unwrap());
        let coordinator = Coordinator::new(Arc::clone(&store));
        let session = coordinator
            .create_session(SessionSpec::default())
            .await
            .unwrap()
            .id;
        (dir, store, coordinator, session)
    }

    /// Concurrent writers of one session can publish its events out of order. A live event
    /// that skips ahead must send the stream to the store for the ones before it, and a late
    /// one that was already delivered must not be sent again.
    #[tokio::test]
    async fn an_event_ahead_of_its_turn_is_filled_in_from_the_store() {
        let (_dir, store, coordinator, session) = one_session().await;
        let run = RunId::from_suffix("r").unwrap();
        let drafts = (0..3)
            .map(|i| EventDraft::new(EventKind::Activity, json!({"i": i})))
            .collect();
        let stored = store
            .append_events(&session, &run, drafts, 1)
            .await
            .unwrap();
        let state = AppState::new(coordinator, Default::default(), CancellationToken::new());
        let (sender, mut receiver) = mpsc::channel(16);
        let mut feed = Feed {
            state,
            scope: Scope::Session(session),
            seen: 0,
            sender,
        };

        feed.offer(stored[2].clone()).await.ok().unwrap();
        assert_eq!(
            feed.seen, 3,
            "seq 3 arrived first: 1 and 2 were read from the store"
        );
        feed.offer(stored[0].clone()).await.ok().unwrap();
        feed.offer(stored[2].clone()).await.ok().unwrap();
        drop(feed);
        let mut ids = Vec::new();
        while let Some(Ok(event)) = receiver.recv().await {
            ids.push(format!("{event:?}"));
        }
        assert_eq!(ids.len(), 3, "each event exactly once: {ids:#?}");
        for (i, id) in ids.iter().enumerate() {
            assert!(
                id.contains(&format!("id: {}", i + 1)),
                "in seq order: {ids:#?}"
            );
        }
    }

    /// Events another process writes are never announced on this process's bus (SQLite) or
    /// their announcement may be lost: a following stream still delivers them, from the store,
    /// once it has been quiet for a while.
    #[tokio::test]
    async fn a_following_stream_finds_unannounced_events_in_the_store() {
        let (_dir, store, coordinator, session) = one_session().await;
        let state = AppState::new(
            Arc::clone(&coordinator),
            Default::default(),
            CancellationToken::new(),
        );
        let (sender, mut receiver) = mpsc::channel(16);
        let mut feed = Feed {
            state,
            scope: Scope::Session(session.clone()),
            seen: 0,
            sender,
        };
        let live = coordinator.subscribe();
        let following = tokio::spawn(async move { feed.run(live, true).await.is_ok() });

        let run = RunId::from_suffix("r").unwrap();
        for round in 0..2 {
            let draft = EventDraft::new(EventKind::Activity, json!({"round": round}));
            // Straight into the store, as another process would: nothing is published here.
            store
                .append_events(&session, &run, vec![draft], 1)
                .await
                .unwrap();
            let event = tokio::time::timeout(Duration::from_secs(10), receiver.recv())
                .await
                .expect("the stream did not look in the store")
                .unwrap()
                .unwrap();
            assert!(
                format!("{event:?}").contains(&format!("id: {}", round + 1)),
                "{event:?}"
            );
        }
        drop(receiver);
        assert!(following.await.unwrap(), "ends when the client goes away");
    }
}
