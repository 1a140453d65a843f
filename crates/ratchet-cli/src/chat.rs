//! `ratchet chat`: an interactive client of a Ratchet server. Each line read from stdin is
//! a message in one session; the answer streams to stdout as it is written, with the tool
//! calls and their results as they happen. On a terminal, a status line on stderr fills the
//! waits: a spinner until the turn's first output, and what the step in flight is doing (the
//! server's live activity: "calling model gpt-x…", "running tools: a, b…") until the step
//! commits or shows output. `/quit` or end of input leaves.

use std::cell::RefCell;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use ratchet_core::RunStatus;
use tokio::sync::mpsc;

use crate::drive::{CHILD_SHOWN, show_progress, show_tree_progress};
use ratchet_client::{Api, EventView, LiveView};

#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// The server's URL.
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:7700")]
    pub server: String,
    /// The agent of the server's catalog that answers (default: the server's model).
    #[arg(long, value_name = "ID")]
    pub agent: Option<String>,
    /// Bearer token for the server.
    #[arg(
        long,
        value_name = "TOKEN",
        env = "RATCHET_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
}

pub async fn chat(args: ChatArgs) -> anyhow::Result<ExitCode> {
    let api = Api::new(&args.server, args.token, 4)?;
    let interactive = std::io::stdin().is_terminal();
    let spinner = interactive && std::io::stderr().is_terminal();
    let session = api.create_session(args.agent.as_deref()).await?;
    if interactive {
        eprintln!(
            "ratchet chat: {} (session {}); /quit or Ctrl-D leaves",
            api.base(),
            session.id
        );
    }
    let mut lines = crate::approve::stdin_lines();
    let mut stdout = std::io::stdout();
    loop {
        if interactive {
            let _ = write!(stdout, "> ");
            let _ = stdout.flush();
        }
        let line = match lines.recv().await {
            Some(line) => line?,
            None => {
                if interactive {
                    let _ = writeln!(stdout);
                }
                break;
            }
        };
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        if text == "/quit" {
            break;
        }
        if let Some(code) = turn(&api, &session.id, text, spinner, &mut lines).await? {
            return Ok(code);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Sends one message and shows its run until it ends. Returns an exit code when the chat
/// cannot go on: the run waits for a human, so the session takes no new message.
async fn turn(
    api: &Api,
    session_id: &str,
    text: &str,
    spinner: bool,
    lines: &mut mpsc::Receiver<std::io::Result<String>>,
) -> anyhow::Result<Option<ExitCode>> {
    let screen = RefCell::new(Screen {
        render: Render::default(),
        status: spinner.then(|| start_spinner("thinking…")),
        spinner,
        out: std::io::stdout(),
    });
    let accepted = match api.send_message(session_id, text).await {
        Ok(accepted) => accepted,
        Err(error) => {
            screen.borrow_mut().clear_status();
            return Err(error.into());
        }
    };
    let run = crate::approve::follow_answering(
        api,
        &accepted.run_id,
        lines,
        |event| screen.borrow_mut().event(event),
        |activity| screen.borrow_mut().activity(activity),
    )
    .await;
    let mut screen = screen.into_inner();
    screen.clear_status();
    let run = run?;
    screen.render.end_line(&mut screen.out);
    let reason = run.stop_reason.map_or("-".to_owned(), |r| r.to_string());
    if run.status.is_waiting() {
        eprintln!(
            "run {} is {} ({reason}): this session takes no new message until it is resolved",
            run.id, run.status
        );
        return Ok(Some(ExitCode::from(2)));
    }
    if run.status != RunStatus::Completed {
        eprintln!("run {} ended {} ({reason})", run.id, run.status);
    }
    Ok(None)
}

/// One turn's output: the answer and tool lines on stdout, the status line on stderr.
struct Screen {
    render: Render,
    /// The status line shown now, if any.
    status: Option<ProgressBar>,
    /// Status lines are drawn (stdin and stderr are a terminal).
    spinner: bool,
    out: std::io::Stdout,
}

impl Screen {
    fn event(&mut self, event: &EventView) {
        if Render::shows(event) || ends_step(event) {
            self.clear_status();
        }
        self.render.show(&mut self.out, event);
    }

    fn activity(&mut self, activity: &LiveView) {
        let Some(text) = status_line(&activity.payload) else {
            return;
        };
        if !self.spinner {
            return;
        }
        match &self.status {
            Some(bar) => bar.set_message(text),
            None => {
                // The status line goes below the answer, never into the middle of its line.
                self.render.end_line(&mut self.out);
                self.status = Some(start_spinner(&text));
            }
        }
    }

    fn clear_status(&mut self) {
        if let Some(bar) = self.status.take() {
            bar.finish_and_clear();
        }
    }
}

/// A step's activity is over once the step is committed (or the run ends without one).
fn ends_step(event: &EventView) -> bool {
    matches!(event.kind.as_str(), "step.committed" | "run.finished")
}

/// The status line of a live activity; `None` for an activity this client does not know.
fn status_line(payload: &serde_json::Value) -> Option<String> {
    match payload["activity"].as_str()? {
        "loading_context" => Some("loading context…".to_owned()),
        "calling_model" => Some(match payload["model"].as_str() {
            Some(model) => format!("calling model {model}…"),
            None => "calling the model…".to_owned(),
        }),
        "executing_tools" => {
            let tools: Vec<&str> = payload["tools"]
                .as_array()
                .map(|tools| tools.iter().filter_map(|t| t.as_str()).collect())
                .unwrap_or_default();
            Some(if tools.is_empty() {
                "running tools…".to_owned()
            } else {
                format!("running tools: {}…", tools.join(", "))
            })
        }
        _ => None,
    }
}

fn start_spinner(message: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(message.to_owned());
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// Shows a turn's events: streamed text as it comes, then tool lines on lines of their own.
#[derive(Default)]
struct Render {
    /// Text of the current assistant message has been shown from its deltas.
    streamed: bool,
    /// The cursor is not at the start of a line.
    mid_line: bool,
}

impl Render {
    fn shows(event: &EventView) -> bool {
        if event.depth > 0 {
            return CHILD_SHOWN.contains(&event.kind.as_str());
        }
        match event.kind.as_str() {
            "assistant.delta" => event.payload["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty()),
            "assistant.message" => event.payload["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty()),
            "tool.call"
            | "tool.result"
            | "model.error"
            | "reconciliation.required"
            | "subagent.started"
            | "subagent.finished" => true,
            _ => false,
        }
    }

    fn show(&mut self, out: &mut impl Write, event: &EventView) {
        if event.depth > 0 {
            if Render::shows(event) {
                self.end_line(out);
                show_tree_progress(out, event);
            }
            return;
        }
        match event.kind.as_str() {
            "assistant.delta" => {
                let text = event.payload["text"].as_str().unwrap_or_default();
                if !text.is_empty() {
                    let _ = write!(out, "{text}");
                    self.streamed = true;
                    self.mid_line = !text.ends_with('\n');
                }
            }
            "assistant.message" => {
                // A message whose deltas were not seen (none were sent) is shown whole.
                let content = event.payload["content"].as_str().unwrap_or_default();
                if !self.streamed && !content.is_empty() {
                    let _ = write!(out, "{content}");
                    self.mid_line = !content.ends_with('\n');
                }
                self.streamed = false;
                self.end_line(out);
            }
            "tool.call"
            | "tool.result"
            | "model.error"
            | "reconciliation.required"
            | "subagent.started"
            | "subagent.finished" => {
                self.end_line(out);
                show_progress(out, &event.kind, &event.payload);
            }
            _ => {}
        }
        let _ = out.flush();
    }

    fn end_line(&mut self, out: &mut impl Write) {
        if self.mid_line {
            let _ = writeln!(out);
            self.mid_line = false;
        }
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn event(kind: &str, payload: serde_json::Value) -> EventView {
        EventView {
            seq: 1,
            kind: kind.into(),
            payload,
            created_at: 0,
            depth: 0,
        }
    }

    fn child_event(depth: u32, kind: &str, payload: serde_json::Value) -> EventView {
        EventView {
            depth,
            ..event(kind, payload)
        }
    }

    #[test]
    fn each_activity_has_a_status_line_naming_what_it_waits_for() {
        for (payload, line) in [
            (
                json!({"activity": "loading_context", "step_index": 1}),
                Some("loading context…"),
            ),
            (
                json!({"activity": "calling_model", "model": "gpt-x"}),
                Some("calling model gpt-x…"),
            ),
            (
                json!({"activity": "executing_tools", "tools": ["add", "sleep_ms"]}),
                Some("running tools: add, sleep_ms…"),
            ),
            (
                json!({"activity": "executing_tools", "tools": []}),
                Some("running tools…"),
            ),
            (json!({"activity": "step_released"}), None),
            (json!({}), None),
        ] {
            assert_eq!(status_line(&payload).as_deref(), line, "{payload}");
        }
    }

    #[test]
    fn text_streams_and_tool_lines_stand_on_their_own() {
        let mut out = Vec::new();
        let mut render = Render::default();
        for e in [
            event("run.status", json!({"status": "running"})),
            event("assistant.delta", json!({"text": "Let me "})),
            event("assistant.delta", json!({"text": "add."})),
            event("assistant.message", json!({"content": "Let me add."})),
            event("step.committed", json!({})),
            event(
                "tool.call",
                json!({"call_id": "c0", "tool": "add", "arguments": {"a": 1}}),
            ),
            event("tool.result", json!({"call_id": "c0", "content": "2"})),
            // No deltas for this one: the message is shown whole.
            event("assistant.message", json!({"content": "It is 2."})),
            event("assistant.message", json!({"content": ""})),
        ] {
            render.show(&mut out, &e);
        }
        render.end_line(&mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "Let me add.\n  [c0] add {\"a\":1}\n  [c0] -> 2\nIt is 2.\n"
        );
    }

    #[test]
    fn a_childs_tool_calls_are_indented_by_its_depth_and_its_text_is_not_shown() {
        let mut out = Vec::new();
        let mut render = Render::default();
        for e in [
            event("assistant.delta", json!({"text": "Asking."})),
            event(
                "subagent.started",
                json!({"agent": "worker", "child_run_id": "run_c", "task": "count"}),
            ),
            child_event(1, "assistant.delta", json!({"text": "child text"})),
            child_event(
                1,
                "tool.call",
                json!({"call_id": "c1", "tool": "add", "arguments": {}}),
            ),
            child_event(
                1,
                "subagent.started",
                json!({"agent": "helper", "child_run_id": "run_g", "task": "t"}),
            ),
            child_event(2, "tool.result", json!({"call_id": "g1", "content": "3"})),
            child_event(1, "assistant.message", json!({"content": "child answer"})),
            event(
                "subagent.finished",
                json!({"agent": "worker", "child_run_id": "run_c", "status": "completed"}),
            ),
        ] {
            render.show(&mut out, &e);
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "Asking.\n  -> worker run_c: count\n    [c1] add {}\n    -> helper run_g: t\n      [g1] -> 3\n  <- worker run_c completed\n"
        );
    }
}
