//! The built-in tools. `append_line` is the one with a side effect that must never happen
//! twice, which is why its replay policy is `never`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use ratchet_core::{CallLimits, ReplayPolicy, ToolDelegation, ToolOutcome};
use serde_json::{Value, json};

use crate::workspace::Workspace;
use crate::{Tool, ToolContext};

pub struct Add;

#[async_trait]
impl Tool for Add {
    fn name(&self) -> &str {
        "add"
    }
    fn description(&self) -> &str {
        "Adds two numbers and returns the sum."
    }
    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
            "additionalProperties": false
        })
    }
    /// Reads nothing but its arguments and writes nothing: any run may have it.
    fn delegation(&self) -> ToolDelegation {
        ToolDelegation::Delegatable
    }
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Safe
    }
    async fn call(&self, arguments: Value, _: &ToolContext) -> ToolOutcome {
        match (arguments["a"].as_i64(), arguments["b"].as_i64()) {
            (Some(a), Some(b)) => match a.checked_add(b) {
                Some(sum) => ToolOutcome::ok(sum.to_string()),
                None => ToolOutcome::error(format!("{a} + {b} overflows a 64-bit integer")),
            },
            _ => {
                let (a, b) = (
                    arguments["a"].as_f64().unwrap_or(0.0),
                    arguments["b"].as_f64().unwrap_or(0.0),
                );
                ToolOutcome::ok((a + b).to_string())
            }
        }
    }
}

pub struct Now;

#[async_trait]
impl Tool for Now {
    fn name(&self) -> &str {
        "now"
    }
    fn description(&self) -> &str {
        "Returns the current time as milliseconds since the Unix epoch."
    }
    fn parameters(&self) -> Value {
        json!({"type": "object", "properties": {}, "additionalProperties": false})
    }
    /// Reads nothing but its arguments and writes nothing: any run may have it.
    fn delegation(&self) -> ToolDelegation {
        ToolDelegation::Delegatable
    }
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Safe
    }
    async fn call(&self, _: Value, _: &ToolContext) -> ToolOutcome {
        let millis = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        ToolOutcome::ok(json!({"unix_ms": millis}).to_string())
    }
}

pub struct SleepMs;

const MAX_SLEEP_MS: u64 = 600_000;

#[async_trait]
impl Tool for SleepMs {
    fn name(&self) -> &str {
        "sleep_ms"
    }
    fn description(&self) -> &str {
        "Waits the given number of milliseconds (at most 600000)."
    }
    fn parameters(&self) -> Value {
        sleep_parameters()
    }
    /// Reads nothing but its arguments and writes nothing: any run may have it.
    fn delegation(&self) -> ToolDelegation {
        ToolDelegation::Delegatable
    }
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Safe
    }
    fn call_limits(&self) -> CallLimits {
        sleep_limits()
    }
    async fn call(&self, arguments: Value, context: &ToolContext) -> ToolOutcome {
        let ms = arguments["ms"].as_u64().unwrap_or(0).min(MAX_SLEEP_MS);
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(ms)) => ToolOutcome::ok(format!("slept {ms} ms")),
            () = context.cancel.cancelled() => ToolOutcome::error("cancelled"),
        }
    }
}

/// A sleep may take its longest allowed time and a little more before it counts as cut off.
fn sleep_limits() -> CallLimits {
    CallLimits {
        timeout_ms: MAX_SLEEP_MS + 60_000,
        ..CallLimits::default()
    }
}

/// `{"ms": N}`, as `sleep_ms` and `sleep` take it.
fn sleep_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {"ms": {"type": "integer", "minimum": 0, "maximum": MAX_SLEEP_MS}},
        "required": ["ms"],
        "additionalProperties": false
    })
}

/// Waits until its time is up or new input arrives for the session, whichever comes first:
/// for a run that has nothing to do until someone (a user, its background work) says more.
pub struct Sleep;

