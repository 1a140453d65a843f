//! How an event's payload is stored. Every event of a run names its run in its payload's
//! `run_id`, and its row holds the same id in a column of its own: the stored text leaves
//! the payload's copy out (a third of a typical event's bytes) and reading puts it back.
//!
//! The round trip is exact because writing normalizes first: an object payload of a run's
//! event that lacks `run_id` gains it, before the event is published or stored. A payload
//! whose `run_id` names another run, or that is not an object, is stored as it is.

use ratchet_core::RunId;
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

use crate::Result;
use crate::rows::{from_json, to_json};

const RUN_ID: &str = "run_id";

/// Adds `run_id` to an object payload of `run`'s event that lacks it.
pub(crate) fn name_run(payload: &mut Value, run: Option<&RunId>) {
    if let (Some(run), Value::Object(fields)) = (run, payload)
        && !fields.contains_key(RUN_ID)
    {
        fields.insert(RUN_ID.to_owned(), Value::String(run.as_str().to_owned()));
    }
}

/// The stored text of `payload`, an event of `run`'s.
pub(crate) fn encode(payload: &Value, run: Option<&RunId>) -> Result<String> {
    match (run, payload) {
        (Some(run), Value::Object(fields)) if names_only(fields, run) => {
            to_json(&WithoutRunId(fields))
        }
        _ => to_json(payload),
    }
}

/// The payload of an event of `run`'s stored as `text`.
pub(crate) fn decode(text: &str, run: Option<&RunId>) -> Result<Value> {
    let mut payload = from_json(text, "event payload")?;
    name_run(&mut payload, run);
    Ok(payload)
}

/// Whether the payload's `run_id`, if it has one, is `run`: the column says it already.
fn names_only(fields: &Map<String, Value>, run: &RunId) -> bool {
    fields
        .get(RUN_ID)
        .is_none_or(|named| named.as_str() == Some(run.as_str()))
}

struct WithoutRunId<'a>(&'a Map<String, Value>);

impl Serialize for WithoutRunId<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().filter(|(key, _)| key.as_str() != RUN_ID))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn round_trip(payload: Value, run: Option<&RunId>) -> (String, Value) {
        let mut published = payload;
        name_run(&mut published, run);
        let stored = encode(&published, run).unwrap();
        let read = decode(&stored, run).unwrap();
        assert_eq!(read, published, "what is read back is what was published");
        (stored, published)
    }

    #[test]
    fn a_run_events_payload_is_stored_without_the_run_it_names() {
        let run = RunId::from_suffix("r").unwrap();
        let (stored, _) = round_trip(
            json!({"run_id": run.as_str(), "status": "running"}),
            Some(&run),
        );
        assert_eq!(stored, r#"{"status":"running"}"#);
    }

    #[test]
    fn a_run_events_payload_without_its_run_gains_it_when_published() {
        let run = RunId::from_suffix("r").unwrap();
        let (stored, published) = round_trip(json!({"reason": "late"}), Some(&run));
        assert_eq!(stored, r#"{"reason":"late"}"#);
        assert_eq!(published, json!({"reason": "late", "run_id": run.as_str()}));
    }

    #[test]
    fn payloads_that_name_another_run_or_are_not_objects_are_stored_as_they_are() {
        let run = RunId::from_suffix("r").unwrap();
        let other = RunId::from_suffix("other").unwrap();
        let cases = [
            (json!({"run_id": other.as_str(), "n": 1}), Some(&run)),
            (json!({"run_id": null}), Some(&run)),
            (json!({"run_id": run.as_str()}), None),
            (json!({"text": "no run"}), None),
            (json!([1, 2]), Some(&run)),
            (json!("text"), Some(&run)),
        ];
        for (payload, row_run) in cases {
            let (stored, published) = round_trip(payload.clone(), row_run);
            assert_eq!(published, payload, "nothing to add to {payload}");
            assert_eq!(stored, payload.to_string());
        }
    }

    #[test]
    fn payloads_stored_with_their_run_are_read_unchanged() {
        let run = RunId::from_suffix("r").unwrap();
        let written_before = json!({"run_id": run.as_str(), "step_index": 3});
        assert_eq!(
            decode(&written_before.to_string(), Some(&run)).unwrap(),
            written_before
        );
    }
}
