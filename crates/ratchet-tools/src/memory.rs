//! `memory_search`: lets the model look up earlier messages by their words.
//!
//! The tool never sees the store: the engine hands it, in the `ToolContext`, a `MemorySearch`
//! already bound to the run's frozen scope (its session, or its tenant). The tool only checks
//! its arguments and turns hits into text the model reads.

use std::fmt::Debug;

use async_trait::async_trait;
use ratchet_core::{Millis, ReplayPolicy, Role, RunId, SessionId, ToolDelegation, ToolOutcome};
use serde::Serialize;
use serde_json::{Value, json};

use crate::{Tool, ToolContext};

/// Hits a search returns when the model does not say.
const DEFAULT_LIMIT: u32 = 5;
/// Most hits one search may return.
const MAX_LIMIT: u32 = 20;
/// Longest query accepted, in characters.
const MAX_QUERY_CHARS: u64 = 1000;

/// An earlier message that matched a search.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryHit {
    pub session_id: SessionId,
    pub run_id: RunId,
    pub message_id: String,
    pub role: Role,
    pub created_at: Millis,
    /// The text around the matched words, which are marked `**like this**`.
    pub snippet: String,
}

/// Searches the history a run may remember. Read-only, so running it again after a crash is
/// always safe.
#[async_trait]
pub trait MemorySearch: Send + Sync + Debug {
    /// The `limit` messages that best match `query`, best first, in the history visible from
    /// `session`. An error is a message for the model.
    async fn search(
        &self,
        session: &SessionId,
        query: &str,
        limit: u32,
    ) -> Result<Vec<MemoryHit>, String>;
}

/// Bytes of a matching message shown to the model when nobody says otherwise.
pub const DEFAULT_MAX_SNIPPET_BYTES: usize = 2048;

/// `memory_search`, showing at most `max_snippet_bytes` of each matching message: a search
/// over large messages must not copy them whole into the run's history and events.
#[derive(Debug, Clone, Copy)]
pub struct MemorySearchTool {
    max_snippet_bytes: usize,
}

impl MemorySearchTool {
    pub fn new(max_snippet_bytes: usize) -> MemorySearchTool {
        MemorySearchTool { max_snippet_bytes }
    }
}

impl Default for MemorySearchTool {
    fn default() -> MemorySearchTool {
        MemorySearchTool::new(DEFAULT_MAX_SNIPPET_BYTES)
    }
}

/// One hit as the model reads it; `session_id` only when the hit is from another session.
#[derive(Serialize)]
struct Shown<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    session_id: Option<&'a SessionId>,
    run_id: &'a RunId,
    message_id: &'a str,
    role: Role,
    at: String,
    text: std::borrow::Cow<'a, str>,
}

#[async_trait]
impl Tool for MemorySearchTool {
    fn name(&self) -> &str {
        "memory_search"
    }
    fn description(&self) -> &str {
        "Searches earlier messages of the conversation history for words and returns the best \
         matches first, with the matched words marked **like this**. A message matching any \
         of the words is found; ones matching more of them rank higher."
    }
    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}
            },
            "required": ["query"],
            "additionalProperties": false
        })
    }
    /// Searches the history of the caller's own session (or tenant): safe to hand down.
    fn delegation(&self) -> ToolDelegation {
        ToolDelegation::Delegatable
    }
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Safe
    }
    async fn call(&self, arguments: Value, context: &ToolContext) -> ToolOutcome {
        let query = arguments["query"].as_str().unwrap_or_default();
        if query.trim().is_empty() {
            return ToolOutcome::error("`query` is empty; give one or more words to search for");
        }
        let limit = arguments["limit"]
            .as_u64()
            .map_or(DEFAULT_LIMIT, |n| n.clamp(1, u64::from(MAX_LIMIT)) as u32);
        let Some(memory) = &context.memory else {
            return ToolOutcome::error("memory search is not available to this run");
        };
        let found = tokio::select! {
            found = memory.search(&context.session_id, query, limit) => found,
            () = context.cancel.cancelled() => return ToolOutcome::error("cancelled"),
        };
        match found {
            Err(message) => ToolOutcome::error(message),
            Ok(hits) if hits.is_empty() => ToolOutcome::ok(format!("no matches for {query:?}")),
            Ok(hits) => {
                let shown: Vec<Shown<'_>> = hits
                    .iter()
                    .map(|hit| Shown {
                        session_id: (hit.session_id != context.session_id)
                            .then_some(&hit.session_id),
                        run_id: &hit.run_id,
                        message_id: &hit.message_id,
                        role: hit.role,
                        at: utc(hit.created_at),
                        text: bounded(&hit.snippet, self.max_snippet_bytes),
                    })
                    .collect();
                ToolOutcome::ok(json!({"matches": shown}).to_string())
            }
        }
    }
}

/// At most `max_bytes` of `snippet`, cut at character boundaries around its first marked
/// match (a quarter of the room before it), with `…` where text was cut.
fn bounded(snippet: &str, max_bytes: usize) -> std::borrow::Cow<'_, str> {
    if snippet.len() <= max_bytes {
        return snippet.into();
    }
    let marked = snippet.find("**").unwrap_or(0);
    let mut start = marked.saturating_sub(max_bytes / 4);
    while !snippet.is_char_boundary(start) {
        start -= 1;
    }
    let mut end = (start + max_bytes).min(snippet.len());
    while !snippet.is_char_boundary(end) {
        end -= 1;
    }
    let before = if start > 0 { "…" } else { "" };
    let after = if end < snippet.len() { "…" } else { "" };
    format!("{before}{}{after}", &snippet[start..end]).into()
}

