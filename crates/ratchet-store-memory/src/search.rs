//! Full-text search of messages: a small word matcher ranked by bm25, shaped after the
//! SQLite backend's FTS5 index.
//!
//! A message's words are its runs of letters and digits, compared lowercased; everything else
//! separates them. Each whitespace-separated word of a query is a phrase of its own words
//! (`NEAR(the` is `near` followed by `the`), never syntax; a message matching any phrase is
//! found. Unlike the SQL backends, nothing is stemmed and no stop word is dropped: `zebras`
//! does not find `zebra` here, though it may there — a test must not expect either.
//!
//! Ranking is FTS5's bm25 (lower is better), with its statistics taken over every message a
//! search can find, as FTS5 takes them over its whole index: a message matching more, and
//! rarer, phrases ranks first.

use ratchet_core::{Role, Visibility};
use ratchet_store::{Error, MessageHit, Result, SearchScope};

use crate::tables::{MessageRow, Tables};

/// Words of a query past this many are ignored: a longer query is a paste, not a search.
const MAX_TERMS: usize = 32;
/// Words a snippet shows around the matched ones.
const SNIPPET_WORDS: usize = 24;
/// bm25's term-frequency saturation and length normalization, as FTS5 sets them.
const K1: f64 = 1.2;
const B: f64 = 0.75;

/// One word of a text: where it lies, and how it is compared.
struct Word {
    start: usize,
    end: usize,
    folded: String,
}

fn words(text: &str) -> Vec<Word> {
    let mut words = Vec::new();
    let mut start = None;
    for (at, ch) in text.char_indices().chain([(text.len(), ' ')]) {
        match (start, ch.is_alphanumeric()) {
            (None, true) => start = Some(at),
            (Some(from), false) => {
                words.push(Word {
                    start: from,
                    end: at,
                    folded: text[from..at].to_lowercase(),
                });
                start = None;
            }
            _ => {}
        }
    }
    words
}

/// The query's phrases, one per whitespace-separated word (control characters separate too).
/// A word without a letter or digit is an empty phrase, which matches nothing. None when the
/// query has no word at all.
fn phrases(query: &str) -> Option<Vec<Vec<String>>> {
    let phrases: Vec<Vec<String>> = query
        .split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|word| !word.is_empty())
        .take(MAX_TERMS)
        .map(|word| words(word).into_iter().map(|w| w.folded).collect())
        .collect();
    (!phrases.is_empty()).then_some(phrases)
}

/// Where `phrase` occurs in `text`: the index of each occurrence's first word.
fn occurrences(phrase: &[String], text: &[Word]) -> Vec<usize> {
    if phrase.is_empty() || phrase.len() > text.len() {
        return Vec::new();
    }
    (0..=text.len() - phrase.len())
        .filter(|&at| (phrase.iter().zip(&text[at..])).all(|(p, w)| *p == w.folded))
        .collect()
}

/// A searchable message, split into words.
struct Indexed<'a> {
    position: i64,
    row: &'a MessageRow,
    words: Vec<Word>,
}

