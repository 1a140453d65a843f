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
    /// This long after sending the run's message, the client sends another
    /// (`interrupting().user_message()`) with `multitask: "interrupt"`: it cancels whatever
    /// run of the session is active then — this one, or a continuation turn telling the
    /// user of background work.
    pub interrupt_after_ms: Option<u64>,
    /// The plans of the helper runs its background delegations start.
    pub children: Vec<Plan>,
}

/// The catalog agent that delegates in the background, and the agent it delegates to.
pub const DISPATCHER: &str = "dispatcher";
pub const HELPER: &str = "helper";

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
    /// The built-in `wait`: the run parks on a durable timer, holding no worker, and any
    /// process wakes it when `ms` have passed.
    Wait { ms: u64 },
    /// A background delegation of `tasks` helper runs, reported one by one (`each`) or
    /// together: the run goes on at once, and the reports reach the session later, in
    /// continuation turns.
    Background { tasks: usize, each: bool },
}

/// The chaos MCP server's name in the fleet's configuration, and its tools' full names.
pub const MCP_SERVER: &str = "chaos";
pub const HANG_TOOL: &str = "chaos.hang";
pub const DROP_TOOL: &str = "chaos.drop";
pub const FLAKY_TOOL: &str = "chaos.flaky";
/// Tools whose calls must never run twice: a human answers for them when their outcome is
/// unknown.
pub const NEVER_TOOLS: [&str; 3] = ["append_line", HANG_TOOL, DROP_TOOL];

/// The tag of the runs the chaos schedule fires.
pub const SCHEDULED: &str = "sched";

/// The path a plan's appends write to; gated ones need approval (see `Fleet`'s config).
pub const LOG_DIR: &str = "log";
pub const GATED_DIR: &str = "approve";

