//! Durable timers: the built-in `wait` tool. A batch's `wait` call does not hold a worker: the
//! step that ran the batch's other calls parks the run `waiting_timer`, with its due time
//! frozen in the state and its next job ready at that time, so any process wakes it then —
//! or sooner, when input for its session arrives. The job's step records the wait's result
//! (`{"woke": "timer" | "input", "waited_ms": …}`) and hands the batch to the model.
//!
//! Nothing here reads the clock: `now` is passed in, and a due time computed once is never
//! computed again, so a crash, a takeover or a replay cannot extend a wait.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::step::{after_tools, park_batch, status_event};
use crate::{
    AgentState, EventDraft, EventKind, Millis, Phase, RunStatus, StepJob, StepResult, ToolOutcome,
};

/// The name the runtime gives a meaning of its own: a call of it parks the run.
pub const WAIT_TOOL: &str = "wait";
/// How long one `wait` may park a run unless `[tools.wait] max_ms` says otherwise: seven days.
pub const DEFAULT_MAX_WAIT_MS: u64 = 7 * 24 * 60 * 60 * 1000;

/// A run parked on a `wait` call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timer {
    /// The `wait` call's position in its batch, and its id.
    pub slot: u32,
    pub call_id: String,
    /// When the run parked.
    pub since: Millis,
    /// When the wait ends unless input ends it sooner: frozen when the run parked.
    pub due_at: Millis,
    /// When input for the run's session ended the wait before its due time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub woken_by_input: Option<Millis>,
}

/// What ended a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Woke {
    /// Its due time came.
    Timer,
    /// Input for the session arrived first: a user message, a steer, a report or a signal
    /// of background work.
    Input,
}

impl Timer {
    pub fn woke(&self) -> Woke {
        if self.woken_by_input.is_some() {
            Woke::Input
        } else {
            Woke::Timer
        }
    }

    /// When the job that ends the wait may be claimed: the due time, or the moment input
    /// ended it sooner.
    pub fn ready_at(&self) -> Millis {
        self.woken_by_input
            .map_or(self.due_at, |at| at.min(self.due_at))
    }
}

/// When the job the store writes for `state`'s next step may be claimed: a run waiting on a
/// timer is woken by its timer (see `Timer::ready_at`); any other at once (`now`).
pub fn job_ready_at(state: &AgentState, now: Millis) -> Millis {
    match (&state.status, &state.timer) {
        (RunStatus::WaitingTimer, Some(timer)) => timer.ready_at(),
        _ => now,
    }
}

/// When the `wait` call with `arguments` would end, made by `state`'s run at `now`, or the
/// error the model is told: exactly one of `until` (an RFC 3339 time in the future) or `ms`
/// (at least 1), no longer than the run's `max_wait_ms`, and ending before the run's deadline
/// (a wait the deadline would cut off is refused rather than begun).
pub fn due_at(state: &AgentState, arguments: &Value, now: Millis) -> Result<Millis, String> {
    let max = state.limits().max_wait_ms;
    let (until, ms) = (arguments.get("until"), arguments.get("ms"));
    let due = match (until, ms) {
        (Some(Value::String(text)), None) => {
            let until = parse_rfc3339(text).ok_or_else(|| {
                format!(
                    "`until` must be an RFC 3339 date-time with an offset, such as \
                     2030-01-01T09:00:00Z; found {text:?}"
                )
            })?;
            if until <= now {
                return Err(format!(
                    "`until` {text} is not in the future: it is {} now",
                    format_rfc3339(now)
                ));
            }
            until
        }
        (None, Some(Value::Number(n))) => match n.as_u64().filter(|&ms| ms >= 1) {
            Some(ms) => now.saturating_add(Millis::try_from(ms).unwrap_or(Millis::MAX)),
            None => {
                return Err(format!(
                    "`ms` must be a whole number of milliseconds, at least 1; found {n}"
                ));
            }
        },
        _ => {
            return Err(format!(
                "wait takes exactly one of `until` (an RFC 3339 date-time such as \
                 2030-01-01T09:00:00Z) or `ms` (milliseconds, at least 1); found {arguments}"
            ));
        }
    };
    let wait = u64::try_from(due - now).unwrap_or(u64::MAX);
    if wait > max {
        let latest = now.saturating_add(Millis::try_from(max).unwrap_or(Millis::MAX));
        return Err(format!(
            "a wait of {wait} ms is longer than the {max} ms one wait may take; wait at most \
             until {} and wait again then if need be",
            format_rfc3339(latest)
        ));
    }
    if let Some(deadline) = state.deadline().filter(|&deadline| due >= deadline) {
        return Err(format!(
            "this run must end by {} (its duration budget, {} ms from now): a wait until {} \
             would outlast it",
            format_rfc3339(deadline),
            deadline.saturating_sub(now).max(0),
            format_rfc3339(due)
        ));
    }
    Ok(due)
}

