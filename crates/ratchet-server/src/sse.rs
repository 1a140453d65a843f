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
//! Between stored events, a following stream also sends the live activity of the steps in
//! flight in this process (`Coordinator::observe`): `activity` events without an `id` and
//! without a `seq`, never stored, each after the stored events published before it. They do
//! not touch the cursor, so a client that reconnects resumes exactly where the stored events
//! left it, and a replay never holds them.
//!
//! The live bus carries this process's events and those other processes announce; an
//! announcement can be lost (or, on SQLite, never made), so a following stream that has
//! delivered nothing for `QUIET` also looks in the store: the events of steps another process
//! runs reach it within that delay at worst.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use ratchet_core::{RunId, SessionId};
use ratchet_engine::LiveActivity;
use ratchet_store::StoredEvent;
use serde::Deserialize;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::{ErrorBody, LiveActivityView, ServerSentEvent};
use crate::auth::Tenant;
use crate::error::{ApiPath, ApiQuery};
use crate::routes::{parse_run_id, parse_session_id, tenant_run, tenant_session};
use crate::streams::StreamPermit;
use crate::{ApiError, AppState};

/// Most events read from the store per query while replaying.
const PAGE_EVENTS: u32 = 500;
/// Most payload bytes read per query (one larger event comes alone): what a stream holds
/// besides the event in flight, however large the backlog.
const PAGE_BYTES: u64 = 64 * 1024;
/// How long a client should wait before reconnecting, sent first on every stream.
const RETRY: Duration = Duration::from_secs(2);
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

    fn hears(&self, activity: &LiveActivity) -> bool {
        match self {
            Scope::Session(session) => &activity.session_id == session,
            Scope::Run(_, run) => &activity.run_id == run,
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
    let permit = state.streams.open(&tenant.0)?;
    Ok(stream(
        state,
        permit,
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
    let permit = state.streams.open(&tenant.0)?;
    Ok(stream(
        state,
        permit,
        Scope::Run(run.session_id, id),
        after,
        query.follow.unwrap_or(true),
    ))
}

fn stream(
    state: AppState,
    permit: StreamPermit,
    scope: Scope,
    after: i64,
    follow: bool,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    // Subscribe before reading the backlog, so nothing published meanwhile is missed.
    let observed = state.coordinator.observe();
    let joined_in_flight = (observed.in_flight.into_iter())
        .filter(|activity| scope.hears(activity))
        .collect();
    let feed = Feed {
        state,
        scope,
        seen: after,
        follow,
        page: VecDeque::new(),
        behind: true,
        live: observed.events,
        activity: observed.activity,
        received: observed.published,
        held: None,
        joined_in_flight,
        quiet: Box::pin(tokio::time::sleep(QUIET)),
        _permit: permit,
    };
    let retry = Event::default().retry(RETRY);
    let events = futures::stream::unfold(feed, |mut feed| async move {
        let event = feed.next_event().await?;
        Some((Ok(event), feed))
    });
    let events = futures::stream::once(async move { Ok(retry) }).chain(events);
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// One client's stream: its cursor, the page of the backlog it is sending, its place among
/// the open streams. It reads only when the client has taken what came before (the response
/// body asks for the next event only then), so a client that stops reading stops the feed:
/// it holds at most one page and the event in flight, and no database connection.
struct Feed {
    state: AppState,
    scope: Scope,
    /// Every event of the session with `seq <= seen` has been sent or filtered out.
    seen: i64,
    follow: bool,
    /// Events read and not yet sent, in `seq` order, right after `seen`.
    page: VecDeque<StoredEvent>,
    /// The store may hold events after `seen` that `page` does not.
    behind: bool,
    live: broadcast::Receiver<StoredEvent>,
    /// What the steps in flight here are doing; sent only while the stream is caught up.
    activity: broadcast::Receiver<LiveActivity>,
    /// Stored events published on the bus up to the last one `live` has handed over.
    received: u64,
    /// An activity waiting for the stored events published before it to be sent.
    held: Option<LiveActivity>,
    /// What the steps in flight were doing when the stream started: sent once the backlog
    /// is, each only if its step still does it.
    joined_in_flight: VecDeque<LiveActivity>,
    /// Fires after `QUIET` without a delivery: announcements can be lost, the store cannot.
    quiet: Pin<Box<tokio::time::Sleep>>,
    _permit: StreamPermit,
}

impl Feed {
    /// The next event for the client, or None when the stream ends: the backlog is sent
    /// (without `follow`), the server shuts down, or the store fails.
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if self.state.shutdown.is_cancelled() {
                return None;
            }
            if let Some(event) = self.page.pop_front() {
                self.seen = event.seq;
                self.quiet
                    .as_mut()
                    .reset(tokio::time::Instant::now() + QUIET);
                if self.scope.includes(&event) {
                    return Some(to_sse(&event));
                }
                continue;
            }
            if let Some(activity) = self.held.take() {
                return Some(live_sse(&activity));
            }
            if self.behind {
                if let Err(error) = self.read_page().await {
                    tracing::warn!(%error, "event stream ended on a store error");
                    return None;
                }
                continue;
            }
            if !self.follow {
                return None;
            }
            if let Some(activity) = self.joined_in_flight.pop_front() {
                if self.state.coordinator.still_in_flight(&activity) {
                    return Some(live_sse(&activity));
                }
                continue;
            }
            // Activity first: each is merged after exactly the stored events published before
            // it (`take_published`), so it never comes ahead of the commit before it nor after
            // the one after it.
            tokio::select! {
                biased;
                () = self.state.shutdown.cancelled() => return None,
                announced = self.activity.recv() => match announced {
                    Ok(activity) if self.scope.hears(&activity) => {
                        self.take_published(activity.published_before);
                        self.held = Some(activity);
                    }
                    // Another session's, or stale ones a slow client missed: nothing to catch up.
                    Ok(_) | Err(RecvError::Lagged(_)) => {}
                    Err(RecvError::Closed) => return None,
                },
                received = self.live.recv() => match received {
                    Ok(event) => {
                        self.received += 1;
                        self.offer(event);
                    }
                    Err(RecvError::Lagged(missed)) => {
                        self.received += missed;
                        self.behind = true;
                    }
                    Err(RecvError::Closed) => return None,
                },
                () = &mut self.quiet => {
                    self.behind = true;
                    self.quiet.as_mut().reset(tokio::time::Instant::now() + QUIET);
                }
            }
        }
    }

    /// Takes from the bus the stored events published before an activity (they are there
    /// already: they were sent before it was announced).
    fn take_published(&mut self, published: u64) {
        while self.received < published {
            match self.live.try_recv() {
                Ok(event) => {
                    self.received += 1;
                    self.offer(event);
                }
                Err(broadcast::error::TryRecvError::Lagged(missed)) => {
                    self.received += missed;
                    self.behind = true;
                }
                Err(_) => return,
            }
        }
    }

    /// A live event: the next one in order joins the page; one beyond a gap sends the feed to
    /// the store for everything up to it; one already sent is dropped.
    fn offer(&mut self, event: StoredEvent) {
        let queued = self.page.back().map_or(self.seen, |last| last.seq);
        if &event.session_id != self.scope.session() || event.seq <= queued {
            return;
        }
        if event.seq == queued + 1 {
            self.page.push_back(event);
        } else {
            self.behind = true;
        }
    }

    /// The next page of the backlog after `seen`, bounded by count and by bytes.
    async fn read_page(&mut self) -> Result<(), ratchet_store::Error> {
        let page = self
            .state
            .coordinator
            .store()
            .events_within(self.scope.session(), self.seen, PAGE_EVENTS, PAGE_BYTES)
            .await?;
        self.behind = !page.is_empty();
        self.page = page.into();
        Ok(())
    }
}

/// No `id`: the client's `Last-Event-ID` stays the last stored event's.
fn live_sse(activity: &LiveActivity) -> Event {
    let data = serde_json::to_string(&LiveActivityView::from(activity)).unwrap_or_default();
    Event::default().event("activity").data(data)
}

fn to_sse(event: &StoredEvent) -> Event {
    let sent = ServerSentEvent::from(event);
    Event::default()
        .id(sent.id)
        .event(sent.event)
        .data(sent.data)
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

    fn feed(state: AppState, session: SessionId, follow: bool) -> Feed {
        let observed = state.coordinator.observe();
        let permit = state.streams.open("t").unwrap();
        Feed {
            state,
            scope: Scope::Session(session),
            seen: 0,
            follow,
            page: VecDeque::new(),
            behind: false,
            live: observed.events,
            activity: observed.activity,
            received: observed.published,
            held: None,
            joined_in_flight: VecDeque::new(),
            quiet: Box::pin(tokio::time::sleep(QUIET)),
            _permit: permit,
        }
    }

    fn id_of(event: &Event) -> String {
        let text = format!("{event:?}");
        let at = text.find("id: ").expect("an event with an id");
        text[at + 4..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect()
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
        let mut feed = feed(state, session, false);

        feed.offer(stored[2].clone());
        let mut ids = Vec::new();
        while let Some(event) = feed.next_event().await {
            ids.push(id_of(&event));
            feed.offer(stored[0].clone());
            feed.offer(stored[2].clone());
        }
        assert_eq!(
            ids,
            ["1", "2", "3"],
            "seq 3 arrived first: 1 and 2 were read from the store, and each is sent once"
        );
    }

    /// A stream holds a page of the backlog, not the backlog: however large the session's
    /// history, what it has read and not yet sent stays within `PAGE_BYTES` (the event in
    /// flight aside), and it reads on only as the client takes events.
    #[tokio::test]
    async fn a_stream_holds_a_bounded_page_of_a_large_backlog() {
        let (_dir, store, coordinator, session) = one_session().await;
        let run = RunId::from_suffix("r").unwrap();
        let big = "x".repeat(40 * 1024);
        let drafts = (0..40)
            .map(|i| EventDraft::new(EventKind::Activity, json!({"i": i, "text": big})))
            .collect();
        store
            .append_events(&session, &run, drafts, 1)
            .await
            .unwrap();
        let state = AppState::new(coordinator, Default::default(), CancellationToken::new());
        let mut feed = feed(state, session, false);
        feed.behind = true;

        let mut sent = 0;
        while feed.next_event().await.is_some() {
            sent += 1;
            let held: usize = feed.page.iter().map(|e| e.payload.to_string().len()).sum();
            assert!(
                held as u64 <= PAGE_BYTES,
                "after {sent} events the stream holds {held} bytes of unsent backlog, \
                 more than a page of {PAGE_BYTES}"
            );
        }
        assert_eq!(sent, 40, "every event of the backlog is sent");
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
        let mut feed = feed(state, session.clone(), true);

        let run = RunId::from_suffix("r").unwrap();
        for round in 0..2 {
            let draft = EventDraft::new(EventKind::Activity, json!({"round": round}));
            // Straight into the store, as another process would: nothing is published here.
            store
                .append_events(&session, &run, vec![draft], 1)
                .await
                .unwrap();
            let event = tokio::time::timeout(Duration::from_secs(10), feed.next_event())
                .await
                .expect("the stream did not look in the store")
                .unwrap();
            assert_eq!(id_of(&event), (round + 1).to_string());
        }
    }
}
