//! Where a run sits in a distributed trace (W3C Trace Context), decided without I/O.
//!
//! A run is one span tree of one trace. Its own span's id is derived from the run's id, so
//! every process that executes one of its steps — after a crash, on another machine —
//! parents the step under the same span without reading anything but the run's state. The
//! state stores only what cannot be derived: the trace a caller's `traceparent` put the run
//! in, and the span it is a child of (the caller's, or the delegating call's for a child
//! run). A run with no stored context is the root of a trace of its own, whose id is derived
//! from the run's id too.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{AgentState, RunId};

/// A trace's id: 16 bytes, never all zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TraceId([u8; 16]);

/// A span's id: 8 bytes, never all zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SpanId([u8; 8]);

impl TraceId {
    pub fn to_bytes(self) -> [u8; 16] {
        self.0
    }
}

impl SpanId {
    pub fn to_bytes(self) -> [u8; 8] {
        self.0
    }
}

/// Lowercase hex digits of exactly `N` bytes, not all zero.
fn parse_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N
        || !text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut bytes = [0u8; N];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    (bytes != [0u8; N]).then_some(bytes)
}

fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_hex(f, &self.0)
    }
}

impl TryFrom<String> for TraceId {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        parse_hex(&text).map(TraceId).ok_or_else(|| {
            format!("expected a trace id of 32 lowercase hex digits, not all zero, found {text:?}")
        })
    }
}

impl TryFrom<String> for SpanId {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        parse_hex(&text).map(SpanId).ok_or_else(|| {
            format!("expected a span id of 16 lowercase hex digits, not all zero, found {text:?}")
        })
    }
}

impl From<TraceId> for String {
    fn from(id: TraceId) -> String {
        id.to_string()
    }
}

impl From<SpanId> for String {
    fn from(id: SpanId) -> String {
        id.to_string()
    }
}

/// What a run's state stores of its trace: the trace it belongs to and its span's parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    pub trace_id: TraceId,
    pub parent_span_id: SpanId,
}

impl TraceContext {
    /// The context a W3C `traceparent` header names (`VERSION-TRACEID-PARENTID-FLAGS`), or
    /// `None` when the header is not one: an invalid header is ignored, as the
    /// specification asks, and the run starts a trace of its own.
    pub fn from_traceparent(header: &str) -> Option<TraceContext> {
        let mut fields = header.trim().split('-');
        let version = fields.next()?;
        let (trace_id, parent, flags) = (fields.next()?, fields.next()?, fields.next()?);
        let version_ok = version.len() == 2
            && version != "ff"
            && u8::from_str_radix(version, 16).is_ok()
            && version == version.to_ascii_lowercase();
        // Version 00 has exactly four fields; a later version may append more.
        let fields_ok = if version == "00" {
            fields.next().is_none()
        } else {
            true
        };
        let flags_ok = flags.len() == 2 && parse_flags(flags);
        if !(version_ok && fields_ok && flags_ok) {
            return None;
        }
        Some(TraceContext {
            trace_id: TraceId(parse_hex(trace_id)?),
            parent_span_id: SpanId(parse_hex(parent)?),
        })
    }

    /// The context of a child run started by the call in `slot` of its parent's step
    /// `step_index`: the parent's trace, under that call's span.
    pub fn of_child(parent: &AgentState, step_index: u64, slot: u32) -> TraceContext {
        TraceContext {
            trace_id: trace_id(parent),
            parent_span_id: call_span_id(&parent.run_id, step_index, slot),
        }
    }
}

