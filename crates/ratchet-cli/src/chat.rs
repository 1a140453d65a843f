//! `ratchet chat`: an interactive client of a Ratchet server. Each line read from stdin is
//! a message in one session; the answer streams to stdout as it is written, with the tool
//! calls and their results as they happen. A spinner (on a terminal only) fills the wait for
//! a turn's first output. `/quit` or end of input leaves.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use ratchet_core::RunStatus;
use tokio::sync::mpsc;

use crate::client::{Api, EventView};
use crate::drive::show_progress;

pub struct ChatArgs {
    pub server: String,
    pub token: Option<String>,
}

pub async fn chat(args: ChatArgs) -> anyhow::Result<ExitCode> {
    let api = Api::new(&args.server, args.token, 4)?;
    let interactive = std::io::stdin().is_terminal();
    let spinner = interactive && std::io::stderr().is_terminal();
    let session = api.create_session().await?;
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
    let mut waiting = spinner.then(start_spinner);
    let clear = |waiting: &mut Option<ProgressBar>| {
        if let Some(bar) = waiting.take() {
            bar.finish_and_clear();
        }
    };
    let accepted = match api.send_message(session_id, text).await {
        Ok(accepted) => accepted,
        Err(error) => {
            clear(&mut waiting);
            return Err(error.into());
        }
    };
    let mut stdout = std::io::stdout();
    let mut render = Render::default();
    let run = crate::approve::follow_answering(api, &accepted.run_id, lines, |event| {
        if Render::shows(event) {
            clear(&mut waiting);
        }
        render.show(&mut stdout, event);
    })
    .await;
    clear(&mut waiting);
    let run = run?;
    render.end_line(&mut stdout);
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

fn start_spinner() -> ProgressBar {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message("thinking…");
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
        match event.kind.as_str() {
            "assistant.delta" => event.payload["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty()),
            "assistant.message" => event.payload["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty()),
            "tool.call" | "tool.result" | "model.error" | "reconciliation.required" => true,
            _ => false,
        }
    }

    fn show(&mut self, out: &mut impl Write, event: &EventView) {
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
            "tool.call" | "tool.result" | "model.error" | "reconciliation.required" => {
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
}
