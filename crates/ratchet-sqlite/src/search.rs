//! Full-text search of messages through the FTS5 index `messages_fts` (see `schema.rs`).
//!
//! Query text comes from models and users: it is never handed to FTS5 as a query. Every word
//! becomes a quoted string, so no input can be an FTS5 syntax error or an operator.

use ratchet_core::{RunId, SessionId};
use ratchet_store::{Error, MessageHit, SearchScope};
use rusqlite::params;

use crate::{Result, Tx, backend};
use ratchet_store_sql::sql_enum;

/// Words of a query past this many are ignored: a longer query is a paste, not a search.
const MAX_TERMS: usize = 32;

/// Tokens of context a snippet shows around the matched words (FTS5 allows up to 64).
const SNIPPET_TOKENS: u8 = 24;

/// What both scopes select, best match first; `{filter}` narrows it to the scope.
macro_rules! search_sql {
    ($join:literal, $filter:literal) => {
        concat!(
            "SELECT m.session_id, m.run_id, m.id, m.role, m.rowid, m.created_at,
                    snippet(messages_fts, 0, '**', '**', '…', ?4), bm25(messages_fts) AS score
             FROM messages_fts JOIN messages m ON m.rowid = messages_fts.rowid ",
            $join,
            " WHERE messages_fts MATCH ?1 AND ",
            $filter,
            " AND m.visibility = 'visible' AND m.role IN ('user', 'assistant') AND m.draft_of IS NULL
             ORDER BY score, m.rowid LIMIT ?3"
        )
    };
}

const IN_SESSION: &str = search_sql!("", "m.session_id = ?2");
const IN_TENANT: &str = search_sql!("JOIN sessions s ON s.id = m.session_id", "s.tenant = ?2");

/// Turns free text into an FTS5 query that matches any of its words. Words are separated by
/// whitespace and control characters (which FTS5 never indexes, and a NUL would end the query
/// text early); each is double-quoted with its own quotes doubled, so `*`, `-`, `:`, `NEAR(`,
/// `AND` or a stray quote are searched as text and never read as syntax. A word without any
/// letter or digit becomes a phrase of no token, which matches nothing. None when the text
/// has no word at all.
pub(crate) fn match_expression(text: &str) -> Option<String> {
    let terms: Vec<String> = text
        .split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|word| !word.is_empty())
        .take(MAX_TERMS)
        .map(|word| format!("\"{}\"", word.replace('"', "\"\"")))
        .collect();
    (!terms.is_empty()).then(|| terms.join(" OR "))
}

/// Indexes the messages written since the last catch-up (only the kinds a search can find).
/// Runs on the writer, so that no step transaction pays for the full-text index.
pub(crate) fn catch_up(c: &Tx<'_>) -> Result<()> {
    c.prepare_cached(
        "INSERT INTO messages_fts(rowid, content)
         SELECT rowid, content FROM messages
         WHERE rowid > (SELECT indexed_through FROM messages_fts_progress)
           AND visibility = 'visible' AND role IN ('user', 'assistant')",
    )
    .and_then(|mut s| s.execute([]))
    .map_err(backend)?;
    c.prepare_cached(
        "UPDATE messages_fts_progress SET indexed_through = (SELECT COALESCE(MAX(rowid), 0) FROM messages)",
    )
    .and_then(|mut s| s.execute([]))
    .map_err(backend)?;
    Ok(())
}

pub(crate) fn search_messages(
    c: &Tx<'_>,
    scope: &SearchScope,
    query: &str,
    limit: u32,
) -> Result<Vec<MessageHit>> {
    let expression = match_expression(query).ok_or_else(|| {
        Error::Invalid(
            "invalid search query: the query is empty; expected at least one word".into(),
        )
    })?;
    let (sql, key) = match scope {
        SearchScope::Session(session_id) => (IN_SESSION, session_id.as_str()),
        SearchScope::Tenant(tenant) => (IN_TENANT, tenant.as_str()),
    };
    let mut stmt = c.prepare_cached(sql).map_err(backend)?;
    let rows = stmt
        .query_map(params![expression, key, limit, SNIPPET_TOKENS], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, i64>(4)?,
                r.get::<_, i64>(5)?,
                r.get::<_, String>(6)?,
                r.get::<_, f64>(7)?,
            ))
        })
        .map_err(backend)?;
    let mut hits = Vec::new();
    for row in rows {
        let (session_id, run_id, message_id, role, position, created_at, snippet, rank) =
            row.map_err(backend)?;
        hits.push(MessageHit {
            session_id: SessionId::parse(&session_id).map_err(|e| Error::Corrupt(e.to_string()))?,
            run_id: RunId::parse(&run_id).map_err(|e| Error::Corrupt(e.to_string()))?,
            message_id,
            role: sql_enum(&role)?,
            position,
            created_at,
            snippet,
            rank,
        });
    }
    Ok(hits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_is_one_quoted_term_and_any_may_match() {
        assert_eq!(
            match_expression("  zebra   pelican\n").as_deref(),
            Some(r#""zebra" OR "pelican""#)
        );
        assert_eq!(
            match_expression(r#"say "hi" NEAR(a b) -x c:d * AND"#).as_deref(),
            Some(r#""say" OR """hi""" OR "NEAR(a" OR "b)" OR "-x" OR "c:d" OR "*" OR "AND""#)
        );
        assert_eq!(match_expression(r#"""#).as_deref(), Some(r#""""""#));
        assert_eq!(match_expression(""), None);
        assert_eq!(match_expression(" \t\n "), None);
        assert_eq!(match_expression("\u{0}"), None);
        assert_eq!(
            match_expression("a\u{0}b\u{7}c").as_deref(),
            Some(r#""a" OR "b" OR "c""#)
        );
        let long = "w ".repeat(100);
        let terms = match_expression(&long).unwrap();
        assert_eq!(terms.matches(" OR ").count(), MAX_TERMS - 1);
    }
}