/// What a batch's `wait` calls come to once its other calls have run.
#[derive(Debug, Clone, PartialEq)]
pub struct Waits {
    /// The call the run parks on: its slot and due time.
    pub parks: Option<(u32, Millis)>,
    /// An error outcome for each `wait` call that does not park the run.
    pub refused: Vec<(u32, ToolOutcome)>,
}

/// Decides a batch's `wait` calls (`calls`: each one's slot and arguments, in batch order,
/// every one checked against the tool's schema). Only the first is performed; a batch that
/// also waits for its children (a foreground `delegate`) performs none, since a run waits on
/// one thing at a time. A first call whose time is wrong is told why (`due_at`), and the run
/// does not park.
pub fn plan_waits(
    state: &AgentState,
    calls: &[(u32, &Value)],
    awaits_children: bool,
    now: Millis,
) -> Waits {
    let mut waits = Waits {
        parks: None,
        refused: Vec::new(),
    };
    for (i, (slot, arguments)) in calls.iter().enumerate() {
        let refusal = if awaits_children {
            "wait cannot share a batch with a foreground delegate call: the run waits for its \
             children instead; call wait again once they have answered"
                .to_owned()
        } else if i > 0 {
            "only the first wait call of a batch is performed; this one did not wait".to_owned()
        } else {
            match due_at(state, arguments, now) {
                Ok(due) => {
                    waits.parks = Some((*slot, due));
                    continue;
                }
                Err(why) => why,
            }
        };
        waits.refused.push((*slot, ToolOutcome::error(refusal)));
    }
    waits
}

/// The step that ran a batch with a `wait` call parks its run: the outcomes of the batch's
/// other calls are kept in the checkpoint, the run is `waiting_timer` with its due time
/// frozen, and its next job (`wait_ended`) is written ready at that time.
pub fn await_timer(
    mut state: AgentState,
    job: &StepJob,
    outcomes: Vec<Option<ToolOutcome>>,
    (slot, due_at): (u32, Millis),
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let call_id = (state.checkpoint.as_ref())
        .and_then(|c| c.calls.get(slot as usize))
        .map(|p| p.call.id.clone())
        .unwrap_or_default();
    let summary = json!({"wait": {"call_id": call_id, "due_at": due_at}});
    let (record, committed) = park_batch(&mut state, job, outcomes, summary, started_at, now);
    state.status = RunStatus::WaitingTimer;
    let set = EventDraft::new(
        EventKind::TimerSet,
        json!({
            "run_id": state.run_id,
            "call_id": call_id,
            "due_at": due_at,
            "wait_ms": due_at.saturating_sub(now).max(0),
        }),
    );
    state.timer = Some(Timer {
        slot,
        call_id,
        since: now,
        due_at,
        woken_by_input: None,
    });
    let events = vec![set, status_event(&state), committed];
    let next = StepJob {
        run_id: state.run_id.clone(),
        step_index: job.step_index + 1,
        phase: Phase::WaitEnded,
        attempt: 0,
    };
    StepResult {
        record,
        state,
        messages: Vec::new(),
        events,
        next: Some(next),
        children: Vec::new(),
    }
}

