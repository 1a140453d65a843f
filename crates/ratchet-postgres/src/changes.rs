//! Hearing what other processes commit, through LISTEN/NOTIFY.
//!
//! A body's `Db::announce` queues a `pg_notify`, which PostgreSQL delivers only if and when
//! the transaction commits, in commit order. A follower is a thread with a connection of its
//! own that listens on both channels and turns other processes' notifications into
//! `Change`s. Notifications are hints, never data: payloads are tiny, and whoever follows
//! still polls, since a change can be missed (while the follower reconnects, or while its
//! reader is slow).

use std::thread;
use std::time::{Duration, Instant};

use futures::channel::mpsc;
use postgres::fallible_iterator::FallibleIterator;
use ratchet_core::SessionId;
use ratchet_store::{Change, ChangeStream};
use ratchet_store_sql::Announcement;

use crate::Connector;

/// Jobs nobody holds were enqueued. Payload: the sender's origin.
const JOBS: &str = "ratchet_jobs";
/// Events were appended. Payload: `origin first_seq last_seq session_id`.
const EVENTS: &str = "ratchet_events";

/// Changes a follower keeps for a reader that has not taken them; past this it drops them
/// and owes the reader a `Change::Missed`.
const BUFFER: usize = 256;

/// How long a follower waits for a notification before it looks whether its reader is
/// gone: the thread ends at most this long after the stream is dropped.
const POLL: Duration = Duration::from_millis(250);

/// The first and the longest wait before connecting again after a failure.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The channel and payload that tell other processes of `announcement`.
pub(crate) fn notification(origin: &str, announcement: Announcement<'_>) -> (&'static str, String) {
    match announcement {
        Announcement::JobsReady => (JOBS, origin.to_owned()),
        Announcement::Events {
            session_id,
            first_seq,
            last_seq,
        } => (
            EVENTS,
            format!("{origin} {first_seq} {last_seq} {session_id}"),
        ),
    }
}

/// What a notification tells the process `origin`: nothing when it sent it itself. One
/// that cannot be read still says that something changed.
fn heard(origin: &str, channel: &str, payload: &str) -> Option<Change> {
    let mut fields = payload.split(' ');
    if fields.next() == Some(origin) {
        return None;
    }
    let change = match channel {
        JOBS => Some(Change::JobsReady),
        EVENTS => events(fields),
        _ => None,
    };
    Some(change.unwrap_or(Change::Missed))
}

fn events<'a>(mut fields: impl Iterator<Item = &'a str>) -> Option<Change> {
    let first_seq = fields.next()?.parse().ok()?;
    let last_seq = fields.next()?.parse().ok()?;
    let session_id = SessionId::parse(fields.next()?).ok()?;
    fields.next().is_none().then_some(Change::Events {
        session_id,
        first_seq,
        last_seq,
    })
}

/// Starts a follower. Its stream begins with `Change::Missed` once it listens (what was
/// committed before then was not heard), and says `Missed` again after each reconnection.
pub(crate) fn follow(connector: Connector, origin: String) -> Option<ChangeStream> {
    let (sender, receiver) = mpsc::channel(BUFFER);
    let spawned = thread::Builder::new()
        .name("ratchet-postgres-changes".into())
        .spawn(move || {
            listen(
                &connector,
                &origin,
                &mut Outbox {
                    sender,
                    owes_missed: false,
                },
            )
        });
    match spawned {
        Ok(_) => Some(Box::pin(receiver)),
        Err(error) => {
            tracing::warn!(%error, "cannot start the PostgreSQL change follower; polling only");
            None
        }
    }
}