impl Tables {
    pub(crate) fn search_messages(
        &self,
        scope: &SearchScope,
        query: &str,
        limit: u32,
    ) -> Result<Vec<MessageHit>> {
        let phrases = phrases(query).ok_or_else(|| {
            Error::Invalid(
                "invalid search query: the query is empty; expected at least one word".into(),
            )
        })?;
        // Only visible user and assistant messages: hidden text must never reach a client
        // through a hit, and tool results would echo earlier searches back.
        let index: Vec<Indexed<'_>> = (1..)
            .zip(&self.messages)
            .filter(|(_, m)| {
                m.draft_of.is_none()
                    && m.message.visibility == Visibility::Visible
                    && matches!(m.message.role, Role::User | Role::Assistant)
            })
            .map(|(position, row)| Indexed {
                position,
                row,
                words: words(&row.message.content),
            })
            .collect();
        let documents = index.len() as f64;
        let average_length =
            index.iter().map(|m| m.words.len()).sum::<usize>() as f64 / documents.max(1.0);
        let found: Vec<Vec<Vec<usize>>> = (index.iter())
            .map(|m| phrases.iter().map(|p| occurrences(p, &m.words)).collect())
            .collect();
        let idf: Vec<f64> = (0..phrases.len())
            .map(|p| {
                let containing = found.iter().filter(|f| !f[p].is_empty()).count() as f64;
                let idf = ((documents - containing + 0.5) / (containing + 0.5)).ln();
                if idf > 0.0 { idf } else { 1e-6 }
            })
            .collect();
        let mut hits: Vec<(f64, &Indexed<'_>, &Vec<Vec<usize>>)> = (index.iter().zip(&found))
            .filter(|(m, f)| self.in_scope(scope, m.row) && f.iter().any(|o| !o.is_empty()))
            .map(|(m, f)| {
                let length = m.words.len() as f64;
                let score: f64 = (f.iter().zip(&idf))
                    .map(|(occurrences, idf)| {
                        let tf = occurrences.len() as f64;
                        idf * tf * (K1 + 1.0) / (tf + K1 * (1.0 - B + B * length / average_length))
                    })
                    .sum();
                (-score, m, f)
            })
            .collect();
        hits.sort_by(|(a, a_m, _), (b, b_m, _)| {
            a.total_cmp(b).then(a_m.position.cmp(&b_m.position))
        });
        Ok((hits.into_iter())
            .take(limit as usize)
            .map(|(rank, m, found)| {
                let marked: Vec<(usize, usize)> = (phrases.iter().zip(found))
                    .flat_map(|(phrase, starts)| starts.iter().map(|&s| (s, s + phrase.len() - 1)))
                    .collect();
                MessageHit {
                    session_id: m.row.session_id.clone(),
                    run_id: m.row.run_id.clone(),
                    message_id: m.row.id.clone(),
                    role: m.row.message.role,
                    position: m.position,
                    created_at: m.row.created_at,
                    snippet: snippet(&m.row.message.content, &m.words, marked),
                    rank,
                }
            })
            .collect())
    }

    fn in_scope(&self, scope: &SearchScope, message: &MessageRow) -> bool {
        match scope {
            SearchScope::Session(session) => message.session_id == *session,
            SearchScope::Tenant(tenant) => {
                (self.sessions.get(&message.session_id)).is_some_and(|s| s.tenant == *tenant)
            }
        }
    }
}

/// The part of `text` around its matched words, which are marked `**like this**`: the whole
/// text when it is short, else the `SNIPPET_WORDS` words around the most matches, with `…`
/// where it was cut. `marked` holds the first and last word of each matched phrase.
fn snippet(text: &str, words: &[Word], mut marked: Vec<(usize, usize)>) -> String {
    marked.sort();
    let mut merged: Vec<(usize, usize)> = Vec::new();
    for (first, last) in marked {
        match merged.last_mut() {
            Some((_, end)) if first <= *end => *end = (*end).max(last),
            _ => merged.push((first, last)),
        }
    }
    let (from, to) = window(words.len(), &merged);
    let start = if from == 0 { 0 } else { words[from].start };
    let end = if to == words.len() {
        text.len()
    } else {
        words[to - 1].end
    };
    let mut out = String::new();
    if from > 0 {
        out.push('…');
    }
    let mut copied = start;
    for (first, last) in merged {
        if first < from || last >= to {
            continue;
        }
        out.push_str(&text[copied..words[first].start]);
        out.push_str("**");
        out.push_str(&text[words[first].start..words[last].end]);
        out.push_str("**");
        copied = words[last].end;
    }
    out.push_str(&text[copied..end]);
    if to < words.len() {
        out.push('…');
    }
    out
}

/// The words `from..to` a snippet shows: all of a short text, else the window holding the
/// most matched phrases, moved so that they sit in its middle.
fn window(count: usize, marked: &[(usize, usize)]) -> (usize, usize) {
    if count <= SNIPPET_WORDS {
        return (0, count);
    }
    let inside = |from: usize| {
        marked
            .iter()
            .filter(|(first, last)| *first >= from && *last < from + SNIPPET_WORDS)
            .collect::<Vec<_>>()
    };
    let best = (marked.iter().map(|(first, _)| *first))
        .max_by_key(|&from| (inside(from).len(), std::cmp::Reverse(from)))
        .unwrap_or(0);
    let shown = inside(best);
    let (first, last) = match (shown.first(), shown.last()) {
        (Some((first, _)), Some((_, last))) => (*first, *last),
        _ => (0, 0),
    };
    let spare = SNIPPET_WORDS.saturating_sub(last - first + 1);
    let from = first.saturating_sub(spare / 2).min(count - SNIPPET_WORDS);
    (from, from + SNIPPET_WORDS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marked(text: &str, query: &str) -> String {
        let words = words(text);
        let found = (phrases(query).unwrap().iter())
            .flat_map(|p| {
                occurrences(p, &words)
                    .into_iter()
                    .map(|s| (s, s + p.len() - 1))
            })
            .collect();
        snippet(text, &words, found)
    }

    #[test]
    fn a_query_word_is_a_phrase_of_its_words_and_never_syntax() {
        let text = r#"he said "halt" -- NEAR(the door): see *notes*"#;
        assert_eq!(
            marked(text, "NEAR(the"),
            r#"he said "halt" -- **NEAR(the** door): see *notes*"#
        );
        assert_eq!(
            marked(text, r#"halt" OR "x"#),
            r#"he said "**halt**" -- NEAR(the door): see *notes*"#
        );
        assert_eq!(
            marked(text, "the NEAR"),
            r#"he said "halt" -- **NEAR**(**the** door): see *notes*"#
        );
        assert_eq!(phrases(r#"" * -"#), Some(vec![vec![], vec![], vec![]]));
        assert_eq!(phrases(" \t\u{0} "), None);
    }

    #[test]
    fn a_long_message_is_cut_around_its_matches() {
        let text: Vec<String> = (0..100).map(|i| format!("w{i}")).collect();
        let text = text.join(" ");
        let snippet = marked(&text, "w50");
        assert!(
            snippet.starts_with("…w39 ") && snippet.ends_with(" w62…"),
            "{snippet}"
        );
        assert!(snippet.contains(" **w50** "), "{snippet}");
        let start = marked(&text, "w1");
        assert!(
            start.starts_with("w0 **w1** ") && start.ends_with(" w23…"),
            "{start}"
        );
    }
}
