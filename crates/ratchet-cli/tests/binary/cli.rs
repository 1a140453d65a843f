//! End-to-end tests of the `ratchet` binary: each test runs the real executable against its
//! own temporary SQLite database and workspace, drives it with scripted models, and checks
//! what a user sees (exit code, stdout, stderr) and what `ratchet runs` reports afterwards.
//!
//! Covered: multi-step runs with a parallel tool batch (JSON and human output), the model
//! retry path, the step budget, the parse-failure stop, tool errors that must reach the
//! model instead of failing the CLI (workspace escapes), `runs list`, and bad input of every
//! kind, which must fail cleanly and leave the database untouched.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

use crate::common::{output_within_deadline, report, stderr_of, stdout_of};

use serde_json::{Value, json};

/// Runs `ratchet ARGS` in `dir` and returns its output, within the common deadline.
fn ratchet(dir: &Path, args: &[&str]) -> Output {
    ratchet_fed(dir, args, "")
}

/// `ratchet ARGS` in `dir` with `stdin` as its input.
fn ratchet_fed(dir: &Path, args: &[&str], stdin: &str) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratchet"));
    command
        .args(args)
        .current_dir(dir)
        // The caller's environment must not change which database or log level is used.
        .env_remove("RATCHET_DB")
        .env_remove("RATCHET_LOG");
    output_within_deadline(&mut command, stdin)
}

fn db_url(dir: &Path) -> String {
    format!("sqlite://{}/r.db", dir.display())
}

/// Writes `script` to `dir/name` and returns the model spec that uses it.
fn script(dir: &Path, name: &str, script: &Value) -> String {
    std::fs::write(dir.join(name), script.to_string()).unwrap();
    format!("scripted:{name}")
}

/// `ratchet run` with `dir` as both the database's directory and the workspace.
fn run(dir: &Path, model: &str, extra: &[&str]) -> Output {
    let db = db_url(dir);
    let workspace = dir.display().to_string();
    let mut args = vec![
        "run",
        "--db",
        &db,
        "--workspace",
        &workspace,
        "--model",
        model,
    ];
    args.extend_from_slice(extra);
    ratchet(dir, &args)
}

/// `ratchet runs show RUN --json`, which must succeed.
fn show(dir: &Path, run_id: &str) -> Value {
    let output = ratchet(
        dir,
        &["runs", "show", run_id, "--db", &db_url(dir), "--json"],
    );
    assert!(output.status.success(), "{}", stderr_of(&output));
    serde_json::from_slice(&output.stdout).unwrap()
}