impl Plan {
    /// A run of a session of the default agent: every kind of call but delegations.
    pub fn random(tag: String, rng: &mut fastrand::Rng) -> Plan {
        let rounds = (0..rng.usize(0..=3))
            .map(|_| {
                (0..rng.usize(1..=4))
                    .map(|_| match rng.u8(0..25) {
                        0..=5 => add(rng),
                        24 => Call::Wait {
                            ms: rng.u64(200..2500),
                        },
                        6..=11 => sleep(rng, 250),
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
            cancel_after_ms: (rng.u8(0..10) == 0).then(|| rng.u64(0..1500)),
            ..Plan::of(tag, rounds, rng.u64(0..12))
        }
    }

    /// A run of a dispatcher's session: safe calls, appends (gated or not) and background
    /// delegations, whose helpers' plans it holds; some are interrupted by the next message.
    pub fn dispatching(tag: String, rng: &mut fastrand::Rng) -> Plan {
        let mut children = Vec::new();
        let rounds = (0..rng.usize(1..=3))
            .map(|round| {
                (0..rng.usize(1..=3))
                    .map(|index| match rng.u8(0..10) {
                        0..=1 => add(rng),
                        2..=3 => sleep(rng, 250),
                        4 => Call::Append,
                        5 => Call::GatedAppend,
                        _ => {
                            let tasks = rng.usize(1..=3);
                            children.extend((0..tasks).map(|task| {
                                Plan::helping(child_tag(&tag, round, index, task), rng)
                            }));
                            Call::Background {
                                tasks,
                                each: rng.bool(),
                            }
                        }
                    })
                    .collect()
            })
            .collect();
        Plan {
            cancel_after_ms: (rng.u8(0..12) == 0).then(|| rng.u64(0..1500)),
            interrupt_after_ms: (rng.u8(0..3) == 0).then(|| rng.u64(0..3000)),
            children,
            ..Plan::of(tag, rounds, rng.u64(0..12))
        }
    }

    /// A helper's run: safe calls only (a child is offered no others), slow enough that
    /// its report often lands while its parent's session is busy.
    fn helping(tag: String, rng: &mut fastrand::Rng) -> Plan {
        let rounds = (0..rng.usize(1..=2))
            .map(|_| {
                (0..rng.usize(1..=2))
                    .map(|_| match rng.bool() {
                        true => add(rng),
                        false => sleep(rng, 1200),
                    })
                    .collect()
            })
            .collect();
        Plan::of(tag, rounds, rng.u64(0..8))
    }

    /// The run of the message that interrupts this plan's (`interrupt_after_ms`).
    pub fn interrupting(&self) -> Plan {
        Plan::of(
            format!("{}i", self.tag),
            vec![vec![Call::Add { a: 1, b: 1 }]],
            self.chunk_delay_ms,
        )
    }

    /// A continuation turn telling of the inbox events `events` (its tag, from
    /// `continuation_tag`): a short sleep, then an answer that names each report.
    pub fn continuation(tag: &str) -> Option<Plan> {
        let events = told(tag)?;
        let ms = events.iter().map(|e| e.unsigned_abs()).sum::<u64>() * 37 % 400;
        Some(Plan::of(tag.to_owned(), vec![vec![Call::Sleep { ms }]], 3))
    }

    /// The run a schedule fires every slot: one safe call, then the answer. Its runs share
    /// this plan (and its tag), each in a session of its own.
    pub fn scheduled() -> Plan {
        Plan::of(
            SCHEDULED.to_owned(),
            vec![vec![Call::Add { a: 2, b: 3 }]],
            2,
        )
    }

    /// A plan of these rounds that nobody cancels or interrupts and that delegates nothing.
    fn of(tag: String, rounds: Vec<Vec<Call>>, chunk_delay_ms: u64) -> Plan {
        Plan {
            tag,
            rounds,
            chunk_delay_ms,
            cancel_after_ms: None,
            interrupt_after_ms: None,
            children: Vec::new(),
        }
    }

    /// This plan and every plan below it.
    pub fn with_descendants(&self) -> Vec<&Plan> {
        let mut plans = vec![self];
        plans.extend(self.children.iter().flat_map(Plan::with_descendants));
        plans
    }

    pub fn user_message(&self) -> String {
        format!("chaos {}", self.tag)
    }

    /// A continuation names the reports it tells (`TOLD` and their inbox ids): the checks
    /// count how often each reached the user.
    pub fn final_answer(&self) -> String {
        match told(&self.tag) {
            Some(events) => {
                let ids: Vec<String> = events.iter().map(ToString::to_string).collect();
                format!("{TOLD}{}.", ids.join(", "))
            }
            None => format!(
                "Plan {} is done after {} rounds.",
                self.tag,
                self.rounds.len()
            ),
        }
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
            Call::Wait { ms } => ("wait", json!({"ms": ms})),
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
            Call::Background { tasks, each } => {
                let tasks: Vec<Value> = (0..tasks)
                    .map(|task| {
                        let child = child_tag(&self.tag, round, index, task);
                        json!({"agent": HELPER, "task": format!("chaos {child}")})
                    })
                    .collect();
                let policy = if each { "each" } else { "all" };
                (
                    "delegate",
                    json!({"mode": "background", "completion_policy": policy, "tasks": tasks}),
                )
            }
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

fn sleep(rng: &mut fastrand::Rng, most_ms: u64) -> Call {
    Call::Sleep {
        ms: rng.u64(0..most_ms),
    }
}

fn add(rng: &mut fastrand::Rng) -> Call {
    Call::Add {
        a: rng.i64(-1000..1000),
        b: rng.i64(-1000..1000),
    }
}

/// The tag of the helper run started by task `task` of the call at `round`, `index`.
fn child_tag(tag: &str, round: usize, index: usize, task: usize) -> String {
    format!("{tag}k{round}x{index}x{task}")
}

/// A continuation's answer starts with this, then names the inbox events it told.
pub const TOLD: &str = "Told reports ";

/// The tag a continuation turn telling of `events` (inbox ids) is answered under.
pub fn continuation_tag(events: &[i64]) -> String {
    let ids: Vec<String> = events.iter().map(ToString::to_string).collect();
    format!("inbox{}", ids.join("x"))
}

/// The inbox events a continuation tag tells of.
pub fn told(tag: &str) -> Option<Vec<i64>> {
    let ids = tag.strip_prefix("inbox")?;
    ids.split('x').map(|id| id.parse().ok()).collect()
}

/// A continuation telling of any of these events fails at its second model call, every time:
/// its reports go to the dead letter once their attempts are spent.
pub fn poisoned(events: &[i64]) -> bool {
    events.iter().any(|event| event % 7 == 0)
}

/// The inbox events a continuation's answer names.
pub fn told_in(answer: &str) -> Vec<i64> {
    let Some(at) = answer.find(TOLD) else {
        return Vec::new();
    };
    answer[at + TOLD.len()..]
        .trim_end_matches('.')
        .split(", ")
        .filter_map(|id| id.trim().parse().ok())
        .collect()
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
        let plan = Plan::of(
            "t".into(),
            vec![vec![Call::Add { a: 1, b: 2 }, Call::Append]],
            0,
        );
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

    /// A background call hands each helper its own plan's tag, and every helper plan the
    /// calls name is among the plan's children.
    #[test]
    fn a_dispatching_plans_background_calls_name_its_childrens_plans() {
        let mut rng = fastrand::Rng::with_seed(3);
        let plans: Vec<Plan> = (0..40)
            .map(|i| Plan::dispatching(format!("d{i}"), &mut rng))
            .collect();
        let mut delegations = 0;
        for plan in &plans {
            let mut named = Vec::new();
            for round in 0..plan.rounds.len() {
                for call in plan.reply(round, true).tool_calls {
                    if call.name == "delegate" {
                        delegations += 1;
                        assert_eq!(call.arguments["mode"], "background");
                        for task in call.arguments["tasks"].as_array().unwrap() {
                            assert_eq!(task["agent"], HELPER);
                            let message = task["task"].as_str().unwrap();
                            named.push(message.strip_prefix("chaos ").unwrap().to_owned());
                        }
                    }
                }
            }
            let children: Vec<String> = plan.children.iter().map(|c| c.tag.clone()).collect();
            assert_eq!(named, children, "plan {}", plan.tag);
            assert!(!plan.tag.contains('-') && children.iter().all(|c| !c.contains('-')));
        }
        assert!(delegations > 10, "the workload delegates: {delegations}");
    }

    #[test]
    fn a_continuation_answers_with_the_reports_it_was_told_of() {
        let tag = continuation_tag(&[12, 40]);
        assert_eq!(told(&tag), Some(vec![12, 40]));
        let plan = Plan::continuation(&tag).unwrap();
        assert_eq!(plan.reply(0, true).tool_calls[0].name, "sleep_ms");
        let answer = plan.reply(1, true).text;
        assert_eq!(told_in(&answer), [12, 40]);
        assert_eq!(told("s1r0"), None);
        assert!(told_in("Plan s1r0 is done after 2 rounds.").is_empty());
    }
}