#[async_trait]
impl Tool for Sleep {
    fn name(&self) -> &str {
        "sleep"
    }
    fn description(&self) -> &str {
        "Waits up to the given number of milliseconds (at most 600000), ending early when new input arrives for this conversation (a user message, or a report of background work you started). Says which it was."
    }
    fn parameters(&self) -> Value {
        sleep_parameters()
    }
    /// A child's sleep wakes on its timer or cancel only; nothing else differs.
    fn delegation(&self) -> ToolDelegation {
        ToolDelegation::Delegatable
    }
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Safe
    }
    fn call_limits(&self) -> CallLimits {
        sleep_limits()
    }
    async fn call(&self, arguments: Value, context: &ToolContext) -> ToolOutcome {
        let ms = arguments["ms"].as_u64().unwrap_or(0).min(MAX_SLEEP_MS);
        let started = std::time::Instant::now();
        let input = async {
            match &context.input {
                Some(watch) => watch.arrived().await,
                None => std::future::pending().await,
            }
        };
        let slept = || started.elapsed().as_millis() as u64;
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(ms)) => {
                ToolOutcome::ok(json!({"woke": "timer", "slept_ms": slept()}).to_string())
            }
            waiting = input => {
                ToolOutcome::ok(json!({"woke": "input", "slept_ms": slept(), "waiting": waiting}).to_string())
            }
            () = context.cancel.cancelled() => ToolOutcome::error("cancelled"),
        }
    }
}

/// Parks the run until a time or for a while, holding no worker: the runtime performs it
/// (`ratchet_core::timer`), never by calling it. Only its name, description and schema are
/// used — to offer it, and to check a call's arguments before the run parks.
pub struct Wait;

#[async_trait]
impl Tool for Wait {
    fn name(&self) -> &str {
        ratchet_core::WAIT_TOOL
    }
    fn description(&self) -> &str {
        "Waits until a time (`until`, RFC 3339 such as 2030-01-01T09:00:00Z) or for a number of milliseconds (`ms`), for minutes to days (at most 7 days unless configured otherwise), holding nothing meanwhile; it survives restarts. Ends early when new input arrives for this conversation (a user message, or a report of background work you started), and says which it was. The batch's other calls run first; one wait per batch. For a few seconds, use sleep."
    }
    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {
                "until": {
                    "type": "string",
                    "description": "When to wake: an RFC 3339 date-time with an offset, in the future"
                },
                "ms": {"type": "integer", "minimum": 1, "description": "How long to wait, in milliseconds"}
            },
            "minProperties": 1,
            "maxProperties": 1,
            "additionalProperties": false
        })
    }
    /// A child's wait ends on its time alone: its session takes no input.
    fn delegation(&self) -> ToolDelegation {
        ToolDelegation::Delegatable
    }
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Safe
    }
    async fn call(&self, _: Value, _: &ToolContext) -> ToolOutcome {
        ToolOutcome::error(
            "wait parks a run and is performed by the Ratchet runtime; it cannot be called on its own",
        )
    }
}

pub struct AppendLine;