/// `ratchet runs list --json`, which must succeed.
fn list(dir: &Path) -> Vec<Value> {
    let output = ratchet(dir, &["runs", "list", "--db", &db_url(dir), "--json"]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    serde_json::from_slice(&output.stdout).unwrap()
}

fn instructions(shown: &Value) -> Vec<&str> {
    shown["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["instruction"].as_str().unwrap())
        .collect()
}

/// Two tool round-trips, the second a batch of three calls whose first call (a sleep)
/// finishes last, so completion order differs from call order.
fn multi_step_script() -> Value {
    json!({"replies": [
        {"text": "Adding first.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]},
        {"text": "Now a batch.", "tool_calls": [
            {"name": "sleep_ms", "arguments": {"ms": 200}},
            {"name": "add", "arguments": {"a": 3, "b": 4}},
            {"name": "append_line", "arguments": {"path": "log.txt", "line": "batch line"}}
        ]},
        {"text": "The sums are 3 and 7."}
    ]})
}

#[test]
fn a_multi_step_run_reports_one_json_object_and_a_contiguous_step_history() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), "script.json", &multi_step_script());
    let output = run(dir.path(), &model, &["--json", "add some numbers"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let report = report(&output);
    assert_eq!(report["status"], "completed");
    assert_eq!(report["stop_reason"], "completed");
    assert_eq!(report["final_answer"], "The sums are 3 and 7.");
    assert_eq!(report["steps"], 5);

    let shown = show(dir.path(), report["run_id"].as_str().unwrap());
    assert_eq!(shown["run_id"], report["run_id"]);
    assert_eq!(shown["session_id"], report["session_id"]);
    assert_eq!(shown["status"], "completed");
    assert_eq!(shown["step_index"], 5);
    let indices: Vec<u64> = shown["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [1, 2, 3, 4, 5]);
    assert_eq!(
        instructions(&shown),
        [
            "call_llm",
            "call_tools_batch",
            "call_llm",
            "call_tools_batch",
            "call_llm"
        ]
    );
    assert_eq!(
        shown["steps"][3]["summary"],
        json!({"calls": ["sleep_ms", "add", "append_line"], "errors": 0, "invalid": 0})
    );
    assert_eq!(shown["counters"]["tool_calls"], 4);
    assert_eq!(shown["counters"]["model_calls"], 3);

    // A `never`-replay side effect happens exactly once.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("log.txt")).unwrap(),
        "batch line\n"
    );

    // Results are committed in the model's call order, not the order the calls finished in
    // (the sleep finished last); the progress stream prints them as committed.
    let stderr = stderr_of(&output);
    let position = |needle: &str| {
        stderr
            .find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not in stderr:\n{stderr}"))
    };
    let results = [
        position("[call_1_0] -> slept 200 ms"),
        position("[call_1_1] -> 7"),
        position("[call_1_2] -> appended 1 line to log.txt"),
    ];
    assert!(results.is_sorted(), "results out of call order:\n{stderr}");
    position("[call_0_0] -> 3");
}

#[test]
fn without_json_the_answer_goes_to_stdout_and_the_stream_to_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(dir.path(), "script.json", &multi_step_script());
    let output = run(dir.path(), &model, &["add some numbers"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    assert_eq!(stdout_of(&output), "The sums are 3 and 7.\n");
    let stderr = stderr_of(&output);
    for streamed in [
        "Adding first.",
        "Now a batch.",
        "The sums are 3 and 7.",
        "[call_0_0] add {\"a\":1,\"b\":2}",
        "[call_1_1] -> 7",
    ] {
        assert!(
            stderr.contains(streamed),
            "{streamed:?} not in stderr:\n{stderr}"
        );
    }
}

#[test]
fn a_failed_model_call_is_retried_without_costing_a_step() {
    let replies = |first_error: Option<&str>, second_error: Option<&str>| {
        let mut first = json!({"text": "Adding.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]});
        let mut second = json!({"text": "One and one make 2."});
        if let Some(error) = first_error {
            first["error"] = json!(error);
        }
        if let Some(error) = second_error {
            second["error"] = json!(error);
        }
        json!({"replies": [first, second]})
    };

    let clean = tempfile::tempdir().unwrap();
    let model = script(clean.path(), "script.json", &replies(None, None));
    let output = run(clean.path(), &model, &["--json", "add"]);
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let clean_report = report(&output);
    let clean_shown = show(clean.path(), clean_report["run_id"].as_str().unwrap());

    let flaky = tempfile::tempdir().unwrap();
    let model = script(
        flaky.path(),
        "script.json",
        &replies(Some("http_500"), Some("http_429")),
    );
    let started = Instant::now();
    let output = run(flaky.path(), &model, &["--json", "add"]);
    let elapsed = started.elapsed();
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let flaky_report = report(&output);
    assert_eq!(flaky_report["status"], "completed");
    assert_eq!(flaky_report["final_answer"], "One and one make 2.");
    assert_eq!(flaky_report["steps"], clean_report["steps"]);
    let flaky_shown = show(flaky.path(), flaky_report["run_id"].as_str().unwrap());
    assert_eq!(instructions(&flaky_shown), instructions(&clean_shown));
    assert_eq!(flaky_shown["counters"]["model_calls"], 2);

    // The CLI does not print retries, so the time is the evidence that both failures really
    // happened: each failed attempt waits out the pool's backoff before the next one.
    let backoff = ratchet_engine::PoolConfig::default().retry_backoff;
    assert!(
        elapsed >= 2 * backoff,
        "two retries should take at least {:?}, took {elapsed:?}",
        2 * backoff
    );
}

#[test]
fn the_step_budget_ends_a_run_that_keeps_calling_tools() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(
        dir.path(),
        "script.json",
        &json!({"replies": [{"text": "Again.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]}]}),
    );
    let output = run(dir.path(), &model, &["--max-steps", "3", "--json", "loop"]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    let report = report(&output);
    assert_eq!(report["status"], "failed");
    assert_eq!(report["stop_reason"], "budget_exhausted");
    assert!(report["steps"].as_u64().unwrap() <= 3, "{report}");

    let shown = show(dir.path(), report["run_id"].as_str().unwrap());
    let steps = shown["steps"].as_array().unwrap();
    assert!(steps.len() <= 3, "{shown}");
    // The last model call is made without tools so that the run can still conclude.
    let last = steps.last().unwrap();
    assert_eq!(last["instruction"], "call_llm");
    assert_eq!(last["summary"]["conclude"], true);
    assert_eq!(last["summary"]["tool_calls"], 0);

    // A spent run goes on only with more budget, and only by `continue`.
    let (db, run_id) = (db_url(dir.path()), report["run_id"].as_str().unwrap());
    for (args, message) in [
        (vec!["runs", "retry", run_id], "use continue"),
        (vec!["runs", "continue", run_id], "budget is spent"),
    ] {
        let refused = ratchet(dir.path(), &[&args[..], &["--db", &db]].concat());
        assert_eq!(refused.status.code(), Some(1), "{args:?}");
        assert!(
            stderr_of(&refused).contains(message),
            "{}",
            stderr_of(&refused)
        );
    }
    let continued = ratchet(
        dir.path(),
        &[
            "runs",
            "continue",
            run_id,
            "--extra-steps",
            "2",
            "--db",
            &db,
        ],
    );
    assert!(continued.status.success(), "{}", stderr_of(&continued));
    assert!(stdout_of(&continued).contains("running again"));
    let resumed = ratchet(dir.path(), &["resume", "--db", &db, "--json"]);
    let again = crate::common::report(&resumed);
    // Two more steps leave no room for a tool round-trip: one concluding call, which still
    // asks for tools, ends the run again.
    assert_eq!(
        (&again["status"], &again["steps"]),
        (&json!("failed"), &json!(4)),
        "{again}"
    );
}

#[test]
fn model_call_and_tool_call_budgets_end_a_run_that_keeps_calling_tools() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(
        dir.path(),
        "script.json",
        &json!({"replies": [{"text": "Again.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]}]}),
    );
    let output = run(
        dir.path(),
        &model,
        &["--max-model-calls", "3", "--json", "loop"],
    );
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    let by_calls = report(&output);
    assert_eq!(by_calls["stop_reason"], "budget_exhausted");
    let shown = show(dir.path(), by_calls["run_id"].as_str().unwrap());
    assert_eq!(shown["counters"]["model_calls"], 3, "{shown}");
    assert_eq!(
        shown["steps"].as_array().unwrap().last().unwrap()["summary"]["conclude"],
        true
    );

    let output = run(
        dir.path(),
        &model,
        &["--max-tool-calls", "2", "--json", "loop"],
    );
    let by_tools = report(&output);
    assert_eq!(by_tools["stop_reason"], "budget_exhausted");
    let shown = show(dir.path(), by_tools["run_id"].as_str().unwrap());
    assert_eq!(shown["counters"]["tool_calls"], 2, "{shown}");

    let refused = run(dir.path(), &model, &["--max-model-calls", "0", "loop"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr_of(&refused).contains("--max-model-calls must be at least 1"),
        "{}",
        stderr_of(&refused)
    );
}

/// `max_duration_ms` is a hard deadline: a tool still running when it passes is cut off, and
/// the run ends `timed_out` with exit code 1.
#[test]
fn a_run_past_its_duration_ends_timed_out_even_inside_a_long_tool_call() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(
        dir.path(),
        "script.json",
        &json!({"replies": [
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 600000}}]},
            {"text": "never reached"}
        ]}),
    );
    let output = run(
        dir.path(),
        &model,
        &["--max-duration-ms", "800", "--json", "wait"],
    );
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    let report = report(&output);
    assert_eq!(report["stop_reason"], "timed_out", "{report}");
    assert_eq!(report["status"], "failed", "{report}");
}

#[test]
fn invalid_tool_arguments_end_the_run_after_repeated_parse_failures() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(
        dir.path(),
        "script.json",
        &json!({"replies": [{"tool_calls": [{"name": "add", "arguments": {"a": "x"}}]}]}),
    );
    let output = run(dir.path(), &model, &["--json", "add badly"]);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    let report = report(&output);
    assert_eq!(report["status"], "failed");
    assert_eq!(report["stop_reason"], "parse_failures");

    let shown = show(dir.path(), report["run_id"].as_str().unwrap());
    let batches: Vec<&Value> = shown["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["instruction"] == "call_tools_batch")
        .collect();
    assert_eq!(batches.len(), 3, "{shown}");
    for batch in batches {
        assert_eq!(
            batch["summary"],
            json!({"calls": ["add"], "errors": 1, "invalid": 1})
        );
    }
    assert_eq!(shown["counters"]["consecutive_parse_failures"], 3);
    // The model was told why its call was rejected.
    assert!(
        stderr_of(&output).contains("invalid arguments for add"),
        "{}",
        stderr_of(&output)
    );
}

#[test]
fn a_tool_escaping_the_workspace_is_an_error_the_model_sees_not_a_cli_failure() {
    let dir = tempfile::tempdir().unwrap();
    // The workspace is a subdirectory, so `..` would land in `dir`, where it can be seen.
    let workspace = dir.path().join("ws");
    std::fs::create_dir(&workspace).unwrap();
    let outside = dir.path().join("absolute.txt");
    let model = script(
        dir.path(),
        "script.json",
        &json!({"replies": [
            {"text": "Writing.", "tool_calls": [
                {"name": "append_line", "arguments": {"path": "../escape.txt", "line": "out"}},
                {"name": "append_line", "arguments": {"path": "inside.txt", "line": "in"}}
            ]},
            {"text": "Once more.", "tool_calls": [
                {"name": "append_line", "arguments": {"path": outside.display().to_string(), "line": "out"}}
            ]},
            {"text": "Both escapes were refused."}
        ]}),
    );
    let db = db_url(dir.path());
    let output = ratchet(
        dir.path(),
        &[
            "run",
            "--db",
            &db,
            "--workspace",
            workspace.to_str().unwrap(),
            "--model",
            &model,
            "--json",
            "write files",
        ],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr_of(&output));
    let report = report(&output);
    assert_eq!(report["status"], "completed");
    assert_eq!(report["final_answer"], "Both escapes were refused.");

    assert!(!dir.path().join("escape.txt").exists());
    assert!(!outside.exists());
    assert_eq!(
        std::fs::read_to_string(workspace.join("inside.txt")).unwrap(),
        "in\n"
    );

    let shown = show(dir.path(), report["run_id"].as_str().unwrap());
    assert_eq!(
        shown["steps"][1]["summary"],
        json!({"calls": ["append_line", "append_line"], "errors": 1, "invalid": 0})
    );
    assert_eq!(
        shown["steps"][3]["summary"],
        json!({"calls": ["append_line"], "errors": 1, "invalid": 0})
    );
    let stderr = stderr_of(&output);
    for refusal in [
        "[call_0_0] -> path \"../escape.txt\" escapes the workspace",
        "[call_1_0] -> path",
        "is absolute",
    ] {
        assert!(
            stderr.contains(refusal),
            "{refusal:?} not in stderr:\n{stderr}"
        );
    }
}

/// The tool results `ratchet run` streamed on stderr.
fn tool_results(output: &Output) -> Vec<String> {
    stderr_of(output)
        .lines()
        .filter_map(|line| {
            line.split_once("] -> ")
                .map(|(_, result)| result.to_owned())
        })
        .collect()
}

#[test]
fn memory_search_finds_another_sessions_messages_only_with_the_tenant_scope() {
    let dir = tempfile::tempdir().unwrap();
    let note = script(
        dir.path(),
        "note.json",
        &json!({"replies": [{"text": "Noted."}]}),
    );
    let told = report(&run(
        dir.path(),
        &note,
        &["--json", "the launch code is zebra seven"],
    ));
    assert_eq!(told["status"], "completed");
    let search = script(
        dir.path(),
        "search.json",
        &json!({"replies": [
            {"tool_calls": [{"name": "memory_search", "arguments": {"query": "zebra code"}}]},
            {"text": "Searched."}
        ]}),
    );

    // Each `ratchet run` is a session of its own: by default its memory is that session.
    let alone = run(dir.path(), &search, &["--json", "what did I say?"]);
    assert_eq!(alone.status.code(), Some(0), "{}", stderr_of(&alone));
    assert_eq!(tool_results(&alone), ["no matches for \"zebra code\""]);

    let wide = run(
        dir.path(),
        &search,
        &["--memory-scope", "tenant", "--json", "what did I say?"],
    );
    assert_eq!(wide.status.code(), Some(0), "{}", stderr_of(&wide));
    let results = tool_results(&wide);
    assert_eq!(results.len(), 1, "{results:?}");
    let found: Value = serde_json::from_str(&results[0]).unwrap();
    assert_eq!(
        found["matches"],
        json!([{
            "session_id": told["session_id"],
            "run_id": told["run_id"],
            "message_id": found["matches"][0]["message_id"],
            "role": "user",
            "at": found["matches"][0]["at"],
            "text": "the launch **code** is **zebra** seven",
        }]),
        "the earlier run's message, from its own session"
    );
}

#[test]
fn runs_list_shows_every_run_with_its_status() {
    let dir = tempfile::tempdir().unwrap();
    let answer = script(
        dir.path(),
        "answer.json",
        &json!({"replies": [{"text": "Hello."}]}),
    );
    let completed = report(&run(dir.path(), &answer, &["--json", "hi"]));
    let looping = script(
        dir.path(),
        "loop.json",
        &json!({"replies": [{"tool_calls": [{"name": "now"}]}]}),
    );
    let failed = report(&run(
        dir.path(),
        &looping,
        &["--max-steps", "1", "--json", "loop"],
    ));

    let runs = list(dir.path());
    assert_eq!(runs.len(), 2, "{runs:?}");
    for expected in [&completed, &failed] {
        let listed = runs
            .iter()
            .find(|r| r["run_id"] == expected["run_id"])
            .unwrap_or_else(|| panic!("{} not listed: {runs:?}", expected["run_id"]));
        assert_eq!(listed["session_id"], expected["session_id"]);
        assert_eq!(listed["status"], expected["status"]);
        assert_eq!(listed["stop_reason"], expected["stop_reason"]);
        assert_eq!(listed["step_index"], expected["steps"]);
    }
    assert_eq!(completed["status"], "completed");
    assert_eq!(failed["status"], "failed");
}

/// Checks a command that must be refused: exit `code`, `message` on stderr, nothing on
/// stdout, and no database created in `dir`.
fn assert_refused(case: &str, dir: &Path, output: &Output, code: i32, message: &str) {
    let stderr = stderr_of(output);
    assert_eq!(output.status.code(), Some(code), "{case}: {stderr}");
    assert!(
        stderr.contains(message),
        "{case}: {message:?} not in stderr:\n{stderr}"
    );
    assert!(
        stdout_of(output).is_empty(),
        "{case}: {}",
        stdout_of(output)
    );
    assert!(
        !dir.join("r.db").exists(),
        "{case}: a refused command created the database"
    );
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort_unstable();
    names
}

#[test]
fn bad_run_input_is_refused_before_anything_is_written() {
    let cases: [(&str, &[&str], &str); 13] = [
        (
            "unknown model kind",
            &["--model", "gpt:4", "hi"],
            "\"gpt\" is none of them",
        ),
        (
            "unknown model profile",
            &["--model", "fast", "hi"],
            "no model profile \"fast\"; profiles: none configured",
        ),
        (
            "missing config file",
            &["--config", "nope.toml", "hi"],
            "cannot read nope.toml",
        ),
        (
            "unreadable script",
            &["--model", "scripted:/nonexistent.json", "hi"],
            "cannot read script file \"/nonexistent.json\"",
        ),
        (
            "malformed script",
            &["--model", "scripted:malformed.json", "hi"],
            "EOF while parsing",
        ),
        (
            "script calling an unknown tool",
            &["--model", "scripted:unknown_tool.json", "hi"],
            "calls unknown tool \"rm_rf\"",
        ),
        ("empty message", &[""], "MESSAGE is empty"),
        ("blank message", &["  \n"], "MESSAGE is empty"),
        (
            "zero step budget",
            &["--max-steps", "0", "hi"],
            "--max-steps must be at least 1",
        ),
        (
            "missing workspace",
            &["--workspace", "missing", "hi"],
            "is not an existing directory",
        ),
        (
            "workspace that is a file",
            &["--workspace", "file.txt", "hi"],
            "is not a directory",
        ),
        (
            "unsupported database url",
            &["--db", "mysql://x", "hi"],
            "unsupported database url \"mysql://x\"",
        ),
        (
            "unreachable database server",
            &["--db", "postgres://nobody@127.0.0.1:1/none", "hi"],
            "cannot connect to PostgreSQL",
        ),
    ];
    for (case, args, message) in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("malformed.json"), r#"{"replies": ["#).unwrap();
        std::fs::write(
            dir.path().join("unknown_tool.json"),
            r#"{"replies": [{"tool_calls": [{"name": "rm_rf"}]}]}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("file.txt"), "").unwrap();
        let before = entries(dir.path());
        // Each case changes one input; clap refuses a repeated flag, so a default is only
        // given when the case does not give that flag itself.
        let db = db_url(dir.path());
        let mut full = vec!["run"];
        for (flag, value) in [
            ("--db", db.as_str()),
            ("--workspace", "."),
            ("--model", "scripted:demo"),
        ] {
            if !args.contains(&flag) {
                full.extend([flag, value]);
            }
        }
        full.extend_from_slice(args);
        let output = ratchet(dir.path(), &full);
        assert_refused(case, dir.path(), &output, 1, message);
        assert_eq!(entries(dir.path()), before, "{case}: files were written");
    }
}

#[test]
fn a_database_in_a_missing_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let output = ratchet(
        dir.path(),
        &[
            "run",
            "--db",
            "sqlite:///nonexistent-dir/x.db",
            "--workspace",
            ".",
            "hi",
        ],
    );
    assert_refused(
        "run",
        dir.path(),
        &output,
        1,
        "directory /nonexistent-dir does not exist",
    );
    assert!(!Path::new("/nonexistent-dir").exists());
    let output = ratchet(
        dir.path(),
        &["runs", "list", "--db", "sqlite:///nonexistent-dir/x.db"],
    );
    assert_refused(
        "runs list",
        dir.path(),
        &output,
        1,
        "database /nonexistent-dir/x.db does not exist",
    );
    assert!(!Path::new("/nonexistent-dir").exists());
}

#[test]
fn reading_commands_never_create_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let db = db_url(dir.path());
    for args in [
        vec!["runs", "list", "--db", &db],
        vec!["runs", "show", "run_abc", "--db", &db],
        vec!["resume", "--db", &db],
    ] {
        let output = ratchet(dir.path(), &args);
        assert_refused(&args.join(" "), dir.path(), &output, 1, "does not exist");
    }
}

/// `serve` and `worker` check their pool settings (flags and config file alike), and every
/// command told `--no-migrate` checks its database, before anything is opened or created.
#[test]
fn bad_process_settings_and_unmigrated_databases_are_refused() {
    let cases: [(&str, &[&str], &str); 8] = [
        (
            "a worker without workers",
            &["worker", "--workers", "0"],
            "--workers must be at least 1 for `ratchet worker`",
        ),
        (
            "a lease too short",
            &["worker", "--lease-ms", "50"],
            "lease_ms (--lease-ms) must be at least 100, found 50",
        ),
        (
            "a heartbeat as long as the lease",
            &["serve", "--lease-ms", "1000", "--heartbeat-ms", "1000"],
            "must be at least 1 and shorter than the lease (1000 ms), found 1000",
        ),
        (
            "no poll interval",
            &["serve", "--poll-ms", "0"],
            "poll_ms (--poll-ms) must be at least 1",
        ),
        (
            "a lease too short in the config file",
            &["worker", "--config", "short.toml"],
            "lease_ms (--lease-ms) must be at least 100, found 10",
        ),
        (
            "a worker on a database never migrated",
            &["worker", "--no-migrate"],
            "without migrating it (--no-migrate); apply the migrations first with `ratchet migrate",
        ),
        (
            "a server on a database never migrated",
            &["serve", "--no-migrate", "--workers", "0"],
            "without migrating it (--no-migrate)",
        ),
        (
            "a run on a database never migrated",
            &["run", "--no-migrate", "hi"],
            "without migrating it (--no-migrate)",
        ),
    ];
    for (case, args, message) in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("short.toml"), "lease_ms = 10\n").unwrap();
        let db = db_url(dir.path());
        let mut full = args.to_vec();
        full.extend(["--db", &db]);
        let output = ratchet(dir.path(), &full);
        assert_refused(case, dir.path(), &output, 1, message);
    }
}

/// `migrate` creates the schema, says so, changes nothing the second time, and then a process
/// told `--no-migrate` accepts the database.
#[test]
fn migrate_applies_the_schema_once_and_no_migrate_then_accepts_it() {
    let dir = tempfile::tempdir().unwrap();
    let db = db_url(dir.path());
    let version = ratchet_sqlite::SCHEMA_VERSION;
    let first = ratchet(dir.path(), &["migrate", "--db", &db]);
    assert!(first.status.success(), "{}", stderr_of(&first));
    assert_eq!(
        stdout_of(&first),
        format!("schema version {version} (migrated from 0)\n")
    );
    let again = ratchet(dir.path(), &["migrate", "--db", &db]);
    assert_eq!(
        stdout_of(&again),
        format!("schema version {version} (up to date)\n")
    );
    let output = run(
        dir.path(),
        "scripted:demo",
        &["--no-migrate", "--json", "hi"],
    );
    assert_eq!(
        report(&output)["status"],
        "completed",
        "{}",
        stderr_of(&output)
    );
}

#[test]
fn an_unknown_flag_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let output = ratchet(
        dir.path(),
        &["run", "--db", &db_url(dir.path()), "--bogus", "hi"],
    );
    // 64 is EX_USAGE, which the CLI returns for every argument error clap reports.
    assert_refused(
        "--bogus",
        dir.path(),
        &output,
        64,
        "unexpected argument '--bogus'",
    );
}

#[test]
fn runs_show_refuses_missing_and_malformed_ids() {
    let dir = tempfile::tempdir().unwrap();
    let db = db_url(dir.path());
    let output = ratchet(dir.path(), &["runs", "show", "not-an-id", "--db", &db]);
    assert_refused(
        "not-an-id",
        dir.path(),
        &output,
        1,
        "invalid run id \"not-an-id\"",
    );

    let existing = report(&run(dir.path(), "scripted:demo", &["--json", "hi"]));
    let output = ratchet(
        dir.path(),
        &["runs", "show", "run_doesnotexist", "--db", &db],
    );
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("run run_doesnotexist not found"),
        "{stderr}"
    );
    assert!(stdout_of(&output).is_empty(), "{}", stdout_of(&output));
    let runs = list(dir.path());
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0]["run_id"], existing["run_id"]);
}

