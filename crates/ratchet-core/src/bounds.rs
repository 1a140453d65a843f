//! Bounds on what enters a model's prompt from outside the model: tool results, child runs'
//! answers and steering messages.
//!
//! Only the model's *view* is cut. The store keeps every result whole and the API returns it
//! whole; a cut result tells the model its original size, so it knows it saw a part. Nothing
//! here reads the store: the caller hands in the messages and the counts it found.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::delegation::DELEGATE_TOOL;
use crate::{Message, Role};

/// The default of `max_tool_result_bytes`: 64 KiB of one tool result, or of one child's answer.
pub const DEFAULT_MAX_TOOL_RESULT_BYTES: u64 = 65_536;

/// `text` as the model may see it: whole when it fits in `max_bytes`, otherwise its first
/// bytes (cut at a character boundary) followed by a marker that states the original size.
/// `whole_at` says where the whole value can be read.
pub fn cut_for_model(text: &str, max_bytes: u64, whole_at: &str) -> Option<String> {
    let limit = usize::try_from(max_bytes).unwrap_or(usize::MAX);
    if text.len() <= limit {
        return None;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Some(format!(
        "{}\n[truncated by ratchet: showing the first {end} of {} bytes; {whole_at}]",
        &text[..end],
        text.len()
    ))
}

/// What a model call sends of `context`: every call given a result (`answer_dangling_calls`),
/// then each result cut to its limit (`model_view`).
pub fn sent_to_model(context: Vec<Message>, max_bytes: u64) -> Vec<Message> {
    model_view(crate::message::answer_dangling_calls(context), max_bytes)
}

/// The messages as the model is sent them: each tool result cut to `max_bytes`, except a
/// `delegate` call's, whose children's answers are cut one by one (so each child of a call
/// keeps its place, however many there are).
pub fn model_view(messages: Vec<Message>, max_bytes: u64) -> Vec<Message> {
    let mut delegate_calls: Vec<String> = Vec::new();
    messages
        .into_iter()
        .map(|mut message| {
            match message.role {
                Role::Assistant => delegate_calls.extend(
                    (message.tool_calls.iter())
                        .filter(|call| call.name == DELEGATE_TOOL)
                        .map(|call| call.id.clone()),
                ),
                Role::Tool => {
                    let answers_delegate = (message.tool_call_id.as_ref())
                        .is_some_and(|id| delegate_calls.contains(id));
                    if let Some(cut) =
                        bound_tool_result(&message.content, answers_delegate, max_bytes)
                    {
                        message.content = cut;
                    }
                }
                Role::System | Role::User => {}
            }
            message
        })
        .collect()
}

fn bound_tool_result(content: &str, answers_delegate: bool, max_bytes: u64) -> Option<String> {
    if answers_delegate && let Ok(mut value) = serde_json::from_str::<Value>(content) {
        return bound_child_answers(&mut value, max_bytes).then(|| value.to_string());
    }
    cut_for_model(
        content,
        max_bytes,
        "the whole result is kept in the run's history",
    )
}

/// Cuts each `answer` of the `results` a join or a background report carries to `max_bytes`,
/// pointing at the child run that holds it whole. Returns whether anything was cut.
pub fn bound_child_answers(report: &mut Value, max_bytes: u64) -> bool {
    let Some(results) = report.get_mut("results").and_then(Value::as_array_mut) else {
        return false;
    };
    let mut cut_any = false;
    for result in results {
        let run = (result.get("run_id").and_then(Value::as_str))
            .unwrap_or("the child run")
            .to_owned();
        let Some(answer) = result.get_mut("answer") else {
            continue;
        };
        let whole_at =
            format!("the whole answer is the result of run {run} (agent_task get_result)");
        if let Some(cut) = answer
            .as_str()
            .and_then(|text| cut_for_model(text, max_bytes, &whole_at))
        {
            *answer = Value::String(cut);
            cut_any = true;
        }
    }
    cut_any
}

/// How much one lane of steering messages may hold, waiting for the run's next model call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneLimit {
    pub max_messages: u32,
    pub max_bytes: u64,
}

/// Steering queued for a session's active run, by lane: messages users send with
/// `multitask: "steer"`, and signals background runs send with `delivery: steer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SteerLimits {
    pub user: LaneLimit,
    pub agent: LaneLimit,
}

impl Default for SteerLimits {
    fn default() -> Self {
        SteerLimits {
            user: LaneLimit {
                max_messages: 32,
                max_bytes: 65_536,
            },
            agent: LaneLimit {
                max_messages: 8,
                max_bytes: 32_768,
            },
        }
    }
}

/// A steering lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SteerLane {
    User,
    Agent,
}

impl SteerLane {
    fn describe(self) -> &'static str {
        match self {
            SteerLane::User => "steering messages from users",
            SteerLane::Agent => "steered signals from background runs",
        }
    }
}

/// What a lane holds now, not yet taken into the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Queued {
    pub messages: u64,
    pub bytes: u64,
}

