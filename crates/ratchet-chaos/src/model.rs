//! The chaos model: an OpenAI-compatible chat-completions server (streamed) that answers each
//! run from its plan. It lives in the chaos process, so it outlives every kill of the
//! runtime, and it checks what only a model sees: that tool results come back in the order
//! of their calls (invariant 6).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::plan::{Plan, Reply, continuation_tag, parse_call_id, poisoned, told};

/// The text of a compaction summary starts with this, so checks can look for it where it
/// must never appear.
pub const SUMMARY_MARK: &str = "HIDDEN-SUMMARY";

#[derive(Clone, Default)]
pub struct ModelState {
    inner: Arc<Mutex<Inner>>,
}

/// A request for one round of a plan, when the model received it.
#[derive(Debug, Clone)]
pub struct RoundAsked {
    pub tag: String,
    pub round: usize,
    pub at: Instant,
}

#[derive(Default)]
struct Inner {
    plans: HashMap<String, Plan>,
    rounds_asked: Vec<RoundAsked>,
    violations: Vec<String>,
    calls: u64,
    summaries: u64,
    /// The calls the model was told were not run, by id.
    told_not_run: Vec<String>,
}

impl ModelState {
    /// Registers a plan and the plans of the helpers it delegates to.
    pub fn add_plan(&self, plan: &Plan) {
        let mut inner = self.inner.lock().unwrap();
        for plan in plan.with_descendants() {
            inner.plans.insert(plan.tag.clone(), plan.clone());
        }
    }

    pub fn violations(&self) -> Vec<String> {
        self.inner.lock().unwrap().violations.clone()
    }

    pub fn calls(&self) -> u64 {
        self.inner.lock().unwrap().calls
    }

    /// Every request for a round of a plan, in the order received.
    pub fn rounds_asked(&self) -> Vec<RoundAsked> {
        self.inner.lock().unwrap().rounds_asked.clone()
    }

    pub fn summaries(&self) -> u64 {
        self.inner.lock().unwrap().summaries
    }

    /// Every call a request's tool result said was not run, by id.
    pub fn told_not_run(&self) -> Vec<String> {
        self.inner.lock().unwrap().told_not_run.clone()
    }

    fn violation(&self, text: String) {
        self.inner.lock().unwrap().violations.push(text);
    }
}

/// Serves the model on a loopback port until `stop`; returns the base url (`…/v1`).
pub async fn serve(state: ModelState, stop: CancellationToken) -> anyhow::Result<String> {
    let app = Router::new()
        .route("/v1/chat/completions", post(complete))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
    let address = listener.local_addr()?;
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
    });
    Ok(format!("http://{address}/v1"))
}

/// How the runtime presents a summary in later contexts (`Message::summary`).
const SUMMARY_PREFIX: &str = "Summary of the earlier conversation:\n";

/// Where the request stands in a run, read from its last messages.
#[derive(Debug)]
enum Turn {
    Round {
        tag: String,
        round: usize,
    },
    /// A summary of the messages before the last one, which asks for it; `at` is where the
    /// run stands at the end of those messages, when it can be read from them.
    Summary {
        at: Option<(String, usize)>,
    },
}

async fn complete(State(state): State<ModelState>, Json(body): Json<Value>) -> Response {
    let received = Instant::now();
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    // About four bytes a token, as providers count: long sessions grow past the prompt
    // budget and are compacted.
    let prompt_tokens = body["messages"].to_string().len() / 4;
    let tools_offered = body["tools"].as_array().is_some_and(|t| !t.is_empty());
    let turn = match read_turn(&messages) {
        Ok(turn) => turn,
        Err(problem) => {
            state.violation(format!("model request: {problem}"));
            return (StatusCode::BAD_REQUEST, problem).into_response();
        }
    };
    let not_run = (messages.iter())
        .filter(|m| {
            m["role"] == "tool"
                && m["content"]
                    .as_str()
                    .is_some_and(|c| c.starts_with("not run"))
        })
        .filter_map(|m| m["tool_call_id"].as_str().map(str::to_owned));
    let (reply, delay) = {
        let mut inner = state.inner.lock().unwrap();
        inner.calls += 1;
        inner.told_not_run.extend(not_run);
        match turn {
            Turn::Summary { at } => {
                inner.summaries += 1;
                // The summary says where the run stands: a compaction may leave it as the
                // whole context, and the next request must still find its plan and round.
                let text = match at {
                    Some((tag, round)) => format!(
                        "{SUMMARY_MARK} {}: plan {tag} round {round}",
                        inner.summaries
                    ),
                    None => format!("{SUMMARY_MARK} {}: earlier chaos turns.", inner.summaries),
                };
                let reply = Reply {
                    text,
                    tool_calls: Vec::new(),
                };
                (reply, 0)
            }
            Turn::Round { tag, round } if round > 0 && told(&tag).is_some_and(|e| poisoned(&e)) => {
                drop(inner);
                // Fatal for the runtime (a 400 is not retried): the continuation fails after
                // its first step, and every attempt of it will.
                let problem = format!("chaos: the continuation {tag} fails");
                return (StatusCode::BAD_REQUEST, problem).into_response();
            }
            Turn::Round { tag, round } => {
                match (inner.plans.get(&tag).cloned()).or_else(|| Plan::continuation(&tag)) {
                    Some(plan) => {
                        let answer = (plan.reply(round, tools_offered), plan.chunk_delay_ms);
                        inner.rounds_asked.push(RoundAsked {
                            tag,
                            round,
                            at: received,
                        });
                        answer
                    }
                    None => {
                        drop(inner);
                        let problem = format!("no plan with tag {tag:?}");
                        state.violation(format!("model request: {problem}"));
                        return (StatusCode::BAD_REQUEST, problem).into_response();
                    }
                }
            }
        }
    };
    stream(reply, prompt_tokens, Duration::from_millis(delay))
}