/// The ids of the tree `write_tree` stores: a root that delegated to `a` and `b`, and `b` to
/// `c`. Ids are chosen so that runs started together are listed in this order.
const TREE: [&str; 4] = ["run_tree-root", "run_tree-a", "run_tree-b", "run_tree-c"];

/// Writes a run tree through the store, as the workers would: the root delegates two tasks
/// to `worker` (a completes; b delegates one task, c, which fails on its budget). The root
/// still waits for its children; b was woken by c's end and is running again.
fn write_tree(db: &str) {
    use ratchet_core::delegation::{ChildRun, await_children, delegate_tool};
    use ratchet_core::step::{after_model, finish_step};
    use ratchet_core::{
        AgentProfile, DelegationConfig, Lineage, MessageId, ModelReply, RunConfigSnapshot, RunId,
        SessionId, StepResult, StopReason, ToolCall,
    };
    use ratchet_store::{ClaimedStep, Commit, Lease, NewRun, SessionSpec, Store, WhenBusy};

    let leaf = RunConfigSnapshot {
        model: "scripted:demo".into(),
        ..RunConfigSnapshot::default()
    };
    let delegating = |config: RunConfigSnapshot| {
        let worker = AgentProfile {
            id: "worker".into(),
            description: "does the work".into(),
            config,
        };
        RunConfigSnapshot {
            tools: vec![delegate_tool(std::slice::from_ref(&worker))],
            delegation: DelegationConfig {
                agents: vec![worker],
                ..DelegationConfig::default()
            },
            ..leaf.clone()
        }
    };
    let root_config = delegating(delegating(leaf.clone()));
    let run = |id: &str| RunId::parse(id).unwrap();
    let now = 1_800_000_000_000;
    let store = ratchet_sqlite::open_url(db).unwrap();
    let claim = async |store: &dyn Store, id: &RunId| -> ClaimedStep {
        let lease = Lease {
            owner: "test".into(),
            expires_at: now + 60_000,
        };
        let claimed = store.claim_next(lease, Some(id), now).await.unwrap();
        let claimed = claimed.unwrap_or_else(|| panic!("no job of {id}"));
        assert_eq!(&claimed.job.run_id, id);
        claimed
    };
    let commit = async |store: &dyn Store, step: &ClaimedStep, result: StepResult| {
        let committed = store.commit_step(&step.claim, result, None, now).await;
        assert!(
            matches!(committed, Ok(Commit::Committed { .. })),
            "{committed:?}"
        );
    };
    // A model step asking `worker` for one task each of `tasks`, then the tools step that
    // starts them as children with the given ids.
    let delegate = async |store: &dyn Store, parent: &RunId, tasks: &[&str]| {
        let model = claim(store, parent).await;
        let arguments = json!({"mode": "foreground", "tasks": tasks
            .iter()
            .map(|t| json!({"agent": "worker", "task": t}))
            .collect::<Vec<_>>()});
        let reply = ModelReply {
            tool_calls: vec![ToolCall {
                id: "call-d".into(),
                name: "delegate".into(),
                arguments,
            }],
            ..ModelReply::default()
        };
        let asked = after_model(model.state.clone(), &model.job, reply, false, now, now);
        commit(store, &model, asked).await;
        let tools = claim(store, parent).await;
        let state = &tools.state;
        let (root_run_id, root_session_id, depth) = match &state.lineage {
            Some(l) => (l.root_run_id.clone(), l.root_session_id.clone(), l.depth),
            None => (state.run_id.clone(), state.session_id.clone(), 0),
        };
        let worker = state.config.delegation.agent("worker").unwrap();
        let children = (0u32..)
            .zip(tasks)
            .map(|(index, id)| ChildRun {
                run_id: run(id),
                session_id: SessionId::parse(&id.replace("run_", "ses_")).unwrap(),
                message_id: MessageId::parse(&id.replace("run_", "msg_")).unwrap(),
                task: format!("task for {id}"),
                call_id: "call_0".into(),
                config: worker.config.clone(),
                lineage: Lineage {
                    parent_run_id: parent.clone(),
                    parent_step: tools.job.step_index,
                    parent_slot: 0,
                    task_index: index,
                    root_run_id: root_run_id.clone(),
                    root_session_id: root_session_id.clone(),
                    depth: depth + 1,
                    agent: "worker".into(),
                    background: None,
                },
            })
            .collect();
        let waiting = await_children(
            tools.state.clone(),
            &tools.job,
            vec![None],
            children,
            now,
            now,
        );
        commit(store, &tools, waiting).await;
    };
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store: &dyn Store = &store;
        let session = SessionId::parse("ses_tree-root").unwrap();
        store
            .create_session(&session, SessionSpec::default(), now)
            .await
            .unwrap();
        let root = NewRun {
            session_id: session,
            run_id: run(TREE[0]),
            message_id: MessageId::parse("msg_tree-root").unwrap(),
            content: "split the work".into(),
            config: root_config,
            when_busy: WhenBusy::Enqueue,
            quota: Default::default(),
            trace: None,
            request: None,
        };
        store.submit_message(root, now).await.unwrap();
        delegate(store, &run(TREE[0]), &TREE[1..3]).await;
        let a = claim(store, &run(TREE[1])).await;
        let answered = ModelReply {
            text: "done".into(),
            ..ModelReply::default()
        };
        commit(
            store,
            &a,
            after_model(a.state.clone(), &a.job, answered, false, now, now),
        )
        .await;
        delegate(store, &run(TREE[2]), &TREE[3..]).await;
        let c = claim(store, &run(TREE[3])).await;
        let spent = finish_step(
            c.state.clone(),
            &c.job,
            StopReason::BudgetExhausted,
            now,
            now,
        );
        commit(store, &c, spent).await;
    });
}