/// Input arrived for the session of `state`'s run at `now`. A run parked on a timer (or paused
/// while it was) whose wait has not ended wakes: the wait ends now, and says so. True when the
/// state changed: the store writes it and makes the run's job ready now.
pub fn wake_by_input(state: &mut AgentState, now: Millis) -> bool {
    let parked = match state.status {
        RunStatus::WaitingTimer => true,
        RunStatus::Paused => state.pause.is_some_and(|p| p.next == Phase::WaitEnded),
        _ => false,
    };
    match state.timer.as_mut().filter(|_| parked) {
        Some(timer) if timer.woken_by_input.is_none() && now < timer.due_at => {
            timer.woken_by_input = Some(now);
            true
        }
        _ => false,
    }
}

/// The step of a `wait_ended` job: the wait's result (what ended it, how long it took) joins
/// the outcomes the batch's other calls left in the checkpoint, the run is `running` again,
/// and the batch is handed to the model in order, as any finished tools step does.
pub fn wake_step(
    mut state: AgentState,
    job: &StepJob,
    started_at: Millis,
    now: Millis,
) -> StepResult {
    let mut events = Vec::new();
    if let Some(timer) = state.timer.take() {
        let woke = timer.woke();
        let waited_ms = now.saturating_sub(timer.since).max(0);
        let result = json!({
            "woke": woke,
            "waited_ms": waited_ms,
            "due_at": format_rfc3339(timer.due_at),
        });
        if let Some(progress) = (state.checkpoint.as_mut())
            .and_then(|c| c.calls.get_mut(timer.slot as usize))
            .filter(|p| p.outcome.is_none())
        {
            progress.outcome = Some(ToolOutcome::ok(result.to_string()));
        }
        events.push(EventDraft::new(
            EventKind::TimerWoke,
            json!({
                "run_id": state.run_id,
                "call_id": timer.call_id,
                "woke": woke,
                "waited_ms": waited_ms,
                "due_at": timer.due_at,
            }),
        ));
    }
    state.status = RunStatus::Running;
    events.push(status_event(&state));
    let outcomes = (state.checkpoint.iter())
        .flat_map(|c| &c.calls)
        .map(|p| {
            (p.outcome.clone())
                .unwrap_or_else(|| ToolOutcome::error("the call produced no outcome"))
        })
        .collect();
    let mut result = after_tools(state, job, outcomes, 0, started_at, now);
    result.events.splice(0..0, events);
    result
}