/// Finds the run's plan and round; checks that trailing tool results answer the calls of the
/// assistant message before them, in their order.
fn read_turn(messages: &[Value]) -> Result<Turn, String> {
    let Some(last) = messages.last() else {
        return Err("no messages".into());
    };
    match last["role"].as_str() {
        Some("user") => {
            let content = last["content"].as_str().unwrap_or_default();
            if let Some(tag) = content.strip_prefix("chaos ") {
                return Ok(Turn::Round {
                    tag: tag.to_owned(),
                    round: 0,
                });
            }
            if content.starts_with(TRIGGER_PREFIX) {
                return Ok(Turn::Round {
                    tag: continuation_tag(&trigger_events(content)),
                    round: 0,
                });
            }
            if let Some(summary) = content.strip_prefix(SUMMARY_PREFIX) {
                return read_summary(summary).ok_or_else(|| {
                    format!("the context ends with a summary the model did not write: {summary:?}")
                });
            }
            let at = match read_turn(&messages[..messages.len() - 1]) {
                Ok(Turn::Round { tag, round }) => Some((tag, round)),
                _ => None,
            };
            Ok(Turn::Summary { at })
        }
        Some("tool") => {
            let results_start = messages
                .iter()
                .rposition(|m| m["role"] != "tool")
                .map_or(0, |i| i + 1);
            let result_ids: Vec<&str> = messages[results_start..]
                .iter()
                .map(|m| m["tool_call_id"].as_str().unwrap_or_default())
                .collect();
            let call_ids: Vec<&str> = results_start
                .checked_sub(1)
                .and_then(|i| messages[i]["tool_calls"].as_array())
                .map(|calls| {
                    calls
                        .iter()
                        .map(|c| c["id"].as_str().unwrap_or_default())
                        .collect()
                })
                .unwrap_or_default();
            if result_ids != call_ids {
                return Err(format!(
                    "invariant 6: tool results {result_ids:?} do not answer the calls {call_ids:?} in order"
                ));
            }
            let last_id = result_ids.last().copied().unwrap_or_default();
            let (tag, round, _) = parse_call_id(last_id)
                .ok_or_else(|| format!("a tool result for a call id not made here: {last_id:?}"))?;
            Ok(Turn::Round {
                tag: tag.to_owned(),
                round: round + 1,
            })
        }
        other => Err(format!(
            "expected the last message to be a user message or a tool result, found role {other:?}"
        )),
    }
}

/// How a continuation turn's hidden trigger starts (`ratchet_core::inbox::continuation_trigger`).
pub const TRIGGER_PREFIX: &str = "[runtime] Background work you started has reported back";

/// The inbox events a trigger carries: after its first line, a JSON array of
/// `{"event": ID, "kind", "report"}`.
pub fn trigger_events(trigger: &str) -> Vec<i64> {
    let reports: Value = (trigger.split_once('\n'))
        .and_then(|(_, reports)| serde_json::from_str(reports).ok())
        .unwrap_or_default();
    (reports.as_array().into_iter().flatten())
        .filter_map(|report| report["event"].as_i64())
        .collect()
}

/// Where a run stands, from a summary the model wrote (`… plan TAG round N`).
fn read_summary(summary: &str) -> Option<Turn> {
    let (_, place) = summary.rsplit_once(": plan ")?;
    let (tag, round) = place.split_once(" round ")?;
    Some(Turn::Round {
        tag: tag.to_owned(),
        round: round.parse().ok()?,
    })
}

