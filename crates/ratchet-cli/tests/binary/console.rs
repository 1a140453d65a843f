//! The web console end to end: `e2e/console.test.mjs` drives headless Chromium (through
//! playwright-core) against real `ratchet serve` processes of this build — sessions, streamed
//! answers, approvals, cancel, run trees, token sign-in, a SIGKILLed server and reconciliation,
//! the inbox's dead letters, a phone's screen, the keyboard and a WCAG 2.1 AA audit (axe-core).
//!
//! It needs Node.js, `npm ci --prefix e2e` and Chromium (`/usr/bin/chromium`, or
//! `RATCHET_CHROMIUM`). Without them the test says it was skipped; with `CI=true` it fails,
//! and `scripts/test` installs them.

use std::path::{Path, PathBuf};
use std::process::Command;

fn chromium() -> PathBuf {
    std::env::var_os("RATCHET_CHROMIUM").map_or_else(|| "/usr/bin/chromium".into(), PathBuf::from)
}

/// What the browser tests need that this machine lacks, in words.
fn missing(e2e: &Path) -> Vec<String> {
    let mut missing = Vec::new();
    if Command::new("node").arg("--version").output().is_err() {
        missing.push("Node.js (`node`)".to_owned());
    }
    for package in ["playwright-core", "axe-core"] {
        if !e2e.join("node_modules").join(package).is_dir() {
            missing.push(format!("{package} (`npm ci --prefix e2e`)"));
        }
    }
    if !chromium().is_file() {
        missing.push(format!("Chromium at {}", chromium().display()));
    }
    missing
}

#[test]
fn the_console_works_in_a_real_browser() {
    let e2e = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e");
    let missing = missing(&e2e);
    if !missing.is_empty() {
        let what = missing.join(", ");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the console's browser tests cannot run without {what}"
        );
        eprintln!("skipped: the console's browser tests need {what}");
        return;
    }
    let output = Command::new("node")
        .args([
            "--test",
            "--test-concurrency=1",
            "--test-timeout=300000",
            "console.test.mjs",
        ])
        .current_dir(&e2e)
        .env("RATCHET_BIN", env!("CARGO_BIN_EXE_ratchet"))
        .env("RATCHET_CHROMIUM", chromium())
        .output()
        .expect("cannot start node");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{report}");
    assert!(
        report.contains("# fail 0") && !report.contains("# pass 0"),
        "every browser test ran and passed:\n{report}"
    );
}
