//! Tool calls on the wire, the same for every provider: tool names encoded into the alphabet
//! the APIs accept, and the arguments a model wrote decoded into the value the engine checks.
//!
//! Nothing here decides whether a call is valid: a name the model made up or arguments that
//! are not an object reach the engine as they are, whose schema validation rejects them with
//! an error the model reads.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::ModelRequest;

/// The longest tool name OpenAI and Anthropic accept.
const MAX_NAME_LEN: usize = 64;

/// The names of one request's tools as sent on the wire, and back.
///
/// Ratchet tool names may contain characters the APIs refuse (an MCP tool is `server.tool`),
/// while both require `^[a-zA-Z0-9_-]{1,64}$`. Each name is encoded once per request: a name
/// the APIs accept is sent as it is; any other has every other character replaced by `_`,
/// is cut to 64 characters, and gets a suffix (`_2`, `_3`, …) when that spelling is taken.
/// Names that are valid keep their spelling before any encoded name is chosen, so an encoded
/// name never displaces a real one. The calls a model returns are mapped back; a name this
/// request did not send (the model made it up) is kept as it is.
#[derive(Debug, Clone, Default)]
pub(crate) struct WireNames {
    wire_of: HashMap<String, String>,
    real_of: HashMap<String, String>,
}

impl WireNames {
    /// Encodes `names` (the request's tools first, then names its history mentions; repeats
    /// are ignored). The same names in the same order always give the same encoding.
    pub(crate) fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> WireNames {
        let mut seen = HashSet::new();
        let unique: Vec<&str> = names.into_iter().filter(|n| seen.insert(*n)).collect();
        let mut encoded = WireNames::default();
        for name in unique.iter().filter(|n| is_valid(n)) {
            encoded.insert(name, (*name).to_owned());
        }
        for name in unique.iter().filter(|n| !is_valid(n)) {
            let base = sanitize(name);
            let mut wire = base.clone();
            let mut n = 2;
            while encoded.real_of.contains_key(&wire) {
                let suffix = format!("_{n}");
                wire = format!(
                    "{}{suffix}",
                    &base[..base.len().min(MAX_NAME_LEN - suffix.len())]
                );
                n += 1;
            }
            encoded.insert(name, wire);
        }
        encoded
    }

    /// The names of a request: its tools, then the tools its history called. A concluding
    /// call has no tools, but its history still names them, and must name them the same way.
    pub(crate) fn for_request(request: &ModelRequest) -> WireNames {
        let tools = request.tools.iter().map(|t| t.name.as_str());
        let called = (request.messages.iter())
            .flat_map(|m| &m.tool_calls)
            .map(|c| c.name.as_str());
        WireNames::new(tools.chain(called))
    }

    fn insert(&mut self, real: &str, wire: String) {
        self.real_of.insert(wire.clone(), real.to_owned());
        self.wire_of.insert(real.to_owned(), wire);
    }

    /// The name to send for the tool `real`.
    pub(crate) fn wire<'a>(&'a self, real: &'a str) -> &'a str {
        self.wire_of.get(real).map_or(real, String::as_str)
    }

    /// The tool a name the model returned stands for.
    pub(crate) fn real(&self, wire: &str) -> String {
        self.real_of
            .get(wire)
            .cloned()
            .unwrap_or_else(|| wire.to_owned())
    }
}

fn is_valid(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn sanitize(name: &str) -> String {
    let mut wire: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(MAX_NAME_LEN)
        .collect();
    if wire.is_empty() {
        wire.push_str("tool");
    }
    wire
}

/// The arguments of a call as the model wrote them (a string of JSON), for the engine.
///
/// An object is the only valid shape. Nothing (an empty string, or `null`) means no arguments:
/// `{}`. Anything else — text that is not JSON, a JSON array or number — is kept as the raw
/// string: the engine's schema validation rejects it and the model reads why, and the call
/// goes back to the model in the next request exactly as it was written.
pub(crate) fn parse_arguments(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Object(Default::default());
    }
    match serde_json::from_str::<Value>(text) {
        Ok(value @ Value::Object(_)) => value,
        Ok(Value::Null) => Value::Object(Default::default()),
        _ => Value::String(text.to_owned()),
    }
}

/// The arguments of a call as a string of JSON, for a provider that takes them so: a raw
/// string kept by [`parse_arguments`] goes back as it was written.
pub(crate) fn arguments_text(arguments: &Value) -> String {
    match arguments {
        Value::String(raw) => raw.clone(),
        other => other.to_string(),
    }
}