/// The follower's loop: connect and listen until the connection fails, then again after a
/// pause that grows with each failure, until the stream is dropped.
fn listen(connector: &Connector, origin: &str, outbox: &mut Outbox) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let listening = connector.connect().and_then(|mut client| {
            client
                .batch_execute(&format!("LISTEN {JOBS}; LISTEN {EVENTS}"))
                .map(|()| client)
                .map_err(|e| crate::backend_error(&e))
        });
        let mut client = match listening {
            Ok(client) => client,
            Err(error) => {
                tracing::warn!(%error, "the PostgreSQL change follower cannot listen");
                if !pause(outbox, backoff) {
                    return;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = MIN_BACKOFF;
        if !outbox.send(Change::Missed) {
            return;
        }
        loop {
            if outbox.is_closed() {
                return;
            }
            // A new iterator each time: one that has timed out once answers at once after.
            let next = client.notifications().timeout_iter(POLL).next();
            match next {
                Ok(Some(note)) => {
                    let change = heard(origin, note.channel(), note.payload());
                    if change.is_some_and(|change| !outbox.send(change)) {
                        return;
                    }
                }
                Ok(None) if client.is_closed() => break,
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%error, "the PostgreSQL change follower lost its connection");
                    break;
                }
            }
        }
    }
}

/// Waits `duration` in short naps; false when the stream was dropped meanwhile.
fn pause(outbox: &Outbox, duration: Duration) -> bool {
    let until = Instant::now() + duration;
    loop {
        if outbox.is_closed() {
            return false;
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        thread::sleep(left.min(POLL));
    }
}

/// The sending end, which never blocks the follower: when the reader falls behind, changes
/// are dropped and the reader is told `Missed` as soon as there is room.
struct Outbox {
    sender: mpsc::Sender<Change>,
    owes_missed: bool,
}

impl Outbox {
    fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }

    /// False once the stream is dropped.
    fn send(&mut self, change: Change) -> bool {
        if self.owes_missed {
            match self.sender.try_send(Change::Missed) {
                Ok(()) => self.owes_missed = false,
                Err(error) if error.is_full() => return true,
                Err(_) => return false,
            }
            if change == Change::Missed {
                return true;
            }
        }
        match self.sender.try_send(change) {
            Ok(()) => true,
            Err(error) if error.is_full() => {
                self.owes_missed = true;
                true
            }
            Err(_) => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notification_reads_back_as_the_change_announced() {
        let session = SessionId::from_suffix("a-1").unwrap();
        let (channel, payload) = notification(
            "them",
            Announcement::Events {
                session_id: session.as_str(),
                first_seq: 3,
                last_seq: 7,
            },
        );
        assert_eq!(
            heard("me", channel, &payload),
            Some(Change::Events {
                session_id: session,
                first_seq: 3,
                last_seq: 7
            })
        );
        let (channel, payload) = notification("them", Announcement::JobsReady);
        assert_eq!(heard("me", channel, &payload), Some(Change::JobsReady));
    }

    #[test]
    fn a_process_does_not_hear_itself() {
        let (channel, payload) = notification("me", Announcement::JobsReady);
        assert_eq!(heard("me", channel, &payload), None);
    }

    #[test]
    fn a_notification_that_cannot_be_read_says_something_changed() {
        for payload in [
            "them",
            "them 1",
            "them x 2 ses_a",
            "them 1 2 bad",
            "them 1 2 ses_a x",
        ] {
            assert_eq!(
                heard("me", EVENTS, payload),
                Some(Change::Missed),
                "{payload:?}"
            );
        }
    }

    #[test]
    fn a_reader_that_falls_behind_is_told_it_missed_changes() {
        let (sender, mut receiver) = mpsc::channel(0);
        let mut outbox = Outbox {
            sender,
            owes_missed: false,
        };
        // A channel of no buffer still holds one message per sender.
        assert!(outbox.send(Change::JobsReady));
        assert!(outbox.send(Change::JobsReady));
        assert!(outbox.owes_missed, "the second change did not fit");
        assert_eq!(receiver.try_recv().ok(), Some(Change::JobsReady));
        assert!(outbox.send(Change::JobsReady));
        assert_eq!(
            receiver.try_recv().ok(),
            Some(Change::Missed),
            "the dropped change is owned up to before anything else"
        );
        drop(receiver);
        assert!(!outbox.send(Change::JobsReady), "the reader is gone");
    }
}
