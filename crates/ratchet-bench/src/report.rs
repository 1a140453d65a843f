//! What every benchmark shares: one way to print a report, one way to take percentiles, a
//! scratch database and a scripted model, reading a process's memory, and starting a
//! `ratchet` child process.

use std::io::Write;
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use ratchet::Toolbox;
use ratchet_core::{Limits, MemoryScope, RunConfigSnapshot};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

/// A memory figure of process `pid` in bytes — `VmRSS` (resident now) or `VmHWM` (the peak
/// of resident memory) — from Linux's `/proc/PID/status`.
pub fn process_memory_bytes(pid: u32, field: &str) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {path} (the benchmarks need Linux's /proc)"))?;
    let kib = status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.trim().strip_suffix("kB"))
        .and_then(|value| value.trim().parse::<u64>().ok())
        .with_context(|| format!("{path} has no `{field}: N kB` line"))?;
    Ok(kib * 1024)
}

/// A scratch directory for a benchmark, and the database it runs on: `db`, or a new SQLite
/// file in that directory.
pub fn scratch_database(db: Option<&str>) -> anyhow::Result<(tempfile::TempDir, String)> {
    let scratch = tempfile::tempdir().context("cannot create a scratch directory")?;
    let db = db.map_or_else(
        || format!("sqlite://{}", scratch.path().join("bench.db").display()),
        str::to_owned,
    );
    Ok((scratch, db))
}

/// A bare run configuration over the built-in tools for a scripted model, and the toolbox it
/// runs with: no system prompt and no workspace, so a benchmark measures the runtime alone.
pub fn scripted_run_config(
    model: String,
    limits: Limits,
) -> anyhow::Result<(Toolbox, RunConfigSnapshot)> {
    let toolbox = Toolbox::new();
    toolbox.models.resolve(&model)?;
    let config = RunConfigSnapshot {
        model,
        model_settings: None,
        workspace: None,
        system_prompt: String::new(),
        tools: toolbox.tools.specs(),
        limits,
        memory_scope: MemoryScope::Session,
        ..RunConfigSnapshot::default()
    };
    Ok((toolbox, config))
}

/// Writes the scripted model's `replies` into `dir`; returns the model's spec.
pub fn scripted_model(dir: &std::path::Path, replies: Value) -> anyhow::Result<String> {
    let script = dir.join("script.json");
    std::fs::write(&script, json!({"replies": replies}).to_string())?;
    Ok(format!("scripted:{}", script.display()))
}

/// The value at quantile `p` (0 to 1) of ascending `sorted` values; 0 when there are none.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(index).copied().unwrap_or_default()
}

/// How every benchmark reports: its figures as one JSON object with `--json`, else one line
/// for people.
pub fn print_report(
    report: &Value,
    json: bool,
    line: impl FnOnce() -> String,
) -> anyhow::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{report}")?;
    } else {
        writeln!(out, "{}", line())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The `ratchet` binary the benchmarks start servers and workers from: `RATCHET_BIN` when
/// set, else the one beside this program (where `cargo build` puts both).
fn ratchet_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("RATCHET_BIN") {
        return Ok(PathBuf::from(path));
    }
    let own = std::env::current_exe().context("cannot find this program's own path")?;
    let beside = own.with_file_name(format!("ratchet{}", std::env::consts::EXE_SUFFIX));
    if !beside.is_file() {
        bail!(
            "this benchmark starts `ratchet` processes, and there is no {} (build it with \
             `cargo build --release -p ratchet-cli`, or name it with RATCHET_BIN)",
            beside.display()
        );
    }
    Ok(beside)
}

/// Starts `ratchet ARGS…` and waits until it prints a line starting with `ready` on stderr,
/// which is returned: a benchmark's clock must not include a process starting. Earlier lines
/// are shown prefixed with `name`; later output is read and dropped. The child is killed if
/// dropped.
pub async fn start_process(
    name: &str,
    args: &[&str],
    ready: &str,
) -> anyhow::Result<(tokio::process::Child, String)> {
    let mut child = tokio::process::Command::new(ratchet_binary()?)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start a {name} process"))?;
    let stderr = child
        .stderr
        .take()
        .with_context(|| format!("a {name}'s stderr"))?;
    let mut lines = BufReader::new(stderr).lines();
    let started = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if line.starts_with(ready) {
                return anyhow::Ok(Some(line));
            }
            eprintln!("{name}: {line}");
        }
        anyhow::Ok(None)
    })
    .await;
    let line = match started {
        Ok(Ok(Some(line))) => line,
        Ok(Ok(None)) => bail!(
            "a {name} process exited before it started: {}",
            child.wait().await?
        ),
        Ok(Err(error)) => return Err(error.context(format!("cannot read a {name}'s output"))),
        Err(_) => bail!("a {name} process did not start within 30 s"),
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, line))
}