#[async_trait]
impl Tool for AppendLine {
    fn name(&self) -> &str {
        "append_line"
    }
    fn description(&self) -> &str {
        "Appends one line of text to a file in the workspace (created if absent)."
    }
    fn parameters(&self) -> Value {
        json!({
            "type": "object",
            "properties": {
                "path": {"type": "string", "minLength": 1},
                "line": {"type": "string"}
            },
            "required": ["path", "line"],
            "additionalProperties": false
        })
    }
    fn replay(&self) -> ReplayPolicy {
        ReplayPolicy::Never
    }
    async fn call(&self, arguments: Value, context: &ToolContext) -> ToolOutcome {
        let (Some(path), Some(line)) = (arguments["path"].as_str(), arguments["line"].as_str())
        else {
            return ToolOutcome::error("expected string arguments `path` and `line`");
        };
        if line.contains(['\n', '\r']) {
            return ToolOutcome::error("`line` must be a single line (no newline characters)");
        }
        let Some(workspace) = &context.workspace else {
            return ToolOutcome::error(
                "this run has no workspace directory; append_line is unavailable",
            );
        };
        let root = workspace.clone();
        let relative = path.to_owned();
        let line = format!("{line}\n");
        let appended = tokio::task::spawn_blocking(move || {
            Workspace::open(&root)?.append(&relative, line.as_bytes())
        })
        .await;
        match appended {
            Ok(Ok(())) => ToolOutcome::ok(format!("appended 1 line to {path}")),
            Ok(Err(refused)) => ToolOutcome::error(refused.to_string()),
            Err(e) => ToolOutcome::error(format!("append task failed: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::Arc;

    use tokio_util::sync::CancellationToken;

    fn context(workspace: Option<&Path>) -> ToolContext {
        ToolContext {
            workspace: workspace.map(Path::to_path_buf),
            idempotency_key: "run_x#1#0".into(),
            cancel: CancellationToken::new(),
            session_id: ratchet_core::SessionId::from_suffix("s").unwrap(),
            memory: None,
            input: None,
            traceparent: None,
        }
    }

    #[tokio::test]
    async fn add_sums_integers_and_floats() {
        let ctx = context(None);
        assert_eq!(
            Add.call(json!({"a": 2, "b": 3}), &ctx).await,
            ToolOutcome::ok("5")
        );
        assert_eq!(
            Add.call(json!({"a": 0.5, "b": 2}), &ctx).await,
            ToolOutcome::ok("2.5")
        );
        assert!(
            Add.call(json!({"a": i64::MAX, "b": 1}), &ctx)
                .await
                .is_error
        );
    }

    #[tokio::test]
    async fn append_line_appends_inside_the_workspace() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(Some(dir.path()));
        let outcome = AppendLine
            .call(json!({"path": "log.txt", "line": "one"}), &ctx)
            .await;
        assert!(!outcome.is_error, "{outcome:?}");
        AppendLine
            .call(json!({"path": "./log.txt", "line": "two"}), &ctx)
            .await;
        assert_eq!(
            std::fs::read_to_string(dir.path().join("log.txt")).unwrap(),
            "one\ntwo\n"
        );
    }

    #[tokio::test]
    async fn append_line_refuses_to_escape_the_workspace() {
        let outer = tempfile::tempdir().unwrap();
        let workspace = outer.path().join("ws");
        std::fs::create_dir(&workspace).unwrap();
        std::os::unix::fs::symlink(outer.path(), workspace.join("out")).unwrap();
        let ctx = context(Some(&workspace));
        for (path, expected) in [
            ("../x.txt", "escapes the workspace"),
            ("a/../../x.txt", "escapes the workspace"),
            ("/etc/passwd", "is absolute"),
            ("out/x.txt", "symbolic link"),
            ("missing/x.txt", "does not exist"),
        ] {
            let outcome = AppendLine
                .call(json!({"path": path, "line": "x"}), &ctx)
                .await;
            assert!(
                outcome.is_error && outcome.content.contains(expected),
                "{path}: {outcome:?}"
            );
        }
        let outcome = AppendLine
            .call(json!({"path": "x.txt", "line": "a\nb"}), &ctx)
            .await;
        assert!(outcome.is_error, "{outcome:?}");
        assert!(
            !outer.path().join("x.txt").exists(),
            "nothing written outside the workspace"
        );
        assert!(
            std::fs::read_dir(&workspace)
                .unwrap()
                .all(|e| e.unwrap().file_name() == "out")
        );
        let outcome = AppendLine
            .call(json!({"path": "x.txt", "line": "a"}), &context(None))
            .await;
        assert!(outcome.content.contains("no workspace"), "{outcome:?}");
    }

    #[tokio::test]
    async fn sleep_ms_stops_when_cancelled() {
        let ctx = context(None);
        ctx.cancel.cancel();
        let outcome = SleepMs.call(json!({"ms": 600000}), &ctx).await;
        assert_eq!(outcome, ToolOutcome::error("cancelled"));
    }

    #[derive(Debug)]
    struct ArrivesAfter(Duration);

    #[async_trait]
    impl crate::InputWatch for ArrivesAfter {
        async fn arrived(&self) -> Value {
            tokio::time::sleep(self.0).await;
            json!({"queued_messages": 1})
        }
    }

    #[tokio::test]
    async fn sleep_ends_on_input_its_timer_or_cancel_whichever_comes_first() {
        let woke =
            |outcome: ToolOutcome| -> Value { serde_json::from_str(&outcome.content).unwrap() };
        let mut ctx = context(None);
        ctx.input = Some(Arc::new(ArrivesAfter(Duration::from_millis(10))));
        let early = woke(Sleep.call(json!({"ms": 600000}), &ctx).await);
        assert_eq!(
            (&early["woke"], &early["waiting"]),
            (&json!("input"), &json!({"queued_messages": 1}))
        );
        ctx.input = Some(Arc::new(ArrivesAfter(Duration::from_secs(600))));
        assert_eq!(
            woke(Sleep.call(json!({"ms": 5}), &ctx).await)["woke"],
            "timer"
        );
        let child = context(None);
        assert_eq!(
            woke(Sleep.call(json!({"ms": 5}), &child).await)["woke"],
            "timer",
            "without an input watch (a child run) only the timer ends it"
        );
        ctx.cancel.cancel();
        assert_eq!(
            Sleep.call(json!({"ms": 600000}), &ctx).await,
            ToolOutcome::error("cancelled")
        );
    }
}