/// The reply as OpenAI streams it: a role chunk, one chunk per word, the tool calls (each
/// with its arguments in two pieces), the finish reason, the usage, `[DONE]`.
fn stream(reply: Reply, prompt_tokens: usize, delay: Duration) -> Response {
    let chunk = |delta: Value, finish: Option<&str>| {
        json!({"id": "chatcmpl-chaos", "object": "chat.completion.chunk", "model": "chaos",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut chunks = vec![(
        chunk(json!({"role": "assistant", "content": ""}), None),
        false,
    )];
    for word in reply.text.split_inclusive(' ') {
        chunks.push((chunk(json!({"content": word}), None), true));
    }
    for (index, call) in reply.tool_calls.iter().enumerate() {
        let arguments = call.arguments.to_string();
        let (head, tail) = arguments.split_at(arguments.len() / 2);
        chunks.push((
            chunk(
                json!({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": head}}]}),
                None,
            ),
            false,
        ));
        chunks.push((
            chunk(
                json!({"tool_calls": [{"index": index, "function": {"arguments": tail}}]}),
                None,
            ),
            false,
        ));
    }
    let finish = if reply.tool_calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    chunks.push((chunk(json!({}), Some(finish)), false));
    let words = reply.text.split_whitespace().count();
    chunks.push((
        json!({"id": "chatcmpl-chaos", "object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": words,
                         "total_tokens": prompt_tokens + words}}),
        false,
    ));
    let lines = chunks
        .into_iter()
        .map(|(value, slow)| (format!("data: {value}\n\n"), slow))
        .chain([("data: [DONE]\n\n".to_owned(), false)]);
    let body = futures::stream::iter(lines).then(move |(line, slow)| async move {
        if slow && !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        Ok::<_, std::convert::Infallible>(line)
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(body))
        .unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool_turn(calls: &[&str], results: &[&str]) -> Vec<Value> {
        let mut messages = vec![
            json!({"role": "user", "content": "chaos t1"}),
            json!({"role": "assistant", "content": "x",
                   "tool_calls": calls.iter().map(|id| json!({"id": id})).collect::<Vec<_>>()}),
        ];
        messages.extend(
            results
                .iter()
                .map(|id| json!({"role": "tool", "tool_call_id": id, "content": "ok"})),
        );
        messages
    }

    #[test]
    fn results_in_call_order_lead_to_the_next_round() {
        let messages = tool_turn(&["c-t1-0-0", "c-t1-0-1"], &["c-t1-0-0", "c-t1-0-1"]);
        assert!(matches!(
            read_turn(&messages),
            Ok(Turn::Round { tag, round: 1 }) if tag == "t1"
        ));
    }

    #[test]
    fn results_out_of_order_or_missing_are_violations() {
        let swapped = tool_turn(&["c-t1-0-0", "c-t1-0-1"], &["c-t1-0-1", "c-t1-0-0"]);
        assert!(read_turn(&swapped).unwrap_err().contains("invariant 6"));
        let missing = tool_turn(&["c-t1-0-0", "c-t1-0-1"], &["c-t1-0-0"]);
        assert!(read_turn(&missing).unwrap_err().contains("invariant 6"));
    }

    #[test]
    fn a_user_message_starts_a_plan_and_anything_else_asks_for_a_summary() {
        let start = [json!({"role": "user", "content": "chaos t9"})];
        assert!(matches!(read_turn(&start), Ok(Turn::Round { tag, round: 0 }) if tag == "t9"));
        let summary = [json!({"role": "user", "content": "Summarize the conversation above"})];
        assert!(matches!(
            read_turn(&summary),
            Ok(Turn::Summary { at: None })
        ));
    }

    #[test]
    fn a_continuation_trigger_leads_to_the_turn_of_the_reports_it_carries() {
        let reports = vec![
            ratchet_core::inbox::DueEvent {
                id: 12,
                kind: ratchet_core::inbox::InboxKind::Completion,
                payload: json!({"answer": "x", "event": 99}),
            },
            ratchet_core::inbox::DueEvent {
                id: 40,
                kind: ratchet_core::inbox::InboxKind::GroupCompletion,
                payload: json!({"runs": []}),
            },
        ];
        let (trigger, _) = ratchet_core::inbox::continuation_trigger(&reports, 1000);
        assert_eq!(trigger_events(&trigger), [12, 40], "{trigger}");
        let messages = [
            json!({"role": "user", "content": "chaos d1r0"}),
            json!({"role": "assistant", "content": "Plan d1r0 is done after 1 rounds."}),
            json!({"role": "user", "content": trigger}),
        ];
        assert!(matches!(
            read_turn(&messages),
            Ok(Turn::Round { tag, round: 0 }) if tag == "inbox12x40"
        ));
    }

    /// A compaction may summarise the whole context: the next request then ends with the
    /// summary, which must lead back to the plan's round.
    #[test]
    fn a_context_that_is_only_a_summary_leads_to_the_round_it_summarised() {
        let mut asking = tool_turn(&["c-t1-0-0"], &["c-t1-0-0"]);
        asking.push(json!({"role": "user", "content": "Summarize the conversation above"}));
        let Ok(Turn::Summary {
            at: Some((tag, round)),
        }) = read_turn(&asking)
        else {
            panic!("expected a summary of plan t1");
        };
        assert_eq!((tag.as_str(), round), ("t1", 1));
        let summary = format!("{SUMMARY_PREFIX}{SUMMARY_MARK} 4: plan t1 round 1");
        let next = [json!({"role": "user", "content": summary})];
        assert!(matches!(read_turn(&next), Ok(Turn::Round { tag, round: 1 }) if tag == "t1"));
    }
}
