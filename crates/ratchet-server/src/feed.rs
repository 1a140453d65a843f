//! One client's event stream: what it has sent, what it holds, where it reads next.
//!
//! A stream follows one or more lanes. A lane is one session's events, all of them or one
//! run's only. A session's `seq` is gap-free, so a lane knows exactly what it has seen: a
//! live event that is not its next `seq` (concurrent writers can publish a session's events
//! out of order), or a lagged subscription, sends it back to the store to fill the gap.
//! Nothing is sent twice, nothing is skipped, and each lane's events go out in `seq` order.
//!
//! A session or run stream has one lane. A tree stream has a lane per run of the tree, each
//! in its own session (the root run's lane shares its session with the session's other
//! runs), and gains one whenever a run of the tree starts a child (`subagent.started`).
//! Lanes are merged by the time their events were written, ties going to the lane that
//! joined first, so a parent's `subagent.started` comes before its child's first events. A
//! tree stream also sends the events of a session's own that a run of the tree is the source
//! of (its signals, the inbox reports of its background runs).

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::Duration;

use axum::response::sse::Event;
use ratchet_core::{EventKind, RunId, SessionId};
use ratchet_engine::{LiveActivity, Observed};
use ratchet_store::StoredEvent;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;

use crate::AppState;
use crate::api::{LiveActivityView, ServerSentEvent, ServerSentTreeEvent, TreeActivityView};
use crate::streams::StreamPermit;

/// How long a following stream waits without delivering anything before it reads the store.
pub(crate) const QUIET: Duration = Duration::from_secs(1);
/// A lane whose run has finished is read on every this many quiet spells, not on each: only
/// a resumed run (`continue`, `retry`) writes after its `run.finished`.
const FINISHED_EVERY: u32 = 10;

/// Where a run sits in its tree, sent with each of its events on a tree stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    pub parent_run_id: Option<RunId>,
    pub depth: u32,
}

/// How much one lane reads from the store at a time: what it holds besides the event in
/// flight, however large its backlog.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PageSize {
    pub events: u32,
    /// Payload bytes as stored; one larger event comes alone.
    pub bytes: u64,
}

/// One session's events as a stream follows them.
#[derive(Debug)]
pub(crate) struct Lane {
    session: SessionId,
    /// Only this run's events are sent; the session's others move the cursor silently.
    run: Option<RunId>,
    /// Set on a tree stream's lanes.
    place: Option<Place>,
    /// Every event of the session with `seq <= seen` has been sent or passed over.
    seen: i64,
    /// Events read and not yet sent, in `seq` order, right after `seen`.
    page: VecDeque<StoredEvent>,
    /// The store may hold events after `seen` that `page` does not.
    behind: bool,
    /// The last event of the lane's run that was sent is its `run.finished`.
    finished: bool,
}

impl Lane {
    /// A lane that starts after `seen` and looks in the store first.
    pub(crate) fn new(
        session: SessionId,
        run: Option<RunId>,
        place: Option<Place>,
        seen: i64,
    ) -> Lane {
        Lane {
            session,
            run,
            place,
            seen,
            page: VecDeque::new(),
            behind: true,
            finished: false,
        }
    }

    fn includes(&self, event: &StoredEvent) -> bool {
        self.run.is_none() || event.run_id == self.run
    }

    fn hears(&self, activity: &LiveActivity) -> bool {
        match &self.run {
            Some(run) => &activity.run_id == run,
            None => activity.session_id == self.session,
        }
    }

    /// A live event of this lane's session: the next one in order joins the page; one beyond
    /// a gap sends the lane to the store for everything up to it; one already sent is dropped.
    fn offer(&mut self, event: StoredEvent) {
        let queued = self.page.back().map_or(self.seen, |last| last.seq);
        if event.seq <= queued {
            return;
        }
        if event.seq == queued + 1 {
            self.page.push_back(event);
        } else {
            self.behind = true;
        }
    }
}

/// A client's stream: its lanes, the buses it listens to and its place among the open
/// streams. It reads only when the client has taken what came before (the response body asks
/// for the next event only then), so a client that stops reading stops the feed: it holds at
/// most a page per lane and the event in flight, and no database connection.
pub(crate) struct Feed {
    state: AppState,
    lanes: Vec<Lane>,
    /// A tree stream: events carry their run's place and a composite cursor, and a run's
    /// `subagent.started` adds its child's lane.
    tree: bool,
    follow: bool,
    page: PageSize,
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
    quiet_spells: u32,
    _permit: StreamPermit,
}