fn parse_flags(flags: &str) -> bool {
    flags
        .bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The `traceparent` header value for `span` of `trace`, sampled.
pub fn traceparent(trace: TraceId, span: SpanId) -> String {
    format!("00-{trace}-{span}-01")
}

/// The first bytes of a SHA-256 over `parts`, each length-prefixed so that no two different
/// lists hash alike.
fn derive<const N: usize>(parts: &[&[u8]]) -> [u8; N] {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    let digest = hasher.finalize();
    let mut bytes = [0u8; N];
    bytes.copy_from_slice(&digest[..N]);
    if bytes == [0u8; N] {
        bytes[N - 1] = 1;
    }
    bytes
}

/// The trace `state`'s run belongs to: its stored context's, or one derived from its id.
pub fn trace_id(state: &AgentState) -> TraceId {
    trace_id_of(&state.run_id, state.trace.as_ref())
}

/// The trace of `run`, whose state stores `stored`.
pub fn trace_id_of(run: &RunId, stored: Option<&TraceContext>) -> TraceId {
    match stored {
        Some(context) => context.trace_id,
        None => TraceId(derive(&[b"trace", run.as_str().as_bytes()])),
    }
}

/// The `traceparent` that names the span of `run` (whose state stores `stored`): what a
/// request made on the run's behalf outside any call (a webhook delivery) carries.
pub fn run_traceparent(run: &RunId, stored: Option<&TraceContext>) -> String {
    traceparent(trace_id_of(run, stored), run_span_id(run))
}

/// The id of the run's own span (`invoke_agent`), the parent of each of its steps.
pub fn run_span_id(run: &RunId) -> SpanId {
    SpanId(derive(&[b"run", run.as_str().as_bytes()]))
}

/// The id of the span of the call in `slot` of step `step_index`: known before the call
/// runs, so that a child run started by it is created under it.
pub fn call_span_id(run: &RunId, step_index: u64, slot: u32) -> SpanId {
    SpanId(derive(&[
        b"call",
        run.as_str().as_bytes(),
        &step_index.to_be_bytes(),
        &slot.to_be_bytes(),
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SessionId;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn state(run: &str) -> AgentState {
        AgentState::new(
            SessionId::from_suffix("s").unwrap(),
            RunId::from_suffix(run).unwrap(),
            Default::default(),
            0,
        )
    }

    #[test]
    fn a_valid_traceparent_names_its_trace_and_parent() {
        let context = TraceContext::from_traceparent(VALID).unwrap();
        assert_eq!(
            context.trace_id.to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(context.parent_span_id.to_string(), "00f067aa0ba902b7");
        assert_eq!(traceparent(context.trace_id, context.parent_span_id), VALID);
    }

    #[test]
    fn a_later_version_may_carry_more_fields() {
        let header = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-ever";
        assert!(TraceContext::from_traceparent(header).is_some());
    }

    #[test]
    fn an_invalid_traceparent_is_ignored() {
        for header in [
            "",
            "00",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
        ] {
            assert_eq!(TraceContext::from_traceparent(header), None, "{header:?}");
        }
    }

    #[test]
    fn ids_are_derived_the_same_way_everywhere_and_differ_between_runs_steps_and_slots() {
        let (a, b) = (state("a"), state("b"));
        assert_eq!(trace_id(&a), trace_id(&state("a")));
        assert_ne!(trace_id(&a), trace_id(&b));
        assert_eq!(run_span_id(&a.run_id), run_span_id(&state("a").run_id));
        assert_ne!(run_span_id(&a.run_id), run_span_id(&b.run_id));
        let calls = [
            call_span_id(&a.run_id, 1, 0),
            call_span_id(&a.run_id, 1, 1),
            call_span_id(&a.run_id, 2, 0),
            call_span_id(&b.run_id, 1, 0),
        ];
        for (i, x) in calls.iter().enumerate() {
            for y in &calls[i + 1..] {
                assert_ne!(x, y);
            }
        }
    }

    #[test]
    fn a_child_run_is_in_its_parents_trace_under_the_delegating_call() {
        let mut parent = state("p");
        parent.trace = TraceContext::from_traceparent(VALID);
        let child = TraceContext::of_child(&parent, 3, 1);
        assert_eq!(child.trace_id, parent.trace.unwrap().trace_id);
        assert_eq!(child.parent_span_id, call_span_id(&parent.run_id, 3, 1));
        let root = state("r");
        assert_eq!(
            TraceContext::of_child(&root, 1, 0).trace_id,
            trace_id(&root)
        );
    }

    #[test]
    fn a_stored_context_reads_back_as_it_was_written() {
        let context = TraceContext::from_traceparent(VALID).unwrap();
        let json = serde_json::to_string(&context).unwrap();
        assert_eq!(
            json,
            r#"{"trace_id":"4bf92f3577b34da6a3ce929d0e0e4736","parent_span_id":"00f067aa0ba902b7"}"#
        );
        assert_eq!(
            serde_json::from_str::<TraceContext>(&json).unwrap(),
            context
        );
        assert!(
            serde_json::from_str::<TraceContext>(
                r#"{"trace_id":"00","parent_span_id":"00f067aa0ba902b7"}"#
            )
            .is_err()
        );
    }
}