impl Queued {
    /// What a lane holds whose waiting messages are of `sizes` bytes.
    pub fn of_sizes(sizes: impl IntoIterator<Item = usize>) -> Queued {
        sizes
            .into_iter()
            .fold(Queued::default(), |queued, size| Queued {
                messages: queued.messages + 1,
                bytes: (queued.bytes).saturating_add(u64::try_from(size).unwrap_or(u64::MAX)),
            })
    }
}

/// Whether one more steering message of `bytes` fits in its lane; the refusal says which cap
/// it would pass.
pub fn admit_steer(
    lane: SteerLane,
    limits: &SteerLimits,
    queued: Queued,
    bytes: u64,
) -> Result<(), String> {
    let limit = match lane {
        SteerLane::User => limits.user,
        SteerLane::Agent => limits.agent,
    };
    let what = lane.describe();
    if queued.messages >= u64::from(limit.max_messages) {
        return Err(format!(
            "{} {what} already wait for the active run, the most it may hold; wait until its next model call takes them",
            queued.messages
        ));
    }
    if queued.bytes.saturating_add(bytes) > limit.max_bytes {
        return Err(format!(
            "{what} waiting for the active run would hold {} bytes, more than the {} allowed ({} already wait); send less, or wait until its next model call takes them",
            queued.bytes.saturating_add(bytes),
            limit.max_bytes,
            queued.bytes
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ToolCall, ToolOutcome};
    use serde_json::json;

    #[test]
    fn a_result_that_fits_is_left_whole_and_a_longer_one_is_cut_with_its_size() {
        assert_eq!(cut_for_model("short", 5, "x"), None);
        let cut = cut_for_model("abcdefghij", 4, "the whole result is elsewhere").unwrap();
        assert!(cut.starts_with("abcd\n"), "{cut}");
        assert!(cut.contains("first 4 of 10 bytes"), "{cut}");
        assert!(cut.contains("the whole result is elsewhere"), "{cut}");
    }

    #[test]
    fn a_cut_never_splits_a_character() {
        // "é" is two bytes and "🦀" four: a limit inside either backs off to its start.
        let text = "aé🦀z";
        for limit in 0..text.len() as u64 {
            let cut = cut_for_model(text, limit, "x").unwrap();
            let kept = cut.split('\n').next().unwrap();
            assert!(text.starts_with(kept), "{kept:?} at {limit}");
            assert!(kept.len() as u64 <= limit);
        }
        assert!(cut_for_model(text, 4, "x").unwrap().starts_with("aé\n"));
    }

    fn call(id: &str, name: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: json!({}),
        }
    }

    #[test]
    fn the_model_sees_tool_results_cut_and_each_childs_answer_cut_on_its_own() {
        let big = "x".repeat(100);
        let join = json!({"results": [
            {"agent": "a", "run_id": "run_1", "status": "completed", "answer": big},
            {"agent": "b", "run_id": "run_2", "status": "completed", "answer": "ok"},
        ]})
        .to_string();
        let history = vec![
            Message::user("go"),
            Message::assistant("", vec![call("t", "add"), call("d", DELEGATE_TOOL)]),
            Message::tool_result("t", &ToolOutcome::ok(big.clone())),
            Message::tool_result("d", &ToolOutcome::ok(join)),
            Message::assistant(big.clone(), Vec::new()),
        ];
        let view = model_view(history.clone(), 10);
        assert_eq!(view[0], history[0]);
        assert!(
            view[2].content.starts_with(
                "xxxxxxxxxx\n[truncated by ratchet: showing the first 10 of 100 bytes"
            )
        );
        let children: Value = serde_json::from_str(&view[3].content).unwrap();
        let answer = children["results"][0]["answer"].as_str().unwrap();
        assert!(answer.contains("first 10 of 100 bytes"), "{answer}");
        assert!(answer.contains("run run_1"), "{answer}");
        assert_eq!(
            children["results"][1]["answer"], "ok",
            "the second child keeps its place"
        );
        assert_eq!(view[4], history[4], "the model's own words are not cut");
        assert_eq!(model_view(history.clone(), 1_000), history);
    }

    #[test]
    fn each_lane_refuses_past_its_count_or_its_bytes_and_says_which() {
        let limits = SteerLimits::default();
        let user = |messages, bytes, more| {
            admit_steer(SteerLane::User, &limits, Queued { messages, bytes }, more)
        };
        assert_eq!(user(31, 0, 10), Ok(()));
        assert!(
            user(32, 0, 1)
                .unwrap_err()
                .contains("32 steering messages from users")
        );
        assert_eq!(user(0, 65_000, 536), Ok(()));
        let error = user(1, 65_000, 537).unwrap_err();
        assert!(
            error.contains("65537 bytes, more than the 65536"),
            "{error}"
        );
        let agent = admit_steer(
            SteerLane::Agent,
            &limits,
            Queued {
                messages: 8,
                bytes: 0,
            },
            1,
        );
        assert!(agent.unwrap_err().contains("8 steered signals"));
        let agent = admit_steer(
            SteerLane::Agent,
            &limits,
            Queued {
                messages: 0,
                bytes: 32_000,
            },
            769,
        );
        assert!(agent.unwrap_err().contains("more than the 32768"));
    }
}