impl Feed {
    /// `observed` must be subscribed before anything of the backlog is read, so nothing
    /// published meanwhile is missed.
    pub(crate) fn new(
        state: AppState,
        permit: StreamPermit,
        observed: Observed,
        lanes: Vec<Lane>,
        tree: bool,
        follow: bool,
        page: PageSize,
    ) -> Feed {
        let joined_in_flight = (observed.in_flight.into_iter())
            .filter(|activity| lanes.iter().any(|lane| lane.hears(activity)))
            .collect();
        Feed {
            state,
            lanes,
            tree,
            follow,
            page,
            live: observed.events,
            activity: observed.activity,
            received: observed.published,
            held: None,
            joined_in_flight,
            quiet: Box::pin(tokio::time::sleep(QUIET)),
            quiet_spells: 0,
            _permit: permit,
        }
    }

    /// The next event for the client, or None when the stream ends: the backlog is sent
    /// (without `follow`), the server shuts down, or the store fails.
    pub(crate) async fn next_event(&mut self) -> Option<Event> {
        loop {
            if self.state.shutdown.is_cancelled() {
                return None;
            }
            // The next event is the earliest head of all lanes, so every lane that may have
            // more in the store and holds nothing reads first.
            if let Some(lane) = self
                .lanes
                .iter()
                .position(|l| l.behind && l.page.is_empty())
            {
                if let Err(error) = self.read_page(lane).await {
                    tracing::warn!(%error, "event stream ended on a store error");
                    return None;
                }
                continue;
            }
            if let Some(index) = self.earliest() {
                let lane = &mut self.lanes[index];
                let Some(event) = lane.page.pop_front() else {
                    continue;
                };
                lane.seen = event.seq;
                self.quiet
                    .as_mut()
                    .reset(tokio::time::Instant::now() + QUIET);
                if lane.includes(&event) || self.about_the_tree(&event) {
                    self.learn(index, &event);
                    return Some(self.to_sse(index, &event));
                }
                continue;
            }
            if let Some(activity) = self.held.take() {
                return Some(self.live_sse(&activity));
            }
            if !self.follow {
                return None;
            }
            if let Some(activity) = self.joined_in_flight.pop_front() {
                if self.state.coordinator.still_in_flight(&activity) {
                    return Some(self.live_sse(&activity));
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
                    Ok(activity) if self.lanes.iter().any(|l| l.hears(&activity)) => {
                        self.take_published(activity.published_before);
                        self.held = Some(activity);
                    }
                    // Another stream's, or stale ones a slow client missed: nothing to catch up.
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
                        self.all_behind();
                    }
                    Err(RecvError::Closed) => return None,
                },
                () = &mut self.quiet => {
                    self.quiet_spells = self.quiet_spells.wrapping_add(1);
                    let every = self.quiet_spells.is_multiple_of(FINISHED_EVERY);
                    for lane in &mut self.lanes {
                        lane.behind |= !lane.finished || every;
                    }
                    self.quiet.as_mut().reset(tokio::time::Instant::now() + QUIET);
                }
            }
        }
    }

    /// On a tree stream, an event of a session's own (no run's: a signal, an inbox report)
    /// that a run of the tree is the source of. Decided by the event alone, so a replay from
    /// any cursor sends the same events.
    fn about_the_tree(&self, event: &StoredEvent) -> bool {
        let source = event.payload["source_run_id"].as_str();
        self.tree
            && event.run_id.is_none()
            && source.is_some_and(|source| {
                (self.lanes.iter())
                    .any(|lane| lane.run.as_ref().is_some_and(|r| r.as_str() == source))
            })
    }

    /// The lane whose next event was written first; ties go to the lane that joined first.
    fn earliest(&self) -> Option<usize> {
        (self.lanes.iter().enumerate())
            .filter_map(|(index, lane)| lane.page.front().map(|e| (e.created_at, index)))
            .min()
            .map(|(_, index)| index)
    }

    /// What a sent event tells the stream: whether its run has finished, and (on a tree
    /// stream) of a child whose lane joins.
    fn learn(&mut self, index: usize, event: &StoredEvent) {
        let kind = event.kind.as_str();
        self.lanes[index].finished = kind == EventKind::RunFinished.as_str();
        if !self.tree || kind != EventKind::SubagentStarted.as_str() {
            return;
        }
        let field = |name: &str| event.payload[name].as_str();
        let (Some(run), Some(session)) = (
            field("child_run_id").and_then(|r| RunId::parse(r).ok()),
            field("child_session_id").and_then(|s| SessionId::parse(s).ok()),
        ) else {
            tracing::warn!(seq = event.seq, "a subagent.started event names no child");
            return;
        };
        if self.lanes.iter().any(|lane| lane.session == session) {
            return;
        }
        let depth = event.payload["depth"].as_u64().map_or_else(
            || self.lanes[index].place.as_ref().map_or(1, |p| p.depth + 1),
            |d| u32::try_from(d).unwrap_or(u32::MAX),
        );
        let place = Place {
            parent_run_id: event.run_id.clone(),
            depth,
        };
        self.lanes
            .push(Lane::new(session, Some(run), Some(place), 0));
    }

    fn all_behind(&mut self) {
        for lane in &mut self.lanes {
            lane.behind = true;
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
                    self.all_behind();
                }
                Err(_) => return,
            }
        }
    }

    fn offer(&mut self, event: StoredEvent) {
        if let Some(lane) = (self.lanes.iter_mut()).find(|l| l.session == event.session_id) {
            lane.offer(event);
        }
    }

    /// The next page of a lane's backlog after what it has seen.
    async fn read_page(&mut self, index: usize) -> Result<(), ratchet_store::Error> {
        let lane = &self.lanes[index];
        let page = self
            .state
            .coordinator
            .store()
            .events_within(&lane.session, lane.seen, self.page.events, self.page.bytes)
            .await?;
        let lane = &mut self.lanes[index];
        lane.behind = !page.is_empty();
        lane.page = page.into();
        Ok(())
    }

    /// A stored event as sent: its `id` is the stream's cursor after it.
    fn to_sse(&self, index: usize, event: &StoredEvent) -> Event {
        let (id, kind, data) = if self.tree {
            let place = self.lanes[index].place.clone().unwrap_or(Place {
                parent_run_id: None,
                depth: 0,
            });
            let sent = ServerSentTreeEvent::new(event, place, self.cursor());
            (sent.id, sent.event, sent.data)
        } else {
            let sent = ServerSentEvent::from(event);
            (sent.id, sent.event, sent.data)
        };
        Event::default().id(id).event(kind).data(data)
    }

    /// No `id`: the client's `Last-Event-ID` stays the last stored event's.
    fn live_sse(&self, activity: &LiveActivity) -> Event {
        let view = LiveActivityView::from(activity);
        let place = (self.lanes.iter())
            .find(|lane| lane.hears(activity))
            .and_then(|lane| lane.place.clone());
        let data = match place.filter(|_| self.tree) {
            Some(place) => serde_json::to_string(&TreeActivityView::new(view, place)),
            None => serde_json::to_string(&view),
        };
        Event::default()
            .event("activity")
            .data(data.unwrap_or_default())
    }

    /// A tree stream's cursor: each lane's session with the last `seq` it has passed.
    fn cursor(&self) -> String {
        TreeCursor::of(self.lanes.iter().map(|lane| (&lane.session, lane.seen))).to_string()
    }
}