/// `2026-08-05T04:21:11Z`: a time a model reads, from milliseconds since the epoch.
fn utc(millis: Millis) -> String {
    let seconds = millis.div_euclid(1000);
    let (days, of_day) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's `civil_from_days`).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    )
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio_util::sync::CancellationToken;

    use super::*;

    /// Answers every search with `hits` and remembers what it was asked.
    #[derive(Debug, Default)]
    struct Recorded {
        hits: Vec<MemoryHit>,
        asked: Mutex<Vec<(SessionId, String, u32)>>,
    }

    #[async_trait]
    impl MemorySearch for Recorded {
        async fn search(
            &self,
            session: &SessionId,
            query: &str,
            limit: u32,
        ) -> Result<Vec<MemoryHit>, String> {
            self.asked
                .lock()
                .unwrap()
                .push((session.clone(), query.to_owned(), limit));
            Ok(self.hits.clone())
        }
    }

    fn session(suffix: &str) -> SessionId {
        SessionId::from_suffix(suffix).unwrap()
    }

    fn context(memory: Option<Arc<dyn MemorySearch>>) -> ToolContext {
        ToolContext {
            workspace: None,
            idempotency_key: "run_x#1#0".into(),
            cancel: CancellationToken::new(),
            session_id: session("mine"),
            memory,
            input: None,
            traceparent: None,
        }
    }

    fn hit(session_id: SessionId, text: &str) -> MemoryHit {
        MemoryHit {
            session_id,
            run_id: RunId::from_suffix("r1").unwrap(),
            message_id: "msg_m1".into(),
            role: Role::User,
            created_at: 1_785_903_671_123,
            snippet: text.into(),
        }
    }

    /// A match inside a huge message shows a bounded window around the marked words, not the
    /// message: the probe's 900 KB messages came back whole, megabytes per search.
    #[tokio::test]
    async fn a_match_in_a_large_message_shows_a_bounded_snippet() {
        let huge = format!(
            "{}the **zebra** is here{}",
            "é".repeat(300_000),
            "z".repeat(300_000)
        );
        let memory = Arc::new(Recorded {
            hits: vec![
                hit(session("mine"), &huge),
                hit(session("mine"), "a **zebra**"),
            ],
            ..Recorded::default()
        });
        let ctx = context(Some(memory));
        let outcome = MemorySearchTool::new(100)
            .call(json!({"query": "zebra"}), &ctx)
            .await;
        assert!(!outcome.is_error, "{outcome:?}");
        let shown: Value = serde_json::from_str(&outcome.content).unwrap();
        let texts: Vec<&str> = shown["matches"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["text"].as_str().unwrap())
            .collect();
        assert!(
            texts[0].starts_with('…') && texts[0].ends_with('…'),
            "cut on both sides: {}",
            texts[0]
        );
        assert!(
            texts[0].contains("**zebra**"),
            "the match stays in view: {}",
            texts[0]
        );
        assert!(
            texts[0].len() <= 100 + 2 * '…'.len_utf8(),
            "at most 100 bytes besides the ellipses, found {}",
            texts[0].len()
        );
        assert_eq!(texts[1], "a **zebra**", "a short snippet is shown as it is");
    }

    #[tokio::test]
    async fn hits_are_listed_best_first_for_the_model() {
        let memory = Arc::new(Recorded {
            hits: vec![
                hit(session("mine"), "the **zebra** is striped"),
                hit(session("other"), "a **zebra** elsewhere"),
            ],
            ..Recorded::default()
        });
        let ctx = context(Some(memory.clone()));
        let outcome = MemorySearchTool::default()
            .call(json!({"query": "zebra", "limit": 7}), &ctx)
            .await;
        assert!(!outcome.is_error, "{outcome:?}");
        let shown: Value = serde_json::from_str(&outcome.content).unwrap();
        assert_eq!(
            shown,
            json!({"matches": [
                {"run_id": "run_r1", "message_id": "msg_m1", "role": "user",
                 "at": "2026-08-05T04:21:11Z", "text": "the **zebra** is striped"},
                {"session_id": "ses_other", "run_id": "run_r1", "message_id": "msg_m1",
                 "role": "user", "at": "2026-08-05T04:21:11Z", "text": "a **zebra** elsewhere"},
            ]})
        );
        assert_eq!(
            *memory.asked.lock().unwrap(),
            [(session("mine"), "zebra".to_owned(), 7)],
            "the search is asked about the run's session with the model's limit"
        );
        MemorySearchTool::default()
            .call(json!({"query": "zebra"}), &ctx)
            .await;
        assert_eq!(memory.asked.lock().unwrap()[1].2, DEFAULT_LIMIT);
    }

    #[tokio::test]
    async fn no_match_is_an_answer_and_a_missing_search_an_error() {
        let outcome = MemorySearchTool::default()
            .call(
                json!({"query": "okapi"}),
                &context(Some(Arc::new(Recorded::default()))),
            )
            .await;
        assert_eq!(outcome, ToolOutcome::ok("no matches for \"okapi\""));
        let outcome = MemorySearchTool::default()
            .call(
                json!({"query": "  "}),
                &context(Some(Arc::new(Recorded::default()))),
            )
            .await;
        assert!(
            outcome.is_error && outcome.content.contains("empty"),
            "{outcome:?}"
        );
        let outcome = MemorySearchTool::default()
            .call(json!({"query": "okapi"}), &context(None))
            .await;
        assert!(
            outcome.is_error && outcome.content.contains("not available"),
            "{outcome:?}"
        );
    }

    #[test]
    fn times_are_shown_in_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_785_903_671_999), "2026-08-05T04:21:11Z");
        assert_eq!(utc(-1), "1969-12-31T23:59:59Z");
    }
}
