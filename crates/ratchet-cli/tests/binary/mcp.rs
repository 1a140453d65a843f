//! The `ratchet` binary with tools from an MCP server configured in `ratchet.toml`: the
//! server is started with the runtime, its tools are offered as `SERVER.TOOL`, a call waits for
//! approval by default (asked at the prompt) unless `[tools."SERVER.TOOL"]` says otherwise, and
//! the server's answers reach the model.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::{json_of, output_within_deadline, report, stderr_of};
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

/// `ratchet serve` with a server that changes its tools while a run calls it: the runs
/// created afterwards are offered the new tools; the run that was running keeps those it was
/// frozen with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_offers_an_mcp_servers_changed_tools_to_the_runs_that_start_after() {
    use std::io::BufRead;
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "[mcp.servers.local]\ncommand = \"python3\"\nargs = [\"{}\"]\n\
         env = {{ MCP_TEST_MODE = \"tools_change\" }}\napproval = \"never\"\n",
        server_script().display()
    );
    std::fs::write(dir.path().join("ratchet.toml"), config).unwrap();
    let script = json!({"replies": [
        {"tool_calls": [{"name": "local.evolve", "arguments": {}}]},
        {"text": "Done."}
    ]});
    std::fs::write(dir.path().join("script.json"), script.to_string()).unwrap();
    let port = crate::common::free_port();
    let db = format!("sqlite://{}/r.db", dir.path().display());
    let mut child = Command::new(env!("CARGO_BIN_EXE_ratchet"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--db",
            &db,
        ])
        .args([
            "--config",
            "ratchet.toml",
            "--model",
            "scripted:script.json",
        ])
        .current_dir(dir.path())
        .env_remove("RATCHET_DB")
        .env_remove("RATCHET_LOG")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (lines, said) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines.send(line);
        }
    });
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < crate::common::DEADLINE,
            "serve did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let run_to_end = |content: &'static str| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let session = json_of(http.post(format!("{base}/v1/sessions")).json(&json!({}))).await;
            let messages = format!(
                "{base}/v1/sessions/{}/messages",
                session["id"].as_str().unwrap()
            );
            let sent = json_of(http.post(messages).json(&json!({"content": content}))).await;
            let run = sent["run_id"].as_str().unwrap().to_owned();
            let deadline = Instant::now() + crate::common::DEADLINE;
            loop {
                let view = json_of(http.get(format!("{base}/v1/runs/{run}"))).await;
                if view["status"] == "completed" {
                    break;
                }
                assert!(Instant::now() < deadline, "{view}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let step = json_of(http.get(format!("{base}/v1/runs/{run}/steps/1"))).await;
            let offered: Vec<String> = (step["model_call"]["tools"].as_array().unwrap().iter())
                .map(|tool| tool["name"].as_str().unwrap().to_owned())
                .collect();
            offered
        }
    };

    let first = run_to_end("change your tools").await;
    assert!(first.contains(&"local.add".to_owned()), "{first:?}");
    assert!(!first.contains(&"local.shout".to_owned()), "{first:?}");
    let refreshed = "an MCP server's tools changed: new runs are offered its new tools";
    loop {
        let line = said
            .recv_timeout(crate::common::DEADLINE)
            .expect("serve says the tools changed");
        if line.contains(refreshed) {
            break;
        }
    }
    let second = run_to_end("again").await;
    assert!(second.contains(&"local.shout".to_owned()), "{second:?}");
    assert!(!second.contains(&"local.add".to_owned()), "{second:?}");
    let _ = child.kill();
    let _ = child.wait();
}