/// Where a tree stream resumes: for each session of the tree, the last `seq` sent or passed
/// over (a session it omits starts from its beginning). Written `ses_a:12,ses_b:7`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct TreeCursor(Vec<(SessionId, i64)>);

impl TreeCursor {
    fn of<'a>(seen: impl Iterator<Item = (&'a SessionId, i64)>) -> TreeCursor {
        TreeCursor(
            seen.filter(|(_, seq)| *seq > 0)
                .map(|(session, seq)| (session.clone(), seq))
                .collect(),
        )
    }

    pub(crate) fn parse(text: &str) -> Result<TreeCursor, String> {
        let mut seen: Vec<(SessionId, i64)> = Vec::new();
        for part in text.trim().split(',').filter(|p| !p.trim().is_empty()) {
            let Some((session, seq)) = part.trim().split_once(':') else {
                return Err(format!(
                    "{part:?} is not SESSION:SEQ; a tree stream's cursor is the id of one of \
                     its events, like ses_a:12,ses_b:7"
                ));
            };
            let session = SessionId::parse(session).map_err(|e| e.to_string())?;
            let seq = seq
                .parse::<i64>()
                .ok()
                .filter(|seq| *seq >= 0)
                .ok_or_else(|| format!("{seq:?} after {session} is not a non-negative seq"))?;
            if seen.iter().any(|(known, _)| known == &session) {
                return Err(format!("{session} appears twice in the cursor"));
            }
            seen.push((session, seq));
        }
        Ok(TreeCursor(seen))
    }

    /// What the cursor says of a session: the last `seq` passed, 0 when it has none.
    pub(crate) fn seen(&self, session: &SessionId) -> i64 {
        (self.0.iter())
            .find(|(known, _)| known == session)
            .map_or(0, |(_, seq)| *seq)
    }

    pub(crate) fn sessions(&self) -> impl Iterator<Item = &SessionId> {
        self.0.iter().map(|(session, _)| session)
    }
}