#[test]
fn runs_show_draws_the_runs_below_a_run_and_lists_them_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let db = db_url(dir.path());
    write_tree(&db);
    let [root, a, b, c] = TREE;
    let output = ratchet(dir.path(), &["runs", "show", root, "--db", &db]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    let text = stdout_of(&output);
    let drawn: Vec<&str> = text.lines().skip_while(|line| *line != "tree:").collect();
    assert_eq!(
        drawn,
        [
            "tree:".to_owned(),
            format!("{root}  waiting_children  2 steps"),
            format!("├─ {a}  worker  completed  1 step"),
            format!("└─ {b}  worker  running  2 steps"),
            format!("   └─ {c}  worker  failed (budget_exhausted)  1 step"),
        ],
        "{text}"
    );

    let shown = show(dir.path(), root);
    let nodes: Vec<(&str, Option<&str>, u64, &str)> = shown["tree"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["run_id"].as_str().unwrap(),
                n["parent_run_id"].as_str(),
                n["depth"].as_u64().unwrap(),
                n["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        nodes,
        [
            (root, None, 0, "waiting_children"),
            (a, Some(root), 1, "completed"),
            (b, Some(root), 1, "running"),
            (c, Some(b), 2, "failed"),
        ]
    );

    // A run with nothing below it draws no tree; its JSON tree is the run alone.
    let leaf = ratchet(dir.path(), &["runs", "show", a, "--db", &db]);
    assert!(leaf.status.success(), "{}", stderr_of(&leaf));
    assert!(!stdout_of(&leaf).contains("tree:"), "{}", stdout_of(&leaf));
    let leaf_tree = &show(dir.path(), a)["tree"];
    assert_eq!(leaf_tree.as_array().unwrap().len(), 1, "{leaf_tree}");
    assert_eq!(leaf_tree[0]["run_id"], a);
}

/// A batch of a guarded `append_line` and an unguarded `add`, then an answer.
fn guarded_script() -> Value {
    json!({"replies": [
        {"text": "Writing.", "tool_calls": [
            {"name": "append_line", "arguments": {"path": "log.txt", "line": "guarded line"}},
            {"name": "add", "arguments": {"a": 1, "b": 2}}
        ]},
        {"text": "Written."}
    ]})
}

/// `ratchet run` of the guarded script in `dir` with `append_line` gated, `extra` before its
/// message.
fn guarded_args(dir: &Path, extra: &[&str]) -> Vec<String> {
    let model = script(dir, "guarded.json", &guarded_script());
    let (db, workspace) = (db_url(dir), dir.display().to_string());
    let mut args: Vec<String> = [
        "run",
        "--db",
        &db,
        "--workspace",
        &workspace,
        "--model",
        &model,
        "--require-approval",
        "append_line",
        "--json",
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(extra.iter().map(|a| (*a).to_owned()));
    args.push("write it".to_owned());
    args
}

fn run_guarded(dir: &Path, stdin: &str) -> Output {
    let args = guarded_args(dir, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ratchet_fed(dir, &args, stdin)
}

#[test]
fn a_gated_batch_is_asked_about_at_the_prompt() {
    let approved = tempfile::tempdir().unwrap();
    let output = run_guarded(approved.path(), "y\n");
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(report(&output)["status"], "completed");
    assert!(stderr.contains("approval apr_"), "{stderr}");
    assert!(
        stderr.contains("append_line") && stderr.contains("(needs approval)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("add") && stderr.contains("(held with its batch)"),
        "{stderr}"
    );
    let log = std::fs::read_to_string(approved.path().join("log.txt")).unwrap();
    assert_eq!(log, "guarded line\n");

    let denied = tempfile::tempdir().unwrap();
    let output = run_guarded(denied.path(), "maybe\nn\n");
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("\"maybe\" is not an answer"), "{stderr}");
    assert!(
        stderr.contains("denied by a human"),
        "the model sees the denial: {stderr}"
    );
    assert!(
        !denied.path().join("log.txt").exists(),
        "a denied call never runs"
    );
    let run_id = report(&output)["run_id"].as_str().unwrap().to_owned();
    assert_eq!(
        show(denied.path(), &run_id)["counters"]["tool_calls"],
        2,
        "both calls have results"
    );

    let aborted = tempfile::tempdir().unwrap();
    let output = run_guarded(aborted.path(), "a\n");
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    let report = report(&output);
    assert_eq!(
        (&report["status"], &report["stop_reason"]),
        (&json!("cancelled"), &json!("cancelled"))
    );
    assert!(!aborted.path().join("log.txt").exists());
}

/// The deadline holds while the run waits at the approval prompt: nobody answers (stdin stays
/// open), the run ends `timed_out` at its deadline, and `ratchet run` reports it and exits 1
/// instead of waiting for an answer that no longer matters.
#[test]
fn a_run_waiting_at_the_approval_prompt_ends_timed_out_at_its_deadline() {
    use std::io::Read;
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratchet"))
        .args(guarded_args(dir.path(), &["--max-duration-ms", "1500"]))
        .current_dir(dir.path())
        .env_remove("RATCHET_DB")
        .env_remove("RATCHET_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Held open and never written: a person at the prompt who does not answer.
    let _silent = child.stdin.take().unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(30) {
            child.kill().unwrap();
            panic!("ratchet run still waits at the prompt long past the run's deadline");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let (mut stdout, mut stderr) = (String::new(), String::new());
    child.stdout.unwrap().read_to_string(&mut stdout).unwrap();
    child.stderr.unwrap().read_to_string(&mut stderr).unwrap();
    assert!(stderr.contains("approval apr_"), "it was asked: {stderr}");
    assert_eq!(status.code(), Some(1), "{stderr}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        (&report["status"], &report["stop_reason"]),
        (&json!("failed"), &json!("timed_out")),
        "{report}"
    );
    assert!(
        !dir.path().join("log.txt").exists(),
        "the unapproved call never ran"
    );
}

#[test]
fn an_unanswered_approval_is_decided_later_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let output = run_guarded(dir, "");
    let stderr = stderr_of(&output);
    assert_eq!(
        output.status.code(),
        Some(2),
        "waiting for a human: {stderr}"
    );
    assert_eq!(report(&output)["status"], "waiting_human");
    assert!(stderr.contains("ratchet approvals decide apr_"), "{stderr}");
    assert!(!dir.join("log.txt").exists(), "nothing of the batch ran");
    let run_id = report(&output)["run_id"].as_str().unwrap().to_owned();
    let shown = ratchet(dir, &["runs", "show", &run_id, "--db", &db_url(dir)]);
    assert!(
        stdout_of(&shown).contains("waiting for  approval apr_"),
        "{}",
        stdout_of(&shown)
    );

    let db = db_url(dir);
    let listed = ratchet(
        dir,
        &[
            "approvals",
            "list",
            "--status",
            "pending",
            "--db",
            &db,
            "--json",
        ],
    );
    assert!(listed.status.success(), "{}", stderr_of(&listed));
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    let approval = listed[0]["id"].as_str().unwrap();
    let calls = listed[0]["calls"].as_array().unwrap();
    let guarded = calls[0]["call_id"].as_str().unwrap();
    assert_eq!(
        (&calls[0]["name"], &calls[0]["needs_approval"]),
        (&json!("append_line"), &json!(true))
    );

    for (args, message) in [
        (vec![], "give --approve CALL"),
        (vec!["--abort", "--approve", guarded], "cannot be combined"),
        (vec!["--approve", "call-9"], "not in this approval"),
    ] {
        let mut full = vec!["approvals", "decide", approval, "--db", &db];
        full.extend(args);
        let refused = ratchet(dir, &full);
        assert_eq!(refused.status.code(), Some(1), "{full:?}");
        assert!(
            stderr_of(&refused).contains(message),
            "{full:?}: {}",
            stderr_of(&refused)
        );
    }
    let decided = ratchet(
        dir,
        &[
            "approvals",
            "decide",
            approval,
            "--approve",
            guarded,
            "--db",
            &db,
        ],
    );
    assert!(decided.status.success(), "{}", stderr_of(&decided));
    assert_eq!(
        stdout_of(&decided).trim(),
        format!("approval {approval} is decided")
    );
    let resumed = ratchet(dir, &["resume", "--db", &db, "--json"]);
    assert!(resumed.status.success(), "{}", stderr_of(&resumed));
    assert_eq!(report(&resumed)["status"], "completed");
    assert_eq!(
        std::fs::read_to_string(dir.join("log.txt")).unwrap(),
        "guarded line\n"
    );
    let listed = ratchet(dir, &["approvals", "list", "--db", &db]);
    assert!(
        stdout_of(&listed).contains(&format!("{approval} decided")),
        "{}",
        stdout_of(&listed)
    );
}

#[test]
fn an_approval_policy_for_an_unknown_tool_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let output = run(
        dir.path(),
        "scripted:demo",
        &["--require-approval", "rm_rf", "hi"],
    );
    assert_refused(
        "unknown tool",
        dir.path(),
        &output,
        1,
        "approval policy for unknown tool \"rm_rf\"",
    );
}

#[test]
fn bench_reports_steps_and_the_disks_own_commit_rate_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let commits = ratchet(dir.path(), &["bench", "commits", "--count", "20", "--json"]);
    assert!(commits.status.success(), "{}", stderr_of(&commits));
    let figures: Value = serde_json::from_slice(&commits.stdout).unwrap();
    assert_eq!(figures["commits"], 20);
    assert!(
        figures["commits_per_s"].as_f64().unwrap() > 0.0,
        "{figures}"
    );
    let steps = ratchet(
        dir.path(),
        &[
            "bench",
            "steps",
            "--runs",
            "4",
            "--concurrency",
            "2",
            "--turns",
            "1",
            "--json",
        ],
    );
    assert!(steps.status.success(), "{}", stderr_of(&steps));
    let figures: Value = serde_json::from_slice(&steps.stdout).unwrap();
    assert_eq!(
        (&figures["runs"], &figures["steps"]),
        (&json!(4), &json!(12)),
        "{figures}"
    );
    let zero = ratchet(dir.path(), &["bench", "commits", "--count", "0"]);
    assert_eq!(zero.status.code(), Some(1));
    assert!(stderr_of(&zero).contains("--count must be at least 1"));
}

/// `ratchet runs cancel --db` reaches a run another process is driving: that `ratchet run`
/// ends with the run cancelled when its step in flight ends. Cancelling it again is met
/// already; a run that completed is refused with the reason, and so is a malformed id.
#[test]
fn a_run_cancelled_from_another_process_ends_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(
        dir.path(),
        "script.json",
        &json!({"replies": [
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 800}}]},
            {"text": "Never said: the run was cancelled."}
        ]}),
    );
    let db = db_url(dir.path());
    let workspace = dir.path().display().to_string();
    let driver = Command::new(env!("CARGO_BIN_EXE_ratchet"))
        .args([
            "run",
            "--db",
            &db,
            "--workspace",
            &workspace,
            "--model",
            &model,
            "--json",
            "sleep",
        ])
        .current_dir(dir.path())
        .env_remove("RATCHET_DB")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let run_id = loop {
        let runs = if dir.path().join("r.db").exists() {
            list(dir.path())
        } else {
            Vec::new()
        };
        if let Some(run) = runs.iter().find(|r| r["status"] == "running") {
            break run["run_id"].as_str().unwrap().to_owned();
        }
        assert!(
            started.elapsed() < crate::common::DEADLINE,
            "no run started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let cancelled = ratchet(dir.path(), &["runs", "cancel", &run_id, "--db", &db]);
    assert!(cancelled.status.success(), "{}", stderr_of(&cancelled));
    assert_eq!(
        stdout_of(&cancelled),
        format!("{run_id} is cancelling: the step it is taking ends it\n")
    );

    let driven = driver.wait_with_output().unwrap();
    assert_eq!(driven.status.code(), Some(1), "{}", stderr_of(&driven));
    assert_eq!(report(&driven)["status"], "cancelled");
    assert_eq!(show(dir.path(), &run_id)["status"], "cancelled");

    let again = ratchet(dir.path(), &["runs", "cancel", &run_id, "--db", &db]);
    assert!(again.status.success(), "{}", stderr_of(&again));
    assert_eq!(stdout_of(&again), format!("{run_id} is cancelled\n"));

    let answer = script(
        dir.path(),
        "answer.json",
        &json!({"replies": [{"text": "Hi."}]}),
    );
    let completed = report(&ratchet(
        dir.path(),
        &["run", "--db", &db, "--model", &answer, "--json", "hello"],
    ));
    let completed_id = completed["run_id"].as_str().unwrap();
    let refused = ratchet(dir.path(), &["runs", "cancel", completed_id, "--db", &db]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr_of(&refused).contains(&format!(
            "cannot cancel run {completed_id}: it has already ended (completed)"
        )),
        "{}",
        stderr_of(&refused)
    );
    assert_eq!(show(dir.path(), completed_id)["status"], "completed");
    let malformed = ratchet(dir.path(), &["runs", "cancel", "run-nope", "--db", &db]);
    assert_eq!(malformed.status.code(), Some(1));
    assert!(
        stderr_of(&malformed).contains("invalid run id"),
        "{}",
        stderr_of(&malformed)
    );
}

/// `ratchet runs pause` reaches a run another process is driving: that `ratchet run` stops
/// when the run pauses (exit 2, saying how to go on); `runs resume` and `ratchet resume`
/// finish it. Runs that are not running are refused with the reason.
#[test]
fn a_run_paused_from_another_process_is_resumed_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let model = script(
        dir.path(),
        "script.json",
        &json!({"replies": [
            {"tool_calls": [{"name": "sleep_ms", "arguments": {"ms": 800}}]},
            {"text": "Done after the pause."}
        ]}),
    );
    let db = db_url(dir.path());
    let workspace = dir.path().display().to_string();
    let driver = Command::new(env!("CARGO_BIN_EXE_ratchet"))
        .args([
            "run",
            "--db",
            &db,
            "--workspace",
            &workspace,
            "--model",
            &model,
            "--json",
            "sleep",
        ])
        .current_dir(dir.path())
        .env_remove("RATCHET_DB")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let run_id = loop {
        let runs = if dir.path().join("r.db").exists() {
            list(dir.path())
        } else {
            Vec::new()
        };
        if let Some(run) = runs.iter().find(|r| r["status"] == "running") {
            break run["run_id"].as_str().unwrap().to_owned();
        }
        assert!(
            started.elapsed() < crate::common::DEADLINE,
            "no run started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let paused = ratchet(dir.path(), &["runs", "pause", &run_id, "--db", &db]);
    assert!(paused.status.success(), "{}", stderr_of(&paused));
    assert!(
        stdout_of(&paused).contains(&run_id),
        "{}",
        stdout_of(&paused)
    );

    let driven = driver.wait_with_output().unwrap();
    assert_eq!(driven.status.code(), Some(2), "{}", stderr_of(&driven));
    assert!(
        stderr_of(&driven).contains(&format!("ratchet runs resume {run_id}")),
        "{}",
        stderr_of(&driven)
    );
    assert_eq!(report(&driven)["status"], "paused");
    assert_eq!(show(dir.path(), &run_id)["status"], "paused");

    let resumed = ratchet(dir.path(), &["runs", "resume", &run_id, "--db", &db]);
    assert!(resumed.status.success(), "{}", stderr_of(&resumed));
    assert!(stdout_of(&resumed).contains("running again"));
    let finished = report(&ratchet(dir.path(), &["resume", "--db", &db, "--json"]));
    assert_eq!(
        (&finished["status"], &finished["final_answer"]),
        (&json!("completed"), &json!("Done after the pause.")),
        "{finished}"
    );
    for (action, says) in [
        ("pause", "only a running run can be paused"),
        ("resume", "only a paused run can"),
    ] {
        let refused = ratchet(dir.path(), &["runs", action, &run_id, "--db", &db]);
        assert_eq!(refused.status.code(), Some(1), "{action}");
        assert!(
            stderr_of(&refused).contains(says),
            "{}",
            stderr_of(&refused)
        );
    }
    let malformed = ratchet(dir.path(), &["runs", "pause", "run-nope", "--db", &db]);
    assert_eq!(malformed.status.code(), Some(1));
    assert!(
        stderr_of(&malformed).contains("invalid run id"),
        "{}",
        stderr_of(&malformed)
    );
}
