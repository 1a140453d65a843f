//! Full-text search of messages with PostgreSQL's text search (the `messages_search` index;
//! the `english` configuration, so words are stemmed and stop words ignored).
//!
//! Query text comes from models and users: it is never read as tsquery syntax. Each word is
//! a bound parameter of its own `plainto_tsquery`, which takes only the word's lexemes and
//! cannot fail on any text, and the words' queries are joined with `||` (any word matches).
//! Ranking is `ts_rank_cd`, cover density: a message holding more of the words ranks first.
//! Unlike SQLite's bm25 it does not weigh how rare a word is.

use ratchet_core::{Role, RunId, SessionId};
use ratchet_store::{Error, MessageHit, SearchScope};
use ratchet_store_sql::{Db, Param};

use crate::Result;

/// Words of a query past this many are ignored: a longer query is a paste, not a search.
const MAX_TERMS: usize = 32;

/// The words of a query: separated by whitespace and control characters (which are never
/// indexed, and PostgreSQL text cannot hold a NUL). A query without any is invalid.
pub(crate) fn words(query: &str) -> Result<Vec<String>> {
    let words: Vec<String> = query
        .split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|word| !word.is_empty())
        .take(MAX_TERMS)
        .map(str::to_owned)
        .collect();
    if words.is_empty() {
        return Err(Error::Invalid(
            "invalid search query: the query is empty; expected at least one word".into(),
        ));
    }
    Ok(words)
}

/// The search of one scope for `words` words: `?1` is the scope's key, `?2` the limit,
/// `?3…` the words. The inner query ranks and limits; only the hits kept get a snippet.
fn sql(scope: &SearchScope, words: usize) -> String {
    let query = (0..words)
        .map(|i| format!("plainto_tsquery('english', ?{})", i + 3))
        .collect::<Vec<_>>()
        .join(" || ");
    let (join, filter) = match scope {
        SearchScope::Session(_) => ("", "m.session_id = ?1"),
        SearchScope::Tenant(_) => ("JOIN sessions s ON s.id = m.session_id", "s.tenant = ?1"),
    };
    format!(
        "SELECT hit.session_id, hit.run_id, hit.id, hit.role, hit.rowid, hit.created_at,
                ts_headline('english', hit.content, hit.query,
                            'StartSel=**, StopSel=**, MaxWords=24, MinWords=12'),
                hit.score
         FROM (SELECT m.session_id, m.run_id, m.id, m.role, m.rowid, m.created_at, m.content,
                      q.query,
                      -ts_rank_cd(to_tsvector('english', m.content), q.query)::float8 AS score
               FROM messages m {join}, (SELECT {query} AS query) q
               WHERE to_tsvector('english', m.content) @@ q.query
                 AND {filter}
                 AND m.visibility = 'visible' AND m.role IN ('user', 'assistant')
                 AND m.draft_of IS NULL
               ORDER BY score, m.rowid
               LIMIT ?2) hit
         ORDER BY hit.score, hit.rowid"
    )
}

pub(crate) fn search(
    db: &dyn Db,
    scope: &SearchScope,
    words: &[String],
    limit: u32,
) -> Result<Vec<MessageHit>> {
    let key = match scope {
        SearchScope::Session(session_id) => session_id.as_str(),
        SearchScope::Tenant(tenant) => tenant.as_str(),
    };
    let mut params = vec![Param::from(key), Param::from(limit)];
    params.extend(words.iter().map(Param::from));
    let corrupt = |e: ratchet_core::IdError| Error::Corrupt(e.to_string());
    db.query(&sql(scope, words.len()), &params)?
        .into_iter()
        .map(|mut row| {
            Ok(MessageHit {
                session_id: SessionId::parse(&row.text(0)?).map_err(corrupt)?,
                run_id: RunId::parse(&row.text(1)?).map_err(corrupt)?,
                message_id: row.text(2)?,
                role: role(&row.text(3)?)?,
                position: row.int(4)?,
                created_at: row.int(5)?,
                snippet: row.text(6)?,
                rank: row.real(7)?,
            })
        })
        .collect()
}

/// The roles a search can find.
fn role(text: &str) -> Result<Role> {
    match text {
        "user" => Ok(Role::User),
        "assistant" => Ok(Role::Assistant),
        other => Err(Error::Corrupt(format!(
            "a search found a message of role {other:?}; expected user or assistant"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_split_on_whitespace_and_control_characters() {
        assert_eq!(words("  zebra   pelican\n").unwrap(), ["zebra", "pelican"]);
        assert_eq!(
            words("halt\u{0}\"  NEAR(a").unwrap(),
            ["halt", "\"", "NEAR(a"]
        );
        assert_eq!(words(&"w ".repeat(100)).unwrap().len(), MAX_TERMS);
        for empty in ["", " \t\n ", "\u{0}"] {
            assert!(
                matches!(words(empty), Err(Error::Invalid(_))),
                "{empty:?} has no word"
            );
        }
    }

    #[test]
    fn each_word_is_a_parameter_of_its_own() {
        let sql = sql(&SearchScope::Tenant("t".into()), 2);
        assert!(
            sql.contains("plainto_tsquery('english', ?3) || plainto_tsquery('english', ?4)"),
            "{sql}"
        );
        assert!(!sql.contains("?5"), "{sql}");
        assert!(sql.contains("s.tenant = ?1"), "{sql}");
    }

    /// The planner can answer a search from the partial GIN index only if the search repeats
    /// its expression and predicate word for word: with the other ways to read `messages`
    /// taken away, the plan must still read the index rather than every row.
    #[cfg(feature = "testkit")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_search_can_read_the_index() {
        use ratchet_store_sql::Backend;

        let Some(database) = crate::testkit::TestDatabase::create() else {
            return;
        };
        let backend = crate::PgBackend::open_url(database.url()).unwrap();
        let session = SessionId::parse("ses_x").unwrap();
        for scope in [
            SearchScope::Session(session),
            SearchScope::Tenant("t".into()),
        ] {
            let plan = backend
                .write(move |db| {
                    db.execute("DROP INDEX messages_by_session", &[])?;
                    db.execute("DROP INDEX messages_summaries", &[])?;
                    db.execute("SET LOCAL enable_seqscan = off", &[])?;
                    let params = [
                        Param::from("key"),
                        Param::from(10_u32),
                        Param::from("zebra"),
                        Param::from("pelican"),
                    ];
                    let plan = db.query(&format!("EXPLAIN {}", sql(&scope, 2)), &params)?;
                    // The indexes come back with the rollback.
                    Err::<(), _>(Error::Invalid(format!("{plan:?}")))
                })
                .await;
            let Err(Error::Invalid(plan)) = plan else {
                panic!("EXPLAIN failed: {plan:?}");
            };
            assert!(plan.contains("messages_search"), "{plan}");
        }
    }
}