impl std::fmt::Display for TreeCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (index, (session, seq)) in self.0.iter().enumerate() {
            if index > 0 {
                f.write_str(",")?;
            }
            write!(f, "{session}:{seq}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ratchet_core::EventDraft;
    use ratchet_engine::Coordinator;
    use ratchet_store::SessionSpec;
    use serde_json::json;
    use tokio_util::sync::CancellationToken;

    use super::*;

    const PAGE: PageSize = PageSize {
        events: 500,
        bytes: 64 * 1024,
    };

    /// A coordinator over a fresh SQLite store with one session; the directory keeps the file.
    async fn one_session() -> (
        tempfile::TempDir,
        Arc<dyn ratchet_store::Store>,
        Arc<Coordinator>,
        SessionId,
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

    fn feed(
        (store, coordinator): (&Arc<dyn ratchet_store::Store>, Arc<Coordinator>),
        lanes: Vec<Lane>,
        tree: bool,
        follow: bool,
    ) -> Feed {
        let state = AppState::new(
            coordinator,
            Arc::clone(store) as Arc<dyn ratchet_store::WebhookAdmin>,
            Default::default(),
            CancellationToken::new(),
        );
        let observed = state.coordinator.observe();
        let permit = state.streams.open("t").unwrap();
        Feed::new(state, permit, observed, lanes, tree, follow, PAGE)
    }

    fn session_lane(session: &SessionId) -> Lane {
        let mut lane = Lane::new(session.clone(), None, None, 0);
        lane.behind = false;
        lane
    }

    /// An event's `id`, read from how it prints (digits only).
    fn id_of(event: &Event) -> String {
        let text = format!("{event:?}");
        let at = text.find("id: ").expect("an event with an id");
        text[at + 4..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect()
    }

    /// Every event a stream that ends by itself sends, as a client reads it: `id` and `data`.
    async fn sent_to_the_end(feed: Feed) -> Vec<(String, serde_json::Value)> {
        use axum::response::IntoResponse;
        let events = futures::stream::unfold(feed, |mut feed| async move {
            let event = feed.next_event().await?;
            Some((Ok::<_, std::convert::Infallible>(event), feed))
        });
        let body = axum::response::sse::Sse::new(events)
            .into_response()
            .into_body();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        (text.split("\n\n"))
            .filter(|block| !block.trim().is_empty())
            .map(|block| {
                let field = |name: &str| {
                    (block.lines())
                        .find_map(|line| line.strip_prefix(name))
                        .unwrap_or_default()
                        .to_owned()
                };
                let data = serde_json::from_str(&field("data: ")).unwrap();
                (field("id: "), data)
            })
            .collect()
    }

    fn drafts(count: usize) -> Vec<EventDraft> {
        (0..count)
            .map(|i| EventDraft::new(EventKind::Activity, json!({"i": i})))
            .collect()
    }

    /// Concurrent writers of one session can publish its events out of order. A live event
    /// that skips ahead must send the stream to the store for the ones before it, and a late
    /// one that was already delivered must not be sent again.
    #[tokio::test]
    async fn an_event_ahead_of_its_turn_is_filled_in_from_the_store() {
        let (_dir, store, coordinator, session) = one_session().await;
        let run = RunId::from_suffix("r").unwrap();
        let stored = store
            .append_events(&session, &run, drafts(3), 1)
            .await
            .unwrap();
        let mut feed = feed(
            (&store, coordinator),
            vec![session_lane(&session)],
            false,
            false,
        );

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
    /// history, what it has read and not yet sent stays within its page (the event in flight
    /// aside), and it reads on only as the client takes events.
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
        let lane = Lane::new(session, None, None, 0);
        let mut feed = feed((&store, coordinator), vec![lane], false, false);

        let mut sent = 0;
        while feed.next_event().await.is_some() {
            sent += 1;
            let held: usize = (feed.lanes[0].page.iter())
                .map(|e| e.payload.to_string().len())
                .sum();
            assert!(
                held as u64 <= PAGE.bytes,
                "after {sent} events the stream holds {held} bytes of unsent backlog, \
                 more than a page of {}",
                PAGE.bytes
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
        let mut feed = feed(
            (&store, coordinator),
            vec![session_lane(&session)],
            false,
            true,
        );

        let run = RunId::from_suffix("r").unwrap();
        for round in 0..2 {
            // Straight into the store, as another process would: nothing is published here.
            store
                .append_events(&session, &run, drafts(1), 1)
                .await
                .unwrap();
            let event = tokio::time::timeout(Duration::from_secs(10), feed.next_event())
                .await
                .expect("the stream did not look in the store")
                .unwrap();
            assert_eq!(id_of(&event), (round + 1).to_string());
        }
    }

    /// A tree stream merges its lanes by when each event was written, joins a child's lane
    /// at its `subagent.started`, and each event's id is the whole cursor after it.
    #[tokio::test]
    async fn a_tree_stream_merges_its_lanes_and_follows_a_child_it_hears_of() {
        let (_dir, store, coordinator, parent_session) = one_session().await;
        let child_session = coordinator
            .create_session(SessionSpec::default())
            .await
            .unwrap()
            .id;
        let parent = RunId::from_suffix("p").unwrap();
        let child = RunId::from_suffix("c").unwrap();
        let other = RunId::from_suffix("o").unwrap();
        // Another run of the parent's session is passed over, and moves the cursor.
        store
            .append_events(&parent_session, &other, drafts(1), 1)
            .await
            .unwrap();
        let started = EventDraft::new(
            EventKind::SubagentStarted,
            json!({"child_run_id": child, "child_session_id": child_session, "depth": 1}),
        );
        store
            .append_events(&parent_session, &parent, vec![started], 2)
            .await
            .unwrap();
        store
            .append_events(&child_session, &child, drafts(2), 3)
            .await
            .unwrap();
        store
            .append_events(&parent_session, &parent, drafts(1), 4)
            .await
            .unwrap();

        let root = Lane::new(
            parent_session.clone(),
            Some(parent.clone()),
            Some(Place {
                parent_run_id: None,
                depth: 0,
            }),
            0,
        );
        let sent: Vec<_> = (sent_to_the_end(feed((&store, coordinator), vec![root], true, false))
            .await)
            .into_iter()
            .map(|(id, data)| {
                (
                    id,
                    data["run_id"].as_str().unwrap().to_owned(),
                    data["parent_run_id"].as_str().map(str::to_owned),
                    data["depth"].as_u64().unwrap(),
                )
            })
            .collect();
        let (p, c) = (parent.to_string(), child.to_string());
        let (ps, cs) = (parent_session.to_string(), child_session.to_string());
        assert_eq!(
            sent,
            [
                (format!("{ps}:2"), p.clone(), None, 0),
                (format!("{ps}:2,{cs}:1"), c.clone(), Some(p.clone()), 1),
                (format!("{ps}:2,{cs}:2"), c.clone(), Some(p.clone()), 1),
                (format!("{ps}:3,{cs}:2"), p.clone(), None, 0),
            ]
        );
    }

    #[test]
    fn a_tree_cursor_reads_back_what_it_wrote_and_refuses_what_is_not_one() {
        let a = SessionId::parse("ses_a").unwrap();
        let b = SessionId::parse("ses_b").unwrap();
        let cursor = TreeCursor::of([(&a, 12), (&b, 0)].into_iter());
        assert_eq!(
            cursor.to_string(),
            "ses_a:12",
            "a lane that has passed nothing is left out"
        );
        let read = TreeCursor::parse("ses_a:12, ses_b:7").unwrap();
        assert_eq!((read.seen(&a), read.seen(&b)), (12, 7));
        assert_eq!(TreeCursor::parse("").unwrap(), TreeCursor::default());
        for (bad, says) in [
            ("ses_a", "is not SESSION:SEQ"),
            ("ses_a:-1", "not a non-negative seq"),
            ("ses_a:x", "not a non-negative seq"),
            ("run_a:1", "session"),
            ("ses_a:1,ses_a:2", "appears twice"),
        ] {
            let error = TreeCursor::parse(bad).unwrap_err();
            assert!(error.contains(says), "{bad:?}: {error}");
        }
    }
}