/// Milliseconds since the Unix epoch of an RFC 3339 date-time (`2030-01-01T09:00:00Z`,
/// `2030-01-01t09:00:00.250+02:00`; `T`, `t` or a space between date and time); None for
/// anything else, a date without a time or a time without an offset included. Fractions
/// beyond milliseconds are dropped; a leap second reads as the second after it.
pub fn parse_rfc3339(text: &str) -> Option<Millis> {
    let b = text.as_bytes();
    let digits = |from: usize, n: usize| -> Option<i64> {
        let part = b.get(from..from + n)?;
        part.iter().try_fold(0i64, |acc, &d| {
            d.is_ascii_digit().then(|| acc * 10 + i64::from(d - b'0'))
        })
    };
    let at = |i: usize, c: u8| b.get(i) == Some(&c);
    if !(at(4, b'-') && at(7, b'-') && at(13, b':') && at(16, b':')) {
        return None;
    }
    if !matches!(b.get(10), Some(b'T' | b't' | b' ')) {
        return None;
    }
    let (year, month, day) = (digits(0, 4)?, digits(5, 2)?, digits(8, 2)?);
    let (hour, minute, second) = (digits(11, 2)?, digits(14, 2)?, digits(17, 2)?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut i = 19;
    let mut millis = 0;
    if at(i, b'.') {
        let start = i + 1;
        i = start;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            return None;
        }
        let kept = (i - start).min(3);
        millis = digits(start, kept)? * 10i64.pow(3 - kept as u32);
    }
    let offset_minutes = match b.get(i) {
        Some(b'Z' | b'z') if b.len() == i + 1 => 0,
        Some(&sign @ (b'+' | b'-')) if b.len() == i + 6 && at(i + 3, b':') => {
            let (oh, om) = (digits(i + 1, 2)?, digits(i + 4, 2)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let minutes = oh * 60 + om;
            if sign == b'+' { minutes } else { -minutes }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3_600 + minute * 60 + second - offset_minutes * 60;
    Some(seconds * 1_000 + millis)
}

/// `millis` as an RFC 3339 date-time in UTC with milliseconds: `2030-01-01T09:00:00.000Z`.
pub fn format_rfc3339(millis: Millis) -> String {
    let (days, in_day) = (millis.div_euclid(86_400_000), millis.rem_euclid(86_400_000));
    let (year, month, day) = civil_from_days(days);
    let (seconds, ms) = (in_day / 1_000, in_day % 1_000);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        seconds / 3_600,
        seconds / 60 % 60,
        seconds % 60
    )
}

fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a date of the proleptic Gregorian calendar (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date `days` after 1970-01-01 (`civil_from_days`, the inverse of the above).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Pause;
    use crate::{
        ApprovalPolicy, CallLimits, Limits, ReplayPolicy, RunConfigSnapshot, RunId, SessionId,
        ToolCall, ToolCheckpoint, ToolDelegation, ToolSpec,
    };

    const NOW: Millis = 1_700_000_000_000;

    fn state(limits: Limits) -> AgentState {
        let spec = |name: &str, completes_run| ToolSpec {
            name: name.into(),
            description: String::new(),
            parameters: json!({"type": "object"}),
            replay: ReplayPolicy::Safe,
            completes_run,
            approval: ApprovalPolicy::Never,
            delegation: ToolDelegation::Delegatable,
            calls: CallLimits::default(),
        };
        let config = RunConfigSnapshot {
            tools: vec![
                spec("add", false),
                spec(WAIT_TOOL, false),
                spec("done", true),
            ],
            limits,
            ..RunConfigSnapshot::default()
        };
        let mut state = AgentState::new(
            SessionId::from_suffix("s").unwrap(),
            RunId::from_suffix("r").unwrap(),
            config,
            NOW - 10_000,
        );
        state.status = RunStatus::Running;
        state.started_at = Some(NOW - 10_000);
        state.step_index = 1;
        state
    }

    fn call(id: &str, name: &str, arguments: Value) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments,
        }
    }

    fn job(step_index: u64, phase: Phase) -> StepJob {
        StepJob {
            run_id: RunId::from_suffix("r").unwrap(),
            step_index,
            phase,
            attempt: 1,
        }
    }

    #[test]
    fn rfc3339_times_are_read_exactly_and_everything_else_is_refused() {
        let read = [
            ("1970-01-01T00:00:00Z", 0),
            ("1970-01-01T00:00:00.001Z", 1),
            ("2000-03-01T00:00:00Z", 951_868_800_000),
            ("2024-02-29T12:00:00.5+01:00", 1_709_204_400_500),
            ("2024-02-29t12:00:00.123456789z", 1_709_208_000_123),
            (
                "2024-02-29 11:00:00-01:30",
                1_709_208_000_000 + 90 * 60_000 - 3_600_000,
            ),
            ("2016-12-31T23:59:60Z", 1_483_228_800_000),
            ("1969-12-31T23:59:59.999Z", -1),
        ];
        for (text, millis) in read {
            assert_eq!(parse_rfc3339(text), Some(millis), "{text}");
        }
        let refused = [
            "",
            "tomorrow",
            "2024-02-29",
            "2024-02-29T12:00:00",
            "2023-02-29T12:00:00Z",
            "2100-02-29T12:00:00Z",
            "2024-13-01T00:00:00Z",
            "2024-04-31T00:00:00Z",
            "2024-01-01T24:00:00Z",
            "2024-01-01T00:60:00Z",
            "2024-01-01T00:00:61Z",
            "2024-01-01T00:00:00.Z",
            "2024-01-01T00:00:00+24:00",
            "2024-01-01T00:00:00+0100",
            "2024-01-01T00:00:00Zjunk",
            "2024-01-01X00:00:00Z",
            "+2024-01-01T00:00:00Z",
            "２０２４-01-01T00:00:00Z",
        ];
        for text in refused {
            assert_eq!(parse_rfc3339(text), None, "{text:?}");
        }
    }

    #[test]
    fn a_formatted_time_reads_back_as_itself() {
        assert_eq!(format_rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            format_rfc3339(1_709_204_400_500),
            "2024-02-29T11:00:00.500Z"
        );
        assert_eq!(format_rfc3339(-1), "1969-12-31T23:59:59.999Z");
        // Every day of four centuries (leap rules included), at an odd time of day.
        let day = 86_400_000;
        for n in -146_097 / 2..146_097 * 2 {
            let millis = n * day + 45_296_789;
            assert_eq!(parse_rfc3339(&format_rfc3339(millis)), Some(millis));
        }
    }

    #[test]
    fn a_wait_ends_when_its_arguments_say_within_the_longest_wait_and_the_deadline() {
        let mut s = state(Limits {
            max_wait_ms: 60_000,
            ..Limits::default()
        });
        let due = |s: &AgentState, arguments: Value| due_at(s, &arguments, NOW);
        assert_eq!(due(&s, json!({"ms": 1})), Ok(NOW + 1));
        assert_eq!(due(&s, json!({"ms": 60_000})), Ok(NOW + 60_000));
        let until = format_rfc3339(NOW + 30_000);
        assert_eq!(due(&s, json!({"until": until})), Ok(NOW + 30_000));
        let too_long = due(&s, json!({"ms": 60_001})).unwrap_err();
        assert!(
            too_long.contains("60001 ms is longer than the 60000 ms"),
            "{too_long}"
        );
        let too_late = due(&s, json!({"until": format_rfc3339(NOW + 60_001)})).unwrap_err();
        assert!(too_late.contains("longer than"), "{too_late}");
        for past in [NOW, NOW - 1] {
            let error = due(&s, json!({"until": format_rfc3339(past)})).unwrap_err();
            assert!(error.contains("is not in the future"), "{error}");
        }
        let bad = due(&s, json!({"until": "next tuesday"})).unwrap_err();
        assert!(
            bad.contains("RFC 3339") && bad.contains("next tuesday"),
            "{bad}"
        );
        for wrong in [
            json!({}),
            json!({"ms": 5, "until": until}),
            json!({"until": 5}),
            json!({"ms": "5"}),
        ] {
            let error = due(&s, wrong.clone()).unwrap_err();
            assert!(error.contains("exactly one of"), "{wrong}: {error}");
        }
        for wrong in [json!({"ms": 0}), json!({"ms": -5}), json!({"ms": 1.5})] {
            let error = due(&s, wrong.clone()).unwrap_err();
            assert!(error.contains("at least 1"), "{wrong}: {error}");
        }
        // A run with a duration budget may wait only until just before its deadline; time it
        // spent paused moves the deadline, as it does for everything else.
        let mut config = s.config.as_ref().clone();
        config.limits.max_duration_ms = Some(40_000);
        s.config = std::sync::Arc::new(config);
        assert_eq!(due(&s, json!({"ms": 29_999})), Ok(NOW + 29_999));
        let cut_off = due(&s, json!({"ms": 30_000})).unwrap_err();
        assert!(cut_off.contains("would outlast it"), "{cut_off}");
        s.paused_ms = 5_000;
        assert_eq!(due(&s, json!({"ms": 34_999})), Ok(NOW + 34_999));
    }

    #[test]
    fn only_the_first_wait_of_a_batch_is_performed_and_none_beside_a_foreground_delegation() {
        let s = state(Limits::default());
        let (one, bad) = (json!({"ms": 1000}), json!({"ms": 0}));
        let waits = plan_waits(&s, &[(1, &one), (3, &one)], false, NOW);
        assert_eq!(waits.parks, Some((1, NOW + 1000)));
        assert_eq!(waits.refused.len(), 1);
        assert_eq!(waits.refused[0].0, 3);
        assert!(waits.refused[0].1.content.contains("only the first wait"));
        let waits = plan_waits(&s, &[(0, &bad), (2, &one)], false, NOW);
        assert_eq!(
            waits.parks, None,
            "a first wait that is wrong parks nothing"
        );
        let slots: Vec<u32> = waits.refused.iter().map(|(slot, _)| *slot).collect();
        assert_eq!(slots, [0, 2]);
        assert!(waits.refused.iter().all(|(_, outcome)| outcome.is_error));
        let waits = plan_waits(&s, &[(0, &one)], true, NOW);
        assert_eq!(waits.parks, None);
        assert!(waits.refused[0].1.content.contains("foreground delegate"));
        assert_eq!(
            plan_waits(&s, &[], false, NOW),
            Waits {
                parks: None,
                refused: Vec::new()
            }
        );
    }

    /// A batch `[add, wait]`: the step parks with add's outcome kept and the wait pending.
    fn parked(woken: Option<Millis>) -> AgentState {
        let mut s = state(Limits::default());
        s.checkpoint = Some(ToolCheckpoint::new(vec![
            call("c0", "add", json!({"a": 1, "b": 2})),
            call("c1", WAIT_TOOL, json!({"ms": 5_000})),
        ]));
        let result = await_timer(
            s,
            &job(2, Phase::LlmResult),
            vec![Some(ToolOutcome::ok("3")), None],
            (1, NOW + 5_000),
            NOW - 100,
            NOW,
        );
        let mut state = result.state;
        if let Some(at) = woken {
            assert!(wake_by_input(&mut state, at));
        }
        state
    }

    #[test]
    fn a_parked_run_waits_with_its_due_time_frozen_and_its_job_ready_then() {
        let mut s = state(Limits::default());
        s.checkpoint = Some(ToolCheckpoint::new(vec![
            call("c0", "add", json!({"a": 1, "b": 2})),
            call("c1", WAIT_TOOL, json!({"ms": 5_000})),
        ]));
        let result = await_timer(
            s,
            &job(2, Phase::LlmResult),
            vec![Some(ToolOutcome::ok("3")), None],
            (1, NOW + 5_000),
            NOW - 100,
            NOW,
        );
        let state = &result.state;
        assert_eq!(state.status, RunStatus::WaitingTimer);
        assert_eq!(state.step_index, 2);
        assert_eq!(
            state.timer,
            Some(Timer {
                slot: 1,
                call_id: "c1".into(),
                since: NOW,
                due_at: NOW + 5_000,
                woken_by_input: None
            })
        );
        let outcomes: Vec<_> = (state.checkpoint.as_ref().unwrap().calls.iter())
            .map(|p| p.outcome.clone())
            .collect();
        assert_eq!(outcomes, [Some(ToolOutcome::ok("3")), None]);
        assert_eq!(
            result.next,
            Some(StepJob {
                run_id: state.run_id.clone(),
                step_index: 3,
                phase: Phase::WaitEnded,
                attempt: 0
            })
        );
        assert_eq!(job_ready_at(state, NOW), NOW + 5_000);
        let kinds: Vec<&str> = result.events.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["timer.set", "run.status", "step.committed"]);
        assert_eq!(result.events[0].payload["wait_ms"], 5_000);
        assert_eq!(result.record.instruction, "call_tools_batch");
        // Nothing of the batch is counted until the wait's result joins it.
        assert_eq!(state.counters.tool_calls, 0);
    }

    #[test]
    fn input_ends_a_wait_early_once_and_only_before_its_due_time() {
        let mut s = parked(None);
        assert!(
            !wake_by_input(&mut s, NOW + 5_000),
            "due already: the timer woke it"
        );
        assert!(!wake_by_input(&mut s, NOW + 9_000));
        assert!(wake_by_input(&mut s, NOW + 1_000));
        assert_eq!(job_ready_at(&s, NOW + 2_000), NOW + 1_000);
        assert!(!wake_by_input(&mut s, NOW + 2_000), "woken once");
        assert_eq!(s.timer.as_ref().unwrap().woken_by_input, Some(NOW + 1_000));
        // A paused wait is woken too (it wakes at once when resumed); nothing else is.
        let mut paused = parked(None);
        pause_idle_for_test(&mut paused);
        assert!(wake_by_input(&mut paused, NOW + 1_000));
        for status in RunStatus::ALL {
            if matches!(status, RunStatus::WaitingTimer | RunStatus::Paused) {
                continue;
            }
            let mut other = parked(None);
            other.status = status;
            assert!(!wake_by_input(&mut other, NOW + 1), "{status}");
        }
        let mut paused_otherwise = parked(None);
        paused_otherwise.status = RunStatus::Paused;
        paused_otherwise.pause = Some(Pause {
            next: Phase::ToolsBatchResult,
            since: NOW,
        });
        assert!(!wake_by_input(&mut paused_otherwise, NOW + 1));
        let mut no_timer = state(Limits::default());
        no_timer.status = RunStatus::WaitingTimer;
        assert!(!wake_by_input(&mut no_timer, NOW));
        assert_eq!(job_ready_at(&no_timer, NOW), NOW, "no timer: at once");
    }

    fn pause_idle_for_test(state: &mut AgentState) {
        crate::step::pause_idle(state, Phase::WaitEnded, NOW + 500).unwrap();
    }

    #[test]
    fn the_wake_step_says_what_ended_the_wait_and_hands_the_batch_to_the_model_in_order() {
        for (woken, woke) in [(None, "timer"), (Some(NOW + 1_200), "input")] {
            let s = parked(woken);
            let ended = woken.unwrap_or(NOW + 5_000) + 30;
            let result = wake_step(s, &job(3, Phase::WaitEnded), ended, ended);
            let state = &result.state;
            assert_eq!(state.status, RunStatus::Running);
            assert_eq!(state.timer, None);
            assert_eq!(state.step_index, 3);
            assert_eq!(state.counters.tool_calls, 2, "the whole batch, once");
            let contents: Vec<Value> = (result.messages.iter())
                .map(|m| serde_json::from_str(&m.content).unwrap_or(json!(m.content)))
                .collect();
            assert_eq!(contents[0], json!(3));
            assert_eq!(contents[1]["woke"], woke);
            assert_eq!(contents[1]["waited_ms"], ended - NOW);
            assert_eq!(contents[1]["due_at"], format_rfc3339(NOW + 5_000));
            let kinds: Vec<&str> = result.events.iter().map(|e| e.kind.as_str()).collect();
            assert_eq!(
                kinds,
                [
                    "timer.woke",
                    "run.status",
                    "tool.result",
                    "tool.result",
                    "step.committed"
                ]
            );
            assert_eq!(result.events[0].payload["woke"], woke);
            assert_eq!(
                result.next.map(|j| (j.step_index, j.phase)),
                Some((4, Phase::ToolsBatchResult)),
                "the model is called next"
            );
        }
    }

    #[test]
    fn a_wake_step_past_the_deadline_ends_the_run_timed_out_and_a_completing_batch_completes() {
        let mut s = parked(None);
        let mut config = s.config.as_ref().clone();
        config.limits.max_duration_ms = Some(14_000);
        s.config = std::sync::Arc::new(config);
        let deadline = s.deadline().unwrap();
        assert_eq!(
            crate::decide(&s, Phase::WaitEnded, deadline),
            crate::Instruction::Finish(crate::StopReason::TimedOut)
        );
        assert_eq!(
            crate::decide(&s, Phase::WaitEnded, deadline - 1),
            crate::Instruction::CallToolsBatch
        );
        // `[done, wait]`: the batch's completing tool ends the run in the wake step itself.
        let mut s = state(Limits::default());
        s.checkpoint = Some(ToolCheckpoint::new(vec![
            call("c0", "done", json!({})),
            call("c1", WAIT_TOOL, json!({"ms": 10})),
        ]));
        let parked = await_timer(
            s,
            &job(2, Phase::LlmResult),
            vec![Some(ToolOutcome::ok("done")), None],
            (1, NOW + 10),
            NOW,
            NOW,
        );
        let woken = wake_step(parked.state, &job(3, Phase::WaitEnded), NOW + 10, NOW + 10);
        assert_eq!(woken.state.status, RunStatus::Completed);
        assert_eq!(woken.next, None);
        assert!(RunStatus::WaitingTimer.edge(woken.state.status).is_ok());
    }

    #[test]
    fn a_pause_keeps_the_due_time_and_a_resume_waits_again_or_wakes_at_once() {
        let mut s = parked(None);
        let events = crate::step::pause_idle(&mut s, Phase::WaitEnded, NOW + 1_000).unwrap();
        assert_eq!(s.status, RunStatus::Paused);
        assert_eq!(events[0].payload["status"], "paused");
        let (events, job) = crate::step::resume_paused(&mut s, NOW + 3_000).unwrap();
        assert_eq!(s.status, RunStatus::WaitingTimer);
        assert_eq!(events[0].payload["status"], "waiting_timer");
        assert_eq!((job.step_index, job.phase), (3, Phase::WaitEnded));
        assert_eq!(
            job_ready_at(&s, NOW + 3_000),
            NOW + 5_000,
            "the same due time"
        );
        assert_eq!(s.paused_ms, 2_000);
        // Resumed after its due time, its job is ready at once (it was due already).
        crate::step::pause_idle(&mut s, Phase::WaitEnded, NOW + 4_000).unwrap();
        crate::step::resume_paused(&mut s, NOW + 9_000).unwrap();
        assert!(job_ready_at(&s, NOW + 9_000) <= NOW + 9_000);
        let result = wake_step(s, &job.clone(), NOW + 9_000, NOW + 9_000);
        let waited: Value = serde_json::from_str(&result.messages[1].content).unwrap();
        assert_eq!(waited["woke"], "timer");
        assert_eq!(waited["waited_ms"], 9_000, "time paused is time waited");
    }

    #[test]
    fn a_cancel_or_pause_that_arrives_while_the_run_parks_wins() {
        let s = parked(None);
        let mut base = state(Limits::default());
        base.checkpoint = s.checkpoint.clone();
        let park = || {
            await_timer(
                base.clone(),
                &job(2, Phase::LlmResult),
                vec![Some(ToolOutcome::ok("3")), None],
                (1, NOW + 5_000),
                NOW,
                NOW,
            )
        };
        let mut cancelled = park();
        cancelled.yield_to_cancel();
        assert_eq!(cancelled.state.status, RunStatus::Cancelling);
        assert_eq!(cancelled.state.timer, None);
        assert!(
            (cancelled.events.iter())
                .all(|e| e.kind != EventKind::TimerSet && e.payload["status"] != "waiting_timer"),
            "the wait is neither announced nor begun"
        );
        assert_eq!(cancelled.next.map(|j| j.phase), Some(Phase::Cancel));
        let mut paused = park();
        assert!(paused.yield_to_pause());
        assert_eq!(paused.state.status, RunStatus::Paused);
        assert_eq!(paused.next, None, "a paused run holds no job");
        assert!(paused.state.timer.is_some(), "it waits again when resumed");
        assert_eq!(paused.state.pause.map(|p| p.next), Some(Phase::WaitEnded));
    }

    #[test]
    fn an_idle_end_drops_the_timer() {
        let mut s = parked(None);
        let (_, closing) = crate::step::cancel_idle(&mut s, NOW + 1);
        assert_eq!(s.status, RunStatus::Cancelled);
        assert_eq!(s.timer, None);
        // The wait was under way: the model is never told it did not run.
        let told: Vec<&str> = closing.iter().map(|m| m.content.as_str()).collect();
        assert!(told.iter().all(|t| !t.starts_with("not run")), "{told:?}");
        assert!(
            told.iter().any(|t| t.starts_with("outcome unknown")),
            "{told:?}"
        );
        let mut s = parked(None);
        crate::step::time_out_idle(&mut s, NOW + 1);
        assert_eq!(s.stop_reason, Some(crate::StopReason::TimedOut));
        assert!(RunStatus::WaitingTimer.edge(s.status).is_ok());
    }
}
