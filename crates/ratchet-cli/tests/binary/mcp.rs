//! The `ratchet` binary with tools from an MCP server configured in `ratchet.toml`: the
//! server is started with the runtime, its tools are offered as `SERVER.TOOL`, a call waits for
//! approval by default (asked at the prompt) unless `[tools."SERVER.TOOL"]` says otherwise, and
//! the server's answers reach the model.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::{output_within_deadline, report, stderr_of};
use serde_json::json;

/// The stdio MCP server the MCP crate's own tests use.
fn server_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ratchet-mcp/tests/stdio_server.py")
}

fn ratchet(dir: &Path, args: &[&str], stdin: &str) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ratchet"));
    command
        .args(args)
        .current_dir(dir)
        .env_remove("RATCHET_DB")
        .env_remove("RATCHET_LOG");
    output_within_deadline(&mut command, stdin)
}

fn setup(dir: &Path, extra: &str) {
    let config = format!(
        "[mcp.servers.local]\ncommand = \"python3\"\nargs = [\"{}\"]\n{extra}",
        server_script().display()
    );
    std::fs::write(dir.join("ratchet.toml"), config).unwrap();
    let script = json!({"replies": [
        {"text": "Asking the server.", "tool_calls": [
            {"name": "local.echo", "arguments": {"text": "from the server"}},
            {"name": "local.add", "arguments": {"a": 20, "b": 22}}
        ]},
        {"text": "Done."}
    ]});
    std::fs::write(dir.join("script.json"), script.to_string()).unwrap();
}

fn run(dir: &Path, stdin: &str) -> Output {
    let db = format!("sqlite://{}/r.db", dir.display());
    let args = [
        "run",
        "--db",
        &db,
        "--config",
        "ratchet.toml",
        "--model",
        "scripted:script.json",
        "--json",
        "use the server",
    ];
    ratchet(dir, &args, stdin)
}

#[test]
fn an_mcp_servers_tools_wait_for_approval_by_default_and_answer_the_model() {
    let dir = tempfile::tempdir().unwrap();
    setup(dir.path(), "");
    let output = run(dir.path(), "y\n");
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("local.echo") && stderr.contains("(needs approval)"),
        "MCP tools need approval unless configured otherwise: {stderr}"
    );
    assert!(stderr.contains("-> from the server"), "{stderr}");
    assert!(stderr.contains("-> 42"), "{stderr}");
    assert_eq!(report(&output)["final_answer"], "Done.");
}

#[test]
fn configured_policies_override_an_mcp_tools_defaults_and_a_dead_server_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    setup(
        dir.path(),
        "[tools.\"local.echo\"]\napproval = \"never\"\n[tools.\"local.add\"]\napproval = \"never\"\n",
    );
    let output = run(dir.path(), "");
    assert!(
        output.status.success(),
        "no prompt needed: {}",
        stderr_of(&output)
    );
    assert!(!stderr_of(&output).contains("needs approval"));

    let broken = tempfile::tempdir().unwrap();
    std::fs::write(
        broken.path().join("ratchet.toml"),
        "[mcp.servers.gone]\ncommand = \"/nonexistent/mcp-server\"\n",
    )
    .unwrap();
    let db = format!("sqlite://{}/r.db", broken.path().display());
    let args = ["run", "--db", &db, "--config", "ratchet.toml", "hi"];
    let refused = ratchet(broken.path(), &args, "");
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr_of(&refused).contains("\"gone\""),
        "{}",
        stderr_of(&refused)
    );
    assert!(!broken.path().join("r.db").exists(), "nothing was written");
}
