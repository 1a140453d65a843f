//! Random run plans and the replies the chaos model gives from them. A plan is drawn from a
//! seeded generator, so a failing chaos run can be replayed with the same `--seed`.
//!
//! Every identifier the model hands out encodes where it comes from (`c-{tag}-{round}-{i}`):
//! the model finds its place in a run from the request alone, whatever the runtime did in
//! between (a crash, a compaction of the context, a denied approval).

use serde_json::{Value, json};

/// What one run of the chaos workload asks the model to do.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Unique per run; the run's user message is `chaos {tag}`.
    pub tag: String,
    /// Tool batches, one per model call; the call after the last one answers.
    pub rounds: Vec<Vec<Call>>,
    /// Words of each reply's text, streamed one by one with this delay between them.
    pub chunk_delay_ms: u64,
    /// The client cancels the run this long after sending its message.
    pub cancel_after_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// Safe to replay.
    Add { a: i64, b: i64 },
    /// Safe to replay; slow, so that kills land inside tool batches.
    Sleep { ms: u64 },
    /// `never` replay: its effect, a line in the workspace, must never happen twice.
    Append,
    /// As `Append`, under the approval-gated directory: a human decides first.
    GatedAppend,
    /// `never` replay, on the chaos MCP server: never answers, so its outcome is unknown.
    Hang,
    /// `never` replay, on the chaos MCP server: the server exits mid-call.
    Drop,
    /// `keyed` replay, on the chaos MCP server: its first `stalls` attempts never answer.
    Flaky { stalls: u64 },
}

/// The chaos MCP server's name in the fleet's configuration, and its tools' full names.
pub const MCP_SERVER: &str = "chaos";
pub const HANG_TOOL: &str = "chaos.hang";
pub const DROP_TOOL: &str = "chaos.drop";
pub const FLAKY_TOOL: &str = "chaos.flaky";
/// Tools whose calls must never run twice: a human answers for them when their outcome is
/// unknown.
pub const NEVER_TOOLS: [&str; 3] = ["append_line", HANG_TOOL, DROP_TOOL];

/// The path a plan's appends write to; gated ones need approval (see `Fleet`'s config).
pub const LOG_DIR: &str = "log";
pub const GATED_DIR: &str = "approve";

impl Plan {
    pub fn random(tag: String, rng: &mut fastrand::Rng) -> Plan {
        let rounds = (0..rng.usize(0..=3))
            .map(|_| {
                (0..rng.usize(1..=4))
                    .map(|_| match rng.u8(0..24) {
                        0..=5 => Call::Add {
                            a: rng.i64(-1000..1000),
                            b: rng.i64(-1000..1000),
                        },
                        6..=11 => Call::Sleep {
                            ms: rng.u64(0..250),
                        },
                        12..=17 => Call::Append,
                        18..=19 => Call::GatedAppend,
                        20 => Call::Hang,
                        21 => Call::Drop,
                        _ => Call::Flaky {
                            stalls: rng.u64(0..=3),
                        },
                    })
                    .collect()
            })
            .collect();
        Plan {
            tag,
            rounds,
            chunk_delay_ms: rng.u64(0..12),
            cancel_after_ms: (rng.u8(0..10) == 0).then(|| rng.u64(0..1500)),
        }
    }

    pub fn user_message(&self) -> String {
        format!("chaos {}", self.tag)
    }

    pub fn final_answer(&self) -> String {
        format!(
            "Plan {} is done after {} rounds.",
            self.tag,
            self.rounds.len()
        )
    }

    /// The model's reply at `round`: a tool batch, or the final answer past the last batch
    /// (or when the runtime offers no tools, as on a run's last allowed call).
    pub fn reply(&self, round: usize, tools_offered: bool) -> Reply {
        match self.rounds.get(round) {
            Some(calls) if tools_offered => Reply {
                text: format!("Round {round} of plan {}: calling tools.", self.tag),
                tool_calls: calls
                    .iter()
                    .enumerate()
                    .map(|(i, call)| self.tool_call(round, i, *call))
                    .collect(),
            },
            _ => Reply {
                text: self.final_answer(),
                tool_calls: Vec::new(),
            },
        }
    }

    fn tool_call(&self, round: usize, index: usize, call: Call) -> ToolCallReply {
        let id = call_id(&self.tag, round, index);
        let (name, arguments) = match call {
            Call::Add { a, b } => ("add", json!({"a": a, "b": b})),
            Call::Sleep { ms } => ("sleep_ms", json!({"ms": ms})),
            Call::Append => (
                "append_line",
                json!({"path": format!("{LOG_DIR}/{}.log", self.tag), "line": id}),
            ),
            Call::GatedAppend => (
                "append_line",
                json!({"path": format!("{GATED_DIR}/{}.log", self.tag), "line": id}),
            ),
            Call::Hang => (HANG_TOOL, json!({"line": id})),
            Call::Drop => (DROP_TOOL, json!({"line": id})),
            Call::Flaky { stalls } => (FLAKY_TOOL, json!({"line": id, "stalls": stalls})),
        };
        ToolCallReply {
            id,
            // The wire protocol refuses `.` in a function name: the runtime offers an MCP
            // tool `server.tool` as `server_tool`, and maps the call back.
            name: name.replace('.', "_"),
            arguments,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub text: String,
    pub tool_calls: Vec<ToolCallReply>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallReply {
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

pub fn call_id(tag: &str, round: usize, index: usize) -> String {
    format!("c-{tag}-{round}-{index}")
}

/// The tag and round of a call id made by `call_id`; tags contain no `-`.
pub fn parse_call_id(id: &str) -> Option<(&str, usize, usize)> {
    let mut parts = id.strip_prefix("c-")?.split('-');
    let (tag, round, index) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    Some((tag, round.parse().ok()?, index.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_ids_round_trip() {
        let id = call_id("s3r1", 2, 7);
        assert_eq!(parse_call_id(&id), Some(("s3r1", 2, 7)));
        assert_eq!(parse_call_id("c-s3r1-2"), None);
        assert_eq!(parse_call_id("c-s3r1-2-7-1"), None);
        assert_eq!(parse_call_id("call_1_0"), None);
    }

    #[test]
    fn the_reply_past_the_last_round_or_without_tools_is_the_final_answer() {
        let plan = Plan {
            tag: "t".into(),
            rounds: vec![vec![Call::Add { a: 1, b: 2 }, Call::Append]],
            chunk_delay_ms: 0,
            cancel_after_ms: None,
        };
        let first = plan.reply(0, true);
        assert_eq!(first.tool_calls.len(), 2);
        assert_eq!(first.tool_calls[1].arguments["line"], "c-t-0-1");
        assert_eq!(plan.reply(1, true).text, plan.final_answer());
        assert!(plan.reply(0, false).tool_calls.is_empty());
    }

    #[test]
    fn the_same_seed_draws_the_same_plans() {
        let draw = |seed| {
            let mut rng = fastrand::Rng::with_seed(seed);
            (0..20)
                .map(|i| format!("{:?}", Plan::random(format!("t{i}"), &mut rng).rounds))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }
}