/// For a field some servers send as `null` where others leave it out: both read as the
/// default.
pub(crate) fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// The start of a text, for an error message that quotes what was found.
pub(crate) fn preview(text: &str) -> String {
    const MAX: usize = 200;
    match text.char_indices().nth(MAX) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn encode(names: &[&str]) -> Vec<String> {
        let encoded = WireNames::new(names.iter().copied());
        names.iter().map(|n| encoded.wire(n).to_owned()).collect()
    }

    #[test]
    fn valid_names_are_sent_as_they_are() {
        assert_eq!(
            encode(&["add", "read_file", "Fetch-URL9"]),
            ["add", "read_file", "Fetch-URL9"]
        );
    }

    #[test]
    fn other_characters_become_underscores_and_map_back() {
        let names = ["fs.read", "git.log", "wiki:search page", "café"];
        let encoded = WireNames::new(names);
        let wire: Vec<&str> = names.iter().map(|n| encoded.wire(n)).collect();
        assert_eq!(wire, ["fs_read", "git_log", "wiki_search_page", "caf_"]);
        for name in names {
            assert_eq!(encoded.real(encoded.wire(name)), name);
        }
    }

    #[test]
    fn collisions_get_a_suffix_and_a_valid_name_keeps_its_spelling() {
        // `a_b` is a real tool: it keeps `a_b` although `a.b` comes first.
        let names = ["a.b", "a_b", "a:b", "a b"];
        let encoded = WireNames::new(names);
        assert_eq!(encoded.wire("a_b"), "a_b");
        assert_eq!(encoded.wire("a.b"), "a_b_2");
        assert_eq!(encoded.wire("a:b"), "a_b_3");
        assert_eq!(encoded.wire("a b"), "a_b_4");
        for name in names {
            assert_eq!(encoded.real(encoded.wire(name)), name);
        }
    }

    #[test]
    fn long_names_are_cut_to_64_characters_suffix_included() {
        let long_a = format!("server.{}", "x".repeat(70));
        let long_b = format!("server:{}", "x".repeat(70));
        let encoded = WireNames::new([long_a.as_str(), long_b.as_str()]);
        let (a, b) = (encoded.wire(&long_a), encoded.wire(&long_b));
        assert_eq!(a, format!("server_{}", "x".repeat(57)));
        assert_eq!(b, format!("server_{}_2", "x".repeat(55)));
        assert!(is_valid(a) && is_valid(b));
        assert_eq!(encoded.real(a), long_a);
        assert_eq!(encoded.real(b), long_b);
        // A valid name of exactly 64 characters is kept; one of 65 is cut.
        let exact = "y".repeat(64);
        assert_eq!(encode(&[&exact]), [exact.as_str()]);
        assert_eq!(encode(&[&"y".repeat(65)]), [exact.as_str()]);
    }

    #[test]
    fn an_empty_name_and_an_unknown_name() {
        let encoded = WireNames::new([""]);
        assert_eq!(encoded.wire(""), "tool");
        assert_eq!(encoded.real("tool"), "");
        assert_eq!(encoded.real("made_up"), "made_up");
        assert_eq!(encoded.wire("not.in.request"), "not.in.request");
    }

    #[test]
    fn repeated_names_are_encoded_once() {
        let encoded = WireNames::new(["a.b", "a.b", "a.b"]);
        assert_eq!(encoded.wire("a.b"), "a_b");
    }

    #[test]
    fn arguments_are_an_object_or_the_raw_text() {
        assert_eq!(parse_arguments(r#"{"a": 1}"#), json!({"a": 1}));
        assert_eq!(parse_arguments(""), json!({}));
        assert_eq!(parse_arguments("  "), json!({}));
        assert_eq!(parse_arguments("null"), json!({}));
        assert_eq!(parse_arguments(r#"{"a": 1"#), json!(r#"{"a": 1"#));
        assert_eq!(parse_arguments("[1, 2]"), json!("[1, 2]"));
        assert_eq!(parse_arguments("7"), json!("7"));
        // And back as they were written.
        assert_eq!(arguments_text(&parse_arguments(r#"{"a": 1"#)), r#"{"a": 1"#);
        assert_eq!(arguments_text(&json!({"a": 1})), r#"{"a":1}"#);
    }

    #[test]
    fn previews_are_cut_on_a_character_boundary() {
        assert_eq!(preview("short"), "short");
        let long = "é".repeat(300);
        assert_eq!(preview(&long), format!("{}…", "é".repeat(200)));
    }
}
